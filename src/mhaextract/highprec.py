"""High-precision number plumbing: mpmath at the oracle boundary, flint balls inside.

The oracle boundary speaks :mod:`mpmath` (``mpf`` tokens and answers); the numerical kernels
work with python-flint ``arb`` balls. Conversions here are exact: an ``mpf`` is a dyadic
rational ``man * 2**exp`` and becomes the zero-radius ball with that midpoint; a ball goes
back to ``mpf`` through its (dyadic) midpoint.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import mpmath
from mpmath.libmp import from_man_exp
import numpy as np
from flint import arb, ctx, fmpz

#: Bits added to the user's precision for intermediate work in the kernels.
GUARD_BITS = 64


@contextlib.contextmanager
def working_precision(bits: int) -> Iterator[None]:
    """Set flint's and mpmath's working precision to ``bits`` for the block, then restore."""
    old = ctx.prec
    ctx.prec = int(bits)
    try:
        with mpmath.workprec(int(bits)):
            yield
    finally:
        ctx.prec = old


def mpf_to_arb(value: mpmath.mpf) -> arb:
    """The exact zero-radius ball of an ``mpf`` (no rounding at any precision)."""
    sign, man, exp, _ = value._mpf_  # mpmath's man_exp drops the sign
    if not man and exp:
        raise ValueError(f"{value} is not a finite number")
    return arb((fmpz(-int(man) if sign else int(man)), int(exp)))


def arb_to_mpf(ball: arb) -> mpmath.mpf:
    """The midpoint of a ball as an exact ``mpf``."""
    man, exp = ball.mid().man_exp()
    # make_mpf wraps the exact value; mpf((man, exp)) would round to mpmath's precision.
    return mpmath.mp.make_mpf(from_man_exp(int(man), int(exp)))


def to_arb(value) -> arb:
    """A ball from an mpf, a decimal string, an int or a float (floats only for constants)."""
    if isinstance(value, arb):
        return value
    if isinstance(value, mpmath.mpf):
        return mpf_to_arb(value)
    if isinstance(value, str):
        return arb(value)
    if isinstance(value, (int, np.integer)):
        return arb(int(value))
    return arb(float(value))


def arb_array(values) -> np.ndarray:
    """An object array of balls with the shape of ``values``."""
    values = np.asarray(values, dtype=object)
    out = np.empty(values.shape, dtype=object)
    for index, value in np.ndenumerate(values):
        out[index] = to_arb(value)
    return out


def mpf_array(values) -> np.ndarray:
    """An object array of exact ``mpf`` from floats, mpf or balls (ball midpoints)."""
    values = np.asarray(values, dtype=object)
    out = np.empty(values.shape, dtype=object)
    for index, value in np.ndenumerate(values):
        if isinstance(value, arb):
            out[index] = arb_to_mpf(value)
        else:
            # float -> mpf and mpf -> mpf are exact whatever mpmath's precision.
            out[index] = value if isinstance(value, mpmath.mpf) else mpmath.mpf(float(value))
    return out


def mid_float(values) -> np.ndarray:
    """float64 midpoints of an object array of balls or mpf (or a float array, unchanged)."""
    values = np.asarray(values)
    if values.dtype != object:
        return values.astype(np.float64)
    out = np.empty(values.shape, dtype=np.float64)
    for index, value in np.ndenumerate(values):
        out[index] = float(value.mid()) if isinstance(value, arb) else float(value)
    return out


def radius_float(values) -> np.ndarray:
    """float64 upper bounds of the radii of an object array of balls."""
    values = np.asarray(values, dtype=object)
    out = np.empty(values.shape, dtype=np.float64)
    for index, value in np.ndenumerate(values):
        # float() rounds to nearest; nudge up so the bound stays an upper bound.
        out[index] = np.nextafter(float(value.rad()), np.inf)
    return out


def magnitude_float(values) -> np.ndarray:
    """float64 of |value| for an array of balls computed at full precision (tiny values stay tiny)."""
    values = np.asarray(values)
    if values.dtype != object:
        return np.abs(values.astype(np.float64))
    out = np.empty(values.shape, dtype=np.float64)
    for index, value in np.ndenumerate(values):
        out[index] = float(abs(value).upper()) if isinstance(value, arb) else abs(float(value))
    return out
