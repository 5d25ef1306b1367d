"""What the answers looked like, measured at the oracle boundary (for checks and error messages).

A constant oracle (every answer equal) or a quantised one (every answer an integer) carries no
information about the heads: the learner's arithmetic then fails in ways that say nothing about
the cause. :class:`AnswerStats` records enough to say so (docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AnswerStats:
    """Running summary of the float64 answers a run used (asked or replayed).

    count : answers seen; first : the first one; all_equal : every answer equal to the first;
    all_integer : every answer an integer; largest : max |answer|.
    """

    count: int = 0
    first: float = np.nan
    all_equal: bool = True
    all_integer: bool = True
    largest: float = 0.0

    def add(self, values) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        if not values.size:
            return
        if not self.count:
            self.first = float(values[0])
        self.count += int(values.size)
        self.all_equal = self.all_equal and bool((values == self.first).all())
        self.all_integer = self.all_integer and bool((values == np.round(values)).all())
        self.largest = max(self.largest, float(np.abs(values).max()))

    def problem(self) -> str | None:
        """A sentence naming what is wrong with the answers, or None when nothing is visible."""
        if self.count < 2:
            return None
        if self.all_equal:
            return (f"all {self.count} answers equal {self.first!r}: the oracle is constant, so nothing about "
                    "its heads can be learned (is it the right output, a constant stub, or saturated by a "
                    "token_scale far too large?)")
        if self.all_integer:
            return (f"all {self.count} answers are integers: the oracle rounds or quantises its outputs (or returns "
                    "labels/booleans); extraction needs the real-valued output, at full precision")
        return None
