"""One arithmetic interface, two backends: the grid learner is written once against it.

Like mpmath's contexts (``mp``, ``fp``, ``iv``), an :class:`Arithmetic` bundles how numbers are
stored and how the kernels of docs/algorithm.md, 'Kernels in float64' to 'Assembly' compute with them:

* :class:`Float64Arithmetic`: numpy float64, batched over instances; redundant measurements are
  combined by weighted least squares, errors are first-order estimates ('Kernels in float64', 'Assembly' and 'Numerics
  in float64 and the token scale');
* :class:`BallArithmetic`: python-flint ``arb`` balls at ``precision`` bits; redundant
  measurements keep the tightest enclosure and errors are ball radii, proven when every instance
  certified ('Kernels in ball arithmetic and certification' and 'Assembly').

* :class:`TorchArithmetic`: float64 with the batched factorisations in torch (:mod:`.torch`), on
  CUDA when present; the same numbers as :class:`Float64Arithmetic` to rounding.

:func:`arithmetic_for` picks the backend from ``precision`` and ``backend``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..oracle.queries import CopiesQueries, KeptQueries
from . import arb as arb_kernel
from . import float64 as float64_kernel
from .assembly import tightest_enclosures, weighted_combination
from .highprec import GUARD_BITS, magnitude_float, mid_float, radius_float, to_arb, working_precision


class Arithmetic:
    """The numbers of one run. Subclasses set ``precision``, ``dtype``, ``unit`` and ``kernel``."""

    precision: int | None
    dtype: object
    #: Relative rounding unit of the answers: the unit of the label deviations (docs/algorithm.md, 'Numerics in float64
    #: and the token scale').
    unit: float
    kernel: object

    def working(self):
        """Context in which the kernels run (the working precision of the balls)."""
        return contextlib.nullcontext()

    def empty_samples(self, n: int, K: int) -> np.ndarray:
        return np.empty((n, K), dtype=self.dtype)

    def detect_ranks(self, samples, ks, max_poles, constant=None, answer_error=0.0):
        """Pole count per instance and relative Loewner singular values (docs/algorithm.md, 'Kernels in float64' and
        'Kernels in ball arithmetic and certification')."""
        return self.kernel.detect_ranks(samples, ks, max_poles, constant=constant)

    def fit(self, samples, ks, poles, constant=None):
        """:class:`~mhaextract.numerics.rational.InstanceFits` of every row of ``samples``."""
        return self.kernel.fit(samples, ks, poles, constant=constant)

    def solve_transposed(self, Z, rhs):
        return self.kernel.solve_transposed(Z, rhs)

    def dot(self, vector, points):
        return self.kernel.dot(vector, points)

    def assemble(self, Z, X, M, labels):
        """``W_h = Z^{-T} M_h X^{-1}``, ``v_h = Z^{-T} l_h`` (docs/algorithm.md, 'Assembly')."""
        return self.kernel.assemble(Z, X, M, labels)

    def combine(self, layout, m, labels, sigma_m, sigma_l):
        """``M`` (H, d, d), ``l`` (H, d) from every redundant measurement of a grid schedule, and
        their first-order standard deviations (None where the numbers carry their own error)."""
        raise NotImplementedError

    def magnitude(self, values) -> np.ndarray:
        """``|value|`` as float64 (upper bounds for balls)."""
        return np.abs(np.asarray(values, dtype=np.float64))

    def midpoint(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def label_error(self, instance_labels, consensus_labels, sigma_l) -> np.ndarray:
        """The error expected of one instance's labels against their column's consensus."""
        raise NotImplementedError

    def error_estimate(self, Z, X, W, v, M_std, label_std) -> float:
        """Max relative parameter error from the rounding of the answers (docs/algorithm.md, 'Numerics in float64 and
        the token scale')."""
        raise NotImplementedError

    def constant_error(self, c, scale: float) -> float:
        """Relative error of the output constant c of the biased grid (docs/algorithm.md, 'Biases: affine scores and an
        output constant') against ``scale``."""
        raise NotImplementedError

    def answers_residual(self, model, sequences, answers) -> float:
        """Max ``|model - answer|`` over the queries asked, relative to the largest answer (the grid's
        copies queries evaluated from their instances, :meth:`CopiesQueries.outputs`, the targeted
        schedules' kept sample from its rows, :meth:`KeptQueries.outputs`)."""
        predicted = (sequences.outputs(model) if isinstance(sequences, (CopiesQueries, KeptQueries))
                     else model(sequences))
        scale = max(np.abs(answers).max(), 1e-300)
        return float(np.abs(predicted - answers).max() / scale)


class Float64Arithmetic(Arithmetic):
    precision = None
    dtype = np.float64
    unit = 2.0**-52
    kernel = float64_kernel

    def detect_ranks(self, samples, ks, max_poles, constant=None, answer_error=0.0):
        # A declared bound on the answers' error widens the rank threshold to what noise can do.
        return self.kernel.detect_ranks(samples, ks, max_poles, constant=constant, answer_error=answer_error)

    def combine(self, layout, m, labels, sigma_m, sigma_l):
        return weighted_combination(layout, m, labels, sigma_m, sigma_l)

    def label_error(self, instance_labels, consensus_labels, sigma_l):
        return self.unit * sigma_l

    def constant_error(self, c, scale: float) -> float:
        """Not estimated in float64 (no first-order sensitivity of c is propagated): 0; the
        ``answers_residual`` check judges the constant with every answer."""
        return 0.0

    def error_estimate(self, Z, X, W, v, M_std, label_std) -> float:
        """First order: ``delta W_h = Z^{-T} delta M_h X^{-1}`` is bounded by the spectral norms of
        the inverses times ``||delta M_h||_F``; ``delta v_h = Z^{-T} delta l_h`` likewise."""
        heads = W.shape[0]
        if not heads:
            return 0.0
        W_scale = max(np.abs(W).max(), 1e-300)
        v_scale = max(np.abs(v).max(), 1e-300)
        Z_inv = np.linalg.norm(np.linalg.inv(Z), 2)
        X_inv = np.linalg.norm(np.linalg.inv(X), 2)
        eps = np.finfo(np.float64).eps
        W_error = eps * Z_inv * X_inv * np.linalg.norm(M_std.reshape(heads, -1), axis=1).max(initial=0.0)
        v_error = eps * Z_inv * np.linalg.norm(label_std, axis=1).max(initial=0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            return float(np.nan_to_num(max(W_error / W_scale, v_error / v_scale), nan=np.inf))


class BallArithmetic(Arithmetic):
    """Balls at ``precision`` bits; the kernels work with ``GUARD_BITS`` more."""

    dtype = object
    kernel = arb_kernel

    def __init__(self, precision: int):
        self.precision = int(precision)
        self.unit = 2.0**-self.precision

    def working(self):
        return working_precision(self.precision + GUARD_BITS)

    def combine(self, layout, m, labels, sigma_m, sigma_l):
        return tightest_enclosures(layout, m, labels)

    def magnitude(self, values):
        return magnitude_float(values)

    def midpoint(self, values):
        return mid_float(values)

    def label_error(self, instance_labels, consensus_labels, sigma_l):
        # Balls of one column overlap when both enclose the truth.
        return radius_float(instance_labels) + radius_float(consensus_labels)

    def constant_error(self, c, scale: float) -> float:
        """The radius of c's ball relative to ``scale``."""
        return float(radius_float(np.array([c], dtype=object))[0]) / max(scale, 1e-300)

    def error_estimate(self, Z, X, W, v, M_std, label_std) -> float:
        """The largest relative ball radius: a proven bound when every instance certified."""
        if not W.shape[0]:
            return 0.0
        W_scale = max(np.abs(mid_float(W)).max(), 1e-300)
        v_scale = max(np.abs(mid_float(v)).max(), 1e-300)
        return max(radius_float(W).max() / W_scale, radius_float(v).max() / v_scale)

    def answers_residual(self, model, sequences, answers) -> float:
        """Max misfit on (at most 256 of) the queries asked, the model evaluated 16 bits above the
        answers' precision; ``model`` holds the exact ball midpoints."""
        picks = np.unique(np.linspace(0, len(sequences) - 1, min(256, len(sequences))).astype(int))
        predicted = model([sequences[p] for p in picks], precision=self.precision + 16)
        difference = np.array([to_arb(value) - answers[p] for value, p in zip(predicted, picks)], dtype=object)
        scale = max(np.abs(mid_float(np.array([answers[p] for p in picks], dtype=object))).max(), 1e-300)
        return float(magnitude_float(difference).max() / scale)


class TorchArithmetic(Float64Arithmetic):
    """float64 whose batched kernels run in torch on ``device`` (default: CUDA when present)."""

    def __init__(self, device: str | None = None):
        from .torch import TorchKernels  # torch is optional: imported only when this backend is asked for

        self.kernel = TorchKernels(device)


#: ``backend=`` names: how float64 numbers are computed (None is numpy).
BACKENDS = ("numpy", "torch", "torch-cpu", "torch-cuda")


def arithmetic_for(precision: int | None, backend: str | None = None) -> Arithmetic:
    """Balls at ``precision`` bits, or float64 with the ``backend``'s kernels (numpy by default)."""
    if precision is not None:
        return BallArithmetic(precision)
    if backend in (None, "numpy"):
        return Float64Arithmetic()
    return TorchArithmetic(None if backend == "torch" else backend.removeprefix("torch-"))
