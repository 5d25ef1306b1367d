"""The lean schedule (docs/algorithm.md, 'The lean schedule'): fewer queries than the paper's count.

Row 0 is asked as in the paper (``vbar`` becomes known on R^d). Every later instance then knows
both anchors, ``F(0) = vbar^T x`` and ``c = vbar^T y``, so ``k = 1..2 H0 - 1`` suffice
(``2 H0 - 1`` queries). Heads are matched inside each column by their residue labels
``l_h = v_h^T z_j``, which do not depend on the final token: only the ``d - 1`` row links remain
(none for ``H0 = 1``, where nothing needs matching). Where two labels of a column are too close
to match, that instance's column link is added and asked (a *fallback link*).

Queries without fallback links::

    H0 = 1:   3 + 2 (d - 1) + d (d - 1)                                  = d^2 + d + 1
    H0 >= 2:  (2 H0 + 1) + 2 H0 (d - 1) + (2 H0 - 1)(d - 1) + (2 H0 - 1) d (d - 1)
            = (2 H0 + 1) + 2 H0 (d - 1) + (2 H0 - 1)(d^2 - 1)

plus ``2 H0 - 1`` per fallback column link. The information lower bound is ``H (d^2 + d)``.
Noisy answers add ``H0 (d^2 + d)`` polish queries for a least-squares refinement (``refine=None``,
H0 <= 3; docs/algorithm.md, 'The lean schedule'); float64 runs ask 12 noise-probe queries.
"""

from __future__ import annotations

import numpy as np

from ..checks.base import CheckPolicy
from ..oracle.queries import Rows
from .grid import GridSchedule
from .matching import match_labels


class LeanSchedule(GridSchedule):
    """``extract(..., schedule="lean")``: both anchors known, heads matched by labels."""

    name = "lean"
    both_anchors = True
    #: Noisy answers (declared or measured by the noise probe): the algebra's 2 H0 - 1 samples per
    #: instance amplify the noise up to the error limit (docs/reliability.md: truths 5e-6..1e-4 at
    #: 1e-10..1e-8 noise, estimates above 1e-4); least squares over every answer and
    #: H0 (d^2 + d) fresh polish queries brings them to 4e-11..1e-7 (docs/algorithm.md, 'The lean schedule').
    refines_when_noisy = True
    refusal = ("oversampling is a feature of the paper schedule; the lean schedule asks the fewest samples "
               "per instance by design")

    def _build(self) -> None:
        x, z = np.ascontiguousarray(self.X.T), np.ascontiguousarray(self.Z.T)  # the instances name rows (Rows)
        H0, last = self.max_heads, 2 * self.max_heads - 1
        d, later, first = self.d, np.arange(1, self.d), np.zeros(self.d - 1, int)
        self.grid_index[0, 0] = self._add("grid", 0, 0, x[0], z[0], 0)
        self.grid_index[0, 1:] = self._add_many("grid", first, later, Rows(x, first), Rows(z, later), 1)
        if H0 >= 2:
            self.row_link_index[1:] = self._add_many("row_link", first, later, Rows(x, first), z[0][None, :] + z[1:],
                                                     1, last)
        i, j = np.repeat(later, d), np.tile(np.arange(d), d - 1)  # row by row
        self.grid_index[1:] = self._add_many("grid", i, j, Rows(x, i), Rows(z, j), 1, last).reshape(d - 1, d)

    def add_column_link(self, i: int, j: int) -> int:
        """Add the fallback column link ``(i, j)`` (final ``x_0 + x_i``, difference ``z_j``)."""
        if self.column_link_index[i, j] >= 0:
            raise ValueError(f"column link ({i}, {j}) is already scheduled")
        x, z = self.X.T, self.Z.T
        index = self._add("column_link", i, j, x[0] + x[i], z[j], 1, 2 * self.max_heads - 1)
        self.column_link_index[i, j] = index
        return index

    def match_within_columns(self, learner):
        """Labels match the heads of each column to its row-0 instance; a match less certain than
        ``CheckPolicy.label_ambiguity`` gets its column link, asked now (the links then decide)."""
        if self.d == 1 or learner.H_star <= 1:
            return None
        grid = self.grid_index
        reference = np.repeat(grid[0][None, :], self.d - 1, axis=0).ravel()
        later = grid[1:].ravel()
        matches = match_labels(learner.side(reference), learner.side(later))
        threshold = CheckPolicy.for_precision(self.settings.precision).label_ambiguity
        ambiguous = later[matches.ambiguity > threshold]
        if len(ambiguous):
            learner.add_instances([self.add_column_link(self.instances[b].i, self.instances[b].j) for b in ambiguous])
        return later, matches

    @property
    def count_formula(self) -> str:
        d, H0 = self.d, self.max_heads
        context = f"paper {4 * H0 * d**2 - 2 * H0 + 1}, lower bound H0(d^2+d) = {H0 * (d**2 + d)}"
        if H0 == 1:
            return f"lean formula d^2 + d + 1 ({context})"
        return f"lean formula (2H0+1) + 2H0(d-1) + (2H0-1)(d^2-1) + (2H0-1) per fallback link ({context})"

    @property
    def promised_queries(self) -> int:
        """The lean count without fallback links."""
        d, H0 = self.d, self.max_heads
        if H0 == 1:
            return d * d + d + 1
        return (2 * H0 + 1) + 2 * H0 * (d - 1) + (2 * H0 - 1) * (d * d - 1)
