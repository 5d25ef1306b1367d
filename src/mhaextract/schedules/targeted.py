"""The targeted schedule: one head at a time, in float64 (docs/algorithm.md §13).

``extract(oracle, d, heads=H, schedule="targeted")``. Every measurement is a copies-instance
designed so that only one head is in the window of the copy counts; the others are saturated
towards ``x`` and contribute the constant ``v_g^T x``. Such an instance is single-pole,

    G(k) = vbar^T x - F(k) = k l_h / (k + tau_h),   tau_h = exp(a_h^T x),  a_h = W_h^T z,  l_h = v_h^T z,

and stays well conditioned whatever H is (the full ``2H + 1``-sample interpolation of the other
schedules loses about three digits per head). The head is known by construction: no matching.

**Design.** For a difference z the log-poles ``m_g = a_g^T x`` are H linear functionals of the
final token. With estimates of the ``a_g`` (H <= d) the instance ``n`` of head h solves

    a_h^T x = t_n in log 2 +- 2.5,   a_g^T x = s_{g,n} in [40, 100] (g != h),   null-space part free,

(``e^{-40}`` puts a saturated head's term ``k l_g / (k + tau_g)`` 1e-17 below its label). The
``(t, s, null part)`` of the d instances of ``(h, z)`` are the columns of a pattern with one
constant row and zero-sum orthogonal rows (:func:`_patterns`), so their final tokens span R^d
with a well-conditioned design. After each block of rounds the estimate of ``a_h`` is corrected to
fit the log-poles measured so far, when the prior's aim misses by more than ``AIM_TOLERANCE``
(the bridges: ``BRIDGE_AIM_TOLERANCE``; :class:`_MinimumNormCorrection`, :func:`correction_blocks`).
Samples ``k = 1, 2, 3`` with ``F(0) = vbar^T x`` known: two determine ``(l_h, tau_h)``, the third
tests that the instance really is single-pole (:mod:`.kernels.single_pole`). Finally the label of
``(h, z)`` is fixed at the consensus of its d instances and every ``m`` refitted with it; with the
label fixed two samples test the single-pole form already, so the float64 first group and every
final unit ask two (:func:`first_copies`, :class:`_FinalDesign`).

**Assembly.** The d measurements ``a_h^T x_n = m_n`` give ``a_h(z) = W_h^T z``; d differences
``z`` (the columns of an orthogonal ``Z_h`` times ``64 * token_scale``) give
``W_h = Z_h^{-T} [a_h(z_1) .. a_h(z_d)]^T`` and ``v_h = Z_h^{-T} l_h``.

**Where the estimates come from** (all measured, in this order):

1. ``vbar`` from d one-token queries (``f((b)) = vbar^T b``), so ``F(0)`` is known everywhere.
2. Group ``z_1``: heads located along lines (:mod:`.linesearch`): labels name the heads, rough
   ``a_h(z_1)`` from readings around each head's switch.
3. Group ``z_1`` measured with targeted instances (stage ``"first"``): precise ``a_h(z_1)``.
4. Bridges ``z_1 + eps z_j`` (eps a power of two, ``j = 2..d``): targeted with the precise
   ``a_g(z_1)``; the head is again known by construction and in the window, since
   ``eps a_h(z_j)^T x`` is small. The first instance of each head asks ``k = 1, 2`` (label and
   pole), the others ``k = 1`` with the label known (``d + 1`` queries per head).
   ``(a_h(z_1 + eps z_j) - a_h(z_1)) / eps`` estimates ``a_h(z_j)`` with the same head identity as
   in group ``z_1``: the bridges link the groups, and give rough ``W_h``, ``v_h`` (~1e-11).
5. Final (stage ``"final"``): each head in its own basis ``Z_h``, the Householder reflection that
   gives the rough ``v_h`` equal components in every column (:func:`_balanced_basis`): a z nearly
   orthogonal to ``v_h`` would make ``l_h`` small next to the oracle's rounding of ``v_h^T y``.
   The other heads' ``a_g(z) = W_g^T z`` come from the rough model; the basis is the candidate
   with the least predicted score rounding (:func:`_least_score_rounding`). The target's log-poles
   sit at both edges of its window, ``log 2 +- 4``, each side read at its best copy counts
   (:class:`_FinalDesign`, docs/algorithm.md §13, "The final instances"): what the d instances
   determine least well is the scale of ``a_h`` itself, and the spread of the target's log-poles
   is what fixes it.

Queries: ``d`` + phase 1 (about ``H (d + 15)`` plus line grids) + ``2 H d`` (first; ``3 H d`` on
answers noisier than float64, :func:`first_copies`) + ``(d + 1) H (d - 1)`` (bridges) + ``2 H d^2``
(final): about ``3 H d^2 + 2 H d``, 0.8 to 1.2 times the paper's ``4 H d^2 - 2 H + 1``. Every count reported is measured at the oracle boundary.

H > d is refused: the H conditions on x need H <= d (saturating some heads towards ``y``
instead would lift that, at one more unknown per instance; not implemented).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..checks.base import Check, heads_found_check
from ..model import MultiHeadAttention
from ..numerics import float64 as float64_kernel
from ..numerics import single_pole
from ..oracle.boundary import OracleBoundary
from ..oracle.queries import KeptQueries, RoundQueries, one_token_queries, quantize, random_basis
from .base import Outcome, Schedule, ScheduleDetails
from .linesearch import CENTER_COPIES, LineSearchReport, locate_heads

EPS = np.finfo(np.float64).eps
#: |z| of every group, in units of the token scale. Large |z| makes the pole term (~|z|) dominate
#: the saturated constant vbar^T x (~1/|z|, since |x| ~ s / |a_h| and |a_h| ~ |z|).
GROUP_SCALE = 64.0
#: Designed log-poles: the target head in TARGET_CENTER +- TARGET (tau near the copy counts
#: 1..3, where the three-sample fit is best conditioned), the others in MID +- SPREAD.
TARGET_CENTER, TARGET = float(np.log(2.0)), 2.5
#: The final stage (:class:`_FinalDesign`): the target head's log-poles at ``TARGET_CENTER`` and
#: ``TARGET_CENTER +- FINAL_TARGET`` (float64 answers; ``NOISY_FINAL_TARGET`` for noisier ones), each
#: side asked at the copy counts that read it best (``FINAL_SIDE_COPIES``: ``k = 1, 2`` where tau is
#: small and at the centre, ``k = 3, 4`` where it is large), the label fixed at the unit's consensus.
#: docs/algorithm.md §13, "The final instances".
FINAL_TARGET, NOISY_FINAL_TARGET = 4.0, 2.0
FINAL_SIDE_COPIES = {-1: (1, 2), 0: (1, 2), 1: (3, 4)}
SATURATION_MID, SATURATION_SPREAD = 70.0, 30.0
#: Groups (differences z_1) phase 1 searches at most while heads are missing (:func:`line_search`).
GROUP_ATTEMPTS = 4
#: Balanced bases tried per head in the final stage (:func:`_balanced_basis`), within BASIS_BYTES
#: of candidate design rows: ``BASIS_CANDIDATES`` at H = d, ``BASIS_CANDIDATES H / d`` but at least
#: ``FEWEST_CANDIDATES`` below (a null space of d - H dimensions leaves ``cond A(z)`` little to choose:
#: 4 rather than 16 candidates, 6 seeds each, moved the median error 2.30e-15 -> 2.38e-15 at d = 64,
#: H = 2, 5.1e-15 -> 5.6e-15 at d = 128, H = 2, 3.85e-15 -> 3.95e-15 at d = 96, H = 3, and cut the
#: learner by a tenth to a sixth there: the choice was 16% of it at d = 128, H = 2).
BASIS_CANDIDATES, FEWEST_CANDIDATES, BASIS_BYTES = 128, 4, 2**26
#: A head counts as saturated when its log-pole (from the final model) is at least this
#: (float64: e^-36 ~ 2^-52, below the answers' rounding; see :func:`saturation_margin`).
SATURATION_MARGIN = 36.0
#: The same for the first group's and the bridges' instances, which only aim the final stage
#: (:func:`prior_saturation_margin`).
PRIOR_SATURATION_MARGIN = 20.0
#: A final instance whose third sample misfits the single-pole form by more than this many
#: rounding units did not hold its saturation assumption.
RESIDUAL_LIMIT = 50.0
FINAL_COPIES = (1, 2, 3)
#: The first group's copy counts in float64 (:func:`first_copies`).
FIRST_COPIES = (1, 2)
#: The common checks' thresholds: relative parameter error expected, misfit of the answers.
ERROR_ESTIMATE_LIMIT, ANSWERS_RESIDUAL_LIMIT = 1e-8, 1e-9
#: Noisy answers: the score rounding taken as ``NOISY_SCORE_FACTOR unit |z| |W x|`` (float64: 8, a
#: bound) and the samples' modelled rounding scaled to the fits' residuals, at least by this.
NOISY_SCORE_FACTOR, NOISY_SAMPLE_FLOOR = 1.0, 1e-2
#: No answers' unit loosens the common limits beyond this (relative).
LOOSEST_LIMIT = 1e-2
#: Queries kept (evenly spaced, with their answers) for the ``answers_residual`` check; the others
#: are dropped once answered (docs/algorithm.md §13, "Memory").
RESIDUAL_SAMPLE = 4096
#: Working memory of one chunk of units in :func:`_measure` (three (units, d, d) float64 arrays).
CHUNK_BYTES = 2**28
#: A stage whose final tokens take at most this many bytes keeps them, and its instances' margins
#: are then computed exactly rather than bounded (:func:`_diagnostics`).
KEEP_BYTES = 2**24
#: Design patterns drawn per random orthogonal base (:func:`_patterns`: shuffled rows and rounds).
PATTERN_SHARING = 32
#: Rounds designed from one estimate of the target at most (:func:`correction_blocks`).
CORRECTION_BLOCK = 16
#: Misfits of a stage's aim (log-pole units) below which its estimates are not corrected at all
#: (:meth:`_MinimumNormCorrection.aim`): the final stage's sides at ``log 2 +- 4`` do not feel it.
AIM_TOLERANCE = 1e-3
#: The bridges' tolerance (log-pole units): their misfits come from the bridge step itself
#: (``eps |a_h| |x| <= 2``, :func:`_bridge_step`; 0.1..0.7 at most, measured), and a one-sample
#: reading's error grows only as ``e^misfit`` at the window's edge, less than the corrections'
#: Gram-Schmidt costs; beyond it (a prior far off) they are corrected as the other stages are.
BRIDGE_AIM_TOLERANCE = 1.0
#: Bases of this many bytes (a block of units) are orthogonalised against together, in cache.
GRAM_SCHMIDT_BYTES = 2**20
#: A row that keeps less than this share of its norm off the basis is orthogonalised a second time
#: (:class:`_MinimumNormCorrection`): one pass leaves it orthogonal to about ``eps / share``.
REORTHOGONALISE = 1e-3


def score_unit(settings, stats=None) -> float:
    """The relative rounding unit of the oracle's own arithmetic, which rounds its scores too:
    ``EPS`` for float64, else the larger of the rounding the calibration measured
    (``settings.arithmetic_noise``: not noise added at random to the outputs, which leaves the
    scores exact, docs/algorithm.md §19) and the unit roundoff the answers' bits show (``stats``, an
    :class:`~mhaextract.oracle.answer_stats.AnswerStats`; free, so a run without calibration
    still recognises float32 answers). A declared ``answer_error`` is not part of it: it bounds
    the answers' total error, score rounding included, and says nothing of a score's rounding
    growing with ``|z| |W x|`` (seed 57 of the reliability table, d = H = 4, declared 1e-8: the
    score term sized by the declared error overstated the estimate 1e2..1e4 times)."""
    unit = EPS
    if settings.arithmetic_noise is not None:
        unit = max(unit, float(settings.arithmetic_noise))
    if stats is not None and stats.precision_name != "float64":
        unit = max(unit, stats.unit_roundoff)
    return unit


def answer_unit(settings, stats=None) -> float:
    """The answers' relative rounding unit that sizes the run's tolerances (docs/algorithm.md §19):
    :func:`score_unit`, the answer noise the calibration measured (``settings.answer_noise``), or a
    declared ``answer_error`` over the largest answer, whichever is largest."""
    unit = score_unit(settings, stats)
    if settings.answer_noise is not None:
        unit = max(unit, float(settings.answer_noise))
    if settings.answer_error is not None and stats is not None and stats.largest > 0:
        # a declared absolute bound, relative to the largest answer seen so far
        unit = max(unit, float(settings.answer_error) / stats.largest)
    return unit


def saturation_margin(unit: float) -> float:
    """The log-pole beyond which a head is saturated for answers of relative unit ``unit``: its
    weight ``e^-margin`` left on the other token is below the answers' error, as ``SATURATION_MARGIN``
    is at float64 (``36 - ln(unit / EPS)``: 19.3 at unit 4e-9, 23.5 at float32's 2^-24). A final
    instance at margin 34.2 under declared noise 1e-8 failed the float64 margin while its unsaturated
    head moved its answer by 1e-15 of the 1e-8 the noise did."""
    return SATURATION_MARGIN - float(np.log(max(unit, EPS) / EPS))


def prior_saturation_margin(unit: float) -> float:
    """The margin the first group's and the bridges' instances must keep: ``PRIOR_SATURATION_MARGIN``
    (20, ``e^-20 ~ 2e-9``), or :func:`saturation_margin` where that is lower (noisier answers).

    Those instances only aim the final stage (their ``a`` and labels are its design's prior; the
    model comes from the final instances alone, which keep :func:`saturation_margin`), so a head
    left at log-pole 20..36 there perturbs a prior by ``e^-margin`` relative, far below the
    ``AIM_TOLERANCE = 1e-3`` the final stage's aim is checked to. Phase 1's rough estimates can miss
    the first group's saturated rows by ~9 log-pole units (d = 64, H = 8, bench_scale target seed 1,
    extraction seed 1: margins down to 31.0 instead of the planned 40, model error 1.9e-15, and the
    run failed ``saturation``: a false alarm). A head near the window (a missed head, a prior far
    off) is still caught: margins near 0 and misfitting samples."""
    return min(PRIOR_SATURATION_MARGIN, saturation_margin(unit))


def agreement_tolerance(unit: float) -> float:
    """A bridge's log-pole must agree with the final model to this (1e-6 at float64 rounding)."""
    return max(1e-6, 1e4 * unit)


def limits(unit: float) -> tuple[float, float]:
    """``(error_estimate, answers_residual)`` limits: the float64 ones, or sized to the answers' unit
    (the answers misfit even the true model by up to ~1e3 units: scores of order 1e3 rounded), and
    never above ``LOOSEST_LIMIT`` (a model off by more is no extraction)."""
    # The answers' misfit gets 3e4 units: a real float32 layer (GPT-2, token scale ~65) rounds the
    # scores of phase 1's tokens (|x| ~ 16 token scales, |z| 64) by ~1e-3 in m, 1.2e4 units of the
    # largest answer (docs/algorithm.md §19, "Real float32 layers"); float64 limits are unchanged.
    return (max(ERROR_ESTIMATE_LIMIT, min(1e4 * unit, LOOSEST_LIMIT)),
            max(ANSWERS_RESIDUAL_LIMIT, min(3e4 * unit, LOOSEST_LIMIT)))


@dataclass
class TargetedInstances:
    """Per-instance diagnostics of a targeted run (arrays indexed by instance, query order).

    Attributes
    ----------
    stage : ``"first"`` (group ``z_1``, three samples), ``"bridge"`` (groups ``z_1 + eps z_j``, one
        or two samples) or ``"final"`` (each head's own basis, three samples in a unit's first
        instance and two in the others; these alone make the model).
    group : which difference: j of ``z_1 + eps z_j`` for bridges (1-based j >= 1 as ``group + 1``),
        the column of the head's basis for final instances, 0 for the first group.
    head : the head the instance was designed for (index into the extracted model).
    log_pole, label : measured ``m_h`` and ``l_h`` (label NaN for one-sample bridge readings).
    designed : the log-pole the design aimed at (``t``).
    residual : misfit of the third sample to the single-pole form, in rounding units (final
        instances; NaN for bridges).
    margin : smallest log-pole of the other heads at this instance, from the extracted model.
    saturated : the instance held its assumption: margin >= :func:`saturation_margin` (final
        instances; the first group's and the bridges', which only aim the final stage:
        :func:`prior_saturation_margin`) and residual <= ``RESIDUAL_LIMIT`` (first group and final
        instances); for bridges the measured log-pole agrees with the extracted model to 1e-6.
    """

    stage: np.ndarray
    group: np.ndarray
    head: np.ndarray
    log_pole: np.ndarray
    label: np.ndarray
    designed: np.ndarray
    residual: np.ndarray
    margin: np.ndarray
    saturated: np.ndarray

    @property
    def unsaturated(self) -> np.ndarray:
        """Indices of the instances whose saturation assumption did not hold."""
        return np.flatnonzero(~self.saturated)


@dataclass
class TargetedDetails(ScheduleDetails):
    """``Extraction.details`` of the targeted schedule.

    Attributes
    ----------
    instances : TargetedInstances, one entry per targeted instance (first group, bridges, final).
    phase1 : :class:`~mhaextract.schedules.linesearch.LineSearchReport` of the line search in group
        ``z_1`` (lines drawn, centres accepted and rejected, the heads found with their rough estimates).
    """

    instances: TargetedInstances
    phase1: LineSearchReport

    def summary(self) -> dict:
        return {"phase1_lines": self.phase1.lines, "unsaturated": int(len(self.instances.unsaturated))}

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"instances_{name}": np.asarray(values, dtype=str if name == "stage" else None)
                for name, values in vars(self.instances).items()}


class _Prober:
    """Asks copies-instances through the boundary; keeps every answer and a bounded sample of the
    queries (docs/algorithm.md §13, "Memory").

    The queries are built per batch from ``(final, difference, k)`` and dropped once answered:
    only every ``stride``-th one is kept (with its answer) for the ``answers_residual`` check, so
    memory grows with the answers (one float each), not with all queries x length x d.
    """

    def __init__(self, boundary: OracleBoundary, d: int, token_scale: float, expected_queries: int = 0):
        self.boundary = boundary
        #: The answers' relative rounding unit every tolerance is sized by (:func:`answer_unit`; set
        #: by the schedule once the one-token answers are in), and the oracle's own (:func:`score_unit`).
        self.unit = self.score_unit = EPS
        self.d = d
        self.token_scale = token_scale
        # One exact grid for every token of the run: sums and differences of tokens stay exact.
        self.grid_scale = 4 * GROUP_SCALE * token_scale
        self.stride = max(1, int(expected_queries) // RESIDUAL_SAMPLE)
        self.asked = 0
        self.sequences = KeptQueries()
        self.answers: list[float] = []
        self.vbar: np.ndarray | None = None

    def quantize(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return quantize(values, self.grid_scale, out)

    def ask(self, sequences, description):
        answers = np.asarray(self.boundary.ask(sequences, description=description), dtype=np.float64)
        first_pick = (-self.asked) % self.stride  # every stride-th query of the run
        self.sequences.keep(sequences, range(first_pick, len(sequences), self.stride))
        self.answers.extend(answers[first_pick::self.stride].tolist())
        self.asked += len(sequences)
        return answers

    def learn_vbar(self, basis: np.ndarray) -> None:
        """``vbar`` from the one-token answers ``f((b_i)) = vbar^T b_i`` on a basis (columns)."""
        answers = self.ask(one_token_queries(basis), "one-token queries (vbar)")
        self.vbar = float64_kernel.solve_transposed(basis, answers)

    def gaps(self, finals: np.ndarray, differences: np.ndarray, copies, description="targeted instances"):
        """``G(k) = vbar^T x - F(k)`` for each row (x, z) and each k in ``copies`` (n, K); and the
        rounding scale of each sample (the magnitudes the subtraction cancels), (n, K)."""
        return self.rounds_gaps(finals[:, None], differences, [copies], description)[0]

    def rounds_gaps(self, finals: np.ndarray, differences: np.ndarray, copies, description="targeted instances"):
        """:meth:`gaps` for R rounds asked at once: ``finals`` (n, R, d) (round r's final token of
        each row), ``differences`` (n, d), ``copies`` R tuples (round r's copy counts). One ask of
        :class:`~mhaextract.oracle.queries.RoundQueries` (round by round, k by k, row by row: the
        order in which the rounds were asked one by one). Returns R pairs ``(gaps, rounding)``."""
        answers = self.ask(RoundQueries(finals, differences, copies), description)
        labels_scale = np.abs(differences) @ np.abs(self.vbar)
        out, start = [], 0
        for n, ks in enumerate(copies):
            n_answers = answers[start:start + len(ks) * len(finals)].reshape(len(ks), len(finals)).T
            start += len(ks) * len(finals)
            x = finals[:, n]
            anchor = x @ self.vbar
            rounding = self.systematic(x)[:, None] + 4 * self.unit * (np.abs(n_answers) + labels_scale[:, None])
            out.append((anchor[:, None] - n_answers, rounding))
        return out

    def systematic(self, finals: np.ndarray) -> np.ndarray:
        """The part of :meth:`gaps`' rounding scale common to every sample of an instance: the
        anchor ``vbar^T x`` (its error is vbar's, from the one-token answers, times x). The
        three-sample fits' residuals cannot show it, so noisy runs do not scale it by them."""
        return 4 * self.unit * np.abs(finals @ self.vbar)


class _NullSpace:
    """The null space of each unit's initial estimates E (U, H, d): ``N0`` (d, d - H), the last d - H
    columns of the complete Q of ``E^T = Q R`` (one batched Householder QR per unit, not per
    instance), kept in its compact WY form ``Q = I - V T V^T`` (V: the H reflectors (U, d, H), T: H x H
    upper triangular), so that ``N0 p = (0, p) - V T V_2^T p`` costs 4 H d flops a column instead of
    the 2 d (d - H) of a product with N0 formed, and no (U, d, d) array is ever held (with a full SVD
    and the null parts of all rounds formed at once, they were a twelfth of the targeted learner
    at d = 128, H = 8). Vectors are rows, as the tokens are: ``(N0 p)^T = (0, p^T) - p^T V_2 T^T V^T``
    for a block's rows ``p^T`` (in columns, the additions ran over b entries at a time, 1.2..2.5 x
    slower)."""

    def __init__(self, estimates: np.ndarray):
        h, tau = np.linalg.qr(estimates.transpose(0, 2, 1), mode="raw")  # reflectors as rows of h (U, H, d)
        U, H, _ = h.shape
        self.heads = H
        self._workspace: np.ndarray | None = None  # (:meth:`workspace`)
        self.V = np.tril(h.transpose(0, 2, 1), -1)  # v_i = e_i + the part of h below the diagonal
        self.V[:, np.arange(H), np.arange(H)] = 1.0
        self.T = np.zeros((U, H, H))  # Q = H_1 .. H_H = I - V T V^T (LAPACK's dlarft, forward, columnwise)
        for i in range(H):
            self.T[:, i, i] = tau[:, i]
            if i:
                inner = np.matmul(self.V[:, :, :i].transpose(0, 2, 1), self.V[:, :, i:i + 1])
                self.T[:, :i, i] = -tau[:, i, None] * np.matmul(self.T[:, :i, :i], inner)[:, :, 0]

    def apply(self, rows: np.ndarray, part: slice = slice(None), out: np.ndarray | None = None) -> np.ndarray:
        """``(N0 p)^T`` (U, n, d) for the rows ``p^T`` (U, n, d - H) of the units ``part``, written into
        ``out`` (any strides) when given: ``-(p^T V_2 T^T) V^T`` is written, then ``p^T`` added from
        column H on (no (U, n, d) temporary)."""
        H, V = self.heads, self.V[part]
        reflected = np.matmul(np.matmul(rows, V[:, H:]), self.T[part].transpose(0, 2, 1))  # (U, n, H)
        out = np.matmul(np.negative(reflected, out=reflected), V.transpose(0, 2, 1), out=out)
        out[:, :, H:] += rows
        return out

    def parts(self, rows: np.ndarray, scale: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """``(SPREAD N0 p / c)^T`` (U, n, d) for pattern rows ``p^T`` (U, n, d - H) (a block's rounds)
        and each unit's ``scale`` c (U,; 1 when not given): the null parts :func:`_designs` adds;
        written into ``out`` if given."""
        out = self.apply(rows, out=out)
        out *= SATURATION_SPREAD if scale is None else (SATURATION_SPREAD / scale)[:, None, None]
        return out

    def workspace(self, block: slice) -> np.ndarray:
        """An array (U, b, d) for :meth:`parts` of a block of b rounds: a view of one array made
        for the first (largest, :func:`correction_blocks`) block and reused by the later ones."""
        size = block.stop - block.start
        if self._workspace is None or self._workspace.shape[1] < size:
            self._workspace = np.empty((self.V.shape[0], size, self.V.shape[1]))
        return self._workspace[:, :size]


def _other_heads_frame(current: np.ndarray, heads: np.ndarray):
    """What :func:`_designs` needs of the rows that stay fixed over a unit's rounds, the other heads'
    estimates ``O`` (the rows of ``current`` (U, H, d) but the target ``heads[u]``), from one batched
    QR ``O^T = Q_o R_o`` per unit (not per round): ``Q_o^T`` (U, H - 1, d), the map
    ``(O^+)^T = R_o^{-1} Q_o^T`` (U, H - 1, d), the other heads' indices (U, H - 1), ascending, and
    the scale ``c`` of the null part, the mean singular value of all H estimates ``E`` (U,) as they
    are here: the corrections of the target's row move it by their relative size only, and ``c``
    merely sizes the null part (an SVD per round cost a twentieth of the low-rank learner).
    (Stored as rows: the per-round products with one vector per unit run ~2x faster so.)"""
    U, H, _ = current.shape
    units = np.arange(U)
    slots = np.arange(H - 1)[None, :]
    others = slots + (slots >= heads[:, None])  # the heads f != h, ascending
    q, r = np.linalg.qr(current[units[:, None], others].transpose(0, 2, 1))
    rows = np.ascontiguousarray(q.transpose(0, 2, 1))
    scale = np.linalg.svd(current, compute_uv=False).mean(axis=1)
    return rows, np.matmul(np.linalg.inv(r), rows), others, scale


def _designs(current: np.ndarray, heads: np.ndarray, columns: np.ndarray, null_part: np.ndarray,
             frame=None, halfwidth: float = TARGET, out: np.ndarray | None = None) -> np.ndarray:
    """The final tokens of a block of b rounds for U units at once (U, b, d), written into ``out``
    (any strides) when given.

    Unit u aims head ``heads[u]`` at log-pole ``TARGET_CENTER + halfwidth p_h`` and the others at
    ``MID + SPREAD p_g`` (by its estimates ``current[u]`` (H, d); ``columns[u]`` (H, b) the pattern
    columns of the rounds), and adds the null-space part: ``x = E^+ u + (I - P_E) b`` with ``b``
    the unit's ``null_part`` (b, d), ``(SPREAD N0 p / c)^T`` (:meth:`_NullSpace.parts`; ``c`` the mean
    singular value of E at the frame's estimates). While the estimates are the initial ones this is
    the square design ``[E; c N0] x = values``; once the target row was corrected the projection
    keeps the null part exactly off every head.

    Only the target's row t changes between blocks: ``frame`` (:func:`_other_heads_frame`, of the
    other rows O, computed here when not given) is extended by t's part ``size * unit`` off O's span
    (classical Gram-Schmidt, twice), and ``E^+ u = O^+ u_O + unit (u_t - t^T O^+ u_O) / size``: no
    factorisation nor solve per block (the same x as a QR of E to rounding). The b rounds of a
    block share t (:func:`correction_blocks`), so every term but ``b`` is a combination of the same
    ``2H - 1`` rows ``(O^+)^T``, ``unit``, ``Q_o``: ``x = C R + b``, with b's projection read off one
    product of the null parts with ``(Q_o, unit)``. The tokens are written once (the terms formed
    and added one by one passed over a block's (U, b, d) tokens a dozen times, memory-bound: a
    sixth of the learner at d = 256, H = 2)."""
    U, H, d = current.shape
    units = np.arange(U)
    q_rows, pseudo_inverse_rows, others, scale = frame if frame is not None else _other_heads_frame(current, heads)

    def along_rows(vectors):  # Q_o^T v for each of the block's vectors (U, b, d) -> (U, b, H - 1)
        return np.matmul(vectors, q_rows.transpose(0, 2, 1))

    def spanned(coefficients):  # Q_o c, (U, b, H - 1) -> (U, b, d)
        return np.matmul(coefficients, q_rows)

    target = current[units, heads][:, None, :]  # (U, 1, d)
    rest = target - spanned(along_rows(target))
    rest -= spanned(along_rows(rest))
    size = np.linalg.norm(rest, axis=2)  # (U, 1)
    if (size == 0).any():  # E singular: what the solve with a QR of E per round raised
        raise np.linalg.LinAlgError("Singular matrix")
    unit = rest / size[:, :, None]
    values = SATURATION_MID + SATURATION_SPREAD * columns[units[:, None], others]  # (U, H - 1, b)
    # O^+ u_O is values^T (O^+)^T: nothing along t; its log-pole for t, t^T O^+ u_O, from (O^+)^T t
    base_target = np.matmul(values.transpose(0, 2, 1), np.matmul(pseudo_inverse_rows, target[:, 0, :, None]))[:, :, 0]
    along = (TARGET_CENTER + halfwidth * columns[units, heads] - base_target) / size  # (U, b)
    free = null_part  # (U, b, d)
    rows = np.concatenate([pseudo_inverse_rows, unit, q_rows], axis=1)  # (U, 2H - 1, d)
    off = np.matmul(free, rows[:, H - 1:].transpose(0, 2, 1))  # b's parts along unit and Q_o (U, b, H)
    coefficients = np.concatenate([values.transpose(0, 2, 1), (along - off[:, :, 0])[:, :, None], -off[:, :, 1:]],
                                  axis=2)
    x = np.matmul(coefficients, rows, out=out)
    x += free
    return x


def correction_blocks(rounds: int, most: int = CORRECTION_BLOCK, correcting=lambda: True):
    """The blocks of rounds designed from one estimate (:class:`_MinimumNormCorrection`), as slices,
    each one made when the previous block is done (a generator): while ``correcting()`` says the
    estimate is being corrected, at most ``most`` rounds and at most a quarter of the rounds left, so
    the estimate a block is designed from fits all but a fifth of the rounds its successor fits (the
    correction's effect on a round's aim grows with the rounds it has seen: the last rounds are
    corrected one by one). Before any correction the prior aims within the tolerance and every
    block is designed from that same prior: the blocks then double from ``most`` up to
    ``CORRECTION_BLOCK`` rounds, whatever is left (the same tokens as the blocks above whenever no
    correction follows, in fewer and larger asks: the final stage and the bridges in float64, and
    the first group when phase 1's prior aims it well; a block that finds the aim off starts the
    corrections, and the blocks after it shrink as above)."""
    start, size = 0, 0
    while start < rounds:
        if correcting():
            size = max(1, min(most, (rounds - start) // 4))
        else:
            size = min(max(most, 2 * size), max(most, CORRECTION_BLOCK), rounds - start)
        yield slice(start, start + size)
        start += size


class _MinimumNormCorrection:
    """The minimum-norm change of each unit's target estimate that fits its log-poles so far,
    ``delta = X^+ (m - X a_prior)`` (X: the finite rows), updated by one block Gram-Schmidt step per
    block of rounds instead of a least-squares solve from scratch (same solution to rounding).

    A block's b rows are projected off the earlier basis in one batched matrix product (each unit's
    basis read from memory once per block, not once per round: the per-round update was the largest
    single cost of the targeted learner, memory-bound), then orthogonalised among themselves. One
    classical Gram-Schmidt pass leaves a new basis vector orthogonal to the others to about
    ``eps |x| / |q|`` (q: the row's part off the basis); the designs of §13 keep ``|q| / |x|`` above
    0.07 (measured: targeted d = 64, low-rank d = 192), so a second pass, which would double the
    cost, is made only for rows below ``REORTHOGONALISE`` (degenerate designs, repeated rows). The
    correction only aims the next blocks' designs: ``a`` itself is solved from all rounds at the
    end (:func:`_reduce_chunk`)."""

    def __init__(self, units: int, d: int, tolerance: float = AIM_TOLERANCE):
        self.units, self.d = units, d
        self.tolerance = tolerance  # the misfits below which nothing is corrected (:meth:`aim`)
        #: orthonormal rows: the rows of X added so far, orthogonalised; (units, d, d), allocated by the
        #: first :meth:`add` (a stage its prior aims well, the final one in float64, never needs it)
        self.basis: np.ndarray | None = None
        self.coefficients = np.zeros((units, d))
        self.delta = np.zeros((units, d))
        self.added = 0  # rows 0 .. added - 1 are in the basis
        self.waiting: list[np.ndarray] = []  # the rows asked since, (U, b, d) blocks in order (aim)
        #: an array (units, d, d) the basis may be written into (a previous chunk's, :func:`_measure`):
        #: rows are written before they are read, so none needs clearing
        self.spare: np.ndarray | None = None

    def aim(self, n: int, rows: np.ndarray, misses: np.ndarray) -> np.ndarray:
        """Rows ``n .. n + b - 1`` (U, b, d) and their misfits (U, b), for aiming: while every misfit
        so far is within :attr:`tolerance` (log-pole units) the prior aims well enough and nothing is
        computed (the rows wait, as the caller's arrays, which must not change); from the first block
        beyond it on, every waiting row is added (:meth:`add`). Returns delta (zero while nothing was
        added)."""
        b = rows.shape[1]
        self.coefficients[:, n:n + b] = misses
        self.waiting.append(rows)
        finite = np.abs(misses[np.isfinite(misses)])
        if self.added or (finite.size and finite.max() > self.tolerance):
            start = self.added
            self.added = n + b
            waiting = self.waiting[0] if len(self.waiting) == 1 else np.concatenate(self.waiting, axis=1)
            self.waiting = []
            return self.add(start, waiting, self.coefficients[:, start:n + b].copy())
        return self.delta

    def add(self, n: int, rows: np.ndarray, misses: np.ndarray) -> np.ndarray:
        """Add rows ``n .. n + b - 1`` (U, b, d) with their misfits (U, b) (NaN: not measured,
        skipped); returns delta."""
        U, b, d = rows.shape
        if self.basis is None:
            self.basis = np.empty((self.units, self.d, self.d)) if self.spare is None else self.spare
        overlap = np.empty((U, b, n))
        q = np.array(rows, dtype=np.float64)
        # Blocks of units whose bases fit the cache: the products below read each block once
        # from memory, not twice. The basis vectors are stored as rows: each unit's (n, d)
        # block is contiguous (as columns the products ran ~1.3x slower).
        step = max(1, GRAM_SCHMIDT_BYTES // max(1, 8 * d * n))
        for start in range(0, U, step) if n else ():
            part = slice(start, start + step)
            basis = self.basis[part, :n]
            overlap[part] = np.matmul(rows[part], basis.transpose(0, 2, 1))  # (units, b, n)
            q[part] -= np.matmul(overlap[part], basis)
        for j in range(b):  # the block's rows among themselves, in order
            k = n + j
            ok = np.isfinite(misses[:, j])
            size = np.linalg.norm(rows[:, j], axis=1)
            inner = np.einsum("ukd,ud->uk", self.basis[:, n:k], q[:, j])
            q[:, j] -= np.einsum("uk,ukd->ud", inner, self.basis[:, n:k])
            rho = np.linalg.norm(q[:, j], axis=1)
            again = np.flatnonzero(rho < REORTHOGONALISE * size)
            if again.size:  # classical Gram-Schmidt, twice
                basis = self.basis[again, :k]
                second = np.matmul(basis, q[again, j, :, None])[:, :, 0]
                q[again, j] -= np.matmul(second[:, None, :], basis)[:, 0]
                overlap[again, j] += second[:, :n]
                inner[again] += second[:, n:]
                rho[again] = np.linalg.norm(q[again, j], axis=1)
            ok &= rho > 1e-12 * size
            safe = np.where(ok, rho, 1.0)
            self.basis[:, k] = np.where(ok[:, None], q[:, j] / safe[:, None], 0.0)
            fitted = (np.einsum("un,un->u", overlap[:, j], self.coefficients[:, :n])
                      + np.einsum("uk,uk->u", inner, self.coefficients[:, n:k]))
            self.coefficients[:, k] = np.where(ok, (np.nan_to_num(misses[:, j]) - fitted) / safe, 0.0)
        self.delta += np.einsum("ub,ubd->ud", self.coefficients[:, n:n + b], self.basis[:, n:n + b])
        return self.delta


def _patterns(rng, d: int, constant_row: int, count: int, target_row: int | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """``count`` design patterns (count, d, d), entries in [-1, 1]: row ``constant_row`` all ones,
    the other rows random, mutually orthogonal and orthogonal to the ones (zero sums).

    The log-poles of the design are ``offset + halfwidth * pattern`` row by row, with a large offset
    (``SATURATION_MID``) on the saturated rows. With zero-sum rows the offsets of all rows are
    carried by the one constant row, so the design matrix is a triangular (well-conditioned)
    transform of orthogonal rows; random rows would let the offset nearly cancel a combination
    of the variations for some draws and make the d final tokens nearly dependent.

    ``target_row`` (the final stage's patterns, :class:`_FinalDesign`): that row is
    :func:`final_sides` (every entry +-1 but a 0 for odd d, zero sum) in every pattern, and the
    other rows, random, are orthogonal to it as well.

    One batched QR draws ``ceil(count / PATTERN_SHARING)`` base patterns (random orthogonal rows);
    each pattern is a base with its random rows shuffled among themselves and their signs drawn,
    which keeps every property above exactly. (The rounds are not permuted: the base's random rows
    are the QR of Gaussian columns, whose law a permutation of the rounds within a side leaves as
    it is. Permuting them per pattern was an element-by-element gather, more than half of the
    patterns' time; the QRs, a sixth of the targeted learner's time at d = 128, H = 8 when every
    pattern had its own, cost a thirty-second.) ``out`` (count, d, d), any strides: written in place
    (a stage reuses one array for all its chunks, :func:`_measure`).
    """
    bases = -(-count // PATTERN_SHARING)
    gaussian = rng.standard_normal((bases, d, d))
    gaussian[:, :, 0] = 1.0  # Gram-Schmidt (QR) with the ones first: the others come out orthogonal to it
    fixed = [constant_row]
    sides = None
    if target_row is not None and target_row != constant_row and d > 1:
        sides = final_sides(d).astype(np.float64)
        fixed = [constant_row, target_row]
        gaussian[:, :, 1] = sides  # zero sum: the QR keeps its direction
    free = [row for row in range(d) if row not in fixed]
    q, _ = np.linalg.qr(gaussian)
    base = np.empty((bases, d, d))
    base[:, fixed + free] = q.transpose(0, 2, 1)
    base /= np.maximum(base.max(axis=2, keepdims=True), -base.min(axis=2, keepdims=True))  # max |.|, no |rows| copy
    if sides is not None:
        base[:, target_row] = sides  # exactly (the QR gives it to rounding, up to sign)
    row_order = np.empty((count, d), dtype=int)
    row_order[:, fixed] = fixed
    row_order[:, free] = rng.permuted(np.broadcast_to(np.array(free, dtype=int), (count, len(free))), axis=1)
    signs = rng.choice([-1.0, 1.0], size=(count, d, 1))
    signs[:, fixed] = 1.0
    picks = rng.integers(bases, size=count)
    # whole rows gathered; the indices are in range, so any mode gives the same rows: "raise" would
    # buffer a copy, and "wrap" takes a modulo per index (9x slower than "clip" at d = 256, H = 2, rank
    # 128: 0.35 s of the bridges' 1.5 s learner under cProfile, 4% of the whole run measured without)
    out = np.take(base.reshape(-1, d), picks[:, None] * d + row_order, axis=0, out=out, mode="clip")
    out *= signs
    return out


def _patterns_per_head(rng, d: int, groups: int, constant_rows, target_rows=None,
                       out: np.ndarray | None = None) -> np.ndarray:
    """(groups, H, d, d): head h's ``groups`` patterns from :func:`_patterns` with constant row
    ``constant_rows[h]`` (and target row ``target_rows[h]``), drawn head by head; written into
    ``out`` when given (a stage's reused array, :func:`_measure`)."""
    H = len(constant_rows)
    out = np.empty((groups, H, d, d)) if out is None else out
    for h in range(H):
        _patterns(rng, d, constant_rows[h], groups, None if target_rows is None else target_rows[h], out=out[:, h])
    return out


def final_sides(rounds: int) -> np.ndarray:
    """The target's side in each round of a final unit (:class:`_FinalDesign`): ``0, -1, +1, -1, ..``
    for odd ``rounds`` (the centre first), ``-1, +1, -1, ..`` for even ones; zero sum.

    What a unit's instances determine least well is ``a_h``'s own scale: with the target's
    log-poles ``TARGET_CENTER + T p_n`` the error of ``a_h(z)`` along itself is
    ``p^T dm / (T |p|^2)`` for log-pole errors dm (the other heads' rows vary by
    ``SATURATION_SPREAD``, 12 times more). Entries +-1 give ``|p|^2 = rounds`` (or ``rounds - 1``),
    the most for entries in [-1, 1] (a random row scaled to max 1: about 3 at 9 rounds)."""
    sides = np.array([-((-1) ** n) for n in range(rounds)], dtype=int)  # -1, +1, -1, ..
    return np.concatenate([[0], sides[:-1]]) if rounds % 2 else sides


@dataclass
class _GroupMeasurements:
    """All instances of some units (g, h): head h with difference ``differences[g, h]``, d rounds each.
    Arrays (G, H, d rounds) unless noted. The final tokens themselves are not kept (memory): what
    the checks need of them is reduced per chunk of units (``a``, ``misfit``, ``margin``, ``x_norm``)."""

    differences: np.ndarray  # (G, H, d)
    estimates: np.ndarray  # (G, H, H, d) the a_f of every head used for the design (the target's before correction)
    log_pole: np.ndarray
    label: np.ndarray
    designed: np.ndarray
    residual: np.ndarray
    sigma_m: np.ndarray
    sigma_l: np.ndarray
    gaps: np.ndarray  # (G, H, d, K) the samples G(k) (NaN where not asked)
    rounding: np.ndarray  # (G, H, d, K) their rounding scales
    ks: np.ndarray  # (G, H, d, K) their copy counts (NaN where not asked)
    a: np.ndarray  # (G, H, d) a_h(z) solved from the d log-poles (NaN unless all finite)
    misfit: np.ndarray  # |m_n - a^T x_n|
    margin: np.ndarray  # smallest other head's log-pole by the design estimates
    x_norm: np.ndarray  # |x_n|
    #: (G, H, D, 2) the first-order variance of each coordinate i of the solved ``a`` (D = d, or d + 1
    #: lifted), ``sum_n (X^{-1})_{in}^2 sigma_n^2`` (final stage; NaN otherwise): [..., 0] every
    #: term, [..., 1] the part that does not grow with answer noise: the oracle's score rounding, and a
    #: subspace unit's basis term, sized to the noise measured (:meth:`_SubspaceDesign.basis_variance`)
    variance: np.ndarray
    #: (G, H) the consensus label's error with the samples' errors scaled as in ``variance`` (final
    #: stage; NaN otherwise)
    label_error: np.ndarray
    finals: np.ndarray | None = None  # (G, H, d, d) the final tokens, kept only when small (KEEP_BYTES)

    @property
    def error_squared(self) -> np.ndarray:
        """(G, H, 2) ``|X^{-1} diag(sigma)|_F^2``: :attr:`variance` summed over the coordinates."""
        return self.variance.sum(axis=2)

    def consensus_labels(self, sigma_scale=1.0) -> tuple[np.ndarray, np.ndarray]:
        """Inverse-variance mean of the labels of each (group, head) over its instances, and its
        error; ``sigma_scale`` (broadcast to (G, H, rounds)) scales the instances' label errors."""
        weights = np.where(np.isfinite(self.label), 1.0 / np.maximum(sigma_scale * self.sigma_l, 1e-300) ** 2, 0.0)
        total = np.maximum(weights.sum(axis=2), 1e-300)
        return (np.nan_to_num(self.label) * weights).sum(axis=2) / total, 1.0 / np.sqrt(total)

    def refit_with_consensus_labels(self) -> None:
        """Final groups: each instance's ``m`` again, now with its label fixed at the consensus."""
        labels, _ = self.consensus_labels()
        G, H, rounds, K = self.gaps.shape
        m, sigma, spread = single_pole.log_pole_given_label(
            self.gaps.reshape(-1, K), self.ks.reshape(-1, K), self.rounding.reshape(-1, K),
            np.repeat(labels.ravel(), rounds), misfit=True)
        self.log_pole = m.reshape(G, H, rounds)
        self.sigma_m = sigma.reshape(G, H, rounds)
        # no third sample: the two samples' disagreement given the label is the test
        two = (np.isfinite(self.gaps).sum(axis=3) == 2)
        self.residual = np.where(two, spread.reshape(G, H, rounds), self.residual)

    def solve(self) -> np.ndarray:
        """``a_h`` of every group and head from ``a_h^T x_n = m_n`` (G, H, d)."""
        return self.a

    @classmethod
    def concatenate(cls, parts: list["_GroupMeasurements"]) -> "_GroupMeasurements":
        return cls(*(np.concatenate([getattr(part, f.name) for part in parts]) for f in fields(cls)
                     if f.name != "finals"))


class _FullDesign:
    """Designs of units that measure ``a_h(z)`` in all of R^d: d instances per unit (§13)."""

    def __init__(self, current: np.ndarray, heads: np.ndarray, patterns: np.ndarray):
        U, H, d = current.shape
        self.current, self.heads, self.units = current, heads, np.arange(U)
        self.rounds, self.pattern = d, patterns
        self.prior = current[self.units, heads].copy()
        self.null_space = _NullSpace(current)
        self.correction = _MinimumNormCorrection(U, d)
        self.frame = _other_heads_frame(current, heads)  # the other heads' rows never change here

    #: the target's log-poles are ``TARGET_CENTER + halfwidth p`` (:func:`_designs`)
    halfwidth = TARGET

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, d, d): unit (g, h)'s pattern has its constant row at ``(h + 1) % d``; written
        into ``out`` when given."""
        return _patterns_per_head(rng, d, groups, [(h + 1) % d for h in range(H)], out=out)

    def copies(self, n: int, default):
        """The copy counts asked in round n (``default``: the stage's, :func:`_measure`)."""
        return default[1] if n else default[0]

    def design(self, block: slice, out: np.ndarray | None = None) -> np.ndarray:
        """The final tokens (U, b, d) of the rounds in ``block`` (:func:`correction_blocks`), unrounded,
        written into ``out`` (any strides) when given."""
        null_part = self.null_space.parts(self.pattern[:, self.null_space.heads:, block].transpose(0, 2, 1),
                                          self.frame[3], self.null_space.workspace(block))
        return _designs(self.current, self.heads, self.pattern[:, :, block], null_part, self.frame, self.halfwidth,
                        out)

    def update(self, block: slice, x: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Correct the target's estimate to fit what was measured (minimal change from the prior) in
        the rounds of ``block`` (tokens x (U, b, d), log-poles m (U, b)); returns the log-poles
        ``t^T x`` the block's tokens were designed for (t: the estimate before)."""
        designed = np.matmul(x, self.current[self.units, self.heads][:, :, None])[:, :, 0]
        miss = m - np.matmul(x, self.prior[:, :, None])[:, :, 0]
        self.current[self.units, self.heads] = self.prior + self.correction.aim(block.start, x, miss)
        return designed

    def solve(self, finals: np.ndarray, rhs: np.ndarray, units=slice(None)) -> np.ndarray:
        """``a`` (and the same map applied to other right-hand sides) from ``X a = rhs`` (the tokens and
        right-hand sides of the units ``units``, a slice or a mask)."""
        return np.linalg.solve(finals, rhs)

    #: what a subspace design's basis got wrong (:meth:`_SubspaceDesign.basis_variance`); none here
    basis_error = None

    def basis_variance(self, finals: np.ndarray, a: np.ndarray) -> np.ndarray | None:
        """The variance (U, D) a unit's ``a`` gets from an error in its design's basis, beside its own
        rounds' (:func:`_solve_units`): none for a design in all of R^D."""
        return None

    def fitted_solution(self) -> np.ndarray | None:
        """The targets' corrected estimates (U, D) when the corrections took in every round: the
        minimum-norm correction then fits all d rounds, so it solves ``X a = m`` (to Gram-Schmidt's
        rounding; :func:`_solve_units` checks the residual). None otherwise."""
        if self.correction.added < self.rounds:
            return None
        return self.current[self.units, self.heads].copy()

    def constant_rows(self) -> np.ndarray:
        """The pattern row of each unit that is all ones or all minus ones (:meth:`patterns`)."""
        return (self.heads + 1) % self.rounds

    def approximate_inverse(self, part: slice = slice(None)) -> np.ndarray | None:
        """``X^{-1}`` (U, D, D) of the rounds' final tokens (rows) of the units ``part``, from the
        design's structure in ``O(H D^2)`` per unit instead of an LU (docs/algorithm.md §13, "The
        inverse from the design"); None once a correction moved the target's row (rounds designed
        from different estimates have no common frame).

        In the frame ``G`` whose rows are the estimates ``E`` (pattern slots ``0 .. H - 1``), ``N0^T``
        (the null slots; lifted, with a 0 against the 1 of ``x~``) and, lifted, ``e_D^T`` (slot H), the
        rounds' coordinates are ``G x_n = o + l * p_n`` (``p_n``: pattern column n; ``o``, ``l``: the
        design's offsets and spreads per slot), so ``C^T = L P`` with ``L = diag(l) + s o e_c^T`` (c:
        the constant row, all ``s = +-1``). P's rows are orthogonal, ``P^{-T} = diag(|p_j|^{-2}) P``,
        and by Sherman-Morrison ``L^{-T} = diag(1/l) - e_c (s o / l)^T / (l_c + s o_c)``:
        ``X^{-1} = G^T C^{-1} = G^T L^{-T} P^{-T}``.
        The tokens are rounded to ``TOKEN_BITS`` after the design: this is ``X^{-1}`` to about
        ``2^-38 cond(X)``, and :func:`_refined_solve` checks and refines with it."""
        if self.correction.added:
            return None
        current, heads, pattern = self.current[part], self.heads[part], self.pattern[part]
        U, H, D = current.shape
        units = np.arange(U)
        d = self.null_space.V.shape[1]  # the slopes' dimension (D - 1 lifted)
        null_start = D - (d - H)
        spread, offset = np.empty((U, D)), np.zeros((U, D))
        spread[:, :H], offset[:, :H] = SATURATION_SPREAD, SATURATION_MID
        spread[units, heads], offset[units, heads] = self.halfwidth, TARGET_CENTER
        spread[:, null_start:] = SATURATION_SPREAD / self.frame[3][part, None]
        constant = self.constant_rows()[part]
        sign = pattern[units, constant, :1]  # the constant row is all ones or all minus ones: 1^T = s p_c^T
        spread[:, H:null_start] = sign  # the lifted coordinate (its slot is the constant row): 1 = s p_c
        offset *= sign
        # C^{-1} = diag(w) P + e_c correction^T with w = 1 / (|p_j|^2 l_j); X^{-1} = G^T C^{-1} is formed as
        # one product of rank 2H + 1 (the estimates' rows, N0's reflectors, the constant slot's column)
        # plus the null rows' diagonal part: one (U, D, D) array besides the pattern, no LU.
        weights = 1.0 / (np.einsum("ujn,ujn->uj", pattern, pattern) * spread)
        heads_part = pattern[:, :H] * weights[:, :H, None]  # C^{-1}'s rows 0 .. H - 1 before the correction
        correction = -np.matmul(offset[:, None, :H], heads_part)[:, 0]
        correction /= (spread[units, constant] + offset[units, constant])[:, None]
        in_heads = constant < H
        heads_part[units[in_heads], constant[in_heads]] += correction[in_heads]
        column = np.zeros((U, D, 1))  # G^T e_c where c is not a head's slot: e_D (lifted) or N0 e_(c - null start)
        if null_start > H:
            column[:, D - 1] = 1.0
        null_weights = weights[:, null_start:]
        in_null = constant >= null_start
        if in_null.any():
            picks = np.zeros((U, d - H, 1))
            picks[units[in_null], constant[in_null] - null_start] = 1.0
            column[:, :d] += self.null_space.apply(picks.transpose(0, 2, 1), part).transpose(0, 2, 1)
        V, T = self.null_space.V[part], self.null_space.T[part]
        reflected = np.matmul(np.matmul(T, (V[:, H:] * null_weights[:, :, None]).transpose(0, 2, 1)),
                              pattern[:, null_start:])  # T V_2^T diag(w) P_null (U, H, D)
        left = np.zeros((U, D, 2 * H + 1))
        left[:, :, :H] = current.transpose(0, 2, 1)
        left[:, :d, H:2 * H] = -V
        left[:, :, 2 * H:] = column
        right = np.concatenate([heads_part, reflected, np.where(in_heads[:, None], 0.0, correction)[:, None]], axis=1)
        inverse = np.matmul(left, right)
        inverse[:, H:d] += pattern[:, null_start:] * null_weights[:, :, None]  # N0 = (0, I) - V T V_2^T on the null rows
        if null_start > H:
            inverse[:, D - 1] += pattern[:, H] * weights[:, H, None]
        return inverse


class _FinalDesign(_FullDesign):
    """The final stage's units in R^d (docs/algorithm.md §13, "The final instances"): the target's row
    of every pattern is :func:`final_sides`, its log-poles ``TARGET_CENTER + halfwidth p_n``
    (``FINAL_TARGET`` in float64, set by :func:`_measure`), and round n asks the two copy counts of
    its side, ``FINAL_SIDE_COPIES``."""

    halfwidth, noisy_halfwidth = FINAL_TARGET, NOISY_FINAL_TARGET

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        return _patterns_per_head(rng, d, groups, [(h + 1) % d for h in range(H)], range(H), out)

    def copies(self, n: int, default):
        return final_copies(self.rounds, n)


def final_copies(rounds: int, n: int) -> tuple:
    """Round n's copy counts in a final unit of ``rounds`` rounds (:class:`_FinalDesign`)."""
    side = int(final_sides(rounds)[n])
    return FINAL_SIDE_COPIES[side]


def first_copies(unit: float) -> tuple:
    """The first group's copy counts (round 0, later rounds): ``k = 1, 2`` in float64, the label
    then fixed at the unit's consensus and the two samples' disagreement its single-pole test (as
    in the final units and §17); ``k = 1, 2, 3`` on noisier answers (``unit`` above float64's),
    whose phase 1 leaves rougher estimates (docs/algorithm.md §13)."""
    return (FIRST_COPIES, FIRST_COPIES) if unit <= EPS else (FINAL_COPIES, FINAL_COPIES)


def final_unit_queries(rounds: int) -> int:
    """Queries of one final unit of ``rounds`` rounds: 2 in each."""
    return sum(len(final_copies(rounds, n)) for n in range(rounds))


class _SubspaceDesign(_FullDesign):
    """Designs of units whose ``a_h(z) = W_h^T z`` lies in a known r-dimensional subspace (the
    row space of a rank-r ``W_h``, orthonormal basis Q, docs/algorithm.md §17): r instances per
    unit. Instance n has ``Q^T x_n = y_n`` with ``y_n`` = the target's direction scaled to the
    log-pole ``TARGET_CENTER`` plus ``SPREAD p_n / |c|`` across it (p: zero-sum orthogonal pattern
    rows), and the other heads saturated; ``Q^T X`` is then well conditioned and ``a = Q (Q^T X)^{-1} m``."""

    def __init__(self, current: np.ndarray, heads: np.ndarray, patterns: np.ndarray, basis: np.ndarray):
        U, H, d = current.shape
        self.current, self.heads, self.units, self.basis = current, heads, np.arange(U), basis
        self.rounds = basis.shape[2]
        self.pattern = patterns
        # The map below is made in one array, its last r rows per unit first Q^T itself (the basis
        # rows, contiguous per unit, which the products below read): one fresh (U, r, d) array instead
        # of four (a copy, a product, a difference, a concatenation; fresh memory is mapped and zeroed
        # by the kernel, docs/algorithm.md §13: they were a sixth of the low-rank learner at d = 256,
        # H = 2, r = 128)
        self.frame_map_rows = np.empty((U, H - 1 + self.rounds, d))
        basis_rows = self.frame_map_rows[:, H - 1:]  # (U, r, d)
        np.copyto(basis_rows, basis.transpose(0, 2, 1))
        self.prior = np.matmul(basis_rows, current[self.units, heads][:, :, None])[:, :, 0]  # c = Q^T a
        self.coordinates = self.prior.copy()
        self.correction = _MinimumNormCorrection(U, self.rounds)
        others = np.array([[f for f in range(H) if f != h] for h in heads], dtype=int).reshape(U, H - 1)
        self.others = others
        # The rows every round's design fits: the other heads' estimates O (never corrected here, only
        # the target's) and the basis rows Q^T, the same in every round, so the minimum-norm map from
        # the right-hand side (u_O, y) to x is formed once (a matrix-vector product per round). Q is
        # orthonormal: x = Q y + O'^+ (u_O - O Q y) with O' = O (I - Q Q^T), the other heads' parts off
        # the subspace (Gram-Schmidt, twice), and O'^+ = Q_o R_o^{-T} from the QR of O'^T (d x (H - 1)):
        # the map's rows are (O'^+)^T and Q^T - (O Q)^T (O'^+)^T, O(H d r) a unit (the QR of the whole
        # d x (H - 1 + r) [O; Q^T] per unit was a fifth of the low-rank learner at d = 256, H = 2).
        O = current[self.units[:, None], others]  # (U, H - 1, d)
        along = np.matmul(O, basis)  # O Q (U, H - 1, r)
        off = O - np.matmul(along, basis_rows)
        off -= np.matmul(np.matmul(off, basis), basis_rows)
        if H > 1:
            q_o, r_o = np.linalg.qr(off.transpose(0, 2, 1))  # (U, d, H - 1), (U, H - 1, H - 1)
            pseudo_inverse_rows = np.linalg.solve(r_o, q_o.transpose(0, 2, 1))  # (O'^+)^T = R_o^{-1} Q_o^T
        else:
            pseudo_inverse_rows = off  # (U, 0, d)
        self.frame_map_rows[:, :H - 1] = pseudo_inverse_rows
        # Q^T - (O Q)^T (O'^+)^T in place, units in blocks whose product stays small (reused heap memory)
        step = max(1, INVERSE_BLOCK_BYTES // (8 * self.rounds * d))
        for start in range(0, U, step):
            part = slice(start, start + step)
            basis_rows[part] -= np.matmul(along[part].transpose(0, 2, 1), pseudo_inverse_rows[part])

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, rounds + H, rounds): r pattern rows in the subspace, H rows for the other heads
        (a new array: ``out`` is not used)."""
        inside = _patterns(rng, rounds, 0, groups * H).reshape(groups, H, rounds, rounds)
        return np.concatenate([inside, rng.uniform(-1.0, 1.0, (groups, H, H, rounds))], axis=2)

    def design(self, block: slice, out: np.ndarray | None = None) -> np.ndarray:
        U, r = self.coordinates.shape
        c = self.coordinates
        size = np.linalg.norm(c, axis=1)
        # An orthonormal frame of R^r whose first column is c / |c|: the reflection exchanging e_0 and it.
        normal = np.eye(r)[0] - c / size[:, None]
        length = np.linalg.norm(normal, axis=1)
        normal = np.where(length[:, None] > 1e-12, normal / np.where(length > 1e-12, length, 1.0)[:, None], 0.0)
        inside = self.pattern[:, 1:r, block].transpose(0, 2, 1)  # (U, b, r - 1)
        along = np.concatenate([np.full(inside.shape[:2] + (1,), TARGET_CENTER), SATURATION_SPREAD * inside], axis=2)
        along /= size[:, None, None]
        y = along - 2.0 * np.matmul(along, normal[:, :, None]) * normal[:, None, :]  # (I - 2 n n^T) along
        values = SATURATION_MID + SATURATION_SPREAD * self.pattern[self.units[:, None], r + self.others, block]
        rhs = np.concatenate([values.transpose(0, 2, 1), y], axis=2)
        return np.matmul(rhs, self.frame_map_rows, out=out)

    def update(self, block: slice, x: np.ndarray, m: np.ndarray) -> np.ndarray:
        """As :meth:`_FullDesign.update` in the coordinates ``c = Q^T t``: ``t^T x = c^T Q^T x``, and
        only ``c`` is corrected (the designs read ``c``; the target's row of ``current`` keeps the
        unit's initial estimate, saving a (U, r, d) product per block)."""
        rows = np.matmul(x, self.basis)  # (Q^T x_n)^T, (U, b, r)
        designed = np.matmul(rows, self.coordinates[:, :, None])[:, :, 0]
        miss = m - np.matmul(rows, self.prior[:, :, None])[:, :, 0]
        self.coordinates = self.prior + self.correction.aim(block.start, rows, miss)
        return designed

    def solve(self, finals: np.ndarray, rhs: np.ndarray, units=slice(None)) -> np.ndarray:
        basis = self.basis[units]
        return np.matmul(basis, np.linalg.solve(np.matmul(finals, basis), rhs))

    def basis_variance(self, finals: np.ndarray, a: np.ndarray) -> np.ndarray | None:
        """The first-order variance (U, D) of each unit's ``a = Q (X Q)^-1 m`` from the error of its
        basis Q (docs/algorithm.md §17, "Error estimate"), given ``basis_error`` = (per head h: the map
        (D, R) from a unit's ``a`` to the weights ``w`` of the full units whose errors turned Q, the
        full units' coordinate variances (R, D)); None without it. With ``g = E^T w`` (coordinate
        variances ``t = sum_j w_j^2 var(E_j)``) the true ``a`` sticks out of Q's span by ``g`` (the
        ``t`` term), and that part of it, read by the final tokens' components off the subspace
        (``B = X (I - Q Q^T)``: the other heads' saturation puts them there, far larger than their
        in-span parts), enters the log-poles the unit solves: ``(X Q)^-1 B g`` in c, variance
        ``diag(M B diag(t) B^T M^T)``, ``M = Q (X Q)^-1``."""
        if self.basis_error is None:
            return None
        to_weights, full_variance = self.basis_error
        others = self.others.shape[1]  # H - 1
        extra = np.full(a.shape, np.nan)
        with np.errstate(invalid="ignore", over="ignore"):
            for h in np.unique(self.heads):
                units = np.flatnonzero(self.heads == h)
                t = np.matmul(np.square(np.matmul(a[units], to_weights[h])), full_variance[h])  # (u, D)
                extra[units] = t
                if not others:
                    continue
                # The tokens' parts off the subspace lie in the span of the frame map's first H - 1
                # rows (x = Q y + O'^+ (u_O - O Q y), __init__): with an orthonormal basis P of it,
                # B = (X P) P^T (to the tokens' rounding), and the variance of P^T g is P^T diag(t) P,
                # (H - 1)-square: O(D r (H - 1)) a unit beside the r x r solve, not O(D r^2)
                P = np.linalg.qr(self.frame_map_rows[units, :others].transpose(0, 2, 1))[0]  # (u, D, H - 1)
                X, Q = finals[units], self.basis[units]
                spread = np.matmul(Q, np.linalg.solve(np.matmul(X, Q), np.matmul(X, P)))  # M X P, (u, D, H - 1)
                off_variance = np.matmul(P.transpose(0, 2, 1) * t[:, None, :], P)  # (u, H - 1, H - 1)
                extra[units] += (np.matmul(spread, off_variance) * spread).sum(axis=2)
        return extra

    def fitted_solution(self) -> None:
        """Not used here (:meth:`_FullDesign.fitted_solution`): ``a = Q c`` is solved from all rounds."""
        return None

    def approximate_inverse(self, part: slice = slice(None)) -> None:
        """No structured inverse here (:meth:`_FullDesign.approximate_inverse`): one LU of the r x r ``X Q``."""
        return None


def _measure(prober: _Prober, differences: np.ndarray, estimates: np.ndarray, rng, bridge: bool,
             W_score: np.ndarray | None = None, copies=None, bases: np.ndarray | None = None,
             designer=None, block: int = CORRECTION_BLOCK, basis_error=None) -> _GroupMeasurements:
    """Targeted instances for every unit ``(g, h)``: head h with difference ``differences[g, h]``.

    ``differences`` (G, H, d); ``estimates`` (G, H, H, d): for unit ``(g, h)`` the ``a_f`` of all
    heads f at its difference, used for the design. The target's own row is corrected after every
    block of rounds to fit its measured log-poles (:func:`correction_blocks`; not at all while the
    prior aims within ``AIM_TOLERANCE``, for bridges ``BRIDGE_AIM_TOLERANCE``). ``copies``: the copy
    counts of round 0 and of the later rounds; by default final units ask ``k = 1, 2, 3`` every round,
    bridges ``k = 1, 2`` in round 0 and ``k = 1`` later (the label is then known); a designer may
    choose them per round (``designer.copies``: :class:`_FinalDesign`). ``W_score`` (final stage):
    the model used for the oracle's score rounding in the error estimate. ``bases`` (G, H, d, r):
    measure each unit in the subspace of its head (r rounds, :class:`_SubspaceDesign`) instead of R^d (d rounds),
    ``basis_error`` what those bases got wrong (:meth:`_SubspaceDesign.basis_variance`; final stage).
    ``designer``: another design class with the interface of :class:`_FullDesign` (the lifted
    design of the biased model, :mod:`.biased`, whose units have ``d + 1`` rounds). ``block``: the
    most rounds designed from one corrected estimate, and the first block (:func:`correction_blocks`;
    1 for the first group, whose prior from phase 1 can miss its aim by 10 log-pole units on float32
    answers: its first round shows whether it does).

    Units are independent: they are measured in chunks of groups whose working arrays (final
    tokens, null parts, Gram-Schmidt bases: three (units, d, d) arrays) fit ``CHUNK_BYTES``, so
    memory does not grow with all instances x d.
    """
    G, H, _, d = estimates.shape
    if copies is None:
        copies = ((1, 2), (1,)) if bridge else (FINAL_COPIES, FINAL_COPIES)
    designer = designer or (_FullDesign if bases is None else _SubspaceDesign)
    rounds = d if bases is None else bases.shape[3]
    per_chunk = max(1, CHUNK_BYTES // (24 * d * d * H))
    keep = G * H * rounds * d * 8 <= KEEP_BYTES
    # The first (largest) chunk's patterns and final tokens are reused by the later chunks: a large
    # array made afresh per chunk is mapped and zeroed by the kernel each time (docs/algorithm.md §13,
    # "Fresh memory is not free"), and the tokens of a stage too large to keep are never all held at once.
    parts, pattern_buffer, finals_buffer, basis_buffer = [], None, None, None
    for start in range(0, G, per_chunk):
        stop = min(G, start + per_chunk)
        patterns = designer.patterns(rng, d, H, rounds, stop - start,
                                     out=None if pattern_buffer is None else pattern_buffer[:stop - start])
        pattern_buffer = patterns if pattern_buffer is None else pattern_buffer
        current = estimates[start:stop].reshape(-1, H, d).copy()
        heads = np.tile(np.arange(H), stop - start)
        design = (designer(current, heads, patterns.reshape((-1,) + patterns.shape[2:])) if bases is None else
                  designer(current, heads, patterns.reshape((-1,) + patterns.shape[2:]),
                           bases[start:stop].reshape(-1, d, rounds)))
        design.basis_error = basis_error
        if basis_buffer is not None:
            design.correction.spare = basis_buffer[:len(heads)]
        if bridge:
            design.correction.tolerance = BRIDGE_AIM_TOLERANCE
        if getattr(design, "noisy_halfwidth", None) is not None and prober.unit > EPS:
            design.halfwidth = design.noisy_halfwidth  # noisy answers: their sampling error dominates
        part = _measure_chunk(prober, differences[start:stop], estimates[start:stop], design, copies,
                              not bridge, W_score, f"{'bridge' if bridge else 'final'} instances, groups "
                              f"{start + 1}..{stop} of {G}", block,
                              None if finals_buffer is None else finals_buffer[:(stop - start) * H])
        if not keep:
            finals_buffer = part.finals.reshape(-1, rounds, d) if finals_buffer is None else finals_buffer
            part.finals = None
        if basis_buffer is None:
            basis_buffer = design.correction.basis
        parts.append(part)
    out = _GroupMeasurements.concatenate(parts)
    if keep:
        out.finals = np.concatenate([part.finals for part in parts])
    return out


def _measure_chunk(prober, differences, estimates, design, copies, refit, W_score, description,
                   block: int = CORRECTION_BLOCK, finals: np.ndarray | None = None) -> _GroupMeasurements:
    """:func:`_measure` on one chunk of groups, all its units batched as arrays in every round
    (``finals``: an array (units, rounds, d) to write the final tokens into, else a new one)."""
    G, H, _, d = estimates.shape
    U, rounds = G * H, design.rounds
    diffs = differences.reshape(U, d)
    K = len(copies[0])
    finals = np.empty((U, rounds, d)) if finals is None else finals
    log_pole, label, designed, residual = (np.full((U, rounds), np.nan) for _ in range(4))
    sigma_m, sigma_l = np.full((U, rounds), np.inf), np.full((U, rounds), np.inf)
    K = max(K, max(len(design.copies(n, copies)) for n in range(rounds)))
    gaps_all, rounding_all, ks_all = (np.full((U, rounds, K), np.nan) for _ in range(3))

    correcting = lambda: design.correction.added > 0  # noqa: E731
    for rounds_block in correction_blocks(rounds, block, correcting):  # a block's rounds: designed from one estimate
        tokens = design.design(rounds_block, finals[:, rounds_block])  # written in place, then rounded there
        prober.quantize(tokens, out=tokens)
        block_copies = [design.copies(n, copies) for n in range(rounds_block.start, rounds_block.stop)]
        # the block's rounds asked at once (their designs do not depend on each other's answers)
        samples = prober.rounds_gaps(finals[:, rounds_block], diffs, block_copies,
                                     f"{description}, rounds {rounds_block.start + 1}..{rounds_block.stop}/{rounds}")
        for n, ks, (gaps, rounding) in zip(range(rounds_block.start, rounds_block.stop), block_copies, samples):
            gaps_all[:, n, :len(ks)], rounding_all[:, n, :len(ks)], ks_all[:, n, :len(ks)] = gaps, rounding, ks
        # the rounds fitted with the same copy counts in one batched fit (each row's fit is its own:
        # the same numbers as round by round), before the one-sample readings, which read round 0's label
        for ks in dict.fromkeys(ks for ks in block_copies if ks != (1,)):
            fitted = [n for n, each in zip(range(rounds_block.start, rounds_block.stop), block_copies) if each == ks]
            count = len(ks)
            fits = single_pole.fit(gaps_all[:, fitted, :count].transpose(1, 0, 2).reshape(-1, count), ks,
                                   rounding_all[:, fitted, :count].transpose(1, 0, 2).reshape(-1, count))
            per_round = lambda values: values.reshape(len(fitted), U).T  # noqa: E731
            log_pole[:, fitted], label[:, fitted] = per_round(fits.log_pole), per_round(fits.label)
            sigma_m[:, fitted], sigma_l[:, fitted] = per_round(fits.sigma_m), per_round(fits.sigma_l)
            residual[:, fitted] = per_round(fits.residual) if count > 2 else np.nan
        for n in (n for n, ks in zip(range(rounds_block.start, rounds_block.stop), block_copies) if ks == (1,)):
            gap, rounding = gaps_all[:, n, 0], rounding_all[:, n, 0]
            m = single_pole.reading(gap, 0.0, label[:, 0])
            log_pole[:, n] = m
            # One sample: the error of m from the rounding of G(1) (dm = dG (1 + tau)^2 / (l tau)).
            tau = np.exp(m)
            sigma_m[:, n] = rounding * (1 + tau) ** 2 / np.abs(label[:, 0] * tau)
        designed[:, rounds_block] = design.update(rounds_block, finals[:, rounds_block], log_pole[:, rounds_block])
    shape = lambda array: array.reshape((G, H) + array.shape[1:])  # noqa: E731
    out = _GroupMeasurements(differences, estimates, *(shape(a) for a in (
        log_pole, label, designed, residual, sigma_m, sigma_l, gaps_all, rounding_all, ks_all)),
        np.full((G, H, d), np.nan), *(np.full((G, H, rounds), np.nan) for _ in range(3)),
        np.full((G, H, d, 2), np.nan), np.full((G, H), np.nan))
    if refit:
        out.refit_with_consensus_labels()
    _reduce_chunk(out, finals, design, W_score, prober.unit, prober.score_unit, prober.systematic)
    out.finals = finals.reshape(G, H, rounds, d)
    return out


def _reduce_chunk(out: _GroupMeasurements, finals: np.ndarray, design, W_score, unit: float = EPS,
                  score_unit: float = EPS, systematic=None) -> None:
    """What the rest of the run needs of a chunk's final tokens (U, rounds, d), before they are
    dropped: the solved ``a``, each instance's misfit, margin and norm, and the error-estimate terms
    (the samples' rounding at the answers' ``unit``, the scores' at the oracle's ``score_unit``;
    ``systematic``: the prober's rounding common to an instance's samples, :meth:`_Prober.systematic`)."""
    G, H, rounds = out.log_pole.shape
    U, d, heads = G * H, finals.shape[2], design.heads
    if not np.array_equal(heads, np.tile(np.arange(H), G)):  # the (group, head) order read below
        raise AssertionError("a chunk's units must be ordered by group, then head")
    m = out.log_pole.reshape(U, rounds)
    sigma, score_sigma = np.full((U, rounds), np.nan), np.full((U, rounds), np.nan)
    x_norm = np.sqrt(np.einsum("und,und->un", finals, finals))  # (no (U, rounds, d) temporary)
    if W_score is not None:
        # The oracle's rounding of the log-pole y^T q - x^T q = -z^T q, q = W_h x: the two dot
        # products round at eps |x| |q| (|x| <= 0.1 |z| over the targeted runs measured), q's own
        # rounding enters as z^T dq, about eps |z| times :func:`_score_norms`.
        z_norm = np.linalg.norm(out.differences.reshape(U, d), axis=1)
        score_factor, sample_scale = (NOISY_SCORE_FACTOR if score_unit > EPS else 8.0), 1.0
        common = np.zeros((U, rounds))  # the largest share of a sample's rounding common to its instance's
        if unit > EPS:  # noisy answers (docs/algorithm.md §19): typical errors rather than float64's bounds
            # The samples' rounding model (4 units per magnitude) against what the three-sample fits
            # show: with one degree of freedom each, E[residual^2] = (actual / modelled error)^2.
            residual = out.residual[np.isfinite(out.residual)]
            if residual.size:
                sample_scale = float(np.clip(3.0 * np.sqrt(np.mean(residual**2)), NOISY_SAMPLE_FLOOR, 1.0))
            if systematic is not None:
                shared = systematic(finals.reshape(U * rounds, -1)).reshape(U, rounds)
                with np.errstate(invalid="ignore", divide="ignore"):
                    ratio = np.nan_to_num(shared[:, :, None] / out.rounding.reshape(U, rounds, -1))
                common = np.clip(ratio.max(axis=2), 0.0, 1.0)
        score_norms = _score_norms(finals.reshape(G, H, rounds, d), W_score, x_norm.reshape(G, H, rounds))
        score = score_factor * score_unit * z_norm[:, None] * score_norms.reshape(U, rounds)
        # the residuals scale the samples' own errors, not the part common to an instance's
        # samples (the anchor's: docs/algorithm.md §19; scaled too, the estimate understated the
        # truth 8x at d = H = 4 under declared uniform noise 1e-8)
        scaled = sample_scale * (1.0 - common) + common
        samples = scaled * out.sigma_m.reshape(U, rounds)
        sigma, score_sigma = np.hypot(samples, score), score
        # the labels' consensus error with the same scaling (unscaled, 3.7e-7 against a true 4e-10
        # at d = 5, H = 3 under Gaussian noise 1e-10: the v part then overstated the error 25x)
        out.label_error = out.consensus_labels(scaled.reshape(G, H, rounds))[1]
    ok = np.isfinite(m).all(axis=1)
    variances = None
    if W_score is not None:
        # First order, independent errors: |a_i error| ~ sqrt(sum_n (X^{-1})_{in}^2 sigma_n^2), the map
        # applied to diag(sigma). Applied to sigma itself the errors cancel in the sum and the
        # estimate understated the truth 270-fold (d = H = 4, bench_reliability seed 57). Both parts
        # at once (a huge sigma squared to inf is held at the largest float, so that 0 x it stays 0).
        with np.errstate(over="ignore", invalid="ignore"):
            variances = np.stack([np.nan_to_num(sigma), np.nan_to_num(score_sigma)], axis=2) ** 2
        variances = np.minimum(variances, np.finfo(np.float64).max)
    solution, spread_squared = _solve_units(finals, design, np.nan_to_num(m), variances, x_norm)
    if spread_squared is not None:
        from_basis = design.basis_variance(finals, solution)
        if from_basis is not None:  # sized to the noise the full units showed: in both parts
            spread_squared += from_basis[:, :, None]
    a = np.where(ok[:, None], solution, np.nan)
    out.a = a.reshape(G, H, d)
    out.misfit = np.abs(m - np.matmul(finals, a[:, :, None])[:, :, 0]).reshape(G, H, rounds)
    poles = np.matmul(finals, out.estimates.reshape(U, H, d).transpose(0, 2, 1))  # (U, rounds, H)
    poles[np.arange(U), :, heads] = np.inf
    out.margin = poles.min(axis=2).reshape(G, H, rounds) if H > 1 else np.full((G, H, rounds), np.inf)
    out.x_norm = x_norm.reshape(G, H, rounds)
    if W_score is not None:  # an unbounded spread is an infinite estimate, said so
        out.variance = np.where(ok[:, None, None], spread_squared, np.nan).reshape(G, H, d, 2)


#: The floor of :func:`_score_norms` as a fraction of ``|W_h|_F |x| / sqrt(d)``, the expected size of
#: ``|W_h x|`` for a token in no particular direction: ordinary tokens stay above it (their estimates
#: unchanged), tokens nearly in a head's null space are lifted to it. (At the full expected size the
#: estimates of ordinary runs grew up to 2x and a float32 GPT-2 layer's, d = 32, H = 8, passed its
#: error_estimate limit.)
SCORE_NORM_FLOOR = 0.5


def _score_norms(by_head: np.ndarray, W_score: np.ndarray, token_norms: np.ndarray | None = None) -> np.ndarray:
    """``max(|W_h x|, SCORE_NORM_FLOOR |W_h|_F |x| / sqrt(d))`` (G, H, rounds) of each unit's own head
    h for its tokens ``by_head`` (G, H, rounds, d) (units ordered (group, head): head h's tokens are
    the strided view ``by_head[:, h]``; ``token_norms`` their ``|x|`` (G, H, rounds), if known).

    They size the oracle's score rounding ``8 eps |z| |q|`` in the error estimate, ``q = W_h x`` as
    the oracle forms it: its rounding error is about ``eps |W_h|_F |x| / sqrt(d)`` (each entry a sum
    of d products of random signs), which is what the log-pole ``-z^T q`` carries where x lies nearly
    in W_h's null space (a low-rank head, a token aimed at a small log-pole along it: the answers of a
    rank-1 head under schedule="lowrank" with |x| = 58 and 6,841 were 8 and 40 times off their
    modelled rounding, the estimate 50 times below the truth). A few digits suffice: the products run
    in float32 (sgemm, twice dgemm's speed; ``d^2`` per token was an eighth of the learner at d = 256,
    H = 2, half the final stage's oracle work at H = 2), with each head's W scaled to entries at most
    1, to a relative error about ``d 2^-24 cond(W_h)`` (4e-3 at d = 256 for a Gaussian W). A row whose
    float32 norm is not a positive finite number (overflow, underflow) is computed again in float64."""
    G, H, rounds, d = by_head.shape
    if token_norms is None:
        token_norms = np.linalg.norm(by_head, axis=3)
    norms = np.empty((G, H, rounds))
    tokens, product = np.empty((G, rounds, d), np.float32), np.empty((G, rounds, d), np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for h in range(H):
            size = float(np.abs(W_score[h]).max())
            size = size if np.isfinite(size) and size > 0 else 1.0
            np.copyto(tokens, by_head[:, h], casting="same_kind")
            np.matmul(tokens, (W_score[h].T / size).astype(np.float32), out=product)
            norms[:, h] = size * np.sqrt(np.einsum("gnd,gnd->gn", product, product).astype(np.float64))
            redo = ~((norms[:, h] > 0) & np.isfinite(norms[:, h]))
            if redo.any():
                exact = np.matmul(by_head[:, h][redo], W_score[h].T)
                norms[:, h][redo] = np.sqrt(np.einsum("nd,nd->n", exact, exact))
            floor = SCORE_NORM_FLOOR * np.linalg.norm(W_score[h]) / np.sqrt(d) * token_norms[:, h]
            np.maximum(norms[:, h], floor, out=norms[:, h])
    return norms


#: An approximate inverse Y is used (:func:`_refined_solve`) only when ``|X Y p - p| <= INVERSE_CHECK |p|`` on a probe
#: p; each refinement step then shrinks the error about that much (the design's Y: ``2^-38 cond(X)``, 1e-8
#: at d = 6 and d = 160), and at most ``REFINEMENT_STEPS`` take ``INVERSE_CHECK`` below float64's rounding.
INVERSE_CHECK, REFINEMENT_STEPS = 1e-4, 3


#: Units whose inverses :func:`_solve_units` forms at once: their temporaries (a few (units, D, D)
#: arrays, about 4 MB) stay small enough to be reused from the heap rather than mapped and zeroed afresh
#: by the kernel each time (at d = 192, H = 6 that took a sixth of the learner's time).
INVERSE_BLOCK_BYTES = 2**22


def _solve_units(finals: np.ndarray, design, rhs: np.ndarray, variances: np.ndarray | None = None,
                 row_norms: np.ndarray | None = None):
    """``a`` (U, D) from ``X a = rhs`` for every unit of a chunk and, given the rounds' ``variances``
    (U, D, V), the first-order spread ``(X^{-1})^2 variances`` (U, D, V) (else None), each by the
    cheapest route the design allows that is as accurate as an LU solve (docs/algorithm.md §13,
    "The inverse from the design"): a stage whose corrections fitted every round reads ``a`` off its
    corrected estimate where the residual shows it backward stable,
    ``|m_n - x_n^T a| <= 64 eps (|x_n| |a| + |m_n|)``; a design never corrected has its inverse from
    its structure, refined (:func:`_refined_solve`), in blocks of units (``INVERSE_BLOCK_BYTES``); LU
    for the rest. ``row_norms``: the ``|x_n|`` (U, D) if known."""
    U, D = rhs.shape
    solution = None if variances is not None else design.fitted_solution()
    if solution is not None:
        with np.errstate(all="ignore"):
            residual = np.abs(rhs - np.matmul(finals, solution[:, :, None])[:, :, 0])
            if row_norms is None:
                row_norms = np.sqrt(np.einsum("und,und->un", finals, finals))
            size = row_norms * np.linalg.norm(solution, axis=1)[:, None] + np.abs(rhs)
        rough = ~(residual <= 64 * EPS * size).all(axis=1)
        if rough.any():
            solution[rough] = design.solve(finals[rough], rhs[rough][:, :, None], rough)[:, :, 0]
        return solution, None
    spread = None  # (U, d) and (U, d, V): a subspace unit's a is in R^d, its rounds r
    step = max(1, INVERSE_BLOCK_BYTES // (8 * D * D))
    for start in range(0, U, step):
        part = slice(start, min(U, start + step))
        refined = _refined_solve(finals[part], design.approximate_inverse(part), rhs[part])
        if refined is None and variances is None:
            solved = design.solve(finals[part], rhs[part, :, None], part)
            refined = solved[:, :, 0], None
        elif refined is None:
            identity = np.broadcast_to(np.eye(D), (part.stop - start, D, D))
            solved = design.solve(finals[part], np.concatenate([rhs[part, :, None], identity], axis=2), part)
            refined = solved[:, :, 0], solved[:, :, 1:]
        if solution is None:
            solution = np.empty((U, refined[0].shape[1]))
            if variances is not None:
                spread = np.empty((U, refined[1].shape[1], variances.shape[2]))
        solution[part], inverse = refined
        if variances is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                spread[part] = np.matmul(np.square(inverse, out=inverse), variances[part])
    return solution, spread


def _refined_solve(finals: np.ndarray, inverse: np.ndarray | None, rhs: np.ndarray):
    """``a`` (U, D) from ``X a = rhs`` with an approximate inverse ``Y`` of every X (U, D, D):
    ``a = Y rhs``, then ``a += Y (rhs - X a)`` (iterative refinement in float64: each step multiplies
    the error by ``I - Y X``, whose size ``mu`` the probe estimates, so ``k`` steps leave
    ``mu^(k + 1)``: as many as take it below ``EPS / 4``; the result is backward stable as an LU
    solve's). Returns ``(a, Y)``, or None (solve by LU instead) when Y is None or fails the probe
    ``mu = max |X Y p - p|_inf / |p|_inf <= INVERSE_CHECK`` for some unit."""
    if inverse is None:
        return None
    D = finals.shape[1]
    probe = np.cos(1.7 * np.arange(D) + 0.3)  # fixed, dense, no exact zeros; the schedule's rng is not touched
    with np.errstate(all="ignore"):
        misfit = np.abs(np.matmul(finals, np.matmul(inverse, probe)[:, :, None])[:, :, 0] - probe).max()
    mu = misfit / np.abs(probe).max()
    if not mu <= INVERSE_CHECK:
        return None
    steps = REFINEMENT_STEPS if mu <= 0 else min(REFINEMENT_STEPS, int(np.ceil(np.log(EPS / 4) / np.log(mu))) - 1)
    a = np.matmul(inverse, rhs[:, :, None])
    for _ in range(max(1, steps)):
        a += np.matmul(inverse, rhs[:, :, None] - np.matmul(finals, a))
    return a[:, :, 0], inverse


def _all_heads_at(W: np.ndarray, differences: np.ndarray) -> np.ndarray:
    """``a_f(z) = W_f^T z`` of every head f (W (H, D, D)) at every unit's difference (G, H', D):
    (G, H', H, D), as one BLAS matmul (the einsum it replaces ran ~2.5x slower at d = 128, H = 8)."""
    H, D, _ = W.shape
    rows = differences.reshape(-1, D) @ W.transpose(1, 0, 2).reshape(D, H * D)
    return rows.reshape(differences.shape[:-1] + (H, D))


def _shared(differences: np.ndarray, estimates: np.ndarray):
    """Units of groups shared by all heads: differences (G, d) and a's (G, H, d) broadcast per unit."""
    G, H, d = estimates.shape
    return (np.repeat(differences[:, None], H, axis=1),
            np.repeat(estimates[:, None], H, axis=1))


def _balanced_basis(label_direction: np.ndarray, rng, scale: float, scores: np.ndarray | None = None,
                    head: int | None = None) -> np.ndarray:
    """An orthogonal basis (columns) times ``scale`` in which ``label_direction`` (a rough ``v_h``)
    has equal components ``+-|v_h| / sqrt(d)``: the Householder reflection that exchanges
    ``v_h / |v_h|`` and ``(1, .., 1) / sqrt(d)``, with random column signs.

    A difference z nearly orthogonal to ``v_h`` makes the label ``l_h = v_h^T z`` small next to the
    oracle's rounding of ``v_h^T y`` (``~ eps |v_h| |z|``), and that head's poles imprecise; in this
    basis every ``|l_h| = |v_h| |z| / sqrt(d)``.

    Every rotation ``O`` that fixes ``(1, .., 1)`` keeps that balance. With ``scores`` (H, d', d'),
    the rough score matrices (``d' = d + 1``, lifted, with biases: their d x d part), the basis is the best of
    ``BASIS_CANDIDATES`` such rotations by the worst condition number over its columns z of the
    design rows ``A(z) = [W_f^T z]_f`` (docs/algorithm.md §13): an instance solves ``A(z) x = m``
    with the other heads' log-poles at 40..100, so an ill-conditioned ``A(z)`` makes ``|x|``, the
    answers and their rounding large (worst of 8 seeds, same queries: 2.9e-11 -> 2.5e-14 at
    d = H = 8, 2.8e-9 -> 8.3e-14 at d = H = 16, 1.3e-14 -> 5.7e-15 at d = 8, H = 6). With ``head``
    (the targeted schedules' final stage) the choice is finer: the candidate whose largest predicted
    score rounding of that head, ``|z| |W_h x + u_h|`` (:func:`_least_score_rounding`), is smallest.
    One head (H = 1): a single row, nothing to condition; the basis is drawn as before.
    """
    d = len(label_direction)
    unit = label_direction / np.linalg.norm(label_direction)
    ones = np.full(d, 1.0 / np.sqrt(d))
    normal = unit - ones
    if np.linalg.norm(normal) < 1e-12:
        normal = np.zeros(d)  # already balanced: R = I
    else:
        normal /= np.linalg.norm(normal)
    reflection = np.eye(d) - 2.0 * np.outer(normal, normal)
    signs = rng.choice([-1.0, 1.0], size=d)
    basis = reflection * signs[None, :]
    if scores is not None and len(scores) > 1:
        rows = scores[:, :d, :d]  # A(z)[f] = W_f^T z on x (a lifted z ends in 0, a lifted x in a fixed 1)
        wanted = max(FEWEST_CANDIDATES, BASIS_CANDIDATES * len(rows) // d)
        count = int(np.clip(BASIS_BYTES // (8 * rows.size), 1, wanted))  # (count, d, H, d) designs
        # A random rotation fixing the ones: O = Q F, Q from the QR of a Gaussian whose first column
        # is the ones (Q e_1 = +-1 / sqrt(d), the rest a random basis of the complement), F the
        # reflection exchanging e_1 and 1 / sqrt(d) (O 1 = Q sqrt(d) e_1 = 1 once Q's sign is fixed):
        # one QR per candidate, and F applied in O(d^2).
        gaussian = rng.standard_normal((count - 1, d, d))
        gaussian[:, :, 0] = 1.0
        q = np.linalg.qr(gaussian)[0]
        q *= np.sign(q[:, :1, :1] * ones[0])  # the first column +1 / sqrt(d) (a column sign keeps Q orthogonal)
        swap = np.eye(d)[0] - ones
        swap /= np.linalg.norm(swap)
        rotations = q - 2.0 * np.matmul(q, swap)[:, :, None] * swap[None, None, :]  # Q (I - 2 s s^T)
        # R O diag(signs): v^T R O = |v| 1^T O / sqrt(d) = |v| 1^T / sqrt(d), every label alike
        reflected = rotations - 2.0 * normal[None, :, None] * np.matmul(normal, rotations)[:, None, :]  # R O
        candidates = np.concatenate([basis[None], reflected * signs[None, None, :]])
        # (count, groups, H, d): designs[k, g, f] = rows[f]^T candidates[k][:, g], as BLAS matmuls (not einsum)
        designs = np.matmul(candidates.transpose(0, 2, 1)[:, None], rows[None]).transpose(0, 2, 1, 3)
        if head is None:
            basis = candidates[_best_conditioned(designs)]
        else:
            basis = candidates[_least_score_rounding(designs, candidates, scores, head, scale)]
    return basis * scale


def _least_score_rounding(designs: np.ndarray, candidates: np.ndarray, scores: np.ndarray, head: int,
                          scale: float) -> int:
    """The candidate k of ``designs`` (count, groups, H, d; the rows ``a_f(z) = W_f^T z`` of unit
    columns z of ``candidates`` (count, d, d)) whose largest predicted ``|z| |W_h x + u_h|`` over its
    columns is smallest (``scores`` (H, d', d'): the rough score matrices, lifted with biases).
    The prediction is the root mean square over a unit's instances: x the minimum-norm token with
    ``a_f^T x + b_f = SATURATION_MID + SATURATION_SPREAD q_f`` (f != h) and
    ``TARGET_CENTER + FINAL_TARGET q_h`` at ``|z| = scale`` (``b_f = u_f^T z``), the pattern entries
    q of variance 1/3 (uniform on [-1, 1]). The mean token alone is not enough: at d = H = 16 it
    chose ill-conditioned ``A(z)`` whose variations were large (two of 8 seeds 1.2e-12, 1.8e-12).

    The oracle rounds the scores ``y^T (W_h x + u_h)`` of the copies ``y = x - z`` by about
    ``eps |z| |W_h x + u_h|``, and that error of the target's log-pole, the same at every copy
    count, dominated the final units' error in float64 (docs/algorithm.md §13, "The final
    instances"). ``cond A(z)`` (:func:`_best_conditioned`) bounds it only loosely: choosing by
    the prediction itself took the worst of 16 seeds at d = H = 8 from 1.0e-14 to 6.9e-15, same
    queries. A singular Gram matrix falls back to :func:`_best_conditioned`."""
    count, groups, H, d = designs.shape
    lifted = scores.shape[1] > d
    offsets = (np.matmul(candidates.transpose(0, 2, 1), scores[:, :d, d].T) if lifted
               else np.zeros((count, groups, H)))  # u_f^T z for unit columns z, (count, groups, H)
    values = np.full(H, SATURATION_MID)
    values[head] = TARGET_CENTER
    spread = np.full(H, SATURATION_SPREAD)
    spread[head] = FINAL_TARGET
    rhs = values[None, None] / scale - offsets  # A x = (values - scale b) / scale for unit z, |z| = scale
    W_h, u_h = scores[head, :d, :d], (scores[head, :d, d] if lifted else np.zeros(d))
    with np.errstate(all="ignore"):
        try:
            inverse_gram = np.linalg.inv(np.matmul(designs, designs.transpose(0, 1, 3, 2)))
        except np.linalg.LinAlgError:
            return _best_conditioned(designs)
        # W_h A^+ = W_h A^T (A A^T)^{-1}: (count, groups, d, H)
        mapped = np.matmul(np.matmul(W_h[None, None], designs.transpose(0, 1, 3, 2)), inverse_gram)
        mean = np.matmul(mapped, rhs[..., None])[..., 0] + u_h  # W_h x + u_h at the mean token
        # the pattern's variations (entries spread uniformly over [-1, 1]: variance 1/3) around it
        varied = (mapped * (spread / scale)) ** 2
        size = np.sqrt((mean**2).sum(axis=2) + varied.sum(axis=(2, 3)) / 3.0) * scale
        worst = np.nan_to_num(size.max(axis=1), nan=np.inf)
    return int(np.argmin(worst))


def _best_conditioned(designs: np.ndarray) -> int:
    """The candidate k of ``designs`` (count, groups, H, d) whose worst condition number over its
    groups, ``max_g s_0 / s_-1`` by SVD, is smallest (the first such k).

    The same k as taking the SVD of every candidate, cheaper: the conditions are first estimated
    from the eigenvalues of the H x H Gram matrices ``A A^T`` (error at most about
    ``H (d + H) eps cond^2`` relative; here with a factor 64 to spare), and only the candidates
    those bounds cannot rule out (usually one) get the SVD."""
    count, groups, H, d = designs.shape
    eigenvalues = np.linalg.eigvalsh(np.matmul(designs, designs.transpose(0, 1, 3, 2)))  # ascending
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = np.sqrt(eigenvalues[..., -1] / eigenvalues[..., 0]).max(axis=1)  # NaN where not positive
        slack = 64.0 * H * (d + H) * EPS * estimate**2
    bounded = np.isfinite(estimate) & (slack < 0.5)
    keep = np.arange(count)
    if bounded.any():  # exact worst within estimate * (1 -+ 2 slack)
        highest = (estimate * (1.0 + 2.0 * slack))[bounded].min()  # >= the smallest exact worst
        keep = np.flatnonzero(~bounded | (estimate * (1.0 - 2.0 * slack) <= highest))
    singular = np.linalg.svd(designs[keep], compute_uv=False)
    with np.errstate(divide="ignore", invalid="ignore"):
        worst = np.nan_to_num(singular[..., 0] / singular[..., -1], nan=np.inf).max(axis=1)
    return int(keep[np.argmin(worst)])


class TargetedSchedule(Schedule):
    """``extract(..., schedule="targeted")``: float64, H <= d (see the module docstring)."""

    name = "targeted"
    accepts = frozenset({"answer_error", "refine"})
    #: its queries are few-sample instances on huge tokens, kept only as a sample: the refinement
    #: (§12) fits the polish queries alone
    refines_on_own_answers = False
    refusal = ("it is a float64 schedule whose instances are single-pole fits (precision=None, no "
               "oversampling); use schedule='paper' for those")

    def __init__(self, settings):
        super().__init__(settings)
        if self.max_heads > self.d:
            raise ValueError(
                f"schedule='targeted' needs H <= d (got H0 = {self.max_heads} > d = {self.d}): each targeted "
                "instance puts one head in the window and the other H - 1 beyond log-pole 40 through H linear "
                "conditions on the final token. Use schedule='paper' with precision=BITS for H > d."
            )
        self.rng = np.random.default_rng(settings.seed)
        self.vbar_basis = random_basis(self.rng, self.d, self.token_scale)
        self.unit = EPS  # until run() has read the answers (answer_unit)

    @property
    def promised_queries(self) -> int:
        """The stages after phase 1, with H0 heads found: ``d`` one-token queries + ``2 H d``
        (first group; ``3 H d`` on answers noisier than float64, :func:`first_copies`, known once
        the run has read them) + ``(d + 1) H (d - 1)`` (bridges) + ``2 H d^2`` (final: d units per
        head of d rounds, 2 queries each). Phase 1 (the line search, about ``H (d + 15)`` plus line
        grids) is adaptive and comes on top."""
        d, H = self.d, self.max_heads
        return d + len(first_copies(self.unit)[0]) * H * d + (d + 1) * H * (d - 1) + H * d * final_unit_queries(d)

    @property
    def promised_max_length(self) -> int:
        return max(CENTER_COPIES) + 1

    @property
    def count_formula(self) -> str:
        return ("targeted d + 2Hd (3Hd on noisy answers) + (d+1)H(d-1) + 2Hd^2 after the adaptive phase 1")

    def fixed_queries(self) -> list[np.ndarray]:
        # The one-token queries are fixed; the rest is adaptive and replays query by query.
        return one_token_queries(self.vbar_basis)

    def run(self, boundary, arithmetic) -> Outcome:
        prober = _Prober(boundary, self.d, self.token_scale, self.promised_queries)
        prober.learn_vbar(self.vbar_basis)
        self.unit = prober.unit = answer_unit(self.settings, boundary.stats)
        prober.score_unit = score_unit(self.settings, boundary.stats)
        search, stages, model, finite = _run(prober, self.d, self.max_heads, self.rng, self.token_scale)
        H = len(search.heads)
        instances = _diagnostics(stages, model, prober.unit)
        measurements = [data for _, data in stages]
        error_estimate, unscaled_estimate, bias_error = (
            _error_estimate(stages[-1][1], model) if model is not None else (np.inf, 0.0, (0.0, 0.0)))
        answers = np.asarray(prober.answers, dtype=np.float64)
        checks = _checks(instances, search, H, self.settings.heads, measurements, prober.unit)
        return Outcome(model, H, error_estimate, TargetedDetails(instances, search), prober.sequences, answers,
                       checks, unscaled_estimate=unscaled_estimate, bias_error=bias_error)

    def thresholds(self) -> tuple[float, float]:
        return limits(self.unit)

    def hints(self, failed: set[str]) -> list[str]:
        unit = self.unit
        if not failed or unit <= EPS:
            return []
        bits = -np.log2(unit)
        said = (f"The answers carry noise of about {unit:.2g} relative ({bits:.0f} bits; bfloat16 has 8, float32 24) "
                "measured before the run, and the targeted instances sized to it did not hold")
        if bits < 20:
            return [said + ": below about 20 bits the single-pole fits cannot see the heads (docs/algorithm.md "
                    "§19). Use a higher-precision oracle (float32 or better) for this layer."]
        return [said + " (docs/algorithm.md §19: float32 layers pass at d <= 32 with few heads, not every one at "
                "d = 32, H = 8). A float64 copy of the layer, where you have one, extracts to 1e-14; or try "
                "another seed."]


def line_search(prober, d: int, max_heads: int, rng, token_scale: float):
    """Phase 1 in one group: the groups' differences ``Z`` and the heads located along lines in
    group ``z_1`` (:func:`.linesearch.locate_heads`)."""
    Z = prober.quantize(random_basis(rng, d, GROUP_SCALE * token_scale))
    z1 = Z[:, 0]
    search = locate_heads(lambda points, ks: prober.gaps(points, np.tile(z1, (len(points), 1)), ks, "phase 1: lines"),
                          z1, max_heads, rng, token_scale, prober.quantize, unit=prober.unit)
    return Z, search


def held_fraction(first: _GroupMeasurements) -> float:
    """The share of the first group's instances that held their single-pole form (a finite
    log-pole, the third sample within ``RESIDUAL_LIMIT``): below 1, phase 1's rough model left
    some head unsaturated and the run's ``saturation`` check would fail."""
    held = np.isfinite(first.log_pole) & (np.nan_to_num(first.residual, nan=np.inf) <= RESIDUAL_LIMIT)
    return float(held.mean()) if held.size else 0.0


def first_group(prober, d: int, max_heads: int, rng, token_scale: float, measure):
    """Phase 1 (heads and rough ``a_h(z_1)`` along lines) and the first group, targeted by
    ``measure(Z, search) -> measurements``. Returns ``(Z, line search report, first-group
    measurements or None when no head was found)``; the report counts every group's lines and
    queries (``groups``: how many were searched).

    A group can mislead phase 1: a head whose ``v_h`` is nearly orthogonal to ``z_1`` has a label
    ``v_h^T z_1`` too small for its step to stand out of the answers' rounding (float32, d = 64,
    H = 8, seed 2: ``l_3 = 1.3`` beside labels 39..668, 7 of 8 heads found), and under float32
    noise a centre contaminated by a neighbour of similar label can pass for a new head (a float32
    nn.MultiheadAttention, d = 32, H = 8: two heads counted twice with directions 10% and 27% off,
    two never searched for, and every first-group instance then unsaturated). Either way the run
    would fail loudly. So while fewer than ``max_heads`` heads were found, or some first-group
    instance did not hold (:func:`held_fraction`), phase 1 starts again in a fresh group (a new
    ``Z``), up to ``GROUP_ATTEMPTS`` groups; the attempt with the most heads, then the most held
    first-group instances, is kept (the earliest on a tie). A run whose first group holds asks
    exactly as before; a bound ``max_heads`` above the canonical count pays the extra groups' lines
    (docs/algorithm.md §13)."""
    position = lambda: prober.boundary.position  # noqa: E731
    before = position()
    attempts, lines = [], 0
    for _ in range(GROUP_ATTEMPTS):
        Z, search = line_search(prober, d, max_heads, rng, token_scale)
        lines += search.lines
        first, start = None, position()
        if search.heads and len(search.heads) >= max_heads:
            first = measure(Z, search)
        attempts.append([len(search.heads), -1.0 if first is None else held_fraction(first), Z, search, first,
                         position() - start])
        if first is not None and attempts[-1][1] == 1.0:
            break
    best = max(attempts, key=lambda attempt: attempt[:2])  # max keeps the earliest of equal keys
    _, _, Z, search, first, kept = best
    if first is None and search.heads:  # every group missed heads (max_heads above the canonical count)
        start = position()
        first = measure(Z, search)
        kept = position() - start
    search.groups, search.lines = len(attempts), lines
    # phase 1's queries: every group's lines and the first groups given up, not the kept one (§13)
    search.queries = position() - before - kept
    return Z, search, first


def _first_group(prober: _Prober, d: int, max_heads: int, rng, token_scale: float, copies=None):
    """:func:`first_group` with the targeted instances of §13 in R^d (``copies``: as
    :func:`_measure`'s; the targeted schedule's own run passes :func:`first_copies`)."""
    def measure(Z, search):
        rough = np.array([head.direction for head in search.heads])
        return _measure(prober, *_shared(Z[:, :1].T, rough[None]), rng, bridge=False, copies=copies, block=1)
    return first_group(prober, d, max_heads, rng, token_scale, measure)


def _bridge_step(first: _GroupMeasurements) -> float:
    """eps of the bridges ``z_1 + eps z_j``: a power of two with ``eps |a_h| |x| <= 2``."""
    a1 = first.a[0]
    return float(2.0 ** np.floor(np.log2(2.0 / (np.linalg.norm(a1, axis=1).max() * first.x_norm.max()))))


def _run(prober: _Prober, d: int, max_heads: int, rng, token_scale: float):
    """Phase 1, the first group, the bridges and the final instances (see the module docstring).
    Returns ``(line search report, [(stage, measurements)], model or None, finite)``."""
    Z, search, first = _first_group(prober, d, max_heads, rng, token_scale, first_copies(prober.unit))
    if first is None:
        return search, [], None, False
    H = len(search.heads)
    a1 = first.solve()[0]
    labels1 = first.consensus_labels()[0][0]
    stages = [("first", first)]

    # --- bridges z_1 + eps z_j: rough a_h(j) and l_h(j), heads named as in group z_1; rough W, v.
    rough_a, rough_l = a1[None], labels1[None]  # (groups, H, d), (groups, H)
    if d > 1 and np.isfinite(a1).all():
        eps_bridge = _bridge_step(first)
        bridge_z = prober.quantize(Z[:, :1].T + eps_bridge * Z[:, 1:].T)  # (d - 1, d)
        bridges = _measure(prober, *_shared(bridge_z, np.repeat(a1[None], d - 1, axis=0)), rng, bridge=True)
        stages.append(("bridge", bridges))
        # a_h(z_1 + eps z_j) - a_h(z_1) = eps a_h(z_j) (+ the rounding of the bridge difference, 2^-40 relative)
        rough_a = np.concatenate([rough_a, (bridges.solve() - a1[None]) / eps_bridge])
        rough_l = np.concatenate([rough_l, (bridges.label[:, :, 0] - labels1[None]) / eps_bridge])
    model, finite = None, bool(np.isfinite(rough_a).all() and np.isfinite(rough_l).all())
    if finite:
        W_rough, v_rough = float64_kernel.assemble(Z, np.eye(d), rough_a.transpose(1, 0, 2), rough_l.T)

        # --- final: each head in its own basis, balanced for its label (every |v_h^T z| alike).
        scale = GROUP_SCALE * token_scale
        bases = np.array([prober.quantize(_balanced_basis(v_rough[h], rng, scale, W_rough, h))
                          for h in range(H)])  # (H, d, d)
        differences = bases.transpose(2, 0, 1)  # (d groups, H, d): differences[g, h] = column g of head h's basis
        estimates = _all_heads_at(W_rough, differences)  # a_f(z) = W_f^T z for every unit
        final = _measure(prober, differences, estimates, rng, bridge=False, W_score=W_rough, designer=_FinalDesign)
        stages.append(("final", final))
        a_final = final.solve()  # (d, H, d)
        labels_final = final.consensus_labels()[0]  # (d, H)
        finite = bool(np.isfinite(a_final).all() and np.isfinite(labels_final).all())
        if finite:
            W = np.empty((H, d, d))
            v = np.empty((H, d))
            for h in range(H):  # W_h^T z = a_h(z) over head h's basis: W_h = Z_h^{-T} A_h^T
                W[h], v[h] = (part[0] for part in float64_kernel.assemble(
                    bases[h], np.eye(d), a_final[:, h][None], labels_final[:, h][None]))
            model = MultiHeadAttention(W, v)

    return search, stages, model, finite


def _diagnostics(stages, model, unit: float = EPS) -> TargetedInstances:
    """One row per targeted instance. The final tokens are gone (memory), so the margin and the
    bridges' agreement with the model are bounded from what each chunk kept: the other heads'
    log-poles by the design estimates, less ``|a_g(model) - a_g(design)| |x|``; a bridge's
    disagreement by its misfit to its own ``a`` plus ``|a - a_h(model)| |x|``. Both bounds are
    at least as strict as the exact quantities."""
    rows = []
    W_error = None
    if stages and unit > EPS and np.isfinite(stages[-1][1].error_squared[..., 0]).all():
        final = stages[-1][1]  # |dW_h|_F per head from the final stage's first-order errors
        W_error = (np.sqrt(final.error_squared[..., 0].sum(axis=0))
                   / np.linalg.norm(final.differences[0], axis=1))
    for stage, data in stages:
        G, H, rounds = data.log_pole.shape
        margin, agrees = np.full((G, H, rounds), np.nan), np.zeros((G, H, rounds), dtype=bool)
        tolerance = agreement_tolerance(unit)
        if unit > EPS:  # noisy answers: a one-sample bridge reading is as precise as its sample and the
            # label of its unit's first instance allow: dm = dG (1 + tau)^2 / (l tau) + (dl / l)(1 + e^-m)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                label_part = (np.abs(data.sigma_l[:, :, :1] / data.label[:, :, :1])
                              * (1.0 + np.exp(-data.log_pole)))
            reading = np.nan_to_num(data.sigma_m, nan=np.inf) + np.nan_to_num(label_part, nan=np.inf)
            if model is not None and W_error is not None:
                # the model's own log-pole at the instance is off by its W's error, |dW_h| |z| |x|
                # (the final stage's first-order error, §13): at declared noise 1e-8, d = H = 4,
                # 13 bridges of a model within its estimate disagreed by that alone
                z_norm = np.linalg.norm(data.differences, axis=2)  # (G, H)
                reading = reading + W_error[None, :, None] * z_norm[:, :, None] * data.x_norm
            tolerance = np.maximum(tolerance, 10.0 * reading)
        if model is not None:
            model_a = _all_heads_at(model.W, data.differences)  # a_f(z) of the model, every unit
            own_a = model_a[:, np.arange(H), np.arange(H)]  # (G, H, d)
            if data.finals is not None:  # exact: the model's log-poles at every instance
                poles = np.einsum("ghfd,ghnd->ghnf", model_a, data.finals)
                own = poles[:, np.arange(H), :, np.arange(H)].transpose(1, 0, 2)  # (G, H, rounds)
                poles[:, np.arange(H), :, np.arange(H)] = np.inf
                margin = poles.min(axis=3) if H > 1 else np.full((G, H, rounds), np.inf)
                agrees = np.abs(own - data.log_pole) <= tolerance
            else:
                drift = np.linalg.norm(model_a - data.estimates, axis=3)  # (G, H, H)
                drift[:, np.arange(H), np.arange(H)] = 0.0
                margin = data.margin - drift.max(axis=2)[:, :, None] * data.x_norm
                own = np.linalg.norm(data.a - own_a, axis=2)
                agrees = data.misfit + own[:, :, None] * data.x_norm <= tolerance
        finite = np.isfinite(data.log_pole)
        held = agrees if stage == "bridge" else data.residual <= RESIDUAL_LIMIT
        least = saturation_margin(unit) if stage == "final" else prior_saturation_margin(unit)
        ok = (margin >= least) & finite & held
        g, h, _ = np.meshgrid(np.arange(G), np.arange(H), np.arange(rounds), indexing="ij")
        rows.append((np.full(G * H * rounds, stage), g.ravel(), h.ravel(), data.log_pole.ravel(),
                     data.label.ravel(), data.designed.ravel(), data.residual.ravel(), margin.ravel(), ok.ravel()))
    if not rows:
        return TargetedInstances(*(np.array([], dtype=bool if name == "saturated" else float)
                                   for name in TargetedInstances.__dataclass_fields__))
    return TargetedInstances(*(np.concatenate(column) for column in zip(*rows)))


def _error_estimate(final: _GroupMeasurements, model) -> tuple[float, float, tuple[float, float]]:
    """``(estimate, its part from the oracle's score rounding alone, the score biases' error)``
    (:func:`first_order_estimate`)."""
    return first_order_estimate(final.variance, final.differences, final.label_error, model)


def largest_of(count: int) -> float:
    """How many standard deviations the largest of ``count`` independent centred Gaussian errors
    reaches: ``sqrt(2 ln count)``, at least 3 (the largest of 16 exceeds 3 with probability ~4%)."""
    return max(3.0, float(np.sqrt(2.0 * np.log(max(count, 1)))))


def first_order_estimate(variance: np.ndarray, differences: np.ndarray, label_sigma: np.ndarray,
                         model) -> tuple[float, float, tuple[float, float]]:
    """The first-order estimate of ``compare``'s ``max(W_rel, v_rel)`` (docs/algorithm.md §13,
    "Error estimate"), its part from the oracle's score rounding alone, and the estimated absolute
    error of u's largest entry (with its score part; zeros without biases).

    ``variance`` (J, H, D, 2): unit j of head h measured ``a~_h(z_j) = (W_h^T z_j[, u_h^T z_j])``
    (D = d, or d + 1 with biases) with coordinate variances ``sum_n (X^{-1})_{in}^2 sigma_n^2``
    ([..., 1]: the part answer noise does not scale: the score-rounding terms, and a subspace unit's
    basis term, §17); ``differences`` (J, H, D) the ``z_j`` (the columns
    of ``Z_h``, orthogonal times ``|z|``); ``label_sigma`` (J, H) the consensus labels' errors.
    ``W_h = Z_h^{-T} A_h^T`` with ``Z_h^{-T} = Z_h / |z|^2``, so entry (k, i) of ``dW_h`` has
    variance ``sum_j (Z_h[k, j] / |z_j|^2)^2 var(a_j[i])``; ``u_h`` and ``v_h`` the same with the
    lifted coordinate and the labels. Each part is its largest entry's standard deviation times
    :func:`largest_of` its entry count, W's and v's relative to the model's largest entry
    (``compare``'s normalisation). Per entry, not per head: the rows and columns of ``W_h`` carry
    unequal shares of its error (the a_j's coordinates and the z_j's entries differ in variance),
    so its largest entry can exceed ``largest_of`` times the head's root mean square (ViT float32,
    d = 16, seed 0: 4.5 times it, the head-wise estimate 1.7x below the truth). u's error stays absolute here: whether u is
    resolved from zero, and its error relative to max|u|, depends on the answers' noise, which
    ``extract`` measures after the run (``api._bias_error``; GPT-2's score biases, max|u| ~ 1e-3
    against max|W| ~ 1, came out up to 1.45x above a W-only estimate)."""
    d = model.d
    J, H, D, _ = variance.shape
    z = differences[:, :, :d]
    weights = (z / (z * z).sum(axis=2, keepdims=True)) ** 2  # (J, H, d): (Z_h^{-T})[k, j]^2
    weights = weights.transpose(1, 2, 0)  # (H, d, J)
    with np.errstate(over="ignore", invalid="ignore"):
        W_var = np.matmul(weights, variance[:, :, :d].transpose(1, 0, 2, 3).reshape(H, J, 2 * d))
        W_std = np.sqrt(W_var.reshape(H, d, d, 2).max(axis=(0, 1, 2)))  # (2,)
        W_part = largest_of(H * d * d) * W_std / max(float(np.abs(model.W).max()), 1e-300)
        v_std = np.sqrt(np.matmul(weights, label_sigma.T[:, :, None] ** 2).max())
        v_part = largest_of(H * d) * v_std / max(float(np.abs(model.v).max()), 1e-300)
        u_error = np.zeros(2)
        if D == d + 1:
            u_var = np.matmul(weights, variance[:, :, d].transpose(1, 0, 2))  # (H, d, 2)
            u_error = largest_of(H * d) * np.sqrt(u_var.max(axis=(0, 1)))
    return float(np.max([W_part[0], v_part])), float(W_part[1]), (float(u_error[0]), float(u_error[1]))  # NaN stays NaN


def label_deviation(labels: np.ndarray, sigma: np.ndarray, unit: float) -> float:
    """The largest deviation of an instance's label from the inverse-variance mean of its unit's
    (the last axis), in its own first-order errors ``sigma + unit max|label|`` (``unit``: the
    answers' relative error). The inverse-variance mean is the consensus the fits use: in a plain
    mean, an instance far off its target's centre, whose label error is 1e7 x the others', moved
    the mean by thousands of theirs and failed correct runs (auto, declared uniform 1e-8,
    bench_reliability: one label -3.1 +- 320 among three at -18.945 +- 1e-5..1.5e-2)."""
    scale = np.nanmax(np.abs(labels))
    error = sigma + unit * scale
    weights = np.where(np.isfinite(labels), 1.0 / np.maximum(error, 1e-300) ** 2, 0.0)
    mean = (np.nan_to_num(labels) * weights).sum(axis=-1, keepdims=True) / np.maximum(
        weights.sum(axis=-1, keepdims=True), 1e-300)
    return float(np.nanmax(np.abs(labels - mean) / error))


def _checks(instances: TargetedInstances, search: LineSearchReport, H, heads_given, measurements, unit: float = EPS):
    checks = [heads_found_check(H, heads_given, f"by phase 1 on {search.lines} lines")]
    bad = instances.unsaturated
    where = ", ".join(f"{instances.stage[i]} group {instances.group[i]} head {instances.head[i]}" for i in bad[:5])
    checks.append(Check(
        "saturation", len(bad) == 0, len(bad), 0,
        f"{len(bad)} of {len(instances.saturated)} targeted instances did not hold their saturation assumption"
        + (f" ({where}{', ...' if len(bad) > 5 else ''})" if len(bad) else ""),
    ))
    deviation = max((label_deviation(data.label, data.sigma_l, unit) for data in measurements), default=0.0)
    checks.append(Check("labels_consistent", deviation <= 1e3, deviation, 1e3,
                        "largest deviation of an instance's label from its (head, group) inverse-variance "
                        "mean, in first-order errors"))
    return checks
