"""The one interface every way of learning shares, and the one registry of them.

A *learner* turns a :class:`~mhaextract.run.session.Session` (the oracle behind its boundary,
the validated common parameters, the transcript, the calibration) into a
:class:`~mhaextract.run.result.Result`. Each family of layers registers its learners here under
the names ``extract(..., schedule=NAME)`` takes: the attention family's schedules ("paper",
"lean", "targeted", "lowrank"), the low-precision start ("saturated"), the split of whole answers
("vector"), rotary attention ("rotary"), the one-layer Transformer ("transformer"), and whatever
comes next (docs/adding-a-learner.md). Nothing here, in the session or in
:func:`mhaextract.extract` names a family.

How ``schedule="auto"`` picks, in three moments, each a class method a learner may override:

1. before any query, :meth:`Learner.claims` on the family options given (``positions="rotary"``
   is claimed by the rotary learner); the first claimant in registry order runs;
2. after the shared calibration's probes, :meth:`Learner.takes_over` on what the answers showed
   (their format, their width ``d_out``): answers of 8 or 11 bits belong to the low-precision
   learner, whole float64 or float32 answers with the heads declared to the split of whole answers
   where it is expected to reach its target; the learner then runs instead, in the same session.
   One that gives way there (:class:`FallBack`) leaves the run to the learner ``"auto"`` had chosen,
   its queries counted; one that declines answers of its kind says why (:meth:`Learner.passes_over`),
   appended to ``result.schedule_reason``;
3. a learner that finds the answers outside its reach raises :class:`FallBack` naming the learner
   to run instead (:attr:`Learner.falls_back_to`, or the one :func:`successor` finds for what a
   failed run's model-class probes showed, :meth:`Learner.explains`); its queries count in the
   result, and the reason is appended to ``result.schedule_reason``.

Examples
--------
>>> from mhaextract.run.learner import learner_names, learner_class
>>> sorted(learner_names())[:3]
['auto', 'lean', 'lowrank']
>>> learner_class("rotary").family
'rotary'
"""

from __future__ import annotations

from typing import ClassVar

#: The name that lets the registry choose.
AUTO = "auto"
#: The options of ``extract`` every learner takes (validated by the session): not family options.
COMMON = ("token_scale", "batch_size", "progress", "on_failure", "transcript", "max_queries", "resume_check",
          "verify_length")


class FallBack(Exception):
    """Raised by a learner whose answers it cannot learn from: the session runs the learner named
    ``to`` (default ``learner.falls_back_to``) instead, counting ``boundary``'s queries and appending
    ``reason``."""

    def __init__(self, reason: str, boundary=None, to: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.boundary = boundary
        self.to = to


class Learner:
    """Base class of the learners: one per way of learning, registered by name.

    Subclasses set the class attributes and override :meth:`run` (and where they take part in
    ``"auto"``, :meth:`claims` or :meth:`takes_over`).

    Class attributes
    ----------------
    name : the registry name (``extract(..., schedule=name)``, ``result.schedule``).
    family : the family it belongs to (a folder of the package: "attention", "rotary", ...).
    model : what it learns, in words (for the registry's table).
    options : the family options of ``extract`` it takes, name -> what it means; every other family
        option given is refused with :attr:`refusal` before any query.
    defaults : family options' values when not given (None: the learner decides).
    refusal : why the options it does not take do not apply to it.
    priority : order in which ``"auto"`` asks :meth:`claims` (lower first); None: never picked by
        ``"auto"`` before a query.
    falls_back_to : the learner run instead when :meth:`run` raises :class:`FallBack`.
    """

    name: ClassVar[str]
    family: ClassVar[str]
    model: ClassVar[str] = ""
    options: ClassVar[dict[str, str]] = {}
    defaults: ClassVar[dict] = {}
    refusal: ClassVar[str] = ""
    priority: ClassVar[int | None] = None
    falls_back_to: ClassVar[str | None] = None

    def __init__(self, session, options: dict):
        self.session = session
        self.options = options

    @classmethod
    def refuse(cls, options: dict) -> None:
        """A ValueError naming the family options given that this learner does not take, and why."""
        refused = [name for name, value in options.items() if name not in cls.options and given(value)]
        if refused:
            owners = [f"{name} (an option of {', '.join(repr(learner.name) for learner in LEARNERS.values() if name in learner.options)})"
                      for name in refused]
            raise ValueError(f"schedule={cls.name!r} does not take {', '.join(owners)}: {cls.refusal}")

    @classmethod
    def validate(cls, options: dict, common) -> dict:
        """The options this learner takes, checked (ValueError naming the bad one); ``common``: the
        validated common parameters (:class:`~mhaextract.run.session.Request`)."""
        return dict(options)

    @classmethod
    def claims(cls, options: dict, common) -> bool:
        """``schedule="auto"``, before any query: whether this learner runs for these options."""
        return False

    @classmethod
    def takes_over(cls, options: dict, common, answer_format: str | None, d_out: int | None) -> bool:
        """``schedule="auto"``, after the calibration's first answers: whether answers of
        ``answer_format`` with ``d_out`` numbers each (None: not seen yet) belong to this learner."""
        return False

    @classmethod
    def passes_over(cls, options: dict, common, answer_format: str | None, d_out: int | None) -> str | None:
        """``schedule="auto"``, where :meth:`takes_over` declined: why, in words, when the answers are
        of the kind this learner learns from (None: they are not, or no reason to give; the default)."""
        return None

    @classmethod
    def explains(cls, evidence) -> str | None:
        """After a failed ``schedule="auto"`` run: what in ``evidence`` (the run's
        :class:`~mhaextract.checks.model_class.ModelClassEvidence`) makes the oracle this learner's,
        in words, or None (default: nothing does)."""
        return None

    @classmethod
    def fixed_queries(cls, request, options: dict):
        """The queries this learner asks before any answer, in order (None: every query depends on
        earlier answers). What a run built on this learner fingerprints (the Transformer's step 1)."""
        return None

    @classmethod
    def refused_settings(cls, options: dict, common) -> list[str]:
        """Common parameters or option values this learner cannot run with, each with why (for
        the refusal when it takes over answers, :meth:`takes_over`); none by default."""
        return []

    def run(self):
        """Ask through the session's boundaries and return a :class:`~mhaextract.run.result.Result`."""
        raise NotImplementedError


def given(value) -> bool:
    """An option counts as given when it is neither None nor False (``positions="none"`` is the
    no-positions default)."""
    return value is not None and value is not False and value != "none"


LEARNERS: dict[str, type[Learner]] = {}


def register_learner(learner: type[Learner]) -> type[Learner]:
    """Make ``learner`` available under ``learner.name`` (a class decorator)."""
    if not (isinstance(learner, type) and issubclass(learner, Learner)):
        raise TypeError(f"a learner must be a Learner subclass, got {learner!r}")
    if not isinstance(getattr(learner, "name", None), str) or learner.name == AUTO:
        raise ValueError(f"a learner needs a name other than {AUTO!r}, got {getattr(learner, 'name', None)!r}")
    if learner.name in LEARNERS and LEARNERS[learner.name] is not learner:
        raise ValueError(f"a learner named {learner.name!r} is already registered "
                         f"({LEARNERS[learner.name].__module__})")
    LEARNERS[learner.name] = learner
    return learner


def learner_names() -> list[str]:
    return list(LEARNERS) + [AUTO]


def learner_class(name) -> type[Learner]:
    """The learner registered as ``name``, or a ValueError listing the names there are."""
    if not isinstance(name, str) or name not in LEARNERS:
        raise ValueError(f"schedule must be one of {learner_names()}, got {name!r}")
    return LEARNERS[name]


def family_options() -> set[str]:
    """Every family option some learner takes (``extract`` accepts exactly these beyond the common ones)."""
    return {option for learner in LEARNERS.values() for option in learner.options}


def pick(name, options: dict, common) -> type[Learner]:
    """The learner that runs: ``name`` itself, or for ``"auto"`` the first claimant (registry
    order by ``priority``); a ValueError when none claims (no learner takes these options)."""
    if name != AUTO:
        return learner_class(name)
    for learner in sorted((learner for learner in LEARNERS.values() if learner.priority is not None),
                          key=lambda learner: learner.priority):
        if learner.claims(options, common):
            return learner
    taken = sorted(option for option, value in options.items() if given(value))
    raise ValueError(f"schedule='auto' found no learner for the options {taken}: name one of {learner_names()}")


def successor(evidence, options: dict, common) -> tuple[type[Learner], str] | None:
    """The learner that a failed ``"auto"`` run hands the session to, and why: the first whose
    :meth:`Learner.explains` names ``evidence`` and which takes the ``options`` the user gave
    (``refuse``, ``validate``); None when none does (the failed run is reported as it is)."""
    for learner in LEARNERS.values():
        why = learner.explains(evidence)
        if why is None:
            continue
        try:
            learner.refuse(options)
            learner.validate(options, common)
        except ValueError:
            continue
        return learner, why
    return None


def takeover(options: dict, common, answer_format, d_out) -> type[Learner] | None:
    """The learner that takes over answers of ``answer_format`` and ``d_out`` (None: none)."""
    for learner in LEARNERS.values():
        if learner.takes_over(options, common, answer_format, d_out):
            return learner
    return None


def passed_over(options: dict, common, answer_format, d_out) -> list[tuple[str, str]]:
    """``(name, why)`` of each learner that declined answers of its kind (:meth:`Learner.passes_over`)."""
    reasons = ((learner.name, learner.passes_over(options, common, answer_format, d_out))
               for learner in LEARNERS.values())
    return [(name, why) for name, why in reasons if why is not None]


def options_table() -> list[tuple[str, str, str, str]]:
    """``(name, family, model, options)`` per learner: what the docs and ``mhaextract schedules`` show."""
    return [(learner.name, learner.family, learner.model, ", ".join(sorted(learner.options)) or "-")
            for learner in LEARNERS.values()]


def option_meanings() -> list[tuple[str, str, str]]:
    """``(option, learners, meaning)``: each family option with what it means to the learners that
    take it (one row per distinct meaning: ``rank`` bounds every W_h for the attention schedules
    and is the head width for rotary)."""
    rows: dict[tuple[str, str], list[str]] = {}
    for learner in LEARNERS.values():
        for option, meaning in learner.options.items():
            rows.setdefault((option, meaning), []).append(learner.name)
    return [(option, ", ".join(names), meaning) for (option, meaning), names in sorted(rows.items())]
