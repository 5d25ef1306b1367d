"""Issue 13: real layers with non-zero biases, the library's defaults only, ground truth from the weights."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, UnsupportedLayerError, to_reduced, to_torch  # noqa: E402


def with_biases(module, seed):
    """Every bias drawn with the std of the layer's weights (trained layers carry such biases)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weights = [p for n, p in module.named_parameters() if not n.endswith("bias")]
        std = float(torch.cat([p.flatten() for p in weights]).std())
        for name, parameter in module.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)
    return module.double().eval()  # no dropout in a reference computed from the module


def with_std(module, std, seed):
    """Every weight and bias drawn N(0, std^2) (seeded): a layer with weights of trained size."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)
    return module


def build(kind, d, H, seed, implementation="eager"):
    # Each Hugging Face model module is imported when first built (importing all four cost the
    # fast tier 5 s of collection).
    torch.manual_seed(seed)
    if kind == "nn.MultiheadAttention":
        layer = torch.nn.MultiheadAttention(d, H, batch_first=bool(seed % 2))
    elif kind == "GPT2Attention":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config
        layer = GPT2Attention(GPT2Config(n_embd=d, n_head=H, attn_implementation=implementation), layer_idx=0)
    elif kind == "BertSelfAttention":
        from transformers.models.bert.modeling_bert import BertConfig, BertSelfAttention
        layer = BertSelfAttention(BertConfig(hidden_size=d, num_attention_heads=H, attn_implementation=implementation))
    elif kind == "OPTAttention":  # OPT's eager path takes its softmax in float32: sdpa is the float64 layer
        from transformers.models.opt.modeling_opt import OPTAttention, OPTConfig
        layer = OPTAttention(OPTConfig(hidden_size=d, num_attention_heads=H, attn_implementation="sdpa"), layer_idx=0)
    else:
        from transformers.models.vit.modeling_vit import ViTAttention, ViTConfig
        layer = ViTAttention(ViTConfig(hidden_size=d, num_attention_heads=H, attn_implementation=implementation))
    return with_biases(layer, seed)


# The fast tier keeps nn.MultiheadAttention and GPT-2; BERT, OPT and ViT run in the full suite.
CASES = [pytest.param("nn.MultiheadAttention", 16, 2, "eager", id="nn.MultiheadAttention"),
         pytest.param("GPT2Attention", 16, 4, "sdpa", id="GPT2Attention", marks=pytest.mark.slow),
         pytest.param("BertSelfAttention", 16, 2, "eager", id="BertSelfAttention", marks=pytest.mark.slow),
         pytest.param("OPTAttention", 16, 2, "sdpa", id="OPTAttention", marks=pytest.mark.slow),
         pytest.param("ViTAttention", 16, 2, "sdpa", id="ViTAttention", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, d, H, implementation", CASES)
def test_a_biased_layer_is_extracted_with_the_defaults(kind, d, H, implementation):
    layer = build(kind, d, H, seed=0, implementation=implementation)
    r = np.random.default_rng(0).standard_normal(d)
    truth = to_reduced(layer, r)
    assert np.abs(truth.u).max() > 0 and truth.c != 0  # the biases reach the model
    oracle = TorchOracle(layer, r)
    result = mx.extract(oracle, d, heads=H, seed=0)
    assert result.ok and result.bias and result.calibration_queries > 0
    assert result.queries == oracle.sequences  # calibration included, measured at the oracle
    assert mx.compare(result.model, truth).max_rel <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nn.MultiheadAttention", "GPT2Attention", "BertSelfAttention", "OPTAttention",
                                  "ViTAttention"])
def test_larger_biased_layers(kind):
    d, H = 32, 8
    layer = build(kind, d, H, seed=1, implementation="sdpa")
    r = np.random.default_rng(1).standard_normal(d)
    result = mx.extract(TorchOracle(layer, r), d, heads=H, seed=1)
    assert result.ok and mx.compare(result.model, to_reduced(layer, r)).max_rel <= 1e-9


@pytest.mark.parametrize("kind, dtype, d, H", [
    pytest.param("nn.MultiheadAttention", "float64", 16, 2, id="nn.MHA-float64"),
    pytest.param("GPT2Attention", "float32", 16, 4, id="GPT2-float32", marks=pytest.mark.slow),
    pytest.param("BertSelfAttention", "float64", 32, 4, id="BERT-float64", marks=pytest.mark.slow),
    pytest.param("ViTAttention", "float32", 32, 8, id="ViT-float32", marks=pytest.mark.slow)])
def test_a_biased_layer_is_extracted_by_the_low_rank_schedule(kind, dtype, d, H):
    """Real heads have rank d / H: ``schedule="lowrank", rank=d // H, bias=True`` learns W, v, u and c
    with O(H r d) queries; float32 layers as well (the rank limit and the estimate sized to the
    answers' noise, docs/algorithm.md, 'Low-rank heads')."""
    layer = build(kind, d, H, seed=d + H, implementation="eager" if dtype == "float32" else "sdpa")
    r = np.random.default_rng(d + H).standard_normal(d)
    truth = to_reduced(layer, r)
    oracle = TorchOracle(layer.to(getattr(torch, dtype)), r)
    result = mx.extract(oracle, d, heads=H, seed=0, schedule="lowrank", rank=d // H, bias=True, token_scale="auto")
    error = mx.compare(result.model, truth).max_rel
    assert result.ok and result.bias and result.queries == oracle.sequences
    # float32: GPT-2 came out 2.8e-5 off with torch's AVX-512 kernels, 1.0e-4 with ATEN_CPU_CAPABILITY=default
    assert error <= (1e-10 if dtype == "float64" else 5e-4) and error <= result.error_estimate
    assert result.queries < 4 * H * d * d - 2 * H + 1  # fewer than the paper's full-rank count


class OwnAttention(torch.nn.Module):
    """A layer the library has never seen: heads of width 3 packed head-major in one (d, 3 H r)
    projection, its own temperature, biases on query, value and output, a 2-dimensional output."""

    def __init__(self, d=10, H=3, r=3, temperature=0.37, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.H, self.r, self.temperature = H, r, temperature
        self.qkv = torch.nn.Parameter(torch.randn(d, H, 3, r, generator=generator, dtype=torch.float64) / d**0.5)
        self.bias = torch.nn.Parameter(torch.randn(H, 3, r, generator=generator, dtype=torch.float64) * 0.3)
        self.out = torch.nn.Parameter(torch.randn(H, r, 2, generator=generator, dtype=torch.float64) / r**0.5)
        self.out_bias = torch.nn.Parameter(torch.randn(2, generator=generator, dtype=torch.float64))

    def forward(self, X):
        projected = torch.einsum("bnd,dhkr->bhknr", X, self.qkv) + self.bias[None, :, :, None]
        q, k, v = projected[:, :, 0], projected[:, :, 1], projected[:, :, 2]
        weights = torch.softmax(torch.einsum("bhnr,bhmr->bhnm", q, k) / self.temperature, dim=-1)
        heads = torch.einsum("bhnm,bhmr->bhnr", weights, v)
        return torch.einsum("bhnr,hro->bno", heads, self.out) + self.out_bias, weights

    def truth(self, readout):
        """The reduced model, from the weights (as a user's test would compute it)."""
        qkv, bias, out = (t.detach().numpy() for t in (self.qkv, self.bias, self.out))
        Wq, Wk, Wv = (qkv[:, :, n].transpose(1, 2, 0) for n in range(3))  # (H, r, d)
        W = np.einsum("hrd,hre->hde", Wk, Wq) / self.temperature
        u = np.einsum("hrd,hr->hd", Wk, bias[:, 0]) / self.temperature
        v = np.einsum("hrd,hro,o->hd", Wv, out, readout)
        c = float(readout @ (np.einsum("hr,hro->o", bias[:, 2], out) + self.out_bias.detach().numpy()))
        return mx.MultiHeadAttention(W, v, u, c)


def test_an_unseen_module_is_extracted_through_the_generic_path():
    module = OwnAttention()
    readout = np.array([0.8, -1.3])
    oracle = TorchOracle(module, readout)
    result = mx.extract(oracle, 10, heads=3, seed=0)
    truth = module.truth(readout)
    assert result.ok and mx.compare(result.model, truth).max_rel <= 1e-9
    X = np.random.default_rng(0).standard_normal((4, 5, 10))
    assert np.allclose(to_torch(result.model)(torch.as_tensor(X)).detach().numpy(), oracle(list(X)), rtol=1e-9)
    with pytest.raises(TypeError, match="OwnAttention"):  # ground truth needs the class; the oracle does not
        to_reduced(module, readout)


@pytest.mark.slow
def test_a_float32_layer_answers_in_float32_and_says_so():
    layer = build("GPT2Attention", 16, 2, seed=0).float()
    oracle = TorchOracle(layer, np.ones(16))
    assert oracle.answer_dtype == "float32" and oracle([np.zeros((3, 16))]).dtype == np.float32
    result = mx.extract(oracle, 16, heads=2, seed=0, on_failure="warn")
    assert result.answer_dtype == "float32"


@pytest.mark.slow
def test_a_layer_outside_the_model_class_fails_its_checks_and_is_refused_by_to_reduced():
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, dtype=torch.float64)
    with pytest.raises(UnsupportedLayerError, match="add_bias_kv"):
        to_reduced(layer, np.ones(8))
    with pytest.raises(mx.ExtractionError):
        mx.extract(TorchOracle(layer, np.ones(8)), 8, heads=2, seed=0)


@pytest.mark.slow
def test_a_float32_biased_layer_is_extracted():
    """A float32 BERT layer whose phase 1 used to read the offsets b_h 10..200 off (no model):
    ground truth from the float64 copy of the weights (docs/algorithm.md, 'Low-precision oracles: float32, mixed
    precision, bfloat16')."""
    d, H = 16, 4
    layer = build("BertSelfAttention", d, H, seed=0, implementation="eager").to(torch.float32)
    r = np.random.default_rng(0).standard_normal(d)
    truth = to_reduced(copy.deepcopy(layer).double(), r)
    result = mx.extract(TorchOracle(layer, r), d, heads=H, seed=0, on_failure="warn")
    assert result.ok, [check.name for check in result.failed_checks]
    assert mx.compare(result.model, truth).max_rel <= 1e-5


@pytest.mark.slow
def test_a_float32_layer_whose_first_group_needs_its_aim_corrected_round_by_round():
    """A float32 OPT layer (d = 32, H = 8, seed 3) whose first group, designed from phase 1's rough
    estimates in blocks of 16 rounds, missed its aim by up to 10 log-pole units and left a rough
    model that the final stage missed by 14: it failed loudly, 7e-4 off. The first group is aimed
    round by round (docs/algorithm.md, 'Aiming in blocks'); ground truth from the float64 copy."""
    d, H = 32, 8
    layer = build("OPTAttention", d, H, seed=3, implementation="eager").to(torch.float32)
    r = np.random.default_rng(3).standard_normal(d)
    truth = to_reduced(copy.deepcopy(layer).double(), r)
    result = mx.extract(TorchOracle(layer, r), d, heads=H, seed=3, on_failure="warn", progress=False)
    assert result.ok, [check.name for check in result.failed_checks]
    assert mx.compare(result.model, truth).max_rel <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind, seed", [("GPT2Attention", 0), ("GPT2Attention", 1), ("ViTAttention", 0)])
def test_the_error_estimate_of_a_float32_layer_covers_its_small_score_biases(kind, seed):
    """GPT-2's score biases are small (max|u| ~ 1e-3 against max|W| ~ 1): their error relative to
    max|u| was up to 1.45x the estimate, which covered W alone (seeds 0, 1: 0.69, 0.71 x the truth);
    ViT seed 0's largest W error is 4.5 times its head's root mean square, above the 3.3 times the
    head-wise estimate assumed (0.58 x). The estimate is per entry of W, u and v (docs/algorithm.md, 'The targeted
    schedule', 'Error estimate'); ground truth from the float64 copy of the weights."""
    d, H = 16, 4
    layer = build(kind, d, H, seed=seed, implementation="eager")
    r = np.random.default_rng(seed).standard_normal(d)
    truth = to_reduced(copy.deepcopy(layer), r)
    result = mx.extract(TorchOracle(layer.to(torch.float32), r), d, heads=H, seed=seed, on_failure="warn",
                        progress=False)
    assert result.ok, [check.name for check in result.failed_checks]
    error = mx.compare(result.model, truth).max_rel
    assert error <= result.error_estimate <= 100 * error


@pytest.mark.slow
@pytest.mark.parametrize("kind, d, H, seed", [("ViTAttention", 64, 2, 0), ("GPT2Attention", 16, 4, 1)])
def test_the_low_rank_estimate_of_a_float32_layer_is_above_its_error_and_within_its_limit(kind, d, H, seed):
    """The subspace units' basis error, bounded by Wedin's theorem, put the estimate 1800x above the
    truth on this ViT layer (rank 32) and failed ``error_estimate`` on a model 3e-6 off (10 of 15
    float32 layers at d = 64, H = 2, 2e-6..4e-5 off); on the GPT-2 layer (rank 4) the same bound stood 2.6x above it
    while what actually moves those units (the basis's miss read by the tokens' parts off the
    subspace) went unmodelled. The first-order term of docs/algorithm.md, 'Low-rank heads' ("Error estimate"),
    sized to the noise the full units show: 10x and 3.8x here (GPT-2's u, its largest error; the old
    estimate of u alone was 0.87x it, covered by the W part's excess). A float32 layer's rounding
    depends on the machine's vector units and threads (the same layer, seed and code came out 6.5e-6
    and 3.2e-6 off here), hence the wide bounds."""
    layer = build(kind, d, H, seed=seed, implementation="eager")
    r = np.random.default_rng(seed).standard_normal(d)
    truth = to_reduced(copy.deepcopy(layer), r)
    result = mx.extract(TorchOracle(layer.to(torch.float32), r), d, heads=H, seed=seed, schedule="lowrank",
                        rank=d // H, bias=True, token_scale="auto", on_failure="warn", progress=False)
    assert result.ok, [check.name for check in result.failed_checks]
    error = mx.compare(result.model, truth).max_rel
    assert error <= result.error_estimate <= 100 * error
