"""Query vectors and sequences: exact token grids, random bases, random sequences, padding, the
copies-instances of the grid and targeted schedules built on demand, and the targeted schedules'
kept sample of them (:class:`KeptQueries`).

Everything that makes tokens for the oracle draws them here, so that every schedule, the
refinement, the verification and the baselines share one definition of "a random query".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

#: Query vectors are rounded to this many significant bits, so that every sum and difference a
#: schedule forms (``x - z``, ``x_0 + x_i``, ``z_0 + z_j``) is exact in float64 and the learner
#: knows exactly which tokens the oracle saw, in any precision (docs/algorithm.md, 'Numerics in float64 and the token
#: scale').
TOKEN_BITS = 40


def quantize(values: np.ndarray, scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """Round to multiples of ``2**(e + 2 - TOKEN_BITS)`` where ``2**e >= scale``: sums stay exact.
    ``out`` (``values`` itself allowed): written there, with the same bits."""
    step = 2.0 ** (np.ceil(np.log2(scale)) + 2 - TOKEN_BITS)
    if out is None:
        return np.round(values / step) * step
    np.divide(values, step, out=out)
    np.round(out, out=out)
    return np.multiply(out, step, out=out)


def random_basis(rng: np.random.Generator, d: int, scale: float) -> np.ndarray:
    """A random orthogonal matrix (Haar) times ``scale``, rounded to ``TOKEN_BITS`` bits."""
    gaussian = rng.standard_normal((d, d))
    q, r = np.linalg.qr(gaussian)
    q = q * np.sign(np.diag(r))  # makes the distribution Haar
    return quantize(scale * q, scale)


def one_token_queries(basis: np.ndarray) -> list[np.ndarray]:
    """The one-token sequences ``(b)`` for each column ``b`` of ``basis`` (they measure ``vbar^T b``)."""
    return [b[None, :] for b in basis.T]


def random_queries(rng: np.random.Generator, count: int, d: int, token_scale: float,
                   lengths: tuple[int, int], spread: float = 0.0, bound: float | None = None) -> list[np.ndarray]:
    """``count`` sequences, lengths uniform in ``lengths`` (inclusive), i.i.d. Gaussian tokens
    ``N(0, I/d)`` times a per-sequence scale ``token_scale * 2**u``, ``u`` uniform in
    ``[-spread, spread]`` (token norms about ``token_scale``); with ``bound``, a token of larger norm
    scaled onto it (an oracle that answers only tokens inside a ball, :func:`bounded`)."""
    low, high = int(lengths[0]), int(lengths[1])
    if low < 1 or high < low:
        raise ValueError(f"lengths must satisfy 1 <= low <= high, got {lengths}")
    count = int(count)
    sizes = rng.integers(low, high + 1, size=count)
    scales = token_scale * (2.0 ** rng.uniform(-spread, spread, size=count) if spread else np.ones(count))
    return [bounded(rng.standard_normal((int(n), d)) * (s / np.sqrt(d)), bound) for n, s in zip(sizes, scales)]


def bounded(tokens: np.ndarray, bound: float | None) -> np.ndarray:
    """``tokens`` (rows) with each row of norm above ``bound`` scaled onto it (None: unchanged). An oracle
    declaring ``token_bound`` answers only tokens of smaller norm: the attention behind a norm, whose
    tokens fill a ball (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block')."""
    if bound is None:
        return tokens
    norms = np.sqrt((tokens * tokens).sum(axis=-1, keepdims=True))
    return np.where(norms > bound, tokens * (bound / np.maximum(norms, 1e-300)), tokens)


def padded(sequences) -> tuple[np.ndarray, np.ndarray]:
    """Sequences right-aligned in one array (Q, N_max, d), zero-padded at the front, so the final
    token of every query is at ``[:, -1]``; and the mask of real tokens (Q, N_max)."""
    longest = max(len(sequence) for sequence in sequences)
    d = np.asarray(sequences[0]).shape[1]
    tokens = np.zeros((len(sequences), longest, d))
    mask = np.zeros((len(sequences), longest), dtype=bool)
    for q, sequence in enumerate(sequences):
        tokens[q, longest - len(sequence):] = sequence
        mask[q, longest - len(sequence):] = True
    return tokens, mask


@dataclass(frozen=True)
class Instance:
    """One copies-instance: ``k`` copies of ``y = final - difference``, then ``final``.

    ``role`` is ``"grid"``, ``"row_link"`` or ``"column_link"`` (the grid schedules, docs/algorithm.md
    'One instance: copies of a token and a rational function'), or ``"repair"`` (asked by the certificate repair,
    'Certificate repair: failed instances measured again with their poles pulled apart'); ``(i, j)`` are grid indices
    (row link ``j`` has ``i = 0``; -1 for a repair). ``ks`` are the copy counts actually queried.
    """

    role: str
    i: int
    j: int
    final: np.ndarray
    difference: np.ndarray
    ks: tuple[int, ...]

    def sequence(self, k: int) -> np.ndarray:
        """The query ``(y, ..., y, x)`` with ``k`` copies of ``y``: shape (k + 1, d)."""
        return copies_sequences(self.final[None, :], self.difference[None, :], np.zeros(1, dtype=int), [k])[0]


def copies_block(finals: np.ndarray, differences: np.ndarray, k: int) -> np.ndarray:
    """(n, k + 1, d): for each row, k copies of ``y = x - z`` then ``x`` (``x`` a row of ``finals``,
    ``z`` of ``differences``), written once: the layout every copies-instance query is built in."""
    block = np.empty((len(finals), int(k) + 1, finals.shape[-1]), dtype=np.result_type(finals, differences))
    np.subtract(finals, differences, out=block[:, 0])
    block[:, 1:k] = block[:, :1]
    block[:, k] = finals
    return block


class CopiesRows:
    """Copies-instance queries as their rows: query ``(y, .., y, x)`` held as ``(x, z)`` and its copy
    count k, not as its ``k + 1`` tokens. ``segments``: ``(finals, differences, k)`` (rows (n, d),
    (n, d)), in order.

    What the boundary hands an oracle that builds the sequences itself (``takes_copies_rows`` true:
    :class:`~mhaextract.adapters.torch.TorchOracle` on its device,
    :class:`~mhaextract.oracle.parallel.ParallelOracle` for its workers), so that no one writes a
    batch's tokens on the host only to read two rows a query back. Iterating it builds the
    sequences (:func:`copies_block`'s, bit for bit). The rows may be views of the learner's
    arrays: an oracle reads them and keeps or changes nothing of them.

    Examples
    --------
    >>> import numpy as np
    >>> rows = CopiesRows([(np.ones((2, 3)), np.zeros((2, 3)), 2), (np.ones((1, 3)), np.ones((1, 3)), 0)])
    >>> len(rows), rows.lengths(), [sequence.shape for sequence in rows]
    (3, array([3, 3, 1]), [(3, 3), (3, 3), (1, 3)])
    """

    def __init__(self, segments):
        self.segments = [(finals, differences, int(k)) for finals, differences, k in segments]

    def __len__(self) -> int:
        return sum(len(finals) for finals, _, _ in self.segments)

    def lengths(self) -> np.ndarray:
        """Tokens of each query, ``k + 1``, in order."""
        return np.concatenate([np.full(len(finals), k + 1, dtype=np.int64) for finals, _, k in self.segments]
                              or [np.empty(0, dtype=np.int64)])

    def share(self, start: int, stop: int) -> list:
        """The segments of queries ``start .. stop - 1``: views of their rows (whoever sends them
        copies them once, into Ray's store or a shared block)."""
        out, offset = [], 0
        for finals, differences, k in self.segments:
            first, last = max(start - offset, 0), min(stop - offset, len(finals))
            if first < last:
                out.append((finals[first:last], differences[first:last], k))
            offset += len(finals)
        return out

    def sequences(self) -> "CopiesBatch":
        """The queries' sequences, as a list (:class:`CopiesBatch`)."""
        return CopiesBatch(self.segments)

    def __iter__(self):
        return iter(self.sequences())


class CopiesBatch(list):
    """A batch of copies-instance queries as the oracle receives it: a list of (k + 1, d) arrays,
    :func:`copies_block`'s sequences of ``segments`` in order, each segment ``(finals, differences,
    k)`` (rows (n, d), (n, d)).

    To the oracle it is a list like any other. It also keeps what it was built from, two rows per
    query where the tokens are ``k + 1`` (``rows``, a :class:`CopiesRows`):
    :class:`~mhaextract.oracle.parallel.ParallelOracle` sends those to its workers, which build the
    same sequences bit for bit (the same :func:`copies_block` on the same rows).

    Examples
    --------
    >>> import numpy as np
    >>> batch = CopiesBatch([(np.ones((2, 3)), np.zeros((2, 3)), 2)])
    >>> len(batch), batch[0].shape, len(batch.rows)
    (2, (3, 3), 2)
    """

    def __init__(self, segments):
        self.rows = segments if isinstance(segments, CopiesRows) else CopiesRows(segments)
        self.segments = self.rows.segments
        super().__init__(sequence for finals, differences, k in self.segments
                         for sequence in copies_block(finals, differences, k))

    def intact(self) -> bool:
        """Whether the list still holds exactly its segments' sequences (no one appended or removed)."""
        return len(self) == len(self.rows)


def rows_of(batch) -> CopiesRows | None:
    """The rows of a batch of copies-instances: a :class:`CopiesRows` itself, an intact
    :class:`CopiesBatch`'s; None for any other batch (whose sequences are what it holds)."""
    if isinstance(batch, CopiesRows):
        return batch
    if isinstance(batch, CopiesBatch) and batch.intact():
        return batch.rows
    return None


def copies_sequences(finals: np.ndarray, differences: np.ndarray, which, copies) -> list[np.ndarray]:
    """Query ``q`` is ``(y, ..., y, x)`` with ``copies[q]`` copies of ``y = x - difference``,
    ``x = finals[which[q]]``, ``difference = differences[which[q]]`` (rows): the sequences of
    :meth:`Instance.sequence`, built as one array per length (each query a contiguous view)."""
    finals, differences = np.asarray(finals), np.asarray(differences)
    which, copies = np.asarray(which, dtype=int), np.asarray(copies, dtype=int)
    out: list[np.ndarray] = [None] * len(copies)  # type: ignore[list-item]
    for k in np.unique(copies):
        positions = np.flatnonzero(copies == k)
        block = copies_block(finals[which[positions]], differences[which[positions]], int(k))
        for position, sequence in zip(positions.tolist(), block):
            out[position] = sequence
    return out


#: Queries built at once when a :class:`CopiesQueries` is iterated.
BUILD_CHUNK = 4096


class CopiesQueries(Sequence):
    """The queries of copies-instances, built on demand: query ``q`` is :func:`copies_sequences`'s
    ``(y, ..., y, x)`` with ``copies[q]`` copies of ``y = x - difference``, ``x = finals[final_of[t]]``,
    ``difference = differences[difference_of[t]]``, ``t = which[q]``.

    A sequence of (N, d) arrays like a list (``len``, indexing, slicing, iteration; every access
    builds fresh arrays, bit for bit those of :func:`copies_sequences`), but it holds one row per
    instance, not every query's tokens: a grid run asks its queries batch by batch from it, and
    :meth:`outputs` evaluates a model on all of them from the instances.
    """

    #: Every access builds new arrays: a batch taken from it may go to the oracle without a copy
    #: (:class:`mhaextract.oracle.boundary.OracleBoundary`).
    fresh_on_access = True

    def __init__(self, finals: np.ndarray, final_of, differences: np.ndarray, which, copies, difference_of=None):
        self.finals = np.asarray(finals, dtype=np.float64)  # (U, d) distinct final tokens
        self.final_of = np.asarray(final_of, dtype=int)  # (n,) instance -> row of finals
        self.differences = np.asarray(differences, dtype=np.float64)  # (V, d) difference rows
        self.which = np.asarray(which, dtype=int)  # (Q,) query -> instance
        self.copies = np.asarray(copies, dtype=int)  # (Q,)
        #: (n,) instance -> row of differences (one row per instance when not given)
        self.difference_of = (np.arange(len(self.differences)) if difference_of is None
                              else np.asarray(difference_of, dtype=int))

    def __len__(self) -> int:
        return len(self.copies)

    def _build(self, which: np.ndarray, copies: np.ndarray) -> list[np.ndarray]:
        instances, local = np.unique(which, return_inverse=True)  # only the instances these queries need
        return copies_sequences(self.finals[self.final_of[instances]], self.differences[self.difference_of[instances]],
                                np.asarray(local).ravel(), copies)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._build(self.which[key], self.copies[key])
        index = range(len(self))[key]  # an int, negative allowed, IndexError past the end
        return self._build(self.which[index:index + 1], self.copies[index:index + 1])[0]

    def __iter__(self):
        for start in range(0, len(self), BUILD_CHUNK):
            yield from self[start:start + BUILD_CHUNK]

    def __add__(self, other):
        """Concatenation: another CopiesQueries stays one (lean's fallback links), else a list."""
        if not isinstance(other, CopiesQueries):
            return list(self) + list(other)
        finals = np.concatenate([self.finals, other.finals])
        return CopiesQueries(finals, np.concatenate([self.final_of, other.final_of + len(self.finals)]),
                             np.concatenate([self.differences, other.differences]),
                             np.concatenate([self.which, other.which + len(self.final_of)]),
                             np.concatenate([self.copies, other.copies]),
                             np.concatenate([self.difference_of, other.difference_of + len(self.differences)]))

    def __radd__(self, other):
        return list(other) + list(self)

    def outputs(self, model) -> np.ndarray:
        """``model`` (float64) on every query, from the instances: ``W_h x + u_h`` once per final
        token, the scores and values of ``x`` and ``y`` once per instance, then per query the
        softmax of ``k`` equal scores and one: ``sum_h (k e_y v_h^T y + e_x v_h^T x) / (k e_y + e_x)``.
        The outputs of ``model(list(self))`` to rounding (the k equal terms are summed as one product)."""
        return model.copies_outputs(self.finals, self.final_of, self.differences[self.difference_of], self.which,
                                    self.copies)


class RoundQueries(Sequence):
    """The queries of a block of targeted rounds (docs/algorithm.md, 'The targeted schedule'), built on demand: round
    by round, each of the round's copy counts k in turn, unit by unit, the copies-instance
    ``(y, ..., y, x)`` with k copies of ``y = x - differences[u]``, ``x = finals[u, n]``.

    ``finals`` (U, R, d) (a view is fine: nothing is copied until asked), ``differences`` (U, d),
    ``copies`` R tuples: round n's copy counts. The tokens are :func:`copies_block`'s, those of
    :func:`copies_sequences` bit for bit; the layout differs (every unit asked in every round, instance i of a query read
    from its position), which is what lets a whole block of rounds be one ask: one oracle call per
    boundary batch instead of one per round and copy count, and only a batch's tokens built at a
    time (a block's would be ``U R (k + 1) d`` floats). Every access builds new arrays, so a batch
    goes to the oracle without the boundary's copy (:class:`mhaextract.oracle.boundary.OracleBoundary`).
    """

    fresh_on_access = True

    def __init__(self, finals: np.ndarray, differences: np.ndarray, copies):
        self.finals, self.differences = finals, differences
        self.units = finals.shape[0]
        #: (round, copy count) of each run of ``units`` consecutive queries
        self.segments = [(n, int(k)) for n, ks in enumerate(copies) for k in ks]

    def __len__(self) -> int:
        return len(self.segments) * self.units

    def _build(self, start: int, stop: int, step: int = 1) -> CopiesBatch:
        """Queries ``start, start + step, ..`` below ``stop`` (step > 0), a block per (round, k)."""
        return CopiesBatch(self.copies_rows(start, stop, step))

    def copies_rows(self, start: int, stop: int, step: int = 1) -> CopiesRows:
        """:meth:`_build`'s queries as their rows, no sequence built (:class:`CopiesRows`; the boundary
        hands them so to an oracle with ``takes_copies_rows``)."""
        segments = []
        U = self.units
        for segment in range(start // U, (stop - 1) // U + 1):
            n, k = self.segments[segment]
            base = segment * U
            first = max(start, base)
            first += (start - first) % step  # the next query of the slice in this segment
            rows = slice(first - base, min(stop, base + U) - base, step)
            segments.append((self.finals[rows, n], self.differences[rows], k))
        return CopiesRows(segments)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step < 0:
                return [self[i] for i in range(start, stop, step)]
            return self._build(start, stop, step) if stop > start else []
        index = range(len(self))[key]  # an int, negative allowed, IndexError past the end
        return self._build(index, index + 1)[0]

    def __iter__(self):
        for start in range(0, len(self), BUILD_CHUNK):
            yield from self[start:start + BUILD_CHUNK]

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(finals, differences, copies)`` of the queries at ``positions`` (ascending, in range):
        query ``p`` is ``copies[p]`` copies of ``finals[p] - differences[p]``, then ``finals[p]``."""
        positions = np.asarray(positions, dtype=int)
        segment, row = np.divmod(positions, self.units)
        rounds_and_copies = np.array(self.segments, dtype=int).reshape(-1, 2)[segment]
        return (np.asarray(self.finals[row, rounds_and_copies[:, 0]], dtype=np.float64),
                np.asarray(self.differences[row], dtype=np.float64), rounds_and_copies[:, 1])


class KeptQueries(Sequence):
    """A sample of a run's queries kept with their answers (the targeted schedules' residual sample,
    docs/algorithm.md, 'Memory'), in the order asked: copies-instances as their rows
    ``(final, difference, k)`` (:meth:`RoundQueries.rows`), other queries as arrays. Indexing builds
    the sequences (those of :func:`copies_block`, bit for bit); :meth:`outputs` evaluates a model on
    the copies rows from the rows (:meth:`~mhaextract.models.attention.MultiHeadAttention.copies_outputs`,
    O(H d) a query, a fifth of a model call's time per query at d = 64)."""

    def __init__(self):
        self._arrays: list[np.ndarray] = []
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (finals, differences, copies) blocks
        #: per kept query: ``r >= 0`` the copies row r, ``-1 - a`` the array a; a list of blocks until joined
        self._source: list[np.ndarray] = []

    def keep(self, sequences, positions: range) -> None:
        """Keep the queries ``positions`` (a range) of ``sequences``: a :class:`RoundQueries`' as
        rows, any other's as copies of their arrays."""
        if not len(positions):
            return
        if isinstance(sequences, RoundQueries):
            block = sequences.rows(np.asarray(positions))
            first = sum(len(copies) for _, _, copies in self._rows)
            self._rows.append(block)
            self._source.append(np.arange(first, first + len(block[2])))
        else:
            first = len(self._arrays)
            self._arrays.extend(np.array(sequence) for sequence in sequences[positions.start:positions.stop:positions.step])
            self._source.append(-1 - np.arange(first, len(self._arrays)))

    def _joined(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """(the source of every kept query, the copies rows joined), joined once and kept joined."""
        if len(self._source) != 1:
            self._source = [np.concatenate(self._source) if self._source else np.zeros(0, dtype=int)]
        if len(self._rows) > 1:
            self._rows = [tuple(np.concatenate(part) for part in zip(*self._rows))]
        return self._source[0], (self._rows[0] if self._rows else None)

    def __len__(self) -> int:
        return sum(map(len, self._source))

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self[n] for n in range(len(self))[key]]
        n = range(len(self))[key]  # an int, negative allowed, IndexError past the end
        source, rows = self._joined()
        where = int(source[n])
        if where < 0:
            return self._arrays[-1 - where]
        finals, differences, copies = rows
        return copies_block(finals[where:where + 1], differences[where:where + 1], int(copies[where]))[0]

    def outputs(self, model) -> np.ndarray:
        """``model`` (float64) on every kept query: ``model(list(self))`` to rounding."""
        source, rows = self._joined()
        out = np.empty(len(source))
        plain = source < 0
        if plain.any():
            out[plain] = model([self._arrays[-1 - where] for where in source[plain]])
        if rows is not None:
            finals, differences, copies = rows
            index = np.arange(len(copies))
            out[~plain] = model.copies_outputs(finals, index, differences, index, copies)[source[~plain]]
        return out


@dataclass(frozen=True)
class Rows:
    """The rows ``source[index]`` of a table of tokens, named without gathering them: an
    :meth:`InstanceTable.add` whose 2 d^2 instances share d final tokens and d differences keeps
    those rows once (a grid run at d = 128 wrote and then joined 2 x 33 MB of repeated rows, a third
    of its learner)."""

    source: np.ndarray
    index: np.ndarray


def _rows(tokens, count: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows (m, d), row of each of ``count`` instances) of :class:`Rows` or an array (count, d)."""
    if isinstance(tokens, Rows):
        return np.asarray(tokens.source, dtype=np.float64).reshape(-1, d), np.asarray(tokens.index, dtype=int).ravel()
    return np.asarray(tokens, dtype=np.float64).reshape(count, d), np.arange(count)


class _Block(NamedTuple):
    """Instances added at once (:meth:`InstanceTable.add`): their role, grid indices, copy counts and
    tokens as distinct rows with each instance's row among them."""

    role: str
    i: np.ndarray
    j: np.ndarray
    final_rows: np.ndarray
    final_of: np.ndarray
    difference_rows: np.ndarray
    difference_of: np.ndarray
    ks: tuple[int, ...]

    def instance(self, row: int) -> Instance:
        return Instance(self.role, int(self.i[row]), int(self.j[row]), self.final_rows[self.final_of[row]],
                        self.difference_rows[self.difference_of[row]], self.ks)


class InstanceTable(Sequence):
    """Copies-instances held as arrays in query order (the grid schedules' ``instances``): :attr:`role`,
    :attr:`i`, :attr:`j` per instance, and their tokens and copy counts. Indexing (or iterating) gives
    :class:`Instance` records like a list of them; instances are added in blocks that share their
    role and copy counts (:meth:`add`), whose tokens may be :class:`Rows` of a few distinct ones:
    those are kept once, not per instance, and :meth:`queries` names them the same way."""

    def __init__(self, d: int):
        self.d = int(d)
        self._blocks: list[_Block] = []
        self._starts = [0]
        self._arrays: dict | None = None

    def add(self, role: str, i, j, finals, differences, ks: tuple[int, ...]) -> np.ndarray:
        """Append instances ``(i[n], j[n])`` with final ``finals[n]`` and difference ``differences[n]``
        (rows (n, d), or :class:`Rows`), all of ``role`` asking the copy counts ``ks``; returns their
        indices."""
        i, j = np.asarray(i, dtype=int).ravel(), np.asarray(j, dtype=int).ravel()
        final_rows, final_of = _rows(finals, len(i), self.d)
        difference_rows, difference_of = _rows(differences, len(i), self.d)
        if len(final_of) != len(i) or len(difference_of) != len(i):
            raise ValueError(f"{len(i)} instances need as many finals and differences, got {len(final_of)} "
                             f"and {len(difference_of)}")
        start = self._starts[-1]
        self._blocks.append(_Block(role, i, j, final_rows, final_of, difference_rows, difference_of, tuple(ks)))
        self._starts.append(start + len(i))
        self._arrays = None
        return np.arange(start, start + len(i))

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def _joined(self) -> dict:
        if self._arrays is None:
            blocks, sizes = self._blocks, [len(block.i) for block in self._blocks]
            present = [block.role for block, size in zip(blocks, sizes) if size]  # (the dtype of the roles asked)

            def stacked(rows, of):  # the blocks' distinct rows, and each instance's row among them
                offsets = np.cumsum([0] + [len(getattr(block, rows)) for block in blocks])
                return (np.concatenate([getattr(block, rows) for block in blocks] or [np.zeros((0, self.d))]),
                        np.concatenate([getattr(block, of) + offset for block, offset in zip(blocks, offsets)]
                                       or [np.zeros(0, dtype=int)]))

            final_rows, final_of = stacked("final_rows", "final_of")
            difference_rows, difference_of = stacked("difference_rows", "difference_of")
            self._arrays = dict(
                role=np.array(present)[np.repeat(np.arange(len(present)), [size for size in sizes if size])]
                if present else np.array([], dtype=str),
                i=np.concatenate([block.i for block in blocks] or [np.zeros(0, dtype=int)]),
                j=np.concatenate([block.j for block in blocks] or [np.zeros(0, dtype=int)]),
                final_rows=final_rows, final_of=final_of, difference_rows=difference_rows, difference_of=difference_of,
                block=np.repeat(np.arange(len(blocks)), sizes).astype(int))
        return self._arrays

    @property
    def role(self) -> np.ndarray:
        return self._joined["role"]

    @property
    def i(self) -> np.ndarray:
        return self._joined["i"]

    @property
    def j(self) -> np.ndarray:
        return self._joined["j"]

    def queries(self, indices) -> tuple[CopiesQueries, np.ndarray, np.ndarray]:
        """The queries of instances ``indices``, each asking its copy counts in order: (sequences built
        on demand, instance index of each query, copy count of each query)."""
        indices = np.asarray(indices, dtype=int).ravel()
        ks = [np.asarray(block.ks, dtype=int) for block in self._blocks]
        table = np.zeros((max(len(ks), 1), max((len(k) for k in ks), default=0)), dtype=int)  # block -> its ks
        for b, k in enumerate(ks):
            table[b, :len(k)] = k
        blocks = self._joined["block"][indices]
        counts = np.array([len(k) for k in ks] or [0], dtype=int)[blocks]
        which = np.repeat(np.arange(len(indices)), counts)
        within = np.arange(len(which)) - np.repeat(np.cumsum(counts) - counts, counts)  # position in its ks
        copies = table[blocks[which], within]
        joined = self._joined
        sequences = CopiesQueries(joined["final_rows"], joined["final_of"][indices], joined["difference_rows"], which,
                                  copies, joined["difference_of"][indices])
        return sequences, indices[which], copies

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[n] for n in range(len(self))[index]]
        n = range(len(self))[index]
        block = int(np.searchsorted(self._starts, n, side="right")) - 1
        return self._blocks[block].instance(n - self._starts[block])

    def __iter__(self):
        for block in self._blocks:
            for row in range(len(block.i)):
                yield block.instance(row)
