"""The attention family's result: :class:`Extraction`, a :class:`~mhaextract.run.result.Result`
with the schedule's promise, its details, the balls of a high-precision run, the certificate and
the value fit of a whole layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks.certificate import Certificate
from ..checks.refine import Refinement
from ..models.attention import MultiHeadAttention
from ..numerics.enclosure import exact_model
from ..numerics.highprec import radius_float
from ..run.result import Result
from .base import ScheduleDetails


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class Extraction(Result):
    """Result of :func:`mhaextract.extract` from the attention family's schedules (``"targeted"``,
    ``"paper"``, ``"lean"``, ``"lowrank"``): the common fields of :class:`~mhaextract.Result`
    (``model`` the canonical heads in float64; ``error_estimate`` the max relative parameter error
    expected, in the sense of ``compare(...).max_rel``: each of W, v, u and c relative to its own
    largest entry, u and c absolute where they are not resolved from zero; in high precision the
    largest relative ball radius, a proven bound when ``certified``; in float64 a first-order
    estimate, or with a certificate and declared or refined noise the certificate's bound), and:

    Attributes
    ----------
    promised_queries, promised_max_length : int
        The schedule's own formula, for comparison (paper: ``4 H0 d^2 - 2 H0 + 1`` and
        ``2 H0 + 1``; lean: its count without fallback links; targeted: its stages after the
        adaptive phase 1). Measured counts are ``queries`` and ``max_query_length``.
    promised_formula : the schedule's count formula in words.
    max_heads : H0 (the declared H or the bound).
    details : ScheduleDetails
        Schedule-specific diagnostics (:class:`~mhaextract.attention.grid.GridDetails` for paper
        and lean, :class:`~mhaextract.attention.targeted.diagnostics.TargetedDetails` for targeted).
    W_balls, v_balls : object arrays of flint ``arb`` (high precision only), shapes (H*, d, d), (H*, d).
    u_balls, c_ball : the score biases (H*, d) and the output constant as balls (high-precision runs
        that learned biases, ``bias=True``: the biased grid, docs/algorithm.md, 'Biases: affine
        scores and an output constant'); None otherwise. Certified like ``W_balls``: they come from
        the same certified instances through ball arithmetic (``certified`` covers them, and
        ``balls_reproduce_answers`` evaluates them).
    calibration : the calibration's report (:class:`~mhaextract.run.calibration.Calibration`) or None.
    bias : whether the run learned score biases and the output constant.
    certificate : Certificate or None
        The first-order error certificate (docs/algorithm.md, 'Approximate answers: certificate,
        oversampling, refinement, verification') where the schedule has one (float64 paper runs),
        behind ``amplification``, ``error_bound(eps)`` and ``valid_below`` (each None when this is None).
    refinement : Refinement or None
        With ``refine=True``: which model was kept, the misfits before and after, the queries added.
    model_class_queries : int
        Probes of the model class's invariants (order of the earlier tokens, scale of a lone token:
        :mod:`mhaextract.checks.model_class`) asked after a failed float64 run to name its cause;
        included in ``queries`` (0 for a run that passed, or that keeps its schedule's exact count).
    answer_error : float or None
        The bound on the answers' absolute error the run was told (None: not told).
    scalar_model : MultiHeadAttention or None
        For vector answers: the schedule's scalar model of ``r^T f`` (``readout``); ``model`` is then
        the vector model (``V_h`` (d_out, d) and ``c`` (d_out,) fitted to the answers), or None where
        no vector model could be fitted (a failed check says why).
    value_fit : :class:`~mhaextract.run.value_fit.ValueFit` or None
        For vector answers: the fit of ``V_h`` and ``c``, its queries, residual and estimate.
    score_error : (float, float) or None
        The errors estimated for the scores alone, W's (with v's: the schedules estimate them
        together) and u's, as ``compare`` reports them, without the output constant's: with the value
        fit's, the whole model's estimate (docs/algorithm.md, 'The whole layer: vector outputs and a
        replacement module'). None: not estimated apart.
    score_deviations : (W (H, d, d), u (H, d) or None) or None
        Every score entry's first-order standard deviation, absolute, scaled to the answers' noise
        (the targeted schedules, ``Outcome.score_deviations``): the value fit moves the scores by them.
        None where the schedule has none or the model is not the one they describe (refined).
    split_queries : int
        Whole answers that could not be split by head (docs/algorithm.md, 'Whole answers near the
        vector bound'): the queries the split asked before this schedule ran (counted in ``queries``).

    Schedule-specific parts are None where the run has none, never an error: ``certificate`` and its
    shortcuts ``amplification``, ``valid_below`` and ``error_bound(eps)`` (float64 paper runs, and
    refined runs), ``W_balls``/``v_balls``, ``model_hp`` and ``radius`` (high precision), ``details``
    (its own class per schedule), ``refinement``, ``verification``, ``calibration``.

    Methods
    -------
    error_bound(eps) : float or None
        The certificate's bound for answers within ``eps`` (None without a certificate).

    ``summary()`` adds the attributes above (and ``details.summary()``) to the common scalars;
    ``repr(result)`` is :class:`~mhaextract.Result`'s one line.

    Examples
    --------
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> oracle = mx.SimulatedOracle(target)
    >>> result = mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper")
    >>> result.ok, result.heads, result.queries, result.promised_queries
    (True, 2, 69, 69)
    >>> [check.name for check in result.checks][:3]
    ['heads_found', 'pole_count', 'poles_real_positive']
    >>> bool(result.error_estimate < 1e-6), bool(result.error_bound(1e-12) < 1e-6)
    (True, True)
    >>> checked = result.with_verification(mx.verify(result, oracle, verify_queries=64, seed=0))
    >>> checked.verified
    True
    """

    promised_queries: int = 0
    promised_max_length: int = 0
    promised_formula: str = ""
    max_heads: int = 0
    details: ScheduleDetails | None = None
    W_balls: np.ndarray | None = None
    v_balls: np.ndarray | None = None
    u_balls: np.ndarray | None = None
    c_ball: object = None
    calibration: object = None
    bias: bool = False
    model_class_queries: int = 0
    certificate: Certificate | None = None
    refinement: Refinement | None = None
    answer_error: float | None = None
    scalar_model: MultiHeadAttention | None = None
    value_fit: object = None
    split_queries: int = 0
    score_error: tuple[float, float] | None = None
    score_deviations: tuple | None = None

    @property
    def d_out(self) -> int | None:
        """Outputs per answer for an oracle answering vectors, None for scalar answers."""
        return None if self.readout is None else len(self.readout)

    @property
    def amplification(self) -> float | None:
        """C: worst-case relative parameter error per unit absolute answer error, first order (None
        without a ``certificate``: high precision, and the schedules that have none)."""
        return None if self.certificate is None else self.certificate.amplification

    @property
    def valid_below(self) -> float | None:
        """The answer-error bound below which the matching is certified and first order holds (None
        without a ``certificate``)."""
        return None if self.certificate is None else self.certificate.valid_below

    def error_bound(self, eps: float) -> float | None:
        """Bound on ``compare(model, truth).max_rel`` if every answer is within ``eps`` of the
        truth (inf when ``eps >= valid_below``; None without a ``certificate``, whose absence
        ``error_estimate`` does not depend on); see :class:`mhaextract.checks.certificate.Certificate`."""
        return None if self.certificate is None else self.certificate.error_bound(eps)

    @property
    def certified(self) -> bool:
        """High precision: every instance's balls were proven (Krawczyk) to enclose its exact
        parameters, given answers within one ulp; the assembled balls then enclose the truth.
        Not claimed when the balls fail to reproduce the answers (``balls_reproduce_answers``:
        heads merged below the answers' resolution). False in high precision: ``error_estimate`` rests
        partly on first-order radii, judged against ``max(2^-53, 2^(-precision/4))`` (docs/algorithm.md, 'Kernels in ball arithmetic and certification')."""
        disproved = any(check.name == "balls_reproduce_answers" and not check.passed for check in self.checks)
        return self.precision is not None and self.details is not None and self.details.certified and not disproved

    @property
    def model_hp(self) -> MultiHeadAttention | None:
        """The canonical heads (with ``u`` and ``c`` when learned) as exact mpf midpoints of the balls
        (high precision only)."""
        if self.W_balls is None:
            return None
        return exact_model(self.W_balls, self.v_balls, self.u_balls, self.c_ball)

    @property
    def radius(self) -> tuple[float, float] | None:
        """Largest ball radius of W and of v (high precision only)."""
        if self.W_balls is None or self.heads == 0:
            return None
        return float(radius_float(self.W_balls).max()), float(radius_float(self.v_balls).max())

    def _summary_extra(self) -> dict:
        """The family's scalars (the attributes above, the certificate's ``valid_below``,
        ``noise_estimate`` and ``method`` or None, and ``details.summary()``)."""
        return {
            "max_heads": self.max_heads, "promised_queries": self.promised_queries,
            "promised_formula": self.promised_formula, "promised_max_length": self.promised_max_length,
            "bias": self.bias, "certified": self.certified, "answer_error": self.answer_error, "d_out": self.d_out,
            "value_fit_rows": None if self.value_fit is None else self.value_fit.rows,
            "valid_below": None if self.certificate is None else self.certificate.valid_below,
            "noise_estimate": None if self.certificate is None else self.certificate.noise_estimate,
            "certificate_method": None if self.certificate is None else self.certificate.method,
            "refinement": None if self.refinement is None else str(self.refinement),
            "model_class_queries": self.model_class_queries, "split_queries": self.split_queries,
            **({} if self.details is None else self.details.summary()),
        }

    def report_rows(self, comparison=None) -> list[tuple[str, str, str]]:
        """The bound H0, the schedule's formula against the measured count, its details, the value
        fit, the errors of W, v (u, c with biases) against the truth, what the estimate rests on,
        the certificate and the refinement."""
        def shown(value) -> str:
            return f"{float(value):.2e}" if value else "0"

        rows = [("H (bound H0)", str(self.max_heads), f"schedule '{self.schedule}'")]
        value_fit = 0 if self.value_fit is None else self.value_fit.rows
        by_schedule = (self.queries - (self.refinement.queries if self.refinement is not None else 0)
                       - self.calibration_queries - self.verification_queries - value_fit)
        formula = (f"{self.promised_formula} = {self.promised_queries} (the schedule's measured/formula "
                   f"{by_schedule / max(self.promised_queries, 1):.3f})")
        if self.refinement is not None:
            formula += f" + {self.refinement.queries} refinement queries"
        rows.append(("promised queries", str(self.promised_queries), formula))
        rows.append(("promised length", str(self.promised_max_length), "the longest query of the schedule's formula"))
        if self.calibration is not None:
            rows.append(("token scale choice", f"{self.token_scale:.4g}", str(self.calibration)))
        for name, value in ({} if self.details is None else self.details.summary()).items():
            rows.append((name.replace("_", " "), f"{value:.3g}" if isinstance(value, float) else str(value),
                         f"schedule '{self.schedule}'"))
        if self.d_out is not None:
            rows.append(("outputs per answer", str(self.d_out), "whole answers: the model has V_h (d_out x d) and c "
                         "(d_out)"))
            if self.value_fit is not None:
                rows.append(("value fit", f"{self.value_fit.rows} queries",
                             f"residual {shown(self.value_fit.residual)}, estimate "
                             f"{shown(self.value_fit.error_estimate)}, |V^T r - v| {shown(self.value_fit.readout_gap)} "
                             "(docs/algorithm.md, 'The whole layer: vector outputs and a replacement module')"))
        if comparison is not None:
            agree = "" if comparison.heads_agree else f"  truth has {comparison.heads_b} canonical heads"
            rows += [("max rel. error W", shown(comparison.W_rel), "normwise, against the truth" + agree),
                     ("max rel. error v", shown(comparison.v_rel), "")]
            if self.bias:  # the estimate covers these too (compare's max_rel)
                rows += [("max rel. error u", shown(comparison.u_rel), "to the truth's max |u| (absolute if it has none)"),
                         ("rel. error c", shown(comparison.c_rel), "to the truth's |c| (absolute if c = 0)")]
        kind = ("certified ball radius" if self.certified
                else ("ball radius (first order)" if self.precision else "first order"))
        proven = getattr(getattr(self.details, "instances", None), "certified", None)
        if self.precision and not self.certified and proven is not None:  # what is proven, what estimated
            kind = f"ball radius: {int(proven.sum())} of {len(proven)} instances proven, the rest first order"
        rows.append(("estimate from", kind, "what the error estimate rests on"))
        if self.certificate is not None:
            method = ("" if self.certificate.method == "exact" else
                      f" ({self.certificate.method}, docs/algorithm.md, 'Matrix-free refinement beyond the dense "
                      "Jacobian')")
            rows += [("amplification C", shown(self.amplification), f"first order, {self.certificate.kind} result{method}"),
                     ("valid below", shown(self.valid_below), "answer error under which the certificate holds"),
                     ("noise estimate", shown(self.certificate.noise_estimate),
                      "std. dev. of the answers' errors, from the data")]
            if self.answer_error is not None:
                rows.append(("error bound", shown(self.error_bound(self.answer_error)),
                             f"at answer_error = {self.answer_error:.3g}"))
        if self.refinement is not None:
            rows.append(("refinement", self.refinement.kept, f"rms misfit {self.refinement.residual_before:.2e} -> "
                         f"{self.refinement.residual_after:.2e}"))
        return rows

    def _saved_extra(self) -> tuple[dict | None, dict]:
        """The exact model from the balls' midpoints (hex strings, ``model_hp``) with the balls'
        radii, and the arrays: the radii and the details' per-instance arrays."""
        arrays = {} if self.details is None else dict(self.details.arrays())
        if self.W_balls is None:
            return None, arrays
        exact, _ = self.model_hp.to_document(exact=True)
        W_radius, v_radius = radius_float(self.W_balls), radius_float(self.v_balls)
        exact.update(W_radius=W_radius.tolist(), v_radius=v_radius.tolist())
        arrays.update(W_radius=W_radius, v_radius=v_radius)
        if self.u_balls is not None:
            u_radius, c_radius = radius_float(self.u_balls), float(radius_float([self.c_ball])[0])
            exact.update(u_radius=u_radius.tolist(), c_radius=c_radius)
            arrays.update(u_radius=u_radius, c_radius=np.array(c_radius))
        return exact, arrays
