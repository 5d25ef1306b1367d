"""What both kernel paths share: the fit's result type, the support split, the Jacobian.

One instance samples ``F(k) = c + sum_h rho_h / (k + tau_h)`` at ``k = 0..K-1`` (K = 2 H0 + 1).
It is a rational function of type (r, r) with r = H* poles ``p_h = -tau_h``. In barycentric form
with ``r + 1`` support points ``s_a``

    F(k) = N(k) / D(k),   N(k) = sum_a w_a F(s_a) / (k - s_a),   D(k) = sum_a w_a / (k - s_a),

the weights ``w`` span the null space of the Loewner matrix of the remaining (test) points ``t_b``

    L[b, a] = (F(t_b) - F(s_a)) / (t_b - s_a),

whose rank is r whenever there are at least r test points and r + 1 support points: the rank of
the Loewner matrix of the full even/odd split detects H* from a bound H0. The poles are the
zeros of D, the residues ``rho_h = N(p_h) / D'(p_h)`` and ``c = sum_a w_a F(s_a) / sum_a w_a``.

When both anchors are known (docs/algorithm.md, 'Anchors', the lean schedule) c is given: the fit is
of ``G = F - c``, which vanishes at infinity. That is one more linear condition on the weights,
``sum_a w_a G(s_a) = 0`` (the barycentric value at infinity), appended to the Loewner rows, so
``2r`` samples suffice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class InstanceFits:
    """Fits of a batch of instances, ``F(k) = c + sum_h tau_h l_h / (k + tau_h)``.

    Attributes
    ----------
    c : (n,) the constants ``c = vbar^T y``.
    log_poles : (n, r) ``m_h = log tau_h = z^T W_h x`` (sorted ascending per instance).
    labels : (n, r) residue labels ``l_h = rho_h / tau_h = v_h^T z``.
    pole_gap : (n,) smallest distance between two log-poles of an instance (inf for r < 2).
    imaginary : (n,) largest |Im p| / |p| of a computed pole (0 when certified real).
    nonpositive : (n,) bool, a pole with tau <= 0 (not a softmax pole).
    residual : (n,) max |F(k) - fit(k)| / max |F| over the samples.
    condition : (n,) first-order amplification from samples to (c, m, l), see :func:`sensitivities`.
    sigma_m, sigma_l : (n, r) per-parameter first-order sensitivities, see :func:`sensitivities`.
    certified : (n,) bool, the balls provably enclose the fit's parameters (arb path only).

    In the arb path ``c``, ``log_poles`` and ``labels`` are object arrays of balls.
    """

    c: np.ndarray
    log_poles: np.ndarray
    labels: np.ndarray
    pole_gap: np.ndarray
    imaginary: np.ndarray
    nonpositive: np.ndarray
    residual: np.ndarray
    condition: np.ndarray
    sigma_m: np.ndarray
    sigma_l: np.ndarray
    certified: np.ndarray


def rank_split(n_samples: int, max_poles: int, constant_known: bool) -> tuple[np.ndarray, np.ndarray]:
    """Support and test points of the Loewner matrix whose rank is the pole count (<= max_poles).

    ``2 H0 + 1`` samples: H0 + 1 support, H0 test points. With c known (``F - c`` vanishes at
    infinity, one sample fewer, ``2 H0``): H0 support and H0 test points.
    """
    return support_split(n_samples, max_poles - 1 if constant_known else max_poles)


def support_split(n_samples: int, poles: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of ``poles + 1`` support points spread over the samples, and the test points.

    For ``poles = (n_samples - 1) / 2`` this is the interleaved even/odd split, which keeps the
    Loewner matrix as well conditioned as the Cauchy structure allows.
    """
    support = np.unique(np.round(np.linspace(0, n_samples - 1, poles + 1)).astype(int))
    test = np.setdiff1d(np.arange(n_samples), support)
    return support, test


def rank_from_singular_values(relative_sv: np.ndarray, tolerance: float) -> np.ndarray:
    """Numerical rank: the number of singular values above ``tolerance`` (relative to the first)."""
    return (relative_sv > tolerance).sum(axis=-1)


def instance_jacobian(ks: np.ndarray, tau: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``J[n, k] = dF(k)/d(c, m_1..m_r, l_1..l_r)`` for ``F = c + sum_h tau_h l_h / (k + tau_h)``,
    ``tau = exp(m)``; shape (n, K, 2r + 1) for ks (K,), tau and labels (n, r)."""
    k = np.asarray(ks, dtype=np.float64)[None, :, None]
    t = tau[:, None, :]
    return np.concatenate(
        [np.ones((tau.shape[0], k.shape[1], 1)), t * labels[:, None, :] * k / (k + t) ** 2, t / (k + t)], axis=2)


#: Square Jacobians are inverted by LU (a fifth of an SVD's time, an eighth at 5 x 5) while their
#: 1-norm condition is below this; above it, singular ones and tall (oversampled) ones are left to
#: the SVD by the callers.
INVERSE_CONDITION = 1e8
#: Matrices inverted per call (np.linalg.inv refuses a whole batch for one singular matrix).
INVERSE_CHUNK = 256


def lu_inverses(J: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``J^{-1}`` of the square, well-conditioned matrices of a batch (n, p, p) by LU.

    Returns ``(inverse, inverted)``: ``inverted`` (n,) marks the matrices whose 1-norm condition
    ``||J||_1 ||J^{-1}||_1`` is finite and below ``INVERSE_CONDITION`` (there the LU inverse is the
    pseudo-inverse to that many rounding units); ``inverse`` holds them (other rows: unspecified).
    A tall batch (n, K > p, p) has nothing inverted. A chunk holding an exactly singular matrix is
    left wholly to the caller's SVD.
    """
    n, rows, columns = J.shape
    inverse = np.full(J.shape if rows == columns else (n, columns, rows), np.nan)
    if rows != columns or not n:
        return inverse, np.zeros(n, bool)
    with np.errstate(all="ignore"):
        for start in range(0, n, INVERSE_CHUNK):
            try:
                inverse[start:start + INVERSE_CHUNK] = np.linalg.inv(J[start:start + INVERSE_CHUNK])
            except np.linalg.LinAlgError:  # an exactly singular matrix: this chunk is the caller's
                pass
        condition = np.abs(J).sum(axis=1).max(axis=1) * np.abs(inverse).sum(axis=1).max(axis=1)
    return inverse, np.isfinite(condition) & (condition < INVERSE_CONDITION)


def spectral_norm_bound(A: np.ndarray) -> np.ndarray:
    """An upper bound on ``||A||_2`` of each matrix of a batch (n, p, q), at most ``min(p, q)^(1/8)``
    times too large, from matrix products only: with ``G = A A^T``,
    ``||A||_2^8 = lambda_max(G)^4 = ||G^2||_2^2 <= ||G^2||_F^2 <= rank(G) ||G^2||_2^2``.
    (A batched SVD of small matrices costs a LAPACK call each; this, three products.)"""
    largest = np.abs(A).max(axis=(1, 2), initial=0.0)
    unit = A / np.where(largest > 0, largest, 1.0)[:, None, None]  # no overflow in the fourth power
    G = np.matmul(unit, unit.transpose(0, 2, 1))
    return largest * np.linalg.norm(np.matmul(G, G), axis=(1, 2)) ** 0.25


def triangular_inverse(R: np.ndarray) -> np.ndarray:
    """``R^{-1}`` of every upper-triangular matrix of a batch (n, p, p) by back substitution, one
    column of unknowns at a time over the whole batch (inf/NaN where a diagonal entry is 0)."""
    n, p, _ = R.shape
    inverse = np.zeros_like(R)
    diagonal = np.diagonal(R, axis1=1, axis2=2)
    with np.errstate(all="ignore"):
        for i in range(p - 1, -1, -1):
            row = -np.matmul(R[:, i:i + 1, i + 1:], inverse[:, i + 1:, :])[:, 0, :]
            row[:, i] += 1.0
            inverse[:, i, :] = row / diagonal[:, i, None]
    return inverse


#: A fit whose model misses its own samples by more than this (relative to the largest sample,
#: :class:`InstanceFits` ``residual``) measures nothing: its sensitivities are infinite.
FAILED_FIT_RESIDUAL = 1.0


def sensitivities(ks: np.ndarray, tau: np.ndarray, labels: np.ndarray, scale: np.ndarray, constant_known: bool = False,
                  residual: np.ndarray | None = None):
    """First-order amplification from sample errors to parameter errors, per instance.

    ``J[k] = dF(k)/d(c, m_1..m_r, l_1..l_r)`` with ``F = c + sum tau l / (k + tau)``,
    ``tau = exp(m)``::

        dF/dc = 1,   dF/dm_h = tau_h l_h k / (k + tau_h)^2,   dF/dl_h = tau_h / (k + tau_h).

    With ``J = U S V^T``, a sample error e moves the parameters by ``V S^{-1} U^T e``. Returns

    * ``condition`` (n,): ``scale / sigma_min(J)``, the largest parameter change per unit
      relative change of the samples (``scale`` = max |F| of each instance); where J is square and
      inverted by LU (:func:`lu_inverses`) an upper bound on it, at most ``(2r + 1)^(1/8)`` times
      too large (1.22 for r = 2) (:func:`spectral_norm_bound`);
    * ``sigma_m``, ``sigma_l`` (n, r): ``scale * sqrt(diag((J^T J)^{-1}))`` for the m's and l's,
      the per-parameter change for i.i.d. unit relative sample errors (used as weights).

    Shapes: ks (K,), tau and labels (n, r). Rows with non-finite parameters get inf. With
    ``constant_known`` (both anchors of docs/algorithm.md, 'Anchors' known) the column of c is dropped.
    Rows whose ``residual`` (n,) is above ``FAILED_FIT_RESIDUAL`` (or NaN) get inf too: the
    linearisation of a fit that does not fit is no error bar. Near such a degenerate fit the SVD's
    rounding can report a sigma far below a huge label's error, which would then outweigh every
    other instance of its column in the weighted consensus.
    """
    n, r = tau.shape
    finite = np.isfinite(tau).all(axis=1) & np.isfinite(labels).all(axis=1)
    if residual is not None:
        finite &= np.asarray(residual) <= FAILED_FIT_RESIDUAL
    condition = np.full(n, np.inf)
    sigma_m = np.full((n, r), np.inf)
    sigma_l = np.full((n, r), np.inf)
    if not finite.any():
        return condition, sigma_m, sigma_l
    J = instance_jacobian(ks, tau[finite], labels[finite])
    if constant_known:
        J = J[:, :, 1:]
    # Square and well conditioned (the exact-count fits, nearly all): diag((J^T J)^{-1}) is the row
    # norms of J^{-1} and 1 / sigma_min = ||J^{-1}||_2, bounded above (spectral_norm_bound).
    J_inverse, inverted = lu_inverses(J)
    variances = np.empty((len(J), J.shape[2]))
    largest_inverse = np.empty(len(J))
    variances[inverted] = (J_inverse[inverted] ** 2).sum(axis=2)
    largest_inverse[inverted] = spectral_norm_bound(J_inverse[inverted])
    rest = ~inverted
    if rest.any():  # tall, singular or ill-conditioned: the SVD
        _, s, Vt = np.linalg.svd(J[rest], full_matrices=False)
        # A column m_h with l_h = 0 is zero: such a pole is not identifiable (and not canonical).
        with np.errstate(divide="ignore"):
            inverse = np.where(s > 0, 1.0 / s, np.inf)
            variances[rest] = np.einsum("nij,ni->nj", Vt**2, inverse**2)
        largest_inverse[rest] = inverse[:, -1]
    scale = scale[finite]
    condition[finite] = scale * largest_inverse
    first = 0 if constant_known else 1
    sigma_m[finite] = scale[:, None] * np.sqrt(variances[:, first:first + r])
    sigma_l[finite] = scale[:, None] * np.sqrt(variances[:, first + r:])
    return condition, sigma_m, sigma_l


def _pseudo_inverses(J: np.ndarray) -> np.ndarray:
    """``J^+`` of a batch (n, K, p); rows with a non-finite entry get NaN (their fit failed)."""
    inverse = np.full((J.shape[0], J.shape[2], J.shape[1]), np.nan)
    finite = np.isfinite(J).all(axis=(1, 2))
    if finite.any():
        inverse[finite] = np.linalg.pinv(J[finite])
    return inverse


def constant_sigmas(ks: np.ndarray, tau: np.ndarray, labels: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """First-order standard deviation of each fitted constant c (n,) per unit relative sample error,
    ``scale * sqrt(((J^T J)^{-1})[c, c])``, as :func:`sensitivities` gives those of m and l (c fitted)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # failed fits: NaN, then inf
        J_plus = _pseudo_inverses(instance_jacobian(ks, tau, labels))
        sigma = np.asarray(scale) * np.sqrt((J_plus[:, 0, :] ** 2).sum(axis=1))
    return np.where(np.isfinite(sigma), sigma, np.inf)


def anchor_sigmas(ks: np.ndarray, tau: np.ndarray, labels: np.ndarray, coefficients: np.ndarray,
                  anchor_sigma: np.ndarray, constant_known: bool) -> tuple[np.ndarray, np.ndarray]:
    """First-order standard deviations of the log-poles and labels (n, r) that the errors of computed
    anchors cause (docs/algorithm.md, 'Anchors' and 'The lean schedule'): the fitted samples are ``G = E a + (answers)``
    with ``a`` the anchors ``vbar^T z_j``, their errors independent with standard deviations ``anchor_sigma``
    (d,); ``coefficients`` is ``E`` (n, K, d) per instance. A parameter moves by ``J^+ E delta a``,
    so its variance is ``sum_j (J^+ E)[:, j]^2 anchor_sigma_j^2``. The anchors' errors are shared by
    every instance that uses them: summed with :func:`sensitivities`' own, in the same units."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # failed fits: NaN, then inf
        J = instance_jacobian(ks, tau, labels)
        if constant_known:
            J = J[:, :, 1:]
        moved = np.einsum("npk,nkd->npd", _pseudo_inverses(J), coefficients)
        sigma = np.sqrt((moved**2 * np.asarray(anchor_sigma)[None, None, :] ** 2).sum(axis=2))
    first, r = (0 if constant_known else 1), tau.shape[1]
    sigma = np.where(np.isfinite(sigma), sigma, np.inf)
    return sigma[:, first:first + r], sigma[:, first + r:]
