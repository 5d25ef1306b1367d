"""Real layers and transcripts: what they cost, against baselines measured in the same run.

    python benchmarks/bench_layers_and_transcripts.py           # both tables (docs/real-layers-and-transcripts.md)
    python benchmarks/bench_layers_and_transcripts.py --quick   # smaller layers

Table 1, real layers (float64, ``token_scale = suggested_token_scale``): the extraction through
:class:`TorchOracle` against the same extraction through a :class:`SimulatedOracle` of the
layer's own reduction (``to_reduced``): measured queries, max relative error against
``to_reduced`` for both, and the wall-time ratio torch / simulated.

Table 2, transcripts: the same extraction without a transcript (baseline), with a new
transcript (every batch committed), and resumed from a complete transcript (every answer read
back, nothing asked): seconds and ratios to the baseline, for an instant simulated oracle (the
worst case for the overhead; a real oracle is slower, which only shrinks the ratios).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

import mhaextract as mx
from mhaextract.adapters.torch import TorchOracle, to_reduced


#: Every time is the best of this many runs (the machine is shared; the minimum is the least noisy).
REPEATS = 3


def timed(function):
    """(value of the last run, best wall seconds over REPEATS runs); ``function(n)`` gets the run number."""
    best = np.inf
    for attempt in range(REPEATS):
        started = time.perf_counter()
        value = function(attempt)
        best = min(best, time.perf_counter() - started)
    return value, best


def layers(quick: bool):
    torch.manual_seed(0)
    out = [("nn.MultiheadAttention(8, 2, bias=False)", torch.nn.MultiheadAttention(8, 2, bias=False)),
           ("GPT2Attention(n_embd=16, n_head=2)", GPT2Attention(GPT2Config(n_embd=16, n_head=2), layer_idx=0))]
    if not quick:
        out += [("nn.MultiheadAttention(16, 4, batch_first)", torch.nn.MultiheadAttention(16, 4, bias=False, batch_first=True)),
                ("GPT2Attention(n_embd=32, n_head=2)", GPT2Attention(GPT2Config(n_embd=32, n_head=2), layer_idx=0))]
    # float64 layers: TorchOracle runs a layer in its own dtype, and this table compares torch's float64
    # arithmetic with the simulated oracle's (float32 layers: bench_real_layers.py --dtype float32)
    return [(name, layer.double()) for name, layer in out]


def error(result, truth) -> str:
    """Max relative error against the truth, or "no model" where the run's parameters were not finite."""
    return "no model" if result.model is None else f"{mx.compare(result.model, truth).max_rel:.1e}"


def real_layers_table(quick: bool) -> list[str]:
    warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)  # the checks column says it
    rows = ["| layer | d | H | queries (measured) | checks | rel. error torch | rel. error simulated | seconds torch | time torch / simulated |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, layer in layers(quick):
        d = layer.embed_dim
        u = np.random.default_rng(0).standard_normal(d)
        oracle = TorchOracle(layer, u)
        truth = to_reduced(layer, u)
        heads = layer.num_heads
        run = dict(heads=heads, seed=0, schedule="paper", token_scale=oracle.suggested_token_scale, on_failure="warn")
        real, real_seconds = timed(lambda _: mx.extract(oracle, d, **run))
        simulated, simulated_seconds = timed(lambda _: mx.extract(mx.SimulatedOracle(truth), d, **run))
        rows.append(
            f"| {name} | {d} | {heads} | {real.queries} | {'ok' if real.ok else 'FAILED'} | "
            f"{error(real, truth)} | {error(simulated, truth)} | {real_seconds:.2f} | "
            f"{real_seconds / simulated_seconds:.1f} |"
        )
    return rows


#: Sequences per oracle call in the transcript table: every batch is one committed (fsync'ed) transaction.
BATCH_SIZE = 256


def transcripts_table(quick: bool) -> list[str]:
    cases = [(8, 2, None), (4, 2, 256)] if quick else [(8, 2, None), (16, 2, None), (4, 2, 256), (6, 3, 256)]
    rows = ["| d | H | precision | queries | batches | no transcript (s) | new transcript (s) | ratio | "
            "ms per batch | resumed, 0 asked (s) | ratio | same result |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, H, precision in cases:
        target = mx.MultiHeadAttention.random(d, H, seed=d + H)
        oracle = mx.SimulatedOracle(target, precision)
        run = dict(heads=H, precision=precision, seed=1, batch_size=BATCH_SIZE, schedule="paper")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "run{}.sqlite"
            plain, plain_seconds = timed(lambda _: mx.extract(oracle, d, **run))
            recorded, recorded_seconds = timed(lambda n: mx.extract(oracle, d, transcript=str(path).format(n), **run))
            # max_queries=0: offline, every answer read back (resume_check=0: no recorded query re-asked)
            resumed, resumed_seconds = timed(
                lambda n: mx.extract(oracle, d, transcript=str(path).format(n), max_queries=0, resume_check=0, **run))
        same = all(np.array_equal(r.model.W, plain.model.W) and np.array_equal(r.model.v, plain.model.v)
                   for r in (recorded, resumed))
        assert resumed.queries_asked == 0 and resumed.queries == plain.queries
        mode = "float64" if precision is None else f"{precision} bits"
        batches = -(-plain.queries // BATCH_SIZE)
        rows.append(
            f"| {d} | {H} | {mode} | {plain.queries} | {batches} | {plain_seconds:.2f} | {recorded_seconds:.2f} | "
            f"{recorded_seconds / plain_seconds:.2f} | {1e3 * (recorded_seconds - plain_seconds) / batches:.1f} | "
            f"{resumed_seconds:.2f} | {resumed_seconds / plain_seconds:.2f} | "
            f"{'bit for bit' if same else 'DIFFERENT'} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller layers and runs")
    quick = parser.parse_args().quick
    print("\n".join(real_layers_table(quick)))
    print()
    print("\n".join(transcripts_table(quick)))


if __name__ == "__main__":
    main()
