"""Matching the heads of two instances through a link instance (docs/algorithm.md, 'Matching').

A link between an instance ``a`` (heads already in the reference order) and a new instance
``b`` has, for every head h, the pole ``m^a_h + m^b_{pi(h)}`` and a residue label that is
``l^a_h + l^b_{pi(h)}`` (row links) or ``l^b_{pi(h)} = l^a_h`` (column links). The permutation
``pi`` solves the H x H assignment problem (:func:`scipy.optimize.linear_sum_assignment`) on

    C[h, g] = min_p  (m^a_h + m^b_g - m^link_p)^2 / s_m^2  +  (label misfit)^2 / s_l^2,

a chi-square in units of each quantity's first-order sensitivity ``s`` (from the instances'
Jacobians). Both kinds of evidence count: a badly conditioned instance (two nearly equal poles)
is still matched by its labels, and equal labels by their poles.

The decision is discrete: stable while every error is below half the gap to the closest
competitor. ``ambiguity = sqrt(chosen cost / closest competing cost)`` (0 is certain, near 1 a
coin toss).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..numerics.highprec import magnitude_float


@dataclass
class LinkMatches:
    """Matches of a batch of links.

    Attributes
    ----------
    permutation : (n, r) int, head h of ``a`` is head ``permutation[h]`` of ``b``.
    link_heads : (n, r) int, head h is pole ``link_heads[h]`` of the link.
    pole_residual : (n,) max over heads of ``|m^a_h + m^b_pi(h) - m^link|``.
    ambiguity : (n,) sqrt of the chosen cost over the closest competing cost (0: certain).
    bijective : (n,) bool, the matched link poles are all distinct.
    order_ambiguity : (n,) the same ratio against other permutations of b only (the link's
        second-nearest poles not competing): how decisively b's head order was chosen. A link whose
        own poles nearly coincide is ambiguous and may match one pole to two heads, while b's order,
        decided by the labels of a and b as well, stays certain.
    """

    permutation: np.ndarray
    link_heads: np.ndarray
    pole_residual: np.ndarray
    ambiguity: np.ndarray
    bijective: np.ndarray
    order_ambiguity: np.ndarray


@dataclass
class Side:
    """One instance's poles and labels (n, r) with their sensitivities (n, r), floats."""

    m: np.ndarray
    l: np.ndarray
    s_m: np.ndarray
    s_l: np.ndarray


def _squared(values: np.ndarray) -> np.ndarray:
    """|x|^2 of an array computed in the kernels' arithmetic (floats or balls), as floats."""
    return np.nan_to_num(magnitude_float(values), nan=np.inf) ** 2


#: Up to this many heads the assignment is found by trying every permutation, all rows at once.
_ENUMERATED_HEADS = 4


def _assign(cost: np.ndarray) -> np.ndarray:
    """Per row n, the permutation ``cols`` minimising ``sum_h cost[n, h, cols[h]]``: what
    :func:`scipy.optimize.linear_sum_assignment` returns on ``min(cost[n], 1e300)``, (n, r) ints.

    Up to :data:`_ENUMERATED_HEADS` heads every permutation is summed for all rows at once; a row
    whose best total is not clear of the second best by more than the rounding of its largest
    cost (ties, infinite costs) goes to ``linear_sum_assignment``, which decides it as before."""
    n, r, _ = cost.shape
    clipped = np.minimum(cost, 1e300)
    out = np.zeros((n, r), dtype=int)
    if n == 0 or r == 0:
        return out
    if r > _ENUMERATED_HEADS:
        undecided = np.arange(n)
    else:
        perms = np.array(list(permutations(range(r))), dtype=int)  # (P, r)
        totals = clipped[:, np.arange(r)[None, :], perms].sum(axis=2)  # (n, P)
        best = totals.argmin(axis=1)
        out[:] = perms[best]
        if len(perms) > 1:
            two = np.partition(totals, 1, axis=1)[:, :2]
            scale = clipped.reshape(n, -1).max(axis=1)
            undecided = np.flatnonzero(~(two[:, 1] - two[:, 0] > 1e-9 * scale) | (scale >= 1e300))
        else:
            undecided = np.zeros(0, dtype=int)
    for row in undecided:
        out[row] = linear_sum_assignment(clipped[row])[1]
    return out


def _excluded_min(cost: np.ndarray, permutation: np.ndarray) -> np.ndarray:
    """Per row, the smallest cost off the chosen assignment: ``min_h min_{g != cols[h]} cost[h, g]``."""
    n, r, _ = cost.shape
    masked = cost.copy()
    masked[np.arange(n)[:, None], np.arange(r)[None, :], permutation] = np.inf
    return masked.reshape(n, -1).min(axis=1)


def _ambiguity(worst: np.ndarray, competitor: np.ndarray) -> np.ndarray:
    """``sqrt(worst / competitor)``, NaN as infinite; infinite where no competitor is positive."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # a ratio past float64 is infinite
        value = np.nan_to_num(np.sqrt(worst / competitor), nan=np.inf)
    return np.where(competitor > 0, value, np.inf)


def match_links(a: Side, b: Side, link: Side, labels_add: bool) -> LinkMatches:
    """Match heads for a batch of links (row links: ``labels_add``; column links: labels equal)."""
    n, r = np.shape(a.m)
    permutation = np.zeros((n, r), dtype=int)
    link_heads = np.zeros((n, r), dtype=int)
    pole_residual = np.zeros(n)
    ambiguity = np.zeros(n)
    bijective = np.ones(n, dtype=bool)
    order_ambiguity = np.zeros(n)
    if r == 0 or n == 0:
        return LinkMatches(permutation, link_heads, pole_residual, ambiguity, bijective, order_ambiguity)
    floor = 1e-300
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # failed fits give inf costs
        # Index layout (n, h, g, p): head h of a, head g of b, pole p of the link.
        pole_miss = (a.m[:, :, None, None] + b.m[:, None, :, None]) - link.m[:, None, None, :]
        pole_var = (a.s_m[:, :, None, None] ** 2 + b.s_m[:, None, :, None] ** 2 + link.s_m[:, None, None, :] ** 2)
        if labels_add:
            label_miss = (a.l[:, :, None, None] + b.l[:, None, :, None]) - link.l[:, None, None, :]
            label_var = a.s_l[:, :, None, None] ** 2 + b.s_l[:, None, :, None] ** 2 + link.s_l[:, None, None, :] ** 2
            label_term = _squared(label_miss) / np.maximum(label_var, floor)
        else:
            pair_miss = a.l[:, :, None, None] - b.l[:, None, :, None]
            pair_var = a.s_l[:, :, None, None] ** 2 + b.s_l[:, None, :, None] ** 2
            link_miss = b.l[:, None, :, None] - link.l[:, None, None, :]
            link_var = b.s_l[:, None, :, None] ** 2 + link.s_l[:, None, None, :] ** 2
            label_term = (_squared(pair_miss) / np.maximum(pair_var, floor)
                          + _squared(link_miss) / np.maximum(link_var, floor))
        chi2 = np.nan_to_num(_squared(pole_miss) / np.maximum(pole_var, floor) + label_term, nan=np.inf)
    cost = chi2.min(axis=3)
    nearest = chi2.argmin(axis=3)
    pole_distance = np.sqrt(_squared(pole_miss))
    permutation[:] = _assign(cost)
    rows, heads = np.arange(n)[:, None], np.arange(r)[None, :]
    link_heads[:] = nearest[rows, heads, permutation]
    chosen = cost[rows, heads, permutation]
    pole_residual[:] = pole_distance[rows, heads, permutation, link_heads].max(axis=1)
    if r > 1:
        # the closest competitor: another head of b for some head h, or the link's second-nearest pole
        other_order = _excluded_min(cost, permutation)
        competitor = np.minimum(other_order, np.sort(chi2[rows, heads, permutation], axis=2)[:, :, 1].min(axis=1))
    else:
        other_order = competitor = np.full(n, np.inf)
    ambiguity[:] = _ambiguity(chosen.max(axis=1), competitor)
    order_ambiguity[:] = _ambiguity(chosen.max(axis=1), other_order)
    ordered = np.sort(link_heads, axis=1)
    bijective[:] = (ordered[:, 1:] != ordered[:, :-1]).all(axis=1)
    return LinkMatches(permutation, link_heads, pole_residual, ambiguity, bijective, order_ambiguity)


def match_labels(a: Side, b: Side) -> LinkMatches:
    """Match heads of instances sharing a difference ``z`` by their residue labels alone.

    Residue labels ``l_h = v_h^T z`` do not depend on the final token (docs/algorithm.md, 'The lean schedule'):
    instances of one grid column carry the same labels. Cost ``(l^a_h - l^b_g)^2 / (s_a^2 + s_b^2)``;
    ``ambiguity`` as for links: equal labels (equal ``v``'s) give 1 and call for a link.
    """
    n, r = np.shape(a.m)
    permutation = np.zeros((n, r), dtype=int)
    ambiguity = np.zeros(n)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        miss = _squared(a.l[:, :, None] - b.l[:, None, :])
        variance = np.maximum(a.s_l[:, :, None] ** 2 + b.s_l[:, None, :] ** 2, 1e-300)
        cost = np.nan_to_num(miss / variance, nan=np.inf)
    if r and n:
        permutation[:] = _assign(cost)
    if r > 1 and n:
        chosen = cost[np.arange(n)[:, None], np.arange(r)[None, :], permutation]
        # (no positive competitor: the largest float, as the per-row version gave)
        ambiguity[:] = np.nan_to_num(_ambiguity(chosen.max(axis=1), _excluded_min(cost, permutation)), nan=np.inf)
    return LinkMatches(permutation, np.zeros((n, r), dtype=int), np.zeros(n), ambiguity, np.ones(n, dtype=bool),
                       ambiguity.copy())
