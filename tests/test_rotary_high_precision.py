"""Rotary attention at high precision (docs/algorithm.md, 'High precision'): the model's
ball-arithmetic evaluation against a reference written here in mpmath, and a 256-bit extraction
whose heads and outputs are judged against the layer's own parameters at 256 bits."""

import mpmath
import numpy as np
import pytest

import mhaextract as mx

BITS = 256


class MpmathRotary:
    """A scalar grouped-query rotary layer evaluated here in mpmath at ``bits`` (Llama's
    ``rotate_half`` on the pairs (m, m + r/2), absolute positions 0..N-1, a query bias, an output
    constant, an optional window): the truth of these tests, independent of the package's code.
    Its parameters are float64 numbers, exact at any precision."""

    answer_dtype = "mpf"

    def __init__(self, d=8, heads=2, kv_heads=1, head_width=4, base=10000.0, window=None, seed=0, bits=BITS):
        rng = np.random.default_rng(seed)
        scale = 1.0 / np.sqrt(d * np.sqrt(head_width))
        self.Wq = rng.normal(size=(heads, head_width, d)) * np.sqrt(scale)
        self.Wk = rng.normal(size=(kv_heads, head_width, d)) * np.sqrt(scale)
        self.bq = rng.normal(size=(heads, head_width)) * 0.3
        self.v = rng.normal(size=(heads, d)) / np.sqrt(d)    # W_O,h W_V,g read out, one vector per head
        self.c = 0.25
        self.base, self.window, self.bits, self.calls, self.queries = base, window, bits, 0, 0
        self.group = heads // kv_heads

    def frequencies(self, head_width):
        with mpmath.workprec(self.bits + 32):
            return [mpmath.mpf(self.base) ** (-mpmath.mpf(2 * m) / head_width) for m in range(head_width // 2)]

    def answer(self, X) -> mpmath.mpf:
        N, d = X.shape
        H, r, _ = self.Wq.shape
        with mpmath.workprec(self.bits + 32):
            freqs = self.frequencies(r) * 2
            X = [[mpmath.mpf(float(x)) for x in row] for row in X]
            first = 0 if self.window is None else max(0, N - self.window)
            total = mpmath.mpf(self.c)
            for h in range(H):
                g = h // self.group

                def rope(vector, position):
                    half = r // 2
                    rotated = [-value for value in vector[half:]] + vector[:half]
                    return [vector[i] * mpmath.cos(position * freqs[i]) + rotated[i] * mpmath.sin(position * freqs[i])
                            for i in range(r)]

                q = rope([mpmath.fdot(self.Wq[h, i], X[-1]) + self.bq[h, i] for i in range(r)], N - 1)
                scores = [mpmath.fdot(rope([mpmath.fdot(self.Wk[g, i], X[j]) for i in range(r)], j), q)
                          for j in range(first, N)]
                weights = [mpmath.exp(s) for s in scores]
                values = [mpmath.fdot(self.v[h], X[j]) for j in range(first, N)]
                total += mpmath.fdot(weights, values) / mpmath.fsum(weights)
        with mpmath.workprec(self.bits):
            return +total

    def __call__(self, batch):
        self.calls += 1
        self.queries += len(batch)
        return [self.answer(np.asarray(X, dtype=np.float64)) for X in batch]

    def truth(self) -> mx.RotaryAttention:
        """The layer as a RotaryAttention with exact parameters (pairs permuted to consecutive
        rows, key factors repeated over their groups), frequencies at ``bits``."""
        H, r, d = self.Wq.shape
        order = np.empty(r, int)
        order[0::2], order[1::2] = np.arange(r // 2), np.arange(r // 2) + r // 2  # row 2m <- m, 2m+1 <- m + r/2
        K = np.repeat(self.Wk, self.group, axis=0)
        theta = np.array([self.frequencies(r) for _ in range(H)], dtype=object)
        return mx.RotaryAttention(mx.numerics.highprec.mpf_array(self.Wq[:, order]), K[:, order], theta, self.v,
                                  self.c, self.window, self.bq[:, order])


def test_the_model_evaluates_in_ball_arithmetic_as_the_reference_does():
    reference = MpmathRotary(window=5, seed=3)
    model = reference.truth()
    rng = np.random.default_rng(0)
    sequences = [rng.normal(size=(n, 8)) * 8 ** -0.25 for n in (1, 2, 5, 9, 9)]
    with mpmath.workprec(BITS):
        high = model(sequences, precision=BITS)
        truth = reference(sequences)
        assert max(abs(a - b) for a, b in zip(high, truth)) <= mpmath.mpf(2) ** (6 - BITS)
        low = model(sequences)
        assert np.abs(low - np.array([float(t) for t in truth])).max() <= 1e-15
    assert model.is_high_precision and model.to_float64().precision == 53 and not model.to_float64().is_high_precision


@pytest.mark.slow
def test_a_rotary_layer_is_recovered_at_256_bits():
    """Issue 40, acceptance 4: a grouped rotary layer with a query bias recovered at 256 bits to
    far below 1e-40 (score matrices, values and outputs), its estimate at least its error, its
    queries counted at the oracle."""
    reference = MpmathRotary(seed=1)
    result = mx.extract(reference, d=8, heads=2, positions="rotary", precision=BITS, seed=0)
    assert result.ok and result.precision == BITS and result.model.is_high_precision
    assert result.queries == reference.queries
    error = mx.compare(result.model, reference.truth())
    assert error.heads_agree
    assert max(error.W_rel, error.v_rel, error.c_rel) <= 1e-70
    assert max(error.W_rel, error.v_rel) <= result.error_estimate <= 1e-60
    rng = np.random.default_rng(5)
    sequences = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(1, 300, 6)]
    truth = reference(sequences)
    with mpmath.workprec(BITS):
        outputs = result.model(sequences, precision=BITS)
        assert max(abs(a - b) for a, b in zip(outputs, truth)) <= 1e-70
    assert result.verification.passed and result.verification.max_relative_error <= 1e-70


@pytest.mark.slow
def test_a_high_precision_rotary_result_is_saved_bit_for_bit(tmp_path):
    layer = mx.RotaryAttention.random(d=6, heads=1, head_width=2, seed=4, bias=True)
    result = mx.extract(mx.SimulatedOracle(layer, precision=128), d=6, heads=1, positions="rotary",
                        precision=128, seed=0, verify_length=32)
    assert result.ok and mx.compare(result.model, layer).W_rel <= 1e-33
    json_path, _ = mx.save_extraction(result, tmp_path / "rotary.json")
    exact, rounded = mx.load_model(json_path, exact=True), mx.load_model(json_path)
    for name in ("Q", "K", "b", "theta", "V"):
        assert np.array_equal(getattr(exact, name), getattr(result.model, name))
        assert getattr(rounded, name).dtype == np.float64
    assert exact.c == result.model.c


def test_a_high_precision_run_refuses_float_answers():
    oracle = mx.SimulatedOracle(mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0))
    with pytest.raises(mx.OracleError, match="mpmath.mpf"):
        mx.extract(oracle, d=4, heads=1, positions="rotary", precision=128, seed=0)


def test_a_float32_layer_cannot_be_asked_for_high_precision():
    class Float32Layer:
        answer_dtype = "float32"

        def __call__(self, batch):
            return np.zeros(len(batch), dtype=np.float32)

    with pytest.raises(ValueError, match="needs an oracle answering mpmath.mpf"):
        mx.extract(Float32Layer(), d=4, heads=1, positions="rotary", precision=128)


@pytest.mark.slow
def test_answers_of_fewer_bits_than_the_precision_asked_are_named():
    layer = mx.RotaryAttention.random(d=6, heads=1, head_width=2, seed=4, bias=True)
    with pytest.raises(mx.ExtractionError, match="fit only to about 2\\^-1[23][0-9], as an oracle computing at about"):
        mx.extract(mx.SimulatedOracle(layer, precision=128), d=6, heads=1, positions="rotary", precision=256,
                   seed=0, verify_length=32)
