"""What every family's result shares, and its files on disk.

:class:`Result` holds the fields of one meaning for every family (the model, the measured counts,
the token scale, the error estimate, the checks, the verification, the schedule that ran); each
family's result (:class:`~mhaextract.Extraction`, :class:`~mhaextract.RotaryExtraction`,
:class:`~mhaextract.LowPrecisionExtraction`, :class:`~mhaextract.VectorExtraction`,
:class:`~mhaextract.TransformerExtraction`) is a subclass adding its own.

:meth:`Result.save` (:func:`save_extraction`) writes ``result.json`` and ``result.npz`` side by side:

* JSON: ``format``; ``result`` (the result's class); ``summary`` (:meth:`Result.summary`: the
  common scalars, then the family's); ``checks`` (every self-check with value and threshold);
  ``verification`` and ``causal`` (their fields, or None); ``model``: the model's own part
  (``model.to_document``, :mod:`mhaextract.models.kinds`: its ``kind``, sizes and float64
  parameters; JSON floats round-trip exactly); ``model_exact`` where the run has exact parameters
  (every bit as ``[-]0x<hex mantissa>p<exponent>`` strings; a high-precision attention result adds
  its balls' radii).
* npz: the model's float64 arrays and the family's (the radii, per-instance diagnostics).

:func:`load_model` reads the model back through the registry of model kinds (a part without
``kind``, as format 1 wrote for attention, is attention); :func:`load_extraction` reads the whole
result back as a :class:`SavedResult`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..checks.base import Check, CheckedResult
from ..checks.causality import CausalRecord
from ..checks.verify import Verification
from ..models.kinds import model_from_document

#: The file format written; every one of :data:`READABLE_FORMATS` is read.
FORMAT = "mhaextract.extraction/2"
READABLE_FORMATS = ("mhaextract.extraction/1", FORMAT)


@dataclass(kw_only=True)
class Result(CheckedResult):
    """What every extraction returns, whatever the family: one meaning per field.

    Attributes
    ----------
    model : the model learned (:class:`~mhaextract.MultiHeadAttention`,
        :class:`~mhaextract.RotaryAttention` or :class:`~mhaextract.Transformer1L`), or None when
        none came out (a failed check says why).
    d : int
        Token dimension of the queries.
    heads : int
        Heads in the model (canonical heads found; 0 without a model).
    queries : int
        Answers the run used, each answered once: ``queries_asked`` (measured at the oracle
        boundary in this run) plus ``queries_replayed`` (read back from the transcript, recorded
        by an earlier run's boundary). Every count below is included in it.
    queries_asked, queries_replayed : int
    max_query_length : int
        Longest query whose answer was used, the verification's included.
    calibration_queries : int
        Queries spent choosing the token scale (docs/algorithm.md, 'Choosing the token scale from
        queries'); 0 when the scale was given or the family chooses it otherwise.
    verification_queries : int
        Fresh queries the run checked its model on (the default verification, or the family's
        own: the Transformer's); 0 when none ran.
    verification_length : int
        The longest of them, in tokens (0 when none).
    token_scale : float
        The norm of the query tokens the run used (:func:`mhaextract.verify` draws at this scale).
    error_estimate : float
        The relative error of the model the run expects, in the sense its family's docstring gives
        (parameters as ``compare(model, truth).max_rel`` for attention, rotary and low precision;
        outputs for the vector split and the norm family); ``inf`` when the family makes no estimate
        (the Transformer, judged on fresh queries instead).
    error_measure : str
        What ``error_estimate`` bounds: ``"parameters"`` (``compare(model, truth).max_rel``) or
        ``"outputs"`` (the largest output error at every position of fresh sequences, relative to
        each prefix's largest output), so a judge compares it with the matching error.
    answers_residual : float
        Misfit of the model on the queries asked, relative to the answers (``inf``: not measured).
    checks : list of Check
        Every self-check; ``ok`` says all passed, ``failed_checks`` lists the others.
    verification : :class:`~mhaextract.Verification` or None
        The run's default verification on fresh queries, or one attached with
        :meth:`with_verification`; ``verified`` says it ran and passed.
    schedule : str
        The registry name of what ran: ``"targeted"``, ``"paper"``, ``"lean"``, ``"lowrank"``,
        ``"saturated"``, ``"vector"``, ``"rotary"`` or ``"transformer"``.
    schedule_reason : str
        Why it ran (``schedule="auto"`` says what it chose and why; "" when named).
    precision : int or None
        Bits of a high-precision run; None for float64.
    seed : the seed of the queries.
    answer_dtype : str
        What the oracle answered in: ``"float64"``, ``"float32"``, ``"bfloat16"``, ``"float16"``
        or ``"mpf"``.
    transcript : str or None
        Path of the run's transcript.
    causal : :class:`~mhaextract.checks.causality.CausalRecord` or None
        Whether the layer is causal, from its outputs at earlier positions (an oracle that shows
        them); ``to_torch(result)`` follows it.
    readout : (d_out,) float64 array or None
        For an oracle answering vectors that the run read through one direction: the unit
        read-out ``r`` of the scalar answers ``r^T f``; None otherwise.
    seconds : float
        Wall time of the run.

    Methods
    -------
    summary() : dict
        The common scalars above, then the family's (``_summary_extra``), JSON-ready.
    save(path) : write ``path`` (JSON) and ``.npz`` beside it; ``load(path)`` reads them back.
    with_verification(verification) : a copy carrying a :func:`mhaextract.verify` result.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=1, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=3, heads=1, seed=1, schedule="paper")
    >>> isinstance(result, mx.Result), result.schedule, result.ok
    (True, 'paper', True)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "result.json"
    >>> _ = result.save(path)
    >>> loaded = mx.Result.load(path)
    >>> loaded.result_type, loaded.queries == result.queries, loaded.summary() == result.summary()
    ('Extraction', True, True)
    """

    model: object = None
    d: int = 0
    heads: int = 0
    queries: int = 0
    queries_asked: int = 0
    queries_replayed: int = 0
    max_query_length: int = 0
    calibration_queries: int = 0
    verification_queries: int = 0
    verification_length: int = 0
    token_scale: float = math.nan
    error_estimate: float = math.inf
    answers_residual: float = math.inf
    checks: list[Check] = field(default_factory=list)
    verification: Verification | None = None
    schedule: str = ""
    schedule_reason: str = ""
    precision: int | None = None
    seed: object = None
    answer_dtype: str = "float64"
    transcript: str | None = None
    causal: CausalRecord | None = None
    readout: np.ndarray | None = None
    seconds: float = 0.0

    #: Family fields shown in ``repr`` after the counts (one or two).
    _repr_fields: ClassVar[tuple[str, ...]] = ()
    error_measure: ClassVar[str] = "parameters"

    @property
    def result_type(self) -> str:
        """The name of the result's class (what a saved file records)."""
        return type(self).__name__

    @property
    def verified(self) -> bool:
        """True when a verification ran (the run's default one, or one attached) and it passed."""
        return self.verification is not None and bool(self.verification.passed)

    def with_verification(self, verification) -> "Result":
        """A copy of this result carrying ``verification`` (from :func:`mhaextract.verify`)."""
        return dataclasses.replace(self, verification=verification)

    def __repr__(self) -> str:
        extra = "".join(f", {name}={value!r}" for name, value in self._repr_items())
        return (f"{self.result_type}(schedule={self.schedule!r}, heads={self.heads}, d={self.d}, "
                f"queries={self.queries}{extra}, ok={self.ok}, error_estimate={self.error_estimate:.3g})")

    def _repr_items(self) -> list[tuple[str, object]]:
        return [(name, getattr(self, name)) for name in self._repr_fields]

    def summary(self) -> dict:
        """The common scalars (the attributes above; ``verification`` and ``causal`` as text), then
        the family's own (``_summary_extra``), as one JSON-ready dict."""
        common = {
            "schedule": self.schedule, "schedule_reason": self.schedule_reason, "d": self.d, "heads": self.heads,
            "queries": self.queries, "queries_asked": self.queries_asked, "queries_replayed": self.queries_replayed,
            "calibration_queries": self.calibration_queries, "verification_queries": self.verification_queries,
            "verification_length": self.verification_length, "max_query_length": self.max_query_length,
            "token_scale": self.token_scale, "precision": self.precision, "seed": self.seed,
            "answer_dtype": self.answer_dtype, "error_estimate": self.error_estimate,
            "error_measure": self.error_measure, "answers_residual": self.answers_residual, "ok": self.ok,
            "failed_checks": [str(check) for check in self.failed_checks],
            "verification": None if self.verification is None else str(self.verification),
            "transcript": self.transcript, "causal": None if self.causal is None else self.causal.verdict,
            "seconds": self.seconds,
        }
        return common | self._summary_extra()

    def _summary_extra(self) -> dict:
        """The family's scalars for :meth:`summary` (none here)."""
        return {}

    def report_rows(self, comparison=None) -> list[tuple[str, str, str]]:
        """Rows ``(quantity, value, note)`` the family adds to the report table
        (:func:`mhaextract.tools.report.extraction_table`; ``comparison``: against the truth, or
        None): here the entries of its summary."""
        return [(name.replace("_", " "), f"{value:.3g}" if isinstance(value, float) else str(value), "")
                for name, value in self._summary_extra().items()]

    def _saved_extra(self) -> tuple[dict | None, dict]:
        """What :meth:`save` writes beside the model: ``(model_exact, arrays)``, the exact model's
        part (here: the model's own, when its parameters are ``mpf``) and the family's arrays."""
        if self.model is not None and getattr(self.model, "is_high_precision", False):
            return self.model.to_document(exact=True)[0], {}
        return None, {}

    def save(self, path) -> tuple[Path, Path]:
        """Write ``path`` (JSON, module docstring) and the same name with ``.npz``. Returns both."""
        json_path = Path(path)
        if json_path.suffix != ".json":
            raise ValueError(f"the result path must end in .json, got {str(json_path)!r}")
        npz_path = json_path.with_suffix(".npz")
        model_part, arrays = (None, {}) if self.model is None else self.model.to_document(exact=False)
        exact_part, extra_arrays = self._saved_extra()
        document = {
            "format": FORMAT, "result": self.result_type, "summary": self.summary(),
            "checks": [check.as_dict() for check in self.checks],
            "verification": None if self.verification is None else dataclasses.asdict(self.verification),
            "causal": None if self.causal is None else dataclasses.asdict(self.causal),
            "model": model_part, "arrays": npz_path.name, "repr_fields": [name for name, _ in self._repr_items()],
        }
        if exact_part is not None:
            document["model_exact"] = exact_part
        json_path.write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False))
        np.savez_compressed(npz_path, **arrays, **extra_arrays)
        return json_path, npz_path

    @classmethod
    def load(cls, path, exact: bool = False) -> "SavedResult":
        """The result saved at ``path`` (:func:`load_extraction`)."""
        return load_extraction(path, exact)


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class SavedResult(Result):
    """A result read back from its files (:func:`load_extraction`): the common fields, the model,
    the checks, the verification and the causal record as they were saved; the family's scalars in
    ``family_summary`` (what its ``summary()`` added), so ``summary()`` is the saved one.

    Attributes
    ----------
    saved_as : the class of the result that was saved (``result_type`` reports it).
    error_measure : that class's ``error_measure``, as saved.
    family_summary : dict, the family's entries of the saved summary.
    repr_fields : the family's entries its one-line repr showed (shown again).
    model_exact : the exact model (``load_extraction(path, exact=True)`` of a file that has one), or None.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=1, hidden=4, seed=0)
    >>> result = mx.extract_transformer(mx.SimulatedOracle(T), d=3, heads=1, hidden=4, seed=1)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "transformer.json"
    >>> _ = result.save(path)
    >>> loaded = mx.load_extraction(path)
    >>> loaded.result_type, loaded.schedule, loaded.model, loaded.family_summary["hidden"]
    ('TransformerExtraction', 'transformer', Transformer1L(d=3, heads=1, hidden=4, p=3, float64), 4)
    """

    saved_as: str = "Result"
    error_measure: str = "parameters"
    family_summary: dict = field(default_factory=dict)
    model_exact: object = None
    repr_fields: tuple[str, ...] = ()

    def _repr_items(self) -> list[tuple[str, object]]:
        return [(name, self.family_summary.get(name)) for name in self.repr_fields]

    @property
    def result_type(self) -> str:
        return self.saved_as

    def _summary_extra(self) -> dict:
        return dict(self.family_summary)

    def _saved_extra(self) -> tuple[dict | None, dict]:
        if self.model_exact is not None:
            return self.model_exact.to_document(exact=True)[0], {}
        return super()._saved_extra()


#: The fields of :class:`Result` that the summary holds as they are (``verification``, ``causal``
#: and ``checks`` are saved whole beside it).
COMMON_SCALARS = ("schedule", "schedule_reason", "d", "heads", "queries", "queries_asked", "queries_replayed",
                  "calibration_queries", "verification_queries", "verification_length", "max_query_length",
                  "token_scale", "precision", "seed", "answer_dtype", "error_estimate", "answers_residual",
                  "transcript", "seconds")
#: Summary entries every result computes from its fields or its class (not read back as common fields).
DERIVED = ("ok", "failed_checks", "verification", "causal", "error_measure")


def _jsonable(value):
    """Plain JSON: numpy scalars as Python numbers, non-finite floats as the strings 'inf'/'nan'."""
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
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


def _number(value):
    """A saved float (non-finite ones were written as 'inf', '-inf' or 'nan'); any other value as it
    is (a causal record's verdict is a word)."""
    return float(value) if isinstance(value, str) and value in ("inf", "-inf", "nan") else value


def save_extraction(extraction: Result, path) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and the same name with ``.npz`` (arrays): ``extraction.save(path)``,
    for the result of any family. Returns both paths.

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
    if not isinstance(extraction, Result):
        raise TypeError(f"save_extraction expects the result of an extraction (a mhaextract.Result), got "
                        f"{type(extraction).__name__}")
    return extraction.save(path)


def _read_document(path) -> dict:
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") not in READABLE_FORMATS:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{str(path)!r} is not a mhaextract extraction (format {found!r}, expected one of "
                         f"{', '.join(repr(name) for name in READABLE_FORMATS)})")
    return document


def _model(document: dict, path, exact: bool):
    part = document.get("model")
    if part is None:
        raise ValueError(f"{str(path)!r} holds no model: the extraction produced none (its failed checks say why)")
    if not exact:
        return model_from_document(part, exact=False)
    if "model_exact" not in document:
        raise ValueError(f"{str(path)!r} is a float64 extraction: it has no exact (high-precision) model")
    exact_part = document["model_exact"]
    if "kind" not in exact_part:  # format 1 wrote the exact numbers alone: the float64 part has the sizes
        exact_part = {**part, **exact_part}
    return model_from_document(exact_part, exact=True)


def load_model(path, exact: bool = False):
    """The model saved by :func:`save_extraction` (or ``mhaextract extract --out``), of whatever
    kind the file names (:class:`~mhaextract.MultiHeadAttention`, :class:`~mhaextract.RotaryAttention`,
    :class:`~mhaextract.Transformer1L`).

    ``exact=False`` gives the float64 model; ``exact=True`` the exact ``mpmath.mpf`` parameters
    (only for a high-precision extraction: the attention family's ball midpoints).

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
    return _model(_read_document(path), path, exact)


def load_extraction(path, exact: bool = False) -> SavedResult:
    """The result saved by :func:`save_extraction`, of any family, as a :class:`SavedResult`: the
    common fields of :class:`Result`, the model (``exact=True``: also ``model_exact``), the checks,
    the verification and the causal record; ``summary()`` gives the saved summary back.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import mhaextract as mx
    >>> layer = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(layer), d=4, heads=1, positions="rotary", seed=1)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "rotary.json"
    >>> _ = mx.save_extraction(result, path)
    >>> loaded = mx.load_extraction(path)
    >>> loaded
    RotaryExtraction(schedule='rotary', heads=1, d=4, queries=..., ok=True, error_estimate=...)
    >>> loaded.summary() == result.summary(), type(loaded.model).__name__
    (True, 'RotaryAttention')
    """
    document = _read_document(path)
    summary = document.get("summary") or {}
    common = {name: summary[name] for name in COMMON_SCALARS if name in summary}
    for name in ("token_scale", "error_estimate", "answers_residual", "seconds"):
        if name in common:
            common[name] = _number(common[name])
    checks = [Check(entry["name"], bool(entry["passed"]), _number(entry["value"]), _number(entry["threshold"]),
                  entry["message"]) for entry in document.get("checks", [])]
    verification = document.get("verification")
    if verification is not None:
        verification = Verification(**{**verification, "lengths": tuple(verification["lengths"]),
                                       "scales": tuple(verification["scales"]),
                                       "max_relative_error": _number(verification["max_relative_error"]),
                                       "mean_relative_error": _number(verification["mean_relative_error"]),
                                       "tolerance": _number(verification["tolerance"])})
    causal = document.get("causal")
    if causal is not None:
        causal = CausalRecord(**{name: _number(value) for name, value in causal.items()})
    model = None if document.get("model") is None else _model(document, path, False)
    family = {name: value for name, value in summary.items() if name not in COMMON_SCALARS + DERIVED}
    return SavedResult(model=model, checks=checks, verification=verification, causal=causal,
                       saved_as=document.get("result") or "Result", family_summary=family,
                       error_measure=summary.get("error_measure", "parameters"),
                       repr_fields=tuple(document.get("repr_fields", ())),
                       model_exact=_model(document, path, True) if exact else None, **common)
