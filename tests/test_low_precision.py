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


def _float32_softmax_layer(d, heads, seed):
    """A float64 causal self-attention whose softmax is computed in float32 (as some models run it), and its
    truth from its own weights: ``W_h = Wk_h^T Wq_h / sqrt(r)``, ``u_h = Wk_h^T bq_h / sqrt(r)``, ``V_h = Wo_h Wv_h``,
    ``c = bo + Wo bv``."""
    torch = pytest.importorskip("torch")
    r = d // heads
    g = torch.Generator().manual_seed(seed)
    Wq, Wk, Wv, Wo = (torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5 for _ in range(4))
    bq, bv, bo = (0.1 * torch.randn(d, generator=g, dtype=torch.float64) for _ in range(3))

    def layer(X):
        B, N, _ = X.shape
        q, k, v = ((X @ W.T + b).view(B, N, heads, r).transpose(1, 2) for W, b in ((Wq, bq), (Wk, 0.0), (Wv, bv)))
        scores = (q @ k.transpose(-1, -2) / r**0.5).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -torch.inf)
        weights = torch.softmax(scores.to(torch.float32), -1).to(torch.float64)
        return (weights @ v).transpose(1, 2).reshape(B, N, d) @ Wo.T + bo

    Wq, Wk, Wv, Wo, bq, bv, bo = (t.numpy() for t in (Wq, Wk, Wv, Wo, bq, bv, bo))
    blocks = [slice(h * r, (h + 1) * r) for h in range(heads)]
    truth = mx.MultiHeadAttention(np.array([Wk[b].T @ Wq[b] / r**0.5 for b in blocks]),
                                  np.array([Wo[:, b] @ Wv[b] for b in blocks]),
                                  np.array([Wk[b].T @ bq[b] / r**0.5 for b in blocks]), bo + Wo @ bv)
    return layer, truth


@pytest.mark.slow
def test_noise_the_calibration_missed_runs_the_schedule_again_at_it():
    """A float64 layer with a float32 softmax whose noise the calibration's permutation probes miss (d = 16, H = 2,
    seed 1: the calibration says float64): the run at float64 rounding fails (saturation, labels), the noise probe's
    fresh queries show about 4e-8 relative noise, and the schedule runs again at it: the model within 1e-6 of the
    truth at its estimate or below, the check ``answer_noise`` saying why, every query counted at the oracle.
    The targeted schedule, named: the defaults split these whole answers by head (docs/algorithm.md, 'Whole
    answers near the vector bound'), and the rerun at the noise is the scalar schedules'."""
    from mhaextract.adapters.torch import TorchOracle
    layer, truth = _float32_softmax_layer(16, 2, seed=1)
    oracle = TorchOracle(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(oracle, 16, heads=2, seed=1, on_failure="warn", progress=False, schedule="targeted")
    assert result.calibration.answer_noise is None  # missed before the run
    assert result.ok and result.queries == oracle.sequences
    noise = next(check for check in result.checks if check.name == "answer_noise")
    assert 1e-9 < noise.value < 1e-6 and "float32" in noise.message
    error = mx.compare(result.model, truth).max_rel
    assert error <= 1e-6 and error <= result.error_estimate <= 100 * error
