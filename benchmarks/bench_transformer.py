"""Transformer benchmark: attention + bias-free ReLU FFN, float64 and 256 bits.

    python benchmarks/bench_transformer.py            # full table (docs/transformer.md numbers)
    python benchmarks/bench_transformer.py --quick    # a smaller grid

For every (mode, d, H, hidden): measured queries of f (total, and the odd-part step against its
formula 2 (4Hd^2 - 2H + 1)), the longest query, segments, the max relative error of the canonical
heads and units against the truth (median and worst over seeds), the verification misfit, checks
passed, and two in-run baselines as ratios:

* ``total/odd part``: all queries over the odd-part queries (what step 2 and the verification
  cost on top of the attention extraction the core would do anyway);
* ``learner/oracle``: time in the learner over time answering queries in the simulated oracle.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx


class TimedOracle:
    def __init__(self, target, precision=None):
        self.target, self.precision, self.seconds = target, precision, 0.0

    def __call__(self, batch):
        started = time.perf_counter()
        try:
            return self.target(batch, precision=self.precision)
        finally:
            self.seconds += time.perf_counter() - started


def run(d, H, n, precision, seeds):
    rows = []
    for seed in range(seeds):
        target = mx.Transformer1L.random(d, H, n, seed=seed)
        oracle = TimedOracle(target, precision)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
            result = mx.extract_transformer(oracle, d, heads=H, hidden=n, precision=precision, seed=1000 + seed,
                                            on_failure="warn")
        total = time.perf_counter() - started
        got = result.model_hp if precision else result.model
        error = float(mx.compare_transformers(got, target).max_rel) if got is not None else np.inf
        rows.append(dict(queries=result.queries, odd=result.queries_odd_part, longest=result.max_query_length,
                         segments=result.segments, error=error, misfit=result.verification_misfit, ok=result.ok,
                         seconds=total, learner=(total - oracle.seconds) / max(oracle.seconds, 1e-9)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    grid = [(None, 4, 2, 8), (None, 8, 2, 16)] if args.quick else \
        [(None, 4, 1, 8), (None, 4, 2, 8), (None, 8, 2, 16), (None, 8, 3, 16), (None, 16, 2, 32),
         (256, 2, 2, 4), (256, 3, 3, 6), (256, 4, 3, 6), (256, 4, 2, 12)]
    print("| mode | d | H | hidden | queries of f (median) | odd part (2(4Hd^2-2H+1)) | longest | segments "
          "| median rel. err | worst rel. err | verification misfit (worst) | checks ok | s (median) "
          "| total/odd part | learner/oracle time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for precision, d, H, n in grid:
        seeds = args.seeds if precision is None else 2
        rows = run(d, H, n, precision, seeds)
        get = lambda key: np.array([row[key] for row in rows], dtype=float)  # noqa: E731
        mode = "float64" if precision is None else f"{precision} bits"
        print(f"| {mode} | {d} | {H} | {n} | {int(np.median(get('queries')))} | {int(get('odd')[0])} "
              f"({2 * (4 * H * d * d - 2 * H + 1)}) | {int(get('longest').max())} | {int(np.median(get('segments')))} | "
              f"{np.median(get('error')):.1e} | {get('error').max():.1e} | {get('misfit').max():.1e} | "
              f"{int(get('ok').sum())}/{seeds} | {np.median(get('seconds')):.2f} | "
              f"{np.median(get('queries') / get('odd')):.2f} | {np.median(get('learner')):.2f} |", flush=True)


if __name__ == "__main__":
    main()
