"""The grid schedules' float64 error estimate against the truth (docs/algorithm.md, "The anchors' error"), random
targets and two stressed kinds, exact answers:

    OMP_NUM_THREADS=1 python benchmarks/bench_grid_estimate.py [--schedule lean] [--seeds 50]

Targets ``MultiHeadAttention.random(d, H, seed)`` for d = 2..6, H = 1..min(d, 3) ("random"); the same
with v scaled by 1e4 ("v x 1e4") and with W_2 = 2 W_1 ("collinear W", H >= 2 only). One row per kind:
runs, passed, failed, false alarms (failed with a true error below 1e-6), the worst and median true
error / estimate over the passing runs (``mx.compare(...).max_rel`` against the target), how many of
them exceed 30, and the queries of all runs (measured at the oracle boundary).
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np

import mhaextract as mx

KINDS = ("random", "v x 1e4", "collinear W")


def stressed(kind: str, d: int, H: int, seed: int) -> mx.MultiHeadAttention:
    target = mx.MultiHeadAttention.random(d, H, seed=seed)
    W, v = target.W.copy(), target.v.copy()
    if kind == "v x 1e4":
        v = v * 1e4
    elif kind == "collinear W":
        W[1] = 2 * W[0]
    return mx.MultiHeadAttention(W, v)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="lean")
    parser.add_argument("--seeds", type=int, default=50)
    args = parser.parse_args()
    print(f"| schedule | targets | runs | passed | failed | false alarms | worst truth / estimate | median | > 30 x "
          "| queries |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        ratios, failed, false_alarms, queries, runs = [], 0, 0, 0, 0
        for d in range(2, 7):
            for H in range(2 if kind == "collinear W" else 1, min(d, 3) + 1):
                for seed in range(args.seeds):
                    target = stressed(kind, d, H, seed)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
                        result = mx.extract(mx.SimulatedOracle(target), d, heads=H, schedule=args.schedule, seed=seed,
                                            on_failure="warn", progress=False)
                    error = float(mx.compare(result.model, target).max_rel) if result.model is not None else np.inf
                    runs, queries = runs + 1, queries + result.queries
                    if result.ok:
                        ratios.append(error / result.error_estimate)
                    else:
                        failed += 1
                        false_alarms += error < 1e-6
        ratios = np.array(ratios)
        print(f"| {args.schedule} | {kind} | {runs} | {len(ratios)} | {failed} | {false_alarms} | {ratios.max():.3g} | "
              f"{np.median(ratios):.3g} | {int((ratios > 30).sum())} | {queries} |")


if __name__ == "__main__":
    main()
