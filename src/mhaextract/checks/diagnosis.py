"""Failures that say what was seen and what to try (docs/reliability.md).

Two situations end a run without a trustworthy model:

* the learner's arithmetic breaks (an SVD that does not converge, a ball whose midpoint is not
  finite, an empty array where heads were expected): :func:`kernel_failure` turns the exception
  into an :class:`~mhaextract.checks.base.ExtractionError` (``extraction`` None, the original
  exception chained as ``__cause__``) naming the options that change the outcome;
* the checks fail: :func:`failure_hints` names the likely cause from the run's evidence (an
  oracle that is not one attention layer, more heads than declared, heads merged, a constant or
  quantised oracle, a token scale that hides the heads) before the schedule's own hints.

:func:`answers_check` makes a constant or integer-valued oracle a failed check of its own.
"""

from __future__ import annotations

import numpy as np

from .base import Check, ExtractionError
from .model_class import model_class_hints

#: Exceptions of the numerical kernels (numpy, scipy, python-flint, mpmath) that mean "this
#: computation broke", as opposed to a bug in the arguments or an oracle's own exception.
KERNEL_ERRORS = (np.linalg.LinAlgError, ValueError, ArithmeticError, TypeError, IndexError)


def answers_check(stats) -> Check | None:
    """A failed ``answers_informative`` check for a constant or integer-valued oracle, else None."""
    problem = stats.problem()
    if problem is None:
        return None
    return Check("answers_informative", False, float(stats.count), 0.0, problem)


def _scale_hint(settings) -> str:
    return (f"token_scale={settings.token_scale:.3g} may not suit the target's W: |z^T W_h x| should be of order "
            "one (MultiHeadAttention.suggested_token_scale; for a trained layer try token_scale between 1/||W|| "
            "and 10/||W||)")


#: Attention modules TorchOracle reads directly (docs/torch.md); a block or a whole model is none.
SUPPORTED_MODULES = "GPT2Attention, BertSelfAttention, OPTAttention, ViTAttention or nn.MultiheadAttention"
#: Phase 1 rejecting more candidate centres than this many per accepted one: the answers switch
#: along lines, but not as one softmax head does (a head's switch passes the single-pole tests).
REJECTED_PER_CENTRE = 4
#: Links' noise (relative to the largest answer) this many times the answers' own rounding unit (and
#: the noise the calibration measured), and at least ``MISFIT_FLOOR``, is no noise of the answers:
#: they do not fit the declared model. (Oracles that add noise stay below the floor.)
MISFIT_ROUNDING, MISFIT_FLOOR = 1e4, 1e-4

#: Redundant measurements disagreeing by more than this many largest answers: no head the run missed
#: moves an answer by more than the answers' own size, so the fits themselves broke down.
BROKEN_FITS = 10.0

#: Answers coarser than this (relative unit, 20 bits) can hide heads by themselves: the schedule's
#: noise hint then comes first (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16').
COARSE_ANSWERS = 2.0 ** -20

NOT_ATTENTION = ("mhaextract learns one multi-head softmax attention layer read at the final token "
                 "(extract; with biases u_h and c), or one such layer followed by a ReLU feed-forward network "
                 "(extract_transformer), or the attention sublayer of a block (a norm before the attention or after "
                 "the residual, and the residual: extract(..., norm='auto') on whole outputs, or a pre-norm "
                 "sublayer's read-out, docs/norm.md). A whole block or model (an MLP after the attention) is none of these: give TorchOracle the attention module itself ("
                 + SUPPORTED_MODULES + "; e.g. block.attn of a GPT2Block), or an oracle that returns that module's "
                 "output.")


BLOCK_ASIDE = ("(If the oracle is a block or a whole model rather than one attention layer, give TorchOracle the "
               "attention module itself.)")


def _heads(count: int) -> str:
    return f"{count} head{'' if count == 1 else 's'}"


def _more_heads(settings) -> str:
    return (f"pass the layer's head count (heads=H), or a bound (max_heads=BOUND above {settings.max_heads}) "
            "to let the run count them.")


def _phase1_evidence(details) -> tuple[int, int, int, int, int] | None:
    """``(lines, centres accepted, centres rejected, first-group instances, of them unsaturated)`` of
    a targeted-family run (its ``details.phase1`` and ``details.instances``), else None."""
    search, instances = getattr(details, "phase1", None), getattr(details, "instances", None)
    if search is None or instances is None:
        return None
    first = np.asarray(instances.stage) == "first"
    return search.lines, search.centers, search.rejected, int(first.sum()), int((~instances.saturated[first]).sum())


def _cause_hints(failed: set[str], settings, stats, extraction, float_only: bool) -> list[str]:
    """Hints that name the likely cause from the run's own evidence (empty when none is clear)."""
    heads_found = extraction.heads
    evidence = _phase1_evidence(extraction.details)
    hints = []
    if evidence is not None:
        lines, centres, rejected, first, unsaturated = evidence
        switches_not_heads = rejected > REJECTED_PER_CENTRE * max(centres, 1)
        if "heads_found" in failed and heads_found == 0:
            hints.append(f"No head was found on any of phase 1's {lines} lines"
                         + (f" ({rejected} candidate switches failed the single-pole tests)" if rejected else "")
                         + ". If the oracle is one attention layer, the token scale hides its heads: "
                         + _scale_hint(settings) + ". Otherwise it is not this model class: " + NOT_ATTENTION)
        elif first and unsaturated == first and heads_found == settings.max_heads:
            if switches_not_heads:
                hints.append(f"Phase 1 found {heads_found} heads but rejected {rejected} candidate switches that are "
                             "not single-pole, and no instance of the first group held its single-pole form: the "
                             "answers switch along lines, but not as softmax heads do. " + NOT_ATTENTION)
            else:
                hints.append(f"Found evidence of more heads than declared: phase 1 found the {_heads(heads_found)} "
                             f"declared, yet all {first} instances of the first group, designed to saturate every "
                             "head but one, still felt another pole: " + _more_heads(settings) + " " + BLOCK_ASIDE)
    elif "heads_found" in failed and heads_found == 0 and stats.problem() is None:
        hints.append("No head was found. If the oracle is one attention layer, the token scale hides its heads: "
                     + _scale_hint(settings) + ("." if float_only else "; or try schedule='paper'.")
                     + " Otherwise it is not this model class: " + NOT_ATTENTION)
    if "noise_within_validity" in failed and settings.answer_error is None and stats.largest > 0:
        noise = getattr(extraction.certificate, "noise_estimate", 0.0) / stats.largest
        if noise > BROKEN_FITS:
            hints.append(f"The redundant measurements disagree by {noise:.2g} of the largest answer, more than "
                         "the answers themselves could: the instances' fits broke down rather than met an extra "
                         "head, as they do where " + _scale_hint(settings) + ".")
        elif noise > max(MISFIT_FLOOR, MISFIT_ROUNDING * stats.unit_roundoff, 1e3 * (settings.answer_noise or 0.0)):
            hints.append(f"Found evidence of more heads than declared: the redundant measurements disagree by "
                         f"{noise:.2g} of the largest answer, far above the answers' {stats.precision_name} "
                         f"rounding, so the answers do not fit {_heads(settings.max_heads)}: "
                         + _more_heads(settings) + " " + BLOCK_ASIDE)
    return hints


def failure_hints(failed: set[str], settings, stats, extraction, schedule_hints=(), float_only: bool = False,
                  model_class=None) -> list[str]:
    """Hints for failed checks: first the likely cause the run's evidence names (not this model class,
    more heads than declared, heads merged), then the schedule's own ``schedule_hints`` (noise), which
    are dropped when the evidence names another cause. ``float_only``: the oracle answers in a float
    dtype only (``answer_dtype`` not ``"mpf"``, a torch layer), so ``precision=BITS`` is not offered.
    ``model_class``: the :class:`~.model_class.ModelClassEvidence` of the failed run's probes; an
    invariant of attention it found broken (positions, a norm before the attention, a zero token
    answering non-zero to a bias-free run) is the cause named, and the guesses from the run's own evidence (noise, head counts, token scale) are dropped."""
    hints = []
    problem = stats.problem()
    if problem is not None:
        hints.append("The answers: " + problem + ".")
    outside = model_class_hints(model_class, bias_free=not getattr(extraction, "bias", True)) if problem is None else []
    if outside:
        return hints + outside
    heads_found = extraction.heads
    causes = _cause_hints(failed, settings, stats, extraction, float_only) if problem is None else []
    merged = "heads_found" in failed and 0 < heads_found < settings.max_heads
    # the targeted family's schedule hints blame the answers' noise: first where the answers are that
    # coarse, else only when no other cause is plain (nor too few heads found)
    coarse = max(stats.unit_roundoff, settings.answer_noise or 0.0) > COARSE_ANSWERS
    if coarse:
        hints += list(schedule_hints) + causes
    else:
        hints += causes if causes or (merged and _phase1_evidence(extraction.details)) else list(schedule_hints)
    if merged:
        hints.append(f"Found {heads_found} of {_heads(settings.max_heads)}: heads with equal W_h merge in the canonical "
                     f"form, and heads closer than this run resolves merge too. Pass max_heads={settings.max_heads} "
                     "to accept the count found"
                     + (" (the oracle answers in floats only, so more bits are not an option)." if float_only else
                        ", or precision=BITS (more bits resolve closer heads)."))
    if "noise_within_validity" in failed and not causes:
        hints.append("The answers are noisier than this run can certify (valid_below): oversample "
                     "(samples_per_instance), use fewer heads per run, or a less noisy oracle.")
    return hints


def kernel_failure(error: BaseException, plan, stats, answers: int) -> ExtractionError:
    """The ExtractionError for an exception raised by the learner's arithmetic after ``answers``
    answers (asked or replayed; ``stats`` sees only float64 ones)."""
    settings = plan.settings
    seen = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    lines = [f"{plan.name} extraction broke down in its arithmetic after {answers} answers ({seen})."]
    problem = stats.problem()
    if problem is not None:
        lines.append("The answers: " + problem + ".")
    lines.append("What to try: " + _scale_hint(settings) + ";")
    if settings.precision is None:
        lines.append(f"precision=BITS (e.g. 128) for the arbitrary-precision path, or another schedule "
                     f"(this was schedule={plan.name!r}; 'paper', 'lean' and 'targeted' fail differently);")
    else:
        lines.append(f"more bits (this was precision={settings.precision}), or fewer heads per run (max_heads);")
    lines.append("with a transcript, answers already paid for are kept and a re-run resumes from them.")
    failure = ExtractionError("\n".join(lines), None)
    failure.hints = lines[1:]
    return failure
