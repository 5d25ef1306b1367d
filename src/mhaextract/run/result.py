"""The result of an extraction, the same for every schedule, and its files on disk.

:class:`Extraction` has common fields of one meaning whatever the schedule (the heads, the
measured counts, the promised count of *that* schedule, the token scale, the checks, the error
estimate) and a schedule-specific ``details`` object that documents and serialises itself.

:func:`save_extraction` writes ``result.json`` and ``result.npz`` side by side:

* JSON: ``format``; ``summary`` (:meth:`Extraction.summary`: d, H0, H*, schedule, token scale,
  measured queries asked and replayed, error estimate, residual, certificate, the details'
  scalars); ``checks`` (every self-check with value and threshold); ``model``: the canonical heads
  ``W`` (H*, d, d), ``v`` (H*, d) (``V`` (H*, d_out, d) for a vector model), ``u`` and ``c`` as float64 numbers (JSON floats round-trip exactly); in high
  precision also ``model_exact``, the ball midpoints as exact ``[-]0x<hex mantissa>p<exponent>``
  strings, and the ball radii.
* npz: ``W``, ``v`` (float64), the radii (high precision) and the details' per-instance arrays
  (``instances_<name>``).

:func:`load_model` reads the JSON back into a :class:`~mhaextract.MultiHeadAttention` (a
:class:`~mhaextract.RotaryAttention` for a rotary result, whose JSON holds its factors).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checks.base import Check, CheckedResult
from ..checks.certificate import Certificate
from ..checks.refine import Refinement
from ..models.attention import MultiHeadAttention
from ..models.rotary import RotaryAttention
from ..numerics.enclosure import exact_model
from ..numerics.highprec import mpf_from_hex, mpf_to_hex, radius_float
from ..attention.base import ScheduleDetails


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
        Longest query whose answer was used (measured at the boundary, or read back), the default
        verification's included (``verification_length``).
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
        Schedule-specific diagnostics (:class:`~mhaextract.attention.grid.GridDetails` for paper
        and lean, :class:`~mhaextract.attention.targeted.diagnostics.TargetedDetails` for targeted).
    W_balls, v_balls : object arrays of flint ``arb`` (high precision only), shapes (H*, d, d), (H*, d).
    u_balls, c_ball : the score biases (H*, d) and the output constant as balls (high-precision runs
        that learned biases, ``bias=True``: the biased grid, docs/algorithm.md §16); None otherwise.
        Certified like ``W_balls``: they come from the same certified instances through ball
        arithmetic (``certified`` covers them, and ``balls_reproduce_answers`` evaluates them).
    calibration_queries : int
        Queries spent choosing the token scale (``token_scale="auto"``, docs/algorithm.md §18);
        included in ``queries``. 0 when the scale was given.
    calibration : the calibration's report (:class:`~mhaextract.run.calibration.Calibration`) or None.
    bias : whether the run learned score biases and the output constant (docs/algorithm.md §16).
    schedule_reason : why this schedule ran (``schedule="auto"`` says what it chose and why).
    answer_dtype : the dtype the oracle answered in (``"float64"``, ``"float32"`` for a float32
        layer, ``"mpf"`` in high precision), from the oracle's ``answer_dtype`` when it has one.
    certificate : Certificate or None
        The first-order error certificate (docs/algorithm.md §12) where the schedule has one
        (float64 paper runs), behind ``amplification``, ``error_bound(eps)`` and ``valid_below``
        (each None when this is None).
    refinement : Refinement or None
        With ``refine=True``: which model was kept, the misfits before and after, the queries added.
    verification : Verification or None
        The run's default verification on fresh long queries (``extract(..., verify_length=...)``,
        the ``long_verification`` check, docs/algorithm.md §12), or the one attached by
        :meth:`with_verification` (:func:`mhaextract.verify`); None when neither ran.
    verification_queries : int
        Fresh queries of the default verification, measured at the oracle boundary and included
        in ``queries`` (0 when it did not run: ``verify_length=0``, ``schedule="paper"`` named
        alone, or no model).
    verification_length : int
        The longest of them, in tokens (included in ``max_query_length``; 0 when none).
    model_class_queries : int
        Probes of the model class's invariants (order of the earlier tokens, scale of a lone token:
        :mod:`mhaextract.checks.model_class`) asked after a failed float64 run to name its cause;
        included in ``queries`` (0 for a run that passed, or that keeps its schedule's exact count).
    answer_error : float or None
        The bound on the answers' absolute error the run was told (None: not told).
    transcript : path of the run's transcript, or None.
    seconds : float
    readout : (d_out,) float64 array or None
        For an oracle answering vectors of d_out numbers: the unit read-out ``r`` the schedule
        learned the scores from (``r^T f``); None for scalar answers.
    scalar_model : MultiHeadAttention or None
        For vector answers: the schedule's scalar model of ``r^T f``; ``model`` is then the vector
        model (``V_h`` (d_out, d) and ``c`` (d_out,) fitted to the answers, docs/algorithm.md §21), or
        None where no vector model could be fitted (a failed check says why).
    value_fit : :class:`~mhaextract.run.value_fit.ValueFit` or None
        For vector answers: the fit of ``V_h`` and ``c``, its queries, residual and estimate.
    causal : :class:`~mhaextract.checks.causality.CausalRecord` or None
        Whether the layer is causal, judged from its outputs at earlier positions of queries the
        run asked, for an oracle that shows them (``TorchOracle``); ``to_torch(result)`` follows it.


    Schedule-specific parts are None where the run has none, never an error: ``certificate`` and its
    shortcuts ``amplification``, ``valid_below`` and ``error_bound(eps)`` (float64 paper runs, and
    refined runs), ``W_balls``/``v_balls``, ``model_hp`` and ``radius`` (high precision), ``details``
    (its own class per schedule), ``refinement``, ``verification``, ``calibration``.

    Methods
    -------
    summary() : dict
        Every scalar above in one JSON-ready dict (``save_extraction`` writes it as ``summary``).
    error_bound(eps) : float or None
        The certificate's bound for answers within ``eps`` (None without a certificate).
    with_verification(verification) : a copy carrying a :func:`mhaextract.verify` result.

    ``repr(result)`` (and ``print(result)``) is one line: schedule, heads, d, queries, ok and the
    error estimate; :func:`mhaextract.tools.report` or ``summary()`` gives the rest.

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
    >>> checked = result.with_verification(mx.verify(result, oracle, n=64, seed=0))
    >>> checked.verified
    True
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
    verification_queries: int = 0
    verification_length: int = 0
    model_class_queries: int = 0
    transcript: str | None = None
    certificate: Certificate | None = None
    refinement: Refinement | None = None
    verification: object = None
    answer_error: float | None = None
    readout: np.ndarray | None = None
    scalar_model: MultiHeadAttention | None = None
    value_fit: object = None
    causal: object = None
    #: Whole answers that could not be split by head (docs/algorithm.md, 'Whole answers near the vector
    #: bound'): the queries the split asked before this schedule ran (counted in ``queries``).
    split_queries: int = 0

    @property
    def d_out(self) -> int | None:
        """Outputs per answer for an oracle answering vectors, None for scalar answers."""
        return None if self.readout is None else len(self.readout)

    def __repr__(self) -> str:
        return (f"Extraction(schedule={self.schedule!r}, heads={self.heads}, d={self.d}, queries={self.queries}, "
                f"ok={self.ok}, error_estimate={self.error_estimate:.3g})")

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

    def with_verification(self, verification) -> "Extraction":
        """A copy of this result carrying ``verification`` (from :func:`mhaextract.verify`)."""
        return dataclasses.replace(self, verification=verification)

    @property
    def verified(self) -> bool:
        """True when a verification ran (the run's default one, or one attached) and it passed."""
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
        """The run's scalars as one JSON-ready dict (the attributes above, the certificate's
        ``valid_below``, ``noise_estimate`` and ``method`` or None, and ``details.summary()``)."""
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
            "answer_error": self.answer_error, "d_out": self.d_out,
            "value_fit_rows": None if self.value_fit is None else self.value_fit.rows,
            "valid_below": None if self.certificate is None else self.certificate.valid_below,
            "noise_estimate": None if self.certificate is None else self.certificate.noise_estimate,
            "certificate_method": None if self.certificate is None else self.certificate.method,
            "refinement": None if self.refinement is None else str(self.refinement),
            "verification": None if self.verification is None else str(self.verification),
            "verification_queries": self.verification_queries, "verification_length": self.verification_length,
            "model_class_queries": self.model_class_queries,
            "causal": None if self.causal is None else self.causal.verdict,
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
    """Write ``path`` (JSON) and the same name with ``.npz`` (arrays). Returns both paths.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=1, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=3, heads=1, seed=1, schedule="paper")
    >>> folder = tempfile.mkdtemp()
    >>> json_path, npz_path = mx.save_extraction(result, pathlib.Path(folder) / "result.json")
    >>> json_path.name, npz_path.name
    ('result.json', 'result.npz')
    """
    from ..lowprecision.learn import LowPrecisionExtraction
    from ..rotary.learn import RotaryExtraction  # (the rotary module imports this one's neighbours)

    if not isinstance(extraction, (Extraction, RotaryExtraction, LowPrecisionExtraction)):
        raise TypeError(f"save_extraction expects an Extraction, got {type(extraction).__name__}")
    json_path = Path(path)
    if json_path.suffix != ".json":
        raise ValueError(f"the result path must end in .json, got {str(json_path)!r}")
    npz_path = json_path.with_suffix(".npz")
    if isinstance(extraction, RotaryExtraction):
        return _save_rotary(extraction, json_path, npz_path)
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
        values = {"V": model.V.tolist()} if model.is_vector else {"v": model.v.tolist()}
        document["model"] = {"d": model.d, "heads": model.heads, "W": model.W.tolist(), **values,
                             "u": model.u.tolist(), "c": np.asarray(model.c).tolist()}
        arrays.update(W=model.W, u=model.u, c=np.array(model.c), **({"V": model.V} if model.is_vector else {"v": model.v}))
    if getattr(extraction, "W_balls", None) is not None:
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
    if getattr(extraction, "details", None) is not None:
        arrays.update(extraction.details.arrays())
    json_path.write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False))
    np.savez_compressed(npz_path, **arrays)
    return json_path, npz_path


def _save_rotary(extraction, json_path: Path, npz_path: Path) -> tuple[Path, Path]:
    """A rotary result: the factors ``Q, K, b, theta`` with ``V`` (or ``v``), ``c``, the window and
    the key bias where the model has one."""
    model = extraction.model
    document = {"format": FORMAT, "summary": extraction.summary(),
                "checks": [check.as_dict() for check in extraction.checks], "model": None, "arrays": npz_path.name}
    arrays = {}
    if model is not None:
        exact, model = model, model.to_float64()
        values = {"V": model.V.tolist()} if model.is_vector else {"v": model.v.tolist()}
        document["model"] = {"kind": "rotary", "d": model.d, "heads": model.heads, "Q": model.Q.tolist(),
                             "K": model.K.tolist(), "b": model.b.tolist(), "theta": model.theta.tolist(), **values,
                             "c": np.asarray(model.c).tolist(), "window": model.window,
                             "key_bias": None if model.key_bias is None else model.key_bias.tolist()}
        arrays.update(Q=model.Q, K=model.K, b=model.b, theta=model.theta, c=np.array(model.c),
                      **({"V": model.V} if model.is_vector else {"v": model.v}),
                      **({} if model.key_bias is None else {"key_bias": model.key_bias}))
        if exact.is_high_precision:  # every bit of the mpf parameters, as exact hex floats
            to_hex = np.vectorize(mpf_to_hex, otypes=[object])
            document["model_exact"] = {name: to_hex(np.asarray(getattr(exact, name), dtype=object)).tolist()
                                       for name in ("Q", "K", "b", "theta", "V", "c")
                                       + (() if exact.key_bias is None else ("key_bias",))}
    json_path.write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False))
    np.savez_compressed(npz_path, **arrays)
    return json_path, npz_path


def load_model(path, exact: bool = False) -> MultiHeadAttention | RotaryAttention:
    """The canonical heads saved by :func:`save_extraction` (or ``mhaextract extract --out``).

    ``exact=False`` gives the float64 model; ``exact=True`` the high-precision ball midpoints as
    exact ``mpmath.mpf`` (only for a high-precision extraction).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=1, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(target, precision=128), d=3, heads=1, seed=1,
    ...                     schedule="paper", precision=128)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "result.json"
    >>> _ = mx.save_extraction(result, path)
    >>> model = mx.load_model(path)
    >>> model.heads, bool(np.array_equal(model.W, result.model.W))
    (1, True)
    >>> mx.load_model(path, exact=True).is_high_precision
    True
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{str(path)!r} is not a mhaextract extraction (format {found!r}, expected {FORMAT!r})")
    part = document.get("model") or {}
    if part.get("kind") == "rotary":  # a rotary result (docs/algorithm.md §22)
        if exact:
            if "model_exact" not in document:
                raise ValueError(f"{str(path)!r} is a float64 rotary extraction: it has no exact (high-precision) "
                                 "model")
            from_hex = np.vectorize(mpf_from_hex, otypes=[object])
            numbers = {name: from_hex(np.array(value, dtype=object)) for name, value in document["model_exact"].items()}
            V = numbers["V"] if "V" in part else numbers["V"][:, 0, :]
            c = numbers["c"] if "V" in part else numbers["c"][()]
            return RotaryAttention(numbers["Q"], numbers["K"], numbers["theta"], V, c, part["window"], numbers["b"],
                                   numbers.get("key_bias"))
        values = np.array(part["V"] if "V" in part else part["v"], dtype=np.float64)
        c = np.array(part["c"], dtype=np.float64) if "V" in part else float(part["c"])
        return RotaryAttention(np.array(part["Q"], dtype=np.float64), np.array(part["K"], dtype=np.float64),
                               np.array(part["theta"], dtype=np.float64), values, c, part["window"],
                               np.array(part["b"], dtype=np.float64),
                               None if part.get("key_bias") is None else np.array(part["key_bias"], dtype=np.float64))
    if exact:
        if "model_exact" not in document:
            raise ValueError(f"{str(path)!r} is a float64 extraction: it has no exact (high-precision) model")
        part = document["model_exact"]
        from_hex = np.vectorize(mpf_from_hex, otypes=[object])
        W, v = from_hex(np.array(part["W"], dtype=object)), from_hex(np.array(part["v"], dtype=object))
    else:
        if document.get("model") is None:
            raise ValueError(f"{str(path)!r} holds no model: the extraction produced non-finite parameters")
        W = np.array(document["model"]["W"], dtype=np.float64)
        if "V" in document["model"]:  # the vector model: V (H, d_out, d) and c (d_out,)
            c = np.array(document["model"]["c"], dtype=np.float64)
            V = np.array(document["model"]["V"], dtype=np.float64).reshape(-1, len(c), document["summary"]["d"])
            return MultiHeadAttention(W.reshape(-1, V.shape[2], V.shape[2]), V,
                                      np.array(document["model"]["u"], dtype=np.float64).reshape(-1, V.shape[2]), c)
        v = np.array(document["model"]["v"], dtype=np.float64)
    d = document["summary"]["d"]
    # A run with no canonical head stores empty lists; give them their shapes. Files written before
    # biases existed (docs/algorithm.md §16) have no "u" and "c": zero.
    part = document["model_exact"] if exact else document["model"]
    u, c = part.get("u"), part.get("c", 0.0)
    if u is not None:
        u = (from_hex(np.array(u, dtype=object)) if exact else np.array(u, dtype=np.float64)).reshape(-1, d)
    c = mpf_from_hex(c) if exact and isinstance(c, str) else c
    return MultiHeadAttention(W.reshape(-1, d, d), v.reshape(-1, d), u, c)
