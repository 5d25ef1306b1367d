"""The targeted family's access to the oracle: copies-instances asked through the boundary, every
answer kept and a bounded sample of the queries (docs/algorithm.md, 'Memory').
"""

from __future__ import annotations

import numpy as np

from ...numerics import float64 as float64_kernel
from ...oracle.boundary import OracleBoundary
from ...oracle.queries import KeptQueries, RoundQueries, one_token_queries, quantize
from .tolerances import EPS, GROUP_SCALE

#: Queries kept (evenly spaced, with their answers) for the ``answers_residual`` check; the others
#: are dropped once answered (docs/algorithm.md, 'Memory').
RESIDUAL_SAMPLE = 4096


class Prober:
    """Asks copies-instances through the boundary; keeps every answer and a bounded sample of the
    queries (docs/algorithm.md, 'Memory').

    The queries are built per batch from ``(final, difference, k)`` and dropped once answered:
    only every ``stride``-th one is kept (with its answer) for the ``answers_residual`` check, so
    memory grows with the answers (one float each), not with all queries x length x d.
    """

    def __init__(self, boundary: OracleBoundary, d: int, token_scale: float, expected_queries: int = 0):
        self.boundary = boundary
        #: The answers' relative rounding unit every tolerance is sized by (:func:`answer_unit`; set
        #: by the schedule once the one-token answers are in), and the oracle's own (:func:`score_unit`).
        self.unit = self.score_unit = EPS
        self.d = d
        self.token_scale = token_scale
        # One exact grid for every token of the run: sums and differences of tokens stay exact.
        self.grid_scale = 4 * GROUP_SCALE * token_scale
        self.stride = max(1, int(expected_queries) // RESIDUAL_SAMPLE)
        self.asked = 0
        self.sequences = KeptQueries()
        self.answers: list[float] = []
        self.vbar: np.ndarray | None = None

    def quantize(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return quantize(values, self.grid_scale, out)

    def ask(self, sequences, description):
        answers = np.asarray(self.boundary.ask(sequences, description=description), dtype=np.float64)
        first_pick = (-self.asked) % self.stride  # every stride-th query of the run
        self.sequences.keep(sequences, range(first_pick, len(sequences), self.stride))
        self.answers.extend(answers[first_pick::self.stride].tolist())
        self.asked += len(sequences)
        return answers

    def learn_vbar(self, basis: np.ndarray) -> None:
        """``vbar`` from the one-token answers ``f((b_i)) = vbar^T b_i`` on a basis (columns)."""
        answers = self.ask(one_token_queries(basis), "one-token queries (vbar)")
        self.vbar = float64_kernel.solve_transposed(basis, answers)

    def gaps(self, finals: np.ndarray, differences: np.ndarray, copies, description="targeted instances"):
        """``G(k) = vbar^T x - F(k)`` for each row (x, z) and each k in ``copies`` (n, K); and the
        rounding scale of each sample (the magnitudes the subtraction cancels), (n, K)."""
        return self.rounds_gaps(finals[:, None], differences, [copies], description)[0]

    def rounds_gaps(self, finals: np.ndarray, differences: np.ndarray, copies, description="targeted instances"):
        """:meth:`gaps` for R rounds asked at once: ``finals`` (n, R, d) (round r's final token of
        each row), ``differences`` (n, d), ``copies`` R tuples (round r's copy counts). One ask of
        :class:`~mhaextract.oracle.queries.RoundQueries` (round by round, k by k, row by row: the
        order in which the rounds were asked one by one). Returns R pairs ``(gaps, rounding)``."""
        answers = self.ask(RoundQueries(finals, differences, copies), description)
        labels_scale = np.abs(differences) @ np.abs(self.vbar)
        out, start = [], 0
        for n, ks in enumerate(copies):
            n_answers = answers[start:start + len(ks) * len(finals)].reshape(len(ks), len(finals)).T
            start += len(ks) * len(finals)
            x = finals[:, n]
            anchor = x @ self.vbar
            rounding = self.systematic(x)[:, None] + 4 * self.unit * (np.abs(n_answers) + labels_scale[:, None])
            out.append((anchor[:, None] - n_answers, rounding))
        return out

    def systematic(self, finals: np.ndarray) -> np.ndarray:
        """The part of :meth:`gaps`' rounding scale common to every sample of an instance: the
        anchor ``vbar^T x`` (its error is vbar's, from the one-token answers, times x). The
        three-sample fits' residuals cannot show it, so noisy runs do not scale it by them."""
        return 4 * self.unit * np.abs(finals @ self.vbar)
