"""The grids of an instance's log-labels completed at low rank: the head widths and the missing or
outlying entries of the rotary start (docs/algorithm.md, 'Rotary attention: positions, grouped
heads and sliding windows'), by robust alternating least squares."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

#: An entry off the completion's fit by more than this many times its median misfit is an outlier
#: (replaced by the fit); Huber's constant of the fit's weights, in the same units.
OUTLIER_FACTOR = 100.0
HUBER = 3.0
#: The head width is the rank at which the completion's median misfit drops by this factor; with
#: float32 answers, the rank of the largest drop if it is this large and twice any other.
RANK_DROP = 100.0
NOISY_RANK_DROP = 5.0
#: A rank-r fit of an (m, n) grid with more than this fraction of its entries as parameters
#: ``r (m + n - r)`` takes in most of them once its outliers are dropped, and its median misfit
#: falls whatever the rank: with float32 answers such ranks are not measured; in float64 a fall
#: there stands unless the next rank falls ``RANK_DROP`` times further (a full-width head, r = d,
#: in a grid of d + 2 keys by d + 3 finals: 98 of 110 entries at rank 7 fell 198-fold, rank 8 then
#: 4.5e5-fold). Only the next: far beyond, a grid whose log-scores are noisier than float64's (a
#: layer computing its angles in float32, taken as exact) falls again as its fits take in the noise.
MEASURED_PARAMETERS = Fraction(2, 3)
#: Entry weights (inverse variances) are taken within this range of their median: an entry is known
#: no better than the answers' noise allows however far apart its poles lie, and one weighed far
#: above the rest stalls the alternating sweeps (float32, a trained Llama layer at d = 32: fit
#: errors of 3e-2 median in a grid with weights unbounded, 3e-4 within this range). Weighted fits
#: take ``WEIGHTED_SWEEPS`` sweeps (errors 6e-3 in the same grid after 60, 3e-4 after 300).
WEIGHT_RANGE = (1e-3, 10.0)
WEIGHTED_SWEEPS = 300
#: The rank search's weighted fits (robust, misfits in standard deviations) take this many sweeps.
WEIGHTED_RANK_SWEEPS = 150


def complete_low_rank(grids: np.ndarray, ranks: np.ndarray, sweeps: int = 60, weights=None) -> np.ndarray:
    """Each (..., m, n) grid of log-scores (rank r: ``L = Z^T [W | u] [X; 1]``) with its missing
    (NaN) entries filled and its outliers replaced by a rank-``ranks[...]`` fit of the entries
    that agree with it (robust alternating least squares: :func:`_alternating_fit`). ``weights``
    (the grids' shape): each entry's inverse variance, where the entries are noisy (float32
    answers); the fit weighs them so, and the grid returned is the fit itself at every entry (at
    rank r it averages the noise of all entries; an entry kept as observed keeps its own)."""
    grids = grids.copy()
    for index in np.ndindex(grids.shape[:-2]):
        grid = grids[index]
        entry_weights = None if weights is None else weights[index]
        fitted, kept = _alternating_fit(grid, np.isfinite(grid), int(ranks[index]),
                                        sweeps if entry_weights is None else WEIGHTED_SWEEPS, weights=entry_weights)
        grids[index] = fitted if entry_weights is not None else np.where(kept, grid, fitted)
    return grids


def complete_offset_pairs(grids: np.ndarray, ranks, weights: np.ndarray, sweeps: int = WEIGHTED_SWEEPS) -> np.ndarray:
    """Each head's two noisy log-score grids (``grids`` (2, H, m, n), offsets 1 and 2; ``weights``
    their entries' inverse variances) fitted together in the rotary form ``L(1) = A B``, ``L(2) =
    A M B`` (A m x r, B r x n, M r x r; r = ``ranks[h]``), from their separate completions
    (:func:`complete_low_rank`). With ``L(delta) = Z^T K^T R^delta [Q | b] [X; 1]`` and any
    invertible G, ``A = Z^T K^T G``, ``B = G^{-1} R [Q | b] [X; 1]`` and ``M = G^{-1} R G``: the
    offsets share every key's and every final token's factor, so each is fitted from the entries
    of both grids, and a grid missing a fifth of its entries (offset 2 of a windowed float32
    layer) leans on the other. Alternating weighted least squares over A, B and M with Huber's
    weights, as :func:`_alternating_fit`; returns the fitted grids at every entry."""
    separate = complete_low_rank(grids, np.array([ranks, ranks]), weights=weights)
    fitted = np.empty_like(separate)
    for h in range(grids.shape[1]):
        fitted[:, h] = _paired_fit(grids[:, h], separate[:, h], int(ranks[h]), sweeps, weights[:, h])
    return fitted


def _paired_fit(grids: np.ndarray, start: np.ndarray, r: int, sweeps: int, weights: np.ndarray) -> np.ndarray:
    """``L(1) = A B``, ``L(2) = A M B`` fitted to the observed entries of ``grids`` (2, m, n), from the
    completed grids ``start``; each entry weighed by its normalised inverse variance times Huber's
    ``min(1, HUBER typical / misfit)`` (misfits in the entries' standard deviations)."""
    observed = np.isfinite(grids)
    values = np.where(observed, grids, 0.0)
    base = np.stack([_normalised(weights[t], observed[t]) for t in range(2)])
    root = np.sqrt(base)
    U, s, Vt = np.linalg.svd(start[0], full_matrices=False)
    A, B = U[:, :r] * np.sqrt(s[:r]), np.sqrt(s[:r])[:, None] * Vt[:r]
    M = np.linalg.pinv(A) @ start[1] @ np.linalg.pinv(B)
    ridge, entry = 1e-14 * np.eye(r), base
    scale = max(float(np.abs(values).max()), 1e-300)
    for _ in range(sweeps):
        one, two = B, M @ B  # each final token's features in the two grids
        A = _solve_rows(np.einsum("ji,ai,bi->jab", entry[0], one, one) + np.einsum("ji,ai,bi->jab", entry[1], two, two),
                        (entry[0] * values[0]) @ one.T + (entry[1] * values[1]) @ two.T, ridge, A)
        one, two = A, A @ M  # each key token's
        B = _solve_rows(np.einsum("ji,ja,jb->iab", entry[0], one, one) + np.einsum("ji,ja,jb->iab", entry[1], two, two),
                        (entry[0] * values[0]).T @ one + (entry[1] * values[1]).T @ two, ridge, B.T).T
        # M from L(2) alone: a_j^T M b_i is linear in M, normal equations of r^2 unknowns
        per_key = np.einsum("ji,bi,di->jbd", entry[1], B, B)
        normal = np.einsum("ja,jc,jbd->abcd", A, A, per_key).reshape(r * r, r * r)
        M = _solve_rows(normal[None], (A.T @ (entry[1] * values[1]) @ B.T).reshape(1, -1), 1e-14 * np.eye(r * r),
                        M.reshape(1, -1)).reshape(r, r)
        misfit = np.abs(np.stack([A @ B, A @ M @ B]) - values) * root
        typical = max(float(np.median(misfit[observed])), 1e-15 * scale)
        entry = np.where(observed, base * np.minimum(1.0, HUBER * typical / np.maximum(misfit, 1e-300)), 0.0)
    return np.stack([A @ B, A @ M @ B])


def head_widths(grids: np.ndarray, noisy: bool = False, weights=None) -> tuple[list[int], int]:
    """Each head's width from its (H, m, n) log-score grids (:func:`completion_rank`), and how many
    heads took theirs from the others: with ``noisy`` grids a head whose grid shows no clear fall
    (float32 answers: a fall of 4 where the other heads fall by 20) takes the largest width the
    other heads found, since the heads of a layer share one width r (``Q`` is (H, r, d)) and a
    full-rank head would widen every head to it."""
    widths = [completion_rank(grid, noisy=noisy, weights=None if weights is None else weights[h])
              for h, grid in enumerate(grids)]
    full = min(grids.shape[-2:])
    found = [width for width in widths if width < full]
    if not noisy or not found:
        return widths, 0
    return [width if width < full else max(found) for width in widths], len(widths) - len(found)


def completion_rank(grid: np.ndarray, sweeps: int = 20, noisy: bool = False, weights=None) -> int:
    """The rank of a log-score grid with missing entries and outliers: the smallest r at which the
    median misfit of the rank-r least-squares fit falls by ``RANK_DROP`` from rank r - 1 (the
    median, not the largest misfit: an instance whose poles were fitted wrongly is an outlier at
    every rank), or reaches rounding; the full rank when there is no such drop. A drop at a rank
    whose fit has more than ``MEASURED_PARAMETERS`` of the entries as parameters may be the fit's
    own (it interpolates most entries once its worst are dropped): the next rank's drop takes its
    place where it is ``RANK_DROP`` times larger (and so on).

    ``noisy`` (log-scores from float32 answers, where the misfit falls from the signal to the
    noise, by 7..30 at d = 64, not to rounding): the rank of the largest drop, if it is at least
    ``NOISY_RANK_DROP`` and twice every other, among the ranks whose fit has at most 2/3 as many
    parameters ``r (m + n - r)`` as there are entries (nearer their count a fit interpolates the
    noise, and its misfit falls whatever the rank); the full rank when there is none.

    ``weights`` (each entry's inverse variance, noisy grids): the fits are the completion's own,
    weighted and robust, and their misfits are measured in the entries' standard deviations (on
    the trained float32 Llama layer llama-d32-h4/1 falls of 32..57 at the head width, where the
    unweighted misfits fell by 3.9..7.8 there and by 5.2 at one rank more in one head)."""
    observed = np.isfinite(grid)
    values = grid[observed]
    scale = max(float(np.abs(values).max()), 1e-300) if values.size else 1.0
    standard = 1.0 if weights is None else np.sqrt(_normalised(weights, observed))
    previous = float(np.median((np.abs(grid - np.median(values)) * standard)[observed])) if values.size else 0.0
    full = min(grid.shape)
    # fits of rank above this have more than MEASURED_PARAMETERS of the entries as parameters (r (m + n - r)
    # grows with r below min(m, n)): they take in most of the entries
    measurable = measurable_rank(grid)
    highest = full - 1 if not noisy else measurable
    drops = np.ones(highest + 1)
    found = None
    for r in range(1, highest + 1):
        if weights is None:
            fitted, kept = _alternating_fit(grid, observed, r, sweeps, robust=False)
        else:
            fitted, _ = _alternating_fit(grid, observed, r, WEIGHTED_RANK_SWEEPS, weights=weights)
            kept = observed
        median = float(np.median((np.abs(fitted - grid) * standard)[kept]))
        drops[r] = previous / max(median, 1e-300)
        previous = median
        if found is not None:
            if drops[r] < RANK_DROP * drops[found]:
                return found
            found = r
        elif median <= 1e-13 * scale or drops[r] >= RANK_DROP:
            if r <= measurable:
                return r
            found = r   # a fall where the fit nears interpolation may be its own: the next, far larger, wins
    if found is not None:
        return found
    largest = int(np.argmax(drops))
    if noisy and drops[largest] >= max(NOISY_RANK_DROP, 2 * np.delete(drops, largest).max(initial=1.0)):
        return largest
    return full


def measurable_rank(grid: np.ndarray) -> int:
    """The highest rank a noisy grid's rank search measures (:func:`completion_rank`): that of the
    widest fit with at most ``MEASURED_PARAMETERS`` of the observed entries as parameters
    ``r (m + n - r)`` (0 where none).

    >>> import numpy as np
    >>> from mhaextract.rotary.completion import measurable_rank
    >>> measurable_rank(np.zeros((18, 19)))   # 7 (24 - 7) = 210 <= 228 = 2/3 of 342
    7
    """
    observed = int(np.isfinite(grid).sum())
    return max((r for r in range(1, min(grid.shape)) if r * (sum(grid.shape) - r) <= MEASURED_PARAMETERS * observed),
               default=0)


def _alternating_fit(grid: np.ndarray, observed: np.ndarray, r: int, sweeps: int,
                     robust: bool = True, weights=None) -> tuple[np.ndarray, np.ndarray]:
    """Rank-r fit ``A B`` of the entries of ``grid`` marked ``observed``; returns (fit, kept mask:
    the entries within ``OUTLIER_FACTOR`` median misfits of the fit).

    Each sweep solves every row of A, then every column of B, from the observed entries, as
    batched normal equations (a start for the refinement, not its accuracy). ``robust``: the
    entries weighted by Huber's ``min(1, HUBER * median misfit / misfit)`` (iteratively reweighted
    least squares: an outlier loses its pull without a row or column losing its entries); else
    plain least squares with the entries beyond ``OUTLIER_FACTOR`` median misfits dropped twice,
    which is what the rank search measures: a robust fit of too low a rank interpolates most
    entries once its parameters ``r (m + n - r)`` near their count, and its median misfit says
    nothing. ``weights``: each entry's inverse variance (over their median, within
    ``WEIGHT_RANGE``), the entries weighed by them and their misfits measured in their standard
    deviations."""
    filled = np.where(observed, grid, np.nanmean(np.where(observed, grid, np.nan)))
    U, s, Vt = np.linalg.svd(filled, full_matrices=False)
    A, B = U[:, :r] * s[:r], Vt[:r]
    values = np.where(observed, grid, 0.0)
    scale = max(float(np.abs(values).max()), 1e-300)
    ridge = 1e-14 * np.eye(r)
    base = observed.astype(np.float64)
    if weights is not None:
        base = _normalised(weights, observed)
    root = np.sqrt(base)
    weights = base
    for sweep in range(sweeps):
        A = _solve_rows(np.einsum("ij,aj,bj->iab", weights, B, B), np.einsum("ij,aj,ij->ia", weights, B, values),
                        ridge, A)
        B = _solve_rows(np.einsum("ij,ia,ib->jab", weights, A, A), np.einsum("ij,ia,ij->ja", weights, A, values),
                        ridge, B.T).T
        misfit = np.abs(A @ B - values) * root
        typical = max(float(np.median(misfit[weights > 0])), 1e-15 * scale)
        if robust:
            weights = np.where(observed, base * np.minimum(1.0, HUBER * typical / np.maximum(misfit, 1e-300)), 0.0)
        elif sweep in (sweeps // 3, 2 * sweeps // 3):
            weights = np.where(misfit > OUTLIER_FACTOR * typical, 0.0, weights)
    misfit = np.abs(A @ B - values) * root
    typical = max(float(np.median(misfit[observed if robust else weights > 0])), 1e-15 * scale)
    return A @ B, observed & (misfit <= OUTLIER_FACTOR * typical)


def _normalised(weights: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Entry weights over their median on the observed entries, within ``WEIGHT_RANGE``; 0 elsewhere."""
    base = np.where(observed, np.nan_to_num(weights), 0.0)
    typical = max(float(np.median(base[observed])), 1e-300)
    return np.where(observed, np.clip(base / typical, *WEIGHT_RANGE), 0.0)


def _solve_rows(normal: np.ndarray, rhs: np.ndarray, ridge: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """``normal[i] x_i = rhs[i]`` for every i (scaled ridge against a row with too few entries,
    which keeps its previous value where the system is singular)."""
    size = np.maximum(np.trace(normal, axis1=1, axis2=2), 1e-300)[:, None, None]
    try:
        return np.linalg.solve(normal + ridge * size, rhs[..., None])[..., 0]
    except np.linalg.LinAlgError:
        return previous
