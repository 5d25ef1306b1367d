"""Verification: does the extracted model answer like the oracle on queries it has never seen?

Two uses of one comparison (:func:`output_errors`):

* **The default verification** of every run (:func:`ask_long_verification`,
  :meth:`LongVerification.judge`; ``extract(..., verify_length=...)``, docs/algorithm.md, 'Approximate answers:
  certificate, oversampling, refinement, verification'): ``VERIFY_QUERIES`` fresh random queries, counted at the run's
  boundary like every other, whose lengths are spread geometrically from 1 to ``verify_length`` tokens (256 by default),
  far beyond the schedule's own (at most ``2 H0 + 1``). It is the ``long_verification`` check: a
  layer that agrees with one model on short sequences and not on long ones (a sliding window,
  position-dependent scores, another model beyond a few tokens) fits every query a schedule asks
  and fails here, with the length from which it misses in the message.
* :func:`verify`: ``n`` fresh random queries (lengths 1..``max_length``, tokens Gaussian at
  several scales around the run's token scale, so that both flat and sharp attention occur)
  through an :class:`~mhaextract.oracle.boundary.OracleBoundary` of its own (counted), compared as

      relative error(X) = |f_hat(X) - oracle(X)| / rms_q |oracle(X_q)|

  (the root mean square of the oracle's answers on the same queries is the output scale; a
  per-query ratio would explode wherever an answer happens to be near 0). The result records how
  the queries were drawn and is attached to the extraction (``extraction.verification``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mpmath
import numpy as np

from ..numerics.float64 import root_mean_square
from ..numerics.highprec import GUARD_BITS, mid_float, mpf_array
from ..oracle.boundary import OracleBoundary, OracleError
from ..oracle.queries import random_queries
from ..run.validation import positive_int, positive_number, renamed
from .base import Check

#: The default verification's longest query (``extract(..., verify_length=None)``), in tokens.
VERIFY_LENGTH = 256
#: The longest ``verify_length`` accepted: the model's own evaluation pads every query to it.
MOST_VERIFY_LENGTH = 4096
#: Fresh queries of the default verification, whatever the run (docs/algorithm.md, 'Approximate answers: certificate,
#: oversampling, refinement, verification').
VERIFY_QUERIES = 32
#: Token scales of the fresh queries, as multiples of the run's token scale.
TOKEN_SCALES = (0.5, 1.0, 2.0)
#: The misfit a correct model may show on a fresh query, in units of what the run itself claims:
#: its error estimate, its residual or its answers' noise (relative to the largest answer).
LIMIT_FACTOR = 100.0
#: ... plus this many units of the answers' rounding per token of the query (a float32 oracle's
#: softmax over N tokens rounds by up to about N units; float64's is far below the rest).
ROUNDING_PER_TOKEN = 4.0
#: :func:`verify`'s default tolerance covers this many units of the answers' own rounding (times
#: the largest answer over their root mean square): an oracle answering in bfloat16 or float16
#: misses the exact layer by about a unit, and a correct model cannot come closer to it.
ANSWER_ROUNDING_UNITS = 8.0
#: The limit never exceeds this fraction of the largest answer: a run whose own estimate is larger
#: has failed ``error_estimate`` already, and a looser limit would let a windowed layer pass.
LIMIT_CAP = 1e-2


def verify_length_option(verify_length) -> int | None:
    """``extract``'s ``verify_length``: None (the schedule's default), 0 (no default verification)
    or an integer 1..``MOST_VERIFY_LENGTH``; anything else is a ValueError saying so."""
    if verify_length is None:
        return None
    if (isinstance(verify_length, bool) or not isinstance(verify_length, (int, np.integer))
            or not 0 <= verify_length <= MOST_VERIFY_LENGTH):
        raise ValueError(f"verify_length must be None (default: {VERIFY_LENGTH} tokens), 0 (no verification) or an "
                         f"integer 1..{MOST_VERIFY_LENGTH}, the longest fresh query of the verification; got "
                         f"{verify_length!r}")
    return int(verify_length)


def spread_lengths(count: int, longest: int) -> np.ndarray:
    """``count`` query lengths spread geometrically from 1 to ``longest`` (both included when
    ``count >= 2``): as many short queries as long ones on a log scale, the longest asked once."""
    if count == 1:
        return np.array([int(longest)])
    return np.rint(np.geomspace(1, longest, count)).astype(int)


def fresh_queries(rng: np.random.Generator, lengths, d: int, token_scale: float,
                  scales: tuple[float, ...] = TOKEN_SCALES) -> list[np.ndarray]:
    """One random query per entry of ``lengths`` (:func:`~mhaextract.oracle.queries.random_queries`),
    its tokens at ``scales[q mod len(scales)] x token_scale``."""
    return [random_queries(rng, 1, d, scales[q % len(scales)] * token_scale, (int(n), int(n)))[0]
            for q, n in enumerate(lengths)]


def output_errors(model, sequences, answers, precision: int | None = None) -> np.ndarray:
    """``|f_hat(X_q) - answer_q|`` per query, absolute, as float64 (answers as the boundary returns
    them: floats, or balls whose midpoints are compared; an answer of several entries counts by
    its largest difference). The model is evaluated in float64, or with ``precision=bits`` at
    ``bits + GUARD_BITS`` and the difference taken there (errors far below float64's rounding
    show)."""
    if precision is not None:
        predicted = model(sequences, precision=int(precision) + GUARD_BITS)
        observed = mpf_array(answers)
        with mpmath.workprec(int(precision) + GUARD_BITS):
            return np.array([float(abs(p - o)) for p, o in zip(predicted, observed)])
    predicted = np.asarray(model(sequences), dtype=np.float64).reshape(len(sequences), -1)
    observed = mid_float(answers).reshape(len(sequences), -1)
    if predicted.shape != observed.shape:
        raise ValueError(f"the model answers {predicted.shape[1]} numbers per query and the oracle "
                         f"{observed.shape[1]}: compare outputs of the same shape")
    return np.abs(predicted - observed).max(axis=1, initial=0.0)


@dataclass
class Verification:
    """Outcome of :func:`verify`, or of a run's default verification (``extraction.verification``).

    Attributes
    ----------
    queries : int, measured at the oracle boundary.
    max_relative_error, mean_relative_error : over the fresh queries, relative to ``relative_to``.
    tolerance : the max relative error allowed; ``passed``: max_relative_error <= tolerance.
    lengths : (shortest, longest) query length asked. scales : token scales used.
    relative_to : the output scale the errors are relative to (:func:`verify`: the root mean
        square of the oracle's answers on the same queries; the default verification: the largest
        answer of the run, the scale its error estimate and residual are relative to).
    misses_from : the shortest query length the model missed (None when it passed).
    seed : the seed of the queries.

    Examples
    --------
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> oracle = mx.SimulatedOracle(target)
    >>> result = mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper")
    >>> verification = mx.verify(result, oracle, verify_queries=60, seed=0)
    >>> verification.passed, verification.queries, verification.lengths
    (True, 60, (1, 16))
    >>> print(verification)  # doctest: +ELLIPSIS
    verification passed: 60 fresh queries (lengths 1..16, token scales 0.658, 1.32, 2.63): max relative output error ...
    """

    queries: int
    max_relative_error: float
    mean_relative_error: float
    tolerance: float
    passed: bool
    lengths: tuple[int, int]
    scales: tuple[float, ...]
    seed: object
    relative_to: str = "the root mean square of the oracle's answers"
    misses_from: int | None = None

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"verification {verdict}: {self.queries} fresh queries (lengths {self.lengths[0]}..{self.lengths[1]}, "
                f"token scales {', '.join(f'{s:.3g}' for s in self.scales)}): max relative output error "
                f"{self.max_relative_error:.3g}, mean {self.mean_relative_error:.3g} (tolerance {self.tolerance:.3g}; "
                f"relative to {self.relative_to})"
                + ("" if self.misses_from is None else f"; missed from {self.misses_from} tokens on"))


@dataclass
class LongVerification:
    """The default verification's fresh queries and the oracle's answers to them: asked once
    (:func:`ask_long_verification`), judged for the run's final model (:meth:`judge`)."""

    sequences: list
    answers: np.ndarray
    scales: tuple[float, ...]
    whole: np.ndarray | None = None  # an oracle answering vectors: the answers whole (n, d_out)

    @property
    def queries(self) -> int:
        return len(self.sequences)

    @property
    def longest(self) -> int:
        return max((len(sequence) for sequence in self.sequences), default=0)

    def limit(self, error_estimate: float, residual: float, noise: float, scale: float, unit: float,
              rounding: float | None = None) -> float:
        """The largest misfit (relative to the largest answer ``scale``) a correct model may show:
        ``min(LIMIT_CAP, LIMIT_FACTOR x max(error_estimate, residual, noise / scale))`` plus the
        answers' rounding, ``rounding`` or by default ``ROUNDING_PER_TOKEN x longest x unit``
        (``unit``: the answers' relative rounding)."""
        claimed = max((value if np.isfinite(value) else np.inf)
                      for value in (error_estimate, residual, noise / scale, 0.0))
        if rounding is None:
            rounding = ROUNDING_PER_TOKEN * self.longest * unit
        return min(LIMIT_CAP, LIMIT_FACTOR * claimed) + rounding

    def judge(self, model, error_estimate: float, residual: float, noise: float, scale: float, unit: float,
              schedule_longest: int, seed=None, rounding: float | None = None,
              precision: int | None = None) -> tuple[Check, Verification]:
        """The ``long_verification`` check of ``model`` and its :class:`Verification`. ``noise``:
        the answers' absolute error the run measured or was told; ``scale``: its largest answer;
        ``rounding``: see :meth:`limit`; ``precision``: bits at which the model's outputs are
        compared (:func:`output_errors`; None: float64)."""
        tolerance = self.limit(error_estimate, residual, noise, scale, unit, rounding)
        answers = self.whole if self.whole is not None and getattr(model, "is_vector", False) else self.answers
        errors = output_errors(model, self.sequences, answers, precision) / scale
        lengths = np.array([len(sequence) for sequence in self.sequences])
        missed = ~(errors <= tolerance)  # NaN misses
        worst = float(np.nan_to_num(errors, nan=np.inf).max(initial=0.0))
        misses_from = int(lengths[missed].min()) if missed.any() else None
        verification = Verification(
            queries=self.queries, max_relative_error=worst, mean_relative_error=float(errors.mean()),
            tolerance=tolerance, passed=misses_from is None, lengths=(int(lengths.min()), int(lengths.max())),
            scales=self.scales, seed=seed, relative_to="the largest answer of the run", misses_from=misses_from)
        message = (f"max misfit of the model on {self.queries} fresh queries of 1..{self.longest} tokens, relative "
                   f"to the largest answer (limit: {LIMIT_FACTOR:g} x the run's own error estimate, residual or "
                   f"noise, at most {LIMIT_CAP:g}, plus the answers' rounding over {self.longest} tokens)")
        if misses_from is not None:
            fits_up_to = int(lengths[~missed & (lengths < misses_from)].max(initial=0))
            if misses_from > schedule_longest:
                message += (f": the model fits every query up to {fits_up_to} tokens but misses answers of length "
                            f">= {misses_from} by up to {worst:.3g}: a sliding window, position-dependent scores "
                            "or another model beyond short sequences; these are outside the model class, and the "
                            "heads describe the oracle on short sequences only (verify_length=0 turns this check "
                            "off; it does not make them right beyond)")
            else:
                message += (f": the model misses fresh queries as short as {misses_from} tokens (the schedule's own "
                            f"are up to {schedule_longest}) by up to {worst:.3g}: it does not answer like the oracle")
        return Check("long_verification", misses_from is None, worst, tolerance, message), verification


def ask_long_verification(boundary: OracleBoundary, rng: np.random.Generator, token_scale: float,
                          longest: int, count: int = VERIFY_QUERIES,
                          scales: tuple[float, ...] = TOKEN_SCALES) -> LongVerification:
    """Ask ``count`` fresh queries of lengths :func:`spread_lengths` up to ``longest`` (tokens at
    ``scales`` x ``token_scale``) through the run's ``boundary`` (counted, recorded in its
    transcript like every other answer)."""
    sequences = fresh_queries(rng, spread_lengths(count, longest), boundary.d, token_scale, scales)
    try:
        answers = boundary.ask(sequences, description="verifying on fresh long queries", whole=True)
    except OracleError as error:  # the budget, or a bad answer: say which queries these were
        error.add_note(f"mhaextract: these are the run's own verification queries ({count} fresh queries of 1.."
                       f"{longest} tokens, docs/algorithm.md, 'Default verification on fresh long queries'); "
                       "verify_length sets their longest, 0 turns "
                       "them off")
        raise
    except Exception as error:
        if getattr(error, "raised_by_oracle", False):  # an oracle that cannot take long sequences
            error.add_note(f"mhaextract: the oracle raised on the run's own verification queries (up to {longest} "
                           "tokens); pass verify_length=L (its longest query) or 0 to turn it off")
        raise
    asked = tuple(s * token_scale for s in scales)
    if np.ndim(answers) == 2:  # whole vector answers: the scalar model is judged on their read-out first
        return LongVerification(sequences, boundary.vectors.scalars(answers), asked, whole=answers)
    return LongVerification(sequences, answers, asked)


def verify(extraction, oracle, verify_queries: int = 256, seed=None, *, verify_length: int = 16,
           scales: tuple[float, ...] = TOKEN_SCALES, tolerance: float | None = None, batch_size: int = 1024,
           progress=None, n=None, max_length=None) -> Verification:
    """Check ``extraction.model`` against ``oracle`` on ``verify_queries`` fresh random queries (float64).

    Every run verifies itself by default on fresh queries up to 256 tokens (the
    ``long_verification`` check, ``extraction.verification``); this asks more, as many and as
    long as you choose, after the run.

    Parameters
    ----------
    extraction : the result of any family (:class:`~mhaextract.Result`) with a model that
        evaluates sequences (``model(sequences)``, ``model.d``, ``model.is_vector``).
    oracle : the oracle it was extracted from (or any float64 oracle for the same d).
    verify_queries : number of fresh queries (>= 1), split evenly over ``scales``.
    seed : seeds the queries.
    verify_length : longest query (lengths uniform in 1..verify_length).
    scales : token scales, as multiples of the extraction's own ``token_scale`` (the regime it was
        extracted in; ``d ** 0.25`` unless the run chose another).
    tolerance : the max relative output error that counts as passing; default
        ``max(1e-6, 10 answer_error / output scale, ANSWER_ROUNDING_UNITS x unit x max|answer| /
        output scale)`` (``extraction.answer_error``, 0 if not given; ``unit`` the answers' rounding,
        declared by the oracle or read from their bits: 2^-8 for bfloat16, 2^-53 for float64).

    Returns
    -------
    Verification
        A new :class:`Verification`; ``extraction`` is not modified (attach the outcome with
        ``extraction.with_verification(...)``).

    Notes
    -----
    ``n`` and ``max_length`` are the former names of ``verify_queries`` and ``verify_length``
    (accepted with a FutureWarning): one vocabulary in every function, option and CLI flag.

    Examples
    --------
    A model that is a little off fails on fresh queries:

    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> oracle = mx.SimulatedOracle(target)
    >>> result = mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper")
    >>> mx.verify(result, oracle, 30, seed=0).passed
    True
    >>> wrong = mx.SimulatedOracle(mx.MultiHeadAttention(target.W, 1.001 * target.v))
    >>> mx.verify(result, wrong, 30, seed=0).passed
    False
    """
    if getattr(extraction, "model", None) is None:
        raise ValueError("the extraction has no model to verify (its parameters were not finite)")
    n = positive_int("verify_queries", renamed("n", n, "verify_queries", verify_queries, 256))
    max_length = positive_int("verify_length", renamed("max_length", max_length, "verify_length", verify_length, 16))
    scales = tuple(positive_number("scales", s) for s in scales)
    if not scales:
        raise ValueError(f"scales must be positive numbers, got {scales!r}")
    if tolerance is not None:
        tolerance = positive_number("tolerance", tolerance)
    model = extraction.model
    d = model.d
    base = extraction.token_scale
    rng = np.random.default_rng(seed)
    counts = np.diff(np.linspace(0, int(n), len(scales) + 1).astype(int))
    sequences = []
    for scale, count in zip(scales, counts):
        sequences += random_queries(rng, count, d, scale * base, (1, int(max_length)))
    boundary = OracleBoundary(oracle, d, batch_size=batch_size, progress=progress)
    answers = boundary.ask(sequences, description="verifying on fresh queries", whole=model.is_vector)
    output_scale = root_mean_square(answers) or 1.0  # scaled: huge answers do not overflow
    errors = output_errors(model, sequences, answers) / output_scale
    if tolerance is None:
        rounding = ANSWER_ROUNDING_UNITS * boundary.answer_unit * float(np.abs(mid_float(answers)).max()) / output_scale
        tolerance = max(1e-6, 10.0 * float(getattr(extraction, "answer_error", None) or 0.0) / output_scale, rounding)
    tolerance = float(tolerance)
    lengths = [len(sequence) for sequence in sequences]
    passed = bool(errors.max() <= tolerance)
    result = Verification(
        queries=boundary.queries, max_relative_error=float(errors.max()), mean_relative_error=float(errors.mean()),
        tolerance=tolerance, passed=passed, lengths=(min(lengths), max(lengths)),
        scales=tuple(s * base for s in scales), seed=seed,
        misses_from=None if passed else min(n for n, e in zip(lengths, errors) if not e <= tolerance),
    )
    return result
