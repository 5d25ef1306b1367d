"""Torch modules as oracles (any of them), and the ground truth of known attention layers.

:class:`TorchOracle` is black-box: any ``nn.Module`` (or callable on tensors) mapping tokens
(B, N, d) to outputs (B, N, d_out) (a tuple's first element is taken; ``nn.MultiheadAttention``
is called as self-attention), read out at the last position through a vector r. It runs the
module in its own dtype and on its own device and knows nothing of the layer's class.

Layer-specific code lives only in :func:`to_reduced` (the ground truth, from the weights) and
:func:`to_torch` (export). A layer with H heads of width r has per head ``r x d`` query, key and
value blocks ``Wq_h, Wk_h, Wv_h``, a ``d x r`` output block ``Wo_h`` (the identity's block for
BERT's self-attention, which has none), biases ``b_Q, b_K, b_V, b_O`` and a score scale sigma
(``1/sqrt(r)`` by default). Read out through r it is the model of docs/algorithm.md §16 with

    W_h = sigma Wk_h^T Wq_h,   u_h = sigma Wk_h^T b_Q_h,   v_h = Wv_h^T Wo_h^T r,
    c   = r^T (sum_h Wo_h b_V_h + b_O);

``b_K`` adds the same score to every token of a row and cancels in the softmax. Supported:
``nn.MultiheadAttention``, transformers' ``GPT2Attention``, ``BertSelfAttention``, ``OPTAttention``
and ``ViTAttention`` (eager or sdpa). Settings outside the model class are refused by
:func:`to_reduced` with the reason: ``add_bias_kv``, ``add_zero_attn``, ``kdim``/``vdim`` other
than ``embed_dim``, cross-attention, rotary or relative position embeddings. Extraction against
such a layer fails its checks rather than returning heads (the oracle cannot know to refuse it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("mhaextract.adapters.torch needs PyTorch: pip install 'mhaextract[torch]'") from error

from ..model import MultiHeadAttention, as_batch


class UnsupportedLayerError(ValueError):
    """The layer is not (reducible to) the model class the extractor learns; the message names why."""


@dataclass
class _Blocks:
    """One layer's per-head blocks in float64: Wq, Wk, Wv (H, r, d), Wo (H, d, r), biases
    bq, bv (H, r) and bo (d,), the score scale sigma."""

    kind: str
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wo: np.ndarray
    bq: np.ndarray
    bv: np.ndarray
    bo: np.ndarray
    sigma: float


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def _bias(linear, shape) -> np.ndarray:
    return _numpy(linear.bias).reshape(shape) if getattr(linear, "bias", None) is not None else np.zeros(shape)


def _linear_blocks(kind, q, k, v, o, H: int, sigma: float) -> _Blocks:
    """Blocks of a layer with separate ``nn.Linear`` projections (``o`` None: no output projection)."""
    d = q.weight.shape[1]
    r = q.weight.shape[0] // H
    Wq, Wk, Wv = (_numpy(layer.weight).reshape(H, r, d) for layer in (q, k, v))
    if o is None:
        Wo, bo = np.eye(H * r).reshape(H * r, H, r).transpose(1, 0, 2), np.zeros(H * r)
    else:
        Wo, bo = _numpy(o.weight).reshape(-1, H, r).transpose(1, 0, 2), _bias(o, o.weight.shape[0])
    return _Blocks(kind, Wq, Wk, Wv, Wo, _bias(q, (H, r)), _bias(v, (H, r)), bo, float(sigma))


def _refuse_positions(kind: str, module) -> None:
    config = getattr(module, "config", None)
    position = getattr(config, "position_embedding_type", "absolute") if config is not None else "absolute"
    if position not in (None, "absolute") or hasattr(module, "rotary_emb"):
        raise UnsupportedLayerError(f"{kind} with position embedding {position!r} (rotary or relative) adds "
                                    "position-dependent scores: not the model class (docs/algorithm.md §16)")
    if getattr(module, "is_cross_attention", False):
        raise UnsupportedLayerError(f"{kind} with is_cross_attention=True attends to encoder states: "
                                    "not self-attention over the query sequence")


def _multihead_attention_blocks(module: nn.MultiheadAttention) -> _Blocks:
    if not module._qkv_same_embed_dim:
        raise UnsupportedLayerError(
            f"nn.MultiheadAttention with kdim={module.kdim}, vdim={module.vdim} != embed_dim={module.embed_dim}: "
            "keys and values of another dimension are cross-attention; the oracle feeds one sequence as "
            "query, key and value")
    if module.bias_k is not None or module.bias_v is not None:
        raise UnsupportedLayerError("nn.MultiheadAttention with add_bias_kv=True appends learned key/value tokens "
                                    "to every sequence: not the model the extractor learns")
    if module.add_zero_attn:
        raise UnsupportedLayerError("nn.MultiheadAttention with add_zero_attn=True appends a zero key/value token "
                                    "to every sequence: not the model the extractor learns")
    d, H = module.embed_dim, module.num_heads
    r = d // H
    Wq, Wk, Wv = _numpy(module.in_proj_weight).reshape(3, H, r, d)  # rows [q; k; v], heads along rows
    Wo = _numpy(module.out_proj.weight).reshape(d, H, r).transpose(1, 0, 2)  # columns split into heads
    if module.in_proj_bias is not None:
        bq, _, bv = _numpy(module.in_proj_bias).reshape(3, H, r)
    else:
        bq = bv = np.zeros((H, r))
    bo = _numpy(module.out_proj.bias) if module.out_proj.bias is not None else np.zeros(d)
    return _Blocks("nn.MultiheadAttention", Wq, Wk, Wv, Wo, bq, bv, bo, 1.0 / np.sqrt(r))


def _gpt2_blocks(module) -> _Blocks:
    _refuse_positions("GPT2Attention", module)
    config = module.config
    d, H = module.embed_dim, module.num_heads
    r = d // H
    # Conv1D computes x @ weight + bias: weight is (in, out), the transpose of nn.Linear's.
    Wq, Wk, Wv = _numpy(module.c_attn.weight).T.reshape(3, H, r, d)
    Wo = _numpy(module.c_proj.weight).T.reshape(d, H, r).transpose(1, 0, 2)
    bq, _, bv = _numpy(module.c_attn.bias).reshape(3, H, r)
    sigma = r ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        sigma /= float(module.layer_idx + 1)
    return _Blocks("GPT2Attention", Wq, Wk, Wv, Wo, bq, bv, _numpy(module.c_proj.bias), sigma)


def _blocks(module) -> _Blocks:
    """Split a supported layer into heads, refusing settings that change the model."""
    name = type(module).__name__
    if isinstance(module, nn.MultiheadAttention):
        return _multihead_attention_blocks(module)
    if name == "GPT2Attention" and hasattr(module, "c_attn"):
        return _gpt2_blocks(module)
    if name == "BertSelfAttention" and hasattr(module, "query"):
        _refuse_positions(name, module)
        return _linear_blocks(name, module.query, module.key, module.value, None, module.num_attention_heads,
                              getattr(module, "scaling", module.attention_head_size ** -0.5))
    if name in ("OPTAttention", "ViTAttention") and hasattr(module, "q_proj"):
        _refuse_positions(name, module)
        out = module.out_proj if hasattr(module, "out_proj") else module.o_proj
        H = getattr(module, "num_heads", None) or module.config.num_attention_heads
        return _linear_blocks(name, module.q_proj, module.k_proj, module.v_proj, out, H, module.scaling)
    raise TypeError(f"to_reduced knows torch.nn.MultiheadAttention or transformers' GPT2Attention, "
                    f"BertSelfAttention, OPTAttention and ViTAttention, not {name} (TorchOracle takes any module)")


def _readout(readout, d: int) -> np.ndarray:
    u = _numpy(readout) if isinstance(readout, torch.Tensor) else np.asarray(readout, dtype=np.float64)
    if u.shape != (d,):
        raise ValueError(f"readout must be a vector of length d = {d} (the layer's output width), got shape {u.shape}")
    if not np.isfinite(u).all():
        raise ValueError("readout must be finite")
    return u


def to_reduced(module, readout) -> MultiHeadAttention:
    """The ground truth ``(W_h, v_h, u_h)`` and ``c`` of a layer read out through ``readout`` (module
    docstring), in float64, one head per head of the layer (not canonicalised). White-box: for
    tests, benchmarks and diagnostics, never on the extraction path. Raises
    :class:`UnsupportedLayerError` for settings outside the model class, naming the setting;
    ``TypeError`` for other modules."""
    blocks = _blocks(module)
    r = _readout(readout, blocks.Wo.shape[1])
    W = blocks.sigma * np.einsum("hrd,hre->hde", blocks.Wk, blocks.Wq)  # sigma Wk_h^T Wq_h
    u = blocks.sigma * np.einsum("hrd,hr->hd", blocks.Wk, blocks.bq)  # sigma Wk_h^T b_Q_h
    v = np.einsum("hrd,hqr,q->hd", blocks.Wv, blocks.Wo, r)  # Wv_h^T Wo_h^T r
    c = float(r @ (np.einsum("hdr,hr->d", blocks.Wo, blocks.bv) + blocks.bo))
    return MultiHeadAttention(W, v, u, c)


def suggested_token_scale(module, readout) -> float:
    """A white-box token scale from the layer's weights (:meth:`MultiHeadAttention.suggested_token_scale`
    of :func:`to_reduced`): a diagnostic; extraction finds its scale from queries (``token_scale="auto"``)."""
    return to_reduced(module, readout).suggested_token_scale()


def _floating_dtype(module) -> torch.dtype:
    for tensor in list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []:
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def _device(module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []:
        return tensor.device
    return torch.device("cpu")


class TorchOracle:
    """Any torch module (or callable on tensors) as an oracle: ``readout^T`` of its output at the last position.

    Parameters
    ----------
    module : ``nn.Module`` or callable mapping a float tensor (B, N, d) to (B, N, d_out) (or a tuple
        whose first element is that). ``nn.MultiheadAttention`` is called as self-attention
        ``module(X, X, X)`` (either ``batch_first``). An ``nn.Module`` is copied in eval mode; the
        caller's is not changed. Nothing about its class is used.
    readout : vector of length d_out (array or tensor).

    Attributes
    ----------
    module : what answers (the eval-mode copy).
    readout : (d_out,) float64 array.
    dtype, device : the module's own (its first floating parameter's), in which it is run.
    answer_dtype : ``"float32"``, ``"float64"``, ...: the precision of the answers (reported as
        ``Extraction.answer_dtype``; a float32 layer cannot be extracted to float64 accuracy).
    calls, sequences : forward passes run and sequences answered.

    Sequences of equal length are stacked into one forward pass. Tokens must be float arrays (a
    torch layer serves float64 extractions, ``precision=None``).
    """

    def __init__(self, module, readout):
        if not callable(module):
            raise TypeError(f"module must be a torch.nn.Module or a callable on tensors, got {type(module).__name__}")
        self.dtype, self.device = _floating_dtype(module), _device(module)
        self.module = copy.deepcopy(module).eval() if isinstance(module, nn.Module) else module
        self.readout = _readout(readout, int(np.asarray(readout.detach().cpu() if isinstance(readout, torch.Tensor)
                                                        else readout).shape[0]))
        self._r = torch.as_tensor(self.readout, dtype=self.dtype, device=self.device)
        self.answer_dtype = str(torch.empty(0, dtype=self.dtype).numpy().dtype)
        self.calls = 0
        self.sequences = 0
        self._original = module

    @property
    def reduced(self) -> MultiHeadAttention:
        """:func:`to_reduced` of the layer: white-box ground truth, for diagnostics only."""
        return to_reduced(self._original, self.readout)

    @property
    def suggested_token_scale(self) -> float:
        """White-box diagnostic (reads the weights): see :func:`suggested_token_scale`."""
        return self.reduced.suggested_token_scale()

    def __repr__(self) -> str:
        return f"TorchOracle({type(self._original).__name__}, {self.answer_dtype}, d_out={len(self.readout)})"

    def __call__(self, batch) -> np.ndarray:
        sequences = as_batch(batch)
        for index, sequence in enumerate(sequences):
            if sequence.dtype == object:
                raise TypeError(f"sequence {index} holds Python objects (high-precision tokens?): a torch layer "
                                "answers in its own float dtype, run the extraction with precision=None")
        out = np.empty(len(sequences), dtype=np.float64)
        lengths = np.array([len(s) for s in sequences])
        with torch.inference_mode():
            for length in np.unique(lengths):
                index = np.flatnonzero(lengths == length)
                X = torch.as_tensor(np.stack([sequences[i] for i in index]), dtype=self.dtype, device=self.device)
                last = self._last_position(X)
                if last.shape != (len(index), len(self.readout)):
                    raise ValueError(f"the module's output at the last position has shape {tuple(last.shape)}, "
                                     f"expected (B, {len(self.readout)}) for a readout of length {len(self.readout)}")
                out[index] = (last @ self._r).cpu().numpy()
                self.calls += 1
        self.sequences += len(sequences)
        return out.astype(self.answer_dtype) if self.answer_dtype in ("float32", "float16") else out

    def _last_position(self, X: torch.Tensor) -> torch.Tensor:
        """The module's output at the last position for a batch (B, N, d) -> (B, d_out)."""
        if isinstance(self.module, nn.MultiheadAttention):
            if not self.module.batch_first:
                X = X.transpose(0, 1)  # (N, B, d)
            output = self.module(X, X, X, need_weights=False)[0]
            return output[:, -1] if self.module.batch_first else output[-1]
        output = self.module(X)
        if isinstance(output, (tuple, list)):
            output = output[0]
        if output.dim() != 3:
            raise ValueError(f"the module must map (B, N, d) to (B, N, d_out); it returned shape {tuple(output.shape)}")
        return output[:, -1]


class ReducedAttention(nn.Module):
    """A :class:`~mhaextract.MultiHeadAttention` as a torch module computing the same f.

    ``forward(X)`` takes tokens (B, N, d) (or one sequence (N, d)) and returns f per sequence,
    (B,) (or a scalar): ``f(X) = c + sum_h sum_i softmax_i(x_i^T (W_h x_N + u_h)) v_h^T x_i``.
    ``W`` (H, d, d), ``v`` and ``u`` (H, d) and ``c`` (a scalar) are float64 parameters.
    """

    def __init__(self, model: MultiHeadAttention):
        super().__init__()
        model = model.to_float64()
        self.W = nn.Parameter(torch.as_tensor(model.W, dtype=torch.float64))
        self.v = nn.Parameter(torch.as_tensor(model.v, dtype=torch.float64))
        self.u = nn.Parameter(torch.as_tensor(model.u, dtype=torch.float64))
        self.c = nn.Parameter(torch.tensor(float(model.c), dtype=torch.float64))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        single = X.dim() == 2
        X = X[None] if single else X
        if X.dim() != 3 or X.shape[-1] != self.W.shape[-1]:
            raise ValueError(f"expected tokens of shape (B, N, {self.W.shape[-1]}), got {tuple(X.shape)}")
        X = X.to(self.W.dtype)
        queries = torch.einsum("hde,be->bhd", self.W, X[:, -1]) + self.u[None]  # W_h x_N + u_h
        scores = torch.einsum("bnd,bhd->bhn", X, queries)
        weights = torch.softmax(scores, dim=-1)
        values = torch.einsum("bnd,hd->bhn", X, self.v)  # v_h^T x_i
        f = (weights * values).sum(dim=(1, 2)) + self.c
        return f[0] if single else f


def to_torch(model: MultiHeadAttention) -> ReducedAttention:
    """An extracted (or any) :class:`~mhaextract.MultiHeadAttention` as a torch module (float64)."""
    if not isinstance(model, MultiHeadAttention):
        raise TypeError(f"to_torch expects a MultiHeadAttention, got {type(model).__name__}")
    return ReducedAttention(model)
