"""Extracted models back into torch: the one entry for every model type, and what an export may round.

:func:`to_torch` and :func:`to_state_dict` take a model (or an extraction's result, whose error
estimate and causal record they use) and hand it to its family's adapter, named in :data:`ADAPTERS`
(the only place families are named). Each family's module has ``layer(model, causal, width, dtype,
tolerance)`` and ``state_dict(model, like, tolerance)``.

What an export may not silently do (docs/full-layer.md, "Put back into the layer's own class"):
a class of head width r holds a head's scores ``[W_h | u_h] = sigma Wk_h^T [Wq_h | b_Q_h]`` and
values ``V_h = Wo_h Wv_h`` only at rank <= r. A factor of numerical rank k > r is cut at r only

* where its singular values drop by at least :data:`RANK_GAP` at or before r (what is cut is the
  extraction's own error), or
* where ``s_{r+1} / s_1 <= tolerance``: the caller's tolerance, or for a result its
  ``error_estimate`` (rounding within the error the model already has);

otherwise :class:`UnsupportedLayerError` names the factor, its rank and what to try. Every
export carries an :class:`ExportReport` (``state.report``, ``module.export_report``) with the
parameter and output error the exported layer has against the model, measured; a cut beyond the
numerical gap also warns (:class:`RoundedExportWarning`), the numbers in the message.
"""

from __future__ import annotations

import importlib
import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..checks.base import CheckedResult


#: A drop of this factor between consecutive singular values separates a head's rank from the
#: extraction's error (float64 layers drop by ~1e13, float32 ones by ~1e4; trained heads' own
#: singular values fall far more gently).
RANK_GAP = 1e3

#: A relative misfit this small is the float64 arithmetic's (or a float64 extraction's): recorded in
#: the report, not warned about (frequencies, shared keys and dropped biases have no singular values
#: to show a gap).
ARITHMETIC = 1e-9

#: What to try when a class's heads are too narrow for a factor.
CLASS_REMEDY = ("export into a class whose heads are at least {rank} wide, or use to_torch(result) (every head at "
                "its own rank)")


class UnsupportedLayerError(ValueError):
    """The layer is not (reducible to) the model class the extractor learns, or a class cannot carry
    a model exported into it; the message names why and what to try.

    Examples
    --------
    >>> import torch
    >>> from mhaextract.adapters.torch import UnsupportedLayerError, to_reduced
    >>> try:
    ...     to_reduced(torch.nn.MultiheadAttention(4, 2, add_zero_attn=True))
    ... except UnsupportedLayerError as error:
    ...     print("add_zero_attn" in str(error))
    True
    """


class RoundedExportWarning(UserWarning):
    """An export rounded the model to fit the class (a rank cut beyond the numerical gap, a bias
    dropped): the message says by how much, ``warning.report`` is the :class:`ExportReport`."""

    def __init__(self, message: str, report: "ExportReport"):
        super().__init__(message)
        self.report = report


class CausalityWarning(UserWarning):
    """``causal=`` given to :func:`to_torch` contradicts the causal record of the result."""


def numerical_rank(singular_values: np.ndarray) -> int:
    """The rank of a matrix whose singular values (descending) carry an extraction's error: the
    count before the largest drop of at least :data:`RANK_GAP`, or all the non-zero ones.

    Examples
    --------
    >>> from mhaextract.adapters.torch import numerical_rank
    >>> numerical_rank([3.0, 1.0, 0.5, 2e-14, 1e-15])
    3
    >>> numerical_rank([3.0, 1.0, 0.5])
    3
    """
    S = np.asarray(singular_values, dtype=np.float64)
    if not len(S) or S[0] == 0:
        return 0
    positive = S[S > 0]
    if len(positive) < 2:
        return len(positive)
    ratios = positive[:-1] / positive[1:]
    largest = int(np.argmax(ratios))
    return largest + 1 if ratios[largest] >= RANK_GAP else len(positive)


@dataclass
class ExportReport:
    """What an export did to fit its target, and the error that added, measured.

    Attributes
    ----------
    target : the class (and width) exported into.
    tolerance : the largest relative cut allowed beyond the numerical gap.
    cuts : ``(what, size)`` for every factor cut or bias dropped: ``size`` is the first singular
        value dropped over the largest (a rank cut) or the dropped entries' largest over their
        weight's (a bias); zero cuts are not listed.
    beyond_gap : the cuts larger than the numerical gap allows (those that warn).
    parameter_error : the larger of ``W_rel`` and ``v_rel`` of ``compare(exported, model)``, the
        exported layer read back (score and value matrices; the biases show in ``output_error``).
    output_error : max over fresh sequences (unit-variance tokens, seeded) of the largest output
        difference at the final token, over the largest output.
    """

    target: str
    tolerance: float
    cuts: list = field(default_factory=list)
    beyond_gap: list = field(default_factory=list)
    parameter_error: float | None = None
    output_error: float | None = None

    @property
    def rounded(self) -> bool:
        """A cut beyond the numerical gap was made (the export warned)."""
        return bool(self.beyond_gap)

    def __str__(self) -> str:
        cut = "; ".join(f"{what} ({size:.1e})" for what, size in self.beyond_gap) or "nothing beyond the gap"
        return (f"export into {self.target}: rounded {cut}; the exported layer is {self.parameter_error:.1e} from "
                f"the model in parameters and {self.output_error:.1e} in outputs (relative)")

    def cut(self, what: str, size: float, beyond_gap: bool) -> None:
        if size > 0:
            self.cuts.append((what, float(size)))
        if beyond_gap:
            self.beyond_gap.append((what, float(size)))

    def measured(self, parameter_error: float, output_error: float) -> "ExportReport":
        """Record the measured errors and warn (:class:`RoundedExportWarning`) when something was
        rounded beyond the numerical gap."""
        self.parameter_error, self.output_error = float(parameter_error), float(output_error)
        if self.rounded:
            warnings.warn(RoundedExportWarning(str(self), self), stacklevel=5)  # the caller of to_state_dict / to_torch
        return self


class StateDict(dict):
    """A state dict (``load_state_dict`` takes it as any dict) that carries its :class:`ExportReport`
    as ``report``."""

    def __init__(self, values: dict, report: ExportReport):
        super().__init__(values)
        self.report = report


def factor_at_width(matrix: np.ndarray, width: int, tolerance: float, what: str, target: str,
                    report: ExportReport, remedy: str = CLASS_REMEDY) -> tuple[np.ndarray, np.ndarray]:
    """``matrix ~= left @ right`` with ``width`` columns in ``left`` (an SVD, the root of each
    singular value on both sides), the cut judged and recorded (module docstring); raises
    :class:`UnsupportedLayerError` naming ``what`` when ``target`` cannot carry it, with ``remedy``
    (formatted with the factor's ``rank``) as what to try."""
    U, S, Vt = np.linalg.svd(matrix, full_matrices=False)
    keep = min(width, len(S))
    size = float(S[keep] / S[0]) if keep < len(S) and S[0] > 0 else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        drops = S[:-1] / S[1:]  # drops[k - 1]: from singular value k to k + 1 (inf onto an exact zero)
    gaps = [k for k in range(1, len(S)) if drops[k - 1] >= RANK_GAP or not S[k] > 0]
    within_gap = size == 0 or any(k <= width for k in gaps)
    if not within_gap and size > tolerance:
        rank = min([k for k in gaps if k > width], default=int(np.count_nonzero(S)))
        raise UnsupportedLayerError(
            f"{what} has rank {rank} > the head width {width} of {target} (singular value {width + 1} is "
            f"{size:.1e} of the largest, above the tolerance {tolerance:.1e}): {remedy.format(rank=rank)}; "
            f"rounding to width {width} adds about {size:.1e} relative error: pass tolerance={size:.1e} (or the "
            "extraction's result, whose error estimate is the default tolerance) to accept it")
    report.cut(what, size, beyond_gap=not within_gap)
    root = np.sqrt(S[:keep])
    left, right = np.zeros((matrix.shape[0], width)), np.zeros((width, matrix.shape[1]))
    left[:, :keep], right[:keep] = U[:, :keep] * root, root[:, None] * Vt[:keep]
    return left, right


def dropped(values: np.ndarray, reference: np.ndarray, tolerance: float, what: str, target: str,
            report: ExportReport) -> None:
    """A part of the model the class has no parameter for (a bias it was built without): refused
    unless its largest entry over ``reference``'s largest is within ``tolerance`` (or the float64
    arithmetic's :data:`ARITHMETIC`), else recorded."""
    size = float(np.abs(values).max(initial=0.0)) / max(float(np.abs(reference).max(initial=0.0)), 1e-300)
    if size > max(tolerance, ARITHMETIC):
        raise UnsupportedLayerError(
            f"{target} has no parameter for {what} (built without biases?) and the model needs it "
            f"({size:.1e} of its weights, above the tolerance {tolerance:.1e}): build the class with biases "
            f"(bias=True, attention_bias=True, ...), or pass tolerance={size:.1e} to drop it")
    report.cut(what, size, beyond_gap=size > ARITHMETIC)


def measure_export(report: ExportReport, exported, model, longest: int = 32, count: int = 32) -> ExportReport:
    """The exported layer (read back as a model) against the model: ``compare(...).max_rel`` and the
    largest final-token output difference over ``count`` seeded sequences of 1..``longest``
    unit-variance tokens (a LayerNorm's output), relative to the largest output; warns where the
    report has a cut beyond the numerical gap."""
    from ..models.compare import compare

    model = model.to_float64()
    rng = np.random.default_rng(0)
    sequences = [rng.standard_normal((int(n), model.d)) for n in rng.integers(1, longest + 1, size=count)]
    sequences.append(rng.standard_normal((longest, model.d)))
    expected, got = model(sequences), exported(sequences)
    output_error = float(np.abs(got - expected).max()) / max(float(np.abs(expected).max()), 1e-300)
    comparison = compare(exported, model)  # biases near zero have no relative error: the outputs show theirs
    return report.measured(max(float(comparison.W_rel), float(comparison.v_rel)), output_error)


def _model_of(model_or_result, tolerance):
    """``(model, tolerance, causal record)``: a result gives its model, its error estimate as the
    default tolerance and its record; a bare model tolerance 0 (cuts below the gap only)."""
    record = None
    if isinstance(model_or_result, CheckedResult):
        model = getattr(model_or_result, "model", None)
        if model is None:
            raise ValueError("the result has no model to export (its failed checks say why)")
        estimate = float(getattr(model_or_result, "error_estimate", 0.0) or 0.0)
        tolerance = (estimate if math.isfinite(estimate) else 0.0) if tolerance is None else tolerance
        record = getattr(model_or_result, "causal", None)
    else:
        model = model_or_result
    tolerance = 0.0 if tolerance is None else tolerance
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1) (the largest relative rounding allowed), "
                         f"got {tolerance!r}")
    return model, float(tolerance), record


def _adapter(model, function: str):
    """The function of the model type's own torch adapter (its ``torch_adapter`` module)."""
    module = getattr(type(model), "torch_adapter", None)
    if module is None:
        from ..models.kinds import MODEL_KINDS

        carried = sorted(kind.__name__ for kind in MODEL_KINDS.values() if getattr(kind, "torch_adapter", None))
        raise TypeError(f"to_torch and to_state_dict take a model ({', '.join(carried)}) or an extraction's "
                        f"result with one, got {type(model).__name__}: it has no torch layer to go into")
    return getattr(importlib.import_module(module), function)


def to_torch(model, causal: bool | None = None, width: int | None = None, dtype=None,
             tolerance: float | None = None):
    """An extracted model (or a result: its model) as a torch module, for every model type.

    ``causal``: ``True`` a decoder's layer (position i sees tokens 0..i), ``False`` an encoder's,
    mapping (B, N, d) to (B, N, d_out) at every position. ``None`` (default): for a result whose
    oracle showed the layer's outputs at every position, what its causal record found
    (``result.causal``, docs/full-layer.md, "Causal or not"); otherwise the family's default
    (plain attention: the final-token function f; rotary: a causal layer). An explicit ``causal``
    that contradicts the record warns (:class:`CausalityWarning`). ``width``: the heads' width
    (None: each head's numerical rank); a cut is judged as in the module docstring, with
    ``tolerance`` (default: a result's error estimate, else 0). ``dtype``: the parameters' dtype
    (default float64).

    Examples
    --------
    >>> import numpy as np, torch
    >>> import mhaextract as mx
    >>> from mhaextract.adapters.torch import to_torch
    >>> layer = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, d_out=4, bias=True)
    >>> module = to_torch(layer, causal=True)
    >>> X = torch.randn(2, 5, 4, dtype=torch.float64)
    >>> out = module(X).detach()              # (B, N, d_out): every position
    >>> out.shape
    torch.Size([2, 5, 4])
    >>> bool(np.allclose(out[:, 2].numpy(), layer(X[:, :3].numpy())))   # position 2 sees tokens 0..2
    True
    """
    model, tolerance, record = _model_of(model, tolerance)
    if causal is not None and not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be True, False or None (follow the result's causal record), got {causal!r}")
    found = getattr(record, "causal", None)
    if causal is None:
        causal = found
    elif found is not None and bool(causal) != found:
        warnings.warn(f"causal={causal} contradicts the run's causal record ({record}): the replacement will differ "
                      "from the layer at earlier positions", CausalityWarning, stacklevel=2)
    if width is not None and (isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1):
        raise ValueError(f"width must be a positive integer (the head width) or None, got {width!r}")
    return _adapter(model, "layer")(model, causal=causal, width=width, dtype=dtype, tolerance=tolerance)


def to_state_dict(model, like, tolerance: float | None = None) -> StateDict:
    """Weights of an extracted vector model (or a result: its model) in the layout of the layer
    ``like``, for its ``load_state_dict``: the class and configuration to put the stolen layer back
    into, its weights only overwritten. Every mismatch the class cannot carry (head count, a head's
    scores or values of rank above its head width, a bias it lacks, d, d_out, frequencies, grouped
    heads) is refused with :class:`UnsupportedLayerError` naming it and what to try (a result
    recorded causal put into a class whose ``is_causal`` says otherwise, or the reverse, warns:
    :class:`CausalityWarning`); a cut within
    the numerical gap or ``tolerance`` (default: a result's error estimate, else 0) is made and
    measured (``state.report``, an :class:`ExportReport`; beyond the gap it also warns).

    Plain attention: ``nn.MultiheadAttention``, ``GPT2Attention``, ``BertSelfAttention``,
    ``OPTAttention``, ``ViTAttention`` (:mod:`mhaextract.adapters.attention`); rotary attention:
    ``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention`` (:mod:`mhaextract.adapters.rotary`);
    a block's attention sublayer: ``GPT2Block``, ``ViTLayer``, ``LlamaDecoderLayer``,
    ``MistralDecoderLayer``, ``Qwen2DecoderLayer`` (norm and attention), ``BertAttention``
    (:mod:`mhaextract.adapters.normed`).

    Examples
    --------
    >>> import torch
    >>> from mhaextract.adapters.torch import to_reduced, to_state_dict
    >>> layer = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    >>> fresh = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    >>> state = to_state_dict(to_reduced(layer), like=fresh)
    >>> _ = fresh.load_state_dict(state)
    >>> X = torch.randn(1, 5, 8, dtype=torch.float64)
    >>> bool(torch.allclose(fresh(X, X, X)[0], layer(X, X, X)[0], atol=1e-12)), state.report.output_error < 1e-14
    (True, True)
    """
    model, tolerance, record = _model_of(model, tolerance)
    found, attends = getattr(record, "causal", None), getattr(like, "is_causal", None)
    if found is not None and isinstance(attends, bool) and attends != found:
        warnings.warn(f"the run recorded the layer as {record.verdict} ({record}); {type(like).__name__} has "
                      f"is_causal={attends}: inside its model it attends {'causally' if attends else 'to every token'}",
                      CausalityWarning, stacklevel=2)
    return _adapter(model, "state_dict")(model, like, tolerance)
