"""Finding a sliding window by queries of increasing length (docs/algorithm.md, 'Windows').

A final zero token has the query ``b_h`` (zero without a query bias); in ``(y, 0^(L - 1))`` the
zeros score 0 and carry value 0, so the answer is ``c + sum_h e^{s_h(y)} v_h^T y / (e^{s_h(y)} + L - 1)``
while y is inside the window, and exactly c once ``L`` exceeds it. Doubling L until the answer is
c, then bisecting, finds the window w with ``2 log2 w`` queries; no change up to ``window_limit``
tokens reports no window (up to that length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks.base import Check
from ..oracle.queries import bounded


@dataclass
class WindowSearch:
    """What the window search asked and found.

    Attributes
    ----------
    window : the window w (tokens attended, the final one included), or None (none up to ``limit``).
    limit : the longest query of the search.
    lengths, deviations : each query's length and ``|f - c|`` relative to ``|f((y)) - c|``.
    undetermined : a length whose answer was neither c nor clearly away from it.
    """

    window: int | None
    limit: int
    lengths: list
    deviations: list
    undetermined: int | None = None

    @property
    def queries(self) -> int:
        return len(self.lengths) + 1

    def check(self, shortest: int) -> Check:
        """``window``: the window was determined and holds the schedule's instances (``shortest`` tokens)."""
        if self.undetermined is not None:
            return Check("window", False, float(self.undetermined), float(self.limit),
                         f"the answer at {self.undetermined} tokens is neither the output constant nor clearly away "
                         "from it: the window cannot be determined (the zero token is not neutral: a key bias? "
                         "extract(..., key_bias=True) seeks a token that is)")
        if self.window is not None and self.window < shortest:
            return Check("window", False, float(self.window), float(shortest),
                         f"the sliding window of {self.window} tokens is shorter than the schedule's instances "
                         f"({shortest} tokens: 2H + 2 counts of zeros before 3 tokens): fewer heads fit in it")
        value = float(self.window or self.limit)
        found = f"window of {self.window} tokens" if self.window else f"no window up to {self.limit} tokens"
        return Check("window", True, value, float(shortest), found)


def find_window(boundary, rng: np.random.Generator, token_scale: float, c: float, limit: int,
                bound: float | None = None) -> WindowSearch:
    """Doubling then bisection on ``(y, 0^(L - 1))`` (one query per length, through ``boundary``; y within
    ``bound``, :func:`~mhaextract.oracle.queries.bounded`)."""
    d = boundary.d
    y = bounded(rng.standard_normal(d) * token_scale / np.sqrt(d), bound)
    base = abs(float(boundary.ask([y[None]], "window search")[0]) - c)
    unit = boundary.answer_unit
    floor = 64 * unit * max(abs(c), base, 1e-300)  # the answers' rounding, with room
    lengths, deviations = [], []

    def inside(length: int) -> bool | None:
        sequence = np.vstack([y[None], np.zeros((length - 1, d))])
        deviation = abs(float(boundary.ask([sequence], "window search")[0]) - c)
        lengths.append(length)
        deviations.append(deviation / max(base, 1e-300))
        if deviation <= floor:
            return False
        if deviation >= 1e-3 * base / length:
            return True
        return None

    if base <= floor:
        return WindowSearch(None, limit, lengths, deviations, undetermined=1)
    low, high = 1, None  # y inside at low tokens; outside at high
    length = 2
    while length <= limit:
        state = inside(length)
        if state is None:
            return WindowSearch(None, limit, lengths, deviations, undetermined=length)
        if not state:
            high = length
            break
        low = length
        length *= 2
    if high is None:
        return WindowSearch(None, limit, lengths, deviations)
    while high - low > 1:
        middle = (low + high) // 2
        state = inside(middle)
        if state is None:
            return WindowSearch(None, limit, lengths, deviations, undetermined=middle)
        low, high = (middle, high) if state else (low, middle)
    return WindowSearch(low, limit, lengths, deviations)
