"""Attention sublayers of real blocks as oracles, and :class:`~mhaextract.models.normed.NormedAttention`
back into torch (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block').

:func:`attention_sublayer` turns a block a user holds into the module of its attention half, raw
hidden states (B, N, d) to the sublayer's outputs (B, N, d), to wrap in
:class:`~mhaextract.adapters.torch.TorchOracle`: ``GPT2Block`` (``x + attn(ln_1(x))``),
``ViTLayer`` (``x + attention(layernorm_before(x))``), ``LlamaDecoderLayer`` (``x +
self_attn(input_layernorm(x))``, the rotary attention run with its positions and causal mask by
:class:`~mhaextract.adapters.rotary.RotaryLayer`), ``MistralDecoderLayer`` (the same, its mask limited
to the sliding window), ``BertAttention`` as it is (self-attention,
output projection, residual, then its LayerNorm: a post-norm). The module calls the block's own
submodules; nothing on the extraction path reads a weight.

:func:`layer` and :func:`state_dict` are what :func:`~mhaextract.adapters.export.to_torch` and
:func:`~mhaextract.adapters.export.to_state_dict` dispatch to for a ``NormedAttention`` (into a
``GPT2Block``, ``ViTLayer`` or, with a rotary inner model, a ``LlamaDecoderLayer``,
``MistralDecoderLayer`` or ``Qwen2DecoderLayer``) or a
``PostNormAttention`` (into a ``BertAttention``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from ..models.normed import NormedAttention, PostNormAttention
from . import attention as attention_adapter
from .export import ExportReport, StateDict, UnsupportedLayerError, _adapter
from .rotary import RotaryLayer
from .torch import _refuse_positions


class AttentionSublayer(nn.Module):
    """The attention half of a block: ``residual + attention(norm(x))`` (or a post-norm block's
    attention module as it is), calling the block's own submodules."""

    def __init__(self, block, kind: str, norm: str | None, attention: str | None, positioned: nn.Module | None = None):
        super().__init__()
        self.block, self.kind, self.norm_name, self.attention_name = block, kind, norm, attention
        # a rotary block's attention takes its positions and mask from the model: run as RotaryLayer
        self.positioned = positioned

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if self.norm_name is None:  # BertAttention: the whole sublayer is the module
            out = self.block(X)
            return out[0] if isinstance(out, (tuple, list)) else out
        attention = self.positioned if self.positioned is not None else getattr(self.block, self.attention_name)
        out = attention(getattr(self.block, self.norm_name)(X))
        return X + (out[0] if isinstance(out, (tuple, list)) else out)

    @property
    def post_norm(self) -> bool:
        """The norm is after the residual (BertAttention): known before any query."""
        return self.norm_name is None

    def extra_repr(self) -> str:
        return f"the attention sublayer of {self.kind}"


#: block class -> (its norm before the attention, its attention module)
SUBLAYERS = {"GPT2Block": ("ln_1", "attn"), "ViTLayer": ("layernorm_before", "attention"),
             "LlamaDecoderLayer": ("input_layernorm", "self_attn"),
             "MistralDecoderLayer": ("input_layernorm", "self_attn"), "BertAttention": (None, None)}
#: blocks whose sublayer the norm learner cannot learn, and why (refused before any query)
UNLEARNED_SUBLAYERS = {
    "Qwen2DecoderLayer": (
        "the attention sublayer of a Qwen2DecoderLayer is not learned: its keys carry a bias (k_proj.bias), so zero "
        "tokens are no counters, and the rotary learner's key-neutral search starts from the token whose queries "
        "are zero, which behind the RMSNorm must lie in the ball of radius sqrt(d) that the norm's outputs fill and "
        "on such layers mostly lies far outside it (docs/algorithm.md, 'Attention behind a norm: the sublayer of a "
        "block', 'Rotary attention behind an RMSNorm'); extract its attention alone instead "
        "(TorchOracle(adapters.rotary.RotaryLayer(block.self_attn)), positions='rotary', key_bias=True). A model "
        "learned elsewhere still goes into a Qwen2DecoderLayer (to_state_dict(model, like=block))"),
}
#: blocks whose attention is rotary (run by RotaryLayer with positions 0..N-1 and the causal mask, limited
#: to the layer's sliding window where it has one)
ROTARY_BLOCKS = ("LlamaDecoderLayer", "MistralDecoderLayer")


def attention_sublayer(block, rotary_embedding=None, angles: str = "model") -> AttentionSublayer:
    """The attention half of ``block`` (module docstring) as a module for
    :class:`~mhaextract.adapters.torch.TorchOracle`; a TypeError naming the classes it knows, an
    :class:`~mhaextract.adapters.export.UnsupportedLayerError` saying why for a block whose sublayer is
    not learned (``Qwen2DecoderLayer``: its key bias). ``rotary_embedding``, ``angles``: for a rotary
    block (``LlamaDecoderLayer``, ``MistralDecoderLayer``), as in
    :class:`~mhaextract.adapters.rotary.RotaryLayer` (the model's embedding by default; transformers
    computes its angles, and ``LlamaRMSNorm`` or ``MistralRMSNorm`` its norm, in float32 whatever the
    block's dtype).

    Examples
    --------
    >>> import torch
    >>> from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Config
    >>> from mhaextract.adapters.normed import attention_sublayer
    >>> block = GPT2Block(GPT2Config(n_embd=8, n_head=2), layer_idx=0).double().eval()
    >>> X = torch.randn(1, 3, 8, dtype=torch.float64)
    >>> expected = X + block.attn(block.ln_1(X))[0]
    >>> bool(torch.allclose(attention_sublayer(block)(X), expected))
    True
    """
    kind = type(block).__name__
    if kind in UNLEARNED_SUBLAYERS:
        raise UnsupportedLayerError(UNLEARNED_SUBLAYERS[kind])
    if kind not in SUBLAYERS:
        raise TypeError(f"attention_sublayer knows {', '.join(SUBLAYERS)}, not {kind}: pass the block of one of "
                        "these, or any module mapping raw hidden states (B, N, d) to the sublayer's outputs to "
                        "TorchOracle yourself")
    norm, attention = SUBLAYERS[kind]
    copied = copy.deepcopy(block).eval()
    positioned = (RotaryLayer(getattr(copied, attention), rotary_embedding, angles=angles) if kind in ROTARY_BLOCKS
                  else None)
    return AttentionSublayer(copied, kind, norm, attention, positioned)


class NormedAttentionModule(nn.Module):
    """A :class:`NormedAttention` as a torch module: raw hidden states (B, N, d) to the sublayer's
    outputs at every position (``causal``) or at the final one (``causal=None``, (B, d_out)), in
    float64: its own norm (gamma = 1, beta = 0, the model's eps), the inner heads lifted to R^d, the
    residual R."""

    def __init__(self, model: NormedAttention, inner: nn.Module, dtype):
        super().__init__()
        self.norm, self.eps, self.inner = model.norm, model.eps, inner
        # a read-out's rho as one row: the scalar inner layer answers (..., 1) as the attention adapter's does
        self.register_buffer("R", torch.as_tensor(np.atleast_2d(model.R), dtype=dtype))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        X = X.to(self.R.dtype)
        centred = X - X.mean(dim=-1, keepdim=True) if self.norm == "layernorm" else X
        normed = centred / torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + self.eps)
        out = self.inner(normed)
        residual = X @ self.R.T
        return out + (residual if out.dim() == 3 else residual[:, -1])


class PostNormAttentionModule(nn.Module):
    """A :class:`PostNormAttention` as a torch module: raw hidden states (B, N, d) to
    ``gamma * n(x + f(X)) + beta`` at every position (``causal``) or at the final one
    (``causal=None``, (B, d)): the attention adapter's layer, the residual, its own LayerNorm."""

    def __init__(self, model: PostNormAttention, inner: nn.Module, dtype):
        super().__init__()
        self.eps, self.inner = model.eps, inner
        self.register_buffer("gamma", torch.as_tensor(model.gamma, dtype=dtype))
        self.register_buffer("beta", torch.as_tensor(model.beta, dtype=dtype))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        X = X.to(self.gamma.dtype)
        out = self.inner(X)
        z = out + (X if out.dim() == 3 else X[:, -1])
        return nn.functional.layer_norm(z, (z.shape[-1],), self.gamma, self.beta, self.eps)


def layer(model, causal, width, dtype, tolerance):
    """:class:`NormedAttentionModule` around the attention adapter's layer of the lifted heads, or
    :class:`PostNormAttentionModule` around its layer of a post-norm's heads."""
    if isinstance(model, PostNormAttention):
        inner = attention_adapter.layer(model.attention, causal, width, dtype, tolerance)
        module = PostNormAttentionModule(model, inner, torch.float64 if dtype is None else dtype)
        module.export_report = getattr(inner, "export_report", None)
        return module
    if not isinstance(model, NormedAttention):
        raise TypeError(f"expected a NormedAttention or PostNormAttention, got {type(model).__name__}")
    lifted = model.lifted()
    inner = _adapter(lifted, "layer")(lifted, causal, width, dtype, tolerance)
    module = NormedAttentionModule(model, inner, torch.float64 if dtype is None else dtype)
    module.export_report = getattr(inner, "export_report", None)
    return module


#: block class -> (norm module, its class name, the norm's kind, its eps attribute, attention module, eps's setting)
BLOCK_LAYOUTS = {"GPT2Block": ("ln_1", "LayerNorm", "layernorm", "eps", "attn", "GPT-2: layer_norm_epsilon"),
                 "ViTLayer": ("layernorm_before", "LayerNorm", "layernorm", "eps", "attention", "ViT: layer_norm_eps"),
                 "LlamaDecoderLayer": ("input_layernorm", "LlamaRMSNorm", "rmsnorm", "variance_epsilon", "self_attn",
                                       "Llama: rms_norm_eps"),
                 "MistralDecoderLayer": ("input_layernorm", "MistralRMSNorm", "rmsnorm", "variance_epsilon",
                                         "self_attn", "Mistral: rms_norm_eps"),
                 "Qwen2DecoderLayer": ("input_layernorm", "Qwen2RMSNorm", "rmsnorm", "variance_epsilon", "self_attn",
                                       "Qwen2: rms_norm_eps")}


def state_dict(model: NormedAttention, like, tolerance: float) -> StateDict:
    """The sublayer in the layout of a block ``like`` (``GPT2Block``, ``ViTLayer``; with a rotary inner
    model ``LlamaDecoderLayer``, ``MistralDecoderLayer``, ``Qwen2DecoderLayer``): its norm's
    weight 1 and bias 0 (gamma and beta are folded into the heads) and its attention's state from
    the attention adapter, keys prefixed with the submodules' names; load with
    ``block.load_state_dict(state, strict=False)`` (the MLP half is not the model's). Refused, with
    the reason, where the block cannot carry it: another norm kind, an eps the block's config does
    not hold, a residual other than the identity. A ``PostNormAttention`` goes into a
    ``BertAttention`` (:func:`post_norm_state_dict`)."""
    if isinstance(model, PostNormAttention):
        return post_norm_state_dict(model, like, tolerance)
    if not isinstance(model, NormedAttention):
        raise TypeError(f"expected a NormedAttention, got {type(model).__name__}")
    kind = type(like).__name__
    if not model.is_vector:
        raise UnsupportedLayerError(f"the model is a read-out (one number a sequence: v_h = V_h^T r, rho = R^T r), "
                                    f"and {kind} computes whole outputs, which a read-out does not determine: use "
                                    "to_torch(result) for a module of its own, or extract from whole outputs")
    if kind not in BLOCK_LAYOUTS:
        raise UnsupportedLayerError(f"a NormedAttention goes into {', '.join(BLOCK_LAYOUTS)} (their norm and "
                                    f"attention), not {kind}: use to_torch(result) for a module of its own")
    norm_name, norm_class, norm_kind, eps_name, attention_name, setting = BLOCK_LAYOUTS[kind]
    norm = getattr(like, norm_name)
    if model.norm != norm_kind or type(norm).__name__ != norm_class:
        raise UnsupportedLayerError(f"{kind}'s {norm_name} is a {type(norm).__name__}; the model's norm is a "
                                    f"{model.norm}: it cannot carry it")
    _check_eps(kind, norm_name, float(getattr(norm, eps_name, np.nan)), model.eps, tolerance, setting)
    identity = float(np.abs(model.R - np.eye(model.d)).max()) if model.R.shape == (model.d, model.d) else np.inf
    if identity > max(tolerance, 1e-9):
        raise UnsupportedLayerError(f"{kind} adds its input unchanged (residual R = I); the model's residual is "
                                    f"{identity:.1e} from the identity: use to_torch(result)")
    lifted = model.lifted()  # plain attention into the block's attention, rotary into its LlamaAttention
    inner = _adapter(lifted, "state_dict")(lifted, getattr(like, attention_name), tolerance)
    state = {f"{attention_name}.{key}": value for key, value in inner.items()}
    for key, tensor in getattr(like, norm_name).state_dict().items():
        value = torch.ones_like(tensor) if key == "weight" else torch.zeros_like(tensor)
        state[f"{norm_name}.{key}"] = value
    report: ExportReport = inner.report
    report.target = f"{kind} ({norm_name} + {attention_name})"
    return StateDict(state, report)


def _check_eps(kind: str, where: str, block_eps: float, model_eps: float, tolerance: float, setting: str) -> None:
    if not abs(block_eps - model_eps) <= max(tolerance, 1e-9) * model_eps:
        raise UnsupportedLayerError(f"{kind}'s {where} has eps = {block_eps:.6g}, the model's is {model_eps:.6g} "
                                    "(eps is a setting of the block's config, not a weight): build the block with "
                                    f"that eps ({setting} = {model_eps!r})")


def post_norm_state_dict(model: PostNormAttention, like, tolerance: float) -> StateDict:
    """A post-norm sublayer in the layout of a ``BertAttention``: the heads through the attention
    adapter's ``nn.MultiheadAttention`` layout (the same scores ``(W_Q x + b_Q) . (W_K x) / sqrt(r)``,
    values, output projection and biases) as ``self.query``, ``self.key``, ``self.value`` and
    ``output.dense``, gamma and beta as ``output.LayerNorm``'s weight and bias. Refused, with the
    reason: another class, an eps its config does not hold, position embeddings other than absolute,
    more heads or wider ones than it holds (the attention adapter's refusals)."""
    kind = type(like).__name__
    if kind != "BertAttention" or not hasattr(like, "self") or not hasattr(like, "output"):
        raise UnsupportedLayerError(f"a PostNormAttention (attention, residual, then a LayerNorm) goes into a "
                                    f"BertAttention, not {kind}: use to_torch(result) for a module of its own")
    _refuse_positions("BertSelfAttention", like.self)
    norm = like.output.LayerNorm
    _check_eps(kind, "output.LayerNorm", float(getattr(norm, "eps", np.nan)), model.eps, tolerance,
               "BertConfig(layer_norm_eps=...)")
    d, heads = model.d, like.self.num_attention_heads
    if like.output.dense.weight.shape != (d, d):
        raise UnsupportedLayerError(f"{kind} has hidden size {like.output.dense.weight.shape[0]}; the model has "
                                    f"d = {d}")
    template = nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64)
    inner = attention_adapter.state_dict(model.attention, template, tolerance)
    weight, bias = inner["in_proj_weight"], inner["in_proj_bias"]
    values = {"self.query.weight": weight[:d], "self.query.bias": bias[:d],
              "self.key.weight": weight[d:2 * d], "self.key.bias": bias[d:2 * d],
              "self.value.weight": weight[2 * d:], "self.value.bias": bias[2 * d:],
              "output.dense.weight": inner["out_proj.weight"], "output.dense.bias": inner["out_proj.bias"],
              "output.LayerNorm.weight": torch.as_tensor(model.gamma), "output.LayerNorm.bias": torch.as_tensor(model.beta)}
    current = like.state_dict()
    state = {key: value.detach().clone().to(dtype=current[key].dtype, device=current[key].device)
             for key, value in values.items()}
    report: ExportReport = inner.report
    report.target = f"{kind} (self, output.dense, output.LayerNorm)"
    return StateDict(state, report)
