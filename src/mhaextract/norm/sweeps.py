"""The norm's kind, eps and the residual R from one-token sweeps (docs/algorithm.md, 'Attention behind
a norm: the sublayer of a block', 'The norm, eps and R from one-token sweeps').

A one-token query has all its weight on its token: ``y((s e)) = s R e + g(s) V' e + c'`` with
``g(s) = s / sqrt(s^2 / d + eps)`` for e in the space the norm's output fills, and ``y(0) = c'``.
Everything here asks through the raw boundary (counted there) and reads no weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checks.base import Check
from ..checks.noise_probe import FLOAT32_UNIT, taken_as_float32
from ..oracle.answer_stats import FLOAT64_UNIT, format_unit

#: The sweep's scales: from below any eps a float64 norm uses (ViT's 1e-12) to far above it.
SWEEP = 10.0 ** np.arange(-10, 5)
#: The large scale at which g is sqrt(d) to ``eps d / S^2`` (the residual's queries, S and 2 S).
LARGE = 1e6
#: The norm after the residual (BertAttention's), as ``norm=`` names it.
POST_NORM = "post-layernorm"
#: A bend counts when the sweep's slopes move by this many times their rounding.
BEND_FACTOR = 1e3


@dataclass
class Sweeps:
    """What the sweeps found: ``kind`` ("layernorm", "rmsnorm", POST_NORM, or None when no norm fits),
    ``eps``, ``R`` (d_out, d; a read-out's ``rho^T = r^T R``, (1, d)), ``c`` (= y(0), (d_out,)), the ``checks`` they add, ``queries`` asked,
    ``unit`` (the answers' relative rounding) and ``eps_error`` (the estimate's relative error)."""

    kind: str | None = None
    eps: float = np.nan
    R: np.ndarray | None = None
    c: np.ndarray | None = None
    unit: float = FLOAT64_UNIT
    eps_error: float = np.inf
    R_error: float = np.inf
    noise: float | None = None  # float64 answers' measured float32 rounding (the eps readings' spread), or None
    checks: list = field(default_factory=list)
    queries: int = 0

    @property
    def read_out(self) -> bool:
        """The oracle answers one number a sequence (``r^T y``): R is then ``rho^T = r^T R``, (1, d)."""
        return self.c is not None and self.c.size == 1


def ask_whole(boundary, sequences, description: str) -> np.ndarray:
    """The sublayer's whole answers to ``sequences`` (B, d_out), float64, asked through ``boundary``; a
    read-out's one number a sequence as one column (B, 1), which every sweep below reads as a d_out of 1."""
    answers = np.asarray(boundary.ask(sequences, description=description, whole=True), dtype=np.float64)
    return answers.reshape(len(answers), -1)  # a read-out's scalar answers: one column


def _slopes(boundary, direction: np.ndarray, scales, zero: np.ndarray):
    """``(y(s e) - y(0)) / s`` at each scale, and each one's rounding (absolute)."""
    answers = ask_whole(boundary, [s * direction[None, :] for s in scales], "norm sweep")
    slopes = (answers - zero) / np.asarray(scales)[:, None]
    size = (np.abs(answers).max(axis=1) + np.abs(zero).max()) / np.asarray(scales)
    return answers, slopes, size


def _bends(slopes: np.ndarray, size: np.ndarray, unit: float) -> float:
    """How far the slopes move from the largest scale's, over their rounding: above BEND_FACTOR a bend."""
    moved = np.abs(slopes - slopes[-1]).max(axis=1)
    return float((moved / (size * unit + 1e-300)).max())


#: An eps spread above float64's limit but below this is float32 rounding inside a float64 layer, not a
#: layer of another form (a whole GPT-2 block, its MLP after the residual, spreads them far wider).
FLOAT32_SPREAD = 1e-5
#: Said where that is so (the check ``answer_noise``).
FLOAT32_CAUSE = ("a float64 sublayer whose norm computes in float32 gives (transformers' LlamaRMSNorm and "
                 "MistralRMSNorm do whatever the layer's dtype, and their rotary angles too)")


def computed_in_float32(spread: float, limit: float) -> bool:
    """Whether the eps readings' ``spread`` misses float64's ``limit`` by float32 rounding: float64 answers
    computed in float32 inside (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block',
    'Float64 answers of a norm computed in float32')."""
    return limit <= spread < FLOAT32_SPREAD


def _eps_from_ratio(rho: float, s: float, S: float, d: int) -> float:
    """eps from ``g(s) / g(S) = rho``: ``q = (rho S / s)^2 = (S^2/d + eps) / (s^2/d + eps)``."""
    q = (rho * S / s) ** 2
    return (S * S / d - q * s * s / d) / (q - 1)


def measure(boundary, d: int, declared: str, rng: np.random.Generator, answer_dtype) -> Sweeps:
    """The sweeps of the module docstring; ``declared``: "auto", "layernorm", "rmsnorm" or POST_NORM
    (whose own measurements are :mod:`mhaextract.norm.post_norm`'s)."""
    out = Sweeps(unit=format_unit(answer_dtype))
    unit = out.unit
    zero = ask_whole(boundary, [np.zeros((1, d))], "norm sweep")[0]
    out.c = zero
    ones = np.ones(d) / np.sqrt(d)
    free = rng.standard_normal(d)
    free -= free.mean()
    free /= np.linalg.norm(free)  # mean-free: a LayerNorm keeps it, an RMSNorm keeps it
    along_ones, slopes_ones, size_ones = _slopes(boundary, ones, SWEEP, zero)
    along_free, slopes_free, size_free = _slopes(boundary, free, SWEEP, zero)
    bend_ones, bend_free = _bends(slopes_ones, size_ones, unit), _bends(slopes_free, size_free, unit)
    # a post-norm bounds the outputs: they stop growing with the input (no residual seen)
    growth = float(np.abs(along_free[-1] - zero).max() / max(np.abs(along_free[-3] - zero).max(), 1e-300))
    post_norm = growth < 10.0  # the input grew 100 times: a residual grows the output with it
    found = POST_NORM if post_norm else ("rmsnorm" if bend_ones > BEND_FACTOR else
                                         "layernorm" if bend_free > BEND_FACTOR else None)
    if post_norm:
        out.checks.append(Check(
            "norm_kind", declared in ("auto", POST_NORM), growth, 10.0,
            f"declared norm={declared!r}; the answers show a norm after the residual (post-LN, BertAttention): "
            "one-token outputs stop growing with the token (x100 input gave this growth)"))
    else:
        message = (f"declared norm={declared!r}; the answers show {found or 'no norm'} before the attention (one-token "
                   f"outputs grow with the token: a residual after it; slopes along 1 bend {bend_ones:.1e}, along a "
                   f"mean-free direction {bend_free:.1e} times their rounding; a bend is above {BEND_FACTOR:.0e})")
        if found is None:
            message += ": attention with no norm before it is the attention family's (extract without norm=)"
        ok = found is not None and declared in ("auto", found)
        out.checks.append(Check("norm_kind", ok, bend_ones if declared == "layernorm" else bend_free,
                                BEND_FACTOR, message))
    out.kind = found  # what the answers show (a declared norm they contradict failed norm_kind)
    out.queries = 1 + 2 * len(SWEEP)
    if found in (None, POST_NORM) or not all(check.passed for check in out.checks):
        return out  # a post-norm's gamma, beta and eps: mhaextract.norm.post_norm
    # the residual: R e_k = (y(2 S e_k) - y(S e_k)) / S for the standard basis
    basis = np.eye(d)
    large = ask_whole(boundary, [s * e[None, :] for e in basis for s in (LARGE, 2 * LARGE)], "residual")
    out.R = ((large[1::2] - large[0::2]) / LARGE).T
    out.R_error = 4 * unit * float(np.abs(large).max()) / LARGE / max(float(np.abs(out.R).max()), 1e-300)
    out.queries += 2 * d
    # eps: z(s) = y(s e) - s R e - c = g(s) b along e (mean-free or any); the ratio of z at two scales
    # is g(s) / g(S), one equation for eps. The sweep's reading nearest the bend (ratio to s = 1 near
    # 1/sqrt(2), where s^2 / d = eps) gives a first eps; two readings at s = sqrt(d eps) against
    # S = sqrt(1000 d eps) (S^2/d >> eps: sensitivity 1/2, and s R e, S R e small) give eps.
    direction = free if found == "layernorm" else ones
    answers = along_free if found == "layernorm" else along_ones
    z = answers - SWEEP[:, None] * (out.R @ direction)[None, :] - zero
    unit_scale = int(np.argmin(np.abs(SWEEP - 1.0)))
    reference = z[unit_scale]
    rho = z @ reference / (reference @ reference)
    bend = [j for j in range(unit_scale) if 0.05 < rho[j] < 0.95]
    if not bend:
        out.checks.append(Check("eps", False, float(rho[0]), 0.95,
                                f"no one-token answer between 1e-10 and 1 shows the norm's bend: its eps is outside "
                                f"(1e-19 d, 1e-1 d) or the norm is of another form"))
        return out
    first = min(bend, key=lambda j: abs(rho[j] - 0.5 ** 0.5))
    rough = _eps_from_ratio(float(rho[first]), float(SWEEP[first]), 1.0, d)
    s, S = float(np.sqrt(d * rough)), float(np.sqrt(1000 * d * rough))
    second = rng.standard_normal(d)
    if found == "layernorm":
        second -= second.mean()
    second /= np.linalg.norm(second)
    readings = []
    for e in (direction, second):
        y = ask_whole(boundary, [s * e[None, :], S * e[None, :]], "norm eps")
        Re = out.R @ e
        z_s, z_S = y[0] - s * Re - zero, y[1] - S * Re - zero
        readings.append(_eps_from_ratio(float(z_s @ z_S / (z_S @ z_S)), s, S, d))
    out.queries += 4
    out.eps = float(np.mean(readings))
    spread = abs(readings[0] - readings[1]) / out.eps
    spread_limit = 1e4 * unit  # measured: 6e-16 .. 3e-15 on float64 sublayers; 1.1e-3 on a whole GPT-2 block
    # float64 answers carrying float32's rounding: taken as float32 answers
    if unit < FLOAT32_UNIT and computed_in_float32(spread, spread_limit):
        out.noise, unit, spread_limit_64 = spread, FLOAT32_UNIT, spread_limit
        out.unit, spread_limit = unit, 1e4 * unit
        out.R_error = 4 * unit * float(np.abs(large).max()) / LARGE / max(float(np.abs(out.R).max()), 1e-300)
        out.checks.append(taken_as_float32(spread, spread_limit_64, "the norm's eps read in two directions spreads by "
                                           "that much; exact float64 answers leave below 3e-15", FLOAT32_CAUSE))
    # sensitivity ~ 1/2: a reading errs by about twice the ratio's relative error (its answers' rounding
    # over the difference's size); the two directions' spread measures it
    out.eps_error = max(2 * spread, 64 * unit)
    out.checks.append(Check("eps", out.eps > 0 and spread < spread_limit, spread, spread_limit,
                            f"eps = {out.eps:.6g} from two directions, relative spread {spread:.1e} (a layer after "
                            "the residual, such as an MLP of a whole block, or a norm of another form than "
                            "n(x) = x / sqrt(|x|^2/d + eps) spreads them)"))
    # the model's form on the sweep: s R e + g(s) b + c along the sweep direction, b from the largest scale
    g = SWEEP / np.sqrt(SWEEP ** 2 / d + out.eps)
    b = reference / g[unit_scale]
    predicted = SWEEP[:, None] * (out.R @ direction)[None, :] + g[:, None] * b[None, :] + zero
    misfit = float((np.abs(predicted - answers).max(axis=1) / np.maximum(np.abs(answers).max(axis=1), 1e-300)).max())
    limit = 1e4 * unit + 10 * out.eps_error  # measured: 5e-16 on float64 sublayers, 3.6e-3 on a whole block
    out.checks.append(Check("one_token_form", misfit <= limit, misfit, limit,
                            "one-token answers against s R e + g(s) V' e + c' (norm, attention, residual): a layer "
                            "after the residual (an MLP: a whole block) or another norm does not fit"))
    return out

