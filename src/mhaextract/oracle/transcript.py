"""A run's transcript: every paid query and its answer in SQLite, so that no answer is ever paid twice.

An extraction asks ``4 H0 d^2 - 2 H0 + 1`` queries of an oracle that may be slow, remote or
metered, and with ``token_scale="auto"`` (the defaults) 147 calibration probes before them. With
``extract(..., transcript="run.sqlite")`` every :class:`~mhaextract.oracle.boundary.OracleBoundary`
of the run commits each batch of answers to the file as it arrives; a run that stops (an
exception, Ctrl-C, SIGKILL, a budget) loses at most the batch in flight. Re-running with the same
transcript and seed reads the recorded answers back and asks the oracle only for the missing
ones. The learner sees the same answers either way, so a resumed run makes the same decisions
(the same token scale to the bit) and returns the same result bit for bit, whatever the oracle's
noise.

**Sections.** The answers are kept in sections, each numbered from 0 in the order its queries
are asked:

* ``"calibration"``: the token-scale probes (:mod:`mhaextract.run.calibration`), which depend only on
  ``d``, the seed and the precision, so they are recorded before the run's plan exists;
* ``"run"``: the schedule's queries and every query after them (noise probe, polish, repair),
  whose plan depends on the calibrated scale;
* ``"vector"``: the queries of the split of whole answers (:mod:`mhaextract.vector`),
  tried before the schedule when the answers are whole vectors;
* ``"norm"``: the queries of the attention sublayer of a pre-norm block (:mod:`mhaextract.norm`), named
  (``norm=``) or run after a failed ``"auto"`` run whose answers showed a norm before the attention.

What makes that safe:

* **Header.** The file records what the run is before any query: ``d``, ``H0``, ``seed``,
  ``precision``, the schedule's name, bias, rank and the token scale (``"auto"`` or its exact
  hex). A run that differs in any of them is refused with a :class:`TranscriptError` listing the
  differences; the file is not touched.
* **Run fingerprint.** Once the token scale is known (:meth:`Transcript.start_run`): the scale
  (exact hex) and the SHA-256 of every query the schedule fixes in advance. Recorded with the
  run's first answers; a run that differs is refused. It is written only after a complete
  calibration, so a file that holds one is refused before anything is asked.
* **Per query.** Row ``(section, id)`` holds the query's length, the SHA-256 of its tokens
  (checked against the query being asked before an answer is replayed) and a checksum of the
  row. Adaptive queries (the lean schedule's fallback links, which depend on earlier answers)
  are not in the fingerprint's hash; this per-row check covers them.
* **Exact answers.** float64 answers are stored as ``float.hex`` and high-precision answers as
  ``mpf`` mantissa/exponent (:func:`mhaextract.numerics.highprec.mpf_to_hex`); a vector answer
  (an oracle with ``d_out`` outputs) as its ``d_out`` entries, comma-separated in brackets. All
  read back bit for bit; ``d_out`` is fixed for a transcript.
* **Never overwritten.** An existing file is validated through a read-only connection first.
  Anything unexpected (not SQLite, damaged pages, missing tables, a bad checksum, an answer
  that does not parse, the layout of an older mhaextract) raises :class:`TranscriptError` and
  leaves the file as it was. Rows are only ever inserted, never updated.
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
FORMAT = 2
#: The sections of a transcript (module docstring).
CALIBRATION, RUN, VECTOR, NORM = "calibration", "run", "vector", "norm"
SECTIONS = (CALIBRATION, RUN, VECTOR, NORM)


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


def _identity(schedule, seed: int, precision: int | None) -> dict:
    return {"d": schedule.d, "max_heads": schedule.max_heads, "seed": seed, "precision": precision,
            "schedule": schedule.name}


def run_header(schedule, seed: int, precision: int | None, calibrated: bool) -> dict:
    """What identifies a run before any query (the file's header): ``schedule`` is the plan built
    from the run's settings; ``calibrated``: the token scale is found by probes (``"auto"``)."""
    settings = schedule.settings
    return _identity(schedule, seed, precision) | {
        "bias": bool(settings.bias),
        "rank": None if settings.rank is None else str(settings.rank),
        "token_scale": "auto" if calibrated else float(schedule.token_scale).hex(),
    }


def run_fingerprint(schedule, seed: int, precision: int | None, sequences: Sequence[np.ndarray]) -> dict:
    """What identifies a run's section: the parameters that determine its queries and answers.

    ``queries_sha256`` hashes every query's tokens in order, so a schedule that changes in any
    way (another version of the code, another scale) is caught even when the parameters agree.
    """
    everything = hashlib.sha256()
    for sequence in sequences:
        everything.update(tokens_sha256(sequence).encode())
    return _identity(schedule, seed, precision) | {
        "token_scale": float(schedule.token_scale).hex(),
        "queries": len(sequences),
        "queries_sha256": everything.hexdigest(),
    }


def _row_checksum(section: str, index: int, length: int, token_hash: str, answer: str) -> str:
    return hashlib.sha256(f"{section}:{index}:{length}:{token_hash}:{answer}".encode()).hexdigest()[:32]


def _differences(recorded: dict, current: dict) -> list[str]:
    return [f"{key}: transcript {recorded.get(key)!r}, this run {current[key]!r}"
            for key in current if recorded.get(key) != current[key]]


class Transcript:
    """The SQLite transcript of one run (see the module docstring).

    Parameters
    ----------
    path : file to create, or to resume from.
    header : dict from :func:`run_header` (any JSON dict naming the run); an existing file must
        carry the same one.

    Attributes
    ----------
    path : str
    created : bool, whether this run created the file.
    fingerprint : the run section's fingerprint once :meth:`start_run` was called (or recorded), else None.
    d_out : None for scalar answers (or none yet), else the length of every vector answer.
    """

    def __init__(self, path, header: dict):
        self.path = os.fspath(path)
        self.header = dict(header)
        self.high_precision = header.get("precision") is not None
        self.fingerprint: dict | None = None
        self.d_out: int | None = None
        self._shape_recorded = False
        self._started = False
        self._answers: dict[str, dict[int, tuple[int, str, object]]] = {name: {} for name in SECTIONS}
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
                self._check_format(meta)
                rows = connection.execute(
                    "SELECT section, id, length, tokens_sha256, answer, checksum FROM queries").fetchall()
            finally:
                connection.close()
        except sqlite3.DatabaseError as error:
            raise self._refuse(f"is not a readable SQLite database ({error})") from None
        recorded = self._json(meta, "header")
        differences = _differences(recorded, self.header)
        if differences:
            raise self._refuse("was recorded by a different run (" + "; ".join(differences) + ")")
        if "fingerprint" in meta:
            self.fingerprint = self._json(meta, "fingerprint")
        shape = meta.get("answer_shape")
        if shape is not None:
            kind, _, size = shape.partition(" ")
            if kind not in ("scalar", "vector") or (kind == "vector" and not (size.isdigit() and int(size) >= 1)):
                raise self._refuse(f"is corrupt: its answer shape {shape!r} does not parse")
            self.d_out, self._shape_recorded = (int(size) if kind == "vector" else None), True
        for section, index, length, token_hash, answer, checksum in rows:
            if not (section in SECTIONS and isinstance(index, int) and index >= 0 and isinstance(length, int)
                    and isinstance(token_hash, str) and isinstance(answer, str)
                    and checksum == _row_checksum(section, index, length, token_hash, answer)):
                raise self._refuse(f"is corrupt: the row of query {index} ({section}) fails its checksum")
            try:
                value = self._decode(answer)
            except ValueError:
                raise self._refuse(f"is corrupt: the answer to query {index} ({section}) does not parse "
                                   f"({answer!r})") from None
            self._answers[section][index] = (length, token_hash, value)
        if self._answers[RUN] and self.fingerprint is None:
            raise self._refuse("is corrupt: it holds answers of the run but not the run's fingerprint")

    def _check_format(self, meta: dict) -> None:
        version = meta.get("format")
        if version is None and "fingerprint" in meta and "header" not in meta:
            raise self._refuse(
                "was written by an earlier mhaextract (transcript format 1, whose calibration probes were not "
                "recorded); this version cannot resume it. Finish that run with the mhaextract that started it, "
                "or start a new transcript; its answers stay readable with sqlite3 (table queries)")
        if version != str(FORMAT):
            raise self._refuse(f"has transcript format {version!r}; this mhaextract reads format {FORMAT}")

    def _json(self, meta: dict, key: str) -> dict:
        try:
            value = json.loads(meta[key])
        except (KeyError, TypeError, ValueError):
            raise self._refuse(f"has no readable {key}") from None
        if not isinstance(value, dict):
            raise self._refuse(f"has no readable {key}")
        return value

    def _decode_number(self, text: str):
        if self.high_precision:
            return mpf_from_hex(text)
        value = float.fromhex(text)
        if not np.isfinite(value):
            raise ValueError(text)
        return value

    def _decode(self, answer: str):
        """A stored answer: a float (an mpf in high precision), or for a vector answer a (d_out,)
        float64 array (object array of mpf in high precision)."""
        if not answer.startswith("["):
            if self.d_out is not None:
                raise ValueError(answer)
            return self._decode_number(answer)
        if not answer.endswith("]") or self.d_out is None:
            raise ValueError(answer)
        entries = [self._decode_number(text) for text in answer[1:-1].split(",")]
        if len(entries) != self.d_out:
            raise ValueError(answer)
        return np.array(entries, dtype=object if self.high_precision else np.float64)

    def _encode_number(self, value) -> str:
        return mpf_to_hex(value) if self.high_precision else float(value).hex()

    def _encode(self, value) -> str:
        if self.d_out is None:
            return self._encode_number(value)
        return "[" + ",".join(self._encode_number(entry) for entry in value) + "]"

    @property
    def answered(self) -> int:
        """The number of answers in the file, every section."""
        return sum(len(answers) for answers in self._answers.values())

    def answered_in(self, section: str) -> int:
        """The number of answers recorded in ``section``."""
        return len(self._answers[section])

    @property
    def resumed(self) -> bool:
        """The file held answers when it was opened (an earlier run's)."""
        return not self.created and self.answered > 0

    def replay(self, first: int, sequences: Sequence[np.ndarray], section: str = RUN) -> dict[int, object]:
        """Recorded answers for queries ``first, first + 1, ...`` (``sequences``) of ``section``, by position.

        Each answer is returned only after the recorded hash of its query's tokens matched the
        query being asked now. The answers are exact: floats (``mpmath.mpf`` in high precision),
        or (d_out,) arrays of them for vector answers.
        """
        recorded, out = self._answers[section], {}
        for position, sequence in enumerate(sequences):
            entry = recorded.get(first + position)
            if entry is None:
                continue
            length, token_hash, value = entry
            if length != len(sequence) or token_hash != tokens_sha256(sequence):
                raise self._refuse(f"recorded another query as query {first + position} ({section})")
            out[position] = value
        return out

    def recorded(self, index: int, section: str = RUN):
        """``(length, tokens_sha256, answer)`` recorded for query ``index`` of ``section``, or None."""
        return self._answers[section].get(index)

    def section(self, name: str) -> "Section":
        """A view of one section with the interface an :class:`OracleBoundary` records through."""
        if name not in SECTIONS:
            raise ValueError(f"a transcript's sections are {SECTIONS}, got {name!r}")
        return Section(self, name)

    # ------------------------------------------------------------------ writing
    def _create(self) -> None:
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        connection.execute(
            "CREATE TABLE queries (section TEXT NOT NULL, id INTEGER NOT NULL, length INTEGER NOT NULL, "
            "tokens_sha256 TEXT NOT NULL, answer TEXT NOT NULL, checksum TEXT NOT NULL, PRIMARY KEY (section, id))"
        )
        connection.execute("INSERT INTO meta VALUES ('format', ?)", (str(FORMAT),))
        connection.execute("INSERT INTO meta VALUES ('header', ?)", (json.dumps(self.header),))
        connection.execute("INSERT INTO meta VALUES ('answer_encoding', ?)",
                           ("exact: float.hex (float64) or [-]0x<hex mantissa>p<exponent> (mpf); a vector answer "
                            "as [entry,entry,...]",))
        connection.execute("COMMIT")

    def start_run(self, fingerprint: dict) -> None:
        """The run section's identity, known once the token scale is: compared with the recorded
        one (a difference is refused, the file untouched), or recorded with the run's first answers."""
        fingerprint = dict(fingerprint)
        if self.fingerprint is not None:
            differences = _differences(self.fingerprint, fingerprint)
            if differences:
                raise self._refuse("was recorded by a different run (" + "; ".join(differences) + ")")
        self.fingerprint, self._started = fingerprint, True

    def _write_meta(self, key: str, value: str) -> None:
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        try:
            connection.execute("INSERT INTO meta VALUES (?, ?)", (key, value))
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def _answer_shape(self, values, count: int):
        """``values`` as one array ((n,) scalars or (n, d_out) vectors) after checking that its
        shape is the transcript's (the first answers fix it)."""
        array = np.asarray(values, dtype=object if self.high_precision else np.float64)
        if array.ndim not in (1, 2) or len(array) != count or (array.ndim == 2 and array.shape[1] < 1):
            raise TranscriptError(
                f"transcript {self.path!r} stores answers given as {count} scalars (shape ({count},)) or {count} "
                f"vectors (shape ({count}, d_out)); got shape {array.shape}", self.path)
        d_out = array.shape[1] if array.ndim == 2 else None
        if self._shape_recorded and d_out != self.d_out:
            def kind(size):
                return "scalar answers" if size is None else f"vector answers of length d_out = {size}"
            raise TranscriptError(
                f"transcript {self.path!r} holds {kind(self.d_out)}; this run's oracle gave {kind(d_out)}. The "
                "answers of one transcript have one shape: pass a new transcript path for this oracle", self.path)
        self.d_out = d_out
        return array

    def record(self, first: int, positions: Sequence[int], sequences: Sequence[np.ndarray], values,
               section: str = RUN) -> list:
        """Insert the answers to queries ``first + positions`` of ``section`` in one transaction
        (committed on return). ``values``: float64 answers, shape (n,), or vectors, shape (n, d_out)
        (``d_out`` fixed for the transcript; high precision: ``mpf``, likewise).

        Returns the answers as they read back from the file, which the caller uses: an
        uninterrupted run and a resumed one then see the very same values (floats, or (d_out,)
        float64 arrays for vectors, as :meth:`replay` returns them).
        """
        if section == RUN and not self._started:
            raise RuntimeError("the run section's fingerprint is not set: call start_run first")
        positions = list(positions)
        if self.high_precision:
            wrong = [entry for value in values for entry in np.atleast_1d(np.asarray(value, dtype=object))
                     if not isinstance(entry, mpmath.mpf)]
            if wrong:
                raise TypeError(f"a high-precision transcript stores mpf answers, got {type(wrong[0]).__name__}")
        array = self._answer_shape(values, len(positions))
        recorded, rows = self._answers[section], []
        for position, sequence, value in zip(positions, sequences, array):
            index = first + int(position)
            if index in recorded:  # the boundary asks only for missing answers: a bug otherwise
                raise RuntimeError(f"query {index} ({section}) is already in the transcript")
            answer = self._encode(value)
            token_hash = tokens_sha256(sequence)
            rows.append((section, index, len(sequence), token_hash, answer,
                         _row_checksum(section, index, len(sequence), token_hash, answer)))
        try:
            self._write_pending()
            self._insert(rows)
        except sqlite3.Error as error:
            failure = self._storage_error(
                f"could not store the answers to queries {rows[0][1]}..{rows[-1][1]} ({section})", error)
            failure.unsaved = {index: self._decode(answer) for _, index, _, _, answer, _ in rows}  # never lost
            raise failure from error
        stored = []
        for _, index, length, token_hash, answer, _ in rows:
            stored.append(self._decode(answer))
            recorded[index] = (length, token_hash, stored[-1])
        return stored

    def _write_pending(self) -> None:
        """With the first answers of their kind: the answers' shape, the run's fingerprint."""
        if not self._shape_recorded:
            self._write_meta("answer_shape", "scalar" if self.d_out is None else f"vector {self.d_out}")
            self._shape_recorded = True
        if self._started and not self._answers[RUN] and not self._fingerprint_recorded():
            self._write_meta("fingerprint", json.dumps(self.fingerprint))

    def _fingerprint_recorded(self) -> bool:
        return self._connection.execute("SELECT count(*) FROM meta WHERE key = 'fingerprint'").fetchone()[0] > 0

    def _insert(self, rows) -> None:
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        try:
            connection.executemany("INSERT INTO queries VALUES (?, ?, ?, ?, ?, ?)", rows)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> "Transcript":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        counts = ", ".join(f"{name} {len(self._answers[name])}" for name in SECTIONS)
        return f"Transcript({self.path!r}, answered: {counts})"


class Section:
    """One section of a :class:`Transcript`, as an :class:`OracleBoundary` uses it (``replay``,
    ``record``, ``recorded``, ``path``)."""

    def __init__(self, transcript: Transcript, name: str):
        self.transcript, self.name = transcript, name

    @property
    def path(self) -> str:
        return self.transcript.path

    @property
    def answered(self) -> int:
        return self.transcript.answered_in(self.name)

    def replay(self, first: int, sequences: Sequence[np.ndarray]) -> dict[int, object]:
        return self.transcript.replay(first, sequences, self.name)

    def record(self, first: int, positions: Sequence[int], sequences: Sequence[np.ndarray], values) -> list:
        return self.transcript.record(first, positions, sequences, values, self.name)

    def recorded(self, index: int):
        return self.transcript.recorded(index, self.name)

    def __repr__(self) -> str:
        return f"Section({self.name!r} of {self.transcript!r})"
