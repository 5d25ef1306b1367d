"""The whole layer in factored form, its outputs and its Jacobian products (docs/algorithm.md,
'Whole answers near the vector bound').

Head h is ``q_h = K_h (G_h x_N + beta_h)`` (K_h: d x k, G_h: k x d, beta_h: k), ``a_h =
softmax(X q_h)``, ``f(X) = c + sum_h O_h P_h X^T a_h`` (O_h: d_out x r, P_h: r x d). So
``W_h = K_h G_h``, ``u_h = K_h beta_h``, ``V_h = O_h P_h``. Heads of smaller width are padded with
zero columns of K (rows of G, beta) and of O (rows of P): the products below are zero in those
directions to first order, so a least-squares step never moves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.attention import MultiHeadAttention

BLOCKS = ("K", "G", "beta", "O", "P", "c")


@dataclass
class FactoredLayer:
    """Parameters of the factored layer (module docstring); arrays per head, padded to common widths."""

    K: np.ndarray     # (H, d, k)
    G: np.ndarray     # (H, k, d)
    beta: np.ndarray  # (H, k)
    O: np.ndarray     # (H, d_out, r)
    P: np.ndarray     # (H, r, d)
    c: np.ndarray     # (d_out,)

    def flat(self) -> np.ndarray:
        return np.concatenate([getattr(self, name).ravel() for name in BLOCKS])

    def shaped(self, vector: np.ndarray) -> "FactoredLayer":
        """A layer of this one's shapes holding ``vector`` (as :meth:`flat` lays it out)."""
        parts, start = {}, 0
        for name in BLOCKS:
            shape = getattr(self, name).shape
            size = int(np.prod(shape))
            parts[name] = vector[start:start + size].reshape(shape)
            start += size
        return FactoredLayer(**parts)

    def block_slices(self) -> dict[str, slice]:
        slices, start = {}, 0
        for name in BLOCKS:
            size = getattr(self, name).size
            slices[name] = slice(start, start + size)
            start += size
        return slices

    def model(self) -> MultiHeadAttention:
        """The layer as a :class:`~mhaextract.models.attention.MultiHeadAttention` (W_h = K_h G_h, ...)."""
        W = np.einsum("hdk,hke->hde", self.K, self.G)
        u = np.einsum("hdk,hk->hd", self.K, self.beta)
        V = np.einsum("hor,hrd->hod", self.O, self.P)
        return MultiHeadAttention(W, V, u, self.c.copy())


@dataclass
class Forward:
    """What one group of equal-length queries computes on the way to its outputs (kept for the
    Jacobian products)."""

    X: np.ndarray   # (B, N, d)
    g: np.ndarray   # (B, H, k): G_h x_N + beta_h
    a: np.ndarray   # (B, H, N): attention weights
    m: np.ndarray   # (B, H, d): X^T a_h
    p: np.ndarray   # (B, H, r): P_h m_h
    f: np.ndarray   # (B, d_out)


def forward(layer: FactoredLayer, X: np.ndarray) -> Forward:
    g = np.einsum("hkd,bd->bhk", layer.G, X[:, -1]) + layer.beta[None]
    q = np.einsum("hdk,bhk->bhd", layer.K, g)
    s = np.einsum("bnd,bhd->bhn", X, q)
    s -= s.max(axis=2, keepdims=True)
    a = np.exp(s)
    a /= a.sum(axis=2, keepdims=True)
    m = np.einsum("bhn,bnd->bhd", a, X)
    p = np.einsum("hrd,bhd->bhr", layer.P, m)
    f = np.einsum("hor,bhr->bo", layer.O, p) + layer.c
    return Forward(X, g, a, m, p, f)


def jvp(layer: FactoredLayer, fw: Forward, step: FactoredLayer) -> np.ndarray:
    """The outputs' first-order change (B, d_out) when the parameters move by ``step``."""
    X, a = fw.X, fw.a
    dg = np.einsum("hkd,bd->bhk", step.G, X[:, -1]) + step.beta[None]
    dq = np.einsum("hdk,bhk->bhd", step.K, fw.g) + np.einsum("hdk,bhk->bhd", layer.K, dg)
    ds = np.einsum("bnd,bhd->bhn", X, dq)
    da = a * (ds - np.einsum("bhn,bhn->bh", a, ds)[..., None])
    dm = np.einsum("bhn,bnd->bhd", da, X)
    dp = np.einsum("hrd,bhd->bhr", step.P, fw.m) + np.einsum("hrd,bhd->bhr", layer.P, dm)
    return np.einsum("hor,bhr->bo", step.O, fw.p) + np.einsum("hor,bhr->bo", layer.O, dp) + step.c


def vjp(layer: FactoredLayer, fw: Forward, e: np.ndarray) -> FactoredLayer:
    """The transpose of :func:`jvp`: the parameters' gradient of ``sum e^T f`` for ``e`` (B, d_out)."""
    X, a = fw.X, fw.a
    dc = e.sum(axis=0)
    dO = np.einsum("bo,bhr->hor", e, fw.p)
    ep = np.einsum("hor,bo->bhr", layer.O, e)
    dP = np.einsum("bhr,bhd->hrd", ep, fw.m)
    em = np.einsum("hrd,bhr->bhd", layer.P, ep)
    ea = np.einsum("bnd,bhd->bhn", X, em)
    es = a * (ea - np.einsum("bhn,bhn->bh", a, ea)[..., None])
    eq = np.einsum("bhn,bnd->bhd", es, X)
    dK = np.einsum("bhd,bhk->hdk", eq, fw.g)
    eg = np.einsum("hdk,bhd->bhk", layer.K, eq)
    dG = np.einsum("bhk,bd->hkd", eg, X[:, -1])
    dbeta = eg.sum(axis=0)
    return FactoredLayer(dK, dG, dbeta, dO, dP, dc)


def grouped(sequences) -> list[tuple[np.ndarray, np.ndarray]]:
    """(indices, tokens (B, N, d)) per query length."""
    lengths = np.array([len(s) for s in sequences])
    return [(index, np.stack([sequences[i] for i in index]))
            for index in (np.flatnonzero(lengths == n) for n in np.unique(lengths))]
