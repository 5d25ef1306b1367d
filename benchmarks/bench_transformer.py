"""Transformer benchmark: attention + bias-free ReLU FFN, float64 and 256 bits, with and without
the residual connection.

    python benchmarks/bench_transformer.py                 # full table (docs/transformer.md numbers)
    python benchmarks/bench_transformer.py --quick         # a smaller grid
    python benchmarks/bench_transformer.py --only 16,2,32  # one float64 cell (d,H,hidden[,r])
    python benchmarks/bench_transformer.py --only 16,2,32 --seeds 10 --per-seed  # and one line per seed

For every (mode, d, H, hidden, residual): measured queries of f (total, the odd-part step and its
core schedule), the longest query, segments, the max relative error of the canonical heads and
units against the truth, the fresh-query error (300 queries, lengths 1..12, token norms over two
decades: max |model - f| / max |f|), checks passed, seconds, and the step-2 time ratio:

* ``step 2 / oracle``: step 2's own time (its wall time less the oracle's time answering its
  queries) over the oracle's time answering step 2's queries (the simulated oracle is vectorised
  numpy, so this is a demanding baseline); median and worst over the seeds.

``--per-seed`` also prints, per seed: the ratio, step 2's own seconds, the oracle's seconds for
step 2's queries, step 2's queries and oracle calls, the fresh-query error and the checks.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx


class TimedOracle:
    """The simulated target, timing every call (and the number of queries before it)."""

    def __init__(self, target, precision=None):
        self.target, self.precision = target, precision
        self.calls = []  # (queries before the call, batch size, seconds)

    def __call__(self, batch):
        started = time.perf_counter()
        try:
            return self.target(batch, precision=self.precision)
        finally:
            before = sum(size for _, size, _ in self.calls)
            self.calls.append((before, len(batch), time.perf_counter() - started))

    def seconds(self, first=0, last=None) -> float:
        """Time answering the queries numbered first..last-1 (call boundaries align with steps)."""
        return sum(s for before, _, s in self.calls if before >= first and (last is None or before < last))


def fresh_error(target, model, rng, count=300) -> float:
    batch = []
    for _ in range(count):
        length = int(rng.integers(1, 13))
        tokens = rng.standard_normal((length, target.d))
        tokens /= np.linalg.norm(tokens, axis=1, keepdims=True)
        batch.append(tokens * target.d ** 0.25 * 10 ** rng.uniform(-1, 1, size=(length, 1)))
    truth = target(batch)
    return float(np.abs(model(batch) - truth).max() / np.abs(truth).max())


def run(d, H, n, precision, seeds, residual):
    rows = []
    for seed in range(seeds):
        target = mx.Transformer1L.random(d, H, n, seed=seed, residual=residual)
        oracle = TimedOracle(target, precision)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
            result = mx.extract_transformer(oracle, d, heads=H, hidden=n, precision=precision, seed=1000 + seed,
                                            residual=residual, on_failure="warn")
        total = time.perf_counter() - started
        got = result.model_hp if precision else result.model
        error = float(mx.compare_transformers(got, target).max_rel) if got is not None else np.inf
        fresh = fresh_error(target, result.model, np.random.default_rng(seed)) if result.model is not None else np.inf
        first, last = result.queries_odd_part, result.queries_odd_part + result.queries_units
        step2_oracle = oracle.seconds(first, last)
        step2_calls = sum(1 for before, _, _ in oracle.calls if first <= before < last)
        rows.append(dict(queries=result.queries, odd=result.queries_odd_part, longest=result.max_query_length,
                         segments=result.segments, error=error, fresh=fresh, ok=result.ok, seconds=total,
                         schedule=result.attention.schedule, units=result.queries_units, calls=step2_calls,
                         own=result.seconds_units - step2_oracle, oracle=step2_oracle,
                         ratio=(result.seconds_units - step2_oracle) / max(step2_oracle, 1e-9)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--only", help="one float64 cell: d,H,hidden[,r]")
    parser.add_argument("--per-seed", action="store_true", help="one line per seed after each cell's row")
    args = parser.parse_args()
    if args.only:
        parts = args.only.split(",")
        grid = [(None, int(parts[0]), int(parts[1]), int(parts[2]), len(parts) > 3 and parts[3] == "r")]
    elif args.quick:
        grid = [(None, 8, 4, 16, False), (None, 6, 2, 8, True)]
    else:
        grid = [(None, 4, 2, 8, False), (None, 8, 2, 16, False), (None, 8, 4, 16, False), (None, 8, 8, 16, False),
                (None, 16, 2, 32, False), (None, 16, 4, 32, False), (None, 16, 8, 32, False), (None, 32, 2, 48, False),
                (None, 32, 4, 64, False), (None, 6, 2, 8, True), (None, 8, 4, 16, True), (None, 16, 4, 32, True),
                (256, 3, 2, 4, False), (256, 3, 2, 4, True), (256, 4, 3, 6, False)]
    print("| mode | d | H | hidden | residual | step 1 | queries of f (median) | odd part | longest | segments "
          "| median rel. err | worst rel. err | fresh-query err (worst) | checks ok | s (median) | step 2 / oracle (median) "
          "| step 2 / oracle (worst) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for precision, d, H, n, residual in grid:
        seeds = args.seeds if precision is None else 2
        rows = run(d, H, n, precision, seeds, residual)
        get = lambda key: np.array([row[key] for row in rows], dtype=float)  # noqa: E731
        mode = "float64" if precision is None else f"{precision} bits"
        print(f"| {mode} | {d} | {H} | {n} | {'yes' if residual else 'no'} | {rows[0]['schedule']} | "
              f"{int(np.median(get('queries')))} | {int(np.median(get('odd')))} | {int(get('longest').max())} | "
              f"{int(np.median(get('segments')))} | {np.median(get('error')):.1e} | {get('error').max():.1e} | "
              f"{get('fresh').max():.1e} | {int(get('ok').sum())}/{seeds} | {np.median(get('seconds')):.2f} | "
              f"{np.median(get('ratio')):.1f} | {get('ratio').max():.1f} |", flush=True)
        if args.per_seed:
            for seed, row in enumerate(rows):
                print(f"    seed {seed}: step 2 / oracle {row['ratio']:.2f} (own {row['own']:.3f} s, oracle "
                      f"{row['oracle']:.3f} s, {row['units']} queries in {row['calls']} calls), fresh {row['fresh']:.1e}, "
                      f"ok {row['ok']}", flush=True)


if __name__ == "__main__":
    main()
