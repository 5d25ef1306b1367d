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

Here: the instances, their fits and the start (:class:`RotaryLearner`), the token scale, and the
run's result (:class:`RotaryExtraction`); the run itself, step by step, is :mod:`.run`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..numerics.float64 import fit
from ..numerics.highprec import mid_float
from ..run.result import Result
from ..oracle.answer_stats import FLOAT64_UNIT
from ..oracle.queries import random_basis
from .completion import complete_low_rank, complete_offset_pairs, head_widths, measurable_rank
from .completion import completion_rank  # noqa: F401 (re-exported)
from ..run.validation import spawn_rng
from ..models.rotary import RotaryAttention
from .neutral import NeutralToken
from .structure import rotary_head, widest_rotary_head
from .window import WindowSearch

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
#: A token whose offset instances' matching misfits have a median this many times the median of
#: all was ordered wrongly (noisy log-scores; ``mismatched_tokens``): left out.
MISMATCHED_TOKEN = 10.0
#: Float64 answers whose offset instances' median matching misfit exceeds this give log-scores as
#: noisy as float32 answers do, and the start treats them so (the finals' labels re-measured, tokens
#: ordered wrongly left out, the grids weighed by their noise): on the trained Qwen2 layer
#: qwen2-d32-h4/0 in float64 the key the key-neutral token leaves made it 5e-5, and the unweighted
#: start read a head width of 22 (of 8) and failed its structure in all three draws; exact float64
#: starts of random layers stay far below (the float64 rotary cases of benchmarks/bench_identity.py among them).
NOISY_MATCH = 1e-5
#: Spare final and key tokens beyond the d (+1) the assembly needs; with float32 answers, where a few
#: more tokens lose too many entries to be kept (d = 32, H = 4: three finals with two spares).
SPARE_TOKENS = 2
NOISY_SPARE_TOKENS = 6
#: A draw drawn again carries this many spares per token the one before lost (``spares_after``).
SPARES_PER_LOST = 1.5
#: A key's row or a final's column of a head's grid missing the assembly by more than this many times the
#: grid's median (relative to its norm), and by more than ``ASSEMBLY_FLOOR``, is an outlier
#: (:meth:`RotaryLearner._assemble`): the grids are assembled again without it, or the draw gives no start.
#: Float64 grids, their poles crowded or not, stay below 1.2e-4 (their ratios reach 10 and more over medians
#: of 1e-7), float32 grids' worst tokens in heads that pass at 1.2e-3; the outlier that spoiled a head 6.7e-2.
ASSEMBLY_OUTLIER = 10.0
ASSEMBLY_FLOOR = 1e-2
#: The token scale makes the self-scores of the basis tokens this large (root mean square).
SCORE_TARGET = 1.5
#: A fitted pole whose label is below this fraction of its instance's largest stands for no head
#: (``score_size``): heads merged into one pole at coarse answers leave another pole far out, its residue vanishing.
SPURIOUS_LABEL = 1e-4
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


def choose_token_scale(learner: "RotaryLearner", ask, c: float, channels_c=None, coarse: bool = False) -> np.ndarray:
    """Scale the learner's tokens so that the self-scores of its d basis tokens have a root mean
    square of ``SCORE_TARGET``, measured on their self instances ``(0^k, x_i)`` (d K queries) by the
    rational fit of each; ``coarse`` answers (float32) first size the scores to first order
    (:func:`score_spread`, d K queries more), since at the first scale ``d^(1/4)`` the heads' poles
    may crowd within a few hundredths, where a rational fit of coarse answers is wrong.
    ``ask(patterns, description)`` returns the instances' ``(queries, read-out answers, channels)``.
    Returns the self instances' fit residuals (relative to each instance's largest sample): the
    answers' own noise where it exceeds the fit's float64 rounding (``answer_noise``)."""
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
    rescale(score_size(fitted))
    return fitted.residual


def score_size(fitted: Instances) -> float:
    """The root mean square of the self instances' log-poles (their self-scores), over the poles
    that carry a head: a pole whose label ``N / P`` is below ``SPURIOUS_LABEL`` of its instance's
    largest stands for no head. A fit of poles crowded within a few hundredths in log at coarse
    answers merges two heads into one pole and sends the other far out with a vanishing residue (seen
    on a trained Qwen2 layer in float32); counted, such poles inflate the measured size, the token
    scale comes out too small, the heads' poles crowd further and no draw of the start holds its
    matching."""
    with np.errstate(divide="ignore", invalid="ignore"):
        labels = np.abs(fitted.N / fitted.P)
        spurious = labels < SPURIOUS_LABEL * np.nanmax(labels, axis=1, keepdims=True, initial=0.0)
        return float(np.sqrt(np.nanmean(np.where(spurious, np.nan, np.log(fitted.P)) ** 2)))


def answer_noise(residuals: np.ndarray) -> float:
    """The answers' relative noise as the self instances' fits show it: the median of their
    residuals (a fit that failed on crowded poles is one instance of d, not the median). Exact
    float64 answers leave about 1e-15; a float64 layer computing its rotary angles in float32
    leaves 1e-10..1e-9, and its softmax in float32 (eager) 1e-9..1e-8 (d = 16, H = 2)."""
    residuals = np.asarray(residuals, dtype=np.float64)
    finite = residuals[np.isfinite(residuals)]
    return float(np.median(finite)) if len(finite) else np.inf


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


def spares_after(diagnostics: dict, spares: int, d: int) -> int:
    """The spare tokens of the draw after one with ``spares`` and these diagnostics: at least
    ``NOISY_SPARE_TOKENS`` after noisy log-scores (float64 answers whose key-neutral token leaves a key drop
    the tokens they mismatch, as float32 answers do), and ``SPARES_PER_LOST`` times the finals or keys the draw
    lost (dropped, mismatched or outliers), at most d: a trained Mistral layer under a window of 16 tokens lost
    16 of its 71 finals in float32 (mistral-d64-h4/0)."""
    lost = max(diagnostics.get("dropped_finals", 0) + diagnostics.get("outlier_finals", 0),
               diagnostics.get("dropped_keys", 0) + diagnostics.get("outlier_keys", 0))
    noisy = NOISY_SPARE_TOKENS if diagnostics.get("noisy_log_scores") else 0
    return int(min(max(spares, noisy, np.ceil(SPARES_PER_LOST * lost)), max(d, spares)))


#: A start whose W(2) lies this far outside W(1)'s row and column spaces (``subspace_residual``,
#: relative), or whose M has an eigenvalue this far off the unit circle (``modulus_error``), had
#: its heads matched wrongly across instances (float32 good starts: 1e-4 at d = 16, 0.02 at
#: d = 32). From log-scores as exact as float64's the limit is ``EXACT_STRUCTURE_LIMIT`` (good
#: starts: 1.8e-10..6.4e-10 on the trained Llama and Mistral layers at d = 32, 6e-6 on qwen2-d32-h4/0
#: through its shifted frame, 2e-6..9e-6 on random d = 8 layers of two heads as wide as d; a start at
#: 0.03 there, its heads matched wrongly, ended 6e-3 off after the refinement).
STRUCTURE_LIMIT = 0.1
EXACT_STRUCTURE_LIMIT = 1e-3


def structure_limit(noisy: bool) -> float:
    """The largest structure error (:func:`start_structure_error`) of a start from log-scores as noisy
    as float32 answers give (``noisy``), or as exact as float64's."""
    return STRUCTURE_LIMIT if noisy else EXACT_STRUCTURE_LIMIT


def start_structure_error(diagnostics: dict) -> float:
    """The larger of a start's ``subspace_residual`` and ``modulus_error`` (its heads' worst), from
    :meth:`RotaryLearner.learn`'s diagnostics; inf where the draw gave no start."""
    return max(diagnostics.get("subspace_residual", np.inf), diagnostics.get("modulus_error", np.inf))


def reference_final(tau: np.ndarray, usable: np.ndarray) -> int:
    """The final token whose heads the start is ordered by: among the ``usable`` self instances
    (``tau`` (n_final, H), the fitted self poles), the one whose closest two poles are furthest
    apart in log. Its labels ``v_h^T x`` are the fit's numerators over its poles, and between poles
    a distance delta apart the answers' noise is amplified about 1 / delta into them."""
    with np.errstate(all="ignore"):
        logs = np.sort(np.log(np.where(usable[:, None], tau, np.nan)), axis=1)
        closest = np.diff(logs, axis=1).min(axis=1, initial=np.inf) if tau.shape[1] > 1 else np.zeros(len(tau))
    return int(np.nanargmax(np.where(usable, closest, -np.inf)))


def log_score_weights(log_E: np.ndarray, tau: np.ndarray, offset_P: np.ndarray) -> np.ndarray:
    """Inverse variances (up to one factor) of the log-score grids' entries ``log E``, ``E = P -
    tau - (delta - 1)`` (``log_E`` (2, H, n_key, n_final); ``tau`` (n_final, H) the self poles in
    head order; ``offset_P`` (2, n_final, n_key, H) the offset instances' fitted poles). A relative
    error s of the pole P (of tau) moves log E by ``s P / E`` (``s tau / E``), and a fitted pole's
    relative error grows as the other poles of its fit crowd it, about as the inverse of the log
    distance to the nearest one (float32 answers, a trained Llama layer at d = 32: median log-score
    errors 1.3e-4 beyond 0.3, 1.8e-3 at 0.03..0.1, 1.7e-2 within 0.01). Each entry's standard
    deviation is taken as ``(P / g_P + tau / g_tau) / E``, g the log distances (at least 1e-3; 1
    for a pole alone in its fit, one head)."""
    E = np.exp(log_E)
    tau_grid = tau.T[None, :, None, :]                                      # (1, H, 1, n_final)
    P = E + tau_grid + np.asarray(OFFSETS)[:, None, None, None]
    with np.errstate(all="ignore"):
        others = np.log(offset_P).transpose(0, 2, 1, 3)[:, None]           # (2, 1, n_key, n_final, H)
        gap_P = _second_smallest(np.abs(np.log(P)[..., None] - others))    # the nearest beside itself
        own = np.log(tau)
        gap_tau = _second_smallest(np.abs(own[:, :, None] - own[:, None, :])).T  # (H, n_final)
        gap_P, gap_tau = (np.where(np.isinf(gap), 1.0, np.maximum(gap, 1e-3)) for gap in (gap_P, gap_tau))
        sigma = (P / gap_P + tau_grid / gap_tau[None, :, None, :]) / E
        return 1.0 / sigma ** 2


def mismatched_tokens(worst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The keys and finals (boolean masks) whose offset instances' matching misfits (``worst``, (2,
    n_key, n_final), each instance's largest) have a median more than ``MISMATCHED_TOKEN`` times the
    median of all: a token whose heads were ordered wrongly misses in most of its instances, and
    with float32 answers (median misfits of 1e-2, a limit up to ``MATCH_WRONG``) many of those
    still pass the limit and carry another head's log-scores into the grids, a whole row or column
    that a rank-r completion fits by its own factor (and the rank search by one rank more)."""
    with warnings.catch_warnings():  # a token whose instances all failed: an All-NaN slice, not flagged
        warnings.simplefilter("ignore", RuntimeWarning)
        typical = np.nanmedian(np.where(np.isfinite(worst), worst, np.nan))
        keys = np.nanmedian(np.where(np.isfinite(worst), worst, np.nan), axis=(0, 2))
        finals = np.nanmedian(np.where(np.isfinite(worst), worst, np.nan), axis=(0, 1))
    return keys > MISMATCHED_TOKEN * typical, finals > MISMATCHED_TOKEN * typical


def _second_smallest(distances: np.ndarray) -> np.ndarray:
    """The second smallest along the last axis (the nearest other pole, beside a pole's own zero
    distance); inf with a single pole."""
    padded = np.concatenate([distances, np.full(distances.shape[:-1] + (1,), np.inf)], axis=-1)
    return np.sort(padded, axis=-1)[..., 1]


def _remeasured(labels: np.ndarray, implied: np.ndarray) -> np.ndarray:
    """Each token's labels (n, H) as the median of what its instances imply (m, n, H), where at
    least three of them do; the labels given elsewhere."""
    counted = np.isfinite(implied).sum(axis=0) >= 3
    with warnings.catch_warnings():  # tokens with no finite implied label: All-NaN slices, not used
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.where(counted, np.nanmedian(implied, axis=0), labels)


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

    def drawn_again(self, seed, spares: int | None = None) -> "RotaryLearner":
        """The same learner (heads, counts, token scale, spares, or ``spares`` where given) with its tokens
        drawn from ``seed``."""
        again = copy.copy(self)
        again.seed = seed
        if spares is not None:
            again.spares = spares
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

    def _order_finals(self, label_z, known_z, offset_P, offset_N, tau, label_x, usable, reference) -> np.ndarray:
        """Every final token's self heads ordered (``order[i, h]`` is the fitted head that is head
        h) by the key labels its offset instances imply; the ``reference`` final keeps its own order."""
        n_final, H = tau.shape
        order = np.tile(np.arange(H), (n_final, 1))
        labels, scale = label_z[known_z], np.maximum(np.abs(label_z[known_z]).max(axis=1), 1e-300)
        for i in np.flatnonzero(usable):
            if i == reference:
                continue
            cost = np.zeros((H, H))
            for t, offset in enumerate(OFFSETS):
                implied, E = implied_labels(offset_P[t, i], offset_N[t, i], tau[i], label_x[i], offset)  # (j, g, p)
                cost += _label_misfit(implied[known_z], E[known_z], labels, scale).sum(axis=0)  # (g, h)
            order[i] = _assign(cost.T)
        return order

    def _assign_poles(self, label_z, known_z, offset_P, offset_N, tau, label_x, usable) -> tuple:
        """Every offset instance's poles assigned to the heads (``tau``, ``label_x`` in head order)
        by the key labels: ``(log_E (2, H, n_key, n_final), implied key labels and implied final
        labels (both (2, n_final, n_key, H)), misfits (2, n_key, n_final), limit)``, log_E NaN where
        the instance failed or its best assignment misses its key's labels by more than the limit
        (``MATCH_OUTLIER``, or ``MATCH_SPREAD`` median misfits up to ``MATCH_WRONG``; implied labels
        are kept for every assignment: the key's ``(N_p - tau_h l_x) / E``, the final's ``(N_p - E
        l_z) / tau_h``), the misfits each instance's largest (inf where it failed), and the limit."""
        H, n_final, n_key = self.H, tau.shape[0], label_z.shape[0]
        z_scale = np.maximum(np.nan_to_num(np.abs(label_z)).max(axis=1), 1e-300)
        log_E = np.full((2, H, n_key, n_final), np.nan)
        implied_chosen = np.full((2, n_final, n_key, H), np.nan)
        implied_finals = np.full((2, n_final, n_key, H), np.nan)
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
                    implied_finals[t, i, j] = (offset_N[t, i, j, pole] - E[j, np.arange(H), pole] * label_z[j]) / tau[i]
                    worst[t, j, i] = chosen.max()
                    with np.errstate(all="ignore"):
                        log_E[t, :, j, i] = np.log(E[j, np.arange(H), pole])
        misfits = worst[np.isfinite(worst)]
        limit = min(max(MATCH_OUTLIER, MATCH_SPREAD * float(np.median(misfits))), MATCH_WRONG) if misfits.size \
            else MATCH_OUTLIER
        # an ambiguous or poorly fitted instance: left out
        log_E = np.where((worst <= limit)[:, None], log_E, np.nan)
        return log_E, implied_chosen, implied_finals, worst, limit

    def _assemble(self, log_E, weights, rows, columns, augmented, noisy, diagnostics):
        """The score matrices from the grids' rows ``rows`` (keys) and columns ``columns`` (finals): each head's
        grids completed at its width and assembled by least squares over those tokens (docs/algorithm.md, 'Rotary
        attention: positions, grouped heads and sliding windows', 'Assembly'), ``Z_r^T [W(delta) | u(delta)] X_c =
        L``. Returns ``(W, widths, outlier keys, outlier finals)`` (the tokens' indices), or None where too many
        entries are missing. A token is an outlier where, in some head's grid, its row or column misses the
        assembled ``Z_r^T W X_c`` by more than ``ASSEMBLY_OUTLIER`` times that grid's median (relative to its own
        norm, and above ``ASSEMBLY_FLOOR``): a final whose heads were ordered wrongly in a few instances passes
        the matching and, through ``pinv(X_c)`` (condition number in the hundreds at d = 64), spreads over its
        head's whole score matrix (mistral-d64-h4/1 in float32: one final 17..21 times the median, the head's
        W(0) given a direction of singular value 4.6 against its own 0.58; the other heads' worst columns 2.4..4 times
        their medians, rows up to 8.3 times, all within 1.2e-3 of their norms)."""
        H = log_E.shape[1]
        weights = None if weights is None else weights[:, :, rows][:, :, :, columns]
        log_E = log_E[:, :, rows][:, :, :, columns]
        missing = ~np.isfinite(log_E)
        diagnostics.update(missing_entries=int(missing.sum() // H))
        if missing.mean() > MOST_MISSING:
            diagnostics.update(no_start="more than a fifth of the grids' entries missing")
            return None
        # one rank per head: the score matrices of both offsets share it (the head width)
        if self.rank:
            widths = [self.rank] * H
        else:
            widths, borrowed = head_widths(log_E[0], noisy=noisy, weights=None if weights is None else weights[0])
            diagnostics.update(widths_from_other_heads=borrowed)
        Z_rows, X_columns = self.keys[:, rows], augmented[:, columns]

        def completed(grids, grid_weights, ranks):
            # noisy grids: both offsets fitted together in the rotary form (a key's and a final's factor
            # shared), so that a grid missing many entries leans on the other
            grids = (complete_low_rank(grids, np.array([ranks, ranks])) if grid_weights is None else
                     complete_offset_pairs(grids, ranks, grid_weights))
            return grids, np.einsum("aj,thji,ib->thab", np.linalg.pinv(Z_rows.T), grids, np.linalg.pinv(X_columns))

        grids, W = completed(log_E, weights, widths)
        if noisy and not self.rank:
            widths, grids, W = self._widen_at_the_limit(log_E, weights, widths, grids, W, completed, diagnostics)
        log_E = grids
        misfit = log_E - np.einsum("aj,thab,bi->thji", Z_rows, W, X_columns)
        outliers = []
        for axis, tokens in ((3, rows), (2, columns)):   # a key's row sums over finals, a final's column over keys
            with np.errstate(all="ignore"):
                relative = np.linalg.norm(misfit, axis=axis) / np.linalg.norm(log_E, axis=axis)
            median = np.median(relative, axis=2, keepdims=True)
            far = (relative > ASSEMBLY_OUTLIER * median) & (relative > ASSEMBLY_FLOOR)
            outliers.append(tokens[far.any(axis=(0, 1))])
        return W, widths, outliers[0], outliers[1]

    def _widen_at_the_limit(self, log_E, weights, widths, grids, W, completed, diagnostics):
        """Noisy grids measure widths only up to ``measurable_rank`` (fits that leave a third of the
        entries free): a head whose fall came at that limit may be wider, its measured fall the fit's
        approach to interpolation (a head of width 8 at d = 12 fell 6.6-fold at rank 7, the limit of
        its 18 x 17 grid, and 1,956-fold at 8, beyond it). Each such head is completed at the widths
        above, up to d, and takes the widest at which it holds the rotary form (:func:`structure_limit`),
        trying on while one of the next two does."""
        limit, widths = structure_limit(True), list(widths)
        for h, width in enumerate(widths):
            if width != measurable_rank(log_E[0, h]) or width >= self.d:
                continue
            failed = 0
            for wider in range(width + 1, self.d + 1):
                head_grids, head_W = completed(log_E[:, h:h + 1], weights[:, h:h + 1], [wider])
                head = rotary_head(head_W[0, 0], head_W[1, 0], wider)
                if head.structure_error <= limit:
                    widths[h], grids[:, h], W[:, h], failed = wider, head_grids[:, 0], head_W[:, 0], 0
                else:
                    failed += 1
                    if failed == 2:
                        break
            if widths[h] > width:
                diagnostics["widened_heads"] = diagnostics.get("widened_heads", 0) + 1
        return widths, grids, W

    def learn(self, answers: np.ndarray, c: float, unit: float = FLOAT64_UNIT, channels=None, channels_c=None) -> tuple:
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
        usable = np.isfinite(tau).all(axis=1) & np.isfinite(label_x).all(axis=1)
        if not usable.any():
            return None, dict(diagnostics, no_start="no self instance fitted")
        # Head order: the reference is the final token whose self poles lie furthest apart (a self
        # instance's labels are split between nearly equal poles only as well as the answers allow:
        # on a trained float32 Llama layer 15% of the finals had two poles within 0.05 in log, their
        # labels 0.4 off). Each key token's labels are ordered by what its offset instances with the
        # reference imply, every final token's heads by the key labels over its offset instances,
        # then the keys again over all final tokens (a key ordered wrongly by the reference's two
        # instances alone is set right by the majority), and the final tokens once more.
        reference = reference_final(tau, usable)
        order = np.tile(np.arange(H), (n_final, 1))
        label_z = self._order_keys(key_labels, offset_P, offset_N, tau, label_x, order, [reference])
        for finals_used in (np.flatnonzero(usable), None):
            known_z = np.isfinite(label_z).all(axis=1)
            if known_z.sum() < d:
                return None, dict(diagnostics, no_start="fewer than d keys with labels")
            order = self._order_finals(label_z, known_z, offset_P, offset_N, tau, label_x, usable, reference)
            if finals_used is not None:
                label_z = self._order_keys(key_labels, offset_P, offset_N, tau, label_x, order, finals_used)
        if usable[0]:  # heads numbered in x_1's order: the numbering does not depend on the reference
            numbering = np.argsort(order[0])
            order, label_z = order[:, numbering], label_z[:, numbering]
        tau_ordered = np.take_along_axis(tau, order, axis=1)
        label_x_ordered = np.take_along_axis(label_x, order, axis=1)
        ordered = (offset_P, offset_N, tau_ordered, label_x_ordered, usable)
        # Each offset instance's poles assigned to the ordered heads by the key labels; then each
        # key's labels re-measured as the median of what its offset instances imply (a key
        # instance whose heads' poles nearly coincide fits those labels poorly), and assigned again.
        # With noisy log-scores (float32 answers, or float64 ones whose matching misfits say so) the
        # finals' labels too: a self instance's poles within 0.05 in log split its labels 0.4 off (a
        # trained Llama layer at d = 32, 15% of its finals), where exact float64 fits leave them accurate.
        log_E, implied_z, implied_x, first, limit = self._assign_poles(label_z, known_z, *ordered)
        first = first[np.isfinite(first)]
        noisy = unit > FIRST_LOOK_UNIT or (first.size > 0 and float(np.median(first)) > NOISY_MATCH)
        if noisy:  # the run seeds the slow blocks of such a start, float64 answers or not
            diagnostics.update(noisy_log_scores=True)
        label_z = _remeasured(label_z, implied_z.reshape(-1, n_key, H))
        if noisy:
            label_x_ordered = _remeasured(label_x_ordered, implied_x.transpose(0, 2, 1, 3).reshape(-1, n_final, H))
            ordered = (offset_P, offset_N, tau_ordered, label_x_ordered, usable)
        log_E, _, _, worst, limit = self._assign_poles(label_z, known_z, *ordered)
        misfits = worst[np.isfinite(worst)]
        worst_match = float(misfits[misfits <= limit].max(initial=0.0))
        # the rows and columns that held: keys with labels, finals with their self instance, each
        # with at least half its entries in every grid (a row of r entries or fewer is not
        # determined by the others, and one mostly missing is a token whose order went wrong)
        observed = np.isfinite(log_E)
        held_keys = known_z & (observed[..., usable].mean(axis=3) >= HELD).all(axis=(0, 1))
        held_finals = usable & (observed[:, :, known_z].mean(axis=2) >= HELD).all(axis=(0, 1))
        if noisy:  # a token ordered wrongly passes the limit within coarse misfits, but not as a whole
            mismatched_keys, mismatched_finals = mismatched_tokens(worst)
            held_keys, held_finals = held_keys & ~mismatched_keys, held_finals & ~mismatched_finals
            diagnostics.update(mismatched_keys=int(mismatched_keys.sum()),
                               mismatched_finals=int(mismatched_finals.sum()))
        rows, columns = np.flatnonzero(held_keys), np.flatnonzero(held_finals)
        augmented = np.vstack([self.finals, np.ones((1, n_final))]) if self.bias else self.finals
        diagnostics.update(dropped_keys=int(n_key - len(rows)), dropped_finals=int(n_final - len(columns)))
        if len(columns) < augmented.shape[0] or len(rows) < d:
            return None, dict(diagnostics, no_start="fewer tokens held than the assembly needs")
        all_weights = log_score_weights(log_E, tau_ordered, offset_P) if noisy else None
        diagnostics.update(match_misfit=worst_match, match_limit=limit,
                           match_quantiles=(np.quantile(misfits, [0.5, 0.9, 0.95, 0.99]).tolist()
                                            if misfits.size else []))
        for _ in range(2):  # a second pass without the tokens the first assembly shows as outliers
            assembled = self._assemble(log_E, all_weights, rows, columns, augmented, noisy, diagnostics)
            if assembled is None:
                return None, diagnostics
            W, widths, outlier_keys, outlier_finals = assembled
            if not (outlier_keys.size or outlier_finals.size):
                break
            diagnostics.update(outlier_keys=int(outlier_keys.size), outlier_finals=int(outlier_finals.size))
            rows, columns = np.setdiff1d(rows, outlier_keys), np.setdiff1d(columns, outlier_finals)
            if len(columns) < augmented.shape[0] or len(rows) < d:
                return None, dict(diagnostics, no_start="too few tokens beside the outliers")  # the run draws again
        else:
            return None, dict(diagnostics, no_start="outliers in the assembly again")
        # the values by least squares over the same tokens: Z_r^T v = l_z and X_c^T v = l_x
        finals_used = self.finals[:, columns]
        v = np.linalg.lstsq(np.hstack([self.keys[:, rows], finals_used]).T,
                            np.vstack([label_z[rows], label_x_ordered[columns]]), rcond=None)[0].T
        # a width the grids' rank search left at their full rank (no fall among the ranks it measures:
        # with noisy log-scores those whose fits leave a third of the entries free, r <= 7 of an
        # 18 x 19 grid at d = 12) is the widest at which the head holds the rotary form
        unmeasured = min(len(rows), len(columns))
        heads = [widest_rotary_head(W[0, h], W[1, h], structure_limit(noisy))
                 if not self.rank and widths[h] >= unmeasured else rotary_head(W[0, h], W[1, h], widths[h])
                 for h in range(H)]
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
