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

    def truncated_scores(self, ranks: list[int]) -> "FactoredLayer":
        """The layer with each head's ``[W_h | u_h] = K_h [G_h | beta_h]`` cut to its ``ranks[h]``
        leading singular directions (``K_h`` their orthonormal basis, ``[G_h | beta_h]`` the
        singular values times the right vectors), padded to the widest."""
        H, d, _ = self.K.shape
        k = max(ranks)
        K, G, beta = np.zeros((H, d, k)), np.zeros((H, k, d)), np.zeros((H, k))
        for h, rank in enumerate(ranks):
            U, s, Vt = np.linalg.svd(self.K[h] @ np.concatenate([self.G[h], self.beta[h][:, None]], axis=1),
                                     full_matrices=False)
            K[h, :, :rank] = U[:, :rank]
            G[h, :rank] = s[:rank, None] * Vt[:rank, :d]
            beta[h, :rank] = s[:rank] * Vt[:rank, d]
        return FactoredLayer(K, G, beta, self.O.copy(), self.P.copy(), self.c.copy())


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
    """Every step as a matrix product (BLAS: einsum's loops cost most of the time at d = 768)."""
    (B, N, d), (H, k, _), (_, d_out, r) = X.shape, layer.G.shape, layer.O.shape
    g = (X[:, -1] @ layer.G.reshape(H * k, d).T).reshape(B, H, k) + layer.beta[None]
    q = np.matmul(layer.K, g.transpose(1, 2, 0)).transpose(2, 0, 1)            # (B, H, d)
    s = np.matmul(X, q.transpose(0, 2, 1)).transpose(0, 2, 1)                  # (B, H, N)
    s -= s.max(axis=2, keepdims=True)
    a = np.exp(s)
    a /= a.sum(axis=2, keepdims=True)
    m = np.matmul(a, X)                                                        # (B, H, d)
    p = np.matmul(layer.P, m.transpose(1, 2, 0)).transpose(2, 0, 1)            # (B, H, r)
    f = p.reshape(B, H * r) @ layer.O.transpose(1, 0, 2).reshape(d_out, H * r).T + layer.c
    return Forward(X, g, a, m, p, f)


def _attention_jvp(fw: Forward, dq: np.ndarray) -> np.ndarray:
    """The heads' means' change ``X^T da_h`` (B, H, d) when the queries ``q_h`` move by ``dq`` (B, H, d)."""
    ds = np.matmul(dq, fw.X.transpose(0, 2, 1))                            # (B, H, N)
    da = fw.a * (ds - (fw.a * ds).sum(axis=2, keepdims=True))
    return np.matmul(da, fw.X)


def _attention_vjp(fw: Forward, em: np.ndarray) -> np.ndarray:
    """The transpose of :func:`_attention_jvp`: (B, H, d) -> (B, H, d)."""
    ea = np.matmul(em, fw.X.transpose(0, 2, 1))
    es = fw.a * (ea - (fw.a * ea).sum(axis=2, keepdims=True))
    return np.matmul(es, fw.X)


def _query_step(layer: FactoredLayer, fw: Forward, dK: np.ndarray, dG: np.ndarray, dbeta: np.ndarray) -> np.ndarray:
    """``dq_h = dK_h g_h + K_h (dG_h x_N + dbeta_h)`` (B, H, d)."""
    dg = np.matmul(dG, fw.X[:, -1].T) + dbeta[:, :, None]                  # (H, k, B)
    return (np.matmul(dK, fw.g.transpose(1, 2, 0)) + np.matmul(layer.K, dg)).transpose(2, 0, 1)


def _query_gradient(layer: FactoredLayer, fw: Forward, eq: np.ndarray):
    """The transpose of :func:`_query_step`: ``(dK, dG, dbeta)`` from ``eq`` (B, H, d)."""
    eq = eq.transpose(1, 2, 0)                                             # (H, d, B)
    eg = np.matmul(layer.K.transpose(0, 2, 1), eq)                         # (H, k, B)
    return np.matmul(eq, fw.g.transpose(1, 0, 2)), np.matmul(eg, fw.X[:, -1][None]), eg.sum(axis=2)


def score_jvp(layer: FactoredLayer, fw: Forward, dK: np.ndarray, dG: np.ndarray, dbeta: np.ndarray) -> np.ndarray:
    """Each head's coordinates' first-order change ``P_h X^T da_h`` (B, H, r) when only its scores'
    parameters move."""
    dm = _attention_jvp(fw, _query_step(layer, fw, dK, dG, dbeta))
    return np.matmul(layer.P, dm.transpose(1, 2, 0)).transpose(2, 0, 1)


def score_vjp(layer: FactoredLayer, fw: Forward, e: np.ndarray):
    """The transpose of :func:`score_jvp`: ``(dK, dG, dbeta)`` for ``e`` (B, H, r)."""
    em = np.matmul(layer.P.transpose(0, 2, 1), e.transpose(1, 2, 0)).transpose(2, 0, 1)
    return _query_gradient(layer, fw, _attention_vjp(fw, em))


def jvp(layer: FactoredLayer, fw: Forward, step: FactoredLayer) -> np.ndarray:
    """The outputs' first-order change (B, d_out) when the parameters move by ``step``."""
    dm = _attention_jvp(fw, _query_step(layer, fw, step.K, step.G, step.beta))
    dp = np.matmul(step.P, fw.m.transpose(1, 2, 0)) + np.matmul(layer.P, dm.transpose(1, 2, 0))  # (H, r, B)
    return (np.matmul(step.O, fw.p.transpose(1, 2, 0)) + np.matmul(layer.O, dp)).sum(axis=0).T + step.c


def vjp(layer: FactoredLayer, fw: Forward, e: np.ndarray) -> FactoredLayer:
    """The transpose of :func:`jvp`: the parameters' gradient of ``sum e^T f`` for ``e`` (B, d_out)."""
    dO = np.matmul(e.T[None], fw.p.transpose(1, 0, 2))                     # (H, d_out, r)
    ep = np.matmul(layer.O.transpose(0, 2, 1), e.T[None])                  # (H, r, B)
    dP = np.matmul(ep, fw.m.transpose(1, 0, 2))
    em = np.matmul(layer.P.transpose(0, 2, 1), ep).transpose(2, 0, 1)      # (B, H, d)
    dK, dG, dbeta = _query_gradient(layer, fw, _attention_vjp(fw, em))
    return FactoredLayer(dK, dG, dbeta, dO, dP, e.sum(axis=0))


def grouped(sequences) -> list[tuple[np.ndarray, np.ndarray]]:
    """(indices, tokens (B, N, d)) per query length."""
    lengths = np.array([len(s) for s in sequences])
    return [(index, np.stack([sequences[i] for i in index]))
            for index in (np.flatnonzero(lengths == n) for n in np.unique(lengths))]
