"""The default verification on fresh long queries (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
refinement, verification', ``long_verification``).

Every schedule asks queries of at most ``2 H0 + 1`` tokens; a layer that is one model on short
sequences and another beyond (a sliding window, a model that changes after 5 tokens) fits them
all. The reference oracles below are written here, from a layer's parameters or a torch layer with
a window mask, independently of the code under test; the counts are measured on the oracle's side.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.checks.verify import VERIFY_QUERIES
from mhaextract.oracle.noise import Float32Oracle, GaussianNoise


class WindowedAttention:
    """Multi-head softmax attention of ``model``'s parameters over the last ``window`` tokens only
    (numpy, written here), counting every sequence and its length."""

    def __init__(self, model: mx.MultiHeadAttention, window: int | None):
        self.model, self.window, self.lengths = model, window, []

    def __call__(self, batch):
        out = []
        for X in batch:
            X = np.asarray(X, dtype=np.float64)
            self.lengths.append(len(X))
            seen = X if self.window is None else X[-self.window:]
            final, f = X[-1], float(self.model.c)
            for W, v, u in zip(self.model.W, self.model.v, self.model.u):
                scores = seen @ (W @ final + u)
                weights = np.exp(scores - scores.max())
                f += weights @ (seen @ v) / weights.sum()
            out.append(f)
        return np.array(out)


class Piecewise:
    """One layer (``short``) on sequences up to ``switch`` tokens, another (``long``) beyond."""

    def __init__(self, short, long, switch: int):
        self.short, self.long, self.switch, self.lengths = short, long, switch, []

    def __call__(self, batch):
        self.lengths += [len(X) for X in batch]
        return np.array([(self.short if len(X) <= self.switch else self.long)([X])[0] for X in batch])


def long_check(result):
    return next(check for check in result.checks if check.name == "long_verification")


@pytest.mark.parametrize("window, d, H", [(5, 4, 2), (8, 4, 2), (16, 4, 2), (64, 4, 2), (8, 8, 8)],
                         ids=["5", "8", "16", "64", "8-eight-heads"])
def test_a_sliding_window_fails_loudly_with_the_defaults(window, d, H):
    target = mx.MultiHeadAttention.random(d, H, seed=window, bias=True)
    oracle = WindowedAttention(target, window)
    with pytest.raises(mx.ExtractionError, match="long_verification") as raised:
        mx.extract(oracle, d, heads=H, seed=1)
    message = str(raised.value)
    assert "a sliding window, position-dependent scores or another model beyond short sequences" in message
    result = raised.value.extraction
    # the model is the layer's on every query the schedule asked: only the verification sees the window
    assert [check.name for check in result.failed_checks] == ["long_verification"]
    assert mx.compare(result.model, target).max_rel < 1e-9
    assert result.verification.misses_from > window and not result.verified
    # the verification's queries, before the model-class probes the failed run asked last
    verification = oracle.lengths[len(oracle.lengths) - result.model_class_queries - VERIFY_QUERIES:][:VERIFY_QUERIES]
    assert f"fits every query up to {max(n for n in verification if n < result.verification.misses_from)} tokens" in message
    assert long_check(result).value > 1e3 * long_check(result).threshold  # loud, not marginal


def test_a_window_of_64_needs_queries_beyond_64_tokens():
    d, H = 4, 2
    target = mx.MultiHeadAttention.random(d, H, seed=64, bias=True)
    short = mx.extract(WindowedAttention(target, 64), d, heads=H, seed=1, verify_length=64)
    assert short.ok and short.verification_length == 64  # all within the window: nothing to see
    with pytest.raises(mx.ExtractionError, match="long_verification"):
        mx.extract(WindowedAttention(target, 64), d, heads=H, seed=1)


def test_a_model_that_changes_after_five_tokens_fails_loudly():
    d, H = 4, 2
    first, second = (mx.MultiHeadAttention.random(d, H, seed=seed, bias=True) for seed in (3, 4))
    oracle = Piecewise(first, second, switch=5)
    with pytest.raises(mx.ExtractionError, match="long_verification") as raised:
        mx.extract(oracle, d, heads=H, seed=0)
    result = raised.value.extraction
    assert "misses answers of length >= 6" in str(raised.value)
    assert mx.compare(result.model, first).max_rel < 1e-9  # it learned the short model, and says the rest differs


@pytest.mark.slow
def test_a_torch_gpt2_layer_with_a_window_mask_fails_loudly():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config

    from mhaextract.adapters.torch import TorchOracle, to_reduced

    class Windowed(torch.nn.Module):
        """GPT2Attention whose every position sees only the last ``window`` keys (additive mask)."""

        def __init__(self, layer, window):
            super().__init__()
            self.layer, self.window = layer, window

        def forward(self, X):
            N = X.shape[1]
            mask = torch.zeros(X.shape[0], 1, N, N, dtype=X.dtype)
            mask[..., :max(0, N - self.window)] = torch.finfo(X.dtype).min
            return self.layer(X, attention_mask=mask)[0]

    d, H = 8, 2
    torch.manual_seed(0)
    layer = GPT2Attention(GPT2Config(n_embd=d, n_head=H, attn_implementation="eager"), layer_idx=0).double()
    readout = np.random.default_rng(0).standard_normal(d)
    oracle = TorchOracle(Windowed(layer, 8), readout)
    with pytest.raises(mx.ExtractionError, match="long_verification") as raised:
        mx.extract(oracle, d, heads=H, seed=0)
    result = raised.value.extraction
    assert result.verification.misses_from > 8
    assert mx.compare(result.model, to_reduced(layer, readout)).max_rel < 1e-8  # right within the window
    assert result.queries == oracle.sequences


def test_a_correct_run_passes_and_its_verification_is_counted_at_the_oracle():
    d, H = 4, 2
    target = mx.MultiHeadAttention.random(d, H, seed=7, bias=True)
    plain, verified = WindowedAttention(target, None), WindowedAttention(target, None)
    without = mx.extract(plain, d, heads=H, seed=2, verify_length=0)
    result = mx.extract(verified, d, heads=H, seed=2)
    assert result.ok and result.verified and long_check(result).passed
    assert without.verification is None and without.verification_queries == 0
    assert all(check.name != "long_verification" for check in without.checks)
    # the same run, plus the verification: its queries are the only difference the oracle saw
    assert result.queries == len(verified.lengths) and without.queries == len(plain.lengths)
    assert result.verification_queries == len(verified.lengths) - len(plain.lengths) == VERIFY_QUERIES
    extra = verified.lengths[len(plain.lengths):]  # asked after the schedule's, before any rescue
    assert result.verification_length == max(extra) == 256 == result.max_query_length == max(verified.lengths)
    assert min(extra) == 1 and sum(n > without.max_query_length for n in extra) >= VERIFY_QUERIES // 2
    assert result.verification.queries == VERIFY_QUERIES and result.verification.lengths == (1, 256)
    assert mx.compare(result.model, target).max_rel < 1e-9


def test_verify_length_sets_the_longest_query_and_is_validated():
    d, H = 3, 1
    target = mx.MultiHeadAttention.random(d, H, seed=1, bias=True)
    oracle = WindowedAttention(target, None)
    result = mx.extract(oracle, d, heads=H, seed=0, verify_length=40)
    assert result.ok and result.verification_length == 40 == max(oracle.lengths)
    for bad in (-1, 4097, 2.5, True, "256"):
        with pytest.raises(ValueError, match="verify_length"):
            mx.extract(oracle, d, heads=H, seed=0, verify_length=bad)


def test_the_paper_schedule_named_alone_keeps_its_exact_count_unless_asked():
    d, H = 3, 1
    target = mx.MultiHeadAttention.random(d, H, seed=2)
    paper = WindowedAttention(target, None)
    result = mx.extract(paper, d, heads=H, seed=0, schedule="paper")
    assert result.queries == len(paper.lengths) == 4 * H * d * d - 2 * H + 1 and result.verification_queries == 0
    windowed = WindowedAttention(target, 3)  # the paper's queries are up to 3 tokens long
    with pytest.raises(mx.ExtractionError, match="long_verification"):
        mx.extract(windowed, d, heads=H, seed=0, schedule="paper", verify_length=256)
    assert len(windowed.lengths) == 4 * H * d * d - 2 * H + 1 + VERIFY_QUERIES


@pytest.mark.parametrize("make", [lambda m: GaussianNoise(m, 1e-10, seed=3), Float32Oracle],
                         ids=["gaussian-1e-10", "float32"])
def test_noisy_and_float32_answers_pass_with_the_verification_on(make):
    d, H = 5, 2
    target = mx.MultiHeadAttention.random(d, H, seed=5, bias=True)
    oracle = make(target)
    result = mx.extract(oracle, d, heads=H, seed=5)
    check = long_check(result)
    assert result.ok and check.passed and result.verification_queries == VERIFY_QUERIES
    assert check.value < 0.1 * check.threshold  # a margin, not a coincidence


def test_high_precision_runs_verify_too_and_catch_a_window():
    d, H, bits = 3, 1, 128
    target = mx.MultiHeadAttention.random(d, H, seed=4, bias=True)

    class Exact:
        """The target in ball arithmetic over the last ``window`` tokens (None: all): attention at the
        final token with a sliding window is the attention over the sequence cut to the window."""

        def __init__(self, window):
            self.window, self.lengths = window, []

        def __call__(self, batch):
            self.lengths += [len(X) for X in batch]
            return target([X if self.window is None else X[-self.window:] for X in batch], precision=bits)

    oracle = Exact(None)
    result = mx.extract(oracle, d, heads=H, seed=0, precision=bits)
    assert result.ok and result.verification_queries == VERIFY_QUERIES and result.verification_length == 256
    assert result.queries == len(oracle.lengths) and max(oracle.lengths) == 256
    with pytest.raises(mx.ExtractionError, match="long_verification"):
        mx.extract(Exact(16), d, heads=H, seed=0, precision=bits)


def test_an_oracle_that_refuses_long_sequences_or_a_tight_budget_is_told_about_verify_length():
    d, H = 3, 1
    target = mx.MultiHeadAttention.random(d, H, seed=1, bias=True)

    def short_context(batch):
        if max(len(X) for X in batch) > 100:
            raise RuntimeError("context of 100 tokens exceeded")
        return target(batch)

    with pytest.raises(RuntimeError, match="context of 100") as raised:
        mx.extract(short_context, d, heads=H, seed=0)
    assert any("verify_length" in note for note in raised.value.__notes__)
    assert mx.extract(short_context, d, heads=H, seed=0, verify_length=100).ok
    needed = mx.extract(target, d, heads=H, seed=0, verify_length=0).queries
    with pytest.raises(mx.BudgetExceeded) as raised:
        mx.extract(target, d, heads=H, seed=0, max_queries=needed)
    assert raised.value.needed == VERIFY_QUERIES and any("verify_length" in note for note in raised.value.__notes__)
