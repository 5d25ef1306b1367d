"""The single-head baseline (arXiv 2601.16873): d^2 + d measured queries, exact in high precision."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhaextract as mx
from mhaextract.baselines import extract_single_head
from mhaextract.numerics.highprec import to_arb

from conftest import CountingOracle




def encloses(balls, truth):
    return all(ball.contains(to_arb(value)) for ball, value in zip(balls.ravel(), np.asarray(truth).ravel()))


def exact_dyadic(values, bits=20):
    """Round to ``bits`` bits so that products with small-integer bases stay exact in float64."""
    return np.round(np.asarray(values) * 2.0**bits) / 2.0**bits


@pytest.mark.parametrize("d", [1, 2, 3, 5, 8])
def test_one_head_is_recovered_exactly_in_high_precision_with_d2_plus_d_queries(d):
    target = mx.MultiHeadAttention.random(d, 1, seed=100 + d)
    oracle = CountingOracle(target, precision=256)
    result = extract_single_head(oracle, d, precision=256, seed=d)
    assert result.queries == oracle.count == d * d + d == result.promised_queries
    assert result.verification_queries == 0
    assert result.max_query_length == oracle.longest == (2 if d else 1)
    assert result.heads == 1 and result.ok and result.certified
    assert float(mx.compare(result.model_hp, target).max_rel) < 1e-65
    # The balls are computed in ball arithmetic from the answer balls: they hold the truth.
    assert encloses(result.W_balls, target.W) and encloses(result.v_balls, target.v)
    assert result.error_estimate < 1e-60


@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True)
@given(d=st.integers(1, 12), seed=st.integers(0, 2**31), log_scale=st.floats(-1.0, 1.0))
def test_float64_one_head_error_stays_under_its_estimate(d, seed, log_scale):
    """Any seed and W scale: the first-order estimate bounds the error; at the default token scale
    and W of size 1/sqrt(d) (log_scale <= 0.3) the error is below 1e-11. Larger W saturate the
    softmax (log-odds of 10 and more) and lose digits, which the estimate reports."""
    rng = np.random.default_rng(seed)
    target = mx.MultiHeadAttention(rng.standard_normal((1, d, d)) * 10**log_scale / np.sqrt(d),
                                   rng.standard_normal((1, d)))
    oracle = CountingOracle(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        result = extract_single_head(oracle, d, seed=seed, on_failure="warn")
    assert result.queries == oracle.count == d * d + d
    error = float(mx.compare(result.model, target).max_rel)
    assert error <= 10 * result.error_estimate + 1e-14
    assert result.ok == (result.error_estimate <= 1e-4)
    if log_scale <= 0.3:
        assert error < 1e-11


def test_orthogonal_subspaces_with_known_bases_are_recovered_exactly():
    """Heads in pairwise orthogonal subspaces (Hadamard columns): W_h = B_h A_h B_h^T, v_h = B_h b_h."""
    hadamard = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=float)
    bases = [hadamard[:, :2], hadamard[:, 2:3], hadamard[:, 3:]]
    rng = np.random.default_rng(7)
    W = np.array([exact_dyadic(B @ rng.standard_normal((B.shape[1],) * 2) @ B.T / 4) for B in bases])
    v = np.array([exact_dyadic(B @ rng.standard_normal(B.shape[1])) for B in bases])
    target = mx.MultiHeadAttention(W, v)
    oracle = CountingOracle(target, precision=200)
    result = extract_single_head(oracle, 4, subspaces=bases, precision=200, seed=3)
    assert result.queries == oracle.count == (4 + 2) + (1 + 1) + (1 + 1) == result.promised_queries
    assert result.dimensions == (2, 1, 1)
    assert result.heads == 3 and result.certified
    assert float(mx.compare(result.model_hp, target).max_rel) < 1e-50
    assert encloses(result.W_balls, W) and encloses(result.v_balls, v)


def test_orthogonal_subspaces_in_float64_with_permuted_coordinates():
    d, dims = 6, (2, 3, 1)
    permutation = np.random.default_rng(1).permutation(d)
    identity = np.eye(d)[:, permutation]
    bases = np.split(identity, np.cumsum(dims)[:-1], axis=1)
    rng = np.random.default_rng(2)
    W = np.array([B @ rng.standard_normal((B.shape[1],) * 2) @ B.T for B in bases]) / np.sqrt(d)
    v = np.array([B @ rng.standard_normal(B.shape[1]) for B in bases])
    target = mx.MultiHeadAttention(W, v)
    result = extract_single_head(CountingOracle(target), d, subspaces=bases, seed=4, verify_queries=20)
    assert result.queries == sum(r * r + r for r in dims) + 20 and result.verification_queries == 20
    assert float(mx.compare(result.model, target).max_rel) < 1e-12
    assert result.verification_residual < 1e-12 and result.ok


def test_a_head_with_zero_value_vector_is_no_head_and_costs_d_queries():
    d = 3
    target = mx.MultiHeadAttention(np.random.default_rng(0).standard_normal((1, d, d)), np.zeros((1, d)))
    oracle = CountingOracle(target)
    result = extract_single_head(oracle, d, seed=0)
    assert result.heads == 0 and oracle.count == d and result.ok


def test_several_general_heads_break_the_assumption_and_verification_says_so():
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    with pytest.raises(mx.ExtractionError, match="verification_residual"):
        extract_single_head(CountingOracle(target), 4, seed=1, verify_queries=8)
    with pytest.warns(mx.UnreliableExtractionWarning):
        result = extract_single_head(CountingOracle(target), 4, seed=1, verify_queries=8, on_failure="warn")
    assert not result.ok and result.verification_residual > 1e-3


def test_an_oracle_no_softmax_head_can_produce_fails_the_weight_range_check():
    """v^T x + 1: the implied attention weights leave (0, 1)."""
    target = mx.MultiHeadAttention.random(3, 1, seed=0)

    def shifted(batch):
        return mx.SimulatedOracle(target)(batch) + np.array([0.0 if len(X) == 1 else 5.0 for X in batch])

    with pytest.raises(mx.ExtractionError, match="weights_in_range"):
        extract_single_head(shifted, 3, seed=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(d=0), "d must be"),
    (dict(d=3, precision=32), "precision"),
    (dict(d=3, verify_queries=-1), "verify_queries"),
    (dict(d=3, on_failure="warn "), "on_failure"),
    (dict(d=3, max_queries=-1), "max_queries"),
    (dict(d=3, max_queries=1.5), "max_queries"),
    (dict(d=3, token_scale=float("inf")), "token_scale"),
    (dict(d=3, on_failure="ignore"), "on_failure"),
    (dict(d=3, token_scale=-1.0), "token_scale"),
    (dict(d=3, subspaces=[]), "subspaces is empty"),
    (dict(d=3, subspaces=[np.ones((2, 1))]), "shape"),
    (dict(d=3, subspaces=[np.array([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]])]), "linearly dependent"),
    (dict(d=3, subspaces=[np.eye(3)[:, :2], np.eye(3)[:, 1:]]), "more than d"),
    (dict(d=3, subspaces=[np.eye(3)[:, :1], np.array([[1.0], [1.0], [0.0]])]), "not orthogonal"),
])
def test_bad_input_is_named(kwargs, message):
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    with pytest.raises(ValueError, match=message):
        extract_single_head(mx.SimulatedOracle(target), **kwargs)


def test_max_queries_below_the_count_raises_before_any_query():
    """The count is known up front (d^2 + d, plus the verification queries): a smaller cap asks nothing."""
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    oracle = CountingOracle(target)
    with pytest.raises(mx.BudgetExceeded, match="max_queries=13.*needs 14") as info:
        extract_single_head(oracle, 3, seed=0, verify_queries=2, max_queries=13)
    assert oracle.count == 0 and (info.value.needed, info.value.answered) == (14, 0)
    result = extract_single_head(oracle, 3, seed=0, verify_queries=2, max_queries=14)
    assert result.queries == oracle.count == 14 and result.verification_queries == 2 and result.ok


def test_verification_in_a_single_subspace():
    """One basis only (the list of bases has one element): verification queries stay in its span."""
    d = 4
    B = np.eye(d)[:, [2, 0]]
    rng = np.random.default_rng(3)
    W, v = B @ rng.standard_normal((2, 2)) @ B.T / 2, B @ rng.standard_normal(2)
    target = mx.MultiHeadAttention(W[None], v[None])
    result = extract_single_head(CountingOracle(target), d, subspaces=[B], seed=1, verify_queries=10)
    assert result.queries == 6 + 10 and result.verification_residual < 1e-12 and result.ok


def test_high_precision_refuses_a_basis_whose_tokens_are_not_exact():
    d = 3
    rotation = np.linalg.qr(np.random.default_rng(0).standard_normal((d, d)))[0]
    target = mx.MultiHeadAttention.random(d, 1, seed=0)
    with pytest.raises(ValueError, match="not exact"):
        extract_single_head(mx.SimulatedOracle(target, 128), d, subspaces=[rotation[:, :2]], precision=128, seed=0)
