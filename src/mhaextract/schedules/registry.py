"""The one place where schedule names are known: ``extract(..., schedule=NAME)`` looks them up here.

Adding a schedule: one module with a :class:`~.base.Schedule` subclass, and one line below.
"""

from __future__ import annotations

from .base import Schedule
from .lean import LeanSchedule
from .lowrank import LowRankSchedule
from .paper import PaperSchedule
from .targeted import TargetedSchedule

SCHEDULES: dict[str, type[Schedule]] = {}


def register(schedule: type[Schedule]) -> type[Schedule]:
    """Make ``schedule`` available under ``schedule.name`` (usable as a class decorator)."""
    if not (isinstance(schedule, type) and issubclass(schedule, Schedule)):
        raise TypeError(f"a schedule must be a Schedule subclass, got {schedule!r}")
    if schedule.name in SCHEDULES and SCHEDULES[schedule.name] is not schedule:
        raise ValueError(f"a schedule named {schedule.name!r} is already registered")
    SCHEDULES[schedule.name] = schedule
    return schedule


def schedule_names() -> list[str]:
    return list(SCHEDULES)


def schedule_for(d: int, max_heads: int, precision) -> type[Schedule]:
    """The schedule the core would choose for a run of ``max_heads`` heads in dimension ``d``.

    Ball arithmetic (``precision=bits``): the paper schedule (exact count, certified, any H;
    docs/algorithm.md §5, §7). float64: the targeted schedule when ``max_heads <= d`` (single-pole
    instances, machine precision whatever H is, §13), else the paper schedule (the only float64
    schedule for H > d; its checks flag H >= 5).
    """
    if precision is None and max_heads <= d:
        return SCHEDULES["targeted"]
    return SCHEDULES["paper"]


def schedule_class(name) -> type[Schedule]:
    """The schedule registered as ``name``, or a ValueError listing the names there are."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {schedule_names()}, got {name!r}")
    return SCHEDULES[name]


register(PaperSchedule)
register(LeanSchedule)
register(TargetedSchedule)
register(LowRankSchedule)
