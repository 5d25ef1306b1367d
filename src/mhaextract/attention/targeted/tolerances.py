"""Constants and tolerances the targeted family shares (docs/algorithm.md, 'The targeted schedule' and 'Low-precision
oracles: float32, mixed precision, bfloat16'): the designed log-poles, the saturation margins, and the answers' units
that size every tolerance.
"""

from __future__ import annotations

import numpy as np

from ...checks.base import LOOSEST_ESTIMATE_LIMIT, parameter_estimate_limit

EPS = np.finfo(np.float64).eps
#: |z| of every group, in units of the token scale. Large |z| makes the pole term (~|z|) dominate
#: the saturated constant vbar^T x (~1/|z|, since |x| ~ s / |a_h| and |a_h| ~ |z|).
GROUP_SCALE = 64.0
#: Designed log-poles: the target head in TARGET_CENTER +- TARGET (tau near the copy counts
#: 1..3, where the three-sample fit is best conditioned), the others in MID +- SPREAD.
TARGET_CENTER, TARGET = float(np.log(2.0)), 2.5
#: The final stage (:class:`FinalDesign`, docs/algorithm.md, 'The final instances'): the target's
#: log-poles at ``TARGET_CENTER`` and ``TARGET_CENTER +- halfwidth``, ``tau = 2, 2 e^-T, 2 e^T``. Float64
#: answers (``FINAL_TARGET``, ``T = ln 16``: ``tau = 2, 1/8, 32``): a round asks the one copy count of
#: at most 4 that reads its side best alone (``FINAL_ONE_COPY``: a one-sample reading errs by
#: ``dG (k + tau)^2 / (|l| k tau)``, 10 units of the sample's rounding on both sides with ``k = 1, 4``, 4
#: at the centre with ``k = 2``; nearer sides read better but fix ``a_h``'s scale worse, 'The targeted schedule'),
#: and every ``FINAL_PAIR_EVERY``-th round its side's two (``FINAL_SIDE_COPIES``: the unit's label and
#: the single-pole test of a sample of its instances). Noisier answers (``NOISY_FINAL_TARGET``): every
#: round its side's two, the label the consensus of all.
FINAL_TARGET, NOISY_FINAL_TARGET = float(np.log(16.0)), 2.0
FINAL_ONE_COPY = {-1: (1,), 0: (2,), 1: (4,)}
FINAL_SIDE_COPIES = {-1: (1, 2), 0: (1, 2), 1: (3, 4)}
FINAL_PAIR_EVERY = 8
SATURATION_MID, SATURATION_SPREAD = 70.0, 30.0
#: A head counts as saturated when its log-pole (from the final model) is at least this
#: (float64: e^-36 ~ 2^-52, below the answers' rounding; see :func:`saturation_margin`).
SATURATION_MARGIN = 36.0
#: The same for the first group's and the bridges' instances, which only aim the final stage
#: (:func:`prior_saturation_margin`).
PRIOR_SATURATION_MARGIN = 20.0
#: A final instance whose third sample misfits the single-pole form by more than this many
#: rounding units did not hold its saturation assumption.
RESIDUAL_LIMIT = 50.0
FINAL_COPIES = (1, 2, 3)
#: The answers' misfit's float64 threshold (the estimate's: ``checks.base.parameter_estimate_limit``).
ANSWERS_RESIDUAL_LIMIT = 1e-9
#: No answers' unit loosens the misfit's limit beyond this (relative).
LOOSEST_LIMIT = LOOSEST_ESTIMATE_LIMIT
#: Rounds designed from one estimate of the target at most (:func:`correction_blocks`).
CORRECTION_BLOCK = 16


def score_unit(settings, stats=None) -> float:
    """The relative rounding unit of the oracle's own arithmetic, which rounds its scores too:
    ``EPS`` for float64, else the larger of the rounding the calibration measured
    (``settings.arithmetic_noise``: not noise added at random to the outputs, which leaves the
    scores exact, docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16') and the unit roundoff
    the answers' bits show (``stats``, an :class:`~mhaextract.oracle.answer_stats.AnswerStats`; free, so a run without
    calibration still recognises float32 answers). A declared ``answer_error`` is not part of it: it bounds
    the answers' total error, score rounding included, and says nothing of a score's rounding
    growing with ``|z| |W x|`` (a score term sized by a declared error would overstate the
    estimate by orders of magnitude)."""
    unit = EPS
    if settings.arithmetic_noise is not None:
        unit = max(unit, float(settings.arithmetic_noise))
    if stats is not None and stats.precision_name != "float64":
        unit = max(unit, stats.unit_roundoff)
    return unit


def answer_unit(settings, stats=None) -> float:
    """The answers' relative rounding unit that sizes the run's tolerances (docs/algorithm.md, 'Low-precision oracles:
    float32, mixed precision, bfloat16'): :func:`score_unit`, the answer noise the calibration measured
    (``settings.answer_noise``), or a declared ``answer_error`` over the largest answer, whichever is largest."""
    unit = score_unit(settings, stats)
    if settings.answer_noise is not None:
        unit = max(unit, float(settings.answer_noise))
    if settings.answer_error is not None and stats is not None and stats.largest > 0:
        # a declared absolute bound, relative to the largest answer seen so far
        unit = max(unit, float(settings.answer_error) / stats.largest)
    return unit


def saturation_margin(unit: float) -> float:
    """The log-pole beyond which a head is saturated for answers of relative unit ``unit``: its
    weight ``e^-margin`` left on the other token is below the answers' error, as ``SATURATION_MARGIN``
    is at float64 (``36 - ln(unit / EPS)``: 19.3 at unit 4e-9, 23.5 at float32's 2^-24). A final
    instance at margin 34.2 under declared noise 1e-8 failed the float64 margin while its unsaturated
    head moved its answer by 1e-15 of the 1e-8 the noise did."""
    return SATURATION_MARGIN - float(np.log(max(unit, EPS) / EPS))


def prior_saturation_margin(unit: float) -> float:
    """The margin the first group's and the bridges' instances must keep: ``PRIOR_SATURATION_MARGIN``
    (20, ``e^-20 ~ 2e-9``), or :func:`saturation_margin` where that is lower (noisier answers).

    Those instances only aim the final stage (their ``a`` and labels are its design's prior; the
    model comes from the final instances alone, which keep :func:`saturation_margin`), so a head
    left at log-pole 20..36 there perturbs a prior by ``e^-margin`` relative, far below the
    ``AIM_TOLERANCE = 1e-3`` the final stage's aim is checked to. Phase 1's rough estimates can miss
    the first group's saturated rows by ~9 log-pole units (margins near 31 instead of the planned
    40), which the float64 margin would fail as a false alarm. A head near the window (a missed head, a prior far
    off) is still caught: margins near 0 and misfitting samples."""
    return min(PRIOR_SATURATION_MARGIN, saturation_margin(unit))


def agreement_tolerance(unit: float) -> float:
    """A bridge's log-pole must agree with the final model to this (1e-6 at float64 rounding)."""
    return max(1e-6, 1e4 * unit)


def limits(unit: float) -> tuple[float, float]:
    """``(error_estimate, answers_residual)`` limits: the estimate's shared one
    (:func:`~mhaextract.checks.base.parameter_estimate_limit`); the misfit's float64 one, or sized to the answers' unit
    (the answers misfit even the true model by up to ~1e3 units: scores of order 1e3 rounded), and
    never above ``LOOSEST_LIMIT`` (a model off by more is no extraction)."""
    # The answers' misfit gets 3e4 units: a real float32 layer (GPT-2, token scale ~65) rounds the
    # scores of phase 1's tokens (|x| ~ 16 token scales, |z| 64) by ~1e-3 in m, 1.2e4 units of the
    # largest answer (docs/algorithm.md, 'Real float32 layers'); float64 limits are unchanged.
    return parameter_estimate_limit(unit), max(ANSWERS_RESIDUAL_LIMIT, min(3e4 * unit, LOOSEST_LIMIT))


#: Units whose inverses :func:`_solve_units` forms at once: their temporaries (a few (units, D, D)
#: arrays, about 4 MB) stay small enough to be reused from the heap rather than mapped and zeroed afresh
#: by the kernel each time.
INVERSE_BLOCK_BYTES = 2**22
