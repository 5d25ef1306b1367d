"""One rotary run, step by step (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding
windows'): :func:`extract_rotary` is the list of the steps, each a function below of the run's state
(:class:`RotaryRun`), in the order the queries are asked:

1. the first look (:func:`first_look`): the output constant, the window search, the answers' precision;
2. with ``key_bias=True`` the key-neutral token (:func:`seek_neutral_token`) and the shift to it
   (:func:`shift_to_neutral_token`);
3. the start (:func:`ask_instances_at_scale`, :func:`learn_start`, :func:`settle_start`): the instances at the
   token scale, their fits and assembly, drawn again where heads were matched wrongly;
4. the refinement (:func:`check_refinement_memory`, :func:`refine_start`): fresh polish queries, the slow blocks
   fitted as generators from float32 answers, the Levenberg-Marquardt steps, the high-precision polish;
5. the judgement (:func:`judge_residual`, :func:`fit_layer_values`, :func:`judge_estimate`) and the long
   verification (:func:`verify_long`);
6. the result (:meth:`RotaryRun.result`), the models shifted back by the key-neutral token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..checks.base import Check, available_memory, parameter_estimate_limit
from ..checks.noise_probe import taken_as_float32
from ..checks.verify import ask_long_verification, output_errors
from ..numerics.highprec import mid_float, mpf_array
from ..oracle.answer_stats import FORMAT_UNITS
from ..oracle.boundary import OracleBoundary
from ..oracle.progress import note_progress
from ..oracle.queries import random_queries
from ..oracle.vector_answers import VectorAnswers
from ..run.validation import spawn_rng
from ..run.value_fit import VALUE_QUERY_LENGTHS, fit_values, value_query_count
from .learn import (FIRST_LOOK_UNIT, NOISY_SPARE_TOKENS, SPARE_TOKENS, RotaryExtraction, RotaryLearner, spares_after,
                    answer_noise, ask_instances, channel_projection, choose_token_scale, start_structure_error,
                    structure_limit)
from .neutral import LARGE_QUERY_LENGTHS, LARGE_QUERY_MIN_WINDOW, NeutralToken, ShiftedBoundary, find_neutral_token
from .refine import GeneratorForm, error_moves, pack, polish_high_precision, refine, refinement_memory
from .window import WindowSearch, find_window

#: The coarsest answers the rotary schedule takes: float32's unit roundoff.
COARSEST_UNIT = FORMAT_UNITS["float32"]
#: Float64 limit of the answers' misfit (relative); for coarser answers (float32) these many units of
#: their rounding, where that is larger. The estimate's limit is every family's
#: (``checks.base.parameter_estimate_limit``).
RESIDUAL_LIMIT = 1e-9
RESIDUAL_UNITS = 30.0
#: The steps stop once one gains less than a tenth of the cost with the max misfit below this many units
#: of the answers' rounding (at least 1e-13): a float32 layer's own rounding leaves a max misfit of about
#: 4 units over the 3 P polish queries (llama-d64-h4/0: 2.2e-7), where more steps gain nothing.
FLOOR_UNITS = 10.0
#: The smallest error estimate claimed: float64 rounding through the scores and the softmax.
ESTIMATE_FLOOR = 1e-14
#: At most this many steps on the slow blocks' generators (``seed_slow_blocks``) before the rotary steps;
#: they stop sooner, once the max misfit is within the steps' floor (``FLOOR_UNITS``).
GENERATOR_STEPS = 12
#: The generator steps fit this fraction of the polish queries (at least ``GENERATOR_LEAST`` times the form's
#: parameters): they take the slow blocks into the rotary steps' basin, which then fit every polish query, and
#: each step's ``J^T J`` costs in proportion to the queries (about 50 s of one core for all of them at d = 64).
GENERATOR_QUERIES, GENERATOR_LEAST = 0.5, 1.25
#: Generator steps stop once they crawl (:data:`~mhaextract.rotary.refine.CRAWL_RATIO`) anywhere above the steps'
#: floor, and hand over to the rotary steps (qwen2-d64-h4/0 in float64: 1.9e-9, then six steps of a minute at
#: 1.7e-9, where the rotary steps went on to 1e-15); ending above this max misfit (relative) they fail the run's
#: start loudly, and rotary steps crawling above it stop (the residual check then fails). From there the steps
#: would crawl for up to an hour at d = 64 (mistral-d64-h4/1 in float32: 0.29, 0.25 after two generator steps of a
#: minute each), where a start in their basin leaves a few 1e-3 after one.
CRAWL_MISFIT = 1e-2
#: The size of the key the large-query search leaves (float32 answers; docs/rotary.md, "From
#: float32 answers"): the refinement's key bias has a Gaussian prior of this size.
SEARCH_KEY_SIZE = 1e-4
#: A start over its ``structure_limit`` had its heads matched wrongly across instances: its instances are
#: drawn again, at most this many times in all, the best kept.
START_DRAWS = 3
#: Float64 answers whose self instances' fits miss by more than this (``answer_noise``, relative)
#: carry noise far above their bits' rounding (exact float64 answers leave about 1e-15): a layer
#: computing its rotary angles or softmax in float32. They are taken as float32 answers
#: (``NOISY_UNIT``): the start, refinement, checks and estimate at float32's rounding.
NOISY_ANSWERS = 1e-11
NOISY_UNIT = COARSEST_UNIT
#: A misfit above this is no rounding inside the layer but structure the model lacks (an exact
#: float64 Qwen2 layer's key bias without ``key_bias=True``: 7e-3): the run goes on as float64.
FLOAT32_NOISE = 1e-6
#: A failed start's self instances within this many units of the answers' rounding (or FLOAT32_NOISE) had a
#: zero token that counts: the start's hint names crowded poles, not a key bias (``_start_hint``).
SELF_MISFIT_UNITS = 100.0
#: A float64 run's misfit below this (relative) is what float32 rounding inside the layer leaves.
FLOAT32_FIT = 1e-5
#: Said by a failed float64 key-neutral search: float64 answers computed in float32 are not
#: measured before it (docs/algorithm.md, 'Float64 answers computed in float32').
FLOAT64_SEARCH_HINT = ("; the float64 search needs answers exact to float64: a float64 layer that computes its "
                       "rotary angles or softmax in float32 (transformers' own rotary embedding, the eager softmax) "
                       "fails it; ask its exact float64 copy (adapters.rotary.float64_layer), or the layer in "
                       "float32, whose answers take the large-query search")
#: The float64 search's checks that float64 answers computed in float32 fail (docs/algorithm.md, 'Float64
#: answers computed in float32'): after them the search for float32 answers is taken.
NOISE_SEARCH_CHECKS = ("query_neutral", "key_neutral")
#: Fresh polish queries per parameter of the model, and their lengths (inclusive).
POLISH_FACTOR = 3
POLISH_LENGTHS = (2, 64)


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


def _fewer_bits(precision: int | None, residual: float, limit: float, float64_unit: bool = False) -> str:
    """A high-precision run whose model fits its answers only to about 2^-b, b < precision: what
    an oracle computing at about b bits gives (its answers carry no more, whatever their type). A
    float64 run judged at float64's unit (``float64_unit``: no noise measured, ``take_as_float32`` not
    taken) whose model fits only to float32's rounding: a float64 layer computing its angles or
    softmax in float32."""
    if not residual > limit:
        return ""
    if precision is None and float64_unit and 0 < residual < FLOAT32_FIT:
        return (f": the answers fit only to about {residual:.0e}, as a float64 layer computing its rotary angles "
                "or softmax in float32 (transformers' own rotary embedding, the eager softmax) gives; leave "
                "token_scale unset (the run then measures the answers' noise and extracts to it), or ask an exact "
                "float64 copy (adapters.rotary.float64_layer)")
    if precision is None or not 0 < residual < 2.0 ** -40:
        return ""
    bits = int(-np.log2(residual))
    return (f": the answers fit only to about 2^-{bits}, as an oracle computing at about {bits} bits, not "
            f"precision={precision}, would give: run at the oracle's own precision")


def _noisy_float64_start(run) -> str:
    """Said by a failed float64 run whose instances' log-scores were as noisy as float32's (their
    median matching misfit above ``NOISY_MATCH``): after a key-neutral token, the key it leaves."""
    if run.coarse or not run.diagnostics.get("noisy_log_scores") or run.residual <= run.residual_limit:
        return ""
    median = (run.diagnostics.get("match_quantiles") or [np.nan])[0]
    return (f"; the instances' log-scores were as noisy as float32 answers give (median matching misfit {median:.0e}, "
            "exact float64 answers leave far less)" + (": the key-neutral token leaves a key, so zero tokens "
                                                       "are no exact counters" if run.neutral is not None else ""))


@dataclass(eq=False)
class RotaryRun:
    """The state of one rotary run, filled in by the steps in order. What the caller passed:
    ``boundary`` (replaced by a :class:`~mhaextract.rotary.neutral.ShiftedBoundary` once the
    key-neutral token is known), ``vectors`` (the whole answers' read-out), ``d``, ``heads``,
    ``seed``, ``precision`` (``units``: the float64 limits' factor ``2^(53 - precision)``, 1 in
    float64), ``token_scale`` (the caller's, or None: chosen from queries), ``key_bias``."""

    boundary: object
    vectors: VectorAnswers
    d: int
    heads: int
    seed: object
    precision: int | None
    token_scale: float | None
    bias: bool
    rank: int | None
    key_bias: bool
    progress: object
    answer_dtype: str
    started: float
    units: float
    token_bound: float | None = None  # the oracle's: the largest token norm it answers (None: any)
    polish_factor: float = POLISH_FACTOR  # fresh polish queries per parameter
    value_factor: float = 1.0  # times the value fit's read-out queries
    # the first look
    c: float = 0.0  # the output constant (read out to a scalar)
    c_whole: np.ndarray | None = None  # a whole layer's output constant
    scale: float = 0.0  # the first token scale, before the learner's choice
    window: WindowSearch | None = None
    coarse: bool = False  # float32 answers, or float64 ones as noisy (``noise``)
    noise: float | None = None  # the answers' measured relative noise, where above their bits' rounding
    self_misfit: float | None = None  # the basis tokens' self instances' median misfit (the token scale's choice)
    learner: RotaryLearner | None = None
    checks: list = field(default_factory=list)
    neutral: NeutralToken | None = None
    shifted_frame: dict | None = None  # the key-neutral token's norm, the shifted frame's constant, the layer's
    # the start
    projection: np.ndarray | None = None  # a whole layer's outputs onto a few channels
    channels_c: np.ndarray | None = None
    unit: float = 0.0  # the answers' unit, read from the instances' bits
    channels: np.ndarray | None = None
    start: object = None
    diagnostics: dict = field(default_factory=dict)
    sequences: list = field(default_factory=list)
    exact: np.ndarray = field(default_factory=lambda: np.zeros(0))
    answers: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # the refinement
    polish: list | None = None
    polish_exact: object = None
    polish_answers: np.ndarray | None = None
    key_size: float | None = None
    model: object = None
    refinement: object = None
    # the judgement
    residual: float = np.inf
    estimate: float = np.inf
    residual_limit: float = np.inf
    estimate_limit: float = np.inf
    whole: np.ndarray | None = None  # the value read-outs' whole answers
    value_fit: object = None
    scalar_model: object = None
    verification: object = None

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def frame_shift(self) -> np.ndarray | None:
        """The shift back to the original tokens, ``x' = x - z*``, or None without a key-neutral token."""
        return None if self.neutral is None else -self.neutral.token

    def ask(self, patterns, description):
        """The instances of ``patterns`` at the learner's counts: ``(queries, read-out answers,
        channels)`` (:func:`~mhaextract.rotary.learn.ask_instances`)."""
        return ask_instances(self.boundary, self.vectors, self.projection, patterns, self.learner.ks, description)

    def steps(self, model, iterations=60, estimate=True):
        """Levenberg-Marquardt steps on the polish queries (docs/algorithm.md, 'Rotary attention: positions, grouped
        heads and sliding windows', 'Refinement'), down to the answers' rounding, or until they crawl above
        ``CRAWL_MISFIT`` (the residual check then fails)."""
        return refine(model, self.polish, self.polish_answers, iterations=iterations, seed=self.seed,
                      floor=max(1e-13, FLOOR_UNITS * self.unit), estimate=estimate, frame_shift=self.frame_shift,
                      key_size=self.key_size, crawl=CRAWL_MISFIT,
                      on_step=lambda step, misfit: note_progress(
                          self.progress, f"refining the rotary model: step {step}, max misfit {misfit:.1e}"))

    def refused(self) -> RotaryExtraction:
        """The result of a run stopped before its instances (a failed check of the key-bias search)."""
        boundary = self.boundary
        return RotaryExtraction(model=None, heads=0, d=self.d, seed=self.seed, schedule="rotary",
                                answer_dtype=self.answer_dtype, queries=boundary.queries + boundary.replayed,
                                queries_asked=boundary.queries, queries_replayed=boundary.replayed,
                                max_query_length=boundary.max_query_length, window=self.window.window,
                                window_search=self.window, token_scale=self.scale, error_estimate=np.inf,
                                answers_residual=np.inf, seconds=time.perf_counter() - self.started,
                                checks=self.checks, neutral=self.neutral)

    def result(self) -> RotaryExtraction:
        """The result, its models seen through the original tokens (``x' = x - z*``) after a key-neutral token."""
        model, start, scalar_model = self.model, self.start, self.scalar_model
        if self.neutral is not None:
            model, start, scalar_model = (None if m is None else m.with_token_shift(-self.neutral.token)
                                          for m in (model, start, scalar_model))
        boundary, verification, whole_layer = self.boundary, self.verification, (self.vectors.d_out or 1) > 1
        return RotaryExtraction(
            model=model, heads=0 if model is None else model.heads, d=self.d, seed=self.seed, schedule="rotary",
            answer_dtype=self.answer_dtype, queries=boundary.queries + boundary.replayed,
            queries_replayed=boundary.replayed,
            verification_queries=0 if verification is None else verification.queries,
            verification_length=0 if verification is None else verification.lengths[1],
            queries_asked=boundary.queries, max_query_length=boundary.max_query_length,
            window=self.window.window, window_search=self.window, token_scale=self.learner.token_scale,
            error_estimate=float(self.estimate), answers_residual=float(self.residual),
            seconds=time.perf_counter() - self.started, checks=self.checks, verification=verification,
            start=start, refinement=self.refinement, diagnostics=self.diagnostics,
            scalar_model=scalar_model, value_fit=self.value_fit,
            readout=self.vectors.readout if whole_layer else None, precision=self.precision, neutral=self.neutral)


def begin_run(oracle, d: int, heads: int, seed, precision: int | None, token_scale, bias: bool, rank: int | None,
              batch_size: int, progress, max_queries, key_bias: bool, boundary) -> RotaryRun:
    """The run's state before its first query: the session's boundary, or one of its own."""
    started = time.perf_counter()
    answer_dtype = str(getattr(oracle, "answer_dtype", "float64" if precision is None else "mpf"))
    if boundary is None:
        boundary = OracleBoundary(oracle, d, precision=precision, batch_size=batch_size, progress=progress,
                                  max_queries=max_queries, vectors=VectorAnswers(seed, getattr(oracle, "answer_dtype",
                                                                                               None)))
    # the limits of a high-precision run: the float64 ones in units of its answers' rounding
    units = 1.0 if precision is None else 2.0 ** (53 - precision)
    return RotaryRun(boundary=boundary, vectors=boundary.vectors, d=d, heads=heads, seed=seed, precision=precision,
                     token_scale=token_scale, bias=bias, rank=rank, key_bias=key_bias, progress=progress,
                     answer_dtype=answer_dtype, started=started, units=units,
                     token_bound=getattr(oracle, "token_bound", None))


def first_look(run: RotaryRun, window_limit: int) -> None:
    """The first look (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows',
    'Windows'): the output constant c (one zero token), the sliding window, the learner at the first token
    scale, and the checks of the answers' precision and of the window against the instances' length."""
    d, precision, boundary = run.d, run.precision, run.boundary
    constant = boundary.ask([np.zeros((1, d))], "the output constant", whole=precision is None)
    run.c_whole = constant[0] if np.ndim(constant) == 2 else None  # a whole layer's output constant
    run.scale = d ** 0.25 if run.token_scale is None else float(run.token_scale)
    run.c = float(run.vectors.scalars(constant)[0] if run.c_whole is not None else constant[0])
    # (y, 0^(L-1)) answers c once y left the window, key bias or not (every token attended is 0 and
    # carries the same value whatever it scores): the window is found before any key-neutral token
    run.window = find_window(boundary, spawn_rng(run.seed, 21), run.scale, run.c, window_limit, run.token_bound)
    run.coarse = boundary.answer_unit > FIRST_LOOK_UNIT  # float32 answers
    run.learner = RotaryLearner(d, run.heads, run.seed, run.scale, run.bias, run.rank, run.window.window,
                                NOISY_SPARE_TOKENS if run.coarse else SPARE_TOKENS)
    # at coarser answers than float32 the window search reads rounding as a window: not reported
    run.checks = [answer_precision(boundary.answer_unit if precision is None else 2.0 ** -precision)]
    if run.checks[-1].passed:
        run.checks.append(run.window.check(run.learner.samples + 3))


def seek_neutral_token(run: RotaryRun) -> None:
    """The key-neutral token z* (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding
    windows', 'A key bias: a key-neutral token'), sought from whole answers, and from float32 answers only
    under a window that leaves the large-query search its counts; its checks join the run's."""
    window = run.window.window
    if run.c_whole is None:
        run.checks.append(Check("key_bias", False, 1.0, 2.0, "a key bias is sought from whole answers (a vector "
                                "a query): this oracle answers one number; ask the whole layer"))
    elif run.coarse and window is not None and window < LARGE_QUERY_MIN_WINDOW:
        run.checks.append(Check("key_bias", False, float(window), float(LARGE_QUERY_MIN_WINDOW),
                                "the sliding window: from float32 answers the key-neutral token is sought over "
                                f"counts up to {LARGE_QUERY_LENGTHS[-1]}, and a window this short leaves too few "
                                "of them; run the layer in float64 (layer.double(), the same weights) and "
                                "compare the model with the float32 layer's outputs"))
    else:
        run.neutral = find_neutral_token(run.boundary, run.c_whole, spawn_rng(run.seed, 24), run.scale, run.progress,
                                         window, heads=run.heads, coarse=run.coarse)
        checks = run.neutral.checks()
        if not run.coarse and not all(check.passed for check in checks) and run.precision is None and \
                checks[-1].name in NOISE_SEARCH_CHECKS and not (window is not None and window < LARGE_QUERY_MIN_WINDOW):
            # float64 answers computed in float32 fail the float64 search (its first-order differences read the
            # noise): the search for float32 answers is taken, and the noise measured after the shift
            run.diagnostics["float64_search"] = {check.name: check.value for check in checks}
            run.neutral = find_neutral_token(run.boundary, run.c_whole, spawn_rng(run.seed, 26), run.scale,
                                             run.progress, window, heads=run.heads, coarse=True)
            checks = run.neutral.checks()
        if not run.neutral.large_queries:  # the float64 search cannot tell noisy answers from a token not neutral
            checks = [check if check.passed else replace(check, message=check.message + FLOAT64_SEARCH_HINT)
                      for check in checks]
        run.checks += checks


def shift_to_neutral_token(run: RotaryRun) -> None:
    """The shift (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows', 'A key
    bias: a key-neutral token'): from here on every query is asked at tokens shifted by z*, where the layer
    is seen without its key bias and the zero token is z*; c is asked again there."""
    run.boundary = ShiftedBoundary(run.boundary, run.neutral.token)
    constant = run.boundary.ask([np.zeros((1, run.d))], "the output constant", whole=True)
    run.shifted_frame = {"token_norm": float(np.linalg.norm(run.neutral.token)),
                         "constant": float(np.linalg.norm(constant[0])),
                         "layer_constant": float(np.linalg.norm(run.c_whole))}
    run.c_whole = constant[0]
    run.c = float(run.vectors.scalars(constant)[0])


def ask_instances_at_scale(run: RotaryRun) -> None:
    """The instances (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows',
    'Zero tokens are counters', 'Samples' and 'Whole layers: poles from several read-outs'): a whole layer's
    channels, the token scale chosen from the basis tokens' self instances (unless given), the instances
    asked at it, and the answers' unit read from their bits (coarser than float32: refused)."""
    # a whole layer: its outputs, read out on a few channels, place the instances' poles too
    if run.c_whole is not None and len(run.c_whole) > 1:
        run.projection = channel_projection(spawn_rng(run.seed, 23), len(run.c_whole), run.heads)
    run.channels_c = None if run.projection is None else run.c_whole @ run.projection
    if run.token_scale is None:
        residuals = choose_token_scale(run.learner, run.ask, run.c, run.channels_c, run.coarse)
        run.self_misfit = answer_noise(residuals)
        # after the float64 search's key-neutral token the fits also carry what is left of the key bias
        # (its key misfit, 4e-9 on exact answers): no measure of noise there; after the large-query search
        # that float64 answers took (their float64 search failed) the noise is measured here, the fits
        # carrying the key that search leaves as well (up to FLOAT32_FIT)
        searched = run.neutral is not None and run.neutral.large_queries and not run.coarse
        if (not run.coarse and run.precision is None and (run.neutral is None or searched)
                and NOISY_ANSWERS < answer_noise(residuals) <= (FLOAT32_FIT if searched else FLOAT32_NOISE)):
            take_as_float32(run, answer_noise(residuals))
        elif searched:
            run.checks.append(Check("answer_noise", False, answer_noise(residuals), NOISY_ANSWERS,
                                    "the float64 key-neutral search failed "
                                    f"({run.diagnostics.get('float64_search')}), the large-query search was taken, "
                                    "and the answers, measured after the shift, are out of the band of float32 "
                                    "rounding (their self instances' fits miss by this much): the float64 search "
                                    "failed for another cause (a final token with zero query needs H r <= d)"))
    run.sequences, run.exact, run.channels = run.ask(run.learner.patterns(), "rotary instances")
    run.unit = max(run.boundary.answer_unit, NOISY_UNIT if run.noise is not None else 0.0)
    if run.unit > COARSEST_UNIT:  # seen only now in the answers' bits
        run.checks.append(answer_precision(run.unit))


def take_as_float32(run: RotaryRun, noise: float) -> None:
    """Float64 answers that carry noise far above float64 rounding (docs/algorithm.md, 'Rotary attention:
    positions, grouped heads and sliding windows', 'Float64 answers computed in float32'): the basis tokens'
    self instances, asked at the first token scale to choose it, miss their rational fits by ``noise``
    (median, relative), which exact answers of the rotary model never do. The run goes on as from float32
    answers: the learner with float32's spare tokens, the token scale sized again to first order, and the
    answers' unit float32's (``NOISY_UNIT``) for the start, the refinement, the checks and the estimate."""
    run.noise, run.coarse = noise, True
    run.learner = RotaryLearner(run.d, run.heads, run.seed, run.scale, run.bias, run.rank, run.window.window,
                                NOISY_SPARE_TOKENS)
    choose_token_scale(run.learner, run.ask, run.c, run.channels_c, coarse=True)
    run.checks.append(taken_as_float32(noise, NOISY_ANSWERS, "the self instances' rational fits miss by that much; "
                                       "exact answers leave about 1e-15", "a float64 layer that computes its rotary "
                                       "angles or softmax in float32 gives (transformers' own rotary embedding, the "
                                       "eager softmax)"))


def learn_start(run: RotaryRun) -> None:
    """The start model from the instances' fits, matching and assembly (docs/algorithm.md, 'Rotary attention:
    positions, grouped heads and sliding windows', 'Matching', 'Assembly' and 'The rotation from two
    offsets'), drawn again while its structure says heads were matched wrongly across the instances (at
    float32 one draw in a few): fresh instances at the same token scale, at most ``START_DRAWS`` draws,
    the best start kept and every answer kept for the residual check."""
    learner, c, unit, channels_c = run.learner, run.c, run.unit, run.channels_c
    run.start, run.diagnostics = learner.learn(mid_float(run.exact), c, unit, run.channels, channels_c)
    drawn, last, diagnostics = [start_structure_error(run.diagnostics)], learner, run.diagnostics
    _note_draw(run, 1, learner, diagnostics)
    for draw in range(1, START_DRAWS):
        if drawn[-1] <= structure_limit(diagnostics.get("noisy_log_scores", False)):
            break
        again = learner.drawn_again(int(spawn_rng(run.seed, 25 + draw).integers(2 ** 63)),
                                    spares_after(diagnostics, last.spares, run.d))
        more, more_exact, more_channels = run.ask(again.patterns(), f"rotary instances, draw {draw + 1}")
        run.sequences, run.exact = list(run.sequences) + list(more), np.concatenate([run.exact, more_exact])
        trial, trial_diagnostics = again.learn(mid_float(more_exact), c, unit, more_channels, channels_c)
        last, diagnostics = again, trial_diagnostics
        _note_draw(run, draw + 1, again, diagnostics)
        drawn.append(start_structure_error(trial_diagnostics))
        if drawn[-1] < min(drawn[:-1]):
            run.start, run.diagnostics = trial, trial_diagnostics
    run.diagnostics["start_structure_errors"] = drawn
    if run.noise is not None:
        run.diagnostics["answer_noise"] = run.noise


def _note_draw(run: RotaryRun, draw: int, learner: RotaryLearner, diagnostics: dict) -> None:
    """A draw of the start on the run's progress: its structure error, its spares and the tokens it lost."""
    lost = ", ".join(f"{diagnostics[key]} {key.replace('_', ' ')}" for key in
                     ("dropped_finals", "dropped_keys", "outlier_finals", "outlier_keys") if diagnostics.get(key))
    note_progress(run.progress, f"start, draw {draw}: structure error {start_structure_error(diagnostics):.2g}, "
                                f"{learner.spares} spare tokens" + (f", {lost}" if lost else "")
                                + (f" ({diagnostics['no_start']})" if "no_start" in diagnostics else ""))


def settle_start(run: RotaryRun) -> None:
    """The start as the refinement takes it: the answers' midpoints, the window found, a key bias fitted
    from 0 (what the shift left of it); no start fails the ``start`` check, naming what went wrong."""
    run.answers = mid_float(run.exact)
    if run.shifted_frame is not None:
        run.diagnostics["shifted_frame"] = run.shifted_frame
    if run.start is not None and run.window.window is not None:
        run.start = run.start.replaced(window=run.window.window)
    if run.start is not None and run.key_bias:  # what is left of the key bias after the shift, fitted from 0
        run.start = run.start.replaced(key_bias=np.zeros_like(run.start.b))
    if run.start is None and run.unit <= COARSEST_UNIT:
        run.checks.append(Check("start", False, float(run.diagnostics.get("failed_instances", 0)), 0.0,
                                "the instances gave no start model (too many failed fits or unmatched heads): "
                                f"{run.diagnostics}" + (_shifted_frame_hint(run) if run.key_bias else _start_hint(run))))


def _start_hint(run: RotaryRun) -> str:
    """What a failed start without ``key_bias`` shows (issue 64: the key-bias hint on a layer without biases):
    self instances that miss their fits far beyond the answers' rounding are a zero token that is no counter,
    a key bias the likeliest cause; self instances within it say the zero token is a counter, and the start
    lost the heads' poles where they crowd (float32 answers: the same weights in float64 separate them)."""
    misfit = run.self_misfit
    if misfit is None or not misfit <= max(FLOAT32_NOISE, SELF_MISFIT_UNITS * run.unit):
        measured = "" if misfit is None else f" (the basis tokens' self instances miss their fits by {misfit:.1e})"
        return f"; a key bias (Qwen2's k_proj.bias) makes the zero token no counter{measured}: try key_bias=True"
    remedy = "another seed, or rank= the heads' width" if run.unit <= FIRST_LOOK_UNIT else _float64_remedy(run)
    return (f"; the basis tokens' self instances fit their answers to {misfit:.1e} (their rounding), so the zero "
            "token is a counter and no key bias is missing: the instances lost the heads' poles where they crowd "
            f"(the failed, mismatched and dropped counts above): try {remedy}")


def _shifted_frame_hint(run: RotaryRun) -> str:
    """A key-bias start that failed on answers rounded at float32: the frame it was asked in, and what to
    try (docs/trained-layers.md, 'Trained rotary layers in float32': both zoo Qwen2 layers fail there in
    float32, their frames' constants 12..20 times the layer's own, and extract in float64)."""
    frame = run.shifted_frame
    if frame is None or run.unit <= FIRST_LOOK_UNIT:
        return ""
    return (f"; every query was asked at tokens shifted by the key-neutral token z* (norm "
            f"{frame['token_norm']:.3g}), where the layer's output constant is {frame['constant']:.3g} against its "
            f"own {frame['layer_constant']:.3g}, and a layer rounding at float32 rounds its keys, values and outputs "
            f"relative to that frame: run {_float64_remedy(run)} and judge the model against this layer's outputs")


def _float64_remedy(run: RotaryRun) -> str:
    """What to run instead of answers rounded at float32: the same weights in float64, or for a float64 layer
    computing in float32 inside, its exact float64 copy."""
    return ("the same weights in float64 (layer.double())" if run.answer_dtype == "float32" else
            "its exact float64 copy (mhaextract.adapters.rotary.float64_layer(attention, embedding))")


def _start_remedies(run: RotaryRun) -> str:
    """What to try after a start the steps would crawl from: ``rank=`` first where the widths the grids gave
    the heads differ (a layer's heads share one width; wide heads from float32 answers, docs/algorithm.md,
    'Rotary attention: positions, grouped heads and sliding windows', 'Assembly'), then another seed or float64."""
    widths = run.diagnostics.get("widths")
    differ = not run.rank and widths is not None and len(set(widths)) > 1
    return ((f"rank= the heads' width (config.head_dim; the widths read, {widths}, differ, where a layer's heads "
             "share one), " if differ else "") + f"another seed, or {_float64_remedy(run)}")


def _noisy_start(run: RotaryRun) -> bool:
    """Whether the start's slow blocks are fitted as generators first: a start from noisy log-scores has their
    angles and planes in the noise, float64 answers or not."""
    return bool(run.coarse or run.diagnostics.get("noisy_log_scores", False))


def check_refinement_memory(run: RotaryRun) -> None:
    """The refinement's memory (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding
    windows', 'Refinement'): its normal equations (or a high-precision run's Jacobian) beside the memory
    available, refused before the polish queries are spent; the start is then dropped."""
    queries = int(run.polish_factor * len(pack(run.start)))
    # a noisy start's slow blocks are first fitted as generators: a few hundred parameters more at d = 64
    form = GeneratorForm.of(run.start) if _noisy_start(run) else None
    parameters = max(len(pack(run.start)), 0 if form is None else len(pack(form)))
    need, have = refinement_memory(parameters, queries, run.precision), available_memory()
    if have is not None and need > have:
        run.checks.append(Check("refinement_memory", False, float(need), float(have),
                                f"the refinement's {'normal equations' if run.precision is None else 'Jacobian'} "
                                f"in {parameters:,} parameters (head width "
                                f"{run.start.head_width}) would hold about {need / 2**30:.1f} GiB, beside "
                                f"{have / 2**30:.1f} GiB available: run on a machine with more memory; a head "
                                "width above the layer's (diagnostics['widths']) says the start misjudged it: "
                                "pass rank= the layer's head width"))
        run.start = None


def ask_polish_queries(run: RotaryRun) -> None:
    """``3 P`` fresh random queries of 2..64 tokens for the refinement (docs/algorithm.md, 'Rotary attention:
    positions, grouped heads and sliding windows', 'Refinement'), and the key bias's prior after the
    large-query search: a Gaussian of the size it leaves, or the steps trade it for the slowest angle
    (theta -> 0, k -> large)."""
    run.polish = random_queries(spawn_rng(run.seed, 22), int(run.polish_factor * len(pack(run.start))), run.d,
                                run.learner.token_scale, POLISH_LENGTHS, bound=run.token_bound)
    run.polish_exact = run.boundary.ask(run.polish, "refining on fresh queries")
    run.polish_answers = mid_float(run.polish_exact)
    run.key_size = SEARCH_KEY_SIZE if run.neutral is not None and run.neutral.large_queries else None


def seed_slow_blocks(run: RotaryRun):
    """From float32 answers, whose slow blocks' angles and planes from M's eigenvalues are noise
    (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows', 'Slow blocks
    from float32 answers'): the steps first on the exact generators of each head's blocks turning less than
    ``GENERATOR_LIMIT`` (:class:`~mhaextract.rotary.refine.GeneratorForm`), whose planes move linearly there,
    then the rotary model of their real form, or the start where its max misfit on the polish answers is lower. Every
    generator step forms ``J^T J`` afresh: in this form they converge quadratically, and a chord step's
    linear rate would cost more steps than it saves.
    Returns ``(model, the generator steps' refinement or None)``; ``diagnostics["generator_blocks"]`` the
    blocks taken as generators."""
    form = GeneratorForm.of(run.start)
    run.diagnostics["generator_blocks"] = 0 if form is None else form.blocks
    if form is None:
        return run.start, None
    note_progress(run.progress, f"fitting {form.blocks} slow rotary blocks as generators")
    floor = max(1e-13, FLOOR_UNITS * run.unit)
    count = max(int(GENERATOR_QUERIES * len(run.polish)), int(GENERATOR_LEAST * len(pack(form))))
    polish, answers = run.polish[:count], run.polish_answers[:count]
    fitted, stretch = refine(form, polish, answers, iterations=GENERATOR_STEPS, floor=floor,
                             until=floor, estimate=False, key_size=run.key_size, reuse_gain=np.inf, accelerate=False,
                             crawl=floor,
                             on_step=lambda step, misfit: note_progress(
                                 run.progress, f"refining the slow blocks' generators: step {step}, "
                                               f"max misfit {misfit:.1e}"))
    model = fitted.to_rotary()
    # the form began as the start itself: its misfit before the steps is the start's
    misfit = float(np.abs(model(polish) - answers).max()) / max(float(np.abs(answers).max()), 1e-300)
    return (model, stretch) if misfit <= stretch.residual_before else (run.start, None)


def refine_start(run: RotaryRun) -> None:
    """The refinement (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows',
    'Refinement' and 'High precision'): the polish queries, the slow blocks fitted as generators (float32 answers,
    or a start from log-scores as noisy as theirs), the steps, a high-precision run's polish at its bits; the polish queries then join the instances'."""
    ask_polish_queries(run)
    model, first = seed_slow_blocks(run) if _noisy_start(run) else (run.start, None)
    if first is not None and first.residual_after > CRAWL_MISFIT:
        run.checks.append(Check("start", False, first.residual_after, CRAWL_MISFIT,
                                f"the start is {first.residual_before:.1e} off the refinement's fresh answers (max "
                                f"misfit, relative) and {first.iterations} steps on its slow blocks' generators left "
                                f"{first.residual_after:.1e} before they crawled or no step gained (from a start the "
                                f"steps take to the answers' rounding one step leaves {CRAWL_MISFIT:.0e} or less): a "
                                "head of the start was matched or assembled wrongly, unseen by its structure errors "
                                f"{run.diagnostics.get('start_structure_errors')}, and the steps would crawl from "
                                f"there: try {_start_remedies(run)}"))
        run.refinement = first
        return
    run.model, run.refinement = run.steps(model)
    if first is not None:
        run.refinement = replace(run.refinement, iterations=first.iterations + run.refinement.iterations,
                                 residual_before=first.residual_before)
    if run.precision is not None:
        precision, progress = run.precision, run.progress
        run.model, run.refinement = polish_high_precision(
            run.model, run.polish, mpf_array(run.polish_exact), precision, seed=run.seed,
            on_step=lambda step, misfit: note_progress(
                progress, f"refining at {precision} bits: step {step}, max misfit {misfit:.1e}"))
    run.sequences = list(run.sequences) + run.polish
    run.answers = np.concatenate([run.answers, run.polish_answers])
    run.exact = np.concatenate([run.exact, run.polish_exact])


def judge_residual(run: RotaryRun) -> None:
    """The judgement's first part (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding
    windows', 'Samples'): the model's misfit on every query asked (instances and polish queries) relative
    to the largest answer, within ``max(1e-9, 30 u)``; the refinement's first-order estimate, and its limit
    :func:`~mhaextract.checks.base.parameter_estimate_limit` (both in units of a high-precision run's rounding)."""
    units, unit = run.units, run.unit
    scale_answers = max(float(np.abs(run.answers).max()), 1e-300)
    run.residual = float(output_errors(run.model, run.sequences, run.exact, run.precision).max()) / scale_answers
    run.estimate = max(run.refinement.noise_error, ESTIMATE_FLOOR * units)
    run.residual_limit = max(RESIDUAL_LIMIT, RESIDUAL_UNITS * unit) * units
    run.estimate_limit = parameter_estimate_limit(unit) * units
    run.checks += [
        Check("answers_residual", run.residual <= run.residual_limit, run.residual, run.residual_limit,
              f"max misfit of the model on the {len(run.sequences)} queries asked (instances and fresh polish "
              "queries), relative to the largest answer" + _fewer_bits(run.precision, run.residual,
                                                                         run.residual_limit,
                                                                         run.unit <= FIRST_LOOK_UNIT)
              + _noisy_float64_start(run)),
    ]


def fit_layer_values(run: RotaryRun) -> None:
    """A whole layer's values (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module'):
    V_h and c fitted to whole answers of fresh value read-out queries, with the refinement's score error;
    the model becomes the whole layer's (the scalar one kept) and the estimate takes the fit's."""
    model, estimate = run.model, run.estimate
    count = int(run.value_factor * value_query_count(model.heads, run.d))
    value_queries = random_queries(spawn_rng(run.seed, 13), count, run.d,
                                   run.learner.token_scale, VALUE_QUERY_LENGTHS, bound=run.token_bound)
    run.whole = run.boundary.ask(value_queries, "value read-outs", whole=True)
    run.value_fit = fit_values(model, value_queries, run.whole, bias=True, readout=run.vectors.readout,
                               score_error=(estimate, estimate), seed=run.seed,
                               score_moves=None if run.refinement.error_draws is None
                               else error_moves(model, run.refinement.error_draws),
                               frame_shift=run.frame_shift)
    run.checks += run.value_fit.checks(run.residual_limit, estimate)
    run.scalar_model, run.model = model, run.value_fit.model
    run.estimate = max(estimate, run.value_fit.error_estimate)


def judge_estimate(run: RotaryRun) -> None:
    """The error estimate's check (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding
    windows', 'Refinement'): first order, within ``max(1e-8, min(1e4 u, 1e-2))`` (every family's limit)."""
    run.checks.append(Check("error_estimate", run.estimate <= run.estimate_limit, run.estimate, run.estimate_limit,
                            "first-order error of W_h(0..2), u_h(0..2) and the values, from the refinement's "
                            "residual (and the value fit's for a whole layer)"))


def verify_long(run: RotaryRun, verify_length: int | None) -> None:
    """The long verification (docs/algorithm.md, 'Default verification on fresh long queries'): fresh queries
    up to ``verify_length`` tokens (256, or four windows), judged against the estimate and the residual."""
    longest = verify_length or max(256, 4 * (run.window.window or 0))
    long_queries = ask_long_verification(run.boundary, spawn_rng(run.seed, 5), run.learner.token_scale, longest)
    scale_long = float(np.abs(run.whole).max()) if run.value_fit is not None else float(np.abs(run.answers).max())
    check, run.verification = long_queries.judge(run.model, run.estimate, run.residual, 0.0, max(scale_long, 1e-300),
                                                 max(run.boundary.answer_unit, run.unit) * run.units,
                                                 max(POLISH_LENGTHS[1], run.learner.longest_instance), seed=run.seed,
                                                 precision=run.precision)
    run.checks.append(check)


def extract_rotary(oracle, d: int, heads: int, seed=None, *, precision: int | None = None, token_scale=None,
                   bias: bool = True, rank: int | None = None, batch_size: int = 1024, progress=None,
                   max_queries=None, verify_length: int | None = None,
                   window_limit: int = 4096, key_bias: bool = False, boundary=None,
                   polish_factor: float = POLISH_FACTOR, value_factor: float = 1.0) -> RotaryExtraction:
    """The rotary extraction behind ``extract(..., positions="rotary")`` (its checks unreported:
    ``extract`` raises or warns on failure). ``precision=bits``: an oracle answering ``mpf`` at
    ``bits``; the float64 fit is taken to them by :func:`~mhaextract.rotary.refine.polish_high_precision`.
    ``key_bias=True`` (float64 or float32 whole answers): the layer's keys carry a bias; every query
    after the search for a key-neutral token z* (:mod:`~mhaextract.rotary.neutral`; from float32
    answers by :func:`~mhaextract.rotary.neutral.large_query_search`) is asked at tokens shifted by
    z*, the refinement fits a key bias too (after the large-query search with a prior of the size
    it leaves), and the model is shifted back. ``polish_factor``: the refinement's fresh queries per parameter;
    ``value_factor``: times the value fit's read-out queries (more answers average more rounding). ``boundary``: the session's (counting, budget, a
    transcript section recording every answer: the run's queries depend on earlier answers, each
    the same given them, so a resumed run asks the same queries and reads back those answered).
    The steps are this module's functions (see its docstring)."""
    run = begin_run(oracle, d, heads, seed, precision, token_scale, bias, rank, batch_size, progress, max_queries,
                    key_bias, boundary)
    run.polish_factor, run.value_factor = float(polish_factor), float(value_factor)
    first_look(run, window_limit)
    if key_bias and run.passed:  # the search's sequences need the window's tokens
        seek_neutral_token(run)
        if not run.passed:
            return run.refused()
        shift_to_neutral_token(run)
    if run.passed:
        ask_instances_at_scale(run)
        if run.unit <= COARSEST_UNIT and run.passed:
            learn_start(run)
        settle_start(run)
    if run.start is not None:
        check_refinement_memory(run)
    if run.start is not None:
        refine_start(run)
    if run.model is not None:
        judge_residual(run)
        if (run.vectors.d_out or 1) > 1:
            fit_layer_values(run)
        judge_estimate(run)
        if verify_length is None or verify_length > 0:
            verify_long(run, verify_length)
    return run.result()
