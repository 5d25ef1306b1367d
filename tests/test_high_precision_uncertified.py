"""High precision with instances that stay uncertified (docs/algorithm.md, 'Not every instance certified'): the run is
judged by a limit meaningful to users, float64's unit roundoff, not by the proven radii's 2^(-precision/4); it says what
was proven and what was estimated; results that are wrong still fail loudly. Truth: mhaextract.models.compare against
the target written in the test."""

import warnings

import mpmath
import numpy as np
import pytest

import mhaextract as mx
from mhaextract.checks.base import FLOAT64_UNIT_ROUNDOFF


def _run(d, H, precision, seed):
    target = mx.MultiHeadAttention.random(d, H, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        result = mx.extract(mx.SimulatedOracle(target, precision=precision), d, heads=H, precision=precision,
                            schedule="paper", repair=True, seed=seed, on_failure="warn", progress=False)
    return target, result, next(check for check in result.checks if check.name == "error_estimate")


@pytest.mark.slow  # 2-3 s
def test_an_accurate_uncertified_result_passes_and_says_what_was_proven():
    # d = 2, H = 12 at 256 bits: 6 of 7 instances fail the Krawczyk test and their repair; the
    # first-order radii give 1.1e-19, above 2^-64 = 5.4e-20, far below float64's 2^-53.
    target, result, check = _run(2, 12, 256, 0)
    truth = mpmath.mpf(mx.compare(result.model_hp, target).max_rel)
    assert not result.certified and not all(result.details.repaired)
    assert 2.0**-64 < check.value <= FLOAT64_UNIT_ROUNDOFF
    assert result.ok, result.failed_checks
    assert check.threshold == FLOAT64_UNIT_ROUNDOFF
    proven = result.details.instances.certified
    assert f"{int(proven.sum())} of {len(proven)} instances proven" in check.message
    assert "first-order radii are estimates" in check.message and "not certified" in check.message
    assert truth <= check.value  # the estimate covers the truth


def test_a_wrong_uncertified_result_still_fails():
    # d = 1, H = 12 at 256 bits, seed 1: heads merge (the model has fewer heads than the target); the
    # estimate is below float64's unit roundoff, the head count and the residual fail the run.
    target, result, check = _run(1, 12, 256, 1)
    assert not result.certified and check.passed
    assert not result.ok
    assert {"heads_found", "answers_residual"} <= {c.name for c in result.failed_checks}
    assert mx.compare(result.model_hp, target).max_rel == np.inf


def test_a_certified_run_keeps_the_proven_radii_limit():
    target, result, check = _run(2, 2, 256, 0)
    assert result.certified and result.ok
    assert check.threshold == 2.0**-64 and "not certified" not in check.message
    assert mpmath.mpf(mx.compare(result.model_hp, target).max_rel) <= check.value


@pytest.mark.parametrize("precision", [128, 200])
def test_below_213_bits_the_uncertified_limit_is_the_certified_one(precision):
    # 2^(-precision/4) >= 2^-53 there: nothing is judged more loosely than a certified run.
    from mhaextract.checks.base import CheckPolicy, uncertified_error_limit

    limit = CheckPolicy.for_precision(precision).error_estimate
    assert uncertified_error_limit(limit, None)[0] == limit
