"""The paper's schedule (docs/algorithm.md, 'The paper schedule'): exactly ``4 H0 d^2 - 2 H0 + 1`` queries.

Instance ``(0, 0)`` asks ``k = 0..2 H0`` (``2 H0 + 1`` queries); every other instance gets
``F(0)`` from the anchors ('Anchors') and asks ``k = 1..2 H0``. With ``d^2`` grid instances and
``d^2 - 1`` links::

    (2 H0 + 1) + 2 H0 (2 d^2 - 2) = 4 H0 d^2 - 2 H0 + 1   queries, the longest of length 2 H0 + 1.

``samples_per_instance=K > 2 H0 + 1`` oversamples every instance (least-squares fits, 'Approximate answers: certificate,
oversampling, refinement, verification'): ``K + (K - 1)(2 d^2 - 2)`` queries of length at most K. The redundant
measurements (every entry of ``M_h`` but one is measured twice) make the first-order certificate of 'Approximate
answers: certificate, oversampling, refinement, verification' possible.
"""

from __future__ import annotations

import numpy as np

from ..checks.certificate import pipeline_certificate
from ..oracle.queries import Rows
from .grid import GridSchedule


class PaperSchedule(GridSchedule):
    """The exact-count schedule of the paper (``extract(..., schedule="paper")``, the default)."""

    name = "paper"
    #: The paper's exact count: no fresh noise probe; the error estimate rests on the links' redundancy.
    probes_noise = False
    #: ... nor a default verification on fresh long queries (``verify_length=256`` asks for one).
    verifies_by_default = False
    #: Noisy answers (declared, or the links' noise above rounding): refined on its own answers, no
    #: query added (the exact count kept): least squares over all ``4 H0 d^2 - 2 H0 + 1`` answers,
    #: whose start is the algebra's model (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
    #: refinement, verification'; docs/reliability.md: models 10..100 x closer to the truth under 1e-10..1e-8 noise); so
    #: is an algebraic result that failed a check.
    refines_when_noisy = True
    noisy_polish_factor = 0
    accepts = GridSchedule.accepts | {"samples_per_instance", "repair"}

    def _build(self) -> None:
        # rows are the tokens; the instances name them (Rows), 2 d^2 instances share d of each
        x, z = np.ascontiguousarray(self.X.T), np.ascontiguousarray(self.Z.T)
        d, later, first = self.d, np.arange(1, self.d), np.zeros(self.d - 1, int)
        # 1. instance (0, 0): k = 0..2H0; its one-token query gives vbar^T x_0.
        self.grid_index[0, 0] = self._add("grid", 0, 0, x[0], z[0], 0)
        # 2. row 0: F(0) = vbar^T x_0 is known; each instance then gives vbar^T z_j.
        self.grid_index[0, 1:] = self._add_many("grid", first, later, Rows(x, first), Rows(z, later), 1)
        # 3. everything else (vbar known on R^d): row links, grid rows 1.., column links.
        self.row_link_index[1:] = self._add_many("row_link", first, later, Rows(x, first), z[0][None, :] + z[1:], 1)
        # (The biased grid of docs/algorithm.md, 'Biases: affine scores and an output constant' has one more final token
        # and column links at w (x_0 + x_i), w = 1/2.)
        finals, weight = len(x), self.column_link_weight
        i, j = np.repeat(np.arange(1, finals), d), np.tile(np.arange(d), finals - 1)  # row by row
        self.grid_index[1:] = self._add_many("grid", i, j, Rows(x, i), Rows(z, j), 1).reshape(finals - 1, d)
        link_finals = weight * (x[0][None, :] + x[1:])  # row i - 1: the final of column links (i, .)
        self.column_link_index[1:] = self._add_many("column_link", i, j, Rows(link_finals, i - 1), Rows(z, j),
                                                    1).reshape(finals - 1, d)

    #: The count in words, and the number of instances after the first as a formula in d.
    exact_formula = "paper 4*H0*d^2 - 2*H0 + 1"
    later_formula = "2d^2-2"

    def later_instances(self) -> int:
        """The instances after the first, ``K - 1`` queries each: ``2 d^2 - 2`` (docs/algorithm.md, 'The paper
        schedule')."""
        return 2 * self.d**2 - 2

    @property
    def promised_queries(self) -> int:
        """``4 H0 d^2 - 2 H0 + 1``, or ``K + (K - 1)(2 d^2 - 2)`` when oversampled."""
        K = self.samples_per_instance
        return K + (K - 1) * self.later_instances()

    @property
    def count_formula(self) -> str:
        if self.samples_per_instance > 2 * self.max_heads + 1:
            return f"oversampled K = {self.samples_per_instance}: K + (K-1)({self.later_formula})"
        return self.exact_formula

    def certificate(self, outcome):
        return None if outcome.linearisation is None else pipeline_certificate(outcome.linearisation)
