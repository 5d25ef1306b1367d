"""The error certificate of a float64 run: how far answer errors can move the parameters.

docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement, verification': if every answer carries
an error ``|e_q| <= eps``, the parameters move by ``delta theta = G e + O(eps^2)`` with ``G`` the derivative of the
whole run with respect to its answers. Worst case over the box ``|e_q| <= eps`` the change of parameter p is exactly
``eps * ||G_p||_1`` (row p of G, l1 norm), so

    C = max_p ||G_p||_1 / scale(p)        (scale: max |W| for W entries, max |v| for v entries)

is the amplification from answer errors (absolute) to the relative parameter error that
:func:`mhaextract.compare` reports (``max_rel``). G is the product of the run's steps:

1. **samples**: instance t's samples ``F_t(k)`` are answers, except the injected ``F_t(0)``
   ('One instance: copies of a token and a rational function'): ``vbar^T x_0`` (an answer) or ``vbar^T x_i`` with
   ``vbar = Z^{-T}(F(0) - c_row0)``, which carries the errors of all of row 0's constants ``c_j`` (the anchors'
   propagation);
2. **instances**: ``(c, m, l)_t = J_t^+ F_t`` to first order, ``J_t[k] = dF(k)/d(c, m, l)`` at
   the fit (:func:`mhaextract.numerics.rational.instance_jacobian`; the exact-count fit
   interpolates, ``J_t^+ = J_t^{-1}``; the oversampled one is polished to the least-squares fit);
3. **matching**: discrete, so no derivative; it is certified separately (below);
4. **combination**: every ``M_h[j, i]`` by weighted least squares over the instances that measure
   it, ``l_h[j]`` by a weighted mean over column j (the learner's weights, held fixed);
5. **assembly**: ``W_h = Z^{-T} M_h X^{-1}``, ``v_h = Z^{-T} l_h``.

After ``refine=True`` (any float64 schedule) the result is the weighted least-squares fit of the
answers it was refined on and ``G = (D J_f)^+ D`` (:func:`mhaextract.checks.refine.output_jacobian`,
with the u and c columns for a model with biases; D the weights): :func:`least_squares_certificate`.

**Validity.** The first order is trusted, and the matching provably unchanged, for
``eps < valid_below``:

* matching: a triple (head h of a, head g of b, pole p of the link) other than the chosen ones
  is excluded when one of its misfits (``m^a_h + m^b_g - m^link_p`` and the label misfits) exceeds
  twice its worst-case first-order movement ``eps * Delta`` (the l1 norm of its row of G). If
  every non-chosen triple is excluded, the true triples, whose misfits are at most
  ``eps * Delta``, can only be the chosen ones;
* linearisation: no log-pole of an instance moves by more than 0.05 or an eighth of its
  instance's smallest pole gap;
* pole count: at most 5% of the instances detected a pole count other than the run's (a head
  lost in the noise would otherwise be certified as absent): else ``valid_below = 0``.

:meth:`Certificate.validity_at` judges a given eps: an instance outside its linear range whose
measured deviation from the assembled model is within its first-order movement at eps is
*verified* and exempt from the linearisation (and, for a link, from the triples that only move its
own poles to other heads); ``valid_below_statistical`` is the same with l2 movements for the
measured noise (a standard deviation). docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement,
verification'.

**Safety.** ``error_bound(eps) = 2 C (eps + rounding_floor)``: a factor 2 for the second-order
terms and the Jacobians evaluated at the estimate rather than the truth (a least-squares fit's
factor shrinks with its movement, :meth:`Certificate.second_order`), and a floor of
``8 u max|answer|`` (u = 2^-53) for the rounding of the answers and of the float64
arithmetic of the run. ``error_bound`` is infinite for ``eps >= valid_below``.

**Noise estimate.** The redundant measurements (every link against its two instances) also
say how noisy the answers were: ``noise_estimate`` is a robust scale of the chosen triples'
misfits in units of their l2 sensitivities, ``1.4826 x median |misfit|`` (the standard deviation
for Gaussian errors; the median keeps a few ill-conditioned instances, whose errors are beyond
first order, from passing for noise on an exact oracle). After refinement it is the corrected
root-mean-square residual.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from ..numerics.float64 import root_mean_square
from ..models.attention import MultiHeadAttention
from ..run.validation import nonnegative_number
from ..oracle.answer_stats import FLOAT64_UNIT
from .linearisation import CHUNK, PipelineOperator, PipelineRun

#: error_bound = (1 + s) * C * (eps + rounding floor), s = SECOND_ORDER_SLACK (least squares:
#: scaled by the movement, Certificate.second_order).
SECOND_ORDER_SLACK = 1.0
#: The float64 floor on the answer error: this many units of 2^-53 of the largest answer.
ROUNDING_ULPS = 8.0
#: First order is trusted while no log-pole moves by more than this (nor a pole-gap fraction).
LINEARIZATION_STEP = 0.05
POLE_GAP_FRACTION = 0.125
#: ``Certificate.method`` after a matrix-free refinement (docs/algorithm.md, 'Matrix-free refinement beyond the dense
#: Jacobian').
MATRIX_FREE_METHOD = "matrix-free estimate"


#: More instances than this fraction detecting a pole count other than r: the count is uncertain.
RANK_DISAGREEMENT = 0.05


@dataclass
class Certificate:
    """First-order error certificate of one float64 run (see the module docstring).

    Attributes
    ----------
    kind : ``"algebraic"`` (the schedule's pipeline) or ``"least squares"`` (after refinement).
    amplification : C, relative parameter error per unit absolute answer error (worst case).
    amplification_W, amplification_v : the same for the W's and for the v's alone.
    valid_below : answer-error bound below which the matching is certified and first order holds.
    rounding_floor : the float64 floor added to eps (absolute).
    noise_estimate : estimated standard deviation of the answers' errors, from the data.
    noise_lower_bound : the smallest eps consistent with the links' misfits (first order).
    valid_below_statistical : the same validity for independent answer errors of standard deviation
        eps / 3 (movements ``eps ||row||_2`` instead of ``eps ||row||_1``); judges the noise the
        links estimate (undeclared), never a declared bound. Defaults to ``valid_below``.
    method : how G's row norms were found: ``"exact"`` (G formed in chunks: the pipeline's, or the
        dense least squares'), or :data:`MATRIX_FREE_METHOD` (after a matrix-free refinement,
        see docs/algorithm.md, 'Matrix-free refinement beyond the dense Jacobian': bounds estimated from LSMR solves on
        random answer errors, with a safety factor).
    linear_movement : the relative parameter movement at which the fit's first order stops being
        trusted (least squares: :data:`LINEAR_MOVEMENT`), where the second-order slack is the full
        ``SECOND_ORDER_SLACK`` and below which it shrinks in proportion (:meth:`second_order`);
        None (algebraic): the full slack at every eps.
    """

    kind: str
    valid_below: float
    rounding_floor: float
    noise_estimate: float
    noise_lower_bound: float
    _norms: object = field(repr=False, default=None)  # () -> (amplification_W, amplification_v)
    valid_below_statistical: float | None = None
    _norms_l2: object = field(repr=False, default=None)  # () -> the same with row l2 norms
    #: "l1", "l2": (per-link matching exclusions of :func:`_matching_margins`, per instance the eps
    #: up to which it is linear, per instance the eps from which it is verified); "unreliable": an
    #: uncertain start's instances whose fits decide nothing (None: certain); None: no exemption.
    _instances: dict | None = field(repr=False, default=None)
    #: Refined under noise: competing head orders of links whose margins the answer error covered,
    #: refitted from their own starts and refuted by the answers (docs/algorithm.md, 'Refuted alternatives');
    #: ``refuting_ratio``: the smallest misfit of such a refit over the fit's (inf: every refit landed on the fit
    #: itself).
    refuted_orders: int = 0
    refuting_ratio: float = np.inf
    linear_movement: float | None = None

    def __post_init__(self):
        if self.valid_below_statistical is None:
            self.valid_below_statistical = self.valid_below

    def verified_against(self, model) -> "Certificate":
        """This certificate with its instances verified against ``model`` (the same heads, in the
        same order) instead of the model the run assembled: after a refinement, whose model is
        closer to the truth, an instance's deviation from it measures the instance's own error
        with less of the model's (docs/algorithm.md, 'Verified instances'). The matching
        margins, movements and amplifications are the run's; only which instances are verified at
        a given eps changes. Itself where there are no instances to verify."""
        reverify = getattr(self, "_reverify", None)
        if reverify is None or self._instances is None:
            return self
        other = replace(self, _instances=reverify(model))
        other.__dict__.update({key: value for key, value in self.__dict__.items()
                               if key in ("_operator", "_reverify")})
        return other

    def _links_at(self, statistical: bool, uncertain: bool):
        """``(link, pairwise, own_pairs, b, verified)`` of the links, or None (no links; or an
        uncertain start, unless ``uncertain``: then every triple of a link that touches an
        instance whose fit decides nothing, failed or with another pole count, is excluded by
        nothing, exclusion 0, and only refits can settle it)."""
        if self._instances is None:
            return None
        links, _, verified = self._instances["l2" if statistical else "l1"]
        unreliable = self._instances.get("unreliable")
        if links is None or (unreliable is not None and not uncertain):
            return None
        link, pairwise, own_pairs, b, a = links
        if unreliable is not None:
            touched = (unreliable[a] | unreliable[b] | unreliable[link])[:, None, None]
            off_diagonal = ~np.eye(pairwise.shape[1], dtype=bool)[None]
            pairwise = np.where(touched & off_diagonal, 0.0, pairwise)
            own_pairs = np.where(touched & off_diagonal, 0.0, own_pairs)
        return link, pairwise, own_pairs, b, verified

    def _matching_at(self, eps: float, statistical: bool, refuted=(), uncertain: bool = False) -> float | None:
        """Condition (a) at ``eps``: half the smallest exclusion of a triple that pairs a link's
        ``a`` and ``b`` heads otherwise, or (links not verified at eps) gives the link's own poles
        to other heads. ``refuted``: ``(position, kind)`` pairs of :meth:`matching_alternatives`
        whose every competing triple a refit refuted; that part of the link no longer counts. None
        where there are no links to judge (``uncertain``: see :meth:`_links_at`)."""
        found = self._links_at(statistical, uncertain)
        if found is None:
            return None
        link, pairwise, own_pairs, _, verified = found
        exempt = verified <= eps if eps > 0 else np.zeros(len(verified), dtype=bool)
        others, own = _smallest(pairwise), _smallest(own_pairs)
        for kind, values in (("order", others), ("own", own)):
            values[[position for position, refuted_kind in refuted if refuted_kind == kind]] = np.inf
        return min(float(others.min(initial=np.inf)), float(own[~exempt[link]].min(initial=np.inf))) / 2.0

    def matching_validity_at(self, eps: float, statistical: bool = False, refuted=(), uncertain: bool = False) -> float:
        """The matching part of :meth:`validity_at` alone (condition (a), docs/algorithm.md, 'Approximate answers:
        certificate, oversampling, refinement, verification'): below it the chosen triples are certified, so the heads
        are the ones the run assembled; the linearisation of the instances (b) is not part of it. 0 where the pole count
        is uncertain or a fit failed (``uncertain``: judged from the links, those touching such an instance
        excluding nothing); ``valid_below`` where the certificate has no instances. ``refuted``: links
        whose competing head orders were refitted and refuted by the answers ('Refuted alternatives')."""
        matching = self._matching_at(eps, statistical, refuted, uncertain)
        base = self.valid_below_statistical if statistical else self.valid_below
        return base if matching is None else max(0.0, matching)

    def matching_alternatives(self, eps: float, statistical: bool = False,
                              uncertain: bool = False) -> list[tuple[int, str, int, int, int]]:
        """``(position, kind, instance, h, g)`` of every triple a link does not exclude at ``eps``
        (half its exclusion at most eps; docs/algorithm.md, 'Refuted alternatives'). ``kind``
        ``"order"``: head h of the link's instance ``a`` could be head g of its instance ``b``
        (``instance``, heads in the run's order); ``"own"``: the link's pole of head h could be
        head g's (``instance`` the link; only where the link is not verified at eps). ``position``
        indexes the links; ``(position, kind)`` pairs are what :meth:`matching_validity_at` takes
        as ``refuted``. Empty without links (``uncertain``: see :meth:`_links_at`)."""
        found_links = self._links_at(statistical, uncertain)
        if found_links is None:
            return []
        link, pairwise, own_pairs, b, verified = found_links
        found = []
        for kind, pairs, instances, judged in (("order", pairwise, b, np.ones(len(b), dtype=bool)),
                                               ("own", own_pairs, link, ~(verified[link] <= eps))):
            position, h, g = np.nonzero((pairs / 2.0 <= eps) & judged[:, None, None])
            found += [(int(n), kind, int(instances[n]), int(i), int(j)) for n, i, j in zip(position, h, g)]
        return found

    def validity_at(self, eps: float, statistical: bool = False) -> float:
        """The validity that judges the answer error ``eps``: ``valid_below`` (or
        ``valid_below_statistical``), except that an instance whose linearisation fails at eps no
        longer lowers it, nor do the link's own pole assignments when it is a link, when its
        measured deviation from the assembled model is within its first-order movement at eps
        (docs/algorithm.md, 'Verified instances'). ``eps`` passes when ``eps < validity_at(eps)``."""
        base = self.valid_below_statistical if statistical else self.valid_below
        matching = self._matching_at(eps, statistical) if eps > 0 else None
        if matching is None:
            return base
        _, linear, verified = self._instances["l2" if statistical else "l1"]
        return max(0.0, min(matching, float(linear[~(verified <= eps)].min(initial=np.inf))))
    method: str = "exact"

    @cached_property
    def _amplifications(self) -> tuple[float, float]:
        return self._norms()

    @property
    def amplification_W(self) -> float:
        return self._amplifications[0]

    @property
    def amplification_v(self) -> float:
        return self._amplifications[1]

    @property
    def amplification_bias(self) -> float:
        """The same for u and c (0 for a bias-free fit)."""
        return max(self._amplifications[2:], default=0.0)

    @property
    def amplification(self) -> float:
        return max(self._amplifications)

    @cached_property
    def amplification_l2(self) -> float:
        """``max_p ||G_p||_2 / scale(p)``: the relative error per unit standard deviation of
        independent answer errors (at most :attr:`amplification`, which it defaults to)."""
        return max(self._norms_l2()) if self._norms_l2 is not None else self.amplification

    def statistical(self, sigma: float) -> float:
        """``2 (3 sigma C_2 + C rounding_floor)``: the estimate for independent answer errors of
        standard deviation ``sigma`` (measured, not declared). Parameter p then errs by
        ``N(0, sigma^2 ||G_p||_2^2)`` to first order, within ``3 sigma ||G_p||_2`` but for a
        fraction 3e-3; the box's worst case ``eps ||G_p||_1`` needs every error at its bound with
        the sign of G_p (docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement,
        verification')."""
        sigma = _validate_eps(sigma)
        return self.second_order(3.0 * sigma * self.amplification_l2 + self.amplification * self.rounding_floor)

    def error_bound(self, eps: float) -> float:
        """Bound on the max relative parameter error (``compare(...).max_rel``) when every answer
        is within ``eps`` of the truth: ``2 C (eps + rounding_floor)``, inf for eps >= valid_below."""
        eps = _validate_eps(eps)
        if not eps < self.validity_at(eps):
            return float("inf")
        return self.first_order(eps)

    def first_order(self, eps: float) -> float:
        """``2 C (eps + rounding_floor)`` whether or not eps is below ``valid_below``: an estimate
        (the learner's ``error_estimate`` when the noise is estimated), not a certified bound."""
        return self.second_order(self.amplification * (_validate_eps(eps) + self.rounding_floor))

    def second_order(self, movement: float) -> float:
        """A first-order relative movement with its second-order slack: ``(1 + s) movement``.
        ``s = SECOND_ORDER_SLACK`` for the algebraic certificate; for a least-squares fit, whose
        first order is trusted up to the movement ``linear_movement`` (the second-order terms as
        large as the first there, by that definition), ``s = SECOND_ORDER_SLACK min(1, movement /
        linear_movement)``: the second-order terms relative to the first grow with the movement
        (docs/algorithm.md, 'Second order')."""
        slack = SECOND_ORDER_SLACK
        if self.linear_movement is not None and np.isfinite(movement):
            slack *= min(1.0, movement / self.linear_movement)
        return (1.0 + slack) * movement


def _validate_eps(eps) -> float:
    return nonnegative_number("eps", eps, "a bound on the answers' absolute error")


def _rounding_floor(answers: np.ndarray) -> float:
    return ROUNDING_ULPS * FLOAT64_UNIT * float(np.abs(answers).max(initial=0.0))


def _relative_scales(model: MultiHeadAttention) -> tuple[float, float]:
    W_scale = float(np.abs(model.W).max(initial=0.0)) or 1.0
    v_scale = float(np.abs(model.v).max(initial=0.0)) or 1.0
    return W_scale, v_scale


def _smallest(pairs: np.ndarray) -> np.ndarray:
    """Per link, the smallest exclusion over its (h, g) pairs ``pairs`` (n, r, r) (a copy)."""
    return pairs.reshape(len(pairs), -1).min(axis=1, initial=np.inf)


def _links(schedule):
    """(a, b, link, labels_add) index arrays of every link (row links, then column links)."""
    d = schedule.d
    grid, row_links, column_links = schedule.grid_index, schedule.row_link_index, schedule.column_link_index
    a = [grid[0, 0]] * (d - 1) + [grid[0, j] for i in range(1, d) for j in range(d)]
    b = [grid[0, j] for j in range(1, d)] + [grid[i, j] for i in range(1, d) for j in range(d)]
    link = [row_links[j] for j in range(1, d)] + [column_links[i, j] for i in range(1, d) for j in range(d)]
    adds = [True] * (d - 1) + [False] * (d * (d - 1))
    return np.array(a, dtype=int), np.array(b, dtype=int), np.array(link, dtype=int), np.array(adds, dtype=bool)


def _matching_margins(run: PipelineRun, D1m, D1l, D2m, D2l):
    """Per link, for two movements of a triple (the sum over its three instances of their l1 norms
    ``D1``, and of their l2 norms ``D2``): the smallest exclusion ratio of a non-chosen triple
    (misfit over its movement), the largest such ratio of a chosen triple, and the exclusions per
    link (:func:`_margins`); and the chosen triples' misfits in units of their l2 sensitivities in
    quadrature (for the noise estimate). Returns ``(D1's (smallest, largest, per link), D2's, noise
    units)``. The misfits of every triple are formed once for both movements."""
    a, b, link, adds = _links(run.schedule)
    r = run.m.shape[1]
    if not len(a):
        empty = (np.inf, 0.0, (link, np.zeros((0, r, r)), np.zeros((0, r, r)), b, a))
        return empty, empty, np.zeros(0)
    m, l = run.m, run.l
    row = adds[:, None, None, None]
    with np.errstate(all="ignore"):
        # triple (h, g, p): a's head h, b's head g, the link's pole p. Row links: labels add. Column
        # links: a's and b's labels agree, and b's equal the link's.
        signed_pole = m[a][:, :, None, None] + m[b][:, None, :, None] - m[link][:, None, None, :]
        pole = np.abs(signed_pole)
        added = np.abs(l[a][:, :, None, None] + l[b][:, None, :, None] - l[link][:, None, None, :])
        pair = np.abs(np.broadcast_to(l[a][:, :, None, None] - l[b][:, None, :, None], pole.shape))
        same = np.abs(l[b][:, None, :, None] - l[link][:, None, None, :] + 0 * signed_pole)

        def exclusion(Dm, Dl):
            pole_1 = Dm[a][:, :, None, None] + Dm[b][:, None, :, None] + Dm[link][:, None, None, :]
            added_1 = Dl[a][:, :, None, None] + Dl[b][:, None, :, None] + Dl[link][:, None, None, :]
            pair_1 = np.broadcast_to(Dl[a][:, :, None, None] + Dl[b][:, None, :, None], pole.shape)
            same_1 = Dl[b][:, None, :, None] + Dl[link][:, None, None, :] + 0 * signed_pole
            ratios = [pole / pole_1, np.where(row, added / added_1, pair / pair_1), np.where(row, 0.0, same / same_1)]
            return np.nan_to_num(np.maximum.reduce(ratios), nan=0.0, posinf=np.inf)

        exclusions = exclusion(D1m, D1l), exclusion(D2m, D2l)
        # the noise units: the chosen triples (h, h, h) alone, their movements in quadrature
        heads = np.arange(r)
        chosen = (slice(None), heads, heads, heads)
        pole_2 = np.sqrt(D2m[a] ** 2 + D2m[b] ** 2 + D2m[link] ** 2)
        added_2 = np.sqrt(D2l[a] ** 2 + D2l[b] ** 2 + D2l[link] ** 2)
        pair_2 = np.sqrt(D2l[a] ** 2 + D2l[b] ** 2)
        same_2 = np.sqrt(D2l[b] ** 2 + D2l[link] ** 2) + 0 * signed_pole[chosen]
        row_links = adds[:, None]
        noise_units = np.concatenate([
            (pole[chosen] / pole_2).ravel(),
            np.where(row_links, added[chosen] / added_2, pair[chosen] / pair_2).ravel(),
            np.where(row_links, 0.0, same[chosen] / same_2).ravel()])
    noise_units = noise_units[np.isfinite(noise_units)]
    return _margins(exclusions[0], link, b, a), _margins(exclusions[1], link, b, a), noise_units


def _margins(exclusion: np.ndarray, link, b, a):
    """``(smallest, largest, per link)`` of the exclusion ratios (n, r, r, r) of every triple of the
    links (:func:`_matching_margins`): the smallest over non-chosen triples, the largest over chosen
    ones, and per link the pairs a refit could refute."""
    r = exclusion.shape[1]
    chosen = np.zeros((r, r, r), dtype=bool)
    chosen[np.arange(r), np.arange(r), np.arange(r)] = True
    # A non-finite misfit (a failed fit) cannot exclude anything: ratio 0.
    non_chosen = exclusion[:, ~chosen]
    smallest_exclusion = float(non_chosen.min(initial=np.inf))
    chosen_ratio = exclusion[:, chosen]
    largest_chosen = float(np.nanmax(np.where(np.isfinite(chosen_ratio), chosen_ratio, np.inf), initial=0.0))
    # Per link: triples that pair a's and b's heads otherwise (h != g), and triples that only give
    # the link's own poles to other heads (h == g, p != h): the latter decide the link's poles alone.
    # Kept per pair, for refits that can refute one (docs/algorithm.md, 'Refuted alternatives'):
    # pairwise[n, h, g], h != g, the smallest over the link's poles; own_pairs[n, h, p], p != h,
    # the triple (h, h, p) that gives head h's link pole to head p.
    heads = np.arange(r)
    pairwise = exclusion.min(axis=3)
    pairwise[:, heads, heads] = np.inf
    own_pairs = exclusion[:, heads, heads, :].copy()
    own_pairs[:, heads, heads] = np.inf
    return smallest_exclusion, largest_chosen, (link, pairwise, own_pairs, b, a)


def _validity(run: PipelineRun, smallest_exclusion: float, links, movement_m: np.ndarray, movement_l: np.ndarray,
              deviation_m: np.ndarray, deviation_l: np.ndarray, uncertain: bool):
    """``(valid_below, (links, per-instance linear validity, per-instance verified-from))`` from the
    matching margin (every non-chosen triple's misfit at least twice its movement; ``links`` from
    :func:`_matching_margins`) and the linearisation (no log-pole of an instance moves by more than
    min(0.05, gap / 8)), with the movements per unit answer error ``movement_*`` (n, r). Instance t
    is *verified* for ``eps >= verified[t]``: its measured deviations from the model
    ``deviation_*`` are within its movement ``eps movement_*`` (docs/algorithm.md, 'Approximate answers: certificate,
    oversampling, refinement, verification')."""
    with np.errstate(all="ignore"):
        gaps = np.diff(np.sort(run.m, axis=1), axis=1).min(axis=1, initial=np.inf)
        allowed = np.minimum(LINEARIZATION_STEP, POLE_GAP_FRACTION * gaps)
        linear = np.nan_to_num(allowed / movement_m.max(axis=1), nan=0.0)
        verified = np.nan_to_num(np.maximum((deviation_m / movement_m).max(axis=1),
                                            (deviation_l / movement_l).max(axis=1)), nan=np.inf)
    valid = 0.0 if uncertain else max(0.0, min(smallest_exclusion / 2.0, float(linear.min(initial=np.inf))))
    return valid, (links, linear, verified)


def _deviations(run: PipelineRun) -> tuple[np.ndarray, np.ndarray]:
    """(n, r) each instance's log-poles and labels minus those the assembled model predicts for it
    (``M_h = Z^T W_h X`` through the pole design; labels ``v_h^T z_j``, row links ``v_h^T (z_0 + z_j)``)."""
    schedule, model = run.schedule, run.model
    M = (schedule.Z.T[None] @ model.W @ schedule.X[None]).reshape(model.heads, -1)  # Z^T W_h X: [h, j * d + i]
    predicted_m = np.asarray(run.design @ M.T)  # (n, r)
    lz = (schedule.Z.T @ model.v.T)  # (d, r): v_h^T z_j
    columns, rows = schedule.instances.j, schedule.instances.role == "row_link"
    predicted_l = lz[columns] + np.where(rows[:, None], lz[0][None, :], 0.0)
    with np.errstate(invalid="ignore"):
        return np.abs(run.m - predicted_m), np.abs(run.l - predicted_l)


def pipeline_certificate(run: PipelineRun) -> Certificate:
    """The certificate of an algebraic float64 run (cheap parts now, the amplification on demand)."""
    operator = PipelineOperator(run)
    D1m, D1l = operator.row_norms("m", 1), operator.row_norms("l", 1)
    D2m, D2l = operator.row_norms("m", 2), operator.row_norms("l", 2)
    if run.m.shape[1] == 0:
        return Certificate("algebraic", np.inf, _rounding_floor(run.answers), 0.0, 0.0, _norms=lambda: (0.0, 0.0))
    # Independent errors of standard deviation eps / 3: a misfit or log-pole moves by at most
    # eps ||row||_2 but for a fraction 3e-3 (the same margins with the l2 norms as movements).
    ((smallest_exclusion, largest_chosen, links_l1), (smallest_statistical, _, links_l2),
     noise_units) = _matching_margins(run, D1m, D1l, D2m, D2l)
    uncertain = (not operator.finite.all()  # a failed fit: its links were matched on nothing
                 or np.mean(run.ranks != run.m.shape[1]) > RANK_DISAGREEMENT)  # the pole count itself
    # Uncertain: the instances whose fits decide nothing (failed, or another pole count detected);
    # only a refit of every order they could have decided can stand in for their margins (docs/algorithm.md,
    # 'Approximate answers: certificate, oversampling, refinement, verification').
    unreliable = (~operator.finite | (run.ranks != run.m.shape[1])) if uncertain else None
    deviation_m, deviation_l = _deviations(run)
    valid_below, instances_l1 = _validity(run, smallest_exclusion, links_l1, D1m, D1l, deviation_m, deviation_l,
                                          uncertain)
    valid_statistical, instances_l2 = _validity(run, smallest_statistical, links_l2, D2m, D2l, deviation_m,
                                                deviation_l, uncertain)
    noise_estimate = float(1.4826 * np.median(np.abs(noise_units))) if len(noise_units) else 0.0
    W_scale, v_scale = _relative_scales(run.model)

    sums = {}

    def accumulate():  # row l1 and l2 norms of G in one pass over the answers' chunks
        if not sums:
            shape = (run.m.shape[1], run.schedule.d)
            sums.update(W1=np.zeros(shape + (run.schedule.d,)), v1=np.zeros(shape),
                        W2=np.zeros(shape + (run.schedule.d,)), v2=np.zeros(shape))
            for _, dW, dv in operator.columns():
                sums["W1"] += np.abs(dW).sum(axis=3)
                sums["v1"] += np.abs(dv).sum(axis=2)
                sums["W2"] += (dW**2).sum(axis=3)
                sums["v2"] += (dv**2).sum(axis=2)
        return sums

    def norms():
        accumulate()
        return float(sums["W1"].max()) / W_scale, float(sums["v1"].max()) / v_scale

    def norms_l2():
        accumulate()
        return float(np.sqrt(sums["W2"].max())) / W_scale, float(np.sqrt(sums["v2"].max())) / v_scale

    certificate = Certificate("algebraic", valid_below, _rounding_floor(run.answers), noise_estimate,
                              largest_chosen, _norms=norms, valid_below_statistical=valid_statistical,
                              _norms_l2=norms_l2,
                              _instances={"l1": instances_l1, "l2": instances_l2, "unreliable": unreliable})
    certificate._operator = operator  # for sensitivity_matrix

    def reverify(model):  # the instances verified against another model of the same heads (order)
        other_m, other_l = _deviations(replace(run, model=model))
        return {"l1": _validity(run, smallest_exclusion, links_l1, D1m, D1l, other_m, other_l, uncertain)[1],
                "l2": _validity(run, smallest_statistical, links_l2, D2m, D2l, other_m, other_l, uncertain)[1],
                "unreliable": unreliable}
    certificate._reverify = reverify
    return certificate


def sensitivity_matrix(certificate: Certificate) -> np.ndarray:
    """The dense G (H (d^2 + d), Q) of a certificate, in :func:`mhaextract.checks.refine.pack` order
    (for small runs and tests; the amplification itself is accumulated in chunks)."""
    if certificate.kind == "least squares":
        if certificate.method == MATRIX_FREE_METHOD:
            raise ValueError("a matrix-free refinement (beyond refine.MAX_JACOBIAN_ENTRIES) forms no Jacobian: no "
                             "sensitivity matrix; its certificate holds estimated row norms (docs/algorithm.md, "
                             "'Matrix-free refinement beyond the dense Jacobian')")
        if certificate._factors is None:
            raise ValueError("the least-squares Jacobian is rank deficient: no sensitivity matrix")
        solver, weights = certificate._factors
        return (((solver.Vt.T / solver.s) @ solver.U_R.T) / solver.norms[:, None]) @ (solver.Q.T * weights)
    blocks_W, blocks_v = [], []
    for _, dW, dv in certificate._operator.columns():
        blocks_W.append(dW.reshape(-1, dW.shape[-1]))
        blocks_v.append(dv.reshape(-1, dv.shape[-1]))
    return np.vstack([np.hstack(blocks_W), np.hstack(blocks_v)])


# ---------------------------------------------------------------- after refinement
#: Without an algebraic certificate's validity, first order is trusted while the worst-case
#: movement of the parameters stays below this fraction of their scale.
LINEAR_MOVEMENT = 1e-3


#: u (or c) is resolved, and its error relative, when it exceeds this many times its own
#: first-order absolute error; below, its error is absolute (see :func:`_bias_scale`).
RESOLVED_BIAS = 100.0


def _bias_scale(values, absolute_error: float) -> float:
    """The scale of u (or c) in the relative error: max |u| when the fit resolves it (above
    ``RESOLVED_BIAS`` times its first-order absolute error ``absolute_error``), else 1 (absolute,
    as :func:`mhaextract.compare` reports it against a target without biases). A bias-free target
    fitted with biases gets u of the size of the noise (1e-7 against float32 answers): relative to
    that size its error would read O(1), and the estimate would fail a correct fit. Not covered: a
    true u, non-zero but under 100 times the fit's error, whose relative error compare reports
    against its own tiny size."""
    size = float(np.abs(np.asarray(values, dtype=np.float64)).max(initial=0.0))
    return size if size > max(RESOLVED_BIAS * absolute_error, 1e-8) else 1.0


def least_squares_certificate(jacobian: np.ndarray | None, model: MultiHeadAttention, residuals: np.ndarray,
                              answers: np.ndarray, valid_below: float | None, bias: bool = False,
                              weights: np.ndarray | None = None, solver=None, linear: bool = False) -> Certificate:
    """Certificate of the (weighted) least-squares fit: ``G = (D J)^+ D`` (J: (Q, P) output
    Jacobian at the fit in :func:`mhaextract.checks.refine.pack` order, ``bias``: it has the u and
    c columns; D: the weights, default one), the derivative of the fit with respect to the answers.
    ``solver``: the refinement's factorisation of its last ``D J`` (:class:`~.refine.FactoredSolver`), reused
    when given (the last step moved the parameters by about their error: the same G to first order);
    a matrix-free one (:class:`~.refine.MatrixFreeSolver`, docs/algorithm.md, 'Matrix-free refinement beyond the dense
    Jacobian') replaces the row norms of G by bounds estimated from LSMR solves (``Certificate.method`` says so) and
    keeps no G.

    ``valid_below`` is the algebraic start's where the schedule has a certificate (refinement
    converges to the fit in whose basin the start lies); None: the answer error under which the
    worst-case first-order movement stays below ``LINEAR_MOVEMENT`` of the parameters' scale.
    ``linear``: ``valid_below`` is the start's matching validity alone, and the fit's own
    linearisation (``LINEAR_MOVEMENT`` / amplification) bounds it too.
    The noise estimate is the residual's root mean square, corrected for the P parameters
    fitted (``sqrt(sum r^2 / (Q - P))``). The amplification is the largest row l1 norm of G over
    the scale of its block (max |W|, max |v|, and with biases max |u|, |c| or 1 at rounding level).
    """
    from .refine import FactoredSolver, MatrixFreeSolver, parameter_count  # the refinement's solvers of D J

    Q, P = len(residuals), parameter_count(model.heads, model.d, bias)
    weights = np.ones(Q) if weights is None else np.asarray(weights, dtype=np.float64)

    solver = solver if solver is not None else FactoredSolver(weights[:, None] * jacobian)
    matrix_free = isinstance(solver, MatrixFreeSolver)
    H, d = model.heads, model.d
    nW, nv = H * d * d, H * d
    W_scale, v_scale = _relative_scales(model)
    noise = root_mean_square(residuals, max(Q - P, 1))
    if matrix_free:
        # no G to take norms of: estimated bounds from LSMR solves (docs/algorithm.md, 'Matrix-free refinement beyond
        # the dense Jacobian')
        rows = solver.row_l1_bounds(weights)
        rank_ok = bool(np.all(np.isfinite(rows)))
    else:
        s = solver.s
        rank_ok = bool(s.size) and s[-1] > s[0] * 1e-14
        rows = np.full(P, np.inf)
    if rank_ok and not matrix_free:
        # G = V diag(1/s) U_R^T Q^T D / norms (row-wise): row l1 norms accumulated over answer chunks.
        left = ((solver.Vt.T / s) @ solver.U_R.T) / solver.norms[:, None]
        rows = np.zeros(P)
        for start in range(0, Q, CHUNK * 8):
            block = slice(start, min(start + CHUNK * 8, Q))
            rows += np.abs(left @ (solver.Q[block].T * weights[block])).sum(axis=1)
    scales = [np.full(nW, W_scale), np.full(nv, v_scale)]
    if bias:  # u and c: relative where resolved, at the first order of 3 x the residual noise
        eps = (1.0 + SECOND_ORDER_SLACK) * (3.0 * noise + _rounding_floor(answers))
        scales += [np.full(nv, _bias_scale(model.u, eps * rows[nW + nv:nW + 2 * nv].max(initial=0.0))),
                   [_bias_scale(model.c, eps * rows[-1])]]
    relative = rows / np.concatenate(scales)
    parts = [relative[:nW], relative[nW:nW + nv]] + ([relative[nW + nv:]] if bias else [])
    amplifications = tuple(float(part.max(initial=0.0)) for part in parts)
    if valid_below is None or linear:
        amplification = max(amplifications)
        own = LINEAR_MOVEMENT / amplification if amplification > 0 else np.inf
        valid_below = own if valid_below is None else min(valid_below, own)
    certificate = Certificate("least squares", valid_below if rank_ok else 0.0, _rounding_floor(answers), noise, 0.0,
                              _norms=lambda: amplifications,
                              method=MATRIX_FREE_METHOD if matrix_free else "exact", linear_movement=LINEAR_MOVEMENT)
    certificate._factors = (solver, weights) if rank_ok and not matrix_free else None
    certificate._bias = bias
    return certificate
