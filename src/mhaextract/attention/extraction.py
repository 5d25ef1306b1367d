"""The attention family's run in a session (:class:`~mhaextract.attention.learner.ScheduleLearner`):

    options -> RunSettings -> schedule (attention.registry, biases resolved) -> calibration
        -> (answers of 8 or 11 bits: handed to the learner that takes them over)
        -> schedule.run: answers -> fits -> matching -> assembly -> Outcome
        -> finish: certificate, refinement, error estimate, checks -> Extraction
        -> (whole answers) value fit -> the whole model -> (failed) model-class probes
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np

from ..checks.base import Check
from ..checks.diagnosis import KERNEL_ERRORS, failure_hints, kernel_failure
from ..checks.model_class import probe_counted
from ..checks.noise_probe import probe_misfit
from ..checks.verify import VERIFY_LENGTH, ask_long_verification
from ..numerics.arithmetic import BACKENDS, arithmetic_for
from ..oracle.progress import expect_queries
from ..oracle.transcript import RUN, run_fingerprint, run_header
from ..run.learner import AUTO, FallBack, given, passed_over, successor, takeover
from ..run.validation import nonnegative_number, positive_int, rank_option, spawn_rng, token_scale_for
from .base import RunSettings
from .finish import (
    Spent, arithmetic_noise, ask_value_queries, finish, refinement_queries, rescued_by_refinement, with_values,
)
from .registry import choose


def settings_for(request, options, token_scale) -> RunSettings:
    """Every attention option checked once, with the option that fixes a bad one named."""
    precision = request.precision
    samples, refine, refine_queries = (options.get(name) for name in ("samples_per_instance", "refine",
                                                                        "refine_queries"))
    answer_error, rank, backend, repair = (options.get(name) for name in ("answer_error", "rank", "backend", "repair"))
    if precision is not None and (samples is not None or refine or answer_error is not None):
        raise ValueError("samples_per_instance, refine and answer_error are float64 options; with precision=bits "
                         "the answers are exact to one ulp and the balls certify the result")
    if refine is not None and not isinstance(refine, (bool, np.bool_)):
        raise ValueError(f"refine must be None, True or False, got {refine!r}")
    if repair is not None and not isinstance(repair, (bool, np.bool_)):
        raise ValueError(f"repair must be None, True or False, got {repair!r}")
    if repair and precision is None:
        raise ValueError("repair=True is a high-precision option (it re-proves failed Krawczyk tests, "
                         "docs/algorithm.md, 'Certificate repair: failed instances measured again with their poles "
                         "pulled apart'): give precision=bits")
    if refine_queries is not None:
        refine_queries = positive_int("refine_queries", refine_queries, minimum=0)
    if answer_error is not None:  # a parameter of extract: every bad value is a ValueError
        answer_error = nonnegative_number("answer_error", answer_error, "a bound on |answer - truth|", ValueError)
    d = request.d
    rank = rank_option(rank, d)
    return RunSettings(d, request.max_heads, request.heads, precision, request.seed, token_scale_for(d, token_scale),
                       samples, None if refine is None else bool(refine), refine_queries, answer_error, rank,
                       _backend(backend, precision), repair=None if repair is None else bool(repair))


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


def refuse_takeover(session, name, answer_format, d_out, evidence: str) -> None:
    """Answers of ``answer_format`` with ``d_out`` numbers (None: not seen yet) that another learner
    takes over (``Learner.takes_over``): a ValueError when the run was given options that learner
    does not take, before any query where the format is declared, else after the first probes."""
    if name != AUTO:
        return
    learner = takeover(session.options, session.request, answer_format, d_out)
    if learner is None:
        return
    refused = [option for option, value in session.options.items() if option not in learner.options and given(value)]
    refused += learner.refused_settings(session.options, session.request)
    if refused:
        raise ValueError(f"the answers carry {answer_format}'s few bits ({evidence}): the {learner.name!r} learner "
                         f"runs ({learner.model}), which does not take {', '.join(refused)}")


def run_attention(session, options, name):
    """The attention family's run in ``session`` for ``schedule=name`` (a schedule name or
    ``"auto"``, already resolved to this family)."""
    request, oracle = session.request, session.oracle
    scale_option = request.token_scale
    settings = settings_for(request, options, None if scale_option == "auto" else scale_option)
    answer_dtype = session.answer_dtype
    if settings.precision is not None and answer_dtype not in (None, "mpf"):
        raise ValueError(f"precision={settings.precision} needs an oracle answering mpmath.mpf; this one answers "
                         f"{answer_dtype} (a torch layer computes in its own dtype): run it with precision=None")
    bias = options.get("bias")
    choice = choose(name, settings.d, settings.max_heads, settings.precision, bias, settings.rank, session.requested)
    refuse_takeover(session, name, answer_dtype, None, "the oracle declares answer_dtype=" + repr(answer_dtype))
    plan = choice.schedule(dataclasses.replace(settings, bias=choice.bias))  # refuses bad options before any query
    calibrating = scale_option == "auto" or (scale_option is None and choice.calibrate)
    session.open_transcript(run_header(plan, None if request.seed is None else int(request.seed), settings.precision,
                                       calibrating))
    vectors, calibration = session.vectors, None
    try:
        if calibrating:  # its probes are recorded too (section "calibration"): a resumed run decides the same
            calibration = session.calibrate(on_first=lambda probes: refuse_takeover(
                session, name, probes.stats.precision_name, vectors.d_out,
                f"the calibration's first {probes.queries + probes.replayed} answers are that format's numbers"))
            settings = dataclasses.replace(settings, token_scale=calibration.token_scale,
                                           answer_noise=calibration.answer_noise,
                                           arithmetic_noise=arithmetic_noise(calibration, settings))
            plan = choice.schedule(dataclasses.replace(settings, bias=choice.bias))
        # the format the oracle declares, else the one the calibration's answers show
        declared = takeover(options, request, answer_dtype, vectors.d_out) is not None
        answer_format = answer_dtype if declared or calibration is None else calibration.answer_precision
        successor = takeover(options, request, answer_format, vectors.d_out) if name == AUTO else None
        if successor is not None:
            refuse_takeover(session, name, answer_format, vectors.d_out,
                            "the calibration's answers are that format's numbers")
            try:
                return successor(session, successor.validate(options, request)).run()
            except FallBack as fallback:  # it gave way: the schedule "auto" chose runs, its queries after the learner's
                session.fall_back(successor.name, fallback.reason, fallback.boundary)
        elif name == AUTO:
            for declined, why in passed_over(options, request, answer_format, vectors.d_out):
                session.fall_back(declined, f"not tried: {why}", None)
        if session.record is not None:
            session.record.start_run(run_fingerprint(plan, int(request.seed), settings.precision,
                                                     plan.fixed_queries()))
    except BaseException:
        session.close()
        raise
    return _run_plan(session, plan, choice, settings, calibration)


def _run_plan(session, plan, choice, settings, calibration):
    """The schedule's queries, the shared finish, the value fit and, after a failure, the model-class probes."""
    oracle, vectors, seed = session.oracle, session.vectors, settings.seed
    arithmetic = arithmetic_for(settings.precision, settings.backend)
    expect_queries(session.progress, plan.promised_queries)
    boundary = session.boundary(RUN, precision=settings.precision)
    handed_on = None  # (learner, why) that runs instead, where the failed run's probes name one
    try:
        session.check_resumed(boundary, plan.fixed_queries() if session.pending_check else [],
                              noise=None if calibration is None else calibration.answer_noise)
        with arithmetic.working():
            outcome = plan.run(boundary, arithmetic)
        value_queries = ask_value_queries(boundary, settings, outcome) if (vectors.d_out or 1) > 1 else None
        extra = refinement_queries(boundary, plan.settings, plan, outcome)
        probe = late_probe = None
        if settings.precision is None and plan.probes_noise and outcome.model is not None:
            probe = late_probe = probe_misfit(boundary, plan, outcome.model)
        elif settings.precision is None and plan.probes_noise and _noise_unseen(settings, calibration):
            # no model: the run has failed, and the probe may show noise the calibration missed (noise_shown_late)
            late_probe = probe_misfit(boundary, plan, None)
        length = session.verify_length if session.verify_length is not None else VERIFY_LENGTH * plan.verifies_by_default
        long_queries = None  # asked once, before finish: judged for whichever model the run keeps
        if length and outcome.model is not None:
            long_queries = ask_long_verification(boundary, spawn_rng(seed, 5), settings.token_scale, length)
        spent = Spent(choice, calibration, str(getattr(oracle, "answer_dtype",
                                                      "mpf" if settings.precision else "float64")), session.probes,
                      long_queries)
        extraction = finish(plan, arithmetic, outcome, extra, boundary, session.record, session.started, spent, probe)
        if rescued_by_refinement(plan, outcome, extraction):
            extraction = finish(plan, arithmetic, outcome, extra, boundary, session.record, session.started, spent,
                                probe, force_refine=True)
        noise = noise_shown_late(settings, calibration, late_probe, extraction)
        if noise is not None:  # the schedule again, at the noise the answers showed
            plan = choice.schedule(dataclasses.replace(settings, bias=choice.bias, answer_noise=noise,
                                                       arithmetic_noise=noise))
            with arithmetic.working():
                outcome = plan.run(boundary, arithmetic)
            whole = (vectors.d_out or 1) > 1
            if whole and outcome.model is not None and (value_queries is None or outcome.model.heads != extraction.heads):
                value_queries = ask_value_queries(boundary, plan.settings, outcome)  # their count is the heads'
            extra = refinement_queries(boundary, plan.settings, plan, outcome)
            if length and long_queries is None and outcome.model is not None:  # the first run had no model to verify
                long_queries = ask_long_verification(boundary, spawn_rng(seed, 5), settings.token_scale, length)
                spent = dataclasses.replace(spent, verification=long_queries)
            extraction = finish(plan, arithmetic, outcome, extra, boundary, session.record, session.started, spent,
                                late_probe)
            extraction = dataclasses.replace(extraction, checks=extraction.checks + [late_noise_check(noise)])
        if vectors.d_out is not None:
            extraction = with_values(extraction, vectors, value_queries, plan, boundary, spent)
        evidence = None
        if not extraction.ok and settings.precision is None and plan.probes_noise:  # is the oracle in the class?
            extraction, evidence = _probe_model_class(boundary, settings, extraction)
            handed_on = successor(evidence, session.given_options, session.request) if session.requested == AUTO else None
        if handed_on is not None:  # another learner's model: it runs in this session (and transcript)
            learner, why = handed_on
            failed = ", ".join(check.name for check in extraction.failed_checks)
            raise FallBack(f"its checks failed ({failed}), and {why}", boundary, to=learner.name)
    except KERNEL_ERRORS as error:
        if getattr(error, "raised_by_oracle", False):
            raise
        raise kernel_failure(error, plan, boundary.stats, boundary.queries + boundary.replayed) from error
    finally:
        if handed_on is None:
            session.close()
    failed = {check.name for check in extraction.failed_checks}
    hints = failure_hints(failed, settings, boundary.stats, extraction, plan.hints(failed),
                          float_only=getattr(oracle, "answer_dtype", "mpf") != "mpf", model_class=evidence)
    return session.finish(extraction, f"{plan.name} extraction", hints=hints, probes_counted=True)


#: A failed float64 run whose noise probe (fresh queries after the schedule) misfits by more than this, relative to
#: its largest answer, while the calibration saw float64 rounding, had answers far noisier than it assumed (exact
#: float64 answers leave at most 16 units of 2^-53); up to ``LATE_NOISE_CEILING``: rounding inside the layer (a
#: float32 softmax in a float64 layer: 1e-8..1e-7), not structure the model lacks.
LATE_NOISE_FLOOR, LATE_NOISE_CEILING = 1e-11, 1e-5


def noise_shown_late(settings: RunSettings, calibration, probe, extraction) -> float | None:
    """The answers' relative noise (the noise probe's misfit over its largest answer) where a failed float64 run
    assumed float64 rounding and its noise probe shows ``LATE_NOISE_FLOOR`` to ``LATE_NOISE_CEILING`` of it, else
    None (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'). The calibration's
    permutation probes can miss a float32 softmax inside a float64 layer (their few five-token sums happen to round
    alike); the probe's twelve answers of fresh tokens then show it."""
    if extraction.ok or probe is None or not _noise_unseen(settings, calibration):
        return None
    relative = probe[0] / max(probe[1], 1e-300)
    return float(relative) if LATE_NOISE_FLOOR < relative <= LATE_NOISE_CEILING else None


def _noise_unseen(settings: RunSettings, calibration) -> bool:
    """A float64 run whose calibration saw float64 rounding and which was told no answer error."""
    return (settings.precision is None and settings.answer_error is None and calibration is not None
            and calibration.answer_noise is None)


def late_noise_check(noise: float) -> Check:
    """Says why the run's schedule ran twice (:func:`noise_shown_late`): passed, the noise and its floor."""
    return Check("answer_noise", True, noise, LATE_NOISE_FLOOR,
                 f"the answers carry about {noise:.1e} relative noise although float64 (the noise probe's fresh "
                 "queries misfit by that much; exact answers leave about 1e-15), as a float64 layer computing its "
                 "softmax in float32 gives: the first run, which assumed float64 rounding, failed, and the schedule ran "
                 "again at that noise, to the answers' precision (its queries counted twice)")


def _probe_model_class(boundary, settings: RunSettings, extraction):
    """After a failed float64 run of a schedule that may ask beyond its own count (``probes_noise``):
    the order and scale probes (stream 41, counted in the result's queries and recorded in the
    transcript), ``(extraction with the counts, evidence)``."""
    evidence, asked, replayed = probe_counted(boundary, settings.d, spawn_rng(settings.seed, 41), settings.token_scale)
    return dataclasses.replace(extraction, queries=extraction.queries + asked + replayed,
                               queries_asked=extraction.queries_asked + asked,
                               queries_replayed=extraction.queries_replayed + replayed,
                               model_class_queries=asked + replayed), evidence
