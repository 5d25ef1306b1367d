"""The finishing step every schedule shares (docs/algorithm.md, 'The lean schedule' to 'The targeted schedule', 'Biases:
affine scores and an output constant' and 'The whole layer: vector outputs and a replacement module').

After a schedule's :class:`~mhaextract.attention.base.Outcome`: the certificate, the refinement
(least squares on the schedule's and fresh polish answers), the answers' noise and the error
estimate, the common checks, the default verification's judgement ('Default verification on fresh long queries') and,
for an oracle answering vectors, the whole model ('The whole layer: vector outputs and a replacement module')::

    Outcome -> certificate -> refinement -> noise, error estimate -> checks -> Extraction
            -> (vector answers) value fit -> the whole model
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from ..run.calibration import Calibration
from ..checks.base import (
    Check, CheckPolicy, answers_residual_check, error_estimate_check, finite_check, uncertified_error_limit,
)
from ..checks.certificate import Certificate, least_squares_certificate
from ..checks.diagnosis import answers_check
from ..checks.noise_probe import redundancy_estimate, scaled_estimate
from ..checks.refine import (
    POLISH_FACTOR, POLISH_LONGEST, POLISH_SCALE, answer_scales, jacobian_solver, parameter_count,
    refine_least_squares, residuals,
)
from ..checks.verify import LongVerification
from ..models.compare import compare
from ..models.attention import MultiHeadAttention
from ..numerics.enclosure import balls_reproduce_answers, exact_model
from ..numerics.float64 import root_mean_square
from ..oracle.answer_stats import FLOAT64_UNIT
from ..oracle.boundary import OracleBoundary
from ..oracle.queries import random_queries
from ..oracle.vector_answers import VectorAnswers
from ..run.value_fit import VALUE_QUERY_LENGTHS, fit_values, value_query_count
from .result import Extraction
from .base import RESOLVED, Outcome, RunSettings, Schedule
from .grid import MORE_POLES
from .registry import Choice
from ..run.validation import spawn_rng


#: Estimated answer noise below this fraction of the largest answer (1e3 units of float64 rounding)
#: is float64 rounding: the existing checks judge it, the validity check is only added above it
#: (or when the caller declares answer_error).
ROUNDING_REGIME = 1e3 * FLOAT64_UNIT
#: The refinement weighs answer q by 1 / max(its computation's size, WEIGHT_FLOOR x the median size).
WEIGHT_FLOOR = 1e-2


@dataclass(frozen=True)
class Spent:
    """What the run chose and spent beyond its schedule: the schedule choice (and its reason), the
    token-scale calibration (its probes count like every other query), the oracle's answer dtype,
    the default verification's queries and answers (asked once, judged by :func:`finish` for the
    model the run keeps; docs/algorithm.md, 'Default verification on fresh long queries')."""

    choice: Choice
    calibration: Calibration | None
    answer_dtype: str
    probes: OracleBoundary | None = None  # the calibration's boundary (its counts), or None
    verification: LongVerification | None = None

    @property
    def queries(self) -> int:
        """The calibration's answers used (asked or read back from the transcript)."""
        return 0 if self.calibration is None else self.calibration.queries

    @property
    def asked(self) -> int:
        """Queries the calibration's boundary asked of the oracle (a resume check's re-asks included)."""
        return 0 if self.probes is None else self.probes.queries

    @property
    def replayed(self) -> int:
        return 0 if self.probes is None else self.probes.replayed

    @property
    def longest(self) -> int:
        return 0 if self.calibration is None else self.calibration.max_query_length


def polish_count(settings: RunSettings) -> int:
    """The refinement's fresh queries: ``refine_queries``, else ``POLISH_FACTOR`` (6) per parameter
    refined, ``6 H0 (d^2 + d)`` (bias-free) or ``6 (H0 (d^2 + 2d) + 1)`` (with u_h and c), at least 32."""
    if settings.refine_queries is not None:
        return settings.refine_queries
    return max(32, POLISH_FACTOR * parameter_count(settings.max_heads, settings.d, settings.bias))


def noisy_polish_count(plan: Schedule) -> int:
    """The polish queries of a refinement the answers' noise decided (``Schedule.refines_when_noisy``):
    ``refine_queries`` when given, else ``noisy_polish_factor`` per parameter (lean 1: ``H0 (d^2 + d)``;
    paper 0: it keeps its exact count and refines on its own answers)."""
    settings = plan.settings
    if settings.refine_queries is not None:
        return settings.refine_queries
    return plan.noisy_polish_factor * parameter_count(settings.max_heads, settings.d, settings.bias)


#: The refinement a schedule decides by itself (``refine=None``) runs only within the grid
#: schedules' float64 envelope, H0 <= 3 (docs/algorithm.md, 'Numerics in float64 and the token scale'), and while its
#: Jacobian stays below this many entries: outside it the algebra's start is no start (its links' misfit taken
#: for noise, a long refinement to a fit further off).
SELF_REFINE_MOST_HEADS, SELF_REFINE_ENTRIES = 3, 10_000_000


def _refinement_affordable(plan: Schedule, outcome: Outcome) -> bool:
    """H0 <= ``SELF_REFINE_MOST_HEADS`` and (answers + polish queries) x parameters <= ``SELF_REFINE_ENTRIES``."""
    settings = plan.settings
    parameters = parameter_count(settings.max_heads, settings.d, settings.bias)
    rows = len(outcome.sequences) + plan.noisy_polish_factor * parameters
    return settings.max_heads <= SELF_REFINE_MOST_HEADS and rows * parameters <= SELF_REFINE_ENTRIES


def _refines_when_noisy(plan: Schedule, certificate, probe, scale: float, outcome: Outcome | None = None) -> bool:
    """float64, a schedule that refines when noisy (lean, paper), ``refine=None`` (neither asked
    for nor refused), and noisy answers: ``answer_error`` declared, or noise above
    ``ROUNDING_REGIME`` (1e3 units of rounding of the largest answer): the noise probe's misfit
    (lean; on an exact oracle it can pass its own 16 units) or 3 x the
    links' noise estimate (paper; docs/algorithm.md, 'The lean schedule' and 'Approximate answers: certificate,
    oversampling, refinement, verification')."""
    settings = plan.settings
    if not plan.refines_when_noisy or settings.refine is not None or settings.precision is not None:
        return False
    if outcome is not None and not _refinement_affordable(plan, outcome):
        return False
    return (settings.answer_error is not None or (probe is not None and probe[0] > ROUNDING_REGIME * probe[1])
            or (certificate is not None and 3.0 * certificate.noise_estimate > ROUNDING_REGIME * scale))


def refinement_queries(boundary: OracleBoundary, settings: RunSettings, plan: Schedule, outcome: Outcome):
    """Fresh random queries for the refinement (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
    refinement, verification'), counted like every other; a stream of the seed independent of the schedule's. Short (2
    to ``min(POLISH_LONGEST, longest)`` tokens, never longer than the schedule's own) and at the run's token scale:
    small answers, whose float64 rounding is small, and a well-conditioned least-squares design."""
    if not settings.refine or outcome.model is None:
        return [], np.zeros(0)
    count = polish_count(settings)
    longest = max(2, min(POLISH_LONGEST, plan.promised_max_length))
    sequences = random_queries(spawn_rng(settings.seed, 1), count, settings.d, POLISH_SCALE * settings.token_scale,
                               (2, longest))
    if not sequences:
        return [], np.zeros(0)
    return sequences, boundary.ask(sequences, description="querying for refinement")


#: Failed checks a refinement can answer: its own estimate and residual replace the algebra's, and
#: it supersedes the algebraic stage's (``SUPERSEDED_BY_FIT``). Any other failed check (declared
#: heads not found, the float64 head limit, no model, uninformative answers) it cannot.
REFINABLE = ("error_estimate", "answers_residual", "noise_within_validity")


def rescued_by_refinement(plan: Schedule, outcome: Outcome, extraction: Extraction) -> bool:
    """float64 paper and lean (``refines_when_noisy``), ``refine=None`` and not refined already, a
    model, and failed checks that a refinement can answer (``REFINABLE``, ``SUPERSEDED_BY_FIT`` but
    ``pole_count`` with more poles than H*): the algebraic result is refined (paper on its own
    answers, no query; lean with its ``H0 (d^2 + d)`` counted polish queries, asked only because
    the run failed) and the refined result, judged by the same checks, is the run's
    (docs/algorithm.md, 'Refined under noise'). Exact answers at H = 3: the algebra's float64
    estimate (paper: 2.6e-4 on a true 5.4e-5; lean: 5.7e-6 on 4e-5, its residual saying so), one
    ambiguous link of 15 or one of 17 instances with another pole count failed models within 2e-7
    of the truth."""
    settings = plan.settings
    if not (plan.refines_when_noisy and settings.refine is None
            and settings.precision is None and outcome.model is not None and not extraction.ok
            and _refinement_affordable(plan, outcome)):
        return False
    # a failed verification alone is no inaccuracy a refinement answers; beside others it may be one
    failed = [check for check in extraction.failed_checks if check.name != "long_verification"]
    return bool(failed) and all(check.name in REFINABLE or (check.name in SUPERSEDED_BY_FIT
                                                            and MORE_POLES not in check.message) for check in failed)


def finish(plan: Schedule, arithmetic, outcome: Outcome, extra, boundary, record, started, spent: Spent,
            probe=None, force_refine=False) -> Extraction:
    """Certificate, refinement, error estimate and checks: the same for every schedule.
    ``force_refine``: refine as :func:`_refines_when_noisy` would (:func:`rescued_by_refinement`)."""
    settings = plan.settings
    # The schedule's queries as it holds them (the grid's are built on demand, CopiesQueries), else one list.
    sequences = outcome.sequences if not len(extra[0]) else list(outcome.sequences) + list(extra[0])
    answers = np.concatenate([np.asarray(outcome.answers), np.asarray(extra[1], dtype=outcome.answers.dtype)])
    model, certificate, refinement = outcome.model, None, None
    error_estimate, answers_residual = outcome.error_estimate, np.inf
    if model is not None:
        certificate = plan.certificate(outcome)
        own_scale = 1.0  # the largest of the schedule's own answers (float64 only)
        if settings.precision is None:
            own_scale = float(np.abs(np.asarray(outcome.answers, dtype=np.float64)).max(initial=0.0)) or 1.0
        if force_refine or _refines_when_noisy(plan, certificate, probe, own_scale, outcome):
            # after the noise probe: the polish queries (if any) come last; counted like every other
            plan.settings = settings = dataclasses.replace(settings, refine=True,
                                                           refine_queries=noisy_polish_count(plan))
            extra = refinement_queries(boundary, settings, plan, outcome)
            sequences = list(outcome.sequences) + list(extra[0])
            answers = np.concatenate([np.asarray(outcome.answers),
                                      np.asarray(extra[1], dtype=outcome.answers.dtype)])
        if settings.refine:
            own = len(outcome.sequences) if plan.refines_on_own_answers else 0
            fitted = slice(len(outcome.sequences) - own, None)
            start = certificate
            model, refinement, certificate = _refine(
                model, sequences[fitted], answers[fitted], len(extra[0]), settings.bias, certificate,
                lambda refined, refit: _start_validity(start.verified_against(refined), settings, own_scale,
                                                       refit, plan.alternative_start))
        exact = None if outcome.W_balls is None else exact_model(outcome.W_balls, outcome.v_balls,
                                                                  outcome.u_balls, outcome.c_ball)
        answers_residual = arithmetic.answers_residual(exact or model, sequences, answers)
    magnitudes = np.abs(arithmetic.midpoint(answers))  # once: high-precision midpoints cost O(answers)
    scale = float(magnitudes.max(initial=0.0)) or 1.0
    # the median answer (docs/algorithm.md, 'Numerics in float64 and the token scale')
    typical = float(np.median(magnitudes)) if magnitudes.size else 0.0
    noise, measured = _noise(certificate, settings, probe)
    if noise is not None:
        error_estimate = (certificate.error_bound(noise) if settings.answer_error is not None
                          else certificate.first_order(noise))
    error_estimate, source = _undeclared_noise(settings, error_estimate, certificate, probe, scale,
                                               plan.unit, outcome.unscaled_estimate, typical or scale)
    # The scores' part of the estimate, W's (with v's) and u's as compare reports them (Extraction.score_error): the
    # estimate so far, before the output constant's joins it (whole answers fit c again), u's apart where it is
    score_error = (error_estimate, error_estimate)
    if settings.bias and (refinement is None or refinement.kept != "refined"):
        error_estimate = max(error_estimate, _constant_error(model, measured))
        if outcome.bias_error[0] > 0:  # u's error, scaled to the answers' noise as the rest was
            u_error = _undeclared_noise(settings, outcome.bias_error[0], certificate, probe, scale, plan.unit,
                                        outcome.bias_error[1], typical or scale)[0]
            u_claimed = _bias_error(model, u_error)
            error_estimate = max(error_estimate, u_claimed)
            score_error = (score_error[0], u_claimed)
    deviations = _score_deviations(outcome, settings, certificate, probe, scale, plan.unit, typical or scale)
    explained = error_estimate  # the residual the model's own estimated error explains (_common_checks)
    if plan.residual_evidence and settings.precision is None and model is not None and answers_residual > error_estimate:
        error_estimate, source = _residual_evidence(answers_residual, source)
        # the residual says nothing of which part errs
        score_error, deviations = (error_estimate, error_estimate), None
    checks = plan.checks(outcome, label_noise=measured / scale) + _common_checks(
        plan, outcome, error_estimate, answers_residual, noise, scale, certificate, boundary.stats, source, measured,
        explained)
    if refinement is not None and refinement.kept == "refined":
        checks = _superseded_by_fit(checks, len(sequences))
    verification, long_queries = None, spent.verification
    if long_queries is not None and model is not None:
        unit = max(FLOAT64_UNIT, boundary.stats.unit_roundoff, settings.arithmetic_noise or 0.0)
        check, verification = long_queries.judge(model, error_estimate, answers_residual, measured, scale, unit,
                                                 plan.promised_max_length, settings.seed)
        checks.append(check)
    return Extraction(
        model=model, heads=model.heads if model is not None else outcome.heads,
        queries=boundary.queries + boundary.replayed + spent.asked + spent.replayed,
        queries_asked=boundary.queries + spent.asked, queries_replayed=boundary.replayed + spent.replayed,
        transcript=None if record is None else record.path,
        max_query_length=max(boundary.max_query_length, spent.longest), promised_queries=plan.promised_queries,
        promised_max_length=plan.promised_max_length, promised_formula=plan.count_formula, d=settings.d,
        max_heads=settings.max_heads,
        precision=settings.precision, seed=settings.seed, schedule=plan.name, token_scale=settings.token_scale,
        error_estimate=error_estimate, answers_residual=answers_residual, details=outcome.details, checks=checks,
        W_balls=outcome.W_balls, v_balls=outcome.v_balls, u_balls=outcome.u_balls, c_ball=outcome.c_ball,
        seconds=time.perf_counter() - started, score_error=score_error, score_deviations=deviations,
        certificate=certificate, refinement=refinement, answer_error=settings.answer_error,
        calibration=spent.calibration, calibration_queries=spent.queries, schedule_reason=spent.choice.reason,
        bias=spent.choice.bias, answer_dtype=spent.answer_dtype, verification=verification,
        verification_queries=0 if long_queries is None else long_queries.queries,
        verification_length=0 if long_queries is None else long_queries.longest,
    )


def ask_value_queries(boundary: OracleBoundary, settings: RunSettings, outcome: Outcome):
    """Fresh queries for the value fit (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module'),
    asked whole after the schedule's: (sequences, answers (n, d_out)), or None when the schedule found no model."""
    if outcome.model is None or outcome.model.heads == 0:
        return None
    count = value_query_count(outcome.model.heads, settings.d)
    sequences = random_queries(spawn_rng(settings.seed, 13), count, settings.d, settings.token_scale,
                               VALUE_QUERY_LENGTHS)
    return sequences, boundary.ask(sequences, "value read-outs", whole=True)


def with_values(extraction: Extraction, vectors: VectorAnswers, value_queries, plan: Schedule,
                 boundary: OracleBoundary, spent: Spent) -> Extraction:
    """The vector model (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module'): the schedule's
    scores with ``V_h`` and ``c`` fitted to whole answers of fresh queries; its estimate and checks join the run's, and
    the default verification judges it on the whole answers."""
    settings = plan.settings
    scalar = extraction.model
    if scalar is not None and vectors.d_out == 1:  # r = (1,): the schedule's v_h is V_h itself
        whole = MultiHeadAttention(scalar.W, scalar.v[:, None, :], scalar.u, np.array([scalar.c]))
        return dataclasses.replace(extraction, model=whole, readout=vectors.readout, scalar_model=scalar)
    if scalar is None or value_queries is None:  # no model of the oracle's outputs: none is returned
        return dataclasses.replace(extraction, model=None, readout=vectors.readout, scalar_model=scalar)
    limit = next((check.threshold for check in extraction.checks if check.name == "answers_residual"),
                 CheckPolicy.for_precision(settings.precision).answers_residual)
    # The whole model keeps the schedule's scores and nothing else of its scalar model (V_h and c are the fit's):
    # its estimate is the scores' and the fit's. The scalar c, one answer's noise over a read-out constant that can
    # be small, would otherwise set it (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module').
    scores = extraction.score_error or (extraction.error_estimate, extraction.error_estimate)
    try:
        fit = fit_values(scalar, value_queries[0], value_queries[1], extraction.bias, vectors.readout,
                         (scores[0], scores[0]), spawn_rng(settings.seed, 12),
                         score_deviations=extraction.score_deviations)
    except (ValueError, np.linalg.LinAlgError) as error:
        failed = Check("value_fit", False, np.inf, 0.0, f"the value read-outs V_h could not be fitted: {error}")
        return dataclasses.replace(extraction, model=None, readout=vectors.readout, scalar_model=scalar,
                                   checks=extraction.checks + [failed])
    error_estimate = max(*scores, fit.error_estimate)
    checks, verification = extraction.checks + fit.checks(limit, extraction.error_estimate), extraction.verification
    long_queries = spent.verification
    if long_queries is not None and long_queries.whole is not None:  # the whole model on the whole answers
        scale = float(np.abs(value_queries[1]).max(initial=0.0)) or 1.0
        unit = max(FLOAT64_UNIT, boundary.stats.unit_roundoff, settings.arithmetic_noise or 0.0)
        check, verification = long_queries.judge(fit.model, error_estimate, fit.residual, 0.0, scale, unit,
                                                 plan.promised_max_length, settings.seed)
        checks = [check if old.name == "long_verification" else old for old in checks]
    return dataclasses.replace(
        extraction, model=fit.model, scalar_model=scalar, readout=vectors.readout, value_fit=fit,
        error_estimate=error_estimate, checks=checks, verification=verification)


def _start_validity(certificate, settings: RunSettings, scale: float, refit=None,
                    alternative_start=None) -> tuple[float, bool, tuple[int, float]]:
    """``(validity, linear, (refuted orders, refuting ratio))``: what a refined fit inherits from
    its algebraic start's certificate. Refinement converges to the fit in whose basin its start
    lies, so the start's heads must be the right ones. Exact answers: the start's ``valid_below``
    (every instance linear too; ``linear`` False). Noisy answers (declared ``answer_error``, or
    3 x the links' noise estimate above ``ROUNDING_REGIME``, for independent errors): the start's
    matching validity at that error, instances verified against the refined model exempt
    (``Certificate.verified_against``, ``matching_validity_at``; docs/algorithm.md, 'Refined under noise'), links whose
    competing head orders ``refit`` refutes exempt too (:func:`_refuted_links`), and ``linear`` True: the refined
    model's first order is the least-squares fit's, bounded by its own linearisation (``LINEAR_MOVEMENT`` / C), not by
    the algebra's instances, whose answers it fits like any other.
    Otherwise one ill-conditioned instance outside its linear range would void a refined model
    within its estimate of the truth."""
    if settings.answer_error is not None:
        eps, statistical = settings.answer_error, False
    elif 3.0 * certificate.noise_estimate > ROUNDING_REGIME * scale:
        # the refined fit's residual noise judges the validity later (_validity_check): the larger
        eps, statistical = 3.0 * max(certificate.noise_estimate, 0.0 if refit is None else refit(None)[2]), True
    else:
        return certificate.valid_below, False, (0, np.inf)
    if refit is None:
        return certificate.matching_validity_at(eps, statistical), True, (0, np.inf)
    # With refits, a start whose pole count is uncertain is judged too: the links touching an
    # instance whose fit decides nothing exclude nothing, and every order they allow is refitted.
    validity = certificate.matching_validity_at(eps, statistical, uncertain=True)
    if validity > eps:
        return validity, True, (0, np.inf)
    refuted, orders, ratio = _refuted_links(certificate, eps, statistical, refit, alternative_start)
    return certificate.matching_validity_at(eps, statistical, refuted, uncertain=True), True, (orders, ratio)


#: A competing head order is refuted when its refit misfits the answers by at least this factor
#: more than the run's fit does (root mean squares, weighted as the refinement weighs them).
REFUTING_MISFIT = 2.0
#: At most this many competing head orders are refitted (each one refinement more, no query).
MOST_ALTERNATIVES = 24
#: A refit within this relative distance of the run's fit (heads aligned) landed on the fit itself.
SAME_FIT = 1e-6


def _refuted_links(certificate, eps: float, statistical: bool, refit, alternative_start):
    """``(links, orders, ratio)``: positions of the links whose every competing head order at
    ``eps`` (``Certificate.matching_alternatives``) the answers refute, how many orders were
    refuted, and the smallest misfit ratio among them (docs/algorithm.md, 'Refuted alternatives'). Each order is
    refitted from the refined model with the two heads exchanged where the link's instance b decided them
    (``alternative_start``); it is refuted when its fit misfits the answers ``REFUTING_MISFIT`` times more than the
    run's or lands on the run's fit (``SAME_FIT``). A refit that fits as well elsewhere is a second model the answers
    cannot tell apart: its link stays, and ``noise_within_validity`` fails as before."""
    alternatives = certificate.matching_alternatives(eps, statistical, uncertain=True)
    # (h, g) and (g, h) exchange the same two heads: one start, one refit
    starts = {(instance, min(h, g), max(h, g)) for _, _, instance, h, g in alternatives}
    if not alternatives or len(starts) > MOST_ALTERNATIVES:
        return set(), 0, np.inf
    refined, misfit, _ = refit(None)
    refuted, ratio = {}, np.inf
    for instance, h, g in sorted(starts):
        fit, record = refit(alternative_start(refined, instance, h, g))
        same = compare(fit, refined).max_rel <= SAME_FIT
        worse = record.residual_after / misfit if misfit > 0 else np.inf
        refuted[instance, h, g] = same or worse >= REFUTING_MISFIT
        ratio = min(ratio, worse) if refuted[instance, h, g] and not same else ratio
    standing = {(position, kind) for position, kind, instance, h, g in alternatives
                if not refuted[instance, min(h, g), max(h, g)]}
    links = {(position, kind) for position, kind, *_ in alternatives} - standing
    return links, sum(refuted.values()), ratio


def _refine(model, sequences, answers, added, bias, certificate, start_validity=None):
    """Refinement (docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement, verification') of all
    parameters (with ``bias``: u_h and c too) against every answer, weighted by the inverse size of each answer's
    computation (its float64 rounding), then the least-squares certificate ``G = (D J)^+ D`` of the fit: every schedule
    that refines has one. ``valid_below``: the algebraic start's where the schedule has a certificate,
    ``start_validity(refined model, refit)`` (:func:`_start_validity`; ``refit(start)`` runs the
    same weighted least squares from another start, ``refit(None)`` gives the fit and its misfit)."""
    scales = answer_scales(model, sequences)
    # An answer of exactly known size 0 (the zero query answers c) must not get an unbounded weight.
    floor = WEIGHT_FLOOR * np.median(scales) if len(scales) else 0.0  # no answers: nothing is refined
    weights = 1.0 / np.maximum(scales, floor + 1e-300)
    model, refinement = refine_least_squares(model, sequences, answers, added=added, bias=bias, weights=weights)
    if refinement.status == -1:  # not attempted (too few answers, or not affordable): the schedule's own stands
        return model, refinement, certificate

    fit_residuals = residuals(model, sequences, answers)  # for the refits' noise and the certificate

    def refit(start):  # the same least squares from another start; None: the fit, its misfit and its noise
        if start is None:
            noise = root_mean_square(fit_residuals,
                                     max(len(answers) - parameter_count(model.heads, model.d, bias), 1))
            return model, refinement.residual_after, noise
        return refine_least_squares(start, sequences, answers, bias=bias, weights=weights)

    valid_below, linear, refuted = (None, False, (0, np.inf)) if certificate is None or start_validity is None \
        else start_validity(model, refit)
    solver = refinement.solver
    if solver is None:  # the start was kept: its own Jacobian (dense or matrix-free as the refinement's)
        solver = jacobian_solver(model, sequences, weights, bias, matrix_free=refinement.path == "matrix-free")
    certificate = least_squares_certificate(
        None, model, fit_residuals, answers, valid_below, bias=bias, weights=weights,
        solver=solver, linear=linear)
    certificate.refuted_orders, certificate.refuting_ratio = refuted
    if refinement.path == "matrix-free":
        refinement.solver = None  # it holds the padded queries (their size): not kept in the result
    return model, refinement, certificate


#: Checks of the algebraic stage (which link's pole is which head; residue labels against their
#: consensus; instances whose fits found fewer poles, or complex or non-positive ones, outvoted by
#: the rest) that a successful refinement replaces: its model is the least-squares fit of every
#: answer, judged by the answers' residual and the fit's own certificate. ``pole_count`` only
#: where no instance detected more than H* poles (then H* may not be the canonical count, which
#: no fit of H* heads can show). (A refined run under noise can keep a few complex
#: instances and still be within its estimate.)
SUPERSEDED_BY_FIT = ("matching", "labels_consistent", "poles_real_positive", "pole_count")


def _superseded_by_fit(checks: list[Check], answers: int) -> list[Check]:
    """After a refinement whose model passes ``error_estimate`` and ``answers_residual`` (it fits
    every answer, the schedule's and the fresh polish queries, to their noise), a failed check of
    the algebraic stage's decisions says only that the start was ambiguous; it passes, saying so.
    (``refine=True`` on a torch MHA(12, 3): ``matching`` failed with a true error of 3e-16.)"""
    judged = {check.name: check.passed for check in checks}
    if not (judged.get("error_estimate") and judged.get("answers_residual")):
        return checks
    return [Check(check.name, True, check.value, check.threshold,
                  f"superseded by the refinement, which fits all {answers} answers: {check.message}")
            if check.name in SUPERSEDED_BY_FIT and not check.passed and MORE_POLES not in check.message else check
            for check in checks]


def _noise(certificate: Certificate | None, settings: RunSettings, probe=None) -> tuple[float | None, float]:
    """``(noise for the error estimate or None, the answers' error the checks judge at)``, absolute.

    The answers' error: the declared ``answer_error``; else, with a certificate, 3 x the noise
    estimated from the redundant measurements or the refined residual (docs/algorithm.md, 'Approximate answers:
    certificate, oversampling, refinement, verification'); else the misfit of the noise probe's fresh queries
    (:mod:`.checks.noise_probe`; lean, targeted, auto); else 0 (float64 rounding). The
    label checks and the answers' residual are judged at it (docs/algorithm.md, 'Numerics in float64 and the token
    scale'): a check that compares a misfit with its rounding-level error would otherwise fail every model of a noisy
    oracle, however good. The first value replaces the error estimate only when the noise was
    declared or the model refined (with a certificate)."""
    if settings.answer_error is not None:
        measured = settings.answer_error
    elif certificate is not None:
        measured = 3.0 * certificate.noise_estimate
    elif probe is not None:
        measured = probe[0]
    else:
        measured = 0.0
    if certificate is None:
        return None, measured
    noise = measured if (settings.refine or settings.answer_error is not None) else None
    return noise, measured


def arithmetic_noise(calibration: Calibration, settings: RunSettings) -> float | None:
    """The oracle's arithmetic rounding the schedule assumes (docs/algorithm.md, 'Low-precision oracles: float32, mixed
    precision, bfloat16'): the calibration's, except that random noise under a declared ``answer_error`` is that error
    (the bound on the answers' total error, which the user states): the scores are then float64's."""
    if calibration.random_noise and settings.answer_error is not None:
        return None
    return calibration.arithmetic_noise


def _residual_evidence(answers_residual: float, source: str) -> tuple[float, str]:
    """The error estimate raised to the answers' residual (``Schedule.residual_evidence``): the
    model misfits the answers it was fitted to by ``r`` relative to the largest answer, and the
    output moves with a relative parameter error ``e`` by at most about ``e`` of the largest
    answer (linear in v, Lipschitz in W with constants of order one at the token scale, docs/algorithm.md, 'Numerics in
    float64 and the token scale'), so ``e >= r`` to first order. An estimate below that understates the truth
    (docs/algorithm.md, 'Numerics in float64 and the token scale')."""
    return float(answers_residual), (f"{source}; raised to the answers' residual, a first-order lower bound "
                                     "of the relative parameter error")


def _constant_error(model, measured: float) -> float:
    """The relative error of an output constant read from one answer (``c = f((0))``, docs/algorithm.md, 'Biases: affine
    scores and an output constant'): that answer's error ``measured`` (absolute) over ``|c|``. The schedules' estimates
    are relative to the answers' sizes; a small c is off by the noise relative to itself, which can be far above
    the rest's estimate.
    A c within ``RESOLVED`` times that error of zero is zero at the answers' resolution (a
    bias-free target's c reads as noise): its error is claimed absolute, ``measured``, as
    ``compare`` reports it against a reference without c (claiming none, an estimate would stand
    below such a c's error)."""
    if model is None or not measured or model.is_high_precision:
        return 0.0
    return float(measured) if abs(model.c) <= RESOLVED * measured else float(measured / abs(model.c))


def _score_deviations(outcome: Outcome, settings: RunSettings, certificate, probe, scale: float, assumed,
                      typical: float):
    """Every score entry's standard deviation (``Outcome.score_deviations``) scaled to the answers' noise as the
    estimate was (:func:`_undeclared_noise`): ``hypot(k rest, score part)`` with the factor ``k >= 1`` that the
    noise measured or declared puts on the part it scales; None where the model is not the one they describe
    (refined, or high precision)."""
    if outcome.score_deviations is None or certificate is not None or settings.precision is not None:
        return None
    factor = _undeclared_noise(settings, 1.0, None, probe, scale, assumed, 0.0, typical)[0]

    def scaled(deviation):
        if deviation is None:
            return None
        total, score = deviation[..., 0], deviation[..., 1]
        return np.hypot(factor * np.sqrt(np.maximum(total**2 - score**2, 0.0)), score)

    W_deviation, u_deviation = outcome.score_deviations
    return scaled(W_deviation), scaled(u_deviation)


def _bias_error(model, error: float) -> float:
    """The score biases' error ``error`` (absolute, their largest entry's, scaled to the answers'
    noise: ``Outcome.bias_error``) as ``compare`` reports it: relative to max|u|, or absolute where
    max|u| is within ``RESOLVED`` times it of zero (a bias-free target's u reads as noise, and its
    error relative to that noise would be ~1)."""
    if model is None or not error or model.is_high_precision:
        return 0.0
    largest = float(np.abs(model.u).max(initial=0.0))
    return float(error) if largest <= RESOLVED * error else float(error / largest)


def _undeclared_noise(settings: RunSettings, error_estimate: float, certificate, probe,
                      scale: float, assumed: float | None = None, unscaled_part: float = 0.0,
                      typical: float | None = None) -> tuple[float, str]:
    """The error estimate raised to the answer noise measured (:mod:`.checks.noise_probe`), and
    what it rests on (for the check's message). The links' noise estimate raises it only above
    float64 rounding (``ROUNDING_REGIME``): at rounding level the schedule's own estimate already
    assumes it, and the certificate's amplification (an operator norm over every answer, the
    slow part of the certificate) is then not needed. ``unscaled_part``: the part of the schedule's
    estimate that answer noise does not scale (``Outcome.unscaled_estimate``: the oracle's rounding
    of its scores, docs/algorithm.md, 'The targeted schedule', and the low-rank basis term, already sized to the noise
    measured, 'Low-rank heads')."""
    if settings.precision is not None:
        return error_estimate, "the answers' precision (ball radii)"

    def scaled(noise: float, answers_scale: float) -> float:
        rest = np.sqrt(max(error_estimate**2 - unscaled_part**2, 0.0))
        return float(np.hypot(scaled_estimate(rest, noise, answers_scale, assumed), unscaled_part))

    if settings.answer_error is not None:
        if certificate is not None:
            return error_estimate, "the declared answer_error"
        # No certificate turned the declared bound into the estimate: scale the schedule's own,
        # which assumed float64 rounding, to the bound (or to the noise the probe measured, if more).
        # The schedule's estimate assumed errors relative to each answer; an absolute bound is a
        # larger relative error on the smaller answers, so it is compared with the median answer,
        # not the largest (against the largest, answers spread over decades would make the
        # estimate understate the truth).
        noise = max(settings.answer_error, probe[0] if probe is not None else 0.0)
        return (scaled(noise, typical if typical is not None else scale),
                "the declared answer_error (the schedule's rounding-level estimate scaled to it)")
    if probe is not None and certificate is not None and certificate.kind == "least squares":
        # Refined: the estimate already rests on the residual noise of every fitted answer; the
        # probe's misfit (a noise the polish queries could not show, e.g. on one-token-type queries)
        # only raises it through the same amplification, not by a ratio to rounding.
        misfit, answers_scale, count = probe
        return (max(error_estimate, certificate.first_order(misfit)),
                f"the residual noise of the least-squares fit and the answer noise measured on {count} fresh "
                f"queries ({misfit / max(answers_scale, 1e-300):.2g} relative)")
    if probe is not None:
        misfit, answers_scale, count = probe
        return (scaled(misfit, answers_scale),
                f"the answer noise measured on {count} fresh queries ({misfit / max(answers_scale, 1e-300):.2g} "
                "relative)")
    if certificate is not None and 3.0 * certificate.noise_estimate > ROUNDING_REGIME * scale:
        return (redundancy_estimate(error_estimate, certificate),
                "the answer noise its redundant measurements (links) show; no fresh query: it rests on redundancy alone")
    if certificate is not None:
        return error_estimate, ("the rounding of the answers: the noise its redundant measurements (links) show is "
                                "at rounding level; no fresh query: it rests on redundancy alone")
    return error_estimate, "the rounding of the answers (noise not measured)"


def _common_checks(plan: Schedule, outcome: Outcome, error_estimate, answers_residual, noise, scale,
                   certificate, stats, source="the rounding of the answers", measured=0.0,
                   explained=None) -> list[Check]:
    """The checks every schedule shares. ``measured``: the answers' error (:func:`_noise`). Noisy
    answers (declared, or measured above ``ROUNDING_REGIME``) cannot be fitted closer than the
    noise, nor than the model's own error moves them: the residual limit becomes
    ``max(limit, 10 noise / scale, error_estimate)`` (docs/algorithm.md, 'Numerics in float64 and the token scale').
    ``explained``: the estimate before the residual raised it (``Schedule.residual_evidence``): the residual limit is
    then ``max(limit, explained)`` with any answers (noisy: and ``10 noise / scale``), never the
    raised estimate, which the residual itself set."""
    settings = plan.settings
    error_limit, residual_limit = plan.thresholds()
    own = error_estimate if explained is None else explained
    own = own if np.isfinite(own) else 0.0  # no model, or no finite estimate: explains no residual
    noisy = noise if noise is not None else (measured if measured > ROUNDING_REGIME * scale else None)
    if noisy is not None and settings.precision is None:
        residual_limit = max(residual_limit, 10 * noisy / scale, own)
    elif plan.residual_evidence and settings.precision is None:
        residual_limit = max(residual_limit, own)
    if settings.precision is not None and outcome.model is not None and not outcome.details.certified:
        # docs/algorithm.md, 'Kernels in ball arithmetic and certification': says what is proven
        error_limit, source = uncertified_error_limit(error_limit, outcome.details)
    checks = [error_estimate_check(error_estimate, error_limit, source),
              answers_residual_check(answers_residual, residual_limit)]
    if certificate is not None and (settings.answer_error is not None
                                    or 3.0 * certificate.noise_estimate > ROUNDING_REGIME * scale):
        checks.append(_validity_check(certificate, settings.answer_error))
    if outcome.model is None:
        checks.append(finite_check())
    if outcome.W_balls is not None and outcome.model is not None:
        checks.append(_enclosure_check(outcome, settings.precision))
    informative = answers_check(stats)
    return checks + ([informative] if informative is not None else [])


def _validity_check(certificate: Certificate, answer_error) -> Check:
    """The answers' error against ``valid_below``: declared, or 3 x the noise estimated from the
    links' misfits (or the refined residual)."""
    if answer_error is not None:
        noise, source = answer_error, "declared answer_error"
        valid = certificate.validity_at(noise)
        against = ("valid_below, the bound under which the matching is certified and the first-order certificate "
                   "holds (instances verified against the model at this error exempt from linearisation)")
    else:
        # a measured standard deviation: its movements are l2, not the box's l1 (docs/algorithm.md, 'Approximate
        # answers: certificate, oversampling, refinement, verification')
        noise, source = 3.0 * certificate.noise_estimate, "3 x the noise estimated from redundant measurements"
        valid = certificate.validity_at(noise, statistical=True)
        against = ("the validity for independent errors of that size (matching margins and linearisation with "
                   "the l2 movements; instances verified against the model exempt from linearisation)")
    if certificate.kind == "least squares":  # refined under noise (_start_validity)
        against += ("; refined: the algebraic start's matching margins (instances verified against the refined "
                    "model exempt) and the least-squares fit's own linearisation")
        if certificate.refuted_orders:
            against += (f"; {certificate.refuted_orders} competing head order(s) within the error refitted and "
                        f"refuted by the answers (misfit >= {min(certificate.refuting_ratio, 1e300):.3g} x the fit's, "
                        f"or the same fit)")
    return Check("noise_within_validity", noise < valid, noise, valid, f"answer error ({source}) against {against}")


def _enclosure_check(outcome: Outcome, precision: int) -> Check:
    """High precision: the certified balls, evaluated in ball arithmetic, must overlap the answers
    they came from (:mod:`mhaextract.numerics.enclosure`); a miss disproves the enclosure (heads
    merged below the answers' resolution) and ``certified`` is then False."""
    misses, tried = balls_reproduce_answers(outcome.W_balls, outcome.v_balls, outcome.sequences, outcome.answers,
                                            precision, u_balls=outcome.u_balls, c_ball=outcome.c_ball)
    return Check("balls_reproduce_answers", misses == 0, misses, 0,
                 f"{misses} of {tried} answers lie outside the output balls of the certified parameters"
                 + ("" if not misses else ": the balls enclose a merged model, not the oracle's heads (heads closer "
                    "than this precision resolves; try more bits)"))
