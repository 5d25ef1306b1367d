"""The low-precision start as a learner ("saturated"): whole answers at 8 or 11 bits
(docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least squares').

``schedule="auto"`` hands a run to it when the oracle declares bfloat16 or float16 answers, or
when the calibration's first answers show that format's few bits (:meth:`SaturatedLearner.takes_over`);
named, it runs on any oracle, its format read from the declaration or the calibration.
"""

from __future__ import annotations

import types

from ..oracle.answer_stats import FORMAT_UNITS
from ..oracle.transcript import RUN, run_fingerprint
from ..run.learner import Learner, register_learner
from .learn import extract_low_precision

#: Answer formats whose few significant bits the algebraic schedules cannot resolve.
COARSE_FORMATS = {name: FORMAT_UNITS[name] for name in ("bfloat16", "float16")}


@register_learner
class SaturatedLearner(Learner):
    """Saturated two-token lines for the scores' rows, then least squares on whole answers, with
    a bootstrap error estimate (:mod:`mhaextract.lowprecision.learn`)."""

    name = "saturated"
    family = "lowprecision"
    model = "multi-head attention, whole (W_h, V_h, u_h, c), from bfloat16 or float16 answers"
    options = {"bias": "always learned: True or None (bias=False is refused)"}
    refusal = ("the low-precision learner fits the whole model from 8- or 11-bit answers in float64, with the "
               "heads declared (heads=H)")

    @classmethod
    def takes_over(cls, options, common, answer_format, d_out) -> bool:
        return answer_format in COARSE_FORMATS and (d_out is None or d_out > 1)

    @classmethod
    def refused_settings(cls, options, common) -> list[str]:
        refused = []
        if common.precision is not None:
            refused.append("precision")
        if common.heads is None:
            refused.append("max_heads (it needs heads=H)")
        if options.get("bias") is False:  # its start and fit learn u_h and c: a bias-free layer gets them near zero
            refused.append("bias=False (it always fits the score biases and the output constant; drop the option)")
        return refused

    @classmethod
    def validate(cls, options, common) -> dict:
        refused = cls.refused_settings(options, common)
        if refused:
            raise ValueError(f"schedule={cls.name!r} does not take {', '.join(refused)}: {cls.refusal}")
        return dict(options)

    def run(self):
        session, request = self.session, self.session.request
        declared = session.answer_dtype
        calibration = session.calibration
        if declared not in COARSE_FORMATS and calibration is None:
            calibration = session.calibrate()
        answer_format = declared if declared in COARSE_FORMATS else calibration.answer_precision
        if answer_format not in COARSE_FORMATS:
            raise ValueError(f"schedule='saturated' learns from bfloat16 or float16 answers; this oracle answers "
                             f"{answer_format}: use schedule='auto'")
        scale = request.token_scale
        if session.record is None and session.transcript is not None:
            session.open_transcript({"d": request.d, "max_heads": request.max_heads, "seed": request.seed,
                                     "precision": None, "schedule": self.name,
                                     "token_scale": "auto" if scale in (None, "auto") else float(scale).hex()})
        section = None
        if session.record is not None:
            plan = types.SimpleNamespace(d=request.d, max_heads=request.max_heads, name="saturated",
                                         token_scale=calibration.token_scale if calibration is not None else 0.0)
            session.record.start_run(run_fingerprint(plan, int(request.seed), None, [])
                                     | {"schedule": "saturated", "answers": answer_format})
            section = RUN
            if session.pending_check and session.probes is not None:
                # its queries depend on earlier answers: the calibration's fixed probes are re-asked
                session.recheck_probes(session.probes, session.pending_check, calibration.answer_noise)
                session.pending_check = 0
        try:
            result = extract_low_precision(
                session.oracle, request.d, request.heads, request.seed, unit=COARSE_FORMATS[answer_format],
                answer_dtype=answer_format, token_scale=None if scale in (None, "auto") else scale,
                batch_size=session.batch_size, progress=session.progress, max_queries=session.max_queries,
                verify_length=session.verify_length, vectors=session.vectors, transcript=session.section(section)
                if section else None)
        finally:
            session.close()
        return session.finish(result, f"low-precision extraction ({answer_format} answers)")
