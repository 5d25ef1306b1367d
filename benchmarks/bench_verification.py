"""What the default verification costs (docs/algorithm.md, 'Verification').

Default runs (``extract(oracle, d, heads=H, seed=...)``: schedule ``auto``, biases, calibrated
token scale) on random biased targets through a simulated float64 oracle. Measured at the oracle:
every query and token it was handed, and the seconds it spent, split into the verification's
call (the one that holds its 256-token query) and the rest.

    python benchmarks/bench_verification.py --sizes 4x2 8x2 32x2 32x4 64x2 64x4
    python benchmarks/bench_verification.py --oracle torch

``--margins N``: N correct runs per kind of oracle (d 2..8, H 1..3, biased or not), and how close
each came to its limit: the largest misfit on the fresh queries (relative to the largest answer)
over what the run claims (``max(error estimate, residual, noise / largest answer)``), over the
runs that pass every other check, and the long_verification false alarms among them.

    python benchmarks/bench_verification.py --margins 16
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx


class TimedOracle:
    """A simulated float64 oracle that counts queries and tokens and times every call, split into
    calls holding a query of ``marker`` tokens (the verification's) and the others."""

    def __init__(self, target, marker: int):
        self.target, self.marker = target, marker
        self.answer_dtype = getattr(target, "answer_dtype", "float64")
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


def margins(runs: int) -> None:
    """The long_verification margins of correct runs (module docstring)."""
    from mhaextract.checks import verify as verification
    from mhaextract.oracle.noise import AdditiveNoise, Float32Oracle, GaussianNoise, MixedPrecisionOracle

    judged = {}
    judge = verification.LongVerification.judge

    def recording(self, model, estimate, residual, noise, scale, unit, *rest):
        check, result = judge(self, model, estimate, residual, noise, scale, unit, *rest)
        judged.update(claimed=max(estimate, residual, noise / scale), misfit=check.value, limit=check.threshold)
        return check, result

    verification.LongVerification.judge = recording
    kinds = {
        "exact": lambda m, seed: (m, {}),
        "gaussian 1e-10": lambda m, seed: (GaussianNoise(m, 1e-10, seed=seed), {}),
        "declared uniform 1e-8": lambda m, seed: (AdditiveNoise(m, 1e-8, seed=seed), dict(answer_error=1e-8)),
        "float32": lambda m, seed: (Float32Oracle(m), {}),
        "float32 softmax": lambda m, seed: (MixedPrecisionOracle(m), {}),
        "high precision 128": lambda m, seed: (lambda batch: m(batch, precision=128), dict(precision=128)),
        "lean, gaussian 1e-10": lambda m, seed: (GaussianNoise(m, 1e-10, seed=seed), dict(schedule="lean")),
    }
    print("| oracle | runs passing the other checks | false alarms | largest misfit / claimed | "
          "largest misfit / limit |")
    print("|---|---|---|---|---|")
    for name, make in kinds.items():
        ratios, fractions, alarms = [], [], 0
        for seed in range(runs):
            rng = np.random.default_rng(seed)
            d, H = int(rng.integers(2, 9)), int(rng.integers(1, 4))
            target = mx.MultiHeadAttention.random(d, H, seed=seed, bias=bool(seed % 2))
            oracle, options = make(target, seed)
            judged.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = mx.extract(oracle, d, heads=H, seed=seed, on_failure="warn", **options)
            if not judged or any(check.name != "long_verification" for check in result.failed_checks):
                continue
            alarms += not result.ok
            ratios.append(judged["misfit"] / max(judged["claimed"], 1e-300))
            fractions.append(judged["misfit"] / judged["limit"])
        print(f"| {name} | {len(ratios)} | {alarms} | {max(ratios, default=np.nan):.2g} | "
              f"{max(fractions, default=np.nan):.2g} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["4x2", "8x2", "32x2", "32x4", "64x2", "64x4"],
                        help="d x H pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oracle", choices=["simulated", "torch"], default="simulated",
                        help="simulated: the model in numpy; torch: a float64 torch.nn.MultiheadAttention through "
                             "TorchOracle (computes every position, O(N^2) per query)")
    parser.add_argument("--margins", type=int, default=0, help="runs per kind of oracle (module docstring)")
    args = parser.parse_args()
    if args.margins:
        margins(args.margins)
        return
    print("| d | H | queries | verification queries | share of queries | share of tokens | "
          "share of oracle time | run s | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        d, H = (int(part) for part in size.split("x"))
        if args.oracle == "torch":
            import torch

            from mhaextract.adapters.torch import TorchOracle

            torch.manual_seed(args.seed)
            layer = torch.nn.MultiheadAttention(d, H, batch_first=True).double()
            target = TorchOracle(layer, np.random.default_rng(args.seed).standard_normal(d))
        else:
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
