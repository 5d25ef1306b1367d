"""The split of whole answers by head as a learner ("vector", docs/algorithm.md, 'Whole answers
near the vector bound'): every query answers every head. Where the answers cannot be split
(scalar answers, H r > d_out, a model that fails a check) it falls back to the targeted
schedule (:attr:`VectorLearner.falls_back_to`; the low-rank one where ``rank`` is given), whose
result then counts the split's queries and says why.

``schedule="auto"`` hands a run to it after the calibration's probes (:meth:`VectorLearner.takes_over`)
where :func:`split_expected` expects the split to reach its target; a split that then gives way
leaves the run to the schedule ``"auto"`` had chosen, its model unchanged bit for bit.
"""

from __future__ import annotations

import numpy as np

from ..checks.base import Check
from ..oracle.answer_stats import format_unit
from ..oracle.transcript import VECTOR
from ..run.learner import AUTO, FallBack, Learner, given, register_learner
from ..run.validation import rank_option
from ..split.estimate import ERROR_TARGET
from .learn import (REFINE_WORK, SCORE_REFINE_WORK, SplitUnavailable, extract_vector, no_room,
                    refines_fully, refines_scores)

#: A split whose model fails a check gives way to the targeted schedule (True), or is returned
#: failed (False: what ``benchmarks/bench_vector.py --split-only`` measures).
SPLIT_FAILURE_FALLS_BACK = True


def split_expected(options: dict, common, answer_format: str | None, d_out: int | None) -> tuple[bool, str]:
    """``(whether schedule="auto" tries the split, why)`` for answers of ``answer_format`` with
    ``d_out`` numbers each, before any query of the split (docs/algorithm.md, 'Whole answers near
    the vector bound', 'When auto splits the answers').

    It needs whole float64 or float32 answers (``d_out >= 2``), ``heads=H`` declared, ``d >= 2``,
    ``H <= d_out`` and, where ``rank`` bounds the heads' width, ``H rank <= d_out``; no option of the scalar
    schedules' beyond ``bias`` (not False) and ``rank``. And every parameter must be refined on every
    answer (:func:`~mhaextract.vector.learn.refines_fully` with heads of width ``r``, the rank given
    or else ``min(d, d_out // H)``, the widest heads whose subspaces fit in ``d_out``), or the scores'
    parameters (:func:`~mhaextract.vector.learn.refines_scores`, the same line in float64 and float32:
    the work counts the oversampled design's answers, which float32 asks wherever it is refined):
    GPT-2-class d = 256, H = 8 and 4 pass every check there in both formats (float32: about 7,900
    queries against the targeted schedule's 0.8..1.6 million, at 1.0..1.7 times its CPU and 5..6
    times its output error, estimate inside its limit; docs/algorithm.md gives the numbers). Where
    neither runs (GPT-2 small, d = 768, H = 12) the run is not taken: past that line the split's start
    is the model, measured to reach its target (float64 1.4e-13; float32 9.9e-6 against its 1e-5, at its
    edge), and a split that gave way would only add its queries and minutes to the scalar schedule's."""
    heads = common.heads
    if answer_format not in ERROR_TARGET or d_out is None or d_out < 2:
        return False, f"answers of {d_out or 1} number(s) at {answer_format}: the split needs whole float64 or float32 ones"
    if heads is None:
        return False, "the split needs the number of heads declared (heads=H)"
    if common.precision is not None:
        return False, "precision=bits runs the high-precision schedules"
    scalar = sorted(name for name, value in options.items()
                    if (name not in VectorLearner.options and given(value)) or (name == "bias" and value is False))
    if scalar:
        return False, f"options of the scalar schedules given ({', '.join(scalar)})"
    rank = options.get("rank")
    declared = isinstance(rank, (int, np.integer)) and not isinstance(rank, bool)
    why = no_room(common.d, heads, int(rank) if declared else None, d_out)
    if why:
        return False, why
    width = int(rank) if declared else min(common.d, d_out // heads)
    full, work = refines_fully(common.d, [width] * heads, format_unit(answer_format))
    words = (f"heads of width r = {width} ({'rank given' if declared else 'at most d_out / H'}): one Jacobian "
             f"product of the full refinement about {work:.2g} multiply-adds")
    if full:
        return True, f"{words} <= {REFINE_WORK:.0e}: every parameter is refined on every answer"
    scores, score_work = refines_scores(common.d, [width] * heads)
    words = f"{words}, above {REFINE_WORK:.0e}; one of the scores-only refinement about {score_work:.2g}"
    if not scores:
        return False, (f"{words}, above {SCORE_REFINE_WORK:.0e}: past it the split's start is the model, measured to "
                       f"reach its target at d = 768, H = 12 (float32 at its edge: 9.9e-6 against 1e-5; "
                       f"schedule='vector' runs it)")
    return True, f"{words} <= {SCORE_REFINE_WORK:.0e}: the scores' parameters are refined on every answer"


@register_learner
class VectorLearner(Learner):
    """Whole answers split by the heads' output subspaces, scores from attention weights,
    Gauss-Newton refinement (:mod:`mhaextract.vector.learn`)."""

    name = "vector"
    family = "vector"
    model = "multi-head attention, whole (W_h, V_h, u_h, c), from float64 or float32 vector answers"
    options = {"bias": "always learned: True or None",
               "rank": "the heads' width where known: the split is not tried where H rank > d_out, and gives way "
                       "to the low-rank schedule"}
    refusal = "the split learns the model with biases in float64 from whole answers, its heads' widths found by queries"
    falls_back_to = "targeted"

    @classmethod
    def takes_over(cls, options, common, answer_format, d_out) -> bool:
        return split_expected(options, common, answer_format, d_out)[0]

    @classmethod
    def passes_over(cls, options, common, answer_format, d_out) -> str | None:
        """Why whole float64 or float32 answers were not split (none for scalar or coarser answers)."""
        if answer_format not in ERROR_TARGET or d_out is None or d_out < 2:
            return None
        expected, why = split_expected(options, common, answer_format, d_out)
        return None if expected else why

    @classmethod
    def validate(cls, options, common) -> dict:
        bias = options.get("bias")
        if bias is not None and not bias or common.precision is not None:
            raise ValueError(f"schedule='vector' learns the model with biases in float64 from whole answers, its "
                             f"heads' widths found by queries; it does not take bias=False or precision "
                             f"(got bias={bias!r}, precision={common.precision!r})")
        return dict(options, bias=True, rank=rank_option(options.get("rank"), common.d, "the heads' width"))

    def give_way(self, reason: str, boundary=None) -> FallBack:
        """The fallback to the scalar schedules: the low-rank one where ``rank`` was given (it takes it),
        else :attr:`falls_back_to`."""
        return FallBack(reason, boundary, to="lowrank" if self.options.get("rank") is not None else None)

    def run(self):
        session, request = self.session, self.session.request
        scale = request.token_scale
        session.open_transcript({"d": request.d, "max_heads": request.max_heads, "seed": request.seed,
                                 "precision": None, "schedule": self.name, "bias": True,
                                 "token_scale": "auto" if scale in (None, "auto") else float(scale).hex()})
        calibration = session.calibrate()
        vectors = session.vectors
        if request.heads is None:
            raise self.give_way("the split was not tried: it needs the number of heads declared (heads=H)")
        if (vectors.d_out or 1) == 1 or calibration.answer_precision not in ERROR_TARGET:
            raise self.give_way(f"the split was not tried: it needs whole answers in float64 or float32 (these are "
                                f"{vectors.d_out or 1} number(s) at {calibration.answer_precision})")
        rank = self.options.get("rank")
        why = no_room(request.d, request.heads, rank if isinstance(rank, int) else None, vectors.d_out)
        if why:
            raise self.give_way(f"the split was not tried: {why}")
        unit = max(vectors.unit, format_unit(calibration.answer_precision))
        boundary = session.boundary(VECTOR)
        try:
            result = extract_vector(boundary, request.seed, request.d, request.heads, calibration.token_scale, unit,
                                    calibration.answer_precision, session.verify_length, session.progress)
        except SplitUnavailable as why:
            raise self.give_way(f"whole answers could not be split by head ({why})", boundary) from None
        except np.linalg.LinAlgError as why:  # a factorisation of the split failed: it cannot work here
            if getattr(why, "raised_by_oracle", False):  # the oracle's own exception: the caller's, unchanged
                raise
            raise self.give_way(f"whole answers could not be split by head (a factorisation of the split failed "
                                f"({why}))", boundary) from None
        if not result.ok and SPLIT_FAILURE_FALLS_BACK:  # never a guess: the scalar schedules run instead
            failed = Check.failures(result.checks)
            raise self.give_way(f"whole answers could not be split by head (its model failed its checks: {failed})",
                                boundary)
        session.close()
        chosen = ""
        if session.requested == AUTO:
            chosen = f"auto: {split_expected(self.options, request, calibration.answer_precision, vectors.d_out)[1]}; "
        result.schedule_reason = (
            f"{chosen}whole answers of d_out = {vectors.d_out} numbers ({calibration.answer_precision}) and H = "
            f"{request.heads} declared: the heads' output subspaces split the answers (ranks {result.value_ranks}, "
            f"condition number {result.split_conditioning:.3g}), every query answers every head (docs/algorithm.md, "
            f"'Whole answers near the vector bound'); model with biases (u_h, c)")
        return session.finish(result, "vector extraction (whole answers split by head)")
