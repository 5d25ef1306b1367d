"""Whole answers split by head (docs/algorithm.md, 'Whole answers near the vector bound'), shared by
the families that learn from them: the constant and the summed value map (:mod:`.values`), the heads'
output subspaces from saturated queries (:mod:`.subspaces`) and each head's attention weights
(:mod:`.weights`)."""

from .values import SplitUnavailable

__all__ = ["SplitUnavailable"]
