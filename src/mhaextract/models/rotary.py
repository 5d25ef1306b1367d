"""Rotary attention (RoPE) read out at the final token, in its canonical form (docs/algorithm.md, 'Rotary attention:
positions, grouped heads and sliding windows').

Head h has a query factor ``Q_h`` and a key factor ``K_h`` (both ``r x d``, r even) and
frequencies ``theta_h`` (r / 2 of them). Rows ``2m, 2m + 1`` of both factors form block m, which
position rotates by ``theta_h[m]`` per token. From the final position N the key at position j
scores

    s_h(j) = (K_h x_j + k_h)^T R_h(N - j) (Q_h x_N + b_h),     R_h(delta) = blockdiag_m rot(delta theta_h[m]),

with query biases ``b_h`` and key biases ``k_h`` (Qwen2's; zero in most layers); without biases
``s_h(j) = x_j^T W_h(N - j) x_N`` with ``W_h(delta) = K_h^T R_h(delta) Q_h``. The rotation
``rot(phi) = [[cos phi, -sin phi], [sin phi, cos phi]]`` is the rotation convention of
Llama's ``rotate_half`` on the pairs ``(m, m + r/2)``, written here on consecutive pairs (a
permutation of rows, which the canonical form is free to choose). The output is
``f(X) = c + sum_h V_h sum_j a_{h,j} x_j`` with the softmax over the keys in the window (the last
``window`` positions, the final one included; all of them when ``window`` is None).
"""

from __future__ import annotations

import mpmath
import numpy as np

from scipy.optimize import linear_sum_assignment

from .attention import as_batch
from .compare import Comparison, register_comparison
from .kinds import document_numbers, read_numbers, register_model_kind
from ..numerics.highprec import GUARD_BITS, arb_array, mid_float, mpf_array, rounded_mpf, working_precision

_mp_cos = np.vectorize(mpmath.cos, otypes=[object])
_mp_sin = np.vectorize(mpmath.sin, otypes=[object])


def rotation_blocks(angles: np.ndarray) -> np.ndarray:
    """``rot(phi)`` for an array of angles: shape ``angles.shape + (2, 2)`` (float64, or ``mpf`` at
    mpmath's working precision for an object array)."""
    if angles.dtype == object:
        cos, sin = _mp_cos(angles), _mp_sin(angles)
    else:
        cos, sin = np.cos(angles), np.sin(angles)
    return np.stack([np.stack([cos, -sin], axis=-1), np.stack([sin, cos], axis=-1)], axis=-2)


def _numbers(values, high: bool) -> np.ndarray:
    """float64, or exact ``mpf`` (object arrays) for a high-precision model."""
    return mpf_array(values) if high else np.asarray(values, dtype=np.float64)


def _finite(values: np.ndarray) -> bool:
    if values.dtype == object:
        return all(mpmath.isfinite(value) for value in values.ravel())
    return bool(np.isfinite(values).all())


@register_model_kind
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
        Query biases: the query is ``Q_h x_N + b_h``. Default zero.
    window : int, optional
        Sliding window: the final token attends to the last ``window`` positions (itself
        included). None: every position.
    key_bias : array of shape (H, r), optional
        Key biases ``k_h`` (Qwen2): the key is ``K_h x_j + k_h``. Unlike a key bias without
        positions it does not cancel in the softmax: ``k_h^T R_h(delta) q_h`` changes with the
        offset. None (default): no key bias, and none among the parameters a refinement fits.

    Attributes
    ----------
    Q, K, theta, V, b, c, window, key_bias : the parameters (float64, or ``mpf`` object arrays;
        ``key_bias`` None where the model has none).
    d, d_out, heads, head_width : sizes.
    is_vector : bool, ``model(batch)`` has shape (B, d_out).
    is_high_precision : bool, the parameters are ``mpf``.

    Notes
    -----
    The parameters are float64, or ``mpmath.mpf`` (object arrays; any one given so makes them all
    so) for a high-precision model, which ``model(batch, precision=bits)`` evaluates in ball
    arithmetic.

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

    def __init__(self, Q, K, theta, V, c=None, window: int | None = None, b=None, key_bias=None):
        high = any(np.asarray(a).dtype == object for a in (Q, K, theta, V, c, b, key_bias) if a is not None)
        Q, K, theta, V = (_numbers(a, high) for a in (Q, K, theta, V))
        if Q.ndim != 3 or K.shape != Q.shape or Q.shape[1] % 2:
            raise ValueError(f"Q and K must have one shape (H, r, d) with r even, got {Q.shape} and {K.shape}")
        H, r, d = Q.shape
        if theta.shape != (H, r // 2):
            raise ValueError(f"theta must have shape (H, r // 2) = ({H}, {r // 2}), got {theta.shape}")
        vector = V.ndim == 3
        if (vector and (V.shape[0], V.shape[2]) != (H, d)) or (not vector and V.shape != (H, d)):
            raise ValueError(f"V must have shape (H, d) = ({H}, {d}) or (H, d_out, d), got {V.shape}")
        d_out = V.shape[1] if vector else 1
        c = _numbers((np.zeros(d_out) if vector else 0.0) if c is None else c, high)
        if c.shape != ((d_out,) if vector else ()):
            raise ValueError(f"c must have shape {(d_out,) if vector else ()}, got {c.shape}")
        b = _numbers(np.zeros((H, r)) if b is None else b, high)
        if b.shape != (H, r):
            raise ValueError(f"b must have shape (H, r) = ({H}, {r}), got {b.shape}")
        if key_bias is not None:
            key_bias = _numbers(key_bias, high)
            if key_bias.shape != (H, r):
                raise ValueError(f"key_bias must have shape (H, r) = ({H}, {r}), got {key_bias.shape}")
        if not all(_finite(a) for a in (Q, K, theta, V, c, b, key_bias) if a is not None):
            raise ValueError("Q, K, theta, V, b, key_bias and c must be finite")
        if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
            raise ValueError(f"window must be a positive integer (tokens attended, the final one included) or "
                             f"None, got {window!r}")
        self.Q, self.K, self.theta, self.b, self.key_bias = Q, K, theta, b, key_bias
        self.V = V if vector else V[:, None, :]
        self.is_vector = vector
        self.c = c if vector else (c[()] if high else float(c))
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
    def is_high_precision(self) -> bool:
        return self.Q.dtype == object

    @property
    def v(self) -> np.ndarray:
        """The scalar model's value vectors (H, d)."""
        if self.is_vector:
            raise AttributeError(f"a model with d_out = {self.d_out} outputs has V (H, d_out, d), not v")
        return self.V[:, 0, :]

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        outputs = f", d_out={self.d_out}" if self.is_vector else ""
        kind = ", mpf" if self.is_high_precision else ""
        return (f"RotaryAttention(d={self.d}, heads={self.heads}, head_width={self.head_width}{outputs}{window}"
                f"{kind})")

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

    @property
    def precision(self) -> int:
        """Bits the parameters carry: 53 for float64, the longest ``mpf`` mantissa (at least 53)
        for a high-precision model, which computes its score matrices at that many bits and more."""
        if not self.is_high_precision:
            return 53
        arrays = (self.Q, self.K, self.theta, self.V, self.b, np.asarray(self.c, dtype=object))
        arrays += () if self.key_bias is None else (self.key_bias,)
        return max([53] + [int(value._mpf_[3]) for a in arrays for value in a.ravel()])

    @property
    def key_bias_or_zero(self) -> np.ndarray:
        """The key biases (H, r): ``key_bias``, or zeros where the model has none."""
        return self.key_bias if self.key_bias is not None else _numbers(np.zeros(self.b.shape), self.is_high_precision)

    def replaced(self, **changes) -> "RotaryAttention":
        """The model with some parameters replaced (``Q``, ``K``, ``theta``, ``V``, ``c``, ``window``,
        ``b``, ``key_bias``), the others kept."""
        fields = dict(Q=self.Q, K=self.K, theta=self.theta, V=self.V if self.is_vector else self.v, c=self.c,
                      window=self.window, b=self.b, key_bias=self.key_bias)
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"RotaryAttention has no parameter {', '.join(sorted(unknown))}")
        return RotaryAttention(**{**fields, **changes})

    def with_token_shift(self, shift) -> "RotaryAttention":
        """The model of ``X -> f(X + shift)``, every token moved by ``shift`` (d,): keys ``K_h x +
        (K_h s + k_h)``, queries ``Q_h x + (Q_h s + b_h)``, constant ``c + sum_h V_h s`` (the value
        shifts, weighted by attention weights summing to one, are constants).

        Examples
        --------
        >>> import numpy as np
        >>> import mhaextract as mx
        >>> model = mx.RotaryAttention.random(d=6, heads=2, head_width=2, seed=0)
        >>> s, X = np.full(6, 0.3), np.random.default_rng(1).normal(size=(2, 5, 6))
        >>> bool(np.allclose(model.with_token_shift(s)(X), model(X + s)))
        True
        """
        shift = np.asarray(shift, dtype=object if self.is_high_precision else np.float64)
        if shift.shape != (self.d,):
            raise ValueError(f"shift must have shape (d,) = ({self.d},), got {shift.shape}")
        moved = np.einsum("hod,d->o", self.V, shift)
        return self.replaced(b=self.b + np.einsum("hrd,d->hr", self.Q, shift),
                             key_bias=self.key_bias_or_zero + np.einsum("hrd,d->hr", self.K, shift),
                             c=self.c + (moved if self.is_vector else moved[0]))

    def to_mpf(self) -> "RotaryAttention":
        """The same model with exact ``mpf`` parameters (itself when it has them)."""
        if self.is_high_precision:
            return self
        return self.replaced(Q=mpf_array(self.Q))

    def score_matrices(self, delta: int, bias: bool = False) -> np.ndarray:
        """``W_h(delta) = K_h^T R_h(delta) Q_h`` for every head, shape (H, d, d); ``bias=True``:
        ``[W_h(delta) | u_h(delta)]`` with ``u_h(delta) = K_h^T R_h(delta) b_h``, shape (H, d, d + 1).
        A high-precision model's are ``mpf``, computed with ``GUARD_BITS`` beyond its ``precision`` or
        mpmath's working precision, whichever is higher."""
        query = np.concatenate([self.Q, self.b[:, :, None]], axis=2) if bias else self.Q
        with mpmath.workprec(max(self.precision, mpmath.mp.prec) + GUARD_BITS):
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
        (``-inf`` outside the window), in float64."""
        X = np.asarray(X, dtype=np.float64)[None]
        N = X.shape[1]
        scores = np.full((self.heads, N), -np.inf)
        inside = N if self.window is None else min(N, self.window)
        model = self._float64
        scores[:, N - inside:] = model._scores(X[:, N - inside:], model._parameters)[0]
        return scores

    @property
    def _float64(self) -> "RotaryAttention":
        return self.to_float64()

    @property
    def _parameters(self) -> tuple:
        return self.Q, self.K, self.b, self.theta, self.key_bias_or_zero

    def _scores(self, X: np.ndarray, parameters: tuple) -> np.ndarray:
        """(B, N, d) sequences of one length, every key inside the window -> (B, H, N) scores
        from the final token. Written once for float64 and for ``arb`` balls (object arrays:
        ``X`` and ``parameters = (Q, K, b, theta, key_bias)``, numpy calling the balls' own operations)."""
        Q, K, b, theta, key_bias = parameters
        B, N, _ = X.shape
        keys = np.einsum("hrd,bnd->bnhr", K, X) + key_bias              # K_h x_j + k_h
        query = np.einsum("hrd,bd->bhr", Q, X[:, -1]) + b                # Q_h x_N + b_h
        offsets = np.arange(N - 1, -1, -1)                               # N - j
        offsets = offsets.astype(object) if theta.dtype == object else offsets.astype(np.float64)
        angles = offsets[:, None, None] * theta[None]                    # (N, H, r/2)
        cos, sin = np.cos(angles), np.sin(angles)
        q = query.reshape(B, 1, self.heads, -1, 2)
        rotated = np.stack([cos * q[..., 0] - sin * q[..., 1], sin * q[..., 0] + cos * q[..., 1]], axis=-1)
        return np.einsum("bnhr,bnhr->bhn", keys, rotated.reshape(B, N, self.heads, -1))

    def _weights(self, X: np.ndarray, parameters: tuple) -> np.ndarray:
        """Attention weights ``a_{h,j}`` (B, H, N) of sequences inside the window."""
        scores = self._scores(X, parameters)
        # the largest score (its float64 midpoint for balls) taken out before the exponential
        scores = scores - mid_float(scores).max(axis=2, keepdims=True)
        weights = np.exp(scores)
        return weights / weights.sum(axis=2, keepdims=True)

    def _groups(self, batch, high: bool):
        """``(index, X)`` per sequence length, X (B, n, d) the tokens inside the window (float64,
        or balls when ``high``)."""
        sequences = as_batch(batch, self.d)
        lengths = np.array([len(X) for X in sequences])
        for length in np.unique(lengths):
            index = np.flatnonzero(lengths == length)
            inside = length if self.window is None else min(length, self.window)
            X = np.stack([np.asarray(sequences[i])[length - inside:] for i in index])
            yield index, (arb_array(X) if high else X.astype(np.float64))

    def head_means(self, batch, precision: int | None = None) -> np.ndarray:
        """``m_h(X) = sum_j a_{h,j} x_j`` for every sequence and head, shape (B, H, d): float64, or
        with ``precision=bits`` an object array of ``arb`` balls computed at ``bits + GUARD_BITS``."""
        if precision is None:
            model = self._float64
            means = np.empty((len(as_batch(batch, self.d)), self.heads, self.d))
            for index, X in self._groups(batch, False):
                means[index] = np.einsum("bhn,bnd->bhd", model._weights(X, model._parameters), X)
            return means
        with working_precision(int(precision) + GUARD_BITS):
            parameters = tuple(arb_array(a) for a in self._parameters)
            means = np.empty((len(as_batch(batch, self.d)), self.heads, self.d), dtype=object)
            for index, X in self._groups(batch, True):
                means[index] = np.einsum("bhn,bnd->bhd", self._weights(X, parameters), X)
        return means

    def __call__(self, batch, precision: int | None = None) -> np.ndarray:
        """``f(X)`` for a batch of sequences (any lengths): (B,) or (B, d_out). In float64, or with
        ``precision=bits`` (tokens float64 or ``mpf``) computed in ball arithmetic and returned as
        ``mpf`` rounded to ``bits`` (object arrays)."""
        if precision is None:
            model = self._float64
            out = np.einsum("hod,bhd->bo", model.V, model.head_means(batch)) + model.c
            return out if self.is_vector else out[:, 0]
        precision = int(precision)
        means = self.head_means(batch, precision)
        with working_precision(precision + GUARD_BITS):
            out = np.einsum("hod,bhd->bo", arb_array(self.V), means) + arb_array(self.c)
            out = np.vectorize(lambda ball: rounded_mpf(ball, precision), otypes=[object])(out)
        return out if self.is_vector else out[:, 0]

    def at_position(self, X, i: int, causal: bool) -> np.ndarray | None:
        """The output at position ``i`` (from 0) of sequence X of a causal layer with this final-token
        model: the model on the prefix ``x_0..x_i`` (float64). ``causal=False``: None, a layer whose
        earlier positions attend to later tokens at negative offsets is not read from this model's
        final-token answers (the causal record then judges the prefixes alone)."""
        if not causal:
            return None
        return np.asarray(self(np.asarray(X, dtype=np.float64)[None, :i + 1]))[0]

    def readout(self, r) -> "RotaryAttention":
        """The scalar model ``r^T f`` (``v_h = V_h^T r``)."""
        r = np.asarray(r, dtype=np.float64)
        if r.shape != (self.d_out,):
            raise ValueError(f"r must have shape (d_out,) = ({self.d_out},), got {r.shape}")
        return self.replaced(V=np.einsum("hod,o->hd", self.V, r), c=float(np.dot(r, np.atleast_1d(self.c))))

    def identifying_matrices(self) -> np.ndarray:
        """The scores' bilinear forms on tokens augmented by a 1, ``[K_h | k_h]^T R_h(delta) [Q_h |
        b_h]`` at delta = 0, 1, 2, shape (H, 3, d + 1, d + 1) (``[W_h(delta) | u_h(delta)]`` above a
        last row that only a key bias fills): together they determine the scores at every offset
        (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'), so two models with equal
        ones and equal values compute the same function.

        The last row is taken relative to its value at delta = 0, ``k_h^T (R_h(delta) - I) [Q_h |
        b_h]``: the same functional of the final token added to every key's score leaves the
        attention unchanged, so only the key bias's change with the offset is seen, and that part
        of a slowly turning block is known only as well as its turn."""
        query = np.concatenate([self.Q, self.b[:, :, None]], axis=2)
        key = np.concatenate([self.K, self.key_bias_or_zero[:, :, None]], axis=2)
        with mpmath.workprec(max(self.precision, mpmath.mp.prec) + GUARD_BITS):
            rotated = self._rotate(np.stack([query] * 3), np.arange(3, dtype=np.float64))  # (3, H, r, d + 1)
            matrices = np.einsum("hrd,thre->htde", key, rotated)
            matrices[:, :, -1, :] = matrices[:, :, -1, :] - matrices[:, :1, -1, :]
            return matrices

    def canonical(self, rtol: float = 1e-9) -> "RotaryAttention":
        """Heads with equal score functions merged (their V summed), heads whose V is zero dropped;
        a key bias in blocks that do not rotate (``theta = 0``) is dropped, since it adds the same
        score to every key."""
        if self.key_bias is not None:
            still = np.repeat(self.theta == 0, 2, axis=1)                # rows of blocks at theta = 0
            return self.replaced(key_bias=np.where(still, 0 * self.key_bias, self.key_bias))._merged(rtol)
        return self._merged(rtol)

    def _merged(self, rtol: float) -> "RotaryAttention":
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
        return self.replaced(Q=self.Q[first], K=self.K[first], theta=self.theta[first], V=values, b=self.b[first],
                             key_bias=None if self.key_bias is None else self.key_bias[first])

    def to_float64(self) -> "RotaryAttention":
        """The model in float64 (itself when it is float64)."""
        if not self.is_high_precision:
            return self
        return RotaryAttention(*(mid_float(a) for a in (self.Q, self.K, self.theta, self.V if self.is_vector else self.v,
                                                          np.asarray(self.c, dtype=object))),
                               self.window, mid_float(self.b),
                               None if self.key_bias is None else mid_float(self.key_bias))

    def scores_moved(self, rng: np.random.Generator, relative: float, bias_relative: float) -> "RotaryAttention":
        """The model with Gaussian score errors: Q, K, b moved by entries of a sixth of ``relative``
        times their largest entry (a score matrix ``K^T R Q`` then moves by about ``relative / 3``),
        theta by ``relative / 3`` radians (the value fit's score-error probe)."""
        Q_size, K_size = float(np.abs(self.Q).max()), float(np.abs(self.K).max())
        b_size = float(np.abs(self.b).max())
        key_bias = self.key_bias
        if key_bias is not None:
            key_bias = key_bias + bias_relative * float(np.abs(key_bias).max()) * rng.standard_normal(key_bias.shape) / 3
        return self.replaced(Q=self.Q + relative * Q_size * rng.standard_normal(self.Q.shape) / 6,
                             K=self.K + relative * K_size * rng.standard_normal(self.K.shape) / 6,
                             theta=self.theta + relative * rng.standard_normal(self.theta.shape) / 3,
                             b=self.b + bias_relative * b_size * rng.standard_normal(self.b.shape) / 3,
                             key_bias=key_bias)

    def with_values(self, V, c) -> "RotaryAttention":
        """The same scores with value read-outs ``V`` (H, d_out, d) and constant ``c`` (d_out,)."""
        return self.replaced(V=V, c=c)

    #: The name of this model class in a saved result (:mod:`mhaextract.models.kinds`).
    kind = "rotary"
    #: The module that puts this model into torch (``layer(model, causal, width, dtype, tolerance)``,
    #: ``state_dict(model, like, tolerance)``): what :func:`mhaextract.to_torch` and
    #: :func:`mhaextract.to_state_dict` dispatch on (a model type without one is refused).
    torch_adapter = "mhaextract.adapters.rotary"

    def to_document(self, exact: bool = False) -> tuple[dict, dict]:
        """``(json_part, arrays)`` for a saved result: ``kind``, ``d``, ``heads``, ``window`` and the
        factors ``Q``, ``K``, ``b``, ``theta``, ``v`` (``V`` (H, d_out, d) for a whole layer), ``c``
        and ``key_bias`` (None where the model has none); float64 numbers and arrays, or with
        ``exact`` every bit of the ``mpf`` parameters as hex strings (and no arrays)."""
        model = self if exact else self.to_float64()
        values = ("V", model.V) if model.is_vector else ("v", model.v)
        numbers = {"Q": model.Q, "K": model.K, "b": model.b, "theta": model.theta, values[0]: values[1],
                   "c": np.asarray(model.c, dtype=model.Q.dtype)}
        if model.key_bias is not None:
            numbers["key_bias"] = model.key_bias
        part = {"kind": self.kind, "d": model.d, "heads": model.heads, "window": model.window, "key_bias": None,
                **{name: document_numbers(array, exact) for name, array in numbers.items()}}
        return part, ({} if exact else numbers)

    @classmethod
    def from_document(cls, part: dict, exact: bool = False) -> "RotaryAttention":
        """Inverse of :meth:`to_document`. A part of format 1 read exactly holds the float64 part's
        entries overwritten by the exact ones, whose values were ``V`` (H, 1, d) for a scalar model."""
        numbers = {name: read_numbers(part[name], exact) for name in ("Q", "K", "theta", "b")}
        values = read_numbers(part["V"] if "V" in part else part["v"], exact)
        c = read_numbers(part["c"], exact)
        if "v" in part:  # the scalar model
            values = values[:, 0, :] if values.ndim == 3 else values
            c = c.reshape(())[()]
        key_bias = None if part.get("key_bias") is None else read_numbers(part["key_bias"], exact)
        return cls(numbers["Q"], numbers["K"], numbers["theta"], values, c, part["window"], numbers["b"], key_bias)


@register_comparison(RotaryAttention)
def compare_rotary(a: RotaryAttention, b: RotaryAttention, rtol: float | None = None) -> Comparison:
    """Errors of ``a`` against the reference ``b`` (a :class:`~mhaextract.Comparison`): heads
    aligned by an assignment on ``(W_h(0), W_h(1), W_h(2), V_h)``; ``W_abs`` is the largest entry
    error of those score matrices, ``v_abs`` of ``V_h``, ``c_abs`` of the constant. ``rtol``: as in
    :meth:`RotaryAttention.canonical` (None: its default). ``mhaextract.compare`` of two rotary
    models runs this."""
    bits = 53
    if a.is_high_precision or b.is_high_precision:  # both in mpf: float64 would hide errors below its rounding
        a, b = a.to_mpf(), b.to_mpf()
        bits = max(a.precision, b.precision)  # a float64 model's exact parameters at the other's precision
    with mpmath.workprec(bits):
        a, b = (a.canonical(), b.canonical()) if rtol is None else (a.canonical(rtol), b.canonical(rtol))
        Wa, Wb = a.identifying_matrices(), b.identifying_matrices()
    cost = (np.abs(Wa[:, None] - Wb[None]).max(axis=(2, 3, 4)) / max(float(np.abs(Wb).max()), 1e-300)
            + np.abs(a.V[:, None] - b.V[None]).max(axis=(2, 3)) / max(float(np.abs(b.V).max()), 1e-300))
    cost = cost.astype(np.float64)
    rows, columns = linear_sum_assignment(cost)
    order = np.argsort(columns)
    aligned, shared = rows[order], columns[order]  # head shared[k] of b is aligned with head aligned[k] of a
    permutation = aligned
    W_abs = float(np.abs(Wa[aligned] - Wb[shared]).max()) if len(shared) else 0.0
    v_abs = float(np.abs(a.V[aligned] - b.V[shared]).max()) if len(shared) else 0.0
    c_abs = float(np.abs(np.atleast_1d(a.c) - np.atleast_1d(b.c)).max())
    c_scale = float(np.abs(np.atleast_1d(b.c)).max())
    return Comparison(heads_agree=a.heads == b.heads and a.window == b.window, heads_a=a.heads, heads_b=b.heads,
                      permutation=permutation, W_abs=W_abs, v_abs=v_abs,
                      W_rel=W_abs / max(float(np.abs(Wb).max()), 1e-300),
                      v_rel=v_abs / max(float(np.abs(b.V).max()), 1e-300),
                      c_abs=c_abs, c_rel=c_abs / c_scale if c_scale > 0 else c_abs)
