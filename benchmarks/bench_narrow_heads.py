"""Issue 39 item 4: float32 layers with narrow heads (head width d / H = 8), library defaults only.

    python benchmarks/bench_narrow_heads.py [--kind GPT2Attention] [--d 64] [--heads 8] [--seeds 10]
        [--outputs whole scalar]

Per seed: the layer ``tests/test_real_layers.build(kind, d, H, seed, implementation="sdpa")`` (every
bias drawn at the std of its weights) converted to float32, extracted with
``mx.extract(TorchOracle(layer), d, heads=H, seed=seed)`` (whole outputs) or
``TorchOracle(layer, r)`` with ``r = default_rng(seed).standard_normal(d)`` (a scalar read-out).
The error is ``compare(result.model, truth).max_rel`` with the truth ``to_reduced`` of the float32
layer taken to float64 (its own rounded weights, so the layer's rounding of its parameters is not
counted); the largest of W, u, v, c is named.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_reduced  # noqa: E402
from test_real_layers import build  # noqa: E402


def row(kind: str, d: int, H: int, seed: int, outputs: str) -> str:
    layer = build(kind, d, H, seed, implementation="sdpa").float()
    readout = np.random.default_rng(seed).standard_normal(d) if outputs == "scalar" else None
    truth = to_reduced(copy.deepcopy(layer).double(), readout)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(TorchOracle(layer, readout), d, heads=H, seed=seed, on_failure="warn", progress=False)
    seconds = time.perf_counter() - started
    checks = "ok" if result.ok else "FAILED: " + ", ".join(check.name for check in result.failed_checks)
    if result.model is None:
        return f"| {kind} | {outputs} | {seed} | {result.queries:,} | {seconds:.1f} | - | - | - | {checks} |"
    comparison = mx.compare(result.model, truth)
    parts = {"W": comparison.W_rel, "u": comparison.u_rel, "v": comparison.v_rel, "c": comparison.c_rel}
    largest = max(parts, key=parts.get)
    return (f"| {kind} | {outputs} | {seed} | {result.queries:,} | {seconds:.1f} | {comparison.max_rel:.1e} ({largest}) "
            f"| {result.error_estimate:.1e} | {result.error_estimate / comparison.max_rel:.2g} | {checks} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="GPT2Attention")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--outputs", nargs="+", choices=["whole", "scalar"], default=["whole", "scalar"])
    arguments = parser.parse_args()
    print("| layer | outputs | seed | queries | seconds | rel. error (largest part) | estimate | estimate / error "
          "| checks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for outputs in arguments.outputs:
        for seed in range(arguments.seeds):
            print(row(arguments.kind, arguments.d, arguments.heads, seed, outputs), flush=True)


if __name__ == "__main__":
    main()
