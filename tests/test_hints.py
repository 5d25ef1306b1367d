"""Failure hints name the likely cause from the run's evidence (checks/diagnosis.py): more heads
than declared, an oracle that is not one attention layer, heads merged; never precision=BITS for an
oracle that answers in floats only, and not the float32-noise hint when another cause is plain."""

import numpy as np
import pytest

import mhaextract as mx
from conftest import Float32Answers


class GPT2LikeBlock:
    """A GPT-2-like block, written here in numpy: ``h = x_N + attn(LN(X))``, then
    ``h + MLP(LN(h))`` (GELU), read out along a fixed vector. Not one attention layer."""

    def __init__(self, d: int, heads: int, seed: int):
        rng = np.random.default_rng(seed)
        self.scores = rng.standard_normal((heads, d, d)) / d
        self.values = rng.standard_normal((heads, d, d)) / np.sqrt(d)
        self.up = rng.standard_normal((4 * d, d)) / np.sqrt(d)
        self.down = rng.standard_normal((d, 4 * d)) / np.sqrt(4 * d)
        self.readout = rng.standard_normal(d)

    @staticmethod
    def _layer_norm(x):
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)

    def _one(self, X):
        Y = self._layer_norm(X)
        attended = np.zeros(X.shape[1])
        for W, V in zip(self.scores, self.values):
            s = Y @ (W @ Y[-1])
            a = np.exp(s - s.max())
            attended += V @ (a @ Y / a.sum())
        h = X[-1] + attended
        u = self.up @ self._layer_norm(h)
        h = h + self.down @ (0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u ** 3))))
        return float(self.readout @ h)

    def __call__(self, batch):
        return np.array([self._one(np.asarray(X, dtype=np.float64)) for X in batch])


def _hints(oracle, d, **options) -> str:
    with pytest.raises(mx.ExtractionError) as failure:
        mx.extract(oracle, d, seed=0, **options)
    return "\n".join(line for line in str(failure.value).splitlines() if not line.startswith("  "))


@pytest.mark.parametrize("float32", [False, True])
def test_heads_one_on_a_two_head_layer_says_more_heads_than_declared(float32):
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    oracle = Float32Answers(mx.SimulatedOracle(target)) if float32 else mx.SimulatedOracle(target)
    hints = _hints(oracle, 4, heads=1)
    assert "Found evidence of more heads than declared" in hints and "max_heads=BOUND" in hints
    assert "float64 copy" not in hints and "another seed" not in hints


def test_the_grid_schedule_on_too_few_heads_says_more_heads_not_noise():
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    hints = _hints(mx.SimulatedOracle(target), 4, heads=1, schedule="paper")
    assert "Found evidence of more heads than declared" in hints
    assert "noisier than this run can certify" not in hints


@pytest.mark.slow
def test_a_float32_block_is_named_not_blamed_on_noise():
    # the model-class probes see its norms (a lone token's effect stops scaling), and name them
    hints = _hints(Float32Answers(GPT2LikeBlock(8, 2, seed=0)), 8, heads=2)
    assert "Scaling a lone token does not scale its effect" in hints and "attention module itself" in hints
    assert "float64 copy" not in hints and "another seed" not in hints and "precision=BITS" not in hints


def test_a_float64_block_with_no_head_found_is_not_this_model_class():
    hints = _hints(GPT2LikeBlock(8, 2, seed=0), 8, heads=2)
    assert "Scaling a lone token does not scale its effect" in hints and "norm='auto'" in hints
    assert "attention module itself" in hints and "more heads than declared" not in hints


@pytest.mark.parametrize("float_only", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_merged_heads_offer_more_bits_only_to_an_oracle_that_has_them(float_only):
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    oracle = Float32Answers(mx.SimulatedOracle(target)) if float_only else mx.SimulatedOracle(target)
    hints = _hints(oracle, 4, heads=4)
    assert "Found 2 of 4 heads" in hints and "max_heads=4" in hints
    assert ("precision=BITS" in hints) is (not float_only)
    assert "float64 copy" not in hints


def test_too_many_heads_declared_is_said_from_the_pole_count():
    """Issue 61: heads=20 declared for a 4-head layer at d = 8 (the grid schedule, H0 > d) was told
    the count 'may be smaller than its canonical head count'. The instances' majority pole count (4)
    says the opposite: too many heads declared (or merged heads, or a token scale that saturates
    some: the same evidence, all named)."""
    target = mx.MultiHeadAttention.random(d=8, heads=4, seed=0, bias=True)
    with pytest.raises(mx.ExtractionError) as caught:
        mx.extract(mx.SimulatedOracle(target), d=8, heads=20, seed=0, progress=False)
    message = str(caught.value)
    assert "The instances show 4 heads, fewer than heads/max_heads = 20: too many heads declared" in message
    assert "declare heads=4" in message and "may be smaller" not in message
