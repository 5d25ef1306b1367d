"""Self-checks, their policies, and the errors a failed run raises.

A result that fails a check is never returned silently: :func:`report_failure` raises (or, with
``on_failure="warn"``, warns) with every failed check and the hints that name what to try.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from ..oracle.answer_stats import FLOAT64_UNIT

#: A relative parameter-error estimate's float64 limit, the units of coarser answers' rounding it
#: grows to, and the loosest limit any answers' unit makes it (a model off by more is no
#: extraction); :func:`parameter_estimate_limit`.
PARAMETER_ESTIMATE_LIMIT, PARAMETER_ESTIMATE_UNITS, LOOSEST_ESTIMATE_LIMIT = 1e-8, 1e4, 1e-2


def parameter_estimate_limit(unit: float) -> float:
    """The largest relative parameter-error estimate a run accepts from answers of relative rounding
    ``unit`` (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'):
    ``max(1e-8, min(1e4 u, 1e-2))``, the same for every family that estimates its parameters' error.
    The estimate is the answers' noise carried through the fit's conditioning, so its ratio to ``u``
    is that conditioning: 1e4 leaves room for the ill-conditioned directions trained layers have
    (a key bias fitted with the scores, heads whose score scales differ a hundredfold), while the
    answers' misfit, held far tighter, judges whether the model is the layer's.

    >>> from mhaextract.checks.base import parameter_estimate_limit
    >>> parameter_estimate_limit(2.0 ** -53), round(parameter_estimate_limit(2.0 ** -24), 7)
    (1e-08, 0.000596)
    """
    return max(PARAMETER_ESTIMATE_LIMIT, min(PARAMETER_ESTIMATE_UNITS * unit, LOOSEST_ESTIMATE_LIMIT))


#: The float64 kernel with 2H + 1 samples loses about three digits per head (docs/algorithm.md, 'Numerics in float64 and
#: the token scale').
FLOAT64_MAX_RELIABLE_HEADS = 4


def available_memory() -> int | None:
    """Bytes the operating system can give this process now (Linux's ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return 1024 * int(line.split()[1])
    except OSError:
        pass
    return None


class ExtractionError(RuntimeError):
    """The extraction failed its own checks. ``.extraction`` holds the result and diagnostics.

    Examples
    --------
    Four heads in float64 with the paper's ``2H + 1`` samples per instance are past its reach;
    the run says so instead of returning the model:

    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=4, heads=4, seed=0)
    >>> try:
    ...     mx.extract(mx.SimulatedOracle(target), d=4, heads=4, seed=1, schedule="paper")
    ... except mx.ExtractionError as error:
    ...     print(str(error).splitlines()[0], error.extraction.ok)
    paper extraction failed its checks: False
    """

    def __init__(self, message: str, extraction):
        super().__init__(message)
        self.extraction = extraction


class UnreliableExtractionWarning(UserWarning):
    """An extraction returned with ``on_failure="warn"`` failed some of its checks.

    Examples
    --------
    >>> import warnings
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=4, heads=4, seed=0)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     result = mx.extract(mx.SimulatedOracle(target), d=4, heads=4, seed=1, schedule="paper",
    ...                         on_failure="warn")
    >>> result.ok, caught[0].category.__name__
    (False, 'UnreliableExtractionWarning')
    """


@dataclass
class Check:
    """One self-check of a run: ``value`` compared against ``threshold`` (smaller is better).

    Examples
    --------
    >>> import mhaextract as mx
    >>> check = mx.Check("answers_residual", passed=True, value=2.5e-13, threshold=1e-6,
    ...                  message="max misfit on the queries asked")
    >>> print(check)
    answers_residual: ok (2.5e-13 vs 1e-06) max misfit on the queries asked
    >>> target = mx.MultiHeadAttention.random(d=3, heads=1, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=3, heads=1, seed=1, schedule="paper")
    >>> all(check.passed for check in result.checks), result.failed_checks
    (True, [])
    """

    name: str
    passed: bool
    value: float
    threshold: float
    message: str

    def __str__(self) -> str:
        status = "ok" if self.passed else "FAILED"
        return f"{self.name}: {status} ({self.value:.3g} vs {self.threshold:.3g}) {self.message}"

    @staticmethod
    def failures(checks) -> str:
        """The failed ``checks`` as ``name value > threshold``, joined by ``"; "`` (a fallback's reason)."""
        return "; ".join(f"{check.name} {check.value:.3g} > {check.threshold:.3g}" for check in checks
                         if not check.passed)

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "value": self.value, "threshold": self.threshold,
                "message": self.message}


class CheckedResult:
    """What every result with ``checks`` answers: did it pass, and what failed."""

    checks: list

    @property
    def ok(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed_checks(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]


def report_failure(result: CheckedResult, what: str, on_failure: str, error_type=None, hints=(), stacklevel=None):
    """Raise ``error_type(message, result)`` (default :class:`ExtractionError`) or warn, when a check
    failed. The warning points at the user's line that called into the package (``stacklevel``
    None: the first frame outside it), however deep the learner that failed."""
    if result.ok:
        return
    message = f"{what} failed its checks:\n  " + "\n  ".join(str(check) for check in result.failed_checks)
    message += "".join("\n" + hint for hint in hints)
    if on_failure == "raise":
        raise (error_type or ExtractionError)(message, result)
    warnings.warn(message, UnreliableExtractionWarning,
                  stacklevel=_outside_the_package() if stacklevel is None else stacklevel)


def _outside_the_package() -> int:
    """The ``stacklevel`` of :func:`warnings.warn` called from :func:`report_failure` that names the
    first frame outside this package."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(2), 2  # report_failure's caller is level 2 of warn's count
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


@dataclass(frozen=True)
class CheckPolicy:
    """Thresholds of the self-checks of the grid schedules (docs/algorithm.md, 'Numerics in float64 and the token
    scale').

    High precision: every instance must pass; quantities must sit below ``2^(-precision/4)``,
    far above the rounding of a correct run and far below any O(1) failure.
    float64: an instance with two nearly equal poles is ill-conditioned by nature and the
    redundant measurements outvote it, so a small fraction of outlying instances is allowed;
    the global checks (error estimate, misfit of all answers) carry the verdict.
    """

    per_instance: float  # tolerance of relative per-instance quantities (imaginary parts)
    outlier_fraction: float  # fraction of instances allowed to fail a per-instance check
    ambiguity: float  # a link with a larger ambiguity counts as unmatched
    label_slack: float  # label deviation allowed, in units of its error (ball radius or first order)
    error_estimate: float
    answers_residual: float
    label_ambiguity: float = 0.01  # lean: a label match less certain than this gets a column link

    @classmethod
    def for_precision(cls, precision: int | None) -> "CheckPolicy":
        if precision is None:
            return cls(1e-6, 0.05, 0.5, 1e3, 1e-4, 1e-6)
        tolerance = 2.0 ** (-precision / 4)
        # Labels: balls of one column must overlap (slack 1), up to a little outward rounding.
        return cls(tolerance, 0.0, 0.1, 4.0, tolerance, tolerance)


#: float64's unit roundoff: a high-precision result not every part of which is proven passes its
#: error estimate when the estimate is below this (or below the certified runs' ``2^(-precision/4)``,
#: if larger): the model is then right to every float64 digit (docs/algorithm.md, 'Kernels in ball arithmetic and
#: certification').
FLOAT64_UNIT_ROUNDOFF = FLOAT64_UNIT


def uncertified_error_limit(limit: float, details) -> tuple[float, str]:
    """High precision with some instances not certified (Krawczyk, docs/algorithm.md, 'Kernels in ball arithmetic and
    certification'): their balls keep first-order radii, so the largest relative radius is an estimate, not a proven
    bound, and the limit ``2^(-precision/4)`` meant for proven radii does not apply. Returns the limit the
    estimate is judged against, ``max(limit, FLOAT64_UNIT_ROUNDOFF)``, and words saying what was
    proven (``details.instances.certified``: instances proven, directly or by repair) and what not."""
    proven = getattr(getattr(details, "instances", None), "certified", None)
    counted = (f"{int(np.sum(proven))} of {len(proven)} instances proven (Krawczyk, their balls enclose the exact "
               f"parameters), {len(proven) - int(np.sum(proven))} not: their first-order radii are estimates"
               if proven is not None else "not every instance proven")
    return (max(limit, FLOAT64_UNIT_ROUNDOFF),
            f"the balls' radii ({counted}; not certified, the estimate is judged against float64's unit "
            f"roundoff 2^-53, not the proven radii's 2^(-precision/4) = {limit:.3g})")


def error_estimate_check(error_estimate: float, threshold: float, what: str) -> Check:
    return Check("error_estimate", error_estimate <= threshold, error_estimate, threshold,
                 f"max relative parameter error expected from {what}")


def answers_residual_check(answers_residual: float, threshold: float) -> Check:
    return Check("answers_residual", answers_residual <= threshold, answers_residual, threshold,
                 "max misfit of the extracted model on the queries asked, relative to the largest answer")


def heads_found_check(found: int, declared: int | None, where: str) -> Check:
    """Declared ``heads=H``: finding another canonical count is a failure that says so."""
    if declared is None:
        return Check("heads_found", found > 0, float(found == 0), 0, f"{found} canonical heads found {where}")
    return Check("heads_found", found == declared, abs(found - declared), 0,
                 f"{found} of {declared} declared heads found {where}"
                 + ("" if found == declared else " (heads with equal W merge in the canonical form; "
                    "pass max_heads to accept fewer)"))


def finite_check() -> Check:
    return Check("finite", False, np.inf, 0.0, "the assembled parameters are not finite; no model")
