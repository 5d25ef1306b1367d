"""Hugging Face rotary attention layers as oracles, their float64 truth, and rotary models back as torch layers.

Supported: transformers' ``LlamaAttention``, ``MistralAttention`` and ``Qwen2Attention`` (grouped-query
heads, Mistral's sliding window, Qwen2's biases and sliding layers). Such a layer does not map hidden
states to outputs on its own: its model hands it the rotary position embeddings and the mask.
:class:`RotaryLayer` supplies them as its model does, so that
``mhaextract.adapters.torch.TorchOracle(RotaryLayer(attention))`` answers the layer's output at the
final token of any sequence.

:func:`to_rotary` reads the weights into the exact :class:`~mhaextract.models.rotary.RotaryAttention`
(docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'): white-box ground truth for tests
and benchmarks, never on the extraction path. Head h of group ``g = h // (H / H_kv)`` (``H_kv`` key/value heads) has

    Q_h = s^2 sigma P Wq_h,   b_h = s^2 sigma P bq_h,   K_h = P Wk_g,   theta_h = inv_freq,
    V_h = Wo_h Wv_g,          c = bo + sum_h Wo_h bv_g,

with sigma the attention's score scale (``head_dim ** -0.5``), s the rotary embedding's
``attention_scaling`` (it multiplies cos and sin, so every score by s^2), and P the permutation of
rows taking ``rotate_half``'s pairs ``(m, m + r/2)`` to the consecutive pairs ``(2m, 2m + 1)``.
A key bias ``bk`` adds ``bk_g^T R(N - j) (Q_h x_N + b_h)`` to the score of key j: a score that
depends on the offset and not on the token, outside the model class, so it is refused.

:func:`to_torch_rotary` turns a :class:`~mhaextract.models.rotary.RotaryAttention` (extracted or
exact) into a causal layer (B, N, d) -> (B, N, d_out) whose output at every position is the model on
the prefix that ends there.

:func:`state_dict` (behind :func:`~mhaextract.adapters.export.to_state_dict`) is :func:`to_rotary`
inverted: a rotary model in the layout of a ``LlamaAttention``, ``MistralAttention`` or
``Qwen2Attention`` of the user's configuration, every mismatch refused by name, the loaded copy
read back and measured; :func:`layer` is what :func:`~mhaextract.adapters.export.to_torch` gives
for a rotary model.

Two details of transformers make a float64 layer less than float64-exact inside its model: the
rotary embedding computes its angles ``position * inv_freq`` and their cos and sin in float32
whatever the layer's dtype, and the eager attention takes its softmax in float32. ``RotaryLayer``
reproduces both by default (``angles="model"``, the attention's own implementation);
``angles="float64"`` with an sdpa layer is the exact float64 layer :func:`to_rotary` describes, and
:func:`float64_layer` builds that from any layer (the truth for layers :func:`to_rotary` refuses).
"""

from __future__ import annotations

import copy
import importlib

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("mhaextract.adapters.rotary needs PyTorch: pip install 'mhaextract[torch]'") from error

from scipy.optimize import linear_sum_assignment

from ..models.rotary import RotaryAttention
from .export import (
    ARITHMETIC, ExportReport, StateDict, UnsupportedLayerError, dropped, factor_at_width, measure_export,
)

__all__ = ["RotaryLayer", "to_rotary", "to_torch_rotary", "float64_layer", "ExtractedRotaryAttention", "causal_mask"]

#: Attention classes and the transformers model package that holds their rotary embedding.
FAMILIES = {"LlamaAttention": "llama", "MistralAttention": "mistral", "Qwen2Attention": "qwen2"}
#: Rotary types whose frequencies change with the sequence's length: not one RotaryAttention.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ANGLES = ("model", "float64")


def _family(attention) -> str:
    for cls in type(attention).__mro__:
        if cls.__name__ in FAMILIES and hasattr(attention, "q_proj") and hasattr(attention, "config"):
            return cls.__name__
    raise TypeError(f"the rotary adapters know transformers' {', '.join(FAMILIES)}, not {type(attention).__name__} "
                    "(pass the attention sublayer, e.g. model.model.layers[i].self_attn)")


def _default_rotary_embedding(attention, family: str) -> nn.Module:
    """``<Model>RotaryEmbedding(attention.config)``, as the attention's model builds it."""
    package = FAMILIES[family]
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    embedding = getattr(module, family.replace("Attention", "RotaryEmbedding"))(attention.config)
    device = next(attention.parameters()).device
    return embedding.to(device)


def _layer_window(attention, window) -> int | None:
    """The window the layer attends in its model: ``window`` when given, else the layer's own
    (Qwen2's ``sliding_window`` attribute, None on its full-attention layers), else the config's
    (Mistral), else None (Llama)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be a positive integer (tokens attended, the final one included) or None "
                             f"(the layer's own), got {window!r}")
        return int(window)
    if hasattr(attention, "sliding_window"):
        own = attention.sliding_window
    else:
        own = getattr(attention.config, "sliding_window", None)
    return None if own is None else int(own)


def _rope_type(rotary_embedding) -> str:
    rope_type = getattr(rotary_embedding, "rope_type", "default")
    return rope_type if isinstance(rope_type, str) else "default"


def _frequencies(rotary_embedding) -> tuple[np.ndarray, float]:
    """The rotary embedding's ``inv_freq`` (radians per position, float64) and its ``attention_scaling``."""
    if not hasattr(rotary_embedding, "inv_freq"):
        raise TypeError(f"rotary_embedding must be a transformers rotary embedding with inv_freq, got "
                        f"{type(rotary_embedding).__name__}")
    rope_type = _rope_type(rotary_embedding)
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise UnsupportedLayerError(f"rope_type {rope_type!r} changes its frequencies with the sequence's length: "
                                    "not one rotary model (docs/algorithm.md, "
                                    "'Rotary attention: positions, grouped heads and sliding windows')")
    inv_freq = rotary_embedding.inv_freq.detach().to(device="cpu", dtype=torch.float64).numpy().copy()
    return inv_freq, float(getattr(rotary_embedding, "attention_scaling", 1.0))


def causal_mask(length: int, window: int | None, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The additive mask (1, 1, N, N) of a causal layer: 0 where query i sees key j (``j <= i`` and,
    with a window, ``i - j < window``), the dtype's most negative number elsewhere (what
    transformers' eager path builds, and a float mask its sdpa path accepts).

    Examples
    --------
    >>> import torch
    >>> from mhaextract.adapters.rotary import causal_mask
    >>> (causal_mask(4, window=2, dtype=torch.float64)[0, 0] == 0).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    seen = j <= i
    if window is not None:
        seen = seen & (i - j < window)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(seen, zero, torch.finfo(dtype).min)[None, None]


class RotaryLayer(nn.Module):
    """A Hugging Face rotary attention layer as a module from hidden states (B, N, d) to outputs (B, N, d_out).

    Runs ``attention(hidden_states, position_embeddings=(cos, sin), attention_mask=mask)`` as the
    layer's model does: position ids ``0..N-1``, cos and sin from the rotary embedding, and the
    additive causal mask of :func:`causal_mask`, limited to the sliding window where the layer has
    one. The result is a plain module, so ``TorchOracle(RotaryLayer(attention))`` is an oracle of the
    layer (any dtype; TorchOracle batches sequences of one length together).

    Parameters
    ----------
    attention : transformers ``LlamaAttention``, ``MistralAttention`` or ``Qwen2Attention``
        The layer (held, not copied: ``TorchOracle`` copies).
    rotary_embedding : ``nn.Module``, optional
        The model's rotary embedding (``model.model.rotary_emb``). Default: the family's
        ``<Model>RotaryEmbedding(attention.config)``, which is what the model builds.
    window : int, optional
        Sliding window (tokens the final one attends, itself included). Default: the layer's own
        (Mistral's ``config.sliding_window``; Qwen2's on its sliding layers; none for Llama).
    angles : ``"model"`` or ``"float64"``
        ``"model"`` (default): cos and sin from the rotary embedding, as inside the model (transformers
        computes them in float32 whatever the layer's dtype). ``"float64"``: ``cos(p inv_freq)`` and
        ``sin(p inv_freq)`` (times the embedding's ``attention_scaling``) computed in float64, then
        cast to the layer's dtype: with a float64 sdpa layer, exactly the model :func:`to_rotary`
        reads (a float64 layer with the model's angles differs from it by about 1e-7 relative).

    Attributes
    ----------
    attention, rotary_embedding : the modules.
    window : int or None, the window applied.
    angles : str.

    Examples
    --------
    >>> import numpy as np, torch
    >>> from transformers import LlamaConfig
    >>> from transformers.models.llama.modeling_llama import LlamaAttention
    >>> from mhaextract.adapters.torch import TorchOracle
    >>> from mhaextract.adapters.rotary import RotaryLayer
    >>> config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    ...                      attn_implementation="sdpa")
    >>> attention = LlamaAttention(config, layer_idx=0).double()
    >>> layer = RotaryLayer(attention)
    >>> layer(torch.randn(3, 5, 16, dtype=torch.float64)).shape
    torch.Size([3, 5, 16])
    >>> TorchOracle(layer)([np.ones((4, 16)), np.ones((7, 16))]).shape     # the final token's outputs
    (2, 16)
    """

    def __init__(self, attention, rotary_embedding=None, window: int | None = None, angles: str = "model"):
        super().__init__()
        family = _family(attention)
        if angles not in ANGLES:
            raise ValueError(f"angles must be one of {ANGLES}, got {angles!r}")
        if rotary_embedding is not None and not callable(rotary_embedding):
            raise TypeError(f"rotary_embedding must be the model's rotary embedding module (model.model.rotary_emb), "
                            f"got {type(rotary_embedding).__name__}")
        self.attention = attention
        self.rotary_embedding = (_default_rotary_embedding(attention, family) if rotary_embedding is None
                                 else rotary_embedding)
        self.window = _layer_window(attention, window)
        self.angles = angles
        if angles == "float64":
            _frequencies(self.rotary_embedding)  # refuses length-dependent frequencies now, not at the first call

    def extra_repr(self) -> str:
        return f"window={self.window}, angles={self.angles!r}"

    def position_embeddings(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for positions ``0..N-1`` of a batch X (B, N, d), shape (B, N, head_dim), X's dtype."""
        B, N = X.shape[:2]
        position_ids = torch.arange(N, device=X.device)[None].expand(B, N)
        if self.angles == "model":
            return self.rotary_embedding(X, position_ids)
        inv_freq, scaling = _frequencies(self.rotary_embedding)
        angles = np.arange(N, dtype=np.float64)[:, None] * inv_freq[None]
        angles = np.concatenate([angles, angles], axis=1)  # rotate_half's layout: (m, m + r/2) share an angle
        cos, sin = (torch.as_tensor(f(angles) * scaling, device=X.device).to(X.dtype) for f in (np.cos, np.sin))
        return cos[None].expand(B, -1, -1), sin[None].expand(B, -1, -1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        d = self.attention.q_proj.in_features
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or hidden_states.shape[-1] != d:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise ValueError(f"RotaryLayer takes hidden states of shape (B, N, d) with d = {d} (the layer's "
                             f"hidden_size), got {shape}")
        if not hidden_states.is_floating_point() or hidden_states.shape[1] == 0:
            raise ValueError(f"RotaryLayer takes float hidden states of at least one position, got "
                             f"{hidden_states.dtype} of shape {tuple(hidden_states.shape)}")
        mask = causal_mask(hidden_states.shape[1], self.window, hidden_states.dtype, hidden_states.device)
        output = self.attention(hidden_states, position_embeddings=self.position_embeddings(hidden_states),
                                attention_mask=mask)
        return output[0] if isinstance(output, (tuple, list)) else output


def float64_layer(attention, rotary_embedding=None, window: int | None = None) -> RotaryLayer:
    """The exact float64 version of a layer: a float64 copy of it on the sdpa path (transformers' eager
    path takes its softmax in float32) with float64 angles. White-box ground truth, for any layer,
    including those :func:`to_rotary` refuses (a Qwen2 key bias); the caller's layer is not changed.

    Examples
    --------
    >>> import torch
    >>> from transformers import Qwen2Config
    >>> from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    >>> from mhaextract.adapters.rotary import float64_layer
    >>> attention = Qwen2Attention(Qwen2Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1), 0)
    >>> truth = float64_layer(attention)          # keeps the key bias to_rotary refuses
    >>> truth(torch.randn(1, 6, 16, dtype=torch.float64)).dtype
    torch.float64
    """
    _family(attention)
    exact = copy.deepcopy(attention).double()
    exact.config._attn_implementation = "sdpa"  # the copy's own config (deepcopy copies it)
    embedding = None if rotary_embedding is None else copy.deepcopy(rotary_embedding)
    return RotaryLayer(exact, embedding, window, angles="float64")


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def _bias(linear, rows: int) -> np.ndarray:
    return _numpy(linear.bias) if getattr(linear, "bias", None) is not None else np.zeros(rows)


def to_rotary(attention, rotary_embedding=None, window: int | None = None) -> RotaryAttention:
    """The exact :class:`~mhaextract.models.rotary.RotaryAttention` of a layer, from its weights, in float64.

    One head per query head of the layer (grouped heads share K and the value block), the vector
    model of the whole output (``V`` of shape (H, d_out, d); ``.readout(r)`` gives a read-out's
    scalar model); the formulas are in the module docstring. White-box: for tests, benchmarks and
    diagnostics, never on the extraction path. It computes what ``RotaryLayer(attention,
    angles="float64")`` computes on a float64 sdpa layer.

    Parameters
    ----------
    attention : transformers ``LlamaAttention``, ``MistralAttention`` or ``Qwen2Attention``
    rotary_embedding : its model's rotary embedding, optional (default as in :class:`RotaryLayer`).
    window : int, optional. Default: the layer's own, as in :class:`RotaryLayer`.

    Raises
    ------
    UnsupportedLayerError
        Frequencies that change with the length (``rope_type`` dynamic or longrope); a rotary
        embedding whose frequencies do not cover the head width. (A key bias, as Qwen2's, is the
        model's ``key_bias``.)
    TypeError
        Another kind of module.

    Examples
    --------
    >>> import numpy as np, torch
    >>> from transformers import MistralConfig
    >>> from transformers.models.mistral.modeling_mistral import MistralAttention
    >>> from mhaextract.adapters.rotary import RotaryLayer, to_rotary
    >>> config = MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    ...                        sliding_window=4, attn_implementation="sdpa")
    >>> attention = MistralAttention(config, layer_idx=0).double()
    >>> truth = to_rotary(attention)
    >>> truth
    RotaryAttention(d=16, heads=2, head_width=8, d_out=16, window=4)
    >>> X = torch.randn(1, 9, 16, dtype=torch.float64)
    >>> out = RotaryLayer(attention, angles="float64")(X)[0, -1].detach().numpy()
    >>> bool(np.allclose(truth(X.numpy()), out, atol=1e-13))
    True
    """
    family = _family(attention)
    rotary_embedding = _default_rotary_embedding(attention, family) if rotary_embedding is None else rotary_embedding
    inv_freq, attention_scaling = _frequencies(rotary_embedding)
    config = attention.config
    H, H_kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    r = int(attention.head_dim)
    if r % 2 or len(inv_freq) != r // 2:
        raise UnsupportedLayerError(f"{family}'s rotary embedding has {len(inv_freq)} frequencies for heads of "
                                    f"width {r}: a partial rotation is not read here (expected r / 2 = {r // 2})")
    bk = _bias(attention.k_proj, H_kv * r).reshape(H_kv, r)
    d = attention.q_proj.weight.shape[1]
    Wq = _numpy(attention.q_proj.weight).reshape(H, r, d)
    Wk = _numpy(attention.k_proj.weight).reshape(H_kv, r, d)
    Wv = _numpy(attention.v_proj.weight).reshape(H_kv, r, d)
    bq = _bias(attention.q_proj, H * r).reshape(H, r)
    bv = _bias(attention.v_proj, H_kv * r).reshape(H_kv, r)
    Wo = _numpy(attention.o_proj.weight)
    d_out = Wo.shape[0]
    Wo = Wo.reshape(d_out, H, r).transpose(1, 0, 2)  # (H, d_out, r): head h's block of columns
    group = np.arange(H) // (H // H_kv)  # query head h reads key/value head group[h] (repeat_kv)
    pairs = np.stack([np.arange(r // 2), np.arange(r // 2) + r // 2], axis=1).reshape(-1)  # row 2m <- m, 2m+1 <- m+r/2
    # cos and sin both carry attention_scaling s, so the rotated query and key carry s each: s^2 per score
    score_scale = float(attention.scaling) * attention_scaling ** 2
    Q = score_scale * Wq[:, pairs]
    b = score_scale * bq[:, pairs]
    K = Wk[group][:, pairs]
    V = np.einsum("hor,hrd->hod", Wo, Wv[group])
    c = _bias(attention.o_proj, d_out) + np.einsum("hor,hr->o", Wo, bv[group])
    theta = np.tile(inv_freq, (H, 1))
    key_bias = bk[group][:, pairs] if np.any(bk != 0) else None
    return RotaryAttention(Q, K, theta, V, c, window=_layer_window(attention, window), b=b, key_bias=key_bias)


class ExtractedRotaryAttention(nn.Module):
    """A :class:`~mhaextract.models.rotary.RotaryAttention` as a torch layer: (B, N, d) -> (B, N, d_out).

    Head h scores key j from position i as ``(K_h x_j + k_h)^T R_h(i - j) (Q_h x_i + b_h)``, computed as
    Llama does with absolute positions (query rotated by ``i theta_h``, key by ``j theta_h``, on
    consecutive pairs), over the keys ``j <= i`` with ``i - j < window`` (``causal=True``), or over
    every key (``causal=False``, no window). The output at i is ``c + sum_h V_h`` times the
    attention-weighted mean of the tokens: with ``causal=True``, the model on the prefix ending at i.
    Parameters Q, K (H, r, d), theta (H, r/2), b and key_bias (H, r), V (H, d_out, d), c (d_out,), float64
    by default;
    a scalar model has d_out = 1.

    Examples
    --------
    >>> import numpy as np, torch
    >>> import mhaextract as mx
    >>> from mhaextract.adapters.rotary import ExtractedRotaryAttention
    >>> model = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=0, d_out=3, window=3)
    >>> layer = ExtractedRotaryAttention(model)
    >>> X = np.random.default_rng(0).normal(size=(1, 7, 6))
    >>> out = layer(torch.as_tensor(X)).detach().numpy()
    >>> bool(np.allclose(out[0, 4], model(X[:, :5])[0]))         # position 4: the prefix of 5 tokens
    True
    """

    def __init__(self, model: RotaryAttention, causal: bool = True, dtype=torch.float64):
        super().__init__()
        if not isinstance(model, RotaryAttention):
            raise TypeError(f"expected a RotaryAttention, got {type(model).__name__}")
        if not causal and model.window is not None:
            raise ValueError(f"causal=False with the model's window of {model.window} tokens: a window is a "
                             "causal layer's (the final token attends to the last ones); pass causal=True")
        self.causal = bool(causal)
        self.window = model.window
        self.vector = model.is_vector
        values = {"Q": model.Q, "K": model.K, "theta": model.theta, "b": model.b, "V": model.V,
                  "c": np.reshape(np.asarray(model.c, dtype=np.float64), -1),
                  "key_bias": model.key_bias_or_zero}
        for name, value in values.items():
            setattr(self, name, nn.Parameter(torch.as_tensor(value, dtype=dtype)))

    def extra_repr(self) -> str:
        H, r, d = self.Q.shape
        return f"d={d}, heads={H}, head_width={r}, d_out={self.V.shape[1]}, causal={self.causal}, window={self.window}"

    def _rotate(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows (B, H, N, r) of position n rotated by ``n theta_h`` on consecutive pairs."""
        angles = positions[None, :, None] * self.theta[:, None, :]  # (H, N, r/2)
        cos, sin = torch.cos(angles), torch.sin(angles)
        even, odd = rows[..., 0::2], rows[..., 1::2]
        return torch.stack([cos * even - sin * odd, sin * even + cos * odd], dim=-1).flatten(-2)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        single = X.dim() == 2
        X = X[None] if single else X
        d = self.Q.shape[-1]
        if X.dim() != 3 or X.shape[-1] != d:
            raise ValueError(f"expected tokens of shape (B, N, {d}), got {tuple(X.shape)}")
        X = X.to(self.Q.dtype)
        N = X.shape[1]
        positions = torch.arange(N, dtype=self.Q.dtype, device=X.device)
        queries = self._rotate(torch.einsum("hrd,bnd->bhnr", self.Q, X) + self.b[None, :, None, :], positions)
        keys = self._rotate(torch.einsum("hrd,bnd->bhnr", self.K, X) + self.key_bias[None, :, None, :], positions)
        scores = queries @ keys.transpose(-1, -2)  # (B, H, N, N): (R(j) k_j)^T R(i) q_i = k_j^T R(i - j) q_i
        if self.causal:
            scores = scores + causal_mask(N, self.window, scores.dtype, X.device)
        means = torch.softmax(scores, dim=-1) @ X[:, None]  # (B, H, N, d)
        out = torch.einsum("hod,bhnd->bno", self.V, means) + self.c
        return out[0] if single else out


def to_torch_rotary(model: RotaryAttention, causal: bool = True, dtype=torch.float64) -> ExtractedRotaryAttention:
    """A :class:`~mhaextract.models.rotary.RotaryAttention` (extracted, or :func:`to_rotary`'s truth) as
    a torch layer mapping (B, N, d) to (B, N, d_out): with ``causal=True`` the output at every
    position i is ``model`` on the prefix ``x_0..x_i`` (its window respected); a scalar model gives
    d_out = 1. See :class:`ExtractedRotaryAttention`.

    Examples
    --------
    >>> import numpy as np, torch
    >>> import mhaextract as mx
    >>> from mhaextract.adapters.rotary import to_torch_rotary
    >>> model = mx.RotaryAttention.random(d=4, heads=2, head_width=2, seed=1, bias=True)
    >>> layer = to_torch_rotary(model)
    >>> X = torch.randn(2, 6, 4, dtype=torch.float64)
    >>> out = layer(X).detach()
    >>> out.shape                                                 # scalar model: d_out = 1
    torch.Size([2, 6, 1])
    >>> bool(np.allclose(out[:, -1, 0].numpy(), model(X.numpy())))
    True
    """
    return ExtractedRotaryAttention(model, causal, dtype)


# -- back into the layer's own class ---------------------------------------------------------------


def layer(model: RotaryAttention, causal: bool | None, width: int | None, dtype, tolerance: float):
    """The adapter :func:`~mhaextract.adapters.export.to_torch` dispatches to for a rotary model:
    :class:`ExtractedRotaryAttention`, causal unless ``causal=False`` (every supported rotary family
    is a decoder's; a result's causal record decides where there is one)."""
    if width is not None and width != model.head_width:
        raise ValueError(f"width={width}: a rotary model's heads keep their width {model.head_width} (each rotary "
                         "block pairs two rows of it); pass width=None")
    dtype = torch.float64 if dtype is None else dtype
    return ExtractedRotaryAttention(model, True if causal is None else causal, dtype)


def _shared_gauge(head: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, float]:
    """Per block m, the scaled rotation ``G_m = [[a, -b], [b, a]]`` (it commutes with every R) with
    ``head[m] ~= G_m reference[m]`` for (r, d + 1) rows ``[K | k]``, by least squares; and the
    misfit relative to ``head``'s largest row norm. Shape (r/2, 2, 2)."""
    blocks = head.reshape(-1, 2, head.shape[-1])
    basis = reference.reshape(-1, 2, head.shape[-1])
    gauges = np.zeros((len(blocks), 2, 2))
    misfit = 0.0
    for m, (target, rows) in enumerate(zip(blocks, basis)):
        columns = np.stack([rows.reshape(-1), np.concatenate([-rows[1], rows[0]])], axis=1)  # a, b
        (a, b), *_ = np.linalg.lstsq(columns, target.reshape(-1), rcond=None)
        gauges[m] = [[a, -b], [b, a]]
        misfit = max(misfit, float(np.abs(columns @ [a, b] - target.reshape(-1)).max()))
    return gauges, misfit / max(float(np.abs(head).max()), 1e-300)


def _placed_blocks(model: RotaryAttention, inv_freq: np.ndarray, tolerance: float, family: str, report) -> list:
    """Each head's rows permuted so that its block m turns at the class's frequency ``inv_freq[m]``
    (blocks assigned by their frequencies): ``(query [Q | b], key [K | k])`` of (r, d + 1) each."""
    r = 2 * len(inv_freq)
    placed = []
    for h in range(model.heads):
        if model.head_width > r:
            raise UnsupportedLayerError(f"head {h} has {model.head_width // 2} rotary blocks; {family}'s heads have "
                                        f"{r // 2} (head_dim {r}): build the class with head_dim >= {model.head_width}")
        cost = np.abs(model.theta[h][:, None] - inv_freq[None, :])
        rows, columns = linear_sum_assignment(cost)
        off = float(cost[rows, columns].max(initial=0.0))
        if off > max(tolerance, 1e-12):
            raise UnsupportedLayerError(f"head {h}'s blocks turn at frequencies {off:.1e} radians per position from "
                                        f"{family}'s (rope_theta, head_dim and rope_scaling fix them): build the class "
                                        f"with the model's frequencies, or pass tolerance={off:.1e} to round them")
        report.cut(f"head {h}'s frequencies", off, beyond_gap=off > ARITHMETIC)
        query = np.zeros((r, model.d + 1))
        key = np.zeros((r, model.d + 1))
        for m, k in zip(rows, columns):
            query[2 * k:2 * k + 2] = np.column_stack([model.Q[h, 2 * m:2 * m + 2], model.b[h, 2 * m:2 * m + 2]])
            key[2 * k:2 * k + 2] = np.column_stack([model.K[h, 2 * m:2 * m + 2],
                                                    model.key_bias_or_zero[h, 2 * m:2 * m + 2]])
        placed.append((query, key))
    return placed


def _groups(placed: list, H: int, H_kv: int, tolerance: float, family: str, report) -> list[list[int]]:
    """Heads sharing their keys up to a per-block scaled rotation, at most ``H / H_kv`` to a group and
    at most ``H_kv`` groups (grouped-query attention's key/value heads); refused otherwise."""
    per_group = H // H_kv
    groups: list[list[int]] = []
    for h, (_, key) in enumerate(placed):
        for group in groups:
            _, misfit = _shared_gauge(key, placed[group[0]][1])
            if len(group) < per_group and misfit <= max(tolerance, 1e-12):
                report.cut(f"head {h}'s keys shared with head {group[0]}'s", misfit, beyond_gap=misfit > ARITHMETIC)
                group.append(h)
                break
        else:
            if len(groups) == H_kv:
                raise UnsupportedLayerError(
                    f"the model's heads need more than {family}'s {H_kv} key/value heads of {per_group} query heads "
                    f"each (head {h} shares its keys with no group that has room): build the class with more "
                    "num_key_value_heads (or num_attention_heads)")
            groups.append([h])
    return groups


def state_dict(model: RotaryAttention, like, tolerance: float):
    """A rotary model in the layout of ``like`` (``LlamaAttention``, ``MistralAttention``,
    ``Qwen2Attention``), the inverse of :func:`to_rotary`: each head's blocks placed at the class's
    frequencies, heads grouped onto the key/value heads (a group's keys one ``[K | k]`` up to a
    per-block scaled rotation G, absorbed as ``G^T`` into its queries: ``(G K x + G k)^T R q =
    (K x + k)^T R G^T q``), a group's values ``[V_h; ...] = [Wo_h; ...] Wv_g`` factored at the head
    width, and ``c`` carried by the output bias, else the value bias, else refused. Measured by
    reading the loaded copy back with :func:`to_rotary`."""
    if not isinstance(model, RotaryAttention):
        raise TypeError(f"expected a RotaryAttention, got {type(model).__name__}")
    family = _family(like)
    report = ExportReport(family, tolerance)
    inv_freq, attention_scaling = _frequencies(_default_rotary_embedding(like, family))
    config = like.config
    H, H_kv, r = int(config.num_attention_heads), int(config.num_key_value_heads), int(like.head_dim)
    d, d_out = like.q_proj.in_features, like.o_proj.out_features
    if not model.is_vector or model.d != d or model.d_out != d_out:
        raise UnsupportedLayerError(f"{family} maps d = {d} to d_out = {d_out}; the model has d = {model.d}, d_out "
                                    f"= {model.d_out if model.is_vector else 'scalar'} (a read-out's model is one "
                                    "number per sequence: extract with TorchOracle(RotaryLayer(layer)))")
    if model.window != _layer_window(like, None):
        raise UnsupportedLayerError(f"the model attends a window of {model.window} tokens, {family} (layer "
                                    f"{like.layer_idx}) {_layer_window(like, None)}: set its config's sliding_window "
                                    "to the model's")
    model = model.to_float64().canonical()
    if model.heads > H:
        raise UnsupportedLayerError(f"the model has {model.heads} canonical heads; {family} holds {H}: build it with "
                                    f"at least {model.heads} num_attention_heads")
    placed = _placed_blocks(model, inv_freq, tolerance, family, report)
    groups = _groups(placed, H, H_kv, tolerance, family, report)
    score_scale = float(like.scaling) * attention_scaling ** 2
    pairs = np.stack([np.arange(r // 2), np.arange(r // 2) + r // 2], axis=1).reshape(-1)  # as in to_rotary
    query, key = np.zeros((H, r, d + 1)), np.zeros((H_kv, r, d + 1))
    Wv, Wo = np.zeros((H_kv, r, d)), np.zeros((H, d_out, r))
    for g, members in enumerate(groups):
        key[g, pairs] = placed[members[0]][1]
        values = np.vstack([model.V[h] for h in members])
        outputs, Wv[g] = factor_at_width(values, r, tolerance, f"the values of heads {members}", family, report,
                                         "build the class with head_dim >= {rank} or more key/value heads")
        for n, h in enumerate(members):
            gauges, _ = _shared_gauge(placed[h][1], placed[members[0]][1])
            turned = np.einsum("mba,mbe->mae", gauges, placed[h][0].reshape(-1, 2, d + 1)).reshape(r, d + 1)
            slot = g * (H // H_kv) + n
            query[slot, pairs] = turned / score_scale
            Wo[slot] = outputs[n * d_out:(n + 1) * d_out]
    c = np.reshape(model.c, -1)
    weights = {"q_proj.weight": query[..., :d].reshape(H * r, d), "k_proj.weight": key[..., :d].reshape(H_kv * r, d),
               "v_proj.weight": Wv.reshape(H_kv * r, d), "o_proj.weight": Wo.transpose(1, 0, 2).reshape(d_out, H * r)}
    biases = {"q_proj.bias": query[..., d].reshape(-1), "k_proj.bias": key[..., d].reshape(-1),
              "v_proj.bias": np.zeros(H_kv * r), "o_proj.bias": c}
    state = {name: tensor.detach().clone() for name, tensor in like.state_dict().items()}
    if "o_proj.bias" not in state and "v_proj.bias" in state:  # c = sum_h Wo_h bv_g (Qwen2)
        carriers = np.hstack([Wo[g * (H // H_kv):(g + 1) * (H // H_kv)].sum(axis=0) for g in range(H_kv)])
        bv, *_ = np.linalg.lstsq(carriers, c, rcond=None)
        biases["v_proj.bias"], biases["o_proj.bias"] = bv, c - carriers @ bv
    for name, value in {**weights, **biases}.items():
        if name not in state:
            dropped(value, weights[name.replace("bias", "weight")], tolerance, repr(name), family, report)
            continue
        state[name] = torch.as_tensor(value, dtype=state[name].dtype, device=state[name].device)
    loaded = copy.deepcopy(like)
    loaded.load_state_dict(state)
    measure_export(report, to_rotary(loaded), model, longest=64)
    return StateDict(state, report)
