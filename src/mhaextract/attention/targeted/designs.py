"""The design classes of the targeted family: units in all of R^d (:class:`FullDesign`), the final
stage's (:class:`FinalDesign`) and units in a known subspace (:class:`SubspaceDesign`, docs/algorithm.md, 'Low-rank
heads').
"""

from __future__ import annotations

import numpy as np

from .patterns import (
    MinimumNormCorrection, NullSpace, design_tokens, draw_patterns, draw_patterns_per_head, final_sides,
    other_heads_frame,
)
from .tolerances import (
    EPS, FINAL_COPIES, FINAL_ONE_COPY, FINAL_PAIR_EVERY, FINAL_SIDE_COPIES, FINAL_TARGET, INVERSE_BLOCK_BYTES,
    NOISY_FINAL_TARGET, SATURATION_MID, SATURATION_SPREAD, TARGET, TARGET_CENTER,
)

#: The first group's copy counts in float64 (:func:`first_copies`).
FIRST_COPIES = (1, 2)


class FullDesign:
    """Designs of units that measure ``a_h(z)`` in all of R^d: d instances per unit (docs/algorithm.md, 'The targeted
    schedule')."""

    def __init__(self, current: np.ndarray, heads: np.ndarray, patterns: np.ndarray):
        U, H, d = current.shape
        self.current, self.heads, self.units = current, heads, np.arange(U)
        self.rounds, self.pattern = d, patterns
        self.prior = current[self.units, heads].copy()
        self.null_space = NullSpace(current)
        self.correction = MinimumNormCorrection(U, d)
        self.frame = other_heads_frame(current, heads)  # the other heads' rows never change here

    #: the target's log-poles are ``TARGET_CENTER + halfwidth p`` (:func:`design_tokens`)
    halfwidth = TARGET

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, d, d): unit (g, h)'s pattern has its constant row at ``(h + 1) % d``; written
        into ``out`` when given."""
        return draw_patterns_per_head(rng, d, groups, [(h + 1) % d for h in range(H)], out=out)

    def copies(self, n: int, default):
        """The copy counts asked in round n (``default``: the stage's, :func:`measure_units`)."""
        return default[1] if n else default[0]

    def design(self, block: slice, out: np.ndarray | None = None) -> np.ndarray:
        """The final tokens (U, b, d) of the rounds in ``block`` (:func:`correction_blocks`), unrounded,
        written into ``out`` (any strides) when given."""
        null_part = self.null_space.parts(self.pattern[:, self.null_space.heads:, block].transpose(0, 2, 1),
                                          self.frame[3], self.null_space.workspace(block))
        return design_tokens(self.current, self.heads, self.pattern[:, :, block], null_part, self.frame, self.halfwidth,
                        out)

    def update(self, block: slice, x: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Correct the target's estimate to fit what was measured (minimal change from the prior) in
        the rounds of ``block`` (tokens x (U, b, d), log-poles m (U, b)); returns the log-poles
        ``t^T x`` the block's tokens were designed for (t: the estimate before)."""
        designed = np.matmul(x, self.current[self.units, self.heads][:, :, None])[:, :, 0]
        miss = m - np.matmul(x, self.prior[:, :, None])[:, :, 0]
        self.current[self.units, self.heads] = self.prior + self.correction.aim(block.start, x, miss)
        return designed

    def solve(self, finals: np.ndarray, rhs: np.ndarray, units=slice(None)) -> np.ndarray:
        """``a`` (and the same map applied to other right-hand sides) from ``X a = rhs`` (the tokens and
        right-hand sides of the units ``units``, a slice or a mask)."""
        return np.linalg.solve(finals, rhs)

    #: what a subspace design's basis got wrong (:meth:`SubspaceDesign.basis_variance`); none here
    basis_error = None

    def basis_variance(self, finals: np.ndarray, a: np.ndarray) -> np.ndarray | None:
        """The variance (U, D) a unit's ``a`` gets from an error in its design's basis, beside its own
        rounds' (:func:`_solve_units`): none for a design in all of R^D."""
        return None

    def fitted_solution(self) -> np.ndarray | None:
        """The targets' corrected estimates (U, D) when the corrections took in every round: the
        minimum-norm correction then fits all d rounds, so it solves ``X a = m`` (to Gram-Schmidt's
        rounding; :func:`_solve_units` checks the residual). None otherwise."""
        if self.correction.added < self.rounds:
            return None
        return self.current[self.units, self.heads].copy()

    def constant_rows(self) -> np.ndarray:
        """The pattern row of each unit that is all ones or all minus ones (:meth:`patterns`)."""
        return (self.heads + 1) % self.rounds

    def approximate_inverse(self, part: slice = slice(None)) -> np.ndarray | None:
        """``X^{-1}`` (U, D, D) of the rounds' final tokens (rows) of the units ``part``, from the
        design's structure in ``O(H D^2)`` per unit instead of an LU (docs/algorithm.md, 'The inverse from the design');
        None once a correction moved the target's row (rounds designed from different estimates have no common frame).

        In the frame ``G`` whose rows are the estimates ``E`` (pattern slots ``0 .. H - 1``), ``N0^T``
        (the null slots; lifted, with a 0 against the 1 of ``x~``) and, lifted, ``e_D^T`` (slot H), the
        rounds' coordinates are ``G x_n = o + l * p_n`` (``p_n``: pattern column n; ``o``, ``l``: the
        design's offsets and spreads per slot), so ``C^T = L P`` with ``L = diag(l) + s o e_c^T`` (c:
        the constant row, all ``s = +-1``). P's rows are orthogonal, ``P^{-T} = diag(|p_j|^{-2}) P``,
        and by Sherman-Morrison ``L^{-T} = diag(1/l) - e_c (s o / l)^T / (l_c + s o_c)``:
        ``X^{-1} = G^T C^{-1} = G^T L^{-T} P^{-T}``.
        The tokens are rounded to ``TOKEN_BITS`` after the design: this is ``X^{-1}`` to about
        ``2^-38 cond(X)``, and :func:`_refined_solve` checks and refines with it."""
        if self.correction.added:
            return None
        current, heads, pattern = self.current[part], self.heads[part], self.pattern[part]
        U, H, D = current.shape
        units = np.arange(U)
        d = self.null_space.V.shape[1]  # the slopes' dimension (D - 1 lifted)
        null_start = D - (d - H)
        spread, offset = np.empty((U, D)), np.zeros((U, D))
        spread[:, :H], offset[:, :H] = SATURATION_SPREAD, SATURATION_MID
        spread[units, heads], offset[units, heads] = self.halfwidth, TARGET_CENTER
        spread[:, null_start:] = SATURATION_SPREAD / self.frame[3][part, None]
        constant = self.constant_rows()[part]
        sign = pattern[units, constant, :1]  # the constant row is all ones or all minus ones: 1^T = s p_c^T
        spread[:, H:null_start] = sign  # the lifted coordinate (its slot is the constant row): 1 = s p_c
        offset *= sign
        # C^{-1} = diag(w) P + e_c correction^T with w = 1 / (|p_j|^2 l_j); X^{-1} = G^T C^{-1} is formed as
        # one product of rank 2H + 1 (the estimates' rows, N0's reflectors, the constant slot's column)
        # plus the null rows' diagonal part: one (U, D, D) array besides the pattern, no LU.
        weights = 1.0 / (np.einsum("ujn,ujn->uj", pattern, pattern) * spread)
        heads_part = pattern[:, :H] * weights[:, :H, None]  # C^{-1}'s rows 0 .. H - 1 before the correction
        correction = -np.matmul(offset[:, None, :H], heads_part)[:, 0]
        correction /= (spread[units, constant] + offset[units, constant])[:, None]
        in_heads = constant < H
        heads_part[units[in_heads], constant[in_heads]] += correction[in_heads]
        column = np.zeros((U, D, 1))  # G^T e_c where c is not a head's slot: e_D (lifted) or N0 e_(c - null start)
        if null_start > H:
            column[:, D - 1] = 1.0
        null_weights = weights[:, null_start:]
        in_null = constant >= null_start
        if in_null.any():
            picks = np.zeros((U, d - H, 1))
            picks[units[in_null], constant[in_null] - null_start] = 1.0
            column[:, :d] += self.null_space.apply(picks.transpose(0, 2, 1), part).transpose(0, 2, 1)
        V, T = self.null_space.V[part], self.null_space.T[part]
        reflected = np.matmul(np.matmul(T, (V[:, H:] * null_weights[:, :, None]).transpose(0, 2, 1)),
                              pattern[:, null_start:])  # T V_2^T diag(w) P_null (U, H, D)
        left = np.zeros((U, D, 2 * H + 1))
        left[:, :, :H] = current.transpose(0, 2, 1)
        left[:, :d, H:2 * H] = -V
        left[:, :, 2 * H:] = column
        right = np.concatenate([heads_part, reflected, np.where(in_heads[:, None], 0.0, correction)[:, None]], axis=1)
        inverse = np.matmul(left, right)
        inverse[:, H:d] += pattern[:, null_start:] * null_weights[:, :, None]  # N0 = (0, I) - V T V_2^T on the null rows
        if null_start > H:
            inverse[:, D - 1] += pattern[:, H] * weights[:, H, None]
        return inverse


class FinalRounds:
    """What the final stage's units share (:class:`FinalDesign`, :class:`.biased.AffineFinalDesign`;
    docs/algorithm.md, 'The final instances'): the target's row of every pattern is
    :func:`final_sides`, its log-poles ``TARGET_CENTER + halfwidth p_n``, and the copy counts of each
    round (:func:`final_copies`). Float64 answers: ``halfwidth = FINAL_TARGET``, one copy count a
    round and two in every ``FINAL_PAIR_EVERY``-th; noisier answers (:meth:`for_noisy_answers`, set by
    :func:`measure_units`): ``NOISY_FINAL_TARGET``, two in every round."""

    halfwidth, one_copy = FINAL_TARGET, True
    #: whether the target's log-poles alternate sides (units in R^D); a subspace unit's (docs/algorithm.md, 'Low-rank
    #: heads') keep the centre
    sided = True

    def for_noisy_answers(self) -> None:
        """Answers noisier than float64: their sampling error dominates, and every instance's label
        and single-pole test come from its own two samples."""
        self.halfwidth, self.one_copy = NOISY_FINAL_TARGET, False

    def copies(self, n: int, default):
        return final_copies(self.rounds, n, self.one_copy, None if self.sided else 0)


class FinalDesign(FinalRounds, FullDesign):
    """The final stage's units in R^d (:class:`FinalRounds`)."""

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        return draw_patterns_per_head(rng, d, groups, [(h + 1) % d for h in range(H)], range(H), out)


def final_copies(rounds: int, n: int, one_copy: bool = True, side: int | None = None) -> tuple:
    """Round n's copy counts in a final unit of ``rounds`` rounds (:class:`FinalRounds`): with
    ``one_copy`` (float64 answers) the one that reads its side best alone, ``FINAL_ONE_COPY``, and
    its side's two, ``FINAL_SIDE_COPIES``, in the rounds ``n % FINAL_PAIR_EVERY == 0`` (the unit's
    label, and the single-pole test of a sample of its instances); else its side's two in every round.
    ``side``: the target's side in every round (-1, 0, +1), else :func:`final_sides`'s.

    Examples
    --------
    >>> [final_copies(9, n) for n in range(3)], final_copies(9, 1, one_copy=False)
    ([(1, 2), (1,), (4,)], (1, 2))
    """
    side = int(final_sides(rounds)[n]) if side is None else side
    return FINAL_ONE_COPY[side] if one_copy and n % FINAL_PAIR_EVERY else FINAL_SIDE_COPIES[side]


def first_copies(unit: float) -> tuple:
    """The first group's copy counts (round 0, later rounds): ``k = 1, 2`` in float64, the label
    then fixed at the unit's consensus and the two samples' disagreement its single-pole test (as
    in the final units and docs/algorithm.md, 'Low-rank heads'); ``k = 1, 2, 3`` on noisier answers (``unit`` above
    float64's), whose phase 1 leaves rougher estimates (docs/algorithm.md, 'The targeted schedule')."""
    return (FIRST_COPIES, FIRST_COPIES) if unit <= EPS else (FINAL_COPIES, FINAL_COPIES)


def final_unit_queries(rounds: int, one_copy: bool = True) -> int:
    """Queries of one final unit of ``rounds`` rounds (:func:`final_copies`): 1 in each round and 2
    in every ``FINAL_PAIR_EVERY``-th, or without ``one_copy`` 2 in each."""
    return sum(len(final_copies(rounds, n, one_copy)) for n in range(rounds))


class SubspaceDesign(FullDesign):
    """Designs of units whose ``a_h(z) = W_h^T z`` lies in a known r-dimensional subspace (the
    row space of a rank-r ``W_h``, orthonormal basis Q, docs/algorithm.md, 'Low-rank heads'): r instances per
    unit. Instance n has ``Q^T x_n = y_n`` with ``y_n`` = the target's direction scaled to the
    log-pole ``TARGET_CENTER`` plus ``SPREAD p_n / |c|`` across it (p: zero-sum orthogonal pattern
    rows), and the other heads saturated; ``Q^T X`` is then well conditioned and ``a = Q (Q^T X)^{-1} m``."""

    def __init__(self, current: np.ndarray, heads: np.ndarray, patterns: np.ndarray, basis: np.ndarray):
        U, H, d = current.shape
        self.current, self.heads, self.units, self.basis = current, heads, np.arange(U), basis
        self.rounds = basis.shape[2]
        self.pattern = patterns
        # The map below is made in one array, its last r rows per unit first Q^T itself (the basis
        # rows, contiguous per unit, which the products below read): one fresh (U, r, d) array instead
        # of four (a copy, a product, a difference, a concatenation; fresh memory is mapped and zeroed
        # by the kernel, docs/algorithm.md, 'The targeted schedule': they were a sixth of the low-rank learner at d =
        # 256, H = 2, r = 128)
        self.frame_map_rows = np.empty((U, H - 1 + self.rounds, d))
        basis_rows = self.frame_map_rows[:, H - 1:]  # (U, r, d)
        np.copyto(basis_rows, basis.transpose(0, 2, 1))
        self.prior = np.matmul(basis_rows, current[self.units, heads][:, :, None])[:, :, 0]  # c = Q^T a
        self.coordinates = self.prior.copy()
        self.correction = MinimumNormCorrection(U, self.rounds)
        others = np.array([[f for f in range(H) if f != h] for h in heads], dtype=int).reshape(U, H - 1)
        self.others = others
        # The rows every round's design fits: the other heads' estimates O (never corrected here, only
        # the target's) and the basis rows Q^T, the same in every round, so the minimum-norm map from
        # the right-hand side (u_O, y) to x is formed once (a matrix-vector product per round). Q is
        # orthonormal: x = Q y + O'^+ (u_O - O Q y) with O' = O (I - Q Q^T), the other heads' parts off
        # the subspace (Gram-Schmidt, twice), and O'^+ = Q_o R_o^{-T} from the QR of O'^T (d x (H - 1)):
        # the map's rows are (O'^+)^T and Q^T - (O Q)^T (O'^+)^T, O(H d r) a unit (not a QR of the whole
        # d x (H - 1 + r) [O; Q^T] per unit).
        O = current[self.units[:, None], others]  # (U, H - 1, d)
        along = np.matmul(O, basis)  # O Q (U, H - 1, r)
        off = O - np.matmul(along, basis_rows)
        off -= np.matmul(np.matmul(off, basis), basis_rows)
        if H > 1:
            q_o, r_o = np.linalg.qr(off.transpose(0, 2, 1))  # (U, d, H - 1), (U, H - 1, H - 1)
            pseudo_inverse_rows = np.linalg.solve(r_o, q_o.transpose(0, 2, 1))  # (O'^+)^T = R_o^{-1} Q_o^T
        else:
            pseudo_inverse_rows = off  # (U, 0, d)
        self.frame_map_rows[:, :H - 1] = pseudo_inverse_rows
        # Q^T - (O Q)^T (O'^+)^T in place, units in blocks whose product stays small (reused heap memory)
        step = max(1, INVERSE_BLOCK_BYTES // (8 * self.rounds * d))
        for start in range(0, U, step):
            part = slice(start, start + step)
            basis_rows[part] -= np.matmul(along[part].transpose(0, 2, 1), pseudo_inverse_rows[part])

    @staticmethod
    def patterns(rng, d: int, H: int, rounds: int, groups: int, out: np.ndarray | None = None) -> np.ndarray:
        """(groups, H, rounds + H, rounds): r pattern rows in the subspace, H rows for the other heads
        (a new array: ``out`` is not used)."""
        inside = draw_patterns(rng, rounds, 0, groups * H).reshape(groups, H, rounds, rounds)
        return np.concatenate([inside, rng.uniform(-1.0, 1.0, (groups, H, H, rounds))], axis=2)

    def design(self, block: slice, out: np.ndarray | None = None) -> np.ndarray:
        U, r = self.coordinates.shape
        c = self.coordinates
        size = np.linalg.norm(c, axis=1)
        # An orthonormal frame of R^r whose first column is c / |c|: the reflection exchanging e_0 and it.
        normal = np.eye(r)[0] - c / size[:, None]
        length = np.linalg.norm(normal, axis=1)
        normal = np.where(length[:, None] > 1e-12, normal / np.where(length > 1e-12, length, 1.0)[:, None], 0.0)
        inside = self.pattern[:, 1:r, block].transpose(0, 2, 1)  # (U, b, r - 1)
        along = np.concatenate([np.full(inside.shape[:2] + (1,), TARGET_CENTER), SATURATION_SPREAD * inside], axis=2)
        along /= size[:, None, None]
        y = along - 2.0 * np.matmul(along, normal[:, :, None]) * normal[:, None, :]  # (I - 2 n n^T) along
        values = SATURATION_MID + SATURATION_SPREAD * self.pattern[self.units[:, None], r + self.others, block]
        rhs = np.concatenate([values.transpose(0, 2, 1), y], axis=2)
        return np.matmul(rhs, self.frame_map_rows, out=out)

    def update(self, block: slice, x: np.ndarray, m: np.ndarray) -> np.ndarray:
        """As :meth:`FullDesign.update` in the coordinates ``c = Q^T t``: ``t^T x = c^T Q^T x``, and
        only ``c`` is corrected (the designs read ``c``; the target's row of ``current`` keeps the
        unit's initial estimate, saving a (U, r, d) product per block)."""
        rows = np.matmul(x, self.basis)  # (Q^T x_n)^T, (U, b, r)
        designed = np.matmul(rows, self.coordinates[:, :, None])[:, :, 0]
        miss = m - np.matmul(rows, self.prior[:, :, None])[:, :, 0]
        self.coordinates = self.prior + self.correction.aim(block.start, rows, miss)
        return designed

    def solve(self, finals: np.ndarray, rhs: np.ndarray, units=slice(None)) -> np.ndarray:
        basis = self.basis[units]
        return np.matmul(basis, np.linalg.solve(np.matmul(finals, basis), rhs))

    def basis_variance(self, finals: np.ndarray, a: np.ndarray) -> np.ndarray | None:
        """The first-order variance (U, D) of each unit's ``a = Q (X Q)^-1 m`` from the error of its
        basis Q (docs/algorithm.md, 'Low-rank heads', 'Error estimate'), given ``basis_error`` = (per head h: the map
        (D, R) from a unit's ``a`` to the weights ``w`` of the full units whose errors turned Q, the
        full units' coordinate variances (R, D)); None without it. With ``g = E^T w`` (coordinate
        variances ``t = sum_j w_j^2 var(E_j)``) the true ``a`` sticks out of Q's span by ``g`` (the
        ``t`` term), and that part of it, read by the final tokens' components off the subspace
        (``B = X (I - Q Q^T)``: the other heads' saturation puts them there, far larger than their
        in-span parts), enters the log-poles the unit solves: ``(X Q)^-1 B g`` in c, variance
        ``diag(M B diag(t) B^T M^T)``, ``M = Q (X Q)^-1``."""
        if self.basis_error is None:
            return None
        to_weights, full_variance = self.basis_error
        others = self.others.shape[1]  # H - 1
        extra = np.full(a.shape, np.nan)
        with np.errstate(invalid="ignore", over="ignore"):
            for h in np.unique(self.heads):
                units = np.flatnonzero(self.heads == h)
                t = np.matmul(np.square(np.matmul(a[units], to_weights[h])), full_variance[h])  # (u, D)
                extra[units] = t
                if not others:
                    continue
                # The tokens' parts off the subspace lie in the span of the frame map's first H - 1
                # rows (x = Q y + O'^+ (u_O - O Q y), __init__): with an orthonormal basis P of it,
                # B = (X P) P^T (to the tokens' rounding), and the variance of P^T g is P^T diag(t) P,
                # (H - 1)-square: O(D r (H - 1)) a unit beside the r x r solve, not O(D r^2)
                P = np.linalg.qr(self.frame_map_rows[units, :others].transpose(0, 2, 1))[0]  # (u, D, H - 1)
                X, Q = finals[units], self.basis[units]
                spread = np.matmul(Q, np.linalg.solve(np.matmul(X, Q), np.matmul(X, P)))  # M X P, (u, D, H - 1)
                off_variance = np.matmul(P.transpose(0, 2, 1) * t[:, None, :], P)  # (u, H - 1, H - 1)
                extra[units] += (np.matmul(spread, off_variance) * spread).sum(axis=2)
        return extra

    def fitted_solution(self) -> None:
        """Not used here (:meth:`FullDesign.fitted_solution`): ``a = Q c`` is solved from all rounds."""
        return None

    def approximate_inverse(self, part: slice = slice(None)) -> None:
        """No structured inverse here (:meth:`FullDesign.approximate_inverse`): one LU of the r x r ``X Q``."""
        return None
