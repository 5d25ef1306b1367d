"""An extraction on disk: JSON for people and programs, ``.npz`` for arrays, and the model back.

:func:`save_extraction` writes ``result.json`` and ``result.npz`` side by side:

* JSON: ``format``; ``summary`` (:meth:`Extraction.summary`: d, H0, H*, measured queries asked and
  replayed, error estimate, residual, certificate...); ``checks`` (every self-check with value
  and threshold); ``model``: the canonical heads ``W`` (H*, d, d) and ``v`` (H*, d) as float64
  numbers (JSON floats round-trip exactly); in high precision also ``model_exact``, the ball
  midpoints as exact ``[-]0x<hex mantissa>p<exponent>`` strings, and the ball radii.
* npz: ``W``, ``v`` (float64), the radii (high precision) and the per-instance diagnostics
  (``instances_<name>``, see :class:`mhaextract.learner.InstanceDiagnostics`).

:func:`load_model` reads the JSON back into a :class:`~mhaextract.MultiHeadAttention`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .highprec import mpf_from_hex, mpf_to_hex, radius_float
from .learner import Extraction
from .model import MultiHeadAttention

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
        "checks": [
            {"name": c.name, "passed": c.passed, "value": c.value, "threshold": c.threshold, "message": c.message}
            for c in extraction.checks
        ],
        "model": None,
        "arrays": npz_path.name,
    }
    arrays = {}
    if extraction.model is not None:
        model = extraction.model
        document["model"] = {"d": model.d, "heads": model.heads, "W": model.W.tolist(), "v": model.v.tolist()}
        arrays.update(W=model.W, v=model.v)
    if extraction.W_balls is not None:
        exact = extraction.model_hp
        to_hex = np.vectorize(mpf_to_hex, otypes=[object])
        W_radius, v_radius = radius_float(extraction.W_balls), radius_float(extraction.v_balls)
        document["model_exact"] = {
            "W": to_hex(exact.W).tolist(), "v": to_hex(exact.v).tolist(),
            "W_radius": W_radius.tolist(), "v_radius": v_radius.tolist(),
        }
        arrays.update(W_radius=W_radius, v_radius=v_radius)
    for name, values in vars(extraction.instances).items():
        arrays[f"instances_{name}"] = np.asarray(values, dtype=str if name == "role" else None)
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
    # A run with no canonical head stores empty lists; give them their shapes.
    return MultiHeadAttention(W.reshape(-1, d, d), v.reshape(-1, d))
