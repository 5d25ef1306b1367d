"""The targeted family's per-instance diagnostics, error estimate and checks (docs/algorithm.md, 'The targeted
schedule', 'Error estimate').
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...checks.base import Check, heads_found_check
from ..base import ScheduleDetails
from .linesearch import LineSearchReport
from .measure import CHUNK_BYTES, GroupMeasurements, all_heads_at, span_basis
from .tolerances import EPS, RESIDUAL_LIMIT, agreement_tolerance, prior_saturation_margin, saturation_margin


@dataclass
class TargetedInstances:
    """Per-instance diagnostics of a targeted run (arrays indexed by instance, query order).

    Attributes
    ----------
    stage : ``"first"`` (group ``z_1``, three samples), ``"bridge"`` (groups ``z_1 + eps z_j``, one
        or two samples) or ``"final"`` (each head's own basis, three samples in a unit's first
        instance and two in the others; these alone make the model).
    group : which difference: j of ``z_1 + eps z_j`` for bridges (1-based j >= 1 as ``group + 1``),
        the column of the head's basis for final instances, 0 for the first group.
    head : the head the instance was designed for (index into the extracted model).
    log_pole, label : measured ``m_h`` and ``l_h`` (label NaN for one-sample bridge readings).
    designed : the log-pole the design aimed at (``t``).
    residual : misfit of the samples to the single-pole form, in rounding units (first group and
        final instances of two or more samples; NaN for bridges and one-sample final rounds, whose
        single-pole form rests on the margin and on the paired rounds' test).
    margin : smallest log-pole of the other heads at this instance, from the extracted model.
    saturated : the instance held its assumption: margin >= :func:`saturation_margin` (final
        instances; the first group's and the bridges', which only aim the final stage:
        :func:`prior_saturation_margin`) and residual <= ``RESIDUAL_LIMIT`` (first group and final
        instances); for bridges the measured log-pole agrees with the extracted model to 1e-6.
    """

    stage: np.ndarray
    group: np.ndarray
    head: np.ndarray
    log_pole: np.ndarray
    label: np.ndarray
    designed: np.ndarray
    residual: np.ndarray
    margin: np.ndarray
    saturated: np.ndarray

    @property
    def unsaturated(self) -> np.ndarray:
        """Indices of the instances whose saturation assumption did not hold."""
        return np.flatnonzero(~self.saturated)


@dataclass
class TargetedDetails(ScheduleDetails):
    """``Extraction.details`` of the targeted schedule.

    Attributes
    ----------
    instances : TargetedInstances, one entry per targeted instance (first group, bridges, final).
    phase1 : :class:`~mhaextract.attention.targeted.linesearch.LineSearchReport` of the line search in group
        ``z_1`` (lines drawn, centres accepted and rejected, the heads found with their rough estimates).
    """

    instances: TargetedInstances
    phase1: LineSearchReport

    def summary(self) -> dict:
        return {"phase1_lines": self.phase1.lines, "unsaturated": int(len(self.instances.unsaturated))}

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"instances_{name}": np.asarray(values, dtype=str if name == "stage" else None)
                for name, values in vars(self.instances).items()}


def instance_diagnostics(stages, model, unit: float = EPS) -> TargetedInstances:
    """One row per targeted instance. The margins and the bridges' agreement with the model are
    exact where a stage kept its tokens (``KEEP_BYTES``). Elsewhere they are bounded from what each
    chunk kept: within the span of each unit's design estimates and mean token exactly, off it by Cauchy-Schwarz
    (:func:`_bounds_in_span`, where the stage kept the tokens' ``span_coordinates``), else the other
    heads' log-poles by the design estimates, less ``|a_g(model) - a_g(design)| |x|``, and a bridge's
    disagreement by its misfit to its own ``a`` plus ``|a - a_h(model)| |x|``. The bounds are at least
    as strict as the exact quantities (to rounding), the span's no looser than the other."""
    rows = []
    W_error = None
    if stages and unit > EPS and np.isfinite(stages[-1][1].error_squared[..., 0]).all():
        final = stages[-1][1]  # |dW_h|_F per head from the final stage's first-order errors
        W_error = (np.sqrt(final.error_squared[..., 0].sum(axis=0))
                   / np.linalg.norm(final.differences[0], axis=1))
    for stage, data in stages:
        G, H, rounds = data.log_pole.shape
        margin, agrees = np.full((G, H, rounds), np.nan), np.zeros((G, H, rounds), dtype=bool)
        tolerance = agreement_tolerance(unit)
        if unit > EPS:  # noisy answers: a one-sample bridge reading is as precise as its sample and the
            # label of its unit's first instance allow: dm = dG (1 + tau)^2 / (l tau) + (dl / l)(1 + e^-m)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                label_part = (np.abs(data.sigma_l[:, :, :1] / data.label[:, :, :1])
                              * (1.0 + np.exp(-data.log_pole)))
            reading = np.nan_to_num(data.sigma_m, nan=np.inf) + np.nan_to_num(label_part, nan=np.inf)
            if model is not None and W_error is not None:
                # the model's own log-pole at the instance is off by its W's error, |dW_h| |z| |x|
                # (the final stage's first-order error, docs/algorithm.md, 'The targeted schedule'): under declared
                # noise a bridge of a model within its estimate can disagree by that alone
                z_norm = np.linalg.norm(data.differences, axis=2)  # (G, H)
                reading = reading + W_error[None, :, None] * z_norm[:, :, None] * data.x_norm
            tolerance = np.maximum(tolerance, 10.0 * reading)
        if model is not None and data.finals is not None:  # exact: the model's log-poles at every instance
            model_a = all_heads_at(model.W, data.differences)  # a_f(z) of the model, every unit
            poles = np.einsum("ghfd,ghnd->ghnf", model_a, data.finals)
            own = poles[:, np.arange(H), :, np.arange(H)].transpose(1, 0, 2)  # (G, H, rounds)
            poles[:, np.arange(H), :, np.arange(H)] = np.inf
            margin = poles.min(axis=3) if H > 1 else np.full((G, H, rounds), np.inf)
            agrees = np.abs(own - data.log_pole) <= tolerance
        elif model is not None and data.span_coords is not None:
            margin, agrees = _bounds_in_span(data, model.W, tolerance)
        elif model is not None:
            drift, own = np.empty((G, H, H)), np.empty((G, H))
            # a slice of groups at a time: the model's and the design's a_f(z) at every unit are
            # H times the model's size each
            step = max(1, CHUNK_BYTES // (16 * H * H * data.differences.shape[2]))
            for start in range(0, G, step):
                groups = slice(start, start + step)
                model_a = all_heads_at(model.W, data.differences[groups])  # a_f(z) of the model
                drift[groups] = np.linalg.norm(model_a - data.estimates[groups], axis=3)
                own[groups] = np.linalg.norm(data.a[groups] - model_a[:, np.arange(H), np.arange(H)], axis=2)
            drift[:, np.arange(H), np.arange(H)] = 0.0
            margin = data.margin - drift.max(axis=2)[:, :, None] * data.x_norm
            agrees = data.misfit + own[:, :, None] * data.x_norm <= tolerance
        finite = np.isfinite(data.log_pole)
        # a one-sample final round has no residual: its single-pole form rests on the margin (the
        # other heads' log-poles from their own units) and on the paired rounds' test
        one_sample = np.isfinite(data.gaps).sum(axis=3) == 1
        held = agrees if stage == "bridge" else (data.residual <= RESIDUAL_LIMIT) | (one_sample & (stage == "final"))
        least = saturation_margin(unit) if stage == "final" else prior_saturation_margin(unit)
        ok = (margin >= least) & finite & held
        g, h, _ = np.meshgrid(np.arange(G), np.arange(H), np.arange(rounds), indexing="ij")
        rows.append((np.full(G * H * rounds, stage), g.ravel(), h.ravel(), data.log_pole.ravel(),
                     data.label.ravel(), data.designed.ravel(), data.residual.ravel(), margin.ravel(), ok.ravel()))
    if not rows:
        return TargetedInstances(*(np.array([], dtype=bool if name == "saturated" else float)
                                   for name in TargetedInstances.__dataclass_fields__))
    return TargetedInstances(*(np.concatenate(column) for column in zip(*rows)))


def span_bound(vectors: np.ndarray, basis: np.ndarray, coords: np.ndarray, off: np.ndarray):
    """``(centre, radius)`` (G, H, rounds, F) with ``|a_f^T x_n - centre| <= radius`` for vectors ``a_f``
    (G, H, F, D) of each unit and its tokens ``x_n``, known only by their coordinates ``coords``
    (G, H, rounds, k) in the unit's orthonormal ``basis`` Q (G, H, D, k) and their norms ``off``
    (G, H, rounds) off it (:func:`~.measure.span_coordinates`): ``a^T x = (Q^T a)^T c + (a - Q Q^T a)^T
    (x - Q c)``, exact in the span, Cauchy-Schwarz off it (docs/algorithm.md, 'The targeted schedule',
    'Margins without the tokens'). Never looser than ``|a| |x|``: ``|Q^T a| |c| + |a_off| |x_off| <= |a| |x|``."""
    along = np.matmul(vectors, basis)  # (G, H, F, k): Q^T a_f
    off_vectors = np.linalg.norm(vectors - np.matmul(along, np.swapaxes(basis, -1, -2)), axis=-1)  # (G, H, F)
    return np.matmul(coords, np.swapaxes(along, -1, -2)), off[..., None] * off_vectors[:, :, None, :]


def _bounds_in_span(data: GroupMeasurements, W: np.ndarray, tolerance):
    """The margins (G, H, rounds) and the bridges' agreement with the model ``W`` from the tokens'
    coordinates in the span of their units' design estimates and mean token (:func:`span_bound`): each other head's
    log-pole ``a_f(model)^T x_n`` at least ``centre - radius``; a bridge's disagreement
    ``|m_n - a_h(model)^T x_n|`` at most its misfit to its own ``a`` plus ``|(a - a_h(model))^T x_n|``.
    The design's estimates span the other heads' ``a_f`` up to the rough model's error, so only that
    error's part off the span meets the tokens' parts off it (their varying null-space parts, which in
    ``|a_g(model) - a_g(design)| |x|`` met the whole error: a float32 layer of 8 heads of width 8 at
    d = 64 read margins of -26 there where its model's were at least 34)."""
    G, H, rounds = data.log_pole.shape
    D = data.differences.shape[2]
    margin, disagreement = np.empty((G, H, rounds)), np.empty((G, H, rounds))
    step = max(1, CHUNK_BYTES // (16 * H * max(H, rounds) * D))
    heads = np.arange(H)
    for start in range(0, G, step):
        groups = slice(start, start + step)
        model_a = all_heads_at(W, data.differences[groups])  # (g, H, H, D): a_f(z) of the model
        basis = span_basis(np.asarray(data.estimates[groups]), data.mean_token[groups])
        coords, off = data.span_coords[groups], data.off_span[groups]
        centre, radius = span_bound(model_a, basis, coords, off)
        lower = centre - radius
        lower[:, heads, :, heads] = np.inf
        margin[groups] = lower.min(axis=3) if H > 1 else np.inf
        own = data.a[groups] - model_a[:, heads, heads]  # (g, H, D)
        centre, radius = span_bound(own[:, :, None, :], basis, coords, off)
        disagreement[groups] = data.misfit[groups] + np.abs(centre[..., 0]) + radius[..., 0]
    return margin, disagreement <= tolerance


def final_error_estimate(final: GroupMeasurements, model) -> tuple[float, float, tuple[float, float], tuple]:
    """``(estimate, its part from the oracle's score rounding alone, the score biases' error, the
    entries' spreads)`` (:func:`first_order_estimate`)."""
    return first_order_estimate(final.variance, final.differences, final.label_error, model)


def largest_of(count: int) -> float:
    """How many standard deviations the largest of ``count`` independent centred Gaussian errors
    reaches: ``sqrt(2 ln count)``, at least 3 (the largest of 16 exceeds 3 with probability ~4%)."""
    return max(3.0, float(np.sqrt(2.0 * np.log(max(count, 1)))))


def first_order_estimate(variance: np.ndarray, differences: np.ndarray, label_sigma: np.ndarray,
                         model) -> tuple[float, float, tuple[float, float], tuple]:
    """The first-order estimate of ``compare``'s ``max(W_rel, v_rel)`` (docs/algorithm.md, 'The targeted schedule',
    'Error estimate'), its part from the oracle's score rounding alone, the estimated absolute error of u's largest
    entry (with its score part; zeros without biases), and every entry's standard deviation with its score part
    (the last axis), ``(W (H, d, d, 2), u (H, d, 2) or None)`` (``Outcome.score_deviations``: the value fit moves
    the scores by them).

    ``variance`` (J, H, D, 2): unit j of head h measured ``a~_h(z_j) = (W_h^T z_j[, u_h^T z_j])``
    (D = d, or d + 1 with biases) with coordinate variances ``sum_n (X^{-1})_{in}^2 sigma_n^2``
    ([..., 1]: the part answer noise does not scale: the score-rounding terms, and a subspace unit's
    basis term, 'Low-rank heads'); ``differences`` (J, H, D) the ``z_j`` (the columns
    of ``Z_h``, orthogonal times ``|z|``); ``label_sigma`` (J, H) the consensus labels' errors.
    ``W_h = Z_h^{-T} A_h^T`` with ``Z_h^{-T} = Z_h / |z|^2``, so entry (k, i) of ``dW_h`` has
    variance ``sum_j (Z_h[k, j] / |z_j|^2)^2 var(a_j[i])``; ``u_h`` and ``v_h`` the same with the
    lifted coordinate and the labels. Each part is its largest entry's standard deviation times
    :func:`largest_of` its entry count, W's and v's relative to the model's largest entry
    (``compare``'s normalisation). Per entry, not per head: the rows and columns of ``W_h`` carry
    unequal shares of its error (the a_j's coordinates and the z_j's entries differ in variance),
    so its largest entry can exceed ``largest_of`` times the head's root mean square (a head-wise
    estimate understates float32 layers' errors). u's error stays absolute here: whether u is
    resolved from zero, and its error relative to max|u|, depends on the answers' noise, which
    ``extract`` measures after the run (``finish._bias_error``: real layers' score biases are small
    beside W, and their error is not W's)."""
    d = model.d
    J, H, D, _ = variance.shape
    z = differences[:, :, :d]
    weights = (z / (z * z).sum(axis=2, keepdims=True)) ** 2  # (J, H, d): (Z_h^{-T})[k, j]^2
    weights = weights.transpose(1, 2, 0)  # (H, d, J)
    with np.errstate(over="ignore", invalid="ignore"):
        W_var = np.matmul(weights, variance[:, :, :d].transpose(1, 0, 2, 3).reshape(H, J, 2 * d))
        W_std = np.sqrt(W_var.reshape(H, d, d, 2).max(axis=(0, 1, 2)))  # (2,)
        W_part = largest_of(H * d * d) * W_std / max(float(np.abs(model.W).max()), 1e-300)
        v_std = np.sqrt(np.matmul(weights, label_sigma.T[:, :, None] ** 2).max())
        v_part = largest_of(H * d) * v_std / max(float(np.abs(model.v).max()), 1e-300)
        u_error, u_spread = np.zeros(2), None
        if D == d + 1:
            u_var = np.matmul(weights, variance[:, :, d].transpose(1, 0, 2))  # (H, d, 2)
            u_error = largest_of(H * d) * np.sqrt(u_var.max(axis=(0, 1)))
            u_spread = np.sqrt(u_var)
        spread = (np.sqrt(W_var.reshape(H, d, d, 2)), u_spread)
    return (float(np.max([W_part[0], v_part])), float(W_part[1]), (float(u_error[0]), float(u_error[1])),  # NaN stays
            spread)


def label_deviation(labels: np.ndarray, sigma: np.ndarray, unit: float) -> float:
    """The largest deviation of an instance's label from the inverse-variance mean of its unit's
    (the last axis), in its own first-order errors ``sigma + unit max|label|`` (``unit``: the
    answers' relative error). The inverse-variance mean is the consensus the fits use: in a plain
    mean, an instance far off its target's centre, whose label error can be 1e7 x the others',
    would move the mean by thousands of theirs and fail correct runs."""
    scale = np.nanmax(np.abs(labels))
    error = sigma + unit * scale
    weights = np.where(np.isfinite(labels), 1.0 / np.maximum(error, 1e-300) ** 2, 0.0)
    mean = (np.nan_to_num(labels) * weights).sum(axis=-1, keepdims=True) / np.maximum(
        weights.sum(axis=-1, keepdims=True), 1e-300)
    return float(np.nanmax(np.abs(labels - mean) / error))


def targeted_checks(instances: TargetedInstances, search: LineSearchReport, H, heads_given, measurements, unit: float = EPS):
    checks = [heads_found_check(H, heads_given, f"by phase 1 on {search.lines} lines")]
    bad = instances.unsaturated
    where = ", ".join(f"{instances.stage[i]} group {instances.group[i]} head {instances.head[i]}" for i in bad[:5])
    checks.append(Check(
        "saturation", len(bad) == 0, len(bad), 0,
        f"{len(bad)} of {len(instances.saturated)} targeted instances did not hold their saturation assumption"
        + (f" ({where}{', ...' if len(bad) > 5 else ''})" if len(bad) else ""),
    ))
    deviation = max((label_deviation(data.label, data.sigma_l, unit) for data in measurements), default=0.0)
    checks.append(Check("labels_consistent", deviation <= 1e3, deviation, 1e3,
                        "largest deviation of an instance's label from its (head, group) inverse-variance "
                        "mean, in first-order errors"))
    return checks
