"""The inner heads by a direct fit of whole answers from tokens inside the ball (docs/algorithm.md,
'Attention behind a norm: the sublayer of a block', 'A direct fit from bounded tokens').

The biased vector model on k coordinates, per query X (N x k) with final token x::

    q_h = W_h x + u_h,   a_h = softmax(X q_h),   m_h = X^T a_h,   f(X) = c + sum_h V_h m_h,

has the Jacobian (``C_h = sum_i a_{h,i} (x_i - m_h) x_i^T``, ``B_h = V_h C_h``, d_out x k)

    df = sum_h [B_h (dW_h x + du_h) + dV_h m_h] + dc,

so ``J v`` and ``J^T w`` cost O(n H k (N + d_out)) (``C_h`` has rank N + 1 and is applied as
``X^T diag(a_h) X - m_h m_h^T``, the products with ``V_h`` are one matrix product over all queries): Levenberg-Marquardt
steps are solved matrix-free (LSMR, damped, columns scaled by the root of ``diag(J^T J)``) from a
random start. Every answer is asked through the reduced oracle (counted at the raw layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse.linalg import LinearOperator, lsmr

from ..models.attention import MultiHeadAttention

#: Fitted answers per parameter's share of one answer (n = FIT_FACTOR P / d_out queries).
FIT_FACTOR = 5
#: Fresh queries held out to estimate the fitted model's output error.
HELD_OUT = 64
#: Query lengths, uniform (both included).
LENGTHS = (2, 8)
#: Token norms as fractions of the ball's radius sqrt(d), uniform.
NORMS = (0.5, 0.9)
#: Levenberg-Marquardt: outer steps, LSMR iterations a step, random starts.
STEPS, INNER, STARTS = 60, 400, 3


@dataclass
class FitResult:
    """``model`` (or None), ``misfit`` (held-out max |f - y| / max |y|), ``fit_misfit`` (on the
    fitted answers), ``queries`` (inner queries asked), ``steps`` and ``starts`` used."""

    model: MultiHeadAttention | None
    misfit: float
    fit_misfit: float
    queries: int
    steps: int
    starts: int


def bounded_queries(rng: np.random.Generator, count: int, k: int, radius: float) -> list[np.ndarray]:
    """``count`` sequences of LENGTHS tokens in random directions with norms NORMS times ``radius``."""
    out = []
    for n in rng.integers(LENGTHS[0], LENGTHS[1] + 1, size=count):
        Z = rng.standard_normal((int(n), k))
        Z *= (rng.uniform(*NORMS, size=int(n)) * radius / np.linalg.norm(Z, axis=1))[:, None]
        out.append(Z)
    return out


class Batch:
    """Queries grouped by length (one (B, N, k) array each) and their answers (B, d_out)."""

    def __init__(self, sequences: list[np.ndarray], answers: np.ndarray):
        lengths = np.array([len(X) for X in sequences])
        self.groups = [(index, np.stack([sequences[i] for i in index]))
                       for index in (np.flatnonzero(lengths == n) for n in np.unique(lengths))]
        self.order = np.concatenate([index for index, _ in self.groups])
        self.answers = np.asarray(answers, dtype=np.float64)[self.order]


class Parameters:
    """(W, u, V, c) as one flat vector."""

    def __init__(self, H: int, k: int, d_out: int):
        self.shapes = [(H, k, k), (H, k), (H, d_out, k), (d_out,)]
        self.sizes = [int(np.prod(shape)) for shape in self.shapes]

    def split(self, theta: np.ndarray):
        parts, start = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            parts.append(theta[start:start + size].reshape(shape))
            start += size
        return parts

    def join(self, *parts) -> np.ndarray:
        return np.concatenate([np.ravel(part) for part in parts])


def _state(theta, parameters: Parameters, batch: Batch):
    """Per group: outputs f (B, d_out), weights a (B, H, N), means m (B, H, k), tokens X (B, N, k),
    finals x (B, k); and the value read-outs ``Vcat`` (H k, d_out). ``C_h = X^T diag(a_h) X - m_h m_h^T``
    is never formed: it has rank at most N + 1, so ``C_h v = X^T (a_h * (X v)) - m_h (m_h . v)``."""
    W, u, V, c = parameters.split(theta)
    H, k = u.shape
    Vcat = np.ascontiguousarray(V.transpose(0, 2, 1).reshape(H * k, -1))
    out = []
    for _, X in batch.groups:
        x = X[:, -1]
        q = (x @ W.reshape(H * k, k).T).reshape(len(x), H, k) + u[None]
        s = np.matmul(q, X.transpose(0, 2, 1))  # (B, H, N)
        s -= s.max(axis=2, keepdims=True)
        a = np.exp(s)
        a /= a.sum(axis=2, keepdims=True)
        m = np.matmul(a, X)  # (B, H, k)
        f = m.reshape(len(x), H * k) @ Vcat + c
        out.append((f, a, m, X, x))
    return out, Vcat


def _covariance_times(a, m, X, v):
    """``C_h v_h`` for every query and head: ``X^T (a_h * (X v_h)) - m_h (m_h . v_h)``; v (B, H, k)."""
    along = np.matmul(v, X.transpose(0, 2, 1)) * a  # (B, H, N)
    return np.matmul(along, X) - m * (m * v).sum(axis=2, keepdims=True)


def products(state, parameters: Parameters):
    """``(J v, J^T w)`` of the unscaled Jacobian: ``v`` a flat parameter vector -> (rows, d_out),
    ``w`` (rows, d_out) -> a flat parameter vector; ``df = sum_h [V_h C_h (dW_h x + du_h) + dV_h m_h]
    + dc``, each product a matrix product over all queries. What a model built on f (the post-norm
    fit) composes its own Jacobian from."""
    groups, Vcat = state
    H, k, _ = parameters.shapes[0]
    d_out = parameters.shapes[3][0]

    def matvec(v):
        dW, du, dV, dc = parameters.split(np.ravel(v))
        dVcat = dV.transpose(0, 2, 1).reshape(H * k, d_out)
        out = []
        for f, a, m, X, x in groups:
            n = len(x)
            dq = (x @ dW.reshape(H * k, k).T).reshape(n, H, k) + du[None]
            moved = _covariance_times(a, m, X, dq).reshape(n, H * k)
            out.append(moved @ Vcat + m.reshape(n, H * k) @ dVcat + dc)
        return np.concatenate(out)

    def rmatvec(w):
        w = np.asarray(w).reshape(-1, d_out)
        dW, du = np.zeros((H * k, k)), np.zeros(H * k)
        dVcat, dc = np.zeros((H * k, d_out)), w.sum(axis=0)
        start = 0
        for f, a, m, X, x in groups:
            n = len(x)
            part = w[start:start + n]
            start += n
            g = _covariance_times(a, m, X, (part @ Vcat.T).reshape(n, H, k)).reshape(n, H * k)  # C_h V_h^T w
            dW += g.T @ x
            du += g.sum(axis=0)
            dVcat += m.reshape(n, H * k).T @ part
        return parameters.join(dW, du, dVcat.reshape(H, k, d_out).transpose(0, 2, 1), dc)

    return matvec, rmatvec


def column_squares(state, parameters: Parameters, weights=None) -> np.ndarray:
    """``diag(J^T diag(weights) J)``, each query's rows weighted alike (default 1). ``V_h C_h = P_h A_h`` with
    ``P_h = [V_h x_1 .. V_h x_N, V_h m_h]`` (d_out x (N + 1)) and ``A_h = [a_{h,i} x_i^T; -m_h^T]``, so
    ``sum_o (V_h C_h)[o, a]^2`` is ``diag(A_h^T (P_h^T P_h) A_h)``, from (N + 1)-square Gram matrices."""
    groups, Vcat = state
    H, k, _ = parameters.shapes[0]
    d_out = parameters.shapes[3][0]
    V = Vcat.reshape(H, k, d_out)
    dW, du, dV = np.zeros((H * k, k)), np.zeros(H * k), np.zeros((H, d_out, k))
    count, start = 0.0, 0
    for f, a, m, X, x in groups:
        n = len(x)
        weight = np.ones(n) if weights is None else np.asarray(weights)[start:start + n]
        start += n
        rows = np.concatenate([np.broadcast_to(X[:, None], (n, H) + X.shape[1:]), m[:, :, None]], axis=2)
        P = np.einsum("nhik,hko->nhio", rows, V, optimize=True)  # rows of P_h^T: (B, H, N + 1, d_out)
        gram = np.matmul(P, P.transpose(0, 1, 3, 2))  # (B, H, N + 1, N + 1)
        A = np.concatenate([a[..., None] * X[:, None], -m[:, :, None]], axis=2)  # (B, H, N + 1, k)
        squares = (A * np.matmul(gram, A)).sum(axis=2).reshape(n, H * k) * weight[:, None]  # sum_o (V_h C_h)[o, a]^2
        dW += squares.T @ (x * x)
        du += squares.sum(axis=0)
        dV += np.broadcast_to(np.einsum("n,nhk->hk", weight, m * m)[:, None, :], (H, d_out, k))
        count += float(weight.sum())
    return parameters.join(dW, du, dV, np.full(d_out, count))


def inverse_root(diagonal: np.ndarray) -> np.ndarray:
    """The column scaling ``1 / sqrt(diag(J^T J))`` (1 where a column is zero)."""
    return np.where(diagonal > 0, 1 / np.sqrt(np.maximum(diagonal, 1e-300)), 1.0)


class AttentionProblem:
    """The least-squares problem of the biased vector model on ``batch``: what
    :func:`levenberg_marquardt` asks of a model (``state``, ``residual``, ``column_scale``,
    ``operator``, ``answers``)."""

    def __init__(self, parameters: Parameters, batch: Batch):
        self.parameters, self.batch, self.answers = parameters, batch, batch.answers

    def state(self, theta):
        return _state(theta, self.parameters, self.batch)

    def residual(self, state) -> np.ndarray:
        return np.concatenate([group[0] for group in state[0]]).ravel() - self.answers.ravel()

    def column_scale(self, state) -> np.ndarray:
        return inverse_root(column_squares(state, self.parameters))

    def operator(self, state, scale: np.ndarray) -> LinearOperator:
        """``J D`` (D the column scaling) as a LinearOperator."""
        matvec, rmatvec = products(state, self.parameters)
        return scaled_operator(matvec, rmatvec, self.answers.size, scale)


def scaled_operator(matvec, rmatvec, rows: int, scale: np.ndarray) -> LinearOperator:
    """``J D`` from the unscaled products ``J v`` (any shape, raveled) and ``J^T w``."""
    return LinearOperator((rows, scale.size), matvec=lambda v: np.ravel(matvec(np.ravel(v) * scale)),
                          rmatvec=lambda w: rmatvec(np.ravel(w)) * scale, dtype=np.float64)


def levenberg_marquardt(theta, problem, unit: float, floor_units: float = 8.0, damping: float = 1e-2,
                        settled: float = 0.0, inner: int = INNER):
    """Damped Gauss-Newton steps on ``problem`` (an :class:`AttentionProblem` or a model built on
    one) from ``theta`` until the RMS misfit reaches ``floor_units`` units of the answers' rounding
    or stops falling, or (``settled`` > 0) an accepted step lowers the cost by less than that fraction
    (a start already near the optimum: the steps after it only search damping). ``damping``: the
    first step's; ``inner``: LSMR iterations a step. Returns ``(theta, relative misfit, steps)``."""
    state = problem.state(theta)
    residual = problem.residual(state)
    cost = float(residual @ residual)
    size = float(np.abs(problem.answers).max())
    steps = 0
    floor = (floor_units * unit * size) ** 2 * residual.size
    for steps in range(1, STEPS + 1):
        scale = problem.column_scale(state)
        operator = problem.operator(state, scale)
        accepted = False
        while damping < 1e10:
            solution = lsmr(operator, -residual, damp=np.sqrt(damping), atol=1e-15, btol=1e-15, maxiter=inner)[0]
            trial = theta + solution * scale
            trial_state = problem.state(trial)
            trial_residual = problem.residual(trial_state)
            trial_cost = float(trial_residual @ trial_residual)
            if np.isfinite(trial_cost) and trial_cost < cost:
                gain = (cost - trial_cost) / cost
                theta, state, residual, cost = trial, trial_state, trial_residual, trial_cost
                damping = max(damping / 5, 1e-15)
                accepted = True
                break
            damping *= 5
        if not accepted or cost <= floor or gain < 1e-3 and damping <= 1e-12 or gain < settled:
            break
    return theta, float(np.abs(residual).max() / max(size, 1e-300)), steps


def fit(ask, k: int, d_out: int, heads: int, radius: float, rng: np.random.Generator, unit: float,
        factor: float = FIT_FACTOR) -> FitResult:
    """The inner heads from ``ask(sequences) -> (B, d_out)`` answers: fit on ``factor`` P / d_out
    bounded queries, judged on HELD_OUT fresh ones; up to STARTS random starts."""
    parameters = Parameters(heads, k, d_out)
    total = sum(parameters.sizes)
    count = max(int(np.ceil(factor * total / d_out)), 4 * heads * k)
    sequences = bounded_queries(rng, count, k, radius)
    batch = Batch(sequences, ask(sequences))
    held_out = bounded_queries(rng, HELD_OUT, k, radius)
    held_answers = np.asarray(ask(held_out), dtype=np.float64)
    best = FitResult(None, np.inf, np.inf, count + HELD_OUT, 0, 0)
    for start in range(1, STARTS + 1):
        theta = parameters.join(rng.standard_normal((heads, k, k)) / k, rng.standard_normal((heads, k)) / k,
                                rng.standard_normal((heads, d_out, k)) / np.sqrt(k), np.zeros(d_out))
        theta, fit_misfit, steps = levenberg_marquardt(theta, AttentionProblem(parameters, batch), unit)
        W, u, V, c = parameters.split(theta)
        model = MultiHeadAttention(W, V, u, c)
        misfit = float(np.abs(model(held_out) - held_answers).max() / max(np.abs(held_answers).max(), 1e-300))
        if misfit < best.misfit:
            best = FitResult(model, misfit, fit_misfit, count + HELD_OUT, steps, start)
        if misfit <= 1e4 * unit:
            break
    return best
