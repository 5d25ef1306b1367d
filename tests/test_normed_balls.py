"""The sublayer models' evaluation in ball arithmetic (issue 63: float64, float32 and balls), against the
sublayer written out in mpmath at twice the bits from the models' own parameters, here in the test."""

import mpmath
import numpy as np
import pytest

import mhaextract as mx
from mhaextract.models.normed import NormedAttention, PostNormAttention


def _norm(x, kind, eps):
    if kind == "layernorm":
        mean = mpmath.fsum(x) / len(x)
        x = [value - mean for value in x]
    scale = mpmath.sqrt(mpmath.fsum(value * value for value in x) / len(x) + mpmath.mpf(eps))
    return [value / scale for value in x]


def _attention(model, Z):
    """c + sum_h V_h sum_i a_{h,i} z_i, a_h = softmax_i(z_i^T W_h z_N + z_i^T u_h) (a read-out: v_h)."""
    final, out = Z[-1], None
    for h in range(model.heads):
        W, u = model.W[h], model.u[h]
        scores = [mpmath.fsum(z[a] * (mpmath.fsum(W[a, b] * final[b] for b in range(len(final))) + u[a])
                              for a in range(len(z))) for z in Z]
        top = max(scores)
        weights = [mpmath.exp(s - top) for s in scores]
        total = mpmath.fsum(weights)
        mean = [mpmath.fsum(w * z[a] for w, z in zip(weights, Z)) / total for a in range(len(final))]
        V = model.V[h] if model.is_vector else model.v[h][None]
        head = [mpmath.fsum(V[o, a] * mean[a] for a in range(len(mean))) for o in range(V.shape[0])]
        out = head if out is None else [x + y for x, y in zip(out, head)]
    constants = np.ravel(model.c)
    return [x + mpmath.mpf(float(c)) for x, c in zip(out, constants)]


def _pre_norm_truth(model: NormedAttention, X):
    basis = model.basis
    Z = [[mpmath.fsum(n[a] * basis[a, j] for a in range(len(n))) for j in range(basis.shape[1])]
         for n in (_norm([mpmath.mpf(float(v)) for v in x], model.norm, model.eps) for x in X)]
    inner = _attention(model.attention, Z)
    R = model.R.reshape(model.d_out, model.d)
    return [y + mpmath.fsum(R[o, a] * mpmath.mpf(float(X[-1][a])) for a in range(model.d)) for o, y in enumerate(inner)]


def _post_norm_truth(model: PostNormAttention, X):
    inner = _attention(model.attention, [[mpmath.mpf(float(v)) for v in x] for x in X])
    z = [y + mpmath.mpf(float(x)) for y, x in zip(inner, X[-1])]
    return [g * n + b for g, n, b in zip(model.gamma, _norm(z, "layernorm", model.eps), model.beta)]


def _relative(got, truth):
    scale = max(abs(t) for t in truth)
    return max(abs(mpmath.mpf(g) - t) for g, t in zip(got, truth)) / scale


@pytest.mark.parametrize("norm, vector", [("layernorm", True), ("rmsnorm", True), ("layernorm", False)])
def test_a_pre_norm_sublayer_in_balls_is_the_sublayer_to_its_bits(norm, vector):
    d = 4
    k = d - 1 if norm == "layernorm" else d
    inner = mx.MultiHeadAttention.random(d=k, heads=2, seed=3, bias=True, **({"d_out": d} if vector else {}))
    model = NormedAttention(norm, 1e-5, inner, np.eye(d) if vector else np.random.default_rng(1).normal(size=d))
    X = np.random.default_rng(2).normal(size=(4, d)) * np.array([[1e-3], [1.0], [30.0], [1.0]])  # eps matters
    got = model([X], precision=160)
    row = got[0] if vector else got
    with mpmath.workprec(330):
        truth = _pre_norm_truth(model, X)
        assert _relative(row, truth) < mpmath.mpf(2) ** -150
    assert np.allclose(np.asarray(row, dtype=float), model([X])[0] if vector else model([X]), rtol=1e-13, atol=0)


def test_a_post_norm_sublayer_in_balls_is_the_sublayer_to_its_bits():
    d = 4
    inner = mx.MultiHeadAttention.random(d=d, heads=2, seed=5, bias=True, d_out=d)
    rng = np.random.default_rng(6)
    model = PostNormAttention(1e-12, inner, 1 + 0.2 * rng.normal(size=d), 0.05 * rng.normal(size=d))
    X = rng.normal(size=(3, d))
    got = model([X], precision=160)
    with mpmath.workprec(330):
        assert _relative(got[0], _post_norm_truth(model, X)) < mpmath.mpf(2) ** -150
    assert np.allclose(got.astype(float), model([X]), rtol=1e-13, atol=1e-15)


def test_a_rotary_sublayer_in_balls_agrees_with_its_float64_evaluation():
    inner = mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=0, d_out=8, kv_heads=1)
    model = NormedAttention("rmsnorm", 1e-6, inner, np.eye(8))
    X = np.random.default_rng(1).normal(size=(5, 8)) * 3
    got = model([X], precision=100)
    assert got.shape == (1, 8)
    assert np.abs(got.astype(float) - model([X])).max() <= 1e-14 * np.abs(model([X])).max()
