"""Failures that say what was seen and what to try (docs/reliability.md).

Two situations end a run without a trustworthy model:

* the learner's arithmetic breaks (an SVD that does not converge, a ball whose midpoint is not
  finite, an empty array where heads were expected): :func:`kernel_failure` turns the exception
  into an :class:`~mhaextract.checks.base.ExtractionError` (``extraction`` None, the original
  exception chained as ``__cause__``) naming the options that change the outcome;
* the checks fail: :func:`failure_hints` adds the hints that do not depend on the schedule
  (a constant or quantised oracle, no head found at this token scale).

:func:`answers_check` makes a constant or integer-valued oracle a failed check of its own.
"""

from __future__ import annotations

import numpy as np

from .base import Check, ExtractionError

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


def failure_hints(failed: set[str], settings, stats, heads_found: int) -> list[str]:
    """Hints for failed checks that hold in every schedule."""
    hints = []
    problem = stats.problem()
    if problem is not None:
        hints.append("The answers: " + problem + ".")
    if "heads_found" in failed and heads_found == 0 and problem is None:
        hints.append("No head was found. " + _scale_hint(settings) + "; or try schedule='paper'.")
    elif "heads_found" in failed and heads_found < settings.max_heads:
        hints.append(f"Found {heads_found} heads: heads closer than the resolution of this run merge. Try "
                     "precision=BITS (more bits resolve closer heads), or max_heads to accept the merged count.")
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
