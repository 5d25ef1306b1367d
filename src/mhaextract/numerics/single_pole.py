"""float64 fits of a saturated instance: one head in the window, the others constant.

A targeted instance (docs/algorithm.md §13) has final token ``x`` and difference ``z`` chosen
so that one head h has its log-pole ``m_h = z^T W_h x`` near 0 while every other head is
saturated. With ``G(k) = vbar^T x - F(k)`` (the gap to the one-token answer ``F(0)``)::

    G(k) = P + k l / (k + tau),    tau = exp(m_h),  l = v_h^T z,

where ``P`` is the sum of the labels of the heads saturated towards ``y`` (0 when every other
head is saturated towards ``x``; then ``G(0) = 0`` and only ``(l, tau)`` are unknown).

With ``P = 0`` the reciprocal is affine in ``1/k``::

    1 / G(k) = 1/l + (tau/l) (1/k),

so the fit is a weighted linear least-squares problem in ``(alpha, beta) = (1/l, tau/l)``.
Two samples determine it; a third one tests it: its residual is the instance's own check that it
really is single-pole to working precision (an unsaturated head would bend ``1/G`` in ``1/k``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPS = np.finfo(np.float64).eps


@dataclass
class SinglePoleFits:
    """Fits of a batch of saturated instances.

    Attributes
    ----------
    log_pole : (n,) ``m = log tau`` (NaN when the samples are not of the single-pole form).
    label : (n,) ``l = v_h^T z``.
    residual : (n,) misfit of the samples in units of their rounding error (root of the weighted
        sum of squares; 0 when only two samples were fitted). Of order one for a single-pole
        instance; large when the instance is not single-pole (a head not saturated).
    sigma_m, sigma_l : (n,) first-order errors of ``m`` and ``l`` from the rounding of the samples.
    """

    log_pole: np.ndarray
    label: np.ndarray
    residual: np.ndarray
    sigma_m: np.ndarray
    sigma_l: np.ndarray


def fit(gaps: np.ndarray, ks, rounding: np.ndarray) -> SinglePoleFits:
    """Fit ``G(k) = k l / (k + tau)`` to each row of ``gaps`` (n, K) sampled at ``ks`` (K >= 2, k >= 1).

    ``rounding`` (n, K): the expected absolute error of each sample (weights and residual units).
    """
    gaps = np.asarray(gaps, dtype=np.float64)
    rounding = np.maximum(np.asarray(rounding, dtype=np.float64), np.finfo(np.float64).tiny)
    inverse_k = 1.0 / np.asarray(ks, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        reciprocal = 1.0 / gaps
        weight = gaps**2 / rounding  # 1 / error of 1/G
    weight = np.where(np.isfinite(weight), weight, 0.0)
    reciprocal = np.where(np.isfinite(reciprocal), reciprocal, 0.0)
    design = np.stack([np.ones_like(gaps), np.broadcast_to(inverse_k, gaps.shape)], axis=2) * weight[:, :, None]
    target = reciprocal * weight
    n, K = gaps.shape
    alpha = np.full(n, np.nan)
    beta = np.full(n, np.nan)
    residual = np.full(n, np.inf)
    covariance = np.full((n, 2, 2), np.nan)
    # (K x 2) systems, all rows at once through one batched SVD (what lstsq does row by row).
    rows = np.flatnonzero(np.all(weight > 0, axis=1))
    if len(rows):
        u, singular, vt = np.linalg.svd(design[rows], full_matrices=False)
        full = singular[:, 1] > singular[:, 0] * EPS * max(K, 2)  # lstsq's default rcond: rank 2
        rows, u, singular, vt = rows[full], u[full], singular[full], vt[full]
        v = vt.transpose(0, 2, 1)
        solution = np.matmul(v, (np.matmul(u.transpose(0, 2, 1), target[rows][:, :, None])[:, :, 0] / singular)[:, :, None])[:, :, 0]
        alpha[rows], beta[rows] = solution[:, 0], solution[:, 1]
        residual[rows] = np.linalg.norm(np.matmul(design[rows], solution[:, :, None])[:, :, 0] - target[rows], axis=1)
        covariance[rows] = np.matmul(v / singular[:, None, :] ** 2, vt)  # (A^T A)^-1 = V S^-2 V^T
    with np.errstate(divide="ignore", invalid="ignore"):
        label = 1.0 / alpha
        tau = beta / alpha
        valid = (tau > 0) & np.isfinite(tau) & np.isfinite(label)
        log_pole = np.where(valid, np.log(np.where(valid, tau, 1.0)), np.nan)
        # m = log(beta) - log(alpha): dm = dbeta/beta - dalpha/alpha; l = 1/alpha: dl = -dalpha/alpha^2.
        gradient_m = np.stack([-1.0 / alpha, 1.0 / beta], axis=1)
        sigma_m = np.sqrt(np.einsum("ni,nij,nj->n", gradient_m, covariance, gradient_m))
        sigma_l = np.sqrt(covariance[:, 0, 0]) / alpha**2
    residual = np.where(valid, residual, np.inf)
    return SinglePoleFits(log_pole, label, residual, np.where(valid, sigma_m, np.inf), np.where(valid, sigma_l, np.inf))


def fit_with_constant(gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``G(k) = P + k l / (k + tau)`` through samples at k = 1, 2, 3 (columns of ``gaps``), P unknown.

    The differences eliminate P: ``G2 - G1 = l tau / ((1 + tau)(2 + tau))`` and
    ``G3 - G2 = l tau / ((2 + tau)(3 + tau))``, whose ratio ``(3 + tau) / (1 + tau)`` gives tau.
    Returns ``(P, l, m)``; NaN where the samples admit no positive tau.
    """
    gaps = np.asarray(gaps, dtype=np.float64)
    first, second = gaps[:, 1] - gaps[:, 0], gaps[:, 2] - gaps[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = first / second
        tau = (3.0 - ratio) / (ratio - 1.0)
        valid = np.isfinite(tau) & (tau > 0)
        tau = np.where(valid, tau, np.nan)
        label = first * (1.0 + tau) * (2.0 + tau) / tau
        constant = gaps[:, 0] - label / (1.0 + tau)
        return constant, label, np.log(tau)


def reading(gap_one: np.ndarray, constant, label) -> np.ndarray:
    """``m`` from the one sample ``G(1) = P + l / (1 + tau)`` when ``P`` and ``l`` are known."""
    with np.errstate(divide="ignore", invalid="ignore"):
        tau = np.asarray(label) / (np.asarray(gap_one) - np.asarray(constant)) - 1.0
        return np.where(tau > 0, np.log(np.where(tau > 0, tau, 1.0)), np.nan)


def log_pole_given_label(gaps: np.ndarray, ks, rounding: np.ndarray, label: np.ndarray, misfit: bool = False):
    """``m`` of ``G(k) = k l / (k + tau)`` when the label ``l`` is known (n,): each sample gives
    ``tau = k (l / G(k) - 1)``; the estimates are combined with inverse-variance weights. ``ks``:
    the copy counts (K,) of every row, or (n, K) row by row (NaN with a NaN sample: none asked).

    A label known more precisely than one instance can fit it (the consensus of the instances
    that share it) removes the strong correlation of ``l`` and ``tau`` in the two-parameter fit.
    Returns ``(m, sigma_m)``, and with ``misfit=True`` also the spread of the per-sample ``m``
    around the combined one in units of their errors (``sqrt(sum w (m_k - m)^2)``): with the label
    known, two samples already test the single-pole form.
    """
    gaps = np.asarray(gaps, dtype=np.float64)
    ks = np.asarray(ks, dtype=np.float64)
    ks = ks[None, :] if ks.ndim == 1 else ks  # (K,) shared, or (n, K) per row (NaN: no sample)
    label = np.asarray(label, dtype=np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        tau = ks * (label / gaps - 1.0)
        valid = tau > 0
        m = np.log(np.where(valid, tau, 1.0))
        # dm = dtau / tau = -k l dG / (G^2 tau)
        sigma = np.abs(ks * label / (gaps**2 * tau)) * rounding
        weight = np.where(valid & np.isfinite(sigma) & (sigma > 0), 1.0 / sigma**2, 0.0)
        total = weight.sum(axis=1)
        combined = np.where(total > 0, (weight * m).sum(axis=1) / total, np.nan)
        sigma_combined = np.where(total > 0, 1.0 / np.sqrt(total), np.inf)
        if not misfit:
            return combined, sigma_combined
        spread = np.sqrt((weight * (m - combined[:, None]) ** 2).sum(axis=1))
        return combined, sigma_combined, np.where(total > 0, spread, np.inf)
