"""The split of whole answers by head as a learner ("vector", docs/algorithm.md, 'Whole answers
near the vector bound'): every query answers every head. Where the answers cannot be split
(scalar answers, H r > d_out, a model that fails a check) it falls back to the targeted
schedule (:attr:`VectorLearner.falls_back_to`), whose result then counts the split's queries
and says why."""

from __future__ import annotations

import numpy as np

from ..oracle.answer_stats import FORMAT_UNITS
from ..oracle.transcript import VECTOR
from ..run.learner import FallBack, Learner, register_learner
from .learn import SplitUnavailable, extract_vector

#: A split whose model fails a check gives way to the targeted schedule (True), or is returned
#: failed (False: what ``benchmarks/bench_vector.py --split-only`` measures).
SPLIT_FAILURE_FALLS_BACK = True


@register_learner
class VectorLearner(Learner):
    """Whole answers split by the heads' output subspaces, scores from attention weights,
    Gauss-Newton refinement (:mod:`mhaextract.vector.learn`)."""

    name = "vector"
    family = "vector"
    model = "multi-head attention, whole (W_h, V_h, u_h, c), from float64 or float32 vector answers"
    options = {"bias": "always learned: True or None"}
    refusal = "the split learns the model with biases in float64 from whole answers, its heads' widths found by queries"
    falls_back_to = "targeted"

    @classmethod
    def validate(cls, options, common) -> dict:
        bias = options.get("bias")
        if bias is not None and not bias or common.precision is not None:
            raise ValueError(f"schedule='vector' learns the model with biases in float64 from whole answers, its "
                             f"heads' widths found by queries; it does not take bias=False or precision "
                             f"(got bias={bias!r}, precision={common.precision!r})")
        return dict(options, bias=True)

    def run(self):
        session, request = self.session, self.session.request
        scale = request.token_scale
        session.open_transcript({"d": request.d, "max_heads": request.max_heads, "seed": request.seed,
                                 "precision": None, "schedule": self.name, "bias": True,
                                 "token_scale": "auto" if scale in (None, "auto") else float(scale).hex()})
        calibration = session.calibrate()
        vectors = session.vectors
        if request.heads is None:
            raise FallBack("the split was not tried: it needs the number of heads declared (heads=H)")
        if (vectors.d_out or 1) == 1 or calibration.answer_precision not in ("float64", "float32"):
            raise FallBack(f"the split was not tried: it needs whole answers in float64 or float32 (these are "
                           f"{vectors.d_out or 1} number(s) at {calibration.answer_precision})")
        unit = max(vectors.unit, FORMAT_UNITS.get(calibration.answer_precision, 2.0 ** -53))
        boundary = session.boundary(VECTOR)
        try:
            result = extract_vector(boundary, request.seed, request.d, request.heads, calibration.token_scale, unit,
                                    calibration.answer_precision, session.verify_length, session.progress)
        except SplitUnavailable as why:
            raise FallBack(f"whole answers could not be split by head ({why})", boundary) from None
        except np.linalg.LinAlgError as why:  # a factorisation of the split failed: it cannot work here
            raise FallBack(f"whole answers could not be split by head (a factorisation of the split failed "
                           f"({why}))", boundary) from None
        if not result.ok and SPLIT_FAILURE_FALLS_BACK:  # never a guess: the targeted schedule runs instead
            failed = "; ".join(f"{check.name} {check.value:.3g} > {check.threshold:.3g}"
                               for check in result.failed_checks)
            raise FallBack(f"whole answers could not be split by head (its model failed its checks: {failed})",
                           boundary)
        session.close()
        result.schedule_reason = (
            f"whole answers of d_out = {vectors.d_out} numbers ({calibration.answer_precision}) and H = "
            f"{request.heads} declared: the heads' output subspaces split the answers (ranks {result.value_ranks}, "
            f"condition number {result.split_conditioning:.3g}), every query answers every head (docs/algorithm.md, "
            f"'Whole answers near the vector bound'); model with biases (u_h, c)")
        return session.finish(result, "vector extraction (whole answers split by head)")
