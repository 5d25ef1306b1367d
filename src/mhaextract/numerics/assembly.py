"""Assembly of the grid schedules' redundant measurements into ``M_h`` and ``l_h`` (docs/algorithm.md, 'Assembly').

The grid instance ``(i, j)`` measures ``M_h[j, i]``; row link ``j`` measures ``M_h[0, 0] + M_h[j, 0]``;
column link ``(i, j)`` measures ``w (M_h[j, 0] + M_h[j, i])`` (``w = layout.column_link_weight``: 1 for
the final token ``x_0 + x_i`` of 'The paper schedule', 1/2 for the affine ``(x_0 + x_i) / 2`` of the biased grid,
'Biases: affine scores and an output constant') and repeats the labels ``l_h[j]`` of its column. Every entry but
``M_h[0, 0]`` is measured twice. Two ways to use that, one per arithmetic:

* float64 (:func:`weighted_combination`): weighted least squares over every measurement, each
  weighted by its first-order variance, so that an ill-conditioned instance is outvoted by its twin;
* balls (:func:`tightest_enclosures`): every measurement is itself an enclosure of the truth (when
  its instance is certified); keep the tightest, which keeps the certificate.

``layout`` is any object with the grid schedules' index arrays: ``d``, ``grid_index`` (F, d) with
F the number of final tokens (d, or d + 1 for the biased grid of 'Biases: affine scores and an output constant'),
``row_link_index`` (d,), ``column_link_index`` (F, d) (-1 where not asked), ``column_link_weight`` and ``instances``
(each with ``role`` and ``j``). ``M_h`` is (d, F): row j a difference, column i a final token.
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.linalg import MatrixRankWarning, spsolve


def inverse_variance_weights(sigma: np.ndarray) -> np.ndarray:
    """Inverse variances; a non-finite sensitivity (failed fit) gets weight 0.

    Sensitivities are floored at 1e-6 of the smallest finite one and never below 1e-150, so that a
    fit reporting sensitivity 0 (noise-free samples) gets a large finite weight (at most 1e300)
    rather than 1 / 0: the weights are also used as absolute inverse variances."""
    sigma = np.where(np.isfinite(sigma), sigma, np.inf)
    floor = max(float(np.nanmin(sigma[np.isfinite(sigma)], initial=1.0)) * 1e-6, 1e-150)
    return 1.0 / np.maximum(sigma, floor) ** 2


def pole_design(layout) -> csr_matrix:
    """Sparse (n, d F): which entries ``M[j, i]`` (column ``j F + i``) each instance's pole measures
    (grid: ``M[j, i]``; row link j: ``M[0, 0] + M[j, 0]``; column link (i, j): ``w (M[j, 0] + M[j, i])``)."""
    finals = layout.grid_index.shape[0]
    role, i, j = layout.instances.role, layout.instances.i, layout.instances.j
    grid, row_link = role == "grid", role == "row_link"
    # each instance's unknowns in order: grid [j F + i]; row link [0, j F]; column link [j F, j F + i]
    first = np.where(grid, j * finals + i, np.where(row_link, 0, j * finals))
    second = np.where(row_link, j * finals, j * finals + i)
    counts = np.where(grid, 1, 2)
    start = np.cumsum(counts) - counts
    rows = np.repeat(np.arange(len(role)), counts)
    cols = np.empty(len(rows), dtype=int)
    cols[start] = first
    cols[start[~grid] + 1] = second[~grid]
    values = np.where(grid | row_link, 1.0, float(layout.column_link_weight))[rows]
    return csr_matrix((values, (rows, cols)), shape=(len(layout.instances), layout.d * finals))


def label_columns(layout) -> tuple[np.ndarray, np.ndarray]:
    """``(column j of each instance, mask of the instances that measure the labels of their column)``:
    grid instances and column links do, row links (which measure sums of labels) do not."""
    columns, role = layout.instances.j, layout.instances.role
    measures = (role == "grid") | (role == "column_link")
    return columns, measures


def weighted_combination(layout, m: np.ndarray, labels: np.ndarray, sigma_m: np.ndarray, sigma_l: np.ndarray):
    """float64: every ``M_h[j, i]`` and ``l_h[j]`` by weighted least squares over all instances.

    ``m``, ``labels``, ``sigma_*`` (n, H) in head order. The normal equations of the poles are
    sparse (the links form a tree) and solved per head. Returns ``M`` (H, d, d), ``l`` (H, d) and
    their first-order standard deviations per unit relative sample error.
    """
    M, M_std = combine_poles(layout, m, sigma_m)
    l, l_std = combine_labels(layout, labels, sigma_l)
    return M, l, M_std, l_std


def combine_poles(layout, m: np.ndarray, sigma: np.ndarray):
    d, finals = layout.d, layout.grid_index.shape[0]
    n, H = m.shape
    A = pole_design(layout)
    weights = inverse_variance_weights(sigma)
    M = np.empty((H, d, finals))
    for h in range(H):
        values = np.where(weights[:, h] > 0, m[:, h], 0.0)
        Aw = A.multiply(weights[:, h][:, None]).tocsr()
        normal = (A.T @ Aw).tocsc()
        with warnings.catch_warnings():  # an unknown with no usable measurement -> NaN, reported
            warnings.simplefilter("ignore", MatrixRankWarning)
            M[h] = np.atleast_1d(spsolve(normal, Aw.T @ values)).reshape(d, finals)
    # Posterior standard deviations, to first order along the tree: M[0,0] from its grid
    # instance; M[j,0] and M[j,i] each from a direct and a linked measurement.
    variance = 1.0 / np.maximum(weights, 1e-300)
    grid, row_links, column_links = layout.grid_index, layout.row_link_index, layout.column_link_index

    def combine(direct, linked):
        return 1.0 / (1.0 / direct + 1.0 / linked)

    def linked(link_index, base, weight=1.0):  # a column link measures w (M[j, 0] + M[j, i])
        return variance[link_index] / weight**2 + base if link_index >= 0 else np.full(H, np.inf)

    std = np.empty((H, d, finals))
    v00 = variance[grid[0, 0]]
    std[:, 0, 0] = v00
    for j in range(1, d):
        std[:, j, 0] = combine(variance[grid[0, j]], linked(row_links[j], v00))
    if finals > 1:  # every (i >= 1, j) at once, as linked() would give each
        links, weight = column_links[1:].T, layout.column_link_weight  # (d, F - 1) [j, i - 1]
        with np.errstate(invalid="ignore"):
            through = np.where(links[None] >= 0, variance[np.maximum(links, 0)].transpose(2, 0, 1) / weight**2
                               + std[:, :, 0][:, :, None], np.inf)
        std[:, :, 1:] = combine(variance[grid[1:].T].transpose(2, 0, 1), through)
    return M, np.sqrt(std)


def combine_labels(layout, labels: np.ndarray, sigma: np.ndarray):
    """Weighted mean of ``l_h[j]`` over grid column j and its column links, and its standard deviation."""
    H = labels.shape[1]
    columns, measures = label_columns(layout)
    weights = inverse_variance_weights(sigma) * measures[:, None]
    total = np.zeros((H, layout.d))
    weight = np.zeros((H, layout.d))
    np.add.at(total.T, columns, weights * np.where(weights > 0, labels, 0.0))
    np.add.at(weight.T, columns, weights)
    weight = np.maximum(weight, 1e-300)
    return total / weight, 1.0 / np.sqrt(weight)


def tightest_enclosures(layout, m: np.ndarray, labels: np.ndarray):
    """Balls: for each ``M_h[j, i]`` and ``l_h[j]`` the tightest of its enclosures.

    ``M[j, 0]`` (j >= 1) is grid (0, j) or row link j minus ``M[0, 0]``; ``M[j, i]`` (i >= 1) is
    grid (i, j) or column link (i, j) divided by its weight w minus ``M[j, 0]``; ``l[j]`` is any
    grid or column link instance of column j (links the schedule did not ask are skipped). Each
    candidate encloses the truth when its instance is certified, so the choice keeps the
    certificate and discards ill-conditioned instances. Returns ``M`` (H, d, F) and ``l`` (H, d) of
    balls, and no standard deviations (the radii are the error).
    """
    d, finals, weight = layout.d, layout.grid_index.shape[0], layout.column_link_weight
    H = m.shape[1]
    grid, row_links, column_links = layout.grid_index, layout.row_link_index, layout.column_link_index

    def tightest(*candidates):
        return min(candidates, key=lambda ball: float(ball.rad()))

    M = np.empty((H, d, finals), dtype=object)
    l = np.empty((H, d), dtype=object)
    for h in range(H):
        M[h, 0, 0] = m[grid[0, 0], h]
        for j in range(1, d):
            link = [m[row_links[j], h] - M[h, 0, 0]] if row_links[j] >= 0 else []
            M[h, j, 0] = tightest(m[grid[0, j], h], *link)
        for j in range(d):
            for i in range(1, finals):
                link = [] if column_links[i, j] < 0 else [
                    (m[column_links[i, j], h] if weight == 1 else m[column_links[i, j], h] / weight) - M[h, j, 0]]
                M[h, j, i] = tightest(m[grid[i, j], h], *link)
            links = column_links[1:, j][column_links[1:, j] >= 0]
            l[h, j] = tightest(*labels[grid[:, j], h], *labels[links, h])
    return M, l, None, None
