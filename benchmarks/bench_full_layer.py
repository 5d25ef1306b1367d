"""Whole layers extracted and replaced (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module'):
the replacement module against the layer.

    python benchmarks/bench_full_layer.py                                   # the acceptance table
    python benchmarks/bench_full_layer.py --cells 32:2 --dtypes float64 --kinds GPT2Attention
    python benchmarks/bench_full_layer.py --cells 768:12 --dtypes float32 --kinds GPT2Attention --rank 64 --seed 0

Per layer class, dtype and (d, H): the layer built with every bias drawn at its weights' std
(``tests/test_real_layers.build``), extracted with the targeted schedule twice in one process:
``extract(TorchOracle(layer), d, heads=H, seed=0, schedule="targeted")`` (whole outputs) and
``extract(TorchOracle(layer, r), ...)`` with the whole run's read-out r (the same schedule queries:
the scalar run the whole one builds on). The defaults split whole answers by head where they can
(docs/algorithm.md, 'Whole answers near the vector bound'; ``benchmarks/bench_vector.py``); this
table is the scalar schedules' route, which the split falls back to. ``--rank r`` runs both with
``schedule="lowrank", rank=r, bias=True, token_scale="auto"``. Columns:

* queries whole (the value fit's share beside) / scalar (measured at the oracle) and their ratio: in
  float64 the scalar run asks the whole run's schedule queries; in float32 the scalar oracle rounds
  its read-out to float32 while the whole run reads out float32 answers in float64, and the
  adaptive schedule may take another path;
* output error: ``to_torch(result.model, causal=...)`` against the layer itself at every position of
  200 fresh sequences of lengths 1..64 with unit-variance tokens (a LayerNorm's output), max
  absolute difference over max |output|, the layer run in float64 from its own (rounded) weights;
* the float32 layer's own output error against that float64 layer (the precision it has);
* parameter error ``compare(result.model, to_reduced(layer))`` and the run's estimate over it;
* seconds whole / scalar (one process; the ratio is the cost of the whole output).
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
from mhaextract.adapters.torch import TorchOracle, to_reduced, to_torch  # noqa: E402
from test_real_layers import build  # noqa: E402
from test_replacement_layers import CAUSAL, outputs  # noqa: E402

KINDS = ["nn.MultiheadAttention", "GPT2Attention", "BertSelfAttention", "OPTAttention", "ViTAttention"]


def output_error(replacement, layer, d, sequences=200, longest=64, seed=11):
    """Max |replacement - layer| over max |layer| at every position of fresh sequences."""
    rng = np.random.default_rng(seed)
    worst = largest = 0.0
    for n in rng.integers(1, longest + 1, size=sequences):
        X = torch.as_tensor(rng.standard_normal((1, int(n), d)))
        with torch.no_grad():
            expected = outputs(layer, X)
            got = outputs(replacement, X.to(next(replacement.parameters()).dtype)).to(torch.float64)
        worst, largest = max(worst, float((got - expected).abs().max())), max(largest, float(expected.abs().max()))
    return worst / largest


def row(kind, dtype, d, H, rank=None, seed=None):
    implementation = "sdpa"  # eager OPT and ViT take the softmax in float32 even in a float64 layer
    seed = d + H if seed is None else seed
    exact = build(kind, d, H, seed=seed, implementation=implementation).eval()  # float64 weights
    layer = build(kind, d, H, seed=seed, implementation=implementation).eval().to(getattr(torch, dtype))
    exact.load_state_dict({k: v.to(torch.float64) for k, v in layer.state_dict().items()})  # its rounded weights
    options = dict(schedule="targeted") if rank is None else dict(schedule="lowrank", rank=rank, bias=True,
                                                                   token_scale="auto")
    started = time.perf_counter()
    whole = mx.extract(TorchOracle(layer), d, heads=H, seed=0, on_failure="warn", progress=False, **options)
    whole_seconds = time.perf_counter() - started
    started = time.perf_counter()
    scalar = mx.extract(TorchOracle(layer, whole.readout), d, heads=H, seed=0, on_failure="warn", progress=False,
                        **options)
    scalar_seconds = time.perf_counter() - started
    causal = (kind, implementation) in CAUSAL
    if whole.model is not None:
        replacement = to_torch(whole.model, causal=causal)
        error = output_error(replacement, exact, d)
        parameters = float(mx.compare(whole.model, to_reduced(exact)).max_rel)
    else:
        error = parameters = np.inf
    own = output_error(layer, exact, d) if dtype != "float64" else 0.0
    checks = "ok" if whole.ok else "FAILED: " + ", ".join(c.name for c in whole.failed_checks)
    checks += " / " + ("ok" if scalar.ok else "FAILED: " + ", ".join(c.name for c in scalar.failed_checks))
    fit = 0 if whole.value_fit is None else whole.value_fit.rows
    print(f"| {kind} | {dtype} | {d} | {H} | {seed} | {'causal' if causal else 'all tokens'} | {whole.queries:,} | {fit:,} | "
          f"{scalar.queries:,} | {whole.queries / scalar.queries:.4f} | {error:.1e} | {own:.1e} | {parameters:.1e} | "
          f"{whole.error_estimate / parameters if parameters else np.nan:.2g} | {whole_seconds:.1f} / {scalar_seconds:.1f} | "
          f"{checks} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", nargs="+", default=["32:2", "64:4", "128:8"], help="d:H pairs")
    parser.add_argument("--dtypes", nargs="+", choices=["float64", "float32"], default=["float64", "float32"])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    parser.add_argument("--rank", type=int, help='schedule="lowrank" with this rank (the heads\' width)')
    parser.add_argument("--seed", type=int, help="the layers' seed (default d + H)")
    arguments = parser.parse_args()
    print("| layer | dtype | d | H | layer seed | positions | queries whole | of which value fit | queries scalar (same r) | ratio "
          "| output error | layer's own float error | parameter error | estimate / error | seconds whole / scalar | checks whole / scalar |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in arguments.dtypes:
        for kind in arguments.kinds:
            for cell in arguments.cells:
                d, H = (int(part) for part in cell.split(":"))
                row(kind, dtype, d, H, arguments.rank, arguments.seed)
    print(f"\npeak memory of this process (ru_maxrss): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB")


if __name__ == "__main__":
    main()
