"""The sublayer of a post-norm block, ``y = gamma * n(x_N + f(X)) + beta`` (docs/algorithm.md,
'Attention behind a norm: the sublayer of a block', 'The norm after the residual').

* gamma and beta from the answers themselves: every answer's ``n = (y - beta) / gamma`` is
  mean-free with ``|n|^2 = d`` (to ``eps / var(z)``), so the answers lie on an ellipsoid in a
  hyperplane: ``a = 1 / gamma`` is the hyperplane's normal (up to a scale lambda), then
  ``|a * (y - beta)|^2 = d`` over ``lambda^2`` is linear in ``a_hat^2 * beta`` and a constant that
  holds lambda (:func:`ellipsoid`).
* a start from one-token queries: ``z = M x + c`` (``M = I + sum_h V_h``) lies along n, so the
  answers at ``0, t e_j, -t e_j`` give ``P M e_j`` and ``P c`` up to one common scale alpha > 0
  (:func:`one_token_start`).
* all parameters, log eps among them, by Levenberg-Marquardt on whole answers
  (:class:`PostNormProblem`, the chain rule through ``dn = (P - n n^T / d) dz / sigma`` on the
  attention's own Jacobian products).
* eps from one-token queries near ``x*`` where ``P (M x* + c) = 0``: ``|n|^2 = d v / (v + eps)``
  with ``v = |P z|^2 / d`` (:func:`measure_eps`).
Every query goes through the boundary it is given (counted at the raw layer); no weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks.base import Check
from ..models.attention import MultiHeadAttention
from ..models.normed import PostNormAttention
from .direct_fit import (FIT_FACTOR, HELD_OUT, STARTS, AttentionProblem, Batch, Parameters, bounded_queries,
                         column_squares, inverse_root, levenberg_marquardt, products, scaled_operator)
from .sweeps import ask_whole

#: One-token queries at this scale (times sqrt(d), random directions) read the ellipsoid: var(z) ~ 1e16, so
#: |n|^2 = d var / (var + eps) is d to below float64's rounding for any eps up to 1e-2.
ELLIPSOID_SCALE = 1e8
#: The start's one-token queries: 0 and +-START_STEP e_j.
START_STEP = 1.0
#: The fit's tokens have norms NORMS times this times sqrt(d) (raw tokens: no norm bounds them).
FIT_RADIUS = 1.0
#: The fit runs until its RMS misfit is this many units of the answers' rounding (not the pre-norm fit's
#: 8: the heads' score errors are what raw tokens of large norm magnify at near ties).
FLOOR_UNITS = 1.0
#: The eps the fit starts with where the start's reading finds none (eps far below the fit's var(z)).
UNSEEN_EPS = 1e-30
#: A first eps is read where ``|n|^2 / d`` lies in this band (``v`` within a factor 100 of eps).
EPS_BAND = (0.01, 0.99)
#: The refinement at near ties runs where the answers' rounding unit is above this (float32 and coarser): in
#: float64 the fit's own W (1e-13 relative) is far below what raw tokens' ties magnify to the claim's size.
TIE_UNIT = 2.0 ** -40
#: Its queries: TIE_FACTOR H d sequences whose tokens have norm TIE_RADIUS sqrt(d) and whose scores, under every
#: fitted head, lie within TIE_SPREAD (a standard deviation) of the final token's own.
TIE_FACTOR, TIE_RADIUS, TIE_SPREAD = 128, 2.0, 1.0
#: Its Levenberg-Marquardt starts near the optimum: a small first damping, TIE_INNER LSMR iterations a step
#: (measured at d = 64, H = 4: the same model to 1e-4 of its error from 100 iterations as from 1000), and it ends
#: once an accepted step gains less than TIE_SETTLED of the cost.
TIE_DAMPING, TIE_SETTLED, TIE_INNER = 1e-5, 1e-4, 100
#: The refined ``W_h`` is cut to a lower rank where its singular values beyond it form a bulk (the largest within
#: RANK_BULK times their median) below a gap of at least RANK_GAP.
RANK_BULK, RANK_GAP = 4.0, 100.0


@dataclass
class Ellipsoid:
    """gamma, beta and how far the answers lie off the ellipsoid: ``plane`` (max |a . (y - beta)| /
    |a| over the answers, relative to the largest |y - beta|) and ``sphere`` (max ||n|^2 / d - 1|)."""

    gamma: np.ndarray
    beta: np.ndarray
    plane: float
    sphere: float


def ellipsoid(Y: np.ndarray) -> Ellipsoid:
    """gamma (its sign: positive sum) and beta from answers Y (n x d, n > d + 1) of large tokens.

    The hyperplane ``a . y = b`` through the answers: a the right singular vector of the centred Y
    for its smallest singular value. With ``a = lambda a_hat``, ``|a * (y - beta)|^2 = d`` divided by
    ``lambda^2`` reads ``s(y) = 2 q . y - r`` (``s(y) = sum a_hat^2 y^2``, ``q = a_hat^2 beta``,
    ``r = sum a_hat^2 beta^2 - d / lambda^2``): linear in (q, r), q fixed along a_hat by
    ``a_hat . beta = b_hat``, i.e. ``sum q / a_hat = b_hat``; then ``lambda^2 = d / (sum q beta - r)``."""
    Y = np.asarray(Y, dtype=np.float64)
    n, d = Y.shape
    centre = Y.mean(axis=0)
    a = np.linalg.svd(Y - centre, full_matrices=False)[2][-1]
    b = float(a @ centre)
    rows = np.column_stack([2 * Y, -np.ones(n)])
    constraint = np.concatenate([1 / a, [0.0]])
    weight = np.abs(rows).max() / np.abs(constraint).max()
    system = np.vstack([rows, weight * constraint])
    solution = np.linalg.lstsq(system, np.concatenate([(a * a * Y * Y).sum(axis=1), [weight * b]]), rcond=None)[0]
    q, r = solution[:d], solution[d]
    beta = q / (a * a)
    gamma = 1 / (np.sqrt(d / abs(float(q @ beta) - r)) * a)
    gamma *= np.sign(gamma.sum())
    N = (Y - beta) / gamma
    size = float(np.abs(Y - beta).max())
    return Ellipsoid(gamma, beta, float(np.abs(N.mean(axis=1)).max() * np.abs(gamma).min() / size),
                     float(np.abs((N * N).mean(axis=1) - 1).max()))


def ask_ellipsoid(boundary, d: int, rng: np.random.Generator) -> Ellipsoid:
    """:func:`ellipsoid` of the answers to ``2 d`` one-token queries in random directions at
    ``ELLIPSOID_SCALE sqrt(d)``."""
    E = rng.standard_normal((2 * d, d))
    E *= (ELLIPSOID_SCALE * np.sqrt(d) / np.linalg.norm(E, axis=1))[:, None]
    return ellipsoid(ask_whole(boundary, [e[None, :] for e in E], "post-norm ellipsoid"))


def directions(Y: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """``n = (y - beta) / gamma`` of each answer, projected on ``1^perp`` and made unit."""
    N = (np.asarray(Y, dtype=np.float64) - beta) / gamma
    N -= N.mean(axis=-1, keepdims=True)
    return N / np.linalg.norm(N, axis=-1, keepdims=True)


@dataclass
class Start:
    """``PM = P M`` (d x d) and ``Pc = P c`` up to one scale alpha > 0 (``alpha`` the one making
    ``alpha PM - P`` smallest), ``coplanar`` the worst misfit of the three answers of one column
    (relative: a layer after the norm, such as BertLayer's MLP, misses), ``queries`` asked."""

    PM: np.ndarray
    Pc: np.ndarray
    alpha: float
    coplanar: float
    queries: int


def one_token_start(boundary, d: int, gamma: np.ndarray, beta: np.ndarray) -> Start:
    """``z(x) = M x + c`` for one token: ``P z`` lies along n. With ``P c = n_0`` (alpha = 1),
    ``t m_j + n_0 = a n_+`` and ``-t m_j + n_0 = b n_-`` give ``a n_+ + b n_- = 2 n_0`` (least squares
    in a, b) and ``m_j = (a n_+ - b n_-) / (2 t)``."""
    t = START_STEP
    tokens = [np.zeros((1, d))] + [s * t * e[None, :] for e in np.eye(d) for s in (1.0, -1.0)]
    n = directions(ask_whole(boundary, tokens, "post-norm start"), gamma, beta)
    n0, plus, minus = n[0], n[1::2], n[2::2]
    PM, worst = np.zeros((d, d)), 0.0
    for j in range(d):
        pair = np.column_stack([plus[j], minus[j]])
        (a, b), *_ = np.linalg.lstsq(pair, 2 * n0, rcond=None)
        worst = max(worst, float(np.abs(pair @ [a, b] - 2 * n0).max() / 2))
        PM[:, j] = (a * plus[j] - b * minus[j]) / (2 * t)
    P = np.eye(d) - 1.0 / d
    alpha = float(np.sum(PM * P) / np.sum(PM * PM))
    return Start(PM, n0, alpha, worst, len(tokens))


def start_model(start: Start, gamma, beta, heads: int) -> PostNormAttention:
    """The start's summed values and c as a model (W = 0, u = 0, eps 1): what :func:`measure_eps` needs
    for a first eps, ``eps (alpha_start / alpha)^2`` (x* does not depend on alpha; the lengths do)."""
    d = len(gamma)
    V = np.broadcast_to((start.alpha * start.PM - (np.eye(d) - 1.0 / d)) / heads, (heads, d, d))
    inner = MultiHeadAttention(np.zeros((heads, d, d)), np.array(V), np.zeros((heads, d)), start.alpha * start.Pc)
    return PostNormAttention(1.0, inner, gamma, beta)


class PostNormProblem:
    """Levenberg-Marquardt's problem for ``y = gamma * n(x_N + f(X)) + beta`` on a batch: theta is the
    attention's parameters, then gamma, beta and ``l = log eps``.

        dy = gamma * (P - n n^T / d) df / sigma + n dgamma + dbeta - gamma * n eps / (2 sigma^2) dl,

    ``(P - n n^T / d)`` symmetric, so ``J^T w`` passes ``(P - n n^T/d)(gamma w) / sigma`` to the
    attention's ``J^T``. l's column is scaled by at most 1 (where eps does not reach the answers its
    column is tiny, and a unit-scaled step would throw it far), and held (scale 0) with
    ``fit_eps=False``."""

    def __init__(self, parameters: Parameters, batch: Batch, fit_eps: bool = True):
        self.attention, self.parameters, self.fit_eps = AttentionProblem(parameters, batch), parameters, fit_eps
        self.answers, self.size = batch.answers, sum(parameters.sizes)
        self.finals = np.concatenate([X[:, -1] for _, X in batch.groups])

    def split(self, theta):
        """(attention's parameters, gamma, beta, eps)."""
        d = self.finals.shape[1]
        return (theta[:self.size], theta[self.size:self.size + d], theta[self.size + d:self.size + 2 * d],
                float(np.exp(theta[-1])))

    def state(self, theta):
        inner_theta, gamma, beta, eps = self.split(theta)
        inner = self.attention.state(inner_theta)
        z = self.finals + np.concatenate([group[0] for group in inner[0]])
        z -= z.mean(axis=1, keepdims=True)
        sigma = np.sqrt((z * z).mean(axis=1) + eps)
        n = z / sigma[:, None]
        return inner, n, sigma, gamma, gamma * n + beta, eps

    def residual(self, state) -> np.ndarray:
        return (state[4] - self.answers).ravel()

    def column_scale(self, state) -> np.ndarray:
        """The attention's columns with each query weighted ``mean(gamma^2) / sigma^2`` (``J_n`` taken
        as ``P / sigma``), gamma's ``sum n^2``, beta's the query count, l's (capped at 1, or 0)."""
        inner, n, sigma, gamma, _, eps = state
        weights = float(np.mean(gamma * gamma)) / sigma ** 2
        along_eps = float((((gamma * n) ** 2).sum(axis=1) * (eps / (2 * sigma ** 2)) ** 2).sum())
        squares = np.concatenate([column_squares(inner, self.parameters, weights), (n * n).sum(axis=0),
                                  np.full(n.shape[1], float(len(n))), [along_eps]])
        scale = inverse_root(squares)
        scale[-1] = min(scale[-1], 1.0) if self.fit_eps else 0.0
        return scale

    def operator(self, state, scale):
        inner, n, sigma, gamma, _, eps = state
        d = n.shape[1]
        matvec, rmatvec = products(inner, self.parameters)
        along_eps = -gamma * n * (eps / (2 * sigma ** 2))[:, None]  # dy / dl

        def through_norm(v):  # (P - n n^T / d) v / sigma, row by row
            v = v - v.mean(axis=1, keepdims=True)
            return (v - n * (n * v).sum(axis=1, keepdims=True) / d) / sigma[:, None]

        def forward(v):
            inner_v, dgamma, dbeta, dl = v[:self.size], v[self.size:self.size + d], v[self.size + d:-1], v[-1]
            return gamma * through_norm(matvec(inner_v)) + n * dgamma + dbeta + along_eps * dl

        def backward(w):
            w = w.reshape(-1, d)
            return np.concatenate([rmatvec(through_norm(gamma * w)), (w * n).sum(axis=0), w.sum(axis=0),
                                   [float((w * along_eps).sum())]])

        return scaled_operator(forward, backward, self.answers.size, scale)


@dataclass
class PostNormFit:
    """``model`` (or None), ``misfit`` (held-out max |f - y| / max |y|), ``fit_misfit``, ``queries``
    (fit and held out, and the refinement's), ``steps`` and ``starts`` used; ``theta``, ``problem`` and the
    held-out queries kept for :func:`refit` and :func:`refine_at_ties`; ``ranks`` the heads' ranks
    :func:`low_rank` kept (None before the refinement)."""

    model: PostNormAttention | None
    misfit: float
    fit_misfit: float
    queries: int
    steps: int
    starts: int
    theta: np.ndarray | None = None
    problem: PostNormProblem | None = None
    held_out: tuple = ()
    ranks: list | None = None


def _judged(theta, problem: PostNormProblem, held_out, fit_misfit: float, queries: int, steps: int,
            attempt: int) -> PostNormFit:
    """The model of ``theta`` and its misfit on the held-out queries."""
    inner_theta, gamma, beta, eps = problem.split(theta)
    W, u, V, c = problem.parameters.split(inner_theta)
    model = PostNormAttention(eps, MultiHeadAttention(W, V, u, c), gamma, beta)
    sequences, answers = held_out
    misfit = float(np.abs(model(sequences) - answers).max() / max(np.abs(answers).max(), 1e-300))
    return PostNormFit(model, misfit, fit_misfit, queries, steps, attempt, theta, problem, held_out)


def fit(boundary, d: int, heads: int, start: Start, gamma, beta, eps: float, rng: np.random.Generator,
        unit: float) -> PostNormFit:
    """All parameters from ``FIT_FACTOR P / d`` queries of 2..8 tokens of norms 0.5..0.9 sqrt(d),
    judged on HELD_OUT fresh ones. Starts: W, u random, ``V_h = (alpha PM - P) / H`` plus a little
    noise, ``c = alpha Pc``, gamma and beta the ellipsoid's; then with gamma's sign turned (the one
    pairing one-token answers cannot tell); up to STARTS."""
    parameters = Parameters(heads, d, d)
    total = sum(parameters.sizes) + 2 * d
    count = max(int(np.ceil(FIT_FACTOR * total / d)), 4 * heads * d)
    sequences = bounded_queries(rng, count, d, FIT_RADIUS * np.sqrt(d))
    problem = PostNormProblem(parameters, Batch(sequences, ask_whole(boundary, sequences, "post-norm fit")))
    held_out = bounded_queries(rng, HELD_OUT, d, FIT_RADIUS * np.sqrt(d))
    held_out = (held_out, ask_whole(boundary, held_out, "post-norm held out"))
    best = PostNormFit(None, np.inf, np.inf, count + HELD_OUT, 0, 0)
    P = np.eye(d) - 1.0 / d
    for attempt in range(1, STARTS + 1):
        sign = 1.0 if attempt % 2 else -1.0  # gamma's sign flips n, so P M and P c, and alpha with them
        alpha = sign * start.alpha
        V = np.broadcast_to((alpha * start.PM - P) / heads, (heads, d, d))
        V = V + rng.standard_normal((heads, d, d)) * 0.1 / np.sqrt(d)
        theta = np.concatenate([parameters.join(rng.standard_normal((heads, d, d)) / d,
                                                rng.standard_normal((heads, d)) / d, V, alpha * start.Pc),
                                sign * gamma, beta, [np.log(eps)]])
        theta, fit_misfit, steps = levenberg_marquardt(theta, problem, unit, FLOOR_UNITS)
        judged = _judged(theta, problem, held_out, fit_misfit, count + HELD_OUT, steps, attempt)
        if judged.misfit < best.misfit:
            best = judged
        if judged.misfit <= 1e4 * unit:
            break
    return best


def refit(fitted: PostNormFit, eps: float, unit: float) -> PostNormFit:
    """The fit again from its own parameters with the measured eps held (no new query), where eps
    reaches the fit's answers (``eps / var(z)`` above the rounding ``unit`` for some query)."""
    problem = PostNormProblem(fitted.problem.parameters, fitted.problem.attention.batch, fit_eps=False)
    theta = np.concatenate([fitted.theta[:-1], [np.log(eps)]])
    sigma = problem.state(theta)[2]
    if eps / float((sigma * sigma).min()) <= unit:
        return _judged(theta, problem, fitted.held_out, fitted.fit_misfit, fitted.queries, fitted.steps, fitted.starts)
    theta, fit_misfit, steps = levenberg_marquardt(theta, problem, unit, FLOOR_UNITS)
    return _judged(theta, problem, fitted.held_out, fit_misfit, fitted.queries, fitted.steps + steps, fitted.starts)


def tied_queries(rng: np.random.Generator, count: int, W: np.ndarray, u: np.ndarray, radius: float,
                 spread: float) -> list[np.ndarray]:
    """``count`` raw sequences whose every token has norm about ``radius`` and whose scores under every head of
    ``(W, u)`` nearly tie: with the final token x (random direction, norm radius) and ``q_h = W_h x + u_h``, each
    key is a random vector off ``span{q_h}`` (norm radius) plus the part in that span that puts its score under
    head h at ``q_h . x + spread z`` (z standard normal), so no head's softmax saturates while the scores are
    of order ``radius^2 |W|``. Lengths ``L .. 2 L`` with ``L = ceil((d - 2) / H) + 1``: the H heads' weights
    then move more directions than the ``d - 2`` an answer's norm leaves."""
    H, d, _ = W.shape
    shortest = int(np.ceil((d - 2) / H)) + 1
    out = []
    for n in rng.integers(shortest, 2 * shortest + 1, size=count):
        x = rng.standard_normal(d)
        x *= radius / np.linalg.norm(x)
        q = W @ x + u
        basis = np.linalg.qr(q.T)[0]
        keys = rng.standard_normal((int(n) - 1, d))
        keys -= (keys @ basis) @ basis.T
        keys *= (radius / np.maximum(np.linalg.norm(keys, axis=1), 1e-300))[:, None]
        targets = (q @ x)[None, :] + spread * rng.standard_normal((int(n) - 1, H))
        along = np.linalg.lstsq(q @ basis, (targets - keys @ q.T).T, rcond=None)[0].T
        out.append(np.vstack([keys + along @ basis.T, x[None, :]]))
    return out


def noise_rank(values: np.ndarray) -> int:
    """The least k whose singular values beyond it look like the fit's noise and nothing else: ``values[k]`` (the
    largest of them) within RANK_BULK times their median (a random square matrix's largest singular value is
    about 2.5 times its median; a real component stands out of that bulk), and a gap ``values[k - 1] /
    values[k]`` of at least RANK_GAP; ``len(values)`` (full rank) where no k is."""
    for k in range(1, len(values)):
        tail = values[k:]
        if tail[0] <= RANK_BULK * float(np.median(tail)) and values[k - 1] >= RANK_GAP * tail[0]:
            return k
    return len(values)


def low_rank(problem: PostNormProblem, theta: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """``theta`` with each ``W_h`` cut to its :func:`noise_rank` r_h and ``u_h`` projected on the r_h left
    singular vectors: scores ``(Wq x_N + b_q) . (Wk x_i + b_k)`` give ``W_h = Wk^T Wq`` and ``u_h = Wk^T b_q``,
    both in the column space of ``Wk^T``, so what a fit puts beyond the rank is its noise (at d = 64, H = 4 the
    block off both singular spaces holds 9/16 of W's entries)."""
    inner_theta, gamma, beta, eps = problem.split(theta)
    W, u, V, c = problem.parameters.split(inner_theta)
    cut, shifted, ranks = W.copy(), u.copy(), []
    for h in range(len(W)):
        left, values, right = np.linalg.svd(W[h])
        rank = noise_rank(values)
        cut[h] = (left[:, :rank] * values[:rank]) @ right[:rank]
        shifted[h] = left[:, :rank] @ (left[:, :rank].T @ u[h])
        ranks.append(rank)
    return np.concatenate([problem.parameters.join(cut, shifted, V, c), gamma, beta, [np.log(eps)]]), ranks


def refine_at_ties(boundary, fitted: PostNormFit, rng: np.random.Generator, unit: float) -> PostNormFit:
    """Where the answers are rounded coarser than TIE_UNIT: the fitted model's parameters again, every one but
    eps, from TIE_FACTOR H d :func:`tied_queries` at TIE_RADIUS sqrt(d), then :func:`low_rank`; judged on the
    fit's held-out queries (its ``ranks`` kept), and the fit kept where that misfit is above 1e4 units. The layer's float32 scores are rounded relative to
    ``|x_i| |x_N|``, as are the score errors a misfit in W makes, so answers with large tokens and unsaturated
    heads carry the most of W per answer; a fitted W's error falls as the root of their count."""
    if unit <= TIE_UNIT or fitted.theta is None:
        return fitted
    problem = fitted.problem
    W, u, _, _ = problem.parameters.split(problem.split(fitted.theta)[0])
    H, d, _ = W.shape
    sequences = tied_queries(rng, TIE_FACTOR * H * d, W, u, TIE_RADIUS * np.sqrt(d), TIE_SPREAD)
    tied = PostNormProblem(problem.parameters, Batch(sequences, ask_whole(boundary, sequences, "post-norm near ties")),
                           fit_eps=False)
    theta, fit_misfit, steps = levenberg_marquardt(fitted.theta, tied, unit, 0.0, TIE_DAMPING, TIE_SETTLED, TIE_INNER)
    theta, ranks = low_rank(tied, theta)
    judged = _judged(theta, tied, fitted.held_out, fit_misfit, fitted.queries + len(sequences), fitted.steps + steps,
                     fitted.starts)
    judged.ranks = ranks
    return judged if judged.misfit <= 1e4 * unit else fitted  # the fit's own acceptance, as in :func:`fit`


@dataclass
class EpsReading:
    """eps, its relative error (twice the spread of two directions' readings, or 64 units), the
    ``check`` and the ``queries`` asked."""

    eps: float
    error: float
    check: Check
    queries: int


def measure_eps(boundary, model: PostNormAttention, rng: np.random.Generator, unit: float) -> EpsReading:
    """eps from one-token queries ``x* + s e``: ``z = s M e`` (``x*`` the least-norm solution of
    ``P (M x* + c) = 0`` with the fitted ``M = I + sum_h V_h``, c), so ``|n|^2 = d v / (v + eps)``,
    ``v = s^2 |P M e|^2 / d``, and ``eps = v (d / |n|^2 - 1)`` (relative error ``delta / (f (1 - f))``
    for an error delta in ``f = |n|^2 / d``). A sweep of s over 1e-10..1e2 (in units of
    ``1 / |P M e|``) in two random directions gives a first eps from the scales whose f lies in
    EPS_BAND; two more queries a direction, at ``x* +- s e`` with ``v = eps`` (f = 1/2), give its
    reading free of x*'s error delta to first order: ``z = +-s M e + M delta``, so ``v_+ + v_- = 2 v``
    and, with ``v = eps f / (1 - f)`` at each, ``eps = 2 v / (f_+ / (1 - f_+) + f_- / (1 - f_-))``."""
    d = model.d
    P = np.eye(d) - 1.0 / d
    M = P @ (np.eye(d) + model.attention.V.sum(axis=0))
    x_star = -np.linalg.lstsq(M, P @ model.attention.c, rcond=None)[0]
    scales = 10.0 ** np.arange(-10, 3)
    readings, queries = [], 0
    for _ in range(2):
        e = rng.standard_normal(d)
        e /= np.linalg.norm(e)
        length = float(np.linalg.norm(M @ e))
        tokens = [(x_star + s / length * e)[None, :] for s in scales]
        N = (ask_whole(boundary, tokens, "post-norm eps") - model.beta) / model.gamma
        queries += len(tokens)
        fraction = (N * N).mean(axis=1)
        inside = (fraction > EPS_BAND[0]) & (fraction < EPS_BAND[1])
        if not inside.any():
            readings.append(np.nan)
            continue
        rough = float(np.mean(scales[inside] ** 2 / d * (1 / fraction[inside] - 1)))
        s = float(np.sqrt(d * rough))
        N = (ask_whole(boundary, [(x_star + sign * s / length * e)[None, :] for sign in (1, -1)], "post-norm eps")
             - model.beta) / model.gamma
        queries += 2
        f = (N * N).mean(axis=1)
        readings.append(float(2 * s * s / d / (f / (1 - f)).sum()))
    eps = float(np.mean(readings))
    spread = abs(readings[0] - readings[1]) / eps if np.isfinite(eps) and eps > 0 else np.inf
    # z = x + f(x) near 0 is a cancellation inside the layer: its rounding, unit (|M| |x*| + |P c|),
    # against |z| = sqrt(d eps)
    cancellation = (np.linalg.norm(M, 2) * max(1.0, float(np.linalg.norm(x_star))) +
                    float(np.linalg.norm(P @ model.attention.c))) / np.sqrt(d * eps) if eps > 0 else np.inf
    limit = 1e3 * unit * cancellation
    check = Check("eps", bool(np.isfinite(eps) and eps > 0 and spread <= limit), spread, limit,
                  f"eps = {eps:.6g} from one-token answers near the token whose z is 0 in two directions, relative "
                  "spread shown (none in the band: eps below 1e-20 d or above 1e4 d, or no LayerNorm after the "
                  "residual)")
    return EpsReading(eps, max(2 * spread, unit * cancellation) if np.isfinite(spread) else np.inf, check, queries)
