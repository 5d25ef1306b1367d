"""The constant and the summed value map from one-token queries (docs/algorithm.md, 'Whole answers
near the vector bound').

A one-token query ``(w)`` gives every head all its attention: ``f((w)) = c + V_tot w`` with
``V_tot = sum_h V_h``, exactly. The zero token answers ``c``; ``rho e_j`` for the columns of a
random orthogonal basis answer ``c + rho V_tot e_j``: ``d + 1`` queries, each number to the
answers' rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular

from ..oracle.queries import random_basis


class SplitUnavailable(RuntimeError):
    """The heads' output subspaces cannot be split from whole answers here; the message says why
    (``extract`` then runs the scalar schedules)."""


@dataclass
class ValueMap:
    c: np.ndarray        # (d_out,)
    V_total: np.ndarray  # (d_out, d)
    sequences: list      # the one-token queries asked
    answers: np.ndarray  # (bases d + 1, d_out)
    bases: int = 1       # random orthogonal bases whose columns were asked


def _solve_basis(basis: np.ndarray, answers: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``V_tot`` from the answers ``c + V_tot b`` at the columns b of one basis: by QR (Householder,
    backward stable to the rounding), not LU: on a random orthogonal basis LU's own error is 1.3e-14
    of V_tot at d = 256 and 3.2e-14 at d = 768 (QR: 1.4e-15, 1.5e-15), and the split's oblique
    projectors (norm about 100) carry V_tot's error into every V_h."""
    Q, R = np.linalg.qr(basis.T)
    return solve_triangular(R, Q.T @ (answers - c)).T


def _one_token_queries(basis: np.ndarray) -> list[np.ndarray]:
    """One query ``(b)`` of one token per column b of ``basis`` (d, d)."""
    return [column[None, :].copy() for column in basis.T]


def value_map(boundary, rng: np.random.Generator, d: int, scale: float) -> ValueMap:
    """``c`` and ``V_tot`` from ``d + 1`` one-token queries at token norm ``scale``."""
    basis = random_basis(rng, d, scale)
    sequences = [np.zeros((1, d))] + _one_token_queries(basis)
    answers = np.asarray(boundary.ask(sequences, "one-token queries: the summed value map", whole=True))
    if answers.ndim != 2 or answers.shape[1] < 2:
        raise SplitUnavailable("the oracle answers one number per query: the split needs whole outputs")
    c = answers[0]
    return ValueMap(c, _solve_basis(basis, answers[1:], c), sequences, answers)


def more_bases(values: ValueMap, boundary, rng: np.random.Generator, d: int, scale: float, count: int) -> ValueMap:
    """``values`` with the columns of ``count`` more random orthogonal bases asked (``count d`` one-token
    queries, drawn from the stream that drew the first), in place: ``V_tot`` the mean of every basis's
    solve. Each answer carries its own rounding, so ``B`` bases divide V_tot's error by ``sqrt(B)``
    (d = 768, H = 12, float32: 3.6e-7 with one, 1.8e-7 with four), and with it the part of every
    ``V_h = O_h [O^+]_h V_tot`` that the oblique projectors carry over from V_tot (docs/algorithm.md,
    'Whole answers near the vector bound', 'What limits the split's values')."""
    for _ in range(count):
        basis = random_basis(rng, d, scale)
        sequences = _one_token_queries(basis)
        answers = np.asarray(boundary.ask(sequences, "one-token queries: more of the summed value map", whole=True))
        solved = _solve_basis(basis, answers, values.c)
        values.V_total = (values.bases * values.V_total + solved) / (values.bases + 1)
        values.sequences += sequences
        values.answers = np.concatenate([values.answers, answers])
        values.bases += 1
    return values
