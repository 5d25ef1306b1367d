"""Comparing two models up to the symmetries of their canonical form.

:func:`compare` dispatches on the model's type through :data:`COMPARISONS`, which each model module
fills when it is imported (:func:`register_comparison`): :func:`compare_attention` here for
:class:`~mhaextract.MultiHeadAttention`, the rotary and the Transformer comparisons beside their
models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mpmath
import numpy as np
from scipy.optimize import linear_sum_assignment

from ..numerics.highprec import mpf_array
from .attention import MultiHeadAttention

#: The comparison of each model type: ``function(a, b, rtol=...)`` -> an object with ``max_rel``.
COMPARISONS: dict[type, Callable] = {}


def register_comparison(model_type: type):
    """Decorator: ``compare(a, b)`` of two ``model_type`` models runs the decorated function."""

    def register(function: Callable) -> Callable:
        COMPARISONS[model_type] = function
        return function

    return register


def _registered_type(model) -> type:
    for cls in type(model).__mro__:
        if cls in COMPARISONS:
            return cls
    raise TypeError(f"compare takes models of the kinds mhaextract knows ("
                    f"{', '.join(sorted(cls.__name__ for cls in COMPARISONS))}); got {type(model).__name__}")


@dataclass
class Comparison:
    """Errors of ``a`` against the reference ``b`` after canonicalising and aligning heads.

    Attributes
    ----------
    heads_agree : bool, both canonical forms have the same number of heads.
    heads_a, heads_b : canonical head counts.
    permutation : (min(H_a, H_b),) head ``k`` of ``b`` is aligned with head ``permutation[k]`` of ``a``.
    W_abs, v_abs : max absolute entry error over the aligned heads (``v``: the value read-outs,
        ``v_h`` of a scalar model, every entry of ``V_h`` of a vector model).
    W_rel, v_rel : ``W_abs / max|W_b|`` and ``v_abs / max|v_b|`` (normwise relative errors).
    u_abs, u_rel : the same for the score biases ``u_h`` (``u_rel = u_abs`` when ``b`` has none).
    c_abs, c_rel : error of the output constant (max over its entries for a vector model),
        absolute and relative to ``max |c_b|`` (absolute when ``c_b = 0``).
    max_rel : ``max(W_rel, v_rel, u_rel, c_rel)``; infinite when the head counts disagree.

    Errors are ``mpmath.mpf`` when either model is high-precision, floats otherwise.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> swapped = mx.MultiHeadAttention(target.W[::-1], target.v[::-1])
    >>> comparison = mx.compare(swapped, target)
    >>> comparison.heads_agree, comparison.permutation.tolist(), float(comparison.max_rel)
    (True, [1, 0], 0.0)
    """

    heads_agree: bool
    heads_a: int
    heads_b: int
    permutation: np.ndarray
    W_abs: float
    v_abs: float
    W_rel: float
    v_rel: float
    u_abs: float = 0.0
    u_rel: float = 0.0
    c_abs: float = 0.0
    c_rel: float = 0.0

    @property
    def max_rel(self):
        return max(self.W_rel, self.v_rel, self.u_rel, self.c_rel) if self.heads_agree else float("inf")


def _magnitude(array: np.ndarray):
    if array.dtype == object:
        return np.vectorize(abs, otypes=[object])(array)
    return np.abs(array)


def _float(array: np.ndarray) -> np.ndarray:
    return np.vectorize(float, otypes=[np.float64])(array) if array.dtype == object else array


def compare(a, b, rtol: float | None = None):
    """Errors of model ``a`` against the reference ``b``, both of one kind, after canonicalising
    and aligning them: :func:`compare_attention` for :class:`~mhaextract.MultiHeadAttention` (a
    :class:`Comparison`), :func:`~mhaextract.models.rotary.compare_rotary` for
    :class:`~mhaextract.RotaryAttention`, :func:`~mhaextract.compare_transformers` for
    :class:`~mhaextract.Transformer1L` (a :class:`~mhaextract.TransformerComparison`). ``rtol``:
    as in the model's ``canonical`` (None: its default). Every result has ``max_rel``.

    Examples
    --------
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=2, hidden=4, seed=0)
    >>> float(mx.compare(mx.Transformer1L(T.W[::-1], T.O[::-1], T.A, T.w), T).max_rel) < 1e-14
    True
    >>> mx.compare(T, mx.MultiHeadAttention.random(d=3, heads=2, seed=0))
    Traceback (most recent call last):
    ...
    ValueError: compare a Transformer1L with a Transformer1L: got a Transformer1L and a MultiHeadAttention
    """
    kind_a, kind_b = _registered_type(a), _registered_type(b)
    if kind_a is not kind_b:
        raise ValueError(f"compare a {kind_a.__name__} with a {kind_a.__name__}: got a {kind_a.__name__} and a "
                         f"{kind_b.__name__}")
    return COMPARISONS[kind_a](a, b) if rtol is None else COMPARISONS[kind_a](a, b, rtol=rtol)


@register_comparison(MultiHeadAttention)
def compare_attention(a: MultiHeadAttention, b: MultiHeadAttention, rtol: float = 0.0) -> Comparison:
    """Canonicalise ``a`` and ``b`` (``rtol`` as in :meth:`MultiHeadAttention.canonical`), align their
    heads with :func:`scipy.optimize.linear_sum_assignment` on the distance of (W_h, V_h, u_h), and
    report max absolute and relative errors of ``a`` against the reference ``b``.

    Examples
    --------
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0)
    >>> swapped = mx.MultiHeadAttention(target.W[::-1], target.v[::-1])
    >>> float(mx.compare(swapped, target).max_rel)
    0.0
    >>> import numpy as np
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> nudged = mx.MultiHeadAttention(target.W + 1e-9, target.v)
    >>> comparison = mx.compare(nudged, target)
    >>> bool(np.isclose(comparison.W_abs, 1e-9)), float(comparison.v_rel)
    (True, 0.0)
    >>> mx.compare(mx.MultiHeadAttention(target.W[:1], target.v[:1]), target).max_rel
    inf
    """
    if a.d != b.d:
        raise ValueError(f"models have different token dimensions: {a.d} and {b.d}")
    if a.is_vector != b.is_vector or a.d_out != b.d_out:
        raise ValueError(f"models have different outputs: d_out = {a.d_out if a.is_vector else 'scalar'} and "
                         f"{b.d_out if b.is_vector else 'scalar'} (compare a vector model's readout(r) with a scalar one)")
    a, b = a.canonical(rtol), b.canonical(rtol)
    high = a.is_high_precision or b.is_high_precision
    Wa, va, ua, Wb, vb, ub = a.W, a.V.reshape(a.heads, -1), a.u, b.W, b.V.reshape(b.heads, -1), b.u
    if high:
        Wa, va, ua, Wb, vb, ub = (mpf_array(x) for x in (Wa, va, ua, Wb, vb, ub))
    fa = np.concatenate([_float(Wa).reshape(a.heads, -1), _float(va), _float(ua)], axis=1)
    fb = np.concatenate([_float(Wb).reshape(b.heads, -1), _float(vb), _float(ub)], axis=1)
    # distances in units of the largest entry (a power of two: exact), so that a model far off (a
    # refit that diverged to 1e150) does not overflow the squares; the assignment is the same
    largest = max(np.abs(fa).max(initial=0.0), np.abs(fb).max(initial=0.0))
    unit = 2.0 ** np.ceil(np.log2(largest)) if np.isfinite(largest) and largest > 0 else 1.0
    cost = (np.linalg.norm(fb[:, None, :] / unit - fa[None, :, :] / unit, axis=2) if a.heads and b.heads
            else np.zeros((b.heads, a.heads)))
    rows, cols = linear_sum_assignment(cost)
    zero = mpmath.mpf(0) if high else 0.0
    if len(rows):
        W_abs = _magnitude(Wa[cols] - Wb[rows]).max()
        v_abs = _magnitude(va[cols] - vb[rows]).max()
        u_abs = _magnitude(ua[cols] - ub[rows]).max()
    else:
        W_abs = v_abs = u_abs = zero
    W_scale = _magnitude(Wb).max() if b.heads else zero
    v_scale = _magnitude(vb).max() if b.heads else zero
    u_scale = _magnitude(ub).max() if b.heads else zero
    W_rel = W_abs / W_scale if W_scale else W_abs
    v_rel = v_abs / v_scale if v_scale else v_abs
    u_rel = u_abs / u_scale if u_scale else u_abs
    # mpf_array keeps an mpf c exact (mpmath.mpf(c) would round it to mpmath's 53-bit default).
    if high:
        ca, cb = (mpf_array(np.ravel(np.asarray(model.c, dtype=object))) for model in (a, b))
    else:
        ca, cb = np.ravel(a.c), np.ravel(b.c)
    c_abs = max(abs(x - y) for x, y in zip(ca, cb))
    c_scale = max(abs(y) for y in cb)
    c_rel = c_abs / c_scale if c_scale else c_abs
    if not high:
        c_abs, c_rel = float(c_abs), float(c_rel)
    return Comparison(a.heads == b.heads, a.heads, b.heads, cols, W_abs, v_abs, W_rel, v_rel, u_abs, u_rel,
                      c_abs, c_rel)
