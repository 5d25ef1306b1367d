"""A key-neutral token for rotary attention with a key bias (docs/algorithm.md §22, "A key bias").

With key biases ``k_h`` (Qwen2) a zero token scores ``k_h^T R_h(delta) q_h`` at offset delta: it is
no counter. A token ``z*`` with ``K_h z* + k_h = 0`` in every head scores 0 from every final token
at every offset, and shifting every token by it gives a layer without key bias
(:class:`ShiftedBoundary`). It is found from whole answers in three steps:

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from ..checks.base import Check
from ..oracle.progress import note_progress

#: Tokens of each probe sequence of the query-neutral search before its final token.
PROBE_TOKENS = 16
#: Norms of the probe tokens tried in turn, in units of the token scale: the steps from 0 stop at
#: other minima of the misfit on some layers at each size, never at all three (docs/algorithm.md
#: §22; ``benchmarks/bench_rotary_layers.py --probe-scales``).
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
#: Largest misfit (relative to the answers) of the uniform attention at the query-neutral token
#: (or ``QUERY_UNITS`` units of the answers' rounding).
QUERY_LIMIT, QUERY_UNITS = 1e-9, 30.0
#: Largest part of ``T_N`` not affine in N left at the key-neutral token, relative to its change
#: under a move of the token by the token scale (or ``KEY_UNITS`` units of the answers' rounding).
KEY_LIMIT, KEY_UNITS = 1e-6, 1e4


@dataclass
class NeutralToken:
    """What the search for a key-neutral token asked and found.

    Attributes
    ----------
    token : the key-neutral token ``z*`` (d,), or None where the search stopped.
    query_neutral : the final token ``x_q`` whose query is zero (d,), or None.
    d : the token dimension.
    value_rank : the rank of ``V = sum_h V_h`` (the value rows, ``n_kv r`` for grouped heads).
    query_misfit : the uniform attention's misfit at ``x_q``, relative to the answers.
    key_misfit : the part of ``T_N`` not affine in N at ``z*``, relative to its change under a move
        of the token by the token scale.
    queries : queries the search asked.
    unit : the answers' rounding unit, which scales the limits.
    key_gap : the criterion Jacobian's singular value past K's rank over the one at it (the gap
        that tells K's row space from its null space).
    invisible_token : the key-neutral token among the value-invisible ones (``x_q + n``), before
        the smallest was taken.
    """

    token: np.ndarray | None
    query_neutral: np.ndarray | None
    d: int
    value_rank: int
    query_misfit: float
    key_misfit: float
    queries: int
    unit: float = 2.0 ** -53
    key_gap: float = np.nan
    invisible_token: np.ndarray | None = None

    def checks(self) -> list[Check]:
        """``value_null_space``, then ``query_neutral`` and ``key_neutral`` as far as the search went."""
        checks = [Check("value_null_space", self.value_rank < self.d, float(self.value_rank), float(self.d),
                        "rank of the summed value maps below d: the key-neutral token is sought among tokens "
                        "that carry the final token's value in every head (grouped-query heads, n_kv r < d)")]
        if not checks[0].passed:
            return checks
        query_limit, key_limit = _query_limit(self.unit), max(KEY_LIMIT, KEY_UNITS * self.unit)
        checks.append(Check("query_neutral", self.query_misfit <= query_limit, self.query_misfit, query_limit,
                            "misfit of uniform attention at the final token found to have zero query, relative "
                            "to the answers (none exists where H r > d)"))
        if checks[-1].passed:
            checks.append(Check("key_neutral", self.key_misfit <= key_limit, self.key_misfit, key_limit,
                                "the part of the first-order answers not affine in the count left at the "
                                "key-neutral token, relative to its change under a move of the token by the "
                                "token scale"))
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
                        max_nfev=LM_EVALUATIONS, diff_step=np.sqrt(max(unit, 2.0 ** -53)))
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
                       progress=None, window: int | None = None) -> NeutralToken:
    """The key-neutral token ``z*`` of a layer answering whole outputs (c its answer to one zero
    token), through ``boundary``; see the module's notes. With a sliding ``window`` every sequence
    of the search fits in it: a token that left it would leave the count."""
    d = boundary.d
    if window is not None and window < 5:  # two lengths beyond the affine part's two
        raise ValueError(f"the key-neutral search needs a window of at least 5 tokens, got {window}: a layer "
                         "with a shorter window has no key-neutral token this search can find")
    lengths, null_space_lengths = within_window(LENGTHS, window), within_window(NULL_SPACE_LENGTHS, window)
    probe_tokens = PROBE_TOKENS if window is None else min(PROBE_TOKENS, window - 1)
    asked = boundary.queries

    def whole(sequences, description):
        return np.asarray(boundary.ask(sequences, description, whole=True), dtype=np.float64)

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
    eps = EPSILON * (unit / 2.0 ** -53) ** (1 / 9) * token_scale / d ** 0.25

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
