"""The low-rank schedule: heads of rank at most r in O(H r d) queries (docs/algorithm.md §17).

``extract(oracle, d, heads=H, schedule="lowrank", rank=r)``, float64, H <= d. It is the
targeted schedule (§13) with one more fact: for a rank-r ``W_h`` every ``a_h(z) = W_h^T z`` lies
in the r-dimensional row space ``S_h`` of ``W_h``. Measuring ``a_h(z)`` in all of R^d takes d
targeted instances; once an orthonormal basis Q_h of ``S_h`` is known, r instances whose final
tokens have well-conditioned coordinates ``Q_h^T x`` determine ``a_h(z) = Q_h (Q_h^T X)^{-1} m``.

Stages (R = min(d, r + RANK_EXTRA) "full" differences per head):

1. ``vbar`` (d one-token queries), phase 1 and the first group ``z_1`` exactly as §13.
2. Bridges ``z_1 + eps z_j``: for ``j = 2..R`` in R^d (d instances, ``(d + 1)`` queries per head);
   the R vectors ``a_h(z_1), a_h(z_2), ..`` span a rough ``S_h``; for ``j > R`` in it (r instances,
   ``r + 1`` queries per head). Rough W, v as in §13.
3. Final, each head in its balanced basis ``Z_h``: R columns in R^d (d instances each), whose
   precise ``a_h`` give Q_h (the top r right singular vectors; the (r+1)-th singular value, relative,
   is the ``rank_bound`` check), then the other ``d - R`` columns in ``S_h`` (r instances each).
   Every final instance asks ``k = 1, 2``: with the label fixed at its unit's consensus the two
   samples test the single-pole form (``residual``), in place of §13's third sample.

Queries after phase 1, with H heads found:
``d + 3Hd + (d + 1) H (R - 1) + (r + 1) H (d - R) + 2 H R d + 2 H r (d - R)``, about
``3H (2dr - r^2)``: three queries per unknown of a rank-r matrix. Measured at the boundary.
"""

from __future__ import annotations

import numpy as np

from ..checks.base import Check
from ..model import MultiHeadAttention
from ..numerics import float64 as float64_kernel
from .base import Outcome
from .targeted import (
    GROUP_SCALE, TargetedDetails, TargetedSchedule, _all_heads_at, _balanced_basis, _bridge_step, _checks,
    _diagnostics, _first_group, _measure, _Prober, _shared, first_order_estimate,
)

#: Full (R^d) differences per head beyond the rank: their extra singular values test the rank bound.
RANK_EXTRA = 2
#: A head whose (r+1)-th singular value of its measured ``a_h(z)``, relative to the largest, exceeds
#: this has rank above the bound.
RANK_LIMIT = 1e-8
FINAL_COPIES = ((1, 2), (1, 2))


class LowRankSchedule(TargetedSchedule):
    """``extract(..., schedule="lowrank", rank=r)``: float64, heads of rank <= r, H <= d."""

    name = "lowrank"
    accepts = frozenset({"rank", "answer_error", "refine"})  # refine: full-rank least squares polish (§12), rank not enforced
    refines_on_own_answers = False
    refusal = ("it is a float64 schedule of single-pole fits (precision=None, no oversampling); "
               "use schedule='paper' for those")

    def __init__(self, settings):
        super().__init__(settings)
        if settings.rank is None:
            raise ValueError("schedule='lowrank' needs rank=r, a bound on the rank of every W_h (1 <= r <= d)")
        self.rank = settings.rank

    @property
    def full_units(self) -> int:
        return min(self.d, self.rank + RANK_EXTRA)

    @property
    def promised_queries(self) -> int:
        """After the adaptive phase 1, H0 heads found (module docstring)."""
        d, H, r, R = self.d, self.max_heads, self.rank, self.full_units
        return (d + 3 * H * d + (d + 1) * H * (R - 1) + (r + 1) * H * (d - R)
                + 2 * H * R * d + 2 * H * r * (d - R))

    @property
    def count_formula(self) -> str:
        return "lowrank d + 3Hd + (d+1)H(R-1) + (r+1)H(d-R) + 2HRd + 2Hr(d-R), R = min(d, r+2), after phase 1"

    def run(self, boundary, arithmetic) -> Outcome:
        prober = _Prober(boundary, self.d, self.token_scale, self.promised_queries)
        prober.learn_vbar(self.vbar_basis)
        search, stages, model, rank_ratio = _run(prober, self.d, self.max_heads, self.rank, self.full_units,
                                                 self.rng, self.token_scale)
        H = len(search.heads)
        instances = _diagnostics(stages, model)
        finals = [data for stage, data in stages if stage == "final"]
        error_estimate, score_estimate = _error_estimate(finals, model) if model is not None else (np.inf, 0.0)
        checks = _checks(instances, search, H, self.settings.heads, [data for _, data in stages])
        checks.append(Check("rank_bound", bool(rank_ratio <= RANK_LIMIT), float(rank_ratio), RANK_LIMIT,
                            f"largest relative singular value {self.rank + 1} of a head's measured a_h(z) "
                            f"(rank={self.rank}; above the limit the heads have higher rank)"))
        return Outcome(model, H, error_estimate, TargetedDetails(instances, search), prober.sequences,
                       np.asarray(prober.answers, dtype=np.float64), checks, score_estimate=score_estimate)


def _span(vectors: np.ndarray, rank: int) -> tuple[np.ndarray, float]:
    """Orthonormal bases (H, d, r) of the top-r right singular subspaces of ``vectors`` (n, H, d),
    and the largest relative (r+1)-th singular value (0 when n <= r)."""
    _, singular, vt = np.linalg.svd(vectors.transpose(1, 0, 2), full_matrices=False)  # per head (n, d)
    r = min(rank, vt.shape[1])
    ratio = float((singular[:, r] / singular[:, 0]).max()) if singular.shape[1] > r else 0.0
    return vt[:, :r].transpose(0, 2, 1), ratio


def _per_unit(bases: np.ndarray, groups: int) -> np.ndarray:
    return np.repeat(bases[None], groups, axis=0)  # (G, H, d, r)


def _run(prober, d: int, max_heads: int, rank: int, R: int, rng, token_scale: float):
    """Returns ``(line search report, [(stage, measurements)], model or None, rank ratio)``."""
    Z, search, first = _first_group(prober, d, max_heads, rng, token_scale)
    if first is None:
        return search, [], None, 0.0
    a1, labels1 = first.a[0], first.consensus_labels()[0][0]
    stages = [("first", first)]
    rough_a, rough_l = a1[None], labels1[None]
    if d > 1 and np.isfinite(a1).all():
        eps = _bridge_step(first)
        bridge_z = prober.quantize(Z[:, :1].T + eps * Z[:, 1:].T)  # (d - 1, d)
        full = _measure(prober, *_shared(bridge_z[:R - 1], np.repeat(a1[None], R - 1, axis=0)), rng, bridge=True)
        stages.append(("bridge", full))
        rough_a = np.concatenate([rough_a, (full.a - a1) / eps])
        rough_l = np.concatenate([rough_l, (full.label[:, :, 0] - labels1) / eps])
        if not np.isfinite(full.a).all():
            return search, stages, None, np.inf
        if R < d:  # the other bridges in the rough row spaces
            spans, _ = _span(np.concatenate([a1[None], full.a]), rank)
            low = _measure(prober, *_shared(bridge_z[R - 1:], np.repeat(a1[None], d - R, axis=0)), rng,
                           bridge=True, bases=_per_unit(spans, d - R))
            stages.append(("bridge", low))
            rough_a = np.concatenate([rough_a, (low.a - a1) / eps])
            rough_l = np.concatenate([rough_l, (low.label[:, :, 0] - labels1) / eps])
    if not (np.isfinite(rough_a).all() and np.isfinite(rough_l).all()):
        return search, stages, None, 0.0
    W_rough, v_rough = float64_kernel.assemble(Z, np.eye(d), rough_a.transpose(1, 0, 2), rough_l.T)
    H = len(search.heads)
    scale = GROUP_SCALE * token_scale
    bases = np.array([prober.quantize(_balanced_basis(v_rough[h], rng, scale)) for h in range(H)])
    differences = bases.transpose(2, 0, 1)  # (d, H, d)
    estimates = _all_heads_at(W_rough, differences)
    final = _measure(prober, differences[:R], estimates[:R], rng, bridge=False, W_score=W_rough, copies=FINAL_COPIES)
    stages.append(("final", final))
    if not np.isfinite(final.a).all():
        return search, stages, None, np.inf
    spans, ratio = _span(final.a, rank)
    a_final, labels_final = final.a, final.consensus_labels()[0]
    if R < d:
        low = _measure(prober, differences[R:], estimates[R:], rng, bridge=False, W_score=W_rough,
                       copies=FINAL_COPIES, bases=_per_unit(spans, d - R))
        stages.append(("final", low))
        a_final = np.concatenate([a_final, low.a])
        labels_final = np.concatenate([labels_final, low.consensus_labels()[0]])
    if not (np.isfinite(a_final).all() and np.isfinite(labels_final).all()):
        return search, stages, None, ratio
    W, v = np.empty((H, d, d)), np.empty((H, d))
    for h in range(H):  # W_h^T z = a_h(z) over head h's basis: W_h = Z_h^{-T} A_h^T
        W[h], v[h] = (part[0] for part in float64_kernel.assemble(
            bases[h], np.eye(d), a_final[:, h][None], labels_final[:, h][None]))
    return search, stages, MultiHeadAttention(W, v), ratio


def _error_estimate(finals, model) -> tuple[float, float]:
    """§13's first-order estimate over every final unit (full and subspace ones), and its part from
    the oracle's score rounding alone; the subspace bases' own error (from the full units) is of the
    same order and not added."""
    squared = sum(data.error_squared.sum(axis=0) for data in finals)
    z_norm = np.linalg.norm(finals[0].differences[0], axis=1)
    return first_order_estimate(squared[:, 0], z_norm, model), first_order_estimate(squared[:, 1], z_norm, model)

