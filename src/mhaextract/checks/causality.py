"""Is the layer causal? Judged from its outputs at earlier positions of queries already asked.

An oracle answers the final token; the layer behind it computes every position of the query as
well. An oracle that shows those (``position_evidence``: pairs of a sequence X (N, d) and the
layer's outputs at all N positions, in the answers' space; :class:`~mhaextract.adapters.torch.TorchOracle`
keeps a few) lets the run record which layer it was, without a query more and without weights:
the final-token model f of the result predicts position i

* of a causal (decoder's) layer as f on the prefix ``x_0..x_i``;
* of a bidirectional (encoder's) layer as f with ``x_i`` the query and every token a key
  (``model.at_position(X, i, causal=False)``; None for a model type with no such reading).

Errors are max absolute differences over the largest output of the evidence. The model's own
error on the same sequences' final positions sets the scale: a reading fits when its error is
within :data:`FIT_FACTOR` times that (and :data:`FLOOR`). The verdict is ``"causal"`` when the
prefix reading fits and the all-token one does not, ``"bidirectional"`` the other way round, else
``"undetermined"`` (both fit: the evidence cannot tell; neither: the layer is something else, a
window or positions).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

#: A reading fits when its error is within this many times the model's own at the final positions.
FIT_FACTOR = 10.0
#: ... and at least this (float64 rounding of outputs of order one).
FLOOR = 1e-12
#: Earlier positions judged per sequence: the first, the second and the middle one.
POSITIONS = (0, 1, "middle")


@dataclass(frozen=True)
class CausalRecord:
    """What the layer's outputs at earlier positions say (module docstring).

    Attributes
    ----------
    verdict : ``"causal"``, ``"bidirectional"`` or ``"undetermined"``.
    prefix_error : max relative error of the model on prefixes against the layer's earlier outputs.
    all_tokens_error : the same with every token a key (None: the model type has no such reading).
    final_error : the model's own error at the final positions of the same sequences.
    sequences, positions : the evidence judged.
    """

    verdict: str
    prefix_error: float
    all_tokens_error: float | None
    final_error: float
    sequences: int
    positions: int

    @property
    def causal(self) -> bool | None:
        """True (causal), False (bidirectional) or None (undetermined)."""
        return {"causal": True, "bidirectional": False}.get(self.verdict)

    def __str__(self) -> str:
        both = "" if self.all_tokens_error is None else f", every token a key {self.all_tokens_error:.1e}"
        return (f"{self.verdict}: at {self.positions} earlier positions of {self.sequences} queries the model on "
                f"prefixes is {self.prefix_error:.1e} off{both} (its own error at their final positions "
                f"{self.final_error:.1e})")


def causal_record(model, evidence) -> CausalRecord | None:
    """Judge ``evidence`` (pairs ``(X, outputs)``, module docstring) against the final-token ``model``;
    None without evidence of at least two tokens.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> from mhaextract.checks.causality import causal_record
    >>> model = mx.MultiHeadAttention.random(d=3, heads=2, seed=0, d_out=3)
    >>> X = np.random.default_rng(1).normal(size=(6, 3))
    >>> decoder = np.stack([model.at_position(X, i, causal=True) for i in range(6)])
    >>> causal_record(model, [(X, decoder)]).verdict
    'causal'
    >>> encoder = np.stack([model.at_position(X, i, causal=False) for i in range(6)])
    >>> causal_record(model, [(X, encoder)]).verdict
    'bidirectional'
    """
    pairs = [(np.asarray(X, dtype=np.float64), np.asarray(out, dtype=np.float64)) for X, out in evidence
             if len(X) >= 2]
    if model is None or not pairs:
        return None
    model = model.to_float64()
    scale = max(max(float(np.abs(out).max()) for _, out in pairs), 1e-300)
    final = prefix = 0.0
    every: float | None = 0.0
    count = 0
    for X, out in pairs:
        N = len(X)
        final = max(final, float(np.abs(model.at_position(X, N - 1, True) - out[N - 1]).max()))
        for i in sorted({p if p != "middle" else N // 2 for p in POSITIONS} & set(range(N - 1))):
            count += 1
            prefix = max(prefix, float(np.abs(model.at_position(X, i, True) - out[i]).max()))
            reading = model.at_position(X, i, False)
            every = None if reading is None or every is None else max(every, float(np.abs(reading - out[i]).max()))
    final, prefix = final / scale, prefix / scale
    every = None if every is None else every / scale
    limit = max(FIT_FACTOR * final, FLOOR)
    fits_prefix, fits_every = prefix <= limit, every is not None and every <= limit
    verdict = ("causal" if fits_prefix and not fits_every else "bidirectional" if fits_every and not fits_prefix
               else "undetermined")
    return CausalRecord(verdict, prefix, every, final, len(pairs), count)


def records_causality(extract):
    """Decorator of :func:`mhaextract.extract`: the result of an oracle with ``position_evidence``
    gets its :class:`CausalRecord` as ``result.causal`` (None otherwise). Nothing is asked."""

    @functools.wraps(extract)
    def wrapper(oracle, *args, **kwargs):
        result = extract(oracle, *args, **kwargs)
        evidence = getattr(oracle, "position_evidence", None)
        if evidence is not None and hasattr(result, "causal"):
            result.causal = causal_record(getattr(result, "model", None), list(evidence))
        return result
    return wrapper
