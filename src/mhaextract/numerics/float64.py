"""float64 kernels, batched over instances (numpy).

Rational fit of ``F(k)`` sampled at ``k = 0..K-1`` (see :mod:`.rational` for the barycentric
form): Loewner null vector by SVD, poles from the barycentric denominator as an eigenvalue
problem, ``(c, rho)`` by least squares on the Cauchy matrix ``[1, 1/(k + tau_h)]``. No monomial
Vandermonde matrix appears anywhere.

Poles as eigenvalues. With support points ``s`` (r + 1 of them), weights ``w`` and ``e`` the
all-ones vector, ``D(k) = sum_a w_a / (k - s_a) = 0`` exactly when ``u = (k - S)^{-1} w`` has
``e^T u = 0``. With the oblique projector ``P = I - w e^T / (e^T w)`` this is ``P S u = k u``:
the poles are the eigenvalues of ``P S`` restricted to ``e^perp`` (the one left over is the
spurious 0 of ``e^T P = 0``). With ``Q`` an orthonormal basis of ``e^perp``, they are the r
eigenvalues of ``Q^T (S - w s^T / e^T w) Q``, the same spectrum as the arrowhead pencil of AAA,
computed as one batched standard eigenproblem.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import null_space

from .rational import (InstanceFits, instance_jacobian, rank_split, sensitivities, support_split,
                       triangular_inverse)

#: Relative singular value below which a Loewner direction counts as numerically zero.
RANK_TOLERANCE = 1e-11


def root_mean_square(values, count=None) -> float:
    """``sqrt(sum values^2 / count)`` (``count`` defaults to the number of values; 0 for none),
    scaled by ``max |values|`` first so that answers of a wrong model near the float64 limit
    (|r| ~ 1e200 at a token scale the target's W cannot take) give their true size, not an
    overflow; inf where any value is not finite."""
    values = np.asarray(values, dtype=np.float64).ravel()
    count = values.size if count is None else count
    if not values.size or not count:
        return 0.0
    largest = float(np.abs(values).max())
    if not np.isfinite(largest):
        return np.inf
    if largest == 0.0:
        return 0.0
    return largest * float(np.sqrt(np.sum((values / largest) ** 2) / count))


def loewner(samples: np.ndarray, ks: np.ndarray, support: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Loewner matrices (n, |test|, |support|): ``(F(t_b) - F(s_a)) / (t_b - s_a)``."""
    F_test = samples[:, test][:, :, None]
    F_support = samples[:, support][:, None, :]
    gaps = (ks[test][:, None] - ks[support][None, :]).astype(np.float64)
    return (F_test - F_support) / gaps


def loewner_rows(targets: np.ndarray, scales: np.ndarray, ks: np.ndarray, support: np.ndarray, test: np.ndarray,
                 known: bool) -> np.ndarray:
    """The Loewner rows (n, m (|test| + known), |support|) of m channels (n, K, m) of each instance
    that share its poles, each channel's rows divided by its ``scales`` (n, m) (its largest answer:
    samples of very different size weigh alike); ``known``: the targets are ``G = F - c``, and
    ``sum_a w_a G(s_a) = 0`` joins each channel's rows."""
    n, K, m = targets.shape
    flat = targets.transpose(0, 2, 1).reshape(n * m, K)
    rows = loewner(flat, ks, support, test)
    if known:  # G = F - c vanishes at infinity
        rows = np.concatenate([rows, flat[:, None, support]], axis=1)
    rows = rows / scales.reshape(n * m)[:, None, None]
    return rows.reshape(n, m * rows.shape[1], len(support))


def pole_start(poles: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """Positive real starting values tau (n, H) from fitted poles p (n, H) (complex): ``-Re p +
    Im p`` parts a conjugate pair into two distinct values around its real part (a merged start
    would stay merged: the polish's Jacobian cannot tell two equal poles apart); a pole that is
    not positive or not finite starts on a geometric spread over the counts."""
    tau = -poles.real + poles.imag
    spread = np.geomspace(1.0, float(ks[-1]) + 1.0, poles.shape[1])
    return np.where(np.isfinite(tau) & (tau > 0), tau, spread[None, :])


def projected_misfit(targets: np.ndarray, ks: np.ndarray, log_poles: np.ndarray,
                     free_constant: bool = False) -> np.ndarray:
    """``(I - C C^+) T`` (n, K, m): the misfit of the best residues of every channel at the poles
    ``exp(log_poles)`` (variable projection: the residues are linear once the poles are fixed);
    ``free_constant``: each channel's constant is fitted too (a column of ones in C)."""
    C = 1.0 / (ks[None, :, None] + np.exp(log_poles)[:, None, :])
    if free_constant:
        C = np.concatenate([np.ones(C.shape[:2] + (1,)), C], axis=2)
    Q = np.linalg.qr(C)[0]
    return targets - Q @ (Q.transpose(0, 2, 1) @ targets)


def common_pole_polish(targets: np.ndarray, ks: np.ndarray, log_poles: np.ndarray, free_constant: bool = False,
                       iterations: int = 40, step: float = 1e-7) -> np.ndarray:
    """Levenberg-Marquardt on the log-poles (n, H) shared by the channels ``targets`` (n, K, m)
    of each instance, the residues projected out (:func:`projected_misfit`); the Jacobian by
    forward differences of ``step`` in each log-pole. A step is kept only where it lowers the
    misfit, so the polish never makes a fit worse. The Loewner estimate it starts from is only
    consistent: with noisy answers (float32) and poles a few hundredths apart it leaves complex or
    negative poles on about half the instances of a d = 64, H = 4 layer, which the least-squares
    fit of all channels resolves."""
    ks = np.asarray(ks, dtype=np.float64)
    m = np.array(log_poles, dtype=np.float64)
    n, H = m.shape
    with np.errstate(all="ignore"):
        misfit = projected_misfit(targets, ks, m, free_constant)
        cost = np.nan_to_num((misfit**2).sum(axis=(1, 2)), nan=np.inf)
        damping = np.full(n, 1e-3)
        for _ in range(iterations):
            J = np.stack([((projected_misfit(targets, ks, m + step * np.eye(H)[h], free_constant) - misfit) / step)
                          .reshape(n, -1) for h in range(H)], axis=2)
            normal = np.matmul(J.transpose(0, 2, 1), J)
            gradient = np.matmul(J.transpose(0, 2, 1), misfit.reshape(n, -1, 1))[:, :, 0]
            scale = np.trace(normal, axis1=1, axis2=2) / H
            damped = normal + (damping * scale)[:, None, None] * np.eye(H)
            good = np.isfinite(damped).all(axis=(1, 2)) & np.isfinite(gradient).all(axis=1) & (scale > 0)
            delta = np.zeros_like(m)
            delta[good] = -np.clip(np.linalg.solve(damped[good], gradient[good][:, :, None])[:, :, 0], -1.0, 1.0)
            trial = projected_misfit(targets, ks, m + delta, free_constant)
            trial_cost = np.nan_to_num((trial**2).sum(axis=(1, 2)), nan=np.inf)
            better = good & (trial_cost < cost)
            m[better], misfit[better], cost[better] = m[better] + delta[better], trial[better], trial_cost[better]
            damping = np.where(better, damping / 3.0, damping * 4.0)
            if (damping > 1e8).all():
                break
    return m


def detect_ranks(samples: np.ndarray, ks: np.ndarray, max_poles: int, constant=None,
                 answer_error: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Pole count of each instance from the singular values of its even/odd Loewner matrix.

    ``constant`` (n,): the known c of each instance (lean schedule), or None.
    ``answer_error`` (a bound on each sample's absolute error) raises the threshold to what the
    noise can produce: a Loewner entry ``(F(t) - F(s)) / (t - s)`` moves by at most
    ``2 eps / |t - s|``, so the noise matrix has norm at most its Frobenius bound; singular
    values under 10 times that are not evidence of a pole.

    Returns (ranks (n,), singular values relative to the largest (n, H0)). An oversampled
    instance has H0 + 1 singular values; the rank counts all of them (more than H0 means the
    bound or the noise assumption is wrong).
    """
    n = samples.shape[0]
    if max_poles == 0:
        return np.zeros(n, dtype=int), np.zeros((n, 0))
    if constant is not None:
        samples = samples - np.asarray(constant, dtype=np.float64)[:, None]
    support, test = rank_split(samples.shape[1], max_poles, constant is not None)
    sv = np.linalg.svd(loewner(samples, ks, support, test), compute_uv=False)
    # Samples scale: a constant F (rank 0) has a zero Loewner matrix.
    scale = np.abs(samples).max(axis=1)
    reference = np.maximum(sv[:, :1], np.maximum(scale[:, None] * 1e-300, np.finfo(float).tiny))  # never 0 / 0
    relative = sv / reference
    gaps = (ks[test][:, None] - ks[support][None, :]).astype(np.float64)
    noise_norm = 2.0 * float(answer_error) * np.sqrt((1.0 / gaps**2).sum())
    tolerance = np.maximum(RANK_TOLERANCE, 10.0 * noise_norm / reference[:, 0])
    # A rank-0 instance: the whole Loewner matrix is at rounding level of the samples (or noise).
    flat = sv[:, 0] <= np.maximum(RANK_TOLERANCE * scale, 10.0 * noise_norm)
    relative[flat] = 0.0
    ranks = (relative > tolerance[:, None]).sum(axis=1)
    return ranks, relative[:, :max_poles]


def null_vectors(L: np.ndarray) -> np.ndarray:
    """A unit vector spanning the null space of each matrix of a batch (n, r, r + 1) of full row
    rank: the last column of Q in ``L^T = Q R`` (complete Householder QR; a QR per matrix costs a
    sixth of an SVD). A taller batch (an oversampled instance's Loewner rows) gets the least
    right singular vector, its least-squares null vector, by the SVD."""
    if L.shape[1] + 1 != L.shape[2]:
        return np.linalg.svd(L, full_matrices=False)[2][:, -1, :]
    return np.linalg.qr(L.transpose(0, 2, 1), mode="complete")[0][:, :, -1]


def least_squares_qr(C: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``argmin_x ||C x - t||`` for each (C, t) of a batch (n, K, p), (n, K) by ``C = Q R``:
    ``x = R^{-1} Q^T t`` (Householder QR is backward stable, as the SVD, at a quarter of its cost
    for these small matrices). Where that is not finite (C of rank below p: a zero on R's
    diagonal) the SVD's solution with singular values clamped at 1e-300, finite, which the fit's
    residual then judges."""
    Q, R = np.linalg.qr(C)
    with np.errstate(all="ignore"):
        x = np.matmul(triangular_inverse(R), np.matmul(targets[:, None, :], Q).transpose(0, 2, 1))[:, :, 0]
    singular = ~np.isfinite(x).all(axis=1)
    if singular.any():
        U, s, Vt = np.linalg.svd(C[singular], full_matrices=False)
        x[singular] = np.einsum("nji,nj,nj->ni", Vt, 1.0 / np.maximum(s, 1e-300),
                                np.einsum("nkj,nk->nj", U, targets[singular]))
    return x


def poles_from_weights(weights: np.ndarray, support_points: np.ndarray) -> np.ndarray:
    """Zeros of ``D(k) = sum_a w_a / (k - s_a)`` for each row of ``weights`` (n, r + 1) -> (n, r)."""
    n, size = weights.shape
    if size == 1:
        return np.zeros((n, 0), dtype=complex)
    Q = null_space(np.ones((1, size)))  # (r + 1, r), orthonormal basis of e-perp
    s = support_points.astype(np.float64)
    QSQ = Q.T @ (s[:, None] * Q)
    Qw = weights @ Q  # (n, r)
    sQ = s @ Q  # (r,)
    total = weights.sum(axis=1)
    # A row whose weights sum to zero has a pole at infinity (no finite zeros of D): NaN poles,
    # which the instance's checks reject, rather than a division by zero and eigvals of infinities.
    finite = np.isfinite(weights).all(axis=1) & (total != 0)
    poles = np.full((n, size - 1), np.nan, dtype=complex)
    if finite.any():
        A = QSQ[None] - Qw[finite, :, None] * sQ[None, None, :] / total[finite, None, None]
        poles[finite] = np.linalg.eigvals(A)
    return poles


def fit(samples: np.ndarray, ks: np.ndarray, poles: int, constant=None, channels=None,
        channel_constants=None) -> InstanceFits:
    """Fit ``F(k) = c + sum_h rho_h / (k + tau_h)`` with ``poles`` terms to every row of ``samples``.

    ``samples`` (n, K) holds F at ``ks`` (K,); ``constant`` (n,) the known c of each instance
    (both anchors known: then ``2 poles`` samples suffice), or None to fit c too.
    ``channels`` (n, K, m): other read-outs of the same answers (a layer's whole outputs), with
    the same poles and their own residues; their Loewner rows join the samples' in the null vector
    that starts the poles, and a least-squares polish of all of them (:func:`common_pole_polish`)
    places them (``channel_constants`` (n, m): their known c, with ``constant``). Where the heads'
    residue vectors differ, m channels separate poles that one read-out blurs; the residues and the
    residual are still the samples' own.
    Returns :class:`InstanceFits` with float64 arrays.
    """
    samples = np.asarray(samples, dtype=np.float64)
    n, K = samples.shape
    scale = np.maximum(np.abs(samples).max(axis=1), np.finfo(float).tiny)
    known = constant is not None
    if known:
        constant = np.asarray(constant, dtype=np.float64)
    if poles == 0:
        c = constant if known else samples.mean(axis=1)
        residual = np.abs(samples - c[:, None]).max(axis=1) / scale
        empty = np.zeros((n, 0))
        return InstanceFits(c, empty, empty, np.full(n, np.inf), np.zeros(n), np.zeros(n, bool), residual,
                            np.full(n, 1.0 / np.sqrt(K)), empty, empty, np.zeros(n, bool))
    # the samples, then any channels: one Loewner block each, one null vector for them all
    columns, offsets = samples[:, :, None], (constant[:, None] if known else None)
    if channels is not None:
        columns = np.concatenate([columns, np.asarray(channels, dtype=np.float64)], axis=2)
        if known:
            offsets = np.concatenate([offsets, np.asarray(channel_constants, dtype=np.float64)], axis=1)
    scales = np.maximum(np.abs(columns).max(axis=1), np.finfo(float).tiny)  # (n, 1 + m); scales[:, 0] = scale
    targets = columns if offsets is None else columns - offsets[:, None, :]
    target = targets[:, :, 0]
    support, test = support_split(K, poles)
    weights = null_vectors(loewner_rows(targets, scales, ks, support, test, known))  # (n, r + 1)
    p = poles_from_weights(weights, ks[support])
    imaginary = (np.abs(p.imag) / np.maximum(np.abs(p), 1e-300)).max(axis=1)
    tau = -p.real
    if channels is not None:  # least squares over all channels from the Loewner start: real, positive
        tau = np.exp(common_pole_polish(targets / scales[:, None, :], ks, np.log(pole_start(p, ks)),
                                        free_constant=not known))
        imaginary = np.zeros(n)
    nonpositive = (tau <= 0).any(axis=1)
    tau = np.where(tau > 0, tau, np.nan)
    # (c, rho) (or rho alone) by least squares on the Cauchy matrix over all samples.
    C = 1.0 / (ks[None, :, None] + tau[:, None, :])
    if not known:
        C = np.concatenate([np.ones((n, K, 1)), C], axis=2)
    bad = ~np.isfinite(C).all(axis=(1, 2))
    C[bad] = np.nan_to_num(C[bad], nan=0.0, posinf=0.0, neginf=0.0)
    coefficients = least_squares_qr(C, target)
    c, rho = (constant, coefficients) if known else (coefficients[:, 0], coefficients[:, 1:])
    m = np.log(tau)
    labels = rho / tau
    if K > 2 * poles + 1 and not known and channels is None:  # (the channels' poles are least squares already)
        # Oversampled: the Loewner/Cauchy steps are only consistent estimators; polish to the
        # nonlinear least-squares fit, whose first-order error is J^+ e (what the certificate uses).
        c, m, labels = least_squares_polish(samples, ks, c, m, labels, ~bad)
    tau = np.exp(m)
    model = c[:, None] + (tau[:, None, :] * labels[:, None, :] / (ks[None, :, None] + tau[:, None, :])).sum(axis=2)
    residual = np.abs(model - samples).max(axis=1) / scale
    residual[bad] = np.inf
    order = np.argsort(np.nan_to_num(m, nan=np.inf), axis=1)
    m = np.take_along_axis(m, order, axis=1)
    labels = np.take_along_axis(labels, order, axis=1)
    gaps = np.diff(m, axis=1)
    pole_gap = np.min(np.nan_to_num(gaps, nan=np.inf), axis=1) if poles > 1 else np.full(n, np.inf)
    condition, sigma_m, sigma_l = sensitivities(ks, np.exp(m), labels, scale, constant_known=known,
                                                residual=residual)
    return InstanceFits(c, m, labels, pole_gap, imaginary, nonpositive, residual, condition, sigma_m, sigma_l,
                        np.zeros(n, bool))


def least_squares_polish(samples, ks, c, m, labels, active, iterations: int = 30):
    """Gauss-Newton on ``sum_k (c + sum_h tau_h l_h / (k + tau_h) - F(k))^2`` over (c, m, l),
    batched over instances, with a backtracking line search. Steps go through the SVD of the
    column-scaled Jacobian (never the normal equations, which would square its condition). A step
    is kept only where it lowers the residual, so the polish never makes a fit worse; an instance
    stops when no step along the Gauss-Newton direction lowers it."""
    c, m, labels = c.copy(), m.copy(), labels.copy()
    active = active & np.isfinite(m).all(axis=1) & np.isfinite(labels).all(axis=1) & np.isfinite(c)
    r = m.shape[1]

    def residuals(c, m, labels, rows=slice(None)):
        tau = np.exp(m)
        fitted = c[:, None] + (tau[:, None, :] * labels[:, None, :] / (ks[None, :, None] + tau[:, None, :])).sum(axis=2)
        return fitted - samples[rows]

    with np.errstate(all="ignore"):
        current = residuals(c, m, labels)
        cost = np.where(active, (current**2).sum(axis=1), np.inf)
        for _ in range(iterations):
            index = np.flatnonzero(active)
            if not len(index):
                break
            J = instance_jacobian(ks, np.exp(m[index]), labels[index])
            columns = np.maximum(np.linalg.norm(J, axis=1), 1e-300)
            U, sv, Vt = np.linalg.svd(J / columns[:, None, :], full_matrices=False)
            inverse = np.where(sv > sv[:, :1] * 1e-15, 1.0 / np.maximum(sv, 1e-300), 0.0)
            delta = np.einsum("nji,nj,nj->ni", Vt, inverse, np.einsum("nkj,nk->nj", U, current[index])) / columns
            best_cost, best = cost[index].copy(), np.zeros(len(index))
            for alpha in 0.5 ** np.arange(10):  # the largest step fraction that lowers the residual
                trial = residuals(c[index] - alpha * delta[:, 0], m[index] - alpha * delta[:, 1:r + 1],
                                  labels[index] - alpha * delta[:, r + 1:], index)
                new_cost = (trial**2).sum(axis=1)
                improves = (best == 0) & np.isfinite(new_cost) & (new_cost < best_cost)
                best[improves], best_cost[improves] = alpha, new_cost[improves]
            moved = best > 0
            accepted = index[moved]
            step = best[moved, None] * delta[moved]
            c[accepted] -= step[:, 0]
            m[accepted] -= step[:, 1:r + 1]
            labels[accepted] -= step[:, r + 1:]
            cost[accepted] = best_cost[moved]
            current[accepted] = residuals(c[accepted], m[accepted], labels[accepted], accepted)
            active[index[~moved]] = False
    return c, m, labels


def solve_transposed(Z: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``Z^{-T} rhs`` for rhs (d,) or (d, m)."""
    return np.linalg.solve(Z.T, rhs)


def assemble(Z: np.ndarray, X: np.ndarray, M: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``W_h = Z^{-T} M_h X^{-1}`` and ``v_h = Z^{-T} l_h`` for M (H, d, d) and labels (H, d)."""
    left = np.linalg.solve(Z.T[None], M)  # Z^{-T} M_h
    W = np.linalg.solve(X.T[None], left.transpose(0, 2, 1)).transpose(0, 2, 1)  # (. ) X^{-1}
    v = np.linalg.solve(Z.T, labels.T).T
    return W, v


def dot(vector: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``vector^T p`` for each column p of ``points`` (d, m)."""
    return vector @ points
