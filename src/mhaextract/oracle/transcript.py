"""A run's transcript: every query and its answer in SQLite, so that no answer is ever paid twice.

An extraction asks ``4 H0 d^2 - 2 H0 + 1`` queries of an oracle that may be slow, remote or
metered. With ``extract(..., transcript="run.sqlite")`` the :class:`~mhaextract.oracle.boundary.OracleBoundary`
commits each batch of answers to the file as it arrives; a run that stops (an exception, Ctrl-C,
a budget) loses at most the batch in flight. Re-running with the same transcript and seed reads
the recorded answers back and asks the oracle only for the missing ones. The learner sees the
same answers either way, so a resumed run returns the same result bit for bit.

What makes that safe:

* **Fingerprint.** The file records what the run was: ``d``, ``H0``, ``seed``, ``precision``,
  the schedule's name, ``token_scale`` (exact hex) and the SHA-256 of every query's tokens. A
  run that differs in any of them is refused with a :class:`TranscriptError` listing the
  differences; the file is not touched.
* **Per query.** Row ``id`` (the run's query number, in the order the learner asks) holds the
  query's length, the SHA-256 of its tokens (checked against the query being asked before an
  answer is replayed) and a checksum of the row. Adaptive queries (the lean schedule's fallback
  links, which depend on earlier answers) are not in the fingerprint's hash; this per-row check
  covers them.
* **Exact answers.** float64 answers are stored as ``float.hex`` and high-precision answers as
  ``mpf`` mantissa/exponent (:func:`mhaextract.numerics.highprec.mpf_to_hex`): both read back bit for bit.
* **Never overwritten.** An existing file is validated through a read-only connection first.
  Anything unexpected (not SQLite, damaged pages, missing tables, a bad checksum, an answer
  that does not parse) raises :class:`TranscriptError` and leaves the file as it was. Rows are
  only ever inserted, never updated.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from typing import Sequence

import mpmath
import numpy as np

from ..numerics.highprec import mpf_from_hex, mpf_to_hex

#: Version of the file layout; a transcript of another version is refused.
FORMAT = 1


class TranscriptError(RuntimeError):
    """A transcript is corrupt, belongs to another run or oracle, or cannot be written. An existing
    file was left untouched.

    Attributes
    ----------
    path : str, the transcript file.
    unsaved : dict {query index: answer} of answers received but not stored (storage errors).

    Examples
    --------
    A transcript records one run; another run (here another seed) is refused, the file untouched:

    >>> import pathlib, tempfile
    >>> import mhaextract as mx
    >>> oracle = mx.SimulatedOracle(mx.MultiHeadAttention.random(d=3, heads=1, seed=0))
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.sqlite"
    >>> first = mx.extract(oracle, d=3, heads=1, seed=1, schedule="paper", transcript=path)
    >>> again = mx.extract(oracle, d=3, heads=1, seed=1, schedule="paper", transcript=path)
    >>> again.queries_replayed == first.queries  # every answer read back, none paid for twice
    True
    >>> try:
    ...     mx.extract(oracle, d=3, heads=1, seed=2, schedule="paper", transcript=path)
    ... except mx.TranscriptError as error:
    ...     print(type(error).__name__, "seed" in str(error))
    TranscriptError True
    """

    def __init__(self, message: str, path):
        super().__init__(message)
        self.path = str(path)
        self.unsaved: dict = {}


def check_directory(path) -> None:
    """Before any query: the transcript's directory must exist and be writable."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise TranscriptError(f"transcript {path!r}: the directory {directory!r} does not exist; create it "
                              "or pass another transcript path (nothing was asked)", path)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TranscriptError(f"transcript {path!r}: the directory {directory!r} is not writable; pass "
                              "another transcript path (nothing was asked)", path)


def tokens_sha256(sequence: np.ndarray) -> str:
    """SHA-256 of one query: its shape and its float64 tokens (little-endian, row-major)."""
    array = np.ascontiguousarray(np.asarray(sequence, dtype="<f8"))
    digest = hashlib.sha256(repr(array.shape).encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


def run_fingerprint(schedule, seed: int, precision: int | None, sequences: Sequence[np.ndarray]) -> dict:
    """What identifies a run: the parameters that determine its queries and answers.

    ``queries_sha256`` hashes every query's tokens in order, so a schedule that changes in any
    way (another version of the code, another scale) is caught even when the parameters agree.
    """
    everything = hashlib.sha256()
    for sequence in sequences:
        everything.update(tokens_sha256(sequence).encode())
    return {
        "format": FORMAT,
        "d": schedule.d,
        "max_heads": schedule.max_heads,
        "seed": seed,
        "precision": precision,
        "schedule": schedule.name,
        "token_scale": float(schedule.token_scale).hex(),
        "queries": len(sequences),
        "queries_sha256": everything.hexdigest(),
    }


def _row_checksum(index: int, length: int, token_hash: str, answer: str) -> str:
    return hashlib.sha256(f"{index}:{length}:{token_hash}:{answer}".encode()).hexdigest()[:32]


class Transcript:
    """The SQLite transcript of one run (see the module docstring).

    Parameters
    ----------
    path : file to create, or to resume from.
    fingerprint : dict from :func:`run_fingerprint`; an existing file must carry the same one.

    Attributes
    ----------
    path : str
    answered : int, the number of answers in the file.
    created : bool, whether this run created the file.
    """

    def __init__(self, path, fingerprint: dict):
        self.path = os.fspath(path)
        self.fingerprint = dict(fingerprint)
        self.high_precision = fingerprint["precision"] is not None
        self._answers: dict[int, tuple[int, str, object]] = {}
        check_directory(self.path)
        self.created = not os.path.exists(self.path) or self._is_empty_database()
        if not self.created:
            self._load()  # read-only; raises TranscriptError and touches nothing on any problem
        try:
            self._connection = sqlite3.connect(self.path, isolation_level=None)
            if self.created:
                self._create()
        except sqlite3.Error as error:
            raise self._storage_error("cannot be created or opened for writing", error) from error

    def _storage_error(self, what: str, error: BaseException) -> TranscriptError:
        return TranscriptError(f"transcript {self.path!r} {what} ({type(error).__name__}: {error}); check that "
                               "its directory is writable and the disk not full, or pass another transcript path",
                               self.path)

    # ------------------------------------------------------------------ reading
    def _refuse(self, problem: str) -> TranscriptError:
        return TranscriptError(
            f"transcript {self.path!r} {problem}. It was not modified; pass another transcript path "
            "(or the original run's parameters) to go on.", self.path,
        )

    def _read_only(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{os.path.abspath(self.path)}?mode=ro", uri=True)

    def _is_empty_database(self) -> bool:
        """A SQLite file with no tables at all (e.g. a run killed while creating it) holds nothing."""
        if os.path.getsize(self.path) == 0:
            return True
        try:
            with self._read_only() as connection:
                return connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        except sqlite3.DatabaseError:
            return False  # not SQLite at all: _load says so

    def _load(self) -> None:
        try:
            connection = self._read_only()
            try:
                check = connection.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise self._refuse(f"is damaged (SQLite integrity check: {check})")
                tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if not {"meta", "queries"} <= tables:
                    raise self._refuse(f"is not a mhaextract transcript (tables {sorted(tables)})")
                meta = dict(connection.execute("SELECT key, value FROM meta").fetchall())
                rows = connection.execute("SELECT id, length, tokens_sha256, answer, checksum FROM queries").fetchall()
            finally:
                connection.close()
        except sqlite3.DatabaseError as error:
            raise self._refuse(f"is not a readable SQLite database ({error})") from None
        try:
            recorded = json.loads(meta["fingerprint"])
        except (KeyError, TypeError, ValueError):
            raise self._refuse("has no readable fingerprint") from None
        self._compare(recorded)
        for index, length, token_hash, answer, checksum in rows:
            if not (isinstance(index, int) and index >= 0 and isinstance(length, int)
                    and isinstance(token_hash, str) and isinstance(answer, str)
                    and checksum == _row_checksum(index, length, token_hash, answer)):
                raise self._refuse(f"is corrupt: the row of query {index} fails its checksum")
            try:
                value = self._decode(answer)
            except ValueError:
                raise self._refuse(f"is corrupt: the answer to query {index} does not parse ({answer!r})") from None
            self._answers[index] = (length, token_hash, value)

    def _compare(self, recorded: dict) -> None:
        keys = ("format", "d", "max_heads", "seed", "precision", "schedule", "token_scale", "queries",
                "queries_sha256")
        differences = [
            f"{key}: transcript {recorded.get(key)!r}, this run {self.fingerprint[key]!r}"
            for key in keys if recorded.get(key) != self.fingerprint[key]
        ]
        if differences:
            raise self._refuse("was recorded by a different run (" + "; ".join(differences) + ")")

    def _decode(self, answer: str):
        if self.high_precision:
            return mpf_from_hex(answer)
        value = float.fromhex(answer)
        if not np.isfinite(value):
            raise ValueError(answer)
        return value

    def _encode(self, value) -> str:
        return mpf_to_hex(value) if self.high_precision else float(value).hex()

    @property
    def answered(self) -> int:
        return len(self._answers)

    def replay(self, first: int, sequences: Sequence[np.ndarray]) -> dict[int, object]:
        """Recorded answers for queries ``first, first + 1, ...`` (``sequences``), by position.

        Each answer is returned only after the recorded hash of its query's tokens matched the
        query being asked now. The answers are exact: floats, or ``mpmath.mpf`` in high precision.
        """
        out = {}
        for position, sequence in enumerate(sequences):
            entry = self._answers.get(first + position)
            if entry is None:
                continue
            length, token_hash, value = entry
            if length != len(sequence) or token_hash != tokens_sha256(sequence):
                raise self._refuse(f"recorded another query as query {first + position}")
            out[position] = value
        return out

    # ------------------------------------------------------------------ writing
    def _create(self) -> None:
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        connection.execute(
            "CREATE TABLE queries (id INTEGER PRIMARY KEY, length INTEGER NOT NULL, "
            "tokens_sha256 TEXT NOT NULL, answer TEXT NOT NULL, checksum TEXT NOT NULL)"
        )
        connection.execute("INSERT INTO meta VALUES ('fingerprint', ?)", (json.dumps(self.fingerprint),))
        connection.execute("INSERT INTO meta VALUES ('answer_encoding', ?)",
                           ("exact: float.hex (float64) or [-]0x<hex mantissa>p<exponent> (mpf)",))
        connection.execute("COMMIT")

    def record(self, first: int, positions: Sequence[int], sequences: Sequence[np.ndarray], values) -> list:
        """Insert the answers to queries ``first + positions`` in one transaction (committed on return).

        Returns the answers as they read back from the file, which the caller uses: an
        uninterrupted run and a resumed one then see the very same values.
        """
        rows = []
        for position, sequence, value in zip(positions, sequences, values):
            index = first + int(position)
            if index in self._answers:  # the boundary asks only for missing answers: a bug otherwise
                raise RuntimeError(f"query {index} is already in the transcript")
            if self.high_precision and not isinstance(value, mpmath.mpf):
                raise TypeError(f"a high-precision transcript stores mpf answers, got {type(value).__name__}")
            answer = self._encode(value)
            token_hash = tokens_sha256(sequence)
            rows.append((index, len(sequence), token_hash, answer, _row_checksum(index, len(sequence), token_hash, answer)))
        try:
            self._insert(rows)
        except sqlite3.Error as error:
            failure = self._storage_error(f"could not store the answers to queries {rows[0][0]}..{rows[-1][0]}", error)
            failure.unsaved = {index: self._decode(answer) for index, _, _, answer, _ in rows}  # never lost
            raise failure from error
        stored = []
        for index, length, token_hash, answer, _ in rows:
            stored.append(self._decode(answer))
            self._answers[index] = (length, token_hash, stored[-1])
        return stored

    def _insert(self, rows) -> None:
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        try:
            connection.executemany("INSERT INTO queries VALUES (?, ?, ?, ?, ?)", rows)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def recorded(self, index: int):
        """``(length, tokens_sha256, answer)`` recorded for query ``index``, or None."""
        return self._answers.get(index)

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> "Transcript":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Transcript({self.path!r}, {self.answered} of {self.fingerprint['queries']} answered)"
