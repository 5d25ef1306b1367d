"""float64 fits of a saturated instance: one head in the window, the others constant.

A targeted instance (docs/algorithm.md, 'The targeted schedule') has final token ``x`` and difference ``z`` chosen
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
    target = reciprocal * weight  # the rows of the design are weight * (1, 1/k)
    n, K = gaps.shape
    alpha = np.full(n, np.nan)
    beta = np.full(n, np.nan)
    residual = np.full(n, np.inf)
    covariance = np.full((n, 2, 2), np.nan)
    # (K x 2) systems, all rows at once: A = Q R by Gram-Schmidt on the two columns, the second
    # orthogonalised twice (so Q is orthonormal to rounding whatever cond(A); a batched SVD, one
    # LAPACK call per row, cost three quarters of the fit). Rank: sigma_2 > sigma_1 eps max(K, 2),
    # lstsq's default rcond, from R's singular values in closed form.
    rows = np.flatnonzero(np.all(weight > 0, axis=1))
    if len(rows):
        first, right = weight[rows], target[rows]
        second = first * inverse_k
        r11 = np.sqrt(np.einsum("nk,nk->n", first, first))
        q0 = first / r11[:, None]
        r12 = np.einsum("nk,nk->n", q0, second)
        rest = second - r12[:, None] * q0
        again = np.einsum("nk,nk->n", q0, rest)
        rest -= again[:, None] * q0
        r12 += again
        r22 = np.sqrt(np.einsum("nk,nk->n", rest, rest))
        # singular values of [[r11, r12], [0, r22]]: s1^2 + s2^2 = |R|_F^2, s1 s2 = r11 r22
        frobenius = r11**2 + r12**2 + r22**2
        product = r11 * r22
        s1 = np.sqrt(0.5 * (frobenius + np.sqrt(np.maximum(frobenius**2 - 4.0 * product**2, 0.0))))
        with np.errstate(divide="ignore", invalid="ignore"):
            full = product / s1 > s1 * EPS * max(K, 2)
        rows, r11, r12, r22, q0, rest, right = (a[full] for a in (rows, r11, r12, r22, q0, rest, right))
        q1 = rest / r22[:, None]
        along_first = np.einsum("nk,nk->n", q0, right)
        off = right - along_first[:, None] * q0
        along_second = np.einsum("nk,nk->n", q1, off)
        beta[rows] = along_second / r22
        alpha[rows] = (along_first - r12 * beta[rows]) / r11
        off -= along_second[:, None] * q1  # the target's part off the columns' span
        residual[rows] = np.sqrt(np.einsum("nk,nk->n", off, off))
        # (A^T A)^-1 = R^-1 R^-T
        covariance[rows, 0, 0] = 1.0 / r11**2 + (r12 / (r11 * r22)) ** 2
        covariance[rows, 0, 1] = covariance[rows, 1, 0] = -r12 / (r11 * r22**2)
        covariance[rows, 1, 1] = 1.0 / r22**2
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


def reading(gap: np.ndarray, constant, label, k: int = 1) -> np.ndarray:
    """``m`` from the one sample ``G(k) = P + k l / (k + tau)`` when ``P`` and ``l`` are known."""
    with np.errstate(divide="ignore", invalid="ignore"):
        tau = k * (np.asarray(label) / (np.asarray(gap) - np.asarray(constant)) - 1.0)
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
