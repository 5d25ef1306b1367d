"""Every head's scores from the split (docs/algorithm.md, 'Whole answers near the vector bound').

With the split, a query ``X = (x_1 .. x_m, t)`` gives head h's coordinates ``z_h = P_h X^T a_h``
(r_h numbers) and so its weights: ``[P_h X^T; 1^T] a_h = [z_h; 1]``, ``m + 1 <= r_h + 1`` unknowns
(least squares; ``m`` about ``r/2`` keeps it well conditioned). Then ``log(a_i / a_N) =
(x_i - t)^T q_h(t)`` with ``q_h(t) = W_h t + u_h``: m equations for every head at once. Phase 1
asks ``d / m`` (oversampled) queries per final token until the span of the ``q_h(t)`` stops
growing (a direction counts where it stands above the vectors' own measured noise,
:func:`score_rank`): it is ``K_h``, of dimension ``k_h = rank [W_h | u_h]``. Phase 2 asks about
``k_h / m`` queries per further final token, ``q_h(t) = K_h g_h(t)``. Over ``d + 1`` and more
final tokens the affine map ``g_h(t) = G_h t + beta_h`` is a least-squares fit:
``W_h = K_h G_h``, ``u_h = K_h beta_h``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular
from scipy.linalg.blas import dtrsv

from ..split.subspaces import ASK_TOKENS, Split, exact_tokens
from ..split.values import SplitUnavailable
from ..split.weights import attention_weights, log_ratios

#: Oversampling of the equations per final token (phase 1: d unknowns, phase 2: k_h) and final
#: tokens beyond the d + 1 the affine map needs, as a fraction of d (the fit's conditioning), by the
#: refinement that follows float64 answers: ``FITTED`` where every parameter is refined, ``(1.5,
#: 0.25)`` where the scores' only are (d = 256, H = 2..8: output error 2.4e-13..2.8e-13 in 4,840..5,854
#: queries, estimates 2.2e-11..4.1e-11 under their limit 1e-10; ``OVERSAMPLED`` at H = 8 and 4:
#: 3.2e-14 and 5.7e-14 in 7,795 and 7,783, ``bench_vector.py --score-design 3 1``). ``OVERSAMPLED`` where the answers are float32: their score parameters are limited by
#: the information in the answers, not by the refinement. Where no refinement follows the start
#: carries the precision itself, ``UNREFINED``: the oversampled equations per final token, and
#: ``1.5 d + 1`` final tokens, whose queries go to phase 1 instead (``PHASE_ONE[""]``: K_h, which
#: nothing corrects afterwards, is the larger part of W_h's error there; GPT-2 small in float32: 9.4e-6
#: at every position in 29,138 queries, against 1.0e-5 in 29,330 with ``OVERSAMPLED`` and phase 1 on
#: 1.5 k final tokens).
FITTED, OVERSAMPLED, UNREFINED = (1.5, 0.125), (3.0, 1.0), (3.0, 0.5)
REFINED_DESIGN = {"full": FITTED, "scores": (1.5, 0.25)}
#: Final tokens per batch of phase 1 (its queries' tokens and equations are held a batch at a time).
#: A round asks, in batches, the final tokens its stop needs for score ranks equal to the value ranks
#: (a head of width r has ``rank [W_h | u_h] <= r + 1``, and GPT-2-class heads ``r``), then to the
#: score ranks measured; while some head's rank grows with every final token, one batch a round.
FINALS_PER_ROUND = 8
#: Phase 1's end, ``(beyond, factor)`` of :func:`learn_scores`, by the refinement that follows (the
#: routes of :func:`~mhaextract.vector.learn.refinement_route`). ``K_h`` is the span of phase 1's F
#: score vectors, off by their noise over their k-th singular value, which grows as ``sqrt(F) -
#: sqrt(k)`` (F = k + 3 at k = 128: 0.13; k + 8: 0.35; 2 k at k = 64: 3.3). The full refinement fits
#: ``K_h`` on every answer, so three final tokens past the rank suffice; the scores-only refinement's
#: few steps start from it (d = 256, H = 2, r = 128: output error 1.3e-12 with k + 3, 4.8e-13 with
#: k + 8); where no refinement follows, phase 2 reads ``q_h`` inside ``K_h`` only and nothing after it
#: corrects ``K_h`` (docs/algorithm.md, 'Whole answers near the vector bound', 'Where no refinement
#: follows'): 2 k.
PHASE_ONE = {"full": (3, 0.0), "scores": (8, 0.0), "": (8, 2.0)}
#: The scores' token scale is set so that the log-ratios ``log(a_i / a_N)`` have about this RMS:
#: soft attention, every weight well above the answers' rounding, so each query tells about W_h in
#: every direction (at the calibrated scale of a GPT-2-class layer the RMS is about 3, many weights
#: are near 0 and W_h comes out 400 times worse).
SCORE_SPREAD = 0.35
#: Pilot queries per look at the spread (two looks: the scores are not exactly quadratic in the scale).
PILOT_QUERIES, PILOT_LOOKS = 8, 2
#: Final tokens per batch of phase 2 (its equations' working memory: at d = 768 all at once was GBs).
PHASE2_FINALS = 128
#: Token numbers one batch holds at most (its float32 tokens 128 MiB, their float64 rows twice that):
#: a batch asks fewer final tokens than ``FINALS_PER_ROUND`` or ``PHASE2_FINALS`` where theirs would
#: hold more (d = 4096: one final token's 192 queries of 65 tokens are 51e6 numbers; d <= 768: never).
BATCH_NUMBERS = 2 ** 25
#: Random numbers drawn at once for the score queries' tokens (:func:`_tokens`; 32 MB in float64).
DRAW_NUMBERS = 2 ** 22
#: CGLS iterations at most for one final token's phase-1 least squares (:func:`_solve_heads`).
CGLS_ITERATIONS = 200


def _batch_finals(most: int, per_final: int, m: int, d: int) -> int:
    """Final tokens per batch: ``most``, or as many as ``BATCH_NUMBERS`` holds (at least one)."""
    return max(1, min(most, BATCH_NUMBERS // (per_final * (m + 1) * d)))


@dataclass
class ScoreBatch:
    """One batch of this step's queries: ``per_final`` queries of m random tokens at ``scale`` before
    each of ``finals`` (F, d), and their whole answers; ``full``: phase 1 (``q_h`` in full) or phase 2
    (its coordinates in ``K_h``). The tokens ``X`` (F per_final, m + 1, d) are drawn again from the
    random stream's state when asked for, not held: at d = 768 every score query's tokens would hold
    1.4 GB as float32."""

    draw: np.random.Generator   # a copy of the stream as it stood before the batch's tokens were drawn
    m: int
    scale: float
    answers: np.ndarray
    finals: np.ndarray
    per_final: int
    full: bool

    @property
    def X(self) -> np.ndarray:
        """The tokens asked, float32 numbers (exact: the oracle got them as float64)."""
        return _tokens(copy.deepcopy(self.draw), self.finals, self.per_final, self.m, self.scale)


def _tokens(rng, finals: np.ndarray, per_final: int, m: int, scale: float) -> np.ndarray:
    """m random tokens before each final token, ``per_final`` times, rounded to float32 numbers. Drawn
    ``DRAW_NUMBERS`` at a time (the stream gives the same numbers in pieces) and written into the
    float32 result: a whole batch's float64 draws would be 180 MB at d = 768."""
    F, d = finals.shape
    X = np.empty((F, per_final, m + 1, d), dtype=np.float32)
    X[:, :, m] = finals[:, None]
    step = max(1, DRAW_NUMBERS // (per_final * m * d))
    for start in range(0, F, step):
        others = rng.standard_normal((min(step, F - start), per_final, m, d))
        others *= scale
        others /= np.sqrt(d)
        X[start:start + step, :, :m] = others
    return X.reshape(F * per_final, m + 1, d)


def tokens_per_query(ranks: list[int]) -> int:
    """m: about half the narrowest head's value rank (the weights' solve stays well conditioned)."""
    return max(1, (min(ranks) + 1) // 2)


def _batch_equations(split: Split, c: np.ndarray, batch: ScoreBatch, X: np.ndarray | None = None):
    """``(rows, per_head)``: the rows ``x_i - t`` (F, per_final m, d), shared by every head, and per
    head the log-ratios and their weights (F, per_final m) of one batch. ``X``: its tokens where the
    caller holds them (:func:`_ask`'s), else drawn again (:attr:`ScoreBatch.X`)."""
    # float32 numbers, exact in float64: widened where used (a float64 copy would hold 150 MB at d = 768)
    X = batch.X if X is None else X
    F, d, m = len(batch.finals), X.shape[2], X.shape[1] - 1
    rows = X[:, :-1].astype(np.float64)
    rows -= X[:, -1:]  # exact differences, in place (a second float64 copy would be 180 MB at d = 768)
    rows = rows.reshape(F, batch.per_final * m, d)
    return rows, [tuple(part.reshape(F, -1) for part in log_ratios(a))
                  for a in attention_weights(split, X, batch.answers, c)]


def _ask(boundary, rng, finals: np.ndarray, per_final: int, m: int, scale: float, unit: float, full: bool,
         description: str) -> tuple[ScoreBatch, np.ndarray]:
    """Queries of m random tokens before each final token: ``(batch, X)``, X the tokens asked (F per_final,
    m + 1, d), float32 numbers (exact in float64: the oracle gets float64 arrays), which the caller
    solves at once and lets go; the batch keeps the stream's state to draw them again."""
    draw = copy.deepcopy(rng)
    X = _tokens(rng, finals, per_final, m, scale)
    step = max(1, ASK_TOKENS // (m + 1))  # the layer's working memory grows with the tokens of one call
    answers = np.concatenate([np.asarray(boundary.ask([x.astype(np.float64) for x in X[start:start + step]],
                                                      description, whole=True))
                              for start in range(0, len(X), step)])
    return ScoreBatch(draw, m, scale, answers, finals.astype(np.float32).astype(np.float64), per_final, full), X


def _solve(rows: np.ndarray, ratios: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Weighted least squares per final token: (F, n, p) rows -> (F, p) solutions."""
    A = rows * weight[..., None]
    b = ratios * weight
    return np.stack([np.linalg.lstsq(A_f, b_f, rcond=None)[0] for A_f, b_f in zip(A, b)])


def _solve_heads(rows: np.ndarray, per_head: list, noise_rng: np.random.Generator | None = None):
    """Per head, the weighted least squares of :func:`_solve` on rows shared by every head, (F, n, d)
    -> (F, d) each: one QR ``rows_f = Q R`` per final token serves all heads, then CGLS on
    ``diag(w_h) Q y = diag(w_h) rho_h`` for all heads at once (its condition number is the weights'
    spread, small at the scores' token scale), ``q_h = R^-1 y``. A head whose CGLS does not settle in
    ``CGLS_ITERATIONS`` (weights spread over many orders) is solved by :func:`_solve`.

    With ``noise_rng``, also per head a draw of each solution's noise (F, d): the weighted equations'
    misfit ``s_h^2 = |diag(w_h) (rows q_h - rho_h)|^2 / (n_h - d)`` (``n_h`` the equations of positive
    weight) measures their noise, and the same least squares solved for a right-hand side of white
    noise ``s_h g`` (``g`` standard normal, the weighted equations' noise model) is a draw of the
    solution's error, covariance ``s_h^2 (rows^T W_h^2 rows)^-1`` (docs/algorithm.md, 'Whole answers
    near the vector bound', 'The score rank of phase 1'). Returns ``(solutions, noise draws or None)``."""
    F, n, d = rows.shape
    out = [np.empty((F, d)) for _ in per_head]
    noise = None if noise_rng is None else [np.empty((F, d)) for _ in per_head]
    heads = len(per_head)
    for f in range(F):
        Q, R = np.linalg.qr(rows[f])
        w = np.stack([weight[f] for _, weight in per_head], axis=1)              # (n, H)
        rho = np.stack([ratios[f] for ratios, _ in per_head], axis=1)
        counted = w > 0
        if noise_rng is None:
            y, settled = _cgls(Q, w, rho * w)
        else:
            # the noise draws' right-hand sides solved in the same CGLS as the ratios (one pass over Q
            # serves 2H columns): CG is homogeneous in its right-hand side, so white noise g solved
            # here and scaled by s_h afterwards is the draw for s_h g
            g = noise_rng.standard_normal((n, heads)) * counted
            both, settled = _cgls(Q, np.concatenate([w, w], axis=1), np.concatenate([rho * w, g], axis=1))
            (y, y_noise), (settled, settled_noise) = np.split(both, 2, axis=1), np.split(settled, 2)
        upper = _upper(R)
        for h, (ratios, weight) in enumerate(per_head):
            out[h][f] = (dtrsv(upper, y[:, h]) if settled[h]
                         else _solve(rows[f:f + 1], ratios[f:f + 1], weight[f:f + 1])[0])
        if noise_rng is None:
            continue
        free = np.maximum(counted.sum(axis=0) - d, 1)
        spread = np.sqrt(((w * (rho - Q @ y)) ** 2).sum(axis=0) / free)              # s_h
        draws = solve_triangular(R, y_noise * spread)  # one triangular solve for every head (no model bits)
        for h, (_, weight) in enumerate(per_head):
            noise[h][f] = (draws[:, h] if settled_noise[h] else
                           _solve(rows[f:f + 1], spread[h] * g[None, :, h] / np.where(counted[:, h], w[:, h], 1.0),
                                  weight[f:f + 1])[0])
    return out, noise


def _upper(R: np.ndarray) -> np.ndarray:
    """The triangular factor of a QR for :func:`~scipy.linalg.blas.dtrsv` (column-major), LinAlgError
    where it is singular. ``R`` is upper triangular: its LU factors (partial pivoting) are ``I`` and
    ``R`` itself, so ``np.linalg.solve(R, y)`` is this triangular solve, the same numbers, after a
    factorisation of ``d^3 / 3`` multiply-adds per head that changes nothing."""
    if not np.all(np.diagonal(R)):
        raise np.linalg.LinAlgError("Singular matrix")
    return np.asfortranarray(R)


def _cgls(Q: np.ndarray, w: np.ndarray, b: np.ndarray):
    """``(y, settled)``: CGLS on ``diag(w_j) Q y_j = b_j`` for every column j of ``w`` and ``b`` (n, J)
    at once, started from the unweighted solution, ``CGLS_ITERATIONS`` at most."""
    y = Q.T @ (b / np.where(w > 0, w, 1.0) * (w > 0))                           # the unweighted solution
    residual = b - w * (Q @ y)
    gradient = Q.T @ (w * residual)
    direction, gamma = gradient.copy(), (gradient ** 2).sum(axis=0)
    settled = np.sqrt(gamma) <= 1e-12 * w.max(axis=0) * np.linalg.norm(residual, axis=0)
    for _ in range(CGLS_ITERATIONS):
        if settled.all():
            break
        image = w * (Q @ direction)
        alpha = gamma / np.maximum((image ** 2).sum(axis=0), 1e-300) * ~settled
        y += alpha * direction
        residual -= alpha * image
        gradient = Q.T @ (w * residual)
        new_gamma = (gradient ** 2).sum(axis=0)
        direction = gradient + new_gamma / np.maximum(gamma, 1e-300) * direction
        gamma = new_gamma
        settled |= np.sqrt(gamma) <= 1e-12 * w.max(axis=0) * np.linalg.norm(residual, axis=0)
    return y, settled


#: A direction of a head's ``[W_h | u_h]`` counts where its singular value is at least this many
#: units of the answers' rounding of the largest (float64: at least 1e-8): the cut of the refined
#: score maps, whose spectra fall to the rounding beyond the layer's directions, and the least a
#: direction of phase 1's score vectors must reach on top of their measured noise
#: (:func:`score_rank`).
SCORE_RANK_UNITS = 1e3
#: Phase 1 counts a direction of the score vectors where its singular value is above this many
#: times the largest singular value of a draw of their noise (:func:`score_rank`; the margin's
#: derivation: docs/algorithm.md, 'Whole answers near the vector bound', 'The score rank of phase 1').
NOISE_MARGIN = 1.5


def score_rank(vectors: np.ndarray, unit: float, noise: np.ndarray | None = None) -> int:
    """Directions of ``vectors`` (score vectors ``q_h(t)`` as rows, or a head's ``[W_h | u_h]``)
    above ``SCORE_RANK_UNITS`` units of the largest (float64: 1e-8) and, where ``noise`` (a draw of
    the rows' errors, the same shape) is given, above ``NOISE_MARGIN`` times its largest singular
    value: ``sigma_(k+1)(T + E) <= |E|`` for the true vectors T of rank k, so no direction of the
    noise passes, and every true direction above ``(NOISE_MARGIN + 1) |E|`` does."""
    s = np.linalg.svd(vectors, compute_uv=False)
    floor = max(1e-8, SCORE_RANK_UNITS * unit) * s[0]
    if noise is not None:
        floor = max(floor, NOISE_MARGIN * float(np.linalg.norm(noise, 2)))
    return int((s > floor).sum())


#: Seed of the noise draws of phase 1 (apart from the queries' stream: the draws ask nothing).
NOISE_SEED = 62


def _solve_full(split: Split, c: np.ndarray, batch: ScoreBatch, index: int, X: np.ndarray | None = None):
    """Phase 1's solve of one batch, the ``index``-th of phase 1 (its noise draws' seed):
    :func:`_solve_heads` on :func:`_batch_equations` (``X``: the tokens asked, where held)."""
    return _solve_heads(*_batch_equations(split, c, batch, X), noise_rng=np.random.default_rng([NOISE_SEED, index]))


def _full_vectors(split: Split, c: np.ndarray, batches: list[ScoreBatch], solved: dict | None = None):
    """Phase 1: the final tokens, per head ``q_h(t)`` in full (F, d) and a draw of their noise (F, d)
    (:func:`_solve_heads`). ``solved``: the batches solved before (by position, :func:`_solve_full`),
    kept between phase 1's rounds so that each is solved once."""
    solved = {} if solved is None else solved
    heads = len(split.ranks)
    finals = np.concatenate([batch.finals for batch in batches])
    full, noise = [[] for _ in range(heads)], [[] for _ in range(heads)]
    for index, batch in enumerate(batches):
        if index not in solved:
            solved[index] = _solve_full(split, c, batch, index)
        for h in range(heads):
            full[h].append(solved[index][0][h])
            noise[h].append(solved[index][1][h])
    return finals, [np.concatenate(q) for q in full], [np.concatenate(e) for e in noise]


def score_bases(full: list[np.ndarray], ranks: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(K, coordinates)``: per head ``K_h``, the leading ``k_h`` left singular vectors of phase 1's
    score vectors (F, d), and their coordinates ``g_h(t) = K_h^T q_h(t)`` (F, k_h)."""
    bases = [np.linalg.svd(q.T, full_matrices=False)[0][:, :rank] for q, rank in zip(full, ranks)]
    return bases, [q @ K for q, K in zip(full, bases)]


def score_coordinates(split: Split, c: np.ndarray, batch: ScoreBatch, bases: list[np.ndarray],
                      X: np.ndarray | None = None) -> list[np.ndarray]:
    """Phase 2: per head the coordinates ``g_h(t)`` (F, k_h) of a batch's final tokens in ``K_h``
    (``X``: the tokens asked, where held). The rows are projected on every head's basis in one
    product (each column the same sums as in a product per head)."""
    rows, per_head = _batch_equations(split, c, batch, X)
    widths = np.cumsum([0] + [K.shape[1] for K in bases])
    projected = (rows.reshape(-1, rows.shape[2]) @ np.concatenate(bases, axis=1)).reshape(rows.shape[:2] + (-1,))
    del rows
    return [_solve(projected[:, :, start:stop], ratios, weight)
            for start, stop, (ratios, weight) in zip(widths[:-1], widths[1:], per_head)]


def affine_scores(finals: np.ndarray, coordinates: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(G, beta)``: per head the least-squares affine map ``g_h(t) = G_h t + beta_h`` over the final
    tokens ``finals`` (F, d) and their coordinates (F, k_h). SplitUnavailable where it is not finite."""
    d = finals.shape[1]
    design = np.concatenate([finals, np.ones((len(finals), 1))], axis=1)
    G, beta = [], []
    for g in coordinates:
        solution = np.linalg.lstsq(design, g, rcond=None)[0]  # (d + 1, k)
        G.append(solution[:d].T)
        beta.append(solution[d])
    if not all(np.isfinite(x).all() for x in G + beta):
        raise SplitUnavailable("the heads' attention weights could not be read from the split answers")
    return G, beta


def _spread(split: Split, c: np.ndarray, batch: ScoreBatch, X: np.ndarray | None = None) -> float:
    """RMS of the log-ratios over every head of a batch's queries (where all its weights are positive)."""
    ratios = [ratios[weight > 0] for ratios, weight in _batch_equations(split, c, batch, X)[1]]
    values = np.concatenate([r.ravel() for r in ratios])
    return float(np.sqrt(np.mean(values ** 2))) if values.size else float("inf")


def score_scale(boundary, rng, d: int, scale: float, split: Split, c: np.ndarray, unit: float, m: int):
    """``(scale, pilots)``: the token scale at which the log-ratios' RMS is about ``SCORE_SPREAD``
    (never above the calibrated one), from ``PILOT_LOOKS`` pilot batches (which the refinement fits too).
    The log-ratios ``(x_i - t)^T (W_h t + u_h)`` grow as the scale squared where W_h dominates."""
    pilots = []
    for _ in range(PILOT_LOOKS):
        finals = exact_tokens(rng.standard_normal((PILOT_QUERIES, d)) * scale / np.sqrt(d), unit)
        pilot, X = _ask(boundary, rng, finals, 1, m, scale, unit, True, "weights: the scores' token scale")
        pilots.append(pilot)
        spread = _spread(split, c, pilot, X)
        if np.isfinite(spread) and spread > 0:
            scale *= min(1.0, float(np.sqrt(SCORE_SPREAD / spread)))
    return scale, pilots


def score_queries(d: int, ranks: list[int], design: tuple[float, float]) -> int:
    """About how many queries :func:`learn_scores` asks (phase 1 over ``k + 3`` final tokens, k taken
    as the widest value rank)."""
    m, k = tokens_per_query(ranks), max(ranks)
    oversample, extra = design
    finals = d + 1 + max(4, int(extra * d))
    return ((k + 3) * int(np.ceil(oversample * d / m)) + (finals - k - 3) * int(np.ceil(oversample * k / m))
            + PILOT_LOOKS * PILOT_QUERIES)


def learn_scores(boundary, rng, d: int, scale: float, split: Split, c: np.ndarray, unit: float,
                 design: tuple[float, float] = FITTED, phase_one: tuple[int, float] = PHASE_ONE["full"]):
    """``(K, G, beta, batches, scale)``: per head ``K_h`` (d x k_h), ``G_h`` (k_h x d), ``beta_h``
    (k_h), the batches asked (:class:`ScoreBatch`, the pilots of :func:`score_scale` first) and the
    scores' token scale. ``design``: ``REFINED_DESIGN[route]`` or ``OVERSAMPLED``; ``phase_one = (beyond, factor)``:
    phase 1 ends where every head's span stopped growing over ``beyond`` final tokens past its rank
    ``k_h`` (at least 3: they must add no direction) and ``factor k_h`` final tokens are asked
    (``PHASE_ONE``)."""
    heads, m = len(split.ranks), tokens_per_query(split.ranks)
    oversample, extra = design
    scale, pilots = score_scale(boundary, rng, d, scale, split, c, unit, m)
    finals_needed = d + 1 + max(4, int(extra * d))
    new_finals = lambda count: exact_tokens(rng.standard_normal((count, d)) * scale / np.sqrt(d), unit)  # noqa: E731
    beyond, factor = phase_one
    stop = lambda rank: max(rank + beyond, int(np.ceil(factor * rank)))  # noqa: E731  (finals that end phase 1)
    batches, asked, solved, ranks = [], 0, {}, list(split.ranks)
    per_final = int(np.ceil(oversample * d / m))
    while True:  # phase 1: q_h(t) in full, until every head's span stopped growing
        growing = asked and any(rank >= asked for rank in ranks)
        goal = min(finals_needed, asked + FINALS_PER_ROUND if growing else max(map(stop, ranks)))
        while asked < goal:
            count = min(_batch_finals(FINALS_PER_ROUND, per_final, m, d), goal - asked)
            batch, X = _ask(boundary, rng, new_finals(count), per_final, m, scale, unit, True,
                            "weights: whole score vectors")
            solved[len(batches)] = _solve_full(split, c, batch, len(batches), X)  # the tokens asked, not drawn again
            batches.append(batch)
            del X
            asked += count
        finals, full, noise = _full_vectors(split, c, batches, solved)
        ranks = [score_rank(q, unit, e) for q, e in zip(full, noise)]
        if all(stop(rank) <= asked for rank in ranks) or asked >= finals_needed:
            break
    K, coordinates = score_bases(full, ranks)
    per_final = int(np.ceil(oversample * max(ranks) / m))
    while finals_needed > asked:  # phase 2: q_h(t) = K_h g_h(t), k_h unknowns per final token
        count = min(_batch_finals(PHASE2_FINALS, per_final, m, d), finals_needed - asked)
        batch, X = _ask(boundary, rng, new_finals(count), per_final, m, scale, unit, False,
                        "weights: score coordinates")
        more = score_coordinates(split, c, batch, K, X)
        coordinates = [np.concatenate([g, part]) for g, part in zip(coordinates, more)]
        finals = np.concatenate([finals, batch.finals])
        batches.append(batch)
        del X
        asked += count
    G, beta = affine_scores(finals, coordinates)
    return K, G, beta, pilots + batches, scale
