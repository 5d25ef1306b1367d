"""Vector answers at the oracle boundary: the read-out the schedules fit (docs/algorithm.md, 'The whole layer: vector
outputs and a replacement module').

A real layer answers ``d_out`` numbers per query. The coordinates share the scores, so they share
``(W_h, u_h)``; every schedule learns those from the scalar ``r^T f(X)`` for one read-out ``r`` (a
random unit vector drawn from the run's seed; ``r = (1,)`` when ``d_out = 1``), asking exactly the
queries of a scalar run. The value read-outs ``V_h`` and ``c`` are then fitted to whole answers
(:mod:`mhaextract.run.value_fit`).
"""

from __future__ import annotations

import numpy as np

from .answer_stats import FLOAT64_UNIT, FORMAT_UNITS

#: The stream of the run's seed (:func:`mhaextract.run.validation.spawn_rng`) the read-out is drawn
#: from: independent of the schedule's queries and of every other stream.
STREAM = 11


def _seed_sequence(seed) -> np.random.SeedSequence:
    """A seed sequence for this module's stream, without drawing from a Generator the caller passed."""
    if isinstance(seed, np.random.Generator):
        parent = seed.bit_generator.seed_seq
        return np.random.SeedSequence(parent.entropy, spawn_key=tuple(parent.spawn_key) + (STREAM,))
    return np.random.SeedSequence(seed).spawn(STREAM)[STREAM - 1]




class VectorAnswers:
    """The read-out ``r`` that turns answers of ``d_out`` numbers into the scalar the schedules fit.

    Parameters
    ----------
    seed : the run's seed (int, None, SeedSequence or Generator; a Generator is not drawn from).
    answer_dtype : the oracle's declared answer precision (``TorchOracle.answer_dtype``), if any:
        ``"float32"``, ``"bfloat16"`` or ``"float16"`` read the answers out to float32, as a scalar
        oracle of such a layer rounds its own read-out (the rounding, ``2^-24`` relative, is below the
        layer's own, and the run sees the answers' precision:
        :class:`~mhaextract.oracle.answer_stats.AnswerStats`, docs/algorithm.md, 'Low-precision oracles: float32, mixed
        precision, bfloat16').

    Attributes
    ----------
    d_out : int or None, numbers per answer (None until the first vector answer).
    unit : the declared answer dtype's relative rounding (``2^-53`` when none is declared).
    readout : (d_out,) float64 unit vector or None: the scalar answer is ``r^T y``.

    Examples
    --------
    >>> import numpy as np
    >>> from mhaextract.oracle.vector_answers import VectorAnswers
    >>> answers = VectorAnswers(seed=0)
    >>> scalars = answers.scalars(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    >>> answers.d_out, scalars.shape, round(float(np.linalg.norm(answers.readout)), 12)
    (2, (3,), 1.0)
    """

    def __init__(self, seed, answer_dtype: str | None = None):
        self._rng = np.random.default_rng(_seed_sequence(seed))
        self.single = answer_dtype in FORMAT_UNITS
        #: The relative rounding of the declared answer dtype (2^-53 when none is declared).
        self.unit = FORMAT_UNITS.get(answer_dtype, FLOAT64_UNIT)
        self.d_out: int | None = None
        self.readout: np.ndarray | None = None

    def start(self, d_out: int) -> None:
        """Fix ``d_out`` and draw the read-out (``r = (1,)`` for one output)."""
        self.d_out = int(d_out)
        if self.d_out == 1:
            self.readout = np.ones(1)
        else:
            r = self._rng.standard_normal(self.d_out)
            self.readout = r / np.linalg.norm(r)

    def scalars(self, values: np.ndarray) -> np.ndarray:
        """``r^T y`` per answer, for values (n, d_out): :func:`read_out`."""
        if self.d_out is None:
            self.start(values.shape[1])
        return read_out(values, self.readout, self.single)


def read_out(values: np.ndarray, readout: np.ndarray, single: bool = False) -> np.ndarray:
    """The scalar answers ``r^T y`` of whole answers ``y`` (n, d_out), float64 (n,).

    Summed along each row on its own (numpy's pairwise sum of one contiguous row), so a replayed
    answer gives the same bits in any batch; ``single``: rounded to float32, as the read-out of a
    layer that answers in float32 or below (the rounding, ``2^-24`` relative, is below the layer's
    own). A scalar oracle of a layer (``TorchOracle(layer, r)``) reads its answers out with this
    function too, so a scalar run of the read-out a whole run drew sees exactly the whole run's
    scalars.

    Examples
    --------
    >>> import numpy as np
    >>> from mhaextract.oracle.vector_answers import read_out
    >>> read_out(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.5, -1.0]))
    array([-1.5, -2.5])
    """
    projected = (np.ascontiguousarray(values, dtype=np.float64) * readout).sum(axis=1)
    if single and len(readout) > 1:
        projected = projected.astype(np.float32).astype(np.float64)
    return projected
