"""Real layers extracted whole and put back: a replacement module equal to the original at every position.

The truth is the original layer itself, run in float64 (a float32 layer: its own weights, converted
to float64, docs' "exact layer"), on fresh sequences longer than any query the schedule asked.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import (  # noqa: E402
    TorchOracle, UnsupportedLayerError, to_reduced, to_state_dict, to_torch,
)
from test_real_layers import build  # noqa: E402

#: Standalone, transformers' sdpa GPT-2 and OPT layers mask the future; the eager GPT-2 path and
#: the encoders' layers do not (inside GPT2Model the model's mask makes every GPT-2 path causal).
CAUSAL = {("GPT2Attention", "sdpa"), ("OPTAttention", "sdpa")}


def outputs(layer, X):
    """The layer's own outputs at every position, (B, N, d_out)."""
    with torch.no_grad():
        if isinstance(layer, torch.nn.MultiheadAttention):
            Xi = X if layer.batch_first else X.transpose(0, 1)
            out = layer(Xi, Xi, Xi, need_weights=False)[0]
            return out if layer.batch_first else out.transpose(0, 1)
        out = layer(X)
        return out[0] if isinstance(out, tuple) else out


def fresh_sequences(d, count=40, longest=64, seed=11):
    """Tokens like a LayerNorm's output (unit variance per coordinate), lengths 1..longest."""
    rng = np.random.default_rng(seed)
    return [torch.as_tensor(rng.standard_normal((1, int(n), d))) for n in rng.integers(1, longest + 1, size=count)]


def worst_relative_error(replacement, original, d, count=40, longest=64):
    """Max |replacement - original| over max |original| at every position of fresh sequences; the
    replacement takes them in its own dtype (its first parameter's), the original in float64."""
    dtype = next(iter(replacement.parameters()), torch.empty(0, dtype=torch.float64)).dtype
    worst, largest = 0.0, 0.0
    for X in fresh_sequences(d, count, longest):
        with torch.no_grad():
            expected, got = outputs(original, X), outputs(replacement, X.to(dtype)).to(torch.float64)
        worst, largest = max(worst, float((got - expected).abs().max())), max(largest, float(expected.abs().max()))
    return worst / largest


CASES = [pytest.param("nn.MultiheadAttention", "eager", id="nn.MultiheadAttention"),
         pytest.param("GPT2Attention", "sdpa", id="GPT2Attention-sdpa-causal", marks=pytest.mark.slow),
         pytest.param("GPT2Attention", "eager", id="GPT2Attention-eager", marks=pytest.mark.slow),
         pytest.param("BertSelfAttention", "eager", id="BertSelfAttention", marks=pytest.mark.slow),
         pytest.param("OPTAttention", "sdpa", id="OPTAttention-causal", marks=pytest.mark.slow),
         pytest.param("ViTAttention", "sdpa", id="ViTAttention", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, implementation", CASES)
def test_a_float64_layer_is_replaced_at_every_position(kind, implementation):
    d, H = 16, 2
    layer = build(kind, d, H, seed=1, implementation=implementation).eval()
    oracle = TorchOracle(layer)
    result = mx.extract(oracle, d, heads=H, seed=0, schedule="targeted")  # "auto" splits whole answers
    assert result.ok and result.model.is_vector and result.d_out == d
    assert oracle.sequences == result.queries  # measured at the oracle
    assert mx.compare(result.model, to_reduced(layer)).max_rel <= 1e-11
    replacement = to_torch(result.model, causal=(kind, implementation) in CAUSAL)
    assert worst_relative_error(replacement, layer, d) <= 1e-12
    assert result.verification.passed and result.verification_length == 256  # the default, whole answers


def test_the_float64_layer_needs_about_one_percent_more_queries_than_its_read_out():
    d, H = 32, 2
    layer = build("nn.MultiheadAttention", d, H, seed=3).eval()
    whole = mx.extract(TorchOracle(layer), d, heads=H, seed=0, schedule="targeted")
    scalar = mx.extract(TorchOracle(layer, whole.readout), d, heads=H, seed=0, schedule="targeted")
    assert whole.queries - scalar.queries == whole.value_fit.rows
    assert whole.queries <= 1.02 * scalar.queries


@pytest.mark.slow
def test_a_float32_layer_is_replaced_within_its_own_precision():
    d, H = 32, 4
    exact = build("GPT2Attention", d, H, seed=0, implementation="eager").eval()
    layer = build("GPT2Attention", d, H, seed=0, implementation="eager").eval().float()
    result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, schedule="targeted")
    assert result.ok and result.answer_dtype == "float32"
    replacement = to_torch(result.model, causal=False)
    assert worst_relative_error(replacement, exact, d) <= 1e-5


@pytest.mark.slow
def test_the_gpt2_state_dict_loads_into_a_fresh_gpt2_attention():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config
    d, H = 32, 4
    layer = build("GPT2Attention", d, H, seed=2, implementation="eager").eval()
    result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, schedule="targeted")
    fresh = GPT2Attention(GPT2Config(n_embd=d, n_head=H, attn_implementation="eager"), layer_idx=0).double().eval()
    fresh.load_state_dict(to_state_dict(result.model, like=fresh))
    assert worst_relative_error(fresh, layer, d) <= 1e-12


@pytest.mark.parametrize("kind", ["nn.MultiheadAttention"] + [
    pytest.param(kind, marks=pytest.mark.slow) for kind in ("BertSelfAttention", "OPTAttention", "ViTAttention")])
def test_state_dicts_of_the_truth_reproduce_each_class(kind):
    # OPT's and ViT's eager paths take the softmax in float32: sdpa is their float64 layer
    implementation = "sdpa" if kind in ("OPTAttention", "ViTAttention") else "eager"
    layer = build(kind, 16, 2, seed=4, implementation=implementation).eval()
    fresh = build(kind, 16, 2, seed=9, implementation=implementation).eval()
    fresh.load_state_dict(to_state_dict(to_reduced(layer), like=fresh))
    assert worst_relative_error(fresh, layer, 16) <= 1e-13


def test_state_dict_export_refuses_what_the_class_cannot_carry():
    layer = build("nn.MultiheadAttention", 8, 2, seed=0).eval()
    with pytest.raises(ValueError, match="one number per sequence"):
        to_state_dict(to_reduced(layer, np.ones(8)), like=layer)
    three = mx.MultiHeadAttention.random(8, 3, seed=0, d_out=8)
    with pytest.raises(UnsupportedLayerError, match="3 canonical heads"):
        to_state_dict(three, like=layer)
    full_rank = mx.MultiHeadAttention.random(8, 2, seed=0, d_out=8)
    with pytest.raises(UnsupportedLayerError, match="rank 8 > the head width 4"):
        to_state_dict(full_rank, like=layer)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_modules_answer_exactly_in_float64(dtype):
    layer = build("nn.MultiheadAttention", 8, 2, seed=0).eval().to(getattr(torch, dtype))
    oracle = TorchOracle(layer)
    X = np.random.default_rng(0).standard_normal((3, 5, 8))
    answers = oracle(X)
    assert oracle.answer_dtype == dtype and answers.dtype == np.float64 and answers.shape == (3, 8)
    with torch.no_grad():
        own = outputs(layer, torch.as_tensor(X, dtype=getattr(torch, dtype)))[:, -1]
    np.testing.assert_array_equal(answers, own.to(torch.float64).numpy())
    scalar = TorchOracle(layer, np.ones(8))(X)
    assert scalar.shape == (3,) and np.isfinite(scalar).all()


@pytest.mark.slow
def test_a_whole_model_taking_token_ids_gets_a_clear_error():
    from transformers import GPT2Config, GPT2Model
    model = GPT2Model(GPT2Config(n_embd=8, n_head=2, n_layer=1, vocab_size=10, n_positions=16))
    with pytest.raises(TypeError, match=r"attention module\s+itself.*model\.h\[i\]\.attn"):
        mx.extract(TorchOracle(model), 8, heads=2, seed=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_layers_scalar_oracle_of_the_whole_runs_readout_asks_the_same_queries(dtype):
    """TorchOracle(layer, r) reads its answers out as the whole run does (float32 numbers for a
    float32 layer), so the scalar run of the whole run's r takes the same path: the whole run costs
    the scalar run's queries plus the value fit's, and its scores are the scalar run's bit for bit."""
    torch.manual_seed(3)
    layer = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype)
    with torch.no_grad():
        layer.in_proj_bias.normal_(0, 0.2)
        layer.out_proj.bias.normal_(0, 0.2)
    whole_oracle = TorchOracle(layer)
    result = mx.extract(whole_oracle, 8, heads=2, seed=4, schedule="targeted")
    scalar_oracle = TorchOracle(layer, result.readout)
    scalar = mx.extract(scalar_oracle, 8, heads=2, seed=4, schedule="targeted")
    assert result.ok and scalar.ok
    assert whole_oracle.sequences == result.queries == scalar_oracle.sequences + result.value_fit.rows
    np.testing.assert_array_equal(result.scalar_model.W, scalar.model.W)
    np.testing.assert_array_equal(result.scalar_model.v, scalar.model.v)
