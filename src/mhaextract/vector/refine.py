"""Gauss-Newton on every unsaturated whole answer, each step solved by LSQR without forming the
Jacobian (docs/algorithm.md, 'Whole answers near the vector bound'): :func:`refine` fits every
parameter to the whole answers; :func:`refine_scores`, for layers where that costs too much, only
the scores' parameters, each head against its own coordinates of the answers.

The start from the split (:mod:`.split`, :mod:`.scores`) carries the conditioning of each step; the
refinement fits all parameters of the factored layer (:mod:`.factored`) to all answers at once, so
its error is that of one least-squares problem on ``n d_out`` numbers. Each block is whitened by
the two factors of its Gauss-Newton matrix (:class:`_Whitening`), then scaled by its Jacobian
columns' root mean square (a few random probes of ``J^T``), which makes LSQR's iterations
independent of the parameters' units and of the heads' spectra.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular
from scipy.sparse.linalg import LinearOperator, lsqr

from .factored import BLOCKS, FactoredLayer, forward, grouped, jvp, score_jvp, score_vjp, vjp

#: Queries per chunk of the Jacobian products (memory: a chunk's weights and means, B H (N + d)).
CHUNK = 512
#: LSQR iterations per Gauss-Newton step, and Gauss-Newton steps at most: on trained layers the
#: whitened problem still has a condition number in the thousands, so each step needs many
#: iterations before the steps reach the answers' rounding (docs/algorithm.md, 'Whole answers near
#: the vector bound', 'Whitening the blocks').
LSQR_ITERATIONS = 1000
STEPS = 12
#: A step that lowers the misfit by less than this fraction ends the refinement.
STALL = 0.05
#: Fractions of a Gauss-Newton step tried in turn until one lowers the misfit.
BACKTRACK = (1.0, 0.5, 0.25)
#: :func:`refine_scores`: LSQR iterations per step and steps at most.
SCORE_ITERATIONS, SCORE_STEPS = 30, 8


@dataclass
class Refinement:
    layer: FactoredLayer
    misfit_before: float   # RMS misfit relative to the answers' RMS
    misfit_after: float
    steps: int


class _Data:
    """Queries grouped by length and chunked, with their answers."""

    def __init__(self, sequences, answers: np.ndarray):
        self.chunks = []
        for index, X in grouped(sequences):
            for start in range(0, len(index), CHUNK):
                part = index[start:start + CHUNK]
                self.chunks.append((part, X[start:start + CHUNK].astype(np.float64)))  # float32 score tokens
        self.answers = answers
        self.scale = float(np.sqrt(np.mean(answers ** 2))) or 1.0

    def residual(self, layer: FactoredLayer):
        forwards, residual = [], np.empty_like(self.answers)
        for part, X in self.chunks:
            fw = forward(layer, X)
            forwards.append(fw)
            residual[part] = self.answers[part] - fw.f
        return forwards, residual


#: Eigenvalues of a whitening's moment matrix below this fraction of its largest are raised to it
#: (directions a head's values barely show, zero padding).
WHITENING_FLOOR = 1e-6


def _inverse_root(moments: np.ndarray, floor: float = WHITENING_FLOOR) -> np.ndarray:
    """``U L^(-1/2)`` for ``M = U L U^T`` symmetric positive semi-definite (``A^T M A = I``), its
    eigenvalues floored at ``floor`` times the largest; exactly zero rows and columns (padding) map to
    zero. Each column is one eigendirection, so a column scale on top still acts direction by direction."""
    alive = np.abs(moments).sum(axis=0) > 0
    out = np.zeros_like(moments)
    if alive.any():
        values, vectors = np.linalg.eigh(moments[np.ix_(alive, alive)])
        values = np.maximum(values, floor * max(values.max(), 1e-300))
        out[np.ix_(alive, alive)] = vectors / np.sqrt(values)
    return out


class _Whitening:
    """A Kronecker-factored change of each block's coordinates, ``dB = A_B Y C_B`` with
    ``A_B``, ``C_B`` the inverse roots of the two factors of the block's Gauss-Newton matrix
    (docs/algorithm.md, 'Whole answers near the vector bound'): a score change ``dq_h`` shows in the
    outputs as ``V_h Cov_a(X) dq_h``, so ``K_h`` is whitened by ``V_h^T V_h`` and the moments of
    ``g_h``, ``[G_h | beta_h]`` by ``K_h^T V_h^T V_h K_h`` and the moments of ``(x_N, 1)``; ``O`` by
    the moments of the stacked ``p``; the stacked ``P`` by ``O^T O`` and the moments of the heads'
    mean ``m``. Trained heads' value maps fall 40..800-fold and their score maps 100..800-fold: a
    column scale alone leaves LSQR a Jacobian of condition number 1e4."""

    def __init__(self, layer: FactoredLayer, forwards):
        H, d, k = layer.K.shape
        d_out, r = layer.O.shape[1:]
        n = sum(len(fw.X) for fw in forwards)
        V = np.einsum("hor,hrd->hod", layer.O, layer.P)
        values = np.einsum("hod,hoe->hde", V, V)
        self.K_left = np.stack([_inverse_root(M) for M in values])
        self.K_right = np.stack([_inverse_root(M) for M in sum(np.einsum("bhk,bhl->hkl", fw.g, fw.g)
                                                               for fw in forwards) / n])
        self.G_left = np.stack([_inverse_root(K.T @ M @ K) for K, M in zip(layer.K, values)])
        finals = [np.concatenate([fw.X[:, -1], np.ones((len(fw.X), 1))], axis=1) for fw in forwards]
        self.G_right = _inverse_root(sum(t.T @ t for t in finals) / n)
        p = [fw.p.reshape(len(fw.X), H * r) for fw in forwards]
        self.O_right = _inverse_root(sum(x.T @ x for x in p) / n)
        stacked = layer.O.transpose(1, 0, 2).reshape(d_out, H * r)
        self.P_left = _inverse_root(stacked.T @ stacked)
        means = [fw.m.mean(axis=1) for fw in forwards]
        self.P_right = _inverse_root(sum(x.T @ x for x in means) / n)
        self.shapes = (H, d, k, d_out, r)

    def forward(self, step: FactoredLayer, transpose: bool = False) -> FactoredLayer:
        """``dB = A Y C^T`` for every block; ``transpose``: ``A^T E C``, its adjoint."""
        H, d, k, d_out, r = self.shapes
        t = (lambda M: np.swapaxes(M, -1, -2))  # noqa: E731
        left = (lambda A: t(A)) if transpose else (lambda A: A)  # noqa: E731
        right = (lambda C: C) if transpose else (lambda C: t(C))  # noqa: E731
        K = np.matmul(np.matmul(left(self.K_left), step.K), right(self.K_right))
        Gt = np.matmul(np.matmul(left(self.G_left), np.concatenate([step.G, step.beta[:, :, None]], axis=2)),
                       right(self.G_right))
        O = (step.O.transpose(1, 0, 2).reshape(d_out, H * r) @ right(self.O_right)).reshape(d_out, H, r).transpose(1, 0, 2)
        P = (left(self.P_left) @ step.P.reshape(H * r, d) @ right(self.P_right)).reshape(H, r, d)
        return FactoredLayer(K, Gt[:, :, :d].copy(), Gt[:, :, d].copy(), O, P, step.c)


def _operator(layer: FactoredLayer, data: _Data, forwards, scale: np.ndarray,
              whitening: "_Whitening | None" = None) -> LinearOperator:
    """``J T D``: ``T`` the blocks' whitening (:class:`_Whitening`), ``D`` the column scale."""
    rows, d_out = data.answers.shape
    size = scale.size
    whitening = _Whitening(layer, forwards) if whitening is None else whitening

    def matvec(vector):
        step = whitening.forward(layer.shaped(vector * scale))
        out = np.empty((rows, d_out))
        for (part, _), fw in zip(data.chunks, forwards):
            out[part] = jvp(layer, fw, step)
        return out.ravel()

    def rmatvec(vector):
        e = vector.reshape(rows, d_out)
        total = np.zeros(size)
        for (part, _), fw in zip(data.chunks, forwards):
            total += whitening.forward(vjp(layer, fw, e[part]), transpose=True).flat()
        return total * scale

    return LinearOperator((rows * d_out, size), matvec=matvec, rmatvec=rmatvec, dtype=np.float64)


def _column_scale(layer: FactoredLayer, data: _Data, forwards, rng: np.random.Generator,
                  whitening: "_Whitening | None" = None) -> np.ndarray:
    """Per block, the inverse RMS of its non-zero Jacobian columns (Hutchinson: E (J^T z)^2 = diag J^T J)."""
    unit = _operator(layer, data, forwards, np.ones(layer.flat().size), whitening)
    rows = unit.shape[0]
    squares = sum(unit.rmatvec(rng.choice([-1.0, 1.0], size=rows)) ** 2 for _ in range(8)) / 8
    scale = np.ones_like(squares)
    for name, part in layer.block_slices().items():
        block = squares[part]
        alive = block > 1e-30 * block.max(initial=0.0)
        if alive.any():
            scale[part] = np.where(alive, 1.0 / np.sqrt(np.where(alive, block, 1.0)), 0.0)
    return scale


def _descend(layer: FactoredLayer, data: _Data, step, steps: int, on_step) -> Refinement:
    """Gauss-Newton steps ``step(layer, forwards, residual)`` while each lowers the misfit, until one
    gains less than ``STALL`` or after ``steps``."""
    forwards, residual = data.residual(layer)
    misfit = float(np.sqrt(np.mean(residual ** 2))) / data.scale
    before, done = misfit, 0
    for done in range(1, steps + 1):
        full_step = step(layer, forwards, residual).flat() - layer.flat()
        for fraction in BACKTRACK:  # far from the answers (a float32 start) a full step can overshoot
            trial = layer.shaped(layer.flat() + fraction * full_step)
            trial_forwards, trial_residual = data.residual(trial)
            trial_misfit = float(np.sqrt(np.mean(trial_residual ** 2))) / data.scale
            if trial_misfit < misfit:
                break
        if on_step is not None:
            on_step(done, trial_misfit)
        if not trial_misfit < misfit:
            break
        gained = trial_misfit < (1 - STALL) * misfit
        layer, forwards, residual, misfit = trial, trial_forwards, trial_residual, trial_misfit
        if not gained:
            break
    return Refinement(layer, before, misfit, done)


def refine(layer: FactoredLayer, sequences, answers: np.ndarray, rng: np.random.Generator,
           steps: int = STEPS, on_step=None) -> Refinement:
    """Gauss-Newton from ``layer`` on ``answers`` (n, d_out) to ``sequences``."""
    data = _Data(sequences, np.asarray(answers, dtype=np.float64))

    def step(layer, forwards, residual):
        whitening = _Whitening(layer, forwards)
        scale = _column_scale(layer, data, forwards, rng, whitening)
        operator = _operator(layer, data, forwards, scale, whitening)
        solution = lsqr(operator, residual.ravel(), atol=1e-16, btol=1e-16, iter_lim=LSQR_ITERATIONS)[0]
        return layer.shaped(layer.flat() + whitening.forward(layer.shaped(solution * scale)).flat())

    return _descend(layer, data, step, steps, on_step)


def _widths(blocks: np.ndarray) -> list[int]:
    """Per head, the number of non-zero columns of a padded block (H, rows, width)."""
    return [int(np.count_nonzero(np.abs(block).sum(axis=0))) for block in blocks]


def _whitener(moments: np.ndarray) -> np.ndarray:
    """The lower Cholesky factor of a second-moment matrix, its null directions (padding) given unit weight."""
    alive = np.abs(moments).sum(axis=0) > 0
    return np.linalg.cholesky(np.where(np.outer(alive, alive), moments, 0.0) + np.diag(~alive * 1.0)
                              + 1e-14 * np.trace(moments) * np.eye(len(moments)))


def _score_step(layer: FactoredLayer, data: _Data, forwards, residual: np.ndarray, rng: np.random.Generator,
                iterations: int) -> FactoredLayer:
    """One Gauss-Newton step on the scores' parameters of every head, each against its coordinates
    ``z_h = [O^+]_h e`` of the residual, by LSQR on the whitened parameters: ``dK_h = Y_h L_h^-T``
    with ``L_h L_h^T = E[g_h g_h^T]`` and ``[dG_h | dbeta_h] = Z_h L^-T`` with ``L L^T = E[t~ t~^T]``,
    ``t~ = (x_N, 1)`` (the two blocks' columns are then about equally informative)."""
    H, d, k = layer.K.shape
    r, ranks = layer.O.shape[2], _widths(layer.O)
    n = data.answers.shape[0]
    stacked = np.linalg.pinv(np.concatenate([layer.O[h][:, :rank] for h, rank in enumerate(ranks)], axis=1))
    target, start = np.zeros((n, H, r)), 0
    for h, rank in enumerate(ranks):
        target[:, h, :rank] = residual @ stacked[start:start + rank].T
        start += rank
    moments = sum(np.matmul(fw.g.transpose(1, 2, 0), fw.g.transpose(1, 0, 2)) for fw in forwards) / n
    finals = [np.concatenate([fw.X[:, -1], np.ones((len(fw.X), 1))], axis=1) for fw in forwards]
    Lg = np.stack([_whitener(moment) for moment in moments])
    Lt = _whitener(sum(final.T @ final for final in finals) / n)
    sizes = (H * d * k, H * k * (d + 1))

    def unwhiten(vector):
        Y, Z = vector[:sizes[0]].reshape(H, d, k), vector[sizes[0]:].reshape(H * k, d + 1)
        dK = np.stack([solve_triangular(Lg[h], Y[h].T, lower=True, trans="T").T for h in range(H)])
        dGt = solve_triangular(Lt, Z.T, lower=True, trans="T").T.reshape(H, k, d + 1)
        return dK, dGt[:, :, :d], dGt[:, :, d]

    def whiten_transpose(dK, dG, dbeta):
        Y = np.stack([solve_triangular(Lg[h], dK[h].T, lower=True).T for h in range(H)])
        Z = solve_triangular(Lt, np.concatenate([dG, dbeta[:, :, None]], axis=2).reshape(H * k, d + 1).T, lower=True).T
        return np.concatenate([Y.ravel(), Z.ravel()])

    scale = np.ones(sum(sizes))

    def matvec(vector):
        step, out = unwhiten(vector * scale), np.empty((n, H, r))
        for (part, _), fw in zip(data.chunks, forwards):
            out[part] = score_jvp(layer, fw, *step)
        return out.ravel()

    def rmatvec(vector):
        e, total = vector.reshape(n, H, r), 0.0
        for (part, _), fw in zip(data.chunks, forwards):
            total = total + whiten_transpose(*score_vjp(layer, fw, e[part]))
        return total * scale

    squares = sum(rmatvec(rng.choice([-1.0, 1.0], size=n * H * r)) ** 2 for _ in range(4)) / 4
    for part in (slice(0, sizes[0]), slice(sizes[0], None)):  # block RMS, as in _column_scale
        block = squares[part]
        alive = block > 1e-30 * block.max(initial=0.0)
        scale[part] = np.where(alive, 1.0 / np.sqrt(np.where(alive, block, 1.0)), 0.0)
    operator = LinearOperator((n * H * r, sum(sizes)), matvec=matvec, rmatvec=rmatvec, dtype=np.float64)
    dK, dG, dbeta = unwhiten(lsqr(operator, target.ravel(), atol=1e-16, btol=1e-16, iter_lim=iterations)[0] * scale)
    K, G, beta = layer.K + dK, layer.G + dG, layer.beta + dbeta
    for h, width in enumerate(_widths(layer.K)):  # K_h orthonormal again: K_h = Q R, (G_h, beta_h) <- R (G_h, beta_h)
        Q, R = np.linalg.qr(K[h][:, :width])
        K[h][:, :width], G[h][:width], beta[h][:width] = Q, R @ G[h][:width], R @ beta[h][:width]
    return FactoredLayer(K, G, beta, layer.O, layer.P, layer.c)


def refine_scores(layer: FactoredLayer, sequences, answers: np.ndarray, rng: np.random.Generator,
                  steps: int = SCORE_STEPS, on_step=None) -> Refinement:
    """Gauss-Newton on the scores' parameters only, the split's values kept (:func:`_score_step`)."""
    data = _Data(sequences, np.asarray(answers, dtype=np.float64))
    return _descend(layer, data, lambda layer, forwards, residual: _score_step(
        layer, data, forwards, residual, rng, SCORE_ITERATIONS), steps, on_step)


__all__ = ["Refinement", "refine", "refine_scores", "BLOCKS"]
