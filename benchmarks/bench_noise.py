"""Approximate oracles: what oversampling and refinement buy, against in-run baselines.

    PYTHONPATH=src python benchmarks/bench_noise.py            # all tables (docs/noise.md numbers)
    PYTHONPATH=src python benchmarks/bench_noise.py --quick    # fewer seeds

Table 1 (acceptance 2): additive noise |e| <= 1e-10, H = 3, d = 8. Baseline: the exact-count
run (the paper's 4Hd^2 - 2H + 1 queries) on the same target, oracle and seed. Columns: median
and worst max relative parameter error over the seeds, measured queries, seconds, and
baseline / row (the improvement factor of the medians).

Table 2 (acceptance 6): exact float64 oracle, refine=True, H <= 3, d in {4, 8, 16}. Baseline:
the exact-count algebraic result of the same run. Max relative parameter error (worst over
seeds), queries (schedule + refinement, measured), CPU seconds per run.

Table 3 (acceptance 3): the target evaluated in float32, H = 2, d = 8, refine=True: parameter
error, the reported bound, and verify's relative output error against the float32 oracle's own
error on the same fresh queries (the rounding floor, measured in the same run).
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx
from mhaextract.oracle.queries import random_queries


def run(target, oracle, d, H, seed, **options):
    options.setdefault("refine", False)  # the algebraic rows stay algebraic (paper refines noisy answers unasked)
    started = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        result = mx.extract(oracle, d, heads=H, seed=seed, schedule="paper", on_failure="warn", **options)
    seconds = time.process_time() - started
    error = float(mx.compare(result.model, target).max_rel) if result.model is not None else np.inf
    return result, error, seconds


def table_noise(seeds: int):
    d, H, eps = 8, 3, 1e-10
    K = 2 * H + 1
    modes = {
        "exact count (baseline)": {},
        "exact count + refine": {"refine": True},
        "2x oversampling": {"samples_per_instance": 2 * K},
        "4x oversampling": {"samples_per_instance": 4 * K},
        "4x oversampling + refine": {"samples_per_instance": 4 * K, "refine": True},
    }
    errors = {name: [] for name in modes}
    queries = {name: set() for name in modes}
    seconds = {name: [] for name in modes}
    for seed in range(seeds):
        target = mx.MultiHeadAttention.random(d, H, seed=seed)
        for name, options in modes.items():
            oracle = mx.AdditiveNoise(mx.SimulatedOracle(target), eps, seed=seed)
            result, error, cpu = run(target, oracle, d, H, 100 + seed, answer_error=eps, **options)
            errors[name].append(error)
            queries[name].add(result.queries)
            seconds[name].append(cpu)
    baseline = np.median(errors["exact count (baseline)"])
    print(f"\n### additive noise eps = {eps:g}, H = {H}, d = {d}, {seeds} seeds\n")
    print("| mode | queries (measured) | median max rel. error | worst | baseline / median | CPU s (median) |")
    print("|---|---|---|---|---|---|")
    for name in modes:
        median = np.median(errors[name])
        print(f"| {name} | {'/'.join(map(str, sorted(queries[name])))} | {median:.1e} | {max(errors[name]):.1e} | "
              f"{baseline / median:.1e} | {np.median(seconds[name]):.2f} |", flush=True)


def table_exact(seeds: int):
    print(f"\n### exact float64 oracle, refine=True, {seeds} seeds\n")
    print("| d | H | queries (schedule + refinement) | algebraic worst rel. error (baseline) | refined worst rel. error | "
          "baseline / refined | CPU s (median) |")
    print("|---|---|---|---|---|---|---|")
    for d in (4, 8, 16):
        for H in (1, 2, 3):
            algebraic, refined, cpu, queries = [], [], [], set()
            for seed in range(seeds):
                target = mx.MultiHeadAttention.random(d, H, seed=seed)
                oracle = mx.SimulatedOracle(target)
                result, error, seconds = run(target, oracle, d, H, 100 + seed, refine=True)
                # The algebraic result of the same run: the same queries without refinement.
                _, baseline, _ = run(target, oracle, d, H, 100 + seed)
                algebraic.append(baseline)
                refined.append(error)
                cpu.append(seconds)
                queries.add(f"{result.promised_queries} + {result.queries - result.promised_queries}")
            print(f"| {d} | {H} | {'/'.join(sorted(queries))} | {max(algebraic):.1e} | {max(refined):.1e} | "
                  f"{max(algebraic) / max(refined):.1e} | {np.median(cpu):.2f} |", flush=True)


def table_float32(seeds: int):
    d, H = 8, 2
    print(f"\n### float32 target, H = {H}, d = {d}, refine=True, {seeds} seeds\n")
    print("| seed | queries | max rel. error | reported error_estimate | checks | verify max / float32 floor max | "
          "verify mean / float32 floor mean | verify mean / 2^-24 |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in range(seeds):
        target = mx.MultiHeadAttention.random(d, H, seed=seed)
        oracle = mx.Float32Oracle(target)
        result, error, _ = run(target, oracle, d, H, 100 + seed, refine=True)
        verification = mx.verify(result, oracle, verify_queries=512, seed=seed)
        # The floor: the float32 oracle against the exact target on the same fresh queries.
        rng = np.random.default_rng(seed)
        counts = np.diff(np.linspace(0, 512, 4).astype(int))
        sequences = []
        for scale, count in zip((0.5, 1.0, 2.0), counts):
            sequences += random_queries(rng, count, d, scale * d**0.25, (1, 16))
        answers, exact = oracle(sequences), target(sequences)
        rms = np.sqrt(np.mean(answers**2))
        floor = np.abs(answers - exact) / rms
        checks = "ok" if result.ok else ", ".join(c.name for c in result.failed_checks)
        print(f"| {seed} | {result.queries} | {error:.1e} | {result.error_estimate:.1e} | {checks} | "
              f"{verification.max_relative_error / floor.max():.1f} | "
              f"{verification.mean_relative_error / floor.mean():.1f} | "
              f"{verification.mean_relative_error / 2.0**-24:.1f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    table_noise(5 if args.quick else 20)
    table_exact(2 if args.quick else 5)
    table_float32(2 if args.quick else 5)


if __name__ == "__main__":
    main()
