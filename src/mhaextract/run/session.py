"""What every run shares, whatever learns in it: the oracle behind its boundaries, the validated
common parameters, the transcript, the calibration, the resume check, and the accounting of
queries that ends in the result.

A :class:`Session` is made by :func:`mhaextract.extract` after it validated the common
parameters once (:class:`Request`); the learner it picked
(:mod:`mhaextract.run.learner`) asks through :meth:`Session.boundary`, calibrates through
:meth:`Session.calibrate` (the probes are counted once, however many learners use them) and
hands its result to :meth:`Session.finish`, which adds the counts of what the session asked for
it (calibration probes, a learner that fell back) and raises or warns on a failed check with the
learner's hints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..checks.base import report_failure
from ..oracle.boundary import OracleBoundary
from ..oracle.resume_check import check_replayed, check_same_oracle
from ..oracle.transcript import CALIBRATION, RUN, Transcript, check_directory
from ..oracle.vector_answers import VectorAnswers
from .calibration import calibrate, probe_queries
from .learner import FallBack, learner_class, pick
from .validation import (head_count, on_failure_mode, positive_int, resumable_seed, seed_option, spawn_rng,
                         token_scale_option)


@dataclass(frozen=True)
class Request:
    """The common parameters of one run, validated once: ``d``; ``heads`` (the declared H, or
    None) and ``max_heads`` (H0: the declared H or the bound); ``precision`` (bits, None for
    float64); ``seed``; ``token_scale`` (``"auto"``, a number, or None: the learner's default)."""

    d: int
    heads: int | None
    max_heads: int
    precision: int | None
    seed: object
    token_scale: object = None

    @classmethod
    def validated(cls, d, heads, max_heads, precision, seed, token_scale) -> "Request":
        d = positive_int("d", d)
        H0, declared = head_count(heads, max_heads)
        if precision is not None:
            precision = positive_int("precision", precision, minimum=64)
        return cls(d, declared, H0, precision, seed_option(seed), token_scale_option(token_scale))


@dataclass
class Asked:
    """Queries the session asked on a result's behalf before its learner ran (added by :meth:`Session.finish`)."""

    asked: int = 0
    replayed: int = 0

    def add(self, boundary) -> None:
        self.asked += boundary.queries
        self.replayed += boundary.replayed


class Session:
    """One run's shared state (module docstring). Attributes: ``oracle``, ``request``,
    ``options`` (the learner's validated family options), ``batch_size``, ``progress``,
    ``on_failure``, ``max_queries`` (what is left of the budget), ``resume_check``,
    ``verify_length``, ``vectors`` (the read-out of whole answers every boundary shares),
    ``record`` (the :class:`~mhaextract.oracle.transcript.Transcript` once opened),
    ``calibration`` and ``probes`` (its boundary) once calibrated, ``started``."""

    def __init__(self, oracle, request: Request, *, batch_size=1024, progress=None, on_failure="raise",
                 transcript=None, max_queries=None, resume_check=3, verify_length=None):
        from ..checks.verify import verify_length_option

        self.oracle = oracle
        self.request = request
        self.options: dict = {}
        self.batch_size = batch_size
        self.progress = progress
        self.on_failure = on_failure_mode(on_failure)
        if max_queries is not None:
            max_queries = positive_int("max_queries", max_queries, minimum=0)
        self.max_queries = self.query_budget = max_queries  # what is left, and what the user gave
        self.spent: list[tuple[str, int]] = []  # (what, fresh queries) taken off max_queries before the boundary asking
        self.transcript = transcript
        if transcript is not None:
            resumable_seed(request.seed)
            check_directory(transcript)  # before any query: nothing is asked for a run that cannot record
        self.resume_check = positive_int("resume_check", resume_check, minimum=0)
        self.verify_length = verify_length_option(verify_length)
        self.answer_dtype = getattr(oracle, "answer_dtype", None)
        self.vectors = VectorAnswers(request.seed, self.answer_dtype)
        self.record: Transcript | None = None
        self.calibration = None
        self.probes: OracleBoundary | None = None
        self.pending_check = 0
        self.requested = None  # the schedule name the user gave ("auto" or a learner's)
        self.given_options: dict = {}  # the family options the user gave, before any learner's defaults
        self.boundaries: list[OracleBoundary] = []  # those whose replayed queries the resume check may re-ask
        self.fallbacks: list[tuple[str, OracleBoundary]] = []
        self.started = time.perf_counter()

    # -- the transcript --------------------------------------------------------------------------
    def open_transcript(self, header: dict) -> None:
        """Open the run's transcript under ``header`` (what identifies the run before any query),
        once; a resumed one arms the resume check (re-asked by :meth:`calibrate` or by the learner)."""
        if self.transcript is None or self.record is not None:
            return
        self.record = Transcript(self.transcript, header)
        self.pending_check = self.resume_check if self.record.resumed else 0

    def section(self, name: str):
        return None if self.record is None else self.record.section(name)

    def close(self) -> None:
        if self.record is not None:
            self.record.close()

    # -- boundaries ------------------------------------------------------------------------------
    def boundary(self, section: str = RUN, precision=None, max_queries="left", resume_check=True) -> OracleBoundary:
        """A counted boundary to the oracle recording in the transcript's ``section``; the budget
        is what is left of ``max_queries`` after the session's earlier boundaries. ``resume_check``: a
        resumed transcript's check, if still due, re-asks a few of this boundary's replayed queries
        before its first fresh one (or when the run ends, :meth:`finish`)."""
        boundary = OracleBoundary(self.oracle, self.request.d, precision=precision, batch_size=self.batch_size,
                                  progress=self.progress,
                                  max_queries=self.max_queries if max_queries == "left" else max_queries,
                                  transcript=self.section(section), vectors=self.vectors,
                                  budget_spent=self._spent_note() if max_queries == "left" else "")
        if resume_check and self.pending_check and boundary.transcript is not None:
            # a learner that does not re-ask its fixed queries first (check_resumed): before its first
            # fresh query, or at the end of a run read back whole, a few of its replayed ones are re-asked
            boundary.before_fresh = self._check_replayed
            self.boundaries.append(boundary)
        return boundary

    def spend(self, boundary, what: str) -> None:
        """Take ``boundary``'s fresh queries off the budget left to later boundaries (``what`` asked
        them: said where a later boundary runs out)."""
        if self.max_queries is not None:
            self.max_queries = max(0, self.max_queries - boundary.queries)
            self.spent.append((what, boundary.queries))

    def _spent_note(self) -> str:
        """What the budget left to a new boundary is, in words ("" where nothing was spent)."""
        if self.max_queries is None or not any(count for _, count in self.spent):
            return ""
        return (f"the {self.max_queries} left of max_queries={self.query_budget} after "
                + ", ".join(f"{what} ({count})" for what, count in self.spent if count))

    # -- calibration -------------------------------------------------------------------------------
    def calibrate(self, on_first=None):
        """The token scale from counted probe queries (docs/algorithm.md, 'Choosing the token scale
        from queries'), once per session, on a seed stream of its own, recorded in the transcript's
        calibration section; a resumed transcript whose run section is still empty re-asks its
        recorded probes first. ``on_first``: :func:`~mhaextract.run.calibration.calibrate`'s."""
        if self.calibration is not None:
            return self.calibration
        early = self.pending_check if self.record is not None and self.record.answered_in(RUN) == 0 else 0
        probes = self.boundary(CALIBRATION, precision=self.request.precision, resume_check=False)
        section = self.section(CALIBRATION)
        if early and section.answered:
            self.recheck_probes(probes, early)
        self.calibration = calibrate(probes, self.request.d, spawn_rng(self.request.seed, 3), on_first)
        self.probes = probes
        self.pending_check -= early
        self.spend(probes, "the calibration's probes")
        return self.calibration

    def recheck_probes(self, probes, count: int, noise: float | None = None) -> None:
        """Re-ask ``count`` of the calibration's recorded probes through ``probes``
        (:mod:`mhaextract.oracle.resume_check`); TranscriptError when the oracle answers differently."""
        queries = [sequence for group in probe_queries(self.request.d, spawn_rng(self.request.seed, 3))
                   for sequence in group]
        # from 1: the zero query answers the constant c alone (0 for a bias-free layer, whatever its heads)
        check_same_oracle(probes, self.section(CALIBRATION), queries, count, first=1, noise=noise)

    def check_resumed(self, boundary, fixed_queries, noise=None) -> None:
        """A resumed transcript: re-ask what is left of the resume check among ``fixed_queries`` (the
        learner's queries known before any answer) through ``boundary``."""
        if self.pending_check:
            check_same_oracle(boundary, boundary.transcript, fixed_queries, self.pending_check, noise=noise)
            self.pending_check = 0

    def _check_replayed(self, boundary) -> None:
        if self.pending_check and boundary.replayed_samples:
            check_replayed(boundary, boundary.transcript, boundary.replayed_samples, self.pending_check)
            self.pending_check = 0

    # -- the end of a run ------------------------------------------------------------------------
    def fall_back(self, learner_name: str, reason: str, boundary) -> None:
        """Record a learner that gave way (its queries count in the final result)."""
        self.fallbacks.append((f"{learner_name}: {reason}", boundary))
        if boundary is not None:
            self.spend(boundary, f"{learner_name}, which gave way")

    def finish(self, result, what: str, hints=(), error_type=None, probes_counted: bool = False):
        """Add the queries the session asked for ``result`` (calibration probes, learners that fell
        back), then raise or warn if a check failed (``on_failure``), with ``hints``."""
        for boundary in self.boundaries:  # a run read back whole: its resume check is still due
            if boundary.before_fresh is not None:
                boundary.before_fresh = None
                asked = boundary.queries
                self._check_replayed(boundary)
                result.queries += boundary.queries - asked
                result.queries_asked += boundary.queries - asked
        spent = Asked()
        if self.probes is not None and not probes_counted:
            spent.add(self.probes)
            result.calibration_queries = self.probes.queries + self.probes.replayed
        for reason, boundary in self.fallbacks:
            if boundary is not None:
                spent.add(boundary)
                result.split_queries = getattr(result, "split_queries", 0) + boundary.queries + boundary.replayed
            result.schedule_reason += ("; " if result.schedule_reason else "") + (
                reason if boundary is None else f"{reason}, after {boundary.queries + boundary.replayed} queries")
        if spent.asked or spent.replayed:
            result.queries += spent.asked + spent.replayed
            result.queries_asked += spent.asked
            result.queries_replayed += spent.replayed
        report_failure(result, what, self.on_failure, error_type=error_type, hints=hints)
        return result


def run_learner(oracle, request: Request, schedule, options: dict, **common):
    """Pick the learner for ``schedule`` (a name, or ``"auto"``), refuse the options it does not
    take, and run it in a new :class:`Session` of ``oracle`` with the ``common`` options; a learner
    that falls back hands the session to the one it names. What :func:`mhaextract.extract` runs
    after validating its parameters."""
    learner = pick(schedule, options, request)  # (an unknown name: the ValueError listing the names there are)
    learner.refuse(options)
    given, options = options, learner.validate(options, request)
    session = Session(oracle, request, **common)
    session.requested, session.options, session.given_options = schedule, options, given
    while True:
        try:
            return learner(session, options).run()
        except FallBack as fallback:  # the learner gave way: the one it names runs in the same session
            session.fall_back(learner.name, fallback.reason, fallback.boundary)
            if fallback.to is None:
                learner = learner_class(learner.falls_back_to)
                options = learner.validate(options, request)
            else:  # a learner of another model (learner.successor): from the options the user gave
                learner = learner_class(fallback.to)
                options = learner.validate(given, request)
