"""The split's error estimate against the truth (docs/algorithm.md, 'Whole answers near the vector
bound', 'The error estimate'): the estimate of ``schedule="vector"`` beside the output error at every
position of fresh sequences where it makes its claim, computed from the layer's weights.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_vector_estimate.py \
        --cases gpt2-d32-h2/0 gpt2-d32-h2/1 64:4 --dtypes float64 float32
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_vector_estimate.py \
        --cases 128:8 --dtypes float64
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_vector_estimate.py \
        --cases 256:8 --dtypes float32

A case is a trained zoo layer (``model/index``, tests/zoo.py: the float32 weights, the truth their
exact float64 layer) or ``d:H``, benchmarks/bench_vector.py's GPT-2-class layer (the truth its
float64 weights). The run is the split's own model (``--split-only``'s: kept where a check fails).
Columns: the output error at every position of ``--sequences`` fresh sequences of 1..64 tokens,
Gaussian tokens of norm 0.25, 0.5 and 1 times the run's token scale (the claim's), each relative to
the largest output of its prefix; the same at benchmarks/bench_vector.py's unit-variance tokens
(its 40 sequences); the parameter error (``compare``); the
float32 layer's own error on the held-out queries (its answers against the exact layer, relative:
the answers' noise inside the held-out misfit); m, the held-out queries' largest relative misfit
(the run's, asked again), and the claim's error over it (what the estimate's factor 10 covers); the
estimate and its ratio to the claim's error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import mhaextract as mx  # noqa: E402
from bench_vector import gpt2_layer, position_error  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_reduced  # noqa: E402
from mhaextract.run.validation import spawn_rng  # noqa: E402
from mhaextract.split import estimate  # noqa: E402
from mhaextract.vector import learn, learner  # noqa: E402

FACTORS = (0.25, 0.5, 1.0)


def layers(case: str, dtype: str):
    """``(d, H, the layer as queried, the exact float64 layer)``."""
    if "/" in case:
        import zoo

        d, heads = zoo.shape(case)
        return d, heads, zoo.layer_as_run(case, getattr(torch, dtype)), zoo.exact_layer(case, getattr(torch, dtype))
    d, heads = (int(part) for part in case.split(":"))
    exact = gpt2_layer(d, heads, 0)
    return d, heads, exact if dtype == "float64" else gpt2_layer(d, heads, 0).float(), exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["gpt2-d32-h2/0", "gpt2-d32-h2/1", "64:4"])
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    parser.add_argument("--sequences", type=int, default=200, help="fresh sequences per token scale")
    args = parser.parse_args()
    learner.SPLIT_FAILURE_FALLS_BACK = False
    print("| case | answers | queries | checks | error at 0.25 / 0.5 / 1 x scale | unit-variance tokens "
          "| parameter error | layer's own (held-out) | m | error / m | estimate | estimate / error | CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for dtype in args.dtypes:
            d, heads, layer, exact = layers(case, dtype)
            truth = to_reduced(exact)
            cpu = time.process_time()
            result = mx.extract(TorchOracle(layer), d, heads=heads, seed=0, schedule="vector", on_failure="warn",
                                progress=False)
            cpu = time.process_time() - cpu
            model, scale = result.model, result.token_scale
            rng = np.random.default_rng(123)
            errors = [position_error(model, truth, d, norm=factor * scale, count=args.sequences, rng=rng)
                      for factor in FACTORS]
            held = learn.holdout_queries(spawn_rng(0, learn.STREAMS["holdout"]), d, scale)  # the run's, asked again
            answers = np.asarray(TorchOracle(layer)(held), dtype=np.float64)
            own = float((np.abs(answers - truth(held)).max(axis=1) / np.abs(answers).max(axis=1)).max())
            misfit = float(estimate.relative_misfits(model, held, answers).max())
            failed = [check.name for check in result.checks if not check.passed]
            print(f"| {case} | {dtype} | {result.queries:,} | {'failed: ' + ', '.join(failed) if failed else 'pass'} "
                  f"| {' / '.join(f'{error:.2g}' for error in errors)} | {position_error(model, truth, d):.2g} "
                  f"| {float(mx.compare(model, truth).max_rel):.2g} | {own:.2g} | {misfit:.2g} | {max(errors) / misfit:.1f} "
                  f"| {result.error_estimate:.2g} "
                  f"| {result.error_estimate / max(errors):.1f} | {cpu:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
