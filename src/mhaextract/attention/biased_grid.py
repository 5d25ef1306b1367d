"""The grid schedule for the model with biases (docs/algorithm.md, 'Biases: affine scores and an output constant', on
the grid of 'The paper schedule').

With score biases ``u_h`` and an output constant ``c0`` the log-pole of an instance with final
token x and difference z is affine in x, ``m_h = z^T W_h x + z^T u_h``, and every answer carries
``c0``: one-token answers are ``c0 + vbar^T x``. The grid therefore takes ``d + 1`` final tokens
``x_0..x_d`` in general (affine) position: the vertices of a regular simplex centred at the
origin, of norm the token scale, randomly rotated (:func:`affine_basis`). Neither they nor the
column links' final tokens are the zero vector: with final token 0 every pole is ``z^T u_h``, and
heads with equal ``u_h`` (``u = 0``, a bias-free layer) would merge there.

* Row 0 (final ``x_0``) and its row links are the paper's ('The paper schedule'). The anchor ``F(0)`` of instance
  (0, 0) is ``c0 + vbar^T x_0``; ``vbar^T z_j = F(0) - c_j`` (c0 cancels) gives vbar, and then
  ``c0 = F(0) - vbar^T x_0`` with no extra query ('Anchors' and 'Biases: affine scores and an output constant').
* Rows 1..d: final ``x_i``, difference ``z_j``, ``F(0) = c0 + vbar^T x_i`` known: ``k = 1..2H0``.
* Column link (i, j), i = 1..d: final ``(x_0 + x_i) / 2`` (affine coefficients summing to one),
  difference ``z_j``; its poles are ``(P_h[j, 0] + P_h[j, i]) / 2``, matched as twice the link pole
  against the sum, assembled with weight 1/2; ``F(0) = (F_0(0) + F_i(0)) / 2``.
* Assembly: ``P_h = Z^T [W_h | u_h] X~`` with ``X~`` the lifted final tokens ``(x_i, 1)`` as
  columns, so ``[W_h | u_h] = Z^{-T} P_h X~^{-1}``; ``v_h = Z^{-T} l_h`` as in 'Assembly'.

``d (d + 1)`` grid instances, ``d - 1`` row links and ``d^2`` column links, ``2d^2 + 2d - 1``
instances; the first asks ``K = 2 H0 + 1`` samples, every other ``K - 1``::

    (2 H0 + 1) + 2 H0 (2 d^2 + 2 d - 2) = 4 H0 d^2 + 4 H0 d - 2 H0 + 1   queries, longest 2 H0 + 1.

In high precision an instance that fails the Krawczyk test is repaired (:mod:`.repair`, 'Certificate repair: failed
instances measured again with their poles pulled apart'): 0, K or 2K more queries each (``details.repair_queries``);
none when every instance certifies.

The learner, matching and assembly are the grid's (:class:`~.grid.GridLearner`,
:mod:`.matching`, :mod:`mhaextract.numerics.assembly`), driven by ``affine`` and
``column_link_weight``.
"""

from __future__ import annotations

import numpy as np

from ..oracle.queries import quantize
from .paper import PaperSchedule


def affine_basis(rng: np.random.Generator, d: int, scale: float) -> np.ndarray:
    """(d, d + 1): the vertices of a regular simplex centred at 0, each of norm ``scale``, randomly
    rotated and rounded like every query token (docs/algorithm.md, 'Numerics in float64 and the token scale'). Their
    lifts ``(x_i, 1)`` are orthogonal before rounding, with norms ``scale`` and ``sqrt(d + 1)`` along and across the
    lifted axis.

    d = 1: the simplex ``(s, -s)`` would put the column link's final token ``(x_0 + x_1) / 2`` at 0,
    where heads with equal ``u_h`` merge; ``(s, -s/2)`` (random sign) is used instead."""
    if d == 1:
        return quantize(scale * rng.choice([-1.0, 1.0]) * np.array([[1.0, -0.5]]), scale)
    gaussian = rng.standard_normal((d + 1, d + 1))
    gaussian[:, 0] = 1.0
    q, _ = np.linalg.qr(gaussian)  # q[:, 1:] spans the complement of the all-ones vector
    return quantize(scale * np.sqrt((d + 1) / d) * q[:, 1:].T, scale)


class BiasedGridSchedule(PaperSchedule):
    """``schedule="paper"`` with ``bias=True``, and ``"auto"`` in high precision: the paper's grid
    with an affine basis of final tokens, learning ``u_h`` and ``c0`` (module docstring, docs/algorithm.md, 'Biases:
    affine scores and an output constant')."""

    affine = True
    column_link_weight = 0.5
    #: High precision: failed Krawczyk tests are repaired with extra queries by default (docs/algorithm.md, 'Certificate
    #: repair: failed instances measured again with their poles pulled apart').
    repairs_certificate = True
    #: No first-order certificate (the certificate of docs/algorithm.md, 'Approximate answers: certificate,
    #: oversampling, refinement, verification' linearises the bias-free grid): float64 runs probe the noise.
    probes_noise = True
    verifies_by_default = True

    def _final_tokens(self, rng) -> np.ndarray:
        return affine_basis(rng, self.d, self.token_scale)

    @property
    def assembly_basis(self) -> np.ndarray:
        """The lifted final tokens ``X~ = [X; 1]`` (d + 1, d + 1)."""
        return np.vstack([self.X, np.ones((1, self.X.shape[1]))])

    exact_formula = "biased grid 4*H0*d^2 + 4*H0*d - 2*H0 + 1"
    later_formula = "2d^2+2d-2"

    def later_instances(self) -> int:
        """``2 d^2 + 2 d - 2``: so ``promised_queries`` is ``4 H0 d^2 + 4 H0 d - 2 H0 + 1``, or
        ``K + (K - 1)(2 d^2 + 2 d - 2)`` when oversampled (module docstring)."""
        return 2 * self.d**2 + 2 * self.d - 2

    def certificate(self, outcome):
        """None: the first-order certificate of docs/algorithm.md, 'Approximate answers: certificate, oversampling,
        refinement, verification' linearises the bias-free grid."""
        return None
