"""The grid schedules (docs/algorithm.md, 'The paper schedule' and 'The lean schedule'): copies-instances on a d x d
grid, joined by links.

An *instance* fixes a final token ``x`` and a difference ``z`` and asks the sequences
``X_k = (y, ..., y, x)`` with ``k`` copies of ``y = x - z`` (docs/algorithm.md, 'One instance: copies of a token and a
rational function'). Its answers sample

    F(k) = c + sum_h rho_h / (k + tau_h),   tau_h = exp(z^T W_h x),  rho_h = tau_h v_h^T z.

Grid instance ``(i, j)`` has final token ``x_i`` and difference ``z_j`` (poles
``M_h[j, i] = z_j^T W_h x_i``); row link ``j`` (final ``x_0``, difference ``z_0 + z_j``) and column
link ``(i, j)`` (final ``x_0 + x_i``, difference ``z_j``) join grid instances ('The paper schedule'; indices are
0-based in the code). The biased grid ('Biases: affine scores and an output constant') adds one final token, a score
bias ``u_h`` in every pole and a constant ``c0`` in every answer; it sets :attr:`GridSchedule.affine`, its column links
use ``(x_0 + x_i) / 2`` (:attr:`GridSchedule.column_link_weight`). :class:`GridSchedule` holds the
grid and the learner written once for every arithmetic (:mod:`mhaextract.numerics.arithmetic`):
anchors and fits ('One instance: copies of a token and a rational function', 'Anchors', 'Kernels in float64' and
'Kernels in ball arithmetic and certification'), matching ('Matching'), assembly ('Assembly'). Subclasses lay out their
instances (``_build``) and may match heads inside a column by their labels (:meth:`GridSchedule.match_within_columns`,
the lean hook).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checks.base import FLOAT64_MAX_RELIABLE_HEADS, Check, CheckPolicy, heads_found_check
from ..checks.linearisation import PipelineRun
from ..models.attention import MultiHeadAttention
from ..numerics import float64 as float64_kernel
from ..numerics.assembly import inverse_variance_weights, pole_design
from ..numerics.rational import InstanceFits, anchor_sigmas, constant_sigmas
from ..oracle.queries import CopiesQueries, InstanceTable, random_basis
from ..run.validation import positive_int
from .base import Outcome, Schedule, ScheduleDetails
from .matching import LinkMatches, Side, match_links
from .repair import Repairer


@dataclass
class InstanceDiagnostics:
    """Per-instance diagnostics of a grid run, arrays indexed like ``schedule.instances``.

    role, i, j : which instance; rank : pole count detected; singular_values : Loewner singular
    values relative to the largest (n, H0); pole_gap, imaginary, nonpositive, residual, condition,
    certified : see :class:`mhaextract.numerics.rational.InstanceFits`; ambiguity : matching margin
    of links (NaN for grid instances); label_residual : link label mismatch relative to the largest
    label (NaN for grid instances); label_deviation : distance of an instance's labels from the
    consensus of its column in units of its error at the answers' rounding (NaN for row links).
    """

    role: np.ndarray
    i: np.ndarray
    j: np.ndarray
    rank: np.ndarray
    singular_values: np.ndarray
    pole_gap: np.ndarray
    imaginary: np.ndarray
    nonpositive: np.ndarray
    residual: np.ndarray
    condition: np.ndarray
    certified: np.ndarray
    ambiguity: np.ndarray
    label_residual: np.ndarray
    label_deviation: np.ndarray


@dataclass
class GridDetails(ScheduleDetails):
    """``Extraction.details`` of the paper and lean schedules.

    Attributes
    ----------
    instances : InstanceDiagnostics, one entry per instance asked.
    samples_per_instance : K, copy counts 0..K-1 per instance (2 H0 + 1 unless oversampled).
    fallback_links : lean: column links added where residue labels were too close to match
        (``2 H0 - 1`` queries each, included in the measured count); 0 for paper.
    links_bijective : every link matched its poles one to one.
    repair_queries : queries asked to repair failed certificates (docs/algorithm.md, 'Certificate repair: failed
        instances measured again with their poles pulled apart'; included in the measured count); 0 where the schedule
        does not repair.
    repairs : one line per instance that failed the Krawczyk test and was given to the repair:
        repaired or not and why, which partner and mix instances, how many queries.
    repaired : which of those lines are repaired instances (bool per line).
    """

    instances: InstanceDiagnostics
    samples_per_instance: int
    fallback_links: int
    links_bijective: bool
    repair_queries: int = 0
    repairs: list[str] = field(default_factory=list)
    repaired: list[bool] = field(default_factory=list)

    @property
    def certified(self) -> bool:
        """Every instance's balls were proven to enclose its exact parameters (balls only)."""
        return bool(self.instances.certified.all())

    @property
    def merge_resolution(self) -> tuple[float, float]:
        """``(smallest kept, largest dropped)``: over every instance, the smallest relative Loewner
        singular value counted as a pole and the largest counted as none (0 when none was
        dropped). The pole count, and so which heads merge, was decided in the gap between them:
        heads that move an instance's spectrum by less than the second are merged (with
        ``max_heads``) or missing (``heads_found`` fails). A merge is this decision at this
        resolution, not a proof that the heads coincide. In the JSON summary as
        ``smallest_pole_sv`` and ``largest_dropped_sv``."""
        values = np.asarray(self.instances.singular_values, dtype=np.float64)
        counted = np.arange(values.shape[1])[None, :] < np.asarray(self.instances.rank)[:, None]
        kept = values[counted & np.isfinite(values)]
        dropped = values[~counted & np.isfinite(values)]
        return (float(kept.min()) if kept.size else float("nan"), float(dropped.max()) if dropped.size else 0.0)

    def summary(self) -> dict:
        kept, dropped = self.merge_resolution
        return {"samples_per_instance": self.samples_per_instance, "fallback_links": self.fallback_links,
                "smallest_pole_sv": kept, "largest_dropped_sv": dropped, "repair_queries": self.repair_queries,
                "repaired_instances": sum(self.repaired),
                "unrepaired_instances": [line for line, ok in zip(self.repairs, self.repaired) if not ok]}

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"instances_{name}": np.asarray(values, dtype=str if name == "role" else None)
                for name, values in vars(self.instances).items()}


#: ``pole_count``'s message when an instance detected more poles than H* (a refinement does not
#: supersede it: ``api.SUPERSEDED_BY_FIT``).
MORE_POLES = "; some detected more, so H* is not the canonical count"


class GridSchedule(Schedule):
    """Instances on the d x d grid of ``x_i`` and ``z_j`` (see the module docstring).

    Attributes
    ----------
    X, Z : (d, F) and (d, d) arrays whose columns are the final tokens ``x_i`` and differences
        ``z_j`` (F = d, or d + 1 for an affine basis, docs/algorithm.md, 'Biases: affine scores and an output
        constant').
    instances : :class:`~mhaextract.oracle.queries.InstanceTable` (a sequence of :class:`Instance`
        records, with their role, i, j as arrays), in query order.
    grid_index : (F, d) int array, instance index of grid ``(i, j)``.
    row_link_index : (d,) int array, instance index of row link ``j`` (-1 where not asked).
    column_link_index : (F, d) int array, instance index of column link ``(i, j)`` (-1 where not asked).
    ks : (K,) the copy counts ``0..K-1`` every instance's samples are indexed by.
    """

    accepts = frozenset({"precision", "refine", "answer_error", "backend"})
    #: Instances after row 0 know F(0) only (paper) or both anchors F(0) and c (lean), docs/algorithm.md, 'Anchors'.
    both_anchors = False
    #: The model with biases (docs/algorithm.md, 'Biases: affine scores and an output constant'): one-token answers are
    #: ``c0 + vbar^T x``, poles affine in the final token, assembled against the lifted final
    #: tokens :attr:`assembly_basis`.
    affine = False
    #: Column link (i, j) has final token ``w (x_0 + x_i)`` and measures ``w (M[j, 0] + M[j, i])``.
    column_link_weight = 1.0
    #: High precision, ``repair=None``: instances that fail the Krawczyk test are measured again with
    #: their close poles pulled apart, with extra queries (:mod:`.repair`, docs/algorithm.md, 'Certificate repair:
    #: failed instances measured again with their poles pulled apart').
    repairs_certificate = False

    def __init__(self, settings):
        super().__init__(settings)
        exact = 2 * self.max_heads + 1  # the paper's 2 H0 + 1 samples per instance
        K = exact if settings.samples_per_instance is None else settings.samples_per_instance
        self.samples_per_instance = positive_int("samples_per_instance (2 H0 + 1 or more)", K, minimum=exact)
        rng = np.random.default_rng(settings.seed)
        self.X = self._final_tokens(rng)
        self.Z = random_basis(rng, self.d, self.token_scale)
        self.ks = np.arange(self.samples_per_instance)
        self.instances = InstanceTable(self.d)
        finals = self.X.shape[1]
        self.grid_index = np.full((finals, self.d), -1)
        self.row_link_index = np.full(self.d, -1)
        self.column_link_index = np.full((finals, self.d), -1)
        self._build()

    def _final_tokens(self, rng) -> np.ndarray:
        """The final tokens as columns: a random orthogonal basis times the token scale (docs/algorithm.md, 'The paper
        schedule')."""
        return random_basis(rng, self.d, self.token_scale)

    @property
    def repairs(self) -> bool:
        """The certificate repair runs (high precision): ``repair=`` given, else the class default."""
        repair = self.settings.repair
        return self.repairs_certificate if repair is None else repair

    @property
    def assembly_basis(self) -> np.ndarray:
        """X in ``M_h = Z^T W_h X`` (docs/algorithm.md, 'Assembly'); the affine grid overrides it with the lifted tokens
        ('Biases: affine scores and an output constant')."""
        return self.X

    def alternative_start(self, model: MultiHeadAttention, instance: int, h: int, g: int) -> MultiHeadAttention:
        """``model`` with heads h and g exchanged where instance ``instance`` decided them, in
        ``M_h = Z^T [W_h | u_h] X`` (docs/algorithm.md, 'Assembly' and 'Biases: affine scores and an output constant')
        and the labels ``v_h^T z_j``: a row-0 grid instance (0, j), whose order names its column's heads ('Matching'),
        the whole column j and its label; any other grid instance (i, j) the entry (j, i); a link the entries its poles
        measure (row link (0, j): (0, 0) and (j, 0); column link (i, j): (j, 0) and (j, i)). The start of a refit of
        a competing head order (docs/algorithm.md, 'Refuted alternatives')."""
        role, i, j = self.instances.role[instance], int(self.instances.i[instance]), int(self.instances.j[instance])
        basis, Z, d = self.assembly_basis, self.Z, self.d
        A = model.W if not self.affine else np.concatenate([model.W, model.u[:, :, None]], axis=2)
        M = Z.T[None] @ A @ basis[None]  # (H, d, F): [h, j, i] = z_j^T A_h x_i
        labels = model.v @ Z  # (H, d): v_h^T z_j
        cells = {"row_link": [(0, 0), (j, 0)], "column_link": [(j, 0), (j, i)]}.get(
            role, [(j, slice(None))] if i == 0 else [(j, i)])
        for row, column in cells:
            M[[h, g], row, column] = M[[g, h], row, column]
        if role == "grid" and i == 0:
            labels[[h, g], j] = labels[[g, h], j]
        A, v = float64_kernel.assemble(Z, basis, M, labels)  # the run's own assembly (docs/algorithm.md, 'Assembly')
        return MultiHeadAttention(A[:, :, :d], v, A[:, :, d] if self.affine else model.u, model.c)

    def _build(self) -> None:
        """Lay out the instances known before any answer, in query order."""
        raise NotImplementedError

    def _add(self, role: str, i: int, j: int, final, difference, first_k: int, last_k: int | None = None) -> int:
        return int(self._add_many(role, [i], [j], [final], [difference], first_k, last_k)[0])

    def _add_many(self, role: str, i, j, finals, differences, first_k: int, last_k: int | None = None) -> np.ndarray:
        """Add instances ``(i[n], j[n])`` with final token ``finals[n]`` and difference
        ``differences[n]`` (rows), all asking ``k = first_k..last_k``; returns their indices."""
        last = self.samples_per_instance - 1 if last_k is None else last_k
        return self.instances.add(role, i, j, finals, differences, tuple(range(first_k, last + 1)))

    @property
    def promised_max_length(self) -> int:
        return self.samples_per_instance

    def instance_queries(self, indices) -> tuple[CopiesQueries, np.ndarray, np.ndarray]:
        """Queries of the given instances: (sequences, built on demand, instance index of each, copy count k)."""
        return self.instances.queries(list(indices))

    def fixed_queries(self) -> CopiesQueries:
        return self.instance_queries(range(len(self.instances)))[0]

    def run(self, boundary, arithmetic) -> Outcome:
        learner = GridLearner(self, boundary, arithmetic)
        learner.fit_instances()
        column_matches = self.match_within_columns(learner)
        learner.match_links(column_matches)
        return learner.assemble()

    def match_within_columns(self, learner: "GridLearner"):
        """Hook: match heads inside each grid column by their labels, asking fallback links through
        ``learner.add_instances`` where needed. Returns ``(instances, LinkMatches)`` relative to
        their column's row-0 instance, or None (the paper schedule: links do all the matching)."""
        return None

    residual_evidence = True

    def thresholds(self) -> tuple[float, float]:
        policy = CheckPolicy.for_precision(self.settings.precision)
        return policy.error_estimate, policy.answers_residual

    def checks(self, outcome: Outcome, label_noise: float = 0.0) -> list[Check]:
        """Pole counts, real positive poles, matching, label consistency, float64 head limit (docs/algorithm.md,
        'Numerics in float64 and the token scale').

        Label deviations are in units of the first-order error at the answers' rounding; noisier
        answers (``label_noise`` above that unit) widen the unit to the noise."""
        policy = CheckPolicy.for_precision(self.settings.precision)
        diag, H_star = outcome.details.instances, outcome.heads
        self.heads_shown = H_star  # the evidence the hints speak from
        # Declared heads=H: fewer canonical heads is a failure (max_heads accepts fewer, down to none).
        checks = [] if self.settings.heads is None else [
            heads_found_check(H_star, self.settings.heads, "by the majority pole count of row 0")]

        def fraction_check(name, flags, message):
            count = int(np.sum(flags))
            fraction = count / max(len(flags), 1)
            checks.append(Check(name, fraction <= policy.outlier_fraction, fraction, policy.outlier_fraction,
                                f"{count} of {len(flags)} {message}"))

        fraction_check("pole_count", diag.rank != H_star, f"instances detected a pole count other than H* = {H_star}")
        if (diag.rank > H_star).any():
            checks[-1].passed = False
            checks[-1].message += MORE_POLES
        fraction_check("poles_real_positive", diag.nonpositive | (diag.imaginary > policy.per_instance),
                       "instances have a complex or non-positive tau")
        links = ~np.isnan(diag.ambiguity)
        fraction_check("matching", diag.ambiguity[links] > policy.ambiguity,
                       f"links matched their heads ambiguously (ambiguity > {policy.ambiguity})")
        if not outcome.details.links_bijective:
            checks[-1].passed = False
            checks[-1].message += "; a link pole was matched to two heads"
        labelled = ~np.isnan(diag.label_deviation)
        deviation = diag.label_deviation[labelled]
        unit = 2.0**-52
        if self.settings.precision is None and label_noise > unit:
            deviation = deviation * (unit / label_noise)
        fraction_check("labels_consistent", deviation > policy.label_slack,
                       f"instances have residue labels off the consensus by more than {policy.label_slack:.3g} "
                       "times their first-order error")
        if self.settings.precision is None:
            # With H given, the conditioning is that of H heads even if fewer were detected.
            heads = max(H_star, self.settings.heads or 0)
            checks.append(Check(
                "float64_head_limit", heads <= FLOAT64_MAX_RELIABLE_HEADS, heads, FLOAT64_MAX_RELIABLE_HEADS,
                "float64 rational interpolation with 2H+1 samples loses ~3 digits per head; for H >= 5 use "
                "precision=BITS (or schedule='targeted')",
            ))
        return checks + list(outcome.checks)

    def hints(self, failed: set[str]) -> list[str]:
        if not failed & {"matching", "poles_real_positive", "labels_consistent", "answers_residual"}:
            return []
        shown = getattr(self, "heads_shown", None)
        if shown is not None and shown < self.max_heads:  # the majority pole count is below the declared one
            return [f"The instances show {shown} heads, fewer than heads/max_heads = {self.max_heads}: too many "
                    f"heads declared (if the layer has {shown}, declare heads={shown}), heads that merge at this "
                    "precision (precision=BITS resolves closer heads), or a token_scale that saturates some "
                    "(|z^T W_h x| should be of order one; see MultiHeadAttention.suggested_token_scale)."]
        return [f"If the oracle is multi-head attention, heads/max_heads = {self.max_heads} may be smaller than "
                "its canonical head count, the precision too low for it, or token_scale unsuited to its W "
                "(|z^T W_h x| should be of order one; see MultiHeadAttention.suggested_token_scale)."]


def _concatenate(parts, indices, n) -> InstanceFits:
    """Merge InstanceFits computed on disjoint index sets into one indexed 0..n-1."""
    out = {}
    for name in InstanceFits.__dataclass_fields__:
        values = [getattr(part, name) for part in parts]
        same = all(value.dtype == values[0].dtype for value in values)
        merged = np.empty((n,) + values[0].shape[1:], dtype=values[0].dtype if same else object)
        for value, index in zip(values, indices):
            merged[index] = value
        out[name] = merged
    return InstanceFits(**out)


class GridLearner:
    """One grid run in one arithmetic: anchors and fits (docs/algorithm.md, 'Anchors', 'Kernels in float64' and 'Kernels
    in ball arithmetic and certification'), matching ('Matching'), assembly ('Assembly').

    State grows as instances are added (lean fallback links); ``order[n, h]`` is which fitted pole
    of instance n is head h, heads in the order of instance (0, 0).
    """

    def __init__(self, schedule: GridSchedule, boundary, arithmetic):
        self.schedule, self.boundary, self.arithmetic = schedule, boundary, arithmetic
        self.answer_error = schedule.settings.answer_error or 0.0
        sequences, self.owners, self.copies = schedule.instance_queries(range(len(schedule.instances)))
        self.answers = boundary.ask(sequences, description=f"querying (d={schedule.d}, H0={schedule.max_heads})")
        self.sequences = sequences
        self.samples = arithmetic.empty_samples(len(schedule.instances), len(schedule.ks))
        self.samples[self.owners, self.copies] = self.answers
        self.repairer = None
        self.vbar_z_sigma = None  # the anchors' standard deviations (float64, _anchor_sigma)
        if schedule.repairs and arithmetic.precision is not None:
            self.repairer = Repairer(self)

    def record_extra(self, sequences, answers) -> None:
        """Queries asked outside the schedule's instances (repairs): kept with every other query
        (owner -1) so that the answers' residual sees them."""
        self.sequences = self.sequences + list(sequences)
        self.answers = np.concatenate([self.answers, np.asarray(answers, dtype=self.answers.dtype)])
        self.owners = np.concatenate([self.owners, np.full(len(sequences), -1)])
        self.copies = np.concatenate([self.copies, np.arange(len(sequences))])

    @property
    def n(self) -> int:
        return len(self.schedule.instances)

    # --- anchors and fits -----------------------------------------------------------------
    def fit_instances(self) -> None:
        """Row 0 first: its one-token anchor, its ranks (H* by majority), its fits; then ``vbar``
        from ``vbar^T z_j = vbar^T x_0 - c_j`` (docs/algorithm.md, 'Anchors'), and every later instance anchored and
        fitted.

        Affine ('Biases: affine scores and an output constant'): the anchor is ``c0 + vbar^T x_0``, c0 cancels in
        ``vbar^T z_j``, and ``c0 = anchor - vbar^T x_0`` makes every final token's one-token answer known."""
        schedule, arithmetic = self.schedule, self.arithmetic
        grid = schedule.grid_index
        self.anchor = self.samples[grid[0, 0], 0]  # F(0) of row 0: the one-token answer vbar^T x_0
        row0 = grid[0]
        self.samples[row0[1:], 0] = self.anchor
        self.ranks = np.zeros(self.n, dtype=int)
        self.singular_values = np.zeros((self.n, schedule.max_heads))
        self.ranks[row0], self.singular_values[row0] = arithmetic.detect_ranks(
            self.samples[row0], schedule.ks, schedule.max_heads, answer_error=self.answer_error)
        counts = np.bincount(self.ranks[row0], minlength=schedule.max_heads + 1)
        self.H_star = min(int(counts.argmax()), schedule.max_heads)  # oversampled instances can show H0 + 1
        fits_row0 = arithmetic.fit(self.samples[row0], schedule.ks, self.H_star)
        if self.repairer is not None:
            # vbar comes from row 0's constants: repaired first (docs/algorithm.md, 'Certificate repair: failed
            # instances measured again with their poles pulled apart')
            self.repairer.repair(fits_row0, row0)
        self.vbar_z = self.anchor - fits_row0.c
        self.vbar_z_sigma = self._anchor_sigma(fits_row0, row0)
        vbar = arithmetic.solve_transposed(schedule.Z, self.vbar_z)
        self.vbar_x = arithmetic.dot(vbar, schedule.X)
        self.c0 = None
        if schedule.affine:  # vbar_x[i] is then the one-token answer c0 + vbar^T x_i
            self.c0 = self.anchor - self.vbar_x[0]
            self.vbar_x = self.vbar_x + self.c0
        self.vbar_x[0] = self.anchor  # measured, not recomputed
        rest = np.setdiff1d(np.arange(self.n), row0)
        self.ranks[rest], self.singular_values[rest], fits_rest = self._fit_later(rest)
        self.fits = _concatenate([fits_row0, fits_rest], [row0, rest], self.n)
        if self.repairer is not None:
            self.repairer.repair(self.fits, np.arange(self.n))

    def _fit_later(self, indices):
        """Anchor, rank and fit instances after row 0 (both anchors in the lean schedule)."""
        schedule = self.schedule
        constant = None
        width = len(schedule.ks) - 1 if schedule.both_anchors else len(schedule.ks)
        indices = np.asarray(indices, dtype=int)
        if len(indices):  # every instance at once, each entry computed as for that instance alone
            table = schedule.instances
            role, final, columns = table.role[indices], self.vbar_x[table.i[indices]], table.j[indices]
            links = role == "column_link"  # final token w (x_0 + x_i); affine: w = 1/2, c0 kept once
            if links.any():
                linked = self.vbar_x[0] + final[links]
                final[links] = linked if schedule.column_link_weight == 1 else linked * schedule.column_link_weight
            difference = self.vbar_z[columns]
            rows = role == "row_link"
            if rows.any():
                difference[rows] = self.vbar_z[0] + self.vbar_z[columns[rows]]
            self.samples[indices, 0] = final  # F(0) = vbar^T x
            if schedule.both_anchors:
                self.samples[indices, width] = final - difference  # c = vbar^T (x - z), kept in the spare column
        block = self.samples[indices]
        if schedule.both_anchors:
            constant, block = block[:, width], block[:, :width]
        ks = schedule.ks[:width]
        ranks, values = self.arithmetic.detect_ranks(block, ks, schedule.max_heads, constant=constant,
                                                     answer_error=self.answer_error)
        fits = self.arithmetic.fit(block, ks, self.H_star, constant=constant)
        if self.vbar_z_sigma is not None and len(indices) and self.H_star:
            self._add_anchor_errors(fits, indices, ks)
        return ranks, values, fits

    def _anchor_sigma(self, fits_row0, row0):
        """float64 (bias-free): the standard deviations of the anchors ``vbar^T z_j = vbar^T x_0 - c_j``
        per unit relative answer error (absolute error / eps): the one-token answer's rounding and the
        row-0 fit's error of c_j. None where they are not propagated (balls enclose them; the affine
        grid's c0 shares them)."""
        if self.arithmetic.precision is not None or self.schedule.affine or not self.H_star:
            return None
        scale = np.maximum(np.abs(self.samples[row0]).max(axis=1), np.finfo(float).tiny)
        sigma_c = constant_sigmas(self.schedule.ks, np.exp(fits_row0.log_poles), fits_row0.labels, scale)
        self.anchor_sigma = np.zeros((self.n, 2, self.H_star))  # (instance, m or l, pole), row 0 none
        # A failed row-0 fit (non-finite poles: its own checks report it) counts as the worst of the
        # others: an infinite sigma would reach every later instance through vbar and leave no weight.
        finite = np.isfinite(sigma_c)
        sigma_c = np.where(finite, sigma_c, sigma_c[finite].max(initial=0.0))
        return np.hypot(abs(float(self.anchor)), sigma_c)

    def _add_anchor_errors(self, fits, indices, ks) -> None:
        """``anchor_sigma[indices]``: what the anchors' errors do to the later instances' log-poles and
        labels (docs/algorithm.md, 'Anchors' and 'The lean schedule'), in the units of their ``sigma_m``, ``sigma_l``,
        in fit order; the assembly adds it to theirs (the matching keeps the instances' own). Their F(0) = vbar^T x
        (and, both anchors known, c = vbar^T (x - z)) are computed from ``vbar_z``, not answered: an
        error there moves the later fits alike, and lean's fits, which take c as known, cannot absorb
        it into c. It dominates where the row-0 constants are ill-determined (heads with collinear W)."""
        schedule, table = self.schedule, self.schedule.instances
        finals = np.linalg.solve(schedule.Z, schedule.X).T  # vbar^T x_i = finals[i] . vbar_z
        finals[0] = 0.0  # vbar^T x_0 is the answer itself
        i, j, role = table.i[indices], table.j[indices], table.role[indices]
        a = finals[i] * np.where(role == "column_link", schedule.column_link_weight, 1.0)[:, None]
        b = np.eye(schedule.d)[j]
        b[role == "row_link", 0] += 1.0
        E = np.zeros((len(indices), len(ks), schedule.d))
        if schedule.both_anchors:  # G(0) = vbar^T z; G(k) = F(k) - vbar^T (x - z)
            E[:, 0], E[:, 1:] = b, (b - a)[:, None, :]
        else:  # F(0) = vbar^T x
            E[:, 0] = a
        anchor_m, anchor_l = anchor_sigmas(ks, np.exp(fits.log_poles), fits.labels, E, self.vbar_z_sigma,
                                           constant_known=schedule.both_anchors)
        grown = max(self.n, len(self.anchor_sigma))
        if grown > len(self.anchor_sigma):  # fallback links added
            self.anchor_sigma = np.concatenate([self.anchor_sigma, np.zeros((grown - len(self.anchor_sigma),
                                                                             2, self.H_star))])
        self.anchor_sigma[indices, 0], self.anchor_sigma[indices, 1] = anchor_m, anchor_l

    def add_instances(self, indices: list[int]) -> None:
        """Ask, anchor and fit instances the schedule added after the first answers (fallback links)."""
        old = self.n - len(indices)
        sequences, owners, copies = self.schedule.instance_queries(indices)
        answers = self.boundary.ask(sequences, description=f"fallback links ({len(indices)})")
        self.sequences = self.sequences + sequences
        self.answers = np.concatenate([self.answers, answers])
        self.owners, self.copies = np.concatenate([self.owners, owners]), np.concatenate([self.copies, copies])
        grown = self.arithmetic.empty_samples(self.n, len(self.schedule.ks))
        grown[:old] = self.samples
        self.samples = grown
        self.samples[owners, copies] = answers
        ranks, values, fits = self._fit_later(np.array(indices))
        self.ranks = np.concatenate([self.ranks, ranks])
        self.singular_values = np.concatenate([self.singular_values, values])
        self.fits = _concatenate([self.fits, fits], [np.arange(old), np.array(indices)], self.n)

    def side(self, index, ordered: bool = False) -> Side:
        """Poles, labels and their sensitivities of some instances, in head order if ``ordered``."""
        fits = self.fits

        def take(values):
            values = values[index]
            return np.take_along_axis(values, self.order[index], axis=1) if ordered else values
        return Side(take(fits.log_poles), take(fits.labels), take(fits.sigma_m), take(fits.sigma_l))

    # --- matching -------------------------------------------------------------------------
    def match_links(self, column_matches=None) -> None:
        """Row links name the heads of row 0; labels (lean) or column links those of each column (docs/algorithm.md,
        'Matching')."""
        schedule, d = self.schedule, self.schedule.d
        grid, row_links, column_links = schedule.grid_index, schedule.row_link_index, schedule.column_link_index
        self.order = np.tile(np.arange(self.H_star), (self.n, 1))
        self.ambiguity = np.full(self.n, np.nan)
        self.label_residual = np.full(self.n, np.nan)
        labels = self.arithmetic.magnitude(self.fits.labels)
        self.label_scale = max(float(labels.max()) if labels.size else 0.0, 1e-300)
        self.bijective = True
        if d > 1 and (row_links[1:] >= 0).all():
            self._link(np.full(d - 1, grid[0, 0]), grid[0, 1:], row_links[1:], labels_add=True)
        if column_matches is not None:  # relative to each column's row-0 instance
            later, matches = column_matches
            reference_order = self.order[grid[0]][schedule.instances.j[later]]
            self.order[later] = np.take_along_axis(matches.permutation, reference_order, axis=1)
            self.ambiguity[later] = matches.ambiguity
            self.bijective = self.bijective and bool(matches.bijective.all())
        linked = np.argwhere(column_links >= 0)
        if len(linked):
            i, j = linked[:, 0], linked[:, 1]
            self._link(grid[0, j], grid[i, j], column_links[i, j], labels_add=False)
            if column_matches is not None:  # the link decided these; its own ambiguity is on the link
                self.ambiguity[grid[i, j]] = np.nan

    def _link(self, a_index, b_index, link_index, labels_add: bool) -> None:
        link, weight = self.side(link_index), self.schedule.column_link_weight
        if not labels_add and weight != 1:  # a column link's poles are w (m_a + m_b): compare them / w
            link = Side(link.m / weight, link.l, link.s_m / weight, link.s_l)
        matches: LinkMatches = match_links(self.side(a_index, ordered=True), self.side(b_index), link, labels_add)
        self.order[b_index] = matches.permutation
        self.order[link_index] = matches.link_heads
        l_a, l_b, l_link = (self._ordered(self.fits.labels, index) for index in (a_index, b_index, link_index))
        mismatch = self.arithmetic.magnitude(l_link - (l_a + l_b if labels_add else l_b))
        if not labels_add:  # column links: the labels of a and b agree too
            mismatch = np.maximum(mismatch, self.arithmetic.magnitude(l_a - l_b))
        ambiguity, bijective = matches.ambiguity, matches.bijective
        if self.arithmetic.precision is None:
            # A link that gave one of its poles to two heads (its poles nearly coincide: a random grid
            # of 2 d^2 instances has some) while b's order stayed decisive (the labels decide it too):
            # only the link's own measurement is lost. It gets weight 0 in the combination and counts
            # as an ambiguous link in the matching check's outlier fraction (docs/algorithm.md, 'Matching');
            # a link that leaves b's order undecided still fails the run.
            lost = ~bijective & (matches.order_ambiguity <= CheckPolicy.for_precision(None).ambiguity)
            if lost.any():
                self.fits.sigma_m[link_index[lost]] = np.inf
                self.fits.sigma_l[link_index[lost]] = np.inf
                ambiguity, bijective = np.where(lost, np.inf, ambiguity), bijective | lost
        self.ambiguity[link_index] = ambiguity
        self.label_residual[link_index] = mismatch.max(axis=1, initial=0.0) / self.label_scale
        self.bijective = self.bijective and bool(bijective.all())

    def _ordered(self, values, index):
        return np.take_along_axis(values[index], self.order[index], axis=1)

    # --- assembly -------------------------------------------------------------------------
    def assemble(self) -> Outcome:
        """``M_h`` and ``l_h`` from every redundant measurement, then ``W_h``, ``v_h`` (docs/algorithm.md,
        'Assembly')."""
        schedule, arithmetic, everything = self.schedule, self.arithmetic, np.arange(self.n)
        m, labels = self._ordered(self.fits.log_poles, everything), self._ordered(self.fits.labels, everything)
        sigma_m, sigma_l = self.fits.sigma_m, self.fits.sigma_l
        if self.vbar_z_sigma is not None:  # the anchors' errors too (_add_anchor_errors)
            sigma_m, sigma_l = np.hypot(sigma_m, self.anchor_sigma[:, 0]), np.hypot(sigma_l, self.anchor_sigma[:, 1])
        sigma_m, sigma_l = self._ordered(sigma_m, everything), self._ordered(sigma_l, everything)
        M, consensus, M_std, label_std = arithmetic.combine(schedule, m, labels, sigma_m, sigma_l)
        basis = schedule.assembly_basis
        # [W_h | u_h] when affine (docs/algorithm.md, 'Biases: affine scores and an output constant')
        A, v = arithmetic.assemble(schedule.Z, basis, M, consensus)
        W, u = (A[:, :, :schedule.d], A[:, :, schedule.d]) if schedule.affine else (A, None)
        repairer = self.repairer
        details = GridDetails(self._diagnostics(labels, consensus, sigma_l), schedule.samples_per_instance,
                              int((schedule.column_link_index >= 0).sum()) if schedule.both_anchors else 0,
                              self.bijective, repair_queries=0 if repairer is None else repairer.queries,
                              repairs=[] if repairer is None else
                              [record.describe(schedule.instances) for record in repairer.records],
                              repaired=[] if repairer is None else
                              [bool(record.certified) for record in repairer.records])
        A_mid, v_mid = arithmetic.midpoint(A), arithmetic.midpoint(v)
        c_mid = 0.0 if self.c0 is None else float(arithmetic.midpoint(np.array([self.c0], dtype=object))[0])
        outcome = Outcome(None, self.H_star, np.inf, details, self.sequences, self.answers)
        if not (np.isfinite(A_mid).all() and np.isfinite(v_mid).all() and np.isfinite(c_mid)):
            outcome.heads = int(np.bincount(self.ranks).argmax())
            return outcome
        # W and u together, relative to the largest entry of either (docs/algorithm.md, 'Biases: affine scores and an
        # output constant'); c against max(|c|, max|v|).
        outcome.error_estimate = arithmetic.error_estimate(schedule.Z, basis, A, v, M_std, label_std)
        if self.c0 is not None:
            outcome.error_estimate = max(outcome.error_estimate, arithmetic.constant_error(
                self.c0, max(abs(c_mid), float(np.abs(v_mid).max(initial=0.0)))))
        W_mid = A_mid[:, :, :schedule.d]
        outcome.model = MultiHeadAttention(W_mid, v_mid, None if u is None else A_mid[:, :, schedule.d], c_mid)
        if arithmetic.precision is not None:
            outcome.W_balls, outcome.v_balls = W, v
            if schedule.affine:
                outcome.u_balls, outcome.c_ball = u, self.c0
        else:  # what the certificate linearises: the fits in head order, the combination's weights
            outcome.linearisation = PipelineRun(
                schedule, self.owners, self.copies, self.fits.c, m, labels, inverse_variance_weights(sigma_m),
                inverse_variance_weights(sigma_l), pole_design(schedule), outcome.model, self.answers, self.ranks)
        return outcome

    def _diagnostics(self, labels, consensus, sigma_l) -> InstanceDiagnostics:
        """Each grid and column-link instance against the consensus labels of its column, in units
        of its own error at the answers' rounding (ball radii, or eps times the label sensitivity)."""
        schedule, arithmetic = self.schedule, self.arithmetic
        label_deviation = np.full(self.n, np.nan)
        role, column = schedule.instances.role, schedule.instances.j
        judged = np.flatnonzero(role != "row_link")
        if not self.H_star:
            label_deviation[judged] = 0.0
        elif len(judged):
            own, column_consensus = labels[judged], consensus[:, column[judged]].T
            miss = arithmetic.magnitude(own - column_consensus)
            expected = arithmetic.label_error(own, column_consensus, sigma_l[judged])
            label_deviation[judged] = np.nanmax(miss / (expected + arithmetic.unit * self.label_scale), axis=1,
                                                initial=0.0)
        fits = self.fits
        return InstanceDiagnostics(
            role=role, i=schedule.instances.i, j=column,
            rank=self.ranks, singular_values=self.singular_values, pole_gap=fits.pole_gap,
            imaginary=fits.imaginary, nonpositive=fits.nonpositive, residual=fits.residual,
            condition=fits.condition, certified=fits.certified, ambiguity=self.ambiguity,
            label_residual=self.label_residual, label_deviation=label_deviation,
        )

