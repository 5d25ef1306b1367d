"""Vector answers at the oracle boundary: the read-out the schedules fit, and the sample the value fit uses.

A real layer answers ``d_out`` numbers per query (docs/algorithm.md §21). The ``d_out`` coordinates
share the scores, so they share ``(W_h, u_h)``; every schedule learns those from the scalar
``r^T f(X)`` for one read-out ``r`` (a random unit vector drawn from the run's seed; ``r = (1,)`` when
``d_out = 1``), asking exactly the queries of a scalar run. What the coordinates add is the value
read-outs ``V_h``, linear in the answers once the scores are known: :class:`VectorAnswers` keeps a
uniform sample of the queries and their whole answers for that fit (:mod:`mhaextract.outputs`),
with memory bounded by the sample's size whatever the number of queries.

The sample is the ``size`` run positions with the smallest keys ``splitmix64(position + offset)``
(a bottom-k sample): which queries it holds depends only on the set of positions asked, not on
the order or the batches they came in, so a resumed run fits its values on the same sample.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: The stream of the run's seed (:func:`mhaextract.validation.spawn_rng`) the read-out and the
#: sample's keys are drawn from: independent of the schedule's queries and of every other stream.
STREAM = 11


def _seed_sequence(seed) -> np.random.SeedSequence:
    """A seed sequence for this module's stream, without drawing from a Generator the caller passed."""
    if isinstance(seed, np.random.Generator):
        parent = seed.bit_generator.seed_seq
        return np.random.SeedSequence(parent.entropy, spawn_key=tuple(parent.spawn_key) + (STREAM,))
    return np.random.SeedSequence(seed).spawn(STREAM)[STREAM - 1]


def splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 (wrapping arithmetic): a well-mixed key per position."""
    z = np.asarray(values, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class VectorAnswers:
    """The read-out ``r`` that turns answers of ``d_out`` numbers into the scalar the schedules fit,
    and a bounded uniform sample of queries with their whole answers.

    Parameters
    ----------
    seed : the run's seed (int, None, SeedSequence or Generator; a Generator is not drawn from).
    sample_size : int, queries kept for the value fit.

    Attributes
    ----------
    d_out : int or None, numbers per answer (None until the first vector answer).
    readout : (d_out,) float64 unit vector or None: the scalar answer is ``r^T y``.
    sample_size : int.

    Examples
    --------
    >>> import numpy as np
    >>> answers = VectorAnswers(seed=0, sample_size=2)
    >>> scalars = answers.scalars(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    >>> answers.d_out, scalars.shape
    (2, (3,))
    >>> answers.keep([0, 1, 2], [np.zeros((1, 3))] * 3, np.arange(6.0).reshape(3, 2))
    >>> sequences, kept = answers.sample()
    >>> len(sequences), kept.shape
    (2, (2, 2))
    """

    def __init__(self, seed, sample_size: int):
        self.sample_size = int(sample_size)
        sequence = _seed_sequence(seed)
        self._rng = np.random.default_rng(sequence)
        self._offset = np.uint64(sequence.generate_state(1, np.uint64)[0])
        self.d_out: int | None = None
        self.readout: np.ndarray | None = None
        self._keys = np.empty(0, dtype=np.uint64)
        self._tokens: list[np.ndarray] = []  # run-length encoded: distinct consecutive tokens...
        self._counts: list[np.ndarray] = []  # ...and how often each repeats
        self._answers = np.empty((0, 0))

    def start(self, d_out: int) -> None:
        """Fix ``d_out`` and draw the read-out (``r = (1,)`` for one output)."""
        self.d_out = int(d_out)
        if self.d_out == 1:
            self.readout = np.ones(1)
        else:
            r = self._rng.standard_normal(self.d_out)
            self.readout = r / np.linalg.norm(r)
        self._answers = np.empty((0, self.d_out))

    def scalars(self, values: np.ndarray) -> np.ndarray:
        """``r^T y`` per answer, for values (n, d_out). Summed along each row on its own (numpy's
        pairwise sum of one contiguous row), so a replayed answer gives the same bits in any batch."""
        if self.d_out is None:
            self.start(values.shape[1])
        return (np.ascontiguousarray(values, dtype=np.float64) * self.readout).sum(axis=1)

    def keep(self, positions: Sequence[int], sequences: Sequence[np.ndarray], values: np.ndarray) -> None:
        """Offer queries (their run positions, tokens and whole answers) to the sample."""
        if not len(positions) or self.sample_size < 1:
            return
        keys = splitmix64(np.asarray(positions, dtype=np.uint64) + self._offset)
        full = len(self._keys) >= self.sample_size
        chosen = np.flatnonzero(keys < self._keys.max()) if full else np.arange(len(keys))
        if not len(chosen):
            return
        tokens, counts = zip(*(self._encode(sequences[i]) for i in chosen))
        self._keys = np.concatenate([self._keys, keys[chosen]])
        self._tokens += list(tokens)
        self._counts += list(counts)
        self._answers = np.concatenate([self._answers, np.asarray(values, dtype=np.float64)[chosen]])
        if len(self._keys) > self.sample_size:
            kept = np.sort(np.argpartition(self._keys, self.sample_size - 1)[:self.sample_size])
            self._keys, self._answers = self._keys[kept], self._answers[kept]
            self._tokens = [self._tokens[i] for i in kept]
            self._counts = [self._counts[i] for i in kept]

    @staticmethod
    def _encode(sequence) -> tuple[np.ndarray, np.ndarray]:
        X = np.array(sequence, dtype=np.float64)
        starts = np.concatenate([[True], np.any(X[1:] != X[:-1], axis=1)])
        index = np.flatnonzero(starts)
        return X[index], np.diff(np.append(index, len(X)))

    def __len__(self) -> int:
        return len(self._keys)

    def sample(self, start: int = 0, stop: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """The kept queries ``start:stop`` in the order of their keys (the same order however the
        queries arrived, so that a resumed run fits the same rows) as (N_i, d) arrays, and their
        answers (n, d_out)."""
        order = np.argsort(self._keys, kind="stable")[start:stop]
        sequences = [np.repeat(self._tokens[i], self._counts[i], axis=0) for i in order]
        return sequences, self._answers[order]
