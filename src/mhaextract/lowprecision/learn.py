"""The run for layers that answer in bfloat16 or float16 (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated
lines, then least squares').

:func:`extract_low_precision` is what :func:`mhaextract.extract` runs when the answers carry 8 or
11 significant bits (declared by the oracle's ``answer_dtype`` or read from their bits) and come
as whole vectors: the saturated start (:mod:`.start`), least squares on fresh short queries
(:mod:`.fit`), a wild-bootstrap error estimate, and the checks below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..checks.base import Check, available_memory
from ..checks.verify import ask_long_verification
from ..models.attention import MultiHeadAttention
from ..oracle.boundary import OracleBoundary
from ..oracle.progress import note_progress
from ..oracle.queries import random_queries
from ..oracle.vector_answers import VectorAnswers
from ..run.result import Result
from ..run.validation import spawn_rng
from .fit import (ARITHMETIC_UNITS, BOOTSTRAP_SAFETY, Design, WholeFit, bootstrap_error, fit_memory, fit_query_count,
                  fit_whole)
from .start import LabelsNotFound, SaturatedStart, saturated_start

#: The fit's queries have 2 .. FIT_LONGEST tokens at the start's token scale times ``2^U``, U
#: uniform in ``[-FIT_SPREAD, FIT_SPREAD]``: small tokens weigh the score biases u_h beside W_h x.
FIT_LONGEST = 8
FIT_SPREAD = 0.0
FIT_SCALE = 1.0
#: The fit's RMS misfit may reach this many answer roundings (``unit`` times the answers' RMS):
#: a fit in the right basin misfits by about the layer's own rounding, a wrong one by far more.
RESIDUAL_UNITS = 4.0
#: The error estimate (relative, ``compare(...).max_rel``) may reach this many answer units: the
#: bootstrap's move, about the part of the error the rounding makes at random, up to 4 units (a fit
#: whose random error alone reaches 4 roundings of the answers is poorly determined).
ESTIMATE_UNITS = 4.0 * BOOTSTRAP_SAFETY + ARITHMETIC_UNITS
#: Default verification length, and the answers' rounding it allows (in units, beside the run's
#: own error estimate).
VERIFY_LONGEST = 64
VERIFY_ROUNDING_UNITS = 8.0
#: The verification's token scales, relative to the start's: up to the fit's own. At twice the
#: scale the scores are four times as large and the layer rounds them by ``|s| unit``: a bfloat16
#: BertSelfAttention (d = 64, H = 4, seed 75) answered a 4-token query there 0.28 away from its
#: exact layer, 5% of the answer, where its model was 2% away.
VERIFY_SCALES = (0.5, 1.0)


class FitTooLarge(RuntimeError):
    """The fit would need ``needed`` bytes, more than the ``available`` the machine has."""

    def __init__(self, message: str, needed: int, available: int):
        super().__init__(message)
        self.needed, self.available = needed, available


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class LowPrecisionExtraction(Result):
    """Result of :func:`mhaextract.extract` on a layer answering in bfloat16 or float16
    (``schedule == "saturated"``): the common fields of :class:`~mhaextract.Result` (``model`` a
    whole :class:`~mhaextract.MultiHeadAttention`, ``V`` (H, d_out, d) and ``c`` (d_out,);
    ``answer_dtype`` ``"bfloat16"`` or ``"float16"``; ``token_scale`` the token norm the start found,
    scores of order one; ``error_estimate`` the relative parameter error in the sense of
    ``compare(...).max_rel``, from the residual bootstrap; ``answers_residual`` the RMS misfit of the
    fit's answers, relative to the largest), and:

    Attributes
    ----------
    error_estimate : here from the wild bootstrap of the fit (docs/algorithm.md, 'Whole answers at 8
        or 11 bits: saturated lines, then least squares'); the other common fields as in
        :class:`~mhaextract.run.result.Result`.
    start : :class:`~mhaextract.lowprecision.start.SaturatedStart` (the start model, the value map,
        lines per direction).
    fit : :class:`~mhaextract.lowprecision.fit.WholeFit`.

    Examples
    --------
    >>> import mhaextract as mx, numpy as np
    >>> from mhaextract.oracle.noise import round_bfloat16
    >>> layer = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True, d_out=4)
    >>> def bfloat16_layer(batch):  # whole outputs rounded to 8 bits
    ...     return round_bfloat16(layer(batch).astype(np.float32)).astype(np.float64)
    >>> result = mx.extract(bfloat16_layer, d=4, heads=2, seed=0)
    >>> result.answer_dtype, result.ok, bool(mx.compare(result.model, layer).max_rel < 2e-2)
    ('bfloat16', True, True)
    """

    start: SaturatedStart | None = None
    fit: WholeFit | None = None

    def _summary_extra(self) -> dict:
        return {"d_out": None if self.model is None else self.model.d_out}


def extract_low_precision(oracle, d: int, heads: int, seed=None, *, unit: float, answer_dtype: str,
                          token_scale: float | None = None, batch_size: int = 1024, progress=None,
                          max_queries=None, verify_length: int | None = None,
                          vectors: VectorAnswers | None = None, transcript=None) -> LowPrecisionExtraction:
    """The run of the module docstring (its checks unreported: ``extract`` raises or warns).
    ``unit``: the answers' unit roundoff (``2^-8`` bfloat16, ``2^-11`` float16). ``transcript``: a
    transcript section (:mod:`mhaextract.oracle.transcript`) that records every answer as it arrives
    and gives back those an interrupted run already paid for."""
    started = time.perf_counter()
    vectors = VectorAnswers(seed, answer_dtype) if vectors is None else vectors
    boundary = OracleBoundary(oracle, d, batch_size=batch_size, progress=progress, max_queries=max_queries,
                              vectors=vectors, transcript=transcript)
    checks, start, fit, model = [], None, None, None
    estimate = residual = np.inf
    try:
        if vectors.d_out is None:  # no vector answer seen (no calibration, or scalars): one query says
            boundary.ask([np.zeros((1, d))], "the output width", whole=True)
        if (vectors.d_out or 1) == 1:
            raise LabelsNotFound(f"the oracle answers one number per query at {answer_dtype}: the heads' labels are "
                                 "vectors of the layer's outputs; answer the whole output (TorchOracle(layer) "
                                 "without readout)")
        count = fit_query_count(heads, d, vectors.d_out)
        need, have = fit_memory(count, heads, d, vectors.d_out, FIT_LONGEST), available_memory()
        if have is not None and need > have:  # refused before the start's queries are spent
            raise FitTooLarge(f"the least-squares fit of the whole model would hold {count:,} "
                              f"queries and their answers, about {need / 2**30:.1f} GiB, beside {have / 2**30:.1f} GiB "
                              "available; its work grows as H^2 d^3 (docs/algorithm.md, "
                              "'Whole answers at 8 or 11 bits: saturated lines, then least squares'): run on a machine "
                              "with "
                              "more memory, or, where you hold the module, extract layer.float() (the same weights, "
                              "answered with 24 bits)", need, have)
        start = saturated_start(boundary, spawn_rng(seed, 31), d, heads, token_scale,
                                on_direction=lambda done, total: note_progress(
                                    progress, f"saturated lines: direction {done} of {total}"))
        checks.append(Check("start", True, 0.0, 0.0, "every direction's labels found on saturated lines"))
    except LabelsNotFound as error:
        checks.append(Check("start", False, 1.0, 0.0, str(error)))
    except FitTooLarge as error:
        checks.append(Check("fit_memory", False, float(error.needed), float(error.available), str(error)))
    design = None
    if start is not None:
        sequences = random_queries(spawn_rng(seed, 32), count, d, FIT_SCALE * start.scale, (2, FIT_LONGEST), FIT_SPREAD)
        design = Design(sequences, boundary.ask(sequences, "fitting on fresh queries", whole=True))
        fit = fit_whole(start.model, design, warm_up=True, on_iteration=lambda step, value: note_progress(
            progress, f"fitting the whole model: iteration {step}, misfit {value:.3g}"))
        model, residual = fit.model, fit.misfit_after
        estimate = bootstrap_error(fit, design, spawn_rng(seed, 33), unit)
        rounding = unit * float(np.sqrt(np.mean(design.answers ** 2))) / design.scale
        checks += [
            Check("answers_residual", residual <= RESIDUAL_UNITS * rounding, residual, RESIDUAL_UNITS * rounding,
                  f"RMS misfit of the fit on its {count} answers, relative to the largest (limit: "
                  f"{RESIDUAL_UNITS:g} roundings of the answers at {answer_dtype})"),
            Check("error_estimate", estimate <= ESTIMATE_UNITS * unit, estimate, ESTIMATE_UNITS * unit,
                  "relative parameter error, wild bootstrap of the fit"),
        ]
    verification = None
    if model is not None and (verify_length is None or verify_length > 0):
        long_queries = ask_long_verification(boundary, spawn_rng(seed, 5), start.scale,
                                             verify_length or VERIFY_LONGEST, scales=VERIFY_SCALES)
        # the model of a bfloat16 nn.MultiheadAttention (d = 12, 1.7e-3 off) misfits its answers by 6.6 units
        # from 10 tokens on: the layer's own rounding grows with the length
        check, verification = long_queries.judge(model, estimate, residual, 0.0, design.scale, unit, FIT_LONGEST,
                                                 seed=seed, rounding=VERIFY_ROUNDING_UNITS * unit)
        checks.append(check)
    return LowPrecisionExtraction(
        model=model, heads=0 if model is None else model.heads, d=d, seed=seed, schedule="saturated",
        verification_queries=0 if verification is None else verification.queries,
        verification_length=0 if verification is None else verification.lengths[1],
        queries=boundary.queries + boundary.replayed,
        queries_asked=boundary.queries, queries_replayed=boundary.replayed,
        max_query_length=boundary.max_query_length, answer_dtype=answer_dtype,
        token_scale=float(start.scale) if start is not None else float("nan"), error_estimate=float(estimate),
        answers_residual=float(residual), seconds=time.perf_counter() - started, checks=checks,
        verification=verification, start=start, fit=fit)
