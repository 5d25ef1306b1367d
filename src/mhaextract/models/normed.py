"""Attention behind a norm, with the residual around it: the attention sublayer of a pre-norm block
(docs/algorithm.md, 'Attention behind a norm: the sublayer of a block').

At the final position N of raw hidden states ``X = (x_1, ..., x_N)`` in R^d::

    n(x)  = (x - mean(x) 1) / sqrt(var(x) + eps)     LayerNorm   (var: the mean of the squares)
    n(x)  = x / sqrt(|x|^2 / d + eps)                RMSNorm
    z_i   = Q^T n(x_i)                               Q: orthonormal basis of 1^perp (LayerNorm), I (RMSNorm)
    y(X)  = R x_N + f(Z)                             f: the inner biased attention (MultiHeadAttention),
                                                        or rotary attention (RotaryAttention: Llama's sublayer)

A read-out ``r^T y`` (an oracle answering one number a sequence) is the same form with the scalar inner
model (``v_h = V_h^T r``, ``r^T c``) and the residual's read-out vector ``rho = R^T r`` in place of R:
``r^T y(X) = rho^T x_N + f_r(Z)`` (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block',
'A scalar read-out').

The norm's gamma and beta are folded into the inner heads (``W'' = Q^T G W G Q``, ...), which is the
canonical form: only those products are identifiable.

:class:`PostNormAttention` is the sublayer of a post-norm block (BERT's ``BertAttention``,
docs/algorithm.md, 'Attention behind a norm: the sublayer of a block', 'The norm after the
residual'): the attention on the raw tokens, the residual, then a LayerNorm with its own gamma and
beta, ``y(X) = gamma * n(x_N + f(X)) + beta``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flint import arb

from ..numerics.highprec import GUARD_BITS, arb_to_mpf, rounded_mpf, to_arb, working_precision
from .attention import MultiHeadAttention, as_batch
from .compare import compare, compare_attention, register_comparison
from .kinds import document_numbers, read_numbers, register_model_kind
from .rotary import RotaryAttention

#: The norms a sublayer may have before its attention.
NORMS = ("layernorm", "rmsnorm")


def norm_basis(norm: str, d: int) -> np.ndarray:
    """``Q`` (d x k): the fixed orthonormal basis of the space a norm's output fills: for a LayerNorm
    the d - 1 last columns of the QR factor of ``[1 | e_1 .. e_{d-1}]`` (``1^perp``), for an RMSNorm
    the identity.

    Examples
    --------
    >>> import numpy as np
    >>> Q = norm_basis("layernorm", 4)
    >>> Q.shape, bool(np.allclose(Q.T @ Q, np.eye(3))), bool(np.allclose(np.ones(4) @ Q, 0))
    ((4, 3), True, True)
    """
    if norm == "rmsnorm":
        return np.eye(d)
    if norm != "layernorm":
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if d < 2:
        raise ValueError(f"a LayerNorm needs d >= 2 (its output is mean-free), got d = {d}")
    Q, _ = np.linalg.qr(np.column_stack([np.ones(d), np.eye(d)[:, :d - 1]]))
    return Q[:, 1:]


def normalize(X: np.ndarray, norm: str, eps: float) -> np.ndarray:
    """``n(x)`` of every row of X (float64, or the dtype of X)."""
    X = np.asarray(X)
    if norm == "layernorm":
        X = X - X.mean(axis=-1, keepdims=True)
    return X / np.sqrt((X * X).mean(axis=-1, keepdims=True) + X.dtype.type(eps))


def normalize_balls(X, norm: str, eps: float) -> list[list[arb]]:
    """``n(x)`` of every row of X (floats or ``mpf``, exact) as flint ``arb`` balls at the working
    precision (:func:`~mhaextract.numerics.highprec.working_precision`): the same formula as
    :func:`normalize`, its every rounding enclosed."""
    eps_ball, rows = to_arb(float(eps)), []
    for row in X:
        x = [to_arb(value) for value in row]
        if norm == "layernorm":
            mean = sum(x, arb(0)) / len(x)
            x = [value - mean for value in x]
        scale = (sum((value * value for value in x), arb(0)) / len(x) + eps_ball).sqrt()
        rows.append([value / scale for value in x])
    return rows


def reachable(T: np.ndarray, eps: float) -> np.ndarray:
    """Raw tokens whose norm output is T (rows of norm below sqrt(d), mean-free for a LayerNorm):
    ``x = t sqrt(eps / (1 - |t|^2 / d))``, the inverse of n on each ray. A ValueError when a row is
    outside the open ball of radius sqrt(d) (no raw token reaches it)."""
    T = np.asarray(T, dtype=np.float64)
    fraction = (T * T).sum(axis=-1, keepdims=True) / T.shape[-1]
    if not np.all(fraction < 1):
        worst = float(np.sqrt(fraction.max() * T.shape[-1]))
        raise ValueError(f"a token of norm {worst:.4g} >= sqrt(d) = {np.sqrt(T.shape[-1]):.4g}: no raw token "
                         "reaches it through the norm (docs/algorithm.md, 'Attention behind a norm: the sublayer "
                         "of a block', 'Which tokens a query can reach')")
    return T * np.sqrt(eps / (1 - fraction))


class EveryPosition:
    """``every_position`` from a model's ``at_position`` (the sublayers' shared reading)."""

    def every_position(self, X, causal: bool) -> np.ndarray:
        """Outputs at every position (N, d_out): a decoder's (``causal``) on each prefix, an
        encoder's with each token as the query and every token a key."""
        return np.array([self.at_position(X, i, causal) for i in range(len(np.asarray(X)))])


@register_model_kind
class NormedAttention(EveryPosition):
    """The attention sublayer of a pre-norm block: ``y(X) = R x_N + f(Q^T n(X))`` (module docstring).

    Parameters
    ----------
    norm : "layernorm" or "rmsnorm".
    eps : the norm's constant (> 0).
    attention : the inner :class:`MultiHeadAttention`, or :class:`~mhaextract.RotaryAttention` (its
        positions untouched by the norm, which acts on each token alone: Llama's sublayer), a vector
        model on k = d - 1 (LayerNorm) or d (RMSNorm) coordinates, with d_out outputs; or the scalar
        :class:`MultiHeadAttention` of a read-out (``v_h = V_h^T r``).
    R : (d_out, d) the residual map (the identity in the blocks we know of); with a scalar inner model
        (d,), the residual's read-out vector ``rho = R^T r``, and the model answers one number a sequence.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> inner = mx.MultiHeadAttention.random(d=3, heads=2, seed=0, d_out=4, bias=True)
    >>> model = NormedAttention("layernorm", 1e-5, inner, np.eye(4))
    >>> X = np.random.default_rng(0).normal(size=(5, 4))
    >>> model([X]).shape, model.every_position(X, causal=True).shape
    ((1, 4), (5, 4))
    >>> bool(np.allclose(model([X + 3.0])[0] - model([X])[0], 3.0))   # a LayerNorm ignores a shift
    True
    """

    kind = "normed-attention"
    torch_adapter = "mhaextract.adapters.normed"

    def __init__(self, norm: str, eps: float, attention: MultiHeadAttention, R):
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        eps = float(eps)
        if not eps > 0 or not np.isfinite(eps):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        scalar = isinstance(attention, MultiHeadAttention) and not attention.is_vector
        if not isinstance(attention, (MultiHeadAttention, RotaryAttention)) or not (attention.is_vector or scalar):
            raise ValueError("attention must be a vector MultiHeadAttention or RotaryAttention (whole outputs, V of "
                             "shape (H, d_out, k)), or a scalar MultiHeadAttention (a read-out: v of shape (H, k))")
        R = np.asarray(R, dtype=np.float64)
        d = attention.d + (1 if norm == "layernorm" else 0)
        shape = (d,) if scalar else (attention.d_out, d)
        if R.shape != shape:
            raise ValueError(f"R must have shape {shape} for a {norm} {'scalar ' if scalar else ''}inner model on "
                             f"{attention.d} coordinates ({'the residual read out: rho = R^T r' if scalar else 'd_out, d'})"
                             f", got {R.shape}")
        self.norm, self.eps, self.attention, self.R = norm, eps, attention.to_float64(), R

    @property
    def d(self) -> int:
        return self.R.shape[-1]

    @property
    def d_out(self) -> int:
        return 1 if self.R.ndim == 1 else self.R.shape[0]

    @property
    def is_vector(self) -> bool:
        """Whole outputs (B, d_out); False for a read-out's model, one number a sequence (B,)."""
        return self.R.ndim == 2

    @property
    def heads(self) -> int:
        return self.attention.heads

    @property
    def basis(self) -> np.ndarray:
        return norm_basis(self.norm, self.d)

    def __repr__(self) -> str:
        return f"NormedAttention({self.norm}, eps={self.eps:.3g}, d={self.d}, heads={self.heads})"

    def inner_tokens(self, X: np.ndarray, dtype=np.float64) -> np.ndarray:
        """``Z = Q^T n(X)``: the inner model's tokens."""
        X = np.asarray(X, dtype=dtype)
        return normalize(X, self.norm, self.eps) @ self.basis.astype(dtype)

    def __call__(self, batch, dtype=np.float64, precision: int | None = None) -> np.ndarray:
        """``y(X)`` at the final position, (B, d_out) (a read-out's: (B,)), in float64 (or float32
        throughout, plain attention inside); with ``precision=bits`` (tokens float64 or ``mpf``) the norm,
        the inner model and the residual in ball arithmetic at ``bits`` (+ guard) bits, returned as ``mpf``
        rounded to ``bits`` (an object array (B, d_out), a read-out's a list).

        Examples
        --------
        >>> import numpy as np
        >>> import mhaextract as mx
        >>> model = NormedAttention("rmsnorm", 1e-6, mx.MultiHeadAttention.random(d=3, heads=1, seed=1, d_out=3),
        ...                         np.eye(3))
        >>> X = np.random.default_rng(1).normal(size=(4, 3))
        >>> exact = model([X], precision=100)
        >>> exact.shape, bool(np.allclose(exact.astype(float), model([X]), rtol=1e-14, atol=0))
        ((1, 3), True)
        """
        if precision is not None:
            return self._evaluate_ball(as_batch(batch, self.d), int(precision))
        if self.rotary and np.dtype(dtype) != np.float64:
            raise ValueError(f"a rotary inner model evaluates in float64 (RotaryAttention), not {np.dtype(dtype)}: "
                             "pass dtype=np.float64, or to_torch(model, dtype=...) for a module in another dtype")
        sequences = as_batch(batch, self.d)
        tokens = [self.inner_tokens(X, dtype) for X in sequences]
        inner = self.attention(tokens) if self.rotary else self.attention(tokens, dtype=dtype)
        finals = np.array([np.asarray(X[-1], dtype=dtype) for X in sequences])
        return inner + finals @ self.R.astype(dtype).T  # a read-out's rho: (B,)

    def _evaluate_ball(self, sequences, precision: int):
        """:meth:`__call__` with ``precision``: the inner tokens ``Q^T n(x)`` as balls, passed to the
        inner model as their exact midpoints (its own ball evaluation at ``precision``; the guard bits
        keep the midpoints' error far below the rounding to ``precision`` bits), then ``R x_N`` added."""
        with working_precision(precision + GUARD_BITS):
            basis = [[to_arb(value) for value in row] for row in self.basis]
            tokens = []
            for X in sequences:
                normed = normalize_balls(X, self.norm, self.eps)
                tokens.append(np.array([[arb_to_mpf(sum((row[a] * basis[a][j] for a in range(len(row))), arb(0)))
                                         for j in range(len(basis[0]))] for row in normed], dtype=object))
        inner = np.asarray(self.attention(tokens, precision=precision), dtype=object).reshape(len(sequences), -1)
        R = self.R.reshape(self.d_out, self.d)
        out = np.empty(inner.shape, dtype=object)
        with working_precision(precision + GUARD_BITS):
            for b, X in enumerate(sequences):
                final = [to_arb(value) for value in X[-1]]
                for o in range(self.d_out):
                    total = to_arb(inner[b, o]) + sum((to_arb(R[o, a]) * final[a] for a in range(self.d)), arb(0))
                    out[b, o] = rounded_mpf(total, precision)
        return out if self.is_vector else list(out[:, 0])

    def at_position(self, X, i: int, causal: bool) -> np.ndarray | None:
        """The output at position ``i`` (from 0): what the causal record judges a layer's earlier
        outputs by (:mod:`mhaextract.checks.causality`)."""
        X = np.asarray(X, dtype=np.float64)
        if causal:
            return self([X[:i + 1]])[0]
        inner = self.attention.at_position(self.inner_tokens(X), i, False)
        # None: a rotary model is read causally only (RotaryAttention.at_position)
        return None if inner is None else inner + self.R @ X[i]

    @property
    def rotary(self) -> bool:
        """Whether the inner model is rotary attention (Llama's sublayer)."""
        return isinstance(self.attention, RotaryAttention)

    def lifted(self):
        """The inner model on the norm's output in R^d (``W = Q W'' Q^T``, ``u = Q u''``,
        ``V = V'' Q^T``; a rotary model's ``Q_h``, ``K_h``, ``V_h`` times ``Q^T``): the attention a block
        with gamma = 1, beta = 0 holds."""
        Q, a = self.basis, self.attention
        if self.rotary:
            return a.replaced(Q=a.Q @ Q.T, K=a.K @ Q.T, V=a.V @ Q.T)
        return MultiHeadAttention(Q @ a.W @ Q.T, (a.V if a.is_vector else a.v) @ Q.T, a.u @ Q.T, a.c)

    def to_float64(self) -> "NormedAttention":
        return self

    def canonical(self, rtol: float | None = None) -> "NormedAttention":
        """The inner model's canonical form (``rtol``: its ``canonical``'s; None: its default)."""
        inner = self.attention.canonical() if rtol is None else self.attention.canonical(rtol)
        return NormedAttention(self.norm, self.eps, inner, self.R)

    def to_document(self, exact: bool = False) -> tuple[dict, dict]:
        inner, arrays = self.attention.to_document(exact=False)
        part = {"kind": self.kind, "norm": self.norm, "eps": self.eps, "d": self.d,
                "R": document_numbers(self.R, exact), "attention": inner}
        return part, {"R": self.R, **{f"attention_{name}": array for name, array in arrays.items()}}

    @classmethod
    def from_document(cls, part: dict, exact: bool = False) -> "NormedAttention":
        from .kinds import model_from_document

        R = np.asarray(read_numbers(part["R"], exact), dtype=np.float64)
        return cls(part["norm"], float(part["eps"]), model_from_document(part["attention"], False), R)


@dataclass
class NormedComparison:
    """``a`` against the reference ``b``: the inner heads' comparison, eps and R relative errors
    (a post-norm's: gamma's and beta's, ``affine_rel``, R = I); ``max_rel`` the largest (infinite for
    norms of another kind or other head counts)."""

    attention: object
    eps_rel: float
    R_rel: float
    same_norm: bool
    affine_rel: float = 0.0

    @property
    def max_rel(self) -> float:
        if not self.same_norm:
            return float("inf")
        return max(float(self.attention.max_rel), self.eps_rel, self.R_rel, self.affine_rel)

    @property
    def heads_agree(self) -> bool:
        return bool(self.attention.heads_agree)


@register_comparison(NormedAttention)
def compare_normed(a: NormedAttention, b: NormedAttention, rtol: float = 0.0) -> NormedComparison:
    """Compare two sublayers (module docstring of :mod:`mhaextract.models.compare`)."""
    if not isinstance(b, NormedAttention):
        raise TypeError(f"compare a NormedAttention with a NormedAttention, got {type(b).__name__}")
    same = a.norm == b.norm and a.d == b.d and a.d_out == b.d_out and type(a.attention) is type(b.attention)
    inner = None if not same else (compare(a.attention, b.attention) if a.rotary
                                   else compare_attention(a.attention, b.attention, rtol=rtol))
    R_rel = float(np.abs(a.R - b.R).max() / max(np.abs(b.R).max(), 1e-300)) if same else float("inf")
    return NormedComparison(inner, abs(a.eps - b.eps) / b.eps, R_rel, same)


@register_model_kind
class PostNormAttention(EveryPosition):
    """The attention sublayer of a post-norm block (BERT's ``BertAttention``): at position N

        z = x_N + f(X),    y(X) = gamma * n(z) + beta,    n(z) = (z - mean(z) 1) / sqrt(var(z) + eps),

    f the biased vector attention on the raw tokens (d_out = d: the residual adds x_N). n drops the
    1-component of z, so only ``P V_h`` and ``P c`` act (``P = I - 1 1^T / d``): the canonical form
    keeps them projected (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block',
    'The norm after the residual').

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> inner = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, d_out=4, bias=True)
    >>> model = PostNormAttention(1e-12, inner, np.full(4, 1.5), np.full(4, 0.1))
    >>> X = np.random.default_rng(0).normal(size=(5, 4))
    >>> y = model([X])[0]
    >>> bool(np.isclose(((y - 0.1) / 1.5).mean(), 0)), bool(np.isclose((((y - 0.1) / 1.5) ** 2).mean(), 1))
    (True, True)
    >>> model.every_position(X, causal=False).shape
    (5, 4)
    """

    kind = "post-norm-attention"
    torch_adapter = "mhaextract.adapters.normed"
    norm = "post-layernorm"
    #: whole outputs (B, d): a post-norm's read-out is not learned (docs/algorithm.md, 'A scalar read-out')
    is_vector = True

    def __init__(self, eps: float, attention: MultiHeadAttention, gamma, beta):
        eps = float(eps)
        if not eps > 0 or not np.isfinite(eps):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        if not isinstance(attention, MultiHeadAttention) or not attention.is_vector or attention.d_out != attention.d:
            raise ValueError("attention must be a vector MultiHeadAttention with d_out = d (the residual adds x_N)")
        gamma, beta = np.asarray(gamma, dtype=np.float64), np.asarray(beta, dtype=np.float64)
        if gamma.shape != (attention.d,) or beta.shape != (attention.d,):
            raise ValueError(f"gamma and beta must have shape (d,) = ({attention.d},), got {gamma.shape} and "
                             f"{beta.shape}")
        self.eps, self.attention, self.gamma, self.beta = eps, attention.to_float64(), gamma, beta

    @property
    def d(self) -> int:
        return self.attention.d

    @property
    def d_out(self) -> int:
        return self.attention.d

    @property
    def heads(self) -> int:
        return self.attention.heads

    def __repr__(self) -> str:
        return f"PostNormAttention(eps={self.eps:.3g}, d={self.d}, heads={self.heads})"

    def normed(self, Z: np.ndarray) -> np.ndarray:
        """``gamma * n(z) + beta`` of every row of Z (in Z's dtype)."""
        Z = np.asarray(Z)
        return self.gamma.astype(Z.dtype) * normalize(Z, "layernorm", self.eps) + self.beta.astype(Z.dtype)

    def __call__(self, batch, dtype=np.float64, precision: int | None = None) -> np.ndarray:
        """``y(X)`` at the final position, (B, d), in float64 (or float32 throughout); with
        ``precision=bits`` (tokens float64 or ``mpf``) the attention, the residual and the norm in ball
        arithmetic at ``bits`` (+ guard) bits, returned as ``mpf`` rounded to ``bits`` (an object array)."""
        sequences = as_batch(batch, self.d)
        if precision is not None:
            return self._evaluate_ball(sequences, int(precision))
        inner = self.attention([np.asarray(X, dtype=dtype) for X in sequences], dtype=dtype)
        return self.normed(inner + np.array([np.asarray(X[-1], dtype=dtype) for X in sequences]))

    def _evaluate_ball(self, sequences, precision: int) -> np.ndarray:
        """:meth:`__call__` with ``precision``: ``gamma * n(x_N + f(X)) + beta`` on balls, f the
        attention's own ball evaluation at ``precision``."""
        inner = np.asarray(self.attention(sequences, precision=precision), dtype=object)
        out = np.empty(inner.shape, dtype=object)
        with working_precision(precision + GUARD_BITS):
            for b, X in enumerate(sequences):
                z = [to_arb(inner[b, o]) + to_arb(X[-1][o]) for o in range(self.d)]
                normed = normalize_balls([z], "layernorm", self.eps)[0]
                for o in range(self.d):
                    out[b, o] = rounded_mpf(to_arb(self.gamma[o]) * normed[o] + to_arb(self.beta[o]), precision)
        return out

    def at_position(self, X, i: int, causal: bool) -> np.ndarray:
        """The output at position ``i`` (from 0), as :meth:`NormedAttention.at_position`."""
        X = np.asarray(X, dtype=np.float64)
        if causal:
            return self([X[:i + 1]])[0]
        return self.normed(self.attention.at_position(X, i, False) + X[i])

    def to_float64(self) -> "PostNormAttention":
        return self

    def canonical(self, rtol: float = 0.0) -> "PostNormAttention":
        """``V_h`` and ``c`` projected on ``1^perp`` (their 1-component never reaches the output),
        then the attention's canonical form."""
        a = self.attention
        V = a.V - a.V.mean(axis=1, keepdims=True)
        inner = MultiHeadAttention(a.W, V, a.u, a.c - a.c.mean()).canonical(rtol)
        return PostNormAttention(self.eps, inner, self.gamma, self.beta)

    def to_document(self, exact: bool = False) -> tuple[dict, dict]:
        inner, arrays = self.attention.to_document(exact=False)
        part = {"kind": self.kind, "eps": self.eps, "d": self.d, "gamma": document_numbers(self.gamma, exact),
                "beta": document_numbers(self.beta, exact), "attention": inner}
        return part, {"gamma": self.gamma, "beta": self.beta,
                      **{f"attention_{name}": array for name, array in arrays.items()}}

    @classmethod
    def from_document(cls, part: dict, exact: bool = False) -> "PostNormAttention":
        from .kinds import model_from_document

        gamma = np.asarray(read_numbers(part["gamma"], exact), dtype=np.float64)
        beta = np.asarray(read_numbers(part["beta"], exact), dtype=np.float64)
        return cls(float(part["eps"]), model_from_document(part["attention"], False), gamma, beta)


@register_comparison(PostNormAttention)
def compare_post_normed(a: PostNormAttention, b: PostNormAttention, rtol: float = 0.0) -> NormedComparison:
    """Compare two post-norm sublayers in canonical form: the inner heads, eps, and gamma and beta
    (relative to the largest of gamma)."""
    if not isinstance(b, PostNormAttention):
        raise TypeError(f"compare a PostNormAttention with a PostNormAttention, got {type(b).__name__}")
    same = a.d == b.d
    if not same:
        return NormedComparison(None, float("inf"), float("inf"), False)
    a, b = a.canonical(), b.canonical()
    affine = max(float(np.abs(a.gamma - b.gamma).max()), float(np.abs(a.beta - b.beta).max()))
    return NormedComparison(compare_attention(a.attention, b.attention, rtol=rtol), abs(a.eps - b.eps) / b.eps, 0.0,
                            True, affine / max(float(np.abs(b.gamma).max()), 1e-300))
