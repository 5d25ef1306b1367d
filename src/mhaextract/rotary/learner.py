"""Rotary attention as a learner ("rotary", docs/algorithm.md, 'Rotary attention: positions,
grouped heads and sliding windows'): claimed by ``schedule="auto"`` when ``positions="rotary"``
is given, or named."""

from __future__ import annotations

import numpy as np

from ..checks.base import Check
from ..checks.model_class import probe_counted
from ..oracle.boundary import BudgetExceeded
from ..oracle.transcript import RUN, VECTOR
from ..run.learner import AUTO, FallBack, Learner, given, register_learner, successor
from ..run.validation import positive_int, spawn_rng
from ..split.values import SplitUnavailable
from .run import POLISH_FACTOR, extract_rotary
from .split import extract_rotary_split

#: The query factors' defaults (a transcript's header names only those set otherwise).
DEFAULT_FACTORS = {"polish_factor": float(POLISH_FACTOR), "value_factor": 1.0}


@register_learner
class RotaryLearner(Learner):
    """Instances of copies at positions, the rotation from two score matrices, matching and
    assembly, the window found by queries, a refinement (:mod:`mhaextract.rotary.run`, its steps)."""

    name = "rotary"
    family = "rotary"
    model = "rotary attention (Q_h, K_g, theta, V_h, c; grouped heads, a sliding window)"
    options = {
        "positions": "'rotary': rotary position embeddings (the option that picks this learner under 'auto')",
        "bias": "the query bias (default True)",
        "rank": "the head width r",
        "key_bias": "the keys carry a bias (Qwen2): found from whole answers first",
        "polish_factor": "the refinement's fresh queries per parameter (default 3)",
        "value_factor": "times the value fit's read-out queries (default 1; whole answers)",
    }
    refusal = "the rotary schedule runs with the number of heads given (heads=H), in float64 or at precision=bits"
    priority = 0

    @classmethod
    def claims(cls, options, common) -> bool:
        # any positions but "none" is this learner's option: a wrong value is told so by validate
        return options.get("positions", "none") not in ("none", None)

    @classmethod
    def validate(cls, options, common) -> dict:
        positions, key_bias = options.get("positions", "rotary"), options.get("key_bias", False)
        if positions not in ("rotary", "none", None):
            raise ValueError(f"positions must be 'none' (no position dependence) or 'rotary' (rotary embeddings, "
                             f"docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'), "
                             f"got {positions!r}")
        if common.heads is None:
            raise ValueError("positions='rotary' does not take max_heads: it needs heads=H, the number of query heads")
        if not isinstance(key_bias, (bool, np.bool_)):
            raise ValueError(f"key_bias must be True or False, got {key_bias!r}")
        if key_bias and common.precision is not None:
            raise ValueError(f"key_bias=True runs in float64 (its search shifts every token by a float64 token); "
                             f"precision={common.precision} is not available for it")
        rank = options.get("rank")
        bias = options.get("bias")
        factors = {}
        for name, default in DEFAULT_FACTORS.items():
            value = options.get(name)
            value = default if value is None else value
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
                raise ValueError(f"{name} must be a positive number (more answers average more rounding), "
                                 f"got {value!r}")
            factors[name] = float(value)
        return {"positions": "rotary", "key_bias": bool(key_bias), "bias": True if bias is None else bool(bias),
                "rank": None if rank is None else positive_int("rank", rank), **factors}

    def run(self):
        session, request, options = self.session, self.session.request, self.options
        if request.precision is not None and session.answer_dtype not in (None, "mpf"):
            raise ValueError(f"precision={request.precision} needs an oracle answering mpmath.mpf; this one answers "
                             f"{session.answer_dtype} (a torch layer computes in its own dtype): run it with "
                             "precision=None")
        scale = request.token_scale
        session.open_transcript({"d": request.d, "heads": request.heads, "seed": request.seed,
                                 "precision": request.precision, "schedule": self.name,
                                 "bias": options["bias"], "rank": options["rank"], "key_bias": options["key_bias"],
                                 **{name: options[name] for name in ("polish_factor", "value_factor")
                                    if options[name] != DEFAULT_FACTORS[name]},
                                 "token_scale": "auto" if scale in (None, "auto") else float(scale).hex()})
        if session.record is not None:
            session.record.start_run({"schedule": self.name, "d": request.d, "heads": request.heads})
        boundary, handed_on = session.boundary(RUN, precision=request.precision), None
        try:
            result = extract_rotary(session.oracle, request.d, request.heads, request.seed,
                                    precision=request.precision, token_scale=None if scale in (None, "auto") else scale,
                                    bias=options["bias"], rank=options["rank"], batch_size=session.batch_size,
                                    progress=session.progress, max_queries=session.max_queries,
                                    verify_length=session.verify_length, key_bias=options["key_bias"],
                                    boundary=boundary, polish_factor=options["polish_factor"],
                                    value_factor=options["value_factor"])
            whole = (getattr(boundary.vectors, "d_out", None) or 1) > 1  # the sublayer learner reads whole answers
            if not result.ok and session.requested == AUTO and request.precision is None and whole:
                handed_on = _successor(session, boundary, result)
            if handed_on is not None:  # another learner's model: it runs in this session (and transcript)
                learner, why = handed_on
                failed = ", ".join(check.name for check in result.failed_checks)
                raise FallBack(f"its checks failed ({failed}), and {why}", boundary, to=learner.name)
        finally:
            if handed_on is None:
                session.close()
        result.transcript = session.transcript
        return session.finish(result, "rotary extraction")


def _successor(session, boundary, result):
    """After a failed ``"auto"`` run of whole answers: the model-class probes (stream 41, at the run's token
    scale); where they show a norm (scaling a lone token does not scale its effect: Llama's sublayer, its
    RMSNorm before the rotary attention), the learner of that model that takes the options given and why
    (``successor``: the session goes on as it, the probes' and the failed run's queries counted in its
    result); otherwise None, the probes counted in the failed run's result."""
    request = session.request
    scale = result.token_scale
    scale = float(scale) if isinstance(scale, (int, float)) and np.isfinite(scale) and scale > 0 else 1.0
    try:
        evidence, asked, replayed = probe_counted(boundary, request.d, spawn_rng(request.seed, 41), scale)
    except BudgetExceeded:  # no room left for the probes: the failed run is reported as it is
        return None
    handed_on = successor(evidence, session.given_options, request) if evidence.normalised else None
    if handed_on is None:
        result.queries, result.queries_asked = result.queries + asked + replayed, result.queries_asked + asked
        result.queries_replayed += replayed
    return handed_on


@register_learner
class RotarySplitLearner(Learner):
    """Whole answers split by head, each head's attention weights read from them, the keys, rotations and
    key bias from each offset's score vector, Gauss-Newton on the log-ratios and the whole answers
    (:mod:`mhaextract.rotary.split`). Where the answers cannot be split or the model fails a check, the
    grid route (``"rotary"``) runs instead, its result counting the split's queries and saying why."""

    name = "rotary-split"
    family = "rotary"
    model = "rotary attention, whole (Q_h, b_h, K_g, k_g, theta_g, V_h, c; grouped heads, a sliding window)"
    options = {
        "positions": "'rotary': rotary position embeddings",
        "bias": "the query bias: always learned (True or None)",
        "rank": "the head width r: a split that finds another falls back",
        "key_bias": "the key bias: always learned by the split (True is passed on to a fallback)",
    }
    refusal = "the rotary split learns whole float64 or float32 answers with biases, its head width found by queries"
    falls_back_to = "rotary"
    priority = -1

    @classmethod
    def claims(cls, options, common) -> bool:
        """``"auto"`` with ``positions="rotary"``: tried first wherever it could run (``heads=H``, no
        ``precision``, the query bias learned, no option of the grid route's own); scalar or coarser answers
        give way to the grid route after the run's first answer."""
        bias = options.get("bias")
        return (options.get("positions", "none") == "rotary" and common.precision is None and common.heads is not None
                and (bias is None or bool(bias))
                and not any(given(value) for name, value in options.items() if name not in cls.options))

    @classmethod
    def validate(cls, options, common) -> dict:
        bias = options.get("bias")
        if (bias is not None and not bias) or common.precision is not None:
            raise ValueError(f"schedule='rotary-split' learns the layer with its biases from whole float64 or float32 "
                             f"answers; it does not take bias=False or precision (got bias={bias!r}, "
                             f"precision={common.precision!r}): schedule='rotary' does")
        return RotaryLearner.validate(dict(options, bias=True), common)

    def run(self):
        session, request, options = self.session, self.session.request, self.options
        scale = request.token_scale
        session.open_transcript({"d": request.d, "heads": request.heads, "seed": request.seed, "precision": None,
                                 "schedule": self.name, "rank": options["rank"], "key_bias": options["key_bias"],
                                 "token_scale": "auto" if scale in (None, "auto") else float(scale).hex()})
        boundary = session.boundary(VECTOR)
        try:
            result = extract_rotary_split(boundary, request.d, request.heads, request.seed,
                                          token_scale=None if scale in (None, "auto") else float(scale),
                                          rank=options["rank"], verify_length=session.verify_length,
                                          progress=session.progress,
                                          token_bound=getattr(session.oracle, "token_bound", None))
        except SplitUnavailable as why:
            raise FallBack(f"whole answers could not be split by head ({why})", boundary) from None
        except np.linalg.LinAlgError as why:
            if getattr(why, "raised_by_oracle", False):
                raise
            raise FallBack(f"whole answers could not be split by head (a factorisation failed ({why}))",
                           boundary) from None
        if not result.ok:
            failed = Check.failures(result.checks)
            raise FallBack(f"the split's model failed its checks ({failed})", boundary)
        session.close()
        result.transcript = session.transcript
        return session.finish(result, "rotary split extraction")
