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


def pack(model) -> np.ndarray:
    """The parameters as one vector: Q, K, b, theta, v, c, and the key bias where the model has one;
    of a :class:`GeneratorForm`, its flat model's without the held angles, then each head's generator."""
    if isinstance(model, GeneratorForm):
        return model.vector()
    parts = [model.Q.ravel(), model.K.ravel(), model.b.ravel(), model.theta.ravel(), model.v.ravel(), [model.c]]
    return np.concatenate(parts + ([] if model.key_bias is None else [model.key_bias.ravel()]))


def _offsets(like: RotaryAttention) -> np.ndarray:
    """Where each part of :func:`pack`'s vector starts, in its order (Q, K, b, theta, v, c, key bias),
    and its end."""
    H, r, d = like.Q.shape
    return np.cumsum([0, H * r * d, H * r * d, H * r, H * (r // 2), H * d, 1]
                     + ([] if like.key_bias is None else [H * r]))


def unpack(vector: np.ndarray, like):
    """The model of a parameter vector (float64, or ``mpf`` for a high-precision model), of ``like``'s kind."""
    if isinstance(like, GeneratorForm):
        return like.of_vector(vector)
    H, r, d = like.Q.shape
    parts = np.split(vector, _offsets(like)[1:-1])
    return RotaryAttention(parts[0].reshape(H, r, d), parts[1].reshape(H, r, d), parts[3].reshape(H, r // 2),
                           parts[4].reshape(H, d), parts[5][0], like.window, parts[2].reshape(H, r),
                           None if like.key_bias is None else parts[6].reshape(H, r))


def key_bias_index(model) -> np.ndarray:
    """Where the key bias's free entries sit in :func:`pack`'s vector (empty where the model has none)."""
    if isinstance(model, GeneratorForm):
        return model.key_bias_index()
    return np.arange(0) if model.key_bias is None else np.arange(*_offsets(model)[6:8])


#: Blocks turning less than this per position are fitted first as one exact generator per head
#: (:class:`GeneratorForm`) where the start's angles and planes come from noisy log-scores: over the
#: polish queries' offsets (at most 63) they turn by at most about pi, where M's eigenvalues hold
#: their angles within the noise and a block's plane is told apart from its neighbours' only through
#: terms of order ``theta delta`` (docs/algorithm.md, 'Slow blocks from float32 answers').
GENERATOR_LIMIT = 5e-2
#: ``rot'(0)``: a rotation block's generator at unit angle, ``d R(phi) / d phi`` at 0.
QUARTER_TURN = np.array([[0.0, -1.0], [1.0, 0.0]])


class GeneratorForm:
    """A rotary model whose slow blocks are one exact generator per head (docs/algorithm.md, 'Rotary
    attention: positions, grouped heads and sliding windows', 'Slow blocks from float32 answers').

    Head h's rows ``c = cluster[h]`` (its blocks with ``theta < limit``) score
    ``k_c^T expm(delta Omega_h) q_c`` with ``Omega_h`` any (|c|, |c|) matrix; the other rows as
    ``flat``, whose angles on the rows c are 0 and held there, as is a key bias on them (``held``:
    their places in ``pack(flat)``): near ``Omega_h = 0`` a key bias's rows c score every key alike,
    so their columns are nearly zero, and a Gauss-Newton step would take them anywhere. Rotary blocks
    are the case ``Omega_h = blockdiag(theta_m J)``; in this form the rows' basis is a gauge,
    ``(K_c, Q_c, Omega_h) -> (S K_c, S^{-T} Q_c, S^{-T} Omega_h S^T)``, so a step that moves the
    blocks' planes within the rows c moves ``Omega_h`` linearly instead of turning factors of order
    one. :meth:`to_rotary` gives the rotary model back by the real form of each generator.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> from mhaextract.rotary.refine import GeneratorForm
    >>> model = mx.RotaryAttention.random(d=8, heads=2, head_width=8, seed=0)
    >>> form = GeneratorForm.of(model, limit=0.05)
    >>> [len(rows) for rows in form.cluster]                  # the blocks at 1e-2 and 1e-3
    [4, 4]
    >>> X = np.random.default_rng(1).normal(size=(3, 40, 8))
    >>> bool(np.allclose(form(X), model(X)) and np.allclose(form.to_rotary()(X), model(X)))
    True
    """

    def __init__(self, flat: RotaryAttention, cluster: list, omegas: list):
        self.flat, self.cluster, self.omegas = flat, cluster, omegas
        H, r, _ = flat.Q.shape
        offsets = _offsets(flat)
        held = [offsets[3] + h * (r // 2) + m for h, rows in enumerate(cluster) for m in rows[::2] // 2]
        if flat.key_bias is not None:
            held += [offsets[6] + h * r + row for h, rows in enumerate(cluster) for row in rows]
        self.held = np.sort(np.array(held, dtype=np.int64))

    @classmethod
    def of(cls, model: RotaryAttention, limit: float = GENERATOR_LIMIT) -> "GeneratorForm | None":
        """The model with its blocks turning less than ``limit`` as generators, or None where it has none."""
        slow = model.theta < limit
        if not slow.any():
            return None
        cluster = [np.flatnonzero(np.repeat(slow[h], 2)) for h in range(model.heads)]
        omegas = [np.kron(np.diag(model.theta[h][slow[h]]), QUARTER_TURN) for h in range(model.heads)]
        return cls(model.replaced(theta=np.where(slow, 0.0, model.theta)), cluster, omegas)

    @property
    def key_bias(self):
        return self.flat.key_bias

    def vector(self) -> np.ndarray:
        """:func:`pack`'s vector: the flat model's parameters without the held ones, then each generator."""
        return np.concatenate([np.delete(pack(self.flat), self.held)] + [o.ravel() for o in self.omegas])

    def of_vector(self, vector: np.ndarray) -> "GeneratorForm":
        """The form of a :meth:`vector` (the held parameters kept at this form's values)."""
        flat_size = len(pack(self.flat)) - len(self.held)
        flat = unpack(np.insert(vector[:flat_size], self.held - np.arange(len(self.held)), pack(self.flat)[self.held]),
                      self.flat)
        sizes = np.cumsum([flat_size] + [o.size for o in self.omegas])
        return GeneratorForm(flat, self.cluster, [vector[a:b].reshape(o.shape)
                                                  for a, b, o in zip(sizes[:-1], sizes[1:], self.omegas)])

    def key_bias_index(self) -> np.ndarray:
        """Where the key bias's free entries sit in :meth:`vector`."""
        if self.flat.key_bias is None:
            return np.arange(0)
        free = np.setdiff1d(np.arange(*_offsets(self.flat)[6:8]), self.held)
        return free - np.searchsorted(self.held, free)

    def jacobian(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(f, J)`` at sequences X (B, N, d) of one length, J's columns in :meth:`vector`'s order."""
        f, J = _jacobian(self.flat, X, self)
        return f, np.delete(J, self.held, axis=1)

    @property
    def blocks(self) -> int:
        """The blocks taken as generators."""
        return sum(len(rows) // 2 for rows in self.cluster)

    def __call__(self, batch) -> np.ndarray:
        groups = length_groups(list(batch), 1)
        f = np.empty(len(batch))
        for index, X in groups:
            f[index] = _jacobian(self.flat, X, self, derivatives=False)[0]
        return f

    def gauge(self) -> np.ndarray:
        """The directions (parameters, g) of :func:`pack`'s vector that move no answer to first
        order: a scaled rotation of each block outside the generators' rows, and any change of basis
        of each generator's rows (the Jacobian is zero along them; a step along them is second order
        in the answers and bends the steps)."""
        flat = self.flat
        H, r, _ = flat.Q.shape
        key_bias = flat.key_bias_or_zero
        directions = []

        def direction(h, rows, key_map, query_map, omega_move=None):
            dQ, dK, db, dk = (np.zeros_like(flat.Q), np.zeros_like(flat.K), np.zeros_like(flat.b),
                              np.zeros_like(flat.b))
            dK[h, rows], dk[h, rows] = key_map @ flat.K[h, rows], key_map @ key_bias[h, rows]
            dQ[h, rows], db[h, rows] = query_map @ flat.Q[h, rows], query_map @ flat.b[h, rows]
            moved = flat.replaced(Q=dQ, K=dK, b=db, theta=np.zeros_like(flat.theta), V=np.zeros_like(flat.v), c=0.0,
                                  key_bias=None if flat.key_bias is None else dk)
            omegas = [np.zeros_like(o) for o in self.omegas]
            if omega_move is not None:
                omegas[h] = omega_move
            directions.append(pack(GeneratorForm(moved, self.cluster, omegas)))

        for h in range(H):
            slow_rows = set(self.cluster[h].tolist())
            for m in range(r // 2):
                rows = np.arange(2 * m, 2 * m + 2)
                if 2 * m not in slow_rows:
                    direction(h, rows, np.eye(2), -np.eye(2))
                    direction(h, rows, QUARTER_TURN, QUARTER_TURN)
            rows, omega = self.cluster[h], self.omegas[h]
            for a in range(len(rows)):
                for b in range(len(rows)):
                    unit = np.zeros((len(rows), len(rows)))
                    unit[a, b] = 1.0
                    direction(h, rows, unit, -unit.T, omega @ unit.T - unit.T @ omega)
        return np.array(directions).T

    def to_rotary(self) -> RotaryAttention:
        """The rotary model of the real form ``Omega_h T = T blockdiag(theta_m J)`` of each generator:
        ``K_c <- T^T K_c``, ``Q_c <- T^{-1} Q_c``, ``b_c <- T^{-1} b_c`` (a key bias's rows turn as K's).
        The generators' eigenvalues off the imaginary axis (the answers' noise) are dropped; a pair of
        real ones is a block at angle 0. A head whose eigenvectors are too close to dependent to invert
        (condition above 1e12) keeps its rows in the basis they have, at their eigenvalues' mean angle."""
        flat = self.flat
        Q, K, b, theta = flat.Q.copy(), flat.K.copy(), flat.b.copy(), flat.theta.copy()
        key_bias = None if flat.key_bias is None else flat.key_bias.copy()
        for h, rows in enumerate(self.cluster):
            if not len(rows):
                continue
            values, vectors = np.linalg.eig(self.omegas[h])
            columns, angles = [], []
            for index in np.flatnonzero(values.imag > 0):
                columns.append(np.stack([vectors[:, index].real, -vectors[:, index].imag], axis=1))
                angles.append(float(values[index].imag))
            real = np.flatnonzero(values.imag == 0)
            columns += [vectors[:, real[i:i + 2]].real for i in range(0, len(real) - 1, 2)]
            angles += [0.0] * (len(real) // 2)
            T = np.hstack(columns) if columns else np.zeros((0, 0))
            if T.shape != (len(rows), len(rows)) or np.linalg.cond(T) > 1e12:
                theta[h, rows[::2] // 2] = float(np.abs(values.imag).mean())
                continue
            inverse = np.linalg.inv(T)
            K[h, rows], Q[h, rows], b[h, rows] = T.T @ K[h, rows], inverse @ Q[h, rows], inverse @ b[h, rows]
            if key_bias is not None:
                key_bias[h, rows] = T.T @ key_bias[h, rows]
            theta[h, rows[::2] // 2] = angles
        return flat.replaced(Q=Q, K=K, theta=theta, b=b, key_bias=key_bias)


#: The largest ``|delta Omega|`` (Frobenius, over the queries' offsets) whose power series the generator
#: rows sum: a slow head's generator turns its rows by a few radians at most (llama-d64-h4/0: 3), and the
#: series of a larger one loses ``e^|delta Omega|`` of float64's digits to cancellation. A step past it is
#: no slow block any more: the model's answers are NaN there, and the step is refused as a failed one.
GENERATOR_REACH = 12.0


def _generator_terms(omega: np.ndarray, reach: float) -> int:
    """Terms of the power series of ``expm(delta Omega)`` for ``delta <= reach``: until the next is below
    float64's rounding of the sum (``|delta Omega|^T / T!`` under 2^-60); 0 past ``GENERATOR_REACH``."""
    size, terms, term = reach * max(float(np.linalg.norm(omega)), 1e-300), 1, 1.0
    if not size <= GENERATOR_REACH:
        return 0
    while term > 2.0 ** -60:
        term *= size / terms
        terms += 1
    return max(terms, 2)


def _exact_generator_rows(omega, offsets, query_rows, key_rows, sensitivity):
    """One head's generator rows c: ``E(delta) q_c`` and ``E(delta)^T k_c`` with ``E(delta) =
    expm(delta Omega)`` at every offset, and (sensitivity given) ``df/dOmega = sum_j g_j delta_j
    sum_{i+l=s} (Omega^T)^i k_{c,j} (Omega^l q_c)^T / (s + 1)!``, the Frechet derivative of the
    exponential by its power series (``|delta Omega|`` stays below a few radians, so the series is
    short and needs no scaling). Shapes: query_rows (B, k), key_rows (B, N, k), sensitivity (B, N)."""
    terms = _generator_terms(omega, float(offsets.max(initial=0.0)))
    if not terms:  # past the series' reach: no answer (``GENERATOR_REACH``)
        nothing = np.full(query_rows.shape[:1] + key_rows.shape[1:], np.nan)
        return nothing, nothing, None if sensitivity is None else np.full(
            (len(query_rows), len(omega), len(omega)), np.nan)
    powers = np.empty((terms, len(omega), len(omega)))
    powers[0] = np.eye(len(omega))
    for m in range(1, terms):
        powers[m] = powers[m - 1] @ omega
    inverse_factorials = 1.0 / np.cumprod(np.r_[1.0, np.arange(1, terms + 1, dtype=np.float64)])
    offset_powers = offsets[:, None] ** np.arange(terms + 1)                  # (N, terms + 1)
    exponential = np.einsum("nm,mab->nab", offset_powers[:, :terms] * inverse_factorials[:terms], powers)
    turned_query = np.einsum("nab,zb->zna", exponential, query_rows)
    turned_key = np.einsum("nba,znb->zna", exponential, key_rows)
    if sensitivity is None:
        return turned_query, turned_key, None
    # A_s = sum_j g_j delta_j^(s+1) k_j / (s+1)!, then sum_{i+l=s} (Omega^T)^i A_s (Omega^l q)^T
    moments = np.einsum("zn,ns,znk->zsk", sensitivity, offset_powers[:, 1:] * inverse_factorials[1:], key_rows)
    query_powers = np.einsum("lab,zb->zla", powers, query_rows)                # Omega^l q
    left = np.empty_like(moments)
    for l in range(terms):
        left[:, l] = np.einsum("iba,zib->za", powers[:terms - l], moments[:, l:])  # sum_i (Omega^T)^i A_{i+l}
    return turned_query, turned_key, np.matmul(left.transpose(0, 2, 1), query_powers)


def _jacobian(model: RotaryAttention, X: np.ndarray, generators: "GeneratorForm | None" = None, derivatives=True):
    """``(f, J)`` of the rotary model for sequences X (B, N, d) of one length, the columns in
    :func:`pack`'s order; with ``generators``, each head's rows ``generators.cluster[h]`` turn by
    ``expm(delta Omega_h)`` instead of their blocks (their angles' columns are then zero, and the
    generator's follow the others, head by head). ``derivatives=False``: ``(f, None)``."""
    B, N, d = X.shape
    H, r, _ = model.Q.shape
    offsets = np.arange(N - 1, -1, -1, dtype=np.float64)
    window = np.ones(N, bool) if model.window is None else offsets < model.window
    keys = np.einsum("hrd,bnd->bhnr", model.K, X) + model.key_bias_or_zero[None, :, None]  # k_{h,j}
    query = np.einsum("hrd,bd->bhr", model.Q, X[:, -1]) + model.b          # q_h
    angles = offsets[:, None, None] * model.theta[None]                    # (N, H, r/2)
    cos, sin = np.cos(angles).transpose(1, 0, 2), np.sin(angles).transpose(1, 0, 2)  # (H, N, r/2)
    q = query.reshape(B, H, 1, r // 2, 2)
    rotated_q = np.stack([cos * q[..., 0] - sin * q[..., 1], sin * q[..., 0] + cos * q[..., 1]],
                         -1).reshape(B, H, N, r)                           # R q
    k = keys.reshape(B, H, N, r // 2, 2)
    back = np.stack([cos * k[..., 0] + sin * k[..., 1], -sin * k[..., 0] + cos * k[..., 1]], -1).reshape(B, H, N, r)
    rows_of = [] if generators is None else generators.cluster
    for h, rows in enumerate(rows_of):
        if len(rows):
            rotated_q[:, h][..., rows], back[:, h][..., rows], _ = _exact_generator_rows(
                generators.omegas[h], offsets, query[:, h][:, rows], keys[:, h][..., rows], None)
    scores = np.einsum("bhnr,bhnr->bhn", keys, rotated_q)
    scores = np.where(window, scores, -np.inf)
    scores -= scores.max(axis=2, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=2, keepdims=True)                          # a_{h,j}
    values = np.einsum("hd,bnd->bhn", model.v, X)                           # v_h^T x_j
    head_out = (weights * values).sum(axis=2)                               # v_h^T m_h
    f = head_out.sum(axis=1) + model.c
    if not derivatives:
        return f, None
    g = weights * (values - head_out[:, :, None])                           # (B, H, N)
    dK = np.einsum("bhn,bhnr,bnd->bhrd", g, rotated_q, X)
    db = np.einsum("bhn,bhnr->bhr", g, back)
    dQ = db[:, :, :, None] * X[:, -1][:, None, None, :]
    # d(k^T rot(phi) q)/dphi = k^T rot'(phi) q, rot'(phi) = [[-sin, -cos], [cos, -sin]], phi = delta theta
    dphase = (k[..., 0] * (-sin * q[..., 0] - cos * q[..., 1]) + k[..., 1] * (cos * q[..., 0] - sin * q[..., 1]))
    dtheta = np.einsum("bhn,bhnm,n->bhm", g, dphase, offsets)
    dv = np.einsum("bhn,bnd->bhd", weights, X)
    columns = [dQ.reshape(B, -1), dK.reshape(B, -1), db.reshape(B, -1), dtheta.reshape(B, -1),
               dv.reshape(B, -1), np.ones((B, 1))]
    if model.key_bias is not None:
        columns.append(np.einsum("bhn,bhnr->bhr", g, rotated_q).reshape(B, -1))
    for h, rows in enumerate(rows_of):
        if len(rows):
            columns.append(_exact_generator_rows(generators.omegas[h], offsets, query[:, h][:, rows],
                                                 keys[:, h][..., rows], g[:, h])[2].reshape(B, -1))
    return f, np.concatenate(columns, axis=1)


def jacobian(model, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(f, J)`` for sequences X (B, N, d) of one length: answers (B,) and df/dparameters (B, P), P
    the length of :func:`pack`'s vector, of a :class:`RotaryAttention` or a :class:`GeneratorForm`."""
    return model.jacobian(X) if isinstance(model, GeneratorForm) else _jacobian(model, X)


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


def _blocks(model, groups):
    """``(index, f, J)`` for every block: the model's answers and Jacobian at its queries."""
    for index, X in groups:
        f, J = jacobian(model, X)
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


def normal_equations(model, groups, answers: np.ndarray, probes: np.ndarray | None = None, product: bool = True):
    """``(residual, J^T J, J^T residual, J^T probes)`` summed over the blocks (residual ``f - answers``
    in the order of the queries; ``probes`` (queries, k) or None).
    ``product=False``: ``J^T J`` is not formed (None), the gradient alone, at a fraction of the cost
    (``Q P`` against ``Q P^2`` flops)."""
    residual = np.empty(len(answers))
    normal = gradient = projected = None
    for index, f, J in _blocks(model, groups):
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


def hold_gauge(normal: np.ndarray, directions: np.ndarray) -> None:
    """``normal += m B B^T`` in place, B an orthonormal basis of the gauge ``directions`` scaled by the
    damping's ``D^{1/2}`` and m the median of D: the Jacobian is zero along them, so an undamped step
    would take them anywhere; held, a step is Gauss-Newton's in every other direction (a
    :class:`GeneratorForm`'s change of basis of its rows moves no answer to first order and every answer
    to second)."""
    scale, sizes = marquardt_scale(normal), np.linalg.norm(directions, axis=0)
    basis, _ = np.linalg.qr(directions[:, sizes > 0] / sizes[sizes > 0] * np.sqrt(scale)[:, None])
    normal += np.median(scale) * (basis @ basis.T)


def refinement_memory(parameters: int, queries: int, precision: int | None = None) -> int:
    """Bytes the refinement holds at once, about: J^T J, its damped copy and Cholesky factor, and
    one block of the Jacobian with the einsum intermediates beside it; at ``precision`` bits, the
    larger of that and :func:`polish_high_precision`'s whole Jacobian with its SVD (J, U, V^T)."""
    levenberg = 8 * (3 * parameters ** 2 + 4 * min(BLOCK_ENTRIES, queries * parameters))
    if precision is None:
        return levenberg
    return max(levenberg, 8 * (2 * queries * parameters + parameters ** 2))


def refine(model, sequences, answers: np.ndarray, iterations: int = 60, seed=0, on_step=None, floor: float = 1e-13,
           estimate: bool = True, frame_shift=None, key_size: float | None = None, reuse_gain: float | None = None,
           accelerate: bool = True, until: float = 0.0, crawl: float = np.inf):
    """Levenberg-Marquardt with geodesic acceleration (:func:`acceleration`) on
    ``sum_q (f(X_q) - answer_q)^2``; returns ``(model, RotaryRefinement)``.
    ``on_step(step, misfit)``, if given, hears of every accepted step (a progress display). After a
    step that lowers the cost by ``reuse_gain`` (default ``REUSE_GAIN``) or more the next solves with the
    same ``J^T J`` and the model's own gradient (a chord step: same fixed point, ``J^T J = sum_q J_q^T J_q`` not formed
    again). The steps stop once the max misfit (relative to the largest answer) is below ``floor``,
    the answers' rounding, and a step on a fresh ``J^T J`` gains less than a tenth of the cost or
    fails, or any such step gains less than 1e-9 of it. ``estimate=False``: no error estimate (``noise_error`` NaN), for a stretch of steps
    the caller continues. ``frame_shift``: the estimate is of the score matrices of the model seen
    through ``x -> x + frame_shift`` (a key-bias run's original tokens, docs/algorithm.md, 'Rotary attention: positions,
    grouped heads and sliding windows'). ``key_size``: the model's key bias k has a Gaussian prior of this size sigma_k
    against the misfit's root mean square sigma, ``(sigma / sigma_k)^2 |k|^2`` joining the cost, sigma taken
    afresh at every step: far from the answers the misfit is the model's error, and a prior weighed
    against the answers' rounding alone would let the first steps trade a slow block's angle for a
    key (theta -> 0, k large) that the later steps cannot undo. ``accelerate=False``: no geodesic acceleration (the
    :class:`GeneratorForm`'s steps, whose valleys the form has straightened: on llama-d64-h4/0 in float32 four
    steps reached the rounding with it and without it, at 90 s and 70 s of one core a step). ``until``: the steps stop as soon as the max misfit is below it (a
    stretch that other steps continue). ``crawl``: the steps stop after ``CRAWL_STEPS`` steps in a row on a fresh
    ``J^T J`` that each leave the max misfit above ``crawl`` and above ``CRAWL_RATIO`` times the one before: a
    start outside the steps' quadratic basin, which they would leave only after many steps, if at all (the caller
    reads ``residual_after``)."""
    answers = np.asarray(answers, dtype=np.float64)
    vector = pack(model)
    groups = length_groups(sequences, len(vector))
    scale = max(float(np.abs(answers).max()), 1e-300)
    # a Gaussian prior on the key bias: (sigma / key_size)^2 |k|^2 added to the cost, sigma the
    # misfit's root mean square at the step, and to the normal matrix of the estimate
    prior = key_bias_index(model) if key_size else np.arange(0)

    def prior_weight(residual):
        return float(residual @ residual) / len(residual) / key_size ** 2 if len(prior) else 0.0

    def with_prior(normal, gradient, vector):
        if isinstance(model, GeneratorForm):  # the normal matrix at ``model``: its gauge is held there
            hold_gauge(normal, model.gauge())
        normal[prior, prior] += weight
        gradient[prior] += weight * vector[prior]
        return normal, gradient

    def penalised(residual, vector):  # the cost: squared misfit and the prior at this step's weight
        return float(residual @ residual) + weight * float(vector[prior] @ vector[prior])

    residual, normal, gradient, _ = normal_equations(model, groups, answers)
    weight = prior_weight(residual)
    normal, gradient = with_prior(normal, gradient, vector)
    before = misfit = float(np.abs(residual).max()) / scale
    cost = penalised(residual, vector)
    damping = 1e-3
    taken = crawled = 0
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
            if accelerate and not stale:
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
        previous, misfit = misfit, float(np.abs(residual).max()) / scale
        if on_step is not None:
            on_step(taken, misfit)
        crawled = crawled + 1 if not stale and misfit > max(crawl, CRAWL_RATIO * previous) else 0
        if crawled >= CRAWL_STEPS:
            break
        # the stop rules judge steps on a fresh J^T J: a step on an older one gains less where the older
        # matrix, not the model, is what limits it
        at_rounding = relative < 0.1 and misfit < floor
        if ((at_rounding or relative < 1e-9) and not stale) or misfit < until:
            break
        # a step that took the cost down by at least REUSE_GAIN keeps J^T J for the next (a chord
        # step, docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows',
        # 'Refinement'): the gradient is always the model's own, so the fixed point is the same
        stale = relative >= (REUSE_GAIN if reuse_gain is None else reuse_gain)
        residual, fresh, gradient, _ = normal_equations(model, groups, answers, product=not stale)
        weight = prior_weight(residual)
        if stale:  # the prior's weight of an older step stays in the older J^T J
            gradient[prior] += weight * vector[prior]
        else:
            normal, gradient = with_prior(fresh, gradient, vector)
        cost = penalised(residual, vector)
    if not estimate or isinstance(model, GeneratorForm):  # a stretch the caller continues: no estimate of it
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
#: :func:`refine`'s ``crawl``: this many fresh steps in a row, each keeping more than this fraction of the max
#: misfit before it, end the steps (mistral-d64-h4/1 in float32: 0.50, 0.29, 0.25 from a start with one head
#: assembled wrongly, where the starts the steps take to the rounding leave 1.4e-3..4.9e-3 after one).
CRAWL_STEPS, CRAWL_RATIO = 2, 0.5
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
