"""ParallelOracle throughput (issue 41, acceptance 1): the oracle part of a d = 256, H = 8
extraction answered by 1 and by 2 Ray workers, each holding a float64 torch
``nn.MultiheadAttention`` (d = 256, H = 8, batch_first) in ``mx.TorchOracle``, torch threads = 1.

    OMP_NUM_THREADS=1 python benchmarks/bench_parallel.py [--every 5] [--workers 1 2] [--batch-size 1024]

1. The extraction ``mx.extract(oracle, d=256, heads=8, seed=0)`` runs once in this process with the
   vectorised numpy oracle of bench_scale.py (a random target, seed 0), the batches the boundary
   sends recorded: every ``--every``-th one is kept (all of them would take ~10 GB), a sample of the
   run's batches in its order, each as sent (up to ``--batch-size``, default 1024, sequences).
2. The kept batches are asked again of a ParallelOracle of each worker count in turn, the layer
   built in every worker by the factory; only the calls are timed (starting Ray and the workers is
   shown apart), on one local Ray instance of as many CPUs as the most workers.
3. Checks: the 1-worker answers are bit-for-bit the layer's own in this process (first batches),
   the 2-worker answers bit-for-bit the layer's answers to the same shares (torch's CPU kernels
   round a sequence's answer by an ulp differently with the batch around it), and how far the
   1- and 2-worker answers are apart over every batch, in units of 2^-52 of the batch's largest.

Prints a markdown table: workers, seconds, queries per second, speedup against 1 worker (the
ratio within this run), the workers' CPU seconds during the calls (against workers x seconds: did
they have their cores?), the seconds of the same calls to a null oracle (what the parallel calls
cost beyond the oracle's work) and the share of the machine's CPU time stolen by other virtual
machines during the timed calls (/proc/stat); the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import numpy as np
import ray

import mhaextract as mx
from mhaextract.oracle.parallel import driver_path, share_bounds
from mhaextract.oracle.queries import CopiesBatch

from bench_scale import NumpyOracle  # the scale benchmark's oracle: one BLAS matmul per step


def layer_oracle(d: int, heads: int, seed: int):
    """The factory: a float64 nn.MultiheadAttention (the same weights in every process) in a
    TorchOracle answering whole outputs (B, d)."""
    import torch

    from mhaextract.adapters.torch import TorchOracle

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    return TorchOracle(torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64))


class ZeroAnswers:
    """The null oracle: answers of the layer's shape at no cost; through a ParallelOracle it times
    what the parallel calls cost beyond the oracle (packing, transfers, Ray's calls)."""

    def __init__(self, d: int):
        self.d = d

    #: Handed copies-instances as their rows, as the layer's TorchOracle is: the null calls carry
    #: what the layer's calls carry, less the layer's work.
    takes_copies_rows = True

    def __call__(self, batch):
        return np.zeros((len(batch), self.d))


def cpu_times() -> np.ndarray:
    """The machine's CPU seconds so far (/proc/stat: user, nice, system, idle, iowait, irq, softirq,
    steal), for the share of the timed calls that other virtual machines took (steal)."""
    with open("/proc/stat") as stat:
        return np.array(stat.readline().split()[1:9], dtype=float)


def worker_cpu_seconds() -> float:
    """CPU seconds used so far by the ParallelOracle workers on this machine (the processes Ray
    titles ``ray::OracleWorker``), from /proc/PID/stat (user + system)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if not cmdline.read().startswith(b"ray::OracleWorker"):
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
        except OSError:  # ended meanwhile
            continue
    return total / os.sysconf("SC_CLK_TCK")


class Recorder:
    """Wraps an oracle; keeps a copy of every ``every``-th batch asked of it."""

    def __init__(self, oracle, every: int):
        self.oracle, self.every = oracle, every
        self.batches, self.calls, self.queries = [], 0, 0

    def __call__(self, batch):
        if self.calls % self.every == 0:  # a CopiesBatch kept as one (its rows are the learner's, reused later)
            self.batches.append(CopiesBatch([(np.array(X), np.array(Z), k) for X, Z, k in batch.segments])
                                if isinstance(batch, CopiesBatch) else [np.array(X) for X in batch])
        self.calls += 1
        self.queries += len(batch)
        return self.oracle(batch)


def record(d: int, H: int, every: int, batch_size: int) -> tuple[Recorder, float, mx.Extraction]:
    target = mx.MultiHeadAttention.random(d, H, seed=0)
    recorder = Recorder(NumpyOracle(target), every)
    started = time.perf_counter()
    result = mx.extract(recorder, d=d, heads=H, seed=0, progress=False, batch_size=batch_size)
    return recorder, time.perf_counter() - started, result


def replay(batches, factory, workers: int) -> dict:
    """The answers to ``batches`` from a ParallelOracle of ``workers``; seconds to start it and of
    the calls; during the calls: the workers' CPU seconds, this process's, and the share of the
    machine's CPU time stolen by other virtual machines."""
    started = time.perf_counter()
    with mx.ParallelOracle(factory, workers=workers) as oracle:
        startup = time.perf_counter() - started
        oracle(batches[0][:8])  # each worker's first forward pass (allocations) outside the timing
        answers, machine, workers_cpu, driver_cpu = [], cpu_times(), worker_cpu_seconds(), time.process_time()
        started = time.perf_counter()
        for batch in batches:
            answers.append(oracle(batch))
        seconds = time.perf_counter() - started
        ticks = cpu_times() - machine
        workers_cpu, driver_cpu = worker_cpu_seconds() - workers_cpu, time.process_time() - driver_cpu
    return dict(answers=answers, startup=startup, seconds=seconds, stolen=ticks[7] / ticks.sum(),
                workers_cpu=workers_cpu, driver_cpu=driver_cpu)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--every", type=int, default=5, help="keep every k-th batch of the run")
    parser.add_argument("--batch-size", type=int, default=1024, help="the extraction's batch_size")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=1, help="timed passes of each worker count (the fastest kept)")
    parser.add_argument("--check-batches", type=int, default=3, help="batches checked against the layer in-process")
    args = parser.parse_args()
    load_before = os.getloadavg()
    recorder, seconds, result = record(args.d, args.heads, args.every, args.batch_size)
    batches = recorder.batches
    kept = sum(len(b) for b in batches)
    print(f"extraction d = {args.d}, H = {args.heads}, seed 0: {result.queries:,} queries in {recorder.calls:,} "
          f"batches, {seconds:.1f} s with the numpy oracle, ok = {result.ok}; kept every {args.every}-th batch: "
          f"{len(batches)} batches, {kept:,} queries, lengths {min(len(X) for b in batches for X in b)}.."
          f"{max(len(X) for b in batches for X in b)}")
    factory = functools.partial(layer_oracle, args.d, args.heads, 0)  # defined in __main__: sent by value
    # one local Ray instance for every pass, its workers importing what this process imports
    ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": driver_path()}})
    runs, null = {}, {}
    for repeat in range(args.repeats):  # the worker counts in turn, so that the machine's moods fall on all alike
        for workers in args.workers:
            run = replay(batches, factory, workers)
            empty = replay(batches, functools.partial(ZeroAnswers, args.d), workers)
            print(f"{workers} worker(s): started in {run['startup']:.1f} s, calls {run['seconds']:.1f} s, workers' "
                  f"CPU {run['workers_cpu']:.1f} s, this process's {run['driver_cpu']:.1f} s, stolen "
                  f"{run['stolen']:.0%}; the null oracle's calls {empty['seconds']:.1f} s", flush=True)
            if workers not in runs or run["seconds"] < runs[workers]["seconds"]:  # the fastest repeat of each
                runs[workers] = run
            if workers not in null or empty["seconds"] < null[workers]["seconds"]:
                null[workers] = empty
    ray.shutdown()
    load_after = os.getloadavg()

    layer = layer_oracle(args.d, args.heads, 0)
    checked = batches[:args.check_batches]
    in_process = [layer(batch) for batch in checked]
    print()
    for workers, run in runs.items():
        answers = run["answers"]
        shares = [np.concatenate([layer(batch[start:stop])
                                  for start, stop in share_bounds(np.array([len(X) for X in batch]), workers)])
                  for batch in checked]
        print(f"{workers} worker(s): answers bit-for-bit the layer's to the same shares in the first "
              f"{len(checked)} batches: {all(np.array_equal(a, s) for a, s in zip(answers, shares))}; "
              f"the layer's to the whole batches: {all(np.array_equal(a, s) for a, s in zip(answers, in_process))}")
    if 1 in runs and 2 in runs:
        pairs = list(zip(runs[1]["answers"], runs[2]["answers"]))
        ulps = [float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) * 2.0**-52)) for a, b in pairs]
        same = sum(np.array_equal(a, b) for a, b in pairs)
        print(f"1 against 2 workers: {same} of {len(batches)} batches bit-for-bit equal; largest difference "
              f"{max(ulps):.1f} units of 2^-52 of the batch's largest answer")
    print(f"\nload average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}\n")
    base = runs[args.workers[0]]["seconds"]
    print("| workers | seconds | queries / s | speedup | workers' CPU s | null oracle s | CPU stolen |")
    print("|---|---|---|---|---|---|---|")
    for workers, run in runs.items():
        print(f"| {workers} | {run['seconds']:.1f} | {kept / run['seconds']:,.0f} | {base / run['seconds']:.2f} | "
              f"{run['workers_cpu']:.1f} | {null[workers]['seconds']:.1f} | {run['stolen']:.0%} |")

if __name__ == "__main__":
    main()
