"""Verification: does the extracted model answer like the oracle on queries it has never seen?

:func:`verify` asks ``n`` fresh random queries (lengths 1..``max_length``, tokens Gaussian at
several scales around the run's token scale, so that both flat and sharp attention occur)
through an :class:`~mhaextract.oracle.boundary.OracleBoundary` (counted), and compares

    relative error(X) = |f_hat(X) - oracle(X)| / rms_q |oracle(X_q)|

(the root mean square of the oracle's answers on the same queries is the output scale; a
per-query ratio would explode wherever an answer happens to be near 0). The result records how
the queries were drawn and is attached to the extraction (``extraction.verification``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..numerics.float64 import root_mean_square
from ..oracle.boundary import OracleBoundary
from ..oracle.queries import random_queries
from ..validation import positive_int, positive_number


@dataclass
class Verification:
    """Outcome of :func:`verify`.

    Attributes
    ----------
    queries : int, measured at the oracle boundary.
    max_relative_error, mean_relative_error : over the fresh queries (see the module docstring).
    tolerance : the max relative error allowed; ``passed``: max_relative_error <= tolerance.
    lengths : (shortest, longest) query length asked. scales : token scales used.
    seed : the seed of the queries.

    Examples
    --------
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> oracle = mx.SimulatedOracle(target)
    >>> result = mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper")
    >>> verification = mx.verify(result, oracle, n=60, seed=0)
    >>> verification.passed, verification.queries, verification.lengths
    (True, 60, (1, 16))
    >>> print(verification)  # doctest: +ELLIPSIS
    verification passed: 60 fresh queries (lengths 1..16, token scales 0.658, 1.32, 2.63): max relative output error ...
    """

    queries: int
    max_relative_error: float
    mean_relative_error: float
    tolerance: float
    passed: bool
    lengths: tuple[int, int]
    scales: tuple[float, ...]
    seed: object

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"verification {verdict}: {self.queries} fresh queries (lengths {self.lengths[0]}..{self.lengths[1]}, "
                f"token scales {', '.join(f'{s:.3g}' for s in self.scales)}): max relative output error "
                f"{self.max_relative_error:.3g}, mean {self.mean_relative_error:.3g} (tolerance {self.tolerance:.3g})")


def verify(extraction, oracle, n: int = 256, seed=None, *, max_length: int = 16,
           scales: tuple[float, ...] = (0.5, 1.0, 2.0), tolerance: float | None = None, batch_size: int = 1024,
           progress=None) -> Verification:
    """Check ``extraction.model`` against ``oracle`` on ``n`` fresh random queries (float64).

    Parameters
    ----------
    extraction : an :class:`~mhaextract.Extraction` with a model.
    oracle : the oracle it was extracted from (or any float64 oracle for the same d).
    n : number of fresh queries (>= 1), split evenly over ``scales``.
    seed : seeds the queries. max_length : longest query (lengths uniform in 1..max_length).
    scales : token scales, as multiples of the extraction's own ``token_scale`` (the regime it was
        extracted in; ``d ** 0.25`` unless the run chose another).
    tolerance : the max relative output error that counts as passing; default
        ``max(1e-6, 10 answer_error / output scale)`` (``extraction.answer_error``, 0 if not given).

    Returns
    -------
    Verification
        A new :class:`Verification`; ``extraction`` is not modified (attach the outcome with
        ``extraction.with_verification(...)``).

    Examples
    --------
    A model that is a little off fails on fresh queries:

    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> oracle = mx.SimulatedOracle(target)
    >>> result = mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper")
    >>> mx.verify(result, oracle, n=30, seed=0).passed
    True
    >>> wrong = mx.SimulatedOracle(mx.MultiHeadAttention(target.W, 1.001 * target.v))
    >>> mx.verify(result, wrong, n=30, seed=0).passed
    False
    """
    if getattr(extraction, "model", None) is None:
        raise ValueError("the extraction has no model to verify (its parameters were not finite)")
    n = positive_int("n", n)
    max_length = positive_int("max_length", max_length)
    scales = tuple(positive_number("scales", s) for s in scales)
    if not scales:
        raise ValueError(f"scales must be positive numbers, got {scales!r}")
    if tolerance is not None:
        tolerance = positive_number("tolerance", tolerance)
    model = extraction.model
    d = model.d
    base = extraction.token_scale
    rng = np.random.default_rng(seed)
    counts = np.diff(np.linspace(0, int(n), len(scales) + 1).astype(int))
    sequences = []
    for scale, count in zip(scales, counts):
        sequences += random_queries(rng, count, d, scale * base, (1, int(max_length)))
    boundary = OracleBoundary(oracle, d, batch_size=batch_size, progress=progress)
    answers = boundary.ask(sequences, description="verifying on fresh queries")
    predicted = model(sequences)
    output_scale = root_mean_square(answers) or 1.0  # scaled: huge answers do not overflow
    errors = np.abs(predicted - answers) / output_scale
    if tolerance is None:
        tolerance = max(1e-6, 10.0 * float(getattr(extraction, "answer_error", None) or 0.0) / output_scale)
    tolerance = float(tolerance)
    lengths = [len(sequence) for sequence in sequences]
    result = Verification(
        queries=boundary.queries, max_relative_error=float(errors.max()), mean_relative_error=float(errors.mean()),
        tolerance=tolerance, passed=bool(errors.max() <= tolerance), lengths=(min(lengths), max(lengths)),
        scales=tuple(s * base for s in scales), seed=seed,
    )
    return result
