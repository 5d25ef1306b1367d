"""Refinement of a rotary model by damped Gauss-Newton on fresh queries (docs/algorithm.md, 'Rotary attention:
positions, grouped heads and sliding windows', 'Refinement').

The parameters ``theta_vec = (Q, K, b, theta, v, c)`` (and the key bias k, where the model has
one) of a scalar :class:`RotaryAttention` enter
the answer of a query X through its scores; with ``a_{h,j}`` the attention weights, ``m_h`` the
head means and ``g_{h,j} = a_{h,j} (v_h^T x_j - v_h^T m_h)`` the sensitivity of f to the score of
key j,

    df/dK_h = sum_j g_{h,j} (R_h(delta_j) q_h) x_j^T,     q_h = Q_h x_N + b_h,
    df/dk_h = sum_j g_{h,j} R_h(delta_j) q_h,           k_{h,j} = K_h x_j + k_h,
    df/dQ_h = (sum_j g_{h,j} R_h(delta_j)^T k_{h,j}) x_N^T,  df/db_h = sum_j g_{h,j} R_h(delta_j)^T k_{h,j},
    df/dtheta_{h,m} = sum_j g_{h,j} delta_j k_{h,j,m}^T rot'(delta_j theta_{h,m}) q_{h,m},
    df/dv_h = m_h,   df/dc = 1.

The factors are determined up to a rotation and a scale per block (``(K_m, Q_m) -> (S K_m,
S^{-T} Q_m)`` with S a scaled rotation), so the Jacobian has a null space of that dimension; the
Levenberg-Marquardt damping keeps the steps out of it. The first-order error of the score
matrices and values is measured by drawing parameter errors from ``sigma^2 (J^T J)^{-1}``
(``sigma`` the residual's root mean square) and mapping them through ``W_h(0..2)`` and ``v``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mpmath
import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.linalg.blas import dsyrk

from ..numerics.highprec import GUARD_BITS, mpf_array
from ..run.value_fit import DRAW_SAFETY
from ..models.rotary import RotaryAttention


@dataclass
class RotaryRefinement:
    """What the refinement did.

    Attributes
    ----------
    queries : fresh queries fitted. iterations : Gauss-Newton steps taken.
    residual_before, residual_after : max misfit on the fresh queries, relative to the largest answer.
    noise_error : the first-order error of ``W_h(0..2)`` and ``v`` from the residual's size (relative).
    error_draws : (draws, parameters) parameter errors drawn from ``sigma^2 (J^T J + eps)^{-1}`` at
        the refined model (:func:`error_draws`), or None where no estimate was made; a whole
        layer's value fit maps them through its own fit (:func:`error_moves`).
    """

    queries: int
    iterations: int
    residual_before: float
    residual_after: float
    noise_error: float
    error_draws: np.ndarray | None = field(default=None, repr=False, compare=False)


def pack(model: RotaryAttention) -> np.ndarray:
    """The parameters as one vector: Q, K, b, theta, v, c, and the key bias where the model has one."""
    parts = [model.Q.ravel(), model.K.ravel(), model.b.ravel(), model.theta.ravel(), model.v.ravel(), [model.c]]
    return np.concatenate(parts + ([] if model.key_bias is None else [model.key_bias.ravel()]))


def _offsets(like: RotaryAttention) -> np.ndarray:
    """Where each part of :func:`pack`'s vector starts, in its order (Q, K, b, theta, v, c, key bias),
    and its end."""
    H, r, d = like.Q.shape
    return np.cumsum([0, H * r * d, H * r * d, H * r, H * (r // 2), H * d, 1]
                     + ([] if like.key_bias is None else [H * r]))


def unpack(vector: np.ndarray, like: RotaryAttention) -> RotaryAttention:
    """The model of a parameter vector (float64, or ``mpf`` for a high-precision model)."""
    H, r, d = like.Q.shape
    parts = np.split(vector, _offsets(like)[1:-1])
    return RotaryAttention(parts[0].reshape(H, r, d), parts[1].reshape(H, r, d), parts[3].reshape(H, r // 2),
                           parts[4].reshape(H, d), parts[5][0], like.window, parts[2].reshape(H, r),
                           None if like.key_bias is None else parts[6].reshape(H, r))


def jacobian(model: RotaryAttention, X: np.ndarray, cluster=None) -> tuple[np.ndarray, np.ndarray]:
    """``(f, J)`` for sequences X (B, N, d) of one length: answers (B,) and df/dparameters (B, P).
    ``cluster`` (one array of rows per head, their blocks at theta = 0): J gains the columns
    ``df/dOmega_h[a, a'] = sum_j g_{h,j} delta_j k_{h,j,a} q_{h,a'}`` (a, a' in the head's rows),
    the first-order effect of a generator ``Omega_h`` in ``k^T (I + delta Omega_h) q``
    (:func:`seed_low_frequencies`)."""
    B, N, d = X.shape
    H, r, _ = model.Q.shape
    offsets = np.arange(N - 1, -1, -1, dtype=np.float64)
    window = np.ones(N, bool) if model.window is None else offsets < model.window
    keys = np.einsum("hrd,bnd->bhnr", model.K, X) + model.key_bias_or_zero[None, :, None]  # k_{h,j}
    query = np.einsum("hrd,bd->bhr", model.Q, X[:, -1]) + model.b          # q_h
    angles = offsets[:, None, None] * model.theta[None]                    # (N, H, r/2)
    cos, sin = np.cos(angles).transpose(1, 0, 2), np.sin(angles).transpose(1, 0, 2)  # (H, N, r/2)
    q = query.reshape(B, H, 1, r // 2, 2)
    rotated_q = np.stack([cos * q[..., 0] - sin * q[..., 1], sin * q[..., 0] + cos * q[..., 1]], -1)  # R q
    scores = np.einsum("bhnr,bhnr->bhn", keys, rotated_q.reshape(B, H, N, r))
    scores = np.where(window, scores, -np.inf)
    scores -= scores.max(axis=2, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=2, keepdims=True)                          # a_{h,j}
    values = np.einsum("hd,bnd->bhn", model.v, X)                           # v_h^T x_j
    head_out = (weights * values).sum(axis=2)                               # v_h^T m_h
    f = head_out.sum(axis=1) + model.c
    g = weights * (values - head_out[:, :, None])                           # (B, H, N)
    dK = np.einsum("bhn,bhnr,bnd->bhrd", g, rotated_q.reshape(B, H, N, r), X)
    k = keys.reshape(B, H, N, r // 2, 2)
    back = np.stack([cos * k[..., 0] + sin * k[..., 1], -sin * k[..., 0] + cos * k[..., 1]], -1)  # R^T k
    db = np.einsum("bhn,bhnr->bhr", g, back.reshape(B, H, N, r))
    dQ = db[:, :, :, None] * X[:, -1][:, None, None, :]
    # d(k^T rot(phi) q)/dphi = k^T rot'(phi) q, rot'(phi) = [[-sin, -cos], [cos, -sin]], phi = delta theta
    dphase = (k[..., 0] * (-sin * q[..., 0] - cos * q[..., 1]) + k[..., 1] * (cos * q[..., 0] - sin * q[..., 1]))
    dtheta = np.einsum("bhn,bhnm,n->bhm", g, dphase, offsets)
    dv = np.einsum("bhn,bnd->bhd", weights, X)
    columns = [dQ.reshape(B, -1), dK.reshape(B, -1), db.reshape(B, -1), dtheta.reshape(B, -1),
               dv.reshape(B, -1), np.ones((B, 1))]
    if model.key_bias is not None:
        columns.append(np.einsum("bhn,bhnr->bhr", g, rotated_q.reshape(B, H, N, r)).reshape(B, -1))
    for h, rows in enumerate(cluster or []):
        # sum_j g delta k_a, then the outer product with q: a four-operand einsum would loop over b, n, a, a'
        moment = np.einsum("bn,bna->ba", g[:, h] * offsets, keys[:, h][..., rows])
        columns.append((moment[:, :, None] * query[:, h][:, None, rows]).reshape(B, -1))
    return f, np.concatenate(columns, axis=1)


#: Entries of the Jacobian formed at once (the normal equations are summed block by block, so the
#: refinement holds P^2 numbers and one block, never the whole (queries, P) Jacobian).
BLOCK_ENTRIES = 2 ** 24


def length_groups(sequences, parameters: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The queries as ``[(index, X (B, N, d))]`` blocks of one length, at most ``BLOCK_ENTRIES /
    parameters`` rows each, in the order of the queries within each length."""
    lengths = np.array([len(X) for X in sequences])
    rows = max(1, BLOCK_ENTRIES // max(parameters, 1))
    groups = []
    for n in np.unique(lengths):
        index = np.flatnonzero(lengths == n)
        for part in range(0, len(index), rows):
            chunk = index[part:part + rows]
            groups.append((chunk, np.stack([sequences[i] for i in chunk])))
    return groups


def predict(model: RotaryAttention, groups) -> np.ndarray:
    """The model's answers over length groups, in the order of the queries."""
    f = np.empty(sum(len(index) for index, _ in groups))
    for index, X in groups:
        f[index] = model(list(X))
    return f


def _blocks(model: RotaryAttention, groups, cluster=None):
    """``(index, f, J)`` for every block: the model's answers and Jacobian at its queries."""
    for index, X in groups:
        f, J = jacobian(model, X, cluster)
        yield index, f, J


def marquardt_scale(normal: np.ndarray) -> np.ndarray:
    """The damping's diagonal ``D``: ``diag(J^T J)``, floored above zero relative to its largest entry."""
    return np.maximum(np.diag(normal), 1e-300 * max(np.diag(normal).max(), 1e-300))


def add_gram(normal: np.ndarray, J: np.ndarray) -> None:
    """``normal += J^T J`` in ``normal``'s upper triangle (a column-major (P, P) array; the lower is
    left to :func:`symmetric_from_upper`). BLAS syrk on a column-major copy of J forms only the
    ``Q P^2 / 2`` products of one triangle from contiguous columns: at d = 64, H = 4 (P = 8,545) it
    takes about 0.6 of the time numpy's ``J.T @ J`` (syrk on the row-major block) takes on one core."""
    dsyrk(1.0, np.asfortranarray(J), beta=1.0, c=normal, trans=1, overwrite_c=True)


def symmetric_from_upper(normal: np.ndarray, width: int = 1024) -> np.ndarray:
    """The symmetric matrix of an upper triangle, in place, a band of ``width`` columns at a time
    (no P^2 temporary beside it)."""
    for start in range(0, normal.shape[0], width):
        stop = min(start + width, normal.shape[0])
        normal[start:stop, :start] = normal[:start, start:stop].T
        block = normal[start:stop, start:stop]
        lower = np.tril_indices(stop - start, -1)
        block[lower] = block.T[lower]
    return normal


def normal_equations(model: RotaryAttention, groups, answers: np.ndarray, probes: np.ndarray | None = None,
                     cluster=None, product: bool = True):
    """``(residual, J^T J, J^T residual, J^T probes)`` summed over the blocks (residual ``f - answers``
    in the order of the queries; ``probes`` (queries, k) or None; ``cluster`` as in :func:`jacobian`).
    ``product=False``: ``J^T J`` is not formed (None), the gradient alone, at a fraction of the cost
    (``Q P`` against ``Q P^2`` flops)."""
    residual = np.empty(len(answers))
    normal = gradient = projected = None
    for index, f, J in _blocks(model, groups, cluster):
        residual[index] = f - answers[index]
        if gradient is None:
            normal = np.zeros((J.shape[1], J.shape[1]), order="F") if product else None
            gradient = np.zeros(J.shape[1])
            projected = None if probes is None else np.zeros((J.shape[1], probes.shape[1]))
        if product:
            add_gram(normal, J)
        gradient += J.T @ residual[index]
        if probes is not None:
            projected += J.T @ probes[index]
    return residual, None if normal is None else symmetric_from_upper(normal), gradient, projected


def transpose_product(model: RotaryAttention, groups, vector: np.ndarray) -> np.ndarray:
    """``J^T vector`` (vector in the order of the queries), block by block."""
    return sum(J.T @ vector[index] for index, _, J in _blocks(model, groups))


def acceleration(model: RotaryAttention, vector: np.ndarray, step: np.ndarray, residual: np.ndarray, groups,
                 answers: np.ndarray, factor) -> np.ndarray:
    """The geodesic acceleration of a step ``-step`` (Transtrum and Sethna): with ``r''`` the
    second directional derivative of the residual along the step (a central difference at
    ``h = 0.1``), ``a = -(J^T J + lambda D)^{-1} J^T r''``, ``factor`` that matrix's Cholesky factor."""
    h = 0.1
    ahead = predict(unpack(vector - h * step, model), groups) - answers
    behind = predict(unpack(vector + h * step, model), groups) - answers
    curvature = (ahead - 2 * residual + behind) / h ** 2
    return -cho_solve(factor, transpose_product(model, groups, curvature))


#: With float32 answers a start's blocks turning less than this per position are seeded again
#: (:func:`seed_low_frequencies`): their angles and planes come from eigenvalues of M within the
#: noise of 1 (an angle of 3e-4 beside noise of 1e-3), and over the fresh queries' offsets (at most
#: 63) they turn by half a radian at most, where the first-order generator holds.
LOW_FREQUENCY = 8e-3


def seed_low_frequencies(model: RotaryAttention, sequences, answers: np.ndarray,
                         limit: float = LOW_FREQUENCY) -> tuple[RotaryAttention, int]:
    """The model with its slow blocks (``theta < limit``) seeded again from one Gauss-Newton step on
    their first-order generator; returns ``(model, blocks seeded)``, the model unchanged where the
    step does not lower the cost.

    Notes
    -----
    At ``theta = 0`` a block's factors are determined only up to ``(K_m, Q_m) -> (S K_m, S^{-T}
    Q_m)`` for any invertible S, not only the scaled rotations that commute with ``R``: a block
    whose angle starts at or near 0 in a wrong basis is told its basis only through terms of order
    ``theta delta``, and Levenberg-Marquardt crawls (docs/algorithm.md, 'Slow blocks'). The slow blocks
    of a head (rows c) are taken together at ``theta = 0`` with a generator ``Omega_h`` (|c| x |c|)
    in their place, ``k_c^T (I + delta Omega_h) q_c``, which enters linearly: one damped
    Gauss-Newton step fits ``Omega_h`` with every other parameter. Its real form
    ``Omega_h T = T blockdiag(theta_m J)`` gives the angles and the planes: ``K_c <- T^T K_c``,
    ``Q_c <- T^{-1} Q_c``, ``b_c <- T^{-1} b_c``.
    """
    H, r, d = model.Q.shape
    slow = model.theta < limit                                            # (H, r/2)
    cluster = [np.flatnonzero(np.repeat(slow[h], 2)) for h in range(H)]
    if not any(len(rows) for rows in cluster):
        return model, 0
    flat = model.replaced(theta=np.where(slow, 0.0, model.theta))
    vector = pack(flat)
    P = len(vector)
    extra = sum(len(rows) ** 2 for rows in cluster)
    groups = length_groups(sequences, P + extra)
    _, normal, gradient, _ = normal_equations(flat, groups, np.asarray(answers, np.float64), cluster=cluster)
    before = predict(model, groups) - answers
    best, best_cost = model, float(before @ before)
    # the slow blocks' angles are in the generator now: their own columns are left out of the step
    offsets = _offsets(flat)
    theta_index = offsets[3] + np.arange(H * (r // 2)).reshape(H, r // 2)
    fixed = theta_index[slow]
    if flat.key_bias is not None:
        # a key bias scores every key alike at theta = 0, so its slow rows' columns are zero there;
        # its other rows are the refinement's to fit, under its prior (:func:`refine`): unweighed
        # here, they took up a d = 64 start's error in keys of up to 0.09
        fixed = np.concatenate([fixed, np.arange(offsets[6], P)])
    free = np.setdiff1d(np.arange(P + extra), fixed)
    normal, gradient = normal[np.ix_(free, free)], gradient[free]
    diagonal = marquardt_scale(normal)
    for damping in (1e-9, 1e-7, 1e-5, 1e-3, 1e-1):
        try:
            step = np.zeros(P + extra)
            step[free] = cho_solve(cho_factor(normal + damping * np.diag(diagonal)), gradient)
        except np.linalg.LinAlgError:
            continue
        trial = _from_generators(unpack(vector - step[:P], flat), -step[P:], cluster)
        trial_residual = predict(trial, groups) - answers
        trial_cost = float(trial_residual @ trial_residual)
        if np.isfinite(trial_cost) and trial_cost < best_cost:
            best, best_cost = trial, trial_cost
    return best, int(slow.sum()) if best is not model else 0


def _from_generators(model: RotaryAttention, generators: np.ndarray, cluster) -> RotaryAttention:
    """The model with each head's slow rows turned into rotation blocks by the real form of its
    generator (:func:`seed_low_frequencies`)."""
    Q, K, b, theta, key_bias = model.Q.copy(), model.K.copy(), model.b.copy(), model.theta.copy(), model.key_bias
    start = 0
    for h, rows in enumerate(cluster):
        k = len(rows)
        if not k:
            continue
        omega = generators[start:start + k * k].reshape(k, k)
        start += k * k
        values, vectors = np.linalg.eig(omega)
        columns, angles = [], []
        for index in np.flatnonzero(values.imag > 0):
            columns.append(np.stack([vectors[:, index].real, -vectors[:, index].imag], axis=1))
            angles.append(float(values[index].imag))
        real = np.flatnonzero(values.imag == 0)                           # noise: pairs at angle 0
        columns += [vectors[:, real[i:i + 2]].real for i in range(0, len(real) - 1, 2)]
        angles += [0.0] * (len(real) // 2)
        T = np.hstack(columns)
        if T.shape != (k, k) or np.linalg.cond(T) > 1e12:
            continue
        inverse = np.linalg.inv(T)
        K[h, rows], Q[h, rows], b[h, rows] = T.T @ K[h, rows], inverse @ Q[h, rows], inverse @ b[h, rows]
        if key_bias is not None:  # a key row's bias turns with it
            key_bias = key_bias.copy()
            key_bias[h, rows] = T.T @ key_bias[h, rows]
        theta[h, rows[::2] // 2] = angles
    return model.replaced(Q=Q, K=K, theta=theta, b=b, key_bias=key_bias)


def refinement_memory(parameters: int, queries: int, precision: int | None = None) -> int:
    """Bytes the refinement holds at once, about: J^T J, its damped copy and Cholesky factor, and
    one block of the Jacobian with the einsum intermediates beside it; at ``precision`` bits, the
    larger of that and :func:`polish_high_precision`'s whole Jacobian with its SVD (J, U, V^T)."""
    levenberg = 8 * (3 * parameters ** 2 + 4 * min(BLOCK_ENTRIES, queries * parameters))
    if precision is None:
        return levenberg
    return max(levenberg, 8 * (2 * queries * parameters + parameters ** 2))


def refine(model: RotaryAttention, sequences, answers: np.ndarray, iterations: int = 60, seed=0,
           on_step=None, floor: float = 1e-13, estimate: bool = True, frame_shift=None, key_size: float | None = None):
    """Levenberg-Marquardt with geodesic acceleration (:func:`acceleration`) on
    ``sum_q (f(X_q) - answer_q)^2``; returns ``(model, RotaryRefinement)``.
    ``on_step(step, misfit)``, if given, hears of every accepted step (a progress display). After a
    step that lowers the cost by ``REUSE_GAIN`` or more the next solves with the same ``J^T J`` and
    the model's own gradient (a chord step: same fixed point, ``J^T J = sum_q J_q^T J_q`` not formed
    again). The steps stop once the max misfit (relative to the largest answer) is below ``floor``,
    the answers' rounding, and a step on a fresh ``J^T J`` gains less than a tenth of the cost or
    fails, or any such step gains less than 1e-9 of it. ``estimate=False``: no error estimate (``noise_error`` NaN), for a stretch of steps
    the caller continues. ``frame_shift``: the estimate is of the score matrices of the model seen
    through ``x -> x + frame_shift`` (a key-bias run's original tokens, docs/algorithm.md, 'Rotary attention: positions,
    grouped heads and sliding windows'). ``key_size``: the model's key bias k has a Gaussian prior of this size sigma_k
    against the misfit's root mean square sigma, ``(sigma / sigma_k)^2 |k|^2`` joining the cost, sigma taken
    afresh at every step: far from the answers the misfit is the model's error, and a prior weighed
    against the answers' rounding alone would let the first steps trade a slow block's angle for a
    key (theta -> 0, k large) that the later steps cannot undo."""
    answers = np.asarray(answers, dtype=np.float64)
    vector = pack(model)
    groups = length_groups(sequences, len(vector))
    scale = max(float(np.abs(answers).max()), 1e-300)
    # a Gaussian prior on the key bias: (sigma / key_size)^2 |k|^2 added to the cost, sigma the
    # misfit's root mean square at the step, and to the normal matrix of the estimate
    prior = (np.arange(_offsets(model)[6], len(vector)) if model.key_bias is not None and key_size
             else np.arange(0))

    def prior_weight(residual):
        return float(residual @ residual) / len(residual) / key_size ** 2 if len(prior) else 0.0

    def with_prior(normal, gradient, vector):
        normal[prior, prior] += weight
        gradient[prior] += weight * vector[prior]
        return normal, gradient

    def penalised(residual, vector):  # the cost: squared misfit and the prior at this step's weight
        return float(residual @ residual) + weight * float(vector[prior] @ vector[prior])

    residual, normal, gradient, _ = normal_equations(model, groups, answers)
    weight = prior_weight(residual)
    normal, gradient = with_prior(normal, gradient, vector)
    before = float(np.abs(residual).max()) / scale
    cost = penalised(residual, vector)
    damping = 1e-3
    taken = 0
    stale = False  # whether ``normal`` was formed at an earlier model than the gradient's
    for _ in range(iterations):
        diagonal = marquardt_scale(normal)
        improved = False
        tries = 0
        while tries < 12:
            tries += 1
            try:
                factor = cho_factor(normal + damping * np.diag(diagonal))
                step = cho_solve(factor, gradient)
            except np.linalg.LinAlgError:
                damping *= 10
                continue
            if not stale:
                # the step bent along the valley: along the curved valleys of nearly equal or nearly
                # zero frequencies plain steps crawl at a damping the quadratic model allows but the
                # valley does not; an acceleration large beside the step (at the answers' rounding: a
                # difference of rounding errors) is not taken, and the step is the plain one
                bend = acceleration(model, vector, step, residual, groups, answers, factor)
                size = np.sqrt(diagonal)
                if 2 * np.linalg.norm(size * bend) <= ACCELERATION_RATIO * np.linalg.norm(size * step):
                    step = step - 0.5 * bend
            trial = unpack(vector - step, model)
            trial_residual = predict(trial, groups) - answers
            trial_cost = penalised(trial_residual, vector - step)
            if np.isfinite(trial_cost) and trial_cost < cost:
                relative = (cost - trial_cost) / max(cost, 1e-300)
                vector, model, residual, cost = vector - step, trial, trial_residual, trial_cost
                damping = max(damping / 10, 1e-15)
                improved = True
                break
            if stale:  # the older J^T J may be what failed, not the damping: formed afresh, the same damping
                residual, normal, gradient, _ = normal_equations(model, groups, answers)
                normal, gradient = with_prior(normal, gradient, vector)
                diagonal = marquardt_scale(normal)
                stale, tries = False, tries - 1
                continue
            if float(np.abs(residual).max()) / scale < floor:  # at the answers' rounding: no step gains
                break
            damping *= 10
        if not improved:
            break
        taken += 1
        if on_step is not None:
            on_step(taken, float(np.abs(residual).max()) / scale)
        # the stop rules judge steps on a fresh J^T J: a step on an older one gains less where the older
        # matrix, not the model, is what limits it
        at_rounding = relative < 0.1 and float(np.abs(residual).max()) / scale < floor
        if (at_rounding or relative < 1e-9) and not stale:
            break
        # a step that took the cost down by at least REUSE_GAIN keeps J^T J for the next (a chord
        # step, docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows',
        # 'Refinement'): the gradient is always the model's own, so the fixed point is the same
        stale = relative >= REUSE_GAIN
        residual, fresh, gradient, _ = normal_equations(model, groups, answers, product=not stale)
        weight = prior_weight(residual)
        if stale:  # the prior's weight of an older step stays in the older J^T J
            gradient[prior] += weight * vector[prior]
        else:
            normal, gradient = with_prior(fresh, gradient, vector)
        cost = penalised(residual, vector)
    if not estimate:  # a first stretch of steps, continued by the caller: no estimate of it is used
        return model, RotaryRefinement(len(sequences), taken, before, float(np.abs(residual).max()) / scale, np.nan)
    draws = np.random.default_rng(seed).standard_normal((len(answers), NOISE_DRAWS))
    residual, normal, _, projected = normal_equations(model, groups, answers, draws)
    normal[prior, prior] += prior_weight(residual)
    errors = error_draws(normal, projected, residual)
    return model, RotaryRefinement(len(sequences), taken, before, float(np.abs(residual).max()) / scale,
                                   _noise_error(model, errors, frame_shift), errors)


def polish_high_precision(model: RotaryAttention, sequences, answers: np.ndarray, precision: int,
                          iterations: int = 40, seed=0, on_step=None):
    """Newton steps at ``precision`` bits from a float64 fit (docs/algorithm.md, 'High precision'); returns
    ``(model, RotaryRefinement)`` with an ``mpf`` model.

    Iterative refinement: the residual ``r = f(X_q; theta) - answer_q`` of the high-precision
    parameters is computed in ball arithmetic, the step ``J^+ r`` in float64 with the pseudo-inverse
    of the Jacobian at the float64 fit (its gauge directions, singular values below
    ``PSEUDO_INVERSE_CUT`` of the largest, left out: they move no answer). A step divides the error
    by about ``cond(J) u`` (``u = 2^-53``), until the residual reaches the answers' rounding at
    ``precision`` bits; the steps stop once one fails to halve the largest misfit. ``answers``:
    ``mpf`` (the oracle's, exact). The whole Jacobian (queries x parameters, float64) is held: a
    high-precision run is for layers whose evaluation in ball arithmetic is affordable, far below
    that size."""
    float_model = model.to_float64()
    parameters = len(pack(float_model))
    groups = length_groups(sequences, parameters)
    J = np.empty((len(sequences), parameters))
    for index, X in groups:
        J[index] = jacobian(float_model, X)[1]
    U, S, Vt = np.linalg.svd(J, full_matrices=False)
    keep = S > PSEUDO_INVERSE_CUT * S[0]
    scale = max(float(np.abs(np.asarray(answers, dtype=np.float64)).max()), 1e-300)
    working = int(precision) + GUARD_BITS

    def misfit(vector: np.ndarray) -> np.ndarray:
        predicted = unpack(vector, model)(sequences, precision=working)
        with mpmath.workprec(working):
            return np.array([float(p - a) for p, a in zip(predicted, answers)])

    with mpmath.workprec(working):
        vector = mpf_array(pack(model))
    residual = misfit(vector)
    before = best = float(np.abs(residual).max())
    taken = 0
    for _ in range(iterations):
        step = Vt[keep].T @ ((U[:, keep].T @ residual) / S[keep])
        with mpmath.workprec(working):
            trial = vector - mpf_array(step)
        trial_residual = misfit(trial)
        worst = float(np.abs(trial_residual).max())
        if not worst <= best / 2:  # at the answers' rounding, or beyond the float64 step's reach
            break
        vector, residual, best = trial, trial_residual, worst
        taken += 1
        if on_step is not None:
            on_step(taken, best / scale)
    draws = np.random.default_rng(seed).standard_normal((len(sequences), NOISE_DRAWS))
    errors = error_draws(J.T @ J, J.T @ draws, residual)
    return unpack(vector, model), RotaryRefinement(len(sequences), taken, before / scale, best / scale,
                                                   _noise_error(float_model, errors), errors)


#: Singular values of the Jacobian below this fraction of the largest are its gauge directions (the
#: rotation and scale of each block, zero but for rounding) in :func:`polish_high_precision`.
PSEUDO_INVERSE_CUT = 1e-12
#: The least relative fall of the cost, ``(cost - new cost) / cost``, of a step after which the next
#: one solves with the same J^T J (a chord step: the gradient afresh, no product, no acceleration).
REUSE_GAIN = 0.5
#: The largest ratio ``2 |a| / |v|`` (scaled norms) of a step's acceleration to its velocity.
ACCELERATION_RATIO = 0.75
#: Parameter-error draws of the first-order error estimate.
NOISE_DRAWS = 8


def error_draws(normal: np.ndarray, projected: np.ndarray, residual: np.ndarray) -> np.ndarray | None:
    """Parameter errors drawn from ``sigma^2 (J^T J + eps)^{-1}``, (draws, parameters): ``sigma`` the
    residual's root mean square, the gauge directions damped by ``eps`` (they move no score matrix),
    ``projected = J^T Z`` for standard normal Z (queries, draws), since ``(J^T J)^{-1} J^T z`` is
    distributed as ``N(0, (J^T J)^{-1})``. None where ``J^T J`` is not positive definite."""
    columns = normal.shape[0]
    sigma = float(np.sqrt(residual @ residual / max(1, len(residual) - columns)))
    ridge = 1e-10 * np.diag(normal).max()
    try:
        factor = cho_factor(normal + ridge * np.eye(columns))
    except np.linalg.LinAlgError:
        return None
    return cho_solve(factor, projected).T * sigma


def error_moves(model: RotaryAttention, errors: np.ndarray) -> list[tuple[RotaryAttention, float]]:
    """The model moved by each drawn parameter error stretched to a move of ``LINEARISATION_STEP``
    of its largest parameter, with the stretch: ``(moved, stretch)`` pairs, through which any map of
    the parameters is taken to first order (its change divided by the stretch). An error below
    float64's rounding of the parameters, as in a high-precision run, is stretched up and so still
    shows; draws of zero are left out."""
    vector = pack(model)
    reach = LINEARISATION_STEP * max(float(np.abs(vector).max()), 1e-300)
    moves = []
    for error in errors:
        size = float(np.abs(error).max())
        if size > 0 and np.isfinite(size):
            moves.append((unpack(vector + (reach / size) * error, model), reach / size))
    return moves


def _noise_error(model: RotaryAttention, errors: np.ndarray | None, frame_shift=None) -> float:
    """Relative error of ``W_h(0..2)`` and ``v``: ``DRAW_SAFETY`` times the largest first-order
    change of either under the drawn parameter errors (:func:`error_draws`); with ``frame_shift``,
    of the score matrices of the models seen through ``x -> x + frame_shift``."""
    if errors is None or not np.isfinite(errors).all():
        return np.inf

    def matrices(m: RotaryAttention) -> np.ndarray:
        return (m if frame_shift is None else m.with_token_shift(frame_shift)).identifying_matrices()

    base_W, base_v = matrices(model), model.v
    W_scale, v_scale = max(float(np.abs(base_W).max()), 1e-300), max(float(np.abs(base_v).max()), 1e-300)
    worst = 0.0
    for moved, stretch in error_moves(model, errors):
        worst = max(worst, float(np.abs(matrices(moved) - base_W).max()) / W_scale / stretch,
                    float(np.abs(moved.v - base_v).max()) / v_scale / stretch)
    return DRAW_SAFETY * worst


#: Relative size of the parameter move through which the first-order error is mapped.
LINEARISATION_STEP = 1e-6
