"""Gradient distillation: what a practitioner would try first (baseline of ``mhaextract bench``).

Ask the oracle ``n_queries`` random queries (by default the paper's count ``4Hd^2 - 2H + 1``; random
lengths ``1..L`` and random token scales, :func:`random_queries`), then fit a student with the
same ``H`` and ``d`` (the model of docs/algorithm.md, 'The model', ``f(X) = sum_h sum_i a_{h,i} v_h^T x_i``)
by minimising the relative squared misfit

    loss(W, v) = sum_n (f_student(X_n) - f(X_n))^2 / sum_n f(X_n)^2

in float64 PyTorch: Adam with a cosine learning-rate schedule for ``restarts`` random
initialisations trained at once as one batched tensor ``(R, H, d, d)`` (the loss is a sum over
restarts, and Adam is elementwise, so each restart follows exactly the path it would alone),
then L-BFGS polishing the ``polish`` best restarts (default: all) one by one (L-BFGS on the
summed loss would couple the restarts through its curvature pairs). The restart with the
lowest training loss is returned.

A restart *converged* when its final relative RMS training misfit ``sqrt(loss)`` is below
``converged_tol``: the practitioner's criterion (the truth is unknown to them); the
``training_fit`` check says whether the best one did, and a result failing it is reported like
every other result (``on_failure``). With about four answers per parameter (the default
``n_queries``), a fit to the training answers at that level means the heads
are found, which the benchmark confirms against the truth with :func:`mhaextract.compare`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..checks.base import Check, CheckedResult, report_failure
from ..models.attention import MultiHeadAttention
from ..oracle.boundary import OracleBoundary
from ..oracle.progress import ProgressBar, shown
from ..oracle.queries import padded, random_queries
from ..run.validation import on_failure_mode, positive_int, positive_number, token_scale_for


def paper_budget(d: int, heads: int) -> int:
    """The paper's query count ``4Hd^2 - 2H + 1``: the default ``n_queries``, so methods compare at equal cost."""
    return 4 * heads * d * d - 2 * heads + 1


@dataclass
class Distillation(CheckedResult):
    """Result of :func:`distill`.

    Attributes
    ----------
    model : MultiHeadAttention
        The student with the lowest training loss (float64, H heads, not canonicalised).
    queries, max_query_length : int
        Measured at the oracle boundary (the training set).
    restarts, adam_steps, lbfgs_steps, polished : int
        What was run: ``restarts`` students for ``adam_steps`` Adam steps, the ``polished`` best of
        them then for up to ``lbfgs_steps`` L-BFGS iterations.
    training_misfit : array (restarts,)
        Final relative RMS misfit ``sqrt(loss)`` of every restart on the training answers.
    best_misfit : float
        That of the returned model.
    converged : float
        Fraction of restarts with ``training_misfit < converged_tol``.
    converged_tol : float
    checks : list of :class:`mhaextract.Check` (``training_fit``: the best restart converged)
    seconds : float
        Querying and training.
    """

    model: MultiHeadAttention
    queries: int
    max_query_length: int
    restarts: int
    adam_steps: int
    lbfgs_steps: int
    polished: int
    training_misfit: np.ndarray
    best_misfit: float
    converged: float
    converged_tol: float
    checks: list = field(default_factory=list)
    seconds: float = 0.0


def distill(oracle, d, heads, *, n_queries=None, restarts=16, adam_steps=1500, lbfgs_steps=500, polish=None,
            learning_rate=0.05, init_scale=0.5, max_length=None, token_scale=None, converged_tol=1e-6,
            seed=None, threads=1, batch_size=1024, progress=None, on_failure="raise",
            max_queries=None) -> Distillation:
    """Fit a student attention layer to ``n_queries`` random queries of ``oracle`` (see the module docstring).

    Parameters
    ----------
    oracle : callable ``oracle(batch) -> outputs`` (float64; see :mod:`mhaextract.oracle.boundary`).
    d, heads : the student's token dimension and head count (the target's, assumed known).
    n_queries : how many random training queries to ask (default :func:`paper_budget`, the
        paper's count). Not a cap: exactly this many are asked; ``max_queries`` is the cap.
    restarts : random initialisations trained together.
    adam_steps : full-batch Adam steps; the learning rate decays from ``learning_rate`` to
        ``learning_rate / 1000`` on a cosine (0.05 was the best of 0.005..0.1 in tuning).
    lbfgs_steps, polish : L-BFGS iterations for each of the ``polish`` best restarts (default all,
        so that the converged fraction is not capped by the number polished; 0: none).
    init_scale : students start with ``W ~ N(0, init_scale^2 / d)``, ``v ~ N(0, init_scale^2)``
        (1 is the distribution of :meth:`MultiHeadAttention.random`; 0.5, half of it, converged
        more often in the tuning runs of docs/benchmarks.md).
    max_length : longest training query (default ``2 heads + 1``, the paper's longest).
    token_scale : token norm (default ``d ** 0.25``, as :func:`mhaextract.extract`).
    converged_tol : a restart converged when its relative RMS training misfit is below this.
    seed : seeds the queries and the initialisations.
    threads : torch intra-op threads while training (restored afterwards; None keeps torch's).
        Default 1: the tensors are small, and on a shared 2-core machine two threads made a step
        3 to 15 times slower (synchronisation), see docs/benchmarks.md.
    batch_size, progress, on_failure, max_queries : as in :func:`mhaextract.extract`: a student
        failing its ``training_fit`` check raises :class:`~mhaextract.ExtractionError` (or warns
        with ``"warn"``); ``max_queries`` below ``n_queries`` raises
        :class:`~mhaextract.BudgetExceeded` before any query is asked.
    """
    try:
        import torch
    except ImportError as error:  # pragma: no cover - the torch extra is installed in CI
        raise ImportError("distill needs PyTorch: pip install 'mhaextract[torch]'") from error
    d = positive_int("d", d)
    heads = positive_int("heads", heads)
    n_queries = paper_budget(d, heads) if n_queries is None else positive_int("n_queries", n_queries)
    on_failure = on_failure_mode(on_failure)
    if max_queries is not None:
        max_queries = positive_int("max_queries", max_queries, minimum=0)
    restarts = positive_int("restarts", restarts)
    adam_steps = positive_int("adam_steps", adam_steps, minimum=0)
    lbfgs_steps = positive_int("lbfgs_steps", lbfgs_steps, minimum=0)
    polish = restarts if polish is None else min(positive_int("polish", polish, minimum=0), restarts)
    learning_rate = positive_number("learning_rate", learning_rate)
    init_scale = positive_number("init_scale", init_scale)
    max_length = 2 * heads + 1 if max_length is None else positive_int("max_length", max_length)
    token_scale = token_scale_for(d, token_scale)
    converged_tol = positive_number("converged_tol", converged_tol)
    threads = None if threads is None else positive_int("threads", threads)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = _distill(torch, oracle, d, heads, n_queries, restarts, adam_steps, lbfgs_steps, polish,
                          learning_rate, init_scale, max_length, token_scale, converged_tol, seed, batch_size,
                          progress, max_queries)
    finally:
        torch.set_num_threads(previous_threads)
    report_failure(result, "distillation", on_failure)
    return result


def _distill(torch, oracle, d, heads, n_queries, restarts, adam_steps, lbfgs_steps, polish, learning_rate, init_scale,
             max_length, token_scale, converged_tol, seed, batch_size, progress, max_queries) -> Distillation:

    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    boundary = OracleBoundary(oracle, d, batch_size=batch_size, progress=progress, max_queries=max_queries)
    sequences = random_queries(rng, n_queries, d, token_scale, (1, max_length), spread=1.0)
    # One ask for all of them: without a transcript the boundary refuses an over-budget ask whole.
    answers = boundary.ask(sequences, description=f"distillation: {n_queries} random queries")
    X, mask = (torch.from_numpy(array) for array in padded(sequences))
    y = torch.from_numpy(np.asarray(answers, dtype=np.float64))
    norm = torch.clamp((y**2).sum(), min=1e-300)

    generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
    W = (torch.randn((restarts, heads, d, d), generator=generator, dtype=torch.float64) * init_scale / math.sqrt(d))
    v = torch.randn((restarts, heads, d), generator=generator, dtype=torch.float64) * init_scale
    W.requires_grad_(True)
    v.requires_grad_(True)

    def losses(W, v):  # (R,) relative squared misfit of each restart
        return ((_forward(torch, W, v, X, mask) - y) ** 2).sum(dim=1) / norm

    optimizer = torch.optim.Adam([W, v], lr=learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1e-3 + (1 - 1e-3) * 0.5 * (1 + math.cos(math.pi * min(step / max(adam_steps, 1), 1))))
    with ProgressBar(shown(progress), f"distillation: Adam, {restarts} restarts", adam_steps) as advance:
        for step in range(adam_steps):
            optimizer.zero_grad(set_to_none=True)
            loss = losses(W, v)
            loss.sum().backward()
            optimizer.step()
            schedule.step()
            advance(1)
    with torch.no_grad():
        final = losses(W, v)
        final = torch.where(torch.isfinite(final), final, torch.full_like(final, math.inf))
    W_out, v_out = W.detach().clone(), v.detach().clone()
    if lbfgs_steps and polish:
        best = torch.argsort(final)[:polish]
        with ProgressBar(shown(progress), f"distillation: L-BFGS on the best {polish}", polish) as advance:
            for r in best.tolist():
                W_r, v_r, loss_r = _lbfgs(torch, W_out[r], v_out[r], X, mask, y, norm, lbfgs_steps)
                if loss_r < final[r]:
                    W_out[r], v_out[r], final[r] = W_r, v_r, loss_r
                advance(1)
    misfit = np.sqrt(final.numpy())
    winner = int(np.argmin(misfit))
    model = MultiHeadAttention(W_out[winner].numpy(), v_out[winner].numpy()) if np.isfinite(misfit[winner]) else \
        MultiHeadAttention(np.zeros((heads, d, d)), np.zeros((heads, d)))
    best_misfit = float(misfit[winner])
    checks = [Check("training_fit", best_misfit < converged_tol, best_misfit, converged_tol,
                    f"relative RMS misfit of the best of {restarts} restarts on its {n_queries} training answers")]
    return Distillation(
        model=model, queries=boundary.queries, max_query_length=boundary.max_query_length, restarts=restarts,
        adam_steps=adam_steps, lbfgs_steps=lbfgs_steps, polished=polish if lbfgs_steps else 0,
        training_misfit=misfit, best_misfit=best_misfit, converged=float(np.mean(misfit < converged_tol)),
        converged_tol=converged_tol, checks=checks, seconds=time.perf_counter() - started,
    )


def _forward(torch, W, v, X, mask):
    """Student outputs (R, N) for parameters W (R, H, d, d), v (R, H, d) (or (N,) for one student
    without the R axis), laid out as three dense products over all restarts and heads at once."""
    single = W.dim() == 3
    if single:
        W, v = W[None], v[None]
    R, H, d, _ = W.shape
    N, L, _ = X.shape
    queries = torch.matmul(W.reshape(R * H, d, d), X[:, -1, :].T)  # W_h x_N: (RH, d, N)
    scores = torch.bmm(X, queries.permute(2, 1, 0))  # x_i^T W_h x_N: (N, L, RH)
    scores = scores.masked_fill(~mask[:, :, None], -math.inf)  # padding gets no weight
    weights = torch.softmax(scores, dim=1)
    values = (X.reshape(N * L, d) @ v.reshape(R * H, d).T).reshape(N, L, R * H)  # v_h^T x_i
    out = (weights * values).sum(dim=1).reshape(N, R, H).sum(dim=2).T
    return out[0] if single else out


def _lbfgs(torch, W, v, X, mask, y, norm, steps):
    """L-BFGS (:func:`scipy.optimize.minimize`, ``L-BFGS-B`` without bounds, 50 correction pairs) on
    one student, gradients from torch; returns (W, v, loss).

    scipy rather than ``torch.optim.LBFGS``: torch's strong Wolfe line search stops refining the
    step at a hard-coded 1e-9 and stalls near 1e-11 relative loss on this problem, where scipy
    runs on to the rounding level.
    """
    from scipy.optimize import minimize

    shape_W, size_W = W.shape, W.numel()

    def loss_and_gradient(p):
        p = torch.from_numpy(p).requires_grad_(True)
        loss = ((_forward(torch, p[:size_W].reshape(shape_W), p[size_W:].reshape(v.shape), X, mask) - y) ** 2).sum() / norm
        loss.backward()
        value = float(loss.detach())
        if not math.isfinite(value):
            return math.inf, np.zeros(p.numel())
        return value, p.grad.numpy().copy()

    start = np.concatenate([W.numpy().ravel(), v.numpy().ravel()])
    result = minimize(loss_and_gradient, start, jac=True, method="L-BFGS-B",
                      options=dict(maxiter=steps, maxfun=4 * steps, maxcor=50, ftol=0.0, gtol=0.0))
    best = torch.from_numpy(result.x)
    loss = float(result.fun) if math.isfinite(result.fun) else math.inf
    return best[:size_W].reshape(shape_W), best[size_W:].reshape(v.shape), loss
