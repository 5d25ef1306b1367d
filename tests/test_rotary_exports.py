"""Rotary models back into their own class (issue 61, item 5): ``to_state_dict`` into LlamaAttention,
MistralAttention and Qwen2Attention, and ``to_torch`` for a rotary model.

The truth is the original layer itself, run exactly in float64 (sdpa, float64 angles), at every
position of sequences of up to 256 tokens; the models exported are its weights' (``to_rotary``),
those with each head's blocks re-gauged as an extraction may return them, or a real extraction's.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.rotary import RotaryLayer, to_rotary  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, UnsupportedLayerError, to_state_dict, to_torch  # noqa: E402
from test_rotary_layers import attention  # noqa: E402

SHAPE = dict(d=16, H=4, H_kv=2, r=8)
KINDS = [("llama", {}), ("mistral", {"sliding_window": 16}), ("qwen2", {"key_bias": True})]


def every_position_error(layer, original, longest=256, seed=0):
    """Max |difference| over every position of sequences of 1, 17 and ``longest`` tokens, relative to
    the original's largest output, both run exactly (float64 angles, sdpa)."""
    rng = np.random.default_rng(seed)
    worst = top = 0.0
    with torch.no_grad():
        for n in (1, 17, longest):
            X = torch.as_tensor(rng.standard_normal((2, n, original.q_proj.in_features)))
            expected = RotaryLayer(original, angles="float64")(X)
            got = RotaryLayer(layer, angles="float64")(X)
            worst, top = max(worst, float((got - expected).abs().max())), max(top, float(expected.abs().max()))
    return worst / top


def regauged(model, seed):
    """The same function with every head's blocks turned and scaled apart (``K -> G K``, ``k -> G k``,
    ``Q -> G^{-T} Q``, ``b -> G^{-T} b``, G a scaled rotation per block) and the blocks listed in
    another order: what an extraction may return for heads that share keys in the layer."""
    rng = np.random.default_rng(seed)
    Q, K, b, k, theta = (np.array(a, dtype=np.float64) for a in (model.Q, model.K, model.b,
                                                                 model.key_bias_or_zero, model.theta))
    for h in range(model.heads):
        for m in range(model.head_width // 2):
            scale, angle = np.exp(rng.normal()), rng.uniform(0, 2 * np.pi)
            turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
            rows = slice(2 * m, 2 * m + 2)
            K[h, rows], k[h, rows] = scale * turn @ K[h, rows], scale * turn @ k[h, rows]
            Q[h, rows], b[h, rows] = turn @ Q[h, rows] / scale, turn @ b[h, rows] / scale
        order = rng.permutation(model.head_width // 2)
        rows = np.stack([2 * order, 2 * order + 1], axis=1).reshape(-1)
        Q[h], K[h], b[h], k[h], theta[h] = Q[h, rows], K[h, rows], b[h, rows], k[h, rows], theta[h, order]
    heads = rng.permutation(model.heads)
    return mx.RotaryAttention(Q[heads], K[heads], theta[heads], model.V[heads], model.c, model.window, b[heads],
                              None if model.key_bias is None else k[heads])


@pytest.mark.parametrize("kind, options", KINDS, ids=[kind for kind, _ in KINDS])
@pytest.mark.parametrize("gauge", [False, True], ids=["weights", "regauged"])
def test_a_rotary_model_goes_back_into_its_class_exactly(kind, options, gauge):
    layer = attention(kind, seed=1, **SHAPE, **options)
    model = to_rotary(layer)
    model = regauged(model, seed=2) if gauge else model
    assert gauge or mx.compare(regauged(model, 2), model).max_rel < 1e-13  # the regauged model is the same function
    fresh = attention(kind, seed=5, **SHAPE, **options)
    state = to_state_dict(model, like=fresh)
    fresh.load_state_dict(state)
    assert every_position_error(fresh, layer) <= 1e-12
    assert state.report.output_error <= 1e-13 and not state.report.rounded


def test_what_a_rotary_class_cannot_carry_is_refused():
    grouped = to_rotary(attention("llama", seed=1, **SHAPE))
    with pytest.raises(UnsupportedLayerError, match="key/value heads"):
        to_state_dict(grouped, like=attention("llama", seed=2, d=16, H=4, H_kv=1, r=8))
    with pytest.raises(UnsupportedLayerError, match="canonical heads"):
        to_state_dict(grouped, like=attention("llama", seed=2, d=16, H=2, H_kv=1, r=8))
    with pytest.raises(UnsupportedLayerError, match="rotary blocks"):
        to_state_dict(grouped, like=attention("llama", seed=2, d=16, H=4, H_kv=2, r=4))
    with pytest.raises(UnsupportedLayerError, match="frequencies"):
        to_state_dict(grouped, like=attention("llama", seed=2, **SHAPE, rope_theta=500.0))
    with pytest.raises(UnsupportedLayerError, match="window"):
        to_state_dict(grouped, like=attention("mistral", seed=2, **SHAPE, sliding_window=16))
    biased = to_rotary(attention("qwen2", seed=1, **SHAPE, key_bias=True))
    with pytest.raises(UnsupportedLayerError, match="q_proj.bias"):
        to_state_dict(biased, like=attention("llama", seed=2, **SHAPE))
    with pytest.raises(UnsupportedLayerError, match="d_out = scalar"):
        to_state_dict(grouped.readout(np.ones(16)), like=attention("llama", seed=2, **SHAPE))


def test_to_torch_takes_a_rotary_model():
    layer = attention("llama", seed=1, **SHAPE)
    module = to_torch(to_rotary(layer))  # a decoder's layer: causal by default
    X = torch.as_tensor(np.random.default_rng(3).standard_normal((1, 40, 16)))
    with torch.no_grad():
        expected = RotaryLayer(layer, angles="float64")(X)
        assert float((module(X) - expected).abs().max() / expected.abs().max()) <= 1e-13
    with pytest.raises(ValueError, match="width"):
        to_torch(to_rotary(layer), width=4)


@pytest.mark.slow  # 8 s
def test_an_extracted_grouped_llama_layer_loads_into_a_fresh_class():
    """Acceptance: a real extraction (defaults, positions="rotary") exported with to_state_dict(result)
    into a fresh float64 LlamaAttention matches the original layer to 1e-12 at every position of
    up to 256 tokens; to_torch(result) too."""
    layer = attention("llama", seed=0, d=16, H=2, H_kv=1, r=8)
    result = mx.extract(TorchOracle(RotaryLayer(layer, angles="float64")), d=16, heads=2, positions="rotary",
                        seed=0, progress=False)
    assert result.ok and result.causal.verdict == "causal" and result.causal.all_tokens_error is None
    fresh = attention("llama", seed=9, d=16, H=2, H_kv=1, r=8)
    state = to_state_dict(result, like=fresh)
    fresh.load_state_dict(state)
    assert every_position_error(fresh, layer) <= 1e-12
    X = torch.as_tensor(np.random.default_rng(4).standard_normal((1, 256, 16)))
    with torch.no_grad():
        expected = RotaryLayer(layer, angles="float64")(X)
        assert float((to_torch(result)(X) - expected).abs().max() / expected.abs().max()) <= 1e-12
