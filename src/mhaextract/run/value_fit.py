"""The value read-outs of a layer's whole output: ``V_h`` and ``c`` from vector answers (docs/algorithm.md, 'The whole
layer: vector outputs and a replacement module').

Once the scores are known (``W_h`` and ``u_h`` from any schedule, learned on the read-out
``r^T f``), every answer is linear in the value read-outs::

    f(X) = c + sum_h V_h m_h(X),     m_h(X) = sum_i a_{h,i}(X) x_i,

so the ``d_out`` coordinates of the answers to ``n`` fresh queries determine ``[V_1 ... V_H c]``
by one least-squares problem with ``p = H d + 1`` unknowns per output and ``d_out`` right-hand
sides, one design for all of them. The schedules' own queries make a poor design (a copies
query's head means all lie on the line through its two tokens, and a head saturated by the
schedule's design sits at one end of it, so the heads' columns nearly coincide); fresh random
queries of 2..8 tokens at the run's token scale give every head its own mixture of several
tokens. :func:`value_query_count` asks ``p + max(32, p / 4)`` of them.

The estimate has two parts, added coefficient by coefficient: the answers' noise through the fit
(the residual's size times the rows of ``A^+``, probed with random vectors), and the first-order
response of the fit to an error in the scores (the design moved by that error, the fit solved again
for the moved right-hand side). Where the schedule drew its own parameter errors (the rotary
refinement's ``sigma^2 (J^T J)^{-1}``) the scores are moved by those draws, ``DRAW_SAFETY`` times
the largest response; where it estimated every entry's standard deviation (the targeted schedules)
by ``DEVIATION_DRAWS`` Gaussian draws of ``DEVIATION_SAFETY`` times each, each coefficient's largest
response kept; else by a Gaussian error of every entry at
the size it estimated for ``W`` and ``u``, which moves directions the schedule's queries pin down as
much as those they leave loose and so overstates. V's estimate is its largest coefficient's, c's its
own row's (docs/algorithm.md, 'The whole layer: vector outputs and a replacement module'). The check
``readout_consistency`` compares ``V_h^T r`` with the ``v_h`` the schedule found independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg

from ..checks.base import Check
from ..models.attention import MultiHeadAttention

#: A parameter within this many of its estimated errors of zero (the output constant c, a head's
#: score bias u_h) is not resolved from zero: its error is then claimed absolute, not relative to it
#: (a bias-free target's c and u read as noise), as ``compare`` reports a reference without them.
RESOLVED = 10.0

#: Above this many design entries (rows x unknowns) the fit is formed as normal equations in
#: chunks (memory O(unknowns^2)) and refined twice on the residual; below, a dense QR.
DENSE_ENTRIES = 2 * 10**7
#: Rows of the design built at once in the chunked fit.
CHUNK = 2048
#: The chunked fit keeps its design's chunks when they take at most this many bytes (each pass
#: over the design otherwise recomputes every query's softmax weights), and rebuilds them per pass
#: above it, so that memory stays O(unknowns^2).
DESIGN_CACHE_BYTES = 2**30
#: Random vectors probing the rows of A^+ for the noise part of the estimate.
PROBES = 8
#: An estimate from a few error draws is this many times the largest change they make.
DRAW_SAFETY = 3.0
#: Scores moved by every entry's own standard deviation are moved by this many of them (the margin the
#: uniform probe has: a third of the largest entry's estimate, taken at about 4.5 of its standard
#: deviations), in this many draws, each coefficient's largest response kept: one draw's largest
#: coefficient fluctuates (truth over estimate up to 1.03 over 300 exact fits at d = 6, H = 2 with one
#: draw, 0.71 with three).
DEVIATION_SAFETY = 1.5
DEVIATION_DRAWS = 3


#: Lengths of the value fit's queries (inclusive).
VALUE_QUERY_LENGTHS = (2, 8)


def value_query_count(heads: int, d: int) -> int:
    """Fresh queries of the value fit: the ``p = H d + 1`` unknowns per output and ``max(32, p / 4)`` more."""
    unknowns = heads * d + 1
    return unknowns + max(32, unknowns // 4)


@dataclass
class ValueFit:
    """The value read-outs fitted to vector answers.

    Attributes
    ----------
    model : MultiHeadAttention or RotaryAttention
        The vector model: the schedule's scores (``W_h``, ``u_h``, or the rotary factors) with the
        fitted ``V_h`` (H, d_out, d) and ``c``.
    rows : int, fresh queries in the fit (each with its ``d_out`` answers).
    unknowns : int, unknowns per output (``H d``, plus one for ``c``).
    residual : float, max misfit of the fit on its rows, relative to the largest answer.
    noise_error, score_error : float
        Max absolute error of ``V`` and ``c`` expected from the answers' noise and from the error in
        the scores, respectively (each the largest over the coefficients).
    error_estimate : float, each coefficient's two parts added, the largest over V's relative to
        ``max |V|`` and over c's relative to ``max |c|`` (the larger of the two).
    readout_gap : float, ``max |V_h^T r - v_h|`` relative to ``max |v_h|``.
    """

    model: MultiHeadAttention
    rows: int
    unknowns: int
    residual: float
    noise_error: float
    score_error: float
    error_estimate: float
    readout_gap: float

    def checks(self, residual_limit: float, scalar_estimate: float) -> list[Check]:
        """``value_fit_residual`` (the fit explains the sample like the schedule explains its answers)
        and ``readout_consistency`` (``V^T r`` agrees with the schedule's own ``v`` within both estimates)."""
        gap_limit = max(10.0 * (scalar_estimate + self.error_estimate), 1e-12)
        return [
            Check("value_fit_residual", self.residual <= residual_limit, self.residual, residual_limit,
                  f"max misfit of the value fit on its {self.rows} vector answers, relative to the largest"),
            Check("readout_consistency", self.readout_gap <= gap_limit, self.readout_gap, gap_limit,
                  "max |V_h^T r - v_h| / max |v_h|: the fitted read-outs against the schedule's own v_h"),
        ]


def _design(model: MultiHeadAttention, sequences, bias: bool) -> np.ndarray:
    """Rows ``[m_1(X)^T ... m_H(X)^T (1)]`` for the sequences (the means under the model's scores)."""
    means = model.head_means(sequences).reshape(len(sequences), -1)
    if not bias:
        return means
    rows = np.empty((len(sequences), means.shape[1] + 1))
    rows[:, :-1], rows[:, -1] = means, 1.0
    return rows


def fit_values(model: MultiHeadAttention, sequences, answers: np.ndarray, bias: bool, readout: np.ndarray,
               score_error: tuple[float, float] = (0.0, 0.0), seed=0, score_moves=None,
               frame_shift: np.ndarray | None = None, score_deviations=None) -> ValueFit:
    """Fit ``V_h`` and ``c`` to whole answers under ``model``'s scores.

    Parameters
    ----------
    model : the schedule's scalar model (canonical, float64), read out through ``readout``: a
        :class:`MultiHeadAttention` or a :class:`~mhaextract.RotaryAttention` (any model with
        ``head_means``, ``with_values`` and ``scores_moved``).
    sequences : the value fit's queries, (N_i, d) arrays.
    answers : (n, d_out) their whole answers.
    bias : fit the constant ``c`` (else ``c = 0``, the paper's model).
    readout : (d_out,) the read-out the schedule's answers were taken through.
    score_error : the relative errors estimated for ``W`` and ``u`` (each of its own largest entry).
    seed : seeds the probes of the estimate.
    score_moves : ``(moved, stretch)`` pairs, ``model`` moved by draws of its parameters' error each
        stretched by ``stretch`` (:func:`~mhaextract.rotary.refine.error_moves`), or None. Given,
        the scores' part of the estimate is ``DRAW_SAFETY`` times the largest response to them
        scaled back, and ``score_error`` is not used.
    score_deviations : ``(W, u)`` every score entry's standard deviation (absolute; u's None without biases), or
        None. Given (and no ``score_moves``), the scores are moved by ``DEVIATION_DRAWS`` draws of Gaussian errors of
        ``DEVIATION_SAFETY`` times each entry's own deviation instead of every entry at the largest's
        (``score_error``), which moves the entries the schedule pins down as much as those it leaves loose.
    frame_shift : (d,) or None: the constant is judged as reported, that of the model seen through
        ``x -> x + frame_shift`` (``c + sum_h V_h frame_shift``), with the values' error carried
        into it; a run that asked every query at shifted tokens reports the model shifted back.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> from mhaextract.run.value_fit import fit_values
    >>> layer = mx.MultiHeadAttention.random(d=3, heads=2, seed=0, d_out=4, bias=True)
    >>> queries = [np.random.default_rng(n).standard_normal((2 + n % 4, 3)) for n in range(40)]
    >>> r = np.ones(4) / 2
    >>> fit = fit_values(layer.readout(r), queries, layer(queries), bias=True, readout=r)
    >>> bool(mx.compare(fit.model, layer).max_rel < 1e-10)
    True
    """
    model = model.to_float64()
    answers = np.asarray(answers, dtype=np.float64)
    rows = len(sequences)
    heads, d = model.heads, model.d
    unknowns = heads * d + int(bias)
    if heads == 0 or rows < unknowns + 1 or answers.shape != (rows, len(readout)):
        raise ValueError(f"the value fit needs more than {unknowns} queries with answers (n, {len(readout)}); it has "
                         f"{rows} queries and answers of shape {answers.shape}")
    scale = float(np.abs(answers).max()) or 1.0
    dense = rows * unknowns <= DENSE_ENTRIES
    solver = _DenseFit(model, sequences, answers, bias) if dense else _NormalFit(model, sequences, answers, bias)
    X = solver.solution
    residual_rms = np.sqrt(solver.residual_squares / max(1, rows - unknowns))  # per output
    rng = np.random.default_rng(seed)
    # The answers' noise through the fit: std of coefficient i is sigma_o * ||row i of A^+||.
    probed = solver.pinv_times(rng.standard_normal((rows, PROBES)))        # A^+ G: (unknowns, PROBES)
    row_norms = np.sqrt(np.mean(probed ** 2, axis=1))
    z = np.sqrt(2 * np.log(2 * unknowns * answers.shape[1]))
    noise = z * row_norms[:, None] * residual_rms[None, :]  # (unknowns, d_out): each coefficient's
    noise_error = float(noise.max())
    # The scores' error: the design moved by the schedule's own error draws, else by a random
    # perturbation of W and u of the estimated size.
    W_error, u_error = score_error
    responses, safety = [], 1.0  # first-order changes of the solution, (unknowns, d_out) each
    if score_moves is not None:
        responses, safety = [solver.response(moved) / stretch for moved, stretch in score_moves], DRAW_SAFETY
    elif score_deviations is not None:
        W_deviation, u_deviation = score_deviations
        u_moved = None if u_deviation is None else DEVIATION_SAFETY * u_deviation
        responses = [solver.response(model.scores_moved_by(rng, DEVIATION_SAFETY * W_deviation, u_moved))
                     for _ in range(DEVIATION_DRAWS)]
    elif W_error > 0 or u_error > 0:
        responses = [solver.response(model.scores_moved(rng, W_error, u_error))]
    moved = safety * np.max([np.abs(response) for response in responses], axis=0) if responses else np.zeros_like(X)
    score_part = float(moved.max(initial=0.0))
    # Each coefficient's error is its own noise and its own response, not the largest of either over
    # every coefficient: V's largest against V's scale, c's row against c's (docs/algorithm.md, 'The whole layer:
    # vector outputs and a replacement module').
    coefficient_error = noise + moved
    V = X[:heads * d].T.reshape(answers.shape[1], heads, d).transpose(1, 0, 2)
    c = X[heads * d] if bias else np.zeros(answers.shape[1])
    fitted = model.with_values(V, c)
    V_scale = float(np.abs(V).max()) or 1.0
    error_estimate = float(coefficient_error[:heads * d].max()) / V_scale
    if bias:  # c's error relative to its own largest entry, as compare() measures it; absolute for a c
        # within RESOLVED errors of zero (a bias-free layer's c reads as noise, compare() reports it absolute)
        if frame_shift is None:
            c_size, c_error = float(np.abs(c).max()), float(coefficient_error[heads * d].max())
        else:
            # the constant reported, c + sum_h V_h s, is the linear functional a^T X of the solution
            # (every head mean moves by the shift): its noise through ||a^T A^+||, its response to
            # the scores' error as a^T times the solution's
            functional = np.append(np.tile(np.asarray(frame_shift, dtype=np.float64), heads), 1.0)
            c_size = float(np.abs(functional @ X).max())
            c_error = float(z * np.sqrt(np.mean((functional @ probed) ** 2)) * residual_rms.max()) + safety * max(
                (float(np.abs(functional @ response).max()) for response in responses), default=0.0)
        error_estimate = max(error_estimate, c_error / c_size if c_size > RESOLVED * c_error else c_error)
    v_scale = float(np.abs(model.v).max()) or 1.0
    gap = float(np.abs(np.einsum("hod,o->hd", V, readout) - model.v).max()) / v_scale
    return ValueFit(fitted, rows, unknowns, float(solver.residual_max) / scale, noise_error, score_part,
                    float(error_estimate), gap)


class _DenseFit:
    """Least squares by a column-equilibrated QR of the whole design (small problems)."""

    def __init__(self, model, sequences, answers, bias):
        self.sequences, self.bias = sequences, bias
        A = _design(model, sequences, bias)
        self.columns = np.linalg.norm(A, axis=0)
        self.columns[self.columns == 0] = 1.0
        self.Q, self.R = scipy.linalg.qr(A / self.columns, mode="economic")
        self.solution = self._solve(answers)
        residual = answers - A @ self.solution
        self.residual_squares = (residual ** 2).sum(axis=0)
        self.residual_max = float(np.abs(residual).max())
        self.A = A

    def _solve(self, rhs):
        return scipy.linalg.solve_triangular(self.R, self.Q.T @ rhs) / self.columns[:, None]

    def pinv_times(self, G):
        """``A^+ G`` (unknowns, k) for G (rows, k)."""
        return self._solve(G)

    def response(self, moved):
        """First-order change of the solution when the design becomes that of ``moved``."""
        return self._solve((_design(moved, self.sequences, self.bias) - self.A) @ self.solution)


class _NormalFit:
    """Least squares by normal equations formed in chunks (memory O(unknowns^2)), equilibrated,
    Cholesky-factored and refined twice on the residual computed chunk by chunk (large problems).
    The chunks are kept for the later passes when they fit ``DESIGN_CACHE_BYTES``."""

    def __init__(self, model, sequences, answers, bias):
        self.model, self.sequences, self.bias = model, sequences, bias
        unknowns = model.heads * model.d + int(bias)
        keep = len(sequences) * unknowns * 8 <= DESIGN_CACHE_BYTES
        self.chunks = [] if keep else None
        gram, self.columns = None, None
        for start in range(0, len(sequences), CHUNK):
            A = _design(model, sequences[start:start + CHUNK], bias)
            gram = A.T @ A if gram is None else gram + A.T @ A
            if keep:
                self.chunks.append(A)
        self.columns = np.sqrt(np.diag(gram)).copy()
        self.columns[self.columns == 0] = 1.0
        self.factor = scipy.linalg.cho_factor(gram / np.outer(self.columns, self.columns))
        self.solution = np.zeros((len(self.columns), answers.shape[1]))
        for _ in range(3):  # the solve and two refinements on the true residual
            correction = self._solve(self._transpose_times(answers - self._times(self.solution)))
            self.solution = self.solution + correction
        residual = answers - self._times(self.solution)
        self.residual_squares = (residual ** 2).sum(axis=0)
        self.residual_max = float(np.abs(residual).max())

    def _designs(self, model=None):
        for number, start in enumerate(range(0, len(self.sequences), CHUNK)):
            rows = slice(start, start + CHUNK)
            if model is None and self.chunks is not None:
                yield rows, self.chunks[number]
            else:
                yield rows, _design(model or self.model, self.sequences[rows], self.bias)

    def _times(self, X, model=None):
        return np.vstack([A @ X for _, A in self._designs(model)])

    def _transpose_times(self, Y, model=None):
        return sum(A.T @ Y[rows] for rows, A in self._designs(model))

    def _solve(self, normal_rhs):
        return scipy.linalg.cho_solve(self.factor, normal_rhs / self.columns[:, None]) / self.columns[:, None]

    def pinv_times(self, G):
        return self._solve(self._transpose_times(G))

    def response(self, moved):
        shifted = np.vstack([(A_moved @ self.solution) - (A @ self.solution) for (_, A), (_, A_moved)
                             in zip(self._designs(), self._designs(moved))])
        return self._solve(self._transpose_times(shifted))
