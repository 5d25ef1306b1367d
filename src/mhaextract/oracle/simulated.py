"""Simulated oracles: a known model answering in float64 or at a given precision."""

from __future__ import annotations

import numpy as np

from ..models.attention import MultiHeadAttention


class SimulatedOracle:
    """An oracle that answers for a known model, in float64 or at ``precision`` bits.

    Parameters
    ----------
    model : MultiHeadAttention (or any object with ``model(batch, precision=...)``)
    precision : int or None
        None answers float64; an int answers ``mpmath.mpf`` computed in ball arithmetic and
        rounded to ``precision`` bits.

    Examples
    --------
    An oracle takes a list of token sequences, each an (N_i, d) array, and answers the output
    at each one's final token:

    >>> import numpy as np
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> oracle = mx.SimulatedOracle(target)
    >>> oracle([np.eye(3), np.ones((2, 3))]).round(6)
    array([1.120096, 2.378388])
    >>> mx.SimulatedOracle(target, precision=80)([np.eye(3)])
    [mpf('1.1200964933794974')]
    """

    def __init__(self, model: MultiHeadAttention, precision: int | None = None):
        self.model = model
        self.precision = None if precision is None else int(precision)

    def __call__(self, batch):
        return self.model(batch, precision=self.precision)

    def __repr__(self) -> str:
        return f"SimulatedOracle({self.model!r}, precision={self.precision})"


class TorchSimulatedOracle:
    """A float64 oracle for a known model, evaluated with torch on ``device`` (CUDA when present).

    The same ``f(X)`` as :class:`SimulatedOracle` in float64 (docs/algorithm.md, 'The model'), batched per
    query length on the device: for simulating large layers fast. torch is imported on construction.
    """

    def __init__(self, model: MultiHeadAttention, device: str | None = None):
        import torch  # optional dependency

        if model.is_high_precision:
            raise ValueError("TorchSimulatedOracle answers in float64; use SimulatedOracle(model, precision=bits)")
        self._torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model
        self._W = torch.as_tensor(model.W, device=self.device)
        self._v = torch.as_tensor(model.v, device=self.device)

    def __call__(self, batch) -> np.ndarray:
        torch = self._torch
        lengths = np.array([len(sequence) for sequence in batch])
        out = np.empty(len(batch))
        for length in np.unique(lengths):
            index = np.flatnonzero(lengths == length)
            X = torch.as_tensor(np.stack([batch[i] for i in index]), dtype=torch.float64, device=self.device)
            queries = torch.einsum("hde,be->bhd", self._W, X[:, -1, :])  # W_h x_N
            weights = torch.softmax(torch.einsum("bnd,bhd->bhn", X, queries), dim=-1)
            values = torch.einsum("bnd,hd->bhn", X, self._v)
            out[index] = (weights * values).sum(dim=(1, 2)).cpu().numpy()
        return out

    def __repr__(self) -> str:
        return f"TorchSimulatedOracle({self.model!r}, device={str(self.device)!r})"
