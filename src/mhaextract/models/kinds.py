"""The registry of model kinds: how a saved result names its model, and how it is read back.

Every model class carries a class attribute ``kind`` (its name in a saved file) and the pair

* ``model.to_document(exact)``: ``(json_part, arrays)``, the JSON part holding ``kind``, the sizes
  and every parameter (float64 numbers, or with ``exact=True`` every bit as
  ``[-]0x<hex mantissa>p<exponent>`` strings) and the arrays the ``.npz`` beside it holds;
* ``cls.from_document(json_part, exact)``: the model again.

A model module registers its class with :func:`register_model_kind` when it is imported;
:func:`model_from_document` dispatches on the part's ``kind``, so reading a saved result names no
family. Parts written before kinds existed (attention results) have no ``kind``: they are read as
:data:`UNNAMED_KIND`.

Examples
--------
>>> import numpy as np
>>> import mhaextract as mx
>>> from mhaextract.models.kinds import model_from_document
>>> model = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
>>> part, arrays = model.to_document(exact=False)
>>> part["kind"], sorted(arrays)
('attention', ['W', 'c', 'u', 'v'])
>>> again = model_from_document(part, exact=False)
>>> bool(np.array_equal(again.W, model.W))
True
"""

from __future__ import annotations

import mpmath
import numpy as np

from ..numerics.highprec import mpf_array, mpf_from_hex, mpf_to_hex

#: Model classes by their ``kind``.
MODEL_KINDS: dict[str, type] = {}
#: The kind of a saved part without one (files of format 1 held attention models only).
UNNAMED_KIND = "attention"


def register_model_kind(cls: type) -> type:
    """Class decorator: ``cls`` is read back from parts whose ``kind`` is ``cls.kind``."""
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a class attribute kind (a non-empty string) to be registered")
    if MODEL_KINDS.get(kind, cls) is not cls:
        raise ValueError(f"model kind {kind!r} is registered already, by {MODEL_KINDS[kind].__name__}")
    MODEL_KINDS[kind] = cls
    return cls


def model_from_document(part: dict, exact: bool = False):
    """The model a saved part describes (``exact``: its exact ``mpf`` parameters)."""
    kind = part.get("kind", UNNAMED_KIND)
    if kind not in MODEL_KINDS:
        raise ValueError(f"the saved model is of kind {kind!r}, which this mhaextract does not know (known: "
                         f"{', '.join(sorted(MODEL_KINDS))}); read it with the mhaextract version that wrote it")
    return MODEL_KINDS[kind].from_document(part, exact)


def document_numbers(array, exact: bool):
    """An array as JSON: nested lists of float64 numbers, or with ``exact`` of exact hex strings
    (float64 entries are exact in mpf, so they keep every bit too)."""
    if not exact:
        return np.asarray(array, dtype=np.float64).tolist()
    numbers = mpf_array(np.asarray(array, dtype=object))
    return np.vectorize(mpf_to_hex, otypes=[object])(numbers).tolist() if numbers.ndim else mpf_to_hex(numbers[()])


def read_numbers(value, exact: bool) -> np.ndarray:
    """Inverse of :func:`document_numbers`: a float64 array, or with ``exact`` an object array of
    exact ``mpf`` (a plain number among hex strings, as files of format 1 held for ``c = 0``, is
    read as its float64 value)."""
    if not exact:
        return np.array(value, dtype=np.float64)

    def one(entry):
        return mpf_from_hex(entry) if isinstance(entry, str) else mpmath.mpf(float(entry))

    return np.vectorize(one, otypes=[object])(np.array(value, dtype=object))
