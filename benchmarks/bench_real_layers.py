"""Issue 13 acceptance table: real layers with non-zero biases, library defaults only.

    python benchmarks/bench_real_layers.py [--d 16 32 64] [--heads 2 4 8] [--sweep]
    python benchmarks/bench_real_layers.py --dtype float32 --d 16 --heads 4 --seeds 4
    python benchmarks/bench_real_layers.py --dtype float32 --d 16 --heads 4 --seeds 4 --rank auto
    python benchmarks/bench_real_layers.py --dtype float32 --d 768 --heads 12 --seeds 1 --rank dH --kinds GPT2Attention

Per layer type, d and H: a float64 layer with every bias drawn at the std of its weights, read out
through a random vector, extracted with ``mx.extract(TorchOracle(layer, r), d, heads=H, seed=0)``
(no token scale, no schedule); the error is ``compare(result.model, to_reduced(layer, r)).max_rel``
(ground truth from the weights, computed here). ``--sweep``: simulated biased targets with weights
scaled 1e-3..1e3, ``token_scale="auto"``; every run must pass or fail loudly. ``--rank dH`` or
``--rank auto``: ``schedule="lowrank", rank=d // H`` (the heads' rank) or ``rank="auto"``, with
``bias=True, token_scale="auto"`` (docs/algorithm.md, 'Low-rank heads').
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_reduced  # noqa: E402
from test_real_layers import build  # noqa: E402

KINDS = ["nn.MultiheadAttention", "GPT2Attention", "BertSelfAttention", "OPTAttention", "ViTAttention"]


def layer_rows(ds, heads, dtype="float64", seeds=(None,), rank=None, kinds=KINDS):
    """One row per layer type, d, H (and seed): the layer in ``dtype`` (float32: built in float64, the
    truth ``to_reduced`` of that float64 copy, then the layer itself converted), sdpa attention for
    float64 and eager (float32 throughout) for float32."""
    print("| layer | dtype | d | H | seed | queries (measured) | calibration queries | seconds | rel. error vs to_reduced "
          "| estimate / error | rank | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        for d in ds:
            for H in heads:
                for seed in seeds:
                    layer_seed = d + H if seed is None else seed
                    layer = build(kind, d, H, seed=layer_seed, implementation="sdpa" if dtype == "float64" else "eager")
                    r = np.random.default_rng(layer_seed).standard_normal(d)
                    truth = to_reduced(layer.double(), r)
                    layer = layer.to(getattr(torch, dtype))
                    options = {} if rank is None else dict(
                        schedule="lowrank", rank=d // H if rank == "dH" else rank, bias=True, token_scale="auto")
                    started = time.perf_counter()
                    result = mx.extract(TorchOracle(layer, r), d, heads=H, seed=0 if seed is None else seed,
                                        on_failure="warn", progress=False, **options)
                    seconds = time.perf_counter() - started
                    error = mx.compare(result.model, truth).max_rel if result.model is not None else np.inf
                    ratio = result.error_estimate / error if np.isfinite(error) and error > 0 else np.nan
                    checks = "ok" if result.ok else "FAILED: " + ", ".join(c.name for c in result.failed_checks)
                    found = getattr(result.details, "rank", "-")
                    print(f"| {kind} | {result.answer_dtype} | {d} | {H} | {layer_seed} | {result.queries:,} | "
                          f"{result.calibration_queries} | {seconds:.1f} | {error:.1e} | {ratio:.2g} | {found} | "
                          f"{checks} |", flush=True)
    # one process for every row: the peak is the largest row's (run one row for its own, as the GPT-2-sized rows of
    # docs/algorithm.md, 'Low-rank heads')
    print(f"\npeak memory of this process (ru_maxrss): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB")


def sweep_rows(d=16, H=4, seeds=2):
    print("| weight scale | seed | token scale chosen | calibration queries | rel. error | outcome |")
    print("|---|---|---|---|---|---|")
    for scale in (1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3):
        for seed in range(seeds):
            base = mx.MultiHeadAttention.random(d, H, seed=seed, bias=True)
            target = mx.MultiHeadAttention(base.W * scale, base.v, base.u * np.sqrt(scale), base.c)
            try:
                result = mx.extract(mx.SimulatedOracle(target), d, heads=H, seed=seed, token_scale="auto",
                                    on_failure="warn", progress=False)
                error = mx.compare(result.model, target).max_rel if result.model is not None else np.inf
                outcome = "ok" if result.ok else "failed its checks: " + ", ".join(c.name for c in result.failed_checks)
                print(f"| {scale:g} | {seed} | {result.token_scale:.4g} | {result.calibration_queries} | {error:.1e} | "
                      f"{outcome} |", flush=True)
            except Exception as error:  # a crash is what the sweep looks for: report it, do not hide it
                print(f"| {scale:g} | {seed} | - | - | - | CRASHED: {type(error).__name__}: {error} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 per cell (default: one layer, seed d + H)")
    parser.add_argument("--rank", choices=["dH", "auto"], help='schedule="lowrank" with rank=d//H or rank="auto"')
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="layer types (default: all five)")
    arguments = parser.parse_args()
    if arguments.sweep:
        sweep_rows()
    else:
        layer_rows(arguments.d, arguments.heads, arguments.dtype,
                   (None,) if arguments.seeds is None else tuple(range(arguments.seeds)), arguments.rank,
                   arguments.kinds)


if __name__ == "__main__":
    main()
