"""Simulated oracles: a known model answering in float64 or at a given precision."""

from __future__ import annotations

from ..model import MultiHeadAttention


class SimulatedOracle:
    """An oracle that answers for a known model, in float64 or at ``precision`` bits.

    Parameters
    ----------
    model : MultiHeadAttention (or any object with ``model(batch, precision=...)``)
    precision : int or None
        None answers float64; an int answers ``mpmath.mpf`` computed in ball arithmetic and
        rounded to ``precision`` bits.
    """

    def __init__(self, model: MultiHeadAttention, precision: int | None = None):
        self.model = model
        self.precision = None if precision is None else int(precision)

    def __call__(self, batch):
        return self.model(batch, precision=self.precision)

    def __repr__(self) -> str:
        return f"SimulatedOracle({self.model!r}, precision={self.precision})"
