"""Learning rotary attention from value queries (docs/algorithm.md §22).

Zero tokens are counters: with no key bias a zero token scores 0 and carries value 0 at every
offset, so ``k`` leading zeros in front of a pattern S of non-zero tokens give

    F(k) - c = sum_h N_h / (k + P_h),   P_h = n_0(S) + sum_{t in S} exp(s_h(t)),
                                        N_h = sum_{t in S} exp(s_h(t)) v_h^T t,

the rational function of the copies instances with the counter in place of the copies. The
instances (final tokens ``x_i``, the columns of X; key tokens ``z_j``, the columns of Z):

* self ``(x_i)``: ``P = tau_h(i) = exp(s_h(x_i, x_i))``, ``N / P = v_h^T x_i``; with the query
  bias one more final token ``x_{d+1}`` off the affine hull of the others, so that
  ``[W | u]`` follows from the affine map ``(x; 1)``;
* key ``(z_j)``: ``N / P = v_h^T z_j``, the labels that name the heads;
* offset ``(z_j, 0^(delta - 1), x_i)``, delta = 1, 2: ``E = P - tau_h(i) - (delta - 1)`` is
  ``exp(z_j^T [W_h(delta) | u_h(delta)] (x_i; 1))``, and ``(N - tau_h(i) v_h^T x_i) / E = v_h^T z_j``
  matches the instance to the heads.

Every instance takes ``k = 0..2H - 1`` (c is measured once, by the query of one zero token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..checks.base import Check, CheckedResult
from ..checks.verify import ask_long_verification
from ..numerics.float64 import fit
from ..oracle.boundary import OracleBoundary
from ..oracle.queries import random_basis
from ..oracle.vector_answers import VectorAnswers
from ..validation import spawn_rng
from .model import RotaryAttention
from .structure import rotary_head
from .window import WindowSearch, find_window

#: Float64 limits of the checks (relative): instance fits, label matching, rotary structure, the
#: answers' misfit, and the error estimate.
FIT_LIMIT = 1e-8
MATCH_LIMIT = 1e-3
STRUCTURE_LIMIT = 1e-6
RESIDUAL_LIMIT = 1e-6
ESTIMATE_LIMIT = 1e-6
#: The error estimate is this many times the largest of its redundancy measurements.
SAFETY = 10.0
#: The token scale makes the self-scores of the basis tokens this large (root mean square).
SCORE_TARGET = 1.0


@dataclass
class RotaryExtraction(CheckedResult):
    """Result of ``extract(..., positions="rotary")``.

    Attributes
    ----------
    model : RotaryAttention or None (the whole layer for an oracle answering vectors).
    heads : canonical heads found.
    queries, queries_asked : answers used, measured at the oracle boundary.
    max_query_length : longest query asked (window search and verification included).
    window : the sliding window found (tokens attended, the final one included), or None.
    window_search : how it was found (:class:`~mhaextract.rotary.window.WindowSearch`).
    token_scale : the norm of the basis tokens.
    frequencies : (H*, r / 2) the rotation angles per position of every head, ascending.
    error_estimate : relative error of the score matrices ``W_h(0..2)`` and values, in the sense
        of ``compare(...).max_rel``: ten times the largest disagreement among the run's redundant
        measurements (labels from X and from Z, self-scores predicted and measured, W(2) outside
        W(1)'s spaces, eigenvalue moduli).
    answers_residual : max misfit on the schedule's own queries, relative to the largest answer.
    checks : list of Check. verification : the long verification, or None.
    readout, scalar_model, value_fit : as in :class:`~mhaextract.Extraction` for vector answers.
    seconds : float.

    Examples
    --------
    >>> import mhaextract as mx
    >>> layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(layer), d=6, heads=2, positions="rotary", seed=1)
    >>> result.ok, result.window, bool(mx.compare(result.model, layer).max_rel < 1e-9)
    (True, None, True)
    """

    model: RotaryAttention | None
    heads: int
    queries: int
    queries_asked: int
    max_query_length: int
    window: int | None
    window_search: WindowSearch
    token_scale: float
    error_estimate: float
    answers_residual: float
    seconds: float
    checks: list = field(default_factory=list)
    verification: object = None
    readout: np.ndarray | None = None
    scalar_model: RotaryAttention | None = None
    value_fit: object = None
    schedule: str = "rotary"

    @property
    def frequencies(self) -> np.ndarray | None:
        return None if self.model is None else np.sort(self.model.theta, axis=1)

    def __repr__(self) -> str:
        return (f"RotaryExtraction(heads={self.heads}, d={None if self.model is None else self.model.d}, "
                f"window={self.window}, queries={self.queries}, ok={self.ok}, "
                f"error_estimate={self.error_estimate:.2g})")

    def summary(self) -> dict:
        return {"schedule": self.schedule, "heads": self.heads, "queries": self.queries,
                "max_query_length": self.max_query_length, "window": self.window, "token_scale": self.token_scale,
                "error_estimate": self.error_estimate, "answers_residual": self.answers_residual,
                "ok": self.ok, "seconds": self.seconds}


@dataclass
class Instances:
    """The fitted instances of one run, as per-head arrays (unordered within an instance)."""

    P: np.ndarray       # (n, H) pole magnitudes P_h
    N: np.ndarray       # (n, H) numerators N_h
    residual: np.ndarray  # (n,) fit misfit relative to the instance's largest sample


def _zeros(count: int, d: int) -> np.ndarray:
    return np.zeros((count, d))


def instance_queries(patterns: list[np.ndarray], samples: int) -> list[np.ndarray]:
    """``(0^k, S)`` for every pattern S and ``k = 0..samples - 1``, pattern-major."""
    d = patterns[0].shape[1]
    return [np.vstack([_zeros(k, d), pattern]) for pattern in patterns for k in range(samples)]


def fit_instances(answers: np.ndarray, c: float, samples: int, heads: int) -> Instances:
    """Fit ``F(k) = c + sum_h N_h / (k + P_h)`` to each instance's ``samples`` answers."""
    table = answers.reshape(-1, samples)
    ks = np.arange(samples)
    fits = fit(table, ks, heads, constant=np.full(len(table), c))
    P = np.exp(fits.log_poles)
    return Instances(P, P * fits.labels, fits.residual)


def _assign(cost: np.ndarray) -> np.ndarray:
    """The permutation minimising the summed cost (row h -> column perm[h]); NaN costs lose."""
    rows, columns = linear_sum_assignment(np.nan_to_num(cost, nan=1e300, posinf=1e300))
    order = np.empty(len(rows), dtype=int)
    order[rows] = columns
    return order


def implied_labels(P, N, tau, label, offset):
    """``(N_p - tau_g l_g) / (P_p - tau_g - offset)`` for every (g, p): the key labels an offset
    instance implies for each pairing of a self head g with a pole p; NaN where ``E <= 0``."""
    E = P[..., None, :] - tau[..., :, None] - offset
    with np.errstate(divide="ignore", invalid="ignore"):
        value = (N[..., None, :] - (tau * label)[..., :, None]) / E
    return np.where(E > 0, value, np.nan), E


class RotaryLearner:
    """One rotary run: the queries from the seed, the fits, the matching and the assembly."""

    def __init__(self, d: int, heads: int, seed, token_scale: float, bias: bool, rank: int | None):
        self.d, self.H, self.seed, self.bias, self.rank = d, heads, seed, bias, rank
        self.samples = 2 * heads
        self.set_scale(token_scale)

    def set_scale(self, token_scale: float):
        self.token_scale = float(token_scale)
        rng = np.random.default_rng(np.random.SeedSequence(self.seed).spawn(1)[0] if self.seed is not None else None)
        self.X = random_basis(rng, self.d, token_scale)   # finals x_i (columns)
        self.Z = random_basis(rng, self.d, token_scale)   # keys z_j (columns)
        # off the hyperplane through x_1..x_d (a random orthogonal basis's sum direction, reversed)
        self.extra = -self.X.sum(axis=1) / np.sqrt(self.d)

    @property
    def finals(self) -> np.ndarray:
        """Final tokens as columns: x_1..x_d, and x_{d+1} when the query bias is learned."""
        return np.hstack([self.X, self.extra[:, None]]) if self.bias else self.X

    def patterns(self) -> list[np.ndarray]:
        """Self (x_i), key (z_j), then offset (z_j, 0^(delta-1), x_i) for delta = 1, 2, i-major."""
        d, finals = self.d, self.finals
        out = [x[None] for x in finals.T] + [z[None] for z in self.Z.T]
        for delta in (1, 2):
            for x in finals.T:
                for z in self.Z.T:
                    out.append(np.vstack([z[None], _zeros(delta - 1, d), x[None]]))
        return out

    def promised_queries(self) -> int:
        return self.samples * len(self.patterns()) + 1

    def learn(self, answers: np.ndarray, c: float, instances_misfit: list) -> tuple:
        """Heads from the instances' answers: returns (model or None, diagnostics dict)."""
        d, H, S = self.d, self.H, self.samples
        fitted = fit_instances(answers, c, S, H)
        n_final = self.finals.shape[1]
        tau, label_x = fitted.P[:n_final], fitted.N[:n_final] / fitted.P[:n_final]
        key_P, key_N = fitted.P[n_final:n_final + d], fitted.N[n_final:n_final + d]
        offset_P = fitted.P[n_final + d:].reshape(2, n_final, d, H)   # (delta, i, j, p)
        offset_N = fitted.N[n_final + d:].reshape(2, n_final, d, H)
        key_labels = key_N / key_P                                # (j, g) unordered
        offsets = np.array([0.0, 1.0])
        # Row i = 0 (the first final token) is the reference order of the heads.
        ref_tau, ref_label = tau[0], label_x[0]
        label_z = np.empty((d, H))
        for j in range(d):
            candidates = [implied_labels(offset_P[t, 0, j], offset_N[t, 0, j], ref_tau, ref_label, offsets[t])[0]
                          for t in range(2)]                      # (h, p) each
            scale = max(np.abs(key_labels[j]).max(), 1e-300)
            cost = sum(np.nanmin((candidate[:, :, None] - key_labels[j][None, None, :]) ** 2, axis=1,
                                 initial=np.inf, where=np.isfinite(candidate)[:, :, None]) for candidate in candidates)
            label_z[j] = key_labels[j][_assign(cost / scale ** 2)]
        # Every final token's self heads ordered against the key labels over its 2d offset instances.
        order = np.zeros((n_final, H), dtype=int)
        for i in range(n_final):
            if i == 0:  # the reference
                order[i] = np.arange(H)
                continue
            cost = np.zeros((H, H))
            for t in range(2):
                implied, _ = implied_labels(offset_P[t, i], offset_N[t, i], tau[i], label_x[i], offsets[t])  # (j, g, p)
                misfit = (implied[:, None, :, :] - label_z[:, :, None, None]) ** 2          # (j, h, g, p)
                misfit /= np.maximum(np.abs(label_z).max(axis=1), 1e-300)[:, None, None, None] ** 2
                cost += np.nanmin(np.where(np.isfinite(misfit), misfit, np.inf), axis=3).sum(axis=0)
            order[i] = _assign(cost)
        tau_ordered = np.take_along_axis(tau, order, axis=1)
        label_x_ordered = np.take_along_axis(label_x, order, axis=1)
        # Each offset instance: its poles assigned to the ordered heads by the key labels.
        log_E = np.empty((2, H, d, n_final))
        worst_match = 0.0
        for t in range(2):
            for i in range(n_final):
                implied, E = implied_labels(offset_P[t, i], offset_N[t, i], tau_ordered[i], label_x_ordered[i],
                                            offsets[t])           # (j, h, p)
                scale = np.maximum(np.abs(label_z).max(axis=1), 1e-300)[:, None, None]
                misfit = np.abs(implied - label_z[:, :, None]) / scale
                for j in range(d):
                    pole = _assign(misfit[j] ** 2)
                    chosen = misfit[j, np.arange(H), pole]
                    worst_match = max(worst_match, float(np.nan_to_num(chosen, nan=np.inf).max()))
                    with np.errstate(invalid="ignore", divide="ignore"):
                        log_E[t, :, j, i] = np.log(E[j, np.arange(H), pole])
        diagnostics = {"fit_residual": float(np.nan_to_num(fitted.residual, nan=np.inf).max()),
                       "match_misfit": worst_match}
        instances_misfit.append(fitted.residual)
        if not np.isfinite(log_E).all():
            diagnostics["nonpositive"] = True
            return None, diagnostics
        # Assembly: [W(delta) | u(delta)] = Z^{-T} L X_aug^{-1}, v = Z^{-T} l_z (and X^{-T} l_x).
        s2 = self.token_scale ** 2
        augmented = np.vstack([self.finals, np.ones((1, n_final))]) if self.bias else self.finals
        inverse = np.linalg.inv(augmented)
        W = np.einsum("aj,thji,ib->thab", self.Z / s2, log_E, inverse)   # (delta, h, d, d(+1))
        v_from_z = (self.Z @ label_z).T / s2
        v_from_x = (self.X @ label_x_ordered[:d]).T / s2
        v = 0.5 * (v_from_z + v_from_x)
        heads = [rotary_head(W[0, h], W[1, h], self.rank) for h in range(H)]
        width = max(head.Q.shape[0] for head in heads)
        Q = np.zeros((H, width, d))
        K = np.zeros((H, width, d))
        b = np.zeros((H, width))
        theta = np.zeros((H, width // 2))
        for h, head in enumerate(heads):
            rows = head.Q.shape[0]
            Q[h, :rows] = head.Q[:, :d]
            b[h, :rows] = head.Q[:, d] if self.bias else 0.0
            K[h, :rows] = head.K
            theta[h, :rows // 2] = head.theta
        model = RotaryAttention(Q, K, theta, v, c, b=b)
        # Redundancy: what the error estimate is made of.
        finals = self.finals
        predicted = np.einsum("ai,hab,bi->ih", finals, model.score_matrices(0, bias=False), finals)
        if self.bias:
            predicted += np.einsum("ai,ha->ih", finals, model.score_matrices(0, bias=True)[:, :, d])
        score_scale = max(float(np.abs(log_E).max()), 1e-300)
        diagnostics.update(
            self_score_misfit=float(np.abs(predicted - np.log(tau_ordered)).max()) / score_scale,
            value_gap=float(np.abs(v_from_z - v_from_x).max()) / max(float(np.abs(v).max()), 1e-300),
            subspace_residual=max(head.subspace_residual for head in heads),
            modulus_error=max(head.modulus_error for head in heads),
            widths=[head.width for head in heads])
        return model, diagnostics


def extract_rotary(oracle, d: int, heads: int, seed=None, *, token_scale=None, bias: bool = True,
                   rank: int | None = None, batch_size: int = 1024, progress=None, max_queries=None,
                   verify_length: int | None = None, window_limit: int = 4096) -> RotaryExtraction:
    """The rotary extraction behind ``extract(..., positions="rotary")`` (its checks unreported:
    ``extract`` raises or warns on failure)."""
    started = time.perf_counter()
    vectors = VectorAnswers(seed, getattr(oracle, "answer_dtype", None))
    boundary = OracleBoundary(oracle, d, batch_size=batch_size, progress=progress, max_queries=max_queries,
                              vectors=vectors)
    c = float(boundary.ask([np.zeros((1, d))], "the output constant")[0])
    scale = d ** 0.25 if token_scale is None else float(token_scale)
    window = find_window(boundary, spawn_rng(seed, 21), scale, c, window_limit)
    learner = RotaryLearner(d, heads, seed, scale, bias, rank)
    checks = [window.check(learner.samples + 2)]
    misfits: list = []
    model, diagnostics = None, {}
    if checks[0].passed:
        if token_scale is None:  # scores of order one: measured on d self instances at d^(1/4)
            answers = boundary.ask(instance_queries([x[None] for x in learner.X.T], learner.samples),
                                   "choosing the token scale")
            fitted = fit_instances(answers, c, learner.samples, heads)
            typical = float(np.sqrt(np.nanmean(np.log(fitted.P) ** 2)))
            if np.isfinite(typical) and typical > 0:
                learner.set_scale(scale * float(np.clip(np.sqrt(SCORE_TARGET / typical), 1e-3, 1e3)))
        sequences = instance_queries(learner.patterns(), learner.samples)
        answers = boundary.ask(sequences, "rotary instances")
        model, diagnostics = learner.learn(answers, c, misfits)
        if model is not None and window.window is not None:
            model = RotaryAttention(model.Q, model.K, model.theta, model.v, model.c, window.window, model.b)
    residual = np.inf
    estimate = np.inf
    if model is not None:
        scale_answers = max(float(np.abs(answers).max()), 1e-300)
        residual = float(np.abs(model(sequences) - answers).max()) / scale_answers
        estimate = SAFETY * max(diagnostics["self_score_misfit"], diagnostics["value_gap"],
                                diagnostics["subspace_residual"], diagnostics["modulus_error"], residual,
                                np.finfo(float).eps)
        checks += [
            Check("instance_fit", diagnostics["fit_residual"] <= FIT_LIMIT, diagnostics["fit_residual"], FIT_LIMIT,
                  "max misfit of an instance's rational fit, relative to its largest sample"),
            Check("matching", diagnostics["match_misfit"] <= MATCH_LIMIT, diagnostics["match_misfit"], MATCH_LIMIT,
                  "max disagreement of an offset instance's implied key label with the head's, relative"),
            Check("rotary_structure", max(diagnostics["subspace_residual"], diagnostics["modulus_error"])
                  <= STRUCTURE_LIMIT, max(diagnostics["subspace_residual"], diagnostics["modulus_error"]),
                  STRUCTURE_LIMIT, "W(2) outside W(1)'s spaces, or an eigenvalue of the rotation off the unit "
                  "circle: the scores are not rotary"),
            Check("answers_residual", residual <= RESIDUAL_LIMIT, residual, RESIDUAL_LIMIT,
                  "max misfit of the model on the queries asked, relative to the largest answer"),
            Check("error_estimate", estimate <= ESTIMATE_LIMIT, estimate, ESTIMATE_LIMIT,
                  "ten times the largest disagreement of the run's redundant measurements"),
        ]
    elif checks[0].passed:
        checks.append(Check("instance_fit", False, np.inf, FIT_LIMIT,
                            "an offset instance's poles do not fit its heads (E <= 0): no model"))
    verification = None
    if model is not None and (verify_length is None or verify_length > 0):
        longest = verify_length or max(256, 4 * (window.window or 0))
        long_queries = ask_long_verification(boundary, spawn_rng(seed, 5), learner.token_scale, longest)
        check, verification = long_queries.judge(model, estimate, residual, 0.0,
                                                 max(float(np.abs(answers).max()), 1e-300), 2.0 ** -53,
                                                 learner.samples + 2, seed=seed)
        checks.append(check)
    return RotaryExtraction(model=model, heads=0 if model is None else model.heads, queries=boundary.queries,
                            queries_asked=boundary.queries, max_query_length=boundary.max_query_length,
                            window=window.window, window_search=window, token_scale=learner.token_scale,
                            error_estimate=float(estimate), answers_residual=float(residual),
                            seconds=time.perf_counter() - started, checks=checks, verification=verification,
                            readout=vectors.readout if (vectors.d_out or 1) > 1 else None)
