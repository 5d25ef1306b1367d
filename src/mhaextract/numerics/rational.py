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

When both anchors are known (docs/algorithm.md §4, the lean schedule) c is given: the fit is
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
      relative change of the samples (``scale`` = max |F| of each instance);
    * ``sigma_m``, ``sigma_l`` (n, r): ``scale * sqrt(diag((J^T J)^{-1}))`` for the m's and l's,
      the per-parameter change for i.i.d. unit relative sample errors (used as weights).

    Shapes: ks (K,), tau and labels (n, r). Rows with non-finite parameters get inf. With
    ``constant_known`` (both anchors of docs/algorithm.md §4 known) the column of c is dropped.
    Rows whose ``residual`` (n,) is above ``FAILED_FIT_RESIDUAL`` (or NaN) get inf too: the
    linearisation of a fit that does not fit is no error bar. Near such a degenerate fit the SVD's
    rounding reported sigma 265 for a label 3.5e279 (paper, d = H = 3 under uniform 1e-8,
    bench_reliability seed 386, on numpy 2.4.6's OpenBLAS), which then outweighed every other
    instance of its column in the weighted consensus.
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
    _, s, Vt = np.linalg.svd(J, full_matrices=False)
    # A column m_h with l_h = 0 is zero: such a pole is not identifiable (and not canonical).
    with np.errstate(divide="ignore"):
        inverse = np.where(s > 0, 1.0 / s, np.inf)
        variances = np.einsum("nij,ni->nj", Vt**2, inverse**2)
    scale = scale[finite]
    condition[finite] = scale * inverse[:, -1]
    first = 0 if constant_known else 1
    sigma_m[finite] = scale[:, None] * np.sqrt(variances[:, first:first + r])
    sigma_l[finite] = scale[:, None] * np.sqrt(variances[:, first + r:])
    return condition, sigma_m, sigma_l
