"""One-layer Transformer: multi-head attention, then a bias-free ReLU feed-forward network.

docs/algorithm.md, 'The one-layer Transformer'. For a sequence ``X = (x_1, ..., x_N)`` with the heads' attention
weights ``a_{h,i}`` ('The model') and value-output maps ``O_h`` (p x d)::

    o(X) = sum_h sum_i a_{h,i} O_h x_i                      (in R^p)
    f(X) = w^T ReLU(A o(X))          (A: n x p, w: n)      (+ A R x_N inside the ReLU if residual)

Write ``m_h(X) = sum_i a_{h,i} x_i`` (the head means) and ``p_{h,j} = O_h^T A_j^T`` (unit j seen
through head h). Unit j's pre-activation is ``u_j(X) = sum_h p_{h,j}^T m_h(X)``.

**What is identifiable, and the canonical form.** Only the products ``p_{h,j}`` and ``w_j`` reach
the output (any invertible ``O_h -> G O_h``, ``A -> A G^{-1}`` leaves f unchanged). Heads with
equal ``W_h`` merge (their ``p_{h,j}`` add); hidden units are defined up to permutation and positive
scaling (``w_j -> w_j / c``, ``A_j -> c A_j``). :meth:`Transformer1L.canonical` returns

* heads: equal ``W_h`` merged, heads that no unit reads dropped;
* units: ``|w_j|`` absorbed into the unit, so ``w_j = +-1`` and the unit's vectors are
  ``c_{h,j} = |w_j| p_{h,j}``; units with positively parallel ``c_j`` merged
  (``w ReLU(u) + w' ReLU(kappa u) = (w + kappa w') ReLU(u)``), units with ``c_j = 0`` or a zero
  merged weight dropped;
* as a model: ``p = H* d`` (+ d with the residual), ``O_h`` the embedding of R^d into block h,
  ``A_j = (c_{1,j}, ..., c_{H*,j})`` and ``w_j = +-1``.

:func:`compare_transformers` aligns heads and units of two canonical forms with
:func:`scipy.optimize.linear_sum_assignment` and reports the max errors of ``W_h`` and of the
``c_{h,j}`` (with their signs); :func:`~mhaextract.transformer.learn.extract_transformer` learns f from value queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import mpmath
import numpy as np
from flint import arb
from scipy.optimize import linear_sum_assignment

from .attention import MultiHeadAttention, as_batch, group_equal_heads
from .compare import register_comparison
from .kinds import document_numbers, read_numbers, register_model_kind
from ..numerics.highprec import mid_float, mpf_array, rounded_mpf, to_arb, working_precision

#: mpmath bits for exact products and sums of the parameters (doubles and few-hundred-bit mpf).
EXACT_BITS = 2200


def _as_parameter(array, name: str, ndim: int) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    if array.dtype == object:
        array = mpf_array(array)
        finite = all(mpmath.isfinite(value) for value in array.ravel())
    else:
        array = array.astype(np.float64)
        finite = bool(np.isfinite(array).all())
    if not finite:
        raise ValueError(f"{name} must be finite")
    return array


@register_model_kind
class Transformer1L:
    """Multi-head attention followed by a bias-free ReLU feed-forward network, read at x_N.

    Parameters
    ----------
    W : array (H, d, d)
        Score matrices of the heads, ``s_{h,i} = x_i^T W_h x_N``.
    O : array (H, p, d)
        Value-output maps of the heads (R^d -> R^p).
    A : array (n, p)
        First FFN layer (no bias); row j is hidden unit j.
    w : array (n,)
        Second FFN layer (no bias), to the scalar output.
    residual : bool
        Add the final token inside the ReLU, ``ReLU(A (o(X) + R x_N))``.
    R : array (p, d), optional
        The residual's embedding of x_N into R^p; default the identity (then ``p == d`` is
        needed). The canonical form (p = H* d + d) puts x_N in the last block. All are float64
        arrays, or object arrays of ``mpmath.mpf`` for a high-precision model.

    Attributes
    ----------
    W, O, A, w, residual, R : the parameters (R None without the residual). d, p, heads (H), hidden (n) : sizes.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=1, hidden=4, seed=0)
    >>> T
    Transformer1L(d=3, heads=1, hidden=4, p=3, float64)
    >>> T([np.eye(3)]).round(6)  # f at the final token of one sequence
    array([0.214832])
    >>> T.canonical().hidden  # units rescaled to w_j = +-1
    4
    """

    def __init__(self, W, O, A, w, residual: bool = False, R=None):
        W = _as_parameter(W, "W", 3)
        O = _as_parameter(O, "O", 3)
        A = _as_parameter(A, "A", 2)
        w = _as_parameter(w, "w", 1)
        H, d = W.shape[0], W.shape[1]
        if W.shape[2] != d:
            raise ValueError(f"W must have shape (H, d, d), got {W.shape}")
        if O.shape[0] != H or O.shape[2] != d:
            raise ValueError(f"O must have shape (H, p, d) = ({H}, p, {d}), got {O.shape}")
        if A.shape[1] != O.shape[1]:
            raise ValueError(f"A must have shape (n, p) with p = {O.shape[1]}, got {A.shape}")
        if w.shape != (A.shape[0],):
            raise ValueError(f"w must have shape (n,) = ({A.shape[0]},), got {w.shape}")
        if R is not None and not residual:
            raise ValueError("R (the residual's embedding of x_N) needs residual=True")
        if residual and R is None:
            if O.shape[1] != d:
                raise ValueError(f"residual=True adds x_N to o(X) in R^p: needs p == d or R (p x d), got p={O.shape[1]}, "
                                 f"d={d}")
            R = np.eye(d)
        if R is not None:
            R = _as_parameter(R, "R", 2)
            if R.shape != (O.shape[1], d):
                raise ValueError(f"R must have shape (p, d) = ({O.shape[1]}, {d}), got {R.shape}")
        high = object in (W.dtype, O.dtype, A.dtype, w.dtype) or (R is not None and R.dtype == object)
        if high:
            W, O, A, w = (mpf_array(x) for x in (W, O, A, w))
            R = None if R is None else mpf_array(R)
        self.W, self.O, self.A, self.w, self.R = W, O, A, w, R
        self.residual = bool(residual)

    d = property(lambda self: self.W.shape[1])
    p = property(lambda self: self.O.shape[1])
    heads = property(lambda self: self.W.shape[0])
    hidden = property(lambda self: self.A.shape[0])
    is_high_precision = property(lambda self: self.W.dtype == object)
    #: One number per sequence (what :func:`mhaextract.verify` and the outputs' comparison read).
    is_vector = False
    d_out = 1
    #: The name of this model class in a saved result (:mod:`mhaextract.models.kinds`).
    kind = "transformer"

    def to_float64(self) -> "Transformer1L":
        """The model in float64 (itself when it is float64)."""
        if not self.is_high_precision:
            return self
        return Transformer1L(*(mid_float(x) for x in (self.W, self.O, self.A, self.w)), residual=self.residual,
                             R=None if self.R is None else mid_float(self.R))

    def to_document(self, exact: bool = False) -> tuple[dict, dict]:
        """``(json_part, arrays)`` for a saved result: ``kind``, the sizes, ``residual`` and ``W``,
        ``O``, ``A``, ``w``, ``R`` (None without the residual); float64 numbers and arrays, or with
        ``exact`` every bit as hex strings (and no arrays)."""
        model = self if exact else self.to_float64()
        numbers = {"W": model.W, "O": model.O, "A": model.A, "w": model.w}
        if model.R is not None:
            numbers["R"] = model.R
        part = {"kind": self.kind, "d": model.d, "heads": model.heads, "hidden": model.hidden, "p": model.p,
                "residual": model.residual, "R": None,
                **{name: document_numbers(array, exact) for name, array in numbers.items()}}
        return part, ({} if exact else numbers)

    @classmethod
    def from_document(cls, part: dict, exact: bool = False) -> "Transformer1L":
        """Inverse of :meth:`to_document` (empty lists of a model with no head or unit reshaped)."""
        d, p = part["d"], part["p"]
        W = read_numbers(part["W"], exact).reshape(-1, d, d)
        O = read_numbers(part["O"], exact).reshape(-1, p, d)
        A = read_numbers(part["A"], exact).reshape(-1, p)
        R = None if part.get("R") is None else read_numbers(part["R"], exact).reshape(p, d)
        return cls(W, O, A, read_numbers(part["w"], exact).reshape(-1), residual=bool(part["residual"]), R=R)

    def __repr__(self) -> str:
        kind = "mpf" if self.is_high_precision else "float64"
        extra = ", residual" if self.residual else ""
        return f"Transformer1L(d={self.d}, heads={self.heads}, hidden={self.hidden}, p={self.p}{extra}, {kind})"

    @classmethod
    def random(cls, d: int, heads: int, hidden: int, p: int | None = None, seed=None,
               residual: bool = False) -> "Transformer1L":
        """A random target: ``W_h`` with N(0, 1/d) entries (as :meth:`MultiHeadAttention.random`,
        suited to the core's default token scale), ``O_h`` N(0, 1/d), ``A`` N(0, 1/p), ``w`` N(0, 1);
        ``p = d`` by default."""
        for name, value in (("d", d), ("heads", heads), ("hidden", hidden)):
            if isinstance(value, bool) or int(value) < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        p = int(d) if p is None else int(p)
        if p < 1:
            raise ValueError(f"p must be a positive integer, got {p}")
        rng = np.random.default_rng(seed)
        W = rng.standard_normal((heads, d, d)) / np.sqrt(d)
        O = rng.standard_normal((heads, p, d)) / np.sqrt(d)
        A = rng.standard_normal((hidden, p)) / np.sqrt(p)
        w = rng.standard_normal(hidden)
        return cls(W, O, A, w, residual=residual)

    def to_high_precision(self) -> "Transformer1L":
        """The same model with exact mpf parameters (products then stay exact)."""
        if self.is_high_precision:
            return self
        return Transformer1L(*(x.astype(object) for x in (self.W, self.O, self.A, self.w)), residual=self.residual,
                             R=None if self.R is None else self.R.astype(object))

    # ------------------------------------------------------------------ the products that matter
    def unit_vectors(self, exact: bool = False) -> np.ndarray:
        """``p_{h,j} = O_h^T A_j^T`` as an array (n, H, d): float64, or exact mpf for a
        high-precision model or with ``exact=True``."""
        if not (self.is_high_precision or exact):
            return np.einsum("hpd,np->nhd", self.O, self.A)
        with mpmath.workprec(EXACT_BITS):
            return np.einsum("hpd,np->nhd", mpf_array(self.O), mpf_array(self.A))

    def residual_vectors(self) -> np.ndarray:
        """``A_j R``, unit j as read by x_N through the residual, (n, d) (exact mpf for a
        high-precision model); zeros without the residual."""
        if not self.residual:
            return np.zeros((self.hidden, self.d), dtype=self.A.dtype)
        if not self.is_high_precision:
            return self.A @ self.R
        with mpmath.workprec(EXACT_BITS):
            return self.A @ self.R

    def residual_term(self) -> np.ndarray:
        """``q = sum_j w_j R^T A_j^T``: with the residual, ``g(X) = f(X) - f(-X)`` is the attention
        of :meth:`odd_part` plus ``q^T x_N`` (docs/algorithm.md, 'The one-layer Transformer'); zeros without it."""
        R = self.residual_vectors()
        if not self.is_high_precision:
            return R.T @ self.w
        with mpmath.workprec(EXACT_BITS):
            return R.T @ self.w

    def odd_part(self) -> MultiHeadAttention:
        """The attention part of ``g(X) = f(X) - f(-X)``: ``v_h = sum_j w_j p_{h,j}`` (docs/algorithm.md
        'The one-layer Transformer'). With the residual, g is this plus ``q^T x_N`` (:meth:`residual_term`).
        """
        C = self.unit_vectors()
        if not self.is_high_precision:
            return MultiHeadAttention(self.W, np.einsum("nhd,n->hd", C, self.w))
        with mpmath.workprec(EXACT_BITS):
            v = np.einsum("nhd,n->hd", C, self.w)
        return MultiHeadAttention(self.W, v)

    # ------------------------------------------------------------------ evaluation
    def __call__(self, batch, precision: int | None = None):
        """Outputs f(X): float64 array (B,), or with ``precision=bits`` a list of mpf (ball
        arithmetic at bits + 32, rounded to ``bits``), like :class:`MultiHeadAttention`."""
        sequences = as_batch(batch, self.d)
        attention = MultiHeadAttention(self.W, np.zeros((self.heads, self.d), dtype=self.W.dtype))
        if precision is None:
            means = attention.head_means(sequences)  # (B, H, d)
            C = self.unit_vectors()
            R = self.residual_vectors()
            if self.is_high_precision:
                C, R = mid_float(C), mid_float(R)
            finals = np.stack([np.asarray(s[-1], dtype=np.float64) for s in sequences]) if sequences else np.zeros((0, self.d))
            u = np.einsum("bhd,nhd->bn", means, C) + finals @ R.T
            return np.maximum(u, 0.0) @ mid_float(self.w)
        precision = int(precision)
        means = attention.head_means(sequences, precision)
        C = self.unit_vectors(exact=True)  # the function of these parameters, not of rounded products
        R = self.residual_vectors()
        outputs = []
        with working_precision(precision + 32):
            C_arb = np.vectorize(to_arb, otypes=[object])(C)
            R_arb = np.vectorize(to_arb, otypes=[object])(R)
            w_arb = [to_arb(value) for value in self.w]
            for sequence, row in zip(sequences, means):
                final = [to_arb(value) for value in sequence[-1]]
                total = arb(0)
                for j in range(self.hidden):
                    u = sum((C_arb[j, h, a] * row[h, a] for h in range(self.heads) for a in range(self.d)), arb(0))
                    if self.residual:
                        u += sum((R_arb[j, a] * final[a] for a in range(self.d)), arb(0))
                    # ReLU of a ball: a ball straddling 0 is within its radius of 0 (far below an ulp).
                    if u.mid() > 0:
                        total += w_arb[j] * u
                outputs.append(rounded_mpf(total, precision))
        return outputs

    # ------------------------------------------------------------------ canonical form
    def canonical(self, rtol: float = 0.0) -> "Transformer1L":
        """The canonical form described in the module docstring.

        ``rtol``: W's within ``rtol * max|W|`` count as equal; a unit vector within
        ``rtol * max|c|`` of a positive multiple of another counts as parallel; smaller vectors
        and merged weights count as zero.
        """
        high = self.is_high_precision
        context = mpmath.workprec(EXACT_BITS) if high else _nullcontext()
        with context:
            C = self.unit_vectors()  # (n, H, d)
            groups = group_equal_heads(self.W, rtol)
            merged = np.stack([C[:, group].sum(axis=1) for group in groups], axis=1) if groups else C[:, :0]
            W = self.W[[group[0] for group in groups]] if groups else self.W[:0]
            # |w_j| into the unit; residual block appended as one more "head" block of the vector.
            blocks = np.concatenate([merged.reshape(self.hidden, -1), self.residual_vectors()], axis=1) \
                if self.residual else merged.reshape(self.hidden, -1)
            weights = np.array([abs(value) for value in self.w], dtype=object if high else np.float64)
            blocks = blocks * weights[:, None]
            signs = [1 if value > 0 else -1 for value in self.w]
            units = _merge_parallel_units(blocks, signs, rtol, high)
            d, Hs = self.d, len(groups)
            # Heads no unit reads are dropped.
            if units:
                vectors = np.array([vector for vector, _ in units], dtype=blocks.dtype)
                keep = [h for h in range(Hs) if _max_abs(vectors[:, h * d:(h + 1) * d]) > 0]
            else:
                vectors = np.zeros((0, blocks.shape[1]), dtype=blocks.dtype)
                keep = []
            columns = [c for h in keep for c in range(h * d, (h + 1) * d)]
            if self.residual:
                columns += list(range(Hs * d, Hs * d + d))
            A = vectors[:, columns]
            w = np.array([sign for _, sign in units], dtype=A.dtype)
            W = W[keep]
            O = block_embedding(len(keep), d, self.residual, dtype=A.dtype)
            R = residual_embedding(len(keep), d, dtype=A.dtype) if self.residual else None
        return Transformer1L(W, O, A, w, residual=self.residual, R=R)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _max_abs(array) -> float:
    if array.size == 0:
        return 0.0
    if array.dtype == object:
        return float(max(abs(value) for value in array.ravel()))
    return float(np.abs(array).max())


def _merge_parallel_units(blocks, signs, rtol, high):
    """Merge units whose vectors are positive multiples of each other; drop zero ones."""
    scale = _max_abs(blocks)
    units: list[list] = []  # [vector, coefficient], the unit being coefficient * ReLU(vector^T M)
    for vector, sign in zip(blocks, signs):
        if _max_abs(vector) <= rtol * scale or _max_abs(vector) == 0:
            continue
        for unit in units:
            reference = unit[0]
            kappa = (vector @ reference) / (reference @ reference)
            if kappa > 0 and _max_abs(vector - kappa * reference) <= rtol * scale:
                unit[1] = unit[1] + sign * kappa
                break
        else:
            units.append([vector, sign if not high else mpmath.mpf(sign)])
    out = []
    for vector, coefficient in units:
        if abs(coefficient) > rtol:
            out.append((vector * abs(coefficient), 1 if coefficient > 0 else -1))
    return out


def block_embedding(heads: int, d: int, residual: bool = False, dtype=np.float64) -> np.ndarray:
    """``O_h`` (H, p, d) embedding R^d into block h of R^p, ``p = H d`` (+ d for the residual block)."""
    p = heads * d + (d if residual else 0)
    O = np.zeros((heads, p, d))
    for h in range(heads):
        O[h, h * d:(h + 1) * d] = np.eye(d)
    return O.astype(dtype) if dtype == object else O


def residual_embedding(heads: int, d: int, dtype=np.float64) -> np.ndarray:
    """``R`` (p, d) embedding R^d into the last block of ``p = H d + d`` (the canonical residual)."""
    R = np.zeros((heads * d + d, d))
    R[heads * d:] = np.eye(d)
    return R.astype(dtype) if dtype == object else R


# ---------------------------------------------------------------------- comparison
@dataclass
class TransformerComparison:
    """Errors of ``a`` against the reference ``b``, both canonical, heads and units aligned.

    Attributes
    ----------
    heads_agree, units_agree : equal canonical head / unit counts.
    heads_a, heads_b, units_a, units_b : the counts.
    head_permutation : head ``k`` of ``b`` is aligned with head ``head_permutation[k]`` of ``a``.
    unit_permutation : unit ``k`` of ``b`` is aligned with unit ``unit_permutation[k]`` of ``a``.
    signs_agree : every aligned unit has the same sign ``w_j = +-1``.
    W_abs, W_rel : max entry error of the aligned ``W_h`` (relative: over ``max|W_b|``).
    units_abs, units_rel : max entry error of the aligned unit vectors ``c_{h,j}`` (relative: over
        ``max|c_b|``), the products that reach the output.
    max_rel : ``max(W_rel, units_rel)``; infinite when counts or signs disagree.

    Examples
    --------
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=1, hidden=4, seed=0)
    >>> flipped = mx.Transformer1L(T.W, T.O, T.A, -T.w)  # every unit's sign flipped
    >>> comparison = mx.compare_transformers(flipped, T)
    >>> comparison.heads_agree, comparison.units_agree, comparison.signs_agree, comparison.max_rel
    (True, True, False, inf)
    """

    heads_agree: bool
    units_agree: bool
    signs_agree: bool
    heads_a: int
    heads_b: int
    units_a: int
    units_b: int
    head_permutation: np.ndarray
    unit_permutation: np.ndarray
    W_abs: float
    W_rel: float
    units_abs: float
    units_rel: float

    @property
    def max_rel(self):
        if not (self.heads_agree and self.units_agree and self.signs_agree):
            return float("inf")
        return max(self.W_rel, self.units_rel)


def _abs_max(array):
    if array.size == 0:
        return 0.0
    if array.dtype == object:
        return max(abs(value) for value in array.ravel())
    return np.abs(array).max()


@register_comparison(Transformer1L)
def compare_transformers(a: Transformer1L, b: Transformer1L, rtol: float = 0.0) -> TransformerComparison:
    """Canonicalise ``a`` and ``b`` (``rtol`` as in :meth:`Transformer1L.canonical`), align heads on
    ``W_h`` and then units on their vectors (in the aligned head order) with
    :func:`scipy.optimize.linear_sum_assignment`, and report errors of ``a`` against ``b``.

    Examples
    --------
    >>> import mhaextract as mx
    >>> T = mx.Transformer1L.random(d=3, heads=2, hidden=4, seed=0)
    >>> swapped = mx.Transformer1L(T.W[::-1], T.O[::-1], T.A, T.w)  # the heads in another order
    >>> bool(mx.compare_transformers(swapped, T).max_rel < 1e-14)
    True
    """
    if a.d != b.d:
        raise ValueError(f"models have different token dimensions: {a.d} and {b.d}")
    if a.residual != b.residual:
        raise ValueError("one model has the residual connection and the other does not")
    high = a.is_high_precision or b.is_high_precision
    if high:  # canonical products of a float64 model in exact arithmetic, not rounded to float64
        a, b = a.to_high_precision(), b.to_high_precision()
    a, b = a.canonical(rtol), b.canonical(rtol)
    d = a.d
    Wa, Wb, Ca, Cb = a.W, b.W, a.A, b.A
    if high:
        Wa, Wb, Ca, Cb = (mpf_array(x) for x in (Wa, Wb, Ca, Cb))
    fa, fb = mid_float(Wa).reshape(a.heads, -1), mid_float(Wb).reshape(b.heads, -1)
    cost = np.linalg.norm(fb[:, None] - fa[None], axis=2) if a.heads and b.heads else np.zeros((b.heads, a.heads))
    head_rows, head_cols = linear_sum_assignment(cost)
    zero = mpmath.mpf(0) if high else 0.0
    W_abs = _abs_max(Wa[head_cols] - Wb[head_rows]) if len(head_rows) else zero
    heads_agree = a.heads == b.heads
    units_agree = a.hidden == b.hidden
    signs_agree = False
    unit_rows = unit_cols = np.zeros(0, dtype=int)
    units_abs = zero
    if heads_agree:
        # a's unit vectors with its head blocks put in b's head order (residual block last).
        order = np.empty(a.heads, dtype=int)
        order[head_rows] = head_cols
        columns = [c for h in order for c in range(h * d, (h + 1) * d)] + list(range(a.heads * d, a.A.shape[1]))
        Ca = Ca[:, columns]
        ua, ub = mid_float(Ca), mid_float(Cb)
        sa, sb = mid_float(a.w), mid_float(b.w)
        scale = max(float(np.abs(ub).max()) if ub.size else 0.0, 1e-300)
        cost = np.linalg.norm(ub[:, None] - ua[None], axis=2) + 10 * scale * (sb[:, None] != sa[None])
        unit_rows, unit_cols = linear_sum_assignment(cost) if a.hidden and b.hidden else (unit_rows, unit_cols)
        signs_agree = bool(np.all(sa[unit_cols] == sb[unit_rows]))
        if len(unit_rows):
            units_abs = _abs_max(Ca[unit_cols] - Cb[unit_rows])
    W_scale = _abs_max(Wb) if b.heads else zero
    C_scale = _abs_max(Cb) if b.hidden else zero
    W_rel = W_abs / W_scale if W_scale else W_abs
    units_rel = units_abs / C_scale if C_scale else units_abs
    return TransformerComparison(
        heads_agree, units_agree, signs_agree, a.heads, b.heads, a.hidden, b.hidden, head_cols, unit_cols,
        W_abs, W_rel, units_abs, units_rel,
    )
