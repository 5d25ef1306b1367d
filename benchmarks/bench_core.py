"""Core benchmark: the paper schedule in float64 and in high precision.

    python benchmarks/bench_core.py            # full table (README numbers)
    python benchmarks/bench_core.py --quick    # a smaller grid
    python benchmarks/bench_core.py --schedules-only   # only the paper/lean table

For every (d, H): measured queries against 4Hd^2 - 2H + 1, the longest query, the max relative
parameter error over seeds (median and worst), wall seconds, and two in-run baselines:

* ``learner/oracle``: time spent in the learner divided by time spent answering queries in
  the simulated oracle (the oracle is the floor any extraction pays);
* ``vandermonde/ours``: per-instance error of the naive monomial-Vandermonde rational fit
  (solve for numerator and denominator coefficients) divided by the error of our barycentric
  kernel, on the same instances of the same run.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx
from mhaextract.numerics import float64 as kernel


class TimedOracle:
    def __init__(self, target, precision=None):
        self.inner = mx.SimulatedOracle(target, precision)
        self.seconds = 0.0

    def __call__(self, batch):
        started = time.perf_counter()
        try:
            return self.inner(batch)
        finally:
            self.seconds += time.perf_counter() - started


def vandermonde_fit_error(F: np.ndarray, ks: np.ndarray, H: int, m_true: np.ndarray) -> float:
    """The naive kernel: p(k) - F(k) q(k) = 0 with monomial p (deg H) and monic q (deg H)."""
    A = np.hstack([ks[:, None] ** np.arange(H + 1), -F[:, None] * ks[:, None] ** np.arange(H)])
    coefficients = np.linalg.solve(A, F * ks**H)
    q = np.concatenate([coefficients[H + 1:], [1.0]])
    tau = -np.roots(q[::-1]).real
    with np.errstate(invalid="ignore"):
        m = np.sort(np.log(tau))
    return float(np.nanmax(np.abs(m - np.sort(m_true)), initial=np.inf)) if np.isfinite(m).all() else np.inf


def kernel_ratio(H: int, trials: int, rng) -> float:
    """Median over random instances of error(Vandermonde) / error(barycentric)."""
    ratios = []
    ks = np.arange(2 * H + 1)
    for _ in range(trials):
        m = rng.standard_normal(H)
        tau, labels, c = np.exp(m), rng.standard_normal(H), rng.standard_normal()
        F = c + (tau * labels / (ks[:, None] + tau)).sum(axis=1)
        fit = kernel.fit(F[None], ks, H)
        ours = float(np.abs(fit.log_poles[0] - np.sort(m)).max())
        naive = vandermonde_fit_error(F, ks, H, m)
        ratios.append(min(naive, 1.0) / max(ours, 1e-17))
    return float(np.median(ratios))


def run(d, H, precision, seeds, schedule="paper"):
    errors, seconds, ratios, queries, longest, ok = [], [], [], [], set(), 0
    for seed in range(seeds):
        target = mx.MultiHeadAttention.random(d, H, seed=seed)
        oracle = TimedOracle(target, precision)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
            result = mx.extract(oracle, d, heads=H, precision=precision, seed=1000 + seed, schedule=schedule,
                                on_failure="warn")
        total = time.perf_counter() - started
        got = result.model_hp if precision else result.model
        errors.append(float(mx.compare(got, target).max_rel) if got is not None else np.inf)
        seconds.append(total)
        ratios.append((total - oracle.seconds) / max(oracle.seconds, 1e-9))
        queries.append(result.queries)
        longest.add(result.max_query_length)
        ok += result.ok
    return errors, seconds, ratios, queries, longest, ok


def schedules_table(ds, seeds):
    """Paper and lean schedules side by side in float64 (and the counts against the lower bound)."""
    print()
    print("| d | H | paper queries | lean queries (median, measured) | lower bound H(d^2+d) | lean/paper | "
          "lean/bound | float64 median err paper | float64 median err lean | lean checks ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in ds:
        for H in (1, 2, 3):
            paper_errors, _, _, paper_queries, _, _ = run(d, H, None, seeds, "paper")
            lean_errors, _, _, lean_queries, _, lean_ok = run(d, H, None, seeds, "lean")
            bound = H * (d * d + d)
            lean = int(np.median(lean_queries))
            print(f"| {d} | {H} | {paper_queries[0]} | {lean} | {bound} | {lean / paper_queries[0]:.3f} | "
                  f"{lean / bound:.2f} | {np.median(paper_errors):.1e} | {np.median(lean_errors):.1e} | "
                  f"{lean_ok}/{seeds} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--schedules-only", action="store_true", help="only the paper/lean table")
    args = parser.parse_args()
    if args.schedules_only:
        schedules_table([4, 8, 16] if args.quick else [4, 8, 16, 32], args.seeds)
        return
    rng = np.random.default_rng(0)
    float_ds = [4, 8, 16] if args.quick else [4, 8, 16, 32, 64]
    hp_grid = [(2, 2), (4, 4), (8, 8)] if args.quick else [(2, 1), (2, 4), (4, 2), (4, 6), (8, 4), (6, 8), (8, 8)]
    print("| mode | d | H | queries (measured) | 4Hd^2-2H+1 | longest | median rel. err | worst rel. err | checks ok | s (median) | learner/oracle time | vandermonde/ours err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in float_ds:
        for H in (1, 2, 3, 4):
            seeds = args.seeds if d <= 32 else 2
            errors, seconds, ratios, queries, longest, ok = run(d, H, None, seeds)
            print(f"| float64 | {d} | {H} | {'/'.join(map(str, sorted(set(queries))))} | {4*H*d*d - 2*H + 1} | "
                  f"{'/'.join(map(str, sorted(longest)))} | {np.median(errors):.1e} | {max(errors):.1e} | {ok}/{seeds} | "
                  f"{np.median(seconds):.2f} | {np.median(ratios):.2f} | {kernel_ratio(H, 200, rng):.1e} |", flush=True)
    for d, H in hp_grid:
        seeds = 2
        errors, seconds, ratios, queries, longest, ok = run(d, H, 256, seeds)
        print(f"| 256 bits | {d} | {H} | {'/'.join(map(str, sorted(set(queries))))} | {4*H*d*d - 2*H + 1} | "
              f"{'/'.join(map(str, sorted(longest)))} | {np.median(errors):.1e} | {max(errors):.1e} | {ok}/{seeds} | "
              f"{np.median(seconds):.2f} | {np.median(ratios):.2f} | - |", flush=True)
    schedules_table([4, 8, 16] if args.quick else [4, 8, 16, 32], args.seeds)


if __name__ == "__main__":
    main()
