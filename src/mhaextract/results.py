"""The result of an extraction, the same for every schedule, and its files on disk.

:class:`Extraction` has common fields of one meaning whatever the schedule (the heads, the
measured counts, the promised count of *that* schedule, the token scale, the checks, the error
estimate) and a schedule-specific ``details`` object that documents and serialises itself.

:func:`save_extraction` writes ``result.json`` and ``result.npz`` side by side:

* JSON: ``format``; ``summary`` (:meth:`Extraction.summary`: d, H0, H*, schedule, token scale,
  measured queries asked and replayed, error estimate, residual, certificate, the details'
  scalars); ``checks`` (every self-check with value and threshold); ``model``: the canonical heads
  ``W`` (H*, d, d) and ``v`` (H*, d) as float64 numbers (JSON floats round-trip exactly); in high
  precision also ``model_exact``, the ball midpoints as exact ``[-]0x<hex mantissa>p<exponent>``
  strings, and the ball radii.
* npz: ``W``, ``v`` (float64), the radii (high precision) and the details' per-instance arrays
  (``instances_<name>``).

:func:`load_model` reads the JSON back into a :class:`~mhaextract.MultiHeadAttention`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checks.base import Check, CheckedResult
from .checks.certificate import Certificate
from .checks.refine import Refinement
from .model import MultiHeadAttention
from .numerics.enclosure import exact_model
from .numerics.highprec import mpf_from_hex, mpf_to_hex, radius_float
from .schedules.base import ScheduleDetails


@dataclass
class Extraction(CheckedResult):
    """Result of :func:`mhaextract.extract`, whatever the schedule.

    Attributes
    ----------
    model : MultiHeadAttention or None
        The canonical heads in float64; None only when the parameters came out non-finite (a
        failed check says so).
    heads : int
        Canonical head count H* found.
    queries : int
        Answers the extraction used, each answered by the oracle exactly once: ``queries_asked``
        (measured at the oracle boundary in this run) plus ``queries_replayed`` (read back from the
        transcript, recorded by an earlier run's boundary).
    queries_asked, queries_replayed : int
    max_query_length : int
        Longest query whose answer was used (measured at the boundary, or read back).
    promised_queries, promised_max_length : int
        The schedule's own formula, for comparison (paper: ``4 H0 d^2 - 2 H0 + 1`` and
        ``2 H0 + 1``; lean: its count without fallback links; targeted: its stages after the
        adaptive phase 1). Measured counts are ``queries`` and ``max_query_length``.
    promised_formula : the schedule's count formula in words.
    d, max_heads : token dimension and H0 (the declared H or the bound).
    precision : bits of the high-precision path, None for float64.
    seed : the seed of the queries.
    schedule : the schedule's registry name.
    token_scale : the norm of the query tokens the run used (``verify`` draws at this scale).
    error_estimate : float
        Max relative parameter error expected, in the sense of ``compare(...).max_rel`` (each of W,
        v, u and c relative to its own largest entry; u and c absolute where they are not resolved
        from zero): in high precision the largest relative ball radius (a proven bound when
        ``certified``), in float64 a first-order estimate (or, with a certificate and declared or
        refined noise, the certificate's bound).
    answers_residual : float
        Max relative misfit of the extracted model on the queries asked.
    checks : list of Check
    details : ScheduleDetails
        Schedule-specific diagnostics (:class:`~mhaextract.schedules.grid.GridDetails` for paper
        and lean, :class:`~mhaextract.schedules.targeted.TargetedDetails` for targeted).
    W_balls, v_balls : object arrays of flint ``arb`` (high precision only), shapes (H*, d, d), (H*, d).
    u_balls, c_ball : the score biases (H*, d) and the output constant as balls (high-precision runs
        that learned biases, ``bias=True``: the biased grid, docs/algorithm.md §16); None otherwise.
        Certified like ``W_balls``: they come from the same certified instances through ball
        arithmetic (``certified`` covers them, and ``balls_reproduce_answers`` evaluates them).
    calibration_queries : int
        Queries spent choosing the token scale (``token_scale="auto"``, docs/algorithm.md §18);
        included in ``queries``. 0 when the scale was given.
    calibration : the calibration's report (:class:`~mhaextract.calibration.Calibration`) or None.
    bias : whether the run learned score biases and the output constant (docs/algorithm.md §16).
    schedule_reason : why this schedule ran (``schedule="auto"`` says what it chose and why).
    answer_dtype : the dtype the oracle answered in (``"float64"``, ``"float32"`` for a float32
        layer, ``"mpf"`` in high precision), from the oracle's ``answer_dtype`` when it has one.
    certificate : Certificate or None
        The first-order error certificate (docs/algorithm.md §12) where the schedule has one
        (float64 paper runs), behind ``amplification``, ``error_bound(eps)`` and ``valid_below``.
    refinement : Refinement or None
        With ``refine=True``: which model was kept, the misfits before and after, the queries added.
    verification : Verification or None
        Attached by :meth:`with_verification` (fresh queries, see :func:`mhaextract.verify`).
    answer_error : float or None
        The bound on the answers' absolute error the run was told (None: not told).
    transcript : path of the run's transcript, or None.
    seconds : float
    """

    model: MultiHeadAttention | None
    heads: int
    queries: int
    max_query_length: int
    promised_queries: int
    promised_max_length: int
    promised_formula: str
    d: int
    max_heads: int
    precision: int | None
    seed: object
    schedule: str
    token_scale: float
    error_estimate: float
    answers_residual: float
    details: ScheduleDetails
    checks: list[Check] = field(default_factory=list)
    W_balls: np.ndarray | None = None
    v_balls: np.ndarray | None = None
    u_balls: np.ndarray | None = None
    c_ball: object = None
    calibration_queries: int = 0
    calibration: object = None
    schedule_reason: str = ""
    answer_dtype: str = "float64"
    bias: bool = False
    seconds: float = 0.0
    queries_asked: int = 0
    queries_replayed: int = 0
    transcript: str | None = None
    certificate: Certificate | None = None
    refinement: Refinement | None = None
    verification: object = None
    answer_error: float | None = None

    def _certificate(self) -> Certificate:
        if self.certificate is None:
            raise ValueError(f"no first-order certificate: schedule={self.schedule!r} at precision={self.precision} "
                             "has none (float64 runs of the paper schedule carry one; high-precision runs carry "
                             "certified balls, W_balls and v_balls, instead)")
        return self.certificate

    @property
    def amplification(self) -> float:
        """C: worst-case relative parameter error per unit absolute answer error, first order."""
        return self._certificate().amplification

    @property
    def valid_below(self) -> float:
        """The answer-error bound below which the matching is certified and first order holds."""
        return self._certificate().valid_below

    def error_bound(self, eps: float) -> float:
        """Bound on ``compare(model, truth).max_rel`` if every answer is within ``eps`` of the
        truth (inf when ``eps >= valid_below``); see :class:`mhaextract.checks.certificate.Certificate`."""
        return self._certificate().error_bound(eps)

    def with_verification(self, verification) -> "Extraction":
        """A copy of this result carrying ``verification`` (from :func:`mhaextract.verify`)."""
        return dataclasses.replace(self, verification=verification)

    @property
    def verified(self) -> bool:
        """True when a verification is attached and it passed."""
        return self.verification is not None and bool(self.verification.passed)

    @property
    def certified(self) -> bool:
        """High precision: every instance's balls were proven (Krawczyk) to enclose its exact
        parameters, given answers within one ulp; the assembled balls then enclose the truth.
        Not claimed when the balls fail to reproduce the answers (``balls_reproduce_answers``:
        heads merged below the answers' resolution). False in high precision: ``error_estimate`` rests
        partly on first-order radii, judged against ``max(2^-53, 2^(-precision/4))`` (docs/algorithm.md §7)."""
        disproved = any(check.name == "balls_reproduce_answers" and not check.passed for check in self.checks)
        return self.precision is not None and self.details.certified and not disproved

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

    def summary(self) -> dict:
        return {
            "d": self.d, "max_heads": self.max_heads, "heads": self.heads, "queries": self.queries,
            "queries_asked": self.queries_asked, "queries_replayed": self.queries_replayed,
            "transcript": self.transcript,
            "promised_queries": self.promised_queries, "promised_formula": self.promised_formula,
            "max_query_length": self.max_query_length,
            "promised_max_length": self.promised_max_length, "precision": self.precision,
            "schedule": self.schedule, "schedule_reason": self.schedule_reason, "token_scale": self.token_scale,
            "calibration_queries": self.calibration_queries, "bias": self.bias, "answer_dtype": self.answer_dtype, "seed": self.seed,
            "error_estimate": self.error_estimate, "answers_residual": self.answers_residual,
            "certified": self.certified, "ok": self.ok,
            "failed_checks": [str(check) for check in self.failed_checks], "seconds": self.seconds,
            "answer_error": self.answer_error,
            "valid_below": None if self.certificate is None else self.certificate.valid_below,
            "noise_estimate": None if self.certificate is None else self.certificate.noise_estimate,
            "certificate_method": None if self.certificate is None else self.certificate.method,
            "refinement": None if self.refinement is None else str(self.refinement),
            "verification": None if self.verification is None else str(self.verification),
            **self.details.summary(),
        }


FORMAT = "mhaextract.extraction/1"


def _jsonable(value):
    """Plain JSON: numpy scalars as Python numbers, non-finite floats as the strings 'inf'/'nan'."""
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, str):
        return value
    return str(value)


def save_extraction(extraction: Extraction, path) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and the same name with ``.npz`` (arrays). Returns both paths."""
    if not isinstance(extraction, Extraction):
        raise TypeError(f"save_extraction expects an Extraction, got {type(extraction).__name__}")
    json_path = Path(path)
    if json_path.suffix != ".json":
        raise ValueError(f"the result path must end in .json, got {str(json_path)!r}")
    npz_path = json_path.with_suffix(".npz")
    document = {
        "format": FORMAT,
        "summary": extraction.summary(),
        "checks": [check.as_dict() for check in extraction.checks],
        "model": None,
        "arrays": npz_path.name,
    }
    arrays = {}
    if extraction.model is not None:
        model = extraction.model
        document["model"] = {"d": model.d, "heads": model.heads, "W": model.W.tolist(), "v": model.v.tolist(),
                             "u": model.u.tolist(), "c": model.c}
        arrays.update(W=model.W, v=model.v, u=model.u, c=np.array(model.c))
    if extraction.W_balls is not None:
        exact = extraction.model_hp
        to_hex = np.vectorize(mpf_to_hex, otypes=[object])
        W_radius, v_radius = radius_float(extraction.W_balls), radius_float(extraction.v_balls)
        document["model_exact"] = {
            "W": to_hex(exact.W).tolist(), "v": to_hex(exact.v).tolist(),
            "u": to_hex(exact.u).tolist(), "c": mpf_to_hex(exact.c),
            "W_radius": W_radius.tolist(), "v_radius": v_radius.tolist(),
        }
        arrays.update(W_radius=W_radius, v_radius=v_radius)
        if extraction.u_balls is not None:
            u_radius, c_radius = radius_float(extraction.u_balls), float(radius_float([extraction.c_ball])[0])
            document["model_exact"].update(u_radius=u_radius.tolist(), c_radius=c_radius)
            arrays.update(u_radius=u_radius, c_radius=np.array(c_radius))
    arrays.update(extraction.details.arrays())
    json_path.write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False))
    np.savez_compressed(npz_path, **arrays)
    return json_path, npz_path


def load_model(path, exact: bool = False) -> MultiHeadAttention:
    """The canonical heads saved by :func:`save_extraction` (or ``mhaextract extract --out``).

    ``exact=False`` gives the float64 model; ``exact=True`` the high-precision ball midpoints as
    exact ``mpmath.mpf`` (only for a high-precision extraction).
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{str(path)!r} is not a mhaextract extraction (format {found!r}, expected {FORMAT!r})")
    if exact:
        if "model_exact" not in document:
            raise ValueError(f"{str(path)!r} is a float64 extraction: it has no exact (high-precision) model")
        part = document["model_exact"]
        from_hex = np.vectorize(mpf_from_hex, otypes=[object])
        W, v = from_hex(np.array(part["W"], dtype=object)), from_hex(np.array(part["v"], dtype=object))
    else:
        if document.get("model") is None:
            raise ValueError(f"{str(path)!r} holds no model: the extraction produced non-finite parameters")
        W, v = np.array(document["model"]["W"], dtype=np.float64), np.array(document["model"]["v"], dtype=np.float64)
    d = document["summary"]["d"]
    # A run with no canonical head stores empty lists; give them their shapes. Files written before
    # biases existed (docs/algorithm.md §16) have no "u" and "c": zero.
    part = document["model_exact"] if exact else document["model"]
    u, c = part.get("u"), part.get("c", 0.0)
    if u is not None:
        u = (from_hex(np.array(u, dtype=object)) if exact else np.array(u, dtype=np.float64)).reshape(-1, d)
    c = mpf_from_hex(c) if exact and isinstance(c, str) else c
    return MultiHeadAttention(W.reshape(-1, d, d), v.reshape(-1, d), u, c)
