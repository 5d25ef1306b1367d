"""Least squares of the whole model on whole answers, to the answers' noise (docs/algorithm.md, 'Whole answers at 8 or
11 bits: saturated lines, then least squares').

For queries ``X_q`` (short, tokens at the run's scale: scores of order one, no saturation) and
whole answers ``y_q`` (d_out numbers), minimise ``sum_q |f_theta(X_q) - y_q|^2`` over every
parameter ``theta = (W, u, V, c)`` of the model with biases, from the saturated start. With
``q_h = W_h x_N + u_h``, ``s_{h,i} = x_i^T q_h``, ``a_h = softmax(s_h)``, ``z_h = sum_i a_{h,i} x_i``
and ``f = c + sum_h V_h z_h``, the gradient is back-propagated in closed form (:func:`misfit`),
and L-BFGS (``scipy.optimize``) runs on parameters scaled block by block to the start's size.

Every answer carries its rounding, about ``unit |y|`` per coordinate, which behaves as noise:
with P parameters and n d_out numbers the fit's error is about ``unit sqrt(P / (n d_out))`` times
the design's conditioning, so the number of fit queries sets the accuracy (:func:`fit_query_count`).
The error estimate is a wild bootstrap (:func:`bootstrap_error`): the fit repeated on the fitted
answers plus each query's own residual times a random sign moves by about the part of the fit's
error that the answers' rounding makes at random.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from ..models.compare import compare
from ..models.attention import MultiHeadAttention

#: Fit queries per parameter and d_out numbers (``n d_out >= FIT_NUMBERS_PER_PARAMETER P``).
FIT_NUMBERS_PER_PARAMETER = 120
#: L-BFGS iterations of the fit on every ``WARM_UP_STEP``-th query first, then on all of them, and
#: of each bootstrap refit (from the fit).
WARM_UP_STEP = 4
WARM_UP_ITERATIONS = 200
FIT_ITERATIONS = 200
BOOTSTRAP_ITERATIONS = 100
#: Bootstrap refits; the estimate is ``BOOTSTRAP_SAFETY`` times the largest move (the error the
#: rounding makes at random, one replicate's spread included) plus ``ARITHMETIC_UNITS`` answer units
#: (the error the layer's arithmetic makes the same for every set of queries, which no refit sees):
#: docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least squares', "The
#: error estimate"; measured by ``benchmarks/bench_low_precision.py --estimate`` (docs/low-precision.md).
BOOTSTRAPS = 1
BOOTSTRAP_SAFETY = 6.0
ARITHMETIC_UNITS = 2.0
#: L-BFGS stops once the misfit fell by less than ``STALL_FRACTION f P / (n d_out)`` over the last
#: ``STALL_WINDOW`` iterations: about ``f P / (n d_out)`` is what moving the parameters by their
#: statistical error adds to the misfit ``f`` (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then
#: least squares'), so the fit has stopped moving on that scale.
STALL_WINDOW = 10
STALL_FRACTION = 1e-3


def fit_query_count(heads: int, d: int, d_out: int) -> int:
    """Fresh queries for the fit: ``FIT_NUMBERS_PER_PARAMETER`` answer numbers per parameter."""
    parameters = heads * (d * d + d + d_out * d) + d_out
    return int(np.ceil(FIT_NUMBERS_PER_PARAMETER * parameters / max(d_out, 1)))


def fit_memory(count: int, heads: int, d: int, d_out: int, longest: int) -> int:
    """Bytes the fit holds at once, about: its queries' tokens (``count`` queries of ``(2 + longest) / 2``
    tokens on average), four copies of the whole answers (answers, predictions, residuals, the
    bootstrap's), and ``H d`` numbers per query for the intermediates ``q``, ``z``, ``dq`` (one
    length's block at a time, with room to spare)."""
    return 8 * count * ((2 + longest) * d // 2 + 4 * d_out + heads * d)


class Design:
    """Queries grouped by length (one dense (n_L, L, d) block per length L) and their answers."""

    def __init__(self, sequences, answers: np.ndarray):
        lengths = np.array([len(s) for s in sequences])
        self.blocks = []
        for length in np.unique(lengths):
            index = np.flatnonzero(lengths == length)
            self.blocks.append((index, np.stack([sequences[i] for i in index]), answers[index]))
        self.answers = answers
        self.scale = float(np.abs(answers).max()) or 1.0  # (squared below: a tiny floor would underflow)

    @classmethod
    def _of(cls, blocks: list, answers: np.ndarray, scale: float) -> "Design":
        design = object.__new__(cls)
        design.blocks, design.answers, design.scale = blocks, answers, scale
        return design

    def subset(self, step: int) -> "Design":
        """Every ``step``-th query of each length (a cheaper design for the first iterations), with
        the same answer scale."""
        blocks, at = [], 0
        for _, X, y in self.blocks:
            count = len(X[::step])
            blocks.append((np.arange(at, at + count), X[::step], y[::step]))
            at += count
        return Design._of(blocks, np.concatenate([y for _, _, y in blocks]), self.scale)

    def with_answers(self, answers: np.ndarray) -> "Design":
        """The same queries with other answers (and the same scale)."""
        return Design._of([(index, X, answers[index]) for index, X, _ in self.blocks], answers, self.scale)


def _forward(W, u, V, c, X):
    """``f`` (n, d_out), the weights ``a`` (n, H, L) and head means ``z`` (n, H, d) of one block, as
    BLAS products over the stacked ``W_h`` (H d, d) and ``V_h^T`` (H d, d_out)."""
    n, _, d = X.shape
    H = len(W)
    q = (X[:, -1] @ W.reshape(H * d, d).T).reshape(n, H, d) + u[None]
    s = np.matmul(q, X.transpose(0, 2, 1))  # (n, H, L)
    s -= s.max(axis=-1, keepdims=True)
    a = np.exp(s)
    a /= a.sum(axis=-1, keepdims=True)
    z = np.matmul(a, X)  # (n, H, d)
    return z.reshape(n, H * d) @ V.transpose(0, 2, 1).reshape(H * d, -1) + c, a, z


def predictions(model: MultiHeadAttention, design: Design) -> np.ndarray:
    out = np.empty_like(design.answers)
    for index, X, _ in design.blocks:
        out[index] = _forward(model.W, model.u, model.V, model.c, X)[0]
    return out


def misfit(W, u, V, c, design: Design) -> tuple[float, tuple]:
    """``sum |f - y|^2 / (2 scale^2)`` and its gradient with respect to ``(W, u, V, c)``."""
    H, d = W.shape[0], W.shape[1]
    total = 0.0
    gW, gu = np.zeros((H * d, d)), np.zeros_like(u)
    gV, gc = np.zeros((H * d, V.shape[1])), np.zeros_like(c)
    Vr = V.transpose(0, 2, 1).reshape(H * d, -1)
    for _, X, y in design.blocks:
        n = len(X)
        f, a, z = _forward(W, u, V, c, X)
        r = (f - y) / design.scale ** 2
        total += 0.5 * float(np.sum((f - y) ** 2)) / design.scale ** 2
        gV += z.reshape(n, H * d).T @ r
        gc += r.sum(axis=0)
        da = np.matmul((r @ Vr.T).reshape(n, H, d), X.transpose(0, 2, 1))  # (n, H, L)
        ds = a * (da - (a * da).sum(axis=-1, keepdims=True))
        dq = np.matmul(ds, X)  # (n, H, d)
        gW += dq.reshape(n, H * d).T @ X[:, -1]
        gu += dq.sum(axis=0)
    return total, (gW.reshape(H, d, d), gu, gV.reshape(H, d, -1).transpose(0, 2, 1), gc)


@dataclass
class WholeFit:
    """The fitted model; ``misfit_before``, ``misfit_after``: RMS misfit of the fit's answers relative
    to the largest; ``iterations``; ``message`` (the optimiser's)."""

    model: MultiHeadAttention
    misfit_before: float
    misfit_after: float
    iterations: int
    message: str


def _rms(model, design) -> float:
    return float(np.sqrt(np.mean((predictions(model, design) - design.answers) ** 2)) / design.scale)


def fit_whole(start: MultiHeadAttention, design: Design, iterations: int = FIT_ITERATIONS,
              warm_up: bool = False, on_iteration=None) -> WholeFit:
    """L-BFGS on every parameter from ``start``, each block scaled by its RMS size in the start, for
    at most ``iterations`` and until the misfit stalls (``STALL_WINDOW``, ``STALL_FRACTION``);
    ``warm_up``: first ``WARM_UP_ITERATIONS`` on every ``WARM_UP_STEP``-th query (most of the way
    from a start 1e-2..0.3 off, at a quarter of the cost). ``on_iteration(iteration, misfit)``: called
    after each iteration (a progress bar), misfit as ``sum |f - y|^2 / (2 scale^2)``."""
    if warm_up:
        first = fit_whole(start, design.subset(WARM_UP_STEP), WARM_UP_ITERATIONS, on_iteration=on_iteration)
        final = fit_whole(first.model, design, iterations, on_iteration=on_iteration)
        before = _rms(start, design)
        if not final.misfit_after <= before:
            return WholeFit(start, before, before, first.iterations + final.iterations, final.message)
        return WholeFit(final.model, before, final.misfit_after, first.iterations + final.iterations, final.message)
    blocks = [start.W, start.u, start.V, np.asarray(start.c, dtype=np.float64)]
    scales = [max(float(np.sqrt(np.mean(b ** 2))), 1e-12) for b in blocks]
    shapes = [b.shape for b in blocks]
    sizes = [b.size for b in blocks]

    def unpack(phi):
        parts, at = [], 0
        for shape, size, scale in zip(shapes, sizes, scales):
            parts.append(phi[at:at + size].reshape(shape) * scale)
            at += size
        return parts

    def objective(phi):
        value, grads = misfit(*unpack(phi), design)
        return value, np.concatenate([g.ravel() * scale for g, scale in zip(grads, scales)])

    phi0 = np.concatenate([b.ravel() / scale for b, scale in zip(blocks, scales)])
    stall = STALL_FRACTION * sum(sizes) / design.answers.size  # times f: P / (n d_out)
    history = []

    def callback(intermediate_result):
        value = float(intermediate_result.fun)
        history.append(value)
        if on_iteration is not None:
            on_iteration(len(history), value)
        if len(history) > STALL_WINDOW and history[-1 - STALL_WINDOW] - value < stall * value:
            raise StopIteration  # scipy ends the run with the current point

    result = minimize(objective, phi0, jac=True, method="L-BFGS-B", callback=callback,
                      options={"maxiter": iterations, "ftol": 1e-15, "gtol": 1e-12, "maxcor": 30})
    W, u, V, c = unpack(result.x)
    model = MultiHeadAttention(W, V, u, c)
    before, after = _rms(start, design), _rms(model, design)
    if not after <= before:  # never worse than the start
        model, after = start, before
    return WholeFit(model, before, after, int(result.nit), str(result.message))


def bootstrap_error(fit: WholeFit, design: Design, seed, unit: float) -> float:
    """``BOOTSTRAP_SAFETY`` times the largest relative move (``compare(...).max_rel``) of
    ``BOOTSTRAPS`` refits, plus ``ARITHMETIC_UNITS * unit`` (``unit``: the answers' unit roundoff).
    Each refit is the fit repeated (from itself, ``BOOTSTRAP_ITERATIONS`` at most) on
    ``f_fit(X_q) + s_q r_q``: the fitted answers plus each query's own residual vector
    ``r_q = y_q - f_fit(X_q)`` times a random sign ``s_q = +-1`` (one per query, a wild bootstrap).

    The residual stays with its query because the layer's rounding is not the same for every query:
    it grows with the query's scores and outputs, and the queries that rule the parameters (large
    scores, steep softmax) round most. Near the fit, ``theta* - theta_fit ~ (J^T J)^-1 J^T (s * r)``
    has the covariance ``(J^T J)^-1 (sum_q J_q^T r_q r_q^T J_q) (J^T J)^-1``, the fit's own under
    any such rounding; permuting residuals across queries would spread the large ones evenly and
    understate it. (The residuals' shrinkage by the fit, ``1 - P / (n d_out) = 119 / 120``, is left
    out.) A part of the layer's rounding that is the same for every set of queries moves the fit
    as well, and no refit on these answers sees it: the ``unit`` term."""
    rng = np.random.default_rng(seed)
    fitted = predictions(fit.model, design)
    residuals = design.answers - fitted
    moves = []
    for _ in range(BOOTSTRAPS):
        signs = rng.choice((-1.0, 1.0), size=(len(residuals), 1))
        refit = fit_whole(fit.model, design.with_answers(fitted + signs * residuals), BOOTSTRAP_ITERATIONS)
        moves.append(float(compare(refit.model, fit.model).max_rel))
    return BOOTSTRAP_SAFETY * max(moves) + ARITHMETIC_UNITS * unit
