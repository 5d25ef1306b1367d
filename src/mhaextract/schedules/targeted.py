"""The targeted schedule: one head at a time, in float64 (docs/algorithm.md §13).

``extract(oracle, d, heads=H, schedule="targeted")``. Every measurement is a copies-instance
designed so that only one head is in the window of the copy counts; the others are saturated
towards ``x`` and contribute the constant ``v_g^T x``. Such an instance is single-pole,

    G(k) = vbar^T x - F(k) = k l_h / (k + tau_h),   tau_h = exp(a_h^T x),  a_h = W_h^T z,  l_h = v_h^T z,

and stays well conditioned whatever H is (the full ``2H + 1``-sample interpolation of the other
schedules loses about three digits per head). The head is known by construction: no matching.

**Design.** For a difference z the log-poles ``m_g = a_g^T x`` are H linear functionals of the
final token. With estimates of the ``a_g`` (H <= d) the instance ``n`` of head h solves

    a_h^T x = t_n in log 2 +- 2.5,   a_g^T x = s_{g,n} in [40, 100] (g != h),   null-space part free,

(``e^{-40}`` puts a saturated head's term ``k l_g / (k + tau_g)`` 1e-17 below its label). The
``(t, s, null part)`` of the d instances of ``(h, z)`` are the columns of a pattern with one
constant row and zero-sum orthogonal rows (:func:`_patterns`), so their final tokens span R^d
with a well-conditioned design. After each round the estimate of ``a_h`` is corrected to fit the
log-poles measured so far. Samples ``k = 1, 2, 3`` with ``F(0) = vbar^T x`` known: two determine
``(l_h, tau_h)``, the third tests that the instance really is single-pole
(:mod:`.kernels.single_pole`). Finally the label of ``(h, z)`` is fixed at the consensus of its d
instances and every ``m`` refitted with it.

**Assembly.** The d measurements ``a_h^T x_n = m_n`` give ``a_h(z) = W_h^T z``; d differences
``z`` (the columns of an orthogonal ``Z_h`` times ``64 * token_scale``) give
``W_h = Z_h^{-T} [a_h(z_1) .. a_h(z_d)]^T`` and ``v_h = Z_h^{-T} l_h``.

**Where the estimates come from** (all measured, in this order):

1. ``vbar`` from d one-token queries (``f((b)) = vbar^T b``), so ``F(0)`` is known everywhere.
2. Group ``z_1``: heads located along lines (:mod:`.linesearch`): labels name the heads, rough
   ``a_h(z_1)`` from readings around each head's switch.
3. Group ``z_1`` measured with targeted instances (stage ``"first"``): precise ``a_h(z_1)``.
4. Bridges ``z_1 + eps z_j`` (eps a power of two, ``j = 2..d``): targeted with the precise
   ``a_g(z_1)``; the head is again known by construction and in the window, since
   ``eps a_h(z_j)^T x`` is small. The first instance of each head asks ``k = 1, 2`` (label and
   pole), the others ``k = 1`` with the label known (``d + 1`` queries per head).
   ``(a_h(z_1 + eps z_j) - a_h(z_1)) / eps`` estimates ``a_h(z_j)`` with the same head identity as
   in group ``z_1``: the bridges link the groups, and give rough ``W_h``, ``v_h`` (~1e-11).
5. Final (stage ``"final"``): each head in its own basis ``Z_h``, the Householder reflection that
   gives the rough ``v_h`` equal components in every column (:func:`_balanced_basis`): a z nearly
   orthogonal to ``v_h`` would make ``l_h`` small next to the oracle's rounding of ``v_h^T y``.
   The other heads' ``a_g(z) = W_g^T z`` come from the rough model.

Queries: ``d`` + phase 1 (about ``H (d + 15)`` plus line grids) + ``3 H d`` (first) +
``(d + 1) H (d - 1)`` (bridges) + ``3 H d^2`` (final): about ``4 H d^2 + 4 H d``, 1.1 to 1.3 times
the paper's ``4 H d^2 - 2 H + 1``. Every count reported is measured at the oracle boundary.

H > d is refused: the H conditions on x need H <= d (saturating some heads towards ``y``
instead would lift that, at one more unknown per instance; not implemented).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks.base import Check, heads_found_check
from ..model import MultiHeadAttention
from ..numerics import float64 as float64_kernel
from ..numerics import single_pole
from ..oracle.boundary import OracleBoundary
from ..oracle.queries import one_token_queries, quantize, random_basis
from .base import Outcome, Schedule, ScheduleDetails
from .grid import Instance
from .linesearch import CENTER_COPIES, LineSearchReport, locate_heads

EPS = np.finfo(np.float64).eps
#: |z| of every group, in units of the token scale. Large |z| makes the pole term (~|z|) dominate
#: the saturated constant vbar^T x (~1/|z|, since |x| ~ s / |a_h| and |a_h| ~ |z|).
GROUP_SCALE = 64.0
#: Designed log-poles: the target head in TARGET_CENTER +- TARGET (tau near the copy counts
#: 1..3, where the three-sample fit is best conditioned), the others in MID +- SPREAD.
TARGET_CENTER, TARGET = float(np.log(2.0)), 2.5
SATURATION_MID, SATURATION_SPREAD = 70.0, 30.0
#: A head counts as saturated when its log-pole (from the final model) is at least this.
SATURATION_MARGIN = 36.0
#: A final instance whose third sample misfits the single-pole form by more than this many
#: rounding units did not hold its saturation assumption.
RESIDUAL_LIMIT = 50.0
FINAL_COPIES = (1, 2, 3)
#: The common checks' thresholds: relative parameter error expected, misfit of the answers.
ERROR_ESTIMATE_LIMIT, ANSWERS_RESIDUAL_LIMIT = 1e-8, 1e-9


@dataclass
class TargetedInstances:
    """Per-instance diagnostics of a targeted run (arrays indexed by instance, query order).

    Attributes
    ----------
    stage : ``"first"`` (group ``z_1``, three samples), ``"bridge"`` (groups ``z_1 + eps z_j``, one
        or two samples) or ``"final"`` (each head's own basis, three samples; these alone make the model).
    group : which difference: j of ``z_1 + eps z_j`` for bridges (1-based j >= 1 as ``group + 1``),
        the column of the head's basis for final instances, 0 for the first group.
    head : the head the instance was designed for (index into the extracted model).
    log_pole, label : measured ``m_h`` and ``l_h`` (label NaN for one-sample bridge readings).
    designed : the log-pole the design aimed at (``t``).
    residual : misfit of the third sample to the single-pole form, in rounding units (final
        instances; NaN for bridges).
    margin : smallest log-pole of the other heads at this instance, from the extracted model.
    saturated : the instance held its assumption: margin >= ``SATURATION_MARGIN`` and (final
        instances) residual <= ``RESIDUAL_LIMIT``; for bridges also the measured log-pole agrees
        with the extracted model to 1e-6.
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
    phase1 : :class:`~mhaextract.schedules.linesearch.LineSearchReport` of the line search in group
        ``z_1`` (lines drawn, centres accepted and rejected, the heads found with their rough estimates).
    """

    instances: TargetedInstances
    phase1: LineSearchReport

    def summary(self) -> dict:
        return {"phase1_lines": self.phase1.lines, "unsaturated": int(len(self.instances.unsaturated))}

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"instances_{name}": np.asarray(values, dtype=str if name == "stage" else None)
                for name, values in vars(self.instances).items()}


class _Prober:
    """Asks copies-instances through the boundary and keeps every query and answer."""

    def __init__(self, boundary: OracleBoundary, d: int, token_scale: float):
        self.boundary = boundary
        self.d = d
        self.token_scale = token_scale
        # One exact grid for every token of the run: sums and differences of tokens stay exact.
        self.grid_scale = 4 * GROUP_SCALE * token_scale
        self.sequences: list[np.ndarray] = []
        self.answers: list[np.ndarray] = []
        self.vbar: np.ndarray | None = None

    def quantize(self, values: np.ndarray) -> np.ndarray:
        return quantize(values, self.grid_scale)

    def ask(self, sequences, description):
        answers = self.boundary.ask(sequences, description=description)
        self.sequences.extend(sequences)
        self.answers.append(np.asarray(answers, dtype=np.float64))
        return answers

    def learn_vbar(self, basis: np.ndarray) -> None:
        """``vbar`` from the one-token answers ``f((b_i)) = vbar^T b_i`` on a basis (columns)."""
        answers = self.ask(one_token_queries(basis), "one-token queries (vbar)")
        self.vbar = float64_kernel.solve_transposed(basis, answers)

    def gaps(self, finals: np.ndarray, differences: np.ndarray, copies, description="targeted instances"):
        """``G(k) = vbar^T x - F(k)`` for each row (x, z) and each k in ``copies``; and the
        rounding scale of each sample (the magnitudes the subtraction cancels)."""
        sequences = [Instance("targeted", 0, 0, x, z, tuple(copies)).sequence(k)
                     for x, z in zip(finals, differences) for k in copies]
        answers = np.asarray(self.ask(sequences, description), dtype=np.float64).reshape(len(finals), len(copies))
        anchor = finals @ self.vbar
        labels_scale = np.abs(differences) @ np.abs(self.vbar)
        rounding = 4 * EPS * (np.abs(anchor)[:, None] + np.abs(answers) + labels_scale[:, None])
        return anchor[:, None] - answers, rounding


def _design(estimates: np.ndarray, head: int, pattern: np.ndarray) -> np.ndarray:
    """The final token for one column ``pattern`` (d,) of the design: log-poles (by the estimates)
    ``TARGET * p_h`` for ``head``, ``MID + SPREAD * p_g`` for the others, ``SPREAD * p`` along the
    null space of the estimates (scaled like their rows)."""
    H, d = estimates.shape
    _, singular, vt = np.linalg.svd(estimates)
    null = vt[H:] * singular.mean()
    design = np.vstack([estimates, null])
    values = np.concatenate([SATURATION_MID + SATURATION_SPREAD * pattern[:H], SATURATION_SPREAD * pattern[H:]])
    values[head] = TARGET_CENTER + TARGET * pattern[head]
    return np.linalg.solve(design, values)


def _patterns(rng, d: int, constant_row: int) -> np.ndarray:
    """Design patterns (d x d, entries in [-1, 1]): row ``constant_row`` all ones, the other rows
    random, mutually orthogonal and orthogonal to the ones (zero sums).

    The log-poles of the design are ``offset + halfwidth * pattern`` row by row, with a large offset
    (``SATURATION_MID``) on the saturated rows. With zero-sum rows the offsets of all rows are
    carried by the one constant row, so the design matrix is a triangular (well-conditioned)
    transform of orthogonal rows; random rows would let the offset nearly cancel a combination
    of the variations for some draws and make the d final tokens nearly dependent.
    """
    gaussian = rng.standard_normal((d, d))
    order = [constant_row] + [row for row in range(d) if row != constant_row]
    gaussian[:, 0] = 1.0  # Gram-Schmidt (QR) with the ones first: the others come out orthogonal to it
    q, _ = np.linalg.qr(gaussian)
    rows = np.empty((d, d))
    rows[order] = q.T
    return rows / np.abs(rows).max(axis=1, keepdims=True)


@dataclass
class _GroupMeasurements:
    """All instances of some units (g, h): head h with difference ``differences[g, h]``, d rounds each.
    Arrays (G, H, d rounds) unless noted."""

    differences: np.ndarray  # (G, H, d)
    finals: np.ndarray  # (G, H, d, d)
    log_pole: np.ndarray
    label: np.ndarray
    designed: np.ndarray
    residual: np.ndarray
    sigma_m: np.ndarray
    sigma_l: np.ndarray
    gaps: np.ndarray  # (G, H, d, K) the samples G(k) (NaN where not asked)
    rounding: np.ndarray  # (G, H, d, K) their rounding scales

    def consensus_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """Inverse-variance mean of the labels of each (group, head) over its instances, and its error."""
        weights = np.where(np.isfinite(self.label), 1.0 / np.maximum(self.sigma_l, 1e-300) ** 2, 0.0)
        total = np.maximum(weights.sum(axis=2), 1e-300)
        return (np.nan_to_num(self.label) * weights).sum(axis=2) / total, 1.0 / np.sqrt(total)

    def refit_with_consensus_labels(self) -> None:
        """Final groups: each instance's ``m`` again, now with its label fixed at the consensus."""
        labels, _ = self.consensus_labels()
        G, H, rounds, K = self.gaps.shape
        m, sigma = single_pole.log_pole_given_label(
            self.gaps.reshape(-1, K), FINAL_COPIES, self.rounding.reshape(-1, K),
            np.repeat(labels.ravel(), rounds))
        self.log_pole = m.reshape(G, H, rounds)
        self.sigma_m = sigma.reshape(G, H, rounds)

    def solve(self) -> np.ndarray:
        """``a_h`` of every group and head from ``a_h^T x_n = m_n`` (G, H, d)."""
        G, H, d, _ = self.finals.shape
        out = np.full((G, H, d), np.nan)
        for g in range(G):
            for h in range(H):
                m = self.log_pole[g, h]
                if np.isfinite(m).all():
                    out[g, h] = np.linalg.solve(self.finals[g, h], m)
        return out


def _measure(prober: _Prober, differences: np.ndarray, estimates: np.ndarray, rng, bridge: bool) -> _GroupMeasurements:
    """Targeted instances, d rounds, for every unit ``(g, h)``: head h with difference ``differences[g, h]``.

    ``differences`` (G, H, d); ``estimates`` (G, H, H, d): for unit ``(g, h)`` the ``a_f`` of all
    heads f at its difference, used for the design. The target's own row is corrected after every
    round to fit its measured log-poles. Final units ask ``k = 1, 2, 3``; bridges ``k = 1, 2`` in
    round 0 and ``k = 1`` later (the label is then known).
    """
    G, H, _, d = estimates.shape
    current = estimates.copy()
    # The constant row: a saturated head (or a null-space direction), never the target itself.
    patterns = np.array([[_patterns(rng, d, (h + 1) % d) for h in range(H)] for _ in range(G)])  # (G, H, d, d)
    shape = (G, H, d)
    K = 2 if bridge else len(FINAL_COPIES)
    out = _GroupMeasurements(differences, np.zeros(shape + (d,)), np.full(shape, np.nan), np.full(shape, np.nan),
                             np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.inf),
                             np.full(shape, np.inf), np.full(shape + (K,), np.nan), np.full(shape + (K,), np.nan))
    stage = "bridge" if bridge else "final"
    heads = np.arange(H)
    for n in range(d):
        finals = np.array([[prober.quantize(_design(current[g, h], h, patterns[g, h, :, n])) for h in range(H)]
                           for g in range(G)])
        out.finals[:, :, n] = finals
        out.designed[:, :, n] = np.einsum("ghd,ghd->gh", current[:, heads, heads], finals)
        copies = (1,) if bridge and n else ((1, 2) if bridge else FINAL_COPIES)
        gaps, rounding = prober.gaps(finals.reshape(G * H, d), differences.reshape(G * H, d), copies,
                                     f"{stage} instances, round {n + 1}/{d}")
        out.gaps[:, :, n, :len(copies)] = gaps.reshape(G, H, len(copies))
        out.rounding[:, :, n, :len(copies)] = rounding.reshape(G, H, len(copies))
        if copies == (1,):
            m = single_pole.reading(gaps[:, 0], 0.0, out.label[:, :, 0].ravel())
            out.log_pole[:, :, n] = m.reshape(G, H)
            # One sample: the error of m from the rounding of G(1) (dm = dG (1 + tau)^2 / (l tau)).
            tau = np.exp(m)
            out.sigma_m[:, :, n] = (rounding[:, 0] * (1 + tau) ** 2 / np.abs(out.label[:, :, 0].ravel() * tau)).reshape(G, H)
        else:
            fits = single_pole.fit(gaps, copies, rounding)
            out.log_pole[:, :, n] = fits.log_pole.reshape(G, H)
            out.label[:, :, n] = fits.label.reshape(G, H)
            out.residual[:, :, n] = fits.residual.reshape(G, H) if len(copies) > 2 else np.nan
            out.sigma_m[:, :, n] = fits.sigma_m.reshape(G, H)
            out.sigma_l[:, :, n] = fits.sigma_l.reshape(G, H)
        # Correct the target's estimate to fit what was measured (minimal change from the prior).
        for g in range(G):
            for h in range(H):
                X, m = out.finals[g, h, :n + 1], out.log_pole[g, h, :n + 1]
                ok = np.isfinite(m)
                if ok.any():
                    miss = m[ok] - X[ok] @ estimates[g, h, h]
                    current[g, h, h] = estimates[g, h, h] + np.linalg.lstsq(X[ok], miss, rcond=1e-12)[0]
    if not bridge:
        out.refit_with_consensus_labels()
    return out


def _shared(differences: np.ndarray, estimates: np.ndarray):
    """Units of groups shared by all heads: differences (G, d) and a's (G, H, d) broadcast per unit."""
    G, H, d = estimates.shape
    return (np.repeat(differences[:, None], H, axis=1),
            np.repeat(estimates[:, None], H, axis=1))


def _balanced_basis(label_direction: np.ndarray, rng, scale: float) -> np.ndarray:
    """An orthogonal basis (columns) times ``scale`` in which ``label_direction`` (a rough ``v_h``)
    has equal components ``+-|v_h| / sqrt(d)``: the Householder reflection that exchanges
    ``v_h / |v_h|`` and ``(1, .., 1) / sqrt(d)``, with random column signs.

    A difference z nearly orthogonal to ``v_h`` makes the label ``l_h = v_h^T z`` small next to the
    oracle's rounding of ``v_h^T y`` (``~ eps |v_h| |z|``), and that head's poles imprecise; in this
    basis every ``|l_h| = |v_h| |z| / sqrt(d)``.
    """
    d = len(label_direction)
    unit = label_direction / np.linalg.norm(label_direction)
    ones = np.full(d, 1.0 / np.sqrt(d))
    normal = unit - ones
    if np.linalg.norm(normal) < 1e-12:
        reflection = np.eye(d)
    else:
        normal /= np.linalg.norm(normal)
        reflection = np.eye(d) - 2.0 * np.outer(normal, normal)
    return reflection * rng.choice([-1.0, 1.0], size=d)[None, :] * scale


class TargetedSchedule(Schedule):
    """``extract(..., schedule="targeted")``: float64, H <= d (see the module docstring)."""

    name = "targeted"
    refusal = ("it is a float64 schedule whose instances are single-pole fits (precision=None, no oversampling, "
               "refinement or answer-error model); use schedule='paper' for those")

    def __init__(self, settings):
        super().__init__(settings)
        if self.max_heads > self.d:
            raise ValueError(
                f"schedule='targeted' needs H <= d (got H0 = {self.max_heads} > d = {self.d}): each targeted "
                "instance puts one head in the window and the other H - 1 beyond log-pole 40 through H linear "
                "conditions on the final token. Use schedule='paper' with precision=BITS for H > d."
            )
        self.rng = np.random.default_rng(settings.seed)
        self.vbar_basis = random_basis(self.rng, self.d, self.token_scale)

    @property
    def promised_queries(self) -> int:
        """The stages after phase 1, with H0 heads found: ``d`` one-token queries + ``3 H d``
        (first group) + ``(d + 1) H (d - 1)`` (bridges) + ``3 H d^2`` (final). Phase 1 (the line
        search, about ``H (d + 15)`` plus line grids) is adaptive and comes on top."""
        d, H = self.d, self.max_heads
        return d + 3 * H * d + (d + 1) * H * (d - 1) + 3 * H * d * d

    @property
    def promised_max_length(self) -> int:
        return max(CENTER_COPIES) + 1

    @property
    def count_formula(self) -> str:
        return "targeted d + 3Hd + (d+1)H(d-1) + 3Hd^2 after the adaptive phase 1"

    def fixed_queries(self) -> list[np.ndarray]:
        # The one-token queries are fixed; the rest is adaptive and replays query by query.
        return one_token_queries(self.vbar_basis)

    def run(self, boundary, arithmetic) -> Outcome:
        prober = _Prober(boundary, self.d, self.token_scale)
        prober.learn_vbar(self.vbar_basis)
        search, stages, model, finite = _run(prober, self.d, self.max_heads, self.rng, self.token_scale)
        H = len(search.heads)
        instances = _diagnostics(stages, model)
        measurements = [data for _, data in stages]
        error_estimate = _error_estimate(stages[-1][1], model) if model is not None else np.inf
        answers = np.concatenate(prober.answers) if prober.answers else np.zeros(0)
        checks = _checks(instances, search, H, self.settings.heads, measurements)
        return Outcome(model, H, error_estimate, TargetedDetails(instances, search), prober.sequences, answers,
                       checks)

    def thresholds(self) -> tuple[float, float]:
        return ERROR_ESTIMATE_LIMIT, ANSWERS_RESIDUAL_LIMIT


def _run(prober: _Prober, d: int, max_heads: int, rng, token_scale: float):
    """Phase 1, the first group, the bridges and the final instances (see the module docstring).
    Returns ``(line search report, [(stage, measurements)], model or None, finite)``."""
    Z = prober.quantize(random_basis(rng, d, GROUP_SCALE * token_scale))
    # --- phase 1: heads and rough a_h(1) along lines in group z_1.
    z1 = Z[:, 0]
    search = locate_heads(lambda points, ks: prober.gaps(points, np.tile(z1, (len(points), 1)), ks, "phase 1: lines"),
                          z1, max_heads, rng, token_scale, prober.quantize)
    found = search.heads
    H = len(found)
    if H == 0:
        return search, [], None, False
    rough = np.array([head.direction for head in found])

    # --- group z_1, targeted: precise a_h(1) and l_h(1).
    first = _measure(prober, *_shared(Z[:, :1].T, rough[None]), rng, bridge=False)
    a1 = first.solve()[0]
    labels1 = first.consensus_labels()[0][0]
    stages = [("first", first)]

    # --- bridges z_1 + eps z_j: rough a_h(j) and l_h(j), heads named as in group z_1; rough W, v.
    rough_a, rough_l = a1[None], labels1[None]  # (groups, H, d), (groups, H)
    if d > 1 and np.isfinite(a1).all():
        x_size = np.linalg.norm(first.finals, axis=-1).max()
        eps_bridge = 2.0 ** np.floor(np.log2(2.0 / (np.linalg.norm(a1, axis=1).max() * x_size)))
        bridge_z = prober.quantize(Z[:, :1].T + eps_bridge * Z[:, 1:].T)  # (d - 1, d)
        bridges = _measure(prober, *_shared(bridge_z, np.repeat(a1[None], d - 1, axis=0)), rng, bridge=True)
        stages.append(("bridge", bridges))
        # a_h(z_1 + eps z_j) - a_h(z_1) = eps a_h(z_j) (+ the rounding of the bridge difference, 2^-40 relative)
        rough_a = np.concatenate([rough_a, (bridges.solve() - a1[None]) / eps_bridge])
        rough_l = np.concatenate([rough_l, (bridges.label[:, :, 0] - labels1[None]) / eps_bridge])
    model, finite = None, bool(np.isfinite(rough_a).all() and np.isfinite(rough_l).all())
    if finite:
        W_rough, v_rough = float64_kernel.assemble(Z, np.eye(d), rough_a.transpose(1, 0, 2), rough_l.T)

        # --- final: each head in its own basis, balanced for its label (every |v_h^T z| alike).
        scale = GROUP_SCALE * token_scale
        bases = np.array([prober.quantize(_balanced_basis(v_rough[h], rng, scale)) for h in range(H)])  # (H, d, d)
        differences = bases.transpose(2, 0, 1)  # (d groups, H, d): differences[g, h] = column g of head h's basis
        estimates = np.einsum("fab,gha->ghfb", W_rough, differences)  # a_f(z) = W_f^T z for every unit
        final = _measure(prober, differences, estimates, rng, bridge=False)
        stages.append(("final", final))
        a_final = final.solve()  # (d, H, d)
        labels_final = final.consensus_labels()[0]  # (d, H)
        finite = bool(np.isfinite(a_final).all() and np.isfinite(labels_final).all())
        if finite:
            W = np.empty((H, d, d))
            v = np.empty((H, d))
            for h in range(H):  # W_h^T z = a_h(z) over head h's basis: W_h = Z_h^{-T} A_h^T
                W[h], v[h] = (part[0] for part in float64_kernel.assemble(
                    bases[h], np.eye(d), a_final[:, h][None], labels_final[:, h][None]))
            model = MultiHeadAttention(W, v)

    return search, stages, model, finite


def _diagnostics(stages, model) -> TargetedInstances:
    rows = []
    for stage, data in stages:
        G, H, rounds, d = data.finals.shape
        for g in range(G):
            for h in range(H):
                z = data.differences[g, h]
                poles_all = np.einsum("d,hde,ne->nh", z, model.W, data.finals[g, h]) if model is not None else None
                for n in range(rounds):
                    measured = data.log_pole[g, h, n]
                    if poles_all is not None:
                        poles = poles_all[n]
                        margin = float(np.delete(poles, h).min()) if H > 1 else np.inf
                        agrees = abs(poles[h] - measured) <= 1e-6
                    else:
                        margin, agrees = np.nan, False
                    residual = data.residual[g, h, n]
                    ok = margin >= SATURATION_MARGIN and np.isfinite(measured)
                    ok = ok and (agrees if stage == "bridge" else residual <= RESIDUAL_LIMIT)
                    rows.append((stage, g, h, measured, data.label[g, h, n], data.designed[g, h, n], residual,
                                 margin, ok))
    if not rows:
        return TargetedInstances(*(np.array([], dtype=bool if name == "saturated" else float)
                                   for name in TargetedInstances.__dataclass_fields__))
    columns = list(zip(*rows))
    return TargetedInstances(*(np.array(column) for column in columns))


def _error_estimate(final: _GroupMeasurements, model) -> float:
    """First order: each log-pole's error (sample rounding, and the oracle's rounding of the
    scores ``y^T W_h x``, about eps |z| |W_h x|) through ``a_h(z) = X^{-1} m`` and
    ``W_h = Z_h^{-T} A_h^T`` (``Z_h`` orthogonal times ``|z|``)."""
    G, H, rounds, d = final.finals.shape
    W_error = 0.0
    for h in range(H):
        squared = 0.0
        for g in range(G):
            X = final.finals[g, h]
            z = final.differences[g, h]
            score = 8 * EPS * np.linalg.norm(z) * np.linalg.norm(X @ model.W[h].T, axis=1)
            sigma = np.hypot(final.sigma_m[g, h], score)
            squared += np.linalg.norm(np.linalg.solve(X, sigma)) ** 2
        W_error = max(W_error, np.sqrt(squared) / np.linalg.norm(final.differences[0, h]))
    return float(4 * W_error / max(np.abs(model.W).max(), 1e-300))


def _checks(instances: TargetedInstances, search: LineSearchReport, H, heads_given, measurements):
    checks = [heads_found_check(H, heads_given, f"by phase 1 on {search.lines} lines")]
    bad = instances.unsaturated
    where = ", ".join(f"{instances.stage[i]} group {instances.group[i]} head {instances.head[i]}" for i in bad[:5])
    checks.append(Check(
        "saturation", len(bad) == 0, len(bad), 0,
        f"{len(bad)} of {len(instances.saturated)} targeted instances did not hold their saturation assumption"
        + (f" ({where}{', ...' if len(bad) > 5 else ''})" if len(bad) else ""),
    ))
    deviation = 0.0
    for data in measurements:
        labels, sigma = data.label, data.sigma_l
        mean = np.nanmean(labels, axis=2, keepdims=True)
        scale = np.nanmax(np.abs(labels))
        deviation = max(deviation, float(np.nanmax(np.abs(labels - mean) / (sigma + EPS * scale))))
    checks.append(Check("labels_consistent", deviation <= 1e3, deviation, 1e3,
                        "largest deviation of an instance's label from its (head, group) mean, in first-order errors"))
    return checks
