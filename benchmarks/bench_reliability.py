"""Reliability table (issue 12): runs, false alarms, silent failures, crashes per mode and case.

    PYTHONPATH=src python benchmarks/bench_reliability.py [--runs N] [--out docs/reliability.md]

Every run is judged against an independent reference (the target, mhaextract.compare) at the
user's side, counts as measured at the oracle boundary:

* correct : ok and the heads agree and the true error <= 100 x the error estimate;
* false alarm : not ok (or an ExtractionError) although a correct model came back or the target
  is a plain random one in a mode that promises it (random targets only);
* silent failure : ok but the heads disagree or the true error > 100 x the estimate;
* clean error : ExtractionError / OracleError / TranscriptError / ValueError (expected for
  misbehaving oracles and unresolvable targets);
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

MODES = {"paper": dict(schedule="paper"), "lean": dict(schedule="lean"), "targeted": dict(schedule="targeted"),
         "paper 256 bits": dict(schedule="paper", precision=256)}


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


def judge(run, target, expect_success):
    """One of correct / false alarm / silent failure / clean error / crash."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run()
    except (ExtractionError, OracleError, TranscriptError, ValueError):
        return "false alarm" if expect_success else "clean error"
    except Exception as error:  # noqa: BLE001 - a crash is what is counted
        return f"crash ({type(error).__name__})"
    if target is None:
        return "silent failure"
    comparison = mx.compare(result.model_hp if result.precision else result.model, target.canonical())
    error = float(comparison.max_rel)
    if comparison.heads_agree and error <= 100 * max(result.error_estimate, 1e-300):
        return "correct"
    return "silent failure"


def cases(runs):
    for mode, options in MODES.items():
        precision = options.get("precision")
        for seed in range(runs):
            d, H = 2 + seed % 3, 1 + seed % 2
            target = mx.MultiHeadAttention.random(d, H, seed=1000 + seed)
            yield mode, "random", lambda t=target, d=d, H=H, s=seed: mx.extract(
                mx.SimulatedOracle(t, precision), d, heads=H, seed=s, **options), target, True
        for name, target in structured(7, precision):
            yield mode, name, lambda t=target: mx.extract(
                mx.SimulatedOracle(t, precision), t.d, heads=t.heads, seed=0, **options), target, False
        if precision is None:
            target = mx.MultiHeadAttention.random(3, 2, seed=11)
            for name, factory in misbehaving(3):
                keeps = name.startswith(("noise", "non-det"))
                yield mode, "oracle: " + name, lambda f=factory: mx.extract(
                    f(target), 3, heads=2, seed=0, **options), target if keeps else None, False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="random targets per mode")
    parser.add_argument("--out", default="docs/reliability.md")
    args = parser.parse_args()
    table = collections.defaultdict(collections.Counter)
    started = time.time()
    for mode, case, run, target, expect in cases(args.runs):
        outcome = judge(run, target, expect)
        table[(mode, "random" if case == "random" else ("oracles" if case.startswith("oracle") else "structured"))][
            outcome.split(" (")[0]] += 1
        if outcome.startswith(("silent", "crash")) or (outcome == "false alarm"):
            print(f"{mode:15s} {case:28s} {outcome}", flush=True)
    lines = ["| mode | targets | runs | correct | clean errors | false alarms | silent failures | crashes |",
             "|---|---|---|---|---|---|---|---|"]
    for (mode, group), counts in table.items():
        lines.append(f"| {mode} | {group} | {sum(counts.values())} | {counts['correct']} | {counts['clean error']} | "
                     f"{counts['false alarm']} | {counts['silent failure']} | {counts['crash']} |")
    text = "\n".join(lines)
    print(text)
    print(f"({time.time() - started:.0f} s)")
    with open(args.out, "w") as handle:
        handle.write(HEADER.format(runs=args.runs) + text + "\n" + FOOTER)


HEADER = """# Reliability (issue 12)

Made by one command: `PYTHONPATH=src python benchmarks/bench_reliability.py --runs {runs}`
(see the script's docstring for how each run is judged against an independent reference).

Random targets: d = 2..4, H = 1..2, `heads=H` declared, a false alarm is any failure.
Structured targets (d = 3): two heads with W apart by 1e-3..1e-12 (float64) or 1e-20..1e-60
(256 bits) with `heads=3` declared, rank-1 W, tiny v, parallel v, ||W|| x100 and x0.01: a clean
error is the expected outcome where the target is not resolvable.
Misbehaving oracles (float64): wrong count, strings, NaN, undeclared noise 1e-9 and 1e-6,
non-deterministic 1e-12, constant zero, integers, booleans.

"""

FOOTER = """
What is measured where: answer noise that nobody declared is measured by 12 fresh probe queries
(lean, targeted; `mhaextract.checks.noise_probe`) or by the links' redundancy (paper, which keeps
its exact count); a resumed transcript re-asks 3 recorded queries (`mhaextract.oracle.resume_check`);
at 256 bits certified balls must reproduce the answers (`mhaextract.numerics.enclosure`).

**Not covered by this table (known gaps).** The random targets are small (d <= 4, H <= 2). At
d = 3..5, H = 1..3 (30 exact-oracle runs each, seeds 100..129) paper failed 2 runs (`matching`)
and lean 3 runs: false alarms above 1% that this table does not show. Not measured here: H = 8 at
256 bits (certification, issue 12), float32-internal layers, `refine=True` on torch layers, d >= 32.
"""

if __name__ == "__main__":
    main()
