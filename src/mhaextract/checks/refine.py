"""Refinement: least squares of all parameters against every answer collected (docs/algorithm.md §12).

For a query ``X = (x_1, .., x_N)`` with scores ``s_{h,i} = x_i^T (W_h x_N + u_h)``, attention
weights ``a_{h,i}`` (§1, §16), head outputs ``f_h = sum_i a_{h,i} v_h^T x_i`` and
``f = c + sum_h f_h``, the Jacobian with respect to ``theta = (W_1..W_H, v_1..v_H[, u_1..u_H, c])``
is analytic and cheap. With ``d f / d s_{h,i} = a_{h,i} (v_h^T x_i - f_h)`` and
``d s_{h,i} / d W_h = x_i x_N^T``, ``d s_{h,i} / d u_h = x_i``:

    df/dv_h = sum_i a_{h,i} x_i
    df/dW_h = g_h x_N^T,   g_h = sum_i a_{h,i} (v_h^T x_i - f_h) x_i     (rank one per head)
    df/du_h = g_h                                                       (the same g, no x_N factor)
    df/dc   = 1

(for a copies-query, k copies of ``y = x - z`` then ``x``, with ``a_h = tau_h / (k + tau_h)``
on ``x``: ``g_h = a_h (1 - a_h) (v_h^T z) z``, the derivative of the pole ``m_h = z^T W_h x``).
``bias=True`` packs and refines ``u`` and ``c`` too (the model of §16); ``bias=False`` the
bias-free model, as the paper.

:func:`refine_least_squares` minimises the (optionally weighted) ``sum_q w_q^2 (f_theta(X_q) -
answer_q)^2`` by Gauss-Newton steps with Levenberg-Marquardt damping where a step fails, each
step an SVD least-squares solve of the column-scaled Jacobian (never the normal equations, whose
condition number is squared). The residuals are evaluated in extended precision
(``np.longdouble``, :func:`residuals`): the model's own float64 rounding would otherwise add
noise of the size of the oracle's. It keeps whichever of the start and the refined model
misfits the answers less: refinement never makes a result worse silently.

The schedules' queries are poorly conditioned as a least-squares design (two distinct tokens
each, or saturated heads), so the learner adds fresh random queries (``api._refinement_queries``):
``POLISH_FACTOR`` per parameter, 2 to ``POLISH_LONGEST`` tokens at ``POLISH_SCALE`` times the
calibrated token scale: small answers (float64 rounding is relative to them) and a well-conditioned
design. They are asked through the oracle boundary (counted). To first order
the minimiser moves by ``G e``, ``G = (D J)^+ D`` (D the weights), for answer errors ``e``:
:mod:`mhaextract.checks.certificate` bounds the refined result with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import MultiHeadAttention, as_batch
from ..oracle.queries import padded

#: Fresh polish queries per refined parameter (default ``refine_queries``): d = 8, H = 6 with
#: biases, 2886 queries, 2^-51..2^-52 (docs/algorithm.md §12).
POLISH_FACTOR = 6
#: The polish queries have 2 .. POLISH_LONGEST tokens (never more than the schedule's longest).
POLISH_LONGEST = 5
#: The polish queries' token norm, as a multiple of the run's (calibrated) token scale.
POLISH_SCALE = 1.5
#: Queries per block when evaluating residuals and Jacobians (bounds the padded token arrays).
BLOCK = 2048
#: Largest dense Jacobian (entries, Q x P) the refinement builds: 3e8 float64 = 2.4 GB would be too
#: much next to an SVD; 6e7 (480 MB) keeps d = 16, H <= 12 and d = 32, H <= 2 in reach.
MAX_JACOBIAN_ENTRIES = 60_000_000


def parameter_count(heads: int, d: int, bias: bool = False) -> int:
    """``H (d^2 + d)``, or ``H (d^2 + 2d) + 1`` with the biases (u_h and c)."""
    return heads * (d * d + d) + (heads * d + 1 if bias else 0)


def pack(model: MultiHeadAttention, bias: bool = False) -> np.ndarray:
    """theta = (W_1..W_H flattened row-major, v_1..v_H[, u_1..u_H, c]): the parameter order of every
    Jacobian here."""
    parts = [model.W.ravel(), model.v.ravel()]
    if bias:
        parts += [model.u.ravel(), np.array([float(model.c)])]
    return np.concatenate(parts).astype(np.float64)


def unpack(theta: np.ndarray, heads: int, d: int, bias: bool = False) -> MultiHeadAttention:
    W = theta[:heads * d * d].reshape(heads, d, d)
    v = theta[heads * d * d:heads * (d * d + d)].reshape(heads, d)
    if not bias:
        return MultiHeadAttention(W.copy(), v.copy())
    u = theta[heads * (d * d + d):heads * (d * d + 2 * d)].reshape(heads, d)
    return MultiHeadAttention(W.copy(), v.copy(), u.copy(), float(theta[-1]))


def _blocks(sequences):
    for start in range(0, len(sequences), BLOCK):
        yield slice(start, min(start + BLOCK, len(sequences))), padded(sequences[start:start + BLOCK])


def _attention(W, v, u, tokens, mask):
    """Weights a (Q, H, N), values v_h^T x_i (Q, H, N), head outputs f_h (Q, H, 1) in the dtype of W."""
    final = tokens[:, -1, :]  # padding is at the front: the last token is x_N
    queried = np.einsum("hab,qb->qha", W, final) + u[None]  # W_h x_N + u_h
    scores = np.einsum("qna,qha->qhn", tokens, queried)
    scores = np.where(mask[:, None, :], scores, -np.inf)
    scores = scores - scores.max(axis=2, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(axis=2, keepdims=True)  # a_{h,i}
    values = np.einsum("qna,ha->qhn", tokens, v)
    return weights, values, (weights * values).sum(axis=2, keepdims=True)


def output_jacobian(model: MultiHeadAttention, sequences, bias: bool = False) -> np.ndarray:
    """``d f(X_q) / d theta`` for every sequence, shape (Q, P), in the order of :func:`pack`."""
    sequences = as_batch(sequences, model.d)
    model = model.to_float64()
    H, d = model.heads, model.d
    out = np.empty((len(sequences), parameter_count(H, d, bias)))
    nW, nv = H * d * d, H * d
    for rows, (tokens, mask) in _blocks(sequences):
        weights, values, heads = _attention(model.W, model.v, model.u, tokens, mask)
        g = np.einsum("qhn,qna->qha", weights * (values - heads), tokens)
        final = tokens[:, -1, :]
        count = len(tokens)
        out[rows, :nW] = (g[:, :, :, None] * final[:, None, None, :]).reshape(count, -1)
        out[rows, nW:nW + nv] = np.einsum("qhn,qna->qha", weights, tokens).reshape(count, -1)
        if bias:
            out[rows, nW + nv:nW + 2 * nv] = g.reshape(count, -1)
            out[rows, -1] = 1.0
    return out


def residuals(model: MultiHeadAttention, sequences, answers, extended: bool = True) -> np.ndarray:
    """``answers - f_model(X)`` (float64), the model evaluated in ``np.longdouble`` (``extended``):
    the residual then carries the answers' errors, not the model's own float64 rounding."""
    sequences = as_batch(sequences, model.d)
    model = model.to_float64()
    dtype = np.longdouble if extended else np.float64
    W, v, u = (np.asarray(p, dtype=dtype) for p in (model.W, model.v, model.u))
    out = np.empty(len(sequences))
    for rows, (tokens, mask) in _blocks(sequences):
        _, _, heads = _attention(W, v, u, tokens.astype(dtype), mask)
        fitted = heads[:, :, 0].sum(axis=1) + dtype(model.c)
        out[rows] = (np.asarray(answers[rows], dtype=dtype) - fitted).astype(np.float64)
    return out


def answer_scales(model: MultiHeadAttention, sequences) -> np.ndarray:
    """The size of each answer's computation, ``|c| + sum_h sum_i a_{h,i} |v_h^T x_i|``: float64
    rounding of an answer is relative to it (the weights of the least squares are its inverse)."""
    sequences = as_batch(sequences, model.d)
    model = model.to_float64()
    out = np.empty(len(sequences))
    for rows, (tokens, mask) in _blocks(sequences):
        weights, values, _ = _attention(model.W, model.v, model.u, tokens, mask)
        out[rows] = (weights * np.abs(values)).sum(axis=(1, 2)) + abs(model.c)
    return out


def affordable(queries: int, heads: int, d: int, bias: bool) -> bool:
    """Whether the dense Jacobian of ``queries`` answers fits :data:`MAX_JACOBIAN_ENTRIES`."""
    return queries * parameter_count(heads, d, bias) <= MAX_JACOBIAN_ENTRIES


@dataclass
class Refinement:
    """What :func:`refine_least_squares` did.

    Attributes
    ----------
    kept : ``"refined"`` or ``"algebraic"``, the model that misfits the answers less (or
        ``"algebraic"`` with ``status = -1`` when not attempted: fewer answers than parameters, or a
        dense Jacobian beyond ``MAX_JACOBIAN_ENTRIES``).
    residual_before, residual_after : root-mean-square (weighted) misfit on all answers of the
        start and of the refined model.
    iterations : Jacobian evaluations; ``status``, ``message`` : the solver's verdict.
    queries : fresh queries asked for the refinement (on top of the schedule's).
    """

    kept: str
    residual_before: float
    residual_after: float
    iterations: int
    status: int
    message: str
    queries: int = 0
    #: The factorisation of the last (weighted) Jacobian, for the certificate (None: none was made).
    solver: object = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return (f"refinement kept the {self.kept} model (rms misfit {self.residual_before:.3g} -> "
                f"{self.residual_after:.3g}, {self.iterations} Jacobians, {self.queries} added queries: {self.message})")


#: Damping tried per Jacobian (relative to the unit column norms): Gauss-Newton, then
#: Levenberg-Marquardt steps of decreasing length, until one lowers the misfit.
DAMPINGS = (0.0, 1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4)
#: A step lowering the (weighted) sum of squares by less than this fraction ends the refinement:
#: at the noise floor a further step only reshuffles rounding.
CONVERGED_GAIN = 1e-2


class _Solver:
    """``s(r, damping) = argmin ||J s - r||^2 + damping ||D s||^2`` (D: J's column norms) from one
    SVD of the column-scaled J: no normal equations, whose condition number is squared."""

    def __init__(self, J: np.ndarray):
        norms = np.linalg.norm(J, axis=0)
        norms[norms == 0] = 1.0
        self.norms = norms
        # QR first (the tall part), then the SVD of the square R: U = Q U_R.
        self.Q, R = np.linalg.qr(J / norms)
        self.U_R, self.s, self.Vt = np.linalg.svd(R)
        self.keep = self.s > self.s[0] * 1e-13 if self.s.size else self.s > 0

    def project(self, r: np.ndarray) -> np.ndarray:
        """``U^T r``."""
        return self.U_R.T @ (self.Q.T @ r)

    def __call__(self, r: np.ndarray, damping: float) -> np.ndarray:
        filtered = np.where(self.keep, self.s / (self.s**2 + damping), 0.0)
        return (self.Vt.T @ (filtered * self.project(r))) / self.norms


def refine_least_squares(model: MultiHeadAttention, sequences, answers: np.ndarray,
                         max_evaluations: int = 30, added: int = 0, bias: bool = False,
                         weights: np.ndarray | None = None) -> tuple[MultiHeadAttention, Refinement]:
    """Polish ``model`` against ``answers`` to ``sequences`` (float64); returns the better of the
    two models (smaller weighted misfit) and a :class:`Refinement` record saying which and why
    (``added``: how many of the sequences were asked for the refinement, recorded; ``bias``: refine
    ``u`` and ``c`` too; ``weights``: per-answer weights, default one)."""
    heads, d = model.heads, model.d
    sequences = as_batch(sequences, d)
    answers = np.asarray(answers, dtype=np.float64)
    if answers.shape != (len(sequences),):
        raise ValueError(f"need one answer per sequence: {len(sequences)} sequences, answers of shape {answers.shape}")
    weights = np.ones(len(sequences)) if weights is None else np.asarray(weights, dtype=np.float64)

    def weighted_residual(theta):
        return weights * residuals(unpack(theta, heads, d, bias), sequences, answers)

    start = pack(model, bias)
    current = weighted_residual(start)
    before = float(np.sqrt(np.mean(current**2))) if len(current) else 0.0
    if heads == 0:
        return model, Refinement("algebraic", before, before, 0, 0, "no heads to refine", added)
    if len(sequences) < len(start):
        return model, Refinement("algebraic", before, before, 0, -1,
                                 f"not refined: {len(sequences)} answers for {len(start)} parameters", added)
    if not affordable(len(sequences), heads, d, bias):
        return model, Refinement("algebraic", before, before, 0, -1,
                                 f"not refined: a dense Jacobian of {len(sequences)} x "
                                 f"{parameter_count(heads, d, bias)} exceeds {MAX_JACOBIAN_ENTRIES:.0e} entries", added)
    theta, cost = start, float(np.sum(current**2)) if np.all(np.isfinite(current)) else np.inf
    solve = None
    evaluations, status, message = 0, 0, "the evaluation limit was reached"
    while evaluations < max_evaluations:
        J = weights[:, None] * output_jacobian(unpack(theta, heads, d, bias), sequences, bias)
        evaluations += 1
        if not np.all(np.isfinite(J)):
            status, message = -2, "the Jacobian is not finite"
            break
        solve = _Solver(J)
        improved, gain = False, 0.0
        for damping in DAMPINGS:  # plain Gauss-Newton first; damped only where it fails
            trial = theta + solve(current, damping)
            trial_residual = weighted_residual(trial)
            trial_cost = float(np.sum(trial_residual**2))
            if np.isfinite(trial_cost) and trial_cost < cost:
                gain = 1.0 - trial_cost / cost
                theta, current, cost, improved = trial, trial_residual, trial_cost, True
                break
        if not improved:
            status, message = 2, "converged: no step lowers the misfit further"
            break
        if gain < CONVERGED_GAIN:
            status, message = 1, f"converged: the last step lowered the misfit by {gain:.2g} (relative)"
            break
    after = float(np.sqrt(cost / len(current))) if len(current) else 0.0
    if np.isfinite(after) and after <= before:
        return unpack(theta, heads, d, bias), Refinement("refined", before, after, evaluations, status, message, added,
                                                         solve)
    return model, Refinement("algebraic", before, after, evaluations, status, message, added)
