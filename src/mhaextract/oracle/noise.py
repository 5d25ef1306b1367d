"""Approximate oracles: wrappers that make an exact float64 oracle answer like a real one.

Each wrapper is itself an oracle (``oracle(batch) -> outputs``, float64) and is seeded: the
same seed and the same questions give the same answers.

* :class:`AdditiveNoise`: ``f(X) + e`` with ``e`` uniform in ``[-eps, eps]`` (bounded: the setting
  of the certificate, docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement, verification');
* :class:`GaussianNoise`: ``f(X) + e``, ``e ~ N(0, sigma^2)`` (unbounded);
* :class:`RoundedAnswers`: ``f(X)`` rounded to ``bits`` significant bits (an API that rounds);
* :class:`Float32Oracle`: the target itself evaluated in float32 (a float32 layer);
* :class:`MixedPrecisionOracle`: a float64 layer whose softmax runs in float32 (float64 answers
  carrying float32-level noise: nothing in the answers' bits says so);
* :class:`BFloat16Oracle`: the target in bfloat16 (8 significant bits), float32 accumulation.

``answer_error`` is each wrapper's bound on ``|answer - f(X)|`` where one exists (to pass to
``extract(..., answer_error=...)``): eps for the additive one; None where there is no absolute
bound known in advance (Gaussian, relative rounding, float32, mixed, bfloat16).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..models.attention import MultiHeadAttention
from ..run.validation import nonnegative_number
from .answer_stats import FORMAT_UNITS


def _callable(oracle) -> Callable:
    if not callable(oracle):
        raise TypeError(f"oracle must be callable, got {type(oracle).__name__}")
    return oracle


def _exact(oracle, batch) -> np.ndarray:
    """The wrapped oracle's answers, (B,) or whole (B, d_out): the noise is drawn per entry."""
    answers = np.asarray(oracle(batch), dtype=np.float64)
    if answers.ndim not in (1, 2) or answers.shape[0] != len(batch):
        raise ValueError(f"the wrapped oracle returned shape {answers.shape} for a batch of {len(batch)}: "
                         "expected (B,) or (B, d_out)")
    return answers


class AdditiveNoise:
    """``f(X) + e`` with ``e`` i.i.d. uniform in ``[-eps, eps]``: ``|error| <= eps`` always.

    Parameters
    ----------
    oracle : a float64 oracle (e.g. :class:`mhaextract.SimulatedOracle`).
    eps : the bound (absolute). seed : seeds the noise.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> exact = mx.SimulatedOracle(mx.MultiHeadAttention.random(d=3, heads=1, seed=0))
    >>> noisy = mx.AdditiveNoise(exact, eps=1e-9, seed=0)
    >>> batch = [np.eye(3), np.ones((2, 3))]
    >>> noisy.answer_error, bool(np.all(np.abs(noisy(batch) - exact(batch)) <= 1e-9))
    (1e-09, True)
    """

    def __init__(self, oracle, eps: float, seed=None):
        self.oracle = _callable(oracle)
        self.eps = nonnegative_number("eps", eps)
        self.rng = np.random.default_rng(seed)

    @property
    def answer_error(self) -> float:
        return self.eps

    def __call__(self, batch):
        answers = _exact(self.oracle, batch)
        return answers + self.rng.uniform(-self.eps, self.eps, size=answers.shape)

    def __repr__(self) -> str:
        return f"AdditiveNoise({self.oracle!r}, eps={self.eps:g})"


class GaussianNoise:
    """``f(X) + e`` with ``e ~ N(0, sigma^2)`` i.i.d. (no bound: ``answer_error`` is None).

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> exact = mx.SimulatedOracle(mx.MultiHeadAttention.random(d=3, heads=1, seed=0))
    >>> noisy = mx.GaussianNoise(exact, sigma=1e-10, seed=0)
    >>> print(noisy.answer_error)
    None
    >>> bool(np.abs(noisy([np.eye(3)]) - exact([np.eye(3)]))[0] < 1e-8)
    True
    """

    def __init__(self, oracle, sigma: float, seed=None):
        self.oracle = _callable(oracle)
        self.sigma = nonnegative_number("sigma", sigma)
        self.rng = np.random.default_rng(seed)

    answer_error = None

    def __call__(self, batch):
        answers = _exact(self.oracle, batch)
        return answers + self.rng.normal(0.0, self.sigma, size=answers.shape)

    def __repr__(self) -> str:
        return f"GaussianNoise({self.oracle!r}, sigma={self.sigma:g})"


class RoundedAnswers:
    """``f(X)`` rounded to ``bits`` significant bits (round to nearest): relative error at most
    ``2^-bits``. Deterministic; ``answer_error`` is None (the bound is relative).

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> exact = mx.SimulatedOracle(mx.MultiHeadAttention.random(d=3, heads=1, seed=0))
    >>> rounded = mx.RoundedAnswers(exact, bits=20)
    >>> rounded.relative_error == 2.0**-20
    True
    >>> a, b = rounded([np.eye(3)])[0], exact([np.eye(3)])[0]
    >>> bool(abs(a - b) <= 2.0**-20 * abs(b))
    True
    """

    def __init__(self, oracle, bits: int):
        self.oracle = _callable(oracle)
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 53:
            raise ValueError(f"bits must be an integer in 1..53 (float64 has 53), got {bits!r}")
        self.bits = int(bits)

    answer_error = None

    @property
    def relative_error(self) -> float:
        return 2.0 ** -self.bits

    def __call__(self, batch):
        answers = _exact(self.oracle, batch)
        mantissa, exponent = np.frexp(answers)  # answers = mantissa 2^exponent, 0.5 <= |mantissa| < 1
        return np.ldexp(np.round(np.ldexp(mantissa, self.bits)), exponent - self.bits)

    def __repr__(self) -> str:
        return f"RoundedAnswers({self.oracle!r}, bits={self.bits})"


class _LowPrecisionTarget:
    """A known target evaluated in a lower precision, answers returned as float64; deterministic.
    Subclasses set ``unit_roundoff`` and say how each intermediate is rounded (``_stage``)."""

    unit_roundoff: float
    answer_error = None

    def __init__(self, model: MultiHeadAttention):
        if not isinstance(model, MultiHeadAttention):
            raise TypeError(f"{type(self).__name__} needs a MultiHeadAttention, got {type(model).__name__}")
        self.model = model

    @staticmethod
    def _stage(name, array):
        raise NotImplementedError

    def __call__(self, batch):
        return _evaluate(self.model, batch, self._stage).astype(np.float64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model!r})"


class Float32Oracle(_LowPrecisionTarget):
    """The target evaluated in float32: tokens, parameters and arithmetic rounded to float32
    (unit roundoff ``2^-24``), answers returned as float64. Deterministic.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> answer = mx.Float32Oracle(target)([np.eye(3)])[0]
    >>> bool(answer == np.float32(answer))  # the answer round-trips through float32
    True
    >>> bool(abs(answer - mx.SimulatedOracle(target)([np.eye(3)])[0]) < 1e-6)
    True
    """

    unit_roundoff = FORMAT_UNITS["float32"]

    def __call__(self, batch):
        return self.model(batch, dtype=np.float32).astype(np.float64)


def round_bfloat16(values) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.astype(np.uint32).view(np.float32)


def _evaluate(model: MultiHeadAttention, batch, stage) -> np.ndarray:
    """The layer with ``stage(name, array)`` applied to every intermediate: tokens, parameters,
    scores, softmax weights, values and the output (each stage rounds to its precision)."""
    from ..models.attention import as_batch

    model = model.to_float64()
    sequences = as_batch(batch, model.d)
    W, u, v = (stage("parameters", p) for p in (model.W, model.u, model.v))
    c = stage("parameters", np.array(model.c))
    out = np.empty(len(sequences), dtype=np.float64)
    lengths = np.array([len(s) for s in sequences])
    for length in np.unique(lengths):
        index = np.flatnonzero(lengths == length)
        X = stage("tokens", np.stack([np.asarray(sequences[i], dtype=np.float64) for i in index]))
        queries = stage("scores", np.einsum("hde,be->bhd", W, X[:, -1, :]) + u[None])
        scores = stage("scores", np.einsum("bnd,bhd->bhn", X, queries))
        weights = stage("softmax", scores)
        weights = np.exp(weights - weights.max(axis=2, keepdims=True))
        weights = stage("softmax", weights / weights.sum(axis=2, keepdims=True))
        values = stage("values", np.einsum("bnd,hd->bhn", X, v))
        out[index] = stage("output", np.einsum("bhn,bhn->b", weights, values) + c)
    return out


class MixedPrecisionOracle(_LowPrecisionTarget):
    """A float64 layer whose softmax runs in float32: the scores are rounded to float32, the
    softmax weights computed in float32, everything else in float64. The answers are float64
    (they do not round-trip through float32) but carry float32-level noise. Deterministic.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> answer = mx.MixedPrecisionOracle(target)([np.eye(3)])[0]
    >>> error = abs(answer - mx.SimulatedOracle(target)([np.eye(3)])[0])
    >>> bool(1e-12 < error < 1e-6)
    True
    """

    unit_roundoff = FORMAT_UNITS["float32"]

    @staticmethod
    def _stage(name, array):
        array = np.asarray(array, dtype=np.float64)
        return array.astype(np.float32) if name == "softmax" else array


class BFloat16Oracle(_LowPrecisionTarget):
    """The target in bfloat16: tokens, parameters and every intermediate (scores, softmax
    weights, values, output) rounded to bfloat16 (unit roundoff ``2^-8``), each product and sum
    accumulated in float32 as accelerators do; answers returned as float64. Deterministic.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> mx.BFloat16Oracle(target)([np.eye(3)])  # 8 significant bits
    array([1.1171875])
    """

    unit_roundoff = 2.0 ** -8

    @staticmethod
    def _stage(name, array):
        return round_bfloat16(np.asarray(array, dtype=np.float32))
