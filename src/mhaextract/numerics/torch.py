"""float64 kernels in torch, batched over instances, on CUDA when present (docs/algorithm.md, 'Kernels in float64').

The same mathematics and the same steps as :mod:`.float64` (Loewner singular values for the
pole count, the Loewner null vector, poles as eigenvalues of the projected support matrix,
``(c, rho)`` by least squares on the Cauchy matrix, first-order sensitivities from the instance
Jacobian), with every batched factorisation done by torch on ``device``. Results come back as
numpy float64 arrays in :class:`~.rational.InstanceFits`, so the learner downstream is unchanged
and the two backends agree to float64 rounding. The oversampled polish (a Gauss-Newton loop with
data-dependent stopping) stays in numpy. torch is an optional dependency, imported here only.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import null_space

from . import float64 as float64_kernel
from .rational import InstanceFits, rank_split, sensitivities, support_split


def default_device() -> str:
    """``"cuda"`` when a GPU is visible to torch, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchKernels:
    """The kernel functions of :mod:`.float64` (``detect_ranks``, ``fit``, ``assemble``,
    ``solve_transposed``, ``dot``) computed with torch on one device."""

    def __init__(self, device: str | None = None):
        self.device = torch.device(device or default_device())

    def _tensor(self, values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.float64), device=self.device)

    def _loewner(self, samples: torch.Tensor, ks: np.ndarray, support, test) -> torch.Tensor:
        gaps = self._tensor(ks[test][:, None] - ks[support][None, :])
        return (samples[:, test][:, :, None] - samples[:, support][:, None, :]) / gaps

    def detect_ranks(self, samples, ks, max_poles, constant=None, answer_error: float = 0.0):
        """Pole counts and relative Loewner singular values, as :func:`.float64.detect_ranks`."""
        n = samples.shape[0]
        if max_poles == 0:
            return np.zeros(n, dtype=int), np.zeros((n, 0))
        F = self._tensor(samples)
        if constant is not None:
            F = F - self._tensor(constant)[:, None]
        support, test = rank_split(F.shape[1], max_poles, constant is not None)
        sv = torch.linalg.svdvals(self._loewner(F, ks, support, test)).cpu().numpy()
        scale = np.abs(F.cpu().numpy()).max(axis=1)
        reference = np.maximum(sv[:, :1], scale[:, None] * 1e-300)
        relative = sv / reference
        gaps = (ks[test][:, None] - ks[support][None, :]).astype(np.float64)
        noise_norm = 2.0 * float(answer_error) * np.sqrt((1.0 / gaps**2).sum())
        tolerance = np.maximum(float64_kernel.RANK_TOLERANCE, 10.0 * noise_norm / reference[:, 0])
        flat = sv[:, 0] <= np.maximum(float64_kernel.RANK_TOLERANCE * scale, 10.0 * noise_norm)
        relative[flat] = 0.0
        return (relative > tolerance[:, None]).sum(axis=1), relative[:, :max_poles]

    def _poles(self, weights: torch.Tensor, support_points: np.ndarray) -> torch.Tensor:
        """Zeros of the barycentric denominator, as :func:`.float64.poles_from_weights`."""
        size = weights.shape[1]
        Q = self._tensor(null_space(np.ones((1, size))))
        s = self._tensor(support_points)
        QSQ = Q.T @ (s[:, None] * Q)
        Qw, sQ = weights @ Q, s @ Q
        A = QSQ[None] - Qw[:, :, None] * sQ[None, None, :] / weights.sum(dim=1)[:, None, None]
        return torch.linalg.eigvals(A)

    def fit(self, samples, ks, poles, constant=None) -> InstanceFits:
        """``F(k) = c + sum_h rho_h / (k + tau_h)`` for every row, as :func:`.float64.fit`."""
        samples = np.asarray(samples, dtype=np.float64)
        n, K = samples.shape
        known = constant is not None
        if poles == 0 or (K > 2 * poles + 1 and not known):
            # No pole to find, or the oversampled polish: the numpy path (it owns those loops).
            return float64_kernel.fit(samples, ks, poles, constant=constant)
        F = self._tensor(samples)
        scale = torch.clamp(F.abs().amax(dim=1), min=np.finfo(float).tiny)
        target = F - self._tensor(constant)[:, None] if known else F
        support, test = support_split(K, poles)
        L = self._loewner(target, ks, support, test)
        if known:
            L = torch.cat([L, target[:, None, support]], dim=1)
        weights = torch.linalg.svd(L / scale[:, None, None]).Vh[:, -1, :]
        p = self._poles(weights, ks[support])
        imaginary = (p.imag.abs() / torch.clamp(p.abs(), min=1e-300)).amax(dim=1)
        tau = -p.real
        nonpositive = (tau <= 0).any(dim=1)
        tau = torch.where(tau > 0, tau, torch.full_like(tau, float("nan")))
        k = self._tensor(ks)
        C = 1.0 / (k[None, :, None] + tau[:, None, :])
        if not known:
            C = torch.cat([torch.ones((n, K, 1), dtype=C.dtype, device=self.device), C], dim=2)
        bad = ~torch.isfinite(C).all(dim=2).all(dim=1)
        C[bad] = torch.nan_to_num(C[bad], nan=0.0, posinf=0.0, neginf=0.0)
        U, s, Vh = torch.linalg.svd(C, full_matrices=False)
        coefficients = torch.einsum("nji,nj,nj->ni", Vh, 1.0 / torch.clamp(s, min=1e-300),
                                    torch.einsum("nkj,nk->nj", U, target))
        c = target.new_tensor(np.asarray(constant, dtype=np.float64)) if known else coefficients[:, 0]
        rho = coefficients if known else coefficients[:, 1:]
        return self._finish(samples, ks, c, torch.log(tau), rho / tau, imaginary, nonpositive, bad, known)

    def _finish(self, samples, ks, c, m, labels, imaginary, nonpositive, bad, known) -> InstanceFits:
        """Residuals, the sorting of the poles and the sensitivities, in numpy (small arrays)."""
        c, m, labels = (value.cpu().numpy() for value in (c, m, labels))
        n = samples.shape[0]
        scale = np.maximum(np.abs(samples).max(axis=1), np.finfo(float).tiny)
        tau = np.exp(m)
        model = c[:, None] + (tau[:, None, :] * labels[:, None, :] / (ks[None, :, None] + tau[:, None, :])).sum(axis=2)
        residual = np.abs(model - samples).max(axis=1) / scale
        residual[bad.cpu().numpy()] = np.inf
        order = np.argsort(np.nan_to_num(m, nan=np.inf), axis=1)
        m, labels = np.take_along_axis(m, order, axis=1), np.take_along_axis(labels, order, axis=1)
        poles = m.shape[1]
        pole_gap = np.min(np.nan_to_num(np.diff(m, axis=1), nan=np.inf), axis=1) if poles > 1 else np.full(n, np.inf)
        condition, sigma_m, sigma_l = sensitivities(ks, np.exp(m), labels, scale, constant_known=known,
                                                    residual=residual)
        return InstanceFits(c, m, labels, pole_gap, imaginary.cpu().numpy(), nonpositive.cpu().numpy(), residual,
                            condition, sigma_m, sigma_l, np.zeros(n, bool))

    def assemble(self, Z, X, M, labels):
        """``W_h = Z^{-T} M_h X^{-1}``, ``v_h = Z^{-T} l_h``, batched over heads."""
        Zt, Xt = self._tensor(Z).T, self._tensor(X).T
        left = torch.linalg.solve(Zt[None], self._tensor(M))
        W = torch.linalg.solve(Xt[None], left.transpose(1, 2)).transpose(1, 2)
        v = torch.linalg.solve(Zt, self._tensor(labels).T).T
        return W.cpu().numpy(), v.cpu().numpy()

    @staticmethod
    def solve_transposed(Z, rhs):
        return float64_kernel.solve_transposed(Z, rhs)

    @staticmethod
    def dot(vector, points):
        return float64_kernel.dot(vector, points)
