"""Learning the attention sublayer of a pre-norm block (docs/algorithm.md, 'Attention behind a norm:
the sublayer of a block'): the norm's kind, eps and the residual from one-token sweeps
(:mod:`mhaextract.norm.sweeps`), then an attention learner of the attention family, by its registry
name, on the reduced oracle ``g(Z) = y(X(Q Z)) - R x_N`` with tokens inside the ball the norm can
reach, then the whole sublayer verified on fresh raw sequences. An oracle answering one number a
sequence (a read-out ``r^T y``) runs the same steps with ``rho = R^T r`` in place of R and the scalar
inner model (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block', 'A scalar read-out').
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..checks.refine import POLISH_SCALE
from ..checks.verify import ROUNDING_PER_TOKEN
from ..checks.base import Check, ExtractionError, UnreliableExtractionWarning
from ..checks.noise_probe import FLOAT32_UNIT as COARSE_UNIT
from ..models.attention import as_batch
from ..models.normed import NormedAttention, norm_basis, reachable
from ..oracle.transcript import NORM
from ..run.learner import pick
from ..run.result import Result
from ..run.session import Request, run_learner
from ..run.validation import spawn_rng
from .direct_fit import FIT_FACTOR, HELD_OUT, NORMS, STARTS, fit
from . import post_norm
from .sweeps import POST_NORM, Sweeps, ask_whole, measure

#: The inner method that is this family's own: the direct fit (any other name: an attention learner).
DIRECT_FIT = "fit"
#: The inner learner of a rotary sublayer (``positions="rotary"``: Llama's), by its registry name.
ROTARY = "rotary"
#: Gaussian tokens ``N(0, s^2 I / k)`` have norms ``s sqrt(chi2_k / k)``, about ``s (1 + z / sqrt(2 k))``
#: for a standard normal z: the rotary learner's tokens stay below ``s (1 + TAIL / sqrt(2 k))``.
TAIL = 8.0

#: A read-out's answers per parameter in the direct fit (one number an answer: ``READ_OUT_FIT_FACTOR P`` queries;
#: docs/algorithm.md, 'A scalar read-out').
READ_OUT_FIT_FACTOR = 4
#: The inner schedule's tokens stay within this fraction of the ball's radius sqrt(d).
BALL_MARGIN = 0.9
#: The rotary learner's query factors from float32 answers (its polish queries per parameter, times its value
#: read-outs): measured at d = 16, H = 4 (docs/norm.md), the replacement's error at every position from 1.4e-6
#: (3, 1) to 5.4e-7 (6, 4), the layer's own 5.4e-7, for 14% more queries.
COARSE_ROTARY_FACTORS = {"polish_factor": 6, "value_factor": 4}
#: ... and from float32 answers within this one: the rotary learner's instances at it (the largest scores the
#: ball allows), its Gaussian tokens scaled onto it, nearer the sphere the raw claim's large tokens reach.
COARSE_BALL_MARGIN = 0.99
#: Fresh raw sequences (as the verification's) whose misfit sets a post-norm run's estimate.
CLAIM_HELD_OUT = 64
#: Fresh raw sequences of the verification, their longest, and the range of their token norms.
VERIFY_SEQUENCES, VERIFY_LONGEST, VERIFY_NORMS = 32, 64, (1e-3, 1e3)


#: Why a read-out (one number a sequence) of these sublayers is refused, by ``POST_NORM`` or ``ROTARY``.
READ_OUT_REFUSED = {
    POST_NORM: "a norm after the residual (BertAttention) read out by r answers r^T (gamma * n(x_N + f(X)) + beta): "
               "one number of a normalised vector, in which the attention is not separable from the norm (the "
               "ellipsoid that gives gamma and beta, and the one-token start, read whole answers); extract it from "
               "the sublayer's whole outputs (TorchOracle without readout=)",
    ROTARY: "the rotary sublayer (positions='rotary') is learned from whole outputs; extract it from the sublayer's "
            "whole outputs (TorchOracle without readout=)",
}


def refuse_read_out(oracle, options) -> None:
    """A ValueError before any query where the oracle is known to answer one number a sequence (a
    ``readout``) and the sublayer's form is one whose read-out this family does not learn: a declared
    post-norm, a post-norm module (``attention_sublayer(bert_attention)``), or ``positions="rotary"``."""
    if getattr(oracle, "readout", None) is None:
        return
    if options["norm"] == POST_NORM or getattr(getattr(oracle, "module", None), "post_norm", False):
        raise ValueError(f"refused before any query: {READ_OUT_REFUSED[POST_NORM]}")
    if options["inner_schedule"] == ROTARY:
        raise ValueError(f"refused before any query: {READ_OUT_REFUSED[ROTARY]}")


class OutsideTheBall(ValueError):
    """The inner schedule asked a token no raw token reaches through the norm."""


class ReducedOracle:
    """``g(Z) = y(X(Q Z)) - R x_N``: the inner biased model on ``k`` coordinates, asked of the raw
    layer through ``boundary`` (every query counted there). ``answer_dtype``: the raw layer's. Answers
    as the oracle gives them: (B, d_out) whole, (B,) for a read-out (``R`` then ``rho^T``, (1, d))."""

    def __init__(self, boundary, sweeps: Sweeps, d: int, answer_dtype):
        self.boundary, self.sweeps, self.d = boundary, sweeps, d
        self.basis = norm_basis(sweeps.kind, d)
        # float64 answers carrying float32's rounding (the sweeps measured it) are float32 ones to the learner
        self.answer_dtype = "float32" if sweeps.noise is not None else answer_dtype
        self.largest = 0.0
        #: The largest token norm asked (the learner's Gaussian tokens are scaled onto it): inside the ball
        self.token_bound = token_bound(d, sweeps.unit)

    def raw(self, Z: np.ndarray) -> np.ndarray:
        T = np.asarray(Z, dtype=np.float64) @ self.basis.T
        self.largest = max(self.largest, float(np.sqrt((T * T).sum(axis=1).max())))
        try:
            return reachable(T, self.sweeps.eps)
        except ValueError as error:
            raise OutsideTheBall(str(error)) from None

    def __call__(self, batch):
        sequences = [self.raw(Z) for Z in as_batch(batch, self.basis.shape[1])]
        answers = np.asarray(self.boundary.ask(sequences, description="reduced oracle", whole=True), dtype=np.float64)
        skip = np.array([X[-1] for X in sequences]) @ self.sweeps.R.T  # (B, d_out); a read-out's: (B, 1)
        return answers - skip.reshape(answers.shape)


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class NormedExtraction(Result):
    """Result of the ``norm`` learner: the common fields (``model`` a
    :class:`~mhaextract.models.normed.NormedAttention`, or None; ``queries`` counted at the raw
    layer's boundary; ``error_estimate`` the relative output error of the sublayer it expects: ten
    times the direct fit's held-out misfit plus the rounding of evaluating 64-token sequences, or an
    attention or rotary learner's estimate (at least that rounding), or eps's or R's where larger (a
    post-norm's: also a hundred times the misfit on 64 fresh raw sequences, and eps's reach on them), judged by the
    ``raw_verification`` check; ``token_scale`` the largest inner token norm the inner method aimed at) and:

    Attributes
    ----------
    norm : the norm the answers show ("layernorm", "rmsnorm" before the attention, "post-layernorm"
        after the residual, or None: none).
    eps, eps_error : the norm's eps and its estimated relative error.
    inner : with an attention schedule or the rotary learner as the inner method, its result on the
        reduced oracle (its ``queries`` are queries of g, each one raw query); None for the direct fit
        or when the run stopped before it.
    inner_schedule : the inner method: "fit" (the direct fit), the attention schedule run, or "rotary"
        (``positions="rotary"``: Llama's sublayer).
    queries_sweeps : raw one-token queries of the kind, residual and eps sweeps.
    largest_inner_token : the largest norm of an inner token asked (below ``sqrt(d)``).
    verification_misfit : max over the fresh raw sequences of ``|model - y| / |y|`` (inf norms).
    """

    norm: str | None = None
    eps: float = np.nan
    eps_error: float = np.inf
    inner: Result | None = None
    inner_schedule: str = ""
    queries_sweeps: int = 0
    largest_inner_token: float = 0.0
    verification_misfit: float = np.inf

    error_measure: ClassVar[str] = "outputs"
    _repr_fields: ClassVar[tuple[str, ...]] = ("norm",)

    def _summary_extra(self) -> dict:
        return {"norm": self.norm, "eps": self.eps, "eps_error": self.eps_error, "inner_schedule": self.inner_schedule,
                "queries_sweeps": self.queries_sweeps, "largest_inner_token": self.largest_inner_token,
                "verification_misfit": self.verification_misfit}


class NormedExtractionError(ExtractionError):
    """The sublayer extraction failed its checks (``.extraction`` holds the result)."""


def inner_token_scale(k: int, d: int, heads, max_heads, seed, schedule: str) -> float:
    """The largest token scale whose schedule queries (known before any answer, at scale 1) and the
    refinement's Gaussian polish queries (norm ``POLISH_SCALE`` times the scale, within eight of
    their standard deviations ``1 / sqrt(2 k)``) lie within ``BALL_MARGIN sqrt(d)``; the reduced
    oracle still checks every token as it is asked."""
    options = {"bias": True}
    learner = pick(schedule, options, Request(k, heads, max_heads, None, seed, 1.0))
    queries = learner.fixed_queries(Request(k, heads, max_heads, None, seed, 1.0), options) or []
    largest = max((float(np.sqrt((np.asarray(X, dtype=np.float64) ** 2).sum(axis=1).max())) for X in queries),
                  default=2.0)
    largest = max(largest, POLISH_SCALE * (1 + 8 / np.sqrt(2 * k)))
    return BALL_MARGIN * np.sqrt(d) / largest


def token_bound(d: int, unit: float) -> float:
    """The largest inner token norm a learner on the reduced oracle asks (its Gaussian tokens scaled onto it):
    ``BALL_MARGIN sqrt(d)``, or ``COARSE_BALL_MARGIN sqrt(d)`` from float32 answers, where the rotary learner's
    instances sit at it (:func:`rotary_token_scale`)."""
    return (COARSE_BALL_MARGIN if unit >= COARSE_UNIT else BALL_MARGIN) * np.sqrt(d)


def rotary_token_scale(k: int, d: int, unit: float) -> float:
    """The token scale s of the rotary learner on the reduced oracle (docs/algorithm.md, 'Attention behind a
    norm: the sublayer of a block', 'Rotary attention behind an RMSNorm'): its instances' tokens have norm s
    (random orthonormal bases at the scale, spares included, and zeros), its window search's, polish and value
    read-out tokens are Gaussian ``N(0, s^2 I / k)``. From float64 answers their norms exceed
    ``s (1 + TAIL / sqrt(2 k))`` with a probability of about ``1e-15`` each, so those stay within
    ``BALL_MARGIN sqrt(d)``; from float32 answers (``unit``) s is the bound itself,
    ``COARSE_BALL_MARGIN sqrt(d)``, for the largest scores the ball allows, and the Gaussian tokens beyond it
    are scaled onto it (:func:`token_bound`). The reduced oracle still checks every token as it is asked."""
    if unit >= COARSE_UNIT:
        return token_bound(d, unit)
    return BALL_MARGIN * np.sqrt(d) / (1 + TAIL / np.sqrt(2 * k))


def verification_sequences(rng: np.random.Generator, d: int, count: int = VERIFY_SEQUENCES) -> list[np.ndarray]:
    """Fresh raw sequences of 1..VERIFY_LONGEST tokens (the longest included) in random directions
    whose norms are log-uniform over VERIFY_NORMS (so eps and the residual both matter)."""
    lengths = list(rng.integers(1, VERIFY_LONGEST + 1, size=count - 1)) + [VERIFY_LONGEST]
    low, high = np.log(VERIFY_NORMS[0]), np.log(VERIFY_NORMS[1])
    out = []
    for n in lengths:
        X = rng.standard_normal((int(n), d))
        X *= (np.exp(rng.uniform(low, high, size=int(n))) / np.linalg.norm(X, axis=1))[:, None]
        out.append(X)
    return out


def run_normed(session, options) -> NormedExtraction:
    """The run of :class:`~mhaextract.norm.learner.NormedLearner` in ``session`` (module docstring)."""
    request = session.request
    d, started = request.d, time.perf_counter()  # precision=None: NormedLearner.validate refused the rest
    # (a run that falls back here keeps the header of the learner that failed: its answers are in the same file)
    session.open_transcript({"schedule": "norm", "d": d, "seed": request.seed, "norm": options["norm"]})
    refuse_read_out(session.oracle, options)
    boundary = session.boundary(NORM)
    answer_dtype = getattr(session.oracle, "answer_dtype", None) or "float64"
    hints: list[str] = []
    try:
        sweeps = measure(boundary, d, options["norm"], spawn_rng(request.seed, 7), answer_dtype)
        result = NormedExtraction(d=d, schedule="norm", seed=request.seed, answer_dtype=str(answer_dtype),
                                  norm=sweeps.kind, eps=sweeps.eps, eps_error=sweeps.eps_error,
                                  checks=list(sweeps.checks), inner_schedule=options["inner_schedule"])
        if sweeps.read_out and (sweeps.kind == POST_NORM or options["inner_schedule"] == ROTARY):
            result.checks.append(Check("whole_outputs", False, sweeps.c.size, d, READ_OUT_REFUSED[
                POST_NORM if sweeps.kind == POST_NORM else ROTARY] + " (the oracle answers one number a sequence)"))
            hints.append("Give the sublayer's whole outputs (TorchOracle without readout=).")
        elif result.ok and sweeps.kind == POST_NORM:
            _post_norm_and_verify(session, boundary, sweeps.unit, result, hints)
        elif result.ok:
            _inner_and_verify(session, boundary, sweeps, options, result, hints)
        else:
            hints.append("The one-token sweeps decide the sublayer's form before any attention query "
                         "(docs/algorithm.md, 'Attention behind a norm: the sublayer of a block'): pass the attention "
                         "half of a block (mhaextract.adapters.normed.attention_sublayer(block)), not a whole block, "
                         "and norm='auto' or the norm it has.")
    finally:
        session.close()
    result.queries = boundary.queries + boundary.replayed
    result.queries_asked, result.queries_replayed = boundary.queries, boundary.replayed
    result.max_query_length = boundary.max_query_length
    result.queries_sweeps += sweeps.queries
    result.seconds = time.perf_counter() - started
    return session.finish(result, "norm sublayer extraction", hints=hints, error_type=NormedExtractionError)


def _inner_and_verify(session, boundary, sweeps: Sweeps, options, result: NormedExtraction, hints: list) -> None:
    request, d = session.request, session.request.d
    k = norm_basis(sweeps.kind, d).shape[1]
    reduced = ReducedOracle(boundary, sweeps, d, result.answer_dtype)
    schedule = options["inner_schedule"]
    if schedule == DIRECT_FIT:  # a read-out's scalar answers are fitted as one column (d_out = 1)
        fitted = fit(lambda sequences: reduced(sequences).reshape(len(sequences), -1), k, sweeps.c.size,
                     request.heads, np.sqrt(d), spawn_rng(request.seed, 9), sweeps.unit,
                     READ_OUT_FIT_FACTOR if sweeps.read_out else FIT_FACTOR)
        result.token_scale, result.largest_inner_token = NORMS[1] * np.sqrt(d), reduced.largest
        limit = 1e4 * sweeps.unit
        result.checks.append(Check("inner_fit", fitted.misfit <= limit, fitted.misfit, limit,
                                   f"the direct fit of the inner heads ({fitted.queries} bounded queries, {fitted.steps} "
                                   f"steps, start {fitted.starts} of up to {STARTS}): max misfit on {HELD_OUT} held-out "
                                   "queries relative to the largest answer"))
        if not result.checks[-1].passed:
            hints.append("The direct fit did not reach the answers' rounding from its random starts: the heads may be "
                         "more than heads=H, or the answers noisier than the layer's dtype (docs/algorithm.md, "
                         "'Attention behind a norm: the sublayer of a block', 'A direct fit from bounded tokens').")
            return
        # plus the rounding of evaluating the sublayer over the longest sequences the claim covers: at the
        # rounding level the held-out misfit is a sample of it, not a bound
        inner_estimate = 10 * fitted.misfit + ROUNDING_PER_TOKEN * VERIFY_LONGEST * sweeps.unit
        inner = fitted.model.readout(np.ones(1)) if sweeps.read_out else fitted.model  # v_h = V_h^T 1
        inner_model, result.heads = inner.canonical(), request.heads
    else:
        inner = _inner_learner(session, reduced, sweeps, schedule, k, result, hints)
        if inner is None:
            return
        inner_model, inner_estimate, result.heads = inner.model, inner.error_estimate, inner.heads
        # plus the rounding of evaluating the sublayer over the longest sequences the claim covers (as the direct
        # fit's): the inner learner's estimate covers its own queries (from float32 answers measured 0.55..0.66 of
        # the error at every position of raw sequences of up to 64 tokens, docs/norm.md)
        inner_estimate = max(inner_estimate, ROUNDING_PER_TOKEN * VERIFY_LONGEST * sweeps.unit)
    model = NormedAttention(sweeps.kind, sweeps.eps, inner_model, sweeps.R[0] if sweeps.read_out else sweeps.R)
    _verify_raw(boundary, model, float(max(inner_estimate, sweeps.eps_error, sweeps.R_error)), session.request.seed,
                sweeps.unit, result, hints)


def relative_misfit(predicted: np.ndarray, answers: np.ndarray) -> float:
    """The largest ``max |predicted - answer| / max |answer|`` over the sequences (rows)."""
    return float((np.abs(predicted - answers).max(axis=1) / np.maximum(np.abs(answers).max(axis=1), 1e-300)).max())


def read_out_misfit(predicted: np.ndarray, answers: np.ndarray, finals: np.ndarray, rho: np.ndarray) -> float:
    """A read-out's misfit over the sequences (final tokens ``finals``, B x d): ``|predicted - a| / (|rho|^T |x_N|
    + max |a - rho^T x_N|)``, each answer a against the size of its two terms, the skip ``rho^T x_N`` as its
    sum's rounding sees it and the attention's part, whose largest over the sequences is its scale
    (docs/algorithm.md, 'A scalar read-out': one number crosses zero where the two cancel, and no relative
    error holds there)."""
    predicted, answers = np.ravel(predicted), np.ravel(answers)
    attention = answers - finals @ rho
    scale = np.abs(finals) @ np.abs(rho) + np.abs(attention).max()
    return float((np.abs(predicted - answers) / np.maximum(scale, 1e-300)).max())


def _verify_raw(boundary, model, estimate: float, seed, unit: float, result: NormedExtraction, hints: list) -> None:
    """``model`` and its ``estimate`` into ``result``, the whole sublayer checked on fresh raw sequences."""
    result.model, result.error_estimate = model, estimate
    d = model.d
    sequences = verification_sequences(spawn_rng(seed, 8), d)
    answers = ask_whole(boundary, sequences, "verification on raw sequences")
    if model.is_vector:
        misfit = relative_misfit(model(sequences), answers)
    else:
        misfit = read_out_misfit(model(sequences), answers, np.array([X[-1] for X in sequences]), model.R)
    result.verification_misfit = misfit
    result.verification_queries, result.verification_length = len(sequences), max(len(X) for X in sequences)
    limit = max(100 * result.error_estimate, 1e3 * unit)
    result.checks.append(Check("raw_verification", misfit <= limit, misfit, limit,
                               f"{len(sequences)} fresh raw sequences of 1..{VERIFY_LONGEST} tokens with norms "
                               f"{VERIFY_NORMS[0]:g}..{VERIFY_NORMS[1]:g}: max |model - y| / |y| against 100 times the "
                               "run's estimate (a layer after the residual or another norm misfits)"))
    if misfit > limit:
        hints.append("The sublayer's answers on raw sequences do not fit norm + attention + residual: a whole block "
                     "(an MLP after the residual) or a norm of another kind; pass attention_sublayer(block).")


def _post_norm_and_verify(session, boundary, unit: float, result: NormedExtraction, hints: list) -> None:
    """The post-norm sublayer (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block', 'The norm
    after the residual'): gamma and beta from the ellipsoid of large one-token answers, the start from one-token
    answers and a first eps from it, the Levenberg-Marquardt fit of every parameter (log eps among them), eps
    measured near the token whose z is 0, the fit again with that eps held where it reaches the fit's answers,
    then the raw verification."""
    request, d = session.request, session.request.d
    if request.heads is None:
        result.checks.append(Check("heads_given", False, 0, 1, "a post-norm sublayer is learned by its direct fit, "
                                   "which needs the head count"))
        hints.append("Pass heads=H: the post-norm fit needs the head count (a bound max_heads is not enough).")
        return
    rng = spawn_rng(request.seed, 10)
    before = boundary.queries + boundary.replayed
    shape = post_norm.ask_ellipsoid(boundary, d, rng)
    limit = 1e4 * unit
    result.checks.append(Check("post_norm_ellipsoid", max(shape.plane, shape.sphere) <= limit,
                               max(shape.plane, shape.sphere), limit,
                               f"{2 * d} answers of large one-token queries against the ellipsoid of a LayerNorm after "
                               "the residual (centre beta, axes gamma, in a hyperplane): a norm of another form (an "
                               "RMSNorm) leaves them off it"))
    start = post_norm.one_token_start(boundary, d, shape.gamma, shape.beta) if result.ok else None
    if start is not None:
        result.checks.append(Check("one_token_form", start.coplanar <= limit, start.coplanar, limit,
                                   "one-token answers against gamma * n(M x + c) + beta (attention, residual, norm: "
                                   "z is affine in the token): a layer after the norm (a whole BertLayer's MLP) "
                                   "does not fit"))
    if not result.ok:
        result.queries_sweeps += boundary.queries + boundary.replayed - before
        hints.append("A norm after the residual is learned as the LayerNorm of attention plus residual "
                     "(BertAttention): pass that sublayer, not a whole BertLayer (its MLP and second norm follow).")
        return
    first = post_norm.measure_eps(boundary, post_norm.start_model(start, shape.gamma, shape.beta, request.heads),
                                  rng, unit).eps  # eps (alpha_start / alpha)^2: the fit takes it on from there
    first = first if np.isfinite(first) and first > 0 else post_norm.UNSEEN_EPS
    fitted = post_norm.fit(boundary, d, request.heads, start, shape.gamma, shape.beta, first,
                           spawn_rng(request.seed, 9), unit)
    epsilon = post_norm.measure_eps(boundary, fitted.model, rng, unit)
    result.queries_sweeps += boundary.queries + boundary.replayed - before - fitted.queries
    result.eps, result.eps_error = epsilon.eps, epsilon.error
    result.checks.append(epsilon.check)
    if epsilon.check.passed:
        fitted = post_norm.refit(fitted, epsilon.eps, unit)
    if fitted.misfit <= limit:  # low-precision answers: W again from answers at near ties of large tokens
        fitted = post_norm.refine_at_ties(boundary, fitted, spawn_rng(request.seed, 12), unit)
    result.token_scale = (NORMS[1] if fitted.ranks is None else post_norm.TIE_RADIUS) * np.sqrt(d)
    refined = "" if fitted.ranks is None else f", refined at near ties, heads' ranks {fitted.ranks}"
    result.checks.append(Check("inner_fit", fitted.misfit <= limit, fitted.misfit, limit,
                               f"the direct fit of the post-norm sublayer ({fitted.queries} queries, "
                               f"{fitted.steps} steps, start {fitted.starts} of up to {STARTS}{refined}): max misfit "
                               f"on {HELD_OUT} held-out bounded queries relative to the largest answer"))
    if not result.ok:
        hints.append("The post-norm fit did not reach the answers' rounding from its starts: the heads may be more "
                     "than heads=H, or a layer after the norm (docs/algorithm.md, 'Attention behind a norm: the "
                     "sublayer of a block', 'The norm after the residual').")
        return
    result.heads = request.heads
    model = fitted.model.canonical()
    # The fit's tokens have norms near sqrt(d); the claim covers raw tokens of norms 1e-3..1e3, whose scores
    # magnify the heads' errors where two keys nearly tie, a tail that 64 final positions sample thinly: the
    # estimate is a hundred times the misfit on fresh raw sequences of the claim's kind (ten times the bounded
    # held-out's), plus the rounding of 64-token sequences, or eps's reach on them where larger:
    # d log n / d log eps = -eps / (2 (var(z) + eps)).
    sequences = verification_sequences(spawn_rng(request.seed, 11), d, CLAIM_HELD_OUT)
    raw_misfit = relative_misfit(model(sequences), ask_whole(boundary, sequences, "post-norm held out, raw"))
    z = model.attention(sequences) + np.array([X[-1] for X in sequences])
    spread = ((z - z.mean(axis=1, keepdims=True)) ** 2).mean(axis=1)
    reach = float((model.eps / (2 * (spread + model.eps))).max())
    estimate = max(max(10 * fitted.misfit, 100 * raw_misfit) + ROUNDING_PER_TOKEN * VERIFY_LONGEST * unit,
                   epsilon.error * reach)
    _verify_raw(boundary, model, float(estimate), request.seed, unit, result, hints)


def _inner_learner(session, reduced: "ReducedOracle", sweeps: Sweeps, schedule: str, k: int,
                   result: NormedExtraction, hints: list):
    """An attention learner, or the rotary learner (``positions="rotary"``), by its registry name, on the
    reduced oracle at a token scale inside the ball (without its own long verification: the raw one
    follows); None (a failed check and a hint added) when it stops or fails."""
    request, d = session.request, session.request.d
    if schedule == ROTARY:  # the zero token is a counter for it: n(0) = 0, and Llama's keys carry no bias
        scale, inner_options = rotary_token_scale(k, d, sweeps.unit), {"positions": ROTARY}
        if sweeps.unit >= COARSE_UNIT:  # float32 rounding at the ball's scores: averaged over more answers
            inner_options.update(COARSE_ROTARY_FACTORS)
    else:  # the polish takes the grid from 1e-6 to rounding
        scale = inner_token_scale(k, d, request.heads, request.max_heads, request.seed, schedule)
        inner_options = {"bias": True, "refine": True}
    result.token_scale = scale
    inner_request = Request.validated(k, request.heads, None if request.heads is not None else request.max_heads,
                                      None, request.seed, scale)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnreliableExtractionWarning)
            inner = run_learner(reduced, inner_request, schedule, inner_options, batch_size=session.batch_size,
                                progress=session.progress, on_failure="warn", verify_length=0)
    except (OutsideTheBall, ExtractionError) as error:
        first = str(error).splitlines()[0]
        result.checks.append(Check("inner_attention", False, reduced.largest, BALL_MARGIN * np.sqrt(d),
                                   f"the {schedule!r} schedule on the reduced oracle stopped: {first}"))
        hints.append(_bounded_hint(schedule, d, isinstance(error, OutsideTheBall)))
        result.largest_inner_token = reduced.largest
        return None
    result.inner, result.largest_inner_token = inner, reduced.largest
    result.checks += [Check(f"inner: {c.name}", c.passed, c.value, c.threshold, c.message) for c in inner.checks]
    if inner.model is None or not inner.ok:
        hints.append(_bounded_hint(schedule, d, False))
        return None
    return inner


def _bounded_hint(schedule: str, d: int, outside: bool) -> str:
    if schedule == ROTARY:
        return (f"The rotary learner did not learn the inner heads from tokens bounded by sqrt(d) = {np.sqrt(d):.3g} "
                "(docs/algorithm.md, 'Attention behind a norm: the sublayer of a block', 'Rotary attention behind an "
                "RMSNorm'): a key bias (Qwen2's) makes the zero token no counter, and a layer whose scores at that "
                "scale are far below one crowds its poles; the inner result's checks say which step stopped.")
    if outside:
        return (f"The {schedule!r} schedule asks tokens beyond the ball of radius sqrt(d) = {np.sqrt(d):.3g} that a "
                "norm's output fills (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block', 'The "
                "schedule with bounded tokens'): the direct fit (inner_schedule='fit', the default) stays inside it.")
    return (f"The {schedule!r} schedule did not learn the inner heads from tokens bounded by sqrt(d) = {np.sqrt(d):.3g}"
            " (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block', 'The schedule with bounded "
            "tokens'): the biased grid breaks down in float64 at the scores bounded tokens give (measured from d = 16, "
            "H = 4); the direct fit (inner_schedule='fit', the default) does not depend on them.")
