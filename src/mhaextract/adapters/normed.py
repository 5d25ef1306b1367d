"""Attention sublayers of real blocks as oracles, and :class:`~mhaextract.models.normed.NormedAttention`
back into torch (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block').

:func:`attention_sublayer` turns a block a user holds into the module of its attention half, raw
hidden states (B, N, d) to the sublayer's outputs (B, N, d), to wrap in
:class:`~mhaextract.adapters.torch.TorchOracle`: ``GPT2Block`` (``x + attn(ln_1(x))``),
``ViTLayer`` (``x + attention(layernorm_before(x))``), ``BertAttention`` as it is (self-attention,
output projection, residual, then its LayerNorm: a post-norm, which the norm family refuses with
that cause). The module calls the block's own submodules; nothing on the extraction path reads a
weight.

:func:`layer` and :func:`state_dict` are what :func:`~mhaextract.adapters.export.to_torch` and
:func:`~mhaextract.adapters.export.to_state_dict` dispatch to for a ``NormedAttention``.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from ..models.normed import NormedAttention
from . import attention as attention_adapter
from .export import ExportReport, StateDict, UnsupportedLayerError


class AttentionSublayer(nn.Module):
    """The attention half of a block: ``residual + attention(norm(x))`` (or a post-norm block's
    attention module as it is), calling the block's own submodules."""

    def __init__(self, block, kind: str, norm: str | None, attention: str | None):
        super().__init__()
        self.block, self.kind, self.norm_name, self.attention_name = block, kind, norm, attention

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if self.norm_name is None:  # BertAttention: the whole sublayer is the module
            out = self.block(X)
            return out[0] if isinstance(out, (tuple, list)) else out
        out = getattr(self.block, self.attention_name)(getattr(self.block, self.norm_name)(X))
        return X + (out[0] if isinstance(out, (tuple, list)) else out)

    def extra_repr(self) -> str:
        return f"the attention sublayer of {self.kind}"


#: block class -> (its norm before the attention, its attention module)
SUBLAYERS = {"GPT2Block": ("ln_1", "attn"), "ViTLayer": ("layernorm_before", "attention"),
             "BertAttention": (None, None)}


def attention_sublayer(block) -> AttentionSublayer:
    """The attention half of ``block`` (module docstring) as a module for
    :class:`~mhaextract.adapters.torch.TorchOracle`; a TypeError naming the classes it knows.

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
    if kind not in SUBLAYERS:
        raise TypeError(f"attention_sublayer knows {', '.join(SUBLAYERS)}, not {kind}: pass the block of one of "
                        "these, or any module mapping raw hidden states (B, N, d) to the sublayer's outputs to "
                        "TorchOracle yourself")
    norm, attention = SUBLAYERS[kind]
    return AttentionSublayer(copy.deepcopy(block).eval(), kind, norm, attention)


class NormedAttentionModule(nn.Module):
    """A :class:`NormedAttention` as a torch module: raw hidden states (B, N, d) to the sublayer's
    outputs at every position (``causal``) or at the final one (``causal=None``, (B, d_out)), in
    float64: its own norm (gamma = 1, beta = 0, the model's eps), the inner heads lifted to R^d, the
    residual R."""

    def __init__(self, model: NormedAttention, inner: nn.Module, dtype):
        super().__init__()
        self.norm, self.eps, self.inner = model.norm, model.eps, inner
        self.register_buffer("R", torch.as_tensor(model.R, dtype=dtype))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        X = X.to(self.R.dtype)
        centred = X - X.mean(dim=-1, keepdim=True) if self.norm == "layernorm" else X
        normed = centred / torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + self.eps)
        out = self.inner(normed)
        residual = X @ self.R.T
        return out + (residual if out.dim() == 3 else residual[:, -1])


def layer(model: NormedAttention, causal, width, dtype, tolerance):
    """:class:`NormedAttentionModule` around the attention adapter's layer of the lifted heads."""
    if not isinstance(model, NormedAttention):
        raise TypeError(f"expected a NormedAttention, got {type(model).__name__}")
    inner = attention_adapter.layer(model.lifted(), causal, width, dtype, tolerance)
    module = NormedAttentionModule(model, inner, torch.float64 if dtype is None else dtype)
    module.export_report = getattr(inner, "export_report", None)
    return module


#: block class -> (norm module, its class name, attention module, what it carries)
BLOCK_LAYOUTS = {"GPT2Block": ("ln_1", "LayerNorm", "attn"), "ViTLayer": ("layernorm_before", "LayerNorm", "attention")}


def state_dict(model: NormedAttention, like, tolerance: float) -> StateDict:
    """The sublayer in the layout of a block ``like`` (``GPT2Block``, ``ViTLayer``): its norm's
    weight 1 and bias 0 (gamma and beta are folded into the heads) and its attention's state from
    the attention adapter, keys prefixed with the submodules' names; load with
    ``block.load_state_dict(state, strict=False)`` (the MLP half is not the model's). Refused, with
    the reason, where the block cannot carry it: another norm kind, an eps the block's config does
    not hold, a residual other than the identity."""
    if not isinstance(model, NormedAttention):
        raise TypeError(f"expected a NormedAttention, got {type(model).__name__}")
    kind = type(like).__name__
    if kind not in BLOCK_LAYOUTS:
        raise UnsupportedLayerError(f"a NormedAttention goes into {', '.join(BLOCK_LAYOUTS)} (their norm and "
                                    f"attention), not {kind}: use to_torch(result) for a module of its own")
    norm_name, norm_class, attention_name = BLOCK_LAYOUTS[kind]
    norm = getattr(like, norm_name)
    if model.norm != "layernorm" or type(norm).__name__ != norm_class:
        raise UnsupportedLayerError(f"{kind}'s {norm_name} is a {type(norm).__name__}; the model's norm is a "
                                    f"{model.norm}: it cannot carry it")
    block_eps = float(getattr(norm, "eps", np.nan))
    if not abs(block_eps - model.eps) <= max(tolerance, 1e-9) * model.eps:
        raise UnsupportedLayerError(f"{kind}'s {norm_name} has eps = {block_eps:.6g}, the model's is {model.eps:.6g} "
                                    "(eps is a setting of the block's config, not a weight): build the block with "
                                    f"that eps (GPT-2: layer_norm_epsilon, ViT: layer_norm_eps = {model.eps!r})")
    identity = float(np.abs(model.R - np.eye(model.d)).max()) if model.R.shape == (model.d, model.d) else np.inf
    if identity > max(tolerance, 1e-9):
        raise UnsupportedLayerError(f"{kind} adds its input unchanged (residual R = I); the model's residual is "
                                    f"{identity:.1e} from the identity: use to_torch(result)")
    inner = attention_adapter.state_dict(model.lifted(), getattr(like, attention_name), tolerance)
    state = {f"{attention_name}.{key}": value for key, value in inner.items()}
    for key, tensor in getattr(like, norm_name).state_dict().items():
        value = torch.ones_like(tensor) if key == "weight" else torch.zeros_like(tensor)
        state[f"{norm_name}.{key}"] = value
    report: ExportReport = inner.report
    report.target = f"{kind} ({norm_name} + {attention_name})"
    return StateDict(state, report)
