"""Do the certified balls reproduce the answers? (docs/reliability.md)

Each instance's balls are proven to enclose the exact parameters *of the rational function it
fitted with H* poles*. When two heads are closer than the answers' precision resolves, the
instances fit H* - 1 poles and the proof holds for that merged model, not for the oracle: the
balls then contain neither head (issue 12, W_1 = W_0 + 1e-40 E at 256 bits). The oracle's own
answers expose it: if the balls enclosed the oracle's parameters, the model evaluated in ball
arithmetic with those balls would contain the exact output, and so overlap every answer's ball
(the answer within one ulp). :func:`balls_reproduce_answers` evaluates a few of the queries
asked that way; a ball that misses its answer disproves the enclosure.
"""

from __future__ import annotations

import numpy as np
from flint import arb

from .highprec import to_arb, working_precision


def _output(W, v, sequence) -> arb:
    """``sum_h v_h^T sum_i softmax_i(x_i^T W_h x_N) x_i`` with ball parameters (nested lists W[h][a][b], v[h][a])."""
    H, d = len(v), len(v[0])
    X = [[to_arb(float(value)) for value in token] for token in sequence]
    final = X[-1]
    total = arb(0)
    for h in range(H):
        query = [sum((W[h][a][b] * final[b] for b in range(d)), arb(0)) for a in range(d)]
        scores = [sum((token[a] * query[a] for a in range(d)), arb(0)) for token in X]
        top = max(float(score.mid()) for score in scores)
        weights = [(score - top).exp() for score in scores]
        denominator = sum(weights, arb(0))
        values = [sum((v[h][a] * token[a] for a in range(d)), arb(0)) for token in X]
        total += sum((w * y for w, y in zip(weights, values)), arb(0)) / denominator
    return total


def balls_reproduce_answers(W_balls, v_balls, sequences, answers, precision: int, count: int = 16) -> tuple[int, int]:
    """``(misses, tried)``: how many of ``count`` queries (spread over those asked) have an output
    ball, from the parameter balls, disjoint from their answer ball."""
    if not len(sequences) or W_balls is None or not W_balls.shape[0]:
        return 0, 0
    picks = np.unique(np.linspace(0, len(sequences) - 1, min(count, len(sequences))).astype(int))
    misses = 0
    with working_precision(precision + 64):
        W = [[[to_arb(W_balls[h, a, b]) for b in range(W_balls.shape[2])] for a in range(W_balls.shape[1])]
             for h in range(W_balls.shape[0])]
        v = [[to_arb(v_balls[h, a]) for a in range(v_balls.shape[1])] for h in range(v_balls.shape[0])]
        for p in picks:
            output = _output(W, v, np.asarray(sequences[p], dtype=np.float64))
            if not output.overlaps(to_arb(answers[p])):
                misses += 1
    return misses, len(picks)
