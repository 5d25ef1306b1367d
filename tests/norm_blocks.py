"""Pre-norm and post-norm (BertAttention) attention sublayers with trained-like weights, their folded truth and the judge at every
position (issue 63): shared by tests/test_norm_sublayer.py and benchmarks/bench_norm.py.

Truth is the block's own forward in float64, or the heads folded from its weights here
(W' = G W G, u' = G (W beta + u), V' = V G, c' = c + V beta, restricted to 1^perp): white-box,
never on the extraction path."""

import numpy as np
import torch

import mhaextract as mx
from mhaextract.adapters.torch import to_reduced
from mhaextract.models.normed import NormedAttention, PostNormAttention, norm_basis


def trained_like(block, norm, attention, d, seed):
    """Projections N(0, 1/d) (scores of order one on a norm's output), gamma ~ 1 +- 0.2, beta ~ 0.05."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) / d ** 0.5)
        norm.weight.copy_(1 + 0.2 * torch.randn(d, generator=generator, dtype=norm.weight.dtype))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(0.05 * torch.randn(d, generator=generator, dtype=norm.bias.dtype))
    return block.eval()


def gpt2_block(d, H, seed=0, **config):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Config

    torch.manual_seed(seed)
    block = GPT2Block(GPT2Config(n_embd=d, n_head=H, attn_implementation="eager", **config), layer_idx=0).double()
    return trained_like(block, block.ln_1, block.attn, d, seed)


def vit_layer(d, H, seed=0):
    from transformers.models.vit.modeling_vit import ViTConfig, ViTLayer

    torch.manual_seed(seed)
    layer = ViTLayer(ViTConfig(hidden_size=d, num_attention_heads=H, intermediate_size=2 * d,
                               attn_implementation="sdpa")).double()  # eager: a float32 softmax
    return trained_like(layer, layer.layernorm_before, layer.attention, d, seed)


class RMSSublayer(torch.nn.Module):
    """x + MHA(RMSNorm(x)) in float64 (torch's RMSNorm computes in the input's dtype)."""

    def __init__(self, d, H, seed=0, eps=1e-6):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = torch.nn.RMSNorm(d, eps=eps, dtype=torch.float64)
        self.attn = torch.nn.MultiheadAttention(d, H, batch_first=True, dtype=torch.float64)
        trained_like(self, self.norm, self.attn, d, seed)

    def forward(self, X):
        T = self.norm(X)
        return X + self.attn(T, T, T, need_weights=False)[0]


def bert_attention(d, H, seed=0):
    """BertAttention (self-attention, output projection, residual, LayerNorm) with trained-like weights."""
    from transformers.models.bert.modeling_bert import BertAttention, BertConfig

    torch.manual_seed(seed)
    layer = BertAttention(BertConfig(hidden_size=d, num_attention_heads=H, attn_implementation="eager")).double()
    return trained_like(layer, layer.output.LayerNorm, layer, d, seed)


class BertLayerHiddenStates(torch.nn.Module):
    """A whole BertLayer (attention sublayer, then its MLP, residual and second LayerNorm) on (B, N, d)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, X):
        out = self.layer(X)
        return out[0] if isinstance(out, (tuple, list)) else out


def bert_layer(d, H, seed=0):
    """A whole BertLayer with trained-like weights (both LayerNorms gamma ~ 1 +- 0.2, beta ~ 0.05)."""
    from transformers.models.bert.modeling_bert import BertConfig, BertLayer

    torch.manual_seed(seed)
    layer = BertLayer(BertConfig(hidden_size=d, num_attention_heads=H, intermediate_size=2 * d,
                                 attn_implementation="eager")).double()
    trained_like(layer, layer.output.LayerNorm, layer, d, seed + 1)
    trained_like(layer, layer.attention.output.LayerNorm, layer.attention, d, seed)
    return BertLayerHiddenStates(layer.eval())


def post_norm_truth(layer) -> PostNormAttention:
    """The post-norm sublayer of a BertAttention from its weights: the self-attention's heads (to_reduced,
    V_h its block of value rows, c = b_V) through the output projection O, b_O: ``V_h -> O V_h``,
    ``c -> O c + b_O``; gamma, beta and eps its LayerNorm's (white-box, the test's own algebra)."""
    A = to_reduced(layer.self)
    O = layer.output.dense.weight.detach().double().numpy()
    b_O = layer.output.dense.bias.detach().double().numpy()
    norm = layer.output.LayerNorm
    inner = mx.MultiHeadAttention(A.W, np.einsum("ab,hbk->hak", O, A.V), A.u, O @ A.c + b_O)
    return PostNormAttention(norm.eps, inner, norm.weight.detach().double().numpy(),
                             norm.bias.detach().double().numpy())


def folded_truth(block) -> NormedAttention:
    """The canonical sublayer of a GPT2Block, from its weights (white-box, the test's own algebra)."""
    A = to_reduced(block.attn)
    gamma, beta = (block.ln_1.weight.detach().double().numpy(), block.ln_1.bias.detach().double().numpy())
    G = np.diag(gamma)
    W = G @ A.W @ G
    u = np.einsum("ab,hb->ha", G, np.einsum("hab,b->ha", A.W, beta) + A.u)
    V, c = A.V @ G, A.c + np.einsum("hob,b->o", A.V, beta)
    Q = norm_basis("layernorm", A.d)
    inner = mx.MultiHeadAttention(Q.T @ W @ Q, V @ Q, u @ Q, c)
    return NormedAttention("layernorm", block.ln_1.eps, inner, np.eye(A.d))


def raw_sequences(rng, d, count, longest=64):
    """Token norms log-uniform in 1e-3..1e3 (so eps and the residual both matter)."""
    out = []
    for n in list(rng.integers(1, longest + 1, size=count - 1)) + [longest]:
        X = rng.standard_normal((int(n), d))
        X *= (np.exp(rng.uniform(np.log(1e-3), np.log(1e3), size=int(n))) / np.linalg.norm(X, axis=1))[:, None]
        out.append(X)
    return out


def every_position_error(model, module, sequences, causal):
    worst = 0.0
    with torch.no_grad():
        for X in sequences:
            expected = module(torch.as_tensor(X)[None])[0].double().numpy()
            got = model.every_position(X, causal)
            worst = max(worst, float((np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)).max()))
    return worst


#: family -> (its config class, its decoder layer class), in transformers.models.<family>
ROTARY_FAMILIES = {"llama": ("LlamaConfig", "LlamaDecoderLayer"), "mistral": ("MistralConfig", "MistralDecoderLayer"),
                   "qwen2": ("Qwen2Config", "Qwen2DecoderLayer")}


def rotary_block(d, H, kv_heads=2, seed=0, family="llama", **config):
    """A decoder layer of a rotary family (RMSNorm, rotary attention with grouped key/value heads; Llama's
    and Mistral's without biases, Qwen2's with query, key and value biases; ``config`` e.g. Mistral's
    ``sliding_window``) with trained-like weights (projections and biases N(0, 1/d), gamma ~ 1 +- 0.2),
    float64, sdpa."""
    import importlib

    config_name, layer_name = ROTARY_FAMILIES[family]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(seed)
    settings = {"hidden_size": d, "num_attention_heads": H, "num_key_value_heads": kv_heads, "head_dim": d // H,
                "intermediate_size": 2 * d, "attn_implementation": "sdpa", **config}
    layer = getattr(module, layer_name)(getattr(module, config_name)(**settings), layer_idx=0).double()
    return trained_like(layer, layer.input_layernorm, layer.self_attn, d, seed)


class RotarySublayerFloat64(torch.nn.Module):
    """``x + self_attn(input_layernorm(x))`` of a Llama, Mistral or Qwen2 decoder layer computed in float64
    throughout: its RMSNorm's weight and eps in torch's RMSNorm (transformers' RMSNorms compute in float32
    whatever the layer's dtype) and its attention with float64 angles and its window
    (adapters.rotary.float64_layer)."""

    def __init__(self, layer):
        super().__init__()
        from mhaextract.adapters.rotary import float64_layer

        source = layer.input_layernorm
        self.norm = torch.nn.RMSNorm(source.weight.shape[0], eps=source.variance_epsilon, dtype=torch.float64)
        with torch.no_grad():
            self.norm.weight.copy_(source.weight.detach().double())
        self.attention = float64_layer(layer.self_attn)

    def forward(self, X):
        return X + self.attention(self.norm(X))


def rotary_truth(layer) -> NormedAttention:
    """The canonical sublayer of a Llama, Mistral or Qwen2 decoder layer from its weights: the rotary heads
    of to_rotary (its window, Qwen2's key bias) with gamma folded in (Q_h G, K_h G, V_h G; an RMSNorm has
    no beta; b, the key bias and c unchanged), eps its norm's, R = I (white-box)."""
    from mhaextract.adapters.rotary import to_rotary

    A = to_rotary(layer.self_attn)
    gamma = layer.input_layernorm.weight.detach().double().numpy()
    inner = A.replaced(Q=A.Q * gamma, K=A.K * gamma, V=A.V * gamma)
    return NormedAttention("rmsnorm", layer.input_layernorm.variance_epsilon, inner, np.eye(A.d))


def read_out_truth(block, r) -> NormedAttention:
    """The canonical read-out ``r^T y`` of a GPT2Block's sublayer, from its weights: the folded heads'
    ``v_h = V_h^T r``, ``r^T c`` and the residual's ``rho = R^T r`` (white-box, the test's own algebra)."""
    folded = folded_truth(block)
    return NormedAttention(folded.norm, folded.eps, folded.attention.readout(r), folded.R.T @ r)


def read_out_error(model, module, r, sequences, causal):
    """A read-out model against ``r^T`` of ``module``'s outputs at every position: the largest
    ``|model - a| / (|rho|^T |x_i| + max |a - rho^T x_i|)``, the max over every position judged (one number
    crosses zero where the skip term and the attention's part cancel, and the skip's sum rounds at the size
    of its terms: docs/algorithm.md, 'A scalar read-out'); rho from ``model``."""
    got, expected, skip, size = [], [], [], []
    with torch.no_grad():
        for X in sequences:
            expected.append(module(torch.as_tensor(X)[None])[0].double().numpy() @ r)
            got.append(model.every_position(X, causal))
            skip.append(X @ model.R)
            size.append(np.abs(X) @ np.abs(model.R))
    got, expected, skip, size = (np.concatenate(a) for a in (got, expected, skip, size))
    return float((np.abs(got - expected) / (size + np.abs(expected - skip).max())).max())
