"""The noise sweep behind ``mhaextract report noise``: parameter error against answer error.

For every H and every eps, seeded random targets are extracted through
:class:`~mhaextract.oracle.noise.AdditiveNoise` (``|e| <= eps``, declared as ``answer_error``); each run
records the measured max relative parameter error (:func:`mhaextract.compare`), its certificate
``error_bound(eps)`` (infinite when eps is above the run's ``valid_below``) and whether its checks
passed. :func:`plot_noise_sweep` draws error against eps, log-log, one line per H (median over
seeds) with the certificate ``C eps`` beside it (dashed; median of the finite bounds).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..api import extract
from ..checks.base import UnreliableExtractionWarning
from ..models.compare import compare
from ..models.attention import MultiHeadAttention
from ..oracle.progress import ProgressBar
from ..oracle.noise import AdditiveNoise
from ..oracle.simulated import SimulatedOracle


@dataclass
class SweepPoint:
    """One run of the sweep."""

    heads: int
    eps: float
    seed: int
    error: float
    bound: float
    valid_below: float
    ok: bool


def noise_sweep(d: int, heads: tuple[int, ...], eps_values: tuple[float, ...], seeds: int,
                refine: bool = False, progress: bool = False) -> list[SweepPoint]:
    """Run the sweep; ``progress`` shows a rich bar. Interrupting keeps nothing half-written:
    the caller gets either all points or the KeyboardInterrupt."""
    points = []
    total = len(heads) * len(eps_values) * seeds
    with ProgressBar(progress, "noise sweep", total) as advance:
        for H in heads:
            for eps in eps_values:
                for seed in range(seeds):
                    target = MultiHeadAttention.random(d, H, seed=1000 * H + seed)
                    oracle = AdditiveNoise(SimulatedOracle(target), eps, seed=seed)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UnreliableExtractionWarning)
                        result = extract(oracle, d, heads=H, seed=seed, schedule="paper", answer_error=eps, refine=refine,
                                         on_failure="warn")
                    error = float(compare(result.model, target).max_rel) if result.model is not None else np.inf
                    bound = result.error_bound(eps) if result.certificate is not None else np.inf
                    valid = result.valid_below if result.certificate is not None else 0.0
                    points.append(SweepPoint(H, float(eps), seed, error, bound, valid, result.ok))
                    advance(1)
    return points


def plot_noise_sweep(points: list[SweepPoint], path, d: int, title: str | None = None) -> None:
    """Write the PNG: median measured error (solid, markers) and median finite bound (dashed) per H."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, H in enumerate(sorted({p.heads for p in points})):
        colour = colours[index % len(colours)]
        eps_values = sorted({p.eps for p in points if p.heads == H})
        errors = [np.median([p.error for p in points if p.heads == H and p.eps == e]) for e in eps_values]
        bounds = [[p.bound for p in points if p.heads == H and p.eps == e] for e in eps_values]
        axes.loglog(eps_values, np.minimum(errors, 1e3), "o-", color=colour, label=f"H = {H}: measured (median)")
        finite = [(e, np.median([b for b in bs if np.isfinite(b)])) for e, bs in zip(eps_values, bounds)
                  if any(np.isfinite(b) for b in bs)]
        if finite:
            axes.loglog(*zip(*finite), "--", color=colour, label=f"H = {H}: certificate 2 C (eps + floor)")
    axes.set_xlabel("answer error bound eps (additive, uniform)")
    axes.set_ylabel("max relative parameter error")
    axes.set_title(title or f"mhaextract: parameter error against answer error (d = {d})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
