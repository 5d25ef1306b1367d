"""A key-neutral token for rotary attention with a key bias (docs/algorithm.md, 'A key bias').

With key biases ``k_h`` (Qwen2) a zero token scores ``k_h^T R_h(delta) q_h`` at offset delta: it is
no counter. A token ``z*`` with ``K_h z* + k_h = 0`` in every head scores 0 from every final token
at every offset, and shifting every token by it gives a layer without key bias
(:class:`ShiftedBoundary`). From whole float64 answers it is found in three steps:

1. A final token ``x_q`` whose query is zero (``Q_h x_q + b_h = 0`` in every head; one exists where
   ``H r <= d``): every key then scores 0, the attention is uniform and
   ``f(t_1, .., t_{n-1}, x_q) = c + V (t_1 + .. + t_{n-1} + x_q) / n`` with ``V = sum_h V_h``.
   Levenberg-Marquardt (``scipy.optimize.least_squares``) on the misfit from that mean over a few
   probe sequences finds it.
2. With the final token ``x_q + eps e`` the queries are ``eps Q_h e``: to first order in eps the
   answers are linear in the scores, and the scores linear in the keys. In ``(z^(N-2), y, x_q +
   eps e)``, z value-invisible (``z = x_q + n``, n in the null space of V, so that z carries the
   value of x_q in every head), the first-order term ``D_N`` gives ``T_N = N^2 D_N - N V e``, which
   is affine in N for a neutral z, and otherwise has the second difference
   ``T_{N+1} - 2 T_N + T_{N-1} = -sum_h V_h (y - x_q) (K_h z + k_h)^T (R_h(N) - R_h(N - 1)) Q_h e``:
   linear in ``K_h z + k_h``, so a least-squares solve over n for the part of ``T_N`` not affine in N
   finds z.
3. That token can be far out, and its query is then the shifted layer's large query bias. The
   criterion vanishes on every neutral token ``z + null(K)`` and, at z, moves with ``K m`` alone:
   its Jacobian's row space is K's, and z projected on it is the smallest neutral token, polished
   by Newton steps within that row space.

Under a sliding window every sequence of the search stays within it (:func:`within_window`).

From float32 answers the first-order differences of steps 1 and 2 are the layer's rounding, and
the search is another (:func:`large_query_search`): Newton steps on ``z`` from 0 over the misfit
of ``(z^(N-1), z + w)`` from uniform attention, the finals' offsets ``w`` grown to give large
queries while their self-scores are held at zero; then, for the slow blocks, finals that take half
the weight after up to 1024 copies (:func:`half_weight_search`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from ..checks.base import Check
from ..oracle.answer_stats import FLOAT64_UNIT, FORMAT_UNITS
from ..oracle.progress import note_progress

#: Tokens of each probe sequence of the query-neutral search before its final token.
PROBE_TOKENS = 16
#: Norms of the probe tokens tried in turn, in units of the token scale: the steps from 0 stop at
#: other minima of the misfit on some layers at each size, never at all three (docs/algorithm.md
#: 'Rotary attention: positions, grouped heads and sliding windows';
#: ``benchmarks/bench_rotary_layers.py --probe-scales``).
PROBE_SCALES = (3.0, 1.0, 10.0)
#: The first-order term ``D_N`` by a central difference of eight points, ``+-eps, .., +-4 eps``:
#: ``D = sum_k STENCIL[k] (f(+k eps) - f(-k eps)) / eps`` (error of order ``eps^8``).
STENCIL = np.array([672.0, -168.0, 32.0, -3.0]) / 840.0
#: The four-point stencil (``+-eps, +-2 eps``, error of order ``eps^4``) of the search's Jacobians,
#: which steer its Newton steps and show K's row space; a criterion a step solves, or the check
#: reads, is at ``STENCIL``'s eight points.
JACOBIAN_STENCIL = np.array([8.0, -1.0]) / 12.0
#: The step ``eps`` of the final token with float64 answers, relative to the token scale at ``d = 1``
#: (``eps = EPSILON token_scale / d^(1/4)``): queries of about 1e-3 of the tokens', where rounding
#: (amplified by ``N^2 / eps``) and the stencil's error balance.
EPSILON = 1e-3
#: Lengths N of the key-neutral search's sequences ``(z^(N-2), y, x_q + eps e)``.
LENGTHS = (2, 3, 4, 5, 6, 8, 11, 16, 23, 32, 45, 64, 90, 128, 181, 256)
#: Lengths of the search for the smallest neutral token (a Jacobian over all d directions).
NULL_SPACE_LENGTHS = (2, 3, 4, 6, 11, 23, 64, 128, 256)
#: Query changes ``e`` asked at every length (more within a short window: as many criterion rows
#: as at all of ``LENGTHS``, each length giving one score per head and direction).
DIRECTIONS = 2
#: Newton steps of the key-neutral search, on one Jacobian (the criterion is affine in the key to
#: first order in eps; the second step takes out what the first left of the higher orders).
NEWTON_STEPS = 2
#: Evaluations of the query-neutral search's Levenberg-Marquardt besides its Jacobians.
LM_EVALUATIONS = 100
#: Newton steps within K's row space from the projection of z* on it (the smallest neutral token;
#: the key it leaves: docs/rotary.md, "A key bias").
SMALLEST_STEPS = 1
#: Singular values of ``V`` below this fraction of the largest span the value-invisible directions
#: (or ``VALUE_RANK_UNITS`` units of the answers' rounding, where that is larger).
VALUE_RANK_CUT, VALUE_RANK_UNITS = 1e-9, 1e3
#: The large-query search (float32 answers): final tokens ``z + w_j``, their offsets' norms in units
#: of the token scale, grown in turn (the criterion's response to a key grows with the final's
#: query), Newton steps at each size and at most ``EXTRA_STEPS`` more at the last while each cuts
#: the criterion to ``EXTRA_GAIN`` of what it was. Eight finals: the start needs keys of 1e-6
#: (docs/rotary.md, "From float32 answers").
LARGE_QUERY_FINALS = 8
FINAL_SIZES = (1.0, 3.0, 10.0)
STEPS_PER_SIZE, EXTRA_STEPS, EXTRA_GAIN = 2, 6, 0.5
#: Lengths N of ``(z^(N-1), z + w)``: long enough that the slowest blocks turn (theta = 3e-4 by
#: 0.65 rad at 2048).
LARGE_QUERY_LENGTHS = (2, 3, 5, 8, 13, 20, 32, 51, 81, 128, 203, 323, 512, 813, 1290, 2048)
#: Shapes ``(N - 1) / N^(k + 2)`` of ``Y_N - Y_1 / N``, k below this, projected out: a final's
#: self-score to that order.
SELF_SCORE_SHAPES = 4
#: Gauss-Newton steps that zero a final's self-scores (the two-token test), in an H-dimensional
#: subspace of moves of ``SELF_SCORE_MOVE`` times the offset's norm; another subspace is tried
#: where one leaves them above ``SELF_SCORE_LIMIT`` (``SELF_SCORE_TRIES`` in all).
SELF_SCORE_STEPS, SELF_SCORE_MOVE, SELF_SCORE_TRIES = 6, 1e-2, 2
#: The offsets grow from one size to the next by at most this factor at a time.
GROWTH = 1.5
#: The difference step of the Newton steps' Jacobians over z, relative to the token scale.
TOKEN_STEP = 1e-3
#: Largest two-token misfit (relative) left at the finals whose self-scores were zeroed: about
#: half the largest self-score, whose fifth power the shapes leave.
SELF_SCORE_LIMIT = 1e-3
#: The shortest sliding window the large-query search takes: ``SELF_SCORE_SHAPES + 4`` lengths in it.
LARGE_QUERY_MIN_WINDOW = LARGE_QUERY_LENGTHS[SELF_SCORE_SHAPES + 2] + 1
#: The half-weight stage after the large-query search (docs/algorithm.md, 'From float32 answers',
#: 'Finals at half weight for the slow blocks'): the finals' self-scores raised to ``log(count - 1)`` along
#: these counts (each a factor of about 2 from the last, where the Gauss-Newton steps still reach),
#: the last at most half the longest length; ``HALF_WEIGHT_TRIES`` subspaces each.
HALF_WEIGHT_COUNTS = (3, 5, 9, 17, 33, 65, 129, 257, 513, 1025)
HALF_WEIGHT_TRIES = 3
#: Lengths N of ``(z^(N-1), z + w)`` at half weight: most near the count, where a slow block turns
#: (theta = 1e-3 by 2 rad at 2048) and the final's weight moves most with the copies' scores.
HALF_WEIGHT_LENGTHS = (2, 16, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
#: Shapes ``(d / d log E)^k E / (E + N - 1)`` at the count's E, k below this, projected out: the heads'
#: self-scores off ``log E`` to first order (a key's response is smooth in N too, and five shapes took 95%
#: of a slow block's), so the finals are held to ``HALF_WEIGHT_LIMIT`` (self-scores within about 1e-4).
HALF_WEIGHT_SHAPES = 2
HALF_WEIGHT_LIMIT = 2e-5
#: Newton steps of the half-weight stage (stacked with the large-query criterion, whose last
#: Jacobian is kept), each kept only where it lowers both; the difference step relative to the
#: token scale (the criterion's noise is about 1e-6, its response to a move of the token about 1),
#: and the least squares' cut (relative singular values, below them noise).
HALF_WEIGHT_STEPS, HALF_WEIGHT_STEP, HALF_WEIGHT_RCOND = 3, 1e-2, 1e-3
#: Largest misfit (relative to the answers) of the uniform attention at the query-neutral token
#: (or ``QUERY_UNITS`` units of the answers' rounding).
QUERY_LIMIT, QUERY_UNITS = 1e-9, 30.0
#: Largest part of ``T_N`` not affine in N left at the key-neutral token, relative to its change
#: under a move of the token by the token scale (or ``KEY_UNITS`` units of the answers' rounding).
KEY_LIMIT, KEY_UNITS = 1e-6, 1e4
#: After the half-weight stage (float32 answers) its criterion's misfit within this many units: the
#: answers' noise leaves about a hundred units where the keys are gone, and a key of 1e-4 in a slow block
#: stands out of it (docs/algorithm.md, 'Finals at half weight for the slow blocks').
HALF_WEIGHT_KEY_UNITS = 300.0
#: The answers' unit the large-query search assumes: float32's, also for float64 answers computed in it.
COARSE_UNIT = FORMAT_UNITS["float32"]


@dataclass
class NeutralToken:
    """What the search for a key-neutral token asked and found.

    Attributes
    ----------
    token : the key-neutral token ``z*`` (d,), or None where the search stopped.
    query_neutral : the final token ``x_q`` whose query is zero (d,), or None.
    d : the token dimension.
    value_rank : the rank of ``V = sum_h V_h`` (the value rows, ``n_kv r`` for grouped heads); -1
        after the large-query search, which does not read it.
    query_misfit : the uniform attention's misfit at ``x_q``, relative to the answers.
    key_misfit : the part of ``T_N`` not affine in N at ``z*`` (after the large-query search: of the
        half-weight criterion, :func:`half_weight_misfit`), relative to its change under a move of the
        token by the token scale.
    queries : queries the search asked.
    unit : the answers' rounding unit, which scales the limits.
    key_gap : the criterion Jacobian's singular value past K's rank over the one at it (the gap
        that tells K's row space from its null space).
    invisible_token : the key-neutral token among the value-invisible ones (``x_q + n``), before
        the smallest was taken.
    large_queries : whether the token came from :func:`large_query_search` (float32 answers),
        which has no query-neutral token and no value-invisible step.
    self_score_misfit : with ``large_queries``, the largest two-token misfit from uniform attention
        left at the last finals (their self-scores held at zero), relative to the answers.
    """

    token: np.ndarray | None
    query_neutral: np.ndarray | None
    d: int
    value_rank: int
    query_misfit: float
    key_misfit: float
    queries: int
    unit: float = FLOAT64_UNIT
    key_gap: float = np.nan
    invisible_token: np.ndarray | None = None
    large_queries: bool = False
    self_score_misfit: float = np.nan

    def checks(self) -> list[Check]:
        """``value_null_space``, then ``query_neutral`` and ``key_neutral`` as far as the search went;
        after the large-query search, ``self_scores`` and ``key_neutral``."""
        key_limit = (HALF_WEIGHT_KEY_UNITS * self.unit if self.large_queries
                     else max(KEY_LIMIT, KEY_UNITS * self.unit))
        left = ("the answers' part off the shapes of finals at half weight" if self.large_queries
                else "the part of the first-order answers not affine in the count")
        key_check = Check("key_neutral", self.key_misfit <= key_limit, self.key_misfit, key_limit,
                          f"{left} left at the key-neutral token, relative to its change under a move of the "
                          "token by the token scale")
        if self.large_queries:
            checks = [Check("self_scores", self.self_score_misfit <= SELF_SCORE_LIMIT, self.self_score_misfit,
                            SELF_SCORE_LIMIT, "the final tokens' two-token misfit from uniform attention after "
                            "their self-scores were zeroed, relative to the answers")]
            return checks + [key_check] if checks[0].passed else checks
        checks = [Check("value_null_space", self.value_rank < self.d, float(self.value_rank), float(self.d),
                        "rank of the summed value maps below d: the key-neutral token is sought among tokens "
                        "that carry the final token's value in every head (grouped-query heads, n_kv r < d)")]
        if not checks[0].passed:
            return checks
        query_limit = _query_limit(self.unit)
        checks.append(Check("query_neutral", self.query_misfit <= query_limit, self.query_misfit, query_limit,
                            "misfit of uniform attention at the final token found to have zero query, relative "
                            "to the answers (none exists where H r > d)"))
        if checks[-1].passed:
            checks.append(key_check)
        return checks


def _query_limit(unit: float) -> float:
    return max(QUERY_LIMIT, QUERY_UNITS * unit)


class ShiftedBoundary:
    """A query boundary seen through ``x' -> x' + shift``: every sequence asked has every token moved
    by ``shift``, so a layer with key bias ``k_h`` and a key-neutral shift ``z*`` answers as a layer
    with keys ``K_h x'`` (no key bias), queries ``Q_h x' + (Q_h z* + b_h)`` and a constant moved by
    ``sum_h V_h z*``. Everything else (counts, the answers' unit, vectors) is the boundary's own."""

    def __init__(self, boundary, shift: np.ndarray):
        self.boundary, self.shift = boundary, np.asarray(shift, dtype=np.float64)

    def ask(self, sequences, description: str = "querying oracle", whole: bool = False):
        return self.boundary.ask([np.asarray(X, dtype=np.float64) + self.shift for X in sequences], description,
                                 whole=whole)

    def __getattr__(self, name):
        return getattr(self.boundary, name)


def _query_neutral(whole, c, V, rng, d, size, unit, tokens=PROBE_TOKENS) -> tuple[np.ndarray, float]:
    """Levenberg-Marquardt from 0 on the misfit from uniform attention over ``ceil(d / tokens) + 1``
    probe sequences of ``tokens`` tokens of norm about ``size`` before the final one:
    ``(x_q, misfit relative to the answers)``."""
    probes = [rng.standard_normal((tokens, d)) * size / np.sqrt(d) for _ in range(-(-d // tokens) + 1)]
    scale = max(float(np.abs(whole([np.vstack([probe, np.zeros(d)]) for probe in probes],
                                   "key bias: the query-neutral token")).max()), 1e-300)

    def uniform_misfit(x):
        sequences = [np.vstack([probe, x]) for probe in probes]
        answers = whole(sequences, "key bias: the query-neutral token")
        mean = np.array([c + V @ sequence.mean(axis=0) for sequence in sequences])
        return (answers - mean).ravel() / scale
    # difference steps of the square root of the answers' unit (float64's own in float64); 'lm'
    # counts no Jacobian in max_nfev, so the queries are at most about LM_EVALUATIONS (d + 1) p
    fit = least_squares(uniform_misfit, np.zeros(d), method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15,
                        max_nfev=LM_EVALUATIONS, diff_step=np.sqrt(max(unit, FLOAT64_UNIT)))
    return fit.x, float(np.abs(uniform_misfit(fit.x)).max())


def within_window(lengths, window: int | None) -> tuple[int, ...]:
    """The lengths that fit a sliding window of ``window`` tokens, the window itself added as the
    longest (all of them where the window holds the longest).

    >>> from mhaextract.rotary.neutral import within_window
    >>> within_window((2, 3, 4, 6, 11, 23), 16)
    (2, 3, 4, 6, 11, 16)
    """
    if window is None or window >= max(lengths):
        return tuple(lengths)
    return tuple(N for N in lengths if N < window) + (window,)


def find_neutral_token(boundary, c: np.ndarray, rng: np.random.Generator, token_scale: float,
                       progress=None, window: int | None = None, heads: int | None = None,
                       coarse: bool = False) -> NeutralToken:
    """The key-neutral token ``z*`` of a layer answering whole outputs (c its answer to one zero
    token), through ``boundary``; see the module's notes. With a sliding ``window`` every sequence
    of the search fits in it: a token that left it would leave the count. ``coarse`` (float32
    answers): by :func:`large_query_search`, which needs the query ``heads`` and a window of at
    least ``LARGE_QUERY_MIN_WINDOW`` tokens."""
    d = boundary.d
    asked = boundary.queries

    def whole(sequences, description):
        return np.asarray(boundary.ask(sequences, description, whole=True), dtype=np.float64)

    if coarse:
        if heads is None:
            raise ValueError("the large-query search needs the number of query heads: pass heads=")
        if window is not None and window < LARGE_QUERY_MIN_WINDOW:
            raise ValueError(f"the large-query key-neutral search needs a window of at least "
                             f"{LARGE_QUERY_MIN_WINDOW} tokens, got {window}")
        token, key_misfit, self_misfit = large_query_search(
            whole, d, heads, rng, token_scale, within_window(LARGE_QUERY_LENGTHS, window), progress)
        return NeutralToken(token, None, d, -1, np.nan, key_misfit, boundary.queries - asked,
                            max(boundary.answer_unit, COARSE_UNIT), large_queries=True, self_score_misfit=self_misfit)
    if window is not None and window < 5:  # two lengths beyond the affine part's two
        raise ValueError(f"the key-neutral search needs a window of at least 5 tokens, got {window}: a layer "
                         "with a shorter window has no key-neutral token this search can find")
    lengths, null_space_lengths = within_window(LENGTHS, window), within_window(NULL_SPACE_LENGTHS, window)
    probe_tokens = PROBE_TOKENS if window is None else min(PROBE_TOKENS, window - 1)
    basis = np.eye(d) * token_scale
    V = (whole([row[None] for row in basis], "key bias: summed values") - c).T / token_scale  # (d_out, d)
    _, singular, right = np.linalg.svd(V)
    unit = boundary.answer_unit
    rank = int((singular > max(VALUE_RANK_CUT, VALUE_RANK_UNITS * unit) * singular[0]).sum())
    if rank >= d:
        return NeutralToken(None, None, d, rank, np.inf, np.inf, boundary.queries - asked, unit)
    invisible = right[rank:].T                                              # (d, d - rank)

    note_progress(progress, "key bias: seeking the final token whose query is zero")
    for probe_scale in PROBE_SCALES:
        query_neutral, query_misfit = _query_neutral(whole, c, V, rng, d, probe_scale * token_scale, unit,
                                                     probe_tokens)
        if query_misfit <= _query_limit(unit):
            break
    else:
        return NeutralToken(None, query_neutral, d, rank, query_misfit, np.inf, boundary.queries - asked, unit)

    note_progress(progress, "key bias: seeking the key-neutral token")
    y = rng.standard_normal(d) * token_scale / np.sqrt(d)
    # as many criterion rows as at all of LENGTHS: the part not affine in N keeps all lengths but two
    direction_count = DIRECTIONS * -(-(len(LENGTHS) - 2) // (len(lengths) - 2))
    directions = rng.standard_normal((direction_count, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    # rounding amplified by 1 / eps against the stencil's error of order eps^8: the best eps grows as
    # the unit's ninth root (9 times float64's for float32 answers)
    eps = EPSILON * (unit / FLOAT64_UNIT) ** (1 / 9) * token_scale / d ** 0.25

    def criteria(tokens, lengths, stencil=STENCIL):
        """The part of ``T_N`` not affine in N in ``(z^(N-2), y, x_q + eps e)``, one row per z in
        ``tokens``, over the ``lengths`` N (asked one z at a time: memory of one z's queries)."""
        lengths = np.asarray(lengths)
        affine = np.stack([np.ones(len(lengths)), lengths], axis=1)
        not_affine = np.eye(len(lengths)) - affine @ np.linalg.pinv(affine)
        counts = lengths[None, :, None]
        steps = np.arange(1, len(stencil) + 1)
        rows = []
        for z in tokens:
            sequences = [np.vstack([np.tile(z, (N - 2, 1)), y, query_neutral + sign * k * eps * e])
                         for e in directions for N in lengths for k in steps for sign in (1, -1)]
            answers = whole(sequences, "key bias: the key-neutral token").reshape(
                direction_count, len(lengths), len(steps), 2, -1)
            first_order = np.einsum("k,dnko->dno", stencil, answers[..., 0, :] - answers[..., 1, :]) / eps
            T = counts ** 2 * first_order - counts * (directions @ V.T)[:, None, :]   # N^2 D_N - N V e
            rows.append(np.einsum("mn,dno->dmo", not_affine, T).ravel())
        return np.array(rows)

    # 1. the key-neutral token among the value-invisible z = x_q + n: the criterion is affine in n
    token = query_neutral
    rows = criteria([token] + [token + token_scale * column for column in invisible.T], lengths, JACOBIAN_STENCIL)
    columns = (rows[1:] - rows[0]).T / token_scale
    # the criterion's change under a move of the token by the token scale
    reference = max(float(np.abs(columns).max()) * token_scale, 1e-300)
    for _ in range(NEWTON_STEPS):
        token = token + invisible @ np.linalg.lstsq(columns, -criteria([token], lengths)[0], rcond=None)[0]
    # 2. the smallest neutral token. The criterion vanishes on all of z* + null(K) (neutral copies
    # with any value leave T_N affine in N) and, at z*, moves with K m alone (the copies' value
    # change multiplies their zero scores): its Jacobian's row space is K's. Central differences
    # are exact, the criterion being quadratic in the token at first order in eps.
    note_progress(progress, "key bias: the smallest key-neutral token")
    moves = np.eye(d) * token_scale
    jacobian = (criteria(token + moves, null_space_lengths, JACOBIAN_STENCIL)
                - criteria(token - moves, null_space_lengths, JACOBIAN_STENCIL)).T / (2 * token_scale)
    _, key_singular, key_rows = np.linalg.svd(jacobian, full_matrices=False)
    key_rows = key_rows[:rank].T                          # K's row space: n_kv r = the values' rank
    smallest = key_rows @ (key_rows.T @ token)
    # Newton steps inside K's row space against the noise of that projection; the copies of the
    # smallest token carry another value than x_q, so the Jacobian is taken again there
    for _ in range(SMALLEST_STEPS):
        moves = key_rows.T * token_scale
        here = criteria([smallest], null_space_lengths)[0]
        rows = criteria(list(smallest + moves) + list(smallest - moves), null_space_lengths, JACOBIAN_STENCIL)
        columns = (rows[:rank] - rows[rank:]).T / (2 * token_scale)
        smallest = smallest - key_rows @ np.linalg.lstsq(columns, here, rcond=None)[0]
    key_misfit = float(np.abs(criteria([smallest], lengths)[0]).max()) / reference
    return NeutralToken(smallest, query_neutral, d, rank, query_misfit, key_misfit, boundary.queries - asked, unit,
                        key_gap=float(key_singular[rank] / key_singular[rank - 1]) if rank < len(key_singular) else 0.0,
                        invisible_token=token)


def large_query_search(whole, d: int, heads: int, rng: np.random.Generator, token_scale: float,
                       lengths=LARGE_QUERY_LENGTHS, progress=None) -> tuple[np.ndarray, float, float]:
    """The key-neutral token from coarse (float32) answers: ``(z, key misfit, self-score misfit)``
    (the ``key_neutral`` and ``self_scores`` checks' values); docs/algorithm.md, 'From float32 answers'.

    With a final token ``x = z + w`` the answers ``Y_N = f(z^(N-1), x) - f(z)`` give
    ``C_N = N Y_N - Y_1 = sum_h V_h w (N a_h(N) - 1)``, a_h(N) the final's weight in head h. For a
    key-neutral z every copy scores 0, ``a_h(N) = E_h / (E_h + N - 1)`` (``E_h`` the final's
    self-score exponentiated) and ``N a_h - 1 = (1 - 1/N) eps_h sum_k (-eps_h / N)^k``
    (``eps_h = E_h - 1``): C lies in the span of ``(N - 1) / N^(k+1)`` over N, whatever the
    self-scores. The part of ``C_N / N`` (rounding alike at every N) off the first
    ``SELF_SCORE_SHAPES`` of those shapes divided by N is the criterion (:func:`off_shape_misfit`),
    zero at a neutral z up to the self-scores' order ``SELF_SCORE_SHAPES + 1`` (held small: each offset is
    moved in an H-dimensional subspace until ``f(z, x)`` is the mean of ``f(z)`` and ``f(x)``). A
    key ``kappa_h`` left in z scores ``q_h(x)^T R_h(delta) kappa_h`` at offset delta: a response
    proportional to the final's query, which grows with ``|w|`` (``FINAL_SIZES``). Newton steps on
    z (forward differences over all d directions, least squares of least norm: the criterion is flat
    along ``null(K)``, so z stays near the smallest neutral token) take it to the neutral set.
    """
    lengths = np.asarray(lengths)

    def criterion(z, offsets):
        return off_shape_misfit(whole, z, offsets, lengths)

    directions = rng.standard_normal((LARGE_QUERY_FINALS, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    z, offsets, h = np.zeros(d), directions * token_scale, TOKEN_STEP * token_scale
    misfit, self_misfit, reference = np.inf, np.inf, 1e-300
    grown = FINAL_SIZES[0]
    for stage, size in enumerate(FINAL_SIZES):
        # grown by at most GROWTH at a time, the self-scores zeroed at each: s_h(t w) = t a_h + t^2 b_h
        # is zero at t = 1, and t = GROWTH leaves (GROWTH^2 - GROWTH) b_h, which the zeroing's steps
        # still take from (all at once, 3x would leave 6 b_h, past where the pair test saturates)
        while grown < size:
            grown = min(size, grown * GROWTH)
            offsets = offsets / np.linalg.norm(offsets, axis=1, keepdims=True) * (grown * token_scale)
            offsets = np.array([hold_self_scores(whole, z, w, heads, rng)[0] for w in offsets])
        last = stage == len(FINAL_SIZES) - 1
        for step in range(STEPS_PER_SIZE + (EXTRA_STEPS if last else 0)):
            note_progress(progress, f"key bias: large-query finals of {size:g} token scales, step {step + 1}")
            zeroed = [hold_self_scores(whole, z, w, heads, rng) for w in offsets]
            offsets, misfits = np.array([w for w, _ in zeroed]), np.array([m for _, m in zeroed])
            # a final whose self-scores stayed large sits this step out (tried again at the next),
            # while at least half of them are left
            held = misfits <= SELF_SCORE_LIMIT
            if 2 * held.sum() < len(offsets):
                held[:] = True
            used, self_misfit = offsets[held], float(misfits[held].max())
            here = criterion(z, used)
            jacobian = np.column_stack([(criterion(z + h * e, used) - here) / h for e in np.eye(d)])
            reference = max(float(np.abs(jacobian).max()) * token_scale, 1e-300)
            move = np.linalg.lstsq(jacobian, -here, rcond=1e-7)[0]
            before, misfit = np.linalg.norm(here), float(np.abs(here).max())
            for length in 0.5 ** np.arange(10):  # the first shorter step that lowers the criterion
                trial = criterion(z + length * move, used)
                if np.linalg.norm(trial) < before:
                    z, misfit = z + length * move, float(np.abs(trial).max())
                    break
            # past the last size's own steps, the extra ones go on while each halves the criterion
            if last and step + 1 >= STEPS_PER_SIZE and not np.linalg.norm(trial) < EXTRA_GAIN * before:
                break
    return half_weight_search(whole, z, used, jacobian, criterion, heads, rng, token_scale,
                              int(lengths.max()), progress) + (self_misfit,)


def half_weight_shapes(lengths, E: float, shapes: int = HALF_WEIGHT_SHAPES) -> np.ndarray:
    """``(d / d log E)^k a(N)`` for ``k < shapes`` at ``a(N) = E / (E + N - 1)`` over ``lengths`` N (columns):
    with ``u = log E``, ``da / du = a (1 - a)``, so each is a polynomial in a, ``p_{k+1} = p_k'(a) a (1 - a)``.

    >>> import numpy as np
    >>> from mhaextract.rotary.neutral import half_weight_shapes
    >>> N, E = np.array([2.0, 10.0, 100.0]), 50.0
    >>> a = lambda u: np.exp(u) / (np.exp(u) + N - 1)
    >>> step = 1e-5
    >>> bool(np.allclose(half_weight_shapes(N, E, 2)[:, 1], (a(np.log(E) + step) - a(np.log(E) - step)) / (2 * step)))
    True
    """
    a = E / (E + np.asarray(lengths, dtype=np.float64) - 1.0)
    polynomials, turn = [np.polynomial.Polynomial([0.0, 1.0])], np.polynomial.Polynomial([0.0, 1.0, -1.0])
    for _ in range(shapes - 1):
        polynomials.append(polynomials[-1].deriv() * turn)
    return np.column_stack([p(a) for p in polynomials])


def half_weight_misfit(whole, z: np.ndarray, finals, lengths, E: float) -> np.ndarray:
    """The half-weight criterion at z with the final tokens ``x`` in ``finals`` (absolute tokens, whose
    self-scores are about ``log E``): the part of ``Y_N = f(z^(N-1), x) - f(z)`` over ``lengths`` N off
    :func:`half_weight_shapes`, relative to ``|Y_1|``. For a key-neutral z, ``Y_N = sum_h V_h (x - z)
    E_h / (E_h + N - 1)``, in their span up to the self-scores' distance from ``log E`` to the power
    ``HALF_WEIGHT_SHAPES``; a move of z leaves the finals, and so their self-scores, where they are. A
    key ``kappa_h`` left in z moves the copies' summed weight by ``sum_delta q_h^T R_h(delta) kappa_h``,
    and the final's weight by ``E / (E + N - 1)^2`` of it: about a quarter of the key's score change
    near ``N = E``, where with self-scores of 0 it is ``1 / N`` of it."""
    lengths = np.asarray(lengths)
    shapes = half_weight_shapes(lengths, E)
    off_shapes = np.eye(len(lengths)) - shapes @ np.linalg.pinv(shapes)
    sequences = [z[None]]
    for x in finals:
        sequences += [x[None]] + [np.vstack([np.tile(z, (N - 1, 1)), x]) for N in lengths]
    answers = np.asarray(whole(sequences, "key bias: finals at half weight"), dtype=np.float64)
    per_final = (answers[1:] - answers[0]).reshape(len(finals), len(lengths) + 1, -1)
    single, copies = per_final[:, 0], per_final[:, 1:]
    scale = np.maximum(np.abs(single).max(axis=1), 1e-300)
    return (np.einsum("mn,jno->jmo", off_shapes, copies) / scale[:, None, None]).ravel()


def half_weight_search(whole, z: np.ndarray, offsets, jacobian, criterion, heads: int, rng: np.random.Generator,
                       token_scale: float, longest: int, progress=None) -> tuple[np.ndarray, float]:
    """After the large-query search: the slow blocks' key (docs/algorithm.md, 'From float32 answers',
    'Finals at half weight for the slow blocks'). The finals' self-scores are raised along
    ``HALF_WEIGHT_COUNTS`` (:func:`hold_self_scores`) until each takes half the weight after
    ``count - 1`` copies; Newton steps then solve the half-weight criterion (:func:`half_weight_misfit`,
    Jacobian by forward differences over all d directions) stacked with the large-query one
    (``criterion(z, offsets)`` at the large-query ``offsets``, its last ``jacobian`` kept: it holds the
    fast blocks, which the half-weight rows see only as ``1 / E`` of their score change). A step is
    kept only where it lowers the stacked misfit. Returns ``(z, key misfit)``: the half-weight criterion's
    largest entry relative to its change under a move of the token by the token scale (the large-query
    rows' floor is their own noise, tens of times the half-weight rows'). Before every step but the first
    both sets of finals are held again at the current z (the copies' scores they were held against move
    with the key)."""
    d = len(z)
    counts = [count for count in HALF_WEIGHT_COUNTS if 2 * count <= longest]
    lengths = np.array([N for N in HALF_WEIGHT_LENGTHS if N <= longest])
    moved = np.array(offsets, dtype=np.float64)
    for count in counts:
        note_progress(progress, f"key bias: finals at half weight after {count - 1} copies")
        held = [hold_self_scores(whole, z, w, heads, rng, count, HALF_WEIGHT_TRIES, HALF_WEIGHT_LIMIT) for w in moved]
        moved, misfits = np.array([w for w, _ in held]), np.array([m for _, m in held])
    # a final whose self-scores stayed off log E would leave the shapes' span: left out; the rest are
    # fixed tokens from here on
    finals = z + moved[misfits <= HALF_WEIGHT_LIMIT]
    E, h = counts[-1] - 1.0, HALF_WEIGHT_STEP * token_scale

    def stacked(z, offsets):
        half = half_weight_misfit(whole, z, finals, lengths, E)
        return np.concatenate([criterion(z, offsets), half]), half
    offsets, reference, half_here = np.array(offsets, dtype=np.float64), 1e-300, np.array([np.inf])
    for step in range(HALF_WEIGHT_STEPS if len(finals) else 0):
        note_progress(progress, f"key bias: finals at half weight, step {step + 1}")
        # the large-query finals zeroed again at this z: their self-scores were held against the copies'
        # scores at the search's last z, and a key moved since leaves them off 0, past the order its
        # shapes take
        offsets = np.array([hold_self_scores(whole, z, w, heads, rng)[0] for w in offsets])
        if step:
            # the half-weight finals held again too: their self-scores were held against the copies' scores
            # at the z of the first step, and a key moved since (qwen2-d32-h4/0: from keys of 3.8e-2) puts
            # them off log E, where two shapes no longer span Y_N and the criterion stalls at the
            # finals' own misfit, not the key's
            held = [hold_self_scores(whole, z, x - z, heads, rng, counts[-1], HALF_WEIGHT_TRIES, HALF_WEIGHT_LIMIT)
                    for x in finals]
            finals = np.array([z + w for w, misfit in held if misfit <= HALF_WEIGHT_LIMIT])
            if not len(finals):
                break
        here, half_here = stacked(z, offsets)
        half = np.column_stack([(half_weight_misfit(whole, z + h * e, finals, lengths, E) - half_here) / h
                                for e in np.eye(d)])
        reference = max(float(np.abs(half).max()) * token_scale, 1e-300)
        move = np.linalg.lstsq(np.vstack([jacobian, half]), -here, rcond=HALF_WEIGHT_RCOND)[0]
        trial, half_trial = stacked(z + move, offsets)
        if not np.linalg.norm(trial) < np.linalg.norm(here):
            break
        z, half_here = z + move, half_trial
    return z, float(np.abs(half_here).max()) / reference


def hold_self_scores(whole, z: np.ndarray, w: np.ndarray, heads: int, rng: np.random.Generator,
                     count: int = 2, tries: int = SELF_SCORE_TRIES,
                     limit: float = SELF_SCORE_LIMIT) -> tuple[np.ndarray, float]:
    """The offset ``w`` moved in a random H-dimensional subspace (Gauss-Newton, central differences,
    moves of ``SELF_SCORE_MOVE`` of its norm, each step shortened until it lowers the misfit) until
    the final ``z + w`` takes half the weight after ``count - 1`` copies of z
    (:func:`pair_misfit`): for a key-neutral z, self-scores ``log(count - 1)`` in every head (0 at
    ``count = 2``). A subspace that leaves the misfit above ``limit`` is replaced, at most
    ``tries`` in all. Returns ``(w, the misfit left, relative)``."""
    d = len(z)
    misfit = pair_misfit(whole, z, [w], count)[0]
    for _ in range(tries):
        moves = np.linalg.qr(rng.standard_normal((d, heads)))[0] * (SELF_SCORE_MOVE * np.linalg.norm(w))
        for _ in range(SELF_SCORE_STEPS):
            sides = pair_misfit(whole, z, list(w + moves.T) + list(w - moves.T), count)
            step = np.linalg.lstsq((sides[:heads] - sides[heads:]).T / 2, -misfit, rcond=None)[0]
            for length in 0.5 ** np.arange(10):  # the first shorter step that lowers the misfit
                trial = pair_misfit(whole, z, [w + length * moves @ step], count)[0]
                if np.linalg.norm(trial) < np.linalg.norm(misfit):
                    w, misfit = w + length * moves @ step, trial
                    break
        if np.abs(misfit).max() <= limit:
            break
    return w, float(np.abs(misfit).max())


def off_shape_misfit(whole, z: np.ndarray, offsets, lengths=LARGE_QUERY_LENGTHS) -> np.ndarray:
    """The large-query search's criterion at the token z with finals ``z + w`` (``w`` in
    ``offsets``): the part of ``Y_N - Y_1 / N`` over ``lengths`` N off the self-score shapes
    ``(N - 1) / N^(k+2)``, ``k < SELF_SCORE_SHAPES``, each final's relative to its ``|Y_1|``;
    ``whole(sequences, description)`` answers whole outputs. Zero at a key-neutral z, whatever the
    finals' self-scores, up to their order ``SELF_SCORE_SHAPES + 1`` (:func:`large_query_search`).

    Examples
    --------
    A layer whose keys have no bias and no offset part (``K = 0``) scores every token 0, so every
    token is neutral:

    >>> import numpy as np
    >>> from mhaextract.rotary.neutral import off_shape_misfit
    >>> V = np.random.default_rng(0).normal(size=(3, 3))
    >>> def uniform(sequences, description):  # equal scores: the mean of the values
    ...     return np.array([V @ np.mean(X, axis=0) for X in sequences])
    >>> misfit = off_shape_misfit(uniform, np.ones(3), [np.array([1.0, 0.0, 2.0])])
    >>> bool(np.abs(misfit).max() < 1e-14)
    True
    """
    lengths = np.asarray(lengths)
    # Y_N - Y_1 / N = C_N / N: its rounding is about the same at every N (that of C_N grows as N)
    shapes = np.column_stack([(lengths - 1.0) / lengths ** (k + 2) for k in range(SELF_SCORE_SHAPES)])
    off_shapes = np.eye(len(lengths)) - shapes @ np.linalg.pinv(shapes)
    sequences = [z[None]]
    for w in offsets:
        sequences += [(z + w)[None]] + [np.vstack([np.tile(z, (N - 1, 1)), z + w]) for N in lengths]
    answers = np.asarray(whole(sequences, "key bias: large-query finals"), dtype=np.float64)
    per_final = (answers[1:] - answers[0]).reshape(len(offsets), len(lengths) + 1, -1)
    single, copies = per_final[:, 0], per_final[:, 1:]
    misfit = copies - single[:, None, :] / lengths[None, :, None]
    scale = np.maximum(np.abs(single).max(axis=1), 1e-300)
    return (np.einsum("mn,jno->jmo", off_shapes, misfit) / scale[:, None, None]).ravel()


def pair_misfit(whole, z: np.ndarray, offsets, count: int = 2) -> np.ndarray:
    """``2 f(z^(count-1), z + w) - f(z) - f(z + w)`` for each ``w`` in ``offsets``, relative to
    ``|f(z + w) - f(z)|``. For a key-neutral z the copies score 0 and carry z's value, so it is
    ``sum_h V_h w (2 a_h - 1)`` with ``a_h = E_h / (E_h + count - 1)`` the final's weight: zero
    exactly where every self-score is ``log(count - 1)`` (the two tokens' attention uniform at
    ``count = 2``)."""
    copies = [np.vstack([np.tile(z, (count - 1, 1)), z + w]) for w in offsets]
    sequences = [z[None]] + [s for w, long in zip(offsets, copies) for s in ((z + w)[None], long)]
    answers = np.asarray(whole(sequences, "key bias: the finals' self-scores"), dtype=np.float64)
    single, pair = answers[1::2] - answers[0], answers[2::2] - answers[0]
    return (2 * pair - single) / np.maximum(np.abs(single).max(axis=1, keepdims=True), 1e-300)
