"""The one place where schedule names are known: ``extract(..., schedule=NAME)`` looks them up here.

Adding a schedule: one module with a :class:`~.base.Schedule` subclass (or a family of them in a
subpackage, as :mod:`.targeted`), and one line below.
``schedule="auto"`` and the model with biases (docs/algorithm.md, 'Biases: affine scores and an output constant') are
resolved here too (:func:`choose`): which class runs, whether it learns biases, whether the token scale is
calibrated by queries ('Choosing the token scale from queries'), and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Schedule
from .biased_grid import BiasedGridSchedule
from .lean import LeanSchedule
from .paper import PaperSchedule
from .targeted import BiasedLowRankSchedule, BiasedTargetedSchedule, LowRankSchedule, TargetedSchedule

SCHEDULES: dict[str, type[Schedule]] = {}


def register(schedule: type[Schedule]) -> type[Schedule]:
    """Make ``schedule`` available under ``schedule.name`` (usable as a class decorator)."""
    if not (isinstance(schedule, type) and issubclass(schedule, Schedule)):
        raise TypeError(f"a schedule must be a Schedule subclass, got {schedule!r}")
    if schedule.name in SCHEDULES and SCHEDULES[schedule.name] is not schedule:
        raise ValueError(f"a schedule named {schedule.name!r} is already registered")
    SCHEDULES[schedule.name] = schedule
    for hook in ON_REGISTER:
        hook(schedule)
    return schedule


#: Called with each schedule registered (:mod:`.learner` makes it a learner of the run's registry).
ON_REGISTER: list = []


#: The name that lets the registry choose (:func:`choose`).
AUTO = "auto"
#: The class that learns the biased model (docs/algorithm.md, 'Biases: affine scores and an output constant') in place
#: of a registered schedule, where there is one.
BIASED: dict[type[Schedule], type[Schedule]] = {}
#: Schedules that, named explicitly, learn biases and calibrate the token scale by default, as
#: ``schedule="auto"`` does (the others reproduce the paper's setting: bias-free model, token scale
#: ``d ** 0.25``). Trained layers need both: GPT-2's and ViT's biases break every bias-free instance's
#: saturation, and BERT's small W hides its heads at ``d ** 0.25`` (docs/trained-layers.md).
REAL_LAYER_DEFAULTS: set[type[Schedule]] = set()


def schedule_names() -> list[str]:
    return list(SCHEDULES) + [AUTO]


def known_schedule(name) -> str:
    """``name`` if it is a schedule name or ``"auto"``, else a ValueError listing the names."""
    if name != AUTO:
        schedule_class(name)
    return name


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: the class that runs, whether it learns biases, whether the
    token scale is calibrated by default, and the reason (reported as ``Extraction.schedule_reason``)."""

    schedule: type[Schedule]
    bias: bool
    calibrate: bool
    reason: str


def choose(name, d: int, max_heads: int, precision, bias, rank=None, requested=None) -> Choice:
    """Resolve ``schedule=name`` and ``bias`` (None: the schedule's default) for a run; ``rank`` (a
    bound, or ``"auto"``) sends ``schedule="auto"`` to the low-rank schedule. ``requested``: the
    schedule the caller named, where it is another learner that gave way to ``name`` (the reason
    says so)."""
    known_schedule(name)
    if name == AUTO:
        learns = True if bias is None else bool(bias)
        if rank is not None and precision is None and max_heads <= d:
            cls, reason = SCHEDULES["lowrank"], (
                f"auto: rank={rank!r} given, float64 arithmetic (precision=None) and H0 = {max_heads} <= d = {d}: the "
                "low-rank schedule, targeted instances in each head's row space, about 2.1H(2dr - r^2) queries "
                "(docs/algorithm.md, 'Low-rank heads')")
        elif rank is not None:
            raise ValueError(f"rank={rank!r} is for the float64 low-rank schedule (docs/algorithm.md, "
                             "'Low-rank heads'), which "
                             f"needs precision=None and H0 <= d (got precision={precision}, H0 = {max_heads}, "
                             f"d = {d}): drop rank, or precision")
        elif precision is None and max_heads <= d:
            cls, reason = SCHEDULES["targeted"], (
                f"auto: float64 arithmetic (precision=None) and H0 = {max_heads} <= d = {d}: targeted single-pole "
                "instances keep the answers' precision for any H (docs/algorithm.md, 'The targeted schedule'); the "
                "paper schedule loses ~3 digits per head")
        elif precision is None:
            cls, reason = SCHEDULES["paper"], (
                f"auto: float64 arithmetic (precision=None) with H0 = {max_heads} > d = {d} rules out the targeted "
                "schedule; the paper's grid "
                + ("(with biases the biased grid, docs/algorithm.md, "
                   "'Biases: affine scores and an output constant') " if learns else "")
                + "is reliable in float64 only for H <= 2: prefer precision=BITS")
        elif learns:
            cls, reason = SCHEDULES["paper"], (
                f"auto: precision={precision}: the biased grid (the paper's grid on d + 1 affine final tokens, "
                "docs/algorithm.md, 'Biases: affine scores and an output constant'), its interpolation certified in "
                "ball arithmetic ('Kernels in ball arithmetic and certification')")
        else:
            cls, reason = SCHEDULES["paper"], (
                f"auto: precision={precision}: the paper schedule's interpolation is certified in ball arithmetic "
                "(docs/algorithm.md, 'The paper schedule' and 'Kernels in ball arithmetic and certification')")
        calibrate = True
    else:
        cls = schedule_class(name)
        learns = (cls in REAL_LAYER_DEFAULTS) if bias is None else bool(bias)
        calibrate = cls in REAL_LAYER_DEFAULTS
        reason = (f"schedule={name!r} given" if requested in (None, AUTO, name) else
                  f"schedule={requested!r} given, which gave way to schedule={name!r}")
    if learns and cls not in BIASED:
        with_bias = sorted({klass.name for klass in BIASED})
        raise ValueError(f"schedule={cls.name!r} learns the bias-free model only; pass bias=False, or "
                         f"schedule='auto' or one of {with_bias} to learn score biases and the output constant")
    if learns:
        cls = BIASED[cls]
    return Choice(cls, learns, calibrate, reason + ("; model with biases (u_h, c)" if learns else "; bias-free model"))


def schedule_for(d: int, max_heads: int, precision) -> type[Schedule]:
    """The bias-free schedule ``schedule="auto"`` would run for ``max_heads`` heads in dimension ``d``
    (see :func:`choose`): targeted in float64 for ``max_heads <= d``, else the paper schedule."""
    return choose(AUTO, d, max_heads, precision, bias=False).schedule


def schedule_class(name) -> type[Schedule]:
    """The schedule registered as ``name``, or a ValueError listing the names there are."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {schedule_names()}, got {name!r}")
    return SCHEDULES[name]


register(PaperSchedule)
register(LeanSchedule)
register(TargetedSchedule)
register(LowRankSchedule)
BIASED[TargetedSchedule] = BiasedTargetedSchedule
BIASED[PaperSchedule] = BiasedGridSchedule
BIASED[LowRankSchedule] = BiasedLowRankSchedule
REAL_LAYER_DEFAULTS.update({TargetedSchedule, LowRankSchedule})
