"""Plain attention models (:class:`~mhaextract.MultiHeadAttention`) back into torch: the adapter
:func:`~mhaextract.adapters.export.to_torch` and :func:`~mhaextract.adapters.export.to_state_dict`
dispatch to for this model type.

:func:`layer`: the final-token function f (:class:`~mhaextract.adapters.torch.ReducedAttention`),
or a whole layer (:class:`~mhaextract.adapters.torch.ExtractedAttention`) of heads factored at
their width. :func:`state_dict`: the layout of ``nn.MultiheadAttention``, ``GPT2Attention``,
``BertSelfAttention``, ``OPTAttention`` or ``ViTAttention``, each head ``W_h = sigma Wk_h^T Wq_h``,
``u_h = sigma Wk_h^T b_Q_h`` (``b_K = 0``), ``V_h = Wo_h Wv_h`` with ``b_V = 0``, ``b_O = c``
(BERT has no output projection: ``Wv_h`` is ``V_h``'s block of rows and ``b_V = c``). Both judge
every cut as :mod:`mhaextract.adapters.export` says and measure what the export adds.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from ..models.attention import MultiHeadAttention
from .export import ExportReport, StateDict, UnsupportedLayerError, dropped, measure_export
from .torch import ExtractedAttention, ReducedAttention, _blocks, _Blocks, head_factors, to_reduced


def layer(model: MultiHeadAttention, causal: bool | None, width: int | None, dtype, tolerance: float):
    """``causal=None``: :class:`ReducedAttention` (the final-token f); else :class:`ExtractedAttention`
    with heads factored at ``width``, its ``export_report`` measured."""
    if not isinstance(model, MultiHeadAttention):
        raise TypeError(f"expected a MultiHeadAttention, got {type(model).__name__}")
    if causal is None:
        if width is not None:
            raise ValueError(f"width={width} is the width of a layer's heads: pass causal=True or False for a layer "
                             "(without it to_torch gives the final-token function, no heads to factor)")
        return ReducedAttention(model)
    factors = head_factors(model, width, tolerance)
    module = ExtractedAttention(factors, causal, torch.float64 if dtype is None else dtype)
    exported = factors.model()  # a scalar model's factors have one output row: read it out
    module.export_report = measure_export(factors.report, exported if model.is_vector else exported.readout(np.ones(1)),
                                          model)
    return module


def _template_blocks(model: MultiHeadAttention, like, tolerance: float, report: ExportReport) -> _Blocks:
    """The model's heads in the per-head layout of the layer ``like`` (its H, head width r, score
    scale sigma): Wq, Wk, Wv (H, r, d), Wo (H, d_out, r), bq, bv (H, r), bo (d_out,) (b_K is zero)."""
    template = _blocks(like)
    H, r, d = template.Wq.shape
    d_out = template.Wo.shape[1]
    kind = template.kind
    if not model.is_vector or model.d != d or model.d_out != d_out:
        shape = f"d = {model.d}, d_out = {model.d_out if model.is_vector else 'scalar'}"
        raise UnsupportedLayerError(f"{kind} maps d = {d} to d_out = {d_out}; the model has {shape} (a model "
                                    "extracted from a read-out is one number per sequence: extract with "
                                    "TorchOracle(layer))")
    model = model.to_float64().canonical()
    if model.heads > H:
        raise UnsupportedLayerError(f"the model has {model.heads} canonical heads; {kind} holds {H}: build it with "
                                    f"at least {model.heads} heads (of width >= each head's rank), or use "
                                    "to_torch(result)")
    factors = head_factors(model, r, tolerance, kind)
    report.cuts += factors.report.cuts
    report.beyond_gap += factors.report.beyond_gap
    blocks = _Blocks(kind, np.zeros((H, r, d)), np.zeros((H, r, d)), np.zeros((H, r, d)),
                     np.zeros((H, d_out, r)), np.zeros((H, r)), np.zeros((H, r)), np.zeros(d_out), template.sigma)
    found = slice(0, model.heads)
    blocks.Wq[found], blocks.bq[found] = factors.Q / template.sigma, factors.b / template.sigma
    blocks.Wk[found] = factors.K
    if kind == "BertSelfAttention":
        _bert_values(model, factors, template, blocks, tolerance, report)
    else:
        blocks.Wv[found], blocks.Wo[found] = factors.P, factors.O
        blocks.bo = factors.c
    return blocks


def _bert_values(model, factors, template, blocks, tolerance: float, report: ExportReport) -> None:
    """No output projection: head g writes output rows ``g r..(g+1) r``, so each model head goes to the
    group holding its values (an assignment on the blocks' norms) and must have nothing outside it."""
    H, r, _ = blocks.Wq.shape
    blocks.Wo = template.Wo
    mass = np.array([[np.linalg.norm(model.V[h, g * r:(g + 1) * r]) for g in range(H)] for h in range(model.heads)])
    rows, groups = linear_sum_assignment(-mass) if model.heads else (np.zeros(0, int), np.zeros(0, int))
    for h, g in zip(rows, groups):
        others = np.delete(model.V[h], np.s_[g * r:(g + 1) * r], axis=0)
        outside = np.linalg.norm(others) / np.linalg.norm(model.V[h])
        if outside > max(tolerance, 1e-12):
            raise UnsupportedLayerError(f"head {h}'s values reach {outside:.1e} of their size outside one head's "
                                        "block of outputs: BertSelfAttention has no output projection to carry them "
                                        "(use to_torch(result), or pass tolerance= to drop them)")
        report.cut(f"head {h}'s values outside output block {g}", outside, beyond_gap=outside > 1e-12)
    blocks.Wq[:], blocks.Wk[:], blocks.bq[:] = 0.0, 0.0, 0.0  # heads go to their groups' slots
    for h, g in zip(rows, groups):
        blocks.Wq[g], blocks.bq[g] = factors.Q[h] / template.sigma, factors.b[h] / template.sigma
        blocks.Wk[g], blocks.Wv[g] = factors.K[h], model.V[h, g * r:(g + 1) * r]
    blocks.bv = np.asarray(model.c, dtype=np.float64).reshape(H, r)


def _layout(blocks: _Blocks, like) -> dict:
    """The class's parameter names and shapes for the blocks: {name: (value, the weight it biases)}."""
    H, r, d = blocks.Wq.shape
    stacked = {name: getattr(blocks, name).reshape(H * r, d) for name in ("Wq", "Wk", "Wv")}
    out_weight = blocks.Wo.transpose(1, 0, 2).reshape(blocks.Wo.shape[1], H * r)  # (d_out, H r)
    bq, bk, bv = blocks.bq.reshape(-1), np.zeros(H * r), blocks.bv.reshape(-1)
    in_weight = np.vstack([stacked["Wq"], stacked["Wk"], stacked["Wv"]])
    if blocks.kind == "nn.MultiheadAttention":
        return {"in_proj_weight": (in_weight, None), "in_proj_bias": (np.concatenate([bq, bk, bv]), in_weight),
                "out_proj.weight": (out_weight, None), "out_proj.bias": (blocks.bo, out_weight)}
    if blocks.kind == "GPT2Attention":  # Conv1D weights are (in, out)
        return {"c_attn.weight": (in_weight.T, None), "c_attn.bias": (np.concatenate([bq, bk, bv]), in_weight),
                "c_proj.weight": (out_weight.T, None), "c_proj.bias": (blocks.bo, out_weight)}
    names = {"BertSelfAttention": ("query", "key", "value", None)}.get(
        blocks.kind, ("q_proj", "k_proj", "v_proj", "out_proj" if hasattr(like, "out_proj") else "o_proj"))
    values = {}
    for name, weight, bias in zip(names, (stacked["Wq"], stacked["Wk"], stacked["Wv"], out_weight),
                                  (bq, bk, bv, blocks.bo)):
        if name is not None:
            values.update({f"{name}.weight": (weight, None), f"{name}.bias": (bias, weight)})
    return values


def state_dict(model: MultiHeadAttention, like, tolerance: float) -> StateDict:
    """The model in the layout of ``like``'s class (module docstring), measured against the model
    by reading the loaded copy back (:func:`~mhaextract.adapters.torch.to_reduced`)."""
    if not isinstance(model, MultiHeadAttention):
        raise TypeError(f"expected a MultiHeadAttention, got {type(model).__name__}")
    template_kind = type(like).__name__
    report = ExportReport(template_kind, tolerance)
    blocks = _template_blocks(model, like, tolerance, report)
    state = {key: tensor.detach().clone() for key, tensor in like.state_dict().items()}
    for key, (value, weight) in _layout(blocks, like).items():
        if key not in state:
            dropped(value, weight if weight is not None else value, tolerance, repr(key), blocks.kind, report)
            continue
        if tuple(state[key].shape) != value.shape:
            raise UnsupportedLayerError(f"{blocks.kind}'s {key} has shape {tuple(state[key].shape)}, the model gives "
                                        f"{value.shape}")
        state[key] = torch.as_tensor(value, dtype=state[key].dtype, device=state[key].device)
    loaded = copy.deepcopy(like)
    loaded.load_state_dict(state)
    measure_export(report, to_reduced(loaded), model)
    return StateDict(state, report)
