"""The oracle boundary: what crosses between the learner and a black box.

Oracle protocol: any callable ``oracle(batch) -> outputs`` where ``batch`` is a list of
sequences, each a 2-D array of shape (N_i, d). In float64 mode the tokens are float64 arrays and
the answers floats. In high-precision mode (``precision=bits``) the tokens are object arrays of
``mpmath.mpf`` and the answers ``mpmath.mpf`` or decimal strings, at least as precise; plain
floats are refused there, since they would silently cap the precision at 53 bits.

:class:`OracleBoundary` is the one place where queries are counted: the numbers an
:class:`~mhaextract.Extraction` reports are the ones measured here, never the schedule's formula.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import mpmath
import numpy as np
from flint import arb

from .highprec import mpf_to_arb
from .model import MultiHeadAttention


class OracleError(RuntimeError):
    """An oracle answered badly (wrong count, NaN, infinite, wrong type) or could not answer.

    Attributes
    ----------
    query : int or None
        Index (0-based, in the order asked) of the offending query, when one can be named.
    sequence : array or None
        The offending sequence.
    """

    def __init__(self, message: str, query: int | None = None, sequence=None):
        super().__init__(message)
        self.query = query
        self.sequence = sequence


class BudgetExceeded(OracleError):
    """The run needs more queries than ``max_queries`` allows."""


class SimulatedOracle:
    """An oracle that answers for a known model, in float64 or at ``precision`` bits.

    Parameters
    ----------
    model : MultiHeadAttention (or any object with ``model(batch, precision=...)``)
    precision : int or None
        None answers float64; an int answers ``mpmath.mpf`` computed in ball arithmetic and
        rounded to ``precision`` bits.
    """

    def __init__(self, model: MultiHeadAttention, precision: int | None = None):
        self.model = model
        self.precision = None if precision is None else int(precision)

    def __call__(self, batch):
        return self.model(batch, precision=self.precision)

    def __repr__(self) -> str:
        return f"SimulatedOracle({self.model!r}, precision={self.precision})"


@dataclass
class OracleBoundary:
    """Wraps a user's oracle: converts tokens, validates answers, counts and batches queries.

    ``queries`` and ``max_query_length`` are measured here, at the call into the user's oracle.
    """

    oracle: Callable
    d: int
    precision: int | None = None
    batch_size: int = 1024
    max_queries: int | None = None
    progress: bool | None = None
    queries: int = 0
    max_query_length: int = 0

    def __post_init__(self):
        if not callable(self.oracle):
            raise TypeError(f"oracle must be callable, got {type(self.oracle).__name__}")
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def ask(self, sequences: Sequence[np.ndarray], description: str = "querying oracle") -> np.ndarray:
        """Answers for ``sequences`` (float64 arrays whose entries are exact in any precision).

        Returns a float64 array in float64 mode, an object array of ``arb`` balls in
        high-precision mode: the answer as midpoint and one ulp at ``precision`` bits as radius
        (the precision contract of the oracle, which the extraction's certificate rests on).
        """
        total = len(sequences)
        if self.max_queries is not None and self.queries + total > self.max_queries:
            raise BudgetExceeded(
                f"query budget exceeded: the run needs {self.queries + total} queries, "
                f"max_queries={self.max_queries} ({self.queries + total - self.max_queries} more needed)"
            )
        answers = np.empty(total, dtype=object if self.precision else np.float64)
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        with _progress(show, description, total) as advance:
            for start in range(0, total, self.batch_size):
                chunk = sequences[start:start + self.batch_size]
                answers[start:start + len(chunk)] = self._ask_batch(chunk)
                advance(len(chunk))
        return answers

    def _ask_batch(self, chunk: Sequence[np.ndarray]):
        first = self.queries
        batch = [self._to_oracle_tokens(sequence) for sequence in chunk]
        try:
            raw = self.oracle(batch)
        except Exception as error:  # propagate unchanged, but say which queries were being asked
            where = f"query {first}" if len(chunk) == 1 else f"queries {first}..{first + len(chunk) - 1}"
            error.add_note(
                f"mhaextract: raised by the oracle while answering {where} "
                f"(lengths {sorted({len(s) for s in chunk})}); the first sequence was\n{chunk[0]!r}"
            )
            raise
        # Every sequence handed over counts, whatever comes back.
        self.queries += len(chunk)
        self.max_query_length = max(self.max_query_length, max(len(s) for s in chunk))
        return self._validate(raw, chunk, first)

    def _to_oracle_tokens(self, sequence: np.ndarray):
        if self.precision is None:
            return np.array(sequence, dtype=np.float64)
        # float64 -> mpf is exact; the schedule's tokens are chosen to be exactly representable.
        return np.vectorize(mpmath.mpf, otypes=[object])(sequence)

    def _validate(self, raw, chunk, first: int):
        try:
            count = len(raw)
        except TypeError:
            raise OracleError(
                f"the oracle must return one answer per sequence; got {type(raw).__name__} for a "
                f"batch of {len(chunk)} (queries {first}..{first + len(chunk) - 1})", first, chunk[0]
            ) from None
        if count != len(chunk):
            raise OracleError(
                f"the oracle returned {count} answers for a batch of {len(chunk)} sequences "
                f"(queries {first}..{first + len(chunk) - 1}); missing answers", first, chunk[0]
            )
        if self.precision is None:
            return [self._float_answer(value, first + n, chunk[n]) for n, value in enumerate(raw)]
        return [self._ball_answer(value, first + n, chunk[n]) for n, value in enumerate(raw)]

    @staticmethod
    def _float_answer(value, query: int, sequence) -> float:
        try:
            number = float(np.asarray(value).reshape(()))
        except (TypeError, ValueError):
            raise OracleError(
                f"answer to query {query} (length {len(sequence)}) is not a scalar number: {value!r}",
                query, sequence,
            ) from None
        if not np.isfinite(number):
            raise OracleError(f"answer to query {query} (length {len(sequence)}) is {number}", query, sequence)
        return number

    def _ball_answer(self, value, query: int, sequence) -> arb:
        if isinstance(value, str):
            with mpmath.workprec(self.precision + 64):
                try:
                    value = mpmath.mpf(value)
                except (ValueError, TypeError):
                    raise OracleError(f"answer to query {query} is not a decimal number: {value!r}", query, sequence) from None
        if isinstance(value, arb):
            raise OracleError(
                f"answer to query {query} is a flint arb; the high-precision boundary speaks mpmath: "
                "return mpmath.mpf or a decimal string", query, sequence,
            )
        if not isinstance(value, mpmath.mpf):
            raise OracleError(
                f"answer to query {query} is a {type(value).__name__}; in high-precision mode "
                f"(precision={self.precision}) answers must be mpmath.mpf or decimal strings: a "
                "float would silently cap the precision at 53 bits",
                query, sequence,
            )
        if not mpmath.isfinite(value):
            raise OracleError(f"answer to query {query} (length {len(sequence)}) is {value}", query, sequence)
        # The contract: an answer is within one unit in the last place at `precision` bits.
        # The ball says so, and everything computed from it inherits a certified radius.
        ball = mpf_to_arb(value)
        return arb(ball.mid(), abs(ball).upper() * arb(2) ** (1 - self.precision))


class _progress:
    """A rich progress bar (or nothing) as a context manager yielding ``advance(n)``."""

    def __init__(self, show: bool, description: str, total: int):
        self.show, self.description, self.total = show, description, total

    def __enter__(self):
        if not self.show:
            return lambda n: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=True,
        )
        self._bar.__enter__()
        task = self._bar.add_task(self.description, total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc):
        if self.show:
            self._bar.__exit__(*exc)
        return False
