"""Step 2 of the Transformer extraction: the hidden ReLU units, read through known attention.

With the canonical heads ``W_h`` known (step 1), every query ``X`` has known head means
``m_h(X) = sum_i a_{h,i} x_i``. Stack them, ``M(X) = (m_1(X), ..., m_H(X))`` in R^D, D = H d.
Then (docs/algorithm.md, 'The one-layer Transformer')

    f(X) = phi(M(X)),     phi(M) = sum_j w_j ReLU(P_j^T M),     P_j = (p_{1,j}, ..., p_{H,j}),

a bias-free ReLU layer on R^D: positively homogeneous, piecewise linear, with one hyperplane
``P_j^T M = 0`` per unit. In a linear region S of phi, ``f(X) = L_S^T M(X)`` exactly, with
``L_S = sum_{j active} w_j P_j``.

**Segments (exact lines in M-space).** Fix x in R^d, offsets e_1..e_m (m = H) and scale lam:
the sequence ``X = (lam x + e_1 / lam, ..., lam x + e_m / lam, lam x)`` has scores relative to the
final token ``e_i^T W_h x``, independent of lam, so its attention weights do not move, and
``M(X) = lam (b + E / lam^2)`` with ``b = (x, ..., x)`` and ``E_h = sum_i a_{h,i} e_i``. By
homogeneity ``f(X) / lam = phi(b + rho E)``, ``rho = lam^-2``. Reparametrised by
``s = rho kappa^-1 / (1 + rho kappa^-1)`` (kappa = |b| / |E|),

    h(s) = (1 - s) f(X) / lam = phi((1 - s) b + s kappa E),   s in (0, 1),

is phi along the segment from b to kappa E: exactly piecewise linear, with a kink where the
segment crosses a unit's hyperplane. Kinks are found on a grid of s and confirmed where two
linear pieces meet (two extra queries beside the intersection).

**Region gradients.** Around a point inside a piece, D + 4 perturbed sequences stay in the same
region; ``f = L^T M`` there is a linear system for ``L`` (exact, no differencing), checked on the
spare equations. Across a confirmed single kink, ``L_B - L_A = +- w_j P_j``: one unit, up to
its orientation, with ``sign(w_j)`` the sign of the slope jump of h.

**Orientation.** ``ReLU(u) - ReLU(-u) = u``: flipping a unit's orientation changes f by a
linear function, so the orientations are fixed by the odd part, ``sum_j w_j P_j = V`` with V
the step-1 value vectors: a sign vector sigma with ``sum_j sigma_j c_j = V``. Solved by
enumerating the signs of the units outside a basis of span{c_j} (2^(n - rank) candidates).

**Conditions** (each violation is detected and reported):

1. every canonical head has ``v_h = sum_j w_j p_{h,j} != 0`` (else step 1 cannot see it; the
   region fits then fail, f is not a function of the visible M);
2. no two units have parallel hyperplanes (``P_j`` and ``P_k`` not proportional: positively
   proportional units merge in the canonical form, opposite ones make f locally ``|u|``, which the
   orientation step cannot explain);
3. orientation is unique: no nonempty set of units has ``sum_j +- c_j = 0`` (general position);
4. every unit's hyperplane crosses the reachable segments (else the unit is never seen: the
   orientation step or the final verification fails), and ``n - rank{c_j} <= 20``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flint import arb, arb_mat

from ..numerics.highprec import GUARD_BITS, magnitude_float, mid_float, working_precision
from ..models.attention import MultiHeadAttention
from ..oracle.boundary import OracleBoundary

#: Ends of the segment parameter s (the scale lam ranges over sqrt((1 - s) / s) / kappa).
S_RANGE = (0.02, 0.98)
#: Extra equations per region fit beyond the D unknowns: they check the region was not left.
SPARE_EQUATIONS = 4
#: Crowded gaps (several kinks within a grid cell or two) are rescanned this many levels deep,
#: each on a grid of ZOOM_GRID intervals.
MAX_ZOOM = 4
ZOOM_GRID = 16
#: Two region fits' unit vectors within this relative distance (up to sign) are one unit. The fits
#: amplify step 1's errors (one unit can be met twice at ~1e-5 apart), while distinct units of the
#: random targets sit 0.86 and more apart; units closer than 1e-3 would be near-parallel hyperplanes (condition 2) anyway.
SAME_UNIT = 1e-3
#: Unit counts beyond the rank of the unit vectors whose orientations are enumerated.
MAX_ENUMERATED = 20
#: Random sequences asked for the float64 polish, per dimension of M (:meth:`UnitLearner.ask_spread`).
SPREAD_PER_DIMENSION = 8
#: What those queries are called at the boundary (and counted as: ``UnitSearch.queries_spread``).
SPREAD_ROWS = "random rows for the polish"


class HeadMeans:
    """``M(X)`` in R^D for the heads found in step 1 (float64, or arb balls at ``precision``):
    ``D = H d``, or ``H d + d`` with the residual, whose final token x_N is one more block."""

    def __init__(self, W: np.ndarray, precision: int | None, residual: bool = False):
        self.heads_model = MultiHeadAttention(W, np.zeros(W.shape[:2], dtype=W.dtype))
        self.precision = precision
        self.residual = bool(residual)
        self.D = (W.shape[0] + self.residual) * W.shape[1]

    def __call__(self, sequences) -> np.ndarray:
        means = self.heads_model.head_means(sequences, self.precision).reshape(len(sequences), -1)
        if not self.residual:
            return means
        if self.precision is None:
            return self.float64(sequences)
        with working_precision(self.precision + GUARD_BITS):
            finals = np.array([[arb(float(value)) for value in X[-1]] for X in sequences], dtype=object)
        return np.concatenate([means, finals.reshape(len(sequences), -1)], axis=1)

    def float64(self, sequences) -> np.ndarray:
        """float64 means of a list of sequences or of one (B, N, d) array (no per-sequence work)."""
        means = self.heads_model.head_means(sequences).reshape(len(sequences), -1)
        if not self.residual:
            return means
        if isinstance(sequences, np.ndarray):
            finals = sequences[:, -1, :].astype(np.float64)
        else:
            finals = np.array([np.asarray(X[-1], dtype=np.float64) for X in sequences]).reshape(len(sequences), -1)
        return np.concatenate([means, finals], axis=1)


@dataclass
class Segment:
    """phi along ``(1 - s) b + s kappa E``; see the module docstring."""

    x: np.ndarray
    offsets: np.ndarray  # (m, d): the e_i
    b: np.ndarray
    E: np.ndarray
    kappa: float

    def scale(self, s: float) -> float:
        rho = s * self.kappa / (1 - s)
        return rho ** -0.5

    def sequence(self, s: float) -> np.ndarray:
        return self.sequences(np.array([s]))[0]

    def sequences(self, ss: np.ndarray) -> np.ndarray:
        """The sequences at every s of ``ss``, one (len(ss), m + 1, d) array."""
        lam = np.array([self.scale(s) for s in ss])[:, None, None]
        out = np.empty((len(lam), len(self.offsets) + 1, len(self.x)))
        out[:, :-1] = lam * self.x + self.offsets / lam
        out[:, -1] = lam[:, :, 0] * self.x
        return out

    def point(self, s: float) -> np.ndarray:
        return (1 - s) * self.b + s * self.kappa * self.E

    def crossing(self, C: np.ndarray) -> np.ndarray:
        """s where each hyperplane ``c^T M = 0`` (rows of C) crosses the segment (nan where it does not)."""
        cb, cE = C @ self.b, self.kappa * (C @ self.E)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(cb != cE, cb / (cb - cE), np.nan)
        return np.where((s > 0) & (s < 1), s, np.nan)


@dataclass
class Unit:
    """One unit, up to orientation: ``c = +- w_j P_j`` (float64 and exact), ``sign = sign(w_j)``."""

    c: np.ndarray
    c_exact: np.ndarray
    sign: int
    fit_residual: float
    segment: "Segment"
    s: float


@dataclass
class UnitSearch:
    """What step 2 found and what it cost (counts measured at the f oracle boundary)."""

    units: list[Unit] = field(default_factory=list)
    segments: int = 0
    queries_grid: int = 0
    queries_confirm: int = 0
    queries_regions: int = 0
    #: random sequences asked only for the polish (:meth:`UnitLearner.ask_spread`, float64)
    queries_spread: int = 0
    regions_fitted: int = 0
    regions_failed: int = 0
    kinks_confirmed: int = 0
    kinks_rejected: int = 0


def random_sequences(rng, count: int, d: int, longest: int, scale: float) -> list[np.ndarray]:
    """``count`` random sequences of lengths 1..``longest``, random token directions and norms
    ``scale x 10^U(-0.5, 0.5)`` (a decade): what the polish's random rows
    (:meth:`UnitLearner.ask_spread`) and the verification queries ask."""
    sequences = []
    for _ in range(count):
        length = int(rng.integers(1, longest + 1))
        norms = scale * 10 ** rng.uniform(-0.5, 0.5, size=(length, 1))
        tokens = rng.standard_normal((length, d))
        sequences.append(norms * tokens / np.linalg.norm(tokens, axis=1, keepdims=True))
    return sequences


def _value(answers, precision):
    return answers if precision is None else mid_float(answers)


class UnitLearner:
    """Finds the units of phi from segments and region gradients (module docstring).

    Parameters
    ----------
    boundary : the f oracle boundary (counts every query).
    W : canonical heads from step 1 (float64, or mpf for high precision).
    precision : None or bits.
    rng : numpy Generator for segment tokens and perturbations.
    token_scale : norm of x and of the offsets e_i.
    grid : number of grid intervals per segment.
    """

    def __init__(self, boundary: OracleBoundary, W: np.ndarray, precision, rng, token_scale: float, grid: int = 48,
                 residual: bool = False):
        self.boundary = boundary
        self.means = HeadMeans(W, precision, residual)
        self.H, self.d = W.shape[0], W.shape[1]
        self.D = self.means.D
        self.precision = precision
        self.rng = rng
        self.token_scale = token_scale
        self.grid = int(grid)
        self.search = UnitSearch()
        # Per batch asked: the float64 head means M of its sequences and the (float64) answers, for refine().
        self.asked_means: list[np.ndarray] = []
        self.answered: list[np.ndarray] = []
        self._stacked = None  # _unit_vectors' cache
        self.fit_tolerance = 1e-9 if precision is None else 2.0 ** (-precision / 3)
        self.kink_tolerance = 1e-9  # linearity of h on the grid, relative (float64 midpoints)

    # ------------------------------------------------------------------ segments
    def segment_pair(self) -> list[Segment]:
        """Two segments from one final direction x: offsets e and -e (together they cross most
        hyperplanes: with equal weights, ``E(-e) = -E(e)``, and every hyperplane separates b from
        exactly one of E, -E)."""
        x = self._random_token()
        offsets = np.stack([self._random_token() for _ in range(self.H)])
        out = []
        for sign in (1.0, -1.0):
            e = sign * offsets
            unit_scale = np.vstack([x + e, x[None, :]])  # lam = 1
            M = self.means.float64([unit_scale])[0]
            b = np.tile(x, self.D // self.d)  # with the residual, x_N = lam x is one more block of b
            E = M - b
            kappa = float(np.linalg.norm(b) / max(np.linalg.norm(E), 1e-300))
            out.append(Segment(x, e, b, E, kappa))
        return out

    def _random_token(self) -> np.ndarray:
        # Random direction and a norm in [0.5, 1.5] x token_scale (directions alone are only +-1 for d = 1).
        v = self.rng.standard_normal(self.d)
        return self.token_scale * self.rng.uniform(0.5, 1.5) * v / np.linalg.norm(v)

    def _ask(self, sequences, what: str):
        """Answers for the (B, m + 1, d) array ``sequences`` (or a list of sequences; handed to the
        boundary as a list, like every batch). In float64 the sequences' head means M are kept with
        the answers, for the region fits and refine()."""
        before = self.boundary.queries
        answers = self.boundary.ask(list(sequences), description=f"FFN units: {what}")
        if self.precision is None:
            self.asked_means.append(self.means.float64(sequences))
            self.answered.append(answers)
        spent = self.boundary.queries - before
        if what == "segment grid":
            self.search.queries_grid += spent
        elif what == "kink confirmation":
            self.search.queries_confirm += spent
        elif what == SPREAD_ROWS:
            self.search.queries_spread += spent
        else:
            self.search.queries_regions += spent
        return answers

    def explore(self, segment: Segment) -> int:
        """Sample one segment, confirm its single kinks, fit the regions beside kinks no known unit
        explains, and add the new units. Returns how many were new."""
        self.search.segments += 1
        needed = [kink for kink in self._scan(segment, *S_RANGE, depth=0) if not self._explained(segment, kink[0])]
        if not needed:
            return 0
        centres = []
        for s_star, left, right, _ in needed:
            centres += [(left, s_star - left), (right, right - s_star)]
        gradients = self._region_gradients(segment, centres)
        new = 0
        for k, (s_star, _, _, jump) in enumerate(needed):
            LA, LB = gradients[2 * k], gradients[2 * k + 1]
            if LA is None or LB is None:
                continue
            c_float = LB[0] - LA[0]
            # The fits against the grid's lines: the hyperplane passes through the kink and the
            # slope jump of h is c^T (kappa E - b).
            at_kink = abs(c_float @ segment.point(s_star)) / (np.linalg.norm(c_float) * np.linalg.norm(segment.point(s_star)))
            along = c_float @ (segment.kappa * segment.E - segment.b)
            if at_kink > 1e-6 or abs(along - jump) > 1e-6 * abs(jump):
                self.search.regions_failed += 1
                continue
            if self._known(c_float) is not None:
                continue
            c_exact = self._difference(LB[1], LA[1])
            self.search.units.append(Unit(c_float, c_exact, 1 if jump > 0 else -1, max(LA[2], LB[2]), segment, s_star))
            new += 1
        return new

    def _scan(self, segment: Segment, lo: float, hi: float, depth: int) -> list:
        """Confirmed single kinks of h on [lo, hi]: ``(s*, left centre, right centre, slope jump)``.

        A grid of ``self.grid`` intervals; consecutive linear pieces one cell apart meet at a
        candidate s*, confirmed by probes (below). Gaps wider than a cell, or candidates that fail,
        hold several kinks: they are rescanned on a finer grid (up to ``MAX_ZOOM`` times)."""
        ss = np.linspace(lo, hi, (self.grid if depth == 0 else ZOOM_GRID) + 1)
        h = self._h(segment, ss, "segment grid")
        scale = max(np.abs(h).max(), 1e-300)
        pieces = _linear_pieces(ss, h, self.kink_tolerance * scale)
        candidates, crowded = [], []
        for A, B in zip(pieces[:-1], pieces[1:]):
            s_star = (B.intercept - A.intercept) / (A.slope - B.slope) if A.slope != B.slope else np.nan
            # One grid cell between the pieces (a grid point inside the gap means two kinks).
            if B.first == A.last + 1 and ss[A.last] < s_star < ss[B.first]:
                candidates.append((A, B, s_star, 0.3 * min(s_star - ss[A.last], ss[B.first] - s_star)))
            else:
                crowded.append((A, B))
        # A single kink at s*: h is on line A left of s* and on line B right of it. Two probes a
        # side, at eta and eta / 1000: two kinks (whose outer lines meet at s*) would both have to
        # lie within eta / 1000 of s* to pass.
        offsets = np.array([-1.0, -1e-3, 1e-3, 1.0])
        kinks = []
        if candidates:
            probes = np.array([c[2] + offsets * c[3] for c in candidates]).ravel()
            values = self._h(segment, probes, "kink confirmation").reshape(-1, 4)
            for (A, B, s_star, eta), value in zip(candidates, values):
                expected = [A(s_star - eta), A(s_star - 1e-3 * eta), B(s_star + 1e-3 * eta), B(s_star + eta)]
                if np.abs(value - expected).max() > 1e-9 * scale:
                    self.search.kinks_rejected += 1
                    crowded.append((A, B))
                    continue
                self.search.kinks_confirmed += 1
                # Region centres halfway between the kink and the next grid point inside each piece
                # (close to the kink, so a faint kink the grid missed is unlikely to lie between).
                left, right = 0.5 * (s_star + ss[A.last - 1]), 0.5 * (s_star + ss[B.first + 1])
                kinks.append((s_star, left, right, B.slope - A.slope))
        if depth < MAX_ZOOM:
            for A, B in crowded:
                kinks += self._scan(segment, ss[A.last - 1], ss[B.first + 1], depth + 1)
        return kinks

    def _h(self, segment: Segment, ss: np.ndarray, what: str) -> np.ndarray:
        f = _value(self._ask(segment.sequences(ss), what), self.precision)
        scales = np.array([segment.scale(s) for s in ss])
        return (1 - ss) * f / scales

    def _unit_vectors(self) -> np.ndarray:
        """The c of the units found so far, one (n, D) array (rebuilt when a unit is added)."""
        units = self.search.units
        if self._stacked is None or len(self._stacked) != len(units):
            self._stacked = np.array([unit.c for unit in units]).reshape(len(units), self.D)
        return self._stacked

    def _explained(self, segment: Segment, s_star: float) -> bool:
        """Whether a known unit's hyperplane crosses the segment within 1e-6 of s* (Segment.crossing)."""
        return bool(np.any(np.abs(segment.crossing(self._unit_vectors()) - s_star) <= 1e-6))

    def _known(self, c: np.ndarray):
        """Index of the first known unit equal to c up to sign (relative ``SAME_UNIT``), or None."""
        C = self._unit_vectors()
        distance = np.minimum(np.linalg.norm(c - C, axis=1), np.linalg.norm(c + C, axis=1))
        close = distance <= SAME_UNIT * np.linalg.norm(C, axis=1)
        hits = np.flatnonzero(close)
        return int(hits[0]) if len(hits) else None

    # ------------------------------------------------------------------ region gradients
    def _region_gradients(self, segment: Segment, centres) -> list:
        """``L`` of the region around each ``(s, room)`` of the segment: solve ``f(X_r) = L^T M(X_r)``
        for D + spare sequences perturbed around the segment's sequence at s (relative size a
        tenth of ``room``, the distance to the kink); shrink tenfold when the spares disagree."""
        out = [None] * len(centres)
        pending = list(range(len(centres)))
        size = 0.1
        for attempt in range(3):
            if not pending:
                break
            rows = self.D + SPARE_EQUATIONS
            clouds = []
            for k in pending:
                s, room = centres[k]
                centre = segment.sequence(s)
                rms = np.sqrt(np.mean(centre**2))
                clouds.append(centre + size * room * rms * self.rng.standard_normal((rows,) + centre.shape))
            flat = np.concatenate(clouds)
            answers = self._ask(flat, "region gradients")
            M = self.asked_means[-1] if self.precision is None else self.means(flat)
            retry = []
            fits = self._solve_all(M.reshape(len(pending), rows, -1), answers.reshape(len(pending), rows))
            for k, fit in zip(pending, fits):
                self.search.regions_fitted += 1
                if fit is None or fit[2] > self.fit_tolerance:
                    self.search.regions_failed += 1
                    retry.append(k)
                else:
                    out[k] = fit
            pending = retry
            size *= 0.1
        return out

    def _solve_all(self, M, f) -> list:
        """:meth:`_solve` for each of a stack of systems (K, rows, D); in float64 as one batched solve."""
        D = self.D
        if self.precision is not None:
            return [self._solve(Mk, fk) for Mk, fk in zip(M, f)]
        try:
            L = np.linalg.solve(M[:, :D], f[:, :D, None])[:, :, 0]
        except np.linalg.LinAlgError:  # one is singular: which one, system by system
            return [self._solve(Mk, fk) for Mk, fk in zip(M, f)]
        spare = np.abs(np.einsum("krd,kd->kr", M[:, D:], L) - f[:, D:]).max(axis=1)
        spare /= np.maximum(np.abs(f).max(axis=1), 1e-300)
        return [(Lk, Lk, float(misfit)) for Lk, misfit in zip(L, spare)]

    def _solve(self, M, f):
        """(L float64, L exact, relative misfit of the spare equations) or None if singular."""
        D = self.D
        if self.precision is None:
            try:
                L = np.linalg.solve(M[:D], f[:D])
            except np.linalg.LinAlgError:
                return None
            spare = np.abs(M[D:] @ L - f[D:]).max() / max(np.abs(f).max(), 1e-300)
            return L, L, float(spare)
        with working_precision(self.precision + GUARD_BITS):
            system = arb_mat([[M[r, c] for c in range(D)] for r in range(D)])
            rhs = arb_mat([[f[r]] for r in range(D)])
            try:
                solution = system.solve(rhs)
            except ZeroDivisionError:
                return None
            L = np.array([solution[c, 0] for c in range(D)], dtype=object)
            misfit = [sum((M[r, c] * L[c] for c in range(D)), arb(0)) - f[r] for r in range(D, M.shape[0])]
            scale = max(float(magnitude_float(np.array(list(f), dtype=object)).max()), 1e-300)
            spare = float(magnitude_float(np.array(misfit, dtype=object)).max()) / scale
        return mid_float(L), L, spare

    def _difference(self, a, b):
        if self.precision is None:
            return a - b
        with working_precision(self.precision + GUARD_BITS):
            return np.array([x - y for x, y in zip(a, b)], dtype=object)

    def ask_spread(self, count: int) -> None:
        """Ask ``count`` random sequences (lengths 1 .. 2H + 1, token norms over a decade around the
        token scale) whose head means M, with their answers, join the polish's rows (float64).

        The segments and the region clouds explore M-space along lines ``(1 - s) b + s kappa E``
        near ``b = (x, .., x)``: together their rows are anisotropic (their smallest singular value
        far below random sequences'), so the least-squares polish would fix the units along the heads'
        differences only loosely, and amplify step 1's rounding there (docs/transformer.md, "float64
        polish"). Random sequences see every direction of M alike."""
        if self.precision is not None or count <= 0:
            return
        self._ask(random_sequences(self.rng, count, self.d, 2 * self.H + 1, self.token_scale), SPREAD_ROWS)

    def answers(self) -> tuple[np.ndarray, np.ndarray]:
        """The float64 head means M of every sequence step 2 asked, with its answer (float64 midpoints)."""
        if not self.answered:
            return np.zeros((0, self.D)), np.zeros(0)
        return np.concatenate(self.asked_means), np.concatenate(self.answered)




@dataclass
class _Piece:
    first: int
    last: int
    slope: float
    intercept: float

    def __call__(self, s):
        return self.intercept + self.slope * s


def _linear_pieces(ss: np.ndarray, h: np.ndarray, tolerance: float) -> list[_Piece]:
    """Maximal runs of >= 3 grid points on one line (second differences below ``tolerance``)."""
    second = np.abs(h[:-2] - 2 * h[1:-1] + h[2:])
    flat = second <= tolerance  # flat[i]: points i, i+1, i+2 collinear
    pieces = []
    i = 0
    while i < len(flat):
        if not flat[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(flat) and flat[j + 1]:
            j += 1
        first, last = i, j + 2
        slope, intercept = np.polyfit(ss[first:last + 1], h[first:last + 1], 1)
        pieces.append(_Piece(first, last, float(slope), float(intercept)))
        i = j + 1
    return pieces


def refine(C: np.ndarray, signs: np.ndarray, M: np.ndarray, f: np.ndarray, margin: float = 1e-6,
           rounds: int = 4) -> tuple[np.ndarray, float]:
    """Least-squares polish of the oriented units ``c_j`` (rows of C, w_j = signs_j) on every answer.

    With the activation pattern fixed, ``f(X_r) = sum_j signs_j [c_j^T M_r > 0] c_j^T M_r`` is linear
    in the c_j: one linear least-squares problem over all answers (each row weighted by 1/|M_r|),
    re-solved until the pattern stops changing (the same pattern is the same problem). Rows within
    ``margin`` (relative) of a hyperplane are left out, their pattern being uncertain. The region
    fits each use D + 4 nearby sequences; this uses all of them at once, spread over many segments,
    so it is far better conditioned. Solved by :func:`_polish` (normal equations with iterative
    refinement: one Gram product instead of an SVD of the design per round).
    Returns the polished C and the relative misfit of the rows used.
    """
    norms = np.maximum(np.linalg.norm(M, axis=1), 1e-300)
    misfit, pattern = np.inf, None
    for _ in range(rounds):
        u = M @ C.T  # (R, n)
        clear = (np.abs(u) > margin * norms[:, None] * np.linalg.norm(C, axis=1)[None, :]).all(axis=1)
        active = (u > 0)[clear]
        if pattern is not None and np.array_equal(clear, pattern[0]) and np.array_equal(active, pattern[1]):
            break
        pattern = (clear, active)
        rows = M[clear] / norms[clear, None]
        weights = active * signs[None, :]  # (R', n): d f_r / d (c_j^T rows_r)
        target = f[clear] / norms[clear]
        C = _polish(C, rows, weights, target)
        fitted = ((rows @ C.T) * weights).sum(axis=1)
        misfit = float(np.abs(fitted - target).max() / max(np.abs(target).max(), 1e-300))
    return C, misfit


def _polish(C: np.ndarray, rows: np.ndarray, weights: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``argmin_C sum_r (sum_j weights_rj c_j^T rows_r - target_r)^2`` near the start C.

    The design (R x n D, row r is ``weights_r kron rows_r``) is never formed. Its Gram matrix is
    ``sum_r (weights_r weights_r^T) kron (rows_r rows_r^T)``, and rows share few activation
    patterns (a region's cloud, a linear piece of a segment: tens to hundreds of patterns for
    thousands of rows; each random row of :meth:`UnitLearner.ask_spread` has its own), so it is
    ``sum_p (w_p w_p^T) kron S_p`` with ``S_p`` the D x D Gram of the rows of pattern p: one product
    of (n (n + 1) / 2 x P) by (P x D (D + 1) / 2), the pairs j <= k and entries a <= b (both
    symmetric), instead of an R x (n D)^2 one. The
    correction to C solves the normal equations (columns scaled to unit norm, a ridge of 1e-13
    for directions no row sees, one Cholesky factorisation), followed by two rounds of iterative
    refinement on the true residual (semi-normal equations: least-squares accuracy for this
    conditioning at a fraction of an SVD's cost); products with the design and its transpose are
    taken block by block (``(rows @ C^T) * weights`` and ``(weights * residual)^T @ rows``)."""
    from scipy.linalg import cho_factor, cho_solve

    n, D = C.shape
    if n == 0 or len(rows) == 0:
        return C
    # Rows grouped by their pattern of weights (a stable sort on each column: exact, no hashing).
    order = np.lexsort(weights.T[::-1])
    ordered = weights[order]
    starts = np.flatnonzero(np.concatenate([[True], (ordered[1:] != ordered[:-1]).any(axis=1)]))
    bounds = np.append(starts, len(rows))
    patterns = ordered[starts]
    # Both symmetries halve the product each: block (j, k) is block (k, j), and every S_p is
    # symmetric; only the pairs j <= k and the entries a <= b are formed, then spread out.
    pair_j, pair_k = np.triu_indices(n)
    entry_a, entry_b = np.triu_indices(D)
    blocks = np.empty((len(patterns), D, D))
    for p in range(len(patterns)):
        members = rows[order[bounds[p]:bounds[p + 1]]]
        np.matmul(members.T, members, out=blocks[p])
    blocks = blocks.reshape(len(patterns), D * D)[:, entry_a * D + entry_b]
    upper = (patterns[:, pair_j] * patterns[:, pair_k]).T @ blocks  # (pairs, entries)
    pair_of, entry_of = np.empty((n, n), dtype=np.intp), np.empty((D, D), dtype=np.intp)
    pair_of[pair_j, pair_k] = pair_of[pair_k, pair_j] = np.arange(len(pair_j))
    entry_of[entry_a, entry_b] = entry_of[entry_b, entry_a] = np.arange(len(entry_a))
    diagonal = upper[np.diag(pair_of)[:, None], np.diag(entry_of)[None, :]]  # [j, j, a, a]
    columns = np.maximum(np.sqrt(np.maximum(diagonal, 0.0)), 1e-300).ravel()
    scale = 1.0 / columns
    # [j, a, k, b] gathered in that order, then its columns scaled to unit norm in place
    gram = upper[pair_of[:, None, :, None], entry_of[None, :, None, :]].reshape(n * D, n * D)
    gram *= scale[:, None]
    gram *= scale[None, :]
    gram[np.diag_indices_from(gram)] += 1e-13
    factor = cho_factor(gram, overwrite_a=True, check_finite=False)
    x = C.ravel() * columns
    for _ in range(3):
        residual = target - ((rows @ (x / columns).reshape(n, D).T) * weights).sum(axis=1)
        x = x + cho_solve(factor, ((weights * residual[:, None]).T @ rows).ravel() / columns, check_finite=False)
    return (x / columns).reshape(n, D)


# ---------------------------------------------------------------------- orientation
@dataclass
class Orientation:
    """Result of the sign solve ``sum_j sigma_j c_j = V``.

    sigma : (n,) signs of the (unique) solution, or None; solutions : how many sign vectors fit;
    misfit : relative residual of the best candidate; rank : rank of the c_j; free : units outside
    the rank's basis, whose ``2^free`` sign choices are enumerated (none when above ``MAX_ENUMERATED``).
    """

    sigma: np.ndarray | None
    solutions: int
    misfit: float
    rank: int
    free: int = 0

    @property
    def enumerated(self) -> bool:
        """Whether the sign choices were searched at all (``free <= MAX_ENUMERATED``)."""
        return self.free <= MAX_ENUMERATED


def orient(C: np.ndarray, V: np.ndarray, tolerance: float = 1e-6, rank_tolerance: float = 1e-6) -> Orientation:
    """Signs sigma in {-1, +1}^n with ``C^T sigma = V`` (C: (n, D) float64), by enumerating the
    units outside a pivoted-QR basis of span{c_j} and solving for the basis signs.

    ``rank_tolerance`` (relative to the largest pivot) must sit above the errors of the c_j:
    a direction the errors create would otherwise enter the basis and amplify them."""
    from scipy.linalg import qr

    n = C.shape[0]
    scale = max(np.abs(V).max(), np.abs(C).max() if n else 0.0, 1e-300)
    if n == 0:
        misfit = float(np.abs(V).max() / scale)
        return Orientation(np.zeros(0) if misfit <= tolerance else None, int(misfit <= tolerance), misfit, 0)
    _, R, pivots = qr(C.T, pivoting=True, mode="economic")
    diagonal = np.abs(np.diag(R))
    rank = int(np.sum(diagonal > rank_tolerance * diagonal[0])) if diagonal.size else 0
    basis, free = pivots[:rank], pivots[rank:]
    if len(free) > MAX_ENUMERATED:
        return Orientation(None, 0, np.inf, rank, len(free))
    # Free rows and V in the basis: C[free] = K C[basis], V = a^T C[basis] (+ what lies outside the
    # span). Then sigma_B = a - K^T sigma_F must be a sign vector: array work over the 2^f choices.
    coordinates = np.linalg.lstsq(C[basis].T, np.column_stack([V, C[free].T]), rcond=None)[0]  # (rank, 1 + f)
    a, K = coordinates[:, 0], coordinates[:, 1:].T
    # The residual of a choice is r = (rounded - candidates) C_B + (sigma_F C_F' - V') exactly, with
    # C_F' = C_F - K C_B and V' = V - a^T C_B (what lies outside the span; small). Since
    # |r|_inf >= s_min(C_B) |rounded - candidates|_2 / sqrt(D) - |sigma_F C_F' - V'|_inf, most
    # choices are ruled out on the rank coordinates alone. A first pass takes that lower bound for
    # every choice; the choice with the smallest is evaluated, then every choice whose bound could
    # pass or beat the best so far: good and best_residual are those of the full enumeration.
    # The 2^f choices: a table of the low bits (shared) and each high-bit pattern.
    C_B, C_F = C[basis], C[free]
    slack = (np.abs(V - a @ C_B).max() + np.abs(C_F - K @ C_B).max(axis=1).sum()) / scale
    floor = 0.99 * np.linalg.svd(C_B, compute_uv=False).min() / np.sqrt(C.shape[1]) / scale if rank else 0.0
    low = min(len(free), 14)
    table = next(_sign_choices(low))
    base = a[None, :] - table @ K[:low]  # (2^low, rank)
    high_bits = np.arange(len(free) - low)

    def lower_bounds(high):
        distance = base - np.where((high >> high_bits) & 1, 1.0, -1.0) @ K[low:]  # the candidates
        np.abs(distance, out=distance)
        distance -= 1.0  # |rounded - candidates| = ||candidates| - 1|
        return floor * np.sqrt(np.einsum("ij,ij->i", distance, distance)) - slack

    def residuals(high, rows):
        pattern = np.where((high >> high_bits) & 1, 1.0, -1.0)
        rounded = np.where(base[rows] - pattern @ K[low:] >= 0, 1.0, -1.0)
        return rounded, pattern, _orientation_residual(rounded, table[rows], pattern, C_B, C_F, V, scale)

    bounds = np.array([lower_bounds(high) for high in range(1 << (len(free) - low))])  # (2^(f - low), 2^low)
    first = np.unravel_index(np.argmin(bounds), bounds.shape)
    best_residual = float(residuals(first[0], [first[1]])[2][0])
    good = []
    for high in np.flatnonzero(bounds.min(axis=1) <= max(tolerance, best_residual) + 1e-9):
        keep = np.flatnonzero(bounds[high] <= max(tolerance, best_residual) + 1e-9)
        rounded, pattern, residual = residuals(high, keep)
        good += [(residual[i], rounded[i], np.concatenate([table[keep[i]], pattern]))
                 for i in np.flatnonzero(residual <= tolerance)]
        if len(keep) and residual.min() < best_residual:
            best_residual = float(residual.min())
    if len(good) != 1:
        return Orientation(None, len(good), best_residual, rank, len(free))
    misfit, rounded, choice = good[0]
    sigma = np.empty(n)
    sigma[basis] = rounded
    sigma[free] = choice
    return Orientation(sigma, 1, float(misfit), rank, len(free))


def _orientation_residual(rounded, low, high, C_B, C_F, V, scale):
    """``|sigma_B C_B + sigma_F C_F - V|_inf / scale`` for rows of basis signs and free signs
    (the free signs: a row of ``low`` followed by ``high``)."""
    choice = np.concatenate([low, np.broadcast_to(high, (len(low), len(high)))], axis=1)
    return np.abs(rounded @ C_B + choice @ C_F - V[None, :]).max(axis=1) / scale


def _sign_choices(count: int, chunk_bits: int = 14):
    """Every vector in {-1, +1}^count, in chunks of at most 2^chunk_bits rows (bit patterns)."""
    total = 1 << count
    step = min(total, 1 << chunk_bits)
    bits = np.arange(count)
    for start in range(0, total, step):
        codes = np.arange(start, min(start + step, total))
        yield np.where((codes[:, None] >> bits[None, :]) & 1, 1.0, -1.0)
