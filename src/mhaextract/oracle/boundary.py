"""The oracle boundary: what crosses between the learner and a black box.

Oracle protocol: any callable ``oracle(batch) -> outputs`` where ``batch`` is a list of
sequences, each a 2-D array of shape (N_i, d). In float64 mode the tokens are float64 arrays and
the answers floats, one per sequence (B,), or vectors of ``d_out`` numbers per sequence (B, d_out)
(a layer's whole output at the final token; :mod:`mhaextract.oracle.vector_answers`), as numpy
arrays, lists or torch tensors of any float dtype (converted exactly to float64). In high-precision mode (``precision=bits``) the tokens are object arrays of
``mpmath.mpf`` and the answers ``mpmath.mpf`` or decimal strings, at least as precise; plain
floats are refused there, since they would silently cap the precision at 53 bits.

:class:`OracleBoundary` is the one place where queries are counted: the numbers an
:class:`~mhaextract.Extraction` reports are the ones measured here, never the schedule's formula.
"""

from __future__ import annotations

from collections.abc import Mapping, Set as AbstractSet
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mpmath
import numpy as np
from flint import arb

from ..numerics.highprec import mpf_to_arb
from .answer_stats import AnswerStats
from .vector_answers import VectorAnswers
from .progress import progress_bar
from .queries import CopiesRows


class OracleError(RuntimeError):
    """An oracle answered badly (wrong count, NaN, infinite, wrong type) or could not answer.

    Attributes
    ----------
    query : int or None
        Index (0-based, in the order asked) of the offending query, when one can be named.
    sequence : array or None
        The offending sequence.

    Examples
    --------
    >>> import mhaextract as mx
    >>> def broken(batch):
    ...     return [float("nan")] * len(batch)
    >>> try:
    ...     mx.extract(broken, d=3, heads=1, schedule="paper")
    ... except mx.OracleError as error:
    ...     print(error, "| query", error.query)
    answer to query 0 (length 1) is nan | query 0
    """

    def __init__(self, message: str, query: int | None = None, sequence=None):
        super().__init__(message)
        self.query = query
        self.sequence = sequence


class BudgetExceeded(OracleError):
    """The run needs more queries than ``max_queries`` allows.

    Attributes
    ----------
    needed : int
        Queries the run still needs (not answered by the oracle nor found in the transcript).
    answered : int
        Answers the run holds (asked now or read back from the transcript); with a transcript they
        are saved there and a re-run with the same transcript and seed resumes from them.

    Examples
    --------
    Without a transcript nothing is asked when the budget cannot cover the run:

    >>> import mhaextract as mx
    >>> oracle = mx.SimulatedOracle(mx.MultiHeadAttention.random(d=3, heads=2, seed=0))
    >>> try:
    ...     mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper", max_queries=10)
    ... except mx.BudgetExceeded as error:
    ...     print(error.needed, error.answered)
    69 0
    """

    def __init__(self, message: str, needed: int, answered: int):
        super().__init__(message)
        self.needed = needed
        self.answered = answered


class _Rebuilt(Sequence):
    """A batch's sequences as the learner asked them, built again on first access (for messages)."""

    def __init__(self, build, count: int):
        self._build, self._count, self._items = build, count, None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if self._items is None:
            self._items = self._build()
        return self._items[index]


#: Queries read back from a transcript that a boundary keeps for the resume check.
REPLAYED_SAMPLES = 16

@dataclass
class OracleBoundary:
    """Wraps a user's oracle: converts tokens, validates answers, counts and batches queries.

    ``queries`` (asked of the oracle by this boundary) and ``max_query_length`` are measured here,
    at the call into the user's oracle. With a ``transcript``, ``replayed`` counts the answers read
    back from it instead of asked; ``max_query_length`` covers every query whose answer was used.
    ``position`` is the run's query index of the next sequence handed to :meth:`ask` (queries
    are numbered in the order the learner asks for them, across calls).
    """

    oracle: Callable
    d: int
    precision: int | None = None
    batch_size: int = 1024
    max_queries: int | None = None
    progress: object = None  # True, False, None (stderr a terminal) or the run's bar (.progress.RunProgress)
    transcript: object = None  # a mhaextract.oracle.transcript.Transcript, or None
    queries: int = 0
    replayed: int = 0
    max_query_length: int = 0
    position: int = 0
    stats: AnswerStats = field(default_factory=AnswerStats)  # float64 answers used so far
    budget_spent: str = ""  # what max_queries is of the run's budget, where earlier boundaries took a part
    vectors: VectorAnswers | None = None  # the read-out of vector answers
    overflowed: int = 0  # answers that came back non-finite where the caller allowed it (ask's ``overflow``)
    #: The first ``REPLAYED_SAMPLES`` queries read back from the transcript (run index -> sequence):
    #: what a resume check re-asks for a learner whose queries depend on earlier answers.
    replayed_samples: dict = field(default_factory=dict)
    #: Called once with this boundary before its first query that is not in the transcript (the
    #: session's resume check), or None.
    before_fresh: Callable | None = None

    def __post_init__(self):
        if self.vectors is None:
            self.vectors = VectorAnswers(None)
        if not callable(self.oracle):
            raise TypeError(f"oracle must be callable, got {type(self.oracle).__name__}")
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def answer_unit(self) -> float:
        """The answers' relative rounding unit: the one the oracle declares (``answer_dtype``, via
        :class:`VectorAnswers`) or the one their bits show so far, whichever is coarser."""
        return max(self.vectors.unit, self.stats.unit_roundoff)

    def ask(self, sequences: Sequence[np.ndarray], description: str = "querying oracle",
            whole: bool = False, overflow: bool = False) -> np.ndarray:
        """Answers for ``sequences`` (float64 arrays whose entries are exact in any precision): a
        list of (N_i, d) arrays, or any sequence of them (one (n, N, d) array; a source that builds
        new arrays on every access, ``fresh_on_access``, whose batches go to the oracle uncopied; one
        that also gives its queries as rows, ``copies_rows``, hands them so to an oracle with
        ``takes_copies_rows``: :class:`~mhaextract.oracle.queries.CopiesRows`).

        Returns a float64 array in float64 mode, an object array of ``arb`` balls in
        high-precision mode: the answer as midpoint and one ulp at ``precision`` bits as radius
        (the precision contract of the oracle, which the extraction's certificate rests on).

        With a ``transcript``, answers an earlier run recorded are read back and only the missing
        queries are asked, in batches of ``batch_size``, each batch committed to the transcript as
        it arrives. ``max_queries`` caps the queries asked of the oracle by this boundary: with a
        transcript the budget is spent (and saved) before :class:`BudgetExceeded` is raised;
        without one nothing could be kept, so it is raised before anything is asked.

        Vector answers (B, d_out) reach the schedules read out through ``vectors.readout``;
        ``whole=True`` returns them whole, float64 (B, d_out), when the oracle answers vectors (the
        value fit's queries, docs/algorithm.md, 'The whole layer: vector outputs and a replacement module').

        ``overflow=True`` (float64 mode; queries whose tokens are large by design): an answer that
        is not finite, in any of its numbers, is evidence that the layer's own dtype overflowed at
        these tokens (a float16 layer's scores beyond 65504), not of a broken oracle. It comes back
        as NaN (the whole vector) instead of raising OracleError, counted in ``queries`` and
        ``overflowed``, left out of the answers' statistics, and not recorded in the transcript (a
        resumed run asks it again, counted again); the caller lowers its tokens and asks again.
        """
        total = len(sequences)
        whole = {} if whole and not self.precision else None  # position -> whole vector answer
        first = self.position
        self.position += total
        exact = np.empty(total, dtype=object if self.precision else np.float64)
        replayed = self.transcript.replay(first, sequences) if self.transcript is not None else {}
        vector_positions = [position for position, value in replayed.items() if np.ndim(value) == 1]
        if vector_positions:
            values = np.stack([replayed[position] for position in vector_positions])
            self._check_vectors(values, [first + p for p in vector_positions], "read back from the transcript")
            self.stats.add_vectors(values)
            if whole is not None:
                whole.update(zip(vector_positions, values))
            replayed.update(zip(vector_positions, self.vectors.scalars(values)))
        for position, value in replayed.items():
            exact[position] = value
        if replayed:
            self.replayed += len(replayed)
            self.max_query_length = max(self.max_query_length, max(len(sequences[p]) for p in replayed))
            for p in sorted(replayed)[:max(0, REPLAYED_SAMPLES - len(self.replayed_samples))]:
                self.replayed_samples[first + p] = np.array(sequences[p], dtype=np.float64)
        missing = ([position for position in range(total) if position not in replayed] if replayed
                   else range(total))  # a range slices to a range: chunks are then slices of `sequences`
        if len(missing) and self.before_fresh is not None:
            hook, self.before_fresh = self.before_fresh, None
            hook(self)
        allowed = len(missing)
        if self.max_queries is not None:
            allowed = max(0, min(allowed, self.max_queries - self.queries))
        if allowed < len(missing) and self.transcript is None:
            raise self._over_budget(len(missing), total - len(missing))
        # A source that builds new arrays on every access (the grid's CopiesQueries): its batches go
        # to the oracle as they are, and what the boundary keeps (transcript hashes, error messages)
        # is built again, so that nothing the oracle does to its arrays reaches them.
        fresh = self.precision is None and getattr(sequences, "fresh_on_access", False)
        # Copies-instances go as their rows to an oracle that builds their sequences itself.
        as_rows = (fresh and getattr(self.oracle, "takes_copies_rows", False)
                   and callable(getattr(sequences, "copies_rows", None)))
        with progress_bar(self.progress, description, total, completed=len(replayed)) as advance:
            for start in range(0, allowed, self.batch_size):
                positions = missing[start:min(start + self.batch_size, allowed)]

                def take(positions=positions):
                    return (sequences[positions.start:positions.stop] if isinstance(positions, range)
                            else [sequences[p] for p in positions])
                chunk = (sequences.copies_rows(positions.start, positions.stop)
                         if as_rows and isinstance(positions, range) else take())
                values = self._ask_batch(chunk, [first + p for p in positions], rebuild=take if fresh else None,
                                         overflow=overflow and not self.precision)
                if self.transcript is not None:
                    # What the learner uses is what reads back from the file: a resumed run sees
                    # exactly the values an uninterrupted one saw.
                    values = self._record(first, positions, take() if fresh else chunk, values)
                if np.ndim(values) == 2:  # vector answers: read out for the schedule
                    values = np.asarray(values, dtype=np.float64)
                    self.stats.add_vectors(values[finite_answers(values)])
                    if whole is not None:
                        whole.update(zip(positions, values))
                    values = self.vectors.scalars(values)
                if self.precision:
                    for position, value in zip(positions, values):
                        exact[position] = value
                elif isinstance(positions, range):
                    exact[positions.start:positions.stop] = values
                else:
                    exact[np.asarray(positions)] = values
                advance(len(chunk))
        if allowed < len(missing):
            raise self._over_budget(len(missing) - allowed, total - len(missing) + allowed)
        if not self.precision:
            self.stats.add(exact[np.isfinite(exact)])
            if whole is not None and len(whole) == total and total:
                return np.stack([whole[position] for position in range(total)])
            return exact
        balls = np.empty(total, dtype=object)
        for position, value in enumerate(exact):
            balls[position] = self._ball(value)
        return balls

    def probe(self, sequences: Sequence[np.ndarray], indices: Sequence[int], description: str = "probing",
              whole: bool = False):
        """Ask ``sequences`` outside the run's sequence (nothing recorded nor replayed); counted in
        ``queries`` and within ``max_queries``. Returns raw validated answers (float or mpf; vector
        answers read out, or whole with ``whole=True``)."""
        if self.max_queries is not None and self.queries + len(sequences) > self.max_queries:
            raise BudgetExceeded(
                f"query budget exceeded: {description} needs {len(sequences)} queries and max_queries="
                f"{self.max_queries}{self._budget_of()} leaves {max(0, self.max_queries - self.queries)} (raise "
                "max_queries, or pass resume_check=0 to replay a transcript without re-asking)", len(sequences), 0)
        if not len(sequences):
            return []
        values = self._ask_batch(list(sequences), list(indices))
        return self.vectors.scalars(values) if np.ndim(values) == 2 and not whole else values

    def _record(self, first: int, positions, sequences, values):
        """Record the finite answers of one batch in the transcript; the answers as read back, with
        the non-finite ones (``ask``'s ``overflow``) left NaN and unrecorded."""
        finite = finite_answers(values)
        if finite.all():
            return self.transcript.record(first, positions, sequences, values)
        kept = np.flatnonzero(finite)
        read = np.array(values, dtype=np.float64)
        if len(kept):
            read[kept] = np.asarray(self.transcript.record(first, [positions[k] for k in kept],
                                                           [sequences[k] for k in kept], read[kept]))
        return read

    def _budget_of(self) -> str:
        return f" ({self.budget_spent})" if self.budget_spent else ""

    def _over_budget(self, needed: int, answered: int) -> BudgetExceeded:
        if self.transcript is not None:
            kept = (f"the {answered} answers so far are saved in the transcript {self.transcript.path!r}; "
                    "re-run with the same transcript and seed to resume")
        else:
            kept = ("nothing was asked: without a transcript the answers would be lost when the run stops "
                    "(pass transcript=PATH to spend the budget and resume later)")
        return BudgetExceeded(
            f"query budget exceeded: max_queries={self.max_queries}{self._budget_of()} and {self.queries} asked in "
            f"this run; the run still needs {needed} more queries ({kept})", needed, answered,
        )

    def _ask_batch(self, chunk: Sequence[np.ndarray], indices: Sequence[int], rebuild=None, overflow: bool = False):
        """Ask the oracle for one batch; ``indices`` are the run's query numbers (for messages).
        ``rebuild``: ``chunk`` is new float64 arrays no one else holds, handed over without a copy;
        ``rebuild()`` builds them again for the messages. ``overflow``: :meth:`ask`'s."""
        if rebuild is not None:
            if isinstance(chunk, CopiesRows):
                batch, longest = chunk, int(chunk.lengths().max(initial=0))
            else:
                batch = chunk if isinstance(chunk, list) else list(chunk)  # a CopiesBatch stays one
                longest = max(map(len, batch), default=0)  # before the oracle has them
            chunk = _Rebuilt(rebuild, len(chunk))
        else:
            batch = [self._to_oracle_tokens(sequence) for sequence in chunk]
        where = f"query {indices[0]}" if len(chunk) == 1 else f"queries {indices[0]}..{indices[-1]}"
        try:
            raw = self.oracle(batch)
        except KeyboardInterrupt:  # the user's Ctrl-C, not the oracle's failure
            raise
        except (Exception, SystemExit) as error:  # propagate unchanged, but say which queries were being asked
            error.add_note(
                f"mhaextract: raised by the oracle while answering {where} "
                f"(lengths {sorted({len(s) for s in chunk})}); the first sequence was\n{chunk[0]!r}"
            )
            error.raised_by_oracle = True  # extract re-raises it unchanged (not a kernel failure)
            raise
        # Every sequence handed over counts, whatever comes back.
        self.queries += len(chunk)
        if rebuild is None:
            longest = max(map(len, chunk))
        self.max_query_length = max(self.max_query_length, longest)
        values = self._validate(raw, chunk, indices, where, overflow)
        if overflow:
            self.overflowed += int((~finite_answers(values)).sum())
        return values

    def _to_oracle_tokens(self, sequence: np.ndarray):
        if self.precision is None:
            return np.array(sequence, dtype=np.float64)
        # float64 -> mpf is exact; the schedule's tokens are chosen to be exactly representable.
        return np.vectorize(mpmath.mpf, otypes=[object])(sequence)

    def _validate(self, raw, chunk, indices, where: str, overflow: bool = False):
        raw = plain_numbers(raw)
        if isinstance(raw, (str, bytes, Mapping, AbstractSet)):  # iterable, but not answers in the batch's order
            raise OracleError(
                f"the oracle returned a {type(raw).__name__} for a batch of {len(chunk)} ({where}): {ANSWER_FORMS}",
                indices[0], chunk[0])
        try:
            count = len(raw)
        except TypeError:
            raise OracleError(
                f"the oracle must return one answer per sequence; got {type(raw).__name__} for a "
                f"batch of {len(chunk)} ({where}): {ANSWER_FORMS}", indices[0], chunk[0]
            ) from None
        if count != len(chunk):
            raise OracleError(
                f"the oracle returned {count} answers for a batch of {len(chunk)} sequences "
                f"({where}); {'missing' if count < len(chunk) else 'extra'} answers", indices[0], chunk[0]
            )
        if np.ma.isMaskedArray(raw) and np.ma.getmaskarray(raw).any():
            n = int(np.argwhere(np.ma.getmaskarray(raw))[0][0])
            raise OracleError(f"answer to query {indices[n]} is masked (a numpy masked array with masked entries, "
                              f"{where}): every answer is a number", indices[n], chunk[n])
        vector = self._vector_answers(raw, count, indices, chunk)
        if vector is not None:
            if self.precision:
                raise OracleError(
                    f"the oracle answered vectors of {vector.shape[1]} numbers per query ({where}); in high "
                    f"precision (precision={self.precision}) answers are one mpmath.mpf per query: read out "
                    "one output (a scalar per sequence)", indices[0], chunk[0])
            self._check_vectors(vector, indices, f"answered ({where})", chunk, overflow)
            return vector
        if self.vectors.d_out is not None and self.vectors.d_out > 1:
            raise OracleError(
                f"the oracle answered one number per query ({where}) after answering vectors of "
                f"{self.vectors.d_out}; an oracle answers the same shape throughout", indices[0], chunk[0])
        if self.precision is None:
            if isinstance(raw, np.ndarray) and raw.dtype.kind == "f" and raw.shape == (count,):
                values = raw.astype(np.float64)
                if np.isfinite(values).all():  # the common case, checked as one array
                    return values
            return [self._float_answer(value, indices[n], chunk[n], overflow) for n, value in enumerate(raw)]
        return [self._mpf_answer(value, indices[n], chunk[n]) for n, value in enumerate(raw)]

    @staticmethod
    def _vector_answers(raw, count: int, indices, chunk) -> np.ndarray | None:
        """The answers as a float64 (count, d_out) array when the oracle answered vectors, else None;
        an OracleError for every other shape, naming what was wrong (:func:`_shape_hint`)."""
        if isinstance(raw, np.ndarray) and raw.dtype != object:
            if raw.ndim == 1:
                return None
            if raw.ndim != 2 or raw.dtype.kind not in "fiu":
                raise OracleError(
                    f"the oracle returned an array of shape {raw.shape} and dtype {raw.dtype} for a batch of "
                    f"{count}: answers are one number per sequence (B,) or one vector per sequence (B, d_out)"
                    f"{_shape_hint(raw.shape[1:], chunk)}", indices[0], chunk[0])
            return raw.astype(np.float64)
        rows = [plain_numbers(value) for value in raw]
        shapes = []
        for n, row in enumerate(rows):
            try:
                shapes.append(np.shape(row))
            except ValueError:  # nested sequences of unequal lengths
                raise OracleError(f"answer to query {indices[n]} is ragged (nested sequences of unequal lengths): "
                                  f"{_short(row)}; every answer is one number or a vector of d_out numbers",
                                  indices[n], chunk[n]) from None
        if all(len(shape) == 0 for shape in shapes):
            return None
        deep = next((n for n, shape in enumerate(shapes) if len(shape) > 1), None)
        if deep is not None:
            raise OracleError(
                f"answer to query {indices[deep]} has shape {shapes[deep]}: every answer is one number or a vector "
                f"of d_out numbers{_shape_hint(shapes[deep], [chunk[deep]])}", indices[deep], chunk[deep])
        if len(set(shapes)) > 1:
            n = next(n for n, shape in enumerate(shapes) if shape != shapes[0])
            raise OracleError(
                f"answer to query {indices[n]} has shape {shapes[n]} while answer {indices[0]} has "
                f"shape {shapes[0]}: every answer is one number or a vector of the same d_out numbers",
                indices[n], chunk[n])
        if any(np.asarray(row).dtype.kind == "b" for row in rows):
            raise OracleError(f"the answers to queries {indices[0]}..{indices[-1]} are vectors of booleans: the "
                              "oracle must return the real-valued attention output, not a decision",
                              indices[0], chunk[0])
        try:
            return np.array(rows, dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            raise OracleError(f"the answers to queries {indices[0]}..{indices[-1]} are vectors that are not "
                              f"float64 numbers: {_short(rows[0])}", indices[0], chunk[0]) from None

    def _check_vectors(self, values: np.ndarray, indices, how: str, chunk=None, overflow: bool = False) -> None:
        """Vector answers: finite in every coordinate (``overflow``: a vector with a non-finite
        number is set NaN whole, :meth:`ask`), of the run's d_out, no mix with scalar answers."""
        if values.shape[1] < 1:
            raise OracleError(f"the oracle {how} vectors of 0 numbers: every answer is one number or a vector of "
                              "d_out >= 1 numbers", indices[0])
        bad = np.argwhere(~np.isfinite(values))
        if len(bad) and overflow:
            values[np.unique(bad[:, 0])] = np.nan
        elif len(bad):
            n, o = bad[0]
            raise OracleError(
                f"answer to query {indices[n]}, output {o} of {values.shape[1]}, is {values[n, o]} "
                f"({len(bad)} non-finite entries in this batch)", indices[n], None if chunk is None else chunk[n])
        if self.vectors.d_out is not None and values.shape[1] != self.vectors.d_out:
            raise OracleError(
                f"the oracle {how} vectors of {values.shape[1]} numbers after vectors of {self.vectors.d_out}: "
                "an oracle answers the same d_out throughout"
                f"{'' if chunk is None else _shape_hint(values.shape[1:], chunk)}",
                indices[0], None if chunk is None else chunk[0])
        if self.vectors.d_out is None and self.stats.count and values.shape[1] > 1:
            raise OracleError(f"the oracle {how} vectors of {values.shape[1]} numbers after answering one "
                              "number per query; an oracle answers the same shape throughout", indices[0])
        if self.vectors.d_out is None:
            self.vectors.start(values.shape[1])

    @staticmethod
    def _float_answer(value, query: int, sequence, overflow: bool = False) -> float:
        value = plain_numbers(value)
        if isinstance(value, (bool, np.bool_)):
            raise OracleError(
                f"answer to query {query} (length {len(sequence)}) is the boolean {value!r}: the oracle must "
                "return the real-valued attention output (a float per sequence), not a decision", query, sequence)
        try:
            number = float(np.asarray(value).reshape(()))
        except OverflowError:
            raise OracleError(f"answer to query {query} (length {len(sequence)}) is beyond float64's range: "
                              f"{_short(value)}", query, sequence) from None
        except (TypeError, ValueError):
            raise OracleError(
                f"answer to query {query} (length {len(sequence)}) is not a scalar number: {_short(value)}",
                query, sequence,
            ) from None
        if not np.isfinite(number):
            if overflow:
                return np.nan
            raise OracleError(f"answer to query {query} (length {len(sequence)}) is {number}", query, sequence)
        return number

    def _mpf_answer(self, value, query: int, sequence) -> mpmath.mpf:
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
        return value

    def _ball(self, value: mpmath.mpf) -> arb:
        # The contract: an answer is within one unit in the last place at `precision` bits.
        # The ball says so, and everything computed from it inherits a certified radius.
        ball = mpf_to_arb(value)
        return arb(ball.mid(), abs(ball).upper() * arb(2) ** (1 - self.precision))


#: What an oracle may return for a batch, said in the messages that refuse anything else.
ANSWER_FORMS = ("return one answer per sequence, in the batch's order: a list, a numpy array or a torch tensor of "
                "shape (B,) (one number per sequence) or (B, d_out) (a layer's whole output at the final token)")


def _shape_hint(shape, sequences) -> str:
    """What to try for an answer of ``shape`` (per sequence) whose first axis runs over the tokens of
    ``sequences``: the outputs at every position, of which the model is the one at the final token."""
    shape = tuple(shape)
    if len(shape) in (1, 2) and len(sequences) and all(len(sequence) == shape[0] for sequence in sequences):
        return (f"; each answer's first axis runs over its sequence's {shape[0]} tokens (the outputs at every "
                "position?): return the output at the final token only: out[-1] per sequence, out[:, -1, :] for a "
                "(B, N, d_out) batch")
    return ""


def finite_answers(values) -> np.ndarray:
    """Per answer (scalars (n,) or vectors (n, d_out), float64): every number of it finite."""
    finite = np.isfinite(np.asarray(values, dtype=np.float64))
    return finite if finite.ndim == 1 else finite.all(axis=1)


def _short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a message names what came back, not all of it)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def plain_numbers(value):
    """A torch tensor as a numpy array, exactly: detached (an answer may require grad) and floats
    widened to float64 (numpy has no bfloat16); anything else unchanged."""
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach"):
        tensor = value.detach().cpu()
        return (tensor.double() if tensor.is_floating_point() else tensor).numpy()
    return value
