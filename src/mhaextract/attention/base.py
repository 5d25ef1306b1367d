"""The schedule interface: what every query schedule provides to :func:`mhaextract.extract`.

A schedule decides which queries to ask and turns their answers into canonical heads. It is
constructed from the validated :class:`RunSettings`, refuses the options it does not support
(``accepts``), states its own promised count, and :meth:`Schedule.run` returns an
:class:`Outcome`; :func:`mhaextract.extract` then finishes every schedule the same way (common
checks, certificate, refinement, result). Adding a schedule is one module with one subclass and
one line in :mod:`.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import numpy as np

from ..checks.base import Check
from ..models.attention import MultiHeadAttention
from ..run.value_fit import RESOLVED  # noqa: F401  (the schedules' and finish's: one definition)

#: Options of ``extract`` that not every schedule supports (the others every schedule takes).
OPTIONAL = ("precision", "samples_per_instance", "refine", "answer_error", "rank", "backend", "repair")


@dataclass(frozen=True)
class RunSettings:
    """The parameters of one run, validated once by :func:`mhaextract.extract`.

    ``max_heads`` is H0 (the known H or the bound); ``heads`` the declared H (None for a bound).
    """

    d: int
    max_heads: int
    heads: int | None
    precision: int | None
    seed: object
    token_scale: float
    samples_per_instance: int | None = None
    refine: bool | None = None  # None: the schedule decides (refines_when_noisy); False: never
    refine_queries: int | None = None
    answer_error: float | None = None
    rank: int | str | None = None  # a bound on the rank of every W_h, or "auto" (docs/algorithm.md, 'Low-rank heads')
    backend: str | None = None  # float64 kernels: None (numpy) or a torch backend (numerics/arithmetic.py)
    # learn score biases u_h and the output constant c (docs/algorithm.md, 'Biases: affine scores and an output
    # constant')
    bias: bool = False
    #: The answers' relative noise (fraction of the largest answer) measured before the schedule
    #: runs (the calibration's probes, docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'):
    #: 2^-24 for float32 answers; None at float64 rounding or not measured. The one place a schedule reads the answers'
    #: precision from.
    answer_noise: float | None = None
    #: The part of ``answer_noise`` that is the oracle's own rounding, which rounds its scores too
    #: (the calibration's repeated probes, docs/algorithm.md, 'Low-precision oracles: float32, mixed precision,
    #: bfloat16'); None for float64 arithmetic with noise added to its outputs, or not measured.
    arithmetic_noise: float | None = None
    #: High precision, grid schedules: repair instances that fail the Krawczyk test with extra
    #: queries (docs/algorithm.md, 'Certificate repair: failed instances measured again with their poles pulled apart');
    #: None: the schedule's default (on for the biased grid).
    repair: bool | None = None

    def given(self, option: str) -> bool:
        value = getattr(self, option)
        return value is not None and value is not False


class ScheduleDetails:
    """Schedule-specific diagnostics of a result (``Extraction.details``). Subclasses are
    dataclasses that document their attributes and serialise themselves."""

    #: Every instance was proven to enclose its exact parameters (ball-arithmetic schedules only).
    certified = False

    def summary(self) -> dict:
        """Scalars for the JSON summary."""
        return {}

    def arrays(self) -> dict[str, np.ndarray]:
        """Per-instance arrays for the ``.npz`` file."""
        return {}


@dataclass
class Outcome:
    """What :meth:`Schedule.run` hands back: the heads and what was measured to get them.

    ``sequences`` and ``answers`` are every query the schedule asked and its answer (in the
    arithmetic's numbers); ``sequences`` is a list, or the grid schedules' queries built on demand
    (:class:`mhaextract.oracle.queries.CopiesQueries`, a sequence of arrays like a list);
    ``linearisation`` is what a schedule's certificate needs (or None).
    ``W_balls``, ``v_balls`` (and ``u_balls``, ``c_ball`` when the run learned biases) are the
    parameters as balls in high precision.
    """

    model: MultiHeadAttention | None
    heads: int
    error_estimate: float
    details: ScheduleDetails
    sequences: Sequence
    answers: np.ndarray
    checks: list[Check] = field(default_factory=list)
    W_balls: np.ndarray | None = None
    v_balls: np.ndarray | None = None
    linearisation: object = None
    #: Score biases (H*, d) and output constant as balls: high-precision runs of the biased grid (docs/algorithm.md,
    #: 'Biases: affine scores and an output constant').
    u_balls: np.ndarray | None = None
    c_ball: object = None
    #: The part of ``error_estimate`` that the answers' noise, measured or declared after the run, does
    #: not scale (``finish._undeclared_noise`` scales only the rest): the oracle's rounding of its own
    #: scores (the targeted schedules, docs/algorithm.md, 'The targeted schedule') and the low-rank subspace units'
    #: basis term, sized to the noise the full units showed ('Low-rank heads').
    unscaled_estimate: float = 0.0
    #: The estimated absolute error of the score biases' largest entry, and its part from the oracle's
    #: score rounding (the targeted schedules with biases, docs/algorithm.md, 'The targeted schedule'; zeros otherwise).
    #: Not part of ``error_estimate``: whether u is resolved from zero, and so whether its error is relative to
    #: max|u|, depends on the answers' noise, which ``extract`` measures after the run
    #: (``finish._bias_error``).
    bias_error: tuple[float, float] = (0.0, 0.0)
    #: Every score entry's first-order standard deviation and its part from the oracle's score rounding (the
    #: last axis, as ``unscaled_estimate`` of the estimate), ``(W (H, d, d, 2), u (H, d, 2) or None)``, absolute, at
    #: the noise the schedule assumed (the targeted schedules; None otherwise): the value fit of whole answers
    #: moves the scores by them (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module').
    score_deviations: tuple | None = None


class Schedule:
    """Base class of the query schedules.

    Class attributes
    ----------------
    name : the name ``extract(..., schedule=name)`` takes (unique in the registry).
    accepts : which of ``OPTIONAL`` the schedule supports; the others are refused with ``refusal``.
    """

    name: ClassVar[str]
    #: float64: ask a few fresh queries to measure undeclared answer noise
    #: (:mod:`mhaextract.checks.noise_probe`); False keeps the schedule's exact count.
    probes_noise: ClassVar[bool] = True
    #: ``verify_length=None``: verify the model on fresh long queries after the run (the
    #: ``long_verification`` check, docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement,
    #: verification'); False keeps the schedule's exact count.
    verifies_by_default: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset()
    #: The answers' relative unit the schedule's own error estimate assumed, once it has run (the
    #: targeted schedules size it to the answers, docs/algorithm.md, 'Low-precision oracles: float32, mixed precision,
    #: bfloat16'); None: float64 rounding.
    unit: float | None = None
    #: refine=True fits the schedule's own answers too (with the fresh polish queries); False: the
    #: polish queries alone (the targeted schedules keep only a subsample of their saturated,
    #: long-token queries, poorly conditioned for least squares).
    refines_on_own_answers: ClassVar[bool] = True
    #: float64: the error estimate is at least the answers' residual (relative to the largest answer),
    #: a first-order lower bound of the relative parameter error (``finish._residual_evidence``,
    #: docs/algorithm.md, 'Numerics in float64 and the token scale'); the grid schedules, whose residual limit is then
    #: their error limit.
    residual_evidence: ClassVar[bool] = False
    #: float64, ``refine=None``: refine anyway when the answers are noisy (``answer_error`` declared,
    #: the noise probe's or the links' noise above rounding), and (no polish query only) when the
    #: algebraic result failed a check, with ``noisy_polish_factor`` fresh polish queries per parameter (``finish._refines_when_noisy``,
    #: ``finish.rescued_by_refinement``, docs/algorithm.md, 'The lean schedule' and 'Approximate answers: certificate,
    #: oversampling, refinement, verification').
    refines_when_noisy: ClassVar[bool] = False
    noisy_polish_factor: ClassVar[int] = 1
    refusal: ClassVar[str] = ""

    def __init__(self, settings: RunSettings):
        refused = [option for option in OPTIONAL if option not in self.accepts and settings.given(option)]
        if refused:
            raise ValueError(f"schedule={self.name!r} does not take {', '.join(refused)}: {self.refusal}")
        self.settings = settings
        self.d = settings.d
        self.max_heads = settings.max_heads
        self.token_scale = settings.token_scale

    @property
    def promised_queries(self) -> int:
        """This schedule's own count formula (for comparison; results report measured counts)."""
        raise NotImplementedError

    @property
    def promised_max_length(self) -> int:
        raise NotImplementedError

    @property
    def count_formula(self) -> str:
        """``promised_queries`` as a formula in words (for reports)."""
        raise NotImplementedError

    def fixed_queries(self) -> list[np.ndarray]:
        """The queries known before any answer (hashed into a transcript's fingerprint)."""
        raise NotImplementedError

    def run(self, boundary, arithmetic) -> Outcome:
        """Ask through ``boundary`` (an :class:`~mhaextract.oracle.boundary.OracleBoundary`) and
        compute the heads in ``arithmetic``."""
        raise NotImplementedError

    def thresholds(self) -> tuple[float, float]:
        """``(error_estimate, answers_residual)`` above which the common checks fail."""
        raise NotImplementedError

    def checks(self, outcome: Outcome, label_noise: float = 0.0) -> list[Check]:
        """The schedule's own checks. ``label_noise``: the answers' noise as a fraction of the
        largest answer, when known or estimated above rounding (0 otherwise)."""
        return list(outcome.checks)

    def certificate(self, outcome: Outcome):
        """The first-order error certificate (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
        refinement, verification'), where the schedule has one."""
        return None

    def alternative_start(self, model, instance: int, h: int, g: int):
        """``model`` with heads h and g exchanged where instance ``instance`` decided them: the
        start of a refit of a competing head order (docs/algorithm.md, 'Refuted alternatives'). Only schedules whose
        certificate names link matchings (the grid) have competing orders to refit."""
        raise NotImplementedError(f"the {self.name} schedule's certificate has no link matchings to refit")

    def hints(self, failed: set[str]) -> list[str]:
        """What to try, for the names of the failed checks."""
        return []
