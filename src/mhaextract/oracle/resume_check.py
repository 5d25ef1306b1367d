"""Is the oracle of a resumed run the one that recorded the transcript? (docs/reliability.md)

The transcript's fingerprint names the run's parameters and queries, not the oracle: a run
resumed against another model would otherwise mix the two oracles' answers, or replay the old
one's complete record and return its heads. So on resume :func:`check_same_oracle` re-asks up to
``count`` recorded queries (spread over the run's fixed queries, the ones asked before any
answer) and refuses the transcript when an answer differs from the recorded one by more than
``RELATIVE_TOLERANCE`` of the larger of the two (float64) or by more than ``2^(-precision/2)``
relative (high precision).

Cost: ``count`` extra queries (default 3) on every resume, asked of the oracle and counted in
``queries_asked`` like any other; they are not recorded. ``resume_check=0`` skips the check
(the caller then vouches for the oracle). A nondeterministic oracle whose answers vary by more
than the tolerance is refused too: pass ``resume_check=0`` for it.
"""

from __future__ import annotations

import mpmath
import numpy as np

from .transcript import TranscriptError

#: float64: answers of the same oracle agree to this relative difference (well above rounding).
RELATIVE_TOLERANCE = 1e-6


def _positions(record, fixed: int, count: int) -> list[int]:
    recorded = [index for index in range(fixed) if record.recorded(index) is not None]
    if not recorded or count <= 0:
        return []
    picks = np.unique(np.linspace(0, len(recorded) - 1, min(count, len(recorded))).round().astype(int))
    return [recorded[p] for p in picks]


def _differs(old, new, precision) -> float:
    """Relative difference of two answers (0 when equal)."""
    if precision is None:
        old, new = float(old), float(new)
        return abs(new - old) / max(abs(old), abs(new), 1e-300)
    with mpmath.workprec(precision + 64):
        return float(abs(new - old) / max(abs(old), abs(new), mpmath.mpf(2) ** -1000))


def check_same_oracle(boundary, record, fixed_queries, count: int) -> int:
    """Re-ask up to ``count`` recorded fixed queries; raise TranscriptError on a different oracle.
    Returns the number of queries re-asked (already counted by the boundary)."""
    if record is None or record.created or count <= 0:
        return 0
    positions = _positions(record, len(fixed_queries), count)
    if not positions:
        return 0
    sequences = [fixed_queries[index] for index in positions]
    answers = boundary.probe(sequences, positions, description="re-asking recorded queries (resume check)")
    precision = boundary.precision
    tolerance = RELATIVE_TOLERANCE if precision is None else 2.0 ** (-precision / 2)
    for index, new in zip(positions, answers):
        old = record.recorded(index)[2]
        difference = _differs(old, new, precision)
        if difference > tolerance:
            raise TranscriptError(
                f"transcript {record.path!r} was recorded from a different oracle: re-asked query {index} answered "
                f"{new} now, {old} in the transcript (relative difference {difference:.3g} > {tolerance:.3g}). "
                f"Nothing was added to the file; pass a new transcript path for this oracle (or resume_check=0 for "
                f"an oracle whose answers vary from call to call).", record.path)
    return len(positions)
