"""A failed run probes the model class's invariants and names what it found broken: positions
(a rotary layer run without positions="rotary") or a norm before the attention (a GPT-2 or Llama
sublayer), never a cause the answers do not show; the probes are counted at the oracle."""

import dataclasses

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.checks.model_class import ModelClassEvidence, model_class_hints, probe_model_class
from mhaextract.norm.learner import NormedLearner
from mhaextract.oracle.boundary import OracleBoundary

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mhaextract.adapters.torch import TorchOracle  # noqa: E402


class Counted:
    """The sequences an oracle is handed, counted independently of the library's boundary."""

    def __init__(self, oracle):
        self.oracle, self.count = oracle, 0

    def __call__(self, batch):
        self.count += len(batch)
        return self.oracle(batch)


class NormedSublayer(torch.nn.Module):
    """``x + attention(norm(x))`` (or without the residual): a pre-norm block's attention half."""

    def __init__(self, norm, d=16, heads=2, residual=True, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.norm, self.residual = norm, residual
        self.attention = torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64)

    def forward(self, X):
        Y = self.norm(X)
        return (X if self.residual else 0.0) + self.attention(Y, Y, Y, need_weights=False)[0]


def _probe(oracle, d=16, scale=1.0):
    return probe_model_class(OracleBoundary(oracle, d), d, np.random.default_rng(3), scale)


def _largest(target, d, scale):
    """The largest |answer| of the probes :func:`_probe` asks at the base scale (not the ``LARGE`` set, judged
    apart), from the target itself."""
    from mhaextract.checks.model_class import DIRECTIONS, _probe_sequences

    sequences = _probe_sequences(d, np.random.default_rng(3), scale)[:-3 * DIRECTIONS]
    return max(abs(float(target([sequence])[0])) for sequence in sequences)


@pytest.mark.parametrize("bias", [False, True])
def test_attention_breaks_neither_invariant(bias):
    target = mx.MultiHeadAttention.random(d=6, heads=3, seed=1, bias=bias)
    for scale in (0.1, 1.0, 30.0):
        evidence = _probe(mx.SimulatedOracle(target), d=6, scale=scale)
        assert not evidence.positions and not evidence.normalised, evidence
        assert evidence.order < 1e-13 and evidence.curvature < 1e-12
        assert model_class_hints(evidence) == []
        # the zero token answers c: 0 without biases; with them a bias-free run is told to learn them
        assert evidence.output_constant == bias
        assert abs(evidence.offset - abs(target.c) / _largest(target, d=6, scale=scale)) <= 1e-12  # 0 without c
        told = " ".join(model_class_hints(evidence, bias_free=True))
        assert ("Pass bias=True" in told) == bias


def test_an_oracles_own_noise_is_not_taken_for_positions_or_a_norm():
    target = mx.MultiHeadAttention.random(d=6, heads=2, seed=2, bias=True)
    noisy = mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-2, seed=0)
    evidence = _probe(noisy, d=6)
    assert evidence.order > 1e-4  # the noise moves the swapped answers ...
    assert not evidence.positions and not evidence.normalised  # ... as much as repeating them does


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("residual", [True, False])
def test_a_norm_before_the_attention_is_found_whatever_the_probes_scale(norm, residual):
    layer = torch.nn.LayerNorm(16, dtype=torch.float64) if norm == "layer" else torch.nn.RMSNorm(
        16, eps=1e-6, dtype=torch.float64)
    oracle = TorchOracle(NormedSublayer(layer, residual=residual).eval())
    for scale in (0.02, 1.0):  # a norm misleads the calibration: the probes' scale does not rely on it
        evidence = _probe(oracle, scale=scale)
        assert evidence.normalised and not evidence.positions, evidence
        assert "LayerNorm or RMSNorm" in " ".join(model_class_hints(evidence))


@pytest.mark.slow
def test_a_failed_run_on_a_normed_sublayer_says_so_and_counts_its_probes():
    # max_heads, not heads: the norm learner's direct fit needs the count, so the run is not handed on
    oracle = Counted(TorchOracle(NormedSublayer(torch.nn.LayerNorm(16, dtype=torch.float64)).eval()))
    with pytest.raises(mx.ExtractionError) as raised:
        mx.extract(oracle, 16, max_heads=2, seed=0)
    message = str(raised.value)
    assert "LayerNorm or RMSNorm" in message and "attention module itself" in message and "norm='auto'" in message
    assert "noise of about" not in message and "more heads than declared" not in message
    assert raised.value.extraction.queries == oracle.count  # the probes are in the measured count


@pytest.mark.slow
def test_a_rotary_layer_run_without_positions_is_told_to_pass_them():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from mhaextract.adapters.rotary import RotaryLayer

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         intermediate_size=8, attn_implementation="eager")
    torch.manual_seed(0)
    layer = LlamaAttention(config, layer_idx=0).double().eval()
    oracle = Counted(TorchOracle(RotaryLayer(layer)))
    with pytest.raises(mx.ExtractionError) as raised:
        mx.extract(oracle, 16, heads=2, seed=0)
    message = str(raised.value)
    assert "positions='rotary'" in message and "order of the earlier tokens" in message
    assert "noise of about" not in message  # the calibration took the positions for 2-bit noise
    assert raised.value.extraction.queries == oracle.count


@pytest.mark.slow
def test_a_wrong_d_is_named_before_token_ids():
    """A GPT-2 layer of hidden size 16 asked with d = 12: the message says to pass the hidden size."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config

    layer = GPT2Attention(GPT2Config(n_embd=16, n_head=2), layer_idx=0).double().eval()
    with pytest.raises(TypeError) as raised:
        mx.extract(TorchOracle(layer), 12, heads=2, seed=0)
    message = str(raised.value)
    assert "pass its hidden size as d" in message and "d = 12" in message
    assert message.index("hidden size") < message.index("token ids")


@pytest.mark.slow
@pytest.mark.parametrize("named", [True, False], ids=["norm-named", "defaults"])
def test_a_normed_sublayer_is_learned_by_the_norm_learner_named_or_by_default(named, tmp_path):
    """The hint's remedy, norm='auto' with heads=H, and the defaults (whose failed targeted run hands its session to
    the norm learner) learn the same sublayer: judged against the module itself at every position of raw sequences
    (the norm's eps and the residual included); every query counted, a transcript resumes without asking again."""
    module = NormedSublayer(torch.nn.LayerNorm(16, dtype=torch.float64)).eval()
    oracle = Counted(TorchOracle(module))
    options = {"norm": "auto"} if named else {}
    result = mx.extract(oracle, 16, heads=2, seed=0, transcript=tmp_path / "run.sqlite", **options)
    assert result.ok and result.schedule == "norm" and result.model.norm == "layernorm"
    assert result.queries == oracle.count
    if not named:  # the defaults try the split of whole answers first: the norm breaks its saturation
        assert result.schedule_reason.startswith("vector: whole answers could not be split by head")
        assert "targeted: its checks failed" in result.schedule_reason and "norm before" in result.schedule_reason
        assert result.split_queries > 0
    again = Counted(TorchOracle(module))
    resumed = mx.extract(again, 16, heads=2, seed=0, transcript=tmp_path / "run.sqlite", **options)
    assert again.count == 3 and resumed.queries == result.queries + 3  # the resume check's three
    assert np.array_equal(resumed.model.R, result.model.R)
    rng = np.random.default_rng(11)
    for length in (1, 7, 40):
        X = rng.standard_normal((length, 16)) * 10.0 ** rng.uniform(-3, 3, size=(length, 1))
        with torch.no_grad():
            truth = module(torch.from_numpy(X)[None])[0].numpy()
        assert np.max(np.abs(result.model.every_position(X, causal=False) - truth)) <= 1e-12 * np.max(np.abs(truth))


def test_a_scalar_read_out_of_a_normed_sublayer_is_not_handed_to_the_norm_learner_by_the_defaults():
    whole = ModelClassEvidence(0.0, 0.5, True, 1e-4, 20, 0.1, d_out=16)
    assert NormedLearner.explains(whole) is not None
    assert NormedLearner.explains(dataclasses.replace(whole, d_out=1)) is None  # a read-out names norm= itself
    assert NormedLearner.explains(dataclasses.replace(whole, scale_invariant=False)) is None
