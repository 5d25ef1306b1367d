"""Low-precision oracles (issue 15 item 2, docs/algorithm.md §19): the default extraction against
float32, mixed-precision (float32 softmax in a float64 layer) and bfloat16 targets.

    python benchmarks/bench_low_precision.py [--sizes 8x2 16x4 32x4 64x8] [--seeds 10]
        [--oracles float32 mixed bfloat16]
    python benchmarks/bench_low_precision.py --bfloat16-oversampling [--sizes 4x1 4x2] [--seeds 2]

Per oracle, size and seed: target ``MultiHeadAttention.random(d, H, seed=s)``, run
``extract(oracle, d, heads=H, seed=1000 + s, on_failure="warn")`` (library defaults: schedule
"auto", calibration, no declared answer_error); the error is ``compare(result.model, target).max_rel``
against the float64 truth. One row per run, then a summary per (oracle, size).

``--bfloat16-oversampling``: what least squares over random queries reaches against a bfloat16
oracle (the algebraic schedules fail loudly there: their instances cannot resolve a pole at 8 bits):
the distillation baseline (:func:`mhaextract.baselines.distillation.distill`, Adam + L-BFGS over
8 restarts) on 1x, 4x and 16x the paper's count of random queries, error against the float64
truth. The oracle rounds its own parameters to bfloat16 (2^-9 relative), the floor of any method.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx

ORACLES = {"float32": mx.Float32Oracle, "mixed": mx.MixedPrecisionOracle, "bfloat16": mx.BFloat16Oracle}


def run(kind: str, d: int, H: int, seed: int) -> dict:
    target = mx.MultiHeadAttention.random(d, H, seed=seed)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(ORACLES[kind](target), d, heads=H, seed=1000 + seed, on_failure="warn")
    seconds = time.perf_counter() - started
    error = (mx.compare(result.model, target).max_rel
             if result.model is not None and result.model.heads == H else np.inf)
    noise = result.calibration.answer_noise if result.calibration is not None else None
    return {"kind": kind, "d": d, "H": H, "seed": seed, "queries": result.queries, "seconds": seconds,
            "error": error, "estimate": result.error_estimate, "ok": result.ok, "noise": noise,
            "precision": result.calibration.answer_precision if result.calibration is not None else "?",
            "failed": ",".join(check.name for check in result.failed_checks)}


def oversampled(d: int, H: int, seed: int, multiple: int) -> dict:
    from mhaextract.baselines.distillation import distill, paper_budget

    target = mx.MultiHeadAttention.random(d, H, seed=seed)
    started = time.perf_counter()
    result = distill(mx.BFloat16Oracle(target), d, H, n_queries=multiple * paper_budget(d, H), restarts=8,
                     adam_steps=800, lbfgs_steps=300, seed=seed, converged_tol=1e-2, on_failure="warn")
    return {"queries": result.queries, "error": float(mx.compare(result.model, target).max_rel),
            "seconds": time.perf_counter() - started}


def oversampling_table(sizes, seeds) -> None:
    print("| oracle | d | H | queries / paper count | queries | rel. error (median) | rel. error (max) | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        d, H = (int(part) for part in size.split("x"))
        for multiple in (1, 4, 16):
            rows = [oversampled(d, H, seed, multiple) for seed in range(seeds)]
            errors = [row["error"] for row in rows]
            print(f"| bfloat16 (distillation) | {d} | {H} | {multiple} | {rows[0]['queries']} | "
                  f"{np.median(errors):.2g} | {max(errors):.2g} | "
                  f"{np.median([row['seconds'] for row in rows]):.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["8x2", "16x4", "32x4"])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--oracles", nargs="+", default=list(ORACLES))
    parser.add_argument("--bfloat16-oversampling", action="store_true")
    args = parser.parse_args()
    if args.bfloat16_oversampling:
        oversampling_table(args.sizes, args.seeds)
        return
    rows = []
    print("| oracle | d | H | seed | detected | noise | queries | seconds | rel. error | estimate / error | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.oracles:
        for size in args.sizes:
            d, H = (int(part) for part in size.split("x"))
            for seed in range(args.seeds):
                row = run(kind, d, H, seed)
                rows.append(row)
                ratio = row["estimate"] / row["error"] if np.isfinite(row["error"]) else np.nan
                noise = "-" if row["noise"] is None else f"{row['noise']:.2g}"
                print(f"| {kind} | {d} | {H} | {seed} | {row['precision']} | {noise} | {row['queries']} | "
                      f"{row['seconds']:.1f} | {row['error']:.2g} | {ratio:.2g} | "
                      f"{'ok' if row['ok'] else 'FAILED ' + row['failed']} |", flush=True)
    print()
    print("| oracle | d | H | runs | checks ok | rel. error (max) | estimate / error (min..max) | queries | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.oracles:
        for size in args.sizes:
            d, H = (int(part) for part in size.split("x"))
            mine = [row for row in rows if row["kind"] == kind and row["d"] == d and row["H"] == H]
            errors = np.array([row["error"] for row in mine])
            ratios = np.array([row["estimate"] / row["error"] for row in mine if np.isfinite(row["error"])])
            ratio = f"{ratios.min():.2g}..{ratios.max():.2g}" if len(ratios) else "-"
            print(f"| {kind} | {d} | {H} | {len(mine)} | {sum(row['ok'] for row in mine)} | {errors.max():.2g} | "
                  f"{ratio} | {int(np.median([row['queries'] for row in mine]))} | "
                  f"{np.median([row['seconds'] for row in mine]):.1f} |")


if __name__ == "__main__":
    main()
