"""Command line: ``mhaextract demo`` and friends."""

from __future__ import annotations

import warnings

import typer
from rich.console import Console

from .compare import compare
from .learner import UnreliableExtractionWarning, extract
from .model import MultiHeadAttention
from .oracle import SimulatedOracle
from .report import extraction_table

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
    schedule: str = typer.Option("paper", "--schedule", help="'paper' (exact 4Hd^2-2H+1), 'lean' or 'targeted' (float64, H <= d)"),
) -> None:
    """Extract a random target through a simulated oracle and print what it took."""
    console = Console()
    if d < 1 or heads < 1:
        raise typer.BadParameter("--d and --heads must be positive")
    target = MultiHeadAttention.random(d, heads, seed=seed)
    oracle = SimulatedOracle(target, precision=precision)
    with warnings.catch_warnings():  # failed checks are printed below, in full
        warnings.simplefilter("ignore", UnreliableExtractionWarning)
        result = extract(oracle, d, heads=heads, precision=precision, seed=seed + 1, schedule=schedule,
                         progress=True, on_failure="warn")
    reference = result.model_hp if result.model_hp is not None else result.model
    comparison = compare(reference, target) if reference is not None else None
    console.print(extraction_table(result, comparison, title=f"mhaextract demo (seed {seed})"))
    if not result.ok:
        console.print("[bold red]The extraction failed its own checks; the heads above are not reliable.[/]")
        for check in result.failed_checks:
            console.print(f"  {check}")
        raise typer.Exit(code=1)


if __name__ == "__main__":  # pragma: no cover
    app()
