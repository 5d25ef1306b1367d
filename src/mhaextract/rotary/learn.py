"""Learning rotary attention from value queries (docs/algorithm.md, 'Rotary attention: positions, grouped heads and
sliding windows').

Zero tokens are counters: with no key bias a zero token scores 0 and carries value 0 at every
offset, so ``k`` leading zeros in front of a pattern S of non-zero tokens give

    F(k) - c = sum_h N_h / (k + P_h),   P_h = n_0(S) + sum_{t in S} exp(s_h(t)),
                                        N_h = sum_{t in S} exp(s_h(t)) v_h^T t,

the rational function of the copies instances with the counter in place of the copies. The
instances (final tokens ``x_i``, the columns of X; key tokens ``z_j``, the columns of Z):

* self ``(x_i)``: ``P = tau_h(i) = exp(s_h(x_i, x_i))``, ``N / P = v_h^T x_i``; with the query
  bias one more final token ``x_{d+1}`` off the affine hull of the others, so that
  ``[W | u]`` follows from the affine map ``(x; 1)``;
* key ``(z_j)``: ``N / P = v_h^T z_j``, the labels that name the heads;
* offset ``(z_j, 0^(delta - 1), x_i)``, delta = 1, 2: ``E = P - tau_h(i) - (delta - 1)`` is
  ``exp(z_j^T [W_h(delta) | u_h(delta)] (x_i; 1))``, and ``(N - tau_h(i) v_h^T x_i) / E = v_h^T z_j``
  matches the instance to the heads.

Every instance takes ``k = 0..2H - 1`` (c is measured once, by the query of one zero token).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..checks.base import Check, available_memory
from ..checks.verify import ask_long_verification, output_errors
from ..numerics.float64 import fit
from ..numerics.highprec import mid_float, mpf_array
from ..oracle.boundary import OracleBoundary
from ..oracle.progress import note_progress
from ..run.result import Result
from ..run.value_fit import VALUE_QUERY_LENGTHS, fit_values, value_query_count
from ..oracle.queries import random_basis, random_queries
from ..oracle.vector_answers import VectorAnswers
from .completion import complete_low_rank, completion_rank, head_widths  # noqa: F401 (re-exported)
from ..run.validation import spawn_rng
from ..models.rotary import RotaryAttention
from .neutral import (LARGE_QUERY_LENGTHS, LARGE_QUERY_MIN_WINDOW, NeutralToken, ShiftedBoundary,
                      find_neutral_token)
from .refine import error_moves, pack, polish_high_precision, refine, refinement_memory, seed_low_frequencies
from .structure import rotary_head
from .window import WindowSearch, find_window

#: The coarsest answers the rotary schedule takes: float32's unit roundoff.
COARSEST_UNIT = 2.0 ** -24
#: Float64 limits of the checks (relative): the answers' misfit and the error estimate; for coarser
#: answers (float32) these many units of their rounding, where that is larger.
RESIDUAL_LIMIT = 1e-9
ESTIMATE_LIMIT = 1e-8
RESIDUAL_UNITS = 30.0
ESTIMATE_UNITS = 300.0
#: The smallest error estimate claimed: float64 rounding through the scores and the softmax.
ESTIMATE_FLOOR = 1e-14
#: An instance whose rational fit misses its samples by more than this (relative), or by more than
#: ``INSTANCE_UNITS`` units of the answers' rounding, is not used.
INSTANCE_LIMIT = 1e-7
INSTANCE_UNITS = 100.0
#: An offset instance whose numerator misfit (relative to its key's labels) exceeds this, or
#: ``MATCH_SPREAD`` times the median misfit where that is larger (float32 answers), but at most
#: ``MATCH_WRONG`` (a wrongly assigned pole misses by about its label's size), is left out.
MATCH_OUTLIER = 1e-2
MATCH_SPREAD = 20.0
MATCH_WRONG = 0.25
#: The two offsets of the offset instances, minus one: E = P - tau - (delta - 1).
OFFSETS = (0.0, 1.0)
#: More missing log-score entries than this fraction leave no start.
MOST_MISSING = 0.2
#: A key or final token keeps its row or column of the log-score grids with this fraction observed.
HELD = 0.5
#: Samples per instance beyond the 2H that determine it (least squares: fewer failed fits at H >= 3).
SAMPLES_OVER = 2
#: The largest count of leading zeros is this many times the samples per instance (``zero_counts``).
ZEROS_PER_SAMPLE = 9
#: Channels of a whole layer's answers per head that join the instances' fits (``channel_projection``).
CHANNELS_PER_HEAD = 2
#: Spare final and key tokens beyond the d (+1) the assembly needs; with float32 answers, where a few
#: more tokens lose too many entries to be kept (d = 32, H = 4: three finals with two spares).
SPARE_TOKENS = 2
NOISY_SPARE_TOKENS = 6
#: With float32 answers the slow blocks are seeded before the refinement and again after every
#: stretch of this many of its steps (``seed_low_frequencies``), at most ``SEEDINGS`` times in all,
#: until a seeding no longer lowers the misfit.
SEEDING_STEPS = 4
SEEDINGS = 8
#: The size of the key the large-query search leaves (float32 answers; docs/rotary.md, "From
#: float32 answers"): the refinement's key bias has a Gaussian prior of this size.
SEARCH_KEY_SIZE = 1e-4
#: A start whose W(2) lies this far outside W(1)'s row and column spaces (``subspace_residual``,
#: relative), or whose M has an eigenvalue this far off the unit circle (``modulus_error``), had
#: its heads matched wrongly across instances (float32 good starts: 1e-4 at d = 16, 0.02 at
#: d = 32); its instances are drawn again, at most ``START_DRAWS`` times in all, the best kept.
STRUCTURE_LIMIT = 0.1
START_DRAWS = 3
#: Fresh polish queries per parameter of the model, and their lengths (inclusive).
POLISH_FACTOR = 3
POLISH_LENGTHS = (2, 64)
#: The token scale makes the self-scores of the basis tokens this large (root mean square).
SCORE_TARGET = 1.5
#: Answers coarser than this (float32) first size the scores to first order (``score_spread``):
#: the rational fit of crowded poles that sizes them in float64 is wrong at their rounding.
FIRST_LOOK_UNIT = 2.0 ** -40


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class RotaryExtraction(Result):
    """Result of ``extract(..., positions="rotary")`` (``schedule == "rotary"``): the common fields
    of :class:`~mhaextract.Result` (``model`` a :class:`~mhaextract.RotaryAttention`, the whole
    layer for an oracle answering vectors; ``max_query_length`` with the window search and the
    verification; ``token_scale`` the norm of the basis tokens; ``error_estimate`` the relative
    error of the score matrices ``[W_h(delta) | u_h(delta)]``, delta = 0..2, and of the values, in
    the sense of ``compare(...).max_rel``: first order from the refinement's residual, and the value
    fit's for a whole layer; ``answers_residual`` the max misfit on every query of the instances and
    the refinement, relative to the largest answer; ``precision`` None (float64) or the bits of a
    high-precision run, whose model has ``mpf`` parameters and whose estimate, residual and
    verification are computed at those bits, a first-order estimate as in float64), and:

    Attributes
    ----------
    window : the sliding window found (tokens attended, the final one included), or None.
    window_search : how it was found (:class:`~mhaextract.rotary.window.WindowSearch`).
    frequencies : (H*, r / 2) the rotation angles per position of every head, ascending.
    start : the model the instances gave, before the refinement.
    refinement : :class:`~mhaextract.rotary.refine.RotaryRefinement` (queries, steps, residuals).
    diagnostics : the instances' fits and matching (failed instances, missing grid entries, widths;
        ``start_structure_errors``: each draw's larger of the subspace residual and modulus error).
    scalar_model, value_fit : as in :class:`~mhaextract.Extraction` for vector answers.
    neutral : with ``key_bias=True``, the search for the key-neutral token
        (:class:`~mhaextract.rotary.neutral.NeutralToken`); the instances, refinement and
        verification were asked of the tokens shifted by it, and ``model`` is shifted back.

    Examples
    --------
    >>> import mhaextract as mx
    >>> layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(layer), d=6, heads=2, positions="rotary", seed=1)
    >>> result.ok, result.window, bool(mx.compare(result.model, layer).max_rel < 1e-12)
    (True, None, True)
    """

    window: int | None = None
    window_search: WindowSearch | None = None
    start: RotaryAttention | None = None
    refinement: object = None
    diagnostics: dict = field(default_factory=dict)
    scalar_model: RotaryAttention | None = None
    value_fit: object = None
    neutral: NeutralToken | None = None

    _repr_fields: ClassVar[tuple[str, ...]] = ("window",)

    @property
    def frequencies(self) -> np.ndarray | None:
        return None if self.model is None else np.sort(self.model.theta, axis=1)

    def _summary_extra(self) -> dict:
        return {"positions": "rotary", "window": self.window,
                "key_neutral_queries": None if self.neutral is None else self.neutral.queries}


@dataclass
class Instances:
    """The fitted instances of one run, as per-head arrays (unordered within an instance)."""

    P: np.ndarray       # (n, H) pole magnitudes P_h
    N: np.ndarray       # (n, H) numerators N_h
    residual: np.ndarray  # (n,) fit misfit relative to the instance's largest sample


def channel_projection(rng: np.random.Generator, d_out: int, heads: int) -> np.ndarray:
    """A random orthonormal (d_out, m) map of a layer's whole answers onto ``m = min(d_out,
    CHANNELS_PER_HEAD H)`` channels: m >= H generic read-outs of the heads' value vectors tell the
    heads of an instance apart, and the fit's memory stays ``m`` numbers an answer at any d_out."""
    m = min(d_out, CHANNELS_PER_HEAD * heads)
    return np.linalg.qr(rng.standard_normal((d_out, m)))[0]


def score_spread(answers: np.ndarray, c: float, ks: np.ndarray, channels=None, channels_c=None) -> float:
    """The root mean square of the self-scores of self instances ``(0^k, x)`` to first order in
    them, without separating their poles. Per head the answer is ``V_h x / (1 + k e^{-s_h})``, so
    ``F(k) - c = a / (1 + k) + b k / (1 + k)^2 + O(s^2)`` with ``a = sum_h V_h x`` and
    ``b = sum_h s_h V_h x``, linear in (a, b); ``|b| / |a|`` (over the read-out, the channels and the
    tokens) is the scores' size where the heads' value vectors are of like size and independent. It
    reads small scores right (0.124 for a root mean square of 0.125: the Llama layer of
    docs/rotary.md at d^(1/4), float32) where H poles crowded within a few hundredths defeat a
    rational fit of coarse answers, and grows with larger ones (2.0 for 3)."""
    ks = np.asarray(ks, dtype=np.float64)
    columns = [np.asarray(answers, dtype=np.float64)[:, None] - c]
    if channels is not None:
        columns.append(np.asarray(channels, dtype=np.float64) - np.asarray(channels_c, dtype=np.float64))
    G = np.concatenate(columns, axis=1)
    G = G.reshape(-1, len(ks), G.shape[1])
    basis = np.stack([1.0 / (1.0 + ks), ks / (1.0 + ks) ** 2], axis=1)
    coefficients = np.linalg.lstsq(basis, G.transpose(1, 0, 2).reshape(len(ks), -1), rcond=None)[0]
    a, b = coefficients.reshape(2, G.shape[0], G.shape[2])
    size = float((a**2).sum())  # summed over the tokens: one read-out's a can be near zero
    return float(np.sqrt((b**2).sum() / size)) if size > 0 else np.nan


def ask_instances(boundary, vectors, projection, patterns: list[np.ndarray], ks: np.ndarray,
                  description: str) -> tuple:
    """The instances ``(0^k, S)`` of ``patterns`` asked at ``boundary``: ``(queries, read-out
    answers, channels)``; the channels are the whole answers through ``projection``
    (:func:`channel_projection`), or None without one (a scalar oracle, or ``mpf`` answers)."""
    queries = instance_queries(patterns, ks)
    if projection is None:
        return queries, boundary.ask(queries, description), None
    whole = boundary.ask(queries, description, whole=True)
    return queries, vectors.scalars(whole), whole @ projection


def choose_token_scale(learner: "RotaryLearner", ask, c: float, channels_c=None, coarse: bool = False) -> None:
    """Scale the learner's tokens so that the self-scores of its d basis tokens have a root mean
    square of ``SCORE_TARGET``, measured on their self instances ``(0^k, x_i)`` (d K queries) by the
    rational fit of each; ``coarse`` answers (float32) first size the scores to first order
    (:func:`score_spread`, d K queries more), since at the first scale ``d^(1/4)`` the heads' poles
    may crowd within a few hundredths, where a rational fit of coarse answers is wrong.
    ``ask(patterns, description)`` returns the instances' ``(queries, read-out answers, channels)``."""
    def basis():  # the basis tokens at the learner's current scale
        return [x[None] for x in learner.X.T]

    def rescale(size: float):
        if np.isfinite(size) and size > 0:
            learner.set_scale(learner.token_scale * float(np.clip(np.sqrt(SCORE_TARGET / size), 1e-3, 1e3)))

    if coarse:
        _, first, channels = ask(basis(), "sizing the scores")
        rescale(score_spread(mid_float(first), c, learner.ks, channels, channels_c))
    _, answers, channels = ask(basis(), "choosing the token scale")
    fitted = fit_instances(mid_float(answers), c, learner.ks, learner.H, channels, channels_c)
    rescale(float(np.sqrt(np.nanmean(np.log(fitted.P) ** 2))))


def _zeros(count: int, d: int) -> np.ndarray:
    return np.zeros((count, d))


def zero_counts(samples: int, longest: int) -> np.ndarray:
    """The counts ``k`` of leading zeros: 0, then geometric up to ``longest`` (distinct integers;
    linear where the range is too short). Poles spread over a decade are resolved by samples
    spread over it: measured on d = 32, H = 4 instances, 0..9 zeros left 1e-3 log-pole errors
    at the 90th percentile where 0, 1, 2, 4, .., 90 left 4e-8."""
    if longest < 2 * samples:
        return np.arange(samples)
    ks = np.unique(np.rint(np.geomspace(1, longest, samples - 1)).astype(int))
    while len(ks) < samples - 1:  # rounding merged small counts: fill from the bottom
        ks = np.union1d(ks, np.setdiff1d(np.arange(1, longest + 1), ks)[:samples - 1 - len(ks)])
    return np.concatenate([[0], ks])


def instance_queries(patterns: list[np.ndarray], ks: np.ndarray) -> list[np.ndarray]:
    """``(0^k, S)`` for every pattern S and every k, pattern-major."""
    d = patterns[0].shape[1]
    return [np.vstack([_zeros(int(k), d), pattern]) for pattern in patterns for k in ks]


def fit_instances(answers: np.ndarray, c: float, ks: np.ndarray, heads: int, channels=None,
                  channels_c=None) -> Instances:
    """Fit ``F(k) = c + sum_h N_h / (k + P_h)`` to each instance's answers at the counts ``ks``.
    ``channels`` (B, m) and ``channels_c`` (m,): more read-outs of a whole layer's answers and of
    its constant (:func:`channel_projection`); they share the instances' poles and place them with
    the read-out's answers (their residue vectors ``V_h (...)`` tell the heads apart where one
    read-out's residues do not)."""
    table = answers.reshape(-1, len(ks))
    if channels is not None:
        channels = np.asarray(channels, dtype=np.float64).reshape(len(table), len(ks), -1)
        channels_c = np.broadcast_to(np.asarray(channels_c, dtype=np.float64), (len(table), channels.shape[2]))
    fits = fit(table, np.asarray(ks), heads, constant=np.full(len(table), c), channels=channels,
               channel_constants=channels_c)
    P = np.exp(fits.log_poles)
    return Instances(P, P * fits.labels, fits.residual)


def start_structure_error(diagnostics: dict) -> float:
    """The larger of a start's ``subspace_residual`` and ``modulus_error`` (its heads' worst), from
    :meth:`RotaryLearner.learn`'s diagnostics; inf where the draw gave no start."""
    return max(diagnostics.get("subspace_residual", np.inf), diagnostics.get("modulus_error", np.inf))


def _assign(cost: np.ndarray) -> np.ndarray:
    """The permutation minimising the summed cost (row h -> column perm[h]); NaN costs lose."""
    rows, columns = linear_sum_assignment(np.nan_to_num(cost, nan=1e300, posinf=1e300))
    order = np.empty(len(rows), dtype=int)
    order[rows] = columns
    return order


def implied_labels(P, N, tau, label, offset):
    """``(N_p - tau_g l_g) / (P_p - tau_g - offset)`` for every (g, p): the key labels an offset
    instance implies for each pairing of a self head g with a pole p; NaN where ``E <= 0``.
    Returns ``(labels, E)``; a label's misfit times E is the misfit of the numerator N_p, which
    is what the matching weighs (a small E makes its implied label uncertain, not wrong)."""
    E = P[..., None, :] - tau[..., :, None] - offset
    with np.errstate(divide="ignore", invalid="ignore"):
        value = (N[..., None, :] - (tau * label)[..., :, None]) / E
    return np.where(E > 0, value, np.nan), E


def _label_misfit(implied: np.ndarray, E: np.ndarray, labels: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``min_p ((implied[j, a, p] - labels[j, b]) E[j, a, p])^2 / scale_j^2``, shape (j, a, b),
    capped at 1 (a label off by its own size is simply wrong, and a failed instance, NaN, is
    no worse: a few bad instances cannot outvote the many that hold)."""
    misfit = ((implied[:, :, :, None] - labels[:, None, None, :]) * E[..., None]) ** 2 / scale[:, None, None, None] ** 2
    return np.minimum(np.nan_to_num(misfit, nan=1.0, posinf=1.0), 1.0).min(axis=2)


class RotaryLearner:
    """One rotary run: the queries from the seed, the fits, the matching and the assembly."""

    def __init__(self, d: int, heads: int, seed, token_scale: float, bias: bool, rank: int | None,
                 window: int | None = None, spares: int = SPARE_TOKENS):
        self.d, self.H, self.seed, self.bias, self.rank, self.spares = d, heads, seed, bias, rank, spares
        self.samples = 2 * heads + SAMPLES_OVER
        longest = ZEROS_PER_SAMPLE * self.samples if window is None else min(ZEROS_PER_SAMPLE * self.samples,
                                                                               window - 3)
        self.ks = zero_counts(self.samples, longest)
        self.set_scale(token_scale)

    def set_scale(self, token_scale: float):
        self.token_scale = float(token_scale)
        rng = spawn_rng(self.seed, 1)  # the bases: stream 1 (the run's other queries draw from streams 5..22)
        self.X = random_basis(rng, self.d, token_scale)   # finals x_i (columns)
        self.Z = random_basis(rng, self.d, token_scale)   # keys z_j (columns)
        # off the hyperplane through x_1..x_d (a random orthogonal basis's sum direction, reversed)
        self.extra = -self.X.sum(axis=1) / np.sqrt(self.d)
        # spare tokens: a final or key token whose instances failed leaves its whole column or row
        # of the log-score grid unknown, which no completion recovers; the spares keep the
        # assembly (least squares over the tokens that held) determined
        spare = np.hstack([random_basis(rng, self.d, token_scale) for _ in range(-(-2 * self.spares // self.d))])
        self.spare_finals, self.spare_keys = spare[:, :self.spares], spare[:, self.spares:2 * self.spares]

    def drawn_again(self, seed) -> "RotaryLearner":
        """The same learner (heads, counts, token scale, spares) with its tokens drawn from ``seed``."""
        again = copy.copy(self)
        again.seed = seed
        again.set_scale(self.token_scale)
        return again

    @property
    def finals(self) -> np.ndarray:
        """Final tokens as columns: x_1..x_d, x_{d+1} when the query bias is learned, the spares."""
        columns = [self.X] + ([self.extra[:, None]] if self.bias else []) + [self.spare_finals]
        return np.hstack(columns)

    @property
    def keys(self) -> np.ndarray:
        """Key tokens as columns: z_1..z_d and the spares."""
        return np.hstack([self.Z, self.spare_keys])

    def patterns(self) -> list[np.ndarray]:
        """Self (x_i), key (z_j), then offset (z_j, 0^(delta-1), x_i) for delta = 1, 2, i-major."""
        d, finals = self.d, self.finals
        out = [x[None] for x in finals.T] + [z[None] for z in self.keys.T]
        for delta in (1, 2):
            for x in finals.T:
                for z in self.keys.T:
                    out.append(np.vstack([z[None], _zeros(delta - 1, d), x[None]]))
        return out

    @property
    def longest_instance(self) -> int:
        return int(self.ks[-1]) + 3

    def _order_keys(self, key_labels, offset_P, offset_N, tau, label_x, order, finals) -> np.ndarray:
        """Each key token's labels (j, l) put in head order: the permutation whose labels best match
        what the offset instances of the given final tokens (heads in ``order``) imply; NaN rows
        for keys whose own instance failed."""
        n_key, H = key_labels.shape
        cost = np.zeros((n_key, H, H))
        key_scale = np.maximum(np.nan_to_num(np.abs(key_labels)).max(axis=1), 1e-300)
        for i in finals:
            tau_i, label_i = tau[i][order[i]], label_x[i][order[i]]
            for t, offset in enumerate(OFFSETS):
                implied, E = implied_labels(offset_P[t, i], offset_N[t, i], tau_i, label_i, offset)  # (j, h, p)
                cost += _label_misfit(implied, E, key_labels, key_scale)
        label_z = np.full((n_key, H), np.nan)
        for j in np.flatnonzero(np.isfinite(key_labels).all(axis=1)):
            label_z[j] = key_labels[j][_assign(cost[j])]
        return label_z

    def _order_finals(self, label_z, known_z, offset_P, offset_N, tau, label_x, usable) -> np.ndarray:
        """Every final token's self heads ordered (``order[i, h]`` is the fitted head that is head
        h) by the key labels its offset instances imply; x_1 is the reference."""
        n_final, H = tau.shape
        order = np.tile(np.arange(H), (n_final, 1))
        labels, scale = label_z[known_z], np.maximum(np.abs(label_z[known_z]).max(axis=1), 1e-300)
        for i in np.flatnonzero(usable):
            if i == 0:
                continue
            cost = np.zeros((H, H))
            for t, offset in enumerate(OFFSETS):
                implied, E = implied_labels(offset_P[t, i], offset_N[t, i], tau[i], label_x[i], offset)  # (j, g, p)
                cost += _label_misfit(implied[known_z], E[known_z], labels, scale).sum(axis=0)  # (g, h)
            order[i] = _assign(cost.T)
        return order

    def _assign_poles(self, label_z, known_z, offset_P, offset_N, tau, label_x, usable) -> tuple:
        """Every offset instance's poles assigned to the heads (``tau``, ``label_x`` in head order)
        by the key labels: ``(log_E (2, H, n_key, n_final), implied (2, n_final, n_key, H) labels,
        misfits, limit)``, log_E NaN where the instance failed or its best assignment misses its key's
        labels by more than the limit (``MATCH_OUTLIER``, or ``MATCH_SPREAD`` median misfits up to
        ``MATCH_WRONG``; implied labels are kept for every assignment), and the limit."""
        H, n_final, n_key = self.H, tau.shape[0], label_z.shape[0]
        z_scale = np.maximum(np.nan_to_num(np.abs(label_z)).max(axis=1), 1e-300)
        log_E = np.full((2, H, n_key, n_final), np.nan)
        implied_chosen = np.full((2, n_final, n_key, H), np.nan)
        worst = np.full((2, n_key, n_final), np.inf)  # each instance's largest misfit
        for t, offset in enumerate(OFFSETS):
            for i in np.flatnonzero(usable):
                implied, E = implied_labels(offset_P[t, i], offset_N[t, i], tau[i], label_x[i], offset)  # (j, h, p)
                misfit = np.abs((implied - label_z[:, :, None]) * E) / z_scale[:, None, None]
                for j in np.flatnonzero(known_z & np.isfinite(offset_P[t, i]).all(axis=1)):
                    pole = _assign(misfit[j] ** 2)
                    chosen = misfit[j, np.arange(H), pole]
                    if not np.isfinite(chosen).all():
                        continue
                    implied_chosen[t, i, j] = implied[j, np.arange(H), pole]
                    worst[t, j, i] = chosen.max()
                    with np.errstate(all="ignore"):
                        log_E[t, :, j, i] = np.log(E[j, np.arange(H), pole])
        misfits = worst[np.isfinite(worst)]
        limit = min(max(MATCH_OUTLIER, MATCH_SPREAD * float(np.median(misfits))), MATCH_WRONG) if misfits.size \
            else MATCH_OUTLIER
        # an ambiguous or poorly fitted instance: left out
        log_E = np.where((worst <= limit)[:, None], log_E, np.nan)
        return log_E, implied_chosen, misfits, limit

    def learn(self, answers: np.ndarray, c: float, unit: float = 2.0 ** -53, channels=None, channels_c=None) -> tuple:
        """The start model from the instances' answers: ``(model or None, diagnostics dict)``.

        Instances whose fit failed (a pole not positive, ``E <= 0``) leave their entry of the
        log-score grid missing; each head's grids (rank r, the head width) are completed by
        robust alternating least squares, outliers replaced (:func:`complete_low_rank`).
        """
        d, H = self.d, self.H
        fitted = fit_instances(answers, c, self.ks, H, channels, channels_c)
        # an instance whose fit misses its own samples found other poles than its heads': unused
        fitted.P[~(fitted.residual <= max(INSTANCE_LIMIT, INSTANCE_UNITS * unit))] = np.nan
        n_final, n_key = self.finals.shape[1], self.keys.shape[1]
        tau, label_x = fitted.P[:n_final], fitted.N[:n_final] / fitted.P[:n_final]
        key_P, key_N = fitted.P[n_final:n_final + n_key], fitted.N[n_final:n_final + n_key]
        offset_P = fitted.P[n_final + n_key:].reshape(2, n_final, n_key, H)   # (delta, i, j, p)
        offset_N = fitted.N[n_final + n_key:].reshape(2, n_final, n_key, H)
        key_labels = key_N / key_P                                # (j, g) unordered
        diagnostics = {"failed_instances": int((~np.isfinite(fitted.P).all(axis=1)).sum()),
                       "fit_residual": float(fitted.residual[np.isfinite(fitted.residual)].max(initial=0.0))}
        if not (np.isfinite(tau[0]).all() and np.isfinite(label_x[0]).all()):
            return None, diagnostics  # the reference instance itself failed
        # Head order: the first final token's self heads are the reference. Each key token's labels
        # are ordered by what its offset instances with x_1 imply, every final token's heads by the
        # key labels over its offset instances, then the keys again over all final tokens (a key
        # ordered wrongly by x_1's two instances alone is set right by the majority), and the
        # final tokens once more.
        usable = np.isfinite(tau).all(axis=1) & np.isfinite(label_x).all(axis=1)
        order = np.tile(np.arange(H), (n_final, 1))
        label_z = self._order_keys(key_labels, offset_P, offset_N, tau, label_x, order, [0])
        for finals_used in (np.flatnonzero(usable), None):
            known_z = np.isfinite(label_z).all(axis=1)
            if known_z.sum() < d:
                return None, diagnostics
            order = self._order_finals(label_z, known_z, offset_P, offset_N, tau, label_x, usable)
            if finals_used is not None:
                label_z = self._order_keys(key_labels, offset_P, offset_N, tau, label_x, order, finals_used)
        tau_ordered = np.take_along_axis(tau, order, axis=1)
        label_x_ordered = np.take_along_axis(label_x, order, axis=1)
        ordered = (offset_P, offset_N, tau_ordered, label_x_ordered, usable)
        # Each offset instance's poles assigned to the ordered heads by the key labels; then each
        # key's labels re-measured as the median of what its offset instances imply (a key
        # instance whose heads' poles nearly coincide fits those labels poorly), and assigned again.
        log_E, implied, misfits, limit = self._assign_poles(label_z, known_z, *ordered)
        counted = np.isfinite(implied).sum(axis=(0, 1)) >= 3
        with np.errstate(all="ignore"):
            label_z = np.where(counted, np.nanmedian(implied.reshape(-1, n_key, H), axis=0), label_z)
        log_E, implied, misfits, limit = self._assign_poles(label_z, known_z, *ordered)
        worst_match = float(misfits[misfits <= limit].max(initial=0.0))
        # the rows and columns that held: keys with labels, finals with their self instance, each
        # with at least half its entries in every grid (a row of r entries or fewer is not
        # determined by the others, and one mostly missing is a token whose order went wrong)
        observed = np.isfinite(log_E)
        rows = np.flatnonzero(known_z & (observed[..., usable].mean(axis=3) >= HELD).all(axis=(0, 1)))
        columns = np.flatnonzero(usable & (observed[:, :, known_z].mean(axis=2) >= HELD).all(axis=(0, 1)))
        augmented = np.vstack([self.finals, np.ones((1, n_final))]) if self.bias else self.finals
        diagnostics.update(dropped_keys=int(n_key - len(rows)), dropped_finals=int(n_final - len(columns)))
        if len(columns) < augmented.shape[0] or len(rows) < d:
            return None, diagnostics
        log_E = log_E[:, :, rows][:, :, :, columns]
        missing = ~np.isfinite(log_E)
        diagnostics.update(match_misfit=worst_match, match_limit=limit, missing_entries=int(missing.sum() // H),
                           match_quantiles=(np.quantile(misfits, [0.5, 0.9, 0.95, 0.99]).tolist()
                                            if misfits.size else []))
        if missing.mean() > MOST_MISSING:
            return None, diagnostics
        # one rank per head: the score matrices of both offsets share it (the head width)
        if self.rank:
            widths = [self.rank] * H
        else:
            widths, borrowed = head_widths(log_E[0], noisy=unit > FIRST_LOOK_UNIT)
            diagnostics.update(widths_from_other_heads=borrowed)
        log_E = complete_low_rank(log_E, np.array([widths, widths]))
        # Assembly by least squares over what held: Z_r^T [W(delta) | u(delta)] X_c = L,
        # Z_r^T v = l_z and X_c^T v = l_x (X_c without the augmenting 1).
        Z_rows, X_columns = self.keys[:, rows], augmented[:, columns]
        W = np.einsum("aj,thji,ib->thab", np.linalg.pinv(Z_rows.T), log_E, np.linalg.pinv(X_columns))
        finals_used = self.finals[:, columns]
        v = np.linalg.lstsq(np.hstack([Z_rows, finals_used]).T,
                            np.vstack([label_z[rows], label_x_ordered[columns]]), rcond=None)[0].T
        heads = [rotary_head(W[0, h], W[1, h], widths[h]) for h in range(H)]
        width = max(max(head.Q.shape[0] for head in heads), 2)
        Q, K, b = np.zeros((H, width, d)), np.zeros((H, width, d)), np.zeros((H, width))
        theta = np.zeros((H, width // 2))
        for h, head in enumerate(heads):
            rows = head.Q.shape[0]
            Q[h, :rows], K[h, :rows] = head.Q[:, :d], head.K
            b[h, :rows] = head.Q[:, d] if self.bias else 0.0
            theta[h, :rows // 2] = head.theta
        diagnostics.update(subspace_residual=max(head.subspace_residual for head in heads),
                           modulus_error=max(head.modulus_error for head in heads),
                           widths=[head.width for head in heads])
        return RotaryAttention(Q, K, theta, v, c, b=b), diagnostics


def answer_precision(unit: float) -> Check:
    """Answers coarser than float32 (bfloat16, float16) are refused: one rational fit per instance
    separates H poles only to a few units of the answers' rounding (docs/algorithm.md, 'Numerics in float64 and the
    token scale'), and at 8 or 11 bits no start comes out that the refinement could take to the layer."""
    name = {2.0 ** -8: "bfloat16", 2.0 ** -11: "float16"}.get(unit, f"a unit roundoff of {unit:.1e}")
    return Check("answer_precision", unit <= COARSEST_UNIT, unit, COARSEST_UNIT,
                 "the answers' rounding unit (declared by the oracle or read from their bits)"
                 + ("" if unit <= COARSEST_UNIT else
                    f": {name} answers are too coarse for the rotary schedule; run the layer in float32 or "
                    "float64 (layer.float(), the same weights)"))


def _fewer_bits(precision: int | None, residual: float, limit: float) -> str:
    """A high-precision run whose model fits its answers only to about 2^-b, b < precision: what
    an oracle computing at about b bits gives (its answers carry no more, whatever their type)."""
    if precision is None or not residual > limit or not 0 < residual < 2.0 ** -40:
        return ""
    bits = int(-np.log2(residual))
    return (f": the answers fit only to about 2^-{bits}, as an oracle computing at about {bits} bits, not "
            f"precision={precision}, would give: run at the oracle's own precision")


def extract_rotary(oracle, d: int, heads: int, seed=None, *, precision: int | None = None, token_scale=None,
                   bias: bool = True, rank: int | None = None, batch_size: int = 1024, progress=None,
                   max_queries=None, verify_length: int | None = None,
                   window_limit: int = 4096, key_bias: bool = False, boundary=None) -> RotaryExtraction:
    """The rotary extraction behind ``extract(..., positions="rotary")`` (its checks unreported:
    ``extract`` raises or warns on failure). ``precision=bits``: an oracle answering ``mpf`` at
    ``bits``; the float64 fit is taken to them by :func:`~mhaextract.rotary.refine.polish_high_precision`.
    ``key_bias=True`` (float64 or float32 whole answers): the layer's keys carry a bias; every query
    after the search for a key-neutral token z* (:mod:`~mhaextract.rotary.neutral`; from float32
    answers by :func:`~mhaextract.rotary.neutral.large_query_search`) is asked at tokens shifted by
    z*, the refinement fits a key bias too (after the large-query search with a prior of the size
    it leaves), and the model is shifted back. ``boundary``: the session's (counting, budget, a
    transcript section recording every answer: the run's queries depend on earlier answers, each
    the same given them, so a resumed run asks the same queries and reads back those answered)."""
    started = time.perf_counter()
    answer_dtype = str(getattr(oracle, "answer_dtype", "float64" if precision is None else "mpf"))
    if boundary is None:
        boundary = OracleBoundary(oracle, d, precision=precision, batch_size=batch_size, progress=progress,
                                  max_queries=max_queries, vectors=VectorAnswers(seed, getattr(oracle, "answer_dtype",
                                                                                               None)))
    vectors = boundary.vectors
    # the limits of a high-precision run: the float64 ones in units of its answers' rounding
    units = 1.0 if precision is None else 2.0 ** (53 - precision)
    constant = boundary.ask([np.zeros((1, d))], "the output constant", whole=precision is None)
    c_whole = constant[0] if np.ndim(constant) == 2 else None  # a whole layer's output constant
    scale = d ** 0.25 if token_scale is None else float(token_scale)
    c = float(vectors.scalars(constant)[0] if c_whole is not None else constant[0])
    # (y, 0^(L-1)) answers c once y left the window, key bias or not (every token attended is 0 and
    # carries the same value whatever it scores): the window is found before any key-neutral token
    window = find_window(boundary, spawn_rng(seed, 21), scale, c, window_limit)
    coarse = boundary.answer_unit > FIRST_LOOK_UNIT  # float32 answers
    learner = RotaryLearner(d, heads, seed, scale, bias, rank, window.window,
                            NOISY_SPARE_TOKENS if coarse else SPARE_TOKENS)
    # at coarser answers than float32 the window search reads rounding as a window: not reported
    checks = [answer_precision(boundary.answer_unit if precision is None else 2.0 ** -precision)]
    if checks[-1].passed:
        checks.append(window.check(learner.samples + 3))
    neutral = None
    if key_bias and all(check.passed for check in checks):  # the search's sequences need the window's tokens
        if c_whole is None:
            checks.append(Check("key_bias", False, 1.0, 2.0, "a key bias is sought from whole answers (a vector "
                                "a query): this oracle answers one number; ask the whole layer"))
        elif coarse and window.window is not None and window.window < LARGE_QUERY_MIN_WINDOW:
            checks.append(Check("key_bias", False, float(window.window), float(LARGE_QUERY_MIN_WINDOW),
                                "the sliding window: from float32 answers the key-neutral token is sought over "
                                f"counts up to {LARGE_QUERY_LENGTHS[-1]}, and a window this short leaves too few "
                                "of them; run the layer in float64 (layer.double(), the same weights) and "
                                "compare the model with the float32 layer's outputs"))
        else:
            neutral = find_neutral_token(boundary, c_whole, spawn_rng(seed, 24), scale, progress, window.window,
                                         heads=heads, coarse=coarse)
            checks += neutral.checks()
        if not all(check.passed for check in checks):
            return RotaryExtraction(model=None, heads=0, d=d, seed=seed, schedule="rotary", answer_dtype=answer_dtype,
                                    queries=boundary.queries + boundary.replayed, queries_asked=boundary.queries,
                                    queries_replayed=boundary.replayed,
                                    max_query_length=boundary.max_query_length, window=window.window,
                                    window_search=window, token_scale=scale, error_estimate=np.inf,
                                    answers_residual=np.inf, seconds=time.perf_counter() - started, checks=checks,
                                    neutral=neutral)
        # from here on the layer is seen without its key bias; the zero token is z*
        boundary = ShiftedBoundary(boundary, neutral.token)
        constant = boundary.ask([np.zeros((1, d))], "the output constant", whole=True)
        c_whole = constant[0]
        c = float(vectors.scalars(constant)[0])
    start, model, refinement, diagnostics = None, None, None, {}
    sequences, answers, exact = [], np.zeros(0), np.zeros(0)
    if all(check.passed for check in checks):
        # a whole layer: its outputs, read out on a few channels, place the instances' poles too
        projection = (channel_projection(spawn_rng(seed, 23), len(c_whole), heads)
                      if c_whole is not None and len(c_whole) > 1 else None)

        def ask(patterns, description):
            return ask_instances(boundary, vectors, projection, patterns, learner.ks, description)

        channels_c = None if projection is None else c_whole @ projection
        if token_scale is None:
            choose_token_scale(learner, ask, c, channels_c, coarse)
        sequences, exact, channels = ask(learner.patterns(), "rotary instances")
        unit = boundary.answer_unit
        if unit > COARSEST_UNIT:  # seen only now in the answers' bits
            checks.append(answer_precision(unit))
        else:
            start, diagnostics = learner.learn(mid_float(exact), c, unit, channels, channels_c)
            drawn = [start_structure_error(diagnostics)]
            # heads matched wrongly across the instances (at float32 one draw in a few): fresh
            # instances at the same token scale, every answer kept for the residual check
            for draw in range(1, START_DRAWS):
                if drawn[-1] <= STRUCTURE_LIMIT:
                    break
                again = learner.drawn_again(int(spawn_rng(seed, 25 + draw).integers(2 ** 63)))
                more, more_exact, more_channels = ask(again.patterns(), f"rotary instances, draw {draw + 1}")
                sequences, exact = list(sequences) + list(more), np.concatenate([exact, more_exact])
                trial, trial_diagnostics = again.learn(mid_float(more_exact), c, unit, more_channels, channels_c)
                drawn.append(start_structure_error(trial_diagnostics))
                if drawn[-1] < min(drawn[:-1]):
                    start, diagnostics = trial, trial_diagnostics
            diagnostics["start_structure_errors"] = drawn
        answers = mid_float(exact)
        if start is not None and window.window is not None:
            start = start.replaced(window=window.window)
        if start is not None and key_bias:  # what is left of the key bias after the shift, fitted from 0
            start = start.replaced(key_bias=np.zeros_like(start.b))
        if start is None and unit <= COARSEST_UNIT:
            checks.append(Check("start", False, float(diagnostics.get("failed_instances", 0)), 0.0,
                                "the instances gave no start model (too many failed fits or unmatched heads): "
                                f"{diagnostics}" + ("" if key_bias else "; a key bias (Qwen2's k_proj.bias) makes "
                                                    "the zero token no counter: try key_bias=True")))
    if start is not None:
        parameters = len(pack(start))
        need, have = refinement_memory(parameters, POLISH_FACTOR * parameters, precision), available_memory()
        if have is not None and need > have:  # refused before the polish queries are spent
            checks.append(Check("refinement_memory", False, float(need), float(have),
                                f"the refinement's {'normal equations' if precision is None else 'Jacobian'} in "
                                f"{parameters:,} parameters (head width "
                                f"{start.head_width}) would hold about {need / 2**30:.1f} GiB, beside "
                                f"{have / 2**30:.1f} GiB available: run on a machine with more memory; a head width "
                                "above the layer's (diagnostics['widths']) says the start misjudged it: pass "
                                "rank= the layer's head width"))
            start = None
    if start is not None:
        polish = random_queries(spawn_rng(seed, 22), POLISH_FACTOR * len(pack(start)), d, learner.token_scale,
                                POLISH_LENGTHS)
        polish_exact = boundary.ask(polish, "refining on fresh queries")
        polish_answers = mid_float(polish_exact)
        # the key bias left by the large-query search: a Gaussian prior of its size, or the steps
        # trade it for the slowest angle (theta -> 0, k -> large)
        key_size = SEARCH_KEY_SIZE if neutral is not None and neutral.large_queries else None
        def steps(model, iterations=60, estimate=True):
            return refine(model, polish, polish_answers, iterations=iterations, seed=seed, floor=max(1e-13, 3 * unit),
                          estimate=estimate, frame_shift=None if neutral is None else -neutral.token,
                          key_size=key_size,
                          on_step=lambda step, misfit: note_progress(
                              progress, f"refining the rotary model: step {step}, max misfit {misfit:.1e}"))

        model, first = start, None
        if coarse:  # float32: the slow blocks' angles and planes from M's eigenvalues are noise
            note_progress(progress, "seeding the slow rotary blocks")
            model, seeded = seed_low_frequencies(start, polish, polish_answers)
            seedings = [seeded]
            # seeded again each time a few steps have settled the other parameters, which each
            # seeding fits beside the generators (a start 4e-2..8e-2 off left the second
            # seeding's angles small by a factor of 2..5): until a seeding gains nothing, or a
            # stretch stops early (the answers' rounding reached, or no step gaining)
            while seedings[-1] and len(seedings) < SEEDINGS:
                model, stretch = steps(model, SEEDING_STEPS, estimate=False)
                first = stretch if first is None else replace(first, iterations=first.iterations
                                                              + stretch.iterations)
                if stretch.iterations < SEEDING_STEPS:
                    break
                model, seeded = seed_low_frequencies(model, polish, polish_answers)
                seedings.append(seeded)
            diagnostics["seeded_blocks"] = seedings
        model, refinement = steps(model)
        if first is not None:
            refinement = replace(refinement, iterations=first.iterations + refinement.iterations,
                                 residual_before=first.residual_before)
        if precision is not None:
            model, refinement = polish_high_precision(
                model, polish, mpf_array(polish_exact), precision, seed=seed,
                on_step=lambda step, misfit: note_progress(
                    progress, f"refining at {precision} bits: step {step}, max misfit {misfit:.1e}"))
        sequences, answers = list(sequences) + polish, np.concatenate([answers, polish_answers])
        exact = np.concatenate([exact, polish_exact])
    residual = estimate = np.inf
    if model is not None:
        scale_answers = max(float(np.abs(answers).max()), 1e-300)
        residual = float(output_errors(model, sequences, exact, precision).max()) / scale_answers
        estimate = max(refinement.noise_error, ESTIMATE_FLOOR * units)
        residual_limit = max(RESIDUAL_LIMIT, RESIDUAL_UNITS * unit) * units
        estimate_limit = max(ESTIMATE_LIMIT, ESTIMATE_UNITS * unit) * units
        checks += [
            Check("answers_residual", residual <= residual_limit, residual, residual_limit,
                  f"max misfit of the model on the {len(sequences)} queries asked (instances and fresh polish "
                  "queries), relative to the largest answer" + _fewer_bits(precision, residual, residual_limit)),
        ]
    value_fit, scalar_model = None, None
    if model is not None and (vectors.d_out or 1) > 1:
        # the whole layer: V_h and c fitted to whole answers (docs/algorithm.md, 'The whole layer: vector outputs and a
        # replacement module')
        value_queries = random_queries(spawn_rng(seed, 13), value_query_count(model.heads, d), d, learner.token_scale,
                                       VALUE_QUERY_LENGTHS)
        whole = boundary.ask(value_queries, "value read-outs", whole=True)
        value_fit = fit_values(model, value_queries, whole, bias=True, readout=vectors.readout,
                               score_error=(estimate, estimate), seed=seed,
                               score_moves=None if refinement.error_draws is None
                               else error_moves(model, refinement.error_draws),
                               frame_shift=None if neutral is None else -neutral.token)
        checks += value_fit.checks(residual_limit, estimate)
        scalar_model, model = model, value_fit.model
        estimate = max(estimate, value_fit.error_estimate)
    if model is not None:
        checks.append(Check("error_estimate", estimate <= estimate_limit, estimate, estimate_limit,
                            "first-order error of W_h(0..2), u_h(0..2) and the values, from the refinement's "
                            "residual (and the value fit's for a whole layer)"))
    verification = None
    if model is not None and (verify_length is None or verify_length > 0):
        longest = verify_length or max(256, 4 * (window.window or 0))
        long_queries = ask_long_verification(boundary, spawn_rng(seed, 5), learner.token_scale, longest)
        scale_long = float(np.abs(whole).max()) if value_fit is not None else float(np.abs(answers).max())
        check, verification = long_queries.judge(model, estimate, residual, 0.0, max(scale_long, 1e-300),
                                                 boundary.answer_unit * units,
                                                 max(POLISH_LENGTHS[1], learner.longest_instance), seed=seed,
                                                 precision=precision)
        checks.append(check)
    if neutral is not None:  # the models seen through the original tokens: x' = x - z*
        model, start, scalar_model = (None if m is None else m.with_token_shift(-neutral.token)
                                      for m in (model, start, scalar_model))
    return RotaryExtraction(model=model, heads=0 if model is None else model.heads, d=d, seed=seed, schedule="rotary",
                            answer_dtype=answer_dtype, queries=boundary.queries + boundary.replayed,
                            queries_replayed=boundary.replayed,
                            verification_queries=0 if verification is None else verification.queries,
                            verification_length=0 if verification is None else verification.lengths[1],
                            queries_asked=boundary.queries, max_query_length=boundary.max_query_length,
                            window=window.window, window_search=window, token_scale=learner.token_scale,
                            error_estimate=float(estimate), answers_residual=float(residual),
                            seconds=time.perf_counter() - started, checks=checks, verification=verification,
                            start=start, refinement=refinement, diagnostics=diagnostics,
                            scalar_model=scalar_model, value_fit=value_fit,
                            readout=vectors.readout if (vectors.d_out or 1) > 1 else None, precision=precision,
                            neutral=neutral)
