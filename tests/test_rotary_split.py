"""The rotary split (``schedule="rotary-split"``, mhaextract.rotary.split; docs/algorithm.md, 'Rotary
layers from whole answers'): its closed-form Jacobian against central differences, its head groups, and
runs on layers whose truth the test computes itself (torch modules of known weights, their outputs at
every position), including its fallback to the grid route."""

import numpy as np
import pytest

import mhaextract as mx
from conftest import CountingOracle
from mhaextract.rotary.split import head_groups
from mhaextract.rotary.whole_fit import NAMES, WholeAnswers, parameter_count


def _parameters(rng, heads=4, groups=2, r=4, d=6, d_out=5):
    return dict(Q=rng.normal(size=(heads, r, d)) * 0.4, b=rng.normal(size=(heads, r)) * 0.4,
                K=rng.normal(size=(groups, r, d)) * 0.4, k=rng.normal(size=(groups, r)) * 0.4,
                t=rng.uniform(0.0, 1.0, size=(groups, r // 2)), O=rng.normal(size=(heads, d_out, r)),
                P=rng.normal(size=(heads, r, d)), c=rng.normal(size=d_out))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_matrix_free_products_are_the_jacobian_of_the_answers(seed):
    """The residuals against the rotary model's own evaluation (a head's K_g read through its group);
    ``J v`` against central differences of the residuals, column by column; ``J^T w`` against the same
    columns. Sequences of 1..30 tokens: 19 and 30 are padded to 32 with tokens of no weight."""
    rng = np.random.default_rng(seed)
    p, labels = _parameters(rng), [0, 1, 1, 0]
    sequences = [rng.normal(size=(n, 6)) for n in (3, 7, 3, 1, 7, 7, 2, 19, 30)]
    answers = rng.normal(size=(len(sequences), 5))
    fit = WholeAnswers(sequences, answers, labels, {name: p[name].shape for name in NAMES})
    x = fit.flat(p)
    assert len(x) == parameter_count(6, 5, 4, 2, 4)
    model = mx.RotaryAttention(p["Q"], p["K"][labels], p["t"][labels], np.einsum("hor,hrd->hod", p["O"], p["P"]),
                               p["c"], b=p["b"], key_bias=p["k"][labels])
    expected = (model([sequences[i] for i in fit.order]) - answers[fit.order]).ravel()
    residuals = fit.residuals(x, keep=True)
    assert np.abs(residuals - expected).max() <= 1e-12 * np.abs(expected).max()
    eye = np.eye(len(x))
    J = np.stack([fit.jvp(e) for e in eye], axis=-1)
    step = 1e-6
    numeric = np.stack([(fit.residuals(x + step * e) - fit.residuals(x - step * e)) / (2 * step) for e in eye],
                       axis=-1)
    assert np.abs(numeric - J).max() <= 1e-7 * np.abs(J).max()
    transposed = np.stack([fit.vjp(e) for e in np.eye(len(residuals))])
    assert np.abs(transposed - J).max() <= 1e-13 * np.abs(J).max()


def test_heads_sharing_a_value_row_space_are_one_group():
    rng = np.random.default_rng(5)
    shared, other = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    P = [shared, other, rng.normal(size=(3, 3)) @ shared, rng.normal(size=(3, 3)) @ other]
    assert head_groups(P) == [0, 1, 0, 1]
    P[2] = P[2] + 1e-2 * rng.normal(size=(3, 8))
    assert head_groups(P) == [0, 1, 2, 1]


torch = pytest.importorskip("torch")


def _llama_layer(d, heads, kv_heads, seed, dtype, window=None, key_bias=False, implementation="sdpa", angles=None):
    """A random transformers Llama (Mistral with a window, Qwen2 with a key bias) attention layer of
    std-0.2 weights, as its model runs it (``angles``: "model", the model's own rotary embedding,
    computed in float32; by default float64 angles for a float64 layer), and its exact float64 copy."""
    import transformers

    from mhaextract.adapters.rotary import RotaryLayer, float64_layer
    torch.manual_seed(seed)
    family = "qwen2" if key_bias else ("mistral" if window else "llama")
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[family]
    extra = {"sliding_window": window} if window else {}
    config = config_class(hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          intermediate_size=2 * d, num_hidden_layers=1, vocab_size=16,
                          attn_implementation=implementation, **extra)
    module = {"llama": transformers.models.llama.modeling_llama.LlamaAttention,
              "mistral": transformers.models.mistral.modeling_mistral.MistralAttention,
              "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2Attention}[family](config, layer_idx=0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)
    module = module.to(dtype).eval()
    exact = {key: value.to(torch.float64) for key, value in module.state_dict().items()}
    copy = {"llama": transformers.models.llama.modeling_llama.LlamaAttention,
            "mistral": transformers.models.mistral.modeling_mistral.MistralAttention,
            "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2Attention}[family](config, layer_idx=0)
    copy = copy.to(torch.float64).eval()
    copy.config._attn_implementation = "sdpa"
    copy.load_state_dict(exact)
    angles = angles or ("float64" if dtype == torch.float64 else "model")
    return RotaryLayer(module, angles=angles), float64_layer(copy)


def _error_at_every_position(model, exact, d, count=12, seed=99, longest=128):
    rng, worst = np.random.default_rng(seed), 0.0
    for _ in range(count):
        X = rng.standard_normal((int(rng.integers(1, longest + 1)), d))
        with torch.no_grad():
            out = exact(torch.from_numpy(X)[None])
        reference = (out[0] if isinstance(out, tuple) else out)[0].numpy()
        mine = np.asarray(model([X[:i + 1] for i in range(len(X))]))
        worst = max(worst, float((np.abs(mine - reference).max(axis=1) / np.abs(reference).max(axis=1)).max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("dtype, family, target", [
    ("float64", dict(kv_heads=1), 1e-12),
    ("float64", dict(kv_heads=2, key_bias=True), 1e-12),
    ("float64", dict(kv_heads=2, window=24), 1e-12),
    ("float32", dict(kv_heads=2, key_bias=True), 1e-5),
])
def test_the_split_learns_a_torch_rotary_layer_at_every_position(dtype, family, target):
    layer, exact = _llama_layer(16, 4, seed=7, dtype=getattr(torch, dtype), **family)
    result = mx.extract(mx.TorchOracle(layer), d=16, heads=4, positions="rotary", schedule="rotary-split", seed=3)
    assert result.schedule == "rotary-split" and result.ok
    assert result.window == family.get("window")
    assert len(set(result.refinement.groups)) == family["kv_heads"]
    error = _error_at_every_position(result.model, exact, 16)
    assert error <= target
    assert result.error_estimate >= error  # the estimate never understates the error it claims


@pytest.mark.slow
@pytest.mark.parametrize("family, implementation", [(dict(kv_heads=2), "eager"), (dict(kv_heads=2, window=24), "sdpa"),
                                                    (dict(kv_heads=2, key_bias=True), "eager")])
def test_a_float64_layer_as_its_model_runs_it_is_extracted_to_its_answers_precision(family, implementation):
    """transformers computes a float64 layer's rotary angles (and the eager softmax) in float32: its answers
    are float64 numbers accurate to about 1e-7. The split's fit misses them by that much, says so
    (``answer_noise``) and judges them at float32's unit: an estimate no smaller than the error."""
    layer, exact = _llama_layer(16, 4, seed=7, dtype=torch.float64, implementation=implementation, angles="model",
                                **family)
    result = mx.extract(mx.TorchOracle(layer), d=16, heads=4, positions="rotary", seed=3)
    assert result.schedule == "rotary-split" and result.ok and result.answer_dtype == "float64"
    noise = next(check for check in result.checks if check.name == "answer_noise")
    assert "computes its rotary angles or softmax in float32" in noise.message and 1e-13 < noise.value < 1e-6
    error = _error_at_every_position(result.model, exact, 16)
    assert 1e-12 < error <= result.error_estimate <= 100 * error


def test_a_layer_the_split_cannot_read_falls_back_to_the_grid_route():
    layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=0)  # scalar answers: nothing to split
    result = mx.extract(mx.SimulatedOracle(layer), d=6, heads=2, positions="rotary", schedule="rotary-split", seed=1)
    assert result.schedule == "rotary" and result.ok
    assert "rotary-split: whole answers could not be split by head" in result.schedule_reason
    assert mx.compare(result.model, layer).max_rel < 1e-12


def test_the_split_refuses_what_it_cannot_learn_before_any_query():
    layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=0, d_out=6)
    oracle = CountingOracle(layer)
    with pytest.raises(ValueError, match="bias=False"):
        mx.extract(oracle, d=6, heads=2, positions="rotary", schedule="rotary-split", bias=False)
    with pytest.raises(ValueError, match="heads"):
        mx.extract(oracle, d=6, positions="rotary", schedule="rotary-split")
    assert oracle.calls == 0
