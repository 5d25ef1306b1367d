"""Issue 63: attention behind a norm, with the residual (the attention sublayer of a pre-norm block),
and attention with the residual behind a norm (BertAttention's post-norm). Truth: the block's own
forward in float64, or the heads folded from its weights (tests/norm_blocks.py)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.normed import attention_sublayer  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_state_dict, to_torch  # noqa: E402
from mhaextract.models.kinds import model_from_document  # noqa: E402
from mhaextract.models.normed import NormedAttention, PostNormAttention  # noqa: E402
from mhaextract.norm.learn import NormedExtractionError  # noqa: E402
from mhaextract.norm.sweeps import measure  # noqa: E402
from mhaextract.oracle.boundary import OracleBoundary  # noqa: E402
from norm_blocks import (  # noqa: E402
    RotarySublayerFloat64, RMSSublayer, bert_attention, bert_layer, every_position_error, folded_truth, gpt2_block,
    read_out_error, read_out_truth, rotary_block, rotary_truth, post_norm_truth, raw_sequences, vit_layer,
)


@pytest.mark.slow
def test_the_folded_model_is_the_gpt2_sublayer_at_every_position_and_saves_and_exports():
    block = gpt2_block(8, 2)
    sublayer = attention_sublayer(block)
    truth = folded_truth(block)
    sequences = raw_sequences(np.random.default_rng(0), 8, 6, longest=12)
    # GPT2Attention called alone in eager mode masks nothing: the bidirectional reading
    assert every_position_error(truth, sublayer, sequences, causal=False) < 1e-12
    part, _ = truth.to_document()
    again = model_from_document(part)
    assert mx.compare(again, truth).max_rel == 0
    module = to_torch(truth, causal=False)
    X = torch.as_tensor(sequences[-1])[None]
    with torch.no_grad():
        assert float((module(X) - sublayer(X)).abs().max()) < 1e-12
    fresh = gpt2_block(8, 2, seed=5)
    state = to_state_dict(truth, like=fresh)
    fresh.load_state_dict(state, strict=False)
    with torch.no_grad():
        assert float((attention_sublayer(fresh)(X) - sublayer(X)).abs().max()) < 1e-12


def test_an_eps_the_block_cannot_hold_and_a_residual_other_than_the_identity_are_refused():
    truth = folded_truth(gpt2_block(8, 2))
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="layer_norm_epsilon"):
        to_state_dict(truth, like=gpt2_block(8, 2, layer_norm_epsilon=1e-6))
    other = NormedAttention(truth.norm, truth.eps, truth.attention, 2 * truth.R)
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="residual"):
        to_state_dict(other, like=gpt2_block(8, 2))


@pytest.mark.slow
def test_the_gpt2_sublayer_is_extracted_with_norm_auto():
    d, H = 16, 2
    block = gpt2_block(d, H)
    sublayer = attention_sublayer(block)
    oracle = TorchOracle(sublayer)
    result = mx.extract(oracle, d, heads=H, seed=1, norm="auto")
    assert result.ok and result.norm == "layernorm" and result.schedule == "norm"
    assert result.queries == oracle.sequences  # counted at the raw layer
    assert abs(result.eps - block.ln_1.eps) / block.ln_1.eps < 1e-12
    assert mx.compare(result.model, folded_truth(block)).max_rel < 1e-10
    causal = result.causal.verdict == "causal"
    error = every_position_error(result.model, sublayer, raw_sequences(np.random.default_rng(7), d, 20), causal)
    assert error < 1e-12
    assert result.error_estimate >= mx.compare(result.model, folded_truth(block)).max_rel
    fresh = gpt2_block(d, H, seed=9)  # acceptance 5: the state dict goes into a fresh GPT2Block
    fresh.load_state_dict(to_state_dict(result, like=fresh), strict=False)
    X = torch.as_tensor(raw_sequences(np.random.default_rng(3), d, 2)[-1])[None]
    with torch.no_grad():
        expected = sublayer(X)
        for module in (attention_sublayer(fresh), to_torch(result)):  # the block's class, and a module of its own
            assert float(((module(X) - expected).abs().amax(-1) / expected.abs().amax(-1)).max()) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ViT", "RMSNorm", "GPT-2 float32"])
def test_other_sublayers_are_extracted_with_norm_auto(kind):
    d, H = 16, 2
    if kind == "ViT":
        module, norm, eps, limit = attention_sublayer(vit_layer(d, H)), "layernorm", 1e-12, 1e-12
    elif kind == "RMSNorm":
        module, norm, eps, limit = RMSSublayer(d, H), "rmsnorm", 1e-6, 1e-12
    else:
        module, norm, eps, limit = attention_sublayer(gpt2_block(d, H).float()), "layernorm", 1e-5, 1e-5
    result = mx.extract(TorchOracle(module), d, heads=H, seed=1, norm="auto")
    assert result.ok and result.norm == norm and abs(result.eps - eps) / eps < 1e-6
    causal = result.causal.verdict == "causal"
    error = every_position_error(result.model, module.double(), raw_sequences(np.random.default_rng(4), d, 20), causal)
    assert error < limit


def test_the_vit_sublayer_sweeps_find_its_eps_of_1e_12():
    from mhaextract.norm.sweeps import measure
    from mhaextract.oracle.boundary import OracleBoundary

    layer = vit_layer(16, 2)
    oracle = TorchOracle(attention_sublayer(layer))
    sweeps = measure(OracleBoundary(oracle, 16), 16, "auto", np.random.default_rng(0), "float64")
    assert sweeps.kind == "layernorm" and all(check.passed for check in sweeps.checks)
    assert abs(sweeps.eps - layer.layernorm_before.eps) / layer.layernorm_before.eps < 1e-10


def test_an_rmsnorm_sublayer_is_found_as_one_and_refused_when_declared_layernorm():
    d, H = 16, 2
    sublayer = RMSSublayer(d, H)
    with pytest.raises(NormedExtractionError, match="norm_kind.*rmsnorm"):
        mx.extract(TorchOracle(sublayer), d, heads=H, seed=1, norm="layernorm")


def test_an_rmsnorm_sublayer_sweeps_find_its_kind_and_eps():
    from mhaextract.norm.sweeps import measure
    from mhaextract.oracle.boundary import OracleBoundary

    sublayer = RMSSublayer(16, 2, eps=1e-6)
    sweeps = measure(OracleBoundary(TorchOracle(sublayer), 16), 16, "auto", np.random.default_rng(0), "float64")
    assert sweeps.kind == "rmsnorm" and all(check.passed for check in sweeps.checks)
    assert abs(sweeps.eps - 1e-6) / 1e-6 < 1e-10 and np.abs(sweeps.R - np.eye(16)).max() < 1e-12


def test_a_whole_gpt2_block_with_its_mlp_fails_loudly_naming_the_cause():
    block = gpt2_block(16, 2)
    with pytest.raises(NormedExtractionError, match="an MLP") as error:
        mx.extract(TorchOracle(block), 16, heads=2, seed=1, norm="auto")
    assert error.value.extraction.model is None


def test_the_read_out_model_is_r_times_the_gpt2_sublayer_at_every_position_and_saves_and_is_not_exported():
    block, r = gpt2_block(8, 2), np.random.default_rng(5).standard_normal(8)
    sublayer, truth = attention_sublayer(block), read_out_truth(block, r)
    assert not truth.is_vector and truth.R.shape == (8,)
    sequences = raw_sequences(np.random.default_rng(0), 8, 6, longest=12)
    assert read_out_error(truth, sublayer, r, sequences, causal=False) < 1e-13
    part, _ = truth.to_document()
    assert mx.compare(model_from_document(part), truth).max_rel == 0
    X = torch.as_tensor(sequences[-1])[None]
    with torch.no_grad():
        expected = sublayer(X) @ torch.as_tensor(r)
        got = to_torch(truth, causal=False)(X)[..., 0]
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-13
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="read-out"):
        to_state_dict(truth, like=gpt2_block(8, 2))


def test_the_sweeps_read_an_rmsnorm_kind_eps_and_the_residual_read_out_from_one_number_a_query():
    from mhaextract.norm.sweeps import measure
    from mhaextract.oracle.boundary import OracleBoundary

    r = np.random.default_rng(2).standard_normal(16)
    oracle = TorchOracle(RMSSublayer(16, 2, eps=1e-6), readout=r)
    sweeps = measure(OracleBoundary(oracle, 16), 16, "auto", np.random.default_rng(0), "float64")
    assert sweeps.read_out and sweeps.kind == "rmsnorm" and all(check.passed for check in sweeps.checks)
    assert abs(sweeps.eps - 1e-6) / 1e-6 < 1e-10 and np.abs(sweeps.R[0] - r).max() < 1e-12 * np.abs(r).max()
    with pytest.raises(NormedExtractionError, match="norm_kind.*rmsnorm"):
        mx.extract(oracle, 16, heads=2, seed=1, norm="layernorm")


def test_a_post_norm_or_rotary_read_out_is_refused_naming_why():
    r = np.random.default_rng(2).standard_normal(8)
    sublayer = attention_sublayer(bert_attention(8, 2))
    for norm in ("auto", "post-layernorm"):  # a readout and a BertAttention: before any query
        oracle = TorchOracle(sublayer, readout=r)
        with pytest.raises(ValueError, match="before any query.*not separable from the norm.*whole outputs"):
            mx.extract(oracle, 8, heads=2, seed=1, norm=norm)
        assert oracle.sequences == 0
    with torch.no_grad():  # a function's read-out is seen in its answers: after the sweeps show the post-norm
        function = lambda batch: (sublayer(torch.as_tensor(np.stack(batch)))[:, -1] @ torch.as_tensor(r)).numpy()  # noqa: E731
        with pytest.raises(NormedExtractionError, match="whole_outputs.*not separable") as error:
            mx.extract(function, 8, heads=2, seed=1, norm="auto")
    assert error.value.extraction.model is None and error.value.extraction.norm == "post-layernorm"
    oracle = TorchOracle(RotarySublayerFloat64(rotary_block(8, 2, kv_heads=1)), readout=r)
    with pytest.raises(ValueError, match="before any query.*rotary"):
        mx.extract(oracle, 8, heads=2, norm="auto", positions="rotary")
    assert oracle.sequences == 0


@pytest.mark.slow
def test_a_read_out_of_the_gpt2_sublayer_is_extracted_with_norm_auto():
    d, H = 8, 2
    block, r = gpt2_block(d, H), np.random.default_rng(5).standard_normal(d)
    sublayer = attention_sublayer(block)
    oracle = TorchOracle(sublayer, readout=r)
    result = mx.extract(oracle, d, heads=H, seed=1, norm="auto")
    assert result.ok and result.norm == "layernorm" and result.queries == oracle.sequences
    truth = read_out_truth(block, r)
    assert not result.model.is_vector and mx.compare(result.model, truth).max_rel < 1e-12
    causal = result.causal is not None and result.causal.verdict == "causal"
    error = read_out_error(result.model, sublayer, r, raw_sequences(np.random.default_rng(7), d, 20), causal)
    assert error < 1e-12 and result.error_estimate >= max(error, mx.compare(result.model, truth).max_rel)


def _relative_every_position(module, reference, X):
    with torch.no_grad():
        expected = reference(X)
        return float(((module(X) - expected).abs().amax(-1) / expected.abs().amax(-1)).max())


def test_the_post_norm_model_is_bert_attention_at_every_position_and_saves_and_exports():
    layer = bert_attention(8, 2)
    sublayer = attention_sublayer(layer)
    truth = post_norm_truth(layer)
    sequences = raw_sequences(np.random.default_rng(0), 8, 6, longest=12)
    assert every_position_error(truth, sublayer, sequences, causal=False) < 1e-12
    # the 1-component of V_h and c never reaches the output: the canonical form drops it
    shifted = PostNormAttention(truth.eps, mx.MultiHeadAttention(truth.attention.W, truth.attention.V + 0.3,
                                                                 truth.attention.u, truth.attention.c - 0.2),
                                truth.gamma, truth.beta)
    assert np.abs(shifted(sequences) - truth(sequences)).max() < 1e-12
    assert mx.compare(shifted, truth).max_rel < 1e-12
    part, _ = truth.to_document()
    assert mx.compare(model_from_document(part), truth).max_rel == 0
    X = torch.as_tensor(sequences[-1])[None]
    assert _relative_every_position(to_torch(truth, causal=False), sublayer, X) < 1e-12
    fresh = bert_attention(8, 2, seed=5)
    fresh.load_state_dict(to_state_dict(truth, like=fresh))  # every key of the BertAttention
    assert _relative_every_position(attention_sublayer(fresh), sublayer, X) < 1e-12


def test_a_post_norm_export_is_refused_where_bert_attention_cannot_carry_it():
    from transformers.models.bert.modeling_bert import BertAttention, BertConfig

    truth = post_norm_truth(bert_attention(8, 2))
    other_eps = BertAttention(BertConfig(hidden_size=8, num_attention_heads=2, layer_norm_eps=1e-6)).double()
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="layer_norm_eps"):
        to_state_dict(truth, like=other_eps)
    relative = BertAttention(BertConfig(hidden_size=8, num_attention_heads=2, position_embedding_type="relative_key"))
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="position embedding"):
        to_state_dict(truth, like=relative.double())
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="goes into a BertAttention"):
        to_state_dict(truth, like=gpt2_block(8, 2))
    one_head = BertAttention(BertConfig(hidden_size=8, num_attention_heads=1)).double()
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="heads"):
        to_state_dict(truth, like=one_head)


def test_the_ellipsoid_gives_gamma_and_beta_from_answers_alone():
    from mhaextract.norm.post_norm import ellipsoid

    rng = np.random.default_rng(3)
    d = 12
    gamma, beta = 1 + 0.2 * rng.standard_normal(d), 0.05 * rng.standard_normal(d)
    N = rng.standard_normal((2 * d, d))
    N -= N.mean(axis=1, keepdims=True)
    N *= np.sqrt(d) / np.linalg.norm(N, axis=1, keepdims=True)  # a LayerNorm's output, var(z) >> eps
    shape = ellipsoid(gamma * N + beta)
    assert np.abs(shape.gamma - gamma).max() < 1e-12 and np.abs(shape.beta - beta).max() < 1e-12
    assert shape.plane < 1e-14 and shape.sphere < 1e-13


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["auto", "post-layernorm", None], ids=["auto", "post-layernorm", "defaults"])
def test_bert_attention_is_extracted_and_exported_into_a_fresh_one(norm, tmp_path):
    # None: the defaults, whose failed targeted run finds the norm by its large one-token probes
    d, H = 8, 2
    layer = bert_attention(d, H)
    sublayer = attention_sublayer(layer)
    oracle = TorchOracle(sublayer)
    result = mx.extract(oracle, d, heads=H, seed=1, norm=norm)
    truth = post_norm_truth(layer)
    assert result.ok and result.norm == "post-layernorm" and result.schedule == "norm"
    assert result.queries == oracle.sequences  # counted at the raw layer (with the defaults, both runs)
    assert abs(result.eps - truth.eps) / truth.eps < 1e-8
    assert mx.compare(result.model, truth).max_rel < 1e-8
    assert result.causal.verdict == "bidirectional"
    result.save(tmp_path / "bert.json")  # the model, its checks and the causal record (its verdict a word)
    saved = mx.load_extraction(tmp_path / "bert.json")
    assert mx.compare(saved.model, result.model).max_rel == 0 and saved.causal.verdict == "bidirectional"
    sequences = raw_sequences(np.random.default_rng(7), d, 20)
    error = every_position_error(result.model, sublayer, sequences, causal=False)
    assert error < 1e-11 and result.error_estimate >= error
    fresh = bert_attention(d, H, seed=9)
    fresh.load_state_dict(to_state_dict(result, like=fresh))
    X = torch.as_tensor(sequences[-1])[None]
    for module in (attention_sublayer(fresh), to_torch(result)):  # BertAttention itself, and a module of its own
        assert _relative_every_position(module, sublayer, X) < 1e-11


def test_a_whole_bert_layer_fails_loudly_naming_the_cause():
    with pytest.raises(NormedExtractionError, match="BertLayer's MLP") as error:
        mx.extract(TorchOracle(bert_layer(16, 2)), 16, heads=2, seed=1, norm="auto")
    assert error.value.extraction.model is None


def test_a_norm_declared_before_or_after_that_the_answers_contradict_fails_naming_what_they_show():
    with pytest.raises(NormedExtractionError, match="norm_kind.*a norm after the residual"):
        mx.extract(TorchOracle(attention_sublayer(bert_attention(8, 2))), 8, heads=2, seed=1, norm="layernorm")
    with pytest.raises(NormedExtractionError, match="norm_kind.*layernorm before the attention"):
        mx.extract(TorchOracle(attention_sublayer(gpt2_block(8, 2))), 8, heads=2, seed=1, norm="post-layernorm")


def test_a_bad_norm_option_is_refused_before_any_query():
    calls = []
    with pytest.raises(ValueError, match="norm must be one of"):
        mx.extract(lambda batch: calls.append(batch), 8, heads=1, norm="batchnorm")
    with pytest.raises(ValueError, match="inner_schedule"):
        mx.extract(lambda batch: calls.append(batch), 8, heads=1, norm="auto", inner_schedule="rotary")
    assert not calls


#: the rotary decoder layers whose sublayer goes into their class: (family, its settings); Mistral's window
#: shorter than the sequences, Qwen2's key bias (its sublayer is not learned, but a model goes into it)
ROTARY_BLOCK_CASES = {"llama": {}, "mistral": {"sliding_window": 4}, "qwen2": {}}


@pytest.mark.parametrize("family", ROTARY_BLOCK_CASES)
def test_the_folded_rotary_model_is_the_sublayer_at_every_position_and_saves_and_exports(family):
    settings = ROTARY_BLOCK_CASES[family]
    layer = rotary_block(8, 2, kv_heads=1, family=family, **settings)
    sublayer = RotarySublayerFloat64(layer)
    truth = rotary_truth(layer)
    assert truth.attention.window == settings.get("sliding_window")
    assert (truth.attention.key_bias is not None) == (family == "qwen2")
    sequences = raw_sequences(np.random.default_rng(0), 8, 6, longest=12)
    assert every_position_error(truth, sublayer, sequences, causal=True) < 1e-12
    if family != "qwen2":  # the adapter runs the block's own modules: their RMSNorm computes in float32
        assert every_position_error(truth, attention_sublayer(layer), sequences, causal=True) < 1e-5
    with pytest.raises(ValueError, match="float64"):
        truth(sequences, dtype=np.float32)
    part, _ = truth.to_document()
    again = model_from_document(part)
    assert mx.compare(again, truth).max_rel == 0
    X = torch.as_tensor(sequences[-1])[None]
    with torch.no_grad():
        assert float((to_torch(truth)(X) - sublayer(X)).abs().max()) < 1e-12
    fresh = rotary_block(8, 2, kv_heads=1, seed=5, family=family, **settings)
    fresh.load_state_dict(to_state_dict(truth, like=fresh), strict=False)
    assert bool(fresh.input_layernorm.weight.detach().eq(1).all())  # gamma lives in the heads
    with torch.no_grad():
        assert float((RotarySublayerFloat64(fresh)(X) - sublayer(X)).abs().max()) < 1e-12


def test_a_qwen2_sublayer_is_refused_by_name_before_any_query():
    # its key bias: the rotary learner's key-neutral search starts from a token outside the norm's ball
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="Qwen2DecoderLayer.*key_bias=True"):
        attention_sublayer(rotary_block(8, 2, kv_heads=1, family="qwen2"))


def test_a_rotary_sublayer_export_is_refused_where_the_block_cannot_carry_it():
    truth = rotary_truth(rotary_block(8, 2, kv_heads=1))
    other_eps = NormedAttention(truth.norm, 1e-5, truth.attention, truth.R)
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="rms_norm_eps"):
        to_state_dict(other_eps, like=rotary_block(8, 2, kv_heads=1))
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="LayerNorm"):
        to_state_dict(truth, like=gpt2_block(8, 2))
    windowed = rotary_truth(rotary_block(8, 2, kv_heads=1, family="mistral", sliding_window=4))
    with pytest.raises(mx.adapters.export.UnsupportedLayerError, match="sliding_window"):
        to_state_dict(windowed, like=rotary_block(8, 2, kv_heads=1, family="mistral", sliding_window=6))


def test_positions_rotary_is_refused_with_options_it_cannot_take():
    oracle = TorchOracle(RotarySublayerFloat64(rotary_block(8, 2, kv_heads=1)))
    with pytest.raises(ValueError, match="RMSNorm"):
        mx.extract(oracle, 8, heads=2, norm="layernorm", positions="rotary")
    with pytest.raises(ValueError, match="inner_schedule"):
        mx.extract(oracle, 8, heads=2, norm="auto", positions="rotary", inner_schedule="paper")
    with pytest.raises(ValueError, match="positions"):
        mx.extract(oracle, 8, heads=2, norm="auto", positions="alibi")


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_sweeps_take_a_float64_block_whose_norm_computes_in_float32_as_float32_answers(family):
    # LlamaRMSNorm and MistralRMSNorm compute in float32 inside a float64 layer: the eps readings spread by float32
    # rounding, measured and named; the exact float64 sublayer of the same weights is not taken so
    layer = rotary_block(8, 2, kv_heads=1, family=family)
    as_run = measure(OracleBoundary(TorchOracle(attention_sublayer(layer)), 8), 8, "auto", np.random.default_rng(0),
                     "float64")
    noise = next(check for check in as_run.checks if check.name == "answer_noise")
    assert noise.passed and 1e-12 < noise.value < 1e-5 and "LlamaRMSNorm" in noise.message
    assert as_run.unit == 2.0 ** -24 and as_run.noise == noise.value and all(c.passed for c in as_run.checks)
    assert abs(as_run.eps - layer.input_layernorm.variance_epsilon) / layer.input_layernorm.variance_epsilon < 1e-6
    exact = measure(OracleBoundary(TorchOracle(RotarySublayerFloat64(layer)), 8), 8, "auto", np.random.default_rng(0),
                    "float64")
    assert exact.noise is None and exact.unit == 2.0 ** -53 and "answer_noise" not in [c.name for c in exact.checks]


@pytest.mark.slow
def test_a_llama_sublayer_as_transformers_runs_it_is_extracted_to_its_answers_precision():
    # a float64 LlamaDecoderLayer computes its RMSNorm and rotary angles in float32: judged against the sublayer
    # computed exactly in float64 from its weights, at every position of fresh raw sequences
    d, H = 16, 4
    layer = rotary_block(d, H, kv_heads=2)
    result = mx.extract(TorchOracle(attention_sublayer(layer)), d, heads=H, seed=1, norm="auto", positions="rotary")
    assert result.ok and result.norm == "rmsnorm" and result.largest_inner_token < np.sqrt(d)
    noise = next(check for check in result.checks if check.name == "answer_noise")
    assert "computes in float32" in noise.message and "LlamaRMSNorm" in noise.message
    exact = RotarySublayerFloat64(layer)
    error = every_position_error(result.model, exact, raw_sequences(np.random.default_rng(5), d, 100), causal=True)
    assert error < 2e-6 and result.error_estimate >= error
    assert mx.compare(result.model, rotary_truth(layer)).max_rel < 2e-6


@pytest.mark.slow
def test_the_llama_sublayer_is_extracted_with_norm_auto_and_positions_rotary():
    d, H = 16, 4
    layer = rotary_block(d, H, kv_heads=2)
    sublayer = RotarySublayerFloat64(layer)
    result = mx.extract(TorchOracle(sublayer), d, heads=H, seed=1, norm="auto", positions="rotary")
    assert result.ok and result.norm == "rmsnorm" and result.schedule == "norm"
    assert result.largest_inner_token < np.sqrt(d)
    truth = rotary_truth(layer)
    assert abs(result.eps - truth.eps) / truth.eps < 1e-12
    assert mx.compare(result.model, truth).max_rel < 1e-11
    sequences = raw_sequences(np.random.default_rng(3), d, 20)
    assert every_position_error(result.model, sublayer, sequences, causal=True) < 1e-11
    X = torch.as_tensor(sequences[-1])[None]
    fresh = rotary_block(d, H, kv_heads=2, seed=7)
    fresh.load_state_dict(to_state_dict(result, like=fresh), strict=False)
    with torch.no_grad():
        assert float((to_torch(result)(X) - sublayer(X)).abs().max() / sublayer(X).abs().max()) < 1e-11
        assert float((RotarySublayerFloat64(fresh)(X) - sublayer(X)).abs().max() / sublayer(X).abs().max()) < 1e-11


@pytest.mark.slow
def test_positions_rotary_alone_hands_a_llama_sublayer_to_the_norm_learner():
    d, H = 16, 4
    layer = rotary_block(d, H, kv_heads=2)
    sublayer = RotarySublayerFloat64(layer)
    result = mx.extract(TorchOracle(sublayer), d, heads=H, seed=1, positions="rotary")
    assert result.ok and result.schedule == "norm" and result.norm == "rmsnorm"
    assert "norm learner" in result.schedule_reason and result.split_queries > 0
    assert every_position_error(result.model, sublayer, raw_sequences(np.random.default_rng(4), d, 10), True) < 1e-11


@pytest.mark.slow
def test_a_mistral_sublayer_with_its_sliding_window_is_extracted_and_exported():
    # the window (16 tokens, the instances' 13 fit in it) is found behind the norm; judged on sequences longer
    # than the window and than any query asked
    d, H = 16, 4
    layer = rotary_block(d, H, kv_heads=2, family="mistral", sliding_window=16)
    sublayer = RotarySublayerFloat64(layer)
    result = mx.extract(TorchOracle(sublayer), d, heads=H, seed=1, norm="auto", positions="rotary")
    assert result.ok and result.norm == "rmsnorm" and result.largest_inner_token < np.sqrt(d)
    truth = rotary_truth(layer)
    assert result.model.attention.window == 16 and abs(result.eps - truth.eps) / truth.eps < 1e-12
    assert mx.compare(result.model, truth).max_rel < 1e-11
    sequences = raw_sequences(np.random.default_rng(3), d, 12, longest=2 * result.max_query_length)
    error = every_position_error(result.model, sublayer, sequences, causal=True)
    assert error < 1e-11 and result.error_estimate >= error
    X = torch.as_tensor(sequences[-1])[None]
    fresh = rotary_block(d, H, kv_heads=2, seed=7, family="mistral", sliding_window=16)
    fresh.load_state_dict(to_state_dict(result, like=fresh), strict=False)
    assert _relative_every_position(RotarySublayerFloat64(fresh), sublayer, X) < 1e-11


def test_a_mistral_window_shorter_than_the_instances_fails_naming_it():
    # H = 4: the instances take 2 H + 5 = 13 tokens, which a window of 8 cannot hold (as on the attention alone)
    sublayer = RotarySublayerFloat64(rotary_block(16, 4, kv_heads=2, family="mistral", sliding_window=8))
    with pytest.raises(NormedExtractionError, match="window of 8 tokens is shorter than the schedule's instances"):
        mx.extract(TorchOracle(sublayer), 16, heads=4, seed=1, norm="auto", positions="rotary")


@pytest.mark.slow
def test_a_float32_bert_attention_is_nearer_its_exact_layer_than_the_layer_itself():
    # d = 32, H = 2: head size 16, so the layer's 1/sqrt(16) is exact in float32. The truth: the layer's own
    # float32 weights evaluated in float64 (the test's algebra), at every position of fresh raw sequences.
    d, H = 32, 2
    layer = bert_attention(d, H).float()
    sublayer = attention_sublayer(layer)
    exact = post_norm_truth(bert_attention(d, H).float().double())
    result = mx.extract(TorchOracle(sublayer), d, heads=H, seed=1, norm="auto")
    assert result.ok and result.norm == "post-layernorm"
    sequences = raw_sequences(np.random.default_rng(11), d, 40)
    def exact_layer(X):
        return torch.as_tensor(exact.every_position(X[0].numpy(), False))[None]

    error = every_position_error(result.model, exact_layer, sequences, causal=False)
    own = every_position_error(exact, lambda X: sublayer(X.float()).double(), sequences, causal=False)
    assert error <= result.error_estimate
    assert error < own / 2 and error < 2e-5  # closer to the exact layer than its own float32 evaluation
