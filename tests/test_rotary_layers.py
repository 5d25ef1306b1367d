"""Real rotary layers (issue 40): Hugging Face Llama, Mistral and Qwen2 attention as oracles
(:class:`RotaryLayer`), their float64 truth from the weights (:func:`to_rotary`), and rotary models
back as torch layers (:func:`to_torch_rotary`). The truth is the layer's own model class run in
transformers, and a float64 reference written here from the weights."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.rotary import (  # noqa: E402
    RotaryLayer, causal_mask, float64_layer, to_rotary, to_torch_rotary)
from mhaextract.adapters.torch import TorchOracle, UnsupportedLayerError  # noqa: E402


def trained_like(module, seed, bias_scale=0.5):
    """Weights N(0, 1/d) (scores of unit tokens of order one, as in trained layers), biases N(0, bias_scale^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            scale = bias_scale if name.endswith("bias") else parameter.shape[-1] ** -0.5
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * scale)
    return module


def config(kind, d=64, H=4, H_kv=2, r=16, implementation="sdpa", **options):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    Config = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    options.setdefault("num_hidden_layers", 1)
    return Config(hidden_size=d, num_attention_heads=H, num_key_value_heads=H_kv, head_dim=r, intermediate_size=8,
                  vocab_size=4, attn_implementation=implementation, **options)


def attention(kind, seed=0, layer_idx=0, dtype=torch.float64, key_bias=False, **options):
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    Attention = {"llama": LlamaAttention, "mistral": MistralAttention, "qwen2": Qwen2Attention}[kind]
    layer = trained_like(Attention(config(kind, **options), layer_idx=layer_idx).double(), seed)
    if kind == "qwen2" and not key_bias:
        with torch.no_grad():
            layer.k_proj.bias.zero_()
    return layer.to(dtype)


def sequences(d, count=50, longest=64, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(int(n), d)) for n in rng.integers(1, longest + 1, count)]


def reference(layer, X, window=None):
    """The layer's final-token output written from its weights in float64 as transformers computes it
    (q/k/v projections with biases, rotate_half at absolute positions 0..N-1 with float64 angles from
    the rotary embedding's inv_freq, grouped key/value heads, softmax over the window, o_proj)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    weights = {name: p.detach().double().numpy() for name, p in layer.named_parameters()}
    H, H_kv, r = layer.config.num_attention_heads, layer.config.num_key_value_heads, layer.head_dim
    inv_freq = LlamaRotaryEmbedding(layer.config).inv_freq.double().numpy()
    N = len(X)
    angles = np.arange(N)[:, None] * np.concatenate([inv_freq, inv_freq])[None]

    def project(name, heads):
        out = X @ weights[f"{name}.weight"].T + weights.get(f"{name}.bias", 0.0)
        return out.reshape(N, heads, r)

    def rope(v):  # (N, heads, r)
        rotated = np.concatenate([-v[..., r // 2:], v[..., : r // 2]], axis=-1)
        return v * np.cos(angles)[:, None] + rotated * np.sin(angles)[:, None]

    q, k, v = rope(project("q_proj", H)), rope(project("k_proj", H_kv)), project("v_proj", H_kv)
    heads = []
    for h in range(H):
        g = h // (H // H_kv)
        scores = k[:, g] @ q[-1, h] * r ** -0.5
        if window is not None:
            scores[: max(0, N - window)] = -np.inf
        a = np.exp(scores - scores.max())
        heads.append((a / a.sum()) @ v[:, g])
    return np.concatenate(heads) @ weights["o_proj.weight"].T + weights.get("o_proj.bias", 0.0)


def relative(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


# -- RotaryLayer is the layer inside its model ----------------------------------------------------

def sublayer_in_model(kind, implementation, dtype, **options):
    """A one-layer model of the family; returns the model, its attention, and the attention's
    hidden states in and output out on a batch, captured by hooks in the model's own forward."""
    from transformers.models.llama.modeling_llama import LlamaModel
    from transformers.models.mistral.modeling_mistral import MistralModel
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model
    Model = {"llama": LlamaModel, "mistral": MistralModel, "qwen2": Qwen2Model}[kind]
    torch.manual_seed(0)
    model = Model(config(kind, implementation=implementation, **options)).to(dtype)
    sublayer = trained_like(model.layers[0].self_attn.double(), seed=3).to(dtype)
    seen = {}
    hooks = [sublayer.register_forward_pre_hook(
                 lambda m, args, kwargs: seen.__setitem__("in", kwargs.get("hidden_states", args[0] if args else None)),
                 with_kwargs=True),
             sublayer.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out[0]))]
    with torch.no_grad():
        model(inputs_embeds=torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(4)).to(dtype))
    for hook in hooks:
        hook.remove()
    return model, sublayer, seen["in"], seen["out"]


@pytest.mark.parametrize("kind, options", [
    ("llama", {}), ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0})])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_wrapped_layer_is_the_attention_inside_its_model(kind, options, implementation, dtype):
    model, sublayer, hidden, out = sublayer_in_model(kind, implementation, dtype, **options)
    with torch.no_grad():
        mine = RotaryLayer(sublayer, rotary_embedding=model.rotary_emb)(hidden)
    assert RotaryLayer(sublayer).window == options.get("sliding_window")
    assert mine.dtype == dtype and mine.shape == out.shape
    tolerance = 4 * torch.finfo(dtype).eps * float(out.abs().max())
    assert float((mine - out).abs().max()) <= tolerance


def test_the_mask_is_additive_with_the_window_counting_the_final_token():
    mask = causal_mask(5, window=2, dtype=torch.float64)
    assert mask.shape == (1, 1, 5, 5)
    seen = mask[0, 0] == 0
    assert seen.tolist() == [[j in (i - 1, i) and j >= 0 for j in range(5)] for i in range(5)]
    assert float(mask[0, 0, 4, 0]) == torch.finfo(torch.float64).min


# -- to_rotary: the exact model from the weights --------------------------------------------------

EXACT_CASES = [pytest.param("llama", {}, id="llama"),
               pytest.param("mistral", {"sliding_window": 8}, id="mistral-w8"),
               pytest.param("mistral", {"sliding_window": 16}, id="mistral-w16"),
               pytest.param("qwen2", {}, id="qwen2-biases")]


@pytest.mark.parametrize("kind, options", EXACT_CASES)
def test_to_rotary_is_the_float64_layer(kind, options):
    layer = attention(kind, seed=0, **options)
    truth = to_rotary(layer)
    assert truth.window == options.get("sliding_window") and truth.heads == 4 and truth.d_out == 64
    batch = sequences(64)
    answers = TorchOracle(RotaryLayer(layer, angles="float64"))(batch)
    assert relative(truth(batch), answers) <= 1e-12
    written = np.array([reference(layer, X, options.get("sliding_window")) for X in batch[:10]])
    assert relative(truth(batch[:10]), written) <= 1e-12
    assert relative(answers[:10], written) <= 1e-12


def test_grouped_heads_share_keys_and_values_and_the_query_bias_is_read():
    layer = attention("qwen2", seed=2)
    truth = to_rotary(layer)
    assert np.array_equal(truth.K[0], truth.K[1]) and not np.array_equal(truth.K[1], truth.K[2])
    assert np.abs(truth.b).max() > 0.1 and np.abs(truth.c).max() > 0.1


def test_the_attention_scaling_of_the_rotary_embedding_scales_every_score():
    options = {"max_position_embeddings": 128,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 32}}
    layer = attention("llama", seed=5, **options)
    exact = RotaryLayer(layer, angles="float64")
    assert exact.rotary_embedding.attention_scaling > 1.1
    batch = sequences(64, count=20)
    assert relative(to_rotary(layer)(batch), TorchOracle(exact)(batch)) <= 1e-12


def test_a_key_bias_is_read_into_the_model_and_matters():
    layer = attention("qwen2", seed=1, key_bias=True)
    truth = to_rotary(layer)
    assert truth.key_bias is not None and np.array_equal(truth.key_bias[0], truth.key_bias[1])  # one per group
    batch = sequences(64, count=10)
    written = np.array([reference(layer, X) for X in batch])
    assert relative(truth(batch), written) <= 1e-12
    assert relative(TorchOracle(float64_layer(layer))(batch), written) <= 1e-12
    assert relative(truth.replaced(key_bias=None)(batch), written) > 1e-3  # the key bias matters
    assert to_rotary(attention("qwen2", seed=1)).key_bias is None         # none where it is zero


def test_qwen2_slides_only_on_its_sliding_layers():
    options = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 2}
    assert config("qwen2", **options).layer_types == ["full_attention", "sliding_attention"]
    full, sliding = (attention("qwen2", layer_idx=i, **options) for i in (0, 1))
    assert RotaryLayer(full).window is None and to_rotary(full).window is None
    assert RotaryLayer(sliding).window == 8 and to_rotary(sliding).window == 8
    assert RotaryLayer(full, window=5).window == 5 and to_rotary(full, window=5).window == 5


@pytest.mark.parametrize("window", [8, 16])
def test_the_window_changes_the_outputs_past_its_length_only(window):
    layer = attention("mistral", seed=3, sliding_window=window)
    windowed = TorchOracle(RotaryLayer(layer, angles="float64"))
    unlimited = TorchOracle(RotaryLayer(layer, window=10 ** 6, angles="float64"))
    rng = np.random.default_rng(0)
    for length in range(1, 3 * window):
        X = [rng.normal(size=(length, 64))]
        difference = relative(windowed(X), unlimited(X))
        assert difference == 0.0 if length <= window else difference > 1e-3
    assert to_rotary(layer, window=10 ** 6).window == 10 ** 6


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_lower_precision_layers_answer_within_their_precision(dtype, tolerance):
    layer = attention("llama", seed=4, dtype=dtype)
    oracle = TorchOracle(RotaryLayer(layer))
    assert oracle.answer_dtype == str(dtype).removeprefix("torch.")
    batch = sequences(64, count=20)
    assert relative(oracle(batch), to_rotary(layer)(batch)) <= tolerance


def test_the_model_angles_are_float32_and_the_float64_angles_exact():
    """transformers computes cos and sin in float32: a float64 layer inside its model is not exact."""
    layer = attention("llama", seed=0)
    batch = sequences(64, count=20, longest=256)
    truth = to_rotary(layer)(batch)
    assert 1e-10 < relative(TorchOracle(RotaryLayer(layer))(batch), truth) < 1e-5
    assert relative(TorchOracle(RotaryLayer(layer, angles="float64"))(batch), truth) <= 1e-12


def test_sequences_are_batched_by_length():
    layer = attention("mistral", seed=6, sliding_window=8)
    batch = sequences(64, count=12, longest=12)
    oracle = TorchOracle(RotaryLayer(layer))
    together = oracle(batch)
    assert oracle.calls == len({len(X) for X in batch})
    alone = np.array([TorchOracle(RotaryLayer(layer))([X])[0] for X in batch])
    assert relative(together, alone) <= 1e-14


def test_bad_layers_and_options_are_named():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    with pytest.raises(TypeError, match="LlamaAttention.*not GPT2Attention"):
        RotaryLayer(GPT2Attention(GPT2Config(n_embd=8, n_head=2), layer_idx=0))
    with pytest.raises(TypeError, match="not Linear"):
        to_rotary(torch.nn.Linear(4, 4))
    layer = attention("llama", d=16, H=2, H_kv=1, r=8)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        RotaryLayer(layer, window=0)
    with pytest.raises(ValueError, match="angles must be one of"):
        RotaryLayer(layer, angles="float32")
    with pytest.raises(ValueError, match=r"hidden states of shape \(B, N, d\)"):
        RotaryLayer(layer)(torch.zeros(5, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="d = 16"):
        RotaryLayer(layer)(torch.zeros(1, 5, 12, dtype=torch.float64))
    with pytest.raises(TypeError, match="rotary_embedding must be"):
        RotaryLayer(layer, rotary_embedding=3)
    dynamic = attention("llama", d=16, H=2, H_kv=1, r=8,
                        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedLayerError, match="'dynamic' changes its frequencies"):
        to_rotary(dynamic)
    with pytest.raises(UnsupportedLayerError, match="'dynamic' changes its frequencies"):
        RotaryLayer(dynamic, angles="float64")
    assert RotaryLayer(dynamic)(torch.zeros(1, 3, 16, dtype=torch.float64)).shape == (1, 3, 16)  # as in its model


# -- to_torch_rotary: every position --------------------------------------------------------------

@pytest.mark.parametrize("d_out, window, bias", [(None, None, True), (5, 6, True), (5, None, False)])
def test_the_exported_layer_is_the_model_on_every_prefix(d_out, window, bias):
    model = mx.RotaryAttention.random(d=8, heads=4, head_width=6, seed=0, kv_heads=2, d_out=d_out, bias=bias,
                                      window=window)
    X = np.random.default_rng(2).normal(size=(3, 20, 8))
    with torch.no_grad():
        out = to_torch_rotary(model)(torch.as_tensor(X)).numpy()
    assert out.shape == (3, 20, 1 if d_out is None else d_out)
    for i in range(20):
        expected = model(X[:, : i + 1])
        assert relative(out[:, i] if d_out else out[:, i, 0], expected) <= 1e-12


@pytest.mark.parametrize("kind, options", [("llama", {}), ("mistral", {"sliding_window": 8}),
                                           ("qwen2", {"key_bias": True})])
def test_the_exported_truth_is_the_hugging_face_layer_at_every_position(kind, options):
    layer = attention(kind, seed=7, **options)
    X = torch.as_tensor(np.random.default_rng(3).normal(size=(4, 40, 64)))
    with torch.no_grad():
        exported = to_torch_rotary(to_rotary(layer))(X)
        original = RotaryLayer(layer, angles="float64")(X)
    assert relative(exported.numpy(), original.numpy()) <= 1e-12


def test_an_encoder_export_sees_every_token_and_refuses_a_window():
    model = mx.RotaryAttention.random(d=4, heads=2, head_width=4, seed=1, d_out=3)
    X = torch.as_tensor(np.random.default_rng(0).normal(size=(1, 6, 4)))
    with torch.no_grad():
        causal, encoder = to_torch_rotary(model)(X), to_torch_rotary(model, causal=False)(X)
    assert relative(encoder[0, -1].numpy(), causal[0, -1].numpy()) <= 1e-14
    assert relative(encoder[0, 0].numpy(), causal[0, 0].numpy()) > 1e-3
    with pytest.raises(ValueError, match="causal=False with the model's window"):
        to_torch_rotary(mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0, window=3), causal=False)
    with pytest.raises(TypeError, match="expected a RotaryAttention"):
        to_torch_rotary(mx.MultiHeadAttention.random(d=4, heads=1, seed=0))


# -- end to end: extraction against the real layer ------------------------------------------------

def fresh_error(result, truth, longest=256, count=100):
    rng = np.random.default_rng(11)
    batch = [rng.normal(size=(int(n), truth.d)) * truth.d ** -0.25 for n in rng.integers(1, longest + 1, count)]
    return relative(result.model(batch), truth(batch))


@pytest.mark.slow
@pytest.mark.parametrize("kind, options", [("llama", {}), ("mistral", {"sliding_window": 8}),
                                           ("mistral", {"sliding_window": 16})])
def test_a_one_head_layer_is_extracted_through_the_adapter(kind, options):
    layer = attention(kind, seed=0, d=16, H=1, H_kv=1, r=8, **options)
    oracle = TorchOracle(RotaryLayer(layer, angles="float64"))
    result = mx.extract(oracle, d=16, heads=1, positions="rotary", seed=0, schedule="rotary")
    assert result.ok and result.window == options.get("sliding_window")
    assert result.queries == oracle.sequences
    truth = to_rotary(layer)  # whole-output answers: the result is the whole layer
    assert result.model.d_out == truth.d_out == 16
    assert mx.compare(result.model, truth).max_rel <= 1e-10
    assert mx.compare(result.scalar_model, truth.readout(result.readout)).max_rel <= 1e-10
    assert fresh_error(result, truth) <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}],
                         ids=["full", "sliding-16"])
def test_a_qwen2_layer_with_its_key_bias_is_extracted_whole(options):
    layer = attention("qwen2", seed=3, key_bias=True, d=16, H=2, H_kv=1, r=8, **options)
    oracle = TorchOracle(RotaryLayer(layer, angles="float64"))
    result = mx.extract(oracle, d=16, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    assert result.ok and result.queries == oracle.sequences and result.window == options.get("sliding_window")
    truth = to_rotary(layer)
    error = mx.compare(result.model, truth).max_rel
    assert error <= 1e-10 and error <= 10 * result.error_estimate
    assert fresh_error(result, truth) <= 1e-10
    with pytest.raises(mx.ExtractionError, match="key_bias=True") as failed:  # without the option: loudly wrong
        mx.extract(oracle, d=16, heads=2, positions="rotary", seed=0, schedule="rotary")
    # the zero token's key bias leaves misfits far above float32 rounding: not read as noisy answers
    assert "answer_noise" not in [check.name for check in failed.value.extraction.checks]
    split = mx.extract(oracle, d=16, heads=2, positions="rotary", seed=0)  # auto: the split learns the key bias unasked
    assert split.schedule == "rotary-split" and split.ok and split.window == options.get("sliding_window")
    assert fresh_error(split, truth) <= 1e-10


@pytest.mark.slow
def test_a_float32_layer_with_a_key_bias_is_extracted_through_large_query_finals():
    """Issue 40, acceptance 2's float32 line with Qwen2's biases: from float32 answers the
    key-neutral token comes from the large-query search (docs/algorithm.md, 'From float32 answers'), whose
    token leaves keys far below the biases; the run passes every check, within 1e-5 of the exact
    layer (float64, its float32 weights) on fresh sequences, with an estimate that does not
    understate. The blocks turning less than ``GENERATOR_LIMIT`` are fitted as generators first (the
    layer's theta = 1e-2 and 1e-3 in each head)."""
    from mhaextract.rotary.refine import GENERATOR_LIMIT
    layer = attention("qwen2", seed=3, key_bias=True, d=16, H=2, H_kv=1, r=8, dtype=torch.float32)
    oracle = TorchOracle(RotaryLayer(layer))
    result = mx.extract(oracle, d=16, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    assert result.ok and result.queries == oracle.sequences and result.neutral.large_queries
    assert result.diagnostics["generator_blocks"] == (to_rotary(layer).theta < GENERATOR_LIMIT).sum() == 4
    assert result.neutral.queries < result.queries
    truth = to_rotary(layer)
    key = np.einsum("hrd,d->hr", truth.K, result.neutral.token) + truth.key_bias
    assert np.abs(key).max() <= 1e-3 * np.abs(truth.key_bias).max()
    error = mx.compare(result.model, truth).max_rel
    assert error <= 1e-5 and error <= result.error_estimate
    assert fresh_error(result, truth) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_a_grouped_two_head_layer_is_extracted_whole(seed):
    layer = attention("llama", seed=seed, d=16, H=2, H_kv=1, r=8)
    oracle = TorchOracle(RotaryLayer(layer, angles="float64"))
    result = mx.extract(oracle, d=16, heads=2, positions="rotary", seed=seed)
    assert result.ok and result.queries == oracle.sequences
    truth = to_rotary(layer)
    error = mx.compare(result.model, truth).max_rel
    assert error <= 1e-10 and error <= 10 * result.error_estimate
    assert fresh_error(result, truth) <= 1e-10


@pytest.mark.slow
def test_a_whole_layers_outputs_place_the_instances_poles():
    """Four heads at d = 32: the instances' poles fitted to the read-out and 2H channels of the
    whole answers give a start model much closer to the layer than the read-out alone (measured on
    layers 0, 1, 2: 2.8e-6, 1.5e-6, 1.3e-8 against 6.0e-5, 2.7e-4, 8.1e-5); the same queries either way."""
    from mhaextract.oracle.boundary import OracleBoundary
    from mhaextract.oracle.vector_answers import VectorAnswers
    from mhaextract.rotary import learn

    d, H = 32, 4
    ratios = []
    for seed in range(3):
        layer = attention("llama", seed=seed, d=d, H=H, H_kv=2, r=8)
        oracle = TorchOracle(RotaryLayer(layer, angles="float64"))
        vectors = VectorAnswers(0)
        boundary = OracleBoundary(oracle, d, vectors=vectors)
        learner = learn.RotaryLearner(d, H, 0, token_scale=6.0, bias=True, rank=8)
        whole = boundary.ask(learn.instance_queries(learner.patterns(), learner.ks), whole=True)
        answers = vectors.scalars(whole)
        projection = learn.channel_projection(np.random.default_rng(0), whole.shape[1], H)
        assert projection.shape == (d, 2 * H) and np.allclose(projection.T @ projection, np.eye(2 * H))
        truth = to_rotary(layer).readout(vectors.readout)
        alone, _ = learner.learn(answers, 0.0)
        joint, _ = learner.learn(answers, 0.0, 2.0 ** -53, whole @ projection, np.zeros(2 * H))
        error_alone, error_joint = mx.compare(alone, truth).max_rel, mx.compare(joint, truth).max_rel
        assert error_joint <= 1e-5 and error_joint * 10 <= error_alone
        ratios.append(error_alone / error_joint)
    assert np.median(ratios) >= 100


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_float64_layer_computed_in_float32_is_extracted_to_its_answers_precision(implementation):
    """Issue 64, acceptance 2: transformers' float64 LlamaAttention as its model runs it (angles in
    float32, and on the eager path the softmax in float32) answers float64 numbers accurate to about
    1e-7. The run measures that noise from its own token-scale queries, says why, and extracts to
    it: every check passing, an estimate at the answers' precision, and the model's outputs on
    fresh sequences of 1..256 tokens no further from the exact float64 layer (``reference``, from
    the weights) than the estimate. The layer's exact float64 copy is still extracted to float64."""
    layer = attention("llama", seed=0, d=16, H=2, H_kv=1, r=8)
    layer.config._attn_implementation = implementation
    oracle = TorchOracle(RotaryLayer(layer, angles="model"))
    result = mx.extract(oracle, d=16, heads=2, positions="rotary", seed=0)
    assert result.ok and result.queries == oracle.sequences
    noise = [check for check in result.checks if check.name == "answer_noise"]
    assert len(noise) == 1 and noise[0].value > 1e-11 and "float32" in noise[0].message
    assert 1e-9 <= result.error_estimate <= 1e-4
    batch = [X * 16 ** -0.25 for X in sequences(16, count=30, longest=256, seed=5)]
    truth = np.array([reference(layer, X) for X in batch])
    own = relative(oracle(batch), truth)  # the layer's own deviation from its exact float64 version
    error = relative(result.model(batch), truth)
    assert 1e-10 <= own <= 1e-5 and error <= result.error_estimate
    exact = mx.extract(TorchOracle(float64_layer(layer)), d=16, heads=2, positions="rotary", seed=0)
    assert exact.ok and "answer_noise" not in [check.name for check in exact.checks]
    assert exact.error_estimate <= 1e-12 and relative(exact.model(batch), truth) <= 1e-12


@pytest.mark.slow
def test_float64_answers_computed_in_float32_unmeasured_fail_naming_the_cause():
    """With ``token_scale`` given the self instances that measure the answers' noise are not asked,
    and with ``key_bias=True`` they would carry the key-neutral token's misfit: the run judges the
    answers as float64 ones, fails, and names the float32 angles or softmax."""
    layer = attention("llama", seed=0, d=16, H=1, H_kv=1, r=8)
    layer.config._attn_implementation = "eager"
    with pytest.raises(mx.ExtractionError, match="rotary angles or softmax in float32") as failed:
        mx.extract(TorchOracle(RotaryLayer(layer)), d=16, heads=1, positions="rotary", seed=0, token_scale=2.0)
    assert not failed.value.extraction.ok


@pytest.mark.slow
def test_a_float32_grouped_layer_is_extracted_within_its_precision():
    """Issue 40, acceptance 2 in float32: the layer's float32 answers (its own float32 angles), its
    truth the exact layer in float64 from its float32 weights; outputs within 1e-5, every check
    passing with limits in units of the answers' rounding, and an estimate that does not understate."""
    layer = attention("llama", seed=0, d=16, H=2, H_kv=1, r=8, dtype=torch.float32)
    oracle = TorchOracle(RotaryLayer(layer))
    result = mx.extract(oracle, d=16, heads=2, positions="rotary", seed=0)
    assert result.ok and result.queries == oracle.sequences
    truth = to_rotary(layer)
    error = mx.compare(result.model, truth).max_rel
    assert error <= 1e-5 and error <= result.error_estimate
    assert fresh_error(result, truth) <= 1e-5


@pytest.mark.slow
def test_a_float32_layer_of_four_grouped_heads_is_extracted_within_its_precision():
    """Acceptance 1's shape (d = 32, four heads of width 8 in two key/value groups) in float32: the
    instances' log-scores carry noise of about 1e-3, so the matching's limit follows their median
    misfit, the head width is the largest fall of the completion's misfit, and spare tokens stand
    in for those that lose too many entries; the refinement takes the start to the answers'
    rounding."""
    layer = attention("llama", seed=0, d=32, H=4, H_kv=2, r=8, dtype=torch.float32)
    oracle = TorchOracle(RotaryLayer(layer))
    result = mx.extract(oracle, d=32, heads=4, positions="rotary", seed=0, schedule="rotary")
    assert result.ok and result.queries == oracle.sequences
    assert result.diagnostics["widths"] == [8] * 4
    truth = to_rotary(layer)
    error = mx.compare(result.model, truth).max_rel
    assert error <= 1e-5 and error <= result.error_estimate
    assert fresh_error(result, truth) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_answers_coarser_than_float32_are_refused_before_the_instances(dtype):
    """At 8 or 11 bits the instances give no start: the run says so, naming the precision and what
    to try, before it asks the instances' queries."""
    layer = attention("llama", seed=0, d=16, H=2, H_kv=1, r=8, dtype=dtype)
    oracle = TorchOracle(RotaryLayer(layer))
    with pytest.raises(mx.ExtractionError, match="(?s)answer_precision.*too coarse.*float32") as caught:
        mx.extract(oracle, d=16, heads=2, positions="rotary", seed=0)
    assert caught.value.extraction.model is None and oracle.sequences < 100  # c and the window search only
