"""What the answers looked like, measured at the oracle boundary (for checks and error messages).

A constant oracle (every answer equal) or a quantised one (every answer an integer) carries no
information about the heads: the learner's arithmetic then fails in ways that say nothing about
the cause. :class:`AnswerStats` records enough to say so (docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


#: Answers needed before their round-trip through float32, float16 or bfloat16 counts as a detection.
MIN_ANSWERS = 4

#: Unit roundoff of each answer format below float64, coarsest first (the order of detection: a
#: bfloat16 number inside float16's range is also a float16 number).
FORMAT_UNITS = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
#: float64's unit roundoff (kept out of FORMAT_UNITS, whose keys are the formats coarser than float64).
FLOAT64_UNIT = 2.0**-53


def format_unit(name) -> float:
    """The unit roundoff of an answer format's name (a key of :data:`FORMAT_UNITS`), float64's for any other.

    >>> format_unit("float32") == 2.0**-24, format_unit("float64") == format_unit(None) == 2.0**-53
    (True, True)
    """
    return FORMAT_UNITS.get(str(name), FLOAT64_UNIT)


def format_name(unit: float) -> str:
    """The answer format whose unit roundoff is ``unit`` (:func:`format_unit`'s inverse), ``"float64"`` for
    any other.

    >>> format_name(2.0**-24), format_name(2.0**-53), format_name(2.0**-8)
    ('float32', 'float64', 'bfloat16')
    """
    return {value: key for key, value in FORMAT_UNITS.items()}.get(unit, "float64")


@dataclass
class AnswerStats:
    """Running summary of the float64 answers a run used (asked or replayed).

    count : answers seen; first : the first one; all_equal : every answer equal to the first;
    all_integer : every answer an integer; largest : max |answer|; numbers : the numbers whose format
    was read (answers, or the coordinates of vector answers); float32_exact, float16_exact,
    bfloat16_exact : every number the oracle answered round-trips exactly through float32 (float16,
    bfloat16): the oracle computes in that precision (:attr:`unit_roundoff`). For an oracle that
    answers vectors the formats are read from the vectors' own numbers (:meth:`add_vectors`), not
    from their read-out.
    """

    count: int = 0
    first: float = np.nan
    all_equal: bool = True
    all_integer: bool = True
    largest: float = 0.0
    float32_exact: bool = True
    float16_exact: bool = True
    bfloat16_exact: bool = True
    vectors: bool = False
    numbers: int = 0

    def add(self, values) -> None:
        """Summarise the (scalar) answers the schedules use."""
        values = np.asarray(values, dtype=np.float64).ravel()
        if not values.size:
            return
        if not self.count:
            self.first = float(values[0])
        self.count += int(values.size)
        self.all_equal = self.all_equal and bool((values == self.first).all())
        self.all_integer = self.all_integer and bool((values == np.round(values)).all())
        self.largest = max(self.largest, float(np.abs(values).max()))
        if not self.vectors:
            self._formats(values)

    def add_vectors(self, values) -> None:
        """Read the answer format from whole vector answers (their read-out is a sum of them)."""
        self.vectors = True
        self._formats(np.asarray(values, dtype=np.float64).ravel())

    def _formats(self, values: np.ndarray) -> None:
        self.numbers += int(values.size)
        if not self.float32_exact:
            return
        with np.errstate(over="ignore"):
            single = values.astype(np.float32)
            self.float32_exact = bool((single.astype(np.float64) == values).all())
            if self.float16_exact:  # each format is checked only while it may still hold
                self.float16_exact = self.float32_exact and bool((single.astype(np.float16) == single).all())
        if self.bfloat16_exact:
            self.bfloat16_exact = self.float32_exact and bool(((single.view(np.uint32) & np.uint32(0xFFFF)) == 0).all())

    @property
    def unit_roundoff(self) -> float:
        """The answers' unit roundoff as their bits show it: ``2^-8`` when every answer is a
        bfloat16 number, ``2^-11`` a float16 number, ``2^-24`` a float32 number, else ``2^-53``.

        Needs at least ``MIN_ANSWERS`` answers that are not all integers or all equal (those
        round-trip through any format and say nothing). A float64 answer that is not the output of
        a lower-precision computation is a float32 number with probability ``2^-29``; a float16
        number is a bfloat16 number with probability ``2^-3``, so telling them apart takes ``4 MIN_ANSWERS``
        numbers.
        """
        if self.count < MIN_ANSWERS or self.all_equal or self.all_integer:
            return FLOAT64_UNIT
        if self.bfloat16_exact and (self.numbers >= 4 * MIN_ANSWERS or not self.float16_exact):
            return FORMAT_UNITS["bfloat16"]
        if self.float16_exact:
            return FORMAT_UNITS["float16"]
        return FORMAT_UNITS["float32"] if self.float32_exact else FLOAT64_UNIT

    @property
    def precision_name(self) -> str:
        """``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"float64"``, as :attr:`unit_roundoff`
        reads the answers."""
        return format_name(self.unit_roundoff)

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
