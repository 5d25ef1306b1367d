"""Prototype: a rotary layer from whole answers split by head (docs/algorithm.md, 'Rotary layers from
whole answers (derived, prototyped)'). Not the library's route yet: the measurements its derivation
rests on, on the trained zoo's rotary layers (tests/zoo.py), the replacement judged against the exact
layer in float64 at every position of 30 fresh sequences of 1..128 unit-variance tokens.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/prototype_rotary_split.py \\
        --layers qwen2-d32-h4/0 qwen2-d32-h4/1 llama-d32-h4/0 --dtypes float64 float32 --whole
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/prototype_rotary_split.py \\
        --layers mistral-d32-h4/0 llama-d32-h4/1 mistral-d32-h4/1 --dtypes float64 float32 --whole
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/prototype_rotary_split.py --layers qwen2-d32-h4/0 \\
        --dtypes float32 --true-split
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/prototype_rotary_split.py \\
        --layers qwen2-d64-h4/0 qwen2-d64-h4/1 llama-d64-h4/0 --dtypes float64
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/prototype_rotary_split.py \\
        --layers qwen2-d64-h4/0 qwen2-d64-h4/1 llama-d64-h4/0 --dtypes float32

The extraction path asks the layer's oracle (``TorchOracle`` of the layer as its model runs it) and
nothing else; the weights are read only to judge (``--true-split`` replaces the split by the layer's
own output subspaces, a white-box diagnostic). Steps: the window by the rotary route's search
(:func:`~mhaextract.rotary.window.find_window`); the value map and the split of
:mod:`mhaextract.vector` (unchanged); heads grouped by their value row spaces; pilots for the scores'
token scale; phase A (each offset's score vector in full on a few final tokens, at offsets
1..m and the m before 64 and 128 tokens: the key space, the generator of the offsets and the key
bias); phase B (each further final token's query in the key coordinates); a Gauss-Newton fit of
every log-ratio, group by group; with ``--whole`` a Gauss-Newton fit of every parameter, values
included, to the whole answers (closed-form Jacobians, dense normal equations: d = 32 only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mhaextract as mx
from mhaextract.oracle.boundary import OracleBoundary
from mhaextract.rotary.structure import rotation_basis
from mhaextract.run.validation import spawn_rng
from mhaextract.models.rotary import rotation_blocks
from mhaextract.rotary.window import find_window
from mhaextract.vector.scores import _chunk_weights, _equations
from mhaextract.vector.split import _Saturated, exact_tokens, output_subspaces
from mhaextract.vector.values import more_bases, value_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

UNITS = {"float64": 2.0 ** -53, "float32": 2.0 ** -24}
SCORE_SPREAD = 0.35          # the log-ratios' RMS the pilots aim at (as the vector route's scores)
SAME_GROUP = 1e-3            # largest sine between two heads' value row spaces in one group
#: Phase B's (final tokens over d + 1, equations per unknown) by the answers' format: float32 answers
#: carry more noise per weight, and their scores' error sets the output error (qwen2-d32-h4/0 after the
#: whole-answer fit: 7.3e-6 with (1.5, 3), 1.7e-6 with (4, 8)).
DESIGN_B = {"float64": (1.5, 3.0), "float32": (4.0, 8.0)}


def rotations(angles: np.ndarray, r: int, derivative: bool = False) -> np.ndarray:
    """``R(phi)`` (or ``dR/dphi`` block by block: ``rot(phi + pi / 2)``) for angles (..., r/2): (..., r, r),
    the model's blocks (:func:`~mhaextract.models.rotary.rotation_blocks`) on the diagonal."""
    blocks = rotation_blocks(angles + np.pi / 2 if derivative else angles)
    out = np.zeros(angles.shape[:-1] + (r, r))
    for j in range(r // 2):
        out[..., 2 * j:2 * j + 2, 2 * j:2 * j + 2] = blocks[..., j, :, :]
    return out


def head_groups(split) -> list[int]:
    """Heads that share a key/value projection have one value row space ``row(P_h)``: group labels."""
    rows = [np.linalg.qr(P.T)[0] for P in split.P]
    labels, count = [-1] * len(rows), 0
    for h in range(len(rows)):
        if labels[h] < 0:
            for other in range(h, len(rows)):
                sine = np.linalg.norm(rows[other] - rows[h] @ (rows[h].T @ rows[other]), 2)
                if labels[other] < 0 and sine < SAME_GROUP:
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

    def ask(self, others: np.ndarray, finals: np.ndarray, lengths: np.ndarray, keep: bool = True):
        d, m = self.d, self.m
        sequences = [self.sequence(o, t, n) for o, t, n in zip(others, finals, lengths)]
        answers = np.asarray(self.boundary.ask(sequences, "rotary scores", whole=True))
        weights = [np.empty((len(others), m + 1)) for _ in self.split.P]
        for padded in (False, True):
            rows = np.flatnonzero((lengths > m + 1) == padded)
            if not len(rows):
                continue
            parts = [others[rows]] + ([np.zeros((len(rows), 1, d))] if padded else []) + [finals[rows, None]]
            solved = _chunk_weights(self.split, np.concatenate(parts, axis=1), answers[rows], self.c)
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
    scale = np.sqrt(d)
    for _ in range(3):
        weights = queries.ask(queries.tokens(8 * m, scale).reshape(8, m, d), queries.tokens(8, scale),
                              np.full(8, m + 1), keep=False)
        rms = np.sqrt(np.mean([np.mean(_equations(a)[0] ** 2) for a in weights]))
        scale *= min(4.0, np.sqrt(SCORE_SPREAD / rms))
    return scale


def phase_a(queries, labels, r, m, scale, finals_count, oversample, lengths):
    """Each offset's score vector ``g_{h,delta}(t) = K^T R(delta)^T q_h(t)`` and intercept in full, on a
    few final tokens, at the m consecutive offsets before each query length of ``lengths``; per group
    the key space (their span), the generator ``T`` of the offsets (``gamma_{delta+1} = T gamma_delta``
    in key coordinates) and the key bias from the intercepts."""
    d, heads = queries.d, len(labels)
    per_final = int(np.ceil(oversample * (d + 1)))
    vectors, intercepts = [[] for _ in range(heads)], [[] for _ in range(heads)]
    for t in queries.tokens(finals_count, scale):
        for length in lengths:
            others = queries.tokens(per_final * m, scale).reshape(per_final, m, d)
            weights = queries.ask(others, np.repeat(t[None], per_final, 0), np.full(per_final, length))
            for h, a in enumerate(weights):
                ratios, weight = _equations(a)
                ok = weight[:, 0] > 0
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
        rows = np.concatenate([v[1:] @ basis - v[:1] @ basis for h in members for v in vectors[h]])
        rhs = np.concatenate([c[1:] - c[0] for h in members for c in intercepts[h]])
        beta = np.linalg.lstsq(rows, rhs, rcond=None)[0]
        keys[g], key_bias[g], angles[g] = C.T @ basis.T, C.T @ beta, theta
        diagnostics[g] = dict(gap=(S[r - 1] / S[0], S[r] / S[0] if len(S) > r else 0.0), modulus=modulus)
    return keys, key_bias, angles, diagnostics


def phase_b(queries, labels, keys, key_bias, angles, r, m, scale, finals_factor, oversample, longest, long_share):
    """Each final token's query ``q_h(t)`` in the canonical key coordinates (r unknowns a head, the
    offsets' rotations known), then ``q_h(t) = Q_h t + b_h`` over the final tokens."""
    d, heads = queries.d, len(labels)
    count = int(np.ceil(finals_factor * (d + 1)))
    per_final = int(np.ceil(oversample * r / m))
    finals = queries.tokens(count, scale)
    solved = [[] for _ in range(heads)]
    for t in finals:
        lengths = np.array([queries.rng.integers(m + 1, longest + 1) if k < per_final * long_share else m + 1
                            for k in range(per_final)])
        others = queries.tokens(per_final * m, scale).reshape(per_final, m, d)
        weights = queries.ask(others, np.repeat(t[None], per_final, 0), lengths)
        offsets = queries.offsets(lengths)
        for h, a in enumerate(weights):
            g = labels[h]
            ratios, weight = _equations(a)
            ok = weight[:, 0] > 0
            k_i = others[ok] @ keys[g].T + key_bias[g]
            rows = np.einsum("qkr,qkrs->qks", k_i, rotations(offsets[ok][..., None] * angles[g], r))
            rows -= keys[g] @ t + key_bias[g]
            solved[h].append(np.linalg.lstsq(rows.reshape(-1, r), ratios[ok].reshape(-1), rcond=None)[0])
    design = np.c_[finals, np.ones(count)]
    Q, b = np.empty((heads, r, d)), np.empty((heads, r))
    for h in range(heads):
        fit = np.linalg.lstsq(design, np.array(solved[h]), rcond=None)[0]
        Q[h], b[h] = fit[:d].T, fit[d]
    return Q, b


#: Directions of the column-scaled normal matrix below this fraction of its largest eigenvalue are left
#: out of a step: the gauge (a scaled rotation per block; O_h, P_h up to an r x r factor) and anything the
#: answers do not fix.
STEP_CUT = 1e-13


def gauss_newton_step(normal: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """The Gauss-Newton step ``-(J^T J)^+ J^T res`` from the normal equations, columns scaled to unit
    diagonal and solved by eigendecomposition with ``STEP_CUT``."""
    scale = np.sqrt(np.maximum(np.diagonal(normal), 1e-300))
    values, vectors = np.linalg.eigh(normal / scale[:, None] / scale[None])
    keep = values > values.max() * STEP_CUT
    return -(vectors[:, keep] @ ((vectors[:, keep].T @ (gradient / scale)) / values[keep])) / scale


def refine_log_ratios(queries, labels, Q, b, keys, key_bias, angles, r, m, steps):
    """Gauss-Newton on every log-ratio, group by group (a group's heads share K, k and theta; each head
    its Q_h, b_h): closed-form Jacobian, steps by :func:`gauss_newton_step`. Returns the refined
    parameters and each group's RMS misfit."""
    others, finals = np.concatenate(queries.others), np.concatenate(queries.finals)
    offsets = queries.offsets(np.concatenate(queries.lengths)).astype(np.float64)
    weights = [np.concatenate([w[h] for w in queries.weights]) for h in range(len(labels))]
    n, d = finals.shape
    misfits = {}
    for g in sorted(set(labels)):
        members = [h for h in range(len(labels)) if labels[h] == g]
        H = len(members)
        sizes = [H * r * d, H * r, r * d, r, r // 2]
        bounds = np.cumsum([0] + sizes)
        data = [_equations(weights[h]) for h in members]

        def system(x, jacobian=True):
            """The weighted residuals (H n m,) and, with ``jacobian``, the normal equations ``(J^T J, J^T res)``
            accumulated head by head (one head's Jacobian at a time: d = 64 would hold GBs at once)."""
            Qg, bg = x[:bounds[1]].reshape(H, r, d), x[bounds[1]:bounds[2]].reshape(H, r)
            K, k, theta = x[bounds[2]:bounds[3]].reshape(r, d), x[bounds[3]:bounds[4]], x[bounds[4]:]
            R = rotations(offsets[..., None] * theta, r)
            dR = rotations(offsets[..., None] * theta, r, derivative=True) * offsets[..., None, None]
            k_i, k_t = others @ K.T + k, finals @ K.T + k
            res = np.empty((H, n, m))
            normal, gradient = (np.zeros((bounds[-1], bounds[-1])), np.zeros(bounds[-1])) if jacobian else (None, None)
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
        for _ in range(steps):
            res, normal, gradient = system(x)
            step = gauss_newton_step(normal, gradient)
            if np.sqrt(np.mean(system(x + step, False)[0] ** 2)) >= np.sqrt(np.mean(res ** 2)):
                break
            x = x + step
        misfits[g] = float(np.sqrt(np.mean(system(x, False)[0] ** 2)))
        Q[members], b[members] = x[:bounds[1]].reshape(H, r, d), x[bounds[1]:bounds[2]].reshape(H, r)
        keys[g], key_bias[g], angles[g] = (x[bounds[2]:bounds[3]].reshape(r, d), x[bounds[3]:bounds[4]],
                                           x[bounds[4]:])
    return Q, b, keys, key_bias, angles, misfits


NAMES = ("Q", "b", "K", "k", "t", "O", "P", "c")


def whole_answers(p: dict, labels, X: np.ndarray, jacobian: bool = True):
    """The layer's answers ``f`` (B, d_out) on sequences X (B, N, d) of one length and their Jacobian
    (B, d_out, parameters), parameters in ``NAMES`` order (``t`` the angles, ``O, P`` the values'
    factors). With ``u_j = a_j (x_j - m_h)`` (``m_h`` the head's mean token), ``df/ds_{h,j} = V_h u_j``,
    and the scores' derivatives as in docs/algorithm.md, 'Rotary layers from whole answers (derived,
    prototyped)': ``ds_j/dQ_h = (R_j^T k_j) t^T``, ``ds_j/dK_g = (R_j q) x_j^T``, ``ds_j/dtheta_b =
    delta_j k_{j,b}^T rot'(delta_j theta_b) q_b``; ``df/dO_h = I (x) (P_h m_h)^T``, ``df/dP_h = O_h (x) m_h^T``."""
    Q, b, K, k, t, O, P, c = (p[name] for name in NAMES)
    heads, r, d = Q.shape
    d_out = O.shape[1]
    B, N, _ = X.shape
    starts = np.cumsum([0] + [p[name].size for name in NAMES])
    offsets = np.arange(N - 1, -1, -1, dtype=np.float64)
    f = np.tile(c, (B, 1))
    J = np.zeros((B, d_out, starts[-1])) if jacobian else None
    block = lambda name, index, width: slice(starts[NAMES.index(name)] + index * width,  # noqa: E731
                                             starts[NAMES.index(name)] + (index + 1) * width)
    for h in range(heads):
        g = labels[h]
        R = rotations(offsets[:, None] * t[g], r)
        q = X[:, -1] @ Q[h].T + b[h]
        keys = X @ K[g].T + k[g]
        Rq = np.einsum("nab,Bb->Bna", R, q)
        s = (keys * Rq).sum(-1)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        mean = np.einsum("Bn,Bnd->Bd", a, X)
        coordinates = mean @ P[h].T
        f += coordinates @ O[h].T
        if not jacobian:
            continue
        V = O[h] @ P[h]
        u = a[..., None] * (X - mean[:, None])
        VMQ = np.einsum("od,Bnd,Bnr->Bor", V, u, np.einsum("nab,Bna->Bnb", R, keys))
        J[:, :, block("Q", h, r * d)] += (VMQ[..., None] * X[:, -1][:, None, None, :]).reshape(B, d_out, r * d)
        J[:, :, block("b", h, r)] += VMQ
        J[:, :, block("K", g, r * d)] += np.einsum("od,Bdre->Bore", V, np.einsum("Bnd,Bnr,Bne->Bdre", u, Rq, X)
                                                   ).reshape(B, d_out, r * d)
        J[:, :, block("k", g, r)] += np.einsum("od,Bnd,Bnr->Bor", V, u, Rq)
        dR = rotations(offsets[:, None] * t[g], r, derivative=True) * offsets[:, None, None]
        dRq = np.einsum("nab,Bb->Bna", dR, q)
        J[:, :, block("t", g, r // 2)] += np.einsum("od,Bnd,Bnj->Boj", V, u,
                                                    (keys * dRq).reshape(B, N, r // 2, 2).sum(-1))
        values = np.zeros((B, d_out, d_out, r))
        values[:, np.arange(d_out), np.arange(d_out)] = coordinates[:, None]
        J[:, :, block("O", h, d_out * r)] = values.reshape(B, d_out, d_out * r)
        J[:, :, block("P", h, r * d)] = (O[h][None, :, :, None] * mean[:, None, None, :]).reshape(B, d_out, r * d)
    if jacobian:
        J[:, :, starts[-2]:] = np.eye(d_out)
    return f, J


def refine_whole(sequences, answers, parameters, labels, steps, chunk=32):
    """Gauss-Newton on the whole answers, every parameter (the values as ``O_h P_h``, c): normal equations
    of the closed-form Jacobian (:func:`whole_answers`), a chunk of queries at a time, steps by
    :func:`gauss_newton_step` (d = 32, H = 4: the normal matrix has 3,672^2 entries)."""
    by_length = {}
    for X, f in zip(sequences, answers):
        by_length.setdefault(len(X), []).append((X, f))
    data = [(np.stack([X for X, _ in group]), np.stack([f for _, f in group])) for group in by_length.values()]
    size = float(np.sqrt(np.mean(np.asarray(answers) ** 2)))
    shapes = {name: parameters[name].shape for name in NAMES}

    def unflat(x):
        out, start = {}, 0
        for name in NAMES:
            count = int(np.prod(shapes[name]))
            out[name], start = x[start:start + count].reshape(shapes[name]), start + count
        return out

    def misfit(x):
        p = unflat(x)
        total = sum(float(((whole_answers(p, labels, X[s:s + 256], False)[0] - A[s:s + 256]) ** 2).sum())
                    for X, A in data for s in range(0, len(X), 256))
        return np.sqrt(total / np.asarray(answers).size) / size

    x = np.concatenate([np.asarray(parameters[name], dtype=np.float64).ravel() for name in NAMES])
    history = [misfit(x)]
    for _ in range(steps):
        normal, gradient = np.zeros((len(x), len(x))), np.zeros(len(x))
        p = unflat(x)
        for X, A in data:
            for s in range(0, len(X), chunk):
                f, J = whole_answers(p, labels, X[s:s + chunk])
                J = J.reshape(-1, len(x))
                normal += J.T @ J
                gradient += J.T @ (f - A[s:s + chunk]).ravel()
        step = gauss_newton_step(normal, gradient)
        trial = history[-1]
        for fraction in (1.0, 0.5, 0.25):
            trial = misfit(x + fraction * step)
            if trial < history[-1]:
                x = x + fraction * step
                break
        history.append(min(trial, history[-1]))
        if history[-1] > 0.95 * history[-2]:
            break
    return unflat(x), history


def judge(model, exact, d: int, count: int = 30, seed: int = 99) -> float:
    """Largest error at every position of ``count`` sequences of 1..128 unit-variance tokens, each
    relative to the position's largest output of the exact layer."""
    rng, worst = np.random.default_rng(seed), 0.0
    for _ in range(count):
        X = rng.standard_normal((int(rng.integers(1, 129)), d))
        with torch.no_grad():
            out = exact(torch.from_numpy(X)[None])
        reference = (out[0] if isinstance(out, tuple) else out)[0].numpy()
        mine = np.asarray(model([X[:i + 1] for i in range(len(X))]))
        worst = max(worst, float((np.abs(mine - reference).max(axis=1) / np.abs(reference).max(axis=1)).max()))
    return worst


def run(layer_id: str, dtype_name: str, args) -> dict:
    dtype = getattr(torch, dtype_name)
    unit = UNITS[dtype_name]
    d, heads = zoo.shape(layer_id)
    boundary = OracleBoundary(mx.TorchOracle(zoo.layer_as_run(layer_id, dtype)), d)
    started = time.process_time()
    scale = np.sqrt(d)
    values = value_map(boundary, spawn_rng(args.seed, 41), d, scale)
    more_bases(values, boundary, spawn_rng(args.seed, 40), d, scale, 3)
    split = output_subspaces(_Saturated(boundary, values, unit), spawn_rng(args.seed, 42), d, len(values.c), scale,
                             heads, values, unit, lambda ranks: "")
    split_queries = boundary.queries
    c = values.c
    # the rotary route's own window search (one read-out of the answers); its "undetermined" ends the row loudly
    search = find_window(boundary, np.random.default_rng(2000 + args.seed), scale,
                         float(boundary.vectors.scalars(c[None])[0]), args.longest)
    if search.undetermined is not None:
        raise RuntimeError(f"{layer_id}: the window search could not decide at {search.undetermined} tokens")
    window = search.window
    r = split.ranks[0]
    if args.true_split:  # white box: the layer's own output subspaces and values
        state = {key: v.detach().double().numpy() for key, v in zoo.attention(layer_id, dtype).state_dict().items()}
        kv = zoo.SPECS[layer_id.split("/")[0]].get("H_kv", heads)
        Wo, Wv = state["o_proj.weight"], state["v_proj.weight"]
        bv = state.get("v_proj.bias", np.zeros(Wv.shape[0]))
        group_rows = lambda h: slice((h * kv // heads) * r, (h * kv // heads + 1) * r)  # noqa: E731
        split.O = [np.linalg.qr(Wo[:, h * r:(h + 1) * r])[0] for h in range(heads)]
        split.P = [O.T @ Wo[:, h * r:(h + 1) * r] @ Wv[group_rows(h)] for h, O in enumerate(split.O)]
        split._inverse = split._metric = None
        c = state.get("o_proj.bias", 0.0) + sum(Wo[:, h * r:(h + 1) * r] @ bv[group_rows(h)] for h in range(heads))
    labels = head_groups(split)
    m = (r + 1) // 2
    queries = ScoreQueries(boundary, split, c, d, m, unit, np.random.default_rng(1000 + args.seed))
    scale = pilot_scale(queries, d, m)
    longest = args.longest if window is None else min(args.longest, window)
    lengths = sorted({min(max(length, m + 1), longest) for length in (m + 1,) + tuple(args.lengths_a)})
    keys, key_bias, angles, diagnostics = phase_a(queries, labels, r, m, scale, args.finals_a, args.oversample_a,
                                                  lengths)
    finals_b, oversample_b = DESIGN_B[dtype_name]
    Q, b = phase_b(queries, labels, keys, key_bias, angles, r, m, scale, args.finals_b or finals_b,
                   args.oversample_b or oversample_b, longest, args.long_share)
    V = np.stack([O @ P for O, P in zip(split.O, split.P)])
    exact = zoo.exact_layer(layer_id, dtype)

    def model(Q, b, keys, key_bias, angles, V, c):
        per_head = lambda table: np.stack([table[labels[h]] for h in range(heads)])  # noqa: E731
        return mx.RotaryAttention(Q, per_head(keys), per_head(angles), V, c, b=b, window=window,
                                  key_bias=per_head(key_bias))

    row = dict(layer=layer_id, dtype=dtype_name, split_queries=split_queries, groups=labels, scale=scale, window=window,
               gaps=[diagnostics[g]["gap"] for g in sorted(diagnostics)])
    row["start"] = judge(model(Q, b, keys, key_bias, angles, V, c), exact, d, args.judge)
    Q, b, keys, key_bias, angles, misfits = refine_log_ratios(queries, labels, Q, b, keys, key_bias, angles, r, m,
                                                              args.steps)
    row["queries"] = boundary.queries
    row["log_ratio_misfit"] = max(misfits.values())
    row["refined"] = judge(model(Q, b, keys, key_bias, angles, V, c), exact, d, args.judge)
    row["angles"] = [np.sort(angles[g]).tolist() for g in sorted(angles)]
    if args.whole:
        pairs = list(queries.sequences()) + list(zip(values.sequences, values.answers))
        stack = lambda table: np.stack([table[g] for g in sorted(table)])  # noqa: E731
        fitted, history = refine_whole([X for X, _ in pairs], np.stack([f for _, f in pairs]),
                                       dict(Q=Q, b=b, K=stack(keys), k=stack(key_bias), t=stack(angles),
                                            O=np.stack(split.O), P=np.stack(split.P), c=np.asarray(c, float)),
                                       labels, args.whole_steps)
        table = lambda name: {g: fitted[name][g] for g in range(len(keys))}  # noqa: E731
        whole = model(fitted["Q"], fitted["b"], table("K"), table("k"), table("t"),
                      np.einsum("hor,hrd->hod", fitted["O"], fitted["P"]), fitted["c"])
        row["whole_misfit"] = history
        row["whole"] = judge(whole, exact, d, args.judge)
    row["cpu"] = time.process_time() - started
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="+", default=["qwen2-d32-h4/0"])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--finals-a", type=int, default=3, help="phase A's final tokens")
    parser.add_argument("--oversample-a", type=float, default=3.0, help="phase A's queries per unknown (d + 1)")
    parser.add_argument("--lengths-a", type=int, nargs="*", default=[64, 128],
                        help="phase A's query lengths besides m + 1 (its offsets: the m before each; "
                             "the window bounds them)")
    parser.add_argument("--finals-b", type=float, default=None,
                        help="phase B's final tokens over d + 1 (default: DESIGN_B of the answers' format)")
    parser.add_argument("--oversample-b", type=float, default=None,
                        help="phase B's equations per unknown r (default: DESIGN_B of the answers' format)")
    parser.add_argument("--longest", type=int, default=128, help="phase B's longest query (zero tokens between)")
    parser.add_argument("--long-share", type=float, default=0.5, help="phase B's share of long queries")
    parser.add_argument("--steps", type=int, default=4, help="Gauss-Newton steps on the log-ratios")
    parser.add_argument("--whole", action="store_true", help="then Gauss-Newton on the whole answers")
    parser.add_argument("--whole-steps", type=int, default=4)
    parser.add_argument("--true-split", action="store_true", help="white box: the layer's own split")
    parser.add_argument("--judge", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| layer | answers | queries (split) | start | log-ratios refined | whole answers refined | CPU |")
    print("|---|---|---|---|---|---|---|")
    for layer_id in args.layers:
        for dtype in args.dtypes:
            row = run(layer_id, dtype, args)
            whole = f"{row['whole']:.2g}" if "whole" in row else "-"
            print(f"| {layer_id} | {dtype} | {row['queries']:,} ({row['split_queries']:,}) | {row['start']:.2g} | "
                  f"{row['refined']:.2g} | {whole} | {row['cpu']:.0f} s |", flush=True)
            print(f"<!-- {row} -->", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
