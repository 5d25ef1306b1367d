"""High-precision number plumbing: mpmath at the oracle boundary, flint balls inside.

The oracle boundary speaks :mod:`mpmath` (``mpf`` tokens and answers); the numerical kernels
work with python-flint ``arb`` balls. Conversions here are exact: an ``mpf`` is a dyadic
rational ``man * 2**exp`` and becomes the zero-radius ball with that midpoint; a ball goes
back to ``mpf`` through its (dyadic) midpoint.
"""

from __future__ import annotations

import contextlib
import re
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


def rounded_mpf(ball: arb, bits: int) -> mpmath.mpf:
    """A ball's midpoint rounded to ``bits`` bits: what the models' ball evaluations return."""
    with mpmath.workprec(int(bits)):
        return +arb_to_mpf(ball)  # unary + rounds to the working precision


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


def mpf_to_hex(value: mpmath.mpf) -> str:
    """The exact text of an ``mpf``: ``[-]0x<mantissa in hex>p<binary exponent>`` (C99 hex-float style).

    ``man * 2**exp`` with integer ``man`` and ``exp``: nothing is rounded whatever the precision,
    unlike a decimal string, so an answer stored this way reads back bit for bit.
    """
    if not mpmath.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    sign, man, exp, _ = value._mpf_
    return f"{'-' if sign else ''}0x{int(man):x}p{int(exp)}"


_HEX_MPF = re.compile(r"(-?)0x([0-9a-f]+)p([+-]?[0-9]+)")


def mpf_from_hex(text: str) -> mpmath.mpf:
    """Inverse of :func:`mpf_to_hex`: the exact ``mpf`` (no rounding at mpmath's precision)."""
    match = _HEX_MPF.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not an exact hex number of the form [-]0x<hex>p<exp>: {text!r}")
    man = int(match.group(2), 16)
    # The sign goes into the mantissa: negating an mpf afterwards would round to mpmath's precision.
    return mpmath.mp.make_mpf(from_man_exp(-man if match.group(1) else man, int(match.group(3))))
