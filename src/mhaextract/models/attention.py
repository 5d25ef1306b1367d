"""The target: multi-head softmax attention read out at the final token (docs/algorithm.md, 'The model', 'Biases: affine
scores and an output constant' and 'The whole layer: vector outputs and a replacement module').

For a sequence ``X = (x_1, ..., x_N)`` of tokens in R^d and heads ``(W_h, V_h, u_h)``::

    s_{h,i} = x_i^T (W_h x_N + u_h)                score of token i (key on the left)
    a_{h,i} = exp(s_{h,i}) / sum_j exp(s_{h,j})    softmax over all N tokens, x_N included
    f(X)    = c + sum_h V_h sum_i a_{h,i} x_i      the output an oracle returns

``V_h`` is a ``d_out x d`` value read-out (``W_O,h W_V,h`` of a real layer) and ``c`` a vector of
``d_out`` (value and output biases). The paper's scalar model is ``d_out = 1`` with ``v_h = V_h^T``:
``f(X) = c + sum_h sum_i a_{h,i} v_h^T x_i``, one number per sequence. ``u_h`` (the query bias
seen through the keys) and ``c`` are zero in the paper's model ('The model') and in a model built without
them.

Canonical form: heads with equal ``(W_h, u_h)`` act as one head with the sum of their ``V_h``; a
merged head whose summed value read-out is zero contributes nothing. Only canonical heads are
identifiable, and only up to permutation.
"""

from __future__ import annotations

from typing import Sequence

import mpmath
import numpy as np
from flint import arb, arb_mat

from ..numerics.highprec import mpf_array, rounded_mpf, to_arb, working_precision
from .kinds import document_numbers, read_numbers, register_model_kind


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


@register_model_kind
class MultiHeadAttention:
    """Multi-head softmax attention read out at the final token: a scalar or a vector of d_out outputs.

    Parameters
    ----------
    W : array of shape (H, d, d)
        Bilinear score matrices; ``s_{h,i} = x_i^T W_h x_N``.
    V : array of shape (H, d) or (H, d_out, d)
        Value read-outs. Shape (H, d): the scalar model, one value vector ``v_h`` per head (the
        paper's model; ``f(X)`` is a number). Shape (H, d_out, d): the vector model, one
        ``d_out x d`` matrix ``V_h = W_O,h W_V,h`` per head (a real layer's whole output).
    u : array of shape (H, d), optional
        Score biases: ``s_{h,i} = x_i^T (W_h x_N + u_h)`` (docs/algorithm.md, 'Biases: affine scores and an output
        constant'). Default zero.
    c : scalar, or array of shape (d_out,) for the vector model, optional
        Output constant added to every answer. Default zero. All are float64, or ``mpmath.mpf``
        (object arrays) for a high-precision model.

    Attributes
    ----------
    W, u : the parameters (float64 or object arrays); ``u`` is zeros when not given.
    V : (H, d_out, d) value read-outs (the scalar model's ``v[:, None, :]``).
    v : (H, d) value vectors of the scalar model (a vector model has none: see :meth:`readout`).
    c : the constant (float or ``mpf``; a (d_out,) array for the vector model).
    d : int, the token dimension.
    d_out : int, outputs per sequence (1 for the scalar model).
    is_vector : bool, the vector model (``model(batch)`` has shape (B, d_out), not (B,)).
    heads : int, the number of heads H (not necessarily canonical).
    has_bias : bool, some ``u_h`` or ``c`` is non-zero.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> scalar = mx.MultiHeadAttention.random(d=4, heads=2, seed=0)
    >>> scalar(np.ones((3, 5, 4))).shape                      # 3 sequences of 5 tokens
    (3,)
    >>> layer = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, d_out=6, bias=True)
    >>> layer.V.shape, layer.c.shape, layer(np.ones((3, 5, 4))).shape
    ((2, 6, 4), (6,), (3, 6))
    >>> r = np.arange(6.0)
    >>> bool(np.allclose(layer.readout(r)(np.ones((3, 5, 4))), layer(np.ones((3, 5, 4))) @ r))
    True
    """

    def __init__(self, W, V, u=None, c=None):
        W = np.asarray(W)
        V = np.asarray(V)
        if W.ndim != 3 or W.shape[1] != W.shape[2]:
            raise ValueError(f"W must have shape (H, d, d), got {W.shape}")
        vector = V.ndim == 3
        if vector and (V.shape[0] != W.shape[0] or V.shape[2] != W.shape[1]):
            raise ValueError(f"V must have shape (H, d_out, d) = ({W.shape[0]}, d_out, {W.shape[1]}), got {V.shape}")
        if not vector and V.shape != W.shape[:2]:
            raise ValueError(f"v must have shape (H, d) = {W.shape[:2]} (the scalar model), or V "
                             f"(H, d_out, d) = ({W.shape[0]}, d_out, {W.shape[1]}) (the vector model); got {V.shape}")
        u = np.zeros(W.shape[:2], dtype=W.dtype if W.dtype == object else np.float64) if u is None else np.asarray(u)
        if u.shape != W.shape[:2]:
            raise ValueError(f"u must have shape (H, d) = {W.shape[:2]}, got {u.shape}")
        if c is None:
            c = np.zeros(V.shape[1]) if vector else 0.0
        if vector and np.shape(c) != (V.shape[1],):
            raise ValueError(f"c must have shape (d_out,) = ({V.shape[1]},) for V of shape {V.shape}, got {np.shape(c)}")
        if not vector and np.ndim(c) != 0:
            raise ValueError(f"c must be a scalar for the scalar model (v of shape (H, d)), got shape {np.shape(c)}")
        c_array = np.asarray(c) if vector else np.array([c], dtype=object)
        if (W.dtype == object or V.dtype == object or u.dtype == object or c_array.dtype == object and
                any(isinstance(value, mpmath.mpf) for value in c_array)):
            W, V, u = mpf_array(W), mpf_array(V), mpf_array(u)  # exact: mpf entries are kept, floats converted
            c_array = mpf_array(np.asarray(c_array, dtype=object))
            finite = all(mpmath.isfinite(value) for value in
                         list(W.ravel()) + list(V.ravel()) + list(u.ravel()) + list(c_array))
        else:
            W, V, u = W.astype(np.float64), V.astype(np.float64), u.astype(np.float64)
            c_array = np.asarray(c_array, dtype=np.float64)
            finite = bool(np.isfinite(W).all() and np.isfinite(V).all() and np.isfinite(u).all()
                          and np.isfinite(c_array).all())
        if not finite:
            raise ValueError("W, V, u and c must be finite")
        self.W = W
        self.V = V if vector else V[:, None, :]
        self.u = u
        self.is_vector = vector
        self.c = c_array if vector else (c_array[0] if c_array.dtype == object else float(c_array[0]))

    @property
    def v(self) -> np.ndarray:
        """The scalar model's value vectors ``v_h`` (H, d); a vector model has ``V`` instead."""
        if self.is_vector:
            raise AttributeError(f"a model with d_out = {self.d_out} outputs has V (H, d_out, d), not v: "
                                 "model.readout(r) is its scalar model r^T f, with v_h = V_h^T r")
        return self.V[:, 0, :]

    @property
    def d_out(self) -> int:
        return self.V.shape[1]

    @property
    def has_bias(self) -> bool:
        return bool(any(value != 0 for value in self.u.ravel()) or any(value != 0 for value in np.ravel(self.c)))

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
        outputs = f", d_out={self.d_out}" if self.is_vector else ""
        return f"MultiHeadAttention(d={self.d}, heads={self.heads}{outputs}, {kind}{bias})"

    @classmethod
    def random(cls, d: int, heads: int, seed=None, bias: bool = False, rank: int | None = None,
               d_out: int | None = None) -> "MultiHeadAttention":
        """A random target: ``W_h`` with i.i.d. N(0, 1/d) entries and ``v_h`` with N(0, 1) entries;
        with ``bias=True`` also ``u_h`` with N(0, 1/sqrt(d)) entries and ``c`` N(0, 1) (the same
        draws of W and v as without). ``rank=r``: ``W_h = A_h B_h^T / sqrt(d r)`` with Gaussian
        ``A_h``, ``B_h`` (d x r), of rank r with entries of variance 1/d (the low-rank schedule's
        targets, docs/algorithm.md, 'Low-rank heads'). ``d_out=n``: the vector model, ``V_h`` (n x d) with N(0, 1)
        entries in place of ``v_h`` and ``c`` of n N(0, 1) entries (the same draws of W).

        The 1/d variance keeps ``z^T W_h x`` of order one for tokens of norm ``d**0.25``, the
        default token scale of :func:`mhaextract.extract`; ``u_h`` of norm ``d**0.25`` keeps
        ``z^T u_h`` of order one there too.

        Examples
        --------
        >>> import mhaextract as mx
        >>> mx.MultiHeadAttention.random(d=8, heads=3, seed=0, bias=True)
        MultiHeadAttention(d=8, heads=3, float64, biased)
        >>> mx.MultiHeadAttention.random(d=8, heads=3, seed=0, d_out=8).V.shape
        (3, 8, 8)
        """
        if int(d) < 1 or int(heads) < 1:
            raise ValueError(f"d and heads must be positive, got d={d}, heads={heads}")
        if d_out is not None and (isinstance(d_out, bool) or not isinstance(d_out, (int, np.integer)) or d_out < 1):
            raise ValueError(f"d_out must be a positive integer (outputs per sequence) or None, got {d_out!r}")
        rng = np.random.default_rng(seed)
        if rank is None:
            W = rng.standard_normal((heads, d, d)) / np.sqrt(d)
        else:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= rank <= d:
                raise ValueError(f"rank must be an integer 1 <= rank <= d = {d}, got {rank!r}")
            A, B = rng.standard_normal((2, heads, d, int(rank)))
            W = np.einsum("hdr,her->hde", A, B) / np.sqrt(d * rank)
        V = rng.standard_normal((heads, d) if d_out is None else (heads, int(d_out), d))
        if not bias:
            return cls(W, V)
        u = rng.standard_normal((heads, d)) / d**0.25
        c = float(rng.standard_normal()) if d_out is None else rng.standard_normal(int(d_out))
        return cls(W, V, u, c)

    def suggested_token_scale(self) -> float:
        """The token norm ``s`` at which the schedule's log-poles ``z^T W_h x`` are of order one.

        For ``x``, ``z`` of norm ``s`` in independent uniformly random directions,
        ``E[(z^T W x)^2] = s^4 ||W||_F^2 / d^2``; the RMS is one at ``s = sqrt(d / ||W||_F)``,
        taken for the largest ``||W_h||_F``. For W with N(0, 1/d) entries (``||W||_F ~ sqrt(d)``)
        this is ``d ** 0.25``, the default of :func:`mhaextract.extract`.

        Examples
        --------
        >>> import mhaextract as mx
        >>> round(mx.MultiHeadAttention.random(d=16, heads=2, seed=0).suggested_token_scale(), 1)
        2.0
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
        c = to_float(self.c) if self.is_vector else float(self.c)
        return MultiHeadAttention(to_float(self.W), to_float(self.V if self.is_vector else self.v), to_float(self.u), c)

    def with_values(self, V, c) -> "MultiHeadAttention":
        """The same scores with value read-outs ``V`` (H, d_out, d) and constant ``c`` (d_out,)."""
        return MultiHeadAttention(self.W, V, self.u, c)

    #: The name of this model class in a saved result (:mod:`mhaextract.models.kinds`).
    kind = "attention"
    #: The module that puts this model into torch (``layer(model, causal, width, dtype, tolerance)``,
    #: ``state_dict(model, like, tolerance)``): what :func:`mhaextract.to_torch` and
    #: :func:`mhaextract.to_state_dict` dispatch on (a model type without one is refused).
    torch_adapter = "mhaextract.adapters.attention"

    def to_document(self, exact: bool = False) -> tuple[dict, dict]:
        """``(json_part, arrays)`` for a saved result: ``kind``, ``d``, ``heads`` and ``W``, ``v``
        (``V`` (H, d_out, d) for the vector model), ``u``, ``c``; float64 numbers and arrays, or
        with ``exact`` every bit as hex strings (and no arrays)."""
        model = self if exact else self.to_float64()
        values = ("V", model.V) if model.is_vector else ("v", model.v)
        numbers = {"W": model.W, values[0]: values[1], "u": model.u, "c": np.asarray(model.c, dtype=model.W.dtype)}
        part = {"kind": self.kind, "d": model.d, "heads": model.heads,
                **{name: document_numbers(array, exact) for name, array in numbers.items()}}
        return part, ({} if exact else numbers)

    @classmethod
    def from_document(cls, part: dict, exact: bool = False) -> "MultiHeadAttention":
        """Inverse of :meth:`to_document`. A run with no head stored empty lists; parts written
        before biases existed (docs/algorithm.md, 'Biases: affine scores and an output constant') have no ``u`` and ``c``: zero."""
        d = part["d"]
        W = read_numbers(part["W"], exact).reshape(-1, d, d)
        u = None if part.get("u") is None else read_numbers(part["u"], exact).reshape(-1, d)
        c = read_numbers(part.get("c", 0.0), exact)
        if "V" in part:  # the vector model: V (H, d_out, d) and c (d_out,)
            return cls(W, read_numbers(part["V"], exact).reshape(-1, len(c), d), u, c)
        return cls(W, read_numbers(part["v"], exact).reshape(-1, d), u, c[()])

    def scores_moved(self, rng: np.random.Generator, relative: float, bias_relative: float) -> "MultiHeadAttention":
        """The model with Gaussian score errors: W and u moved by entries of a third of ``relative``
        (and ``bias_relative``) times their largest entry (the value fit's score-error probe)."""
        W_size, u_size = float(np.abs(self.W).max()), float(np.abs(self.u).max())
        return MultiHeadAttention(self.W + relative * W_size * rng.standard_normal(self.W.shape) / 3, self.V if
                                  self.is_vector else self.v,
                                  self.u + bias_relative * u_size * rng.standard_normal(self.u.shape) / 3, self.c)

    def scores_moved_by(self, rng: np.random.Generator, W_deviation: np.ndarray,
                        u_deviation: np.ndarray | None = None) -> "MultiHeadAttention":
        """The model with Gaussian score errors of the given standard deviation per entry (W's (H, d, d),
        u's (H, d) or None: u kept), the value fit's score-error probe where the schedule estimated each entry's."""
        W = self.W + W_deviation * rng.standard_normal(self.W.shape)
        u = self.u if u_deviation is None else self.u + u_deviation * rng.standard_normal(self.u.shape)
        return MultiHeadAttention(W, self.V if self.is_vector else self.v, u, self.c)

    def readout(self, r) -> "MultiHeadAttention":
        """The scalar model ``r^T f``: ``v_h = V_h^T r`` and ``r^T c`` (what an oracle read out through ``r`` answers).

        Examples
        --------
        >>> import numpy as np
        >>> import mhaextract as mx
        >>> layer = mx.MultiHeadAttention.random(d=4, heads=2, seed=1, d_out=3)
        >>> layer.readout(np.array([0.0, 1.0, 0.0])).v.shape
        (2, 4)
        """
        r = np.asarray(r)
        if r.shape != (self.d_out,):
            raise ValueError(f"the read-out must be a vector of d_out = {self.d_out} entries, got shape {r.shape}")
        if self.is_high_precision or r.dtype == object:
            with mpmath.workprec(2200):  # exact for float64 products and short sums
                V, r_mp, c = mpf_array(self.V), mpf_array(r.astype(object)), mpf_array(np.ravel(np.asarray(self.c, dtype=object)))
                v = np.einsum("hod,o->hd", V, r_mp)
                scalar_c = sum((c[o] * r_mp[o] for o in range(self.d_out)), mpmath.mpf(0))
            return MultiHeadAttention(self.W, v, self.u, scalar_c)
        r = r.astype(np.float64)
        return MultiHeadAttention(self.W, np.einsum("hod,o->hd", self.V, r), self.u, float(np.ravel(self.c) @ r))

    def at_position(self, X, i: int, causal: bool) -> np.ndarray:
        """The output at position ``i`` (from 0) of sequence X of a layer whose final-token function is
        this model, in float64: ``causal=True`` (a decoder's) the model on the prefix ``x_0..x_i``;
        ``causal=False`` (an encoder's) ``x_i`` the query token and every token a key, which,
        attention without positions not seeing the keys' order, is the model of X with ``x_i`` moved
        last. (The causal record compares a layer's own outputs at earlier positions with both,
        docs/algorithm.md, "The whole layer: vector outputs and a replacement module".)

        Examples
        --------
        >>> import numpy as np
        >>> import mhaextract as mx
        >>> model = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
        >>> X = np.random.default_rng(1).normal(size=(5, 3))
        >>> bool(np.isclose(model.at_position(X, 4, causal=False), model([X])[0]))  # the final position
        True
        >>> bool(np.isclose(model.at_position(X, 1, causal=True), model([X[:2]])[0]))
        True
        """
        X = np.asarray(X, dtype=np.float64)
        sequence = X[:i + 1] if causal else np.concatenate([np.delete(X, i, axis=0), X[i:i + 1]])
        return np.asarray(self.to_float64()([sequence]))[0]

    # ------------------------------------------------------------------ evaluation
    def __call__(self, batch, precision: int | None = None, dtype=np.float64):
        """Outputs f(X) for a batch of sequences.

        In float64 (``precision=None``) returns a float64 array of shape (B,), (B, d_out) for the
        vector model. With ``precision=bits`` the sequences may hold ``mpmath.mpf`` (or floats) and
        the outputs are a list of ``mpf`` (an object array (B, d_out) for the vector model) computed
        with ball arithmetic at ``bits`` (+ guard) bits.
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
        through its value-output maps (docs/algorithm.md, 'The one-layer Transformer'). Returns float64 (B, H, d), or
        with ``precision=bits`` an object array (B, H, d) of flint ``arb`` balls computed at
        ``bits + 32`` bits (the caller sets nothing; the balls carry their own precision).

        Examples
        --------
        >>> import numpy as np
        >>> import mhaextract as mx
        >>> model = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
        >>> means = model.head_means([np.eye(3)])
        >>> means.shape
        (1, 2, 3)
        >>> bool(np.isclose(np.einsum("bhd,hd->b", means, model.v)[0], model([np.eye(3)])[0]))
        True
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
        if self.is_vector:
            V, c = model.V.astype(dtype), model.c.astype(dtype)
            out = np.empty((len(sequences), self.d_out), dtype=dtype)
            for index, X, weights in self._weights_float(sequences, dtype):
                means = np.einsum("bhn,bnd->bhd", weights, X)  # m_h(X), (B, H, d)
                out[index] = np.einsum("bhd,hod->bo", means, V) + c
            return out
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
        W, u = model.W, model.u
        heads, d = W.shape[0], W.shape[1]
        finals, differences = np.asarray(finals, dtype=np.float64), np.asarray(differences, dtype=np.float64)
        final_of, which, k = np.asarray(final_of, dtype=int), np.asarray(which, dtype=int), np.asarray(copies)
        if not len(which):
            return np.empty((0, self.d_out) if self.is_vector else 0)
        # one BLAS product for all final tokens (stacked per token, a matrix-vector product each is
        # several times slower at d = 64)
        queries = (finals @ W.reshape(heads * d, d).T).reshape(len(finals), heads, d) + u[None]
        y = finals[final_of] - differences  # (n, d)
        # each instance's y against its final token's W_h x + u_h, gathered in chunks of ~8 MB (faster
        # than one BLAS product per final token when instances share few final tokens)
        s_y = np.empty((len(y), heads))
        step = max(1, 2**20 // max(1, heads * d))
        for start in range(0, len(y), step):
            part = slice(start, start + step)
            s_y[part] = np.einsum("nd,nhd->nh", y[part], queries[final_of[part]])
        s_x = np.einsum("fd,fhd->fh", finals, queries)[final_of][which]  # (Q, H)
        s_y = s_y[which]
        top = np.where(k[:, None] > 0, np.maximum(s_x, s_y), s_x)
        e_x, e_y = np.exp(s_x - top), k[:, None] * np.exp(s_y - top)
        if self.is_vector:  # V_h x and V_h y per head and output: (Q, H, d_out)
            v_x = np.einsum("fd,hod->fho", finals, model.V)[final_of][which]
            v_y = np.einsum("nd,hod->nho", y, model.V)[which]
            weights_x, weights_y = (e_x / (e_y + e_x))[:, :, None], (e_y / (e_y + e_x))[:, :, None]
            return (weights_y * v_y + weights_x * v_x).sum(axis=1) + model.c
        v = model.v
        v_x, v_y = (finals @ v.T)[final_of][which], (y @ v.T)[which]
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

    def _evaluate_arb(self, sequences: Sequence[np.ndarray], precision: int):
        means = self._means_arb(sequences, precision)
        with working_precision(precision + 32):
            V = np.vectorize(to_arb, otypes=[object])(self.V)
            constants = [to_arb(value) for value in np.ravel(np.asarray(self.c, dtype=object))]
            outputs = np.empty((len(means), self.d_out), dtype=object)
            for b, row in enumerate(means):
                for o in range(self.d_out):
                    # Head by head: heads that cancel (equal W, opposite V) then cancel exactly.
                    total = constants[o]
                    for h in range(self.heads):
                        total += sum((row[h, a] * V[h, o, a] for a in range(self.d)), arb(0))
                    outputs[b, o] = rounded_mpf(total, precision)
            return outputs if self.is_vector else list(outputs[:, 0])

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
        """The canonical form: equal (W, u)'s merged (V's summed), zero merged V's dropped; c kept.

        ``rtol`` is the tolerance, relative to the largest entry of W (resp. u, V), under which two
        heads count as equal (resp. a summed V as zero). The default 0 merges exact equality only.

        Examples
        --------
        >>> import numpy as np
        >>> import mhaextract as mx
        >>> W, v = np.stack([np.eye(2), np.eye(2), 2 * np.eye(2)]), np.array([[1.0, 0], [-1, 0], [0, 1]])
        >>> mx.MultiHeadAttention(W, v).canonical().heads   # heads 1 and 2 merge and cancel
        1
        """
        W, V, u = self.W, self.V, self.u
        W_mag = np.vectorize(lambda value: abs(float(value)), otypes=[np.float64])
        V_abs = W_mag(V) if V.dtype == object else np.abs(V)
        V_scale = float(V_abs.max()) if V.size else 0.0
        groups = group_equal_heads(W, rtol, u)
        W_out, V_out, u_out = [], [], []
        for group in groups:
            # mpf sums are exact here (enough bits for any sum of a few doubles); float64 rounds.
            with mpmath.workprec(2200):
                summed = V[group].sum(axis=0)
            size = W_mag(summed).max() if V.dtype == object else np.abs(summed).max()
            if size > rtol * V_scale:
                W_out.append(W[group[0]])
                V_out.append(summed)
                u_out.append(u[group[0]])
        dtype = object if self.is_high_precision else np.float64
        value_shape = (self.d_out, self.d) if self.is_vector else (self.d,)
        if not W_out:
            return MultiHeadAttention(np.zeros((0, self.d, self.d), dtype=dtype), np.zeros((0,) + value_shape, dtype=dtype),
                                      np.zeros((0, self.d), dtype=dtype), self.c)
        V_out = np.array(V_out, dtype=dtype).reshape((len(V_out),) + value_shape)
        return MultiHeadAttention(np.array(W_out, dtype=dtype), V_out, np.array(u_out, dtype=dtype), self.c)
