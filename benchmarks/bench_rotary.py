"""Rotary schedule (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'): what it
recovers from random Llama-like layers.

    OMP_NUM_THREADS=1 python benchmarks/bench_rotary.py [--seeds 4] [--cells d:H:r:kv ...] [--precision BITS]

Each cell extracts ``RotaryAttention.random(d, H, r, kv_heads=kv, bias=seed odd)`` with the
defaults plus ``positions="rotary"`` and ``rank=r`` (the head width, as a user reads it from the
layer's config; ``--no-rank`` leaves it to the run), through an oracle that counts what it is asked, and prints one
row per seed: passed or failed (and which checks), the error against the layer
(``compare(...).max_rel``), the run's own estimate, their ratio, the output error on 200 fresh
sequences of 1..256 tokens, the queries counted at the oracle, and the seconds.

``--precision BITS``: the oracle answers at BITS (``SimulatedOracle(layer, precision=BITS)``), the
run is ``precision=BITS``, errors are measured in mpf at BITS, and each row adds the seconds of
the float64 run of the same cell and their ratio (the cost of the high-precision polish).
"""

from __future__ import annotations

import argparse
import time
import warnings

import mpmath
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
    parser.add_argument("--precision", type=int, default=None, help="bits of the answers (default float64)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
    high = args.precision is not None
    extra = " float64 s | ratio |" if high else ""
    print("| d | H | r | kv | seed | ok | failed checks | error | estimate | error / estimate | output error (1..256) "
          "| queries | s |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if high else ""))
    for cell in args.cells:
        d, H, r, kv = (int(value) for value in cell.split(":"))
        for seed in range(args.seeds):
            layer = mx.RotaryAttention.random(d=d, heads=H, head_width=r, seed=seed, kv_heads=kv, bias=bool(seed % 2))
            oracle = Counting(mx.SimulatedOracle(layer, precision=args.precision))
            started = time.perf_counter()
            result = mx.extract(oracle, d=d, heads=H, positions="rotary", schedule="rotary", seed=seed, on_failure="warn",
                                rank=None if args.no_rank else r, precision=args.precision)
            seconds = time.perf_counter() - started
            error, output = np.inf, np.inf
            if result.model is not None:
                error = float(mx.compare(result.model, layer).max_rel)
                rng = np.random.default_rng(100 + seed)
                sequences = [rng.normal(size=(int(n), d)) * d ** -0.25 for n in rng.integers(1, 257, 200)]
                output = output_error(result.model, layer, sequences, args.precision)
            failed = ", ".join(check.name for check in result.failed_checks) or "-"
            row = (f"| {d} | {H} | {r} | {kv} | {seed} | {result.ok} | {failed} | {error:.1e} | "
                   f"{result.error_estimate:.1e} | {error / result.error_estimate:.2g} | {output:.1e} | "
                   f"{oracle.queries} | {seconds:.1f} |")
            if high:  # the baseline: the same cell in float64
                started = time.perf_counter()
                mx.extract(layer, d=d, heads=H, positions="rotary", schedule="rotary", seed=seed, on_failure="warn",
                           rank=None if args.no_rank else r)
                baseline = time.perf_counter() - started
                row += f" {baseline:.1f} | {seconds / baseline:.1f} |"
            print(row, flush=True)


def output_error(model, layer, sequences, precision) -> float:
    """Max output error on ``sequences`` relative to the largest output (in mpf at ``precision``)."""
    if precision is None:
        truth = layer(sequences)
        return float(np.abs(model(sequences) - truth).max() / np.abs(truth).max())
    truth, predicted = layer(sequences, precision=precision), model(sequences, precision=precision)
    with mpmath.workprec(precision + 64):
        return float(max(abs(a - b) for a, b in zip(predicted, truth)) / max(abs(t) for t in truth))


if __name__ == "__main__":
    main()
