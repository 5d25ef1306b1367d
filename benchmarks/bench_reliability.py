"""Reliability table (issue 12): runs, false alarms, silent failures, crashes per mode and case.

    PYTHONPATH=src python benchmarks/bench_reliability.py [--runs N] [--out docs/reliability.md]

Every run is judged against an independent reference (the target, mhaextract.compare) at the
user's side, counts as measured at the oracle boundary:

* correct : ok, the heads agree and the true error <= 100 x the error estimate (the ratio
  truth / estimate of every passing run is kept: the table gives how many exceed 30 and the worst);
* loud failure : a random target, not ok, and the model that came back is wrong by more than the
  run's own error limit (the threshold of its ``error_estimate`` check), or no model came back: an
  honest failure of the mode on that target;
* false alarm : a random target, not ok although the model is within that limit (a run that
  returns no model at all is a loud failure: it says it failed, and there is no result that the
  alarm could be wrong about);
* silent failure : ok but the heads disagree or the true error > 100 x the estimate;
* clean error : ExtractionError / OracleError / TranscriptError / ValueError, or a failed run, on
  a misbehaving oracle or an unresolvable structured target (the expected outcome);
* crash : any other exception.
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

import mpmath
import numpy as np

import mhaextract as mx
from mhaextract.checks.base import ExtractionError
from mhaextract.oracle.boundary import OracleError
from mhaextract.oracle.transcript import TranscriptError

MODES = {"auto (default)": dict(), "paper": dict(schedule="paper"), "lean": dict(schedule="lean"), "targeted": dict(schedule="targeted"),
         "paper 256 bits": dict(schedule="paper", precision=256), "auto 256 bits": dict(precision=256)}


#: Random targets have H <= min(d, MOST_HEADS[mode]): float64 rational interpolation of 2H + 1
#: samples (paper, lean) loses about 3 digits per head, and at H = 4 (d = 4..6) 6 of 10 exact runs
#: fail their checks with errors 1e-4..1 (loud failures, bench --modes paper --most-heads 4).
MOST_HEADS = {"paper": 3, "lean": 3}


def near_equal(d, H, separation, seed, precision=None):
    rng = np.random.default_rng(seed)
    base = mx.MultiHeadAttention.random(d, H - 1, seed=seed)
    E, v_last = rng.standard_normal((d, d)), rng.standard_normal(d) / np.sqrt(d)
    if precision is None:
        return mx.MultiHeadAttention(np.concatenate([base.W, (base.W[0] + separation * E)[None]]),
                                     np.concatenate([base.v, v_last[None]]))
    with mpmath.workprec(4 * precision):
        W = np.empty((H, d, d), dtype=object)
        W[:H - 1] = np.vectorize(mpmath.mpf, otypes=[object])(base.W)
        W[H - 1] = np.array([[mpmath.mpf(base.W[0, a, b]) + mpmath.mpf(separation) * mpmath.mpf(E[a, b])
                              for b in range(d)] for a in range(d)], dtype=object)
    return mx.MultiHeadAttention(W, np.concatenate([base.v, v_last[None]]))


def structured(seed, precision):
    """(name, target) structured cases."""
    rng = np.random.default_rng(seed)
    d, H = 3, 2
    base = mx.MultiHeadAttention.random(d, H, seed=seed)
    seps = [1e-20, 1e-40, 1e-60] if precision else [1e-3, 1e-6, 1e-9, 1e-12]
    cases = [(f"near-equal W {s:g}", near_equal(d, 3, s, seed, precision)) for s in seps]
    u, w = rng.standard_normal(d), rng.standard_normal(d)
    rank1 = base.W.copy()
    rank1[0] = np.outer(u, w) / d
    parallel = base.v.copy()
    parallel[1] = 2.0 * parallel[0]
    tiny = base.v.copy()
    tiny[1] *= 1e-6
    cases += [("rank-1 W", mx.MultiHeadAttention(rank1, base.v)), ("tiny v", mx.MultiHeadAttention(base.W, tiny)),
              ("parallel v", mx.MultiHeadAttention(base.W, parallel)),
              ("||W|| x100", mx.MultiHeadAttention(base.W * 100, base.v)),
              ("||W|| x0.01", mx.MultiHeadAttention(base.W * 0.01, base.v))]
    return cases


def misbehaving(seed):
    """(name, oracle factory taking the target) for float64 oracles that misbehave."""
    rng = np.random.default_rng(seed)
    return [
        ("wrong count", lambda t: (lambda b: t(b)[:-1])),
        ("wrong type (str)", lambda t: (lambda b: ["x"] * len(b))),
        ("NaN", lambda t: (lambda b: np.where(rng.random(len(b)) < 0.1, np.nan, t(b)))),
        ("noise 1e-9 undeclared", lambda t: mx.AdditiveNoise(mx.SimulatedOracle(t), 1e-9, seed=seed)),
        ("noise 1e-6 undeclared", lambda t: mx.AdditiveNoise(mx.SimulatedOracle(t), 1e-6, seed=seed)),
        ("non-deterministic 1e-12", lambda t: (lambda b: t(b) * (1 + 1e-12 * rng.standard_normal(len(b))))),
        ("constant zero", lambda t: (lambda b: [0.0] * len(b))),
        ("integers", lambda t: (lambda b: [int(round(10 * y)) for y in t(b)])),
        ("booleans", lambda t: (lambda b: [bool(y > 0) for y in t(b)])),
    ]


def error_limit(result) -> float:
    """The relative error the run's own ``error_estimate`` check accepts (its threshold)."""
    return next((check.threshold for check in result.checks if check.name == "error_estimate"), 0.0)


def explain(result, error):
    """One line per failed check of ``result`` (name, value, threshold) with the true error and the estimate."""
    if result is None:
        return "    no result (raised)"
    estimate = float(result.error_estimate) if result.error_estimate is not None else float("nan")
    lines = [f"    truth {error:.3g}, estimate {estimate:.3g}, limit {error_limit(result):.3g}"]
    lines += [f"    {check.name}: {check.value:.3g} vs {check.threshold:.3g} ({check.message})"
              for check in result.failed_checks]
    return "\n".join(lines)


def judge(run, target, expect_success, explained=None):
    """``(outcome, truth / estimate)``: outcome one of correct / loud failure / false alarm /
    silent failure / clean error / crash; the ratio of the true error to the error estimate for
    runs that passed (None otherwise). ``explained``, a list, gets :func:`explain`'s lines of a
    run that was not correct."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run()
    except (ExtractionError, OracleError, TranscriptError, ValueError) as error:
        if explained is not None:
            explained.append(f"    raised {type(error).__name__}: {str(error).splitlines()[0]}")
        return ("false alarm" if expect_success else "clean error"), None
    except Exception as error:  # noqa: BLE001 - a crash is what is counted
        return f"crash ({type(error).__name__})", None
    if target is None:
        return ("silent failure" if result.ok else "clean error"), None
    got = result.model_hp if result.precision else result.model
    if got is None:
        if explained is not None:
            explained.append(explain(result, float("nan")) + "\n    no model")
        return ("loud failure" if expect_success else "clean error"), None
    comparison = mx.compare(got, target.canonical())
    error = float(comparison.max_rel)
    if explained is not None and not result.ok:
        explained.append(explain(result, error) + ("" if comparison.heads_agree else "\n    heads disagree"))
    if not result.ok:
        # Failing is right when the model is wrong by more than the run accepts; a model within the
        # run's own limit flagged as failed is a false alarm.
        if expect_success and comparison.heads_agree and error <= error_limit(result):
            return "false alarm", None
        return ("loud failure" if expect_success else "clean error"), None
    ratio = error / max(float(result.error_estimate), 1e-300)
    if explained is not None and ratio > 30:
        explained.append(f"    passed with truth {error:.3g} = {ratio:.3g} x its estimate "
                         f"{float(result.error_estimate):.3g}")
    if comparison.heads_agree and ratio <= 100:
        return "correct", ratio
    return "silent failure", ratio


def random_cases(mode, options, runs):
    """Random targets d = 2..6, H = 1..min(d, MOST_HEADS) (biased for the default mode, which learns biases),
    answered exactly, with undeclared Gaussian noise 1e-10, and with declared uniform noise 1e-8."""
    precision = options.get("precision")
    bias = options.get("schedule", "auto") == "auto"  # the default learns biases (the biased grid at 256 bits)
    most = MOST_HEADS.get(mode, 4)
    for seed in range(runs):
        d = 2 + seed % 5
        H = 1 + (seed // 5) % min(d, most)
        target = mx.MultiHeadAttention.random(d, H, seed=1000 + seed, bias=bias)
        conditions = [("exact", lambda t: mx.SimulatedOracle(t, precision), {})]
        if precision is None:
            conditions += [
                ("gaussian 1e-10 undeclared", lambda t, s=seed: mx.GaussianNoise(mx.SimulatedOracle(t), 1e-10, seed=s),
                 {}),
                ("uniform 1e-8 declared", lambda t, s=seed: mx.AdditiveNoise(mx.SimulatedOracle(t), 1e-8, seed=s),
                 dict(answer_error=1e-8)),
            ]
        for condition, factory, extra in conditions:
            case = f"random, {condition} (d={d} H={H} seed={seed})"
            yield mode, case, lambda t=target, d=d, H=H, s=seed, f=factory, e=extra: mx.extract(
                f(t), d, heads=H, seed=s, on_failure="warn", **options, **e), target, True


def cases(runs):
    for mode, options in MODES.items():
        precision = options.get("precision")
        yield from random_cases(mode, options, runs)
        for name, target in structured(7, precision):
            yield mode, name, lambda t=target: mx.extract(
                mx.SimulatedOracle(t, precision), t.d, heads=t.heads, seed=0, **options), target, False
        if precision is None:
            target = mx.MultiHeadAttention.random(3, 2, seed=11)
            for name, factory in misbehaving(3):
                keeps = name.startswith(("noise", "non-det"))
                yield mode, "oracle: " + name, lambda f=factory: mx.extract(
                    f(target), 3, heads=2, seed=0, **options), target if keeps else None, False


def group_of(case: str) -> str:
    if case.startswith("random"):
        return case.split(" (")[0]
    return "oracles" if case.startswith("oracle") else "structured"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="random targets per mode (each under 3 answer conditions)")
    parser.add_argument("--modes", help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--most-heads", type=int, help="H <= min(d, this) for every mode's random targets")
    parser.add_argument("--out", help="write the page here (default: docs/reliability.md for a run of every mode, "
                                      "case and condition; a filtered run only prints unless --out is given)")
    parser.add_argument("--explain", action="store_true",
                        help="print the failed checks (value vs threshold), true error and estimate of every "
                             "false alarm and loud failure")
    parser.add_argument("--seeds", help="comma-separated seeds of the random targets to run (of range(runs)); "
                                        "only random targets")
    parser.add_argument("--conditions", help="comma-separated subset of exact,gaussian,uniform")
    args = parser.parse_args()
    if args.modes:
        for mode in set(MODES) - set(args.modes.split(",")):
            del MODES[mode]
    if args.most_heads:
        MOST_HEADS.update({mode: args.most_heads for mode in MODES})
    table = collections.defaultdict(collections.Counter)
    ratios = collections.defaultdict(list)
    started = time.time()
    seeds = None if args.seeds is None else {int(seed) for seed in args.seeds.split(",")}
    conditions = None if args.conditions is None else args.conditions.split(",")
    for mode, case, run, target, expect in cases(args.runs):
        if seeds is not None and not (case.startswith("random") and int(case.split("seed=")[1][:-1]) in seeds):
            continue
        if conditions is not None and not (case.startswith("random") and case.split()[1] in conditions):
            continue
        explained = [] if args.explain else None
        outcome, ratio = judge(run, target, expect, explained)
        key = (mode, group_of(case))
        table[key][outcome.split(" (")[0]] += 1
        if ratio is not None:
            ratios[key].append(ratio)
        if outcome.startswith(("silent", "crash", "false alarm", "loud")) or explained:
            print(f"{mode:15s} {case:58s} {outcome}", flush=True)
            if explained:
                print("\n".join(explained), flush=True)
    lines = ["| mode | targets | runs | correct | loud failures | clean errors | false alarms | silent failures "
             "| crashes | truth > 30 x estimate | worst truth / estimate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, group), counts in table.items():
        measured = np.array(ratios[(mode, group)])
        over = f"{int((measured > 30).sum())}/{measured.size}" if measured.size else "-"
        worst = f"{measured.max():.2g}" if measured.size else "-"
        lines.append(f"| {mode} | {group} | {sum(counts.values())} | {counts['correct']} | {counts['loud failure']} | "
                     f"{counts['clean error']} | {counts['false alarm']} | {counts['silent failure']} | "
                     f"{counts['crash']} | {over} | {worst} |")
    text = "\n".join(lines)
    print(text)
    print(f"({time.time() - started:.0f} s)")
    out = args.out
    if out is None and not (args.modes or args.seeds or args.conditions or args.most_heads):
        out = "docs/reliability.md"  # only the whole table replaces the page
    if out is not None:
        with open(out, "w") as handle:
            handle.write(HEADER.format(runs=args.runs) + text + "\n" + FOOTER)


HEADER = """# Reliability (issue 12)

Made by one command: `PYTHONPATH=src python benchmarks/bench_reliability.py --runs {runs}`
(see the script's docstring for how each run is judged against an independent reference).

Random targets: d = 2..6, H = 1..min(d, 4) (paper and lean in float64: H <= 3, their float64
envelope), `heads=H` declared, each answered exactly, with undeclared Gaussian noise 1e-10 and
with declared uniform noise 1e-8 (`answer_error=1e-8`); the default mode ("auto") gets targets
with biases (u, c), which it learns. Structured targets (d = 3): two heads with W apart by
1e-3..1e-12 (float64) or 1e-20..1e-60 (256 bits) with `heads=3` declared, rank-1 W, tiny v,
parallel v, ||W|| x100 and x0.01: a clean error is the expected outcome where the target is not
resolvable. Misbehaving oracles (float64): wrong count, strings, NaN, undeclared noise 1e-9 and
1e-6, non-deterministic 1e-12, constant zero, integers, booleans. The last two columns are over
the runs that passed: how many had a true error above 30 times their error estimate, and the
worst ratio of true error to estimate.

"""

FOOTER = """
What is measured where: answer noise that nobody declared is measured by 12 fresh probe queries
(lean, targeted, auto; `mhaextract.checks.noise_probe`) and by the calibration's permutation probes
(docs/algorithm.md §19), or by the links' redundancy (paper, which keeps its exact count); a
resumed transcript re-asks 3 recorded queries (`mhaextract.oracle.resume_check`); at 256 bits
certified balls must reproduce the answers (`mhaextract.numerics.enclosure`).

Reading it: no silent failure and no crash in any mode. The default (auto) and targeted modes pass
every random target, exact and under each noise; no passing run's error exceeded 13 times its
estimate (auto: 1.3). Paper and lean in float64 are the paper's algebra with `2H + 1` samples per
instance: exact, they fail on 3..5 of 100 targets (H = 3); under noise 1e-10..1e-8 on 34..62 of
100 (loud failures, errors 1e-4..1, and false alarms). Use the default, or `refine=True`,
with noisy answers.

**False alarms by cause** (`--explain` prints every false alarm's failed checks with value and
threshold, its true error and estimate; `--modes`, `--seeds`, `--conditions` select runs).
Issue 12 removed three causes (before: paper 3 / 22 / 27, lean 2 / 35 / 22 of 100 exact / Gaussian
/ uniform): checks judged at rounding level against noisy answers (lean's `labels_consistent`,
`answers_residual` fixed at 1e-6: docs/algorithm.md §11), the links' noise estimate (a standard
deviation) propagated as a bound through G's l1 norms, and one outvoted ill-conditioned link voiding
the paper certificate's validity (both §12). What remains:

* auto and targeted: none since the calibration tells random output noise from the oracle's
  rounding (docs/algorithm.md §19). Seed 57 (d = H = 4) was one of each under both noises: the
  calibration's answer noise sized the score-rounding term `u |z| |W x|`, which grows with the
  large saturating tokens, as if the oracle rounded its scores at the noise (Gaussian 1e-10: auto
  1.85e-6 and targeted 1.35e-6 against true 7.8e-10 and 1.6e-10). Its 2 repeated probes now show
  the noise random, the scores float64's. Three things this uncovered, fixed with it: the fits'
  residuals scaled the anchor's rounding, common to an instance's samples (the estimate then 8 x
  below the truth under declared 1e-8); the output constant `c = f((0))` carries its answer's
  error, 600 x the rest's estimate relative to a small c (seed 21); and the saturation margin and
  the bridges' agreement were judged at float64 rounding (auto failed `saturation` on 13 bridges
  whose disagreement was the model's own first-order error, targeted on one final instance at
  margin 34.2 where 19.3 suffices at the answers' unit).
* paper, exact, 3 (H = 3): `error_estimate` 2.6e-4 on a true 4.1e-5, `matching`, `pole_count`: the
  float64 algebra at H = 3 (§11).
* paper, Gaussian 1e-10, 12: 8 `error_estimate` alone, 1.1e-4..8.8e-4 (3 sigma through the l2 norms,
  factor 2 for second order) on true errors 4.7e-6..5.3e-5; 2 `noise_within_validity` (seed 53:
  an ill-conditioned grid instance, whose pairing names later instances' heads, so it is not
  exempt; seed 67 also fails `matching`); 2 no model (H = 3).
* paper, uniform 1e-8 declared, 27: 11 no model (H = 3: the fits detect other pole counts and
  complex poles in 13..32% of the instances, seeds 13 and 27; the algebra fails); 13 `error_estimate` alone: a
  declared `answer_error` is a bound and `error_bound` the worst case over the box, 1.2e-4..1.5e-3,
  on true errors 6e-6..9.6e-5 (6 within 2x of the limit): the model is inside the limit because the
  errors were random, which the run cannot promise; 3 `noise_within_validity`.
* lean, exact, 2 (d = 6, H = 3): `answers_residual` 1.1e-6, 1.2e-6 against 1e-6 where the estimate (6.7e-7,
  1.1e-7) understates the truth (2.7e-6, 2.4e-6): the residual catches the understatement.
* lean, Gaussian 1e-10, 11: 5 `error_estimate` alone (1.0e-4..2.3e-3 on true 4.6e-6..7.8e-5), 2
  `answers_residual` above an estimate 2.5..5x below the truth, 1 `matching`, 3 no model (H = 3).
* lean, uniform 1e-8 declared, 21: 14 no model (13 at H = 3), 7 `error_estimate` alone (1.7e-4..1.1e-2,
  the rounding-level estimate scaled to the declared error against the median answer, on true
  5.9e-6..8.1e-5).

A declared bound is compared with the median answer, not the largest, when it scales a
certificate-less estimate (docs/algorithm.md §11): the estimate assumed errors relative to each
answer, and an absolute bound is a larger relative error on the smaller ones. Against the largest,
one passing lean run (seed 78, d = 5, H = 1, answers 0.064..4.9) had a true error 32 times its
estimate (3.0e-5 against 9.5e-7); now no passing run is 30 times above its estimate (worst 10), at
the price of two more lean false alarms (19 -> 21).
"""


if __name__ == "__main__":
    main()
