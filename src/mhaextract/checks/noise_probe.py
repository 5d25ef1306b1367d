"""Answer noise nobody declared: measured, so that the error estimate does not understate it.

A schedule's own error estimate assumes answers exact to float64 rounding unless
``answer_error`` is declared. Undeclared noise (an oracle that adds 1e-9, computes in float32
inside, or rounds its output) moves the parameters by the noise times the run's amplification,
orders of magnitude above that estimate. Two sources measure the noise (docs/reliability.md):

* **redundancy** (paper): the links' misfits give ``Certificate.noise_estimate``; the error
  estimate is at least ``certificate.statistical(noise_estimate)`` (3 sigma through G's row l2
  norms). No query is added; the estimate then rests on redundancy alone.
* **fresh noise-probe queries** (every other float64 schedule): ``PROBE_TRIPLES`` triples of
  fresh queries (``3 x PROBE_TRIPLES = 12`` queries, counted at the boundary like every other,
  stream 2 of the seed) whose exact answers are affinely related whatever the heads: a sequence
  of ``k`` equal tokens ``(b, .., b)`` answers ``c + vbar^T b`` (uniform attention; ``c = 0``
  without biases, docs/algorithm.md, 'Biases: affine scores and an output constant'), so
  ``f(b1 x k1) + f(b2 x k2) - 2 f(((b1 + b2) / 2) x k3) = 0`` exactly (tokens on a grid where the half-sum is exact).
  Its misfit is the answers' noise alone, not the model's error, through the softmax path (lengths 1 to the schedule's
  longest query). Noise only on sequences of distinct tokens escapes it. When the largest misfit ``r`` exceeds
  ``ROUNDING_ULPS`` units of rounding of its three answers, the schedule's estimate, linear in the answer error it
  assumed (``2^-52 x`` the largest answer), is scaled by ``r / (2^-52 x largest answer)``.
"""

from __future__ import annotations

import numpy as np

from .base import Check
from ..oracle.answer_stats import FLOAT64_UNIT, FORMAT_UNITS
from ..oracle.queries import quantize
from ..run.validation import spawn_rng

#: The answer error a schedule's own estimate assumes, relative to the largest answer.
ASSUMED_RELATIVE_ERROR = 2.0**-52
#: Triples of probe queries (3 queries each): PROBE_QUERIES fresh queries per run.
PROBE_TRIPLES = 4
PROBE_QUERIES = 3 * PROBE_TRIPLES
#: A triple's misfit under this many units of 2^-53 of its answers is float64 rounding.
ROUNDING_ULPS = 16.0
#: float32's unit roundoff: the unit a run takes for float64 answers that carry float32's rounding.
FLOAT32_UNIT = FORMAT_UNITS["float32"]


def taken_as_float32(noise: float, float64_limit: float, measured: str, cause: str) -> Check:
    """The passed check ``answer_noise`` of a run that measured float32-level ``noise`` in float64 answers
    (above ``float64_limit``, what exact float64 answers stay below; ``measured``: from what) and goes on
    as from float32 answers (unit :data:`FLOAT32_UNIT`), naming the likely ``cause`` (docs/algorithm.md,
    'Float64 answers computed in float32'; 'Attention behind a norm: the sublayer of a block')."""
    return Check("answer_noise", True, noise, float64_limit,
                 f"the answers carry about {noise:.1e} relative noise although float64 ({measured}), as {cause}: "
                 "extracted as from float32 answers, to their precision")


def _triples(plan) -> list[np.ndarray]:
    settings = plan.settings
    rng = spawn_rng(settings.seed, 2)
    longest = max(1, plan.promised_max_length)
    sequences = []
    for _ in range(PROBE_TRIPLES):
        b1, b2 = (quantize(rng.standard_normal(settings.d) * settings.token_scale / np.sqrt(settings.d),
                           2 * settings.token_scale) for _ in range(2))
        for token in (b1, b2, (b1 + b2) / 2):
            sequences.append(np.tile(token, (int(rng.integers(1, longest + 1)), 1)))
    return sequences


def probe_misfit(boundary, plan, model=None) -> tuple[float, float, int]:
    """``(noise beyond rounding (absolute, 0 if none), largest |answer|, queries asked)``."""
    sequences = _triples(plan)
    answers = np.asarray(boundary.ask(sequences, description="noise probe (fresh queries)"), dtype=np.float64)
    triples = answers.reshape(-1, 3)
    misfit = np.abs(triples[:, 0] + triples[:, 1] - 2.0 * triples[:, 2])
    rounding = ROUNDING_ULPS * FLOAT64_UNIT * (np.abs(triples) * [1.0, 1.0, 2.0]).sum(axis=1)
    noise = float(np.where(misfit > rounding, misfit, 0.0).max(initial=0.0))
    return noise, float(np.abs(answers).max(initial=0.0)), len(sequences)


def scaled_estimate(estimate: float, noise: float, answers_scale: float, assumed_relative: float | None = None) -> float:
    """The schedule's estimate scaled to the measured noise (never lowered). ``assumed_relative``:
    the relative answer error the schedule's estimate already assumes (a schedule that sized its
    estimate to the answers' measured unit, e.g. float32, ``TargetedSchedule.unit``); float64
    rounding (``ASSUMED_RELATIVE_ERROR``) by default."""
    relative = max(ASSUMED_RELATIVE_ERROR, assumed_relative or 0.0)
    assumed = relative * max(answers_scale, 1e-300)
    return max(estimate, estimate * noise / assumed) if np.isfinite(noise) else np.inf


def redundancy_estimate(estimate: float, certificate) -> float:
    """The paper's estimate: at least the first order at the noise its links measured, a standard
    deviation of independent errors: ``certificate.statistical(noise_estimate)``, 3 sigma through
    the l2 norms of G (docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement,
    verification')."""
    return max(estimate, certificate.statistical(certificate.noise_estimate))
