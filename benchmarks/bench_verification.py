"""What the default verification costs (docs/algorithm.md §12, "Verification").

Default runs (``extract(oracle, d, heads=H, seed=...)``: schedule ``auto``, biases, calibrated
token scale) on random biased targets through a simulated float64 oracle. Measured at the oracle:
every query and token it was handed, and the seconds it spent, split into the verification's
call (the one that holds its 256-token query) and the rest.

    python benchmarks/bench_verification.py --sizes 4x2 8x2 32x2 32x4 64x2 64x4
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import mhaextract as mx


class TimedOracle:
    """A simulated float64 oracle that counts queries and tokens and times every call, split into
    calls holding a query of ``marker`` tokens (the verification's) and the others."""

    def __init__(self, target, marker: int):
        self.target, self.marker = target, marker
        self.queries = {"verification": 0, "rest": 0}
        self.tokens = {"verification": 0, "rest": 0}
        self.seconds = {"verification": 0.0, "rest": 0.0}

    def __call__(self, batch):
        kind = "verification" if any(len(X) == self.marker for X in batch) else "rest"
        started = time.perf_counter()
        out = self.target(batch)
        self.seconds[kind] += time.perf_counter() - started
        self.queries[kind] += len(batch)
        self.tokens[kind] += sum(len(X) for X in batch)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["4x2", "8x2", "32x2", "32x4", "64x2", "64x4"],
                        help="d x H pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| d | H | queries | verification queries | share of queries | share of tokens | "
          "share of oracle time | run s | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        d, H = (int(part) for part in size.split("x"))
        target = mx.MultiHeadAttention.random(d, H, seed=args.seed, bias=True)
        oracle = TimedOracle(target, marker=256)
        started = time.perf_counter()
        result = mx.extract(oracle, d, heads=H, seed=args.seed, on_failure="warn")
        seconds = time.perf_counter() - started
        queries = sum(oracle.queries.values())
        assert queries == result.queries and oracle.queries["verification"] == result.verification_queries
        share = {key: part["verification"] / sum(part.values())
                 for key, part in (("queries", oracle.queries), ("tokens", oracle.tokens), ("time", oracle.seconds))}
        print(f"| {d} | {H} | {queries} | {result.verification_queries} | {100 * share['queries']:.2f}% | "
              f"{100 * share['tokens']:.1f}% | {100 * share['time']:.1f}% | {seconds:.1f} | {result.ok} |", flush=True)


if __name__ == "__main__":
    main()
