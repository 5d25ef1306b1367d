"""Refinement: nonlinear least squares of all parameters against every answer collected.

For a query ``X = (x_1, .., x_N)`` with attention weights ``a_{h,i}`` (docs/algorithm.md §1),
head outputs ``f_h = sum_i a_{h,i} v_h^T x_i`` and ``f = sum_h f_h``, the Jacobian with
respect to ``theta = (W_1..W_H, v_1..v_H)`` is analytic and cheap:

    df/dv_h = sum_i a_{h,i} x_i
    df/dW_h = g_h x_N^T,   g_h = sum_i a_{h,i} (v_h^T x_i - f_h) x_i     (rank one per head)

(for a copies-query, k copies of ``y = x - z`` then ``x``, with ``a_h = tau_h / (k + tau_h)``
on ``x``: ``g_h = a_h (1 - a_h) (v_h^T z) z``, the derivative of the pole ``m_h = z^T W_h x``).
:func:`refine_least_squares` minimises ``sum_q (f_theta(X_q) - answer_q)^2`` with
:func:`scipy.optimize.least_squares` from the algebraic solution and keeps whichever of the two
models misfits the answers less: refinement never makes a result worse silently.

The schedule's queries hold only two distinct tokens each, and for W they are poorly
conditioned as a least-squares design (the heads of one instance are separated only through
the few copy counts). A few fresh random queries of the schedule's lengths fix that:
:func:`random_queries` draws them and the learner asks them through the same oracle boundary
(they are counted). To first order the minimiser moves by ``J^+ e`` for answer errors ``e``
(J full column rank for canonical heads): :mod:`mhaextract.checks.certificate` bounds the refined
result with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from ..model import MultiHeadAttention, as_batch
from ..oracle.queries import padded


def pack(model: MultiHeadAttention) -> np.ndarray:
    """theta = (W_1..W_H flattened row-major, v_1..v_H): the parameter order of every Jacobian here."""
    return np.concatenate([model.W.ravel(), model.v.ravel()])


def unpack(theta: np.ndarray, heads: int, d: int) -> MultiHeadAttention:
    W = theta[:heads * d * d].reshape(heads, d, d)
    v = theta[heads * d * d:].reshape(heads, d)
    return MultiHeadAttention(W.copy(), v.copy())


def output_jacobian(model: MultiHeadAttention, sequences) -> np.ndarray:
    """``d f(X_q) / d theta`` for every sequence, shape (Q, H (d^2 + d)), in the order of :func:`pack`."""
    sequences = as_batch(sequences, model.d)
    tokens, mask = padded(sequences)
    W, v = model.W, model.v
    final = tokens[:, -1, :]  # padding is at the front: the last token is x_N
    queried = np.einsum("hab,qb->qha", W, final)  # W_h x_N
    scores = np.einsum("qna,qha->qhn", tokens, queried)
    scores = np.where(mask[:, None, :], scores, -np.inf)
    scores -= scores.max(axis=2, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=2, keepdims=True)  # a_{h,i}, (Q, H, N)
    values = np.einsum("qna,ha->qhn", tokens, v)  # v_h^T x_i
    head_outputs = (weights * values).sum(axis=2, keepdims=True)  # f_h
    g = np.einsum("qhn,qna->qha", weights * (values - head_outputs), tokens)
    dW = g[:, :, :, None] * final[:, None, None, :]  # (Q, H, d, d)
    dv = np.einsum("qhn,qna->qha", weights, tokens)
    return np.concatenate([dW.reshape(len(sequences), -1), dv.reshape(len(sequences), -1)], axis=1)


@dataclass
class Refinement:
    """What :func:`refine_least_squares` did.

    Attributes
    ----------
    kept : ``"refined"`` or ``"algebraic"``, the model that misfits the answers less.
    residual_before, residual_after : root-mean-square misfit on all answers of the algebraic
        and of the refined model.
    iterations : Jacobian evaluations of the solver; ``status``, ``message`` : its verdict.
    queries : fresh queries asked for the refinement (on top of the schedule's).
    """

    kept: str
    residual_before: float
    residual_after: float
    iterations: int
    status: int
    message: str
    queries: int = 0

    def __str__(self) -> str:
        return (f"refinement kept the {self.kept} model (rms misfit {self.residual_before:.3g} -> "
                f"{self.residual_after:.3g}, {self.iterations} Jacobians, {self.queries} added queries: {self.message})")


def refine_least_squares(model: MultiHeadAttention, sequences, answers: np.ndarray,
                         max_evaluations: int = 100, added: int = 0) -> tuple[MultiHeadAttention, Refinement]:
    """Polish ``model`` against ``answers`` to ``sequences`` (float64); returns the better of the
    two models (smaller misfit) and a :class:`Refinement` record saying which and why
    (``added``: how many of the sequences were asked for the refinement, recorded)."""
    heads, d = model.heads, model.d
    sequences = as_batch(sequences, d)
    answers = np.asarray(answers, dtype=np.float64)
    if answers.shape != (len(sequences),):
        raise ValueError(f"need one answer per sequence: {len(sequences)} sequences, answers of shape {answers.shape}")

    def misfit(theta):
        return unpack(theta, heads, d)(sequences) - answers

    def jacobian(theta):
        return output_jacobian(unpack(theta, heads, d), sequences)

    start = pack(model)
    before = float(np.sqrt(np.mean(misfit(start) ** 2)))
    if heads == 0:
        return model, Refinement("algebraic", before, before, 0, 0, "no heads to refine", added)
    # W and v differ in size and sensitivity: scale each parameter by its Jacobian column norm.
    solution = least_squares(misfit, start, jac=jacobian, method="lm", x_scale="jac",
                             ftol=1e-15, xtol=1e-15, gtol=1e-15, max_nfev=max_evaluations)
    after = float(np.sqrt(np.mean(solution.fun ** 2)))
    iterations = int(solution.njev or 0)
    if np.isfinite(after) and after <= before:
        return unpack(solution.x, heads, d), Refinement("refined", before, after, iterations,
                                                        int(solution.status), solution.message, added)
    return model, Refinement("algebraic", before, after, iterations, int(solution.status), solution.message, added)
