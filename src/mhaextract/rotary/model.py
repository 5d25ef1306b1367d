"""Rotary attention (RoPE) read out at the final token, in its canonical form (docs/algorithm.md §22).

Head h has a query factor ``Q_h`` and a key factor ``K_h`` (both ``r x d``, r even) and
frequencies ``theta_h`` (r / 2 of them). Rows ``2m, 2m + 1`` of both factors form block m, which
position rotates by ``theta_h[m]`` per token. From the final position N the key at position j
scores

    s_h(j) = (K_h x_j)^T R_h(N - j) (Q_h x_N) = x_j^T W_h(N - j) x_N,
    W_h(delta) = K_h^T R_h(delta) Q_h,     R_h(delta) = blockdiag_m rot(delta theta_h[m]),

with ``rot(phi) = [[cos phi, -sin phi], [sin phi, cos phi]]``: the rotation convention of
Llama's ``rotate_half`` on the pairs ``(m, m + r/2)``, written here on consecutive pairs (a
permutation of rows, which the canonical form is free to choose). The output is
``f(X) = c + sum_h V_h sum_j a_{h,j} x_j`` with the softmax over the keys in the window (the last
``window`` positions, the final one included; all of them when ``window`` is None).
"""

from __future__ import annotations

import numpy as np

from ..model import as_batch


def rotation_blocks(angles: np.ndarray) -> np.ndarray:
    """``rot(phi)`` for an array of angles: shape ``angles.shape + (2, 2)``."""
    cos, sin = np.cos(angles), np.sin(angles)
    return np.stack([np.stack([cos, -sin], axis=-1), np.stack([sin, cos], axis=-1)], axis=-2)


class RotaryAttention:
    """Multi-head attention with rotary position embeddings, read out at the final token.

    Parameters
    ----------
    Q, K : arrays of shape (H, r, d), r even
        Query and key factors; rows ``2m, 2m + 1`` are rotary block m.
    theta : array of shape (H, r // 2)
        Rotation per position of each block, in radians (Llama: ``base ** (-2m / r)``).
    V : array of shape (H, d) or (H, d_out, d)
        Value read-outs, as in :class:`~mhaextract.MultiHeadAttention` (scalar or whole layer).
    c : scalar, or (d_out,) for the vector model, optional
        Output constant. Default zero.
    b : array of shape (H, r), optional
        Query biases: the query is ``Q_h x_N + b_h`` (a key bias is outside the model: it makes a
        zero token score differently at each offset). Default zero.
    window : int, optional
        Sliding window: the final token attends to the last ``window`` positions (itself
        included). None: every position.

    Attributes
    ----------
    Q, K, theta, V, b, c, window : the parameters (float64).
    d, d_out, heads, head_width : sizes.
    is_vector : bool, ``model(batch)`` has shape (B, d_out).

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> model = mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=0)
    >>> X = np.random.default_rng(1).normal(size=(3, 10, 8))
    >>> model(X).shape
    (3,)
    >>> W1 = model.score_matrices(1)          # W_h(1), shape (H, d, d)
    >>> s = X[0, -2] @ W1[0] @ X[0, -1]      # head 0's score of the key one position back
    >>> bool(np.isclose(s, model.scores(X[0])[0, -2]))
    True
    """

    def __init__(self, Q, K, theta, V, c=None, window: int | None = None, b=None):
        Q, K, theta, V = (np.asarray(a, dtype=np.float64) for a in (Q, K, theta, V))
        if Q.ndim != 3 or K.shape != Q.shape or Q.shape[1] % 2:
            raise ValueError(f"Q and K must have one shape (H, r, d) with r even, got {Q.shape} and {K.shape}")
        H, r, d = Q.shape
        if theta.shape != (H, r // 2):
            raise ValueError(f"theta must have shape (H, r // 2) = ({H}, {r // 2}), got {theta.shape}")
        vector = V.ndim == 3
        if (vector and (V.shape[0], V.shape[2]) != (H, d)) or (not vector and V.shape != (H, d)):
            raise ValueError(f"V must have shape (H, d) = ({H}, {d}) or (H, d_out, d), got {V.shape}")
        d_out = V.shape[1] if vector else 1
        c = (np.zeros(d_out) if vector else 0.0) if c is None else c
        c = np.asarray(c, dtype=np.float64)
        if c.shape != ((d_out,) if vector else ()):
            raise ValueError(f"c must have shape {(d_out,) if vector else ()}, got {c.shape}")
        b = np.zeros((H, r)) if b is None else np.asarray(b, dtype=np.float64)
        if b.shape != (H, r):
            raise ValueError(f"b must have shape (H, r) = ({H}, {r}), got {b.shape}")
        if not all(np.isfinite(a).all() for a in (Q, K, theta, V, c, b)):
            raise ValueError("Q, K, theta, V, b and c must be finite")
        if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
            raise ValueError(f"window must be a positive integer (tokens attended, the final one included) or "
                             f"None, got {window!r}")
        self.Q, self.K, self.theta, self.b = Q, K, theta, b
        self.V = V if vector else V[:, None, :]
        self.is_vector = vector
        self.c = c if vector else float(c)
        self.window = None if window is None else int(window)

    @property
    def d(self) -> int:
        return self.Q.shape[2]

    @property
    def heads(self) -> int:
        return self.Q.shape[0]

    @property
    def head_width(self) -> int:
        return self.Q.shape[1]

    @property
    def d_out(self) -> int:
        return self.V.shape[1]

    @property
    def v(self) -> np.ndarray:
        """The scalar model's value vectors (H, d)."""
        if self.is_vector:
            raise AttributeError(f"a model with d_out = {self.d_out} outputs has V (H, d_out, d), not v")
        return self.V[:, 0, :]

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        outputs = f", d_out={self.d_out}" if self.is_vector else ""
        return f"RotaryAttention(d={self.d}, heads={self.heads}, head_width={self.head_width}{outputs}{window})"

    @classmethod
    def random(cls, d: int, heads: int, head_width: int, seed=None, base: float = 10000.0, kv_heads=None,
               d_out: int | None = None, bias: bool = False, window: int | None = None) -> "RotaryAttention":
        """A random Llama-like layer: Gaussian factors scaled so that scores at tokens of norm
        about ``d ** 0.25`` are of order one, frequencies ``base ** (-2m / r)``, and ``kv_heads``
        groups of query heads sharing their key factor and value (grouped-query attention)."""
        rng = np.random.default_rng(seed)
        kv_heads = heads if kv_heads is None else kv_heads
        if heads % kv_heads:
            raise ValueError(f"heads = {heads} must be a multiple of kv_heads = {kv_heads}")
        scale = 1.0 / np.sqrt(d * np.sqrt(head_width))
        Q = rng.normal(size=(heads, head_width, d)) * np.sqrt(scale)
        K = np.repeat(rng.normal(size=(kv_heads, head_width, d)) * np.sqrt(scale), heads // kv_heads, axis=0)
        theta = np.tile(base ** (-np.arange(0, head_width, 2) / head_width), (heads, 1))
        # V_h = W_O,h W_V,g: the value block W_V,g (r x d) shared in a group, the output block per head
        values = rng.normal(size=(kv_heads, head_width, d)) / np.sqrt(d)
        outputs = rng.normal(size=(heads, 1 if d_out is None else d_out, head_width)) / np.sqrt(head_width)
        V = np.einsum("hor,hrd->hod", outputs, np.repeat(values, heads // kv_heads, axis=0))
        V = V[:, 0] if d_out is None else V
        c = (rng.normal(size=d_out if d_out is not None else ()) * 0.1) if bias else None
        b = rng.normal(size=(heads, head_width)) * np.sqrt(scale) * d ** 0.25 if bias else None
        return cls(Q, K, theta, V, c, window=window, b=b)

    def score_matrices(self, delta: int, bias: bool = False) -> np.ndarray:
        """``W_h(delta) = K_h^T R_h(delta) Q_h`` for every head, shape (H, d, d); ``bias=True``:
        ``[W_h(delta) | u_h(delta)]`` with ``u_h(delta) = K_h^T R_h(delta) b_h``, shape (H, d, d + 1)."""
        query = np.concatenate([self.Q, self.b[:, :, None]], axis=2) if bias else self.Q
        rotated = self._rotate(query, np.asarray(delta, dtype=np.float64))
        return np.einsum("hrd,hre->hde", self.K, rotated)

    def _rotate(self, rows: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """``R_h(delta)`` applied to (..., H, r, *) row blocks, delta broadcast against (...)."""
        blocks = rotation_blocks(np.asarray(delta)[..., None, None] * self.theta)  # (..., H, r/2, 2, 2)
        shape = rows.shape
        paired = rows.reshape(shape[:-2] + (shape[-2] // 2, 2, shape[-1]))
        return np.einsum("...mab,...mbe->...mae", blocks, paired).reshape(shape)

    def scores(self, X: np.ndarray) -> np.ndarray:
        """Scores of every key of one sequence X (N, d) from its final token, shape (H, N)
        (``-inf`` outside the window)."""
        return self._scores(np.asarray(X, dtype=np.float64)[None])[0]

    def _scores(self, X: np.ndarray) -> np.ndarray:
        """(B, N, d) sequences of one length -> (B, H, N) scores from the final token."""
        B, N, _ = X.shape
        keys = np.einsum("hrd,bnd->bnhr", self.K, X)                    # K_h x_j
        query = np.einsum("hrd,bd->bhr", self.Q, X[:, -1]) + self.b      # Q_h x_N + b_h
        offsets = np.arange(N - 1, -1, -1, dtype=np.float64)             # N - j
        angles = offsets[:, None, None] * self.theta[None]               # (N, H, r/2)
        cos, sin = np.cos(angles), np.sin(angles)
        q = query.reshape(B, 1, self.heads, -1, 2)
        rotated = np.stack([cos * q[..., 0] - sin * q[..., 1], sin * q[..., 0] + cos * q[..., 1]], axis=-1)
        scores = np.einsum("bnhr,bnhr->bhn", keys, rotated.reshape(B, N, self.heads, -1))
        if self.window is not None and N > self.window:
            scores[:, :, : N - self.window] = -np.inf
        return scores

    def head_means(self, batch) -> np.ndarray:
        """``m_h(X) = sum_j a_{h,j} x_j`` for every sequence and head, shape (B, H, d)."""
        sequences = as_batch(batch, self.d)
        means = np.empty((len(sequences), self.heads, self.d))
        lengths = np.array([len(X) for X in sequences])
        for length in np.unique(lengths):
            index = np.flatnonzero(lengths == length)
            X = np.stack([sequences[i] for i in index]).astype(np.float64)
            scores = self._scores(X)
            scores -= scores.max(axis=2, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=2, keepdims=True)
            means[index] = np.einsum("bhn,bnd->bhd", weights, X)
        return means

    def __call__(self, batch, precision: int | None = None) -> np.ndarray:
        """``f(X)`` for a batch of sequences (any lengths): (B,) or (B, d_out), in float64."""
        if precision is not None:
            raise ValueError("RotaryAttention evaluates in float64 (precision=None)")
        out = np.einsum("hod,bhd->bo", self.V, self.head_means(batch)) + self.c
        return out if self.is_vector else out[:, 0]

    def readout(self, r) -> "RotaryAttention":
        """The scalar model ``r^T f`` (``v_h = V_h^T r``)."""
        r = np.asarray(r, dtype=np.float64)
        if r.shape != (self.d_out,):
            raise ValueError(f"r must have shape (d_out,) = ({self.d_out},), got {r.shape}")
        return RotaryAttention(self.Q, self.K, self.theta, np.einsum("hod,o->hd", self.V, r),
                               float(np.dot(r, np.atleast_1d(self.c))), self.window, self.b)

    def identifying_matrices(self) -> np.ndarray:
        """``[W_h(delta) | u_h(delta)]`` at delta = 0, 1, 2, shape (H, 3, d, d + 1): together they determine
        ``W_h(delta)`` at every offset (docs/algorithm.md §22), so two models with equal ones and
        equal values compute the same function."""
        return np.stack([self.score_matrices(delta, bias=True) for delta in range(3)], axis=1)

    def canonical(self, rtol: float = 1e-9) -> "RotaryAttention":
        """Heads with equal score functions merged (their V summed), heads whose V is zero dropped."""
        W = self.identifying_matrices()
        scale = max(float(np.abs(W).max()), np.finfo(float).tiny)
        groups: list[list[int]] = []
        for h in range(self.heads):
            for group in groups:
                if np.abs(W[h] - W[group[0]]).max() <= rtol * scale:
                    group.append(h)
                    break
            else:
                groups.append([h])
        V = np.stack([self.V[group].sum(axis=0) for group in groups])
        keep = [k for k, group in enumerate(groups) if np.abs(V[k]).max() > 0]
        first = [groups[k][0] for k in keep]
        values = V[keep] if self.is_vector else V[keep][:, 0, :]
        return RotaryAttention(self.Q[first], self.K[first], self.theta[first], values, self.c, self.window,
                               self.b[first])

    def to_float64(self) -> "RotaryAttention":
        return self

    def scores_moved(self, rng: np.random.Generator, relative: float, bias_relative: float) -> "RotaryAttention":
        """The model with Gaussian score errors: Q, K, b moved by entries of a sixth of ``relative``
        times their largest entry (a score matrix ``K^T R Q`` then moves by about ``relative / 3``),
        theta by ``relative / 3`` radians (the value fit's score-error probe)."""
        Q_size, K_size = float(np.abs(self.Q).max()), float(np.abs(self.K).max())
        b_size = float(np.abs(self.b).max())
        return RotaryAttention(self.Q + relative * Q_size * rng.standard_normal(self.Q.shape) / 6,
                               self.K + relative * K_size * rng.standard_normal(self.K.shape) / 6,
                               self.theta + relative * rng.standard_normal(self.theta.shape) / 3,
                               self.V if self.is_vector else self.v, self.c, self.window,
                               self.b + bias_relative * b_size * rng.standard_normal(self.b.shape) / 3)

    def with_values(self, V, c) -> "RotaryAttention":
        """The same scores with value read-outs ``V`` (H, d_out, d) and constant ``c`` (d_out,)."""
        return RotaryAttention(self.Q, self.K, self.theta, V, c, self.window, self.b)

