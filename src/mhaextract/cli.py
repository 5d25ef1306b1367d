"""Command line: ``mhaextract demo`` and friends."""

from __future__ import annotations

import warnings

import typer
from rich.console import Console

from pathlib import Path

from .compare import compare
from .learner import UnreliableExtractionWarning, extract
from .model import MultiHeadAttention
from .noise import AdditiveNoise
from .oracle import SimulatedOracle
from .report import extraction_table
from .verify import verify

app = typer.Typer(add_completion=False, help="Learn multi-head softmax attention from black-box value queries.")


@app.callback()
def main() -> None:
    """mhaextract: extraction of multi-head attention (arXiv 2608.03294)."""


@app.command()
def demo(
    d: int = typer.Option(8, "--d", help="token dimension"),
    heads: int = typer.Option(3, "--heads", help="number of heads of the random target"),
    precision: int = typer.Option(None, "--precision", help="bits for the high-precision path (default float64)"),
    seed: int = typer.Option(0, "--seed", help="seeds the target and the queries"),
    noise: float = typer.Option(None, "--noise", help="float64: add uniform noise |e| <= NOISE to every answer"),
    samples: int = typer.Option(None, "--samples", help="float64: samples per instance (> 2H+1 oversamples)"),
    refine: bool = typer.Option(False, "--refine", help="float64: least-squares refinement of all parameters"),
) -> None:
    """Extract a random target through a simulated oracle, verify it on fresh queries, print what it took."""
    console = Console()
    if d < 1 or heads < 1:
        raise typer.BadParameter("--d and --heads must be positive")
    if precision is not None and (noise is not None or samples is not None or refine):
        raise typer.BadParameter("--noise, --samples and --refine are float64 options (omit --precision)")
    if noise is not None and not noise >= 0:
        raise typer.BadParameter("--noise must be >= 0")
    target = MultiHeadAttention.random(d, heads, seed=seed)
    oracle = SimulatedOracle(target, precision=precision)
    if noise is not None:
        oracle = AdditiveNoise(oracle, noise, seed=seed + 2)
    robust = {} if precision is not None else {"samples_per_instance": samples, "refine": refine, "answer_error": noise}
    with warnings.catch_warnings():  # failed checks are printed below, in full
        warnings.simplefilter("ignore", UnreliableExtractionWarning)
        result = extract(oracle, d, heads=heads, precision=precision, seed=seed + 1, progress=True, on_failure="warn",
                         **robust)
    reference = result.model_hp if result.model_hp is not None else result.model
    comparison = compare(reference, target) if reference is not None else None
    if precision is None and result.model is not None:
        verify(result, oracle, n=256, seed=seed + 3)
    console.print(extraction_table(result, comparison, title=f"mhaextract demo (seed {seed})"))
    if not result.ok:
        console.print("[bold red]The extraction failed its own checks; the heads above are not reliable.[/]")
        for check in result.failed_checks:
            console.print(f"  {check}")
        raise typer.Exit(code=1)


report_app = typer.Typer(add_completion=False, help="Reports that run sweeps and write figures.")
app.add_typer(report_app, name="report")


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values or not all(v > 0 for v in values):
        raise typer.BadParameter(f"{name} must be positive numbers, got {text!r}")
    return values


@report_app.command("noise")
def report_noise(
    output: Path = typer.Option(Path("noise.png"), "--output", "-o", help="where to write the PNG"),
    d: int = typer.Option(4, "--d", help="token dimension"),
    heads: str = typer.Option("1,2,3", "--heads", help="comma-separated head counts, one line each"),
    eps: str = typer.Option("1e-14,1e-13,1e-12,1e-11,1e-10,1e-9,1e-8", "--eps", help="comma-separated noise bounds"),
    seeds: int = typer.Option(5, "--seeds", help="random targets per (H, eps)"),
    refine: bool = typer.Option(False, "--refine", help="refine every run"),
) -> None:
    """Sweep additive answer noise, write parameter error against eps (log-log) with the certificate."""
    from .noise_sweep import noise_sweep, plot_noise_sweep

    console = Console()
    head_values = tuple(int(h) for h in _floats(heads, "--heads"))
    eps_values = _floats(eps, "--eps")
    if d < 1 or seeds < 1:
        raise typer.BadParameter("--d and --seeds must be positive")
    if not output.parent.exists():
        raise typer.BadParameter(f"the folder of --output does not exist: {output.parent}")
    points = noise_sweep(d, head_values, eps_values, seeds, refine=refine, progress=True)
    plot_noise_sweep(points, output, d)
    covered = [p for p in points if p.eps < p.valid_below]
    held = sum(p.error <= p.bound for p in covered)
    console.print(f"wrote {output}: {len(points)} runs (d = {d}, H in {head_values}); {len(covered)} with eps below "
                  f"valid_below, the certificate held in {held} of them")


if __name__ == "__main__":  # pragma: no cover
    app()
