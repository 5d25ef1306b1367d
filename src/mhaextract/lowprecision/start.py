"""A start model from saturated two-token queries: heads told apart at 8 bits (docs/algorithm.md, 'Whole answers at 8 or
11 bits: saturated lines, then least squares').

For a query token ``z`` and a key ``x = z + t e`` (``e`` a unit direction), the two-token query
``[x, z]`` answers, with ``V = sum_h V_h`` and rates ``alpha_h(z) = e^T (W_h z + u_h)``,

    y = V z + c + t sum_h sigmoid(t alpha_h(z)) V_h e,

and one-token queries ``[z]`` answer ``V z + c`` exactly (the value map, :func:`value_map`).
Three stages, each well conditioned at a few significant bits:

* labels (:func:`direction_labels`): with ``|t alpha_h| >> 1`` every head is saturated, and
  ``R(z) = (y - V z - c) / t`` is the subset sum of the labels ``w_h = V_h e`` of the heads with
  ``alpha_h(z) > 0``, as precise as the answers whatever ``t``. Along a line of query tokens
  ``z(s) = rho (z_0 + s z_1)`` it is piecewise constant, jumping by ``+-w_h`` where head h's rate
  crosses zero. Jumps that recur on several lines are labels (two heads crossing together make a
  sum, which does not recur); their signs are those whose sum is ``V e``.
* rates (:func:`direction_rates`): with the labels known, ``R(z, t) = sum_h sigmoid(t alpha_h) w_h``
  is linear in the H sigmoids, which least squares separates; ``alpha_h = logit(sigma_h) / t``
  where ``sigma_h`` is away from 0 and 1, and ``alpha_h(z) = g_h^T z + beta_h`` is affine in z:
  ``g_h = W_h^T e``, ``beta_h = u_h^T e``.
* assembly (:func:`saturated_start`): d orthonormal directions ``e_k`` give ``W_h = E G_h^T``,
  ``u_h = E beta_h``, ``V_h = L_h E^T``; the heads of direction ``e_k`` are matched to those of
  ``e_1`` by the labels of the bridge ``(e_1 + e_k) / sqrt 2``, ``w(b) = (w(e_1) + w(e_k)) / sqrt 2``.

The start is 1e-2..0.3 off (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least
squares'); :mod:`mhaextract.lowprecision.fit` takes it to the answers' noise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..models.attention import MultiHeadAttention
from ..oracle.answer_stats import FORMAT_UNITS

#: Saturating key length, in token scales: ``|t alpha_h|`` of order 100 away from a crossing.
SATURATING = 400.0
#: A saturated query the layer's dtype cannot answer (a float16 layer's scores overflow: the answer
#: is not finite) is asked again with its key length divided by this, down to SATURATED_FLOOR token
#: scales (``|t alpha_h|`` still of order 5 there), and left out of its line beyond.
BACK_OFF = 4.0
SATURATED_FLOOR = 25.0 / 4
#: Samples per line of query tokens, and the line's half-length (in token scales).
LINE_SAMPLES = 64
LINE_HALF_LENGTH = 3.0
#: Lines tried per direction (or bridge) before its labels are declared not found; their token
#: scales cycle through LINE_SCALES doublings of the run's. A run that finds every direction's
#: labels within fewer lines asks the same queries whatever the cap: a float16 GPT2Attention
#: (d = 128, H = 8, weights of std 0.2) needed more than 16 on a bridge.
MOST_LINES = 48
LINE_SCALES = 3
#: A jump joins a cluster within this relative distance of its centre.
CLUSTER_RADIUS = 0.05
#: The labels' signed sum must give V e within this relative misfit.
SUM_MISFIT = 0.02
#: Recurring jumps beyond the H most frequent that may stand in for one of them.
SPARE_CLUSTERS = 2
#: Key lengths of the rate queries, in token scales (one of them puts each head near sigma = 1/2).
RATE_LENGTHS = (0.5, 2.0, 8.0, 32.0)
#: Sigmoid values read as rates (beyond them logit amplifies the answers' rounding too much).
SIGMOID_RANGE = (0.02, 0.98)
#: Largest H for the exhaustive search of the labels' signs (2^H sums).
MOST_SIGN_HEADS = 16


class LabelsNotFound(RuntimeError):
    """A direction whose H labels did not show on any of the lines tried (heads crossing together,
    or outside the lines, every time)."""


@dataclass
class ValueMap:
    """``y([z]) = V z + c``: the sum of the heads' value read-outs and the output constant, by least
    squares over one-token queries. ``misfit``: relative RMS misfit of those answers."""

    V: np.ndarray
    c: np.ndarray
    misfit: float

    def __call__(self, Z: np.ndarray) -> np.ndarray:
        return Z @ self.V.T + self.c


def value_map(boundary, rng, d: int, scale: float, count: int | None = None) -> ValueMap:
    """Ask ``count`` (default 4d) one-token queries of norm about ``scale``; fit ``V`` and ``c``."""
    count = 4 * d if count is None else count
    Z = rng.standard_normal((count, d)) * (scale / np.sqrt(d))
    answers = boundary.ask([z[None] for z in Z], "the value map", whole=True)
    design = np.hstack([Z, np.ones((count, 1))])
    solution, *_ = np.linalg.lstsq(design, answers, rcond=None)
    misfit = float(np.sqrt(np.mean((design @ solution - answers) ** 2)) / max(np.abs(answers).max(), 1e-300))
    return ValueMap(solution[:d].T.copy(), solution[d].copy(), misfit)


def _unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def line_plateaus(boundary, values: ValueMap, rng, e: np.ndarray, scale: float,
                  magnification: float = 1.0) -> list[np.ndarray]:
    """The plateau values of ``R(z(s))`` along one random line of query tokens
    ``z(s) = magnification scale (z0 + s z1)`` (``LINE_SAMPLES`` queries, ``s`` in
    ``[-LINE_HALF_LENGTH, LINE_HALF_LENGTH]`` at equal steps of ``arctan s``; keys ``z + t e`` with
    ``t = SATURATING scale`` whatever the magnification, which a float16 layer's scores could not
    carry, or shorter where the layer overflowed: :func:`saturated_answers`): runs of
    samples whose consecutive differences stay below 20 times their median (the answers' rounding)
    and 1% of the largest R."""
    d = len(e)
    z1 = _unit(rng.standard_normal(d))
    z0 = rng.standard_normal(d)
    z0 = _unit(z0 - (z0 @ z1) * z1)
    # equal steps in the token's direction: head h crosses at s = -(g_h^T z0 + beta_h / m) / g_h^T z1
    # (m the line's token scale), about a Cauchy variable where the bias is small beside W_h z, whose
    # arctangent is about uniform; equal steps in s would put the fewest samples where most heads cross
    s = np.tan(np.linspace(-np.arctan(LINE_HALF_LENGTH), np.arctan(LINE_HALF_LENGTH), LINE_SAMPLES))
    Z = magnification * scale * (z0[None] + s[:, None] * z1[None])
    t, answers = saturated_answers(boundary, Z, e, scale)
    kept = np.isfinite(answers).all(axis=1)
    R = ((answers - values(Z)) / t[:, None])[kept]
    if len(R) < 2:
        return []
    steps = np.linalg.norm(np.diff(R, axis=0), axis=1)
    threshold = max(20.0 * float(np.median(steps)), 1e-2 * float(np.linalg.norm(R, axis=1).max()))
    runs, current = [], [0]
    for m, step in enumerate(steps):
        if step < threshold:
            current.append(m + 1)
        else:
            runs.append(current)
            current = [m + 1]
    runs.append(current)
    return [R[run].mean(axis=0) for run in runs if len(run) >= 2]


def saturated_answers(boundary, Z: np.ndarray, e: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``(t, answers)``: the whole answers to ``[z + t e, z]`` for each row z of ``Z``, with
    ``t = SATURATING scale`` where the layer answers it; a query whose answer is not finite (the
    layer's dtype overflowed at that key) asked again at ``t / BACK_OFF``, counted, down to
    ``SATURATED_FLOOR scale`` (still saturated: ``R`` is the same subset sum of labels), and left NaN
    beyond (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least
    squares'). Every line starts again at ``SATURATING``: a key shortened for all its samples
    leaves too many unsaturated (a simulated layer whose scores overflow above 200 then found no
    labels)."""
    t = np.full(len(Z), SATURATING * scale)
    answers = boundary.ask([np.stack([z + key * e, z]) for z, key in zip(Z, t)], "saturated lines", whole=True,
                           overflow=True)
    while True:
        again = np.flatnonzero(~np.isfinite(answers).all(axis=1) & (t / BACK_OFF >= SATURATED_FLOOR * scale))
        if not len(again):
            return t, answers
        t[again] /= BACK_OFF
        answers[again] = boundary.ask([np.stack([Z[n] + t[n] * e, Z[n]]) for n in again],
                                      "saturated lines, nearer keys (the layer overflowed)", whole=True, overflow=True)


def _signed(labels: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, float]:
    """The signs of the labels whose sum is ``total`` (= V e), and the relative misfit."""
    H = len(labels)
    if H > MOST_SIGN_HEADS:  # least squares, rounded to signs
        coefficients, *_ = np.linalg.lstsq(labels.T, total, rcond=None)
        signs = np.where(coefficients >= 0, 1.0, -1.0)
    else:
        sums = np.array(list(itertools.product((1.0, -1.0), repeat=H)))
        signs = sums[int(np.argmin(np.linalg.norm(sums @ labels - total, axis=1)))]
    misfit = float(np.linalg.norm(signs @ labels - total) / max(np.linalg.norm(total), 1e-300))
    return signs[:, None] * labels, misfit


def direction_labels(boundary, values: ValueMap, rng, e: np.ndarray, heads: int, scale: float) -> tuple[np.ndarray, int]:
    """The labels ``w_h = V_h e`` (heads, d_out) of direction ``e`` and the lines it took.

    Raises :class:`LabelsNotFound` after ``MOST_LINES`` lines."""
    total = values.V @ e
    clusters: list[list] = []  # [sum of members, count]
    for line in range(1, MOST_LINES + 1):
        # a head whose score bias outweighs W_h z on these lines crosses far out on them: lines of
        # larger tokens (the bias's share shrinks as 1 / scale), in turn with the base scale
        plateaus = line_plateaus(boundary, values, rng, e, scale, 2.0 ** ((line - 1) % LINE_SCALES))
        for before, after in zip(plateaus, plateaus[1:]):
            jump = after - before
            jump = jump * np.sign(jump[np.argmax(np.abs(jump))])  # +-w_h: one sign for the clustering
            for cluster in clusters:
                centre = cluster[0] / cluster[1]
                if np.linalg.norm(jump - centre) < CLUSTER_RADIUS * np.linalg.norm(centre):
                    cluster[0] = cluster[0] + jump
                    cluster[1] += 1
                    break
            else:
                clusters.append([jump.copy(), 1])
        recurring = sorted((c for c in clusters if c[1] >= 2), key=lambda c: -c[1])
        if len(recurring) >= heads:
            # the H most frequent jumps; should their signed sum miss V e (two heads that often
            # cross together recur as their sum), the other H of the SPARE_CLUSTERS more, most
            # frequent first
            counts = np.array([c[1] for c in recurring])
            pool = range(min(len(recurring), heads + SPARE_CLUSTERS))
            for subset in sorted(itertools.combinations(pool, heads), key=lambda chosen: -counts[list(chosen)].sum()):
                labels, misfit = _signed(np.stack([recurring[i][0] / recurring[i][1] for i in subset]), total)
                if misfit < SUM_MISFIT:
                    return labels, line
    raise LabelsNotFound(f"the {heads} labels of a direction did not show on {MOST_LINES} lines of saturated "
                         f"queries ({len(clusters)} jumps seen, {sum(c[1] >= 2 for c in clusters)} recurring): the "
                         "heads are not resolved at these answers' precision (heads that switch together on every "
                         "line), or the oracle is not one attention layer")


def direction_rates(boundary, values: ValueMap, rng, e: np.ndarray, labels: np.ndarray,
                    scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``g_h = W_h^T e`` (heads, d) and ``beta_h = u_h^T e`` (heads,) from ``2d`` query tokens and
    the ``RATE_LENGTHS`` keys each, and how many rates each head's fit used."""
    d, heads = len(e), len(labels)
    count = 2 * d
    Z = rng.standard_normal((count, d)) * (scale / np.sqrt(d))
    lengths = scale * np.asarray(RATE_LENGTHS)
    sequences = [np.stack([z + t * e, z]) for z in Z for t in lengths]
    # a key the layer's dtype overflowed at answers NaN (the boundary's overflow): no reading there
    answers = boundary.ask(sequences, "rates", whole=True, overflow=True).reshape(count, len(lengths), -1)
    R = (answers - values(Z)[:, None, :]) / lengths[None, :, None]
    sigmoids = np.einsum("hk,ntk->nth", np.linalg.pinv(labels.T), R)
    low, high = SIGMOID_RANGE
    with np.errstate(invalid="ignore"):
        usable = (sigmoids > low) & (sigmoids < high)
    sigmoids = np.where(np.isfinite(sigmoids), sigmoids, 0.5)
    clipped = np.clip(sigmoids, low, high)
    # d alpha = d sigma / (sigma (1 - sigma) t): the weight of a reading is its inverse
    weights = np.where(usable, clipped * (1 - clipped) * lengths[None, :, None], 0.0)
    readings = np.log(clipped / (1 - clipped)) / lengths[None, :, None]
    best = np.argmax(weights, axis=1)  # per query token and head: the length nearest sigma = 1/2
    pick = lambda array: np.take_along_axis(array, best[:, None, :], axis=1)[:, 0, :]
    alpha, weight = pick(readings), pick(weights)
    g, beta, used = np.zeros((heads, d)), np.zeros(heads), (weight > 0).sum(axis=0)
    design = np.hstack([Z, np.ones((count, 1))])
    for h in range(heads):
        w = weight[:, h]
        solution, *_ = np.linalg.lstsq(design * w[:, None], alpha[:, h] * w, rcond=None)
        g[h], beta[h] = solution[:d], solution[d]
    return g, beta, used


#: Token scales tried by :func:`order_one_scale`: factors 2^-8 .. 2^16 of the first guess.
SCALE_STEPS = range(-8, 17)
#: Departure of ``R`` from its linear-response value ``V e / 2`` taken as scores of order one.
ORDER_ONE = 0.1
#: Token pairs per trial scale.
SCALE_SAMPLES = 8
#: A departure counts when it is this many times the answers' rounding divided by rho.
NOISE_MARGIN = 30.0


def order_one_scale(boundary, values: ValueMap, rng, d: int, first: float) -> float:
    """A token norm rho at which scores ``z^T W_h x`` are of order one, found by queries.
    (Where the layer's dtype overflows before, its answers not finite, the last rho it answered.)

    For tokens of norm rho, ``R = (y([rho (z + e), rho z]) - V rho z - c) / rho`` is ``V e / 2`` while
    the scores are small and moves by a fraction of ``|V e|`` once they are of order one (the
    heads switch). The answers' rounding, ``unit |y|``, reaches R divided by rho: a departure counts
    only above ``NOISE_MARGIN`` times it. The first rho of ``first * 2^k`` whose median departure
    (``SCALE_SAMPLES`` token pairs) reaches ``ORDER_ONE`` of ``|V e|`` that way;
    ``first * 2^16`` when none does (a layer whose scores never switch is not resolved by this
    start and fails its checks).
    """
    unit = max(boundary.stats.unit_roundoff, FORMAT_UNITS["float32"])
    pairs = [(_unit(rng.standard_normal(d)), _unit(rng.standard_normal(d))) for _ in range(SCALE_SAMPLES)]
    half = np.stack([values.V @ e for _, e in pairs]) / 2
    for step in SCALE_STEPS:
        rho = first * 2.0 ** step
        Z = np.stack([rho * z for z, _ in pairs])
        answers = boundary.ask([np.stack([rho * (z + e), rho * z]) for z, e in pairs], "choosing the token scale",
                               whole=True, overflow=True)
        if not np.isfinite(answers).all():
            return rho / 2 if step > SCALE_STEPS[0] else rho
        departure = np.linalg.norm((answers - values(Z)) / rho - half, axis=1)
        rounding = NOISE_MARGIN * unit * np.linalg.norm(answers, axis=1) / rho
        if np.median(departure) >= ORDER_ONE * 2 * np.median(np.linalg.norm(half, axis=1)) and \
                np.median(departure) >= np.median(rounding):
            return rho
    return first * 2.0 ** SCALE_STEPS[-1]


@dataclass
class SaturatedStart:
    """The start model and how it was found.

    model : MultiHeadAttention (whole: V (H, d_out, d), c (d_out,)).
    values : the value map. scale : the token norm rho. lines : lines asked per direction and per bridge.
    rates_used : (d, H) rate readings each head's affine fit used, per direction.
    """

    model: MultiHeadAttention
    values: ValueMap
    scale: float
    lines: list = field(default_factory=list)
    bridge_lines: list = field(default_factory=list)
    rates_used: np.ndarray | None = None


def saturated_start(boundary, rng, d: int, heads: int, scale: float | None = None,
                    on_direction=None) -> SaturatedStart:
    """The start model of the module docstring (raises :class:`LabelsNotFound`); ``scale`` None:
    found by :func:`order_one_scale` from ``d^(1/4)``."""
    values = value_map(boundary, rng, d, d ** 0.25 if scale is None else scale)
    if scale is None:
        scale = order_one_scale(boundary, values, rng, d, d ** 0.25)
        values = value_map(boundary, rng, d, scale)
    E = np.linalg.qr(rng.standard_normal((d, d)))[0]
    labels, g, beta, lines, used = [], [], [], [], []
    for k in range(d):
        found, count = direction_labels(boundary, values, rng, E[:, k], heads, scale)
        rows, offsets, readings = direction_rates(boundary, values, rng, E[:, k], found, scale)
        labels.append(found), g.append(rows), beta.append(offsets), lines.append(count), used.append(readings)
        if on_direction is not None:
            on_direction(k + 1, d)
    bridges = []
    for k in range(1, d):
        bridge = (E[:, 0] + E[:, k]) / np.sqrt(2.0)
        found, count = direction_labels(boundary, values, rng, bridge, heads, scale)
        bridges.append(count)
        # cost of pairing head i of e_1 with head j of e_k: the nearest bridge label to their sum
        sums = (labels[0][:, None, :] + labels[k][None, :, :]) / np.sqrt(2.0)
        cost = np.linalg.norm(sums[:, :, None, :] - found[None, None, :, :], axis=-1).min(axis=2)
        _, order = linear_sum_assignment(cost)
        labels[k], g[k], beta[k] = labels[k][order], g[k][order], beta[k][order]
    L = np.stack(labels, axis=2)  # (heads, d_out, d): columns w_h(e_k)
    G = np.stack(g, axis=1)  # (heads, d, d): G[h, k] = g_h(e_k) = W_h^T e_k
    B = np.stack(beta, axis=1)  # (heads, d)
    W = np.einsum("ik,hkj->hij", E, G)  # W_h^T E = G_h^T, so W_h = E G_h
    u = B @ E.T
    V = L @ E.T
    model = MultiHeadAttention(W, V, u, values.c)
    return SaturatedStart(model, values, scale, lines, bridges, np.stack(used))
