"""Real attention layers as oracles: ``torch.nn.MultiheadAttention`` and Hugging Face GPT-2 attention.

A layer with ``H`` heads of width ``r = d / H`` has per head ``r x d`` query, key and value blocks
``Wq_h, Wk_h, Wv_h``, a ``d x r`` output block ``Wo_h`` and a score scale ``sigma`` (``1/sqrt(r)``
by default). Read out at the last position through a vector ``u`` it is the model of
docs/algorithm.md §1 with

    W_h = sigma * Wk_h^T Wq_h        v_h = Wv_h^T Wo_h^T u,

which is what :func:`to_reduced` returns. Biases (``b_Q, b_K, b_V, b_O``):

* ``b_K`` adds ``sigma (Wq_h x_N + b_Q_h)^T b_K_h`` to every score of a row: the same for all
  tokens, it cancels in the softmax. Accepted, whatever its value.
* ``b_Q`` adds ``sigma b_Q_h^T Wk_h x_i``, a score linear in the key token. The model class has
  no such term (the extractor would return wrong heads): a non-zero ``b_Q`` is refused.
* ``b_V`` and ``b_O`` add the constant ``u^T (sum_h Wo_h b_V_h + b_O)`` to every answer (the
  attention weights sum to one). The constant is identifiable (the one-token query of the zero
  vector returns it) but the extractor learns ``f`` without a constant term, so a layer whose
  constant is non-zero is refused, naming the biases; zero them (or their read-out) to extract.
* ``add_bias_kv``, ``add_zero_attn``, keys/values of another dimension (``kdim``/``vdim``) and
  GPT-2 cross-attention change the model: refused, naming the setting.

Real layers' ``W_h`` are not scaled like :meth:`MultiHeadAttention.random`'s (GPT-2's weights
have standard deviation 0.02, so its ``W_h`` are ~1e4 times smaller): pass
``token_scale=TorchOracle.suggested_token_scale`` (computed from the layer's own weights, see
:meth:`~mhaextract.MultiHeadAttention.suggested_token_scale`) or another value that puts
``|z^T W_h x|`` at order one; with the default scale the extraction's checks fail.
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
    bq, bk, bv (H, r) and bo (d,), the score scale sigma; ``names`` say where each bias lives."""

    kind: str
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wo: np.ndarray
    bq: np.ndarray
    bv: np.ndarray
    bo: np.ndarray
    sigma: float
    names: dict


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def _is_gpt2_attention(module) -> bool:
    return type(module).__name__ == "GPT2Attention" and hasattr(module, "c_attn") and hasattr(module, "c_proj")


def _blocks(module) -> _Blocks:
    """Split a supported layer into heads, refusing settings that change the model."""
    if isinstance(module, nn.MultiheadAttention):
        return _multihead_attention_blocks(module)
    if _is_gpt2_attention(module):
        return _gpt2_blocks(module)
    raise TypeError(
        f"unsupported layer {type(module).__name__}: expected torch.nn.MultiheadAttention or "
        "transformers' GPT2Attention"
    )


def _multihead_attention_blocks(module: nn.MultiheadAttention) -> _Blocks:
    if not module._qkv_same_embed_dim:
        raise UnsupportedLayerError(
            f"nn.MultiheadAttention with kdim={module.kdim}, vdim={module.vdim} != embed_dim={module.embed_dim}: "
            "keys and values of another dimension are cross-attention; the oracle feeds one sequence as "
            "query, key and value"
        )
    if module.bias_k is not None or module.bias_v is not None:
        raise UnsupportedLayerError(
            "nn.MultiheadAttention with add_bias_kv=True appends learned key/value tokens to every "
            "sequence: not the model the extractor learns"
        )
    if module.add_zero_attn:
        raise UnsupportedLayerError(
            "nn.MultiheadAttention with add_zero_attn=True appends a zero key/value token to every "
            "sequence: not the model the extractor learns"
        )
    d, H = module.embed_dim, module.num_heads
    r = d // H
    Wq, Wk, Wv = _numpy(module.in_proj_weight).reshape(3, H, r, d)  # rows [q; k; v], heads along rows
    Wo = _numpy(module.out_proj.weight).reshape(d, H, r).transpose(1, 0, 2)  # columns split into heads
    if module.in_proj_bias is not None:
        bq, _, bv = _numpy(module.in_proj_bias).reshape(3, H, r)
    else:
        bq = bv = np.zeros((H, r))
    bo = _numpy(module.out_proj.bias) if module.out_proj.bias is not None else np.zeros(d)
    names = {"bq": "in_proj_bias[:embed_dim] (the query bias)", "bv": "in_proj_bias[2*embed_dim:] (the value bias)",
             "bo": "out_proj.bias"}
    return _Blocks("nn.MultiheadAttention", Wq, Wk, Wv, Wo, bq, bv, bo, 1.0 / np.sqrt(r), names)


def _gpt2_blocks(module) -> _Blocks:
    config = module.config
    if getattr(module, "is_cross_attention", False):
        raise UnsupportedLayerError("GPT2Attention with is_cross_attention=True attends to encoder states: "
                                    "not self-attention over the query sequence")
    if getattr(config, "reorder_and_upcast_attn", False) and getattr(config, "_attn_implementation", None) in (None, "eager"):
        raise UnsupportedLayerError(
            "GPT2Attention with config.reorder_and_upcast_attn=True computes the attention weights in float32 "
            "(eager attention): the oracle runs in float64; set it to False"
        )
    d, H = module.embed_dim, module.num_heads
    r = d // H
    # Conv1D computes x @ weight + bias: weight is (in, out), the transpose of nn.Linear's.
    qkv = _numpy(module.c_attn.weight).T  # (3d, d), rows [q; k; v] like nn.MultiheadAttention
    Wq, Wk, Wv = qkv.reshape(3, H, r, d)
    Wo = _numpy(module.c_proj.weight).T.reshape(d, H, r).transpose(1, 0, 2)
    bq, _, bv = _numpy(module.c_attn.bias).reshape(3, H, r)
    bo = _numpy(module.c_proj.bias)
    sigma = 1.0
    if config.scale_attn_weights:
        sigma = r ** -0.5
    if config.scale_attn_by_inverse_layer_idx:
        sigma /= float(module.layer_idx + 1)
    names = {"bq": "c_attn.bias[:n_embd] (the query bias)", "bv": "c_attn.bias[2*n_embd:] (the value bias)",
             "bo": "c_proj.bias"}
    return _Blocks("GPT2Attention", Wq, Wk, Wv, Wo, bq, bv, bo, sigma, names)


def _readout(readout, d: int) -> np.ndarray:
    u = _numpy(readout) if isinstance(readout, torch.Tensor) else np.asarray(readout, dtype=np.float64)
    if u.shape != (d,):
        raise ValueError(f"readout must be a vector of length d = {d} (the layer's width), got shape {u.shape}")
    if not np.isfinite(u).all():
        raise ValueError("readout must be finite")
    return u


def to_reduced(module, readout) -> MultiHeadAttention:
    """The ground truth ``(W_h, v_h)`` of a layer read out through ``readout`` (module docstring).

    ``W_h = sigma Wk_h^T Wq_h`` and ``v_h = Wv_h^T Wo_h^T u`` in float64, one per head of the layer
    (not canonicalised). Raises :class:`UnsupportedLayerError` for a non-zero query bias, a
    non-zero constant from value/output biases, ``add_bias_kv``, ``add_zero_attn``, ``kdim``/
    ``vdim`` and cross-attention, naming the setting; ``TypeError`` for other modules.
    """
    blocks = _blocks(module)
    u = _readout(readout, blocks.Wq.shape[2])
    if np.any(blocks.bq != 0):
        raise UnsupportedLayerError(
            f"{blocks.kind}: the query bias {blocks.names['bq']} is non-zero: it adds a score "
            "sigma * b_Q^T Wk_h x_i linear in each key token, which the model class (scores x_i^T W_h x_N) "
            "does not have; set it to zero"
        )
    offset = float(u @ (np.einsum("hdr,hr->d", blocks.Wo, blocks.bv) + blocks.bo))
    if offset != 0.0:
        raise UnsupportedLayerError(
            f"{blocks.kind}: the value bias {blocks.names['bv']} and output bias {blocks.names['bo']} add the "
            f"constant u^T (W_O b_V + b_O) = {offset:.6g} to every answer; the extractor learns f without a "
            "constant term. Zero these biases (the key bias may stay: it cancels in the softmax)"
        )
    W = blocks.sigma * np.einsum("hrd,hre->hde", blocks.Wk, blocks.Wq)  # sigma Wk_h^T Wq_h
    v = np.einsum("hrd,hqr,q->hd", blocks.Wv, blocks.Wo, u)  # Wv_h^T Wo_h^T u
    return MultiHeadAttention(W, v)


class TorchOracle:
    """A real attention layer as an oracle: ``readout^T`` of its output at the last position.

    Parameters
    ----------
    module : ``torch.nn.MultiheadAttention`` (either ``batch_first``) or transformers'
        ``GPT2Attention``. A float64 copy in eval mode is queried (on the module's device); the
        caller's module is not changed.
    readout : vector of length d (array or tensor), the read-out ``u``.

    Attributes
    ----------
    module : the float64 eval-mode copy that answers.
    readout : (d,) float64 array.
    d, heads : token dimension and the layer's head count.
    kind : ``"nn.MultiheadAttention"`` or ``"GPT2Attention"``.
    reduced : :class:`~mhaextract.MultiHeadAttention`, :func:`to_reduced` of the layer.
    suggested_token_scale : float, a ``token_scale`` for :func:`mhaextract.extract` computed from
        the layer's weights (``reduced.suggested_token_scale()``).
    calls, sequences : forward passes run and sequences answered.

    Sequences of equal length are stacked into one forward pass. Tokens must be float64 arrays:
    the layer computes in float64, so it serves float64 extractions (``precision=None``).
    """

    def __init__(self, module, readout):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.reduced = to_reduced(module, readout)  # validates the layer and the read-out
        self.kind = _blocks(module).kind
        parameter = next(module.parameters(), None)
        self.device = parameter.device if parameter is not None else torch.device("cpu")
        self.module = copy.deepcopy(module).to(dtype=torch.float64).eval()
        if self.kind == "GPT2Attention" and getattr(self.module.config, "_attn_implementation", None) is None:
            # A standalone GPT2Attention has no dispatch set; eager is what transformers falls back to.
            self.module.config._attn_implementation = "eager"
        self.readout = _readout(readout, self.reduced.d)
        self._u = torch.as_tensor(self.readout, dtype=torch.float64, device=self.device)
        self.calls = 0
        self.sequences = 0

    @property
    def d(self) -> int:
        return self.reduced.d

    @property
    def heads(self) -> int:
        return self.reduced.heads

    @property
    def suggested_token_scale(self) -> float:
        return self.reduced.suggested_token_scale()

    def __repr__(self) -> str:
        return f"TorchOracle({self.kind}, d={self.d}, heads={self.heads})"

    def __call__(self, batch) -> np.ndarray:
        sequences = as_batch(batch, self.d)
        for index, sequence in enumerate(sequences):
            if sequence.dtype == object:
                raise TypeError(
                    f"sequence {index} holds Python objects (high-precision tokens?): a torch layer answers in "
                    "float64, run the extraction with precision=None"
                )
        out = np.empty(len(sequences), dtype=np.float64)
        lengths = np.array([len(s) for s in sequences])
        with torch.inference_mode():
            for length in np.unique(lengths):
                index = np.flatnonzero(lengths == length)
                X = torch.as_tensor(np.stack([sequences[i] for i in index]), dtype=torch.float64, device=self.device)
                out[index] = (self._last_position(X) @ self._u).cpu().numpy()
                self.calls += 1
        self.sequences += len(sequences)
        return out

    def _last_position(self, X: torch.Tensor) -> torch.Tensor:
        """The layer's output at the last position for a batch (B, N, d) -> (B, d)."""
        if self.kind == "nn.MultiheadAttention":
            if not self.module.batch_first:
                X = X.transpose(0, 1)  # (N, B, d)
            output = self.module(X, X, X, need_weights=False)[0]
            return output[:, -1] if self.module.batch_first else output[-1]
        # GPT-2's causal mask (when its attention implementation applies one) leaves the last
        # position attending to every token: exactly f.
        return self.module(X)[0][:, -1]


class ReducedAttention(nn.Module):
    """A :class:`~mhaextract.MultiHeadAttention` as a torch module computing the same f.

    ``forward(X)`` takes tokens (B, N, d) (or one sequence (N, d)) and returns f per sequence,
    (B,) (or a scalar): ``f(X) = sum_h sum_i softmax_i(x_i^T W_h x_N) v_h^T x_i``. ``W`` (H, d, d)
    and ``v`` (H, d) are float64 parameters.
    """

    def __init__(self, model: MultiHeadAttention):
        super().__init__()
        model = model.to_float64()
        self.W = nn.Parameter(torch.as_tensor(model.W, dtype=torch.float64))
        self.v = nn.Parameter(torch.as_tensor(model.v, dtype=torch.float64))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        single = X.dim() == 2
        X = X[None] if single else X
        if X.dim() != 3 or X.shape[-1] != self.W.shape[-1]:
            raise ValueError(f"expected tokens of shape (B, N, {self.W.shape[-1]}), got {tuple(X.shape)}")
        X = X.to(self.W.dtype)
        scores = torch.einsum("bnd,hde,be->bhn", X, self.W, X[:, -1])  # x_i^T W_h x_N
        weights = torch.softmax(scores, dim=-1)
        values = torch.einsum("bnd,hd->bhn", X, self.v)  # v_h^T x_i
        f = (weights * values).sum(dim=(1, 2))
        return f[0] if single else f


def to_torch(model: MultiHeadAttention) -> ReducedAttention:
    """An extracted (or any) :class:`~mhaextract.MultiHeadAttention` as a torch module (float64)."""
    if not isinstance(model, MultiHeadAttention):
        raise TypeError(f"to_torch expects a MultiHeadAttention, got {type(model).__name__}")
    return ReducedAttention(model)
