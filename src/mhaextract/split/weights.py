"""Each head's attention weights from whole answers split by head (docs/algorithm.md, 'Whole answers
near the vector bound', 'The weights in the output metric'): with the split's ``O_h``, ``P_h`` and
``c``, a query's answer ``f - c = sum_h O_h P_h X^T a_h`` gives every head's weights ``a_h`` by one
least squares, and their log-ratios ``log(a_i / a_N)`` the scores' equations.
"""

from __future__ import annotations

import numpy as np

from .subspaces import Split


#: Preconditioned conjugate-gradient iterations at most for the weights' least squares in the output
#: metric (:func:`attention_weights`), and the reduction of the preconditioned residual norm at which a query
#: stops: the start (each head on its own) is off by the answers' rounding times the split's
#: amplification, which the output metric removes in about 15 iterations at d = 768.
WEIGHT_ITERATIONS, WEIGHT_TOLERANCE = 20, 1e-4
#: Queries per chunk of :func:`attention_weights` (the score queries' oracle calls hold ``ASK_TOKENS`` tokens each).
WEIGHT_CHUNK = 128


def attention_weights(split: Split, X: np.ndarray, outputs: np.ndarray, c: np.ndarray) -> list[np.ndarray]:
    """:func:`chunk_weights`, a chunk of ``WEIGHT_CHUNK`` queries at a time (each query's weights are
    its own; the working memory is about ``6 H r N`` numbers a query)."""
    parts = [chunk_weights(split, X[start:start + WEIGHT_CHUNK], outputs[start:start + WEIGHT_CHUNK], c)
             for start in range(0, len(X), WEIGHT_CHUNK)]
    return [np.concatenate([part[h] for part in parts]) for h in range(len(split.ranks))]


def chunk_weights(split: Split, X: np.ndarray, outputs: np.ndarray, c: np.ndarray) -> list[np.ndarray]:
    """Per head, the attention weights (B, N) the answers imply: the least squares of
    ``f - c = sum_h O_h P_h X^T a_h`` in the output metric, each head's ``1^T a_h = 1`` a row of its
    own (docs/algorithm.md, 'Whole answers near the vector bound', 'The weights in the output
    metric'). In the heads' coordinates ``z = O^+ (f - c)`` that is ``min (z - M a)^T O^T O (z - M a)``
    with ``M = diag(P_h X^T)``: conjugate gradients on its normal equations, preconditioned by each
    head's own least squares (``O_h^T O_h = I``, so that is the metric's block diagonal), started from
    its solution."""
    B, N, _ = X.shape
    heads, R = len(split.ranks), max(split.ranks)
    z = split.coordinates(outputs - c)
    # one product over every token of the chunk (B N, d): the same sums as B products of (N, d), in fewer calls
    projected = (X.reshape(B * N, -1).astype(np.float64) @ np.concatenate(split.P).T).reshape(B, N, -1)
    A = np.zeros((B, heads, R + 1, N))                                             # [P_h X^T; 1^T], padded
    target = np.zeros((B, heads, R + 1))
    start = 0
    for h, rank in enumerate(split.ranks):
        A[:, h, :rank] = projected[:, :, start:start + rank].transpose(0, 2, 1)
        target[:, h, :rank] = z[h]
        start += rank
    A[:, :, R], target[:, :, R] = 1.0, 1.0
    metric = split.metric()

    def weighted(e: np.ndarray) -> np.ndarray:  # the metric on (B, H, R + 1): O^T O on z, 1 on the sum rows
        out = e.copy()
        out[:, :, :R] = (e[:, :, :R].reshape(B, heads * R) @ metric).reshape(B, heads, R)
        return out

    # CG on the whitened unknowns y_h = U_h a_h (A_h = Q_h U_h): the operator is Q^T metric Q, whose
    # block diagonal is the identity; the start y = Q^T target is each head on its own
    Q, upper = np.linalg.qr(A)
    Qt = np.swapaxes(Q, -1, -2)
    operator = lambda v: (Qt @ weighted((Q @ v[..., None])[..., 0])[..., None])[..., 0]  # noqa: E731
    y = (Qt @ target[..., None])[..., 0]
    residual = (Qt @ weighted(target)[..., None])[..., 0] - operator(y)
    direction = residual.copy()
    gamma = (residual ** 2).sum(axis=(1, 2))
    stop = WEIGHT_TOLERANCE ** 2 * gamma
    for _ in range(WEIGHT_ITERATIONS):
        active = gamma > stop
        if not active.any():
            break
        image = operator(direction)
        curvature = (direction * image).sum(axis=(1, 2))
        alpha = np.where(active & (curvature > 0), gamma / np.where(curvature > 0, curvature, 1.0), 0.0)
        y += alpha[:, None, None] * direction
        residual -= alpha[:, None, None] * image
        new_gamma = (residual ** 2).sum(axis=(1, 2))
        direction = residual + (new_gamma / np.where(gamma > 0, gamma, 1.0))[:, None, None] * direction
        gamma = np.where(active, new_gamma, gamma)
    a = np.linalg.solve(upper, y[..., None])[..., 0]
    return [a[:, h] for h in range(heads)]


def log_ratios(a: np.ndarray):
    """Log-ratios (B, m) and their weights (B, m) (the inverse of the log-ratios' sensitivity to the
    weights' error, 0 where a weight is not positive)."""
    positive = (a > 0).all(axis=1)
    safe = np.where(a > 0, a, 1.0)
    ratios = np.log(safe[:, :-1]) - np.log(safe[:, -1:])
    weight = 1.0 / np.sqrt(1.0 / safe[:, :-1] ** 2 + 1.0 / safe[:, -1:] ** 2)
    return ratios, weight * positive[:, None]
