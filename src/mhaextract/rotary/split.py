"""A rotary layer from whole answers split by head (docs/algorithm.md, 'Rotary layers from whole
answers'): :func:`extract_rotary_split` is what ``schedule="rotary-split"`` runs. Its steps, in the
order the queries are asked:

1. the value map and the split of :mod:`mhaextract.split` (unchanged: the heads' output subspaces
   ``O_h``, their value rows ``P_h`` and ``c``), the answers' format read from their bits;
2. the sliding window by the rotary route's search (:func:`~mhaextract.rotary.window.find_window`);
3. heads grouped by their value row spaces (:func:`head_groups`: grouped-query heads share ``K_g``);
4. pilots for the scores' token scale (:func:`pilot_scale`);
5. phase A (:func:`phase_a`): each offset's score vector in full on a few final tokens, at the
   offsets 1..m and the m before 64 and 128 tokens: the key space, the generator of the offsets
   (:func:`~mhaextract.rotary.structure.rotation_basis`: canonical ``K_g`` and ``theta_g``) and the
   key bias;
6. phase B (:func:`phase_b`): each further final token's query in the key coordinates, and
   ``q_h(t) = Q_h t + b_h`` over them;
7. Gauss-Newton on every log-ratio, group by group (:func:`refine_log_ratios`), then on the whole
   answers, every parameter (:func:`~mhaextract.rotary.whole_fit.refine_whole`, matrix-free);
8. the error estimate from held-out queries of 1..``HOLDOUT_LONGEST`` tokens, the checks and the
   long verification.

:class:`~mhaextract.split.values.SplitUnavailable` (raised before any model exists) says why the
answers cannot be learned this way; the learner then falls back to the rotary grid route.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..checks.noise_probe import taken_as_float32
from ..checks.verify import ask_long_verification, fresh_queries, spread_lengths
from ..models.rotary import RotaryAttention
from ..oracle.answer_stats import FORMAT_UNITS, format_name
from ..oracle.progress import note_progress
from ..run.validation import spawn_rng
from ..split.estimate import error_estimate, estimate_limit, relative_misfits, split_checks
from ..split.subspaces import _Saturated, exact_tokens, output_subspaces
from ..split.values import SplitUnavailable, more_bases, value_map
from ..split.weights import chunk_weights, log_ratios
from .learn import RotaryExtraction
from .structure import rotation_basis
from .whole_fit import kept_bytes, parameter_count, refine_whole, rotations
from .window import find_window

#: The log-ratios' RMS the pilots aim at (as the vector route's scores).
SCORE_SPREAD = 0.35
#: The largest sine between two heads' value row spaces in one group (heads sharing K_g and V_g).
SAME_GROUP = 1e-3
#: Phase A: final tokens, queries per unknown (d + 1) and the query lengths besides m + 1 (each gives
#: the m offsets before it; the window bounds them): the far offsets show the slow blocks' rotations.
PHASE_A_FINALS, PHASE_A_OVERSAMPLE, PHASE_A_LENGTHS = 3, 3.0, (64, 128)
#: The largest distance of the generator's eigenvalues from the unit circle phase A takes for a rotation.
GENERATOR_MODULUS = 0.1
#: Phase B's (final tokens over d + 1, equations per unknown) by the answers' format: float32 answers
#: carry more noise per weight, and their scores' error sets the output error.
DESIGN_B = {"float64": (1.5, 3.0), "float32": (4.0, 8.0)}
#: Phase B's longest query (zero tokens between the m random ones and the final one) and the share
#: of its queries drawn longer than m + 1.
PHASE_B_LONGEST, PHASE_B_LONG_SHARE = 128, 0.5
#: Gauss-Newton steps on the log-ratios (each stops early once it no longer gains).
LOG_RATIO_STEPS = 4
#: The whole-answer fit runs where what it keeps between its products
#: (:func:`~mhaextract.rotary.whole_fit.kept_bytes`) fits in this many bytes; larger runs keep the
#: log-ratio fit.
WHOLE_MEMORY = 2 ** 31
#: Directions of the column-scaled normal matrix below this fraction of its largest eigenvalue are left
#: out of a step: the gauge (a scaled rotation per block; O_h, P_h up to an r x r factor) and anything
#: the answers do not fix.
STEP_CUT = 1e-13
#: Held-out queries for the error estimate: lengths 1..HOLDOUT_LONGEST (offsets as far as the phase
#: queries reach), tokens at the run's token scale.
HOLDOUT_QUERIES, HOLDOUT_LONGEST = 32, 128
#: The fitted answers' relative RMS misfit the ``answers_residual`` check allows, in units of their
#: rounding; float64 answers missed by more, up to this many float32 units, are taken as computed in
#: float32 inside (the check ``answer_noise``) and judged at float32's unit.
RESIDUAL_UNITS = 1e3
#: Random streams of the run's seed (:func:`~mhaextract.run.validation.spawn_rng`).
STREAMS = {"values": 41, "split": 42, "scores": 46, "holdout": 44, "window": 21, "verify": 5, "whole": 47,
           "selection": 48}
def answer_format(unit: float) -> str:
    """``"float64"`` or ``"float32"`` for answers rounded at ``unit`` (their bits), or SplitUnavailable."""
    name = format_name(unit)
    if name not in ("float64", "float32"):
        raise SplitUnavailable(f"answers rounded at {unit:.3g} ({name}): the rotary split reads attention weights "
                               "from float64 or float32 answers")
    return name


def head_groups(P: list[np.ndarray]) -> list[int]:
    """Group labels of the heads: heads that share a key/value projection have one value row space
    ``row(P_h)`` (sines below ``SAME_GROUP``); labels in order of first appearance."""
    rows = [np.linalg.qr(np.asarray(p, dtype=np.float64).T)[0] for p in P]
    labels, count = [-1] * len(rows), 0
    for h in range(len(rows)):
        if labels[h] < 0:
            for other in range(h, len(rows)):
                if labels[other] >= 0 or rows[other].shape != rows[h].shape:
                    continue
                sine = np.linalg.norm(rows[other] - rows[h] @ (rows[h].T @ rows[other]), 2)
                if sine < SAME_GROUP:
                    labels[other] = count
            count += 1
    return labels


class ScoreQueries:
    """Queries ``(x_1 .. x_m, 0 .. 0, t)``: m random tokens at the first positions, zero tokens up to the
    length asked, the final token t last; per head the weights of the m tokens and of t (the zero tokens
    add nothing to the values, so their weights come out as one lump), kept with the whole answers."""

    def __init__(self, boundary, split, c, d, m, unit, rng):
        self.boundary, self.split, self.c, self.d, self.m, self.unit, self.rng = boundary, split, c, d, m, unit, rng
        self.others, self.finals, self.lengths, self.answers, self.weights = [], [], [], [], []

    def tokens(self, count: int, scale: float) -> np.ndarray:
        return exact_tokens(self.rng.standard_normal((count, self.d)) * scale / np.sqrt(self.d), self.unit)

    def sequence(self, others: np.ndarray, final: np.ndarray, length: int) -> np.ndarray:
        X = np.zeros((length, self.d))
        X[:self.m], X[-1] = others, final
        return X

    def ask(self, others: np.ndarray, finals: np.ndarray, lengths: np.ndarray, description: str, keep: bool = True):
        d, m = self.d, self.m
        sequences = [self.sequence(o, t, n) for o, t, n in zip(others, finals, lengths)]
        answers = np.asarray(self.boundary.ask(sequences, description, whole=True), dtype=np.float64)
        weights = [np.empty((len(others), m + 1)) for _ in self.split.P]
        for padded in (False, True):
            rows = np.flatnonzero((lengths > m + 1) == padded)
            if not len(rows):
                continue
            parts = [others[rows]] + ([np.zeros((len(rows), 1, d))] if padded else []) + [finals[rows, None]]
            solved = chunk_weights(self.split, np.concatenate(parts, axis=1), answers[rows], self.c)
            for h, a in enumerate(solved):
                weights[h][rows] = np.concatenate([a[:, :m], a[:, -1:]], axis=1)
        if keep:
            self.others.append(others), self.finals.append(finals), self.lengths.append(lengths)
            self.answers.append(answers), self.weights.append(weights)
        return weights

    def offsets(self, lengths: np.ndarray) -> np.ndarray:
        return lengths[:, None] - 1 - np.arange(self.m)[None]

    def sequences(self):
        for others, finals, lengths, answers in zip(self.others, self.finals, self.lengths, self.answers):
            for o, t, n, f in zip(others, finals, lengths, answers):
                yield self.sequence(o, t, n), f


def pilot_scale(queries: ScoreQueries, d: int, m: int) -> float:
    """The scores' token scale: three rounds of eight pilot queries, each scaling the tokens towards
    log-ratios of RMS ``SCORE_SPREAD`` (large enough to be read, small enough that no weight vanishes)."""
    scale = np.sqrt(d)
    for _ in range(3):
        weights = queries.ask(queries.tokens(8 * m, scale).reshape(8, m, d), queries.tokens(8, scale),
                              np.full(8, m + 1), "rotary split: pilot queries for the scores' scale", keep=False)
        rms = np.sqrt(np.mean([np.mean(log_ratios(a)[0] ** 2) for a in weights]))
        if not np.isfinite(rms) or rms <= 0:
            raise SplitUnavailable("the pilot queries' attention weights show no scores (log-ratios of RMS "
                                   f"{rms:.3g}): the heads attend uniformly at every token scale tried")
        scale *= min(4.0, np.sqrt(SCORE_SPREAD / rms))
    return float(scale)


def phase_a(queries, labels, r, m, scale, lengths, progress=None):
    """Each offset's score vector ``g_{h,delta}(t) = K^T R(delta)^T q_h(t)`` and intercept in full, on
    ``PHASE_A_FINALS`` final tokens, at the m consecutive offsets before each query length of ``lengths``;
    per group the key space (their span), the generator ``T`` of the offsets (``gamma_{delta+1} = T
    gamma_delta`` in key coordinates), its canonical basis and angles, and the key bias from the intercepts.
    Returns ``(keys, key_bias, angles, diagnostics)``, dictionaries by group."""
    d, heads = queries.d, len(labels)
    per_final = int(np.ceil(PHASE_A_OVERSAMPLE * (d + 1)))
    vectors, intercepts = [[] for _ in range(heads)], [[] for _ in range(heads)]
    for index, t in enumerate(queries.tokens(PHASE_A_FINALS, scale)):
        for length in lengths:
            note_progress(progress, f"rotary split: phase A, final token {index + 1}/{PHASE_A_FINALS}, {length} tokens")
            others = queries.tokens(per_final * m, scale).reshape(per_final, m, d)
            weights = queries.ask(others, np.repeat(t[None], per_final, 0), np.full(per_final, length),
                                  "rotary split: phase A (each offset's score vector)")
            for h, a in enumerate(weights):
                ratios, weight = log_ratios(a)
                ok = weight[:, 0] > 0
                if ok.sum() <= d + 1:
                    raise SplitUnavailable(f"phase A: head {h} left {int(ok.sum())} of {per_final} queries with "
                                           f"readable weights (at least {d + 2} needed): its scores saturate")
                solved = [np.linalg.lstsq(np.c_[others[ok, i], np.ones(ok.sum())], ratios[ok, i], rcond=None)[0]
                          for i in range(m)]
                vectors[h].append(np.array([s[:d] for s in solved])[::-1])  # rows: offsets length - m .. length - 1
                intercepts[h].append(np.array([s[d] for s in solved])[::-1])
    keys, key_bias, angles, diagnostics = {}, {}, {}, {}
    for g in sorted(set(labels)):
        members = [h for h in range(heads) if labels[h] == g]
        stacked = np.concatenate([v for h in members for v in vectors[h]])
        _, S, Vt = np.linalg.svd(stacked, full_matrices=False)
        basis = Vt[:r].T
        before = np.concatenate([v[:-1] @ basis for h in members for v in vectors[h]])
        after = np.concatenate([v[1:] @ basis for h in members for v in vectors[h]])
        generator = np.linalg.lstsq(before, after, rcond=None)[0].T
        C, theta, modulus = rotation_basis(generator)
        if C.shape != (r, r) or len(theta) != r // 2 or not modulus <= GENERATOR_MODULUS:
            raise SplitUnavailable(f"phase A: the offsets' generator of head group {g} is no rotation of {r // 2} "
                                   f"blocks (eigenvalues off the unit circle by {modulus:.3g}): its key space or its "
                                   "rotations are not what the rotary model says")
        rows = np.concatenate([v[1:] @ basis - v[:1] @ basis for h in members for v in vectors[h]])
        rhs = np.concatenate([c[1:] - c[0] for h in members for c in intercepts[h]])
        beta = np.linalg.lstsq(rows, rhs, rcond=None)[0]
        keys[g], key_bias[g], angles[g] = C.T @ basis.T, C.T @ beta, theta
        diagnostics[g] = {"key_gap": float(S[r] / S[r - 1]) if len(S) > r else 0.0, "modulus_error": float(modulus)}
    return keys, key_bias, angles, diagnostics


def phase_b(queries, labels, keys, key_bias, angles, r, m, scale, design, longest, progress=None):
    """Each final token's query ``q_h(t)`` in the canonical key coordinates (r unknowns a head, the
    offsets' rotations known), then ``q_h(t) = Q_h t + b_h`` over the final tokens: ``(Q, b)``.
    ``design``: (final tokens over d + 1, equations per unknown), :data:`DESIGN_B`."""
    d, heads = queries.d, len(labels)
    count = int(np.ceil(design[0] * (d + 1)))
    per_final = int(np.ceil(design[1] * r / m))
    finals = queries.tokens(count, scale)
    solved = [[] for _ in range(heads)]
    for index, t in enumerate(finals):
        if index % 16 == 0:
            note_progress(progress, f"rotary split: phase B, final token {index + 1}/{count}")
        lengths = np.array([queries.rng.integers(m + 1, longest + 1) if k < per_final * PHASE_B_LONG_SHARE else m + 1
                            for k in range(per_final)])
        others = queries.tokens(per_final * m, scale).reshape(per_final, m, d)
        weights = queries.ask(others, np.repeat(t[None], per_final, 0), lengths,
                              "rotary split: phase B (each final token's queries)")
        offsets = queries.offsets(lengths)
        for h, a in enumerate(weights):
            g = labels[h]
            ratios, weight = log_ratios(a)
            ok = weight[:, 0] > 0
            k_i = others[ok] @ keys[g].T + key_bias[g]
            rows = np.einsum("qkr,qkrs->qks", k_i, rotations(offsets[ok][..., None] * angles[g], r))
            rows -= keys[g] @ t + key_bias[g]
            solved[h].append(np.linalg.lstsq(rows.reshape(-1, r), ratios[ok].reshape(-1), rcond=None)[0])
    design_matrix = np.c_[finals, np.ones(count)]
    Q, b = np.empty((heads, r, d)), np.empty((heads, r))
    for h in range(heads):
        fit = np.linalg.lstsq(design_matrix, np.array(solved[h]), rcond=None)[0]
        Q[h], b[h] = fit[:d].T, fit[d]
    return Q, b


def gauss_newton_step(normal: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """The Gauss-Newton step ``-(J^T J)^+ J^T res`` from the normal equations, columns scaled to unit
    diagonal and solved by eigendecomposition with ``STEP_CUT``."""
    scale = np.sqrt(np.maximum(np.diagonal(normal), 1e-300))
    values, vectors = np.linalg.eigh(normal / scale[:, None] / scale[None])
    keep = values > values.max() * STEP_CUT
    return -(vectors[:, keep] @ ((vectors[:, keep].T @ (gradient / scale)) / values[keep])) / scale


def refine_log_ratios(queries, labels, Q, b, keys, key_bias, angles, r, m, steps=LOG_RATIO_STEPS, progress=None):
    """Gauss-Newton on every log-ratio, group by group (a group's heads share K, k and theta; each head
    its Q_h, b_h): closed-form Jacobian, steps by :func:`gauss_newton_step`, each kept only where it lowers
    the misfit. Returns the refined parameters (new arrays and dictionaries) and each group's RMS misfit."""
    Q, b, keys, key_bias, angles = Q.copy(), b.copy(), dict(keys), dict(key_bias), dict(angles)
    others, finals = np.concatenate(queries.others), np.concatenate(queries.finals)
    offsets = queries.offsets(np.concatenate(queries.lengths)).astype(np.float64)
    weights = [np.concatenate([w[h] for w in queries.weights]) for h in range(len(labels))]
    n, d = finals.shape
    misfits = {}
    for g in sorted(set(labels)):
        members = [h for h in range(len(labels)) if labels[h] == g]
        H = len(members)
        bounds = np.cumsum([0, H * r * d, H * r, r * d, r, r // 2])
        data = [log_ratios(weights[h]) for h in members]

        def system(x, jacobian=True):
            """The weighted residuals (H n m,) and, with ``jacobian``, the normal equations ``(J^T J, J^T res)``
            accumulated head by head (one head's Jacobian at a time: d = 64 would hold GBs at once)."""
            Qg, bg = x[:bounds[1]].reshape(H, r, d), x[bounds[1]:bounds[2]].reshape(H, r)
            K, k, theta = x[bounds[2]:bounds[3]].reshape(r, d), x[bounds[3]:bounds[4]], x[bounds[4]:]
            R = rotations(offsets[..., None] * theta, r)
            k_i, k_t = others @ K.T + k, finals @ K.T + k
            res = np.empty((H, n, m))
            normal, gradient = (np.zeros((bounds[-1], bounds[-1])), np.zeros(bounds[-1])) if jacobian else (None, None)
            dR = rotations(offsets[..., None] * theta, r, derivative=True) * offsets[..., None, None] if jacobian else None
            for j, (ratios, weight) in enumerate(data):
                q = finals @ Qg[j].T + bg[j]
                Rq = np.einsum("nmab,nb->nma", R, q)
                res[j] = weight * ((k_i * Rq).sum(-1) - (k_t * q).sum(-1)[:, None] - ratios)
                if not jacobian:
                    continue
                J = np.zeros((n, m, bounds[-1]))
                u = np.einsum("nmab,nma->nmb", R, k_i) - k_t[:, None]
                J[:, :, j * r * d:(j + 1) * r * d] = (weight[..., None, None] * u[..., None]
                                                      * finals[:, None, None, :]).reshape(n, m, r * d)
                J[:, :, bounds[1] + j * r:bounds[1] + (j + 1) * r] = weight[..., None] * u
                J[:, :, bounds[2]:bounds[3]] = (weight[..., None, None] * (Rq[..., None] * others[:, :, None, :]
                                                - q[:, None, :, None] * finals[:, None, None, :])).reshape(n, m, r * d)
                J[:, :, bounds[3]:bounds[4]] = weight[..., None] * (Rq - q[:, None])
                dRq = np.einsum("nmab,nb->nma", dR, q)
                J[:, :, bounds[4]:] = weight[..., None] * (k_i * dRq).reshape(n, m, r // 2, 2).sum(-1)
                J = J.reshape(n * m, -1)
                normal += J.T @ J
                gradient += J.T @ res[j].ravel()
            return res.ravel(), normal, gradient

        x = np.concatenate([Q[members].ravel(), b[members].ravel(), keys[g].ravel(), key_bias[g], angles[g]])
        for step in range(steps):
            res, normal, gradient = system(x)
            note_progress(progress, f"rotary split: log-ratio fit, group {g + 1}, step {step + 1}, "
                                    f"misfit {np.sqrt(np.mean(res ** 2)):.3g}")
            trial = x + gauss_newton_step(normal, gradient)
            if not np.sqrt(np.mean(system(trial, False)[0] ** 2)) < np.sqrt(np.mean(res ** 2)):
                break
            x = trial
        misfits[g] = float(np.sqrt(np.mean(system(x, False)[0] ** 2)))
        Q[members], b[members] = x[:bounds[1]].reshape(H, r, d), x[bounds[1]:bounds[2]].reshape(H, r)
        keys[g], key_bias[g], angles[g] = (x[bounds[2]:bounds[3]].reshape(r, d), x[bounds[3]:bounds[4]],
                                           x[bounds[4]:])
    return Q, b, keys, key_bias, angles, misfits


@dataclass
class SplitRefinement:
    """What the rotary split fitted: ``groups`` (each head's group label), ``log_ratio_misfits`` (each
    group's RMS log-ratio misfit after its Gauss-Newton fit), ``whole_misfits`` (the whole-answer fit's
    relative RMS misfit before each step and after the last; empty where the layer has more than
    ``WHOLE_MEMORY`` would not hold its products' state), ``selection_misfits`` (the largest relative
    misfit on fresh queries of the model before and after it) and ``whole_kept`` (whether the fit was
    kept: it lowered that misfit), ``parameters`` (the whole-answer fit's count), ``phase_a``
    (per group the key space's gap and the generator's modulus error), ``score_scale`` (the phase
    queries' token scale from the pilots), ``queries`` (by step)."""

    groups: list = field(default_factory=list)
    log_ratio_misfits: list = field(default_factory=list)
    whole_misfits: list = field(default_factory=list)
    selection_misfits: list = field(default_factory=list)
    whole_kept: bool = False
    parameters: int = 0
    phase_a: list = field(default_factory=list)
    score_scale: float = float("nan")
    queries: dict = field(default_factory=dict)


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class RotarySplitExtraction(RotaryExtraction):
    """Result of ``extract(..., schedule="rotary-split")``: the fields of
    :class:`~mhaextract.rotary.learn.RotaryExtraction` (``model`` the whole layer), with
    ``error_estimate`` the largest output error expected at every position of fresh sequences of up to
    ``HOLDOUT_LONGEST`` tokens at the token scale, relative to each query's largest output (ten times
    the held-out queries' largest misfit, :func:`~mhaextract.vector.learn.error_estimate`),
    ``answers_residual`` the RMS misfit on the fitted whole answers relative to their RMS, and
    ``refinement`` a :class:`SplitRefinement`.

    Examples
    --------
    >>> import mhaextract as mx
    >>> layer = mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=3, d_out=8)
    >>> result = mx.extract(mx.SimulatedOracle(layer), d=8, heads=2, positions="rotary",
    ...                     schedule="rotary-split", seed=1)
    >>> result.schedule, result.ok, bool(mx.compare(result.model, layer).max_rel < 1e-11)
    ('rotary-split', True, True)
    """

    error_measure: ClassVar[str] = "outputs"


def _model(labels, Q, b, keys, key_bias, angles, V, c, window) -> RotaryAttention:
    per_head = lambda table: np.stack([table[g] for g in labels])  # noqa: E731
    return RotaryAttention(Q, per_head(keys), per_head(angles), V, c, b=b, window=window,
                           key_bias=per_head(key_bias))


def extract_rotary_split(boundary, d: int, heads: int, seed=None, *, token_scale: float | None = None,
                         rank: int | None = None, verify_length: int | None = None, window_limit: int = 4096,
                         progress=None, token_bound: float | None = None) -> RotaryExtraction:
    """The run of the module docstring on ``boundary`` (whole float64 or float32 answers; its checks
    unreported: ``extract`` raises or warns), or SplitUnavailable before any model exists. ``token_scale``:
    the value map's, the held-out queries' and the verification's token norm (default ``sqrt(d)``, unit
    variance tokens); ``rank``: the heads' width where known (a split that finds another is refused)."""
    started = time.perf_counter()
    scale = float(np.sqrt(d) if token_scale is None else token_scale)
    refinement, counted = SplitRefinement(), boundary.queries

    def count(step):
        nonlocal counted
        refinement.queries[step], counted = boundary.queries - counted, boundary.queries

    constant = np.asarray(boundary.ask([np.zeros((1, d))], "rotary split: the output constant", whole=True))
    if constant.ndim != 2 or constant.shape[1] < 2:
        raise SplitUnavailable("the oracle answers one number per query: the split needs whole outputs")
    answer_format(boundary.answer_unit)  # answers coarser than float32: refused before the value map
    note_progress(progress, "rotary split: the value map")
    values_rng = spawn_rng(seed, STREAMS["values"])
    values = value_map(boundary, values_rng, d, scale)
    more_bases(values, boundary, values_rng, d, scale, 3)
    unit = boundary.answer_unit
    answer_dtype = answer_format(unit)
    c, d_out = np.asarray(values.c, dtype=np.float64), len(values.c)
    note_progress(progress, "rotary split: saturated queries for the heads' output subspaces")
    split = output_subspaces(_Saturated(boundary, values, unit), spawn_rng(seed, STREAMS["split"]), d, d_out, scale,
                             heads, values, unit, lambda ranks: "")
    count("split")
    widths = sorted(set(split.ranks))
    if len(widths) != 1 or widths[0] % 2:
        raise SplitUnavailable(f"the heads' value ranks {split.ranks}: the rotary split needs heads of one even "
                               "width (their value maps of full rank)")
    r = widths[0]
    if rank is not None and rank != r:
        raise SplitUnavailable(f"the heads' values have rank {r}, not the rank={rank} given")
    search = find_window(boundary, spawn_rng(seed, STREAMS["window"]), scale,
                         float(boundary.vectors.scalars(c[None])[0]), window_limit, token_bound)
    count("window")
    m = (r + 1) // 2
    if search.undetermined is not None:
        raise SplitUnavailable(f"the window search could not decide at {search.undetermined} tokens")
    window = search.window
    if window is not None and window < m + 2:
        raise SplitUnavailable(f"a window of {window} tokens: the split's score queries need m + 2 = {m + 2}")
    labels = head_groups(split.P)
    refinement.groups = labels
    queries = ScoreQueries(boundary, split, c, d, m, unit, spawn_rng(seed, STREAMS["scores"]))
    refinement.score_scale = pilot_scale(queries, d, m)
    longest = PHASE_B_LONGEST if window is None else min(PHASE_B_LONGEST, window)
    lengths = sorted({min(max(length, m + 1), longest) for length in (m + 1,) + PHASE_A_LENGTHS})
    keys, key_bias, angles, diagnostics = phase_a(queries, labels, r, m, refinement.score_scale, lengths, progress)
    refinement.phase_a = [diagnostics[g] for g in sorted(diagnostics)]
    count("phase A")
    Q, b = phase_b(queries, labels, keys, key_bias, angles, r, m, refinement.score_scale, DESIGN_B[answer_dtype],
                   longest, progress)
    count("phase B")
    Q, b, keys, key_bias, angles, misfits = refine_log_ratios(queries, labels, Q, b, keys, key_bias, angles, r, m,
                                                              progress=progress)
    refinement.log_ratio_misfits = [misfits[g] for g in sorted(misfits)]
    O, P = np.stack(split.O), np.stack(split.P)
    groups = len(keys)
    refinement.parameters = parameter_count(d, d_out, heads, groups, r)
    pairs = list(queries.sequences()) + list(zip(values.sequences, values.answers))
    sequences, answers = [X for X, _ in pairs], np.stack([np.asarray(f, dtype=np.float64) for _, f in pairs])
    model = _model(labels, Q, b, keys, key_bias, angles, np.einsum("hor,hrd->hod", O, P), c, window)
    if kept_bytes(sum(len(X) for X in sequences), heads, groups, r) <= WHOLE_MEMORY:
        stack = lambda table: np.stack([table[g] for g in range(groups)])  # noqa: E731
        fitted, refinement.whole_misfits = refine_whole(
            sequences, answers, dict(Q=Q, b=b, K=stack(keys), k=stack(key_bias), t=stack(angles), O=O, P=P, c=c),
            labels, seed=int(spawn_rng(seed, STREAMS["whole"]).integers(2 ** 31)), progress=progress)
        whole = _model(labels, fitted["Q"], fitted["b"], *({g: fitted[name][g] for g in range(groups)}
                                                          for name in ("K", "k", "t")),
                       np.einsum("hor,hrd->hod", fitted["O"], fitted["P"]), fitted["c"], window)
        # the fit lowers the misfit on the queries it fits; it is kept where it does so on fresh ones too
        # (directions the phase queries leave loose can move): SELECTION_QUERIES of their own, apart from
        # the estimate's
        selection = fresh_queries(spawn_rng(seed, STREAMS["selection"]),
                                  spread_lengths(HOLDOUT_QUERIES, HOLDOUT_LONGEST), d, scale, (1.0,))
        chosen = np.asarray(boundary.ask(selection, "rotary split: fresh queries to keep the whole-answer fit or not",
                                         whole=True), dtype=np.float64)
        refinement.selection_misfits = [float(relative_misfits(candidate, selection, chosen).max())
                                        for candidate in (model, whole)]
        refinement.whole_kept = refinement.selection_misfits[1] <= refinement.selection_misfits[0]
        model = whole if refinement.whole_kept else model
    predicted = np.concatenate([model(sequences[s:s + 256]) for s in range(0, len(sequences), 256)])
    residual = float(np.sqrt(np.mean((predicted - answers) ** 2) / np.mean(answers ** 2)))
    noise_checks = []
    if answer_dtype == "float64" and RESIDUAL_UNITS * unit < residual <= RESIDUAL_UNITS * FORMAT_UNITS["float32"]:
        # float64 answers that the fitted model misses at float32's level: computed in float32 inside
        # (transformers' rotary angles, the eager softmax); judged from here on at float32's unit
        noise_checks.append(taken_as_float32(residual, RESIDUAL_UNITS * unit, "the split's fitted answers miss the "
                                             "model by that much, relative RMS; exact float64 answers leave about "
                                             "1e-15", "a float64 layer that computes its rotary angles or softmax in "
                                             "float32 gives (transformers' own rotary embedding, the eager softmax)"))
        unit, limit_format = FORMAT_UNITS["float32"], "float32"
    else:
        limit_format = answer_dtype
    holdout = fresh_queries(spawn_rng(seed, STREAMS["holdout"]), spread_lengths(HOLDOUT_QUERIES, HOLDOUT_LONGEST), d,
                            scale, (1.0,))
    held = np.asarray(boundary.ask(holdout, "rotary split: held-out queries for the error estimate", whole=True),
                      dtype=np.float64)
    estimate = error_estimate(float(relative_misfits(model, holdout, held).max()), unit, HOLDOUT_LONGEST)
    limit = estimate_limit(limit_format, unit)
    checks = noise_checks + [search.check(m + 2)] + split_checks(
        split, residual, RESIDUAL_UNITS * unit, estimate, limit, "the phase queries' and value map's whole answers",
        f"fresh queries up to {HOLDOUT_LONGEST} tokens at the token scale ({HOLDOUT_QUERIES} held out)",
        f"; head groups {labels}")
    verification = None
    if verify_length is None or verify_length > 0:
        longest_verified = verify_length or max(256, 4 * (window or 0))
        long_queries = ask_long_verification(boundary, spawn_rng(seed, STREAMS["verify"]), scale, longest_verified)
        largest = float(np.abs(long_queries.whole).max())
        check, verification = long_queries.judge(model, estimate, residual, 0.0, largest, unit, HOLDOUT_LONGEST,
                                                 seed=seed)
        checks.append(check)
    return RotarySplitExtraction(
        model=model, heads=heads, d=d, seed=seed, schedule="rotary-split", answer_dtype=answer_dtype,
        queries=boundary.queries + boundary.replayed, queries_asked=boundary.queries,
        queries_replayed=boundary.replayed, max_query_length=boundary.max_query_length,
        verification_queries=0 if verification is None else verification.queries,
        verification_length=0 if verification is None else verification.lengths[1],
        window=window, window_search=search, token_scale=scale, error_estimate=float(estimate),
        answers_residual=residual, seconds=time.perf_counter() - started, checks=checks, verification=verification,
        refinement=refinement, diagnostics={"route": "split", "value_ranks": list(split.ranks),
                                            "split_conditioning": float(split.conditioning)})
