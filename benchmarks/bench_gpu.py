"""GPU oracles (issue 41, "GPU"): a torch attention layer on CUDA answering the targeted schedule's
queries, against the same layer on the CPU in the same run (docs/scale.md, "GPU oracles").

    python benchmarks/bench_gpu.py            # on a machine with a GPU
    python benchmarks/bench_gpu.py --quick    # the same parts on the CPU at small sizes (a smoke run)

1. **Throughput.** ``nn.MultiheadAttention(d, H, batch_first=True)`` in float32, bfloat16 and
   float64 in :class:`~mhaextract.adapters.torch.TorchOracle` answers batches of copies-instances
   as the targeted schedule asks them (a ``CopiesBatch`` of ``--batch`` queries, copy counts 1..4 in
   equal parts: sequences of 2..5 tokens), up to d = 4096, H = 32 (the attention width of
   Llama-2-7B). Queries per second on the GPU, handed over as the schedule hands them (two rows a
   query, the sequences built on the GPU) and as plain sequences stacked on the host (the ratio of
   the two is what building on the device saves), against the CPU (torch, all cores; the
   baseline of the row's ratio) at the same size, in batches of ``--cpu-batch`` queries, where one
   fits ``--cpu-budget`` seconds.
2. **Extraction.** ``mx.extract(TorchOracle(layer), d, heads=H, seed=0, batch_size=--batch)`` with
   the float64 layer on the GPU, whole outputs (the layer as a replacement): queries at the
   oracle's boundary, oracle and learner seconds, learner / oracle, the relative error against the
   layer's own weights (``to_reduced``, computed for the check only, after the run), the checks;
   and the oracle seconds of the same run against the layer on the CPU (the ratio).
3. **Projection.** The oracle's hours for a Llama-sized layer (d = 4096, H = 32, rank 128) on one
   GPU: ``--project-queries`` (default: the queries docs/scale.md projects for that layer from
   its measured cells; a projection, not a measurement) times the measured GPU seconds per query
   at d = 4096 in float32 and bfloat16.

Prints markdown tables and the device's name; peak GPU memory per row.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

import mhaextract as mx
from mhaextract.adapters.torch import TorchOracle, to_reduced
from mhaextract.oracle.queries import CopiesBatch

from bench_backends import Timed  # the oracle with its calls timed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def copies_batch(rng, d: int, queries: int, scale: float) -> CopiesBatch:
    """``queries`` copies-instances of copy counts 1..4 in equal parts, tokens of norm ~scale."""
    parts = np.array_split(np.arange(queries), 4)
    return CopiesBatch([(scale * rng.standard_normal((len(part), d)) / np.sqrt(d),
                         scale * rng.standard_normal((len(part), d)) / np.sqrt(d), k)
                        for k, part in zip((1, 2, 3, 4), parts)])


def layer(d: int, heads: int, dtype, device: str, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64).to(device=device, dtype=dtype)


def rate(oracle, batch, repeats: int, plain: bool = False) -> float:
    """Queries per second over ``repeats`` calls after one warm-up call (answers reach the host:
    every call ends synchronised)."""
    asked = list(batch) if plain else batch
    oracle(asked)
    started = time.perf_counter()
    for _ in range(repeats):
        oracle(asked)
    return repeats * len(batch) / (time.perf_counter() - started)


def peak_gb(device: str) -> str:
    if device != "cuda":
        return "-"
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"


def throughput(args, device: str) -> dict:
    rng = np.random.default_rng(0)
    print(f"\n### Throughput: copies-instances, batches of {args.batch} queries\n")
    print("| d | H | dtype | device | queries / s (two rows a query) | queries / s (sequences stacked on the host) "
          "| built on the device / stacked | CPU queries / s | device / CPU | peak GPU GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_query = {}
    for d, heads in args.sizes:
        batch = copies_batch(rng, d, args.batch, scale=d ** 0.25)
        for name in args.dtypes:
            dtype = DTYPES[name]
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            oracle = TorchOracle(layer(d, heads, dtype, device))
            built = rate(oracle, batch, args.repeats)
            stacked = rate(oracle, batch, args.repeats, plain=True)
            cpu_rate = "-"
            ratio = "-"
            cpu_oracle = TorchOracle(layer(d, heads, dtype, "cpu"))
            cpu_batch = copies_batch(rng, d, args.cpu_batch, scale=d ** 0.25)
            started = time.perf_counter()
            cpu_oracle(cpu_batch)  # one batch: does the CPU fit the budget at this size?
            once = time.perf_counter() - started
            if once <= args.cpu_budget:
                measured = rate(cpu_oracle, cpu_batch, 1)
                cpu_rate, ratio = f"{measured:,.0f}", f"{built / measured:.1f}"
            per_query[(d, heads, name)] = 1.0 / built
            print(f"| {d} | {heads} | {name} | {device} | {built:,.0f} | {stacked:,.0f} | {built / stacked:.2f} | "
                  f"{cpu_rate} | {ratio} | {peak_gb(device)} |", flush=True)
    return per_query


def extraction(args, device: str) -> None:
    print(f"\n### Extraction: float64 layer, whole outputs, batch_size = {args.batch}\n")
    print("| d | H | device | queries | seconds | oracle s | learner / oracle | CPU oracle s | CPU / device oracle "
          "| rel. error | checks | peak GPU GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d, heads in args.cells:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        results = {}
        for where in dict.fromkeys([device, "cpu"]):
            if where == "cpu" and d > args.cpu_cell_d:
                continue
            oracle = Timed(TorchOracle(layer(d, heads, torch.float64, where)))
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
                result = mx.extract(oracle, d, heads=heads, seed=0, batch_size=args.batch, on_failure="warn",
                                    progress=False)
            results[where] = (result, time.perf_counter() - started, oracle.seconds)
        result, seconds, oracle_s = results[device]
        truth = to_reduced(layer(d, heads, torch.float64, "cpu"))  # the check only, after the run
        error = mx.compare(result.model, truth).max_rel if result.model is not None else float("nan")
        cpu = results.get("cpu") if device != "cpu" else None
        cpu_s, ratio = (f"{cpu[2]:.1f}", f"{cpu[2] / oracle_s:.1f}") if cpu else ("-", "-")
        print(f"| {d} | {heads} | {device} | {result.queries:,} | {seconds:.1f} | {oracle_s:.1f} | "
              f"{(seconds - oracle_s) / oracle_s:.2f} | {cpu_s} | {ratio} | {error:.1e} | "
              f"{'ok' if result.ok else 'FAILED'} | {peak_gb(device)} |", flush=True)


def projection(args, per_query: dict) -> None:
    print(f"\n### Projection: a Llama-sized layer (d = 4096, H = 32, rank 128), {args.project_queries:.3g} "
          "queries (docs/scale.md's projection)\n")
    print("| dtype | measured at | GPU seconds per query | oracle hours on one GPU |")
    print("|---|---|---|---|")
    largest = max(d for d, _, _ in per_query)
    for (d, heads, name), seconds in per_query.items():
        if d == largest:
            print(f"| {name} | d = {d}, H = {heads} | {seconds:.2e} | {seconds * args.project_queries / 3600:.2f} |")


def pairs(text: str) -> tuple[int, int]:
    d, heads = text.split("x")
    return int(d), int(heads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes on the CPU: a smoke run")
    parser.add_argument("--sizes", type=pairs, nargs="+", default=[(256, 8), (1024, 16), (4096, 32)])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--cells", type=pairs, nargs="+", default=[(64, 4), (128, 8), (256, 8)])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-batch", type=int, default=1024, help="queries of the CPU's batches")
    parser.add_argument("--cpu-budget", type=float, default=20.0, help="seconds one CPU batch may take")
    parser.add_argument("--cpu-cell-d", type=int, default=128, help="largest d whose extraction also runs on the CPU")
    parser.add_argument("--project-queries", type=float, default=7.10e7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.sizes, args.cells, args.batch, args.repeats, args.cpu_batch = [(64, 4), (256, 8)], [(32, 2)], 1024, 2, 256
    elif device == "cpu":
        parser.error("no CUDA device: run on a machine with a GPU, or --quick for a smoke run on the CPU")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU only)"
    print(f"GPU: {name}; torch {torch.__version__}; CPU threads {torch.get_num_threads()}")
    per_query = throughput(args, device)
    extraction(args, device)
    projection(args, per_query)


if __name__ == "__main__":
    main()
