"""Do the certified balls reproduce the answers? (docs/reliability.md)

Each instance's balls are proven to enclose the exact parameters *of the rational function it
fitted with H* poles*. When two heads are closer than the answers' precision resolves, the
instances fit H* - 1 poles and the proof holds for that merged model, not for the oracle: the
balls then contain neither head (e.g. W_1 = W_0 + 1e-40 E at 256 bits). The oracle's own
answers expose it: if the balls enclosed the oracle's parameters, the model evaluated in ball
arithmetic with those balls would contain the exact output, and so overlap every answer's ball
(the answer within one ulp). :func:`balls_reproduce_answers` evaluates a few of the queries
asked that way; a ball that misses its answer disproves the enclosure. With biases (the biased
grid, docs/algorithm.md, 'Biases: affine scores and an output constant') the score biases ``u_h`` and the constant ``c``
are evaluated as balls too.
"""

from __future__ import annotations

import numpy as np
from flint import arb

from ..models.attention import MultiHeadAttention
from .highprec import mpf_array, to_arb, working_precision


def exact_model(W_balls, v_balls, u_balls=None, c_ball=None) -> MultiHeadAttention:
    """The model of the balls' exact midpoints (mpf); ``u`` zero and ``c`` 0 when not learned."""
    u = None if u_balls is None else mpf_array(u_balls)
    c = 0.0 if c_ball is None else mpf_array(np.array([c_ball], dtype=object))[0]
    return MultiHeadAttention(mpf_array(W_balls), mpf_array(v_balls), u, c)


def _output(W, v, u, c, sequence) -> arb:
    """``c + sum_h v_h^T sum_i softmax_i(x_i^T (W_h x_N + u_h)) x_i`` with ball parameters (nested
    lists W[h][a][b], v[h][a], u[h][a], and a ball c)."""
    H, d = len(v), len(v[0])
    X = [[to_arb(float(value)) for value in token] for token in sequence]
    final = X[-1]
    total = c
    for h in range(H):
        query = [sum((W[h][a][b] * final[b] for b in range(d)), u[h][a]) for a in range(d)]
        scores = [sum((token[a] * query[a] for a in range(d)), arb(0)) for token in X]
        top = max(float(score.mid()) for score in scores)
        weights = [(score - top).exp() for score in scores]
        denominator = sum(weights, arb(0))
        values = [sum((v[h][a] * token[a] for a in range(d)), arb(0)) for token in X]
        total += sum((w * y for w, y in zip(weights, values)), arb(0)) / denominator
    return total


def balls_reproduce_answers(W_balls, v_balls, sequences, answers, precision: int, count: int = 16,
                            u_balls=None, c_ball=None) -> tuple[int, int]:
    """``(misses, tried)``: how many of ``count`` queries (spread over those asked) have an output
    ball, from the parameter balls (``u_balls``, ``c_ball``: the biases, zero when None), disjoint
    from their answer ball."""
    if not len(sequences) or W_balls is None or not W_balls.shape[0]:
        return 0, 0
    picks = np.unique(np.linspace(0, len(sequences) - 1, min(count, len(sequences))).astype(int))
    misses = 0
    with working_precision(precision + 64):
        W = [[[to_arb(W_balls[h, a, b]) for b in range(W_balls.shape[2])] for a in range(W_balls.shape[1])]
             for h in range(W_balls.shape[0])]
        v = [[to_arb(v_balls[h, a]) for a in range(v_balls.shape[1])] for h in range(v_balls.shape[0])]
        u = [[arb(0) if u_balls is None else to_arb(u_balls[h, a]) for a in range(v_balls.shape[1])]
             for h in range(v_balls.shape[0])]
        c = arb(0) if c_ball is None else to_arb(c_ball)
        for p in picks:
            output = _output(W, v, u, c, np.asarray(sequences[p], dtype=np.float64))
            if not output.overlaps(to_arb(answers[p])):
                misses += 1
    return misses, len(picks)
