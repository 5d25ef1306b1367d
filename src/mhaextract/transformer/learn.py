"""Learning a one-layer Transformer (:class:`~mhaextract.models.transformer.Transformer1L`) from value
queries (docs/algorithm.md, 'The one-layer Transformer', docs/transformer.md): the odd part ``f(X) - f(-X)`` handed to
the attention core for the heads, then the ReLU units (:mod:`mhaextract.transformer.relu_units`), assembled and
verified on fresh queries. The model, its canonical form and :func:`compare_transformers` are in
:mod:`mhaextract.models.transformer`.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import mpmath
import numpy as np

from ..checks.base import Check, ExtractionError, UnreliableExtractionWarning, report_failure
from ..numerics.highprec import arb_to_mpf, magnitude_float, mid_float, to_arb, working_precision
from ..oracle.boundary import OracleBoundary
from ..oracle.queries import random_basis
from ..oracle.transcript import RUN, run_fingerprint
from ..run.session import Request, run_learner
from .relu_units import MAX_ENUMERATED, SPREAD_PER_DIMENSION, UnitLearner, orient, random_sequences, refine
from ..run.result import Result
from ..run.learner import AUTO, pick
from ..models.transformer import EXACT_BITS, Transformer1L, block_embedding, compare_transformers, residual_embedding
from ..run.validation import (
    head_count, on_failure_mode, positive_int, renamed, resumable_seed, spawn_rng, token_scale_for,
)

#: High precision: g = f(X) - f(-X) is handed to the core as good to this many bits fewer than f,
#: so that its certificate covers cancellation up to that much (checked: odd_part_precision).
ODD_PART_MARGIN_BITS = 32


# ---------------------------------------------------------------------- extraction
class TransformerExtractionError(ExtractionError):
    """The Transformer extraction failed its checks. ``.extraction`` holds the result. An
    :class:`~mhaextract.checks.base.ExtractionError`, so ``except mx.ExtractionError`` catches
    every family's failed run.

    Examples
    --------
    Two units on the same hyperplane (``a_1 = -a_0``, equal weights) cannot be told apart; the
    run refuses them instead of returning a wrong Transformer:

    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=1, hidden=4, seed=0)
    >>> A, w = T.A.copy(), T.w.copy()
    >>> A[1], w[1] = -A[0], w[0]
    >>> try:
    ...     mx.extract_transformer(mx.SimulatedOracle(mx.Transformer1L(T.W, T.O, A, w)), d=3, heads=1, seed=1)
    ... except mx.TransformerExtractionError as error:
    ...     print(str(error).splitlines()[0], error.extraction.ok)
    Transformer extraction failed its checks: False
    """


def _key(sequence: np.ndarray):
    array = np.ascontiguousarray(sequence, dtype=np.float64)
    return array.shape, array.tobytes()


def residual_queries(basis: np.ndarray) -> list[np.ndarray]:
    """The queries of g that measure the residual term (docs/algorithm.md, 'The one-layer Transformer'): the one-token
    ``(b)`` and the two-token ``(b, 0)`` for each column b of ``basis``.

    ``g((b)) = (vbar + q)^T b``; with the final token 0 every score is 0, the attention is uniform
    and the residual term vanishes: ``g((b, 0)) = vbar^T b / 2``. So ``q^T b = g((b)) - 2 g((b, 0))``.
    """
    zero = np.zeros((1, basis.shape[0]))
    return [b[None, :] for b in basis.T] + [np.vstack([b[None, :], zero]) for b in basis.T]


class OddPartOracle:
    """The user-protocol oracle for ``g(X) = f(X) - f(-X)`` (docs/algorithm.md, 'The one-layer Transformer'): each query
    of g asks the f boundary for X and -X, so both are counted there.

    With the residual, g is attention plus ``q^T x_N``: :meth:`measure_residual` measures q and
    every later answer has ``q^T x_N`` subtracted, so the core sees attention alone. The one-token
    answers it measured are kept and served again when the core asks the same query (not counted
    twice at the boundary).

    In high precision the answers of f carry one ulp at ``precision`` bits relative to |f|; their
    difference is within ``2^(1 - precision) (|f(X)| + |f(-X)|)`` of g. ``cancellation_bits``
    records the worst ``log2((|f(X)| + |f(-X)| + |q^T x_N|) / |answer|)``: the answer is good to
    ``precision`` minus that.
    """

    def __init__(self, boundary: OracleBoundary):
        self.boundary = boundary
        self.cancellation_bits = 0.0
        self.linear = None  # q (float64, or exact mpf at high precision) once measured
        self.reused = 0  # queries of g answered from the residual measurement
        self._kept: dict = {}

    def __call__(self, batch):
        # Tokens arrive as float64 or exact mpf from float64 values: float64 is exact either way.
        sequences = [np.vectorize(float, otypes=[np.float64])(X) if X.dtype == object else X for X in batch]
        keys = [_key(X) if len(X) == 1 else None for X in sequences]
        asked = iter(zip(*self._raw([X for X, k in zip(sequences, keys) if k not in self._kept])))
        answers = []
        for k in keys:
            if k in self._kept:
                self.reused += 1
                answers.append(self._kept[k])
            else:
                answers.append(next(asked))
        return self._subtract(sequences, answers)

    def _raw(self, sequences):
        """``[g(X)]`` and ``[|f(X)| + |f(-X)|]`` for the sequences, asked as X, -X side by side (the
        queries of f follow those of g in order, whatever the batching: what a transcript's
        fingerprint hashes, TransformerRun.fixed_queries)."""
        if not sequences:
            return [], []
        pairs = [sequence for X in sequences for sequence in (X, -X)]
        answers = self.boundary.ask(pairs, description="odd part g(X) = f(X) - f(-X)")
        plus, minus = answers[0::2], answers[1::2]
        if self.boundary.precision is None:
            return list(plus - minus), list(np.abs(plus) + np.abs(minus))
        with working_precision(self.boundary.precision + 64):
            return ([arb_to_mpf(a - b) for a, b in zip(plus, minus)],
                    [abs(float(a.mid())) + abs(float(b.mid())) for a, b in zip(plus, minus)])

    def _subtract(self, sequences, answers):
        """The answers less ``q^T x_N`` (when q is known), and the cancellation bookkeeping."""
        finals = np.array([X[-1] for X in sequences]).reshape(len(sequences), -1)
        if self.boundary.precision is None:
            values = np.array([g for g, _ in answers], dtype=np.float64)
            return values if self.linear is None else values - finals @ self.linear
        out = []
        with mpmath.workprec(self.boundary.precision + 64):
            for x, (g, total) in zip(finals, answers):
                term = mpmath.fsum(q * float(a) for q, a in zip(self.linear, x)) if self.linear is not None else 0
                value = g - term
                total = total + abs(float(term))
                if total > 0:
                    size = abs(float(value))
                    self.cancellation_bits = max(self.cancellation_bits,
                                                 np.inf if size == 0 else float(np.log2(total / size)))
                out.append(value)
        return out

    def measure_residual(self, basis: np.ndarray) -> np.ndarray:
        """q from the :func:`residual_queries` of ``basis`` (d x d, columns), ``2 d`` queries of g
        (fewer asked when the core asks the same one-token queries later: they are kept)."""
        d = basis.shape[0]
        sequences = residual_queries(basis)
        answers = list(zip(*self._raw(sequences)))
        for X, answer in zip(sequences[:d], answers[:d]):
            self._kept[_key(X)] = answer
        one, zero = [g for g, _ in answers[:d]], [g for g, _ in answers[d:]]
        if self.boundary.precision is None:
            self.linear = np.linalg.solve(basis.T, np.array(one) - 2 * np.array(zero))
            return self.linear
        with mpmath.workprec(self.boundary.precision + 64):
            rhs = mpmath.matrix([a - 2 * b for a, b in zip(one, zero)])
            q = mpmath.lu_solve(mpmath.matrix(basis.T.tolist()), rhs)
            self.linear = np.array([q[i] for i in range(d)], dtype=object)
        return self.linear


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class TransformerExtraction(Result):
    """Result of :func:`extract_transformer` (``schedule == "transformer"``): the common fields of
    :class:`~mhaextract.Result` (``model`` the canonical :class:`~mhaextract.Transformer1L` found,
    float64 midpoints, None when a check failed before assembly; ``heads`` the canonical heads;
    ``queries`` the queries of f whose answers the run used, measured at the oracle boundary:
    ``queries_odd_part + queries_units + verification_queries``, of them ``queries_asked`` asked in
    this run and ``queries_replayed`` read back from a transcript; ``verification_queries`` and
    ``verification_length`` the fresh random queries of the ``verification`` check;
    ``error_estimate`` and ``answers_residual`` ``inf``: the run makes no estimate, its model is
    judged on the fresh queries, ``verification_misfit``), and:

    Attributes
    ----------
    model_hp : Transformer1L or None
        High precision: the same with exact mpf midpoints.
    attention : Result (the attention family's :class:`~mhaextract.Extraction`)
        Step 1: the core extraction run on the odd part g (its ``queries`` count g-queries).
    hidden : canonical units found.
    queries_odd_part : int
        Two queries of f per query of g asked of f; with the residual it includes the
        ``queries_residual_term`` that measured q, and the core's one-token queries answered again
        from them (``odd_part_queries_reused`` queries of g) are not asked twice.
    queries_units : segments, kink confirmations, region fits (step 2).
    queries_residual_term, odd_part_queries_reused : int
    residual : whether the FFN reads the final token too.
    segments : segments explored in step 2.
    verification_misfit : max |model - f| / max |f| on the verification queries.
    search : step 2's search (its query counts by kind).
    seconds_units : wall time of step 2 (its queries, search, orientation, assembly and polish).

    Examples
    --------
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=1, hidden=4, seed=0)
    >>> result = mx.extract_transformer(mx.SimulatedOracle(T), d=3, heads=1, hidden=4, seed=1)
    >>> result.ok, result.heads, result.hidden, result.schedule
    (True, 1, 4, 'transformer')
    >>> result.queries == result.queries_odd_part + result.queries_units + result.verification_queries
    True
    """

    model_hp: Transformer1L | None = None
    attention: Result | None = None
    hidden: int = 0
    queries_odd_part: int = 0
    queries_units: int = 0
    queries_residual_term: int = 0
    odd_part_queries_reused: int = 0
    residual: bool = False
    segments: int = 0
    verification_misfit: float = np.inf
    search: object = None
    seconds_units: float = 0.0

    _repr_fields: ClassVar[tuple[str, ...]] = ("hidden",)

    def _summary_extra(self) -> dict:
        return {
            "hidden": self.hidden, "queries_odd_part": self.queries_odd_part, "queries_units": self.queries_units,
            "queries_residual_term": self.queries_residual_term, "odd_part_queries_reused": self.odd_part_queries_reused,
            "residual": self.residual, "segments": self.segments, "verification_misfit": self.verification_misfit,
        }

    def report_rows(self, comparison=None) -> list[tuple[str, str, str]]:
        """The queries of f by step (against step 1's formula), the units found, and the errors of W
        and of the units against the truth."""
        def shown(value) -> str:
            return f"{float(value):.2e}" if value else "0"

        a = self.attention
        rows = [("H (bound H0)", str(a.max_heads), "queries of f: odd part + units + verification"),
                ("  odd part g", str(self.queries_odd_part),
                 f"2 x {a.queries - self.odd_part_queries_reused} queries of g, {a.schedule} schedule "
                 f"({a.promised_formula})" + (f", of them {self.queries_residual_term} measuring the residual term"
                                              if self.residual else ""))]
        if self.search is not None:
            search = self.search
            rows.append(("  units", str(self.queries_units),
                         f"{search.segments} segments: grid {search.queries_grid}, kink probes "
                         f"{search.queries_confirm}, region fits {search.queries_regions}"
                         + (f", random rows for the polish {search.queries_spread}" if search.queries_spread else "")))
        rows += [("  verification", str(self.verification_queries), "fresh random queries"),
                 ("hidden units found", str(self.hidden), "")]
        if comparison is not None:
            agree = [text for flag, text in ((comparison.heads_agree, f"truth has {comparison.heads_b} heads"),
                                             (comparison.units_agree, f"truth has {comparison.units_b} units"),
                                             (comparison.signs_agree, "unit signs differ")) if not flag]
            rows += [("max rel. error W", shown(comparison.W_rel), "normwise, against the truth"),
                     ("max rel. error units", shown(comparison.units_rel), "|w_j| A_j O_h, aligned; " + ", ".join(agree))]
        rows.append(("verification misfit", shown(self.verification_misfit), "max |model - f| / max |f|, fresh queries"))
        return rows

    def _saved_extra(self) -> tuple[dict | None, dict]:
        """The exact model of a high-precision run (``model_hp``) beside the float64 one."""
        return (None if self.model_hp is None else self.model_hp.to_document(exact=True)[0]), {}


@dataclass(frozen=True)
class TransformerRun:
    """The validated parameters of one :func:`extract_transformer` run.

    It also identifies the run in a transcript's fingerprint
    (:func:`mhaextract.oracle.transcript.run_fingerprint` reads ``d``, ``max_heads``, ``name`` and
    ``token_scale``, as of a core schedule; ``name`` keeps a Transformer transcript apart from a
    core one).
    """

    d: int
    heads: int | None  # the declared H (None for a bound)
    max_heads: int  # H0: the known H or the bound
    hidden: int | None
    precision: int | None
    seed: object
    token_scale: float
    max_segments: int
    quiet_segments: int
    verify_queries: int | None
    on_failure: str
    max_queries: int | None
    residual: bool = False
    name: str = field(default="transformer", init=False)

    @property
    def core_schedule(self):
        """The learner step 1 runs on g: the bias-free one ``schedule="auto"`` picks for float64 /
        ball arithmetic and H0 heads (:func:`mhaextract.run.learner.pick`): targeted in float64 when
        H0 <= d (docs/algorithm.md, 'The targeted schedule'), else the paper schedule ('The paper schedule')."""
        return pick(AUTO, {"bias": False}, Request(self.d, self.heads, self.max_heads, self.precision, self.seed))

    @property
    def core_precision(self) -> int | None:
        """What step 1 tells the core about g: ODD_PART_MARGIN_BITS fewer bits than f."""
        return None if self.precision is None else self.precision - ODD_PART_MARGIN_BITS

    def _core_queries(self) -> list[np.ndarray]:
        """The core's queries of g known before any answer (its learner's ``fixed_queries``)."""
        request = Request(self.d, self.heads, self.max_heads, self.core_precision, self.seed, self.token_scale)
        return self.core_schedule.fixed_queries(request, {"bias": False})

    def residual_basis(self, core_queries=None) -> np.ndarray:
        """Columns b for :func:`residual_queries`: the core schedule's own one-token queries (so
        their answers are reused, docs/algorithm.md, 'The one-layer Transformer'), completed by random directions."""
        core_queries = self._core_queries() if core_queries is None else core_queries
        tokens = [X[0] for X in core_queries if len(X) == 1][:self.d]
        extra = random_basis(spawn_rng(self.seed, 4), self.d, self.token_scale)
        return np.column_stack(tokens + list(extra.T[:self.d - len(tokens)]))

    def fixed_queries(self) -> list[np.ndarray]:
        """The queries of f known before any answer: with the residual, the queries of g that
        measure it; then the core schedule's fixed queries of g not already asked; each query of g
        followed by its negation (the order :class:`OddPartOracle` asks them in)."""
        core_queries = self._core_queries()
        first = residual_queries(self.residual_basis(core_queries)) if self.residual else []
        kept = {_key(X) for X in first if len(X) == 1}
        queries = first + [X for X in core_queries if len(X) != 1 or _key(X) not in kept]
        return [sequence for X in queries for sequence in (X, -X)]


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _transformer_run(d, heads, max_heads, hidden, precision, seed, residual, token_scale, max_segments,
                     quiet_segments, verify_queries, on_failure, transcript, max_queries) -> TransformerRun:
    """Every parameter of :func:`extract_transformer` checked once (validation.py's rules)."""
    d = positive_int("d", d)
    H0, declared = head_count(heads, max_heads)
    if hidden is not None:
        hidden = positive_int("hidden", hidden)
    if precision is not None:
        precision = positive_int("precision", precision, minimum=64 + ODD_PART_MARGIN_BITS)
    if verify_queries is not None:
        verify_queries = positive_int("verify_queries", verify_queries, minimum=0)
    if max_queries is not None:
        max_queries = positive_int("max_queries", max_queries, minimum=0)
    if transcript is not None:
        seed = resumable_seed(seed)
    return TransformerRun(d, declared, H0, hidden, precision, seed, token_scale_for(d, token_scale),
                          positive_int("max_segments", max_segments), positive_int("quiet_segments", quiet_segments),
                          verify_queries, on_failure_mode(on_failure), max_queries,
                          _flag("residual", residual))


def extract_transformer(oracle, d, heads=None, max_heads=None, precision=None, seed=None, *, hidden=None,
                        residual=False, token_scale=None, max_segments=32, quiet_segments=8,
                        verify_queries=None, batch_size=1024, progress=None,
                        on_failure="raise", transcript=None, max_queries=None,
                        resume_check=3, verification_queries=None) -> TransformerExtraction:
    """Learn a one-layer Transformer (attention, then a bias-free ReLU FFN) from value queries.

    Step 1 runs :func:`mhaextract.extract` on the odd part ``g(X) = f(X) - f(-X)``, an attention
    model with ``v_h = sum_j w_j p_{h,j}``: the canonical ``W_h`` (two f-queries per g-query).
    Step 2 finds the hidden units through the known attention (:mod:`mhaextract.transformer.relu_units`):
    segments on which f is exactly piecewise linear, one unit per confirmed kink from the region
    gradients on either side, orientations from the odd part. The result is then checked on
    fresh random queries.

    Parameters
    ----------
    oracle, d, heads, max_heads, precision, seed, token_scale, batch_size, progress : as in
        :func:`mhaextract.extract`, the same positional prefix (``seed`` also seeds step 2's
        segments and perturbations; ``precision`` at least ``64 + ODD_PART_MARGIN_BITS``, since step
        1 runs the core on g at that many bits fewer). The options of this family, from ``hidden``
        on, are keyword-only.
    hidden : the number of hidden units, if known: step 2 stops when it has found this many.
        Without it, step 2 stops after ``quiet_segments`` segment pairs in a row found nothing new.
    residual : the FFN reads ``o(X) + x_N`` (``f(X) = w^T ReLU(A (o(X) + x_N))``): d more queries of g
        (``2 d`` of f) measure the linear term ``q^T x_N`` it adds to g, the core then runs on g less
        that term, and step 2 reads x_N as one more block of M (docs/algorithm.md, 'The one-layer Transformer').
    max_segments : at most this many segment pairs in step 2.
    verify_queries : fresh random queries to check the result on (default ``4 H d + 32``; its former
        name ``verification_queries`` is accepted with a FutureWarning).
    on_failure : "raise" a :class:`TransformerExtractionError` or "warn" and return.
    transcript, max_queries, resume_check : as in :func:`mhaextract.extract`, for every query of f (steps 1, 2
        and the verification): answers are committed to the SQLite transcript as they arrive and
        a re-run with the same transcript and seed asks only the missing ones; a run needing more
        than ``max_queries`` queries of f raises :class:`~mhaextract.BudgetExceeded`.

    Returns
    -------
    TransformerExtraction
        The canonical Transformer (``model``), the step-1 attention extraction and every measured
        count and check.

    Notes
    -----
    The conditions step 2 needs are listed in :mod:`mhaextract.transformer.relu_units`; a target that violates
    one fails a check (it is not returned as a wrong Transformer).

    Examples
    --------
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=4, heads=2, hidden=4, seed=0)
    >>> result = mx.extract_transformer(mx.SimulatedOracle(T), d=4, heads=2, hidden=4, seed=1)
    >>> result.ok, result.model
    (True, Transformer1L(d=4, heads=2, hidden=4, p=8, float64))
    >>> bool(mx.compare_transformers(result.model, T).max_rel < 1e-10)
    True
    """
    request = Request.validated(d, heads, max_heads, precision, seed, token_scale)
    options = {"hidden": hidden, "residual": residual, "max_segments": max_segments, "quiet_segments": quiet_segments,
               "verify_queries": renamed("verification_queries", verification_queries, "verify_queries",
                                         verify_queries, None)}
    return run_learner(oracle, request, "transformer", options, batch_size=batch_size, progress=progress,
                       on_failure=on_failure, transcript=transcript, max_queries=max_queries,
                       resume_check=resume_check)


def run_transformer(session, options) -> "TransformerExtraction":
    """The Transformer's run in ``session`` (:class:`~mhaextract.transformer.learner.TransformerLearner`)."""
    request = session.request
    run = _transformer_run(request.d, request.heads, None if request.heads is not None else request.max_heads,
                           options.get("hidden"), request.precision, request.seed, options.get("residual", False),
                           request.token_scale, options.get("max_segments", 32), options.get("quiet_segments", 8),
                           options.get("verify_queries"), session.on_failure, session.transcript,
                           session.max_queries)
    if session.transcript is not None:
        fingerprint = run_fingerprint(run, run.seed, run.precision, run.fixed_queries())
        session.open_transcript(fingerprint)  # no calibration: the fingerprint is known before any query
        session.record.start_run(fingerprint)
    try:
        boundary = session.boundary(RUN, precision=run.precision)
        result = _extract_transformer(boundary, run, session.batch_size, session.progress, session.started)
    finally:
        session.close()
    return session.finish(result, "Transformer extraction", error_type=TransformerExtractionError)


def _extract_transformer(boundary: OracleBoundary, run: TransformerRun, batch_size, progress,
                         started) -> TransformerExtraction:
    """Step 1, step 2, assembly and verification; a failed step ends the run with what it has."""
    odd = OddPartOracle(boundary)
    if run.residual:
        odd.measure_residual(run.residual_basis())
    queries_residual = _used(boundary)
    step1 = _odd_part_heads(odd, run, batch_size, progress)
    queries_odd = _used(boundary)
    checks = [Check(f"odd part: {c.name}", c.passed, c.value, c.threshold, c.message) for c in step1.checks]
    counts = (queries_odd, 0, queries_residual, odd.reused)
    if not step1.ok or step1.heads == 0:
        if step1.heads == 0:
            checks.append(Check("heads_visible", False, 0, 1, "the odd part shows no attention head: the FFN "
                                "cannot be read through the attention (condition 1)"))
        return _transformer_result(run, boundary, step1, checks, counts, started)
    rng = np.random.default_rng(None if run.seed is None else [int(np.asarray(run.seed).ravel()[0])
                                                               if np.ndim(run.seed) else int(run.seed), 3])
    step2 = time.perf_counter()
    learner, orientation = _units(boundary, run, step1, odd.linear, rng, checks)
    counts = (queries_odd, _used(boundary) - queries_odd, queries_residual, odd.reused)
    units = learner.search.units
    if orientation.sigma is None:
        return _transformer_result(run, boundary, step1, checks, counts, started, search=learner.search,
                                   hidden_found=len(units), seconds_units=time.perf_counter() - step2)
    model, model_hp = _assemble(run, step1, learner, orientation)
    seconds_units = time.perf_counter() - step2
    misfit, longest = _verify_transformer(boundary, run, step1.heads, model, model_hp, rng, checks)
    if run.precision is not None:
        checks.append(Check("odd_part_precision", odd.cancellation_bits < ODD_PART_MARGIN_BITS, odd.cancellation_bits,
                            ODD_PART_MARGIN_BITS, "bits lost to cancellation in g(X) = f(X) - f(-X) (the core "
                            "was told g is good to precision minus the threshold)"))
    return _transformer_result(run, boundary, step1, checks, counts, started, model=model, model_hp=model_hp,
                               search=learner.search, hidden_found=len(units), misfit=misfit,
                               seconds_units=seconds_units, verification_length=longest)


def _used(boundary: OracleBoundary) -> int:
    """Queries of f whose answers the run used: asked now or read back from the transcript."""
    return boundary.queries + boundary.replayed


def _odd_part_heads(odd: OddPartOracle, run: TransformerRun, batch_size, progress) -> Result:
    """Step 1: the core extraction on g (its failed checks become the Transformer's)."""
    request = Request.validated(run.d, run.heads, None if run.heads is not None else run.max_heads,
                                run.core_precision, run.seed, run.token_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnreliableExtractionWarning)
        # the attention family's learner, by its registry name: the core as measured in docs/algorithm.md, 'The
        # one-layer Transformer', no refinement of noisy answers ('The lean schedule') here
        return run_learner(odd, request, run.core_schedule.name, {"refine": False}, batch_size=batch_size,
                           progress=progress, on_failure="warn")


def _units(boundary: OracleBoundary, run: TransformerRun, step1: Result, linear, rng, checks: list):
    """Step 2: hidden units through the heads of step 1, and their orientation (checks appended).
    With the residual, M has x_N as one more block and V the residual term q (``linear``) as one
    more block: ``sum_j w_j (P_j, R^T A_j^T) = (v_1, .., v_H, q)`` (docs/algorithm.md, 'The one-layer Transformer')."""

    W = step1.model_hp.W if run.precision is not None else step1.model.W
    V = step1.model.v.reshape(-1)
    if run.residual:
        V = np.concatenate([V, mid_float(np.asarray(linear))])
    learner = UnitLearner(boundary, W, run.precision, rng, float(step1.token_scale), residual=run.residual)
    quiet = 0
    for _ in range(run.max_segments):
        if run.hidden is not None and len(learner.search.units) >= run.hidden:
            break
        if run.hidden is None and quiet >= run.quiet_segments:
            break
        new = sum(learner.explore(segment) for segment in learner.segment_pair())
        quiet = 0 if new else quiet + 1
    search = learner.search
    units = search.units
    learner.ask_spread(SPREAD_PER_DIMENSION * learner.D if units else 0)  # float64: rows for the polish
    if run.hidden is not None:
        checks.append(Check("units_found", len(units) <= run.hidden, len(units), run.hidden,
                            f"{len(units)} units found, hidden={run.hidden} given (more found means hidden is too "
                            "small)"))
    # The sign solve runs on the region fits' unit vectors, before the polish: in float64 they carry
    # step 1's errors amplified to ~1e-5, and the true signs of such units fit V only to ~1e-6. A
    # wrong sign moves the sum by a whole |c_j|; two choices within the tolerance are reported as
    # ambiguous, and the verification on fresh queries judges the model that comes out. The rank
    # tolerance sits above those errors too: a tolerance of 1e-6 can count a spurious pivot of
    # that size, and then find no sign solution.
    tolerance, rank_tolerance = (1e-4, 1e-4) if run.precision is None else (1e-12, 1e-12)
    orientation = orient(np.array([u.c for u in units]).reshape(len(units), V.size), V,
                         tolerance=tolerance, rank_tolerance=rank_tolerance)
    if orientation.enumerated:
        message = (f"sum_j sigma_j c_j = V has {orientation.solutions} sign solutions over {len(units)} units "
                   f"(rank {orientation.rank}); exactly one is needed (conditions 2-4: units with parallel "
                   "hyperplanes, a unit never seen, or a sign-ambiguous set of units)")
    else:
        message = (f"{len(units)} units in a span of rank {orientation.rank}: the 2^{orientation.free} sign choices "
                   f"of the units outside it were not searched (at most {MAX_ENUMERATED} units beyond the rank, "
                   "docs/transformer.md condition 6): fewer hidden units or a larger d (the units' vectors "
                   "span about p = d dimensions)")
    if search.regions_failed:
        message += (f"; {search.regions_failed} of {search.regions_fitted} region fits failed (if most did, f depends "
                    "on a head the odd part does not show: condition 1)")
    checks.append(Check("orientation", orientation.sigma is not None, orientation.misfit, tolerance, message))
    return learner, orientation


def _assemble(run: TransformerRun, step1: Result, learner, orientation):
    """``w_j = sign``, ``A_j = sign * sigma_j * c_j`` in the block coordinates of M: (model, model_hp)."""

    units = learner.search.units
    H, d = step1.heads, run.d
    O = block_embedding(H, d, run.residual)
    R = residual_embedding(H, d) if run.residual else None
    D = learner.D
    signs = np.array([u.sign for u in units], dtype=np.float64)
    factors = signs * orientation.sigma
    A = np.array([f * u.c for f, u in zip(factors, units)]).reshape(len(units), D)
    if run.precision is None and len(units):
        # float64: the region fits carry the step-1 errors amplified by their small clouds; a joint
        # least-squares polish on every answer of step 2 removes most of that (relu_units.refine).
        means, values = learner.answers()
        A, _ = refine(A, signs, means, values)
    model = Transformer1L(step1.model.W, O, A, signs, residual=run.residual, R=R)
    if run.precision is None:
        return model, None
    # The balls' midpoints, negated where the orientation says so (at EXACT_BITS: mpmath and
    # flint would otherwise round to their 53-bit defaults).
    with mpmath.workprec(EXACT_BITS):
        A_hp = np.array([[arb_to_mpf(value) * int(f) for value in u.c_exact] for f, u in zip(factors, units)],
                        dtype=object).reshape(len(units), D)
    return model, Transformer1L(step1.model_hp.W, O.astype(object), A_hp, signs.astype(object), residual=run.residual,
                                R=None if R is None else R.astype(object))


def _verify_transformer(boundary: OracleBoundary, run: TransformerRun, H: int, model, model_hp, rng,
                        checks: list) -> tuple[float, int]:
    """The misfit on fresh random queries of f (counted) and their longest; the ``verification``
    check appended."""
    d, scale, precision = run.d, run.token_scale, run.precision
    count = run.verify_queries if run.verify_queries is not None else 4 * H * d + 32
    sequences = random_sequences(rng, count, d, 2 * H + 1, scale)  # no longer than the core schedule's 2H + 1
    answers = boundary.ask(sequences, description="verification queries")
    if precision is None:
        misfit = float(np.abs(model(sequences) - answers).max() / max(np.abs(answers).max(), 1e-300))
        tolerance = 1e-6
    else:
        predicted = model_hp(sequences, precision=precision + 16)
        with working_precision(precision + 64):
            differences = np.array([to_arb(p) - a for p, a in zip(predicted, answers)], dtype=object)
        misfit = float(magnitude_float(differences).max() / max(np.abs(mid_float(answers)).max(), 1e-300))
        tolerance = 2.0 ** (-precision / 4)
    checks.append(Check("verification", misfit <= tolerance, misfit, tolerance,
                        f"max misfit on {count} fresh random queries, relative to the largest answer"))
    return misfit, max((len(X) for X in sequences), default=0)


def _transformer_result(run: TransformerRun, boundary: OracleBoundary, step1: Result, checks: list, counts,
                        started, model=None, model_hp=None, search=None, hidden_found=0,
                        misfit=np.inf, seconds_units=0.0, verification_length=0) -> TransformerExtraction:
    queries_odd, queries_units, queries_residual, reused = counts
    used = _used(boundary)
    return TransformerExtraction(
        model=model, model_hp=model_hp, attention=step1, heads=step1.heads, hidden=hidden_found,
        schedule="transformer", token_scale=run.token_scale, answer_dtype=str(getattr(boundary.oracle, "answer_dtype", "float64" if run.precision is None else "mpf")),
        verification_length=verification_length,
        queries=used, queries_odd_part=queries_odd, queries_units=queries_units,
        queries_residual_term=queries_residual, odd_part_queries_reused=reused, residual=run.residual,
        verification_queries=used - queries_odd - queries_units, max_query_length=boundary.max_query_length,
        segments=search.segments if search else 0, verification_misfit=misfit, precision=run.precision, d=run.d,
        seed=run.seed, checks=checks, search=search, seconds=time.perf_counter() - started, seconds_units=seconds_units,
        queries_asked=boundary.queries, queries_replayed=boundary.replayed,
        transcript=None if boundary.transcript is None else boundary.transcript.path,
    )
