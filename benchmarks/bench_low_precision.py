"""Low-precision oracles (issue 15 item 2, docs/algorithm.md, 'Low-precision oracles: float32, mixed precision,
bfloat16'): the default extraction against float32, mixed-precision (float32 softmax in a float64 layer) and bfloat16
targets.

    python benchmarks/bench_low_precision.py [--sizes 8x2 16x4 32x4 64x8] [--seeds 10]
        [--oracles float32 mixed bfloat16]
    python benchmarks/bench_low_precision.py --bfloat16-oversampling [--sizes 4x1 4x2] [--seeds 2]
    python benchmarks/bench_low_precision.py --whole [--sizes 64x4 128x8] [--dtypes bfloat16 float16 float32]
        [--kinds GPT2Attention BertSelfAttention nn.MultiheadAttention ViTAttention] [--seeds 1]
        [--std 0.1 0.2] [--implementation eager] [--no-reference] [--start-only]
    python benchmarks/bench_low_precision.py --estimate [--sizes 16x2 24x3] [--dtypes bfloat16 float16]
        [--kinds GPT2Attention BertSelfAttention nn.MultiheadAttention] [--std 0.1 0.25] [--seeds 2]
        [--implementation eager] [--zoo gpt2-d32-h2/0 gpt2-d32-h2/1]

Per oracle, size and seed: target ``MultiHeadAttention.random(d, H, seed=s)``, run
``extract(oracle, d, heads=H, seed=1000 + s, on_failure="warn")`` (library defaults: schedule
"auto", calibration, no declared answer_error); the error is ``compare(result.model, target).max_rel``
against the float64 truth. One row per run, then a summary per (oracle, size).

``--bfloat16-oversampling``: what least squares over random queries reaches against a bfloat16
oracle (the algebraic schedules fail loudly there: their instances cannot resolve a pole at 8 bits):
the distillation baseline (:func:`mhaextract.baselines.distillation.distill`, Adam + L-BFGS over
8 restarts) on 1x, 4x and 16x the paper's count of random queries, error against the float64
truth. The oracle rounds its own parameters to bfloat16 (2^-9 relative), the floor of any method.

``--estimate``: the low-precision learner's error estimate against the true parameter error, on the
layers of ``--whole`` (and the trained zoo's layers named by ``--zoo``, tests/zoo.py), library
defaults: per run the error ``compare(result.model, to_reduced(exact)).max_rel``, the run's estimate
(:func:`mhaextract.lowprecision.fit.bootstrap_error`: the wild bootstrap and the arithmetic's units)
and beside it the residual
bootstrap with permuted residuals (one refit, three times its move) on the same fit and answers;
then min / median / max of estimate / error for both, and the seconds of each estimate.
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


class NonFiniteCount:
    """An oracle passed through, counting the answers with a non-finite number (overflow)."""

    def __init__(self, oracle):
        self.oracle, self.answer_dtype, self.readout, self.nonfinite = oracle, oracle.answer_dtype, None, 0

    def __call__(self, batch):
        answers = self.oracle(batch)
        self.nonfinite += int((~np.isfinite(np.asarray(answers, dtype=np.float64))).any(axis=1).sum())
        return answers


def layers(kind: str, dtype: str, d: int, H: int, seed: int, std: float | None, implementation: str):
    """``(layer in dtype, its exact float64 copy)``: ``tests/test_real_layers.build`` (biases at the
    weights' std), or with ``std`` every weight and bias N(0, std^2) (``with_std``)."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_real_layers import build, with_std

    low = build(kind, d, H, seed=seed, implementation=implementation).eval()
    low = (low if std is None else with_std(low, std, seed)).to(getattr(torch, dtype))
    exact = build(kind, d, H, seed=seed, implementation=implementation).eval().double()
    exact.load_state_dict({key: value.double() for key, value in low.state_dict().items()})
    return low, exact


def start_row(kind: str, dtype: str, d: int, H: int, seed: int, std: float | None, implementation: str) -> str:
    """The queries that are large by design alone (docs/algorithm.md, 'Whole answers at 8 or 11
    bits: saturated lines, then least squares'): the calibration and the saturated start of the
    library's low-precision run, through one counting boundary, on the layer of :func:`layers`;
    the start model's parameter error against the exact layer (white-box, here only)."""
    from mhaextract.adapters.torch import TorchOracle, to_reduced
    from mhaextract.run.calibration import calibrate
    from mhaextract.lowprecision.start import saturated_start
    from mhaextract.oracle.boundary import OracleBoundary
    from mhaextract.oracle.vector_answers import VectorAnswers
    from mhaextract.run.validation import spawn_rng

    low, exact = layers(kind, dtype, d, H, seed, std, implementation)
    oracle = NonFiniteCount(TorchOracle(low))
    boundary = OracleBoundary(oracle, d, vectors=VectorAnswers(0, oracle.answer_dtype))
    started = time.perf_counter()
    calibration = calibrate(boundary, d, spawn_rng(0, 3))
    start = saturated_start(boundary, spawn_rng(0, 31), d, H)
    seconds = time.perf_counter() - started
    error = mx.compare(start.model, to_reduced(exact)).max_rel
    overflow = "-" if calibration.overflow_scale is None else f"{calibration.overflow_scale:.3g}"
    return (f"| {kind} | {dtype} | {d} | {H} | {std} | {oracle.nonfinite} | {overflow} | {start.scale:.3g} | "
            f"{boundary.queries:,} | {error:.2g} | {seconds:.0f} |")


def whole_row(kind: str, dtype: str, d: int, H: int, seed: int, std: float | None = None,
              implementation: str = "sdpa", reference: bool = True) -> str:
    """A torch layer in ``dtype`` (biases at its weights' std, ``tests/test_real_layers.build``; with
    ``std``, every weight and bias drawn N(0, std^2) instead, as trained layers' larger weights), whole
    outputs, library defaults (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least squares').
    Truth: the same layer in float64 from its own rounded weights (``to_reduced``, white-box, here only). Output errors
    at every position of 200 fresh sequences of 1..32 tokens (unit-variance tokens) relative to the exact layer's
    largest output; the float64 run is the default extraction of that exact layer (``reference``)."""
    import sys
    from pathlib import Path

    import torch

    from mhaextract.adapters.torch import TorchOracle, to_reduced, to_torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from bench_full_layer import outputs

    low, exact = layers(kind, dtype, d, H, seed, std, implementation)
    oracle = NonFiniteCount(TorchOracle(low))
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(oracle, d, heads=H, seed=0, on_failure="warn", progress=False)
        seconds = time.perf_counter() - started
        # the float64 run for the query ratio, where there is a model to compare
        reference = mx.extract(TorchOracle(exact), d, heads=H, seed=0, on_failure="warn", progress=False) \
            if result.model is not None and reference else None
    truth = to_reduced(exact)
    error = mx.compare(result.model, truth).max_rel if result.model is not None else np.inf
    rng = np.random.default_rng(11)
    own = mine = top = 0.0
    # causal as the exact layer is (a bare GPT2Attention is causal on the sdpa path, not on eager)
    probe = torch.as_tensor(np.random.default_rng(0).standard_normal((1, 3, d)))
    with torch.no_grad():
        causal = bool(torch.allclose(outputs(exact, probe)[:, :1], outputs(exact, probe[:, :1]), rtol=0, atol=1e-12))
    replacement = to_torch(result.model, causal=causal) if result.model is not None else None
    for n in rng.integers(1, 33, size=200):
        X = torch.as_tensor(rng.standard_normal((1, int(n), d)))
        with torch.no_grad():
            expected = outputs(exact, X)
            top = max(top, float(expected.abs().max()))
            own = max(own, float((outputs(low, X.to(low_dtype(low))).double() - expected).abs().max()))
            if replacement is not None:
                mine = max(mine, float((outputs(replacement, X) - expected).abs().max()))
    mine = mine / top if replacement is not None else np.inf
    checks = "ok" if result.ok else "FAILED: " + ", ".join(check.name for check in result.failed_checks)
    for check in result.failed_checks:  # the reasons, beside the table
        print(f"{kind} {dtype} d = {d}, H = {H}: {check}", file=sys.stderr)
    ratio = f"{result.queries / reference.queries:.2f}" if reference is not None else "-"
    weights = "" if std is None else f"{std:g} | {oracle.nonfinite} | "
    return (f"| {kind} | {dtype} | {d} | {H} | {weights}{result.queries:,} | {ratio} | "
            f"{error:.2g} | {mine:.2g} | {own / top:.2g} | {result.error_estimate / error:.2g} | {seconds:.0f} | "
            f"{checks} |")


def permuted_residual_estimate(fit, design, rng) -> float:
    """The residual bootstrap the wild one replaced, for the comparison: three times the move of one
    refit (100 iterations) on the fitted answers plus the residuals of a random permutation of the
    queries."""
    from mhaextract.lowprecision.fit import fit_whole, predictions

    fitted = predictions(fit.model, design)
    residuals = design.answers - fitted
    refit = fit_whole(fit.model, design.with_answers(fitted + residuals[rng.permutation(len(residuals))]), 100)
    return 3.0 * float(mx.compare(refit.model, fit.model).max_rel)


def estimate_row(name: str, dtype: str, d: int, H: int, low, exact) -> dict:
    """One default run of the low-precision learner on ``low``; its estimate (timed inside the run)
    and the permuted-residual one (on the fit and answers the run's estimate saw) against the
    parameter error from ``exact``'s weights (white-box, here only)."""
    from mhaextract.adapters.torch import TorchOracle, to_reduced
    from mhaextract.lowprecision import learn
    from mhaextract.run.validation import spawn_rng

    seen = {}
    library = learn.bootstrap_error

    def recording(fit, design, seed, unit):
        started = time.perf_counter()
        estimate = library(fit, design, seed, unit)
        seen.update(fit=fit, design=design, seconds=time.perf_counter() - started)
        return estimate

    learn.bootstrap_error = recording
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = mx.extract(TorchOracle(low), d, heads=H, seed=0, on_failure="warn", progress=False)
    finally:
        learn.bootstrap_error = library
    error = float(mx.compare(result.model, to_reduced(exact)).max_rel) if result.model is not None else np.inf
    row = {"layer": name, "dtype": dtype, "d": d, "H": H, "error": error, "ok": result.ok,
           "after": result.error_estimate / error, "after_seconds": seen.get("seconds", np.nan)}
    if "fit" in seen:
        started = time.perf_counter()  # the run's estimate stream (seed 0), as that estimate used it
        before = permuted_residual_estimate(seen["fit"], seen["design"], spawn_rng(0, 33))
        row.update(before=before / error, before_seconds=time.perf_counter() - started)
    return row


def layer_grid(args):
    """(kind, dtype, d, H, seed, std) for every ``--sizes`` x ``--kinds`` x ``--dtypes`` x ``--std`` x
    ``--seeds`` case; a layer's seed is d + H + its index."""
    for size in args.sizes:
        d, H = (int(part) for part in size.split("x"))
        for kind in args.kinds:
            for dtype in args.dtypes:
                for std in args.std:
                    for seed in range(args.seeds):
                        yield kind, dtype, d, H, d + H + seed, std


def estimate_table(args) -> None:
    print("| layer | dtype | d | H | parameter error | estimate / error, permuted residuals | estimate / error, "
          "wild + units | seconds (permuted) | seconds (wild) | checks |")
    print("|---" * 10 + "|")
    cases = [(f"{kind} (std {std}, seed {seed})", dtype, d, H,
              lambda kind=kind, dtype=dtype, d=d, H=H, seed=seed, std=std:
              layers(kind, dtype, d, H, seed, std, args.implementation))
             for kind, dtype, d, H, seed, std in layer_grid(args)]
    for layer_id in args.zoo:
        import sys
        from pathlib import Path

        import torch
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import zoo
        for dtype in args.dtypes:
            d, H = zoo.shape(layer_id)
            cases.append((f"zoo {layer_id}", dtype, d, H, lambda layer_id=layer_id, dtype=dtype: (
                zoo.layer_as_run(layer_id, getattr(torch, dtype)), zoo.exact_layer(layer_id, getattr(torch, dtype)))))
    rows = []
    for name, dtype, d, H, make in cases:
        row = estimate_row(name, dtype, d, H, *make())
        rows.append(row)
        print(f"| {name} | {dtype} | {d} | {H} | {row['error']:.2g} | {row.get('before', np.nan):.2g} | "
              f"{row['after']:.2g} | {row.get('before_seconds', np.nan):.1f} | {row['after_seconds']:.1f} | "
              f"{'ok' if row['ok'] else 'FAILED'} |", flush=True)
    print()
    print("| runs | estimate / error, permuted residuals (min / median / max) | estimate / error, wild + units "
          "(min / median / max) | runs under the error (permuted / wild) | seconds per estimate (permuted / wild, median) |")
    print("|---|---|---|---|---|")
    before = np.array([row.get("before", np.nan) for row in rows])
    after = np.array([row["after"] for row in rows])

    def spread(ratios):
        return f"{np.nanmin(ratios):.2g} / {np.nanmedian(ratios):.2g} / {np.nanmax(ratios):.2g}"
    print(f"| {len(rows)} | {spread(before)} | {spread(after)} | {int(np.sum(before < 1))} / {int(np.sum(after < 1))} | "
          f"{np.nanmedian([row.get('before_seconds', np.nan) for row in rows]):.1f} / "
          f"{np.nanmedian([row['after_seconds'] for row in rows]):.1f} |")


def low_dtype(module):
    return next(module.parameters()).dtype


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["8x2", "16x4", "32x4"])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--oracles", nargs="+", default=list(ORACLES))
    parser.add_argument("--bfloat16-oversampling", action="store_true")
    parser.add_argument("--whole", action="store_true", help="torch layers in bfloat16/float16/float32, whole outputs")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--kinds", nargs="+", default=["GPT2Attention", "BertSelfAttention"])
    parser.add_argument("--std", nargs="+", type=float, default=[None],
                        help="--whole: every weight and bias N(0, std^2) (one row per std)")
    parser.add_argument("--implementation", default="sdpa", help="--whole: the layers' attention implementation")
    parser.add_argument("--no-reference", action="store_true", help="--whole: skip the float64 run (query ratio)")
    parser.add_argument("--start-only", action="store_true",
                        help="--whole: the calibration and the saturated start alone (the queries large by design)")
    parser.add_argument("--estimate", action="store_true",
                        help="the low-precision learner's error estimate against the true error (wild and permuted)")
    parser.add_argument("--zoo", nargs="*", default=[], help="--estimate: trained zoo layers too (tests/zoo.py ids)")
    args = parser.parse_args()
    if args.estimate:
        estimate_table(args)
        return
    if args.whole:
        weights = "" if args.std == [None] else " weight std | answers not finite |"
        if args.start_only:
            print("| layer | dtype | d | H | weight std | answers not finite | calibration overflow scale | start "
                  "token scale | queries | start parameter error | seconds |")
            print("|---" * 11 + "|")
        else:
            print(f"| layer | dtype | d | H |{weights} queries | / float64 run | parameter error | output error | the "
                  "layer's own output error | estimate / error | seconds | checks |")
            print("|---" * (12 + 2 * bool(weights)) + "|")
        for kind, dtype, d, H, seed, std in layer_grid(args):
            print(start_row(kind, dtype, d, H, seed, std, args.implementation) if args.start_only else
                  whole_row(kind, dtype, d, H, seed, std, args.implementation, not args.no_reference), flush=True)
        return
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
