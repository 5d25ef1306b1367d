"""The target: multi-head softmax attention read out at the final token (docs/algorithm.md §1, §16).

For a sequence ``X = (x_1, ..., x_N)`` of tokens in R^d and heads ``(W_h, v_h, u_h)``::

    s_{h,i} = x_i^T (W_h x_N + u_h)                score of token i (key on the left)
    a_{h,i} = exp(s_{h,i}) / sum_j exp(s_{h,j})    softmax over all N tokens, x_N included
    f(X)    = c + sum_h sum_i a_{h,i} v_h^T x_i    the one scalar an oracle returns

``u_h`` (the query bias seen through the keys) and the constant ``c`` (value and output biases)
are zero in the paper's model (§1) and in a model built without them.

Canonical form: heads with equal ``(W_h, u_h)`` act as one head with the sum of their ``v_h``; a
merged head whose summed value vector is zero contributes nothing. Only canonical heads are
identifiable, and only up to permutation.
"""

from __future__ import annotations

from typing import Sequence

import mpmath
import numpy as np
from flint import arb, arb_mat

from .numerics.highprec import arb_to_mpf, mpf_array, to_arb, working_precision


def as_batch(batch, d: int | None = None) -> list[np.ndarray]:
    """Validate a batch of sequences: a list of 2-D arrays (N_i, d) or one 3-D array (B, N, d)."""
    if isinstance(batch, np.ndarray) and batch.ndim == 3:
        sequences = list(batch)
    elif isinstance(batch, np.ndarray) and batch.ndim == 2 and batch.dtype != object:
        raise ValueError(
            "a batch is a list of sequences of shape (N, d) (or one array (B, N, d)); "
            f"got one 2-D array of shape {batch.shape}: wrap a single sequence in a list"
        )
    else:
        sequences = list(batch)
    out = []
    for index, sequence in enumerate(sequences):
        array = np.asarray(sequence)
        if array.ndim != 2 or array.shape[0] < 1:
            raise ValueError(f"sequence {index} must have shape (N, d) with N >= 1, got {array.shape}")
        if d is not None and array.shape[1] != d:
            raise ValueError(f"sequence {index} has tokens of dimension {array.shape[1]}, expected d = {d}")
        out.append(array)
    return out


def group_equal_heads(W: np.ndarray, rtol: float = 0.0, u: np.ndarray | None = None) -> list[list[int]]:
    """Indices of heads with equal score matrices (max entry difference <= ``rtol * max|W|``) and,
    when ``u`` is given, equal score biases (likewise against ``max|u|``), in order of first
    appearance: the heads that merge in a canonical form."""
    magnitude = np.vectorize(lambda value: abs(float(value)), otypes=[np.float64])

    def size(array):
        if not array.size:
            return 0.0
        return float(magnitude(array).max()) if array.dtype == object else float(np.abs(array).max())

    W_scale = size(W)
    u_scale = size(u) if u is not None else 0.0
    groups: list[list[int]] = []
    for h in range(W.shape[0]):
        for group in groups:
            same = size(W[h] - W[group[0]]) <= rtol * W_scale
            if same and u is not None:
                same = size(u[h] - u[group[0]]) <= rtol * u_scale
            if same:
                group.append(h)
                break
        else:
            groups.append([h])
    return groups


class MultiHeadAttention:
    """Multi-head softmax attention with a scalar read-out at the final token.

    Parameters
    ----------
    W : array of shape (H, d, d)
        Bilinear score matrices; ``s_{h,i} = x_i^T W_h x_N``.
    v : array of shape (H, d)
        Value read-out vectors.
    u : array of shape (H, d), optional
        Score biases: ``s_{h,i} = x_i^T (W_h x_N + u_h)`` (docs/algorithm.md §16). Default zero.
    c : scalar, optional
        Output constant added to every answer. Default zero.

    All are float64, or ``mpmath.mpf`` (object arrays) for a high-precision model.

    Attributes
    ----------
    W, v, u : the parameters (float64 or object arrays); ``u`` is zeros when not given.
    c : the constant (float, or ``mpf`` for a high-precision model).
    d : int, the token dimension.
    heads : int, the number of heads H (not necessarily canonical).
    has_bias : bool, some ``u_h`` or ``c`` is non-zero.
    """

    def __init__(self, W, v, u=None, c=0.0):
        W = np.asarray(W)
        v = np.asarray(v)
        if W.ndim != 3 or W.shape[1] != W.shape[2]:
            raise ValueError(f"W must have shape (H, d, d), got {W.shape}")
        if v.shape != W.shape[:2]:
            raise ValueError(f"v must have shape (H, d) = {W.shape[:2]}, got {v.shape}")
        u = np.zeros(W.shape[:2], dtype=W.dtype if W.dtype == object else np.float64) if u is None else np.asarray(u)
        if u.shape != W.shape[:2]:
            raise ValueError(f"u must have shape (H, d) = {W.shape[:2]}, got {u.shape}")
        if np.ndim(c) != 0:
            raise ValueError(f"c must be a scalar, got shape {np.shape(c)}")
        if W.dtype == object or v.dtype == object or u.dtype == object or isinstance(c, mpmath.mpf):
            W, v, u = mpf_array(W), mpf_array(v), mpf_array(u)  # exact: mpf entries are kept, floats converted
            c = mpf_array(np.array([c], dtype=object))[0]
            finite = all(mpmath.isfinite(value) for value in list(W.ravel()) + list(v.ravel()) + list(u.ravel()) + [c])
        else:
            W, v, u = W.astype(np.float64), v.astype(np.float64), u.astype(np.float64)
            c = float(c)
            finite = bool(np.isfinite(W).all() and np.isfinite(v).all() and np.isfinite(u).all() and np.isfinite(c))
        if not finite:
            raise ValueError("W, v, u and c must be finite")
        self.W = W
        self.v = v
        self.u = u
        self.c = c

    @property
    def has_bias(self) -> bool:
        return bool(any(value != 0 for value in self.u.ravel()) or self.c != 0)

    @property
    def d(self) -> int:
        return self.W.shape[1]

    @property
    def heads(self) -> int:
        return self.W.shape[0]

    @property
    def is_high_precision(self) -> bool:
        return self.W.dtype == object

    def __repr__(self) -> str:
        kind = "mpf" if self.is_high_precision else "float64"
        bias = ", biased" if self.has_bias else ""
        return f"MultiHeadAttention(d={self.d}, heads={self.heads}, {kind}{bias})"

    @classmethod
    def random(cls, d: int, heads: int, seed=None, bias: bool = False, rank: int | None = None) -> "MultiHeadAttention":
        """A random target: ``W_h`` with i.i.d. N(0, 1/d) entries and ``v_h`` with N(0, 1) entries;
        with ``bias=True`` also ``u_h`` with N(0, 1/sqrt(d)) entries and ``c`` N(0, 1) (the same
        draws of W and v as without). ``rank=r``: ``W_h = A_h B_h^T / sqrt(d r)`` with Gaussian
        ``A_h``, ``B_h`` (d x r), of rank r with entries of variance 1/d (the low-rank schedule's
        targets, docs/algorithm.md §17).

        The 1/d variance keeps ``z^T W_h x`` of order one for tokens of norm ``d**0.25``, the
        default token scale of :func:`mhaextract.extract`; ``u_h`` of norm ``d**0.25`` keeps
        ``z^T u_h`` of order one there too.
        """
        if int(d) < 1 or int(heads) < 1:
            raise ValueError(f"d and heads must be positive, got d={d}, heads={heads}")
        rng = np.random.default_rng(seed)
        if rank is None:
            W = rng.standard_normal((heads, d, d)) / np.sqrt(d)
        else:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= rank <= d:
                raise ValueError(f"rank must be an integer 1 <= rank <= d = {d}, got {rank!r}")
            A, B = rng.standard_normal((2, heads, d, int(rank)))
            W = np.einsum("hdr,her->hde", A, B) / np.sqrt(d * rank)
        v = rng.standard_normal((heads, d))
        if not bias:
            return cls(W, v)
        u = rng.standard_normal((heads, d)) / d**0.25
        return cls(W, v, u, float(rng.standard_normal()))

    def suggested_token_scale(self) -> float:
        """The token norm ``s`` at which the schedule's log-poles ``z^T W_h x`` are of order one.

        For ``x``, ``z`` of norm ``s`` in independent uniformly random directions,
        ``E[(z^T W x)^2] = s^4 ||W||_F^2 / d^2``; the RMS is one at ``s = sqrt(d / ||W||_F)``,
        taken for the largest ``||W_h||_F``. For W with N(0, 1/d) entries (``||W||_F ~ sqrt(d)``)
        this is ``d ** 0.25``, the default of :func:`mhaextract.extract`.
        """
        norms = [float(np.linalg.norm(np.asarray(W_h, dtype=np.float64))) for W_h in self.to_float64().W]
        largest = max(norms, default=0.0)
        if largest == 0.0:
            raise ValueError("every W_h is zero: the scores do not depend on the tokens, any token_scale will do")
        return float(np.sqrt(self.d / largest))

    def to_float64(self) -> "MultiHeadAttention":
        if not self.is_high_precision:
            return self
        to_float = np.vectorize(float, otypes=[np.float64])
        return MultiHeadAttention(to_float(self.W), to_float(self.v), to_float(self.u), float(self.c))

    # ------------------------------------------------------------------ evaluation
    def __call__(self, batch, precision: int | None = None, dtype=np.float64):
        """Outputs f(X) for a batch of sequences.

        In float64 (``precision=None``) returns a float64 array of shape (B,). With
        ``precision=bits`` the sequences may hold ``mpmath.mpf`` (or floats) and the outputs are
        a list of ``mpf`` computed with ball arithmetic at ``bits`` (+ guard) bits.
        ``dtype=np.float32`` evaluates in float32 throughout (tokens, parameters and arithmetic
        rounded to float32; a lower-precision target, see :class:`mhaextract.oracle.noise.Float32Oracle`).
        """
        sequences = as_batch(batch, self.d)
        if precision is None:
            dtype = np.dtype(dtype)
            if dtype not in (np.float64, np.float32):
                raise ValueError(f"dtype must be float64 or float32, got {dtype}")
            return self._evaluate_float(sequences, dtype)
        return self._evaluate_arb(sequences, int(precision))

    def head_means(self, batch, precision: int | None = None) -> np.ndarray:
        """The attention-weighted mean token of every head, ``m_h(X) = sum_i a_{h,i} x_i``.

        The output is ``f(X) = sum_h v_h^T m_h(X)``; a one-layer Transformer reads the same means
        through its value-output maps (docs/algorithm.md §14). Returns float64 (B, H, d), or with
        ``precision=bits`` an object array (B, H, d) of flint ``arb`` balls computed at
        ``bits + 32`` bits (the caller sets nothing; the balls carry their own precision).
        """
        if precision is None and isinstance(batch, np.ndarray) and batch.ndim == 3 and batch.dtype == np.float64:
            # One (B, N, d) float64 array: computed as one group, no per-sequence work.
            if batch.shape[1] < 1 or batch.shape[2] != self.d:
                raise ValueError(f"a batch array must have shape (B, N >= 1, d = {self.d}), got {batch.shape}")
            return self._means_float64(batch)
        sequences = as_batch(batch, self.d)
        if precision is None:
            return self._means_float64(sequences)
        return self._means_arb(sequences, int(precision))

    def _evaluate_float(self, sequences: Sequence[np.ndarray], dtype=np.float64) -> np.ndarray:
        model = self.to_float64()
        v, c = model.v.astype(dtype), np.dtype(dtype).type(model.c)
        out = np.empty(len(sequences), dtype=dtype)
        for index, X, weights in self._weights_float(sequences, dtype):
            values = np.einsum("bnd,hd->bhn", X, v)  # v_h^T x_i, (B, H, N)
            out[index] = np.einsum("bhn,bhn->b", weights, values) + c
        return out

    def copies_outputs(self, finals, final_of, differences, which, copies) -> np.ndarray:
        """float64 outputs on copies sequences ``(y, ..., y, x)``: query q has ``copies[q]`` copies of
        ``y = x - differences[t]``, ``x = finals[final_of[t]]``, ``t = which[q]``
        (:class:`mhaextract.oracle.queries.CopiesQueries`). ``W_h x + u_h`` once per final token, scores
        and values once per instance, then per query
        ``c + sum_h (k e_y v_h^T y + e_x v_h^T x) / (k e_y + e_x)``: ``self(sequences)`` to rounding,
        in O(H d) per instance and O(H) per query instead of O(N H d^2) per query."""
        model = self.to_float64()
        W, v, u = model.W, model.v, model.u
        heads, d = W.shape[0], W.shape[1]
        finals, differences = np.asarray(finals, dtype=np.float64), np.asarray(differences, dtype=np.float64)
        final_of, which, k = np.asarray(final_of, dtype=int), np.asarray(which, dtype=int), np.asarray(copies)
        if not len(which):
            return np.empty(0)
        # one BLAS product for all final tokens (a kept sample has thousands: stacked per token, a
        # matrix-vector product each, it was half of this evaluation's time at d = 64)
        queries = (finals @ W.reshape(heads * d, d).T).reshape(len(finals), heads, d) + u[None]
        y = finals[final_of] - differences  # (n, d)
        # each instance's y against its final token's W_h x + u_h, gathered in chunks of ~8 MB (half the
        # time of one BLAS product per final token over the grid's d^2 instances on 4d finals, d = 128)
        s_y = np.empty((len(y), heads))
        step = max(1, 2**20 // max(1, heads * d))
        for start in range(0, len(y), step):
            part = slice(start, start + step)
            s_y[part] = np.einsum("nd,nhd->nh", y[part], queries[final_of[part]])
        s_x = np.einsum("fd,fhd->fh", finals, queries)[final_of][which]  # (Q, H)
        s_y = s_y[which]
        v_x, v_y = (finals @ v.T)[final_of][which], (y @ v.T)[which]
        top = np.where(k[:, None] > 0, np.maximum(s_x, s_y), s_x)
        e_x, e_y = np.exp(s_x - top), k[:, None] * np.exp(s_y - top)
        return ((e_y * v_y + e_x * v_x) / (e_y + e_x)).sum(axis=1) + model.c

    def _means_float64(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        out = np.empty((len(sequences), self.heads, self.d), dtype=np.float64)
        for index, X, weights in self._weights_float(sequences):
            out[index] = np.einsum("bhn,bnd->bhd", weights, X)
        return out

    def _weights_float(self, sequences: Sequence[np.ndarray], dtype=np.float64):
        """Per group of equal lengths: (indices, tokens (B, N, d), softmax weights a_{h,i} (B, H, N)),
        computed in ``dtype`` (float64, or float32 for a lower-precision target). ``sequences``
        may be one (B, N, d) array: one group."""
        model = self.to_float64()
        W, u = model.W.astype(dtype), model.u.astype(dtype)
        if isinstance(sequences, np.ndarray) and sequences.ndim == 3:
            groups = [(np.arange(len(sequences)), sequences.astype(dtype, copy=False))]
        else:
            lengths = np.array([len(s) for s in sequences])
            groups = ((index, np.stack([np.asarray(sequences[i], dtype=dtype) for i in index]))  # (B, N, d)
                      for index in (np.flatnonzero(lengths == length) for length in np.unique(lengths)))
        heads, d = W.shape[0], W.shape[1]
        W_rows = W.reshape(heads * d, d)  # row (h, a): row a of W_h
        for index, X in groups:
            # W_h x_N + u_h (B, H, d): one BLAS product per sequence (stacked), not einsum (slower),
            # and not one product for the batch, whose rounding would depend on the batch's size.
            queries = np.matmul(X[:, -1:, :], W_rows.T).reshape(len(index), heads, d) + u[None]
            scores = np.einsum("bnd,bhd->bhn", X, queries)  # (B, H, N)
            scores -= scores.max(axis=2, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=2, keepdims=True)
            yield index, X, weights

    def _evaluate_arb(self, sequences: Sequence[np.ndarray], precision: int) -> list:
        means = self._means_arb(sequences, precision)
        with working_precision(precision + 32):
            v = np.vectorize(to_arb, otypes=[object])(self.v)
            outputs = []
            c = to_arb(self.c)
            for row in means:
                # Head by head: heads that cancel (equal W, opposite v) then cancel exactly.
                total = c
                for h in range(self.heads):
                    total += sum((row[h, a] * v[h, a] for a in range(self.d)), arb(0))
                with mpmath.workprec(precision):
                    outputs.append(+arb_to_mpf(total))  # unary + rounds to `precision` bits
            return outputs

    def _means_arb(self, sequences: Sequence[np.ndarray], precision: int) -> np.ndarray:
        H, d = self.heads, self.d
        out = np.empty((len(sequences), H, d), dtype=object)
        with working_precision(precision + 32):
            # [W_1 | ... | W_H] (d x Hd) so that X Wcat holds x_i^T W_h in block h.
            W_cat = arb_mat(d, H * d)
            U = arb_mat(d, H)  # column h is u_h: X U holds the scores' bias terms x_i^T u_h
            for h in range(H):
                for a in range(d):
                    U[a, h] = to_arb(self.u[h, a])
                    for b in range(d):
                        W_cat[a, h * d + b] = to_arb(self.W[h, a, b])
            for index, sequence in enumerate(sequences):
                N = sequence.shape[0]
                X = arb_mat(N, d)
                for i in range(N):
                    for a in range(d):
                        X[i, a] = to_arb(sequence[i, a])
                final = arb_mat(H * d, H)  # block-diagonal copies of x_N
                for h in range(H):
                    for b in range(d):
                        final[h * d + b, h] = X[N - 1, b]
                scores = (X * W_cat) * final + X * U  # (N, H)
                attention = arb_mat(H, N)  # a_{h,i}
                for h in range(H):
                    top = max(float(scores[i, h].mid()) for i in range(N))
                    weights = [(scores[i, h] - top).exp() for i in range(N)]
                    denominator = sum(weights, arb(0))
                    for i in range(N):
                        attention[h, i] = weights[i] / denominator
                means = attention * X  # (H, d): one matrix product in C, not H*N*d Python steps
                for h in range(H):
                    for a in range(d):
                        out[index, h, a] = means[h, a]
        return out

    # ------------------------------------------------------------------ canonical form
    def canonical(self, rtol: float = 0.0) -> "MultiHeadAttention":
        """The canonical form: equal (W, u)'s merged (v's summed), zero merged v's dropped; c kept.

        ``rtol`` is the tolerance, relative to the largest entry of W (resp. u, v), under which two
        heads count as equal (resp. a summed v as zero). The default 0 merges exact equality only.
        """
        W, v, u = self.W, self.v, self.u
        W_mag = np.vectorize(lambda value: abs(float(value)), otypes=[np.float64])
        v_abs = W_mag(v) if v.dtype == object else np.abs(v)
        v_scale = float(v_abs.max()) if v.size else 0.0
        groups = group_equal_heads(W, rtol, u)
        W_out, v_out, u_out = [], [], []
        for group in groups:
            # mpf sums are exact here (enough bits for any sum of a few doubles); float64 rounds.
            with mpmath.workprec(2200):
                summed = v[group].sum(axis=0)
            size = W_mag(summed).max() if v.dtype == object else np.abs(summed).max()
            if size > rtol * v_scale:
                W_out.append(W[group[0]])
                v_out.append(summed)
                u_out.append(u[group[0]])
        dtype = object if self.is_high_precision else np.float64
        if not W_out:
            return MultiHeadAttention(np.zeros((0, self.d, self.d), dtype=dtype), np.zeros((0, self.d), dtype=dtype),
                                      np.zeros((0, self.d), dtype=dtype), self.c)
        return MultiHeadAttention(np.array(W_out, dtype=dtype), np.array(v_out, dtype=dtype),
                                  np.array(u_out, dtype=dtype), self.c)
