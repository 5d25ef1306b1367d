"""Refinement: least squares of all parameters against every answer collected (docs/algorithm.md, 'Approximate answers:
certificate, oversampling, refinement, verification').

For a query ``X = (x_1, .., x_N)`` with scores ``s_{h,i} = x_i^T (W_h x_N + u_h)``, attention
weights ``a_{h,i}`` ('The model' and 'Biases: affine scores and an output constant'), head outputs
``f_h = sum_i a_{h,i} v_h^T x_i`` and ``f = c + sum_h f_h``, the Jacobian with respect to
``theta = (W_1..W_H, v_1..v_H[, u_1..u_H, c])`` is analytic and cheap. With
``d f / d s_{h,i} = a_{h,i} (v_h^T x_i - f_h)`` and ``d s_{h,i} / d W_h = x_i x_N^T``, ``d s_{h,i} / d u_h = x_i``:

    df/dv_h = sum_i a_{h,i} x_i
    df/dW_h = g_h x_N^T,   g_h = sum_i a_{h,i} (v_h^T x_i - f_h) x_i     (rank one per head)
    df/du_h = g_h                                                       (the same g, no x_N factor)
    df/dc   = 1

(for a copies-query, k copies of ``y = x - z`` then ``x``, with ``a_h = tau_h / (k + tau_h)``
on ``x``: ``g_h = a_h (1 - a_h) (v_h^T z) z``, the derivative of the pole ``m_h = z^T W_h x``).
``bias=True`` packs and refines ``u`` and ``c`` too (the model of 'Biases: affine scores and an output constant');
``bias=False`` the bias-free model, as the paper.

:func:`refine_least_squares` minimises the (optionally weighted) ``sum_q w_q^2 (f_theta(X_q) -
answer_q)^2`` by Gauss-Newton steps with Levenberg-Marquardt damping where a step fails, each
step an SVD least-squares solve of the column-scaled Jacobian (never the normal equations, whose
condition number is squared). The residuals are evaluated in extended precision
(``np.longdouble``, :func:`residuals`): the model's own float64 rounding would otherwise add
noise of the size of the oracle's. It keeps whichever of the start and the refined model
misfits the answers less: refinement never makes a result worse silently.

The schedules' queries are poorly conditioned as a least-squares design (two distinct tokens
each, or saturated heads), so the learner adds fresh random queries (``finish.refinement_queries``):
``POLISH_FACTOR`` per parameter, 2 to ``POLISH_LONGEST`` tokens at ``POLISH_SCALE`` times the
calibrated token scale: small answers (float64 rounding is relative to them) and a well-conditioned
design. They are asked through the oracle boundary (counted). To first order
the minimiser moves by ``G e``, ``G = (D J)^+ D`` (D the weights), for answer errors ``e``:
:mod:`mhaextract.checks.certificate` bounds the refined result with it.

Beyond ``MAX_JACOBIAN_ENTRIES`` (d = 32 from H = 4 on, d = 64) the Jacobian is never formed
(docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian'): :class:`MatrixFreeSolver` applies ``D J`` and
``J^T D`` from the rank-one structure above, query block by query block (``O(Q (H d^2 + N H d))`` per product, memory of
the order of the queries themselves), and each Gauss-Newton / Levenberg-Marquardt step is an LSMR
solve of the column-scaled problem (``scipy.sparse.linalg.lsmr``, ``damp = sqrt(damping)``: the
same damped problem the SVD solves). Its certificate estimates the row norms of G by LSMR solves
on random answer errors (:meth:`MatrixFreeSolver.row_l1_bounds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scipy.sparse.linalg import LinearOperator, lsmr

from ..models.attention import MultiHeadAttention, as_batch
from ..oracle.queries import padded
from ..numerics.float64 import root_mean_square

#: Fresh polish queries per refined parameter (default ``refine_queries``; docs/algorithm.md, 'Approximate answers:
#: certificate, oversampling, refinement, verification').
POLISH_FACTOR = 6
#: The polish queries have 2 .. POLISH_LONGEST tokens (never more than the schedule's longest).
POLISH_LONGEST = 5
#: The polish queries' token norm, as a multiple of the run's (calibrated) token scale.
POLISH_SCALE = 1.5
#: Queries per block when evaluating residuals and Jacobians (bounds the padded token arrays).
BLOCK = 2048
#: Largest dense Jacobian (entries, Q x P) the refinement builds: 3e8 float64 = 2.4 GB would be too
#: much next to an SVD; 6e7 (480 MB) keeps d = 16, H <= 8 and d = 32, H <= 2 (with biases) dense.
#: Beyond it the refinement is matrix-free (docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian').
MAX_JACOBIAN_ENTRIES = 60_000_000
#: Matrix-free steps (docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian'): LSMR's ``atol = btol``
#: (the normal-equations residual relative to ``||A|| ||r||``; the step's relative error is at most about this times the
#: squared condition number of the scaled Jacobian, and the next Gauss-Newton step corrects it),
#: its condition limit (the dense path's rank cut-off) and its iteration cap per solve.
LSMR_TOLERANCE = 1e-8
LSMR_CONDITION_LIMIT = 1e13
LSMR_MAX_ITERATIONS = 4000
#: The matrix-free certificate: Gaussian answer-error probes ``e`` solved for ``G e`` (to
#: ESTIMATE_TOLERANCE), and the safety factor on the row norms they estimate (the chi-square tail
#: of ESTIMATE_PROBES samples: P(chi2_4 / 4 < 1 / 16) = 0.7%).
ESTIMATE_PROBES = 4
ESTIMATE_SAFETY = 4.0
ESTIMATE_TOLERANCE = 1e-6
#: The matrix-free operator keeps g and s (2 Q H d floats) up to this many bytes, else rebuilds
#: them per product from the padded queries (d = 64, H = 8: 1.7 GB would be kept).
CACHE_BYTES = 500_000_000


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
        ``"algebraic"`` with ``status = -1`` when not attempted: fewer answers than parameters).
    residual_before, residual_after : root-mean-square (weighted) misfit on all answers of the
        start and of the refined model.
    iterations : Jacobian evaluations; ``status``, ``message`` : the solver's verdict.
    queries : fresh queries asked for the refinement (on top of the schedule's).
    path : ``"dense"`` (SVD of the formed Jacobian) or ``"matrix-free"`` (LSMR on Jacobian
        products, beyond ``MAX_JACOBIAN_ENTRIES``; docs/algorithm.md, 'Matrix-free refinement beyond the dense
        Jacobian').
    inner_iterations : LSMR iterations over all the steps tried (matrix-free; 0 dense).
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
    path: str = "dense"
    inner_iterations: int = 0

    def __str__(self) -> str:
        how = "" if self.path == "dense" else f" (matrix-free, {self.inner_iterations} LSMR iterations)"
        return (f"refinement kept the {self.kept} model (rms misfit {self.residual_before:.3g} -> "
                f"{self.residual_after:.3g}, {self.iterations} Jacobians{how}, {self.queries} added queries: "
                f"{self.message})")


#: Damping tried per Jacobian (relative to the unit column norms): Gauss-Newton, then
#: Levenberg-Marquardt steps of decreasing length, until one lowers the misfit.
DAMPINGS = (0.0, 1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4)
#: A step lowering the (weighted) sum of squares by less than this fraction ends the refinement:
#: at the noise floor a further step only reshuffles rounding.
CONVERGED_GAIN = 1e-2


class FactoredSolver:
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


class MatrixFreeSolver:
    """``D J`` (D: the answers' weights, J: the output Jacobian of ``model`` at the queries of
    ``blocks``) as products, never formed (docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian'). Per
    query and head J's row is ``g_h x_N^T`` (W_h), ``s_h = sum_i a_{h,i} x_i`` (v_h), ``g_h`` (u_h), 1 (c), and
    ``g_h = sum_i b_{h,i} x_i`` with ``b_{h,i} = a_{h,i} (v_h^T x_i - f_h)``. g and s (Q, H, d) are
    kept where they fit ``CACHE_BYTES``; beyond, only the coefficients a and b (Q, H, N) next to the
    padded queries, and g, s are rebuilt per block (``O(N H d)`` per query against the ``O(H d^2)``
    of the products with W).

    ``__call__(r, damping)`` is :class:`FactoredSolver`'s: the step ``argmin ||J s - r||^2 + damping ||D_c s||^2``
    (D_c: the column norms), here by LSMR on the column-scaled operator with ``damp = sqrt(damping)``."""

    def __init__(self, model: MultiHeadAttention, blocks, weights: np.ndarray, bias: bool):
        model = model.to_float64()
        self.heads, self.d, self.bias = model.heads, model.d, bias
        self.shape = (sum(len(tokens) for _, (tokens, _) in blocks), parameter_count(model.heads, model.d, bias))
        cache = 2 * self.shape[0] * model.heads * model.d * 8 <= CACHE_BYTES
        self.parts = []
        squares = np.zeros(self.shape[1])
        for rows, (tokens, mask) in blocks:
            a, values, heads = _attention(model.W, model.v, model.u, tokens, mask)
            b, w = a * (values - heads), weights[rows]
            g, s, final = np.matmul(b, tokens), np.matmul(a, tokens), np.ascontiguousarray(tokens[:, -1, :])
            self.parts.append((rows, final, w, (g, s) if cache else (tokens, a, b)))
            # Column norms: the squared entries of D J summed over the block (the same products, squared).
            w2 = (w**2)[:, None, None]
            squares += self._adjoint(g**2 * w2, s**2 * w2, final**2, float(w2.sum()))
        self.finite = bool(np.all(np.isfinite(squares)))
        norms = np.sqrt(squares)
        norms[norms == 0] = 1.0
        self.norms = norms
        self.iterations = 0  # LSMR iterations, all solves
        self.converged = True  # every solve stopped on its tolerance (not the cap or the condition limit)

    @staticmethod
    def _gs(kept):
        """g and s (B, H, d) of a block: kept, or rebuilt from the padded tokens and a, b."""
        if len(kept) == 2:
            return kept
        tokens, a, b = kept
        return np.matmul(b, tokens), np.matmul(a, tokens)

    def _adjoint(self, g, s, final, c) -> np.ndarray:
        """theta-shaped ``sum_q (g_qh x_qN^T, s_qh[, g_qh, c])`` for per-query g, s (B, H, d) already
        multiplied by the residual weights (the c entry given)."""
        count, H, d = g.shape
        parts = [(g.reshape(count, H * d).T @ final).ravel(), s.sum(axis=0).ravel()]
        if self.bias:
            parts += [g.sum(axis=0).ravel(), [c]]
        return np.concatenate(parts)

    def _split(self, p):
        H, d = self.heads, self.d
        nW, nv = H * d * d, H * d
        W, v = p[:nW].reshape(H * d, d), p[nW:nW + nv].reshape(H, d)
        if not self.bias:
            return W, v, None, 0.0
        return W, v, p[nW + nv:nW + 2 * nv].reshape(H, d), float(p[-1])

    def matvec(self, p: np.ndarray) -> np.ndarray:
        """``D J p``: per query ``w (sum_h g_h^T (W_h x_N + u_h) + s_h^T v_h + c)``."""
        W, v, u, c = self._split(np.asarray(p, dtype=np.float64).ravel())
        H, d = self.heads, self.d
        out = np.empty(self.shape[0])
        for rows, final, w, kept in self.parts:
            g, s = self._gs(kept)
            z = (final @ W.T).reshape(len(final), H, d)  # W_h x_N
            if u is not None:
                z += u[None]
            out[rows] = w * (np.einsum("qha,qha->q", g, z) + np.einsum("qha,ha->q", s, v) + c)
        return out

    def rmatvec(self, r: np.ndarray) -> np.ndarray:
        """``J^T D r``: ``sum_q w_q r_q (g_qh x_qN^T, s_qh[, g_qh, 1])``."""
        r = np.asarray(r, dtype=np.float64).ravel()
        out = np.zeros(self.shape[1])
        for rows, final, w, kept in self.parts:
            g, s = self._gs(kept)
            rw = (w * r[rows])[:, None, None]
            out += self._adjoint(g * rw, s * rw, final, float(rw.sum()))
        return out

    def _scaled(self) -> LinearOperator:
        norms = self.norms
        return LinearOperator(self.shape, matvec=lambda y: self.matvec(np.ravel(y) / norms),
                              rmatvec=lambda r: self.rmatvec(r) / norms, dtype=np.float64)

    def __call__(self, r: np.ndarray, damping: float, tolerance: float = LSMR_TOLERANCE) -> np.ndarray:
        x, istop, itn = lsmr(self._scaled(), r, damp=np.sqrt(damping), atol=tolerance, btol=tolerance,
                             conlim=LSMR_CONDITION_LIMIT, maxiter=LSMR_MAX_ITERATIONS)[:3]
        self.iterations += int(itn)
        self.converged = self.converged and istop in (1, 2)
        return x / self.norms

    def row_l1_bounds(self, weights: np.ndarray, probes: int = ESTIMATE_PROBES, seed: int = 0) -> np.ndarray:
        """Estimated upper bounds on the row l1 norms ``||G_p||_1`` of ``G = (D J)^+ D``, inf where
        a solve did not converge (docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian'):
        ``ESTIMATE_SAFETY sqrt(Q)`` times the root mean square of ``(G e)_p`` over ``probes`` Gaussian e (unit variance:
        each sample of ``(G e)_p`` is N(0, ||G_p||_2^2)), and ``||G_p||_1 <= sqrt(Q) ||G_p||_2``."""
        rng = np.random.default_rng(seed)
        self.converged = True
        squares = np.zeros(self.shape[1])
        for _ in range(probes):
            squares += self(weights * rng.standard_normal(self.shape[0]), 0.0, ESTIMATE_TOLERANCE) ** 2
        if not self.converged:
            return np.full(self.shape[1], np.inf)
        return ESTIMATE_SAFETY * np.sqrt(self.shape[0] * squares / probes)


def jacobian_solver(model: MultiHeadAttention, sequences, weights: np.ndarray, bias: bool = False,
                    matrix_free: bool | None = None):
    """The solver of ``D J`` at ``model``: :class:`FactoredSolver` (the SVD of the formed Jacobian) where it
    fits ``MAX_JACOBIAN_ENTRIES`` (or ``matrix_free=False``), else :class:`MatrixFreeSolver`."""
    sequences = as_batch(sequences, model.d)
    if matrix_free is None:
        matrix_free = not affordable(len(sequences), model.heads, model.d, bias)
    if matrix_free:
        return MatrixFreeSolver(model, list(_blocks(sequences)), weights, bias)
    return FactoredSolver(weights[:, None] * output_jacobian(model, sequences, bias))


def refine_least_squares(model: MultiHeadAttention, sequences, answers: np.ndarray,
                         max_evaluations: int = 30, added: int = 0, bias: bool = False,
                         weights: np.ndarray | None = None,
                         matrix_free: bool | None = None) -> tuple[MultiHeadAttention, Refinement]:
    """Polish ``model`` against ``answers`` to ``sequences`` (float64); returns the better of the
    two models (smaller weighted misfit) and a :class:`Refinement` record saying which and why
    (``added``: how many of the sequences were asked for the refinement, recorded; ``bias``: refine
    ``u`` and ``c`` too; ``weights``: per-answer weights, default one; ``matrix_free``: None chooses
    the matrix-free steps of docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian' exactly where the
    dense Jacobian exceeds ``MAX_JACOBIAN_ENTRIES``)."""
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
    before = root_mean_square(current)
    if heads == 0:
        return model, Refinement("algebraic", before, before, 0, 0, "no heads to refine", added)
    if len(sequences) < len(start):
        return model, Refinement("algebraic", before, before, 0, -1,
                                 f"not refined: {len(sequences)} answers for {len(start)} parameters", added)
    if matrix_free is None:
        matrix_free = not affordable(len(sequences), heads, d, bias)
    path = "matrix-free" if matrix_free else "dense"
    blocks = list(_blocks(sequences)) if matrix_free else None  # padded once for every product
    # The misfit as a root mean square (scaled: a wrong start's ~1e200 residuals would overflow
    # sum r^2); a relative gain is 1 - (after / before)^2 of the sum of squares.
    theta, misfit = start, before
    solve = None
    evaluations, status, message, inner = 0, 0, "the evaluation limit was reached", 0
    while evaluations < max_evaluations:
        if matrix_free:
            solve = None  # the previous operator's g and s are freed before the next one's are built
            operator = MatrixFreeSolver(unpack(theta, heads, d, bias), blocks, weights, bias)
            finite = operator.finite
        else:
            J = weights[:, None] * output_jacobian(unpack(theta, heads, d, bias), sequences, bias)
            finite = bool(np.all(np.isfinite(J)))
        evaluations += 1
        if not finite:
            status, message = -2, "the Jacobian is not finite"
            break
        solve = operator if matrix_free else FactoredSolver(J)
        improved, gain = False, 0.0
        for damping in DAMPINGS:  # plain Gauss-Newton first; damped only where it fails
            step = solve(current, damping)
            trial = theta + step
            trial_residual = weighted_residual(trial)
            trial_misfit = root_mean_square(trial_residual)
            if trial_misfit < misfit:
                gain = 1.0 - (trial_misfit / misfit) ** 2
                theta, current, misfit, improved = trial, trial_residual, trial_misfit, True
                break
            if matrix_free and damping == 0.0 and (misfit == 0.0 or
                    1.0 - (root_mean_square(current - solve.matvec(step)) / misfit) ** 2 < CONVERGED_GAIN):
                # At the noise floor: the Gauss-Newton step predicts under 1% and damped steps predict
                # less still, so none would count as progress; each would be one more LSMR solve.
                break
        if matrix_free:
            inner += solve.iterations
        if not improved:
            status, message = 2, "converged: no step lowers the misfit further"
            break
        if gain < CONVERGED_GAIN:
            status, message = 1, f"converged: the last step lowered the misfit by {gain:.2g} (relative)"
            break
    after = misfit
    if np.isfinite(after) and after <= before:
        return unpack(theta, heads, d, bias), Refinement("refined", before, after, evaluations, status, message, added,
                                                         solve, path, inner)
    return model, Refinement("algebraic", before, after, evaluations, status, message, added, path=path,
                             inner_iterations=inner)
