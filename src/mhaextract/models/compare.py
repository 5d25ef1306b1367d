"""Comparing two attention models up to the symmetries of the canonical form."""

from __future__ import annotations

from dataclasses import dataclass

import mpmath
import numpy as np
from scipy.optimize import linear_sum_assignment

from ..numerics.highprec import mpf_array
from .attention import MultiHeadAttention
from .rotary import RotaryAttention


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


def compare(a: MultiHeadAttention, b: MultiHeadAttention, rtol: float = 0.0) -> Comparison:
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
    if isinstance(a, RotaryAttention) or isinstance(b, RotaryAttention):
        if not (isinstance(a, RotaryAttention) and isinstance(b, RotaryAttention)):
            raise ValueError("compare a RotaryAttention with a RotaryAttention (positions change the function)")
        return compare_rotary(a, b)
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


def compare_rotary(a: RotaryAttention, b: RotaryAttention) -> Comparison:
    """Errors of ``a`` against the reference ``b`` (a :class:`~mhaextract.Comparison`): heads
    aligned by an assignment on ``(W_h(0), W_h(1), W_h(2), V_h)``; ``W_abs`` is the largest entry
    error of those score matrices, ``v_abs`` of ``V_h``, ``c_abs`` of the constant."""
    bits = 53
    if a.is_high_precision or b.is_high_precision:  # both in mpf: float64 would hide errors below its rounding
        a, b = a.to_mpf(), b.to_mpf()
        bits = max(a.precision, b.precision)  # a float64 model's exact parameters at the other's precision
    with mpmath.workprec(bits):
        a, b = a.canonical(), b.canonical()
        Wa, Wb = a.identifying_matrices(), b.identifying_matrices()
    cost = (np.abs(Wa[:, None] - Wb[None]).max(axis=(2, 3, 4)) / max(float(np.abs(Wb).max()), 1e-300)
            + np.abs(a.V[:, None] - b.V[None]).max(axis=(2, 3)) / max(float(np.abs(b.V).max()), 1e-300))
    cost = cost.astype(np.float64)
    rows, columns = linear_sum_assignment(cost)
    order = np.argsort(columns)
    aligned, shared = rows[order], columns[order]  # head shared[k] of b is aligned with head aligned[k] of a
    permutation = aligned
    W_abs = float(np.abs(Wa[aligned] - Wb[shared]).max()) if len(shared) else 0.0
    v_abs = float(np.abs(a.V[aligned] - b.V[shared]).max()) if len(shared) else 0.0
    c_abs = float(np.abs(np.atleast_1d(a.c) - np.atleast_1d(b.c)).max())
    c_scale = float(np.abs(np.atleast_1d(b.c)).max())
    return Comparison(heads_agree=a.heads == b.heads and a.window == b.window, heads_a=a.heads, heads_b=b.heads,
                      permutation=permutation, W_abs=W_abs, v_abs=v_abs,
                      W_rel=W_abs / max(float(np.abs(Wb).max()), 1e-300),
                      v_rel=v_abs / max(float(np.abs(b.V).max()), 1e-300),
                      c_abs=c_abs, c_rel=c_abs / c_scale if c_scale > 0 else c_abs)

