"""The designs of targeted instances (docs/algorithm.md, 'The final instances'): the pattern columns, the
null-space part, the final tokens of a block of rounds, and the corrections of the target's estimate.
"""

from __future__ import annotations

import numpy as np

from .tolerances import CORRECTION_BLOCK, SATURATION_MID, SATURATION_SPREAD, TARGET, TARGET_CENTER

#: Design patterns drawn per random orthogonal base (:func:`draw_patterns`: shuffled rows and rounds).
PATTERN_SHARING = 32
#: Misfits of a stage's aim (log-pole units) below which its estimates are not corrected at all
#: (:meth:`MinimumNormCorrection.aim`): the final stage's sides at ``log 2 +- 4`` do not feel it.
AIM_TOLERANCE = 1e-3
#: Bases of this many bytes (a block of units) are orthogonalised against together, in cache.
GRAM_SCHMIDT_BYTES = 2**20
#: A row that keeps less than this share of its norm off the basis is orthogonalised a second time
#: (:class:`MinimumNormCorrection`): one pass leaves it orthogonal to about ``eps / share``.
REORTHOGONALISE = 1e-3


class NullSpace:
    """The null space of each unit's initial estimates E (U, H, d): ``N0`` (d, d - H), the last d - H
    columns of the complete Q of ``E^T = Q R`` (one batched Householder QR per unit, not per
    instance), kept in its compact WY form ``Q = I - V T V^T`` (V: the H reflectors (U, d, H), T: H x H
    upper triangular), so that ``N0 p = (0, p) - V T V_2^T p`` costs 4 H d flops a column instead of
    the 2 d (d - H) of a product with N0 formed, and no (U, d, d) array is ever held. Vectors are rows, as the tokens are: ``(N0 p)^T = (0, p^T) - p^T V_2 T^T V^T``
    for a block's rows ``p^T`` (in columns, the additions ran over b entries at a time, 1.2..2.5 x
    slower)."""

    def __init__(self, estimates: np.ndarray):
        h, tau = np.linalg.qr(estimates.transpose(0, 2, 1), mode="raw")  # reflectors as rows of h (U, H, d)
        U, H, _ = h.shape
        self.heads = H
        self._workspace: np.ndarray | None = None  # (:meth:`workspace`)
        self.V = np.tril(h.transpose(0, 2, 1), -1)  # v_i = e_i + the part of h below the diagonal
        self.V[:, np.arange(H), np.arange(H)] = 1.0
        self.T = np.zeros((U, H, H))  # Q = H_1 .. H_H = I - V T V^T (LAPACK's dlarft, forward, columnwise)
        for i in range(H):
            self.T[:, i, i] = tau[:, i]
            if i:
                inner = np.matmul(self.V[:, :, :i].transpose(0, 2, 1), self.V[:, :, i:i + 1])
                self.T[:, :i, i] = -tau[:, i, None] * np.matmul(self.T[:, :i, :i], inner)[:, :, 0]

    def apply(self, rows: np.ndarray, part: slice = slice(None), out: np.ndarray | None = None) -> np.ndarray:
        """``(N0 p)^T`` (U, n, d) for the rows ``p^T`` (U, n, d - H) of the units ``part``, written into
        ``out`` (any strides) when given: ``-(p^T V_2 T^T) V^T`` is written, then ``p^T`` added from
        column H on (no (U, n, d) temporary)."""
        H, V = self.heads, self.V[part]
        reflected = np.matmul(np.matmul(rows, V[:, H:]), self.T[part].transpose(0, 2, 1))  # (U, n, H)
        out = np.matmul(np.negative(reflected, out=reflected), V.transpose(0, 2, 1), out=out)
        out[:, :, H:] += rows
        return out

    def parts(self, rows: np.ndarray, scale: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """``(SPREAD N0 p / c)^T`` (U, n, d) for pattern rows ``p^T`` (U, n, d - H) (a block's rounds)
        and each unit's ``scale`` c (U,; 1 when not given): the null parts :func:`design_tokens` adds;
        written into ``out`` if given."""
        out = self.apply(rows, out=out)
        out *= SATURATION_SPREAD if scale is None else (SATURATION_SPREAD / scale)[:, None, None]
        return out

    def workspace(self, block: slice) -> np.ndarray:
        """An array (U, b, d) for :meth:`parts` of a block of b rounds: a view of one array made
        for the first (largest, :func:`correction_blocks`) block and reused by the later ones."""
        size = block.stop - block.start
        if self._workspace is None or self._workspace.shape[1] < size:
            self._workspace = np.empty((self.V.shape[0], size, self.V.shape[1]))
        return self._workspace[:, :size]


def other_heads_frame(current: np.ndarray, heads: np.ndarray):
    """What :func:`design_tokens` needs of the rows that stay fixed over a unit's rounds, the other heads'
    estimates ``O`` (the rows of ``current`` (U, H, d) but the target ``heads[u]``), from one batched
    QR ``O^T = Q_o R_o`` per unit (not per round): ``Q_o^T`` (U, H - 1, d), the map
    ``(O^+)^T = R_o^{-1} Q_o^T`` (U, H - 1, d), the other heads' indices (U, H - 1), ascending, and
    the scale ``c`` of the null part, the mean singular value of all H estimates ``E`` (U,) as they
    are here: the corrections of the target's row move it by their relative size only, and ``c``
    merely sizes the null part (no SVD per round).
    (Stored as rows: the per-round products with one vector per unit run faster so.)"""
    U, H, _ = current.shape
    units = np.arange(U)
    slots = np.arange(H - 1)[None, :]
    others = slots + (slots >= heads[:, None])  # the heads f != h, ascending
    q, r = np.linalg.qr(current[units[:, None], others].transpose(0, 2, 1))
    rows = np.ascontiguousarray(q.transpose(0, 2, 1))
    scale = np.linalg.svd(current, compute_uv=False).mean(axis=1)
    return rows, np.matmul(np.linalg.inv(r), rows), others, scale


def design_tokens(current: np.ndarray, heads: np.ndarray, columns: np.ndarray, null_part: np.ndarray,
             frame=None, halfwidth: float = TARGET, out: np.ndarray | None = None) -> np.ndarray:
    """The final tokens of a block of b rounds for U units at once (U, b, d), written into ``out``
    (any strides) when given.

    Unit u aims head ``heads[u]`` at log-pole ``TARGET_CENTER + halfwidth p_h`` and the others at
    ``MID + SPREAD p_g`` (by its estimates ``current[u]`` (H, d); ``columns[u]`` (H, b) the pattern
    columns of the rounds), and adds the null-space part: ``x = E^+ u + (I - P_E) b`` with ``b``
    the unit's ``null_part`` (b, d), ``(SPREAD N0 p / c)^T`` (:meth:`NullSpace.parts`; ``c`` the mean
    singular value of E at the frame's estimates). While the estimates are the initial ones this is
    the square design ``[E; c N0] x = values``; once the target row was corrected the projection
    keeps the null part exactly off every head.

    Only the target's row t changes between blocks: ``frame`` (:func:`other_heads_frame`, of the
    other rows O, computed here when not given) is extended by t's part ``size * unit`` off O's span
    (classical Gram-Schmidt, twice), and ``E^+ u = O^+ u_O + unit (u_t - t^T O^+ u_O) / size``: no
    factorisation nor solve per block (the same x as a QR of E to rounding). The b rounds of a
    block share t (:func:`correction_blocks`), so every term but ``b`` is a combination of the same
    ``2H - 1`` rows ``(O^+)^T``, ``unit``, ``Q_o``: ``x = C R + b``, with b's projection read off one
    product of the null parts with ``(Q_o, unit)``. The tokens are written once (the terms formed
    and added one by one would pass over a block's (U, b, d) tokens a dozen times, memory-bound)."""
    U, H, d = current.shape
    units = np.arange(U)
    q_rows, pseudo_inverse_rows, others, scale = frame if frame is not None else other_heads_frame(current, heads)

    def along_rows(vectors):  # Q_o^T v for each of the block's vectors (U, b, d) -> (U, b, H - 1)
        return np.matmul(vectors, q_rows.transpose(0, 2, 1))

    def spanned(coefficients):  # Q_o c, (U, b, H - 1) -> (U, b, d)
        return np.matmul(coefficients, q_rows)

    target = current[units, heads][:, None, :]  # (U, 1, d)
    rest = target - spanned(along_rows(target))
    rest -= spanned(along_rows(rest))
    size = np.linalg.norm(rest, axis=2)  # (U, 1)
    if (size == 0).any():  # E singular: what the solve with a QR of E per round raised
        raise np.linalg.LinAlgError("Singular matrix")
    unit = rest / size[:, :, None]
    values = SATURATION_MID + SATURATION_SPREAD * columns[units[:, None], others]  # (U, H - 1, b)
    # O^+ u_O is values^T (O^+)^T: nothing along t; its log-pole for t, t^T O^+ u_O, from (O^+)^T t
    base_target = np.matmul(values.transpose(0, 2, 1), np.matmul(pseudo_inverse_rows, target[:, 0, :, None]))[:, :, 0]
    along = (TARGET_CENTER + halfwidth * columns[units, heads] - base_target) / size  # (U, b)
    free = null_part  # (U, b, d)
    rows = np.concatenate([pseudo_inverse_rows, unit, q_rows], axis=1)  # (U, 2H - 1, d)
    off = np.matmul(free, rows[:, H - 1:].transpose(0, 2, 1))  # b's parts along unit and Q_o (U, b, H)
    coefficients = np.concatenate([values.transpose(0, 2, 1), (along - off[:, :, 0])[:, :, None], -off[:, :, 1:]],
                                  axis=2)
    x = np.matmul(coefficients, rows, out=out)
    x += free
    return x


def correction_blocks(rounds: int, most: int = CORRECTION_BLOCK, correcting=lambda: True):
    """The blocks of rounds designed from one estimate (:class:`MinimumNormCorrection`), as slices,
    each one made when the previous block is done (a generator): while ``correcting()`` says the
    estimate is being corrected, at most ``most`` rounds and at most a quarter of the rounds left, so
    the estimate a block is designed from fits all but a fifth of the rounds its successor fits (the
    correction's effect on a round's aim grows with the rounds it has seen: the last rounds are
    corrected one by one). Before any correction the prior aims within the tolerance and every
    block is designed from that same prior: the blocks then double from ``most`` up to
    ``CORRECTION_BLOCK`` rounds, whatever is left (the same tokens as the blocks above whenever no
    correction follows, in fewer and larger asks: the final stage and the bridges in float64, and
    the first group when phase 1's prior aims it well; a block that finds the aim off starts the
    corrections, and the blocks after it shrink as above)."""
    start, size = 0, 0
    while start < rounds:
        if correcting():
            size = max(1, min(most, (rounds - start) // 4))
        else:
            size = min(max(most, 2 * size), max(most, CORRECTION_BLOCK), rounds - start)
        yield slice(start, start + size)
        start += size


class MinimumNormCorrection:
    """The minimum-norm change of each unit's target estimate that fits its log-poles so far,
    ``delta = X^+ (m - X a_prior)`` (X: the finite rows), updated by one block Gram-Schmidt step per
    block of rounds instead of a least-squares solve from scratch (same solution to rounding).

    A block's b rows are projected off the earlier basis in one batched matrix product (each unit's
    basis read from memory once per block, not once per round: the per-round update was the largest
    single cost of the targeted learner, memory-bound), then orthogonalised among themselves. One
    classical Gram-Schmidt pass leaves a new basis vector orthogonal to the others to about
    ``eps |x| / |q|`` (q: the row's part off the basis); the designs of docs/algorithm.md, 'The targeted schedule' keep
    ``|q| / |x|`` well above that, so a second pass, which would double the
    cost, is made only for rows below ``REORTHOGONALISE`` (degenerate designs, repeated rows). The
    correction only aims the next blocks' designs: ``a`` itself is solved from all rounds at the
    end (:func:`_reduce_chunk`)."""

    def __init__(self, units: int, d: int, tolerance: float = AIM_TOLERANCE):
        self.units, self.d = units, d
        self.tolerance = tolerance  # the misfits below which nothing is corrected (:meth:`aim`)
        #: orthonormal rows: the rows of X added so far, orthogonalised; (units, d, d), allocated by the
        #: first :meth:`add` (a stage its prior aims well, the final one in float64, never needs it)
        self.basis: np.ndarray | None = None
        self.coefficients = np.zeros((units, d))
        self.delta = np.zeros((units, d))
        self.added = 0  # rows 0 .. added - 1 are in the basis
        self.waiting: list[np.ndarray] = []  # the rows asked since, (U, b, d) blocks in order (aim)
        #: an array (units, d, d) the basis may be written into (a previous chunk's, :func:`measure_units`):
        #: rows are written before they are read, so none needs clearing
        self.spare: np.ndarray | None = None

    def aim(self, n: int, rows: np.ndarray, misses: np.ndarray) -> np.ndarray:
        """Rows ``n .. n + b - 1`` (U, b, d) and their misfits (U, b), for aiming: while every misfit
        so far is within :attr:`tolerance` (log-pole units) the prior aims well enough and nothing is
        computed (the rows wait, as the caller's arrays, which must not change); from the first block
        beyond it on, every waiting row is added (:meth:`add`). Returns delta (zero while nothing was
        added)."""
        b = rows.shape[1]
        self.coefficients[:, n:n + b] = misses
        self.waiting.append(rows)
        finite = np.abs(misses[np.isfinite(misses)])
        if self.added or (finite.size and finite.max() > self.tolerance):
            start = self.added
            self.added = n + b
            waiting = self.waiting[0] if len(self.waiting) == 1 else np.concatenate(self.waiting, axis=1)
            self.waiting = []
            return self.add(start, waiting, self.coefficients[:, start:n + b].copy())
        return self.delta

    def add(self, n: int, rows: np.ndarray, misses: np.ndarray) -> np.ndarray:
        """Add rows ``n .. n + b - 1`` (U, b, d) with their misfits (U, b) (NaN: not measured,
        skipped); returns delta."""
        U, b, d = rows.shape
        if self.basis is None:
            self.basis = np.empty((self.units, self.d, self.d)) if self.spare is None else self.spare
        overlap = np.empty((U, b, n))
        q = np.array(rows, dtype=np.float64)
        # Blocks of units whose bases fit the cache: the products below read each block once
        # from memory, not twice. The basis vectors are stored as rows: each unit's (n, d)
        # block is contiguous (faster than columns).
        step = max(1, GRAM_SCHMIDT_BYTES // max(1, 8 * d * n))
        for start in range(0, U, step) if n else ():
            part = slice(start, start + step)
            basis = self.basis[part, :n]
            overlap[part] = np.matmul(rows[part], basis.transpose(0, 2, 1))  # (units, b, n)
            q[part] -= np.matmul(overlap[part], basis)
        for j in range(b):  # the block's rows among themselves, in order
            k = n + j
            ok = np.isfinite(misses[:, j])
            size = np.linalg.norm(rows[:, j], axis=1)
            inner = np.einsum("ukd,ud->uk", self.basis[:, n:k], q[:, j])
            q[:, j] -= np.einsum("uk,ukd->ud", inner, self.basis[:, n:k])
            rho = np.linalg.norm(q[:, j], axis=1)
            again = np.flatnonzero(rho < REORTHOGONALISE * size)
            if again.size:  # classical Gram-Schmidt, twice
                basis = self.basis[again, :k]
                second = np.matmul(basis, q[again, j, :, None])[:, :, 0]
                q[again, j] -= np.matmul(second[:, None, :], basis)[:, 0]
                overlap[again, j] += second[:, :n]
                inner[again] += second[:, n:]
                rho[again] = np.linalg.norm(q[again, j], axis=1)
            ok &= rho > 1e-12 * size
            safe = np.where(ok, rho, 1.0)
            self.basis[:, k] = np.where(ok[:, None], q[:, j] / safe[:, None], 0.0)
            fitted = (np.einsum("un,un->u", overlap[:, j], self.coefficients[:, :n])
                      + np.einsum("uk,uk->u", inner, self.coefficients[:, n:k]))
            self.coefficients[:, k] = np.where(ok, (np.nan_to_num(misses[:, j]) - fitted) / safe, 0.0)
        self.delta += np.einsum("ub,ubd->ud", self.coefficients[:, n:n + b], self.basis[:, n:n + b])
        return self.delta


def draw_patterns(rng, d: int, constant_row: int, count: int, target_row: int | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """``count`` design patterns (count, d, d), entries in [-1, 1]: row ``constant_row`` all ones,
    the other rows random, mutually orthogonal and orthogonal to the ones (zero sums).

    The log-poles of the design are ``offset + halfwidth * pattern`` row by row, with a large offset
    (``SATURATION_MID``) on the saturated rows. With zero-sum rows the offsets of all rows are
    carried by the one constant row, so the design matrix is a triangular (well-conditioned)
    transform of orthogonal rows; random rows would let the offset nearly cancel a combination
    of the variations for some draws and make the d final tokens nearly dependent.

    ``target_row`` (the final stage's patterns, :class:`FinalDesign`): that row is
    :func:`final_sides` (every entry +-1 but a 0 for odd d, zero sum) in every pattern, and the
    other rows, random, are orthogonal to it as well.

    One batched QR draws ``ceil(count / PATTERN_SHARING)`` base patterns (random orthogonal rows);
    each pattern is a base with its random rows shuffled among themselves and their signs drawn,
    which keeps every property above exactly. (The rounds are not permuted: the base's random rows
    are the QR of Gaussian columns, whose law a permutation of the rounds within a side leaves as
    it is. Permuting them per pattern would be an element-by-element gather; one QR per
    ``PATTERN_SHARING`` patterns, not per pattern, keeps the QRs cheap.) ``out`` (count, d, d), any strides: written in place
    (a stage reuses one array for all its chunks, :func:`measure_units`).
    """
    bases = -(-count // PATTERN_SHARING)
    gaussian = rng.standard_normal((bases, d, d))
    gaussian[:, :, 0] = 1.0  # Gram-Schmidt (QR) with the ones first: the others come out orthogonal to it
    fixed = [constant_row]
    sides = None
    if target_row is not None and target_row != constant_row and d > 1:
        sides = final_sides(d).astype(np.float64)
        fixed = [constant_row, target_row]
        gaussian[:, :, 1] = sides  # zero sum: the QR keeps its direction
    free = [row for row in range(d) if row not in fixed]
    q, _ = np.linalg.qr(gaussian)
    base = np.empty((bases, d, d))
    base[:, fixed + free] = q.transpose(0, 2, 1)
    base /= np.maximum(base.max(axis=2, keepdims=True), -base.min(axis=2, keepdims=True))  # max |.|, no |rows| copy
    if sides is not None:
        base[:, target_row] = sides  # exactly (the QR gives it to rounding, up to sign)
    row_order = np.empty((count, d), dtype=int)
    row_order[:, fixed] = fixed
    row_order[:, free] = rng.permuted(np.broadcast_to(np.array(free, dtype=int), (count, len(free))), axis=1)
    signs = rng.choice([-1.0, 1.0], size=(count, d, 1))
    signs[:, fixed] = 1.0
    picks = rng.integers(bases, size=count)
    # whole rows gathered; the indices are in range, so any mode gives the same rows: "raise" would
    # buffer a copy, and "wrap" takes a modulo per index (much slower than "clip")
    out = np.take(base.reshape(-1, d), picks[:, None] * d + row_order, axis=0, out=out, mode="clip")
    out *= signs
    return out


def draw_patterns_per_head(rng, d: int, groups: int, constant_rows, target_rows=None,
                       out: np.ndarray | None = None) -> np.ndarray:
    """(groups, H, d, d): head h's ``groups`` patterns from :func:`draw_patterns` with constant row
    ``constant_rows[h]`` (and target row ``target_rows[h]``), drawn head by head; written into
    ``out`` when given (a stage's reused array, :func:`measure_units`)."""
    H = len(constant_rows)
    out = np.empty((groups, H, d, d)) if out is None else out
    for h in range(H):
        draw_patterns(rng, d, constant_rows[h], groups, None if target_rows is None else target_rows[h], out=out[:, h])
    return out


def final_sides(rounds: int) -> np.ndarray:
    """The target's side in each round of a final unit (:class:`FinalDesign`): ``0, -1, +1, -1, ..``
    for odd ``rounds`` (the centre first), ``-1, +1, -1, ..`` for even ones; zero sum.

    What a unit's instances determine least well is ``a_h``'s own scale: with the target's
    log-poles ``TARGET_CENTER + T p_n`` the error of ``a_h(z)`` along itself is
    ``p^T dm / (T |p|^2)`` for log-pole errors dm (the other heads' rows vary by
    ``SATURATION_SPREAD``, 12 times more). Entries +-1 give ``|p|^2 = rounds`` (or ``rounds - 1``),
    the most for entries in [-1, 1] (a random row scaled to max 1: about 3 at 9 rounds)."""
    sides = np.array([-((-1) ** n) for n in range(rounds)], dtype=int)  # -1, +1, -1, ..
    return np.concatenate([[0], sides[:-1]]) if rounds % 2 else sides
