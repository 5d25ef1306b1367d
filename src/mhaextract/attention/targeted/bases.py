"""The final stage's bases: each head's balanced basis, chosen by its predicted score rounding or
conditioning (docs/algorithm.md, 'The targeted schedule', its step 5).
"""

from __future__ import annotations

import numpy as np

from .tolerances import EPS, FINAL_TARGET, SATURATION_MID, SATURATION_SPREAD, TARGET_CENTER

#: Balanced bases tried per head in the final stage (:func:`balanced_basis`), within BASIS_BYTES
#: of candidate design rows: ``BASIS_CANDIDATES`` at H = d, ``BASIS_CANDIDATES H / d`` but at least
#: ``FEWEST_CANDIDATES`` below (a null space of d - H dimensions leaves ``cond A(z)`` little to choose,
#: and the choice is a large part of the learner's time there).
BASIS_CANDIDATES, FEWEST_CANDIDATES, BASIS_BYTES = 128, 4, 2**26


#: Noisy answers with score biases (docs/algorithm.md, 'Narrow heads'): the final stage's
#: ``|z|`` grows until the part of the target's query ``W_h x`` that shrinks as ``1 / |z|`` (x aims
#: fixed log-poles) is about ``SCORE_BALANCE`` times the score bias ``u_h``, by at most
#: ``LONGEST_FINAL`` times ``GROUP_SCALE`` token scales. A bias below ``1 / UNRESOLVED_BIAS`` of
#: that query part is the rough model's noise (bias-free float32 targets read 1e4..2e5, real
#: layers 3..43): nothing to balance, the default length is kept.
SCORE_BALANCE, LONGEST_FINAL, UNRESOLVED_BIAS = 2.5, 8.0, 1e3


def bias_balanced_scale(scores: np.ndarray, directions: np.ndarray, scale: float) -> float:
    """The final differences' length for noisy answers: ``scale`` times
    ``clip(rms |W_h x| / (SCORE_BALANCE rms |u_h|), 1, LONGEST_FINAL)``, or ``scale`` itself where the
    ratio exceeds ``UNRESOLVED_BIAS`` (no bias to read).

    ``scores`` (H, d + 1, d + 1): the rough lifted score matrices (:func:`.biased.lifted_scores`);
    ``directions`` (d, n): the columns z of some basis (their lengths do not matter); x the
    minimum-norm token with ``a_f^T x = SATURATION_MID`` (f != h) and ``TARGET_CENTER`` (f = h),
    ``a_f = W_f^T z``, ``|z| = scale``: a final unit's mean token, leaving out the offsets
    ``b_f = u_f^T z`` (their part of x does not shrink as z grows).

    A final unit solves ``a~ = (W_h^T z, u_h^T z)`` from lifted tokens ``(x, 1)``: the bias's
    coordinate is 1 while x aims log-poles of 70 at ``|z|``, so ``u_h`` is read ``|W_h x| / |u_h|``
    times less well than ``W_h`` relative to their sizes. A longer z shortens x (``|x| ~ 1 / |z|``)
    at the same log-poles: W's error stays (the scores' rounding ``|z| |W_h x|`` does not change)
    and u's falls as ``1 / |z|`` until the bias itself dominates the rounding, ``|z| |u_h|``."""
    H, D, _ = scores.shape
    d = D - 1
    W, u = scores[:, :d, :d], scores[:, :d, d]
    units = directions / np.linalg.norm(directions, axis=0)
    bias = np.sqrt(np.mean(np.sum(u**2, axis=1)))
    if not (bias > 0 and np.isfinite(bias)):
        return scale
    designs = np.matmul(units.T[None], W).transpose(1, 0, 2)  # (n, H, d): rows a_f(z)^T = z^T W_f
    with np.errstate(all="ignore"):
        try:
            inverse_gram = np.linalg.inv(np.matmul(designs, designs.transpose(0, 2, 1)))
        except np.linalg.LinAlgError:
            return scale
        sizes = []
        for head in range(H):
            values = np.full(H, SATURATION_MID)
            values[head] = TARGET_CENTER
            tokens = np.matmul(designs.transpose(0, 2, 1), np.matmul(inverse_gram, values / scale)[..., None])[..., 0]
            sizes.append(np.sum((tokens @ W[head].T) ** 2, axis=1))
        query = np.sqrt(np.mean(sizes))
    if not np.isfinite(query) or query > UNRESOLVED_BIAS * bias:
        return scale
    return scale * float(np.clip(query / (SCORE_BALANCE * bias), 1.0, LONGEST_FINAL))


def balanced_basis(label_direction: np.ndarray, rng, scale: float, scores: np.ndarray | None = None,
                    head: int | None = None) -> np.ndarray:
    """An orthogonal basis (columns) times ``scale`` in which ``label_direction`` (a rough ``v_h``)
    has equal components ``+-|v_h| / sqrt(d)``: the Householder reflection that exchanges
    ``v_h / |v_h|`` and ``(1, .., 1) / sqrt(d)``, with random column signs.

    A difference z nearly orthogonal to ``v_h`` makes the label ``l_h = v_h^T z`` small next to the
    oracle's rounding of ``v_h^T y`` (``~ eps |v_h| |z|``), and that head's poles imprecise; in this
    basis every ``|l_h| = |v_h| |z| / sqrt(d)``.

    Every rotation ``O`` that fixes ``(1, .., 1)`` keeps that balance. With ``scores`` (H, d', d'),
    the rough score matrices (``d' = d + 1``, lifted, with biases: their d x d part), the basis is the best of
    ``BASIS_CANDIDATES`` such rotations by the worst condition number over its columns z of the
    design rows ``A(z) = [W_f^T z]_f`` (docs/algorithm.md, 'The targeted schedule'): an instance solves ``A(z) x = m``
    with the other heads' log-poles at 40..100, so an ill-conditioned ``A(z)`` makes ``|x|``, the
    answers and their rounding large. With ``head``
    (the targeted schedules' final stage) the choice is finer: the candidate whose largest predicted
    score rounding of that head, ``|z| |W_h x + u_h|`` (:func:`_least_score_rounding`), is smallest.
    One head (H = 1): a single row, nothing to condition; the basis is drawn as it is.
    """
    d = len(label_direction)
    unit = label_direction / np.linalg.norm(label_direction)
    ones = np.full(d, 1.0 / np.sqrt(d))
    normal = unit - ones
    if np.linalg.norm(normal) < 1e-12:
        normal = np.zeros(d)  # already balanced: R = I
    else:
        normal /= np.linalg.norm(normal)
    reflection = np.eye(d) - 2.0 * np.outer(normal, normal)
    signs = rng.choice([-1.0, 1.0], size=d)
    basis = reflection * signs[None, :]
    if scores is not None and len(scores) > 1:
        rows = scores[:, :d, :d]  # A(z)[f] = W_f^T z on x (a lifted z ends in 0, a lifted x in a fixed 1)
        wanted = max(FEWEST_CANDIDATES, BASIS_CANDIDATES * len(rows) // d)
        count = int(np.clip(BASIS_BYTES // (8 * rows.size), 1, wanted))  # (count, d, H, d) designs
        # A random rotation fixing the ones: O = Q F, Q from the QR of a Gaussian whose first column
        # is the ones (Q e_1 = +-1 / sqrt(d), the rest a random basis of the complement), F the
        # reflection exchanging e_1 and 1 / sqrt(d) (O 1 = Q sqrt(d) e_1 = 1 once Q's sign is fixed):
        # one QR per candidate, and F applied in O(d^2).
        gaussian = rng.standard_normal((count - 1, d, d))
        gaussian[:, :, 0] = 1.0
        q = np.linalg.qr(gaussian)[0]
        q *= np.sign(q[:, :1, :1] * ones[0])  # the first column +1 / sqrt(d) (a column sign keeps Q orthogonal)
        swap = np.eye(d)[0] - ones
        swap /= np.linalg.norm(swap)
        rotations = q - 2.0 * np.matmul(q, swap)[:, :, None] * swap[None, None, :]  # Q (I - 2 s s^T)
        # R O diag(signs): v^T R O = |v| 1^T O / sqrt(d) = |v| 1^T / sqrt(d), every label alike
        reflected = rotations - 2.0 * normal[None, :, None] * np.matmul(normal, rotations)[:, None, :]  # R O
        candidates = np.concatenate([basis[None], reflected * signs[None, None, :]])
        # (count, groups, H, d): designs[k, g, f] = rows[f]^T candidates[k][:, g], as BLAS matmuls (not einsum)
        designs = np.matmul(candidates.transpose(0, 2, 1)[:, None], rows[None]).transpose(0, 2, 1, 3)
        if head is None:
            basis = candidates[_best_conditioned(designs)]
        else:
            basis = candidates[_least_score_rounding(designs, candidates, scores, head, scale)]
    return basis * scale


def _least_score_rounding(designs: np.ndarray, candidates: np.ndarray, scores: np.ndarray, head: int,
                          scale: float) -> int:
    """The candidate k of ``designs`` (count, groups, H, d; the rows ``a_f(z) = W_f^T z`` of unit
    columns z of ``candidates`` (count, d, d)) whose largest predicted ``|z| |W_h x + u_h|`` over its
    columns is smallest (``scores`` (H, d', d'): the rough score matrices, lifted with biases).
    The prediction is the root mean square over a unit's instances: x the minimum-norm token with
    ``a_f^T x + b_f = SATURATION_MID + SATURATION_SPREAD q_f`` (f != h) and
    ``TARGET_CENTER + FINAL_TARGET q_h`` at ``|z| = scale`` (``b_f = u_f^T z``), the pattern entries
    q of variance 1/3 (uniform on [-1, 1]). The mean token alone is not enough: it can choose
    an ill-conditioned ``A(z)`` whose variations are large.

    The oracle rounds the scores ``y^T (W_h x + u_h)`` of the copies ``y = x - z`` by about
    ``eps |z| |W_h x + u_h|``, and that error of the target's log-pole, the same at every copy
    count, dominated the final units' error in float64 (docs/algorithm.md, 'The final instances'). ``cond A(z)``
    (:func:`_best_conditioned`) bounds it only loosely, so the choice is by the prediction itself. A singular Gram
    matrix falls back to :func:`_best_conditioned`."""
    count, groups, H, d = designs.shape
    lifted = scores.shape[1] > d
    offsets = (np.matmul(candidates.transpose(0, 2, 1), scores[:, :d, d].T) if lifted
               else np.zeros((count, groups, H)))  # u_f^T z for unit columns z, (count, groups, H)
    values = np.full(H, SATURATION_MID)
    values[head] = TARGET_CENTER
    spread = np.full(H, SATURATION_SPREAD)
    spread[head] = FINAL_TARGET
    rhs = values[None, None] / scale - offsets  # A x = (values - scale b) / scale for unit z, |z| = scale
    W_h, u_h = scores[head, :d, :d], (scores[head, :d, d] if lifted else np.zeros(d))
    with np.errstate(all="ignore"):
        try:
            inverse_gram = np.linalg.inv(np.matmul(designs, designs.transpose(0, 1, 3, 2)))
        except np.linalg.LinAlgError:
            return _best_conditioned(designs)
        # W_h A^+ = W_h A^T (A A^T)^{-1}: (count, groups, d, H)
        mapped = np.matmul(np.matmul(W_h[None, None], designs.transpose(0, 1, 3, 2)), inverse_gram)
        mean = np.matmul(mapped, rhs[..., None])[..., 0] + u_h  # W_h x + u_h at the mean token
        # the pattern's variations (entries spread uniformly over [-1, 1]: variance 1/3) around it
        varied = (mapped * (spread / scale)) ** 2
        size = np.sqrt((mean**2).sum(axis=2) + varied.sum(axis=(2, 3)) / 3.0) * scale
        worst = np.nan_to_num(size.max(axis=1), nan=np.inf)
    return int(np.argmin(worst))


def _best_conditioned(designs: np.ndarray) -> int:
    """The candidate k of ``designs`` (count, groups, H, d) whose worst condition number over its
    groups, ``max_g s_0 / s_-1`` by SVD, is smallest (the first such k).

    The same k as taking the SVD of every candidate, cheaper: the conditions are first estimated
    from the eigenvalues of the H x H Gram matrices ``A A^T`` (error at most about
    ``H (d + H) eps cond^2`` relative; here with a factor 64 to spare), and only the candidates
    those bounds cannot rule out (usually one) get the SVD."""
    count, groups, H, d = designs.shape
    eigenvalues = np.linalg.eigvalsh(np.matmul(designs, designs.transpose(0, 1, 3, 2)))  # ascending
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = np.sqrt(eigenvalues[..., -1] / eigenvalues[..., 0]).max(axis=1)  # NaN where not positive
        slack = 64.0 * H * (d + H) * EPS * estimate**2
    bounded = np.isfinite(estimate) & (slack < 0.5)
    keep = np.arange(count)
    if bounded.any():  # exact worst within estimate * (1 -+ 2 slack)
        highest = (estimate * (1.0 + 2.0 * slack))[bounded].min()  # >= the smallest exact worst
        keep = np.flatnonzero(~bounded | (estimate * (1.0 - 2.0 * slack) <= highest))
    singular = np.linalg.svd(designs[keep], compute_uv=False)
    with np.errstate(divide="ignore", invalid="ignore"):
        worst = np.nan_to_num(singular[..., 0] / singular[..., -1], nan=np.inf).max(axis=1)
    return int(keep[np.argmin(worst)])
