"""Rotary schedule (docs/algorithm.md §22): what it recovers from random Llama-like layers in float64.

    OMP_NUM_THREADS=1 python benchmarks/bench_rotary.py [--seeds 4] [--cells d:H:r:kv ...]

Each cell extracts ``RotaryAttention.random(d, H, r, kv_heads=kv, bias=seed odd)`` with the
defaults plus ``positions="rotary"`` and ``rank=r`` (the head width, as a user reads it from the
layer's config; ``--no-rank`` leaves it to the run), through an oracle that counts what it is asked, and prints one
row per seed: passed or failed (and which checks), the error against the layer
(``compare(...).max_rel``), the run's own estimate, their ratio, the output error on 200 fresh
sequences of 1..256 tokens, the queries counted at the oracle, and the seconds.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx


class Counting:
    def __init__(self, model):
        self.model, self.queries = model, 0

    def __call__(self, batch):
        self.queries += len(batch)
        return self.model(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--no-rank", action="store_true", help="do not give the head width")
    parser.add_argument("--cells", nargs="*", default=["8:1:4:1", "32:1:16:1", "8:2:4:2", "16:2:8:1", "32:2:16:1",
                                                       "16:3:4:3", "32:4:8:2"])
    args = parser.parse_args()
    warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
    print("| d | H | r | kv | seed | ok | failed checks | error | estimate | error / estimate | output error (1..256) "
          "| queries | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in args.cells:
        d, H, r, kv = (int(value) for value in cell.split(":"))
        for seed in range(args.seeds):
            layer = mx.RotaryAttention.random(d=d, heads=H, head_width=r, seed=seed, kv_heads=kv, bias=bool(seed % 2))
            oracle = Counting(layer)
            started = time.perf_counter()
            result = mx.extract(oracle, d=d, heads=H, positions="rotary", seed=seed, on_failure="warn",
                                rank=None if args.no_rank else r)
            seconds = time.perf_counter() - started
            error, output = np.inf, np.inf
            if result.model is not None:
                error = float(mx.compare(result.model, layer).max_rel)
                rng = np.random.default_rng(100 + seed)
                sequences = [rng.normal(size=(int(n), d)) * d ** -0.25 for n in rng.integers(1, 257, 200)]
                truth = layer(sequences)
                output = float(np.abs(result.model(sequences) - truth).max() / np.abs(truth).max())
            failed = ", ".join(check.name for check in result.failed_checks) or "-"
            print(f"| {d} | {H} | {r} | {kv} | {seed} | {result.ok} | {failed} | {error:.1e} | "
                  f"{result.error_estimate:.1e} | {error / result.error_estimate:.2g} | {output:.1e} | "
                  f"{oracle.queries} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
