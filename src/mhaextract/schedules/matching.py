"""Matching the heads of two instances through a link instance (docs/algorithm.md §8).

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
    """

    permutation: np.ndarray
    link_heads: np.ndarray
    pole_residual: np.ndarray
    ambiguity: np.ndarray
    bijective: np.ndarray


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


def match_links(a: Side, b: Side, link: Side, labels_add: bool) -> LinkMatches:
    """Match heads for a batch of links (row links: ``labels_add``; column links: labels equal)."""
    n, r = np.shape(a.m)
    permutation = np.zeros((n, r), dtype=int)
    link_heads = np.zeros((n, r), dtype=int)
    pole_residual = np.zeros(n)
    ambiguity = np.zeros(n)
    bijective = np.ones(n, dtype=bool)
    if r == 0:
        return LinkMatches(permutation, link_heads, pole_residual, ambiguity, bijective)
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
    for row in range(n):
        rows, cols = linear_sum_assignment(np.minimum(cost[row], 1e300))
        permutation[row] = cols
        link_heads[row] = nearest[row, rows, cols]
        chosen = cost[row, rows, cols]
        pole_residual[row] = pole_distance[row, rows, cols, link_heads[row]].max()
        if r > 1:
            competitor = min(np.delete(cost[row, h], cols[h]).min() for h in range(r))
            second_pole = np.sort(chi2[row, rows, cols], axis=1)[:, 1].min()
            competitor = min(competitor, second_pole)
        else:
            competitor = np.inf
        worst = chosen.max()
        with np.errstate(invalid="ignore", divide="ignore"):
            ambiguity[row] = np.nan_to_num(np.sqrt(worst / competitor), nan=np.inf) if competitor > 0 else np.inf
        bijective[row] = len(set(link_heads[row])) == r
    return LinkMatches(permutation, link_heads, pole_residual, ambiguity, bijective)


def match_labels(a: Side, b: Side) -> LinkMatches:
    """Match heads of instances sharing a difference ``z`` by their residue labels alone.

    Residue labels ``l_h = v_h^T z`` do not depend on the final token (docs/algorithm.md §10):
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
    for row in range(n):
        rows, cols = linear_sum_assignment(np.minimum(cost[row], 1e300))
        permutation[row] = cols
        if r > 1:
            competitor = min(np.delete(cost[row, h], cols[h]).min() for h in range(r))
            with np.errstate(invalid="ignore", divide="ignore"):
                value = np.sqrt(cost[row, rows, cols].max() / competitor) if competitor > 0 else np.inf
            ambiguity[row] = np.nan_to_num(value, nan=np.inf)
    return LinkMatches(permutation, np.zeros((n, r), dtype=int), np.zeros(n), ambiguity, np.ones(n, dtype=bool))
