"""``extract``: validate once, run the schedule from the registry, finish every schedule alike.

The data flow of one extraction (docs/algorithm.md §5-§13)::

    parameters -> RunSettings -> schedule (registry) -> boundary (+ transcript)
        -> schedule.run: answers -> fits -> matching -> assembly -> Outcome
        -> finish (mhaextract.attention.finish): certificate, refinement, error estimate, checks -> Extraction
        -> (vector answers) value fit -> the whole model
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import TYPE_CHECKING

import numpy as np

from .run.calibration import calibrate, probe_queries
from .checks.base import report_failure
from .checks.causality import records_causality
from .checks.diagnosis import KERNEL_ERRORS, failure_hints, kernel_failure
from .checks.model_class import probe_model_class
from .checks.noise_probe import probe_misfit
from .checks.verify import VERIFY_LENGTH, ask_long_verification, verify_length_option
from .attention.finish import (
    Spent, arithmetic_noise, ask_value_queries, finish, refinement_queries, rescued_by_refinement, with_values,
)
from .numerics.arithmetic import BACKENDS, arithmetic_for
from .oracle.boundary import OracleBoundary
from .oracle.progress import expect_queries, one_bar_per_run
from .oracle.resume_check import check_same_oracle
from .oracle.answer_stats import FORMAT_UNITS
from .oracle.transcript import CALIBRATION, RUN, VECTOR, Transcript, check_directory, run_fingerprint, run_header
from .oracle.vector_answers import VectorAnswers
from .run.result import Extraction
from .attention.base import RunSettings
from .attention.registry import COARSE_FORMATS, VECTOR, choose, low_precision_run
from .attention.targeted.lowrank import AUTO as AUTO_RANK
from .vector import SplitUnavailable, VectorExtraction, extract_vector
from .run.validation import (
    bias_option, head_count, nonnegative_number, on_failure_mode, positive_int, resumable_seed, spawn_rng,
    token_scale_for, token_scale_option,
)

if TYPE_CHECKING:
    from .lowprecision.learn import LowPrecisionExtraction
    from .rotary.learn import RotaryExtraction


@one_bar_per_run
@records_causality
def extract(oracle, d, heads=None, max_heads=None, precision=None, seed=None, *, schedule="auto",
            bias=None, token_scale=None, batch_size=1024, progress=None, on_failure="raise", transcript=None,
            max_queries=None, samples_per_instance=None, refine=None, refine_queries=None,
            answer_error=None, rank=None, backend=None, resume_check=3, repair=None,
            verify_length=None, positions="none",
            key_bias=False) -> Extraction | RotaryExtraction | LowPrecisionExtraction | VectorExtraction:
    """Learn the canonical heads of multi-head attention from value queries.

    Parameters
    ----------
    oracle : callable ``oracle(batch) -> outputs`` (see :mod:`mhaextract.oracle.boundary`).
    d : token dimension.
    heads : the number of heads H, if known. Exactly one of ``heads`` and ``max_heads``.
    max_heads : a bound H0 >= H*; the canonical count is detected on every instance (grid schedules:
        ``result.details.merge_resolution`` is the singular-value gap it was decided in).
    precision : None for float64; bits (>= 64) for the high-precision (python-flint) path.
    seed : seeds the random query vectors (same seed, same queries).
    schedule : ``"auto"`` (default: the registry chooses from the arithmetic and H0, and
        ``result.schedule_reason`` says what and why: targeted in float64 with H0 <= d, else the
        paper's grid, with biases the biased grid of §16: ``4 H0 d^2 + 4 H0 d - 2 H0 + 1`` queries
        of length at most ``2 H0 + 1``) or a name from :mod:`mhaextract.attention.registry`: ``"paper"`` (exactly
        ``4 H0 d^2 - 2 H0 + 1`` queries of length at most ``2 H0 + 1``, docs/algorithm.md §5; named
        alone it reproduces the paper: bias-free model, token scale ``d ** 0.25``, no probes),
        ``"lean"`` (§10: about ``(2 H0 - 1) d^2`` queries, heads matched by residue labels),
        ``"targeted"`` (§13: float64, H <= d, one head in the window per instance; machine
        precision for many heads, about ``4 H d^2 + 4 H d`` queries) or ``"lowrank"`` (§17).
    bias : learn score biases ``u_h`` and the output constant ``c`` (§16; real layers have them).
        None (default): True for ``"auto"`` and ``"targeted"``, False for the paper-model schedules;
        ``schedule="paper", bias=True`` runs the biased grid (high precision: ``result.u_balls``,
        ``result.c_ball``).
    token_scale : norm of the query vectors: ``"auto"`` (found by counted probe queries, §18;
        ``result.calibration_queries``), a number (choose it so that ``|z^T W_h x|`` is of order
        one, §11), or None (default: ``"auto"`` for ``"auto"`` and ``"targeted"``, ``d ** 0.25``
        for the paper-model schedules, suited to W with entries of size ``1/sqrt(d)``).
    batch_size : sequences per oracle call.
    progress : draw one progress bar for the run on stderr: True, False, or None (default: only when
        stderr is a terminal, so a redirected log gets no bar lines). Its description names the
        stage being asked (calibration probes, the schedule's rounds, polish and probe queries,
        verification), with the queries asked against those expected and the time left.
    on_failure : ``"raise"`` an :class:`~mhaextract.checks.base.ExtractionError` when a check
        fails (the result is on the error), or ``"warn"`` and return it.
    transcript : path of a SQLite transcript (:mod:`mhaextract.oracle.transcript`), or None. Every
        batch of answers (the calibration's probes included) is committed to it as it arrives;
        re-running with the same transcript and seed reads them back and asks only the missing
        queries, so it re-pays at most the batch in flight and the resume check. Needs an integer ``seed``.
    max_queries : cap on the queries asked of the oracle in this run; when the run needs more it
        raises :class:`~mhaextract.oracle.boundary.BudgetExceeded` saying how many.
    samples_per_instance : K >= 2 H0 + 1 copy counts per instance (float64, paper schedule).
    refine : polish all parameters (with ``bias``: u_h and c too) by least squares on fresh, counted
        polish queries (and the grid schedules' own answers), then certify the fit (float64, every
        schedule, §12): ``result.certificate``, ``result.error_estimate`` from ``G = J^+``. None
        (default): only where the schedule refines by itself (float64 paper and lean, when
        ``answer_error`` is declared or the answers show noise above rounding, and paper when its
        algebraic result failed a check; paper on its own answers, its exact count kept; lean
        with ``H0 (d^2 + d)`` polish queries; H0 <= 3; §10, §12); False: never.
    refine_queries : fresh polish queries for the refinement (default ``6 P``, P the parameters:
        ``6 H0 (d^2 + d)``, with biases ``6 (H0 (d^2 + 2d) + 1)``; at least 32).
    answer_error : a bound on every answer's absolute error, if known (float64).
    rank : a bound r on the rank of every ``W_h`` (``schedule="lowrank"``, §17: about
        ``2.1 H (2dr - r^2)`` queries instead of ``4 H d^2``), or ``"auto"``: the schedule finds r from
        its bridges first (at most twice the full bridges r needs; ``details.rank``). With
        ``schedule="auto"`` a rank selects the low-rank schedule (float64, H0 <= d, with biases and
        calibration as the other defaults); the other schedules refuse it.
    backend : float64 kernels of the grid schedules (paper, lean): None or ``"numpy"``, or
        ``"torch"`` (CUDA when present, else CPU), ``"torch-cpu"``, ``"torch-cuda"``: the batched
        factorisations in torch, the same results to float64 rounding (needs the ``[torch]`` extra).
    resume_check : resuming a transcript, re-ask this many recorded queries (counted in
        ``queries_asked``) and refuse the transcript when the oracle answers differently
        (:mod:`mhaextract.oracle.resume_check`); 0 skips the check.
    repair : high precision, grid schedules: an instance whose Krawczyk test failed is measured
        again with its close poles pulled apart, with 0, K or 2K extra counted queries
        (docs/algorithm.md §20; ``result.details.repair_queries``, ``result.details.repairs``).
        None (default): on for the biased grid (``"auto"``, ``bias=True``), off for
        ``schedule="paper"`` named alone, whose count then stays the paper's exactly; True turns
        it on there; False turns it off.
    verify_length : the default verification (docs/algorithm.md §12): 32 fresh random queries of
        lengths spread from 1 to ``verify_length`` tokens, asked after the schedule and counted like
        every query (``result.verification_queries``, ``result.verification_length``), judged by
        the ``long_verification`` check against the run's own error estimate and noise; a layer
        that is another model beyond short sequences (a sliding window, position-dependent scores)
        fails it. None (default): 256, except ``schedule="paper"`` named alone (0: the paper's
        exact count); an integer 1..4096; 0 turns it off.

    positions : ``"none"`` (default: the model of docs/algorithm.md §1, no positions) or
        ``"rotary"``: rotary position embeddings (Llama-style RoPE, grouped-query heads, a sliding
        window found by queries; §22), learned with the rotary schedule in float64, or taken on to
        ``precision`` bits for an oracle answering ``mpf``; returns a
        :class:`~mhaextract.rotary.learn.RotaryExtraction` whose ``model`` is a
        :class:`~mhaextract.RotaryAttention`. It takes ``heads``, ``precision``, ``seed``,
        ``token_scale``, ``bias`` (the query bias; default True), ``rank`` (the head width),
        ``batch_size``, ``progress``, ``on_failure``, ``max_queries``, ``verify_length`` and
        ``key_bias``.
    key_bias : ``positions="rotary"`` only: the keys carry a bias (Qwen2), which under rotation
        does not cancel in the softmax. The run first finds a token whose key is zero from whole
        answers (float64: grouped-query heads with ``n_kv r < d`` and ``H r <= d``, §22, "A key
        bias"; float32: by large-query finals, counts up to 2048, "From float32 answers"), asks
        everything else at tokens shifted by it and fits the key bias in the refinement
        (``result.neutral``). Default False: a key-biased layer then fails its checks.

    Returns
    -------
    Extraction
        The canonical heads and every measured count, check and error estimate. Every count
        reported is measured at the oracle boundary. A layer answering whole outputs in bfloat16
        or float16 (its ``answer_dtype``, or the answers' bits) returns a
        :class:`~mhaextract.lowprecision.learn.LowPrecisionExtraction` (docs/algorithm.md §23).

    Examples
    --------
    The defaults (targeted schedule in float64, biases, token scale found by 147 probe queries):

    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=4, heads=2, seed=1)
    >>> result.schedule, result.heads, result.ok, result.calibration_queries
    ('targeted', 2, True, 147)
    >>> bool(mx.compare(result.model, target).max_rel < 1e-12)
    True

    ``schedule="paper"`` named alone reproduces the paper: exactly ``4Hd^2 - 2H + 1`` queries:

    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=3, heads=2, seed=1, schedule="paper")
    >>> result.queries, 4 * 2 * 3**2 - 2 * 2 + 1, result.max_query_length
    (69, 69, 5)
    """
    if positions == "rotary":
        return _extract_rotary(oracle, d, heads, max_heads, precision, seed, schedule, bias, token_scale, batch_size,
                               progress, on_failure, transcript, max_queries, samples_per_instance, refine,
                               refine_queries, answer_error, rank, backend, repair, verify_length, key_bias)
    if key_bias is not False:
        raise ValueError(f"key_bias={key_bias!r} is for positions='rotary' (without positions a key bias cancels "
                         "in the softmax and needs no option)")
    if positions != "none":
        raise ValueError(f"positions must be 'none' (no position dependence) or 'rotary' (rotary embeddings, "
                         f"docs/algorithm.md §22), got {positions!r}")
    scale_option, bias = token_scale_option(token_scale), bias_option(bias)
    settings = _settings(d, heads, max_heads, precision, seed, None if scale_option == "auto" else scale_option,
                         samples_per_instance, refine, refine_queries, answer_error, rank, backend, repair)
    on_failure = on_failure_mode(on_failure)
    answer_dtype = getattr(oracle, "answer_dtype", None)
    if settings.precision is not None and answer_dtype not in (None, "mpf"):
        raise ValueError(f"precision={settings.precision} needs an oracle answering mpmath.mpf; this one answers "
                         f"{answer_dtype} (a torch layer computes in its own dtype): run it with precision=None")
    if max_queries is not None:
        positive_int("max_queries", max_queries, minimum=0)
    if transcript is not None:
        resumable_seed(seed)
        check_directory(transcript)  # before the calibration's probes: nothing is asked for a run that cannot record
    resume_check = positive_int("resume_check", resume_check, minimum=0)
    verify_length = verify_length_option(verify_length)
    choice = choose(schedule, settings.d, settings.max_heads, settings.precision, bias, settings.rank)
    # options the low-precision learner does not take: refused before any query where the oracle
    # declares its format, else as soon as the calibration's first answers show it
    refuse_low_precision = _low_precision_refusal(schedule, settings, bias)
    refuse_low_precision(answer_dtype, None, "the oracle declares answer_dtype=" + repr(answer_dtype))
    started = time.perf_counter()
    calibration, probes = None, None
    plan = choice.schedule(dataclasses.replace(settings, bias=choice.bias))  # refuses bad options before any query
    # answers of d_out numbers: one read-out for every boundary of the run
    vectors = VectorAnswers(settings.seed, getattr(oracle, "answer_dtype", None))
    calibrating = scale_option == "auto" or (scale_option is None and choice.calibrate)
    record = None
    if transcript is not None:  # before any query: a transcript that cannot be written fails here
        record = Transcript(transcript, run_header(plan, int(seed), settings.precision, calibrating))
    # a resumed transcript: is it the same oracle? Checked on the run's recorded queries, or on the
    # calibration's before it asks anything new where the run section is still empty
    check = 0 if record is None or not record.resumed else resume_check
    try:
        if calibrating:  # its probes are recorded too (section "calibration"): a resumed run decides the same
            early = check if record is not None and record.answered_in(RUN) == 0 else 0
            calibration, probes = _calibrate(oracle, settings, batch_size, progress, max_queries, record, early,
                                              vectors, on_first=lambda probes: refuse_low_precision(
                                                  probes.stats.precision_name, vectors.d_out,
                                                  f"the calibration's first {probes.queries + probes.replayed} "
                                                  "answers are that format's numbers"))
            check -= early
            max_queries = None if max_queries is None else max(0, max_queries - probes.queries)
            settings = dataclasses.replace(settings, token_scale=calibration.token_scale,
                                           answer_noise=calibration.answer_noise,
                                           arithmetic_noise=arithmetic_noise(calibration, settings))
            plan = choice.schedule(dataclasses.replace(settings, bias=choice.bias))
        answer_format = answer_dtype if answer_dtype in COARSE_FORMATS else (
            calibration.answer_precision if calibration is not None else None)
        if low_precision_run(schedule, answer_format, vectors.d_out):
            refuse_low_precision(answer_format, vectors.d_out, "the calibration's answers are that format's numbers")
            return _extract_low_precision(oracle, settings, answer_format, scale_option, vectors, batch_size, progress,
                                          on_failure, record, check, max_queries, verify_length, probes, plan,
                                          calibration)
        attempt = None
        if choice.bias and vector_run(schedule, settings, vectors.d_out, calibration):
            attempt = _extract_whole(oracle, settings, vectors, calibration, probes, batch_size, progress, max_queries,
                                     record, verify_length)
            if isinstance(attempt.result, VectorExtraction):
                if record is not None:
                    record.close()
                report_failure(attempt.result, "vector extraction (whole answers split by head)", on_failure)
                return attempt.result
            max_queries = None if max_queries is None else max(0, max_queries - attempt.boundary.queries)
        if record is not None:
            record.start_run(run_fingerprint(plan, int(seed), settings.precision, plan.fixed_queries()))
    except BaseException:
        if record is not None:
            record.close()
        raise
    arithmetic = arithmetic_for(settings.precision, settings.backend)
    expect_queries(progress, plan.promised_queries)
    boundary = OracleBoundary(oracle, settings.d, precision=settings.precision, batch_size=batch_size,
                              progress=progress, max_queries=max_queries,
                              transcript=None if record is None else record.section(RUN), vectors=vectors)
    try:
        if check:  # (fixed_queries costs O(queries))
            check_same_oracle(boundary, boundary.transcript, plan.fixed_queries(), check,
                              noise=None if calibration is None else calibration.answer_noise)
        with arithmetic.working():
            outcome = plan.run(boundary, arithmetic)
        value_queries = ask_value_queries(boundary, settings, outcome) if (vectors.d_out or 1) > 1 else None
        extra = refinement_queries(boundary, plan.settings, plan, outcome)
        probe = None
        if settings.precision is None and plan.probes_noise and outcome.model is not None:
            probe = probe_misfit(boundary, plan, outcome.model)
        length = verify_length if verify_length is not None else VERIFY_LENGTH * plan.verifies_by_default
        long_queries = None  # asked once, before finish: judged for whichever model the run keeps
        if length and outcome.model is not None:
            long_queries = ask_long_verification(boundary, spawn_rng(settings.seed, 5), settings.token_scale, length)
        spent = Spent(choice, calibration, str(getattr(oracle, "answer_dtype",
                                                      "mpf" if settings.precision else "float64")), probes,
                       long_queries)
        extraction = finish(plan, arithmetic, outcome, extra, boundary, record, started, spent, probe)
        if rescued_by_refinement(plan, outcome, extraction):
            extraction = finish(plan, arithmetic, outcome, extra, boundary, record, started, spent, probe,
                                 force_refine=True)
        if vectors.d_out is not None:
            extraction = with_values(extraction, vectors, value_queries, plan, boundary, spent)
        evidence = None
        if not extraction.ok and settings.precision is None and plan.probes_noise:  # is the oracle in the class?
            extraction, evidence = _probe_model_class(boundary, settings, extraction)
    except KERNEL_ERRORS as error:
        if getattr(error, "raised_by_oracle", False):
            raise
        raise kernel_failure(error, plan, boundary.stats, boundary.queries + boundary.replayed) from error
    finally:
        if record is not None:
            record.close()
    if attempt is not None:  # the split was tried first: its queries count, and the reason says why it fell back
        extraction.queries += attempt.boundary.queries + attempt.boundary.replayed
        extraction.queries_asked += attempt.boundary.queries
        extraction.queries_replayed += attempt.boundary.replayed
        extraction.split_queries = attempt.boundary.queries + attempt.boundary.replayed
        extraction.schedule_reason += (f"; whole answers could not be split by head ({attempt.result}), after "
                                       f"{attempt.boundary.queries + attempt.boundary.replayed} queries")
    failed = {check.name for check in extraction.failed_checks}
    hints = failure_hints(failed, settings, boundary.stats, extraction, plan.hints(failed),
                          float_only=getattr(oracle, "answer_dtype", "mpf") != "mpf", model_class=evidence)
    report_failure(extraction, f"{plan.name} extraction", on_failure, hints=hints)
    return extraction


def _probe_model_class(boundary, settings: RunSettings, extraction: Extraction):
    """After a failed float64 run of a schedule that may ask beyond its own count (``probes_noise``):
    the order and scale probes (stream 41, counted in the result's queries and recorded in the
    transcript), ``(extraction with the counts, evidence)``."""
    asked, replayed = boundary.queries, boundary.replayed
    evidence = probe_model_class(boundary, settings.d, spawn_rng(settings.seed, 41), settings.token_scale)
    asked, replayed = boundary.queries - asked, boundary.replayed - replayed
    return dataclasses.replace(extraction, queries=extraction.queries + asked + replayed,
                               queries_asked=extraction.queries_asked + asked,
                               queries_replayed=extraction.queries_replayed + replayed,
                               model_class_queries=asked + replayed), evidence


#: A split of whole answers whose model fails a check gives way to the scalar schedules (True), or is
#: returned failed (False: what ``benchmarks/bench_vector.py --split-only`` measures).
SPLIT_FAILURE_FALLS_BACK = True


@dataclasses.dataclass
class _WholeAttempt:
    """The split of whole answers tried before the scalar schedules: its boundary (the queries it
    asked) and its result, a VectorExtraction or the reason it could not split (a string)."""

    boundary: OracleBoundary
    result: object


def vector_run(schedule, settings: RunSettings, d_out, calibration) -> bool:
    """Whether ``schedule="vector"`` tries the split of whole answers (docs/algorithm.md, 'Whole answers
    near the vector bound'): float64 arithmetic, whole answers (``d_out > 1``, known from the
    calibration's probes) of float32 or float64 precision, H declared and none of the scalar
    schedules' options given. (Not ``"auto"``'s choice yet: past d = 128 its model is not refined,
    fails its checks and gives way to the targeted schedule after its queries and time.)"""
    scalar_options = ("samples_per_instance", "refine", "refine_queries", "answer_error", "rank", "backend", "repair")
    return (schedule == VECTOR and settings.precision is None and settings.heads is not None
            and (d_out or 1) > 1 and calibration is not None
            and calibration.answer_precision in ("float64", "float32")
            and not any(settings.given(option) for option in scalar_options))


def _extract_whole(oracle, settings: RunSettings, vectors, calibration, probes, batch_size, progress, max_queries,
                   record, verify_length) -> _WholeAttempt:
    """The split of whole answers on a boundary of its own (recorded in the transcript's ``"vector"``
    section); SplitUnavailable comes back as its reason."""
    unit = max(vectors.unit, FORMAT_UNITS.get(calibration.answer_precision, 2.0 ** -53))
    boundary = OracleBoundary(oracle, settings.d, batch_size=batch_size, progress=progress, max_queries=max_queries,
                              transcript=None if record is None else record.section(VECTOR), vectors=vectors)
    try:
        result = extract_vector(boundary, settings.seed, settings.d, settings.heads, settings.token_scale, unit,
                                calibration.answer_precision, verify_length, progress)
    except SplitUnavailable as why:
        return _WholeAttempt(boundary, str(why))
    except np.linalg.LinAlgError as why:  # a factorisation of the split failed: it cannot work here
        return _WholeAttempt(boundary, f"a factorisation of the split failed ({why})")
    if not result.ok and SPLIT_FAILURE_FALLS_BACK:  # never a guess: the scalar schedules run instead
        failed = "; ".join(f"{check.name} {check.value:.3g} > {check.threshold:.3g}" for check in result.failed_checks)
        return _WholeAttempt(boundary, f"its model failed its checks: {failed}")
    result.calibration_queries = probes.queries + probes.replayed
    result.queries += probes.queries + probes.replayed
    result.queries_asked += probes.queries
    result.queries_replayed += probes.replayed
    result.schedule_reason = (
        f"auto: whole answers of d_out = {vectors.d_out} numbers ({calibration.answer_precision}) and H = "
        f"{settings.heads} declared: the heads' output subspaces split the answers (ranks {result.value_ranks}, "
        f"condition number {result.split_conditioning:.3g}), every query answers every head (docs/algorithm.md, "
        f"'Whole answers near the vector bound'); model with biases (u_h, c)")
    return _WholeAttempt(boundary, result)


def _extract_rotary(oracle, d, heads, max_heads, precision, seed, schedule, bias, token_scale, batch_size, progress,
                    on_failure, transcript, max_queries, samples_per_instance, refine, refine_queries, answer_error,
                    rank, backend, repair, verify_length, key_bias):
    """``positions="rotary"``: the options the rotary schedule takes validated, the rest refused."""
    from .rotary.learn import extract_rotary

    others = {"max_heads": max_heads, "transcript": transcript,
              "samples_per_instance": samples_per_instance, "refine": refine, "refine_queries": refine_queries,
              "answer_error": answer_error, "backend": backend, "repair": repair}
    given = [name for name, value in others.items() if value is not None]
    if schedule != "auto":
        given.append("schedule")
    if given:
        raise ValueError(f"positions='rotary' does not take {', '.join(given)}: the rotary schedule runs with the "
                         "number of heads given (heads=H), in float64 or at precision=bits")
    if not isinstance(key_bias, (bool, np.bool_)):
        raise ValueError(f"key_bias must be True or False, got {key_bias!r}")
    if key_bias and precision is not None:
        raise ValueError(f"key_bias=True runs in float64 (its search shifts every token by a float64 token); "
                         f"precision={precision} is not available for it")
    if precision is not None:
        precision = positive_int("precision", precision, minimum=64)
        answer_dtype = getattr(oracle, "answer_dtype", None)
        if answer_dtype not in (None, "mpf"):
            raise ValueError(f"precision={precision} needs an oracle answering mpmath.mpf; this one answers "
                             f"{answer_dtype} (a torch layer computes in its own dtype): run it with precision=None")
    d = positive_int("d", d)
    heads = positive_int("heads", heads) if heads is not None else None
    if heads is None:
        raise ValueError("positions='rotary' needs heads=H, the number of query heads")
    scale = token_scale_option(token_scale)
    verify_length = verify_length_option(verify_length)
    if rank is not None:
        rank = positive_int("rank", rank)
    on_failure = on_failure_mode(on_failure)
    result = extract_rotary(oracle, d, heads, seed, precision=precision,
                            token_scale=None if scale in (None, "auto") else scale,
                            bias=True if bias is None else bool(bias), rank=rank, batch_size=batch_size,
                            progress=progress, max_queries=max_queries, verify_length=verify_length,
                            key_bias=bool(key_bias))
    report_failure(result, "rotary extraction", on_failure)
    return result


def _extract_low_precision(oracle, settings: RunSettings, answer_format: str, scale_option, vectors, batch_size,
                           progress, on_failure, record, resume_check, max_queries, verify_length, probes, plan,
                           calibration):
    """Answers of 8 or 11 bits, whole: the low-precision learner (docs/algorithm.md §23) with the
    options it takes; the others refused. ``record``: the run's transcript, whose run section
    belongs to this learner (closed here when the run returns; ``extract`` closes it on an
    exception); ``resume_check`` recorded probes are re-asked first (its queries depend on earlier
    answers, so the calibration's fixed probes are the ones re-asked; a run with a given token
    scale has none, and its transcript is resumed unchecked)."""
    from .lowprecision.learn import extract_low_precision

    section = None
    if record is not None:
        fingerprint = run_fingerprint(plan, int(settings.seed), None, [])
        record.start_run(fingerprint | {"schedule": "saturated", "answers": answer_format})
        section = record.section(RUN)
        if resume_check and probes is not None:
            _recheck_probes(probes, record.section(CALIBRATION), settings, resume_check, calibration.answer_noise)
    result = extract_low_precision(oracle, settings.d, settings.heads, settings.seed,
                                   unit=COARSE_FORMATS[answer_format], answer_dtype=answer_format,
                                   token_scale=None if scale_option in (None, "auto") else scale_option,
                                   batch_size=batch_size, progress=progress, max_queries=max_queries,
                                   verify_length=verify_length, vectors=vectors, transcript=section)
    if record is not None:
        record.close()
    if probes is not None:
        result.calibration_queries = probes.queries + probes.replayed
        result.queries += probes.queries + probes.replayed
        result.queries_asked += probes.queries
        result.queries_replayed += probes.replayed
    report_failure(result, f"low-precision extraction ({answer_format} answers)", on_failure)
    return result


def _low_precision_refusal(schedule, settings: RunSettings, bias):
    """``refuse(answer_format, d_out, evidence)``: raises ValueError when answers of ``answer_format``
    with ``d_out`` numbers each (None: not yet seen) route the run to the low-precision learner
    (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least squares') and
    the run was given options that learner does not take; ``evidence`` says how the format is
    known. Called before the first query (a declared format) and after the calibration's first
    answers, so no refusal waits for answers paid in vain."""
    given = [name for name in ("precision", "samples_per_instance", "refine", "refine_queries", "answer_error",
                               "rank", "backend", "repair") if settings.given(name)]
    if settings.heads is None:
        given.append("max_heads (it needs heads=H)")
    if bias is False:  # its start and fit learn u_h and c: a bias-free layer gets them near zero
        given.append("bias=False (it always fits the score biases and the output constant; drop the option)")

    def refuse(answer_format, d_out, evidence: str) -> None:
        if given and low_precision_run(schedule, answer_format, d_out):
            raise ValueError(f"the answers carry {answer_format}'s few bits ({evidence}): the low-precision learner "
                             "runs (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least "
                             f"squares'), which does not take {', '.join(given)}")
    return refuse


def _calibrate(oracle, settings: RunSettings, batch_size, progress, max_queries, record, resume_check: int,
               vectors=None, on_first=None):
    """The token scale from counted probe queries (§18), on a stream of the seed of its own, asked
    through a boundary of their own and recorded in the transcript's calibration section.
    ``resume_check``: re-ask this many recorded probes first (a resumed transcript whose run section
    is empty: :mod:`.oracle.resume_check`); ``on_first``: :func:`~.calibration.calibrate`'s. Returns
    ``(calibration, its boundary)``."""
    section = None if record is None else record.section(CALIBRATION)
    probes = OracleBoundary(oracle, settings.d, precision=settings.precision, batch_size=batch_size,
                            progress=progress, max_queries=max_queries, transcript=section, vectors=vectors)
    if resume_check and section.answered:
        _recheck_probes(probes, section, settings, resume_check)
    return calibrate(probes, settings.d, spawn_rng(settings.seed, 3), on_first), probes


def _recheck_probes(probes, section, settings: RunSettings, count: int, noise: float | None = None) -> None:
    """Re-ask ``count`` of the calibration's recorded probes through their boundary ``probes``
    (:mod:`.oracle.resume_check`); TranscriptError when the oracle answers differently."""
    queries = [sequence for group in probe_queries(settings.d, spawn_rng(settings.seed, 3)) for sequence in group]
    # from 1: the zero query answers the constant c alone (0 for a bias-free layer, whatever its heads)
    check_same_oracle(probes, section, queries, count, first=1, noise=noise)


def _settings(d, heads, max_heads, precision, seed, token_scale, samples_per_instance, refine, refine_queries,
              answer_error, rank=None, backend=None, repair=None) -> RunSettings:
    """Every parameter checked once, with the option that fixes a bad one named."""
    d = positive_int("d", d)
    H0, declared = head_count(heads, max_heads)
    if precision is not None:
        precision = positive_int("precision", precision, minimum=64)
        if samples_per_instance is not None or refine or answer_error is not None:
            raise ValueError("samples_per_instance, refine and answer_error are float64 options; with precision=bits "
                             "the answers are exact to one ulp and the balls certify the result")
    if refine is not None and not isinstance(refine, (bool, np.bool_)):
        raise ValueError(f"refine must be None, True or False, got {refine!r}")
    if repair is not None and not isinstance(repair, (bool, np.bool_)):
        raise ValueError(f"repair must be None, True or False, got {repair!r}")
    if repair and precision is None:
        raise ValueError("repair=True is a high-precision option (it re-proves failed Krawczyk tests, "
                         "docs/algorithm.md §20): give precision=bits")
    if refine_queries is not None:
        refine_queries = positive_int("refine_queries", refine_queries, minimum=0)
    if answer_error is not None:  # a parameter of extract: every bad value is a ValueError
        answer_error = nonnegative_number("answer_error", answer_error, "a bound on |answer - truth|", ValueError)
    if isinstance(rank, str):
        if rank != AUTO_RANK:
            raise ValueError(f"rank must be an integer 1 <= r <= d = {d} or {AUTO_RANK!r}, got {rank!r}")
    elif rank is not None:
        rank = positive_int("rank", rank)
        if rank > d:
            raise ValueError(f"rank must be at most d = {d} (a bound on the rank of every W_h), got {rank}")
    return RunSettings(d, H0, declared, precision, seed, token_scale_for(d, token_scale), samples_per_instance,
                       None if refine is None else bool(refine), refine_queries, answer_error, rank,
                       _backend(backend, precision),
                       repair=None if repair is None else bool(repair))


def _backend(backend, precision) -> str | None:
    """None for numpy; a torch backend only where torch can run it (the ``[torch]`` extra)."""
    if backend is None or backend == "numpy":
        return None
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if precision is not None:
        raise ValueError(f"backend={backend!r} computes in float64; with precision=bits the ball arithmetic is used")
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"backend={backend!r} needs torch: pip install 'mhaextract[torch]' (or backend='numpy')")
    if backend == "torch-cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("backend='torch-cuda' needs a CUDA GPU visible to torch; use backend='torch' (CUDA "
                             "when present, else CPU) or 'torch-cpu'")
    return backend
