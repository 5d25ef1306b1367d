"""A rotary head from its score matrices at two offsets (docs/algorithm.md, 'The rotation').

``W(1) = K^T R Q`` and ``W(2) = K^T R^2 Q`` (R = R(1), r x r block rotations) determine the head:
any rank-r factorisation ``W(1) = A B`` gives ``M = A^+ W(2) B^+ = G^{-1} R G`` (G invertible), so
``W(delta) = A M^(delta - 1) B`` at every offset. M's eigenvalues are ``exp(+-i theta_m)``; a real
basis T of its invariant planes with ``M T = T R(1)`` gives the canonical factors
``K = (A T)^T`` and ``Q = R(-1) T^{-1} B``. A cluster of eigenvalues at 1 (dimensions the layer
does not rotate: partial rotary, or no positions at all) is split off first by an ordered real
Schur form and a Sylvester equation, since its eigenvectors are not determined.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import schur, solve_sylvester

from ..models.rotary import rotation_blocks

#: Eigenvalues of M within this distance of 1 are a block the layer does not rotate.
UNROTATED = 1e-6
#: The head width is the count of singular values of W(1) before the largest drop of at least this
#: factor between consecutive ones (none: full rank d).
RANK_GAP = 1e4


@dataclass
class RotaryHead:
    """One head's canonical factors and how well the two score matrices fit the rotary form.

    Attributes
    ----------
    Q, K : (r, d) factors (zero rows pad an odd count of unrotated directions).
    theta : (r // 2,) angles per position in [0, pi].
    width : the numerical rank of W(1) (the head width).
    subspace_residual : ``||W(2) - P_K W(2) P_Q|| / ||W(2)||``: W(2) outside W(1)'s row and column
        spaces (zero for a rotary head).
    modulus_error : ``max | |lambda| - 1 |`` over M's eigenvalues (zero for a rotation).
    structure_error : the larger of the two.
    """

    Q: np.ndarray
    K: np.ndarray
    theta: np.ndarray
    width: int
    subspace_residual: float
    modulus_error: float

    @property
    def structure_error(self) -> float:
        return max(self.subspace_residual, self.modulus_error)


def head_width(W1: np.ndarray, gap: float = RANK_GAP) -> int:
    """The count of singular values before the largest drop of at least ``gap`` (else d)."""
    singular = np.linalg.svd(W1, compute_uv=False)
    if singular[0] == 0:
        return 0
    ratios = singular[:-1] / np.maximum(singular[1:], singular[0] * 1e-300)
    drop = int(np.argmax(ratios))
    return drop + 1 if ratios[drop] >= gap else len(singular)


def rotary_head(W1: np.ndarray, W2: np.ndarray, width: int | None = None, gap: float = RANK_GAP) -> RotaryHead:
    """The canonical rotary factors of a head from ``W(1)`` and ``W(2)`` (both d x d', d' = d, or
    d + 1 with the query bias as the last column: ``[W(delta) | u(delta)] = K^T R(delta) [Q | b]``).

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> from mhaextract.rotary.structure import rotary_head
    >>> layer = mx.RotaryAttention.random(d=6, heads=1, head_width=4, seed=0)
    >>> head = rotary_head(layer.score_matrices(1)[0], layer.score_matrices(2)[0])
    >>> head.width, bool(np.allclose(np.sort(head.theta), np.sort(layer.theta[0])))
    (4, True)
    """
    d = W1.shape[0]
    # a width beyond W(1)'s dimensions (a grid of more tokens than d whose rank search found no
    # drop) is its full rank
    r = head_width(W1, gap) if width is None else min(int(width), min(W1.shape))
    if r == 0:
        return RotaryHead(np.zeros((0, W1.shape[1])), np.zeros((0, d)), np.zeros(0), 0, 0.0, 0.0)
    U, s, Vt = np.linalg.svd(W1)
    U, s, Vt = U[:, :r], s[:r], Vt[:r]
    root = np.sqrt(s)
    A, B = U * root, root[:, None] * Vt                      # W(1) = A B
    projected = U.T @ W2 @ Vt.T                                 # W(2) within the spaces of W(1)
    outside = W2 - U @ projected @ Vt
    subspace_residual = float(np.linalg.norm(outside) / max(np.linalg.norm(W2), 1e-300))
    M = projected / root[:, None] / root[None, :]              # A^+ W(2) B^+
    T, theta, modulus_error = rotation_basis(M)
    K = (A @ T).T
    live = np.abs(T).max(axis=0) > 0                            # padding columns stay zero rows
    rows = np.zeros((T.shape[1], W1.shape[1]))
    rows[live] = np.linalg.solve(T[:, live], B)
    Q = _rotate_back(rows, theta)
    return RotaryHead(Q, K, theta, r, subspace_residual, modulus_error)


def widest_rotary_head(W1: np.ndarray, W2: np.ndarray, limit: float) -> RotaryHead:
    """The head of the largest width whose two score matrices fit the rotary form within ``limit``
    (``subspace_residual`` and ``modulus_error``), W(1)'s full rank where none does: for a head whose
    width the log-score grids could not measure. Directions of W(1) beyond the head's width are the
    grids' noise, and M's eigenvalues there lie anywhere (modulus errors near 1); a real weak
    direction has its own rotation (a random head of width 8 at d = 8 in float32: W(1)'s weakest
    singular value 8.7e-5 of its largest, modulus error 0.02 with it), so a gap in W(1)'s singular
    values cannot tell the two apart where the rotation can.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> from mhaextract.rotary.structure import widest_rotary_head
    >>> layer = mx.RotaryAttention.random(d=6, heads=1, head_width=4, seed=0)
    >>> W1, W2 = layer.score_matrices(1)[0], layer.score_matrices(2)[0]
    >>> noise = np.random.default_rng(0).normal(size=(2, 6, 6)) * 1e-6
    >>> widest_rotary_head(W1 + noise[0], W2 + noise[1], 1e-2).width
    4
    """
    for width in range(min(W1.shape), 0, -1):
        head = rotary_head(W1, W2, width)
        if head.structure_error <= limit:
            return head
    return rotary_head(W1, W2, min(W1.shape))


def rotation_basis(M: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """A real basis T (r x r', r' = r rounded up to even) with ``M T = T R(1)``, R(1) the block
    rotation by ``theta`` (r' / 2 angles); returns ``(T, theta, max | |lambda| - 1 |)``. An odd
    count of unrotated directions gets a zero column (a block with one live direction)."""
    r = M.shape[0]
    eigenvalues = np.linalg.eigvals(M)
    modulus_error = float(np.abs(np.abs(eigenvalues) - 1.0).max()) if r else 0.0
    near_one = np.abs(eigenvalues - 1.0) < UNROTATED
    k = int(near_one.sum())
    columns, angles = [], []
    if k:
        S, Z, found = schur(M, output="real", sort=lambda re, im: abs(re - 1.0) < UNROTATED and abs(im) < UNROTATED)
        k = int(found)
        rest = Z[:, k:]
        if k < r:  # decouple the rotated part from the unrotated cluster: T11 X - X T22 = -T12
            X = solve_sylvester(S[:k, :k], -S[k:, k:], -S[:k, k:])
            rest = Z[:, k:] + Z[:, :k] @ X
        unrotated = Z[:, :k]
        if k % 2:
            unrotated = np.hstack([unrotated, np.zeros((r, 1))])
        columns.append(unrotated)
        angles += [0.0] * (unrotated.shape[1] // 2)
        reduced = np.linalg.lstsq(rest, M @ rest, rcond=None)[0]  # M on the rotated subspace
    else:
        rest, reduced = np.eye(r), M
    if rest.shape[1]:
        values, vectors = np.linalg.eig(reduced)
        upper = np.flatnonzero(values.imag > 0)
        real = np.flatnonzero(values.imag == 0)
        for index in upper:
            vector = rest @ vectors[:, index]
            columns.append(np.stack([vector.real, -vector.imag], axis=1))
            angles.append(float(np.angle(values[index])))
        if len(real):  # eigenvalues -1 (a half turn per position), or 1 not caught above: pairs
            vectors_real = rest @ vectors[:, real].real
            signs = np.sign(values[real].real)
            for sign in (1.0, -1.0):
                chosen = vectors_real[:, signs == sign]
                if chosen.shape[1] % 2:
                    chosen = np.hstack([chosen, np.zeros((r, 1))])
                columns.append(chosen)
                angles += [0.0 if sign > 0 else np.pi] * (chosen.shape[1] // 2)
    T = np.hstack(columns) if columns else np.zeros((r, 0))
    return T, np.asarray(angles), modulus_error


def _rotate_back(rows: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """``R(-1)`` applied to the (r', d) rows in blocks of two (zero rows where T had zero columns)."""
    blocks = rotation_blocks(-theta)                            # (r'/2, 2, 2)
    paired = rows.reshape(len(theta), 2, -1)
    return np.einsum("mab,mbe->mae", blocks, paired).reshape(rows.shape)
