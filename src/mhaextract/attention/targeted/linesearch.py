"""Phase 1 of the targeted schedule: heads located along lines (docs/algorithm.md, 'The targeted schedule').

Fix a large difference ``z``. The gap of the k-copies instance at final token ``x``,

    S_k(x) = vbar^T x - F_k(x) = sum_h l_h k / (k + exp(a_h^T x)),   a_h = W_h^T z,  l_h = v_h^T z,

is a sum of H sigmoid ridges. On a line ``x(t) = x0 + t u`` head h's log-pole
``m_h(t) = a_h^T x0 + t a_h^T u`` is affine in t: the head switches from "saturated towards y"
(contributing ``l_h``) to "saturated towards x" (contributing 0) around ``t_h = -a_h^T x0 / a_h^T u``,
within ``|t - t_h| ~ 1 / |a_h^T u|``. With ``|z|`` and ``|u|`` large the switches are sharp and
``S_1(t)`` is a staircase whose steps are the labels ``+-l_h``.

Each step is bisected until a point ``x_c`` lies inside the window of its head (``|m_h| <~ 4``;
the step has moved a fraction 0.02..0.98 of its height there). At ``x_c`` three samples
``k = 1, 2, 3`` give ``(P, l_h, m_h)`` of the single-pole form ``S_k = P + k l_h / (k + tau_h)``
(:func:`mhaextract.numerics.single_pole.fit_with_constant`); the candidate counts only if a fourth
sample ``k = 4`` agrees with that form (two heads in the window at once do not). A point where
``S_2 = S_1`` lies on a plateau between two switches: both halves are searched. The label names the head within the z-group. A new head's direction ``a_h`` is
then read from ``d`` one-sample readings at ``x_c + delta q_i`` (``q_i`` orthonormal):
``m_h(x_c + delta q_i) - m_h(x_c) = delta a_h^T q_i``, with P and ``l_h`` known.

These estimates are rough (the other heads are only as saturated as the line happened to make
them) and serve to design the targeted instances of phase 2, which need about 1%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...numerics import single_pole

EPS = np.finfo(np.float64).eps

#: A head in its window (the step moved a fraction f = tau / (1 + tau) in WINDOW_FRACTION ..
#: 1 - WINDOW_FRACTION) has ``S_2 - S_1 = l tau / ((2 + tau)(1 + tau))``, at least 0.0099 |l| (at f =
#: 0.02): the point is tested as a centre when ``S_2 - S_1`` exceeds this fraction of the step being
#: bisected, even below the line's noise tolerance (1e3 rounding scales). That tolerance is sized for
#: the staircase's steps; against ``S_2 - S_1``, at most 0.17 |l|, it would hide every head with |l|
#: under 6 tolerances (a small label beside large ones in a float32 layer).
WINDOW_GAP = 0.005
#: Copy counts asked at a candidate centre (k = 1 is the bisection's own sample): the longest
#: query of the targeted schedule has max(CENTER_COPIES) + 1 tokens.
CENTER_COPIES = (1, 2, 3, 4)
#: A step has moved this fraction (and at most 1 - it) of its height inside its head's window.
WINDOW_FRACTION = 0.02
#: Largest |m| accepted at a centre: further out the head's own term is nearly linear in k and
#: cannot be told from a barely saturated neighbour by the fourth sample.
MAX_CENTER_LOG_POLE = 4.0
#: Largest |m| accepted at a reading (one sample resolves m to ~1e-10 up to here).
MAX_READING_LOG_POLE = 8.0
#: Bisection steps a line may take, per grid interval and head (:func:`_search_line`).
LINE_STEPS_PER_HEAD = 4
#: Largest error of a reading's m from its sample's rounding (noisy answers reach it well inside
#: MAX_READING_LOG_POLE); a reading beyond it is asked again nearer the centre.
MAX_READING_ERROR = 1e-3
#: Two centres with the same label whose directions agree to this (relative) are one head.
DIRECTION_AGREEMENT = 1e-2
#: Noisy answers (float32 layers): a centre's label and direction are good to a few percent only
#: (the three-sample fit with the plateau P amplifies the score rounding of tokens at
#: ``line_scale * token_scale``, ~1e-3 in m, up to 1e-2 in l at |m| ~ 3): two centres of one head
#: are told apart from two heads by these looser tolerances (directions of different heads are
#: unrelated, so 10% still separates them).
NOISY_DIRECTION_AGREEMENT = 1e-1
#: Two centres whose directions agree (DIRECTION_AGREEMENT, or the noisy one) are one head when
#: their labels agree to this: the labels carry their neighbours' incomplete saturation (``_accept``).
DUPLICATE_LABEL_AGREEMENT = 5e-2
NOISY_MAX_CENTER_LOG_POLE = 2.5  # ... and only centres where the fit with P is well conditioned


@dataclass
class LocatedHead:
    """A head found on a line.

    Attributes
    ----------
    label : ``l_h = v_h^T z``, from the three-sample fit at the centre.
    center : (d,) a final token where head h is in its window and the others are saturated.
    plateau : ``P`` at the centre (sum of the labels of the heads saturated towards y).
    log_pole : ``m_h`` at the centre.
    direction : (d,) rough ``a_h = W_h^T z`` from the readings around the centre.
    """

    label: float
    center: np.ndarray
    plateau: float
    log_pole: float
    direction: np.ndarray


@dataclass
class LineSearchReport:
    """What the search did: lines drawn, centres accepted, candidates rejected (two switches
    in one interval, or a reading outside the window)."""

    lines: int = 0
    centers: int = 0
    rejected: int = 0
    duplicates: int = 0
    heads: list[LocatedHead] = field(default_factory=list)
    queries: int = 0  # asked by the search (measured at the boundary by the caller)
    groups: int = 1  # differences z_1 searched (the caller's retries in a fresh group)


def locate_heads(gap: Callable, z: np.ndarray, max_heads: int, rng: np.random.Generator, token_scale: float,
                 quantize: Callable, line_scale: float = 16.0, half_length: float = 2.0, grid: int = 16,
                 patience: int = 6, max_lines: int | None = None, unit: float = EPS) -> LineSearchReport:
    """Find the heads visible in the z-group of ``z`` and rough estimates of their ``a_h``.

    Parameters
    ----------
    gap : ``gap(points (n, d), ks) -> (S, rounding)``, both (n, len(ks)): the gaps ``S_k`` at those
        final tokens (asked at the oracle boundary) and their expected rounding errors.
    z : the difference of the group.
    max_heads : stop when this many distinct heads are found.
    token_scale : norm at which ``z^T W x`` is of order one (sets the reading step).
    quantize : rounds a final token onto the run's exact grid.
    line_scale : ``|x0| = |u| = line_scale * token_scale``.
    half_length, grid : lines run over ``t in [-half_length, half_length]``, first sampled at
        ``grid + 1`` equispaced points.
    patience : stop after this many consecutive lines without a new head.
    unit : the answers' relative rounding unit (``EPS`` for float64; larger for float32 answers):
        the tolerances below are float64's or sized to it, whichever is larger.
    """
    d = len(z)
    report = LineSearchReport()
    max_lines = max_lines if max_lines is not None else 10 + 6 * max_heads
    step = token_scale**2 / np.linalg.norm(z)  # |a_h| ~ |z| / token_scale^2: steps move m_h by O(1)
    # Noisy answers: centres first only where the fit is well conditioned; if that leaves heads
    # unfound, another round of lines accepts the float64 range (a head
    # can show at no centre with |m| <= 2.5).
    tiers = [MAX_CENTER_LOG_POLE] if unit is None or unit <= EPS else [NOISY_MAX_CENTER_LOG_POLE, MAX_CENTER_LOG_POLE]
    for max_center in tiers:
        idle, last_line = 0, report.lines + max_lines
        while len(report.heads) < max_heads and idle < patience and report.lines < last_line:
            report.lines += 1
            if d == 1:  # the line is R itself (H <= d = 1: one head, switching at x = 0)
                u = np.array([line_scale * token_scale])
                x0 = rng.uniform(-0.5, 0.5) * u
            else:
                basis = np.linalg.qr(rng.standard_normal((d, 2)))[0] * line_scale * token_scale
                x0, u = basis[:, 0], basis[:, 1]
            found_before = len(report.heads)
            _search_line(gap, x0, u, half_length, grid, quantize, report, max_heads, step, rng, unit, max_center)
            idle = 0 if len(report.heads) > found_before else idle + 1
    return report


def _search_line(gap, x0, u, half_length, grid, quantize, report, max_heads, step, rng, unit=None,
                 max_center=MAX_CENTER_LOG_POLE):
    ts = np.linspace(-half_length, half_length, grid + 1)
    points = np.array([quantize(x0 + t * u) for t in ts])
    values, rounding = gap(points, (1,))
    values = values[:, 0]
    scale = max(float(np.abs(values).max()), np.finfo(float).tiny)
    # Differences below the rounding of the answers are noise, not steps (a line on which every
    # head stays saturated towards x has S_1 = 0 up to rounding).
    tolerance = max(1e-9 * scale, 1e3 * float(rounding.max()))
    # The fourth sample's agreement with the three-sample fit (the fit amplifies the samples' errors).
    agreement = max(1e-7, 1e3 * (unit or EPS)) * scale
    # A safety net: no line may take more bisection steps than this. A staircase's lines take at most
    # ~5 per head (d = 8..64, H = 3..32, float64 and float32); a line that is no staircase (a biased
    # oracle read as bias-free: vbar off by c Z^{-T} 1 adds a ramp, and every half is "significant")
    # would be bisected without end.
    budget = LINE_STEPS_PER_HEAD * (grid + 1) * max_heads
    stack = [(ts[n], values[n], ts[n + 1], values[n + 1], 0)
             for n in range(grid) if abs(values[n + 1] - values[n]) > tolerance]
    while stack and len(report.heads) < max_heads and budget > 0:
        budget -= 1
        t_a, G_a, t_b, G_b, depth = stack.pop()
        if depth > 40:
            continue
        t_m = 0.5 * (t_a + t_b)
        x_m = quantize(x0 + t_m * u)
        G_m = float(gap(x_m[None], (1,))[0][0, 0])
        fraction = (G_m - G_a) / (G_b - G_a)
        step_height = abs(G_b - G_a)
        if WINDOW_FRACTION < fraction < 1 - WINDOW_FRACTION:
            more = gap(x_m[None], CENTER_COPIES[1:])[0][0]
            # some head is in its window here (a step above tolerance: WINDOW_GAP of it is 5 rounding
            # scales or more, above the two samples' rounding)
            if abs(more[0] - G_m) > max(min(tolerance, WINDOW_GAP * step_height), 1e-9 * scale):
                samples = np.array([[G_m, more[0], more[1]]])
                P, label, m = (float(value[0]) for value in single_pole.fit_with_constant(samples))
                predicted = P + 4 * label / (4 + np.exp(m)) if np.isfinite(m) else np.nan
                # The label must be the height of the step being bisected (a blend of two barely
                # saturated neighbours can mimic a small single pole, but not the step).
                if (np.isfinite(m) and abs(m) <= max_center and abs(predicted - more[2]) <= agreement
                        and abs(abs(label) - step_height) <= 0.1 * step_height):
                    report.centers += 1
                    _accept(gap, x_m, P, label, m, quantize, report, step, rng, unit)
                else:
                    # Two heads in the window at once: halving cannot separate them; another
                    # line will meet these heads apart.
                    report.rejected += 1
                continue
            # A plateau between two switches: both halves hold a step.
        # A half holding only the tail of a sigmoid (under 2% of this interval's step) is not a switch.
        significant = max(tolerance, WINDOW_FRACTION * abs(G_b - G_a))
        for left, right, G_left, G_right in ((t_a, t_m, G_a, G_m), (t_m, t_b, G_m, G_b)):
            if abs(G_right - G_left) > significant:
                stack.append((left, G_left, right, G_right, depth + 1))


def _accept(gap, center, P, label, m, quantize, report, step, rng, unit=None):
    """A centre: a known head (same label, and its estimate predicts this log-pole) or a new one."""
    noisy = unit is not None and unit > EPS
    direction_agreement = NOISY_DIRECTION_AGREEMENT if noisy else DIRECTION_AGREEMENT
    for head in report.heads:
        # A known head predicts its own log-pole here; the label agrees up to the contamination of
        # a centre by neighbours that are saturated only to ~e^-10.
        # Predicted from the head's own centre: the log-pole is affine in x (a score bias, docs/algorithm.md, 'Biases:
        # affine scores and an output constant', adds a constant the direction does not carry).
        same_label = abs(head.label - label) <= 1e-2 * max(abs(head.label), abs(label))
        if same_label and abs(head.log_pole + head.direction @ (center - head.center) - m) <= 1.0:
            report.duplicates += 1
            return
    d = len(center)
    directions = np.linalg.qr(rng.standard_normal((d, d)))[0]
    deltas = np.full(d, step)
    readings = np.full(d, np.nan)
    for _ in range(4):  # shrink the step where a reading left the window
        todo = np.flatnonzero(~np.isfinite(readings))
        if not len(todo):
            break
        points = np.array([quantize(center + deltas[i] * directions[:, i]) for i in todo])
        actual = (points - center[None]) @ directions  # the quantized offsets, in the q basis
        values, rounding = (part[:, 0] for part in gap(points, (1,)))
        m_read = single_pole.reading(values, P, label)
        ok = np.isfinite(m_read) & (np.abs(m_read) <= MAX_READING_LOG_POLE)
        # The reading's own error from its sample's rounding, dm = dS (1 + tau)^2 / (|l| tau): with
        # float32 answers a reading at |m| ~ 7 has dm ~ 1 and sits at the noise floor (its direction
        # then far off, a head counted twice).
        with np.errstate(over="ignore", invalid="ignore"):
            tau = np.exp(np.clip(m_read, -MAX_READING_LOG_POLE, MAX_READING_LOG_POLE))
            ok &= rounding * (1.0 + tau) ** 2 / (abs(label) * tau) <= MAX_READING_ERROR
        for n, i in enumerate(todo):
            if ok[n]:
                readings[i] = (m_read[n] - m) / actual[n, i]
            else:
                deltas[i] /= 4
    direction = directions @ readings
    # One more reading along a random direction must agree with the estimate: a centre that was
    # not single-pole gives readings that are not affine in x.
    probe = rng.standard_normal(d)
    probe *= 0.5 * step / np.linalg.norm(probe)
    point = quantize(center + probe)
    check = single_pole.reading(gap(point[None], (1,))[0][:, 0], P, label)[0]
    if not np.isfinite(readings).all() or not abs(check - (m + direction @ (point - center))) <= 0.05:
        report.rejected += 1
        return
    for head in report.heads:
        # A known head whose prediction above missed: with noisy answers (float32) the direction's
        # error times the distance between the centres can exceed 1. Its direction is still the
        # same to a few digits, while another head's is not. The label is then compared loosely
        # even in float64: a centre's label carries its neighbours' incomplete saturation,
        # l_g exp(-|m_g|), which is a few percent of a small label when a large-label neighbour
        # sits at |m_g| ~ 5 (else one head is found twice, and every targeted instance then fails).
        same_label = abs(head.label - label) <= DUPLICATE_LABEL_AGREEMENT * max(abs(head.label), abs(label))
        if same_label and np.linalg.norm(head.direction - direction) <= direction_agreement * np.linalg.norm(direction):
            report.duplicates += 1
            return
    report.heads.append(LocatedHead(label, center, P, m, direction))
