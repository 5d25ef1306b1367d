"""Evidence that the oracle is outside the model class, asked only after a failed run.

Attention without positions, read at the final token, has two invariants that cost a handful of
queries to test and that the commonest wrong oracles break:

* **order**: the earlier tokens enter only through the softmax over the set ``{x_1 .. x_{N-1}}``,
  so swapping two of them leaves the answer unchanged, ``f(a, b, x) = f(b, a, x)``. A layer that
  encodes positions (rotary angles, learned positions) breaks it.
* **scale**: a one-token query puts all the attention on that token, ``f(x) = c + V x`` (with
  ``V = sum_h V_h``), so ``g(lambda) = f(lambda x)`` is affine in lambda and its second
  differences ``g(2) - 2 g(1) + g(0)`` and ``g(4) - 2 g(2) + g(0)`` vanish. A norm before the
  attention (LayerNorm or RMSNorm: ``n(lambda x) = n(x)`` for lambda > 0 and tokens well above
  the norm's eps) makes ``g(lambda) = lambda R x + K`` for lambda > 0 (R the residual's map, if
  any) while ``g(0) = K_0``: both differences equal ``K_0 - K``, the same non-zero vector. A
  LayerNorm after the residual (post-LN: ``y = gamma n(x + o(x)) + beta``) does the same once the
  token outweighs the output constant (``n(lambda (x + V x) + c) -> n(x + V x)``): the directions are
  scaled again by ``LARGE`` for it, where attention's one-token answers stay exactly affine.

The zero token's answer is the output constant ``c``: exactly 0 for the bias-free model, so a run
that learned that model on a layer with biases is told to learn them (``bias=True``).

:func:`probe_model_class` asks these queries through the run's boundary (counted, and recorded in
its transcript) and :func:`model_class_hints` turns what they show into what to try. The tests
are one-sided: passing them does not prove the oracle is attention (the run's own checks decide
that); failing them names a cause the checks alone cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Pairs of earlier tokens swapped, and one-token directions scaled: two of each, so that one
#: unlucky draw (a direction the norm barely moves, a pair of nearly equal scores) does not decide.
PAIRS = DIRECTIONS = 2
#: An invariant counts as broken when the answers move by more than this fraction of the largest
#: answer, by more than ``ROUNDING_MULTIPLE`` units of the answers' format (a swap reorders sums) and by
#: more than ``NOISE_MULTIPLE`` times what repeating a probe moves it (an oracle's own noise; the
#: calibration's noise estimate is not used: an oracle outside the class inflates it).
BROKEN, ROUNDING_MULTIPLE, NOISE_MULTIPLE = 1e-4, 10.0, 100.0
#: Scale invariance: the two second differences agree to this fraction of their size.
SAME_DIFFERENCE = 0.05
#: The one-token directions asked again at this many times their scale (a norm after the residual
#: shows there, past the output constant; each set is judged relative to its own largest answer).
LARGE = 1e3


@dataclass(frozen=True)
class ModelClassEvidence:
    """What the probes measured, each relative to the largest answer of the probes.

    Attributes
    ----------
    order : the largest change of an answer when two earlier tokens are swapped.
    curvature : the largest second difference of a one-token answer along its scale (of the scale set
        that showed invariance, else of both), relative to that set's largest answer.
    scale_invariant : whether the second differences at scales (1, 2) and (2, 4) agree, as a norm
        before the attention makes them, at the base scale or at ``LARGE`` times it (a norm after
        the residual), and are large there.
    offset : the zero token's answer ``|f(0)| = |c|`` (0 for the bias-free model).
    d_out : the numbers each answer holds (1: a scalar read-out; the probes judge its read-out).
    threshold : the size above which a change counts (``BROKEN``, or the noise's multiple).
    queries : the probes asked.
    """

    order: float
    curvature: float
    scale_invariant: bool
    threshold: float
    queries: int
    offset: float = 0.0
    d_out: int = 1

    @property
    def positions(self) -> bool:
        """The answers depend on the order of the earlier tokens."""
        return self.order > self.threshold

    @property
    def output_constant(self) -> bool:
        """The zero token's answer is not 0: the layer has an output constant (value or output biases)."""
        return self.offset > self.threshold

    @property
    def normalised(self) -> bool:
        """Scaling a lone token does not scale its effect, as a norm before the attention, or after
        the residual, does."""
        return self.curvature > self.threshold and self.scale_invariant


def _probe_sequences(d: int, rng: np.random.Generator, token_scale: float) -> list[np.ndarray]:
    """``PAIRS`` swapped pairs ``(a, b, x), (b, a, x), (a, b, x)`` (the last a repeat, for the
    oracle's own noise), then for each of ``DIRECTIONS`` directions the one-token queries
    ``x, 2x, 4x``, then the zero token twice, then each direction's ``LARGE`` times ``x, 2x, 4x``."""
    def token(scale):
        vector = rng.standard_normal(d)
        return scale * vector / np.linalg.norm(vector)

    sequences, directions = [], []
    for _ in range(PAIRS):
        a, b, x = token(token_scale), token(token_scale), token(token_scale)
        sequences += [np.stack([a, b, x]), np.stack([b, a, x]), np.stack([a, b, x])]
    for _ in range(DIRECTIONS):
        # entries of order one at least: a norm's eps (1e-5 .. 1e-6 on the variance) then does not
        # show, whatever token scale the run used (a norm in front misleads the calibration)
        directions.append(token(max(token_scale, np.sqrt(d))))
        sequences += [(scale * directions[-1])[None, :] for scale in (1.0, 2.0, 4.0)]
    sequences += [np.zeros((1, d))] * 2
    return sequences + [(LARGE * scale * x)[None, :] for x in directions for scale in (1.0, 2.0, 4.0)]


def _second_differences(lines: np.ndarray, zero: float) -> tuple[float, bool]:
    """``(largest |second difference| relative to the set's largest answer, whether both agree)`` of
    one-token answers ``lines`` (DIRECTIONS, 3) at scales 1, 2, 4 and the zero token's."""
    first = lines[:, 1] - 2.0 * lines[:, 0] + zero    # g(2) - 2 g(1) + g(0)
    second = lines[:, 2] - 2.0 * lines[:, 1] + zero   # g(4) - 2 g(2) + g(0)
    scale = max(float(np.abs(lines).max()), abs(zero)) or 1.0
    size = np.maximum(np.abs(first), np.abs(second))
    return (float(np.abs(np.concatenate([first, second])).max()) / scale,
            bool(np.all(np.abs(first - second) <= SAME_DIFFERENCE * size)))


def probe_model_class(boundary, d: int, rng: np.random.Generator, token_scale: float) -> ModelClassEvidence:
    """Ask the order and scale probes through ``boundary`` and measure both invariants.

    Examples
    --------
    >>> import numpy as np, mhaextract as mx
    >>> from mhaextract.oracle.boundary import OracleBoundary
    >>> target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True)
    >>> evidence = probe_model_class(OracleBoundary(mx.SimulatedOracle(target), 4), 4,
    ...                              np.random.default_rng(0), 1.0)
    >>> evidence.positions, evidence.normalised, evidence.queries
    (False, False, 20)
    """
    sequences = _probe_sequences(d, rng, token_scale)
    answers = np.asarray(boundary.ask(sequences, description="model-class probes"), dtype=np.float64)
    large = answers[-3 * DIRECTIONS:].reshape(DIRECTIONS, 3)
    answers = answers[:-3 * DIRECTIONS]
    scale = float(np.abs(answers).max(initial=0.0)) or 1.0
    swapped = answers[: 3 * PAIRS].reshape(PAIRS, 3)
    order = float(np.abs(swapped[:, 0] - swapped[:, 1]).max()) / scale
    repeated = max(float(np.abs(swapped[:, 0] - swapped[:, 2]).max()), abs(answers[-1] - answers[-2])) / scale
    zero = answers[-1]
    threshold = max(BROKEN, ROUNDING_MULTIPLE * boundary.stats.unit_roundoff, NOISE_MULTIPLE * repeated)
    readings = [_second_differences(answers[3 * PAIRS: -2].reshape(DIRECTIONS, 3), zero),
                _second_differences(large, zero)]
    shown = [curvature for curvature, invariant in readings if invariant and curvature > threshold]
    curvature = float(max(shown) if shown else max(curvature for curvature, _ in readings))
    vectors = getattr(boundary, "vectors", None)
    return ModelClassEvidence(order, curvature, bool(shown), threshold, len(sequences), abs(float(zero)) / scale,
                              getattr(vectors, "d_out", None) or 1)


def probe_counted(boundary, d: int, rng: np.random.Generator, token_scale: float) -> tuple[ModelClassEvidence, int, int]:
    """:func:`probe_model_class` after a failed run, with the queries it asked and replayed at ``boundary``
    (``(evidence, asked, replayed)``: the failed run's result counts them)."""
    asked, replayed = boundary.queries, boundary.replayed
    evidence = probe_model_class(boundary, d, rng, token_scale)
    return evidence, boundary.queries - asked, boundary.replayed - replayed


def model_class_hints(evidence: ModelClassEvidence | None, bias_free: bool = False) -> list[str]:
    """What to try, for the invariants the probes found broken (empty when none is); ``bias_free``: the
    run learned the bias-free model, which a non-zero answer to the zero token rules out."""
    if evidence is None:
        return []
    hints = []
    if bias_free and evidence.output_constant:
        hints.append(f"The zero token's answer is {evidence.offset:.2g} of the largest answer, where the bias-free "
                     "model this run learned answers exactly 0: the layer has biases (value or output biases give "
                     "the output constant c, query biases the score biases u_h; real layers have them). Pass "
                     "bias=True, the default of schedule='auto', 'targeted' and 'lowrank'.")
    if evidence.positions:
        hints.append(f"The answers depend on the order of the earlier tokens (swapping two of them moved an answer by "
                     f"{evidence.order:.2g} of the largest), which attention without positions cannot do: the layer "
                     "encodes positions. For a rotary layer (Llama, Mistral, Qwen2) pass positions='rotary' and "
                     "heads=H (wrap a Hugging Face layer in mhaextract.adapters.rotary.RotaryLayer); positions added "
                     "to the tokens before the layer are outside the model class.")
    if evidence.normalised:
        hints.append(f"Scaling a lone token does not scale its effect: f(2x) - 2f(x) + f(0) and f(4x) - 2f(2x) + f(0) "
                     f"agree and reach {evidence.curvature:.2g} of the largest answer (zero for attention), as "
                     "when a LayerNorm or RMSNorm normalises every token before the attention, or a LayerNorm the "
                     "sum after the residual. For the attention sublayer of a block (its norm, the attention and "
                     "the residual: mhaextract.adapters.normed.attention_sublayer(block)), pass norm='auto' with heads=H "
                     "(docs/norm.md); to learn the attention alone, give the oracle the attention module itself "
                     "(e.g. block.attn of a GPT2Block, not the block or ln_1 followed by attn).")
    return hints
