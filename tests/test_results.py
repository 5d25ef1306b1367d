"""What a newcomer sees of a result: a short repr, schedule-specific parts that are None (not
errors) where the run has none, and ``summary()`` documented."""

import numpy as np

import mhaextract as mx

from conftest import CountingOracle


def _default_run():
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    oracle = CountingOracle(target)
    return mx.extract(oracle, 4, heads=2, seed=0), oracle


def test_repr_is_one_short_line_with_the_measured_count():
    result, oracle = _default_run()
    text = repr(result)
    assert "\n" not in text and len(text) <= 160
    assert str(result) == text
    assert f"queries={oracle.count}" in text  # the count the oracle itself saw
    assert "schedule='targeted'" in text and "heads=2" in text and "d=4" in text and "ok=True" in text
    assert f"error_estimate={result.error_estimate:.3g}" in text


def test_schedule_specific_parts_are_none_on_the_default_run():
    result, _ = _default_run()
    assert result.certificate is None
    assert result.amplification is None and result.valid_below is None and result.error_bound(1e-9) is None
    assert result.radius is None and result.model_hp is None and result.W_balls is None
    summary = result.summary()
    assert summary["valid_below"] is None and summary["queries"] == result.queries


def test_a_certificate_run_keeps_its_shortcuts():
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    result = mx.extract(mx.SimulatedOracle(target), 2, heads=1, seed=0, schedule="paper")
    assert result.certificate is not None
    assert result.amplification == result.certificate.amplification > 0
    assert result.valid_below == result.certificate.valid_below > 0
    assert np.isfinite(result.error_bound(1e-14))


def test_summary_is_documented_on_the_class():
    assert "summary()" in mx.Extraction.__doc__
    assert mx.Extraction.summary.__doc__
