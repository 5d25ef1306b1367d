"""Low-precision oracles (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'): the answers'
precision is measured before the schedule runs, and the targeted schedule sizes its tolerances to it."""

import warnings

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.run.calibration import calibrate
from mhaextract.oracle.answer_stats import AnswerStats
from mhaextract.oracle.boundary import OracleBoundary
from mhaextract.oracle.noise import round_bfloat16


def _answers(oracle, d=6, n=16, seed=0):
    rng = np.random.default_rng(seed)
    return oracle([rng.standard_normal((4, d)) for _ in range(n)])


@pytest.mark.parametrize("wrapper, name", [
    (mx.SimulatedOracle, "float64"), (mx.Float32Oracle, "float32"), (mx.BFloat16Oracle, "bfloat16"),
    (mx.MixedPrecisionOracle, "float64"),  # float64 numbers: the bits cannot tell, the probes do (below)
])
def test_answer_bits_name_the_precision(wrapper, name):
    stats = AnswerStats()
    stats.add(_answers(wrapper(mx.MultiHeadAttention.random(6, 2, seed=1))))
    assert stats.precision_name == name
    assert stats.unit_roundoff == {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8}[name]


def test_too_few_or_uninformative_answers_say_float64():
    for values in ([0.5, 0.25, 0.125], np.arange(20.0), np.full(20, 0.1)):
        stats = AnswerStats()
        stats.add(values)
        assert stats.precision_name == "float64"


def test_float16_answers_are_told_from_bfloat16_and_float32():
    """11 significant bits read as float16 (also when a few answers happen to be bfloat16 numbers)."""
    answers = _answers(mx.SimulatedOracle(mx.MultiHeadAttention.random(6, 2, seed=1)), n=40)
    stats = AnswerStats()
    stats.add(answers.astype(np.float16).astype(np.float64))
    assert (stats.precision_name, stats.unit_roundoff) == ("float16", 2.0**-11)
    lucky = AnswerStats()  # four float16 answers that are bfloat16 numbers too: too few to say bfloat16
    lucky.add([0.5, 0.375, -1.25, 3.0 + 2.0**-6])
    assert lucky.precision_name == "float16"


def test_vector_answers_show_their_format_through_the_read_out():
    """Whole answers of a bfloat16 layer are read out to float32 scalars; the format is read from the
    vectors' own numbers."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for dtype, name in [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")]:
        boundary = OracleBoundary(lambda batch: torch.as_tensor(np.stack([X.sum(axis=0) for X in batch])).to(dtype),
                                  d=5)
        boundary.ask([rng.standard_normal((3, 5)) for _ in range(20)])
        assert boundary.stats.precision_name == name


def test_round_bfloat16_keeps_eight_bits():
    values = np.float32([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9, -3.14159, 1e-3])
    rounded = round_bfloat16(values)
    assert np.all(rounded.view(np.uint32) & np.uint32(0xFFFF) == 0)
    assert np.all(np.abs(rounded - values) <= 2.0**-8 * np.abs(values))  # unit roundoff 2^-8


@pytest.mark.parametrize("wrapper, precision, low, high", [
    (mx.SimulatedOracle, "float64", None, None),
    (lambda t: mx.GaussianNoise(mx.SimulatedOracle(t), 1e-17, seed=0), "float64", None, None),
    (lambda t: mx.GaussianNoise(mx.SimulatedOracle(t), 1e-12, seed=0), "float64 with noise", 1e-14, 1e-10),
    (mx.Float32Oracle, "float32", 2.0**-25, 1e-6),
    (mx.MixedPrecisionOracle, "float64 with noise", 1e-9, 1e-6),
    (mx.BFloat16Oracle, "bfloat16", 2.0**-9, 1e-2),
])
def test_calibration_measures_the_answer_noise(wrapper, precision, low, high):
    """Float64 answers (even with noise far below float32's) are not taken for float32 ones."""
    target = mx.MultiHeadAttention.random(4, 2, seed=3)
    calibration = calibrate(OracleBoundary(wrapper(target), 4), 4, np.random.default_rng(0))
    assert calibration.answer_precision == precision and calibration.queries == 147
    if low is None:
        assert calibration.answer_noise is None
    else:
        assert low <= calibration.answer_noise <= high


@pytest.mark.parametrize("wrapper, kind", [
    (lambda t: mx.GaussianNoise(mx.SimulatedOracle(t), 1e-10, seed=0), "random"),
    (lambda t: mx.AdditiveNoise(mx.SimulatedOracle(t), 1e-8, seed=1), "random, may hide float32"),
    (mx.Float32Oracle, "rounding"),
    (mx.MixedPrecisionOracle, "rounding"),
])
def test_calibration_tells_rounding_from_random_output_noise(wrapper, kind):
    """Repeated probe queries: a rounding oracle answers them alike (its scores are rounded too),
    an oracle adding random noise does not (its scores are exact unless the noise can hide a
    float32 arithmetic, docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'); 147 queries."""
    target = mx.MultiHeadAttention.random(4, 2, seed=3)
    calibration = calibrate(OracleBoundary(wrapper(target), 4), 4, np.random.default_rng(0))
    assert calibration.queries == 147 and calibration.answer_noise is not None
    assert calibration.random_noise == kind.startswith("random")
    if kind == "rounding":
        assert calibration.arithmetic_noise == calibration.answer_noise
    elif kind == "random":
        assert calibration.answer_noise < 4e-10 and calibration.arithmetic_noise is None
    else:
        assert calibration.arithmetic_noise == min(calibration.answer_noise, 2.0**-24) > 4e-10


@pytest.mark.parametrize("wrapper", [mx.Float32Oracle, mx.MixedPrecisionOracle])
def test_targeted_extracts_from_float32_answers(wrapper):
    d, H = 4, 2
    target = mx.MultiHeadAttention.random(d, H, seed=2)
    result = mx.extract(wrapper(target), d, heads=H, seed=7)
    assert result.ok and result.heads == H and result.calibration.answer_noise > 1e-9
    error = mx.compare(result.model, target).max_rel
    # float32 rounds the parameters themselves by 2^-24: the error is a few hundred units of it at most.
    assert error <= 300 * 2.0**-24
    assert error / 10 <= result.error_estimate <= 1e3 * error


def test_float64_answers_keep_float64_tolerances():
    d, H = 4, 2
    target = mx.MultiHeadAttention.random(d, H, seed=2)
    result = mx.extract(mx.SimulatedOracle(target), d, heads=H, seed=7)
    assert result.ok and result.calibration.answer_noise is None
    assert mx.compare(result.model, target).max_rel < 1e-12


def test_float32_detected_without_calibration():
    """An explicit token scale skips the calibration: the answers' bits still say float32."""
    d, H = 4, 2
    target = mx.MultiHeadAttention.random(d, H, seed=2)
    result = mx.extract(mx.Float32Oracle(target), d, heads=H, seed=7, token_scale=d**0.25)
    assert result.ok and mx.compare(result.model, target).max_rel <= 300 * 2.0**-24


def test_bfloat16_fails_loudly_with_a_hint():
    """Scalar answers at 8 bits: the heads' labels need vector answers (docs/algorithm.md, 'Whole answers at 8 or 11
    bits: saturated lines, then least squares')."""
    d, H = 4, 2
    target = mx.MultiHeadAttention.random(d, H, seed=2)
    with pytest.raises(mx.ExtractionError, match="answer the whole output"):
        mx.extract(mx.BFloat16Oracle(target), d, heads=H, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(mx.BFloat16Oracle(target), d, heads=H, seed=7, on_failure="warn")
    assert not result.ok
