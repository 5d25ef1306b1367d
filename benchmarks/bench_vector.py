"""Whole answers split by head (docs/algorithm.md, 'Whole answers near the vector bound'): queries
against the vector bound, today's scalar schedules and the scalar bound, on GPT-2-class layers.

    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 64:4 128:8 256:8 --dtypes float64
    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 768:12 --dtypes float64 float32 --split-only

Each cell is a ``GPT2Attention`` (sdpa, head width d / H, every bias drawn like its weights) run as
a ``TorchOracle`` in the given dtype; the truth is the layer's own weights in float64
(``to_reduced``). The output error is the largest over every position of 40 fresh sequences of 1..64
tokens, each relative to the largest output of its prefix. "today" is the default run's count on
main before the split (issue 62's table), where it was measured.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_reduced  # noqa: E402
from mhaextract.vector import learner as vector_learner, vector_bound  # noqa: E402

#: The defaults' counts on main before the split, whole answers (issue 62).
TODAY = {(64, 4): 36_997, (128, 8): 286_381, (768, 12): 3_847_746}


def gpt2_layer(d: int, heads: int, seed: int):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config

    torch.manual_seed(seed)
    layer = GPT2Attention(GPT2Config(n_embd=d, n_head=heads, attn_implementation="sdpa"), layer_idx=0).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        std = float(torch.cat([p.flatten() for n, p in layer.named_parameters() if not n.endswith("bias")]).std())
        for name, parameter in layer.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)
    return layer.eval()


def position_error(model, truth, d: int, seed: int = 11) -> float:
    rng = np.random.default_rng(seed)
    worst = 0.0
    for n in rng.integers(1, 65, size=40):
        X = rng.standard_normal((int(n), d))
        prefixes = [X[:i] for i in range(1, int(n) + 1)]
        expected, got = truth(prefixes), model(prefixes)
        worst = max(worst, float((np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)).max()))
    return worst


def run(d: int, heads: int, dtype: str, seed: int) -> dict:
    exact = gpt2_layer(d, heads, seed)
    layer = exact if dtype == "float64" else gpt2_layer(d, heads, seed).float()
    started = time.perf_counter()
    result = mx.extract(TorchOracle(layer), d, heads=heads, seed=0, schedule="vector", on_failure="warn", progress=False)
    seconds = time.perf_counter() - started
    truth = to_reduced(exact)
    r = d // heads
    parameters = heads * (2 * d * r - r * r + d + 2 * d * r - r * r) + d
    return {"d": d, "H": heads, "r": r, "dtype": dtype, "schedule": result.schedule, "queries": result.queries,
            "bound": vector_bound(d, heads, r, d), "today": TODAY.get((d, heads)), "scalar_bound": parameters,
            "error": position_error(result.model, truth, d), "estimate": result.error_estimate, "ok": result.ok,
            "refinement": getattr(result, "refinement", ""), "seconds": seconds, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["64:4", "128:8", "256:8"], help="d:H per cell")
    parser.add_argument("--dtypes", nargs="+", default=["float64"], choices=["float64", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-only", action="store_true",
                        help="report the split's model even where it fails its checks (the defaults then run the "
                             "scalar schedules instead)")
    args = parser.parse_args()
    vector_learner.SPLIT_FAILURE_FALLS_BACK = not args.split_only
    print("| d, H, r | answers | schedule | queries | vector bound | ratio | today | scalar bound | output error "
          "| estimate | ok | time | peak memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in args.cells:
        d, heads = (int(part) for part in cell.split(":"))
        for dtype in args.dtypes:
            row = run(d, heads, dtype, args.seed)
            today = f"{row['today']:,}" if row["today"] else "not measured"
            print(f"| {d}, {heads}, {row['r']} | {dtype} | {row['schedule']} | {row['queries']:,} | {row['bound']:,} "
                  f"| {row['queries'] / row['bound']:.1f} | {today} | {row['scalar_bound']:,} | {row['error']:.2g} "
                  f"| {row['estimate']:.2g} | {row['ok']} | {row['seconds']:.0f} s | {row['peak_gb']:.2f} GB |",
                  flush=True)


if __name__ == "__main__":
    main()
