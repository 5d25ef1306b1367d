"""The learner: schedule, oracle boundary, kernels, matching and assembly tied together.

``extract`` runs the exact-count schedule of ALGORITHM.md section 4 and returns an
:class:`Extraction`: the canonical heads, the measured query counts, per-instance diagnostics
and the checks the result passed or failed.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from .certificate import Certificate, PipelineRun, least_squares_certificate, pipeline_certificate
from .highprec import GUARD_BITS, magnitude_float, mid_float, mpf_array, radius_float, working_precision
from .kernels import arb as arb_kernel
from .kernels import float64 as float64_kernel
from .kernels.rational import InstanceFits
from .matching import Side, match_labels, match_links
from .model import MultiHeadAttention
from .noise import nonnegative_number
from .oracle import OracleBoundary
from .refine import Refinement, output_jacobian, random_queries, refine_least_squares
from .schedule import LeanSchedule, PaperSchedule
from .transcript import Transcript, run_fingerprint

#: The float64 kernel with 2H + 1 samples loses about three digits per head (ALGORITHM.md 7).
FLOAT64_MAX_RELIABLE_HEADS = 4
#: Estimated answer noise below this fraction of the largest answer (1e3 units of float64 rounding)
#: is float64 rounding: the existing checks judge it, the validity check is only added above it
#: (or when the caller declares answer_error).
ROUNDING_REGIME = 1e3 * 2.0**-53


class ExtractionError(RuntimeError):
    """The extraction failed its own checks. ``.extraction`` holds the result and diagnostics."""

    def __init__(self, message: str, extraction: "Extraction"):
        super().__init__(message)
        self.extraction = extraction


class UnreliableExtractionWarning(UserWarning):
    """An extraction returned with ``on_failure="warn"`` failed some of its checks."""


@dataclass
class Check:
    """One self-check of a run: ``value`` compared against ``threshold`` (smaller is better)."""

    name: str
    passed: bool
    value: float
    threshold: float
    message: str

    def __str__(self) -> str:
        status = "ok" if self.passed else "FAILED"
        return f"{self.name}: {status} ({self.value:.3g} vs {self.threshold:.3g}) {self.message}"


class CheckedResult:
    """What every result with ``checks`` answers: did it pass, and what failed."""

    checks: list

    @property
    def ok(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed_checks(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]


def report_failure(result: CheckedResult, what: str, on_failure: str, error_type=None, hints=(), stacklevel=3):
    """Raise ``error_type(message, result)`` (default :class:`ExtractionError`) or warn, when a check failed."""
    if result.ok:
        return
    message = f"{what} failed its checks:\n  " + "\n  ".join(str(check) for check in result.failed_checks)
    message += "".join("\n" + hint for hint in hints)
    if on_failure == "raise":
        raise (error_type or ExtractionError)(message, result)
    warnings.warn(message, UnreliableExtractionWarning, stacklevel=stacklevel)


@dataclass
class InstanceDiagnostics:
    """Per-instance diagnostics, arrays indexed like ``schedule.instances``.

    role, i, j : which instance; rank : pole count detected; singular_values : Loewner singular
    values relative to the largest (n, H0); pole_gap, imaginary, nonpositive, residual, condition :
    certified : see :class:`mhaextract.kernels.rational.InstanceFits`; ambiguity : matching margin of links
    (NaN for grid instances); label_residual : link label mismatch relative to the largest label
    (NaN for grid instances); label_deviation : distance of an instance's labels from the consensus
    of its column in units of its first-order error (NaN for row links).
    """

    role: np.ndarray
    i: np.ndarray
    j: np.ndarray
    rank: np.ndarray
    singular_values: np.ndarray
    pole_gap: np.ndarray
    imaginary: np.ndarray
    nonpositive: np.ndarray
    residual: np.ndarray
    condition: np.ndarray
    certified: np.ndarray
    ambiguity: np.ndarray
    label_residual: np.ndarray
    label_deviation: np.ndarray


@dataclass
class Extraction(CheckedResult):
    """Result of :func:`extract`.

    Attributes
    ----------
    model : MultiHeadAttention or None
        The canonical heads in float64 (order: ascending pole of the first instance); None only
        when the kernels produced non-finite parameters (a failed check says so).
    heads : int
        Canonical head count H* found.
    queries : int
        Answers the extraction used, each answered by the oracle exactly once: the queries asked
        in this run (``queries_asked``, measured at the oracle boundary) plus those read back from
        the transcript (``queries_replayed``), which an earlier run's boundary recorded as the
        oracle answered them. Equals ``promised_queries`` for a complete run.
    queries_asked, queries_replayed : int
        Asked of the oracle in this run; read back from the transcript (0 without one).
    max_query_length : int
        Longest query whose answer was used (measured at the boundary, or read back).
    promised_queries, promised_max_length : int
        The schedule's formula (paper: ``4 H0 d^2 - 2 H0 + 1``, ``2 H0 + 1``; lean: its count
        without fallback links), for comparison.
    schedule : str
        ``"paper"`` or ``"lean"``.
    fallback_links : int
        Lean schedule: column links added where residue labels were too close to match
        (``2 H0 - 1`` queries each, included in ``queries``).
    precision : int or None
        Bits of the high-precision path, None for float64.
    W_balls, v_balls : object arrays of flint ``arb`` (high precision only), shapes (H*, d, d), (H*, d).
    error_estimate : float
        Max relative parameter error from the rounding of the answers: in high precision the
        largest relative ball radius (a proven bound when ``certified``), in float64 a first-order
        estimate.
    certified : bool
        High precision only: every instance's balls were proven (Krawczyk) to enclose its exact
        parameters, given answers within one ulp; the assembled balls then enclose the truth.
        Very ill-conditioned instances (nearly equal poles) may not certify at the oracle's
        precision; their radii are then first-order estimates.
    answers_residual : float
        Max relative misfit of the extracted model on the queries asked.
    certificate : Certificate or None
        float64 runs of the paper schedule: the first-order error certificate
        (:mod:`mhaextract.certificate`), behind ``amplification``, ``error_bound(eps)`` and ``valid_below``.
    refinement : Refinement or None
        With ``refine=True``: which model was kept, the misfits before and after, the queries added.
    verification : Verification or None
        Set by :func:`mhaextract.verify`: fresh queries, errors, how they were drawn.
    answer_error : float or None
        The bound on the answers' absolute error the run was told (None: not told; the checks
        then use 3 x the estimated noise).
    samples_per_instance : int
        K, copy counts 0..K-1 per instance (2 H0 + 1 unless oversampled).
    instances : InstanceDiagnostics
    checks : list of Check
    seconds : float
    """

    model: MultiHeadAttention | None
    heads: int
    queries: int
    max_query_length: int
    promised_queries: int
    promised_max_length: int
    d: int
    max_heads: int
    precision: int | None
    seed: object
    schedule: str
    fallback_links: int
    error_estimate: float
    answers_residual: float
    instances: InstanceDiagnostics
    checks: list[Check] = field(default_factory=list)
    W_balls: np.ndarray | None = None
    v_balls: np.ndarray | None = None
    seconds: float = 0.0
    queries_asked: int = 0
    queries_replayed: int = 0
    transcript: str | None = None
    certificate: Certificate | None = None
    refinement: Refinement | None = None
    verification: object = None
    answer_error: float | None = None
    samples_per_instance: int | None = None

    def _certificate(self) -> Certificate:
        if self.certificate is None:
            raise ValueError("no first-order certificate: it is computed for float64 runs of the paper schedule with "
                             "a model; high-precision runs carry certified balls (W_balls, v_balls) instead")
        return self.certificate

    @property
    def amplification(self) -> float:
        """C: worst-case relative parameter error per unit absolute answer error, first order."""
        return self._certificate().amplification

    @property
    def valid_below(self) -> float:
        """The answer-error bound below which the matching is certified and first order holds."""
        return self._certificate().valid_below

    def error_bound(self, eps: float) -> float:
        """Bound on ``compare(model, truth).max_rel`` if every answer is within ``eps`` of the
        truth (inf when ``eps >= valid_below``); see :class:`mhaextract.certificate.Certificate`."""
        return self._certificate().error_bound(eps)

    @property
    def verified(self) -> bool:
        """True when :func:`mhaextract.verify` ran on this result and it passed."""
        return self.verification is not None and bool(self.verification.passed)

    @property
    def certified(self) -> bool:
        return self.precision is not None and bool(self.instances.certified.all())

    @property
    def model_hp(self) -> MultiHeadAttention | None:
        """The canonical heads as exact mpf midpoints of the balls (high precision only)."""
        if self.W_balls is None:
            return None
        return MultiHeadAttention(mpf_array(self.W_balls), mpf_array(self.v_balls))

    @property
    def radius(self) -> tuple[float, float] | None:
        """Largest ball radius of W and of v (high precision only)."""
        if self.W_balls is None or self.heads == 0:
            return None
        return float(radius_float(self.W_balls).max()), float(radius_float(self.v_balls).max())

    def summary(self) -> dict:
        return {
            "d": self.d, "max_heads": self.max_heads, "heads": self.heads, "queries": self.queries,
            "queries_asked": self.queries_asked, "queries_replayed": self.queries_replayed,
            "transcript": self.transcript,
            "promised_queries": self.promised_queries, "max_query_length": self.max_query_length,
            "promised_max_length": self.promised_max_length, "precision": self.precision,
            "schedule": self.schedule, "fallback_links": self.fallback_links, "seed": self.seed, "error_estimate": self.error_estimate,
            "answers_residual": self.answers_residual, "certified": self.certified, "ok": self.ok,
            "failed_checks": [str(check) for check in self.failed_checks], "seconds": self.seconds,
            "samples_per_instance": self.samples_per_instance, "answer_error": self.answer_error,
            "valid_below": None if self.certificate is None else self.certificate.valid_below,
            "noise_estimate": None if self.certificate is None else self.certificate.noise_estimate,
            "refinement": None if self.refinement is None else str(self.refinement),
            "verification": None if self.verification is None else str(self.verification),
        }


def _validate_robust(precision, samples_per_instance, refine, refine_queries, answer_error):
    """The approximate-oracle options are float64 features (high precision certifies with balls)."""
    if precision is not None and (samples_per_instance is not None or refine or answer_error is not None):
        raise ValueError("samples_per_instance, refine and answer_error are float64 options; with precision=bits "
                         "the answers are exact to one ulp and the balls certify the result")
    if not isinstance(refine, (bool, np.bool_)):
        raise ValueError(f"refine must be True or False, got {refine!r}")
    if refine_queries is not None and (isinstance(refine_queries, bool) or not isinstance(refine_queries, (int, np.integer))
                                       or refine_queries < 0):
        raise ValueError(f"refine_queries must be an integer >= 0, got {refine_queries!r}")
    if answer_error is not None:  # a parameter of extract: every bad value is a ValueError
        answer_error = nonnegative_number("answer_error", answer_error, "a bound on |answer - truth|", ValueError)
    return answer_error


def _validate(d, heads, max_heads, precision, on_failure, transcript=None, seed=None, max_queries=None):
    def positive_int(name, value, minimum=1):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        return int(value)

    d = positive_int("d", d)
    if (heads is None) == (max_heads is None):
        raise ValueError("give exactly one of heads (H known) or max_heads (a bound H0 >= H*)")
    H0 = positive_int("heads" if heads is not None else "max_heads", heads if heads is not None else max_heads)
    if precision is not None:
        precision = positive_int("precision", precision, minimum=64)
    if on_failure not in ("raise", "warn"):
        raise ValueError(f"on_failure must be 'raise' or 'warn', got {on_failure!r}")
    if max_queries is not None:
        positive_int("max_queries", max_queries, minimum=0)
    if transcript is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise ValueError(f"transcript= needs an integer seed >= 0 (the resumed run must ask the same queries), "
                         f"got seed={seed!r}")
    return d, H0, precision


SCHEDULES = {"paper": PaperSchedule, "lean": LeanSchedule}


def extract(oracle, d, heads=None, max_heads=None, precision=None, seed=None, *, schedule="paper",
            token_scale=None, batch_size=1024, progress=None, on_failure="raise", transcript=None,
            max_queries=None, samples_per_instance=None, refine=False, refine_queries=None,
            answer_error=None) -> Extraction:
    """Learn the canonical heads of multi-head attention from value queries.

    Parameters
    ----------
    oracle : callable ``oracle(batch) -> outputs`` (see :mod:`mhaextract.oracle`).
    d : token dimension.
    heads : the number of heads H, if known. Exactly one of ``heads`` and ``max_heads``.
    max_heads : a bound H0 >= H*; the canonical count is detected on every instance.
    precision : None for float64; bits for the high-precision (python-flint) path.
    seed : seeds the random query vectors (same seed, same queries).
    schedule : ``"paper"`` (default; exactly ``4 H0 d^2 - 2 H0 + 1`` queries of length at most
        ``2 H0 + 1``) or ``"lean"`` (ALGORITHM.md section 6: about ``(2 H0 - 1) d^2`` queries,
        heads matched by residue labels, column links added only where labels are ambiguous;
        see :class:`mhaextract.schedule.LeanSchedule` for the count), or ``"targeted"`` (float64,
        H <= d: one head in the window per instance, the others saturated; machine precision for
        many heads, about ``4 H d^2`` queries; see :mod:`mhaextract.targeted`).
    token_scale : norm of the query vectors (default ``d ** 0.25``, suited to W with entries of
        size ``1/sqrt(d)``; choose it so that ``|z^T W_h x|`` is of order one).
    batch_size : sequences per oracle call.
    progress : show a progress bar (default: when stderr is a terminal).
    on_failure : ``"raise"`` an :class:`ExtractionError` when a check fails (the result is on
        the error), or ``"warn"`` and return it.
    transcript : path of a SQLite transcript (:mod:`mhaextract.transcript`), or None. Every batch
        of answers is committed to it as it arrives; re-running with the same transcript and
        seed reads them back and asks only the missing queries. Needs an integer ``seed``.
        A transcript of another run (or a corrupt file) raises ``TranscriptError``, untouched.
    max_queries : cap on the queries asked of the oracle in this run; when the run needs more it
        raises :class:`~mhaextract.oracle.BudgetExceeded` saying how many (after spending the
        budget and saving the answers, when there is a transcript).

    samples_per_instance : K >= 2 H0 + 1 copy counts per instance (float64, paper schedule;
        default the exact count). More samples make every instance a least-squares fit.
    refine : polish all parameters by nonlinear least squares against every answer (float64,
        :mod:`mhaextract.refine`); keeps the algebraic result if that misfits less.
    refine_queries : fresh random queries (lengths 2..K) asked for the refinement, on top of the
        schedule; default ``max(32, H0 (d^2 + d))``, one per parameter. They condition W far
        better than the schedule's two-token queries and are counted like every other query.
    answer_error : a bound on every answer's absolute error, if known (float64). It sets the
        rank threshold, the error estimate (``error_bound(answer_error)``) and the validity check.

    The paper schedule uses exactly ``4 H0 d^2 - 2 H0 + 1`` queries of length at most
    ``2 H0 + 1`` (by default; oversampling and refinement ask more, and report what they
    asked); every count reported is measured at the oracle boundary.
    """
    d, H0, precision = _validate(d, heads, max_heads, precision, on_failure, transcript, seed, max_queries)
    if schedule not in SCHEDULES and schedule != "targeted":
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES) + ['targeted']}, got {schedule!r}")
    if schedule == "targeted":  # adaptive, float64 only: its own driver (mhaextract.targeted)
        from .targeted import extract_targeted
        return extract_targeted(oracle, d, H0, H0 if heads is not None else None, seed, token_scale, batch_size,
                                progress, on_failure, precision=precision, transcript=transcript,
                                max_queries=max_queries, samples_per_instance=samples_per_instance, refine=refine,
                                refine_queries=refine_queries, answer_error=answer_error)
    answer_error = _validate_robust(precision, samples_per_instance, refine, refine_queries, answer_error)
    heads_given = H0 if heads is not None else None
    started = time.perf_counter()
    schedule = SCHEDULES[schedule](d, H0, seed=seed, token_scale=token_scale, samples_per_instance=samples_per_instance)
    sequences, owners, copies = schedule.queries()
    # The fingerprint hashes the schedule's fixed queries; adaptive ones (lean fallback links) are
    # checked one by one against the hashes recorded with their answers.
    record = None
    try:
        if transcript is not None:
            record = Transcript(transcript, run_fingerprint(schedule, int(seed), precision, sequences))
        boundary = OracleBoundary(oracle, d, precision=precision, batch_size=batch_size, progress=progress,
                                  max_queries=max_queries, transcript=record)
        answers = boundary.ask(sequences, description=f"querying (d={d}, H0={H0})")
        asked = [(sequences, answers)]

        def ask(instances):
            """Fallback instances (lean schedule): their queries, asked and recorded."""
            more, more_owners, more_copies = schedule.instance_queries(instances)
            more_answers = boundary.ask(more, description=f"fallback links ({len(instances)})")
            asked.append((more, more_answers))
            return more_answers, more_owners, more_copies

        kernel = float64_kernel if precision is None else arb_kernel
        with working_precision((precision or 53) + GUARD_BITS):
            result = _learn(schedule, answers, owners, copies, kernel, precision, ask, answer_error or 0.0)
        extra = []
        if refine and result[0] is not None:  # fresh random queries for the refinement, counted
            count = max(32, H0 * (d * d + d)) if refine_queries is None else int(refine_queries)
            extra = random_queries(_refine_rng(seed), count, d, schedule.token_scale, (2, schedule.samples_per_instance))
            if extra:
                asked.append((extra, boundary.ask(extra, description="querying for refinement")))
    finally:
        if record is not None:
            record.close()
    sequences = [sequence for batch, _ in asked for sequence in batch]
    answers = np.concatenate([batch_answers for _, batch_answers in asked])
    model, W_balls, v_balls, diagnostics, bijective, error_estimate, pipeline = result
    certificate = refinement = None
    if model is None:  # the kernels produced non-finite parameters
        answers_residual = np.inf
        heads = int(np.bincount(diagnostics.rank).argmax())
    else:
        if pipeline is not None:
            certificate = pipeline_certificate(pipeline)
        if refine:
            model, refinement = refine_least_squares(model, sequences, answers, added=len(extra))
            if refinement.kept == "refined" and certificate is not None:
                jacobian = output_jacobian(model, sequences)
                certificate = least_squares_certificate(jacobian, model, model(sequences) - answers, answers,
                                                        certificate.valid_below)
        hp_model = None if precision is None else MultiHeadAttention(mpf_array(W_balls), mpf_array(v_balls))
        answers_residual = _answers_residual(hp_model or model, sequences, answers, precision)
        heads = model.heads
    noise = None
    scale = float(np.abs(mid_float(answers)).max(initial=0.0)) or 1.0
    if certificate is not None:
        # Label deviations are in units of the first-order error at float64 rounding (2^-52 of
        # each instance's scale); noisier answers widen that unit to the declared or estimated noise.
        label_noise = answer_error if answer_error is not None else 3.0 * certificate.noise_estimate
        unit = 2.0**-52
        if label_noise / scale > unit:
            diagnostics.label_deviation = diagnostics.label_deviation * (unit * scale / label_noise)
    if certificate is not None and (refine or answer_error is not None):
        if answer_error is not None:  # declared: the certified bound (inf above valid_below)
            noise = answer_error
            error_estimate = certificate.error_bound(noise)
        else:  # estimated from the data: a first-order estimate, like the core's
            noise = 3.0 * certificate.noise_estimate
            error_estimate = certificate.first_order(noise)
    checks = _checks(diagnostics, heads, precision, bijective, error_estimate, answers_residual,
                     known_heads=heads_given,
                     residual_floor=0.0 if noise is None else max(10 * noise / scale, error_estimate))
    if certificate is not None and (answer_error is not None or 3.0 * certificate.noise_estimate > ROUNDING_REGIME * scale):
        checks.append(_validity_check(certificate, answer_error))
    if model is None:
        checks.append(Check("finite", False, np.inf, 0.0, "the assembled parameters are not finite; no model"))
    extraction = Extraction(
        model=model, heads=heads, queries=boundary.queries + boundary.replayed,
        queries_asked=boundary.queries, queries_replayed=boundary.replayed,
        transcript=None if record is None else record.path, max_query_length=boundary.max_query_length,
        promised_queries=schedule.promised_queries, promised_max_length=schedule.promised_max_length,
        d=d, max_heads=H0, precision=precision, seed=seed, schedule=schedule.name,
        fallback_links=int((schedule.column_link_index >= 0).sum()) if schedule.name == "lean" else 0,
        error_estimate=error_estimate, answers_residual=answers_residual, instances=diagnostics,
        checks=checks, W_balls=W_balls, v_balls=v_balls, seconds=time.perf_counter() - started,
        certificate=certificate, refinement=refinement, answer_error=answer_error,
        samples_per_instance=schedule.samples_per_instance,
    )
    failed = {check.name for check in extraction.failed_checks}
    hints = []
    if "noise_within_validity" in failed:
        hints.append("The answers are noisier than this run can certify (valid_below): oversample "
                     "(samples_per_instance), use fewer heads per run, or a less noisy oracle.")
    if failed & {"matching", "poles_real_positive", "labels_consistent", "answers_residual"}:
        hints.append(f"If the oracle is multi-head attention, heads/max_heads = {H0} may be smaller than its "
                     "canonical head count, the precision too low for it, or token_scale unsuited to its W "
                     "(|z^T W_h x| should be of order one; see MultiHeadAttention.suggested_token_scale).")
    report_failure(extraction, "extraction", on_failure, hints=hints)
    return extraction


def _refine_rng(seed) -> np.random.Generator:
    """The refinement's random queries: a stream independent of the schedule's (same seed)."""
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])


def _validity_check(certificate: Certificate, answer_error) -> Check:
    """The answers' error against ``valid_below``: declared, or 3 x the noise estimated from the
    links' misfits (or the refined residual)."""
    if answer_error is not None:
        noise, source = answer_error, "declared answer_error"
    else:
        noise, source = 3.0 * certificate.noise_estimate, "3 x the noise estimated from redundant measurements"
    return Check("noise_within_validity", noise < certificate.valid_below, noise, certificate.valid_below,
                 f"answer error ({source}) against valid_below, the bound under which the matching is "
                 "certified and the first-order certificate holds")


def _learn(schedule: PaperSchedule, answers, owners, copies, kernel, precision, ask, answer_error=0.0):
    """Fit, match and assemble. ``ask(instance indices)`` queries fallback instances (lean);
    ``answer_error`` (float64) widens the rank threshold to the declared noise."""
    d, H0 = schedule.d, schedule.max_poles
    ks = schedule.ks
    n = len(schedule.instances)
    is_hp = precision is not None
    samples = np.empty((n, len(ks)), dtype=object if is_hp else np.float64)
    samples[owners, copies] = answers
    grid, row_links = schedule.grid_index, schedule.row_link_index
    # --- anchors (section 3): F(0) of row 0 is the one-token answer vbar^T x_0.
    anchor = samples[grid[0, 0], 0]
    row0 = grid[0]
    samples[row0[1:], 0] = anchor
    ranks = np.zeros(n, dtype=int)
    singular_values = np.zeros((n, H0))
    rank_options = {} if is_hp else {"answer_error": answer_error}
    ranks[row0], singular_values[row0] = kernel.detect_ranks(samples[row0], ks, H0, **rank_options)
    counts = np.bincount(ranks[row0], minlength=H0 + 1)
    H_star = min(int(counts.argmax()), H0)  # an oversampled instance can show H0 + 1 (noise)
    fits_row0 = kernel.fit(samples[row0], ks, H_star)
    # vbar^T z_j = vbar^T x_0 - c_j, then vbar = Z^{-T} (vbar^T z_j); vbar^T x_i follows.
    vbar_z = anchor - fits_row0.c
    vbar = kernel.solve_transposed(schedule.Z, vbar_z)
    vbar_x = kernel.dot(vbar, schedule.X)
    vbar_x[0] = anchor  # measured, not recomputed

    def fit_later(indices):
        """Anchor, rank and fit instances after row 0 (both anchors in the lean schedule)."""
        constant = None
        width = len(ks) - 1 if schedule.both_anchors else len(ks)
        for index in indices:
            instance = schedule.instances[index]
            final = vbar_x[0] + vbar_x[instance.i] if instance.role == "column_link" else vbar_x[instance.i]
            difference = vbar_z[0] + vbar_z[instance.j] if instance.role == "row_link" else vbar_z[instance.j]
            samples[index, 0] = final  # F(0) = vbar^T x
            if schedule.both_anchors:
                samples[index, width] = final - difference  # c = vbar^T (x - z), kept in the spare column
        block = samples[indices]
        if schedule.both_anchors:
            constant, block = block[:, width], block[:, :width]
        instance_ranks, values = kernel.detect_ranks(block, ks[:width], H0, constant=constant, **rank_options)
        return instance_ranks, values, kernel.fit(block, ks[:width], H_star, constant=constant)

    rest = np.setdiff1d(np.arange(n), row0)
    ranks[rest], singular_values[rest], fits_rest = fit_later(rest)
    fits = _concatenate([fits_row0, fits_rest], [row0, rest], n)

    # --- lean: heads inside a column match by residue labels; too close -> a column link.
    label_order = None
    if schedule.name == "lean" and d > 1 and H_star > 1:
        reference = np.repeat(grid[0][None, :], d - 1, axis=0).ravel()
        later = grid[1:].ravel()
        matches = match_labels(_side(fits, reference), _side(fits, later))
        label_order = (later, matches)
        ambiguous = later[matches.ambiguity > CheckPolicy.for_precision(precision).label_ambiguity]
        if len(ambiguous):
            links = [schedule.add_column_link(schedule.instances[b].i, schedule.instances[b].j) for b in ambiguous]
            extra_answers, extra_owners, extra_copies = ask(links)
            grown = np.empty((len(schedule.instances), len(ks)), dtype=samples.dtype)
            grown[:n] = samples
            samples = grown
            samples[extra_owners, extra_copies] = extra_answers
            extra_ranks, extra_values, extra_fits = fit_later(np.array(links))
            ranks = np.concatenate([ranks, extra_ranks])
            singular_values = np.concatenate([singular_values, extra_values])
            fits = _concatenate([fits, extra_fits], [np.arange(n), np.array(links)], len(schedule.instances))
            n = len(schedule.instances)
    column_links = schedule.column_link_index

    # --- matching (section 4): order[inst, h] = which fitted pole of inst is head h, with the
    # heads in the order of instance (0, 0).
    order = np.tile(np.arange(H_star), (n, 1))
    ambiguity = np.full(n, np.nan)
    label_residual = np.full(n, np.nan)
    label_scale = max(float(magnitude_float(fits.labels).max()) if fits.labels.size else 0.0, 1e-300)
    bijective = True

    def ordered(values, index):
        return np.take_along_axis(values[index], order[index], axis=1)

    def link(a_index, b_index, link_index, labels_add):
        nonlocal bijective
        matches = match_links(_side(fits, a_index, order), _side(fits, b_index), _side(fits, link_index), labels_add)
        order[b_index] = matches.permutation
        order[link_index] = matches.link_heads
        l_a, l_b, l_link = (ordered(fits.labels, index) for index in (a_index, b_index, link_index))
        mismatch = magnitude_float(l_link - (l_a + l_b if labels_add else l_b))
        if not labels_add:  # column links: the labels of a and b agree too
            mismatch = np.maximum(mismatch, magnitude_float(l_a - l_b))
        ambiguity[link_index] = matches.ambiguity
        label_residual[link_index] = mismatch.max(axis=1, initial=0.0) / label_scale
        bijective = bijective and bool(matches.bijective.all())

    if d > 1 and (row_links[1:] >= 0).all():
        link(np.full(d - 1, grid[0, 0]), grid[0, 1:], row_links[1:], labels_add=True)
    if label_order is not None:  # lean: a label match is relative to the column's row-0 instance
        later, matches = label_order
        reference_order = order[grid[0]][np.array([schedule.instances[b].j for b in later])]
        order[later] = np.take_along_axis(matches.permutation, reference_order, axis=1)
        ambiguity[later] = matches.ambiguity
        bijective = bijective and bool(matches.bijective.all())
    linked = np.argwhere(column_links >= 0)
    if d > 1 and len(linked):
        i, j = linked[:, 0], linked[:, 1]
        link(grid[0, j], grid[i, j], column_links[i, j], labels_add=False)
        if label_order is not None:  # the link decided these; its own ambiguity is on the link
            ambiguity[grid[i, j]] = np.nan

    # --- assembly (section 5): M_h[j, i] = m of grid (i, j), l_h[j] from column j.
    m_ordered, l_ordered = ordered(fits.log_poles, np.arange(n)), ordered(fits.labels, np.arange(n))
    if is_hp:
        # Balls: every redundant measurement is itself an enclosure; keep the tightest.
        M, mean_labels = _tightest_balls(schedule, m_ordered, l_ordered)
    else:
        # float64: every redundant measurement (links too), weighted by its first-order variance.
        sigma_m, sigma_l = ordered(fits.sigma_m, np.arange(n)), ordered(fits.sigma_l, np.arange(n))
        M, M_std = _combine_poles(schedule, m_ordered, sigma_m)
        mean_labels, label_std = _combine_labels(schedule, l_ordered, sigma_l)
    W, v = kernel.assemble(schedule.Z, schedule.X, M, mean_labels)
    # Each grid and column-link instance against the consensus labels of its column, in units of
    # its own error: ball radii in high precision, eps times the label sensitivity in float64.
    label_deviation = np.full(n, np.nan)
    eps = 2.0 ** -(precision if is_hp else 52)
    for index, instance in enumerate(schedule.instances):
        if instance.role == "row_link":
            continue
        if not H_star:
            label_deviation[index] = 0.0
            continue
        miss = magnitude_float(l_ordered[index] - mean_labels[:, instance.j])
        if is_hp:
            expected = radius_float(l_ordered[index]) + radius_float(mean_labels[:, instance.j])
        else:
            expected = eps * ordered(fits.sigma_l, np.array([index]))[0]
        label_deviation[index] = float(np.nanmax(miss / (expected + eps * label_scale), initial=0.0))

    diagnostics = InstanceDiagnostics(
        role=np.array([inst.role for inst in schedule.instances]),
        i=np.array([inst.i for inst in schedule.instances]), j=np.array([inst.j for inst in schedule.instances]),
        rank=ranks, singular_values=singular_values, pole_gap=fits.pole_gap, imaginary=fits.imaginary,
        nonpositive=fits.nonpositive, residual=fits.residual, condition=fits.condition,
        certified=fits.certified, ambiguity=ambiguity, label_residual=label_residual,
        label_deviation=label_deviation,
    )
    # --- error estimate. High precision: the balls' radii, a certified bound given answers within
    # one ulp. float64: first order, the worst instance's amplification through the assembly.
    W_mid, v_mid = mid_float(W), mid_float(v)
    W_scale = max(np.abs(W_mid).max(), 1e-300) if H_star else 1.0
    v_scale = max(np.abs(v_mid).max(), 1e-300) if H_star else 1.0
    if is_hp:
        error_estimate = max(radius_float(W).max() / W_scale, radius_float(v).max() / v_scale) if H_star else 0.0
    else:
        # delta W_h = Z^{-T} delta M_h X^{-1}: bounded by the spectral norms times ||delta M_h||_F.
        Z_inv = np.linalg.norm(np.linalg.inv(schedule.Z), 2)
        X_inv = np.linalg.norm(np.linalg.inv(schedule.X), 2)
        eps = np.finfo(np.float64).eps
        W_error = eps * Z_inv * X_inv * np.linalg.norm(M_std.reshape(H_star, -1), axis=1).max(initial=0.0)
        v_error = eps * Z_inv * np.linalg.norm(label_std, axis=1).max(initial=0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            error_estimate = float(np.nan_to_num(max(W_error / W_scale, v_error / v_scale), nan=np.inf))

    if not (np.isfinite(W_mid).all() and np.isfinite(v_mid).all()):
        return None, None, None, diagnostics, bijective, np.inf, None
    if is_hp:
        model = MultiHeadAttention(W_mid, v_mid)
        return model, W, v, diagnostics, bijective, error_estimate, None
    model = MultiHeadAttention(W, v)
    pipeline = None
    if schedule.name == "paper":
        # What the certificate linearises: the fits in head order, the combination's weights.
        pipeline = PipelineRun(schedule, owners, copies, fits.c, m_ordered, l_ordered, _weights(sigma_m),
                               _weights(sigma_l), _pole_design(schedule), model, answers, ranks)
    return model, None, None, diagnostics, bijective, error_estimate, pipeline


def _tightest_balls(schedule: PaperSchedule, m: np.ndarray, labels: np.ndarray):
    """High precision: for each ``M_h[j, i]`` and ``l_h[j]`` the tightest of its enclosures.

    ``M[j, 0]`` (j >= 1) is grid (0, j) or row link j minus ``M[0, 0]``; ``M[j, i]`` (i >= 1) is
    grid (i, j) or column link (i, j) minus ``M[j, 0]``; ``l[j]`` is any grid or column link
    instance of column j (links the schedule did not ask are skipped). Each candidate encloses the truth when its instance is certified, so
    the choice keeps the certificate and discards ill-conditioned instances.
    """
    d = schedule.d
    H = m.shape[1]
    grid, row_links, column_links = schedule.grid_index, schedule.row_link_index, schedule.column_link_index

    def tightest(*candidates):
        return min(candidates, key=lambda ball: float(ball.rad()))

    M = np.empty((H, d, d), dtype=object)
    l = np.empty((H, d), dtype=object)
    for h in range(H):
        M[h, 0, 0] = m[grid[0, 0], h]
        for j in range(1, d):
            link = [m[row_links[j], h] - M[h, 0, 0]] if row_links[j] >= 0 else []
            M[h, j, 0] = tightest(m[grid[0, j], h], *link)
        for j in range(d):
            for i in range(1, d):
                link = [m[column_links[i, j], h] - M[h, j, 0]] if column_links[i, j] >= 0 else []
                M[h, j, i] = tightest(m[grid[i, j], h], *link)
            links = column_links[1:, j][column_links[1:, j] >= 0]
            l[h, j] = tightest(*labels[grid[:, j], h], *labels[links, h])
    return M, l


def _weights(sigma: np.ndarray) -> np.ndarray:
    """Inverse variances; a non-finite sensitivity (failed fit) gets weight 0."""
    sigma = np.where(np.isfinite(sigma), sigma, np.inf)
    floor = np.nanmin(sigma[np.isfinite(sigma)], initial=1.0) * 1e-6 + 1e-300
    return 1.0 / np.maximum(sigma, floor) ** 2


def _pole_design(schedule: PaperSchedule):
    """Sparse (n, d^2): which entries ``M[j, i]`` (column ``j d + i``) each instance's pole measures
    (grid: ``M[j, i]``; row link j: ``M[0, 0] + M[j, 0]``; column link (i, j): ``M[j, 0] + M[j, i]``)."""
    from scipy.sparse import csr_matrix

    d = schedule.d
    rows, cols = [], []
    for index, instance in enumerate(schedule.instances):
        i, j = instance.i, instance.j
        if instance.role == "grid":
            unknowns = [j * d + i]
        elif instance.role == "row_link":
            unknowns = [0, j * d]
        else:
            unknowns = [j * d, j * d + i]
        rows += [index] * len(unknowns)
        cols += unknowns
    return csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(schedule.instances), d * d))


def _combine_poles(schedule: PaperSchedule, m: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Weighted least squares for every ``M_h[j, i]`` from all instances (float64).

    Grid ``(i, j)`` measures ``M[j, i]``; row link j measures ``M[0, 0] + M[j, 0]``; column link
    ``(i, j)`` measures ``M[j, 0] + M[j, i]``. The links make every entry but ``M[0, 0]`` measured
    twice, so a badly conditioned instance (a close pair of poles) is outvoted by its twin.
    The normal equations are sparse (the links form a tree) and solved per head. Returns
    M (H, d, d) and its first-order standard deviations per unit relative sample error.
    """
    from scipy.sparse.linalg import MatrixRankWarning, spsolve

    d = schedule.d
    n, H = m.shape
    A = _pole_design(schedule)
    weights = _weights(sigma)
    M = np.empty((H, d, d))
    for h in range(H):
        values = np.where(weights[:, h] > 0, m[:, h], 0.0)
        Aw = A.multiply(weights[:, h][:, None]).tocsr()
        normal = (A.T @ Aw).tocsc()
        with warnings.catch_warnings():  # an unknown with no usable measurement -> NaN, reported
            warnings.simplefilter("ignore", MatrixRankWarning)
            M[h] = np.atleast_1d(spsolve(normal, Aw.T @ values)).reshape(d, d)
    # Posterior standard deviations, to first order along the tree: M[0,0] from its grid
    # instance; M[j,0] and M[j,i] each from a direct and a linked measurement.
    variance = 1.0 / np.maximum(weights, 1e-300)
    grid, row_links, column_links = schedule.grid_index, schedule.row_link_index, schedule.column_link_index

    def combine(direct, linked):
        return 1.0 / (1.0 / direct + 1.0 / linked)

    def linked(link_index, base):
        return variance[link_index] + base if link_index >= 0 else np.full(H, np.inf)

    std = np.empty((H, d, d))
    v00 = variance[grid[0, 0]]
    std[:, 0, 0] = v00
    for j in range(1, d):
        std[:, j, 0] = combine(variance[grid[0, j]], linked(row_links[j], v00))
    for i in range(1, d):
        for j in range(d):
            std[:, j, i] = combine(variance[grid[i, j]], linked(column_links[i, j], std[:, j, 0]))
    return M, np.sqrt(std)


def _combine_labels(schedule: PaperSchedule, labels: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Weighted mean of ``l_h[j] = v_h^T z_j`` over grid column j and its column links (float64),
    and its standard deviation per unit relative sample error."""
    d = schedule.d
    H = labels.shape[1]
    total = np.zeros((H, d))
    weight = np.zeros((H, d))
    weights = _weights(sigma)
    for index, instance in enumerate(schedule.instances):
        if instance.role in ("grid", "column_link"):
            total[:, instance.j] += weights[index] * np.where(weights[index] > 0, labels[index], 0.0)
            weight[:, instance.j] += weights[index]
    weight = np.maximum(weight, 1e-300)
    return total / weight, 1.0 / np.sqrt(weight)


def _concatenate(parts, indices, n):
    """Merge InstanceFits computed on disjoint index sets into one indexed 0..n-1."""
    out = {}
    for name in InstanceFits.__dataclass_fields__:
        values = [getattr(part, name) for part in parts]
        same = all(value.dtype == values[0].dtype for value in values)
        merged = np.empty((n,) + values[0].shape[1:], dtype=values[0].dtype if same else object)
        for value, index in zip(values, indices):
            merged[index] = value
        out[name] = merged
    return InstanceFits(**out)


def _side(fits: InstanceFits, index, order=None) -> Side:
    """Poles, labels and their sensitivities of some instances, in head order if ``order`` is given."""
    def take(values):
        values = values[index]
        return values if order is None else np.take_along_axis(values, order[index], axis=1)
    return Side(take(fits.log_poles), take(fits.labels), take(fits.sigma_m), take(fits.sigma_l))


@dataclass(frozen=True)
class CheckPolicy:
    """Thresholds of the self-checks.

    High precision: every instance must pass; quantities must sit below ``2^(-precision/4)``,
    far above the rounding of a correct run and far below any O(1) failure.
    float64: an instance with two nearly equal poles is ill-conditioned by nature and the
    redundant measurements outvote it, so a small fraction of outlying instances is allowed;
    the global checks (error estimate, misfit of all answers) carry the verdict.
    """

    per_instance: float  # tolerance of relative per-instance quantities (imaginary parts)
    outlier_fraction: float  # fraction of instances allowed to fail a per-instance check
    ambiguity: float  # a link with a larger ambiguity counts as unmatched
    label_slack: float  # label deviation allowed, in units of its error (ball radius or first order)
    error_estimate: float
    answers_residual: float
    label_ambiguity: float = 0.01  # lean: a label match less certain than this gets a column link

    @classmethod
    def for_precision(cls, precision: int | None) -> "CheckPolicy":
        if precision is None:
            return cls(1e-6, 0.05, 0.5, 1e3, 1e-4, 1e-6)
        tolerance = 2.0 ** (-precision / 4)
        # Labels: balls of one column must overlap (slack 1), up to a little outward rounding.
        return cls(tolerance, 0.0, 0.1, 4.0, tolerance, tolerance)


def _checks(diag: InstanceDiagnostics, H_star, precision, bijective, error_estimate, answers_residual,
            known_heads=None, residual_floor=0.0):
    policy = CheckPolicy.for_precision(precision)
    residual_threshold = max(policy.answers_residual, residual_floor)  # noisy answers cannot be fitted closer
    checks = []

    def fraction_check(name, flags, message):
        count = int(np.sum(flags))
        fraction = count / max(len(flags), 1)
        checks.append(Check(name, fraction <= policy.outlier_fraction, fraction, policy.outlier_fraction,
                            f"{count} of {len(flags)} {message}"))

    fraction_check("pole_count", diag.rank != H_star, f"instances detected a pole count other than H* = {H_star}")
    if (diag.rank > H_star).any():
        checks[-1].passed = False
        checks[-1].message += "; some detected more, so H* is not the canonical count"
    fraction_check("poles_real_positive", diag.nonpositive | (diag.imaginary > policy.per_instance),
                   "instances have a complex or non-positive tau")
    links = ~np.isnan(diag.ambiguity)
    fraction_check("matching", diag.ambiguity[links] > policy.ambiguity,
                   f"links matched their heads ambiguously (ambiguity > {policy.ambiguity})")
    if not bijective:
        checks[-1].passed = False
        checks[-1].message += "; a link pole was matched to two heads"
    labelled = ~np.isnan(diag.label_deviation)
    fraction_check("labels_consistent", diag.label_deviation[labelled] > policy.label_slack,
                   f"instances have residue labels off the consensus by more than {policy.label_slack:.3g} "
                   "times their first-order error")
    checks.append(Check(
        "error_estimate", error_estimate <= policy.error_estimate, error_estimate, policy.error_estimate,
        "max relative parameter error expected from the rounding of the answers",
    ))
    checks.append(Check(
        "answers_residual", answers_residual <= residual_threshold, answers_residual, residual_threshold,
        "max misfit of the extracted model on the queries asked, relative to the largest answer",
    ))
    if precision is None:
        # With H given, the conditioning is that of H heads even if fewer were detected.
        heads = max(H_star, known_heads or 0)
        checks.append(Check(
            "float64_head_limit", heads <= FLOAT64_MAX_RELIABLE_HEADS, heads, FLOAT64_MAX_RELIABLE_HEADS,
            "float64 rational interpolation with 2H+1 samples loses ~3 digits per head; for H >= 5 use "
            "precision=BITS (or a saturating schedule)",
        ))
    return checks


def _answers_residual(model: MultiHeadAttention, sequences, answers, precision) -> float:
    """Max |model - answer| / max |answer| on the queries asked (at most 256 of them in high precision)."""
    if precision is None:
        predicted = model(sequences)
        scale = max(np.abs(answers).max(), 1e-300)
        return float(np.abs(predicted - answers).max() / scale)
    picks = np.unique(np.linspace(0, len(sequences) - 1, min(256, len(sequences))).astype(int))
    predicted = model([sequences[p] for p in picks], precision=precision + 16)
    chosen = mid_float(np.array([answers[p] for p in picks], dtype=object))
    from .highprec import to_arb
    difference = np.array([to_arb(pred) - answers[p] for pred, p in zip(predicted, picks)], dtype=object)
    scale = max(np.abs(chosen).max(), 1e-300)
    return float(magnitude_float(difference).max() / scale)
