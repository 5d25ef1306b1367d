"""The low-rank schedule's error estimate against the truth (docs/algorithm.md, 'Low-rank heads', 'Error estimate'),
float64 simulated targets of rank d / H, with and without biases:

    OMP_NUM_THREADS=1 python benchmarks/bench_lowrank_estimate.py [--d 16 32 64] [--heads 2 4 8] [--seeds 4]

Per run: the normwise relative error after alignment (``mx.compare(...).max_rel``, against the
target's own parameters) and ``error_estimate / error``, which must stay above 1 (an estimate below
the truth is a bug) and is best not far above it (an estimate far above the truth fails correct
runs on noisy answers). Float32 layers: ``bench_real_layers.py --dtype float32 --rank dH``.
"""

from __future__ import annotations

import argparse

import numpy as np

import mhaextract as mx
from bench_scale import target  # the scale table's targets: rank d / H, biases as its "lowb" cells


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, nargs="*", default=[16, 32, 64])
    parser.add_argument("--heads", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    print("| d | H | biases | seed | queries | rel. error | estimate | estimate / error | checks |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios, passed, runs = [], 0, 0
    for d in args.d:
        for H in args.heads:
            for bias in (False, True):
                for seed in range(args.seeds):
                    truth = target(d, H, d // H, seed, bias)
                    result = mx.extract(mx.SimulatedOracle(truth), d, heads=H, seed=seed + 1, schedule="lowrank",
                                        rank=d // H, bias=bias, token_scale=d ** 0.25, on_failure="warn", progress=False)
                    error = float(mx.compare(result.model, truth).max_rel) if result.model is not None else np.inf
                    ratio = result.error_estimate / error if 0 < error < np.inf else np.nan
                    runs += 1
                    passed += bool(result.ok)
                    if result.ok and np.isfinite(ratio):  # an exact result (error 0) has no ratio
                        ratios.append(ratio)
                    print(f"| {d} | {H} | {'yes' if bias else 'no'} | {seed} | {result.queries:,} | {error:.2e} | "
                          f"{result.error_estimate:.2e} | {ratio:.3g} | "
                          f"{'ok' if result.ok else 'FAILED: ' + ', '.join(c.name for c in result.failed_checks)} |",
                          flush=True)
    if ratios:
        print(f"\n{passed} of {runs} runs pass their checks; estimate / error over them: min {min(ratios):.3g}, "
              f"median {np.median(ratios):.3g}, max {max(ratios):.3g}")


if __name__ == "__main__":
    main()
