"""Low-precision oracles (issue 15 item 2, docs/algorithm.md §19): the default extraction against
float32, mixed-precision (float32 softmax in a float64 layer) and bfloat16 targets.

    python benchmarks/bench_low_precision.py [--sizes 8x2 16x4 32x4 64x8] [--seeds 10]
        [--oracles float32 mixed bfloat16]

Per oracle, size and seed: target ``MultiHeadAttention.random(d, H, seed=s)``, run
``extract(oracle, d, heads=H, seed=1000 + s, on_failure="warn")`` (library defaults: schedule
"auto", calibration, no declared answer_error); the error is ``compare(result.model, target).max_rel``
against the float64 truth. One row per run, then a summary per (oracle, size).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["8x2", "16x4", "32x4"])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--oracles", nargs="+", default=list(ORACLES))
    args = parser.parse_args()
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
