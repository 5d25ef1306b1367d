"""The targeted schedule: one head at a time, in float64 (docs/algorithm.md, 'The targeted schedule').

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
constant row and zero-sum orthogonal rows (:func:`draw_patterns`), so their final tokens span R^d
with a well-conditioned design. After each block of rounds the estimate of ``a_h`` is corrected to
fit the log-poles measured so far, when the prior's aim misses by more than ``AIM_TOLERANCE``
(the bridges: ``BRIDGE_AIM_TOLERANCE``; :class:`MinimumNormCorrection`, :func:`correction_blocks`).
Samples ``k = 1, 2, 3`` with ``F(0) = vbar^T x`` known: two determine ``(l_h, tau_h)``, the third
tests that the instance really is single-pole (:mod:`.kernels.single_pole`). Finally the label of
``(h, z)`` is fixed at the consensus of its d instances and every ``m`` refitted with it; with the
label fixed two samples test the single-pole form already, so the float64 first group and every
final unit ask two (:func:`first_copies`, :class:`FinalDesign`).

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
   gives the rough ``v_h`` equal components in every column (:func:`balanced_basis`): a z nearly
   orthogonal to ``v_h`` would make ``l_h`` small next to the oracle's rounding of ``v_h^T y``.
   The other heads' ``a_g(z) = W_g^T z`` come from the rough model; the basis is the candidate
   with the least predicted score rounding (:func:`_least_score_rounding`). The target's log-poles
   sit at both edges of its window, ``log 2 +- ln 16``: what the d instances determine least well
   is the scale of ``a_h`` itself, and the spread of the target's log-poles is what fixes it. In
   float64 each instance asks the one copy count that reads its side best (``k = 1, 2, 4``) and
   every eighth two, whose fits give the unit's label and test the single-pole form; every
   instance is read with the label fixed (:class:`FinalDesign`, docs/algorithm.md, 'The final instances'). Noisier
   answers: ``log 2 +- 2``, two copy counts in every instance.

Queries: ``d`` + phase 1 (about ``H (d + 15)`` plus line grids) + ``2 H d`` (first; ``3 H d`` on
answers noisier than float64, :func:`first_copies`) + ``(d + 1) H (d - 1)`` (bridges) +
``H d (d + ceil(d / 8))`` (final; ``2 H d^2`` on noisier answers): about ``2.1 H d^2``, 0.55 to 0.7
times the paper's ``4 H d^2 - 2 H + 1`` at d >= 16. Every count reported is measured at the oracle
boundary.

H > d is refused: the H conditions on x need H <= d (saturating some heads towards ``y``
instead would lift that, at one more unknown per instance; not implemented).
"""

from __future__ import annotations

import numpy as np

from ...run.calibration import PERMUTED, permutation_spread, permuted_probes
from ...models.attention import MultiHeadAttention
from ...numerics import float64 as float64_kernel
from ...oracle.queries import one_token_queries, random_basis
from ..base import Outcome, Schedule
from .bases import balanced_basis
from .designs import FinalDesign, final_unit_queries, first_copies
from .diagnostics import TargetedDetails, final_error_estimate, instance_diagnostics, targeted_checks
from .linesearch import CENTER_COPIES, locate_heads
from .measure import GroupMeasurements, HeadsAt, measure_units, shared_estimates
from .prober import Prober
from .tolerances import EPS, GROUP_SCALE, RESIDUAL_LIMIT, answer_unit, limits, score_unit

#: Groups (differences z_1) phase 1 searches at most while heads are missing (:func:`line_search`);
#: on noisy answers (float32) ``NOISY_GROUP_ATTEMPTS``: a label ``v_h^T z_1`` of a few percent of
#: the others' hides its step in the answers' rounding there, or a centre blended with a neighbour
#: passes for a new head; over 30 float32 GPT-2 layers at d = 64, H = 8 read out to a scalar, 8 first
#: groups failed so, and two layers needed 5 and 7 groups (docs/algorithm.md, 'Narrow heads').
GROUP_ATTEMPTS, NOISY_GROUP_ATTEMPTS = 4, 8
#: :func:`lines_unit`: a calibration noise reading this many times the run-scale probes' is a misreading.
MISREAD_NOISE = 4.0


class TargetedSchedule(Schedule):
    """``extract(..., schedule="targeted")``: float64, H <= d (see the module docstring)."""

    name = "targeted"
    accepts = frozenset({"answer_error", "refine"})
    #: its queries are few-sample instances on huge tokens, kept only as a sample: the refinement
    #: (docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement, verification') fits the polish
    #: queries alone
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
        the run has read them) + ``(d + 1) H (d - 1)`` (bridges) + ``H d (d + ceil(d / 8))`` (final:
        d units per head of d rounds, 1 query each and 2 in every eighth; 2 in each on noisier
        answers). Phase 1 (the line search, about ``H (d + 15)`` plus line grids) is adaptive and
        comes on top."""
        d, H = self.d, self.max_heads
        return d + len(first_copies(self.unit)[0]) * H * d + (d + 1) * H * (d - 1) + H * d * final_unit_queries(d, self.unit <= EPS)

    @property
    def promised_max_length(self) -> int:
        return max(CENTER_COPIES) + 1

    @property
    def count_formula(self) -> str:
        return ("targeted d + 2Hd (3Hd on noisy answers) + (d+1)H(d-1) + Hd(d + ceil(d/8)) (2Hd^2 on noisy "
                "answers) after the adaptive phase 1")

    def fixed_queries(self) -> list[np.ndarray]:
        # The one-token queries are fixed; the rest is adaptive and replays query by query.
        return one_token_queries(self.vbar_basis)

    def run(self, boundary, arithmetic) -> Outcome:
        prober = Prober(boundary, self.d, self.token_scale, self.promised_queries)
        prober.learn_vbar(self.vbar_basis)
        self.unit = prober.unit = answer_unit(self.settings, boundary.stats)
        prober.score_unit = score_unit(self.settings, boundary.stats)
        search, stages, model, finite = _run(prober, self.d, self.max_heads, self.rng, self.token_scale)
        H = len(search.heads)
        instances = instance_diagnostics(stages, model, prober.unit)
        measurements = [data for _, data in stages]
        error_estimate, unscaled_estimate, bias_error, score_deviations = (
            final_error_estimate(stages[-1][1], model) if model is not None else (np.inf, 0.0, (0.0, 0.0), None))
        answers = np.asarray(prober.answers, dtype=np.float64)
        checks = targeted_checks(instances, search, H, self.settings.heads, measurements, prober.unit)
        return Outcome(model, H, error_estimate, TargetedDetails(instances, search), prober.sequences, answers,
                       checks, unscaled_estimate=unscaled_estimate, bias_error=bias_error,
                       score_deviations=score_deviations)

    def thresholds(self) -> tuple[float, float]:
        return limits(self.unit)

    def hints(self, failed: set[str]) -> list[str]:
        unit = self.unit
        if not failed or unit <= EPS:
            return []
        bits = -np.log2(unit)
        said = (f"The answers carry noise of about {unit:.2g} relative ({bits:.0f} bits; bfloat16 has 8, float16 11, float32 24) "
                "measured before the run, and the targeted instances sized to it did not hold")
        if bits < 20:
            return [said + ": below about 20 bits the single-pole fits of one read-out cannot see the heads "
                    "(docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'). Answer the "
                    "layer's whole output (TorchOracle(layer) without readout): "
                    "at 8 or 11 bits the run then learns it from the vectors (docs/algorithm.md, "
                    "'Whole answers at 8 or 11 bits: saturated lines, then least squares'); or use a float32 or better "
                    "copy."]
        return [said + " (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16': float32 "
                       "layers pass at d <= 32 with few heads, not every one at "
                "d = 32, H = 8). A float64 copy of the layer, where you have one, extracts to 1e-14; or try "
                "another seed."]


def lines_unit(prober, d: int, rng, token_scale: float) -> float:
    """The answers' unit phase 1's lines are sized by (docs/algorithm.md, 'Narrow heads'):
    ``prober.unit``, or on answers whose bits are below float64 the noise ``PERMUTED`` permutation
    probes show at the run's token scale (never below the bits' unit) where ``prober.unit`` is more
    than ``MISREAD_NOISE`` times that: two maxima over 4 pairs differ by chance by a factor of a
    few, and a phase 1 sized otherwise than the calibration says would move every run for nothing.

    The calibration reads the noise at the default token norm ``d^(1/4)``, where a trained layer's
    answers are mostly its biases; read out to a scalar they cancel, and a float32 GPT-2 layer at
    d = 64, H = 8 read 1.2e-6 there against 0.8e-7..1.4e-7 at its token scale: its lines then could
    not read heads with labels below about 14, and phase 1 missed one in every group. The probes
    are queries of the run (counted); their tokens come from a jumped copy of ``rng``, so the
    run's own stream is not moved."""
    stats = prober.boundary.stats
    if prober.unit <= EPS or stats.precision_name == "float64":
        return prober.unit
    generator = np.random.Generator(rng.bit_generator.jumped())
    tokens = [prober.quantize(generator.standard_normal((5, d)) * token_scale / np.sqrt(d)) for _ in range(PERMUTED)]
    permuted, _ = permutation_spread(prober.ask(permuted_probes(tokens, repeated=0), "phase 1: permutation probes"))
    reading = max(stats.unit_roundoff, permuted)
    return reading if prober.unit > MISREAD_NOISE * reading else prober.unit


def line_search(prober, d: int, max_heads: int, rng, token_scale: float):
    """Phase 1 in one group: the groups' differences ``Z`` and the heads located along lines in
    group ``z_1`` (:func:`.linesearch.locate_heads`)."""
    Z = prober.quantize(random_basis(rng, d, GROUP_SCALE * token_scale))
    z1 = Z[:, 0]
    search = locate_heads(lambda points, ks: prober.gaps(points, np.tile(z1, (len(points), 1)), ks, "phase 1: lines"),
                          z1, max_heads, rng, token_scale, prober.quantize, unit=prober.unit)
    return Z, search


def held_fraction(first: GroupMeasurements) -> float:
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
    ``v_h^T z_1`` too small for its step to stand out of the answers' rounding (a head missed), and under
    float32 noise a centre contaminated by a neighbour of similar label can pass for a new head (a
    head counted twice, another never searched for, and the first group's instances unsaturated). Either way the run
    would fail loudly. So while fewer than ``max_heads`` heads were found, or some first-group
    instance did not hold (:func:`held_fraction`), phase 1 starts again in a fresh group (a new
    ``Z``), up to ``GROUP_ATTEMPTS`` groups (``NOISY_GROUP_ATTEMPTS`` on noisy answers); the attempt
    with the most heads, then the most held
    first-group instances, is kept (the earliest on a tie). A run whose first group holds asks
    one group only; a bound ``max_heads`` above the canonical count pays the extra groups' lines
    (docs/algorithm.md, 'The targeted schedule')."""
    position = lambda: prober.boundary.position  # noqa: E731
    before = position()
    attempts, lines = [], 0
    unit, line_unit = prober.unit, lines_unit(prober, d, rng, token_scale)
    for _ in range(GROUP_ATTEMPTS if prober.unit <= EPS else max(GROUP_ATTEMPTS, NOISY_GROUP_ATTEMPTS)):
        prober.unit = line_unit
        try:
            Z, search = line_search(prober, d, max_heads, rng, token_scale)
        finally:
            prober.unit = unit
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
    # phase 1's queries: every group's lines and the first groups given up, not the kept one (docs/algorithm.md, 'The
    # targeted schedule')
    search.queries = position() - before - kept
    return Z, search, first


def targeted_first_group(prober: Prober, d: int, max_heads: int, rng, token_scale: float, copies=None):
    """:func:`first_group` with the targeted instances of docs/algorithm.md, 'The targeted schedule' in R^d (``copies``:
    as :func:`measure_units`'s; the targeted schedule's own run passes :func:`first_copies`)."""
    def measure(Z, search):
        rough = np.array([head.direction for head in search.heads])
        return measure_units(prober, *shared_estimates(Z[:, :1].T, rough[None]), rng, bridge=False, copies=copies, block=1)
    return first_group(prober, d, max_heads, rng, token_scale, measure)


def bridge_step(first: GroupMeasurements) -> float:
    """eps of the bridges ``z_1 + eps z_j``: a power of two with ``eps |a_h| |x| <= 2``."""
    a1 = first.a[0]
    return float(2.0 ** np.floor(np.log2(2.0 / (np.linalg.norm(a1, axis=1).max() * first.x_norm.max()))))


def _run(prober: Prober, d: int, max_heads: int, rng, token_scale: float):
    """Phase 1, the first group, the bridges and the final instances (see the module docstring).
    Returns ``(line search report, [(stage, measurements)], model or None, finite)``."""
    Z, search, first = targeted_first_group(prober, d, max_heads, rng, token_scale, first_copies(prober.unit))
    if first is None:
        return search, [], None, False
    H = len(search.heads)
    a1 = first.solve()[0]
    labels1 = first.consensus_labels()[0][0]
    stages = [("first", first)]

    # --- bridges z_1 + eps z_j: rough a_h(j) and l_h(j), heads named as in group z_1; rough W, v.
    rough_a, rough_l = a1[None], labels1[None]  # (groups, H, d), (groups, H)
    if d > 1 and np.isfinite(a1).all():
        eps_bridge = bridge_step(first)
        bridge_z = prober.quantize(Z[:, :1].T + eps_bridge * Z[:, 1:].T)  # (d - 1, d)
        bridges = measure_units(prober, *shared_estimates(bridge_z, np.broadcast_to(a1, (d - 1,) + a1.shape)), rng, bridge=True)
        stages.append(("bridge", bridges))
        # a_h(z_1 + eps z_j) - a_h(z_1) = eps a_h(z_j) (+ the rounding of the bridge difference, 2^-40 relative)
        rough_a = np.concatenate([rough_a, (bridges.solve() - a1[None]) / eps_bridge])
        rough_l = np.concatenate([rough_l, (bridges.label[:, :, 0] - labels1[None]) / eps_bridge])
    model, finite = None, bool(np.isfinite(rough_a).all() and np.isfinite(rough_l).all())
    if finite:
        W_rough, v_rough = float64_kernel.assemble(Z, np.eye(d), rough_a.transpose(1, 0, 2), rough_l.T)

        # --- final: each head in its own basis, balanced for its label (every |v_h^T z| alike).
        scale = GROUP_SCALE * token_scale
        bases = np.array([prober.quantize(balanced_basis(v_rough[h], rng, scale, W_rough, h))
                          for h in range(H)])  # (H, d, d)
        differences = bases.transpose(2, 0, 1)  # (d groups, H, d): differences[g, h] = column g of head h's basis
        final = measure_units(prober, differences, HeadsAt(W_rough, differences), rng, bridge=False,  # a_f(z) = W_f^T z
                              W_score=W_rough, designer=FinalDesign)
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
