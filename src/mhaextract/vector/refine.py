"""Gauss-Newton on every unsaturated whole answer, each step solved by LSQR without forming the
Jacobian (docs/algorithm.md, 'Whole answers near the vector bound').

The start from the split (:mod:`.split`, :mod:`.scores`) carries the conditioning of each step; the
refinement fits all parameters of the factored layer (:mod:`.factored`) to all answers at once, so
its error is that of one least-squares problem on ``n d_out`` numbers. The blocks are scaled by
their Jacobian columns' root mean square (a few random probes of ``J^T``), which makes LSQR's
iterations independent of the parameters' units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse.linalg import LinearOperator, lsqr

from .factored import BLOCKS, FactoredLayer, forward, grouped, jvp, vjp

#: Queries per chunk of the Jacobian products (memory: a chunk's weights and means, B H (N + d)).
CHUNK = 512
#: LSQR iterations per Gauss-Newton step, and Gauss-Newton steps at most.
LSQR_ITERATIONS = 400
STEPS = 8
#: A step that lowers the misfit by less than this fraction ends the refinement.
STALL = 0.05


@dataclass
class Refinement:
    layer: FactoredLayer
    misfit_before: float   # RMS misfit relative to the answers' RMS
    misfit_after: float
    steps: int


class _Data:
    """Queries grouped by length and chunked, with their answers."""

    def __init__(self, sequences, answers: np.ndarray):
        self.chunks = []
        for index, X in grouped(sequences):
            for start in range(0, len(index), CHUNK):
                part = index[start:start + CHUNK]
                self.chunks.append((part, X[start:start + CHUNK]))
        self.answers = answers
        self.scale = float(np.sqrt(np.mean(answers ** 2))) or 1.0

    def residual(self, layer: FactoredLayer):
        forwards, residual = [], np.empty_like(self.answers)
        for part, X in self.chunks:
            fw = forward(layer, X)
            forwards.append(fw)
            residual[part] = self.answers[part] - fw.f
        return forwards, residual


def _operator(layer: FactoredLayer, data: _Data, forwards, scale: np.ndarray) -> LinearOperator:
    rows, d_out = data.answers.shape
    size = scale.size

    def matvec(vector):
        step = layer.shaped(vector * scale)
        out = np.empty((rows, d_out))
        for (part, _), fw in zip(data.chunks, forwards):
            out[part] = jvp(layer, fw, step)
        return out.ravel()

    def rmatvec(vector):
        e = vector.reshape(rows, d_out)
        total = np.zeros(size)
        for (part, _), fw in zip(data.chunks, forwards):
            total += vjp(layer, fw, e[part]).flat()
        return total * scale

    return LinearOperator((rows * d_out, size), matvec=matvec, rmatvec=rmatvec, dtype=np.float64)


def _column_scale(layer: FactoredLayer, data: _Data, forwards, rng: np.random.Generator) -> np.ndarray:
    """Per block, the inverse RMS of its non-zero Jacobian columns (Hutchinson: E (J^T z)^2 = diag J^T J)."""
    unit = _operator(layer, data, forwards, np.ones(layer.flat().size))
    rows = unit.shape[0]
    squares = sum(unit.rmatvec(rng.choice([-1.0, 1.0], size=rows)) ** 2 for _ in range(8)) / 8
    scale = np.ones_like(squares)
    for name, part in layer.block_slices().items():
        block = squares[part]
        alive = block > 1e-30 * block.max(initial=0.0)
        if alive.any():
            scale[part] = np.where(alive, 1.0 / np.sqrt(np.where(alive, block, 1.0)), 0.0)
    return scale


def refine(layer: FactoredLayer, sequences, answers: np.ndarray, rng: np.random.Generator,
           steps: int = STEPS, on_step=None) -> Refinement:
    """Gauss-Newton from ``layer`` on ``answers`` (n, d_out) to ``sequences``."""
    data = _Data(sequences, np.asarray(answers, dtype=np.float64))
    forwards, residual = data.residual(layer)
    misfit = float(np.sqrt(np.mean(residual ** 2))) / data.scale
    before, done = misfit, 0
    for done in range(1, steps + 1):
        scale = _column_scale(layer, data, forwards, rng)
        operator = _operator(layer, data, forwards, scale)
        solution = lsqr(operator, residual.ravel(), atol=1e-16, btol=1e-16, iter_lim=LSQR_ITERATIONS)[0]
        trial = layer.shaped(layer.flat() + solution * scale)
        trial_forwards, trial_residual = data.residual(trial)
        trial_misfit = float(np.sqrt(np.mean(trial_residual ** 2))) / data.scale
        if on_step is not None:
            on_step(done, trial_misfit)
        if not trial_misfit < misfit:
            break
        gained = trial_misfit < (1 - STALL) * misfit
        layer, forwards, residual, misfit = trial, trial_forwards, trial_residual, trial_misfit
        if not gained:
            break
    return Refinement(layer, before, misfit, done)


__all__ = ["Refinement", "refine", "BLOCKS"]
