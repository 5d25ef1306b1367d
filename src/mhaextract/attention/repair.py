"""Certificate repair of the grid schedules in high precision (docs/algorithm.md, 'Certificate repair: failed instances
measured again with their poles pulled apart').

An instance whose Krawczyk test failed ('Kernels in ball arithmetic and certification': two poles so close that the
answers' one-ulp balls admit complex-conjugate poles) is measured again with its close poles pulled apart. Its log-poles
``m_h(x) = z^T (W_h x + u_h)`` are affine in the final token x (linear without biases), its
residue labels ``l_h = v_h^T z`` and its constant ``c = c0 + vbar^T (x - z)`` do not depend on x
or are affine in it. With a *partner* instance r of the same difference z and another final token
``x_r``, the *mix* instance (final ``(x_n + x_r) / 2``, difference z) has

    m_h(mix) = (m_h(x_n) + m_h(x_r)) / 2,   l_h(mix) = l_h(x_r) = l_h(x_n),   c(mix) = (c_n + c_r) / 2,

so its two formerly close poles differ by half their difference at ``x_r``, generically O(1).
If partner and mix certify, ``m_h(x_n) = 2 m_h(mix) - m_h(x_r)`` and ``c_n = 2 c(mix) - c_r`` in
ball arithmetic enclose the failed instance's exact parameters. Heads are paired by their labels:
the partner's label balls must be pairwise disjoint and each of the mix's label balls must overlap
exactly one of them (the true labels of one head are the same number in both instances).

Partners and mixes are taken where they already exist (a certified instance of the schedule with
that final token and difference: no query) and asked otherwise, the partner whose mix the fits'
midpoints predict to have the widest pole gap first (:func:`_predicted_gap`). Asked instances are
self-anchored (``k = 0..K-1``, K queries): they need no ``vbar``, so instances of row 0 (which
``vbar`` is computed from) are repaired before it. Final tokens stay exact: tokens are multiples
of a power of two with ``TOKEN_BITS`` bits ('Numerics in float64 and the token scale'), so the half sum is exact in
float64 (checked in rational arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..numerics.highprec import mid_float
from ..oracle.queries import Instance

#: Mix instances tried per failed instance before it stays uncertified.
ATTEMPTS = 3


@dataclass
class Repair:
    """One failed instance and what its repair did.

    instance : index into ``schedule.instances``; partner, mix : the final tokens' origin in words;
    queries : oracle queries this repair asked; certified : the instance's balls are now proven;
    reason : why not (empty when certified).
    """

    instance: int
    partner: str
    mix: str
    queries: int
    certified: bool
    reason: str

    def describe(self, instances) -> str:
        inst = instances[self.instance]
        state = "repaired" if self.certified else f"not repaired: {self.reason}"
        return (f"{inst.role} ({inst.i}, {inst.j}): {state} (partner {self.partner}, mix {self.mix}, "
                f"{self.queries} queries)")


class Repairer:
    """Repairs failed instances of one :class:`~.grid.GridLearner` (module docstring)."""

    def __init__(self, learner):
        self.learner = learner
        self.records: list[Repair] = []
        self.queries = 0

    # --- instances: the schedule's and those asked here ------------------------------------------
    def _ask(self, final: np.ndarray, difference: np.ndarray, what: str):
        """Ask a self-anchored instance (k = 0..K-1) and fit it: (fit of one row, queries)."""
        learner = self.learner
        schedule, arithmetic = learner.schedule, learner.arithmetic
        instance = Instance("repair", -1, -1, final, difference, tuple(int(k) for k in schedule.ks))
        sequences = [instance.sequence(k) for k in instance.ks]
        answers = learner.boundary.ask(sequences, description=f"certificate repair ({what})")
        learner.record_extra(sequences, answers)
        self.queries += len(sequences)
        samples = arithmetic.empty_samples(1, len(schedule.ks))
        samples[0, :] = answers
        return arithmetic.fit(samples, schedule.ks, learner.H_star), len(sequences)

    @staticmethod
    def _row(fits, row: int) -> dict:
        return {name: getattr(fits, name)[row] for name in ("c", "log_poles", "labels", "sigma_m", "sigma_l",
                                                            "certified", "nonpositive")}

    def _existing(self, fits, members, final, difference, exclude):
        """Certified instances among ``members`` (rows of ``fits``) with this difference and, if
        ``final`` is given, this final token; else every other final token. Yields (row, name)."""
        instances = self.learner.schedule.instances
        for row, index in enumerate(members):
            if index == exclude or not fits.certified[row] or fits.nonpositive[row]:
                continue
            inst = instances[index]
            if not np.array_equal(inst.difference, difference):
                continue
            if final is None and not np.array_equal(inst.final, instances[exclude].final):
                yield row, f"{inst.role} ({inst.i}, {inst.j})"
            elif final is not None and np.array_equal(inst.final, final):
                yield row, f"{inst.role} ({inst.i}, {inst.j})"

    # --- the repair ------------------------------------------------------------------------------
    def repair(self, fits, members) -> None:
        """Repair every failed row of ``fits`` (``fits`` row p is instance ``members[p]``) in place.

        Then, while a pass repaired something, the rows still failed are tried again with mixes
        that now exist certified (repaired in the meantime: no query)."""
        members = np.asarray(members)
        failed = {int(row): self._repair_one(fits, members, int(row))
                  for row in np.flatnonzero(~np.asarray(fits.certified, dtype=bool))}
        progress = any(record.certified for record in failed.values())
        while progress:
            progress = False
            for row, record in failed.items():
                if record.certified:
                    continue
                retry = self._repair_one(fits, members, row, free_only=True)
                if retry.certified:
                    retry.queries += record.queries
                    failed[row], progress = retry, True
        self.records += list(failed.values())

    def _repair_one(self, fits, members, row: int, free_only: bool = False) -> Repair:
        learner = self.learner
        schedule = learner.schedule
        index = int(members[row])
        target = schedule.instances[index]
        asked = 0
        reasons = []
        partners = list(self._existing(fits, members, None, target.difference, index))
        # (partner row, its name, (mix row, name) or None to ask the mix); partner row None: ask both.
        plans = []
        for partner_row, name in partners:  # first a mix the schedule already asked: no query
            final = (target.final + schedule.instances[members[partner_row]].final) / 2
            mix = next(self._existing(fits, members, final, target.difference, index), None)
            if mix is not None:
                plans.append((partner_row, name, mix))
                break
        # Then asked mixes, the partner whose mix is predicted to separate the poles most first.
        asked_mixes = [(partner_row, name, None) for partner_row, name in partners
                       if not plans or partner_row != plans[0][0]]
        gaps = [_predicted_gap(fits, row, partner_row) for partner_row, _, _ in asked_mixes]
        plans += [asked_mixes[a] for a in sorted(range(len(gaps)), key=lambda a: -np.nan_to_num(gaps[a], nan=-1.0))]
        plans.append((None, "asked", None))
        if free_only:
            plans = [plan for plan in plans if plan[2] is not None]
        for partner_row, partner_name, mix in plans[:ATTEMPTS]:
            if partner_row is None:
                token = next((x for x in schedule.X.T if not np.array_equal(x, target.final)), None)
                if token is None:
                    reasons.append("no other final token")
                    break
                partner_fit, cost = self._ask(token, target.difference, "partner")
                asked += cost
                partner, partner_final = self._row(partner_fit, 0), token
            else:
                partner = self._row(fits, partner_row)
                partner_final = schedule.instances[members[partner_row]].final
            if not partner["certified"] or partner["nonpositive"]:
                reasons.append(f"partner {partner_name} did not certify")
                continue
            final = (target.final + partner_final) / 2
            if not _exact_half_sum(final, target.final, partner_final):
                reasons.append("the mixed final token is not exact in float64")
                continue
            if mix is not None:
                mix_row, mix_name = mix
                mixed = self._row(fits, mix_row)
            else:
                mix_fit, cost = self._ask(final, target.difference, "mix")
                asked += cost
                mixed, mix_name = self._row(mix_fit, 0), "asked"
            if not mixed["certified"] or mixed["nonpositive"]:
                reasons.append(f"mix {mix_name} (partner {partner_name}) did not certify")
                continue
            pairing = _pair_by_labels(partner["labels"], mixed["labels"])
            if isinstance(pairing, str):
                reasons.append(f"mix {mix_name} (partner {partner_name}): {pairing}")
                continue
            self._write(fits, row, partner, mixed, pairing)
            return Repair(index, partner_name, mix_name, asked, True, "")
        return Repair(index, "-", "-", asked, False, "; ".join(reasons) or "no partner")

    @staticmethod
    def _write(fits, row: int, partner: dict, mixed: dict, pairing: list[int]) -> None:
        """``m = 2 m(mix) - m(partner)``, ``c = 2 c(mix) - c(partner)``, labels the tighter of the
        two enclosures, in ball arithmetic; poles sorted ascending like every fit."""
        H = len(pairing)
        m = [2 * mixed["log_poles"][pairing[h]] - partner["log_poles"][h] for h in range(H)]
        labels = [min(partner["labels"][h], mixed["labels"][pairing[h]], key=lambda ball: float(ball.rad()))
                  for h in range(H)]
        sigma_m = [float(np.hypot(2 * mixed["sigma_m"][pairing[h]], partner["sigma_m"][h])) for h in range(H)]
        sigma_l = [float(min(partner["sigma_l"][h], mixed["sigma_l"][pairing[h]])) for h in range(H)]
        order = sorted(range(H), key=lambda h: float(m[h].mid()))
        log_poles = np.empty(H, dtype=object)
        label_row = np.empty(H, dtype=object)
        for slot, h in enumerate(order):
            log_poles[slot], label_row[slot] = m[h], labels[h]
        fits.log_poles[row] = log_poles
        fits.labels[row] = label_row
        fits.sigma_m[row] = np.array(sigma_m)[order]
        fits.sigma_l[row] = np.array(sigma_l)[order]
        fits.c[row] = 2 * mixed["c"] - partner["c"]
        mids = np.array([float(value.mid()) for value in log_poles])
        fits.pole_gap[row] = float(np.min(np.diff(mids))) if H > 1 else np.inf
        fits.imaginary[row] = 0.0
        fits.nonpositive[row] = False
        fits.certified[row] = True


def _predicted_gap(fits, row: int, partner_row: int) -> float:
    """The smallest log-pole gap the mix of ``row`` and ``partner_row`` is expected to have, from
    the fits' midpoints (a failed fit's midpoints are accurate, only unproven): poles paired by
    nearest labels, ``(m_n + m_r) / 2`` sorted. Chooses the order of the attempts, proves nothing;
    NaN when a fit has none."""
    m_n, l_n = mid_float(fits.log_poles[row]), mid_float(fits.labels[row])
    m_r, l_r = mid_float(fits.log_poles[partner_row]), mid_float(fits.labels[partner_row])
    if len(m_n) < 2 or not all(np.isfinite(values).all() for values in (m_n, l_n, m_r, l_r)):
        return float("nan")
    ours, theirs = linear_sum_assignment(np.abs(l_n[:, None] - l_r[None, :]))
    return float(np.diff(np.sort((m_n[ours] + m_r[theirs]) / 2)).min())


def _exact_half_sum(half, a, b) -> bool:
    """``half == (a + b) / 2`` exactly (rational arithmetic on the float64 entries)."""
    return all(2 * Fraction(float(h)) == Fraction(float(p)) + Fraction(float(q)) for h, p, q in zip(half, a, b))


def _pair_by_labels(partner_labels, mix_labels):
    """``pairing[h]``: the mix pole with head h's label, or a string saying why the balls do not
    decide it (partner labels must be pairwise disjoint, each mix label must overlap exactly one)."""
    H = len(partner_labels)
    for a in range(H):
        for b in range(a + 1, H):
            if partner_labels[a].overlaps(partner_labels[b]):
                return f"the partner's labels of two heads overlap ({partner_labels[a]}, {partner_labels[b]})"
    pairing = [-1] * H
    for g, label in enumerate(mix_labels):
        hits = [h for h in range(H) if partner_labels[h].overlaps(label)]
        if len(hits) != 1:
            return f"a mix label overlaps {len(hits)} partner labels"
        if pairing[hits[0]] >= 0:
            return "two mix labels overlap one partner label"
        pairing[hits[0]] = g
    return pairing
