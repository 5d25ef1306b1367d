"""The lean schedule (docs/algorithm.md, 'The lean schedule')."""

import warnings

import numpy as np
import pytest

import mhaextract as mx
from conftest import run_settings
from mhaextract.checks.noise_probe import PROBE_QUERIES
from mhaextract.checks.verify import VERIFY_QUERIES
from mhaextract.attention.lean import LeanSchedule
from mhaextract.attention.paper import PaperSchedule

from conftest import hp_error


def lean_formula(d, H):
    if H == 1:
        return d * d + d + 1
    return (2 * H + 1) + 2 * H * (d - 1) + (2 * H - 1) * (d * d - 1)


@pytest.mark.slow
@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("H", [1, 2, 3, 4, 8])
def test_the_schedule_asks_the_documented_count(d, H):
    schedule = LeanSchedule(run_settings(d, H, seed=0))
    sequences = schedule.fixed_queries()
    assert len(sequences) == schedule.promised_queries == lean_formula(d, H)
    assert max(len(X) for X in sequences) == 2 * H + 1
    paper = PaperSchedule(run_settings(d, H)).promised_queries
    if d >= 8 and H >= 2:
        assert lean_formula(d, H) <= 0.55 * paper
    if H == 1:
        assert lean_formula(d, H) <= d * d + d + 1
    assert lean_formula(d, H) >= H * (d * d + d) or d == 1  # never below the information bound


@pytest.mark.slow
def test_high_precision_lean_recovers_100_random_targets_to_1e_40():
    rng = np.random.default_rng(55)
    fallbacks = 0
    for trial in range(100):
        d = int(rng.integers(1, 5))
        H = int(rng.integers(1, 7))
        target = mx.MultiHeadAttention.random(d, H, seed=3000 + trial)
        asked = []

        def oracle(batch, target=target):
            asked.extend(batch)
            return target(batch, precision=256)

        result = mx.extract(oracle, d, heads=H, precision=256, seed=trial, schedule="lean")
        assert result.ok and result.schedule == "lean"
        # Measured at the boundary: the formula plus 2H - 1 per fallback link, and the verification's.
        assert result.queries == len(asked) == (lean_formula(d, H) + result.details.fallback_links * (2 * H - 1)
                                                + VERIFY_QUERIES)
        fallbacks += result.details.fallback_links
        assert hp_error(result, target) <= 1e-40
    assert fallbacks <= 5  # distinct random labels rarely need a link


@pytest.mark.parametrize("precision", [256, None])
def test_equal_value_vectors_fall_back_to_column_links(precision):
    rng = np.random.default_rng(3)
    d, H = 4, 3
    W = rng.standard_normal((H, d, d)) / np.sqrt(d)
    v = rng.standard_normal((H, d))
    v[1] = v[0]  # heads 0 and 1 have the same residue label in every column
    target = mx.MultiHeadAttention(W, v)
    result = mx.extract(mx.SimulatedOracle(target, precision), d, heads=H, precision=precision, seed=2,
                        schedule="lean")
    # Every column needs its links: one per instance of rows 1..d-1.
    assert result.details.fallback_links == d * (d - 1)
    probe = PROBE_QUERIES if precision is None else 0  # float64: the noise probe (issue 12)
    assert result.queries == lean_formula(d, H) + result.details.fallback_links * (2 * H - 1) + probe + VERIFY_QUERIES
    got = result.model_hp if precision else result.model
    assert float(mx.compare(got, target).max_rel) < (1e-40 if precision else 1e-6)


@pytest.mark.parametrize("d, H", [(4, 1), (8, 1), (8, 2), (16, 2)])
def test_float64_lean_is_accurate_or_says_so(d, H):
    for seed in range(2):
        target = mx.MultiHeadAttention.random(d, H, seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
            result = mx.extract(mx.SimulatedOracle(target), d, heads=H, seed=seed, schedule="lean", on_failure="warn")
        error = mx.compare(result.model, target).max_rel
        if result.ok:
            assert error <= 30 * result.error_estimate + 1e-14
        assert error <= (1e-11 if H == 1 else 1e-5)


def test_lean_with_a_bound_finds_the_canonical_count():
    target = mx.MultiHeadAttention.random(3, 2, seed=9)
    result = mx.extract(mx.SimulatedOracle(target, 256), 3, max_heads=4, precision=256, seed=1, schedule="lean")
    assert result.heads == 2
    assert result.queries == lean_formula(3, 4) + result.details.fallback_links * 7 + VERIFY_QUERIES
    assert hp_error(result, target) <= 1e-40


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule must be one of"):
        mx.extract(lambda batch: [0.0] * len(batch), 2, heads=1, schedule="fast")
