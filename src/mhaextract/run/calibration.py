"""The token scale from queries (docs/algorithm.md, 'Choosing the token scale from queries'):
``extract(..., token_scale="auto")``.

The schedules need log-poles ``m_h = z^T (W_h x + u_h)`` of order one, and nothing on the
extraction path may read the weights. A two-token query ``(y, x)`` with ``y = x - z`` answers

    f((y, x)) - (f((x)) + f((y))) / 2 = sum_h (l_h / 2) tanh(m_h / 2),    l_h = v_h^T z

(the two one-token answers are affine in their token, so the constant c cancels). With ``x = s x^``
and ``z = s z^`` for fixed unit directions, ``D(s) / s`` grows like ``s^2`` (like s where the
score biases dominate) while the log-poles are small, and flattens once they saturate. The
probes: ``P`` random direction pairs on a ladder of scales ``s = 2^j d^(1/4)``,
``j = -6..8`` (weights 1e-4..1e4 times the random model's); each pair's knee is the first scale
at which ``|D_p(s)| / s`` reaches half its largest value, interpolated geometrically, and the
run's knee is the geometric median of the pairs' knees. The token scale is the knee times
:data:`KNEE_TO_SCALE`, the factor that gives the library's random model
(``MultiHeadAttention.random``, whose weights the default ``d ** 0.25`` suits) its default back:
over d = 4..64, H = 1, 2, 4, 8, with and without biases, 2 seeds (80 targets), default / knee has
median 0.80, 90% of targets within 0.54..1.26, all within 0.34..1.87.

**The answers' precision** (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'), measured
here too, before any schedule runs: the bits of the answers (every answer a float32, float16 or bfloat16 number:
:attr:`~mhaextract.oracle.answer_stats.AnswerStats.unit_roundoff`) and ``PERMUTED`` pairs of
five-token queries that differ only in the order of their first four tokens. Softmax attention is
invariant under that permutation, so each pair's difference is the oracle's own rounding (the
summation order changed): about ``2^-24`` relative for a float32 layer or a float32 softmax inside
a float64 one, ``2^-53`` for float64. ``Calibration.answer_noise`` (relative to the largest
answer) is the larger of the two readings, or None at float64 rounding; :func:`mhaextract.extract`
passes it to the schedule as ``RunSettings.answer_noise``.

**Rounding or random noise** (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'): the first
``REPEATED`` permuted probes' first queries are asked a second time, unchanged. An oracle that rounds (float32
arithmetic, a float32 softmax) answers a repeat exactly as before, and its permuted disagreement is the rounding of its
own scores too; an oracle that adds random noise to its outputs (a defence, a sampled estimate)
answers a repeat differently, by about as much as the permuted pairs differ
(``Calibration.random_noise``).
``Calibration.arithmetic_noise``, the rounding unit of the oracle's own arithmetic
(``RunSettings.arithmetic_noise``; the targeted schedules size their score-rounding term by it,
not by the answer noise, which would overstate the estimate by orders of magnitude):

* the answer noise, when the repeats differ by less than ``1 / RANDOM_RATIO`` of the permuted
  pairs or the answers' bits are below float64 (the noise is the arithmetic's);
* None (float64 scores) for random noise below ``HIDDEN_FLOAT32`` relative: a float32 arithmetic
  would have shown in the permuted pairs above it (the smallest a float32 softmax showed was 4e-9);
* ``min(answer noise, 2^-24)`` for larger random noise, which may hide a float32 arithmetic (taken as
  float64 scores, a float32 layer behind Gaussian noise would pass with an estimate below the truth).

Queries: ``1 + 2P`` one-token queries (the zero vector and both tokens of each pair at the base
scale; one-token answers at the other scales follow exactly, since the tokens scale by powers of
two), ``P`` two-token queries per rung, ``2 PERMUTED`` permutation probes and ``REPEATED`` repeats:
``1 + 2P + 15P + 2 PERMUTED + REPEATED`` (147 for P = 8), asked through an
:class:`~mhaextract.oracle.boundary.OracleBoundary`, counted and reported as
``Extraction.calibration_queries``. They depend on ``d`` and the seed alone
(:func:`probe_queries`), so a transcript records them in a section of their own before the run's
plan exists, and a resumed run replays them: the same scale to the bit, whatever the oracle's
noise (:mod:`mhaextract.oracle.transcript`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..oracle.answer_stats import FLOAT64_UNIT, FORMAT_UNITS
from ..oracle.boundary import OracleError
from ..oracle.queries import quantize
from .validation import default_token_scale

#: Rungs of the ladder: token norms ``2^j d^(1/4)``.
LADDER = np.arange(-6, 9)
#: Direction pairs probed per rung.
PAIRS = 8
#: The knee: ``A(s)`` reaches this fraction of its largest value.
KNEE = 0.5
#: Token scale = knee times this (module docstring; the random model's default over its knee).
KNEE_TO_SCALE = 0.80
#: Below this many units of the answers' rounding, D is noise: no knee can be read.
NOISE_UNITS = 1e4
#: Pairs of permuted five-token queries measuring the answers' own rounding.
PERMUTED = 4
#: Of their first queries, this many are asked a second time unchanged (rounding or random noise).
REPEATED = 2
#: Repeats that differ by at least 1 / RANDOM_RATIO of the permuted disagreement: random noise.
RANDOM_RATIO = 30.0
#: Random noise below this (relative) cannot hide a float32 arithmetic (module docstring).
HIDDEN_FLOAT32 = 4e-10
#: A relative answer noise at most this many units of 2^-53 is float64 rounding (answer_noise None).
FLOAT64_NOISE_UNITS = 64.0


@dataclass
class Calibration:
    """What the probes found.

    Attributes
    ----------
    token_scale : the scale chosen (the default ``d ** 0.25`` when no knee was seen).
    queries, max_query_length : measured at the calibration's oracle boundary.
    scales : (rungs,) the token norms probed.
    response : (rungs, P) ``|D_p(s)| / s`` relative to each pair's largest value (NaN below the noise).
    knee : the knee scale (geometric median of the pairs'), or None.
    message : what was decided, in words.
    answer_noise : the answers' relative noise (fraction of the largest answer) when above float64
        rounding, else None (module docstring).
    answer_precision : ``"float64"``, ``"float32"``, ``"float16"``, ``"bfloat16"`` (the answers' bits), or
        ``"float64 with noise"`` (float64 numbers whose permuted probes disagree beyond rounding).
    arithmetic_noise : the relative rounding unit of the oracle's own arithmetic, which rounds its
        scores too (module docstring): ``answer_noise`` for deterministic noise; for random noise
        None (float64) below ``HIDDEN_FLOAT32``, else ``min(answer_noise, 2^-24)``; None without noise.
    random_noise : the repeated probes answered differently (noise added at random to the outputs).
    overflow_scale : the smallest probe token norm at which an answer was not finite (the layer's
        dtype overflowed: :func:`probe_responses`), or None.
    """

    token_scale: float
    queries: int
    max_query_length: int
    scales: np.ndarray
    response: np.ndarray
    knee: float | None
    message: str
    answer_noise: float | None = None
    answer_precision: str = "float64"
    arithmetic_noise: float | None = None
    random_noise: bool = False
    overflow_scale: float | None = None

    def __str__(self) -> str:
        noise = "" if self.answer_noise is None else f"; answers {self.answer_precision}, noise {self.answer_noise:.2g}"
        return f"token_scale {self.token_scale:.4g} from {self.queries} probe queries: {self.message}{noise}"


def _pairs(rng, d: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """P final tokens and differences of norm ``base``, rounded to the token grid."""
    xs, zs = np.empty((PAIRS, d)), np.empty((PAIRS, d))
    for p in range(PAIRS):
        if d == 1:
            xs[p], zs[p] = 1.0, -0.5
        else:
            q = np.linalg.qr(rng.standard_normal((d, 2)))[0]
            xs[p], zs[p] = q[:, 0], q[:, 1]
    return quantize(base * xs, 4 * base), quantize(base * zs, 4 * base)


def _floats(answers) -> np.ndarray:
    """Answers as floats (ball midpoints in high precision)."""
    answers = np.asarray(answers)
    if answers.dtype == object:
        return np.array([float(value.mid()) if hasattr(value, "mid") else float(value) for value in answers])
    return answers.astype(np.float64)


def probe_queries(d: int, rng) -> list[list[np.ndarray]]:
    """The calibration's queries in the order asked, in three groups: the ``1 + 2P`` one-token
    probes, the ``15 P`` two-token probes (rung by rung), the ``2 PERMUTED + REPEATED``
    permutation and repeated probes (asked in float64 only). They depend on ``d`` and ``rng``
    alone, never on an answer: a transcript records them before the run's plan exists."""
    base = default_token_scale(d)
    x0, z0 = _pairs(rng, d, base)
    one_token = [np.zeros((1, d))] + [token[None] for token in x0] + [token[None] for token in x0 - z0]
    two_token = [np.vstack([f * (x - z), f * x]) for f in 2.0 ** LADDER for x, z in zip(x0, z0)]
    tokens = [quantize(rng.standard_normal((5, d)) * base / np.sqrt(d), 4 * base) for _ in range(PERMUTED)]
    return [one_token, two_token, permuted_probes(tokens)]


def probe_responses(boundary, d: int, queries, on_first=None) -> tuple[np.ndarray, np.ndarray, float, float | None]:
    """``(scales, A(s), noise level of A, overflow scale)`` from the one- and two-token probes of
    ``queries`` (:func:`probe_queries`), asked through ``boundary``; ``on_first(boundary)`` is
    called once the one-token probes are answered (:func:`calibrate`).

    The two-token probes reach ``2^8`` times the default token norm, where a float16 layer's scores
    may overflow: a pair's non-finite answer leaves that rung and every larger one of the pair out
    (``A`` NaN there, read as noise), and the overflow scale is the smallest rung with one (None
    without). A non-finite answer at the smallest rung is no overflow: an OracleError."""
    one_token, sequences = queries[0], queries[1]
    first = _floats(boundary.ask(one_token, description="calibration: one-token probes"))
    if on_first is not None:
        on_first(boundary)
    c0, fx, fy = first[0], first[1:PAIRS + 1], first[PAIRS + 1:]
    factors = 2.0 ** LADDER
    asked = boundary.position
    pairs = _floats(boundary.ask(sequences, description="calibration: two-token probes",
                                 overflow=True)).reshape(len(factors), PAIRS)
    overflow = None
    beyond = np.cumsum(~np.isfinite(pairs), axis=0) > 0  # per pair: from its first non-finite answer on
    if beyond.any():
        if beyond[0].any():
            p = int(np.flatnonzero(beyond[0])[0])
            raise OracleError(
                f"answer to query {asked + p} (length 2) is not finite: the calibration's two-token probe at its "
                f"smallest token norm {default_token_scale(d) * factors[0]:.3g}, where no dtype's scores overflow; the "
                "oracle cannot answer it", asked + p, sequences[p])
        overflow = float(default_token_scale(d) * factors[int(np.flatnonzero(beyond.any(axis=1))[0])])
        pairs = np.where(beyond, np.nan, pairs)
    linear = c0 + factors[:, None] * ((fx - c0) + (fy - c0))[None] / 2  # (f((x)) + f((y))) / 2 at every rung
    D = pairs - linear
    scales = default_token_scale(d) * factors
    magnitude = np.abs(pairs) + np.abs(linear)
    noise = NOISE_UNITS * np.finfo(np.float64).eps * magnitude / scales[:, None]
    return scales, np.abs(D) / scales[:, None], noise, overflow


def _knee(scales: np.ndarray, relative: np.ndarray) -> float | None:
    """First scale where ``relative`` (NaN: noise) reaches KNEE, interpolated geometrically."""
    above = np.flatnonzero(np.nan_to_num(relative) >= KNEE)
    if not len(above):
        return None
    k = int(above[0])
    if k == 0 or not np.isfinite(relative[k - 1]) or relative[k - 1] <= 0:
        return float(scales[k])
    low, high = np.log(relative[k - 1]), np.log(relative[k])
    step = (np.log(KNEE) - low) / (high - low) if high > low else 1.0
    return float(scales[k - 1] * (scales[k] / scales[k - 1]) ** step)


def permutation_noise(boundary, sequences) -> tuple[float, float]:
    """``(permuted, repeated)``: the largest ``|f(X) - f(pi X)|`` over ``PERMUTED`` pairs and the
    largest ``|f(X) - f(X)|`` over ``REPEATED`` queries asked twice, each relative to the largest
    of the answers. pi reverses the first four of five tokens (random, at the default scale),
    which leaves exact softmax attention unchanged. ``sequences``: the third group of
    :func:`probe_queries`."""
    return permutation_spread(_floats(boundary.ask(sequences, description="calibration: permutation and repeated probes")))


def permuted_probes(tokens: list[np.ndarray], repeated: int = REPEATED) -> list[np.ndarray]:
    """The permutation probes of ``tokens`` (five-token queries): each, then each with its first
    four tokens reversed, then the first ``repeated`` of them again (:func:`permutation_spread`)."""
    return tokens + [np.vstack([X[3::-1], X[4:]]) for X in tokens] + tokens[:repeated]


def permutation_spread(answers: np.ndarray, pairs: int = PERMUTED) -> tuple[float, float]:
    """``(permuted, repeated)`` of :func:`permutation_noise` from the answers to
    :func:`permuted_probes` of ``pairs`` token sets (any number of repeats, none included)."""
    answers = np.asarray(answers, dtype=np.float64)
    first, second, again = answers[:pairs], answers[pairs:2 * pairs], answers[2 * pairs:]
    largest = max(float(np.abs(answers).max()), 1e-300)
    repeated = np.abs(first[:len(again)] - again).max(initial=0.0)
    return float(max(np.abs(first - second).max(), repeated) / largest), float(repeated / largest)


def answer_noise(boundary, permuted: float, repeated: float = 0.0) -> tuple[float | None, str, float | None, bool]:
    """``(relative noise or None at float64 rounding, precision name, arithmetic noise or None,
    random)`` from the answers' bits (``boundary.stats``), the permutation probes' disagreement
    ``permuted`` and the repeated probes' ``repeated`` (module docstring: rounding or random noise)."""
    stats = boundary.stats
    precision = stats.precision_name
    noise = max(stats.unit_roundoff if precision != "float64" else 0.0, permuted)
    if noise <= FLOAT64_NOISE_UNITS * FLOAT64_UNIT:
        return None, precision, None, False
    random = precision == "float64" and RANDOM_RATIO * repeated >= permuted
    arithmetic = (None if noise < HIDDEN_FLOAT32 else min(noise, FORMAT_UNITS["float32"])) if random else noise
    return float(noise), precision if precision != "float64" else "float64 with noise", arithmetic, random


def calibrate(boundary, d: int, rng, on_first=None) -> Calibration:
    """Probe the oracle through ``boundary`` and choose the token scale (module docstring).
    ``on_first(boundary)``: called once the ``1 + 2P`` one-token probes are answered, before the
    rest are asked (a run refuses there the options that the answers' format rules out)."""
    base = default_token_scale(d)
    before = boundary.position
    queries = probe_queries(d, rng)
    scales, response, noise, overflow = probe_responses(boundary, d, queries, on_first)
    noisy = None
    if boundary.precision is None:
        noisy, precision, arithmetic, random = answer_noise(boundary, *permutation_noise(boundary, queries[2]))
        if noisy is not None:  # D below the answers' own noise (not float64 rounding) is noise
            noise = noise * max(1.0, noisy / np.finfo(np.float64).eps)
    queries = boundary.position - before
    extra = {} if noisy is None else {"answer_noise": noisy, "answer_precision": precision,
                                      "arithmetic_noise": arithmetic, "random_noise": random}
    extra["overflow_scale"] = overflow
    beyond = ("" if overflow is None else f"; answers not finite from token norm {overflow:.4g} on (the layer's dtype "
              f"overflowed): {boundary.overflowed} probes, left out with the larger ones of their pairs")
    response = np.where(response > noise, response, np.nan)
    peak = np.nanmax(np.where(np.isfinite(response), response, -np.inf), axis=0)
    relative = response / np.where(peak > 0, peak, np.inf)[None]
    knees = [knee for knee in (_knee(scales, relative[:, p]) for p in range(PAIRS)) if knee is not None]
    if not knees:
        return Calibration(base, queries, boundary.max_query_length, scales, relative, None,
                           "no probe moved the answers beyond their rounding (scores independent of the tokens?): "
                           f"kept the default d ** 0.25 = {base:.4g}{beyond}", **extra)
    knee = float(np.exp(np.median(np.log(knees))))
    edge = (" (at the edge of the ladder: the weights may be outside 1e-4..1e4 times the random model's)"
            if knee <= scales[0] or knee >= scales[-1] else "")
    return Calibration(KNEE_TO_SCALE * knee, queries, boundary.max_query_length, scales, relative, knee,
                       f"knee of the two-token response at {knee:.4g} ({len(knees)} of {PAIRS} probe pairs){edge}"
                       f"{beyond}",
                       **extra)
