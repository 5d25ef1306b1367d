"""Is the oracle of a resumed run the one that recorded the transcript? (docs/reliability.md)

The transcript's fingerprint names the run's parameters and queries, not the oracle: a run
resumed against another model would otherwise mix the two oracles' answers, or replay the old
one's complete record and return its heads. So on resume :func:`check_same_oracle` re-asks up to
``count`` recorded queries (spread over the run's fixed queries, the ones asked before any
answer) and refuses the transcript when an answer differs from the recorded one by more than
``RELATIVE_TOLERANCE`` (float64) or ``2^(-precision/2)`` (high precision) of the largest answer
re-asked (a vector answer: its largest entry).

Which queries: a run whose transcript holds answers of its schedule re-asks recorded fixed
queries of the run section; one interrupted in (or right after) its token-scale calibration, whose
run section is empty, re-asks recorded calibration probes, before the calibration asks anything
new. Every re-asked answer is compared with the largest of the re-asked answers (old and new), so
that an answer near zero (the zero query of a bias-free layer) does not turn the oracle's noise into
a large relative difference; where the calibration measured the answers' noise
(``Calibration.answer_noise``, relative to the largest answer), the tolerance is at least
``NOISE_FACTOR`` times it: a noisy oracle resumes, another oracle does not.

Cost: ``count`` extra queries (default 3) on every resume, asked of the oracle and counted in
``queries_asked`` like any other; they are not recorded (the one paid query a transcript does
not keep). ``resume_check=0`` skips the check (the caller then vouches for the oracle).
"""

from __future__ import annotations

import mpmath
import numpy as np

from .transcript import TranscriptError

#: float64: answers of the same oracle agree to this relative difference (well above rounding).
RELATIVE_TOLERANCE = 1e-6
#: With a measured answer noise: the tolerance is at least this many times it.
NOISE_FACTOR = 30.0


def _positions(section, fixed: int, count: int, first: int = 0) -> list[int]:
    recorded = [index for index in range(first, fixed) if section.recorded(index) is not None]
    if not recorded or count <= 0:
        return []
    picks = np.unique(np.linspace(0, len(recorded) - 1, min(count, len(recorded))).round().astype(int))
    return [recorded[p] for p in picks]


def _entries(value, precision):
    """An answer's entries (one for a scalar answer, d_out for a vector)."""
    if precision is None:
        return np.atleast_1d(np.asarray(value, dtype=np.float64))
    return list(np.atleast_1d(np.asarray(value, dtype=object)))


def _largest(values, precision):
    return max(max(abs(entry) for entry in _entries(value, precision)) for value in values)


def _difference(old, new, largest, precision) -> float:
    """The largest ``|new - old|`` (over a vector's entries) relative to ``largest`` (0 when equal)."""
    if precision is None:
        return float(np.abs(_entries(new, None) - _entries(old, None)).max()) / max(float(largest), 1e-300)
    with mpmath.workprec(precision + 64):
        step = max(abs(b - a) for a, b in zip(_entries(old, precision), _entries(new, precision)))
        return float(step / max(largest, mpmath.mpf(2) ** -1000))


def check_same_oracle(boundary, section, fixed_queries, count: int, first: int = 0, noise: float | None = None) -> int:
    """Re-ask up to ``count`` recorded queries among ``fixed_queries[first:]`` of ``section`` (a
    :class:`~mhaextract.oracle.transcript.Section`) through ``boundary``; raise TranscriptError on a
    different oracle. ``noise``: the answers' relative noise, when measured. Returns the number of
    queries re-asked (already counted by the boundary)."""
    if section is None or count <= 0:
        return 0
    positions = _positions(section, len(fixed_queries), count, first)
    if not positions:
        return 0
    return _compare(boundary, section, positions, [fixed_queries[index] for index in positions], noise)


def check_replayed(boundary, section, samples: dict, count: int, noise: float | None = None) -> int:
    """The resume check of a learner whose queries depend on earlier answers: re-ask up to ``count``
    of ``samples`` (run index -> sequence, the queries ``boundary`` read back from ``section``,
    spread over them) and raise TranscriptError on a different oracle. Returns the number re-asked."""
    if section is None or count <= 0 or not samples:
        return 0
    indices = sorted(samples)
    picks = np.unique(np.linspace(0, len(indices) - 1, min(count, len(indices))).round().astype(int))
    positions = [indices[p] for p in picks]
    return _compare(boundary, section, positions, [samples[index] for index in positions], noise)


def _compare(boundary, section, positions, sequences, noise) -> int:
    """Re-ask ``sequences`` (the recorded queries ``positions`` of ``section``) and compare."""
    answers = boundary.probe(sequences, positions, description="re-asking recorded queries (resume check)",
                             whole=True)  # vector answers were recorded whole: compared whole
    precision = boundary.precision
    tolerance = RELATIVE_TOLERANCE if precision is None else 2.0 ** (-precision / 2)
    if noise is not None and precision is None:
        tolerance = max(tolerance, NOISE_FACTOR * noise)
    recorded = [section.recorded(index)[2] for index in positions]
    largest = _largest(list(recorded) + list(answers), precision)
    for index, old, new in zip(positions, recorded, answers):
        difference = _difference(old, new, largest, precision)
        if difference > tolerance:
            raise TranscriptError(
                f"transcript {section.path!r} was recorded from a different oracle: re-asked query {index} "
                f"({section.name}) answered {new} now, {old} in the transcript (difference {difference:.3g} of the "
                f"largest answer re-asked > {tolerance:.3g}). Nothing was added to the file; pass a new transcript "
                f"path for this oracle (or resume_check=0 for an oracle whose answers vary from call to call by "
                f"more than that).", section.path)
    return len(positions)
