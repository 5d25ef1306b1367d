"""The trained zoo (issue 64, tests/zoo.py): every attention layer extracted with the library's
defaults (plus ``positions="rotary"``, and ``key_bias=True`` for Qwen2, as docs/rotary.md says),
its replacement judged against the exact float64 layer at every position.

    python benchmarks/train_zoo.py       # once: the cache in tests/data/zoo (already committed)
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py                       # the whole table
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py --layers gpt2-d64-h8/0 --dtypes float32
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py --layers gpt2-d64-h8/0 gpt2-d64-h8/1 --dtypes float32 \
        --seeds 0 1 2 3 4
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py --rotary --cpu-limit 900
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py --no-rotary --readout --dtypes float64 float32
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py --schedule lowrank --rank 16 --dtypes float64 float32 \
        --layers gpt2-d64-h4/0 bert-d64-h4/0 vit-d64-h4/0
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py --cpu-limit 600 --dtypes float32 --layers llama-d64-h4/0 \
        --stages

One row per layer and dtype (bfloat16 and float16 for the non-rotary families only: rotary runs
refuse answers coarser than float32). Each row runs in a child process with a limit on its CPU
time (``--cpu-limit``, seconds; on a shared machine wall time says little): a row that does not
finish within it says so. Columns (``zoo.run_and_judge``):

* queries: measured at the oracle, the calibration included; seconds: the extraction's wall time
  and CPU time (one thread);
* output error: the replacement (``to_torch`` / ``to_torch_rotary``) against the exact layer (float64,
  the dtype layer's own rounded weights; rotary: ``float64_layer``) at every position of 100 fresh
  sequences of lengths 1..128, max absolute difference over max |output|; where the estimate is of
  the outputs, in brackets the error where it speaks (``zoo.scope_error``, below);
* layer's own error: the dtype layer (as its model runs it) against the same exact layer;
* parameter error: ``compare(result.model, truth)``, the truth from the weights; the estimate is
  ``result.error_estimate`` and its ratio to the error it speaks for (``zoo.estimated_error``: the
  parameter error, or where the family's ``error_measure`` is ``"outputs"`` the larger of the output
  error and the error at every position of sequences of up to 64 tokens of norms up to the run's
  token scale, each position relative to its own largest output, ``zoo.scope_error``);
* verdict: ``zoo.verdicts`` (acceptance 1 of issue 64), or the first line of the run's error.

``--stages``: each step of a rotary run (``rotary/run.py``) and each part of its refinement
(``rotary/refine.py``: the normal equations, the geodesic acceleration, the Cholesky factors, the
slow blocks' seeding) printed on stderr as it ends, with the CPU seconds it took and the run's CPU
time so far, and every refinement step's max misfit: where a row's time goes, also in a row that
does not finish.

``--readout``: the oracle answers ``r^T`` of the outputs (``zoo.readout_vector``, a seeded unit
vector), the run learns that scalar model, and outputs and truth are read out through r alike.
``--schedule``, ``--rank``, ``--bias`` / ``--no-bias``, ``--token-scale``: those options of ``extract`` on top of
the defaults (``--schedule lowrank --rank 16``: the low-rank schedule at the heads' width). ``--seeds``: the
extraction's seeds (default 0), a row each, the layer named with its seed when more than one is given.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue as queue_module
import resource
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

LOW = ("bfloat16", "float16")


def time_stages():
    """``--stages``: the rotary run's steps and the refinement's parts wrapped to print their CPU
    seconds on stderr (module attributes replaced in this child process only)."""
    import functools

    import mhaextract.rotary.refine as refine_module
    import mhaextract.rotary.run as run_module
    started = time.process_time()

    def say(text):
        print(f"[{time.process_time() - started:7.1f} s CPU] {text}", file=sys.stderr, flush=True)

    def timed(module, name):
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            begun = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                say(f"{name}: {time.process_time() - begun:.1f} s")
        setattr(module, name, wrapper)

    for name in ("first_look", "seek_neutral_token", "ask_instances_at_scale", "learn_start", "ask_polish_queries",
                 "seed_slow_blocks", "judge_residual", "fit_layer_values", "verify_long"):
        timed(run_module, name)
    for name in ("normal_equations", "acceleration", "cho_factor", "error_draws"):
        timed(refine_module, name)
    run_module.note_progress = lambda progress, text: say(text)  # the refinement's steps and misfits


def measure(layer_id, dtype, queue, cpu_limit=None, readout=False, options=None, seed=0, stages=False):
    torch.set_num_threads(1)
    if stages:
        time_stages()
    if cpu_limit is not None:  # SIGXCPU ends the child
        resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_limit), int(cpu_limit) + 5))
    try:
        row = zoo.run_and_judge(layer_id, getattr(torch, dtype), readout=readout, seed=seed, **(options or {}))
        failures = zoo.verdicts(row)
        row["verdict"] = "pass" if not failures else "FAIL: " + "; ".join(failures)
        row["estimated_error"] = zoo.estimated_error(row)
        row.pop("result")
    except Exception as failure:  # the table records what a user would have seen
        row = dict(layer=layer_id, dtype=dtype, verdict=f"FAIL: {type(failure).__name__}: {str(failure).splitlines()[0]}")
    queue.put(row)


def rank_option(text: str):
    """``--rank``: an integer, or ``"auto"``."""
    return text if text == "auto" else int(text)


def line(row):
    if "queries" not in row:
        return f"| {row['layer']} | {row['dtype']} | - | {row.get('seconds', '-')} | - | - | - | - | - | {row['verdict']} |"
    ratio = row["estimate"] / row["estimated_error"] if row["estimated_error"] else float("nan")
    output = f"{row['output_error']:.1e}"
    if row.get("scope_error") is not None:  # an estimate of the outputs: the error where it speaks as well
        output += f" ({row['scope_error']:.1e} to the token scale)"
    return (f"| {row['layer']} | {row['dtype']} | {row['queries']:,} | {row['seconds']:.1f} / {row['cpu_seconds']:.1f} | {output} | "
            f"{row['own_error']:.1e} | {row['parameter_error']:.1e} | {row['estimate']:.1e} | {ratio:.3g} | {row['verdict']} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", nargs="+", help='"<model>/<layer>" ids (default: the whole zoo)')
    parser.add_argument("--rotary", action=argparse.BooleanOptionalAction, default=None,
                        help="only the rotary (--rotary) or the other (--no-rotary) families")
    parser.add_argument("--dtypes", nargs="+", choices=["float64", "float32", *LOW], default=["float64", "float32", *LOW])
    parser.add_argument("--cpu-limit", type=float, default=1800.0, help="seconds of CPU a row may take")
    parser.add_argument("--readout", action="store_true",
                        help="the oracle answers one read-out of the outputs (zoo.readout_vector), judged read out; "
                             "the non-rotary families")
    parser.add_argument("--schedule", help="extract's schedule (default: the library's, 'auto')")
    parser.add_argument("--rank", type=rank_option, help="extract's rank: an integer or 'auto' (the low-rank schedule)")
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                        help="extract's bias (default: the schedule's)")
    parser.add_argument("--token-scale", type=float, help="extract's token_scale (default: the schedule's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="extract's seeds, a row each (default: 0)")
    parser.add_argument("--stages", action="store_true",
                        help="print each rotary step's and refinement part's CPU seconds on stderr")
    arguments = parser.parse_args()
    options = {key: value for key, value in (("schedule", arguments.schedule), ("rank", arguments.rank),
                                             ("bias", arguments.bias), ("token_scale", arguments.token_scale))
               if value is not None}
    stale = zoo.stale_reasons()
    if stale:
        sys.exit("the zoo's cache is stale: " + "; ".join(stale))
    print("| layer | dtype | queries | seconds wall / CPU | output error | layer's own error | parameter error | estimate | "
          "estimate / error | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    context = multiprocessing.get_context("fork")
    for dtype in arguments.dtypes:
        for layer_id in arguments.layers or zoo.layer_ids(arguments.rotary):
            rotary = zoo.SPECS[layer_id.split("/")[0]]["family"] in zoo.ROTARY
            if (dtype in LOW or arguments.readout) and rotary:
                continue
            for seed in arguments.seeds:
                queue = context.Queue()
                child = context.Process(target=measure, args=(layer_id, dtype, queue, arguments.cpu_limit,
                                                              arguments.readout, options, seed, arguments.stages))
                started = time.perf_counter()
                child.start()
                row = None
                while row is None and (child.is_alive() or not queue.empty()):
                    try:
                        row = queue.get(timeout=5)
                    except queue_module.Empty:  # still running
                        pass
                child.join()
                if row is None:
                    row = dict(layer=layer_id, dtype=dtype, seconds="-", verdict=(
                        f"not finished in {arguments.cpu_limit:.0f} s of CPU" if child.exitcode == -signal.SIGXCPU
                        else f"FAIL: the child exited with {child.exitcode}"))
                if len(arguments.seeds) > 1:
                    row["layer"] = f"{layer_id} (seed {seed})"
                print(line(row), flush=True)
                print(f"{layer_id} {dtype} seed {seed}: {time.perf_counter() - started:.0f} s in all", file=sys.stderr,
                      flush=True)


if __name__ == "__main__":
    main()
