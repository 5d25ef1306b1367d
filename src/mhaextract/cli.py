"""Command line: ``mhaextract demo`` and friends."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import typer
from rich.console import Console

from .compare import compare
from .learner import UnreliableExtractionWarning, extract
from .model import MultiHeadAttention
from .oracle import OracleError, SimulatedOracle
from .report import extraction_table
from .results import save_extraction
from .transcript import TranscriptError

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
    schedule: str = typer.Option("paper", "--schedule", help="'paper' (exact 4Hd^2-2H+1) or 'lean'"),
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


def load_oracle(spec: str):
    """The callable named by ``package.module:name`` (importable from the current directory, as
    with ``python -m``) or ``path/to/file.py:name``."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise typer.BadParameter(f"expected package.module:callable or file.py:callable, got {spec!r}", param_hint="--oracle")
    try:
        if target.endswith(".py"):
            location = Path(target)
            if not location.is_file():
                raise FileNotFoundError(f"no file {target!r}")
            module_spec = importlib.util.spec_from_file_location(location.stem, location)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(target)
        oracle = getattr(module, name)
    except (ImportError, FileNotFoundError, AttributeError) as error:
        raise typer.BadParameter(f"cannot load {spec!r}: {error}", param_hint="--oracle") from None
    if not callable(oracle):
        raise typer.BadParameter(f"{spec!r} is a {type(oracle).__name__}, not a callable oracle", param_hint="--oracle")
    return oracle


@app.command("extract")
def extract_command(
    oracle: str = typer.Option(..., "--oracle", help="the oracle: package.module:callable or file.py:callable"),
    d: int = typer.Option(..., "--d", help="token dimension"),
    heads: int = typer.Option(None, "--heads", help="number of heads H, if known"),
    max_heads: int = typer.Option(None, "--max-heads", help="a bound H0 >= H* (instead of --heads)"),
    precision: int = typer.Option(None, "--precision", help="bits for the high-precision path (default float64)"),
    seed: int = typer.Option(0, "--seed", help="seeds the queries (a resumed run needs the same)"),
    schedule: str = typer.Option("paper", "--schedule", help="'paper' (exact 4Hd^2-2H+1) or 'lean'"),
    token_scale: float = typer.Option(None, "--token-scale", help="norm of the query tokens (default d**0.25)"),
    transcript: Path = typer.Option(None, "--transcript", help="SQLite transcript: saves every answer, resumes"),
    max_queries: int = typer.Option(None, "--max-queries", help="cap on the queries asked in this run"),
    batch_size: int = typer.Option(1024, "--batch-size", help="sequences per oracle call"),
    out: Path = typer.Option(None, "--out", help="write the result as JSON (and .npz arrays beside it)"),
) -> None:
    """Extract the heads of a user's oracle and print (and save) what it took."""
    console = Console()
    function = load_oracle(oracle)
    if out is not None and out.suffix != ".json":
        raise typer.BadParameter(f"must end in .json, got {str(out)!r}", param_hint="--out")
    try:
        with warnings.catch_warnings():  # failed checks are printed below, in full
            warnings.simplefilter("ignore", UnreliableExtractionWarning)
            result = extract(function, d, heads=heads, max_heads=max_heads, precision=precision, seed=seed,
                             schedule=schedule, token_scale=token_scale, batch_size=batch_size, progress=True, on_failure="warn",
                             transcript=transcript, max_queries=max_queries)
    except (ValueError, OracleError, TranscriptError) as error:  # bad input, budget, oracle, transcript
        console.print(f"[bold red]{type(error).__name__}:[/] {error}", highlight=False)
        for note in getattr(error, "__notes__", []):
            console.print(note, markup=False, highlight=False)
        raise typer.Exit(code=2)
    console.print(extraction_table(result, title=f"mhaextract extract {oracle}"))
    if out is not None:
        json_path, npz_path = save_extraction(result, out)
        console.print(f"wrote {json_path} and {npz_path}")
    if not result.ok:
        console.print("[bold red]The extraction failed its own checks; the heads are not reliable.[/]")
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
                                                 ("adam_steps", adam_steps), ("lbfgs_steps", lbfgs_steps)]
                 if value is not None and value != []}
    try:
        settings = BenchSettings.quick(**overrides) if quick else BenchSettings(**overrides)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    console = Console(width=400)
    run_bench(settings, out_dir=out, console=console)
    console.print(f"wrote {out}/bench.md and {out}/bench.png")


if __name__ == "__main__":  # pragma: no cover
    app()
