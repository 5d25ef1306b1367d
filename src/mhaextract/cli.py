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
) -> None:
    """Extract a random target through a simulated oracle and print what it took."""
    console = Console()
    if d < 1 or heads < 1:
        raise typer.BadParameter("--d and --heads must be positive")
    target = MultiHeadAttention.random(d, heads, seed=seed)
    oracle = SimulatedOracle(target, precision=precision)
    with warnings.catch_warnings():  # failed checks are printed below, in full
        warnings.simplefilter("ignore", UnreliableExtractionWarning)
        result = extract(oracle, d, heads=heads, precision=precision, seed=seed + 1, progress=True, on_failure="warn")
    reference = result.model_hp if result.model_hp is not None else result.model
    comparison = compare(reference, target) if reference is not None else None
    console.print(extraction_table(result, comparison, title=f"mhaextract demo (seed {seed})"))
    if not result.ok:
        console.print("[bold red]The extraction failed its own checks; the heads above are not reliable.[/]")
        for check in result.failed_checks:
            console.print(f"  {check}")
        raise typer.Exit(code=1)


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="d in {4, 8}, H in {1, 2}, fewer restarts and steps"),
    out: str = typer.Option("benchmarks/out", "--out", help="folder for bench.md and bench.png"),
    d: list[int] = typer.Option(None, "--d", help="token dimensions (repeat the option; default 4 8 16)"),
    heads: list[int] = typer.Option(None, "--heads", help="head counts (repeat the option; default 1 2 3)"),
    seed: int = typer.Option(0, "--seed", help="seeds the targets, the queries and the students"),
    restarts: int = typer.Option(None, "--restarts", help="distillation restarts (default 12, quick 6)"),
    adam_steps: int = typer.Option(None, "--adam-steps", help="distillation Adam steps (default 1500, quick 600)"),
    lbfgs_steps: int = typer.Option(None, "--lbfgs-steps", help="L-BFGS iterations per restart (default 300, quick 200)"),
) -> None:
    """mhaextract beside the single-head algorithm and gradient distillation, same targets, same run."""
    from .bench import BenchSettings, run_bench

    overrides = {name: value for name, value in [("ds", d), ("heads", heads), ("seed", seed), ("restarts", restarts),
                                                 ("adam_steps", adam_steps), ("lbfgs_steps", lbfgs_steps)] if value}
    try:
        settings = BenchSettings.quick(**overrides) if quick else BenchSettings(**overrides)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    console = Console(width=400)
    run_bench(settings, out_dir=out, console=console)
    console.print(f"wrote {out}/bench.md and {out}/bench.png")


if __name__ == "__main__":  # pragma: no cover
    app()
