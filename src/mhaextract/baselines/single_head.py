"""The prior single-head algorithm (arXiv 2601.16873; docs/algorithm.md, 'The single-head baseline') as a baseline.

One head ``(W, v)`` on R^r (tokens ``x = B c`` for a basis ``B`` of the space, ``c`` in R^r):

1. **v from r one-token queries.** ``f((x)) = v^T x``; with final tokens ``x_i = B X[:, i]``
   the answers are ``b^T X[:, i]`` for ``b = B^T v``, hence ``b = X^{-T} f``.
2. **W from r^2 length-2 queries.** For ``(y, x)`` with ``y = x - z`` the attention weight of
   ``y`` is ``a = (f - v^T x) / (v^T y - v^T x)`` (v is known now), and its log-odds give one
   bilinear measurement::

       m = log((1 - a) / a) = log((v^T y - f) / (f - v^T x)) = z^T W x      (the k = 1 instance
                                                                             of docs/algorithm.md, 'One instance: copies
                                                                             of a token and a rational function')

   With ``z_j = B Z[:, j]`` and the ``x_i``: ``Z^T A X = M`` for ``A = B^T W B``, so
   ``A = Z^{-T} M X^{-1}`` (the core's assembly, :func:`mhaextract.numerics.float64.assemble`).

``r^2 + r`` queries in all: ``d^2 + d`` for one head on R^d, the information lower bound. The
measurement needs ``v^T z_j != 0`` (the prior paper's "v_j != 0" condition): here ``Z`` is chosen
after ``v`` is known so that ``b^T Z[:, j] = |b| s / sqrt(r)`` for every j (a rotation taking the
all-ones direction to ``b``), which meets the condition whenever ``v != 0``. A zero ``v`` makes
the head vanish from the canonical form; it is returned as no head, after the r one-token queries.

**Several heads, the prior paper's assumption.** Heads live in pairwise orthogonal subspaces
``S_1, ..., S_H`` with known bases ``B_h`` (d x r_h): with ``P_h`` the orthogonal projector on
``S_h``,

    W_h = P_h W_h P_h   (head h reads its keys and queries only in S_h),
    v_h = P_h v_h       (and writes only from S_h),      P_g P_h = 0  for g != h.

A query whose tokens all lie in ``S_h`` then sees head h alone: every other head g gives
``x_i^T W_g x_N = 0`` (uniform weights) and ``v_g^T x_i = 0`` (zero values). The single-head
algorithm runs in each subspace on the coefficients, ``sum_h (r_h^2 + r_h)`` queries, and lifts
back: ``W_h = B_h G_h^{-1} A_h G_h^{-1} B_h^T``, ``v_h = B_h G_h^{-1} b_h`` with
``G_h = B_h^T B_h``. What is recovered is ``(P_h W_h P_h, P_h v_h)``: the truth exactly when the
assumption holds, something else (silently, the count leaves no redundancy) when it does not.

**No redundancy.** ``r^2 + r`` answers determine ``r^2 + r`` parameters: a target outside the
model class (more heads, heads outside the subspaces) shows only when an implied attention
weight leaves (0, 1). ``verify_queries=n`` spends ``n`` further random queries (counted, reported apart)
to check the model against the oracle.

**Numerics.** Everything is an explicit formula; in high precision (``precision=bits``) it runs
in python-flint ball arithmetic on the oracle's answer balls (one ulp), so the returned balls
enclose the head given answers correct to one ulp: a certified extraction without a Krawczyk
step. Tokens are rounded to 40 bits (:func:`mhaextract.oracle.queries.quantize`) so ``y = x - z`` is
exact; with a basis ``B`` the tokens ``B c`` must be exact in float64 too (bases with dyadic
entries of few bits, e.g. signed coordinate vectors or Hadamard columns), which high precision
checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mpmath
import numpy as np
from flint import arb

from ..numerics.highprec import GUARD_BITS, arb_array, magnitude_float, mid_float, mpf_array, radius_float, working_precision
from ..numerics import arb as arb_kernel
from ..numerics import float64 as float64_kernel
from ..checks.base import Check, CheckedResult, CheckPolicy, report_failure
from ..models.attention import MultiHeadAttention
from ..oracle.boundary import BudgetExceeded, OracleBoundary
from ..oracle.queries import quantize, random_basis, random_queries
from ..run.validation import on_failure_mode, positive_int, renamed, token_scale_for


@dataclass
class SingleHeadExtraction(CheckedResult):
    """Result of :func:`extract_single_head`.

    Attributes
    ----------
    model : MultiHeadAttention
        The heads found (float64), one per subspace whose value vector is not zero, in the order
        of ``subspaces``; the single head for ``subspaces=None``.
    heads : int
    queries : int
        Every query asked, measured at the oracle boundary (extraction plus verification).
    verification_queries : int
        The part of ``queries`` spent on verification (the ``verification_queries`` asked for).
    max_query_length : int
        Measured (2 whenever a head is measured).
    promised_queries : int
        ``sum_h (r_h^2 + r_h)`` (``d^2 + d`` for one head on R^d), for comparison.
    dimensions : tuple of int
        ``r_h`` of each subspace.
    precision : int or None
    W_balls, v_balls : object arrays of flint ``arb`` (high precision only).
    error_estimate : float
        Max relative parameter error from the rounding of the answers: the largest relative ball
        radius in high precision (proven), a first-order estimate in float64.
    verification_residual : float or None
        Max relative misfit on the verification queries (None without verification).
    checks : list of :class:`mhaextract.Check`
    seconds : float
    """

    model: MultiHeadAttention
    heads: int
    queries: int
    verification_queries: int
    max_query_length: int
    promised_queries: int
    dimensions: tuple
    d: int
    precision: int | None
    seed: object
    error_estimate: float
    verification_residual: float | None
    checks: list = field(default_factory=list)
    W_balls: np.ndarray | None = None
    v_balls: np.ndarray | None = None
    seconds: float = 0.0

    @property
    def certified(self) -> bool:
        """High precision, and every ball finite: the balls enclose the heads (answers within one ulp)."""
        return self.precision is not None and self.ok and self.W_balls is not None

    @property
    def model_hp(self) -> MultiHeadAttention | None:
        """The heads as exact mpf midpoints of the balls (high precision only)."""
        if self.W_balls is None:
            return None
        return MultiHeadAttention(mpf_array(self.W_balls), mpf_array(self.v_balls))


def _reflection(unit: np.ndarray) -> np.ndarray:
    """The Householder reflection (symmetric, orthogonal) that swaps ``e_1`` and the unit vector."""
    r = len(unit)
    w = unit.copy()
    w[0] -= 1.0
    norm = np.linalg.norm(w)
    if norm < 1e-12:
        return np.eye(r)
    w /= norm
    return np.eye(r) - 2.0 * np.outer(w, w)


def _differences(b: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Columns z_j (r, r), a quantized orthogonal basis times ``scale`` with ``b^T z_j = |b| scale / sqrt(r)``.

    ``P e_1 = b / |b|``, ``R`` random orthogonal fixing ``e_1``, ``E`` with first row all
    ``1/sqrt(r)``: ``b^T P R E = |b| e_1^T E``. Every measurement then divides by the same,
    largest possible ``|v^T z|``.
    """
    r = len(b)
    P = _reflection(b / np.linalg.norm(b))
    R = np.eye(r)
    if r > 1:
        R[1:, 1:] = random_basis(rng, r - 1, 1.0)
    E = _reflection(np.full(r, 1.0 / np.sqrt(r)))
    return quantize(scale * (P @ R @ E), scale)


def _validate_subspaces(subspaces, d: int, precision):
    if subspaces is None:
        return [None], (d,)
    bases = []
    for index, basis in enumerate(subspaces):
        B = np.asarray(basis, dtype=np.float64)
        if B.ndim == 1:
            B = B[:, None]
        if B.ndim != 2 or B.shape[0] != d or not 1 <= B.shape[1] <= d:
            raise ValueError(f"subspace {index}: a basis is an array (d, r) with d = {d} and 1 <= r <= d, "
                             f"got shape {np.shape(basis)}")
        if not np.isfinite(B).all():
            raise ValueError(f"subspace {index}: the basis has non-finite entries")
        if np.linalg.matrix_rank(B) < B.shape[1]:
            raise ValueError(f"subspace {index}: the basis columns are linearly dependent (rank "
                             f"{np.linalg.matrix_rank(B)} < {B.shape[1]})")
        bases.append(B)
    if not bases:
        raise ValueError("subspaces is empty: give one basis per head, or None for a single head on R^d")
    if sum(B.shape[1] for B in bases) > d:
        raise ValueError(f"the subspaces' dimensions {[B.shape[1] for B in bases]} add up to more than d = {d}: "
                         "they cannot be pairwise orthogonal")
    for g in range(len(bases)):
        for h in range(g):
            overlap = np.abs(bases[g].T @ bases[h]).max()
            size = np.abs(bases[g]).max() * np.abs(bases[h]).max()
            # Exactly zero for dyadic bases; float rounding only otherwise.
            if overlap > 1e-12 * size * d:
                raise ValueError(f"subspaces {h} and {g} are not orthogonal (max |B_{g}^T B_{h}| = {overlap:.3g}); "
                                 "the multi-head use of the single-head algorithm needs pairwise orthogonal subspaces")
    return bases, tuple(B.shape[1] for B in bases)


def _exact_tokens(B: np.ndarray, coefficients: np.ndarray, what: str) -> np.ndarray:
    """``B c`` for each column c, checked exact (high precision: the oracle must see tokens in S_h)."""
    tokens = B @ coefficients
    with mpmath.workprec(4096):
        for index in np.ndindex(tokens.shape):
            a, col = index
            exact = mpmath.fsum(mpmath.mpf(float(B[a, k])) * mpmath.mpf(float(coefficients[k, col]))
                                for k in range(B.shape[1]))
            if exact != mpmath.mpf(float(tokens[index])):
                raise ValueError(
                    f"{what}: the token B c is not exact in float64, so it leaves the subspace at the "
                    "rounding level and the high-precision result would not be exact; use a basis with "
                    "dyadic entries of few bits (signed coordinate vectors, Hadamard columns)")
    return tokens


def extract_single_head(oracle, d, *, subspaces=None, precision=None, seed=None, token_scale=None,
                        verify_queries=0, batch_size=1024, progress=None, on_failure="raise",
                        max_queries=None, verification_queries=None) -> SingleHeadExtraction:
    """The prior single-head algorithm: ``d^2 + d`` queries for one head (see the module docstring).

    Parameters
    ----------
    oracle : callable ``oracle(batch) -> outputs`` (see :mod:`mhaextract.oracle.boundary`).
    d : token dimension.
    subspaces : None for one head on R^d; or a list of bases ``B_h`` (arrays (d, r_h)) of pairwise
        orthogonal subspaces, one head in each (the prior paper's multi-head assumption).
    precision : None for float64; bits for ball arithmetic (certified).
    seed : seeds the random tokens.
    token_scale : norm of the coefficient tokens (default ``d ** 0.25``, as :func:`mhaextract.extract`).
    verify_queries : extra random queries (lengths 1..4, tokens in the subspaces' span)
        checking the model against the oracle; 0 keeps the count at ``sum_h (r_h^2 + r_h)``.
        (Reported as the result's ``verification_queries``; :func:`mhaextract.verify` is the
        library's verification of a core extraction.)
    batch_size, progress, on_failure : as in :func:`mhaextract.extract`.
    max_queries : cap on the queries asked; the count is known up front
        (``sum_h (r_h^2 + r_h) + verify_queries``), so a cap below it raises
        :class:`~mhaextract.BudgetExceeded` before any query is asked.
    """
    d = positive_int("d", d)
    if precision is not None:
        precision = positive_int("precision", precision, minimum=64)
    verification_queries = positive_int("verify_queries", renamed("verification_queries", verification_queries,
                                                                  "verify_queries", verify_queries, 0), minimum=0)
    on_failure = on_failure_mode(on_failure)
    if max_queries is not None:
        max_queries = positive_int("max_queries", max_queries, minimum=0)
    scale = token_scale_for(d, token_scale)
    bases, dimensions = _validate_subspaces(subspaces, d, precision)
    needed = sum(r * r + r for r in dimensions) + verification_queries
    if max_queries is not None and needed > max_queries:
        raise BudgetExceeded(f"query budget exceeded: max_queries={max_queries}, and the single-head algorithm "
                             f"needs {needed} queries (sum_h r_h^2 + r_h, plus {verification_queries} for "
                             "verification); nothing was asked", needed, 0)
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    boundary = OracleBoundary(oracle, d, precision=precision, batch_size=batch_size, progress=progress,
                              max_queries=max_queries)
    kernel = float64_kernel if precision is None else arb_kernel
    heads, out_of_range, estimates = [], 0, []
    with working_precision((precision or 53) + GUARD_BITS):
        for h, B in enumerate(bases):
            found, bad, estimate = _one_head(boundary, kernel, B, dimensions[h], d, scale, rng, precision, h)
            out_of_range += bad
            estimates.append(estimate)
            if found is not None:
                heads.append(found)
        extraction_queries = boundary.queries
        measured = sum(r * r for r in dimensions)
        W = np.array([W for W, _ in heads], dtype=object if precision else np.float64).reshape(len(heads), d, d)
        v = np.array([v for _, v in heads], dtype=object if precision else np.float64).reshape(len(heads), d)
        finite = bool(np.isfinite(mid_float(W)).all() and np.isfinite(mid_float(v)).all())
        if precision is not None and finite and len(heads):
            finite = bool(np.isfinite(radius_float(W)).all() and np.isfinite(radius_float(v)).all())
        model = MultiHeadAttention(np.nan_to_num(mid_float(W)), np.nan_to_num(mid_float(v)))
        residual = None
        if verification_queries:
            residual = _verify(boundary, model if precision is None else MultiHeadAttention(mpf_array(W), mpf_array(v)),
                               bases, d, scale, rng, verification_queries, precision) if finite else np.inf
    policy = CheckPolicy.for_precision(precision)
    error_estimate = float(max(estimates, default=0.0))
    checks = [
        Check("weights_in_range", out_of_range == 0, float(out_of_range), 0.0,
              f"{out_of_range} of {measured} length-2 answers imply an attention weight outside (0, 1): the oracle "
              "is not one softmax head per subspace"),
        Check("finite", finite, 0.0 if finite else np.inf, 0.0, "parameters (and ball radii) are finite"),
        Check("error_estimate", error_estimate <= policy.error_estimate, error_estimate, policy.error_estimate,
              "relative parameter error from the rounding of the answers"
              + (" (ball radii)" if precision else " (first order)")),
    ]
    if residual is not None:
        checks.append(Check("verification_residual", residual <= policy.answers_residual, residual,
                            policy.answers_residual, f"misfit on {boundary.queries - extraction_queries} fresh queries"))
    result = SingleHeadExtraction(
        model=model, heads=len(heads), queries=boundary.queries,
        verification_queries=boundary.queries - extraction_queries, max_query_length=boundary.max_query_length,
        promised_queries=sum(r * r + r for r in dimensions), dimensions=dimensions, d=d, precision=precision,
        seed=seed, error_estimate=error_estimate, verification_residual=residual, checks=checks,
        W_balls=W if precision is not None and finite else None, v_balls=v if precision is not None and finite else None,
        seconds=time.perf_counter() - started,
    )
    report_failure(result, "single-head extraction", on_failure)
    return result


def _one_head(boundary, kernel, B, r, d, scale, rng, precision, h):
    """Steps 1 and 2 in the subspace spanned by ``B`` (None: R^d). Returns ((W, v) or None,
    number of out-of-range weights, relative error estimate)."""
    is_hp = precision is not None
    lift = (lambda C: C) if B is None else (
        (lambda C: _exact_tokens(B, C, f"subspace {h}")) if is_hp else (lambda C: B @ C))
    where = "" if B is None else f" in subspace {h}"
    X = random_basis(rng, r, scale)  # coefficient final tokens, columns
    x_tokens = lift(X)
    answers = boundary.ask([x_tokens[:, i][None, :] for i in range(r)], description=f"v{where}: one-token queries")
    b = kernel.solve_transposed(X, answers)  # b = B^T v in coefficients: b^T X = answers
    if (mid_float(answers) == 0.0).all():
        return None, 0, 0.0  # v = 0 on this subspace: the head is not in the canonical form
    b_mid = mid_float(b)
    Z = _differences(b_mid, scale, rng)
    pairs = [(i, j) for i in range(r) for j in range(r)]
    first, second = [i for i, _ in pairs], [j for _, j in pairs]
    Y = X[:, first] - Z[:, second]  # exact: X and Z share the quantization grid
    y_tokens = lift(Y)
    sequences = [np.vstack([y_tokens[:, n][None, :], x_tokens[:, i][None, :]]) for n, i in enumerate(first)]
    f = boundary.ask(sequences, description=f"W{where}: length-2 queries")
    v_x = kernel.dot(b, X)[first]  # v^T x_i for each query
    v_y = kernel.dot(b, Y)  # v^T y for each query
    upper, lower = v_y - f, f - v_x  # (1 - a) and a, times v^T (y - x)
    if is_hp:
        positive = np.array([(u / l) > 0 for u, l in zip(upper, lower)])
        m = np.array([(u / l).log() if p else arb("nan") for u, l, p in zip(upper, lower, positive)], dtype=object)
    else:
        positive = (upper / lower) > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            m = np.log(upper / lower)
    M = np.empty((r, r), dtype=object if is_hp else np.float64)
    for (i, j), value in zip(pairs, m):
        M[j, i] = value  # M[j, i] = z_j^T A x_i
    labels = kernel.dot(b, Z)  # b^T z_j, for the assembly's value vector (equal to b)
    A, _ = kernel.assemble(Z, X, M[None], labels[None])
    A = A[0]
    if B is None:
        W, v = A, b
    else:
        # W = B G^{-1} A G^{-1} B^T, v = B G^{-1} b with G = B^T B (G symmetric: G^{-T} = G^{-1}).
        B_k = arb_array(B) if is_hp else B
        G_inv_Bt = kernel.solve_transposed(B_k.T @ B_k, B_k.T)  # (r, d)
        W = G_inv_Bt.T @ A @ G_inv_Bt
        v = G_inv_Bt.T @ b
    estimate = _error_estimate(W, v, M, f, upper, lower, X, Z, is_hp)
    return (W, v), int((~positive).sum()), estimate


def _error_estimate(W, v, M, f, upper, lower, X, Z, is_hp) -> float:
    """Largest relative error of W and v: ball radii (high precision), first order (float64).

    float64: an answer error ``delta f`` moves ``m = log(upper / lower)`` by
    ``delta f (1/|upper| + 1/|lower|)``; the assembly multiplies by at most
    ``||Z^{-1}|| ||X^{-1}||`` (times the basis lift, an orthogonal projection for orthonormal bases).
    """
    W_mid, v_mid = mid_float(W), mid_float(v)
    W_scale, v_scale = max(np.abs(W_mid).max(), 1e-300), max(np.abs(v_mid).max(), 1e-300)
    if is_hp:
        return float(max(radius_float(W).max() / W_scale, radius_float(v).max() / v_scale))
    eps = np.finfo(np.float64).eps
    with np.errstate(divide="ignore", invalid="ignore"):
        delta_m = eps * np.abs(f).max() * (1 / np.abs(upper) + 1 / np.abs(lower))
        norms = np.linalg.norm(np.linalg.inv(Z), 2) * np.linalg.norm(np.linalg.inv(X), 2)
        W_error = norms * np.linalg.norm(delta_m) + eps * np.abs(W_mid).max()
        v_error = eps * np.linalg.norm(np.linalg.inv(X), 2) * np.abs(f).max() * np.sqrt(len(f))
    return float(np.nan_to_num(max(W_error / W_scale, v_error / v_scale), nan=np.inf))


def _verify(boundary, model, bases, d, scale, rng, count, precision) -> float:
    """Max relative misfit of ``model`` on ``count`` random queries (lengths 1..4) in the subspaces' span."""
    B = None if bases[0] is None else np.hstack(bases)
    # The shared random queries (N(0, I/r) times the scale) in coordinates of the span (r its
    # dimension), on the token grid, lifted into the span (exactly, checked, in high precision).
    r = d if B is None else B.shape[1]
    coefficients = [quantize(c, scale) for c in random_queries(rng, count, r, scale, (1, 4))]
    if B is None:
        sequences = coefficients
    else:
        sequences = [(_exact_tokens(B, c.T, "verification") if precision else B @ c.T).T.copy()
                     for c in coefficients]
    answers = boundary.ask(sequences, description="verification queries")
    predicted = model(sequences, precision=precision)
    if precision is not None:  # the misfit at full precision: 1e-60 must not round to 1e-16
        misfit = magnitude_float(arb_array(predicted) - answers)
    else:
        misfit = np.abs(predicted - answers)
    return float(misfit.max() / max(magnitude_float(answers).max(), 1e-300))
