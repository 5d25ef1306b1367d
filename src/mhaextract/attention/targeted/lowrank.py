"""The low-rank schedule: heads of rank at most r in O(H r d) queries (docs/algorithm.md, 'Low-rank heads').

``extract(oracle, d, heads=H, schedule="lowrank", rank=r)``, float64, H <= d. It is the
targeted schedule ('The targeted schedule') with one more fact: for a rank-r ``W_h`` every ``a_h(z) = W_h^T z`` lies
in the r-dimensional row space ``S_h`` of ``W_h``. Measuring ``a_h(z)`` in all of R^d takes d
targeted instances; once an orthonormal basis Q_h of ``S_h`` is known, r instances whose final
tokens have well-conditioned coordinates ``Q_h^T x`` determine ``a_h(z) = Q_h (Q_h^T X)^{-1} m``.

Stages (R = min(d, r + RANK_EXTRA) "full" differences per head):

1. ``vbar`` (d one-token queries), phase 1 and the first group ``z_1`` exactly as 'The targeted schedule'.
2. Bridges ``z_1 + eps z_j``: for ``j = 2..R`` in R^d (d instances, ``(d + 1)`` queries per head);
   the R vectors ``a_h(z_1), a_h(z_2), ..`` span a rough ``S_h``; for ``j > R`` in it (r instances,
   ``r + 1`` queries per head). Rough W, v as in 'The targeted schedule'.
3. Final, each head in its balanced basis ``Z_h``: R columns in R^d (d instances each), whose
   precise ``a_h`` give Q_h (the top r right singular vectors; the (r+1)-th singular value, relative,
   is the ``rank_bound`` check), then the other ``d - R`` columns in ``S_h`` (r + 1 instances each:
   the lifted design of the biased model with a free offset, :func:`_offset_subspace_units`).
   The final rounds are those of 'The targeted schedule' (:class:`.designs.FinalRounds`): in float64 one copy count a
   round and two in every eighth, whose fits give the unit's label and test the single-pole form
   (``residual``); two in every round on noisier answers.

Queries after phase 1, with H heads found:
``d + 3Hd + (d + 1) H (R - 1) + (r + 1) H (d - R) + H R q(d) + H (d - R) q(r + 1)``,
``q(D) = D + ceil(D / 8)`` (``2D`` on noisier answers), about ``2.1 H (2dr - r^2)``: two queries per
unknown of a rank-r matrix. Measured at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from scipy.special import gammaincinv

from ...checks.base import Check
from ...models.attention import MultiHeadAttention
from ...numerics import float64 as float64_kernel
from ...run.validation import FOUND_RANK
from . import biased
from ..base import Outcome
from .biased import AffineDesign, AffineFinalDesign, AffineProber, lift, lifted_scores
from .bases import balanced_basis, bias_balanced_scale
from .designs import FinalDesign, FinalRounds, final_unit_queries, SubspaceDesign
from .diagnostics import first_order_estimate, instance_diagnostics, targeted_checks, TargetedDetails
from .measure import GroupMeasurements, HeadsAt, measure_units, shared_estimates
from .patterns import draw_patterns
from .prober import Prober
from .schedule import bridge_step, targeted_first_group, TargetedSchedule
from .tolerances import EPS, GROUP_SCALE, SATURATION_MID, SATURATION_SPREAD, TARGET, TARGET_CENTER

#: Full (R^d) differences per head beyond the rank: their extra singular values test the rank bound.
RANK_EXTRA = 2
#: A head whose (r+1)-th singular value of its measured ``a_h(z)``, relative to the largest, exceeds
#: this has rank above the bound (float64 answers; noisier ones: :func:`rank_limit`).
RANK_LIMIT = 1e-8
#: Noisy answers: the limit is this many of the answers' relative units, at most ``LOOSEST_RANK_LIMIT``
#: (float32 torch layers of exact rank d / H showed 2e-7..5e-7 at units 6e-8..3e-7).
RANK_UNITS, LOOSEST_RANK_LIMIT = 1e3, 1e-3


def rank_limit(unit: float) -> float:
    """The ``rank_bound`` check's limit for answers of relative unit ``unit`` (the rank is told from
    noise only above it: a head of higher rank whose extra singular values are below it passes)."""
    return max(RANK_LIMIT, min(RANK_UNITS * unit, LOOSEST_RANK_LIMIT))


#: ``rank="auto"``: the value of ``rank`` that asks the schedule to find the rank itself.
AUTO = FOUND_RANK
#: rank="auto": the full bridges come in blocks, the first this large, each later one as large as all
#: before it while some head's rough ``a_h(z_j)`` are still independent, then just enough for every
#: head to show ``AUTO_WITNESSES`` vectors beyond its numerical rank (or until every bridge is full).
AUTO_FIRST_BRIDGES, AUTO_WITNESSES = 4, RANK_EXTRA + 1
#: The rough ``a_h(z_j)`` (bridge differences over eps) are noisier than the final ones: a singular
#: value counts toward the rank above this many times :func:`rank_limit` (relative to the largest).
AUTO_ROUGH_FACTOR = 10.0


def numerical_ranks(vectors: np.ndarray, tolerance: float) -> np.ndarray:
    """Each head's numerical rank (H,) of its vectors (n, H, d): the singular values of the n x d
    matrix above ``tolerance`` times the largest (at least 1)."""
    singular = np.linalg.svd(vectors.transpose(1, 0, 2), compute_uv=False)  # (H, min(n, d))
    return np.maximum(1, (singular > tolerance * singular[:, :1]).sum(axis=1))


def _full_bridges(measure, rough_of, first_rough: np.ndarray, d: int, rank, unit: float):
    """The bridges measured in all of R^d (docs/algorithm.md, 'Low-rank heads'): with a bound ``rank`` the first
    ``min(d, rank + RANK_EXTRA) - 1`` in one block; with ``rank="auto"`` blocks (``AUTO_FIRST_BRIDGES``,
    doubling while a head's vectors are all independent, then the witnesses missing) until
    :func:`numerical_ranks` of every head's rough ``a_h(z_1), a_h(z_2), ..`` leaves ``AUTO_WITNESSES``
    vectors beyond it (a head of rank k: any k + 1 generic a_h(z) are dependent); the rank is the
    largest head's.

    ``measure(rows)`` measures the bridges ``rows`` (a slice of ``j - 2``), ``rough_of(data)`` gives
    their rough ``a_h(z_j)`` (b, H, d) (W's part). Returns ``(blocks of measurements, rank, bridges
    measured)``; it stops early at a block with non-finite estimates (the caller fails the run)."""
    if rank != AUTO:
        count = min(d, rank + RANK_EXTRA) - 1
        return [measure(slice(0, count))], rank, count
    blocks, rough, measured = [], [first_rough[None]], 0
    tolerance = AUTO_ROUGH_FACTOR * rank_limit(unit)
    ranks = np.ones(first_rough.shape[0], dtype=int)
    while measured < d - 1:
        vectors = measured + 1
        if measured and (ranks < vectors).all():  # every head showed its rank: just the witnesses missing
            size = int(ranks.max()) + AUTO_WITNESSES - vectors
        else:  # some head still full: double
            size = max(AUTO_FIRST_BRIDGES, measured)
        size = min(d - 1 - measured, size)
        data = measure(slice(measured, measured + size))
        blocks.append(data)
        measured += size
        if not np.isfinite(data.a).all():
            break
        rough.append(rough_of(data))
        ranks = numerical_ranks(np.concatenate(rough), tolerance)
        if (measured + 1 - ranks >= AUTO_WITNESSES).all():
            break
    return blocks, int(min(d, ranks.max())), measured


@dataclass
class LowRankDetails(TargetedDetails):
    """``Extraction.details`` of the low-rank schedule: :class:`~.diagnostics.TargetedDetails` and

    Attributes
    ----------
    rank : the bound r the final stage used: ``rank`` as given, or the rank found (``rank="auto"``).
    rank_found : True when ``rank="auto"`` found it (:func:`numerical_ranks` of the bridges).
    full_bridges : bridge units measured in all of R^d (``R - 1`` for a given bound; for
        ``rank="auto"`` the blocks asked until the rank showed, at least ``r + 2``).
    """

    rank: int = 0
    rank_found: bool = False
    full_bridges: int = 0

    def summary(self) -> dict:
        return {**super().summary(), "rank": self.rank, "rank_found": self.rank_found,
                "full_bridges": self.full_bridges}


class LowRankSchedule(TargetedSchedule):
    """``extract(..., schedule="lowrank", rank=r)``: float64, heads of rank <= r, H <= d;
    ``rank="auto"`` finds r from the bridges first (docs/algorithm.md, 'Low-rank heads')."""

    name = "lowrank"
    # refine: full-rank least squares polish (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
    # refinement, verification'), rank not enforced
    accepts = frozenset({"rank", "answer_error", "refine"})
    refines_on_own_answers = False
    refusal = ("it is a float64 schedule of single-pole fits (precision=None, no oversampling); "
               "use schedule='paper' for those")

    def __init__(self, settings):
        super().__init__(settings)
        if settings.rank is None:
            raise ValueError("schedule='lowrank' needs rank=r, a bound on the rank of every W_h (1 <= r <= d), "
                             "or rank='auto' to find it")
        self.rank = settings.rank
        self.found: tuple[int, int] | None = None  # rank="auto", after run(): (rank, full bridges)

    def _counts(self) -> tuple[int, int, int]:
        """(r, R, full bridges) of the count: the bound, or for ``rank="auto"`` what run() found (before
        it: r = d, the most it can find)."""
        d = self.d
        if self.rank != AUTO:
            r = self.rank
            return r, min(d, r + RANK_EXTRA), min(d, r + RANK_EXTRA) - 1
        r, bridges = self.found if self.found is not None else (d, d - 1)
        return r, min(d, r + RANK_EXTRA), bridges

    @property
    def promised_queries(self) -> int:
        """After the adaptive phase 1, H0 heads found (module docstring; with n full bridges)."""
        d, H = self.d, self.max_heads
        r, R, n = self._counts()
        one = self.unit <= EPS
        return (d + 3 * H * d + (d + 1) * H * n + (r + 1) * H * (d - 1 - n)
                + H * R * final_unit_queries(d, one) + H * (d - R) * final_unit_queries(r + 1, one))

    #: The count in words: with a bound (R - 1 full bridges) and with ``rank="auto"`` (n of them).
    bound_formula = "lowrank d + 3Hd + (d+1)H(R-1) + (r+1)H(d-R) + HRq(d) + H(d-R)q(r+1), q(D) = D + ceil(D/8) (2D noisy)"
    auto_formula = ("lowrank rank='auto' d + 3Hd + (d+1)Hn + (r+1)H(d-1-n) + HRq(d) + H(d-R)q(r+1), "
                    "q(D) = D + ceil(D/8) (2D noisy)")

    @property
    def count_formula(self) -> str:
        if self.rank != AUTO:
            return f"{self.bound_formula}, R = min(d, r+2), after phase 1"
        r, _, n = self._counts()
        return f"{self.auto_formula}, r = {r} found, n = {n} full bridges measured, R = min(d, r+2), after phase 1"

    def _outcome(self, prober, search, stages, model, rank_ratio, found, lifted=None) -> Outcome:
        """What both run()s report: the diagnostics, the estimate, the checks and the rank used.
        ``found``: (rank used, full bridges measured or None when the run stopped before them)."""
        rank, bridges = found
        if self.rank == AUTO:
            self.found = (rank, min(self.d, rank + RANK_EXTRA) - 1 if bridges is None else bridges)
        H = len(search.heads)
        unit = () if lifted is None else (prober.unit,)  # the bias-free checks judge float64 answers
        instances = instance_diagnostics(stages, model if lifted is None else
                                 None if model is None else SimpleNamespace(W=lifted), *unit)
        finals = [data for stage, data in stages if stage == "final"]
        error_estimate, unscaled_estimate, bias_error, score_deviations = (
            _error_estimate(finals, model) if model is not None else (np.inf, 0.0, (0.0, 0.0), None))
        checks = targeted_checks(instances, search, H, self.settings.heads, [data for _, data in stages], *unit)
        checks.append(_rank_check(rank_ratio, rank, *unit, found=self.rank == AUTO))
        details = LowRankDetails(instances, search, rank=rank, rank_found=self.rank == AUTO,
                                 full_bridges=self._counts()[2])
        return Outcome(model, H, error_estimate, details, prober.sequences,
                       np.asarray(prober.answers, dtype=np.float64), checks, unscaled_estimate=unscaled_estimate,
                       bias_error=bias_error, score_deviations=score_deviations)

    def run(self, boundary, arithmetic) -> Outcome:
        prober = LiftingProber(boundary, self.d, self.token_scale, self.promised_queries)
        prober.learn_vbar(self.vbar_basis)
        search, stages, model, rank_ratio, found = _run(prober, self.d, self.max_heads, self.rank, self.rng,
                                                       self.token_scale)
        return self._outcome(prober, search, stages, model, rank_ratio, found)


class BiasedLowRankSchedule(LowRankSchedule):
    """``extract(..., schedule="lowrank", rank=r, bias=True)``: heads of rank <= r with score biases
    ``u_h`` and the output constant ``c`` (docs/algorithm.md, 'Biases: affine scores and an output constant' and
    'Low-rank heads'), float64, H <= d. In the lifted coordinates of 'Biases: affine scores and an output constant'
    ``a~_h(z) = (W_h^T z, u_h^T z)`` lies in ``S_h x R`` (r + 1 dimensions): the final subspace units ask ``r + 1``
    rounds (:class:`AffineFinalSubspaceDesign`), the full ones ``d + 1`` (:class:`~.biased.AffineFinalDesign`).
    Queries after phase 1 (module docstring, lifted, n full bridges): ``(d + 1) + 3H(d + 1) + (d + 2)Hn
    + (r + 2)H(d - 1 - n) + HRq(d + 1) + H(d - R)q(r + 1)``, ``q(D) = D + ceil(D / 8)`` (``2D`` on
    noisier answers)."""

    @property
    def promised_queries(self) -> int:
        d, H = self.d, self.max_heads
        r, R, n = self._counts()
        one = self.unit <= EPS
        return ((d + 1) + 3 * H * (d + 1) + (d + 2) * H * n + (r + 2) * H * (d - 1 - n)
                + H * R * final_unit_queries(d + 1, one) + H * (d - R) * final_unit_queries(r + 1, one))

    bound_formula = ("lowrank with biases (d+1) + 3H(d+1) + (d+2)H(R-1) + (r+2)H(d-R) + HRq(d+1) "
                     "+ H(d-R)q(r+1), q(D) = D + ceil(D/8) (2D noisy)")
    auto_formula = ("lowrank with biases rank='auto' (d+1) + 3H(d+1) + (d+2)Hn + (r+2)H(d-1-n) + HRq(d+1) "
                    "+ H(d-R)q(r+1), q(D) = D + ceil(D/8) (2D noisy)")

    fixed_queries = biased.BiasedTargetedSchedule.fixed_queries

    def run(self, boundary, arithmetic) -> Outcome:
        prober = biased.affine_prober(self, boundary)
        search, stages, model, rank_ratio, W_lift, found = _run_affine(prober, self.d, self.max_heads, self.rank,
                                                                      self.rng, self.token_scale)
        return self._outcome(prober, search, stages, model, rank_ratio, found, lifted=W_lift)


def _rank_check(rank_ratio: float, rank: int, unit: float = 0.0, found: bool = False) -> Check:
    limit = rank_limit(unit)
    told = (f"rank='auto' found r = {rank} from the bridges; above the limit the final units show a higher rank, "
            f"too weak for the bridges to tell (give rank=r)" if found else
            f"rank={rank}; above the limit the heads have higher rank")
    return Check("rank_bound", bool(rank_ratio <= limit), float(rank_ratio), limit,
                 f"largest relative singular value {rank + 1} of a head's measured a_h(z) ({told})")


class AffineSubspaceDesign(SubspaceDesign):
    """The subspace design of docs/algorithm.md, 'Low-rank heads' in the lifted coordinates of 'Biases: affine scores
    and an output constant': ``a~_h(z) = (W_h^T z, u_h^T z)`` lies in the span of ``Q~ = [[Q, 0], [0, 1]]`` (``basis``,
    (U, d + 1, r + 1)), and a lifted final token ``x~ = (x, 1)`` has coordinates ``Q~^T x~ = (y, 1)``. The r + 1
    instances of a unit aim its head at ``m = c^T y + b = TARGET_CENTER + TARGET p_0`` (c, b: its coordinates
    ``Q~^T a~``), with ``y`` spread by ``SPREAD p_1.. p_{r-1}`` across c, p the zero-sum orthogonal rows of a
    pattern whose constant row is the lifted 1: the (r + 1)-square ``[(y_n, 1)]`` is a triangular
    transform of orthogonal rows (the target's log-pole must vary here: held at one value, as in the
    bias-free design, its component along c would be parallel to the constant 1). The other heads
    aim at ``a~_g^T x~ = a_g^T x + b_g = MID + SPREAD p_g``."""

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, rounds + H, rounds): rows 0..r-1 zero-sum and orthogonal, row r constant (the
        lifted coordinate), then H rows for the other heads (a new array: ``out`` is not used)."""
        inside = draw_patterns(rng, rounds, rounds - 1, groups * H).reshape(groups, H, rounds, rounds)
        return np.concatenate([inside, rng.uniform(-1.0, 1.0, (groups, H, H, rounds))], axis=2)

    def design(self, block: slice, out: np.ndarray | None = None) -> np.ndarray:
        U, rounds = self.coordinates.shape
        r, D = rounds - 1, self.current.shape[2]
        c, b = self.coordinates[:, :r], self.coordinates[:, r]
        size = np.linalg.norm(c, axis=1)
        # An orthonormal frame of R^r whose first column is c / |c|: the reflection exchanging e_0 and it.
        normal = np.eye(r)[0] - c / size[:, None]
        length = np.linalg.norm(normal, axis=1)
        normal = np.where(length[:, None] > 1e-12, normal / np.where(length > 1e-12, length, 1.0)[:, None], 0.0)
        pattern = self.pattern[:, :, block].transpose(0, 2, 1)  # (U, b, rows)
        along = np.concatenate([TARGET_CENTER + TARGET * pattern[:, :, :1] - b[:, None, None],
                                SATURATION_SPREAD * pattern[:, :, 1:r]], axis=2) / size[:, None, None]
        y = along - 2.0 * np.matmul(along, normal[:, :, None]) * normal[:, None, :]
        # the frame's rows are the other heads' lifted a~_g: their offsets b_g ride on the lifted 1
        values = SATURATION_MID + SATURATION_SPREAD * self.pattern[self.units[:, None], rounds + self.others, block]
        rhs = np.concatenate([values.transpose(0, 2, 1), y, np.ones(y.shape[:2] + (1,))], axis=2)
        x = np.matmul(rhs, self.frame_map_rows, out=out)
        x[:, :, D - 1] = 1.0  # the frame asked for exactly this; the prober requires it to the bit
        return x


class AffineFinalSubspaceDesign(FinalRounds, AffineSubspaceDesign):
    """The final stage's lifted units in ``S_h x R`` (:class:`AffineSubspaceDesign`): the target's
    log-poles spread over ``TARGET_CENTER +- TARGET`` (``tau`` 0.16..24), in float64 read with one copy
    count, ``k = 2`` (4 units of the sample's rounding at ``tau = 2``, 15 at the ends), and every
    ``FINAL_PAIR_EVERY``-th round with ``k = 1, 2`` (:class:`.designs.FinalRounds`)."""

    sided = False


def _lifted_bases(spans: np.ndarray) -> np.ndarray:
    """``Q~ = [[Q, 0], [0, 1]]`` (H, d + 1, r + 1) from the row-space bases Q (H, d, r)."""
    H, d, r = spans.shape
    out = np.zeros((H, d + 1, r + 1))
    out[:, :d, :r], out[:, d, r] = spans, 1.0
    return out


def _bridge_stages(prober, Z: np.ndarray, first, d: int, rank, rng, affine: bool):
    """The bridges of the first group (full ones until the rank settles, the rest in the rough row
    spaces): ``(stages, rough a, rough labels, rank, full bridges measured, finite)``, ``finite`` False
    where a full bridge's measurements were not. ``affine``: in the lifted coordinates of
    docs/algorithm.md, 'Biases: affine scores and an output constant' (the scores' part is the first
    d of d + 1)."""
    a1, labels1 = first.a[0], first.consensus_labels()[0][0]  # (H, d [+ 1]), (H,)
    stages = [("first", first)]
    rough_a, rough_l = a1[None], labels1[None]
    measured = None  # full bridges measured (none yet)
    if not (d > 1 and np.isfinite(a1).all()):
        return stages, rough_a, rough_l, rank, measured, True
    eps = bridge_step(first)
    bridge_z = prober.quantize(Z[:, :1].T + eps * Z[:, 1:].T)  # (d - 1, d)
    if affine:
        bridge_z = lift(bridge_z, 0.0)  # (d - 1, d + 1)
    scores = (lambda a: a[..., :d]) if affine else (lambda a: a)  # noqa: E731

    def measure(rows, spans=None):  # spans (H, d, r): the bridges in those row spaces (lifted where affine)
        count = len(range(d - 1)[rows])
        if affine:
            design = ({"designer": AffineDesign} if spans is None else
                      {"bases": _per_unit(_lifted_bases(spans), count), "designer": AffineSubspaceDesign})
        else:
            design = {"bases": None if spans is None else _per_unit(spans, count)}
        return measure_units(prober, *shared_estimates(bridge_z[rows], np.broadcast_to(a1, (count,) + a1.shape)), rng,
                             bridge=True, **design)

    blocks, rank, measured = _full_bridges(measure, lambda data: (scores(data.a) - scores(a1)) / eps, scores(a1), d,
                                           rank, prober.unit)
    for full in blocks:
        stages.append(("bridge", full))
        rough_a = np.concatenate([rough_a, (full.a - a1) / eps])
        rough_l = np.concatenate([rough_l, (full.label[:, :, 0] - labels1) / eps])
        if not np.isfinite(full.a).all():
            return stages, rough_a, rough_l, rank, measured, False
    if measured < d - 1:  # the other bridges in the rough row spaces
        spans = _span(scores(np.concatenate([a1[None]] + [full.a for full in blocks])), rank)[0]
        low = measure(slice(measured, None), spans)
        stages.append(("bridge", low))
        rough_a = np.concatenate([rough_a, (low.a - a1) / eps])
        rough_l = np.concatenate([rough_l, (low.label[:, :, 0] - labels1) / eps])
    return stages, rough_a, rough_l, rank, measured, True


def _run_affine(prober: AffineProber, d: int, max_heads: int, rank, rng, token_scale: float):
    """:func:`_run` in the lifted coordinates of docs/algorithm.md, 'Biases: affine scores and an output constant'.
    Returns
    ``(line search report, [(stage, measurements)], model or None, rank ratio, lifted W~ or None, (rank, full
    bridges))``."""
    Z, search, first = biased.affine_first_group(prober, d, max_heads, rng, token_scale)
    if first is None:
        return search, [], None, 0.0, None, (_settled(rank, d), None)
    stages, rough_a, rough_l, rank, measured, finite = _bridge_stages(prober, Z, first, d, rank, rng, affine=True)
    if not finite:
        return search, stages, None, np.inf, None, (rank, measured)
    rank = _settled(rank, d)
    R = min(d, rank + RANK_EXTRA)
    if not (np.isfinite(rough_a).all() and np.isfinite(rough_l).all()):
        return search, stages, None, 0.0, None, (rank, measured)
    W_rough, v_rough, u_rough = biased.assemble_affine(Z, rough_a, rough_l)
    W_lift = lifted_scores(W_rough, u_rough)
    H = len(search.heads)
    scale = GROUP_SCALE * token_scale
    if prober.unit > EPS:  # noisy answers: u_h read as well as W_h (docs/algorithm.md, 'Narrow heads')
        scale = bias_balanced_scale(W_lift, Z, scale)
    bases = np.array([prober.quantize(balanced_basis(v_rough[h], rng, scale)) for h in range(H)])
    differences = lift(bases.transpose(2, 0, 1), 0.0)  # (d, H, d + 1)
    final = measure_units(prober, differences[:R], HeadsAt(W_lift, differences[:R]), rng, bridge=False, W_score=W_lift,
                          designer=AffineFinalDesign)
    stages.append(("final", final))
    if not np.isfinite(final.a).all():
        return search, stages, None, np.inf, None, (rank, measured)
    spans, ratio, factors = _span(final.a[..., :d], rank)
    a_final, labels_final = final.a, final.consensus_labels()[0]
    if R < d:
        low = measure_units(prober, differences[R:], HeadsAt(W_lift, differences[R:]), rng, bridge=False, W_score=W_lift,
                       bases=_per_unit(_lifted_bases(spans), d - R),
                       designer=AffineFinalSubspaceDesign, basis_error=_basis_error(final, factors, d, rank))
        stages.append(("final", low))
        a_final = np.concatenate([a_final, low.a])
        labels_final = np.concatenate([labels_final, low.consensus_labels()[0]])
    if not (np.isfinite(a_final).all() and np.isfinite(labels_final).all()):
        return search, stages, None, ratio, None, (rank, measured)
    W, v, u = np.empty((H, d, d)), np.empty((H, d)), np.empty((H, d))
    for h in range(H):
        W_h, v_h, u_h = biased.assemble_affine(bases[h], a_final[:, h:h + 1], labels_final[:, h:h + 1])
        W[h], v[h], u[h] = W_h[0], v_h[0], u_h[0]
    return search, stages, MultiHeadAttention(W, v, u, prober.c0), ratio, lifted_scores(W, u), (rank, measured)


def _span(vectors: np.ndarray, rank: int) -> tuple[np.ndarray, float, tuple]:
    """Orthonormal bases (H, d, r) of the top-r right singular subspaces of ``vectors`` (n, H, d),
    the largest relative (r+1)-th singular value (0 when n <= r), and the SVDs themselves
    ``(U, S, V^T)`` per head (the final stage's feed :func:`_basis_error`)."""
    left, singular, vt = np.linalg.svd(vectors.transpose(1, 0, 2), full_matrices=False)  # per head (n, d)
    r = min(rank, vt.shape[1])
    ratio = float((singular[:, r] / singular[:, 0]).max()) if singular.shape[1] > r else 0.0
    return vt[:, :r].transpose(0, 2, 1), ratio, (left, singular, vt)


def _per_unit(bases: np.ndarray, groups: int) -> np.ndarray:
    """The heads' bases (H, d, r) for every group, (G, H, d, r): a read-only view, not G copies
    (7.6 GB at d = 1024, H = 8, r = 128)."""
    return np.broadcast_to(bases[None], (groups,) + bases.shape)


class LiftingProber(AffineProber):
    """The bias-free schedule's prober (``c = 0``, vbar as :class:`~.prober.Prober` learns it) that also
    takes lifted tokens ``(x, 1)`` and differences ``(z, 0)``: its subspace units
    (:func:`_offset_subspace_units`) are the biased model's lifted ones."""

    learn_vbar = Prober.learn_vbar


def _offset_subspace_units(prober, differences: np.ndarray, W_rough: np.ndarray, spans: np.ndarray, rng,
                           basis_error) -> GroupMeasurements:
    """The bias-free final units in the heads' row spaces (docs/algorithm.md, 'Low-rank heads'), r + 1 rounds each: the
    lifted design of the biased model (:class:`AffineFinalSubspaceDesign`, ``u = 0``) solves
    ``a^T x_n + b = m_n`` for ``a`` in span(Q) and a free offset b, which is dropped (0 for this model).

    With r rounds and ``a = Q c`` alone, every round's target log-pole sits at ``TARGET_CENTER``, so an
    error common to the rounds moves ``c`` along itself by ``|c| / TARGET_CENTER`` times it, and the
    measured Q carries one: the true ``a`` sticks out of it by ``g`` (the SVD's rounding, ~1e-15 |a|),
    which the tokens' large parts off the subspace (the other heads' saturation, ``SATURATION_MID``, the
    same in every round) read as ``x_n^T g``, nearly constant over n. The offset absorbs that common
    part, for one query more a unit. Returns the stage in R^d as the other stages (``a``, differences,
    variances, tokens and norms without the lifted coordinate)."""
    G, H, d = differences.shape
    lifted = lift(differences, 0.0)
    W_lift = lifted_scores(W_rough, np.zeros((H, d)))
    to_weights, variance = basis_error
    lifted_error = (np.concatenate([to_weights, np.zeros((H, 1, to_weights.shape[2]))], axis=1),
                    np.concatenate([variance, np.zeros(variance.shape[:2] + (1,))], axis=2))  # the 1: exact
    low = measure_units(prober, lifted, HeadsAt(W_lift, lifted), rng, bridge=False, W_score=W_lift,
                        bases=_per_unit(_lifted_bases(spans), G), designer=AffineFinalSubspaceDesign,
                        basis_error=lifted_error)
    low.differences, low.estimates = differences, HeadsAt(W_rough, differences)
    low.a, low.variance = low.a[..., :d], low.variance[:, :, :d]
    low.x_norm = np.sqrt(np.maximum(low.x_norm**2 - 1.0, 0.0))  # |x|, not |(x, 1)|
    # the tokens' coordinates in their units' span are the lifted tokens' (its basis takes in their mean,
    # lifted): in R^d the margins are bounded through the whole token
    low.span_coords = low.off_span = low.mean_token = None
    if low.finals is not None:
        low.finals = low.finals[..., :d]
    return low


def _run(prober, d: int, max_heads: int, rank, rng, token_scale: float):
    """Returns ``(line search report, [(stage, measurements)], model or None, rank ratio, (rank, full
    bridges))``: the bound given or the rank found for ``rank="auto"``, and the bridge units measured
    in all of R^d (None when the run stopped before the bridges)."""
    Z, search, first = targeted_first_group(prober, d, max_heads, rng, token_scale)
    if first is None:
        return search, [], None, 0.0, (_settled(rank, d), None)
    stages, rough_a, rough_l, rank, measured, finite = _bridge_stages(prober, Z, first, d, rank, rng, affine=False)
    if not finite:
        return search, stages, None, np.inf, (rank, measured)
    rank = _settled(rank, d)
    R = min(d, rank + RANK_EXTRA)
    if not (np.isfinite(rough_a).all() and np.isfinite(rough_l).all()):
        return search, stages, None, 0.0, (rank, measured)
    W_rough, v_rough = float64_kernel.assemble(Z, np.eye(d), rough_a.transpose(1, 0, 2), rough_l.T)
    H = len(search.heads)
    scale = GROUP_SCALE * token_scale
    bases = np.array([prober.quantize(balanced_basis(v_rough[h], rng, scale)) for h in range(H)])
    differences = bases.transpose(2, 0, 1)  # (d, H, d)
    final = measure_units(prober, differences[:R], HeadsAt(W_rough, differences[:R]), rng, bridge=False,
                          W_score=W_rough, designer=FinalDesign)
    stages.append(("final", final))
    if not np.isfinite(final.a).all():
        return search, stages, None, np.inf, (rank, measured)
    spans, ratio, factors = _span(final.a, rank)
    a_final, labels_final = final.a, final.consensus_labels()[0]
    if R < d:
        low = _offset_subspace_units(prober, differences[R:], W_rough, spans, rng,
                                     _basis_error(final, factors, d, rank))
        stages.append(("final", low))
        a_final = np.concatenate([a_final, low.a])
        labels_final = np.concatenate([labels_final, low.consensus_labels()[0]])
    if not (np.isfinite(a_final).all() and np.isfinite(labels_final).all()):
        return search, stages, None, ratio, (rank, measured)
    W, v = np.empty((H, d, d)), np.empty((H, d))
    for h in range(H):  # W_h^T z = a_h(z) over head h's basis: W_h = Z_h^{-T} A_h^T
        W[h], v[h] = (part[0] for part in float64_kernel.assemble(
            bases[h], np.eye(d), a_final[:, h][None], labels_final[:, h][None]))
    return search, stages, MultiHeadAttention(W, v), ratio, (rank, measured)


def _settled(rank, d: int) -> int:
    """``rank`` once the bridges are measured: a bound stays; ``"auto"`` left unsettled (a run that
    failed before its bridges, or d = 1) is d."""
    return d if rank == AUTO else rank


#: The lower quantile of chi^2 with (R - k)(d - k) degrees of freedom that turns the measured
#: A's singular values past the significant k into an upper bound on E's mean square
#: (:func:`_basis_error`): the bound is below the truth with probability 1e-3 (24 degrees of freedom at
#: d = 16, rank 4: 3.0 times the measured mean square).
BASIS_NOISE_QUANTILE = 1e-3

#: The basis's own rounding, as a standard deviation per entry of A in units of ``eps sigma_1``
#: (:func:`_basis_error`): in float64 the measured errors E turn Q less than the SVD's backward
#: error and the target's rank, exact only to rounding, do. Over 18 heads (d = 16..64, H = 2..8,
#: float64) the out-of-span error of the true ``a`` took 0.1..2.1 of it.
BASIS_ROUNDING = 4.0

#: The measured noise's margin, in standard deviation (:func:`_basis_error`): the model of E behind
#: the term (independent across the full units, the first-order pattern across coordinates) put the
#: first-order miss of the true ``a`` at 0.44..1.38 times what it says over 26 heads of float32 layers
#: (d = 16..64); without the margin the estimate stood 1.5..1.7 times the truth on the tightest of
#: the 236 float32 runs that pass (3.0 with it).
BASIS_NOISE_MARGIN = 2.0


def _basis_error(full, factors, d: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """What the subspace units need to know of their bases' error (:meth:`.designs.SubspaceDesign.
    basis_variance`): per head h, the map (D, R) from a unit's ``a`` to the weights ``w = U S^-1 Q^T a``
    on the R full units (the measured ``A = U S Q^T``, R x d: ``factors``, the SVDs :func:`_span` made
    the bases from), and the full units' coordinate
    variances (R, D); zero on a lifted coordinate (D = d + 1), whose basis vector is exact. To first
    order Q's component off its span moves by ``(I - Q Q^T) E^T U S^-1`` (E: the full units'
    errors), so a true ``a = Q c`` sticks out of the measured span by ``(I - Q Q^T) E^T w``. Only the
    singular values above ``10 |E|_F`` enter: a head of rank k < r has noise in Q's other directions,
    along which the units measure c ~ 0.

    Only E's part off the heads' row space turns Q, and the measured A shows it: the singular values
    past the k significant ones are E seen in ``(R - k)(d - k)`` directions off A's row and column
    spaces (:data:`BASIS_NOISE_QUANTILE`). The first-order variances, bounds on every rounding, run
    above that (in standard deviation 6..25 times on float32 layers, 70..250 times in float64); they
    are scaled to its upper confidence bound (up too: answers noisier than the schedule assumed show
    there as they are; a rank above the bound shows there too, and fails ``rank_bound``), with a
    margin (:data:`BASIS_NOISE_MARGIN`). The basis's own rounding comes on top
    (:data:`BASIS_ROUNDING`). So sized, the term is not scaled again by
    the answer noise measured after the run (``Outcome.unscaled_estimate``)."""
    R, H, D = full.a.shape
    to_weights, variance = np.zeros((H, D, R)), np.zeros((H, R, D))
    for h, (left, singular, right_t) in enumerate(zip(*factors)):
        error = np.sqrt(full.error_squared[:, h, 0].sum())
        keep = np.flatnonzero(singular[:rank] > 10.0 * error)
        to_weights[h, :d] = right_t[keep].T @ (left[:, keep] / singular[keep]).T
        predicted = full.variance[:, h, :d, 0]
        directions = (R - len(keep)) * (d - len(keep))  # E's entries the singular values past k show
        scale = 1.0
        if directions > 0:
            quantile = 2.0 * gammaincinv(directions / 2.0, BASIS_NOISE_QUANTILE)  # of chi^2 (scipy.stats: 0.6 s to import)
            bound = float((singular[len(keep):] ** 2).sum()) / quantile
            mean = float(predicted.mean())
            if np.isfinite(bound) and 0.0 < mean < np.inf:  # else as predicted (inf stays inf)
                scale = bound / mean
        variance[h, :, :d] = BASIS_NOISE_MARGIN**2 * scale * predicted + (BASIS_ROUNDING * EPS * singular[0]) ** 2
    return to_weights, variance


def _error_estimate(finals, model) -> tuple[float, float, tuple[float, float], tuple]:
    """The first-order estimate of docs/algorithm.md, 'The targeted schedule' over every final unit (full and subspace
    ones, the latter with their bases' error, :func:`_basis_error`), its part answer noise does not scale (the score
    rounding and that basis term), and the score biases' error (:func:`.diagnostics.first_order_estimate`)."""
    return first_order_estimate(np.concatenate([data.variance for data in finals]),
                                np.concatenate([data.differences for data in finals]),
                                np.concatenate([data.label_error for data in finals]), model)
