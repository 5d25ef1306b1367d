"""The query schedule of ALGORITHM.md section 4 (the paper's count, ``4 H0 d^2 - 2 H0 + 1``).

An *instance* fixes a final token ``x`` and a difference ``z`` and asks the sequences
``X_k = (y, ..., y, x)`` with ``k`` copies of ``y = x - z``. Its answers sample

    F(k) = c + sum_h rho_h / (k + tau_h),   tau_h = exp(z^T W_h x),  rho_h = tau_h v_h^T z.

The grid instance ``(i, j)`` has final token ``x_i`` and difference ``z_j`` (poles
``M_h[j, i] = z_j^T W_h x_i``). Links join grid instances through sums of tokens:

* row link ``j >= 1``: final ``x_0``, difference ``z_0 + z_j``; poles ``M_h[0,0] + M_h[j,0]``.
* column link ``(i, j)``, ``i >= 1``: final ``x_0 + x_i``, difference ``z_j``; poles
  ``M_h[j,0] + M_h[j,i]``, labels equal to those of grid ``(0, j)``.

(Indices are 0-based here; ALGORITHM.md counts from 1.) Instance ``(0, 0)`` asks
``k = 0..2 H0`` (``2 H0 + 1`` queries); every other instance gets ``F(0)`` from the anchors
(section 3) and asks ``k = 1..2 H0``. With ``d^2`` grid instances and ``d^2 - 1`` links:

    (2 H0 + 1) + 2 H0 (2 d^2 - 2) = 4 H0 d^2 - 2 H0 + 1   queries, the longest of length 2 H0 + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Query vectors are rounded to this many significant bits, so that every sum and difference
#: the schedule forms (``x - z``, ``x_0 + x_i``, ``z_0 + z_j``) is exact in float64 and the
#: learner knows exactly which tokens the oracle saw, in any precision.
TOKEN_BITS = 40


@dataclass(frozen=True)
class Instance:
    """One copies-instance: ``k`` copies of ``y = final - difference``, then ``final``.

    ``role`` is ``"grid"``, ``"row_link"`` or ``"column_link"``; ``(i, j)`` are grid indices
    (row link ``j`` has ``i = 0``). ``ks`` are the copy counts actually queried.
    """

    role: str
    i: int
    j: int
    final: np.ndarray
    difference: np.ndarray
    ks: tuple[int, ...]

    def sequence(self, k: int) -> np.ndarray:
        """The query ``(y, ..., y, x)`` with ``k`` copies of ``y``: shape (k + 1, d)."""
        repeated = self.final - self.difference
        return np.vstack([np.tile(repeated, (k, 1)), self.final[None, :]])


def random_basis(rng: np.random.Generator, d: int, scale: float) -> np.ndarray:
    """A random orthogonal matrix (Haar) times ``scale``, rounded to ``TOKEN_BITS`` bits."""
    gaussian = rng.standard_normal((d, d))
    q, r = np.linalg.qr(gaussian)
    q = q * np.sign(np.diag(r))  # makes the distribution Haar
    return quantize(scale * q, scale)


def quantize(values: np.ndarray, scale: float) -> np.ndarray:
    """Round to multiples of ``2**(e - TOKEN_BITS)`` where ``2**e >= scale``: exact sums stay exact."""
    step = 2.0 ** (np.ceil(np.log2(scale)) + 2 - TOKEN_BITS)
    return np.round(values / step) * step


class PaperSchedule:
    """The exact-count schedule of the paper (ALGORITHM.md section 4).

    Parameters
    ----------
    d : token dimension.
    max_poles : H0, the number of heads (or the bound) the schedule is sized for.
    seed : seeds the random bases (same seed, same queries).
    token_scale : norm of every ``x_i`` and ``z_j``; default ``d ** 0.25``, which puts the pole
        logs ``z^T W x`` at order one for W with N(0, 1/d) entries.
    samples_per_instance : K, the copy counts ``k = 0..K-1`` each instance is sampled at (the
        first instance asks all K, every other one ``k = 1..K-1``). Default ``2 H0 + 1``, the
        paper's exact count; a larger K oversamples (the kernels then fit by least squares) and
        costs ``K + (K - 1)(2 d^2 - 2)`` queries of length at most K.

    Attributes
    ----------
    X, Z : (d, d) arrays whose columns are the final tokens ``x_i`` and differences ``z_j``.
    instances : list of :class:`Instance`, in query order.
    grid_index : (d, d) int array, instance index of grid ``(i, j)``.
    row_link_index : (d,) int array, instance index of row link ``j`` (-1 for ``j = 0``).
    column_link_index : (d, d) int array, instance index of column link ``(i, j)`` (-1 for ``i = 0``).
    ks : (K,) the copy counts ``0..K-1`` every instance's samples are indexed by (K = 2 H0 + 1
        unless oversampled).
    """

    name = "paper"

    def __init__(self, d: int, max_poles: int, seed=None, token_scale: float | None = None,
                 samples_per_instance: int | None = None):
        self.d = int(d)
        self.max_poles = int(max_poles)
        exact = 2 * self.max_poles + 1
        K = exact if samples_per_instance is None else samples_per_instance
        if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < exact:
            raise ValueError(f"samples_per_instance must be an integer >= 2 H0 + 1 = {exact}, got {samples_per_instance!r}")
        self.samples_per_instance = int(K)
        self.token_scale = float(token_scale) if token_scale is not None else self.d ** 0.25
        if not np.isfinite(self.token_scale) or self.token_scale <= 0:
            raise ValueError(f"token_scale must be a positive number, got {token_scale}")
        rng = np.random.default_rng(seed)
        self.X = random_basis(rng, self.d, self.token_scale)
        self.Z = random_basis(rng, self.d, self.token_scale)
        self.ks = np.arange(self.samples_per_instance)
        self.instances: list[Instance] = []
        self.grid_index = np.full((self.d, self.d), -1)
        self.row_link_index = np.full(self.d, -1)
        self.column_link_index = np.full((self.d, self.d), -1)
        self._build()

    #: Instances after row 0 know F(0) only (paper) or both anchors F(0) and c (lean).
    both_anchors = False

    def _add(self, role: str, i: int, j: int, final, difference, first_k: int, last_k: int | None = None) -> int:
        last = self.samples_per_instance - 1 if last_k is None else last_k
        self.instances.append(Instance(role, i, j, final, difference, tuple(range(first_k, last + 1))))
        return len(self.instances) - 1

    def _build(self) -> None:
        x, z = self.X.T, self.Z.T  # rows are the tokens
        # 1. instance (0, 0): k = 0..2H0; its one-token query gives vbar^T x_0.
        self.grid_index[0, 0] = self._add("grid", 0, 0, x[0], z[0], 0)
        # 2. row 0: F(0) = vbar^T x_0 is known; each instance then gives vbar^T z_j.
        for j in range(1, self.d):
            self.grid_index[0, j] = self._add("grid", 0, j, x[0], z[j], 1)
        # 3. everything else (vbar known on R^d): row links, grid rows 1.., column links.
        for j in range(1, self.d):
            self.row_link_index[j] = self._add("row_link", 0, j, x[0], z[0] + z[j], 1)
        for i in range(1, self.d):
            for j in range(self.d):
                self.grid_index[i, j] = self._add("grid", i, j, x[i], z[j], 1)
        for i in range(1, self.d):
            for j in range(self.d):
                self.column_link_index[i, j] = self._add("column_link", i, j, x[0] + x[i], z[j], 1)

    @property
    def oversampled(self) -> bool:
        return self.samples_per_instance > 2 * self.max_poles + 1

    @property
    def promised_queries(self) -> int:
        """The paper's count ``4 H0 d^2 - 2 H0 + 1``, or ``K + (K - 1)(2 d^2 - 2)`` when oversampled
        (for comparison; runs report measured counts)."""
        K = self.samples_per_instance
        return K + (K - 1) * (2 * self.d**2 - 2)

    @property
    def promised_max_length(self) -> int:
        return self.samples_per_instance

    def queries(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """All queries in order: (sequences, instance index of each, copy count k of each)."""
        return self.instance_queries(range(len(self.instances)))

    def instance_queries(self, indices) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Queries of the given instances: (sequences, instance index of each, copy count k)."""
        sequences, owners, copies = [], [], []
        for index in indices:
            for k in self.instances[index].ks:
                sequences.append(self.instances[index].sequence(k))
                owners.append(index)
                copies.append(k)
        return sequences, np.array(owners, dtype=int), np.array(copies, dtype=int)


class LeanSchedule(PaperSchedule):
    """The lean schedule of ALGORITHM.md section 6 (``extract(..., schedule="lean")``).

    Row 0 is asked as in the paper (``vbar`` becomes known on R^d). Every later instance then
    knows both anchors, ``F(0) = vbar^T x`` and ``c = vbar^T y``, so ``k = 1..2 H0 - 1`` suffice
    (``2 H0 - 1`` queries). Heads are matched inside each column by their residue labels
    ``l_h = v_h^T z_j``, which do not depend on the final token: only the ``d - 1`` row links
    remain (none for ``H0 = 1``, where nothing needs matching). Where two labels of a column are
    too close to match, the learner adds that instance's column link (:meth:`add_column_link`).

    Queries without fallback links::

        H0 = 1:   3 + 2 (d - 1) + d (d - 1)                                  = d^2 + d + 1
        H0 >= 2:  (2 H0 + 1) + 2 H0 (d - 1) + (2 H0 - 1)(d - 1) + (2 H0 - 1) d (d - 1)
                = (2 H0 + 1) + 2 H0 (d - 1) + (2 H0 - 1)(d^2 - 1)

    plus ``2 H0 - 1`` per fallback column link. The information lower bound is the number of
    parameters, ``H (d^2 + d)``.
    """

    name = "lean"
    both_anchors = True

    def __init__(self, d: int, max_poles: int, seed=None, token_scale: float | None = None,
                 samples_per_instance: int | None = None):
        if samples_per_instance is not None and samples_per_instance != 2 * int(max_poles) + 1:
            raise ValueError("samples_per_instance (oversampling) is a feature of the paper schedule; "
                             "the lean schedule asks the fewest samples per instance by design")
        super().__init__(d, max_poles, seed=seed, token_scale=token_scale)

    def _build(self) -> None:
        x, z = self.X.T, self.Z.T
        H0, last = self.max_poles, 2 * self.max_poles - 1
        self.grid_index[0, 0] = self._add("grid", 0, 0, x[0], z[0], 0)
        for j in range(1, self.d):
            self.grid_index[0, j] = self._add("grid", 0, j, x[0], z[j], 1)
        if H0 >= 2:
            for j in range(1, self.d):
                self.row_link_index[j] = self._add("row_link", 0, j, x[0], z[0] + z[j], 1, last)
        for i in range(1, self.d):
            for j in range(self.d):
                self.grid_index[i, j] = self._add("grid", i, j, x[i], z[j], 1, last)

    def add_column_link(self, i: int, j: int) -> int:
        """Add the fallback column link ``(i, j)`` (final ``x_0 + x_i``, difference ``z_j``)."""
        if self.column_link_index[i, j] >= 0:
            raise ValueError(f"column link ({i}, {j}) is already scheduled")
        x, z = self.X.T, self.Z.T
        index = self._add("column_link", i, j, x[0] + x[i], z[j], 1, 2 * self.max_poles - 1)
        self.column_link_index[i, j] = index
        return index

    @property
    def promised_queries(self) -> int:
        """The lean count without fallback links (for comparison; runs report measured counts)."""
        d, H0 = self.d, self.max_poles
        if H0 == 1:
            return d * d + d + 1
        return (2 * H0 + 1) + 2 * H0 * (d - 1) + (2 * H0 - 1) * (d * d - 1)
