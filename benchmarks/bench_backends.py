"""numpy against torch (CPU, and CUDA when present) for the paper schedule's float64 kernels.

    python benchmarks/bench_backends.py                 # d = 16, 32, 64 (CPU)
    python benchmarks/bench_backends.py --d 64 128 256  # on a GPU machine

For each (d, H) and backend, the same extraction (same seed, same queries) with the oracle
answering through the matching simulated oracle (numpy ``SimulatedOracle`` for numpy,
``TorchSimulatedOracle`` on the same device for torch): measured queries, oracle and learner
seconds (learner = total - oracle), learner/oracle, the error against the target, and the
difference from the numpy model (the backends must agree to float64 rounding). The baseline is
the numpy row of the same (d, H) in the same run: ``learner speed-up`` is its learner time over
this row's.
"""

from __future__ import annotations

import argparse
import time
import warnings

import mhaextract as mx
from mhaextract.oracle.simulated import TorchSimulatedOracle


class Timed:
    """The oracle with its calls timed (the learner's time is the rest of the run); what the
    boundary reads of an oracle (``answer_dtype``, ``takes_copies_rows``) is the wrapped one's."""

    def __init__(self, oracle):
        self.oracle, self.seconds = oracle, 0.0

    def __getattr__(self, name):
        return getattr(self.oracle, name)

    def __call__(self, batch):
        started = time.perf_counter()
        try:
            return self.oracle(batch)
        finally:
            self.seconds += time.perf_counter() - started


def run(target, d, H, backend, device):
    oracle = Timed(mx.SimulatedOracle(target) if backend is None else TorchSimulatedOracle(target, device))
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        result = mx.extract(oracle, d, heads=H, seed=1, schedule="paper", backend=backend, on_failure="warn",
                            batch_size=8192)
    total = time.perf_counter() - started
    return result, oracle.seconds, total - oracle.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    import torch

    backends = [("numpy", None, "cpu"), ("torch", "torch-cpu", "cpu")]
    if torch.cuda.is_available():
        backends.append(("torch", "torch-cuda", "cuda"))
        name = torch.cuda.get_device_name(0)
    else:
        name = "none"
    print(f"GPU: {name}; torch {torch.__version__}\n")
    print("| backend | device | d | H | queries | oracle s | learner s | learner/oracle | learner speed-up vs numpy "
          "| rel. error | rel. diff to numpy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    warm = mx.MultiHeadAttention.random(4, 2, seed=0)
    for _, backend, device in backends:  # first calls pay library start-up (CUDA context, kernels)
        run(warm, 4, 2, backend, device)
    for d in args.d:
        for H in args.heads:
            target = mx.MultiHeadAttention.random(d, H, seed=0)
            reference = None
            for label, backend, device in backends:
                result, oracle_s, learner_s = run(target, d, H, backend, device)
                if reference is None:
                    reference = (result, learner_s)
                error = mx.compare(result.model, target).max_rel if result.model is not None else float("inf")
                diff = mx.compare(result.model, reference[0].model).max_rel if result.model is not None else float("inf")
                print(f"| {label} | {device} | {d} | {H} | {result.queries} | {oracle_s:.2f} | {learner_s:.2f} | "
                      f"{learner_s / max(oracle_s, 1e-9):.2f} | {reference[1] / max(learner_s, 1e-9):.2f} | "
                      f"{error:.1e} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
