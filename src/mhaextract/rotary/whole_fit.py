"""The rotary split's fit of every parameter to the whole answers (docs/algorithm.md, 'Rotary layers from
whole answers', 'Refinement'): Gauss-Newton on ``f = c + sum_h O_h P_h X^T a_h``, its Jacobian in closed
form: :class:`WholeAnswers` gives its products ``J v`` and ``J^T w`` without forming it, and
:func:`refine_whole` solves each step by LSQR on them, columns scaled to unit norm.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse.linalg import LinearOperator, lsqr

from ..models.rotary import rotation_blocks
from ..oracle.progress import note_progress

#: The parameters of the whole-answer fit, in the order of its vector: ``t`` the angles (per group),
#: ``O, P`` the values' factors ``V_h = O_h P_h``.
NAMES = ("Q", "b", "K", "k", "t", "O", "P", "c")
#: Gauss-Newton steps at most (each kept only where it lowers the misfit; the fit stops once a step
#: gains less than 5%).
WHOLE_STEPS = 4
#: LSQR iterations at most for one step, and its stopping tolerances (atol, btol): the step's least
#: squares to well below the answers' rounding.
LSQR_ITERATIONS, LSQR_TOLERANCE = 100, 1e-10
#: Random sign vectors whose products ``J^T w`` estimate the Jacobian's column norms (the scaling).
COLUMN_PROBES = 8


def rotations(angles: np.ndarray, r: int, derivative: bool = False) -> np.ndarray:
    """``R(phi)`` (or ``dR/dphi`` block by block: ``rot(phi + pi / 2)``) for angles (..., r/2): (..., r, r),
    the model's blocks (:func:`~mhaextract.models.rotary.rotation_blocks`) on the diagonal."""
    blocks = rotation_blocks(angles + np.pi / 2 if derivative else angles)
    out = np.zeros(angles.shape[:-1] + (r, r))
    for j in range(r // 2):
        out[..., 2 * j:2 * j + 2, 2 * j:2 * j + 2] = blocks[..., j, :, :]
    return out


def parameter_count(d: int, d_out: int, heads: int, groups: int, r: int) -> int:
    """The whole-answer fit's parameters: ``H (r d + r + d_out r + r d) + G (r d + r + r / 2) + d_out``."""
    return heads * (r * d + r + d_out * r + r * d) + groups * (r * d + r + r // 2) + d_out


def rotated(R: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``R_n q_b`` for every position n and query b: (B, N, r) from R (N, r, r) and q (B, r), one product."""
    N, r, _ = R.shape
    return (q @ R.reshape(N * r, r).T).reshape(len(q), N, r)


def kept_bytes(tokens: int, heads: int, groups: int, r: int) -> int:
    """What :class:`WholeAnswers` keeps between its products for sequences of ``tokens`` tokens in all
    (padding aside): per token each group's keys (r numbers) and each head's rotated query (r), angle
    derivatives (r / 2) and weight, in float64."""
    return 8 * tokens * (groups * r + heads * (3 * r // 2 + 1))


#: Sequences longer than this are left-padded (with tokens of no weight) to a multiple of it, so that
#: the products run over a few lengths, not every length asked.
PAD_TO = 16


def padded_length(length: int) -> int:
    """The length a sequence is computed at: itself up to ``PAD_TO``, else the next multiple of it."""
    return length if length <= PAD_TO else -(-length // PAD_TO) * PAD_TO


class WholeAnswers:
    """The whole answers of fixed sequences as a function of the parameters: :meth:`residuals` at a point
    (``f - answers``; with ``keep``, what the products need, kept bucket by bucket of padded length), then
    :meth:`jvp` (``J v``) and :meth:`vjp` (``J^T w``) there, each the cost of about two forward passes;
    vectors flat in ``NAMES`` order (parameters) and in :attr:`order` (answers). The derivatives, with
    ``u_j = a_j (x_j - m_h)`` (``m_h`` the head's mean token) and ``df/ds_{h,j} = O_h P_h u_j``:
    ``ds_j/dQ_h = (R_j^T k_j) t^T``, ``ds_j/dK_g = (R_j q) x_j^T``, ``ds_j/dtheta_b = delta_j k_{j,b}^T
    rot'(delta_j theta_b) q_b``; ``df/dO_h = I (x) (P_h m_h)^T``, ``df/dP_h = O_h (x) m_h^T``, ``df/dc = I``
    (docs/algorithm.md, 'Rotary layers from whole answers', 'Refinement')."""

    def __init__(self, sequences, answers, labels, shapes: dict):
        by_length = {}
        for index, X in enumerate(sequences):
            by_length.setdefault(padded_length(len(X)), []).append(index)
        answers = np.asarray(answers, dtype=np.float64)
        self.buckets, self.masks, self.order = [], [], []  # order: the sequences' indices, bucket by bucket
        for length, rows in by_length.items():
            self.order += rows
            d = sequences[rows[0]].shape[1]
            X, mask = np.zeros((len(rows), length, d)), np.zeros((len(rows), length), dtype=bool)
            for row, index in enumerate(rows):  # left-padded: every real token keeps its offset
                X[row, length - len(sequences[index]):] = sequences[index]
                mask[row, length - len(sequences[index]):] = True
            self.buckets.append((X, answers[rows]))
            self.masks.append(None if mask.all() else mask)
        self.labels, self.shapes = list(labels), {name: tuple(shapes[name]) for name in NAMES}
        self.sizes = [int(np.prod(self.shapes[name])) for name in NAMES]
        self.count = sum(len(A) for _, A in self.buckets) * self.shapes["c"][0]
        self.cache = None

    def unflat(self, x: np.ndarray) -> dict:
        out, start = {}, 0
        for name, size in zip(NAMES, self.sizes):
            out[name], start = x[start:start + size].reshape(self.shapes[name]), start + size
        return out

    def flat(self, p: dict) -> np.ndarray:
        return np.concatenate([np.asarray(p[name], dtype=np.float64).ravel() for name in NAMES])

    def residuals(self, x: np.ndarray, keep: bool = False) -> np.ndarray:
        """``f(x) - answers``, flat; with ``keep`` the point becomes the one :meth:`jvp` and :meth:`vjp` use."""
        p = self.unflat(x)
        Q, b, K, k, t, O, P, c = (p[name] for name in NAMES)
        heads, r, _ = Q.shape
        parts, cache = [], []
        for (X, A), mask in zip(self.buckets, self.masks):
            B, N, _ = X.shape
            offsets = np.arange(N - 1, -1, -1, dtype=np.float64)
            f = np.tile(c, (B, 1))
            groups = {}
            for g in sorted(set(self.labels)):
                R = rotations(offsets[:, None] * t[g], r)
                D = rotations(offsets[:, None] * t[g], r, derivative=True) * offsets[:, None, None]
                groups[g] = (R, D, X @ K[g].T + k[g])
            heads_cache = []
            for h in range(heads):
                R, D, key = groups[self.labels[h]]
                q = X[:, -1] @ Q[h].T + b[h]
                Rq = rotated(R, q)
                s = np.einsum("Bnr,Bnr->Bn", key, Rq)
                if mask is not None:  # padding: no weight, so no part in any product below
                    s = np.where(mask, s, -np.inf)
                a = np.exp(s - s.max(axis=1, keepdims=True))
                a /= a.sum(axis=1, keepdims=True)
                mean = np.matmul(a[:, None, :], X)[:, 0]
                coordinates = mean @ P[h].T
                f += coordinates @ O[h].T
                if keep:
                    dRq = rotated(D, q)
                    turn = (key * dRq).reshape(B, N, r // 2, 2).sum(-1)  # ds / dtheta_b, per block
                    heads_cache.append((Rq, turn, a, mean, coordinates))
            parts.append((f - A).ravel())
            cache.append((groups, heads_cache))
        if keep:
            self.cache, self.point = cache, p
        return np.concatenate(parts)

    def jvp(self, v: np.ndarray) -> np.ndarray:
        """``J v`` at the kept point."""
        dp, p = self.unflat(v), self.point
        parts = []
        for (X, _), (groups, heads_cache) in zip(self.buckets, self.cache):
            df = np.tile(dp["c"], (len(X), 1))
            dkeys = {g: X @ dp["K"][g].T + dp["k"][g] for g in groups}
            for h, (Rq, turn, a, mean, coordinates) in enumerate(heads_cache):
                g = self.labels[h]
                R, _, key = groups[g]
                dq = X[:, -1] @ dp["Q"][h].T + dp["b"][h]
                ds = (np.einsum("Bnr,Bnr->Bn", dkeys[g], Rq) + np.einsum("Bnr,Bnr->Bn", key, rotated(R, dq))
                      + turn @ dp["t"][g])
                da = a * (ds - (a * ds).sum(axis=1, keepdims=True))
                dmean = np.matmul(da[:, None, :], X)[:, 0]
                df += (dmean @ p["P"][h].T + mean @ dp["P"][h].T) @ p["O"][h].T + coordinates @ dp["O"][h].T
            parts.append(df.ravel())
        return np.concatenate(parts)

    def vjp(self, w: np.ndarray) -> np.ndarray:
        """``J^T w`` at the kept point."""
        p = self.point
        grad = {name: np.zeros(self.shapes[name]) for name in NAMES}
        start = 0
        for (X, _), (groups, heads_cache) in zip(self.buckets, self.cache):
            B = len(X)
            W = w[start:start + B * self.shapes["c"][0]].reshape(B, -1)
            start += W.size
            grad["c"] += W.sum(axis=0)
            gkeys = {g: 0.0 for g in groups}
            for h, (Rq, turn, a, mean, coordinates) in enumerate(heads_cache):
                g = self.labels[h]
                R, _, key = groups[g]
                grad["O"][h] += W.T @ coordinates
                z = W @ p["O"][h]
                grad["P"][h] += z.T @ mean
                ga = np.matmul(X, (z @ p["P"][h])[:, :, None])[..., 0]
                gs = a * (ga - (a * ga).sum(axis=1, keepdims=True))
                gkeys[g] = gkeys[g] + gs[..., None] * Rq
                gq = (gs[..., None] * key).reshape(B, -1) @ R.reshape(-1, R.shape[-1])
                grad["Q"][h] += gq.T @ X[:, -1]
                grad["b"][h] += gq.sum(axis=0)
                grad["t"][g] += gs.reshape(-1) @ turn.reshape(-1, turn.shape[-1])
            for g, gkey in gkeys.items():
                grad["K"][g] += gkey.reshape(-1, gkey.shape[-1]).T @ X.reshape(-1, X.shape[-1])
                grad["k"][g] += gkey.sum(axis=(0, 1))
        return self.flat(grad)


def refine_whole(sequences, answers, parameters, labels, steps=WHOLE_STEPS, seed=0, progress=None):
    """Gauss-Newton on the whole answers, every parameter (the values as ``O_h P_h``, c): each step the
    least squares ``min |J S y + res|`` by LSQR on :class:`WholeAnswers`' products (``S`` the columns'
    inverse norms, estimated from ``COLUMN_PROBES`` random sign vectors; LSQR from zero gives the
    least-norm step, leaving the gauge, a scaled rotation per block and an r x r factor between
    ``O_h`` and ``P_h``, alone), halved up to twice where a full one does not lower the misfit. Returns
    the parameters and the relative RMS misfit before each step and after the last."""
    fit = WholeAnswers(sequences, answers, labels, {name: np.shape(parameters[name]) for name in NAMES})
    size = float(np.sqrt(np.mean(np.asarray(answers, dtype=np.float64) ** 2)))
    x = fit.flat(parameters)
    rng = np.random.default_rng(seed)

    def misfit(res):
        return float(np.sqrt(np.mean(res ** 2)) / size)

    res = fit.residuals(x, keep=True)
    history = [misfit(res)]
    for step in range(steps):
        note_progress(progress, f"rotary split: whole-answer fit, step {step + 1}, misfit {history[-1]:.3g}")
        probes = [fit.vjp(rng.choice([-1.0, 1.0], size=fit.count)) for _ in range(COLUMN_PROBES)]
        columns = np.sqrt(np.mean(np.square(probes), axis=0))
        scale = 1.0 / np.where(columns > 0, columns, 1.0)
        operator = LinearOperator((fit.count, len(x)), matvec=lambda y: fit.jvp(scale * np.ravel(y)),
                                  rmatvec=lambda w: scale * fit.vjp(np.ravel(w)), dtype=np.float64)
        full = scale * lsqr(operator, -res, atol=LSQR_TOLERANCE, btol=LSQR_TOLERANCE, iter_lim=LSQR_ITERATIONS)[0]
        trial = history[-1]
        for fraction in (1.0, 0.5, 0.25):
            trial_res = fit.residuals(x + fraction * full)
            trial = misfit(trial_res)
            if trial < history[-1]:
                x = x + fraction * full
                res = fit.residuals(x, keep=True)
                break
        history.append(min(trial, history[-1]))
        if history[-1] > 0.95 * history[-2]:
            break
    return fit.unflat(x), history
