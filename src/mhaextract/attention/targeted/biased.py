"""The targeted schedule for the model with biases (docs/algorithm.md, 'Biases: affine scores and an output constant'
and 'The targeted schedule').

With score biases ``u_h`` and an output constant ``c`` ('Biases: affine scores and an output constant') a
copies-instance with final token x and difference z keeps the form of 'One instance: copies of a token and a rational
function': the one-token query ``(x)`` answers ``c + vbar^T x``, and

    G(k) = c + vbar^T x - F(k) = sum_h k l_h / (k + tau_h),   log tau_h = m_h = a_h^T x + b_h,

with ``a_h = W_h^T z``, ``b_h = u_h^T z`` and ``l_h = v_h^T z``: the log-pole is *affine* in the
final token. Everything of 'The targeted schedule' carries over in the lifted coordinates ``x~ = (x, 1)``,
``a~_h = (a_h, b_h)``, ``m_h = a~_h^T x~``:

* ``c`` and ``vbar`` from ``d + 1`` one-token queries (the zero vector gives c);
* phase 1 (lines) is unchanged: along a line the log-pole is still affine, and readings around a
  centre measure differences of log-poles, in which ``b_h`` cancels; the centre's own log-pole
  gives the rough ``b_h = m_h - a_h^T x_c``;
* each unit (head, z) asks ``d + 1`` instances (one more than 'The targeted schedule'): the designs aim
  ``a_g^T x = s_g - b_g`` (the offsets measured like the slopes), their lifted final tokens are
  the columns of a pattern whose constant row is the lifted coordinate, and ``a~_h`` solves the
  square system ``X~ a~ = m``;
* the final bases give ``W_h = Z_h^{-T} [a_h(z_j)]^T`` and ``u_h = Z_h^{-T} [b_h(z_j)]``.

Queries after phase 1, with H heads found: ``(d + 1) + 2H(d + 1)`` (first group; ``3H(d + 1)`` on
answers noisier than float64) ``+ (d + 2) H (d - 1)`` (bridges) ``+ 2 H d (d + 1)`` (final); the longest
query has 5 tokens (phase 1's ``k = 4``).
The design, fit and check code is the targeted schedule's own (:mod:`.schedule`); only the lifted
design (:class:`AffineDesign`), the prober that knows c, and the run's assembly live here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ...models.attention import MultiHeadAttention
from ...numerics import float64 as float64_kernel
from ...numerics import single_pole
from ...oracle.queries import one_token_queries
from ..base import Outcome
from .linesearch import MAX_READING_LOG_POLE
from .bases import balanced_basis, bias_balanced_scale
from .designs import FinalRounds, final_unit_queries, first_copies, FullDesign
from .diagnostics import final_error_estimate, instance_diagnostics, targeted_checks, TargetedDetails
from .measure import HeadsAt, measure_units, shared_estimates
from .patterns import (
    design_tokens, draw_patterns, draw_patterns_per_head, MinimumNormCorrection, NullSpace, other_heads_frame,
)
from .prober import Prober
from .schedule import bridge_step, first_group, TargetedSchedule
from .tolerances import (
    EPS, GROUP_SCALE, SATURATION_SPREAD, answer_unit, score_unit,
)


class AffineProber(Prober):
    """A :class:`~.prober.Prober` for the biased model: knows ``c`` as well as ``vbar``, and takes
    final tokens and differences either in R^d or lifted to R^(d+1) (last coordinate 1 for final
    tokens, 0 for differences; the oracle is asked the first d coordinates)."""

    c0 = 0.0

    def learn_vbar(self, basis: np.ndarray) -> None:
        """``c`` from the one-token query of the zero vector, ``vbar`` from ``f((b_i)) = c + vbar^T b_i``."""
        answers = self.ask([np.zeros((1, self.d))] + one_token_queries(basis), "one-token queries (c, vbar)")
        self.c0 = float(answers[0])
        self.vbar = float64_kernel.solve_transposed(basis, answers[1:] - self.c0)

    def quantize(self, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if values.shape[-1] == self.d:
            return super().quantize(values, out)
        if out is None:
            out = values.copy()
        elif out is not values:
            out[..., self.d:] = values[..., self.d:]
        super().quantize(values[..., :self.d], out[..., :self.d])
        return out

    def rounds_gaps(self, finals, differences, copies, description="targeted instances"):
        if finals.shape[-1] == self.d + 1:
            if not (np.all(finals[..., self.d] == 1.0) and np.all(differences[:, self.d] == 0.0)):
                raise AssertionError("lifted final tokens must end in 1 and differences in 0")
            finals, differences = finals[..., :self.d], differences[:, :self.d]
        return [(gaps + self.c0, rounding)  # c's rounding is in systematic()
                for gaps, rounding in super().rounds_gaps(finals, differences, copies, description)]

    def systematic(self, finals: np.ndarray) -> np.ndarray:
        """The anchor's and ``c``'s rounding: both common to an instance's samples."""
        return super().systematic(finals[..., :self.d]) + 4 * self.unit * abs(self.c0)


class AffineDesign(FullDesign):
    """Designs of units measuring ``a~_h(z) = (W_h^T z, u_h^T z)`` in lifted coordinates: ``d + 1``
    instances per unit (module docstring). ``current`` (U, H, d + 1) are the lifted estimates."""

    def __init__(self, current: np.ndarray, heads: np.ndarray, patterns: np.ndarray):
        U, H, D = current.shape
        self.current, self.heads, self.units = current, heads, np.arange(U)
        self.rounds, self.pattern = D, patterns
        self.prior = current[self.units, heads].copy()
        # Null part in R^d off the H slopes, from pattern rows H + 1.. (row H is the lifted coordinate).
        self.null_space = NullSpace(current[:, :, :D - 1])
        self.correction = MinimumNormCorrection(U, D)
        self.frame = other_heads_frame(current[:, :, :D - 1], heads)  # only the target's row is corrected

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, D, D) with D = ``d`` here the lifted dimension: row H constant (the lifted
        coordinate); written into ``out`` (contiguous) when given."""
        return draw_patterns(rng, d, H, groups * H, out=None if out is None else out.reshape(groups * H, d, d)
                         ).reshape(groups, H, d, d)

    def constant_rows(self) -> np.ndarray:
        return np.full(len(self.heads), self.current.shape[1])

    def design(self, block: slice, out: np.ndarray | None = None) -> np.ndarray:
        """``a_g^T x = value_g - b_g``: the design of docs/algorithm.md, 'The targeted schedule' in R^d with the offsets
        moved to the right-hand side (expressed as a shift of the pattern columns), then lifted with an exact 1 (U, b,
        d + 1); written into ``out`` when given."""
        U, H, D = self.current.shape
        slopes, offsets = self.current[:, :, :D - 1], self.current[:, :, D - 1]
        columns = self.pattern[:, :H, block] - offsets[:, :, None] / SATURATION_SPREAD
        columns[self.units, self.heads] = (self.pattern[self.units, self.heads, block]
                                           - offsets[self.units, self.heads][:, None] / self.halfwidth)
        null_part = self.null_space.parts(self.pattern[:, H + 1:, block].transpose(0, 2, 1), self.frame[3],
                                          self.null_space.workspace(block))
        if out is None:
            out = np.empty((U, columns.shape[2], D))
        design_tokens(slopes, self.heads, columns, null_part, self.frame, self.halfwidth, out[:, :, :D - 1])
        out[:, :, D - 1] = 1.0
        return out


class AffineFinalDesign(FinalRounds, AffineDesign):
    """The final stage's lifted units (:class:`.designs.FinalRounds` in the coordinates of docs/algorithm.md, 'Biases:
    affine scores and an output constant'): ``d + 1`` rounds, the centre first."""

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, D, D), D = ``d`` the lifted dimension: row H constant, row h the target's sides."""
        return draw_patterns_per_head(rng, d, groups, [H] * H, range(H), out)


def lift(vectors: np.ndarray, last: float) -> np.ndarray:
    """Rows of ``vectors`` (..., d) with one more coordinate ``last``."""
    return np.concatenate([vectors, np.full(vectors.shape[:-1] + (1,), last)], axis=-1)


def lifted_scores(W: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``W~_h = [[W_h, u_h], [0, 0]]`` (H, d + 1, d + 1): ``W~_h^T (z, 0) = (W_h^T z, u_h^T z)`` and
    ``(y, 1)^T W~_h (x, 1) = y^T (W_h x + u_h)``."""
    H, d, _ = W.shape
    out = np.zeros((H, d + 1, d + 1))
    out[:, :d, :d], out[:, :d, d] = W, u
    return out


def assemble_affine(Z: np.ndarray, a: np.ndarray, labels: np.ndarray):
    """``W_h = Z^{-T} [a_h(z_j)]^T``, ``u_h = Z^{-T} [b_h(z_j)]``, ``v_h = Z^{-T} l_h`` for lifted
    ``a`` (groups j, H, d + 1) and labels (groups j, H) over the columns z_j of Z."""
    d = Z.shape[0]
    W, v = float64_kernel.assemble(Z, np.eye(d), a[:, :, :d].transpose(1, 0, 2), labels.T)
    u = float64_kernel.solve_transposed(Z, a[:, :, d]).T
    return W, v, u


#: Noisy answers: a head's offset b_h is read at ``(1 - OFFSET_SHRINK) x_c`` (its centre pulled towards 0).
OFFSET_SHRINK = (0.25, 0.0625)


def _offset(prober: AffineProber, z: np.ndarray, head) -> float:
    """The rough offset ``b_h = m_h(x_c) - a_h^T x_c`` of a head found at centre ``x_c``.

    In float64 from the centre's log-pole and the rough direction. With noisy answers (float32
    layers) the direction is only good to ~1e-2 (its readings inherit the score rounding of tokens
    at ``16 token_scale``, ~1e-3 in m) and ``|a_h| |x_c|`` is ~1e4: b would be wrong by tens to
    hundreds, and the first group's designs would leave other heads unsaturated. Instead read ``m_h`` at
    ``lam x_c``: ``m_h(lam x_c) = lam (m_c - b) + b`` (affine, no direction involved), so
    ``b = (m(lam) - lam m_c) / (1 - lam)``, with ``1 - lam`` small enough that head h stays in its
    window and the other heads (|m_g| ~ |a_g^T x_c|, hundreds) stay saturated. One query per head."""
    rough = float(head.log_pole - head.direction @ head.center)
    if prober.unit <= EPS:
        return rough
    for shrink in OFFSET_SHRINK:
        lam = 1.0 - shrink
        x = prober.quantize(lam * head.center)
        lam_actual = float(x @ head.center / (head.center @ head.center))
        gap = prober.gaps(x[None], z[None], (1,), "phase 1: offsets")[0][0, 0]
        m = float(single_pole.reading(gap, head.plateau, head.label))
        if np.isfinite(m) and abs(m) <= MAX_READING_LOG_POLE:
            # the quantized point is lam x_c plus a tiny residue across x_c: its log-pole part is
            # carried by the rough direction
            residue = x - lam_actual * head.center
            return (m - head.direction @ residue - lam_actual * head.log_pole) / (1.0 - lam_actual)
    return rough


def affine_first_group(prober: AffineProber, d: int, max_heads: int, rng, token_scale: float, copies=None):
    """Phase 1 in R^d, then the first group ``z_1`` with lifted targeted instances
    (:func:`.schedule.first_group`: a fresh group while heads are missing or instances did not hold;
    ``copies`` as :func:`.measure.measure_units`'s, :func:`.designs.first_copies` in :func:`run_affine`)."""
    def measure(Z, search):
        rough = np.array([np.append(head.direction, _offset(prober, Z[:, 0], head)) for head in search.heads])
        return measure_units(prober, *shared_estimates(lift(Z[:, :1].T, 0.0), rough[None]), rng, bridge=False, designer=AffineDesign,
                        copies=copies, block=1)  # phase 1's rough prior: aimed round by round (few units)
    return first_group(prober, d, max_heads, rng, token_scale, measure)


def run_affine(prober: AffineProber, d: int, max_heads: int, rng, token_scale: float):
    """Phase 1, first group, bridges and final instances in lifted coordinates (module docstring).
    Returns ``(line search report, [(stage, measurements)], model or None, lifted W~ or None)``."""
    Z, search, first = affine_first_group(prober, d, max_heads, rng, token_scale, first_copies(prober.unit))
    if first is None:
        return search, [], None, None
    H = len(search.heads)
    a1, labels1 = first.solve()[0], first.consensus_labels()[0][0]
    stages = [("first", first)]
    rough_a, rough_l = a1[None], labels1[None]
    if d > 1 and np.isfinite(a1).all():
        eps_bridge = bridge_step(first)
        bridge_z = lift(prober.quantize(Z[:, :1].T + eps_bridge * Z[:, 1:].T), 0.0)
        bridges = measure_units(prober, *shared_estimates(bridge_z, np.broadcast_to(a1, (d - 1,) + a1.shape)), rng, bridge=True,
                           designer=AffineDesign)
        stages.append(("bridge", bridges))
        rough_a = np.concatenate([rough_a, (bridges.solve() - a1[None]) / eps_bridge])
        rough_l = np.concatenate([rough_l, (bridges.label[:, :, 0] - labels1[None]) / eps_bridge])
    if not (np.isfinite(rough_a).all() and np.isfinite(rough_l).all()):
        return search, stages, None, None
    W_rough = lifted_scores(*assemble_affine(Z, rough_a, rough_l)[::2])
    v_rough = assemble_affine(Z, rough_a, rough_l)[1]
    scale = GROUP_SCALE * token_scale
    if prober.unit > EPS:  # noisy answers: u_h read as well as W_h (docs/algorithm.md, 'Narrow heads')
        scale = bias_balanced_scale(W_rough, Z, scale)
    bases = np.array([prober.quantize(balanced_basis(v_rough[h], rng, scale, W_rough, h)) for h in range(H)])
    differences = lift(bases.transpose(2, 0, 1), 0.0)  # (d groups, H, d + 1)
    final = measure_units(prober, differences, HeadsAt(W_rough, differences), rng, bridge=False,  # a~_f(z)
                          W_score=W_rough, designer=AffineFinalDesign)
    stages.append(("final", final))
    a_final, labels_final = final.solve(), final.consensus_labels()[0]  # (d, H, d + 1), (d, H)
    if not (np.isfinite(a_final).all() and np.isfinite(labels_final).all()):
        return search, stages, None, None
    W, v, u = np.empty((H, d, d)), np.empty((H, d)), np.empty((H, d))
    for h in range(H):
        W_h, v_h, u_h = assemble_affine(bases[h], a_final[:, h:h + 1], labels_final[:, h:h + 1])
        W[h], v[h], u[h] = W_h[0], v_h[0], u_h[0]
    return search, stages, MultiHeadAttention(W, v, u, prober.c0), lifted_scores(W, u)


class BiasedTargetedSchedule(TargetedSchedule):
    """``extract(..., schedule="targeted")`` with ``bias=True``: the model of docs/algorithm.md, 'Biases: affine scores
    and an output constant' in float64, H <= d. ``refine=True`` polishes W, v, u and c by least squares on fresh queries
    ('Approximate answers: certificate, oversampling, refinement, verification')."""

    @property
    def promised_queries(self) -> int:
        """After phase 1, with H0 heads: ``(d + 1) + 2H(d + 1) + (d + 2)H(d - 1) + Hd(D + ceil(D / 8))``,
        ``D = d + 1`` (first group: ``3H(d + 1)`` on answers noisier than float64,
        :func:`.designs.first_copies`; final: d units per head of D rounds, 1 query each and 2 in
        every eighth, :func:`.designs.final_copies`; ``2HdD`` on noisier answers)."""
        d, H = self.d, self.max_heads
        first = len(first_copies(self.unit)[0])
        return (d + 1) + first * H * (d + 1) + (d + 2) * H * (d - 1) + H * d * final_unit_queries(d + 1, self.unit <= EPS)

    @property
    def count_formula(self) -> str:
        return ("targeted with biases (d+1) + 2H(d+1) (3H(d+1) on noisy answers) + (d+2)H(d-1) + Hd(D + ceil(D/8)), "
                "D = d+1 (2HdD on noisy answers) after the adaptive phase 1")

    def fixed_queries(self) -> list[np.ndarray]:
        return [np.zeros((1, self.d))] + one_token_queries(self.vbar_basis)

    def run(self, boundary, arithmetic) -> Outcome:
        prober = affine_prober(self, boundary)
        search, stages, model, W_lift = run_affine(prober, self.d, self.max_heads, self.rng, self.token_scale)
        H = len(search.heads)
        instances = instance_diagnostics(stages, None if model is None else SimpleNamespace(W=W_lift), prober.unit)
        error_estimate, unscaled_estimate, bias_error, score_deviations = (
            final_error_estimate(stages[-1][1], model) if model is not None else (np.inf, 0.0, (0.0, 0.0), None))
        answers = np.asarray(prober.answers, dtype=np.float64)
        checks = targeted_checks(instances, search, H, self.settings.heads, [data for _, data in stages], prober.unit)
        return Outcome(model, H, error_estimate, TargetedDetails(instances, search), prober.sequences, answers,
                       checks, unscaled_estimate=unscaled_estimate, bias_error=bias_error,
                       score_deviations=score_deviations)


def affine_prober(schedule, boundary) -> AffineProber:
    """The prober of a biased targeted-family schedule: c and vbar learned, its units set from the
    answers (the schedule's ``unit`` too, which sizes its thresholds)."""
    prober = AffineProber(boundary, schedule.d, schedule.token_scale, schedule.promised_queries)
    prober.learn_vbar(schedule.vbar_basis)
    schedule.unit = prober.unit = answer_unit(schedule.settings, boundary.stats)
    prober.score_unit = score_unit(schedule.settings, boundary.stats)
    return prober
