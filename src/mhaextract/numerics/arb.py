"""High-precision kernels in python-flint ball arithmetic (arb/acb).

Same mathematics as :mod:`.float64` (see :mod:`.rational`), with balls instead of guesses:

* a starting point in midpoint arithmetic: the Loewner null vector (one weight fixed to 1),
  the poles as roots of the barycentric denominator's numerator polynomial
  ``q(k) = sum_a w_a prod_{b != a} (k - s_b)`` (acb root isolation at full precision),
  ``c = sum_a w_a F(s_a) / sum_a w_a`` and ``rho_h = N(p_h) / D'(p_h)``;
* Newton polishing of ``(c, tau, rho)`` on the square system ``F(k) = c + sum rho/(k + tau)``
  at ``2r + 1`` samples;
* a Krawczyk test that proves a real solution exists in a small box and encloses it: the
  returned balls contain the exact parameters of the rational function through the samples.
  Remaining samples (when r < H0) are checked against the fit.

Samples are balls of one ulp at the oracle's precision (the boundary's contract). Balls stay tight
because only the final certification step runs in interval arithmetic (at twice the working
precision, :func:`_certify`); running the whole pipeline in
balls would inflate the radii by the product of every step's condition number. Only the rank
decision (how many poles) is numerical: it reads the singular values of the Loewner matrix in
mpmath at the working precision.
"""

from __future__ import annotations

import mpmath
import numpy as np
from flint import acb_poly, arb, arb_mat, arb_poly, ctx

from .highprec import arb_to_mpf, magnitude_float, mid_float
from .rational import InstanceFits, rank_split, sensitivities, support_split


def rank_tolerance() -> float:
    """Relative singular value under which a Loewner direction is zero: half the working digits."""
    return 2.0 ** (-ctx.prec / 2)


def loewner(samples: np.ndarray, ks: np.ndarray, support: np.ndarray, test: np.ndarray) -> arb_mat:
    """Loewner matrix (|test|, |support|) of one instance's ball samples."""
    L = arb_mat(len(test), len(support))
    for b, t in enumerate(test):
        for a, s in enumerate(support):
            L[b, a] = (samples[t] - samples[s]) / int(ks[t] - ks[s])
    return L


def detect_ranks(samples: np.ndarray, ks: np.ndarray, max_poles: int, constant=None) -> tuple[np.ndarray, np.ndarray]:
    """Pole count of each instance (rows of ``samples``, balls) and relative Loewner singular values.

    ``constant`` (n,) balls: the known c of each instance (lean schedule), or None."""
    n = samples.shape[0]
    if max_poles == 0:
        return np.zeros(n, dtype=int), np.zeros((n, 0))
    if constant is not None:
        samples = samples - np.asarray(constant, dtype=object)[:, None]
    support, test = rank_split(samples.shape[1], max_poles, constant is not None)
    tolerance = rank_tolerance()
    ranks = np.zeros(n, dtype=int)
    relative = np.zeros((n, max_poles))
    with mpmath.workprec(ctx.prec):
        for row in range(n):
            L = loewner(samples[row], ks, support, test)
            matrix = mpmath.matrix([[arb_to_mpf(L[b, a]) for a in range(L.ncols())] for b in range(L.nrows())])
            sv = mpmath.svd_r(matrix, compute_uv=False)
            sv = sorted((sv[i] for i in range(len(sv))), reverse=True)
            scale = max(abs(arb_to_mpf(value)) for value in samples[row])
            if scale == 0 or sv[0] <= tolerance * scale:
                continue  # constant F: no pole at all
            ratios = [value / sv[0] for value in sv]
            relative[row] = [float(value) for value in ratios]
            ranks[row] = sum(1 for value in ratios if value > tolerance)
    return ranks, relative


def _mid(ball: arb) -> arb:
    return arb(ball.mid())


def _isolated_roots(polynomial: acb_poly) -> list:
    """Roots of a polynomial with exact coefficients, refined to the working precision."""
    for bits in (ctx.prec - 32, ctx.prec // 2):
        try:
            return polynomial.roots(tol=arb(2) ** -bits, maxprec=4 * ctx.prec)
        except ValueError:
            continue
    return polynomial.roots(maxprec=4 * ctx.prec)  # isolation only; raises ValueError when even that fails


def _approximate_fit(F: np.ndarray, ks: np.ndarray, poles: int, constant=None):
    """Midpoint solution ((c,) tau, rho) from the barycentric form, and the largest |Im| / |p| of the poles.

    With ``constant`` (c known) the fit is of ``G = F - c`` with the condition at infinity
    ``sum_a w_a G(s_a) = 0`` as the last row, and the solution omits c."""
    if constant is not None:
        F = np.array([value - constant for value in F], dtype=object)
    support, test = support_split(len(F), poles)
    rows = poles - 1 if constant is not None else poles
    L = loewner(F, ks, support, test[:rows])  # a square system; further test points checked later
    # Null vector with the last weight fixed to 1: L[:, :r] w' = -L[:, r].
    A = arb_mat(poles, poles)
    b = arb_mat(poles, 1)
    for row in range(poles):
        for col in range(poles):
            A[row, col] = _mid(L[row, col]) if row < rows else _mid(F[support[col]])
        b[row, 0] = -_mid(L[row, poles]) if row < rows else -_mid(F[support[poles]])
    solution = A.solve(b)
    weights = [_mid(solution[a, 0]) for a in range(poles)] + [arb(1)]
    s = [int(ks[a]) for a in support]
    f = [_mid(F[a]) for a in support]
    # q(k) = sum_a w_a prod_{b != a} (k - s_b): the numerator of D over a common denominator.
    q = arb_poly([0])
    for a in range(poles + 1):
        term = arb_poly([weights[a]])
        for other in range(poles + 1):
            if other != a:
                term *= arb_poly([-s[other], 1])
        q += term
    roots = _isolated_roots(acb_poly(q))
    imaginary = max(float(abs(root.imag.mid())) / max(float(abs(root.mid())), 1e-300) for root in roots)
    p = sorted((_mid(root.real) for root in roots), key=lambda ball: -float(ball.mid()))  # ascending tau
    c = sum((w * fa for w, fa in zip(weights, f)), arb(0)) / sum(weights, arb(0))
    rho = []
    for pole in p:
        numerator = sum((w * fa / (pole - sa) for w, fa, sa in zip(weights, f, s)), arb(0))
        derivative = -sum((w / (pole - sa) ** 2 for w, sa in zip(weights, s)), arb(0))
        rho.append(_mid(numerator / derivative))
    head = [] if constant is not None else [_mid(c)]
    return head + [-pole for pole in p] + rho, imaginary


def _system(u: list, ks: np.ndarray, F: np.ndarray, rows: np.ndarray, constant=None):
    """Residuals ``c + sum rho/(k + tau) - F(k)`` at ``ks[rows]`` and their Jacobian in the unknowns
    ``u = (c, tau, rho)``, or ``u = (tau, rho)`` with ``constant`` (a known c, a ball) given."""
    first = 0 if constant is not None else 1
    r = (len(u) - first) // 2
    c = constant if constant is not None else u[0]
    tau, rho = u[first:first + r], u[first + r:]
    residual = arb_mat(len(rows), 1)
    J = arb_mat(len(rows), len(u))
    for row, index in enumerate(rows):
        k = int(ks[index])
        inverse = [1 / (k + t) for t in tau]
        residual[row, 0] = c + sum((p * q for p, q in zip(rho, inverse)), arb(0)) - F[index]
        if first:
            J[row, 0] = arb(1)
        for h in range(r):
            J[row, first + h] = -rho[h] * inverse[h] ** 2
            J[row, first + r + h] = inverse[h]
    return residual, J


#: The Krawczyk step works at this multiple of the working precision (:func:`_certify`).
CERTIFY_PRECISION_FACTOR = 2


def _certify(u: list, ks: np.ndarray, F: np.ndarray, rows: np.ndarray, constant=None):
    """Newton-polish ``u`` on the square system at ``rows``, then enclose the exact solution.

    Krawczyk: with ``Y ~ J(u)^{-1}`` and a box ``X`` around ``u``, if
    ``K(X) = u - Y f(u) + (I - Y J(X)) (X - u)`` lies inside ``X`` then ``X`` holds exactly one
    solution, and it lies in ``K(X)``. Returns (balls, certified).

    Run at ``CERTIFY_PRECISION_FACTOR`` times the working precision: the test needs
    ``cond(J)^2`` times the box's radius well below one, and at the working precision the polish's
    own rounding (not the samples' one-ulp radii) made that radius: every H = 8 instance at 256
    bits failed (cond ~ 1e30..1e40). Sound at any precision; the samples keep their radii.
    """
    working = ctx.prec
    ctx.prec = CERTIFY_PRECISION_FACTOR * working
    try:
        return _krawczyk(u, ks, F, rows, constant)
    finally:
        ctx.prec = working


def _krawczyk(u: list, ks: np.ndarray, F: np.ndarray, rows: np.ndarray, constant=None):
    size = len(u)
    for _ in range(12):  # quadratic convergence from the barycentric start
        f, J = _system(u, ks, F, rows, constant)
        step = J.solve(f)
        u = [_mid(u[a] - step[a, 0]) for a in range(size)]
        if all(abs(step[a, 0].mid()) <= abs(u[a].mid()) * arb(2) ** -(ctx.prec - 8) for a in range(size)):
            break
    f, J = _system(u, ks, F, rows, constant)
    Y = arb_mat(size, size)
    inverse = J.inv()
    for a in range(size):
        for b in range(size):
            Y[a, b] = _mid(inverse[a, b])
    correction = Y * f
    identity = arb_mat(size, size)
    for a in range(size):
        identity[a, a] = arb(1)
    radius = [abs(correction[a, 0]).upper() * 2 + abs(u[a]).upper() * arb(2) ** -(ctx.prec - 16) for a in range(size)]
    for _ in range(4):  # epsilon-inflation: grow each radius to what K(X) needed, plus margin
        X = [arb(u[a].mid(), radius[a]) for a in range(size)]
        _, J_box = _system(X, ks, F, rows, constant)
        offset = arb_mat(size, 1)
        for a in range(size):
            offset[a, 0] = X[a] - u[a]
        K = (identity - Y * J_box) * offset
        K = [u[a] - correction[a, 0] + K[a, 0] for a in range(size)]
        if all(X[a].contains(K[a]) for a in range(size)):
            return K, True
        radius = [max(radius[a], abs(K[a] - u[a]).upper() * 2) * 2 for a in range(size)]
    # Not certified (Krawczyk needs cond(J)^2 * sample radius << 1; close poles can break that
    # at the oracle's precision): keep the polished midpoints with the first-order radius
    # |Y| rad(f) + |Y f|, and say so through the flag.
    first_order = [abs(correction[a, 0]).upper() * 2 for a in range(size)]
    return [arb(u[a].mid(), first_order[a]) for a in range(size)], False


def _fit_one(F: np.ndarray, ks: np.ndarray, poles: int, constant=None):
    """One instance: (c, log-poles, labels, imaginary, nonpositive, residual ball, certified) or raises."""
    u, imaginary = _approximate_fit(F, ks, poles, constant)
    # The first 2r + 1 samples (2r with c known) determine the fit; the rest check it.
    rows = np.arange(2 * poles + (0 if constant is not None else 1))
    balls, certified = _certify(u, ks, F, rows, constant)
    if constant is not None:
        balls = [constant] + list(balls)
    c, tau, rho = balls[0], balls[1:poles + 1], balls[poles + 1:]
    residual = arb(0)
    for k, value in zip(ks, F):
        model = c + sum((r / (int(k) + t) for r, t in zip(rho, tau)), arb(0))
        residual = max(residual, abs(model - value), key=lambda ball: float(ball.upper()))
    nonpositive = not all(t > 0 for t in tau)
    m = [arb("nan")] * poles if nonpositive else [t.log() for t in tau]
    labels = [r / t for r, t in zip(rho, tau)]
    return c, m, labels, (0.0 if certified else imaginary), nonpositive, residual, certified


def fit(samples: np.ndarray, ks: np.ndarray, poles: int, constant=None) -> InstanceFits:
    """Fit every row of ``samples`` (object array of balls, (n, K)) with ``poles`` poles;
    ``constant`` (n,) balls: the known c of each instance, or None to fit c too."""
    n, K = samples.shape
    c = np.empty(n, dtype=object)
    m = np.empty((n, poles), dtype=object)
    labels = np.empty((n, poles), dtype=object)
    imaginary = np.zeros(n)
    nonpositive = np.zeros(n, dtype=bool)
    residual = np.zeros(n)
    certified = np.zeros(n, dtype=bool)
    scale = np.maximum(magnitude_float(samples).max(axis=1), 1e-300)
    for row in range(n):
        if poles == 0:
            c[row] = constant[row] if constant is not None else sum(samples[row], arb(0)) / K
            residual[row] = max(float(abs(value - c[row]).upper()) for value in samples[row]) / scale[row]
            certified[row] = True
            continue
        try:
            c[row], m[row], labels[row], imaginary[row], nonpositive[row], res, certified[row] = _fit_one(
                samples[row], ks, poles, None if constant is None else constant[row])
            residual[row] = float(res.upper()) / scale[row]
        except (ValueError, ZeroDivisionError):  # singular solve or roots not isolated
            c[row] = arb("nan")
            m[row] = [arb("nan")] * poles
            labels[row] = [arb("nan")] * poles
            imaginary[row], nonpositive[row], residual[row] = np.inf, True, np.inf
    m_mid = mid_float(m)
    with np.errstate(invalid="ignore"):
        gaps = np.diff(m_mid, axis=1)
    pole_gap = np.min(np.abs(np.nan_to_num(gaps, nan=np.inf)), axis=1) if poles > 1 else np.full(n, np.inf)
    condition, sigma_m, sigma_l = sensitivities(ks, np.exp(m_mid), mid_float(labels), scale,
                                                constant_known=constant is not None, residual=residual)
    if poles == 0:
        condition = np.full(n, 1.0 / np.sqrt(K))
    return InstanceFits(c, m, labels, pole_gap, imaginary, nonpositive, residual, condition, sigma_m, sigma_l,
                        certified)


def _mat(array: np.ndarray) -> arb_mat:
    rows, cols = array.shape
    out = arb_mat(rows, cols)
    for a in range(rows):
        for b in range(cols):
            value = array[a, b]
            out[a, b] = value if isinstance(value, arb) else arb(float(value))
    return out


def _array(matrix: arb_mat) -> np.ndarray:
    out = np.empty((matrix.nrows(), matrix.ncols()), dtype=object)
    for a in range(matrix.nrows()):
        for b in range(matrix.ncols()):
            out[a, b] = matrix[a, b]
    return out


def solve_transposed(Z: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``Z^{-T} rhs`` in ball arithmetic, rhs (d,) or (d, m) of balls."""
    rhs = np.asarray(rhs, dtype=object)
    column = rhs.ndim == 1
    out = _array(_mat(np.asarray(Z).T).solve(_mat(rhs[:, None] if column else rhs)))
    return out[:, 0] if column else out


def assemble(Z: np.ndarray, X: np.ndarray, M: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``W_h = Z^{-T} M_h X^{-1}`` and ``v_h = Z^{-T} l_h`` in balls; M (H, d, F), X (F, F), labels (H, d).

    F = d, or d + 1 with the lifted final tokens of the biased grid (docs/algorithm.md, 'Biases: affine scores and an
    output constant'): then ``W_h`` is ``[W_h | u_h]``."""
    Zt = _mat(np.asarray(Z).T)
    Xt = _mat(np.asarray(X).T)
    H, d = labels.shape
    W = np.empty((H, d, np.shape(X)[1]), dtype=object)
    for h in range(H):
        left = Zt.solve(_mat(M[h]))  # Z^{-T} M_h
        W[h] = _array(Xt.solve(left.transpose()).transpose())  # (Z^{-T} M_h) X^{-1}
    v = solve_transposed(Z, labels.T).T if H else np.zeros((0, d), dtype=object)
    return W, v


def dot(vector: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``vector^T p`` in balls for each column p of ``points`` (d, m) (floats, exact)."""
    d, count = points.shape
    return np.array([sum((vector[a] * arb(float(points[a, col])) for a in range(d)), arb(0)) for col in range(count)],
                    dtype=object)
