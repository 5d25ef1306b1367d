"""Command line: ``mhaextract demo`` and friends."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from ..api import extract
from ..checks.base import ExtractionError, UnreliableExtractionWarning
from ..checks.verify import verify, verify_length_option
from ..models.compare import compare
from ..models.attention import MultiHeadAttention
from ..oracle.boundary import OracleError
from ..oracle.noise import AdditiveNoise
from ..oracle.simulated import SimulatedOracle
from ..oracle.transcript import TranscriptError
from .report import extraction_table
from ..run.result import save_extraction
from .. import families  # noqa: F401  (the learners registered, for their names)
from ..run.learner import family_options, learner_class, learner_names, option_meanings, options_table
from ..run.validation import head_count, nonnegative_number, positive_int, token_scale_option

app = typer.Typer(add_completion=False, help="Learn multi-head softmax attention from black-box value queries.")

#: The --schedule help of every command: the registry's names, never a list kept here.
SCHEDULE_HELP = ("query schedule, one of " + ", ".join(repr(name) for name in learner_names())
                 + " (see docs/algorithm.md)")
FLOAT64_ONLY = "--noise, --samples, --refine, --answer-error and --verify-queries are float64 options (omit --precision)"


def _checked(hint: str, rule, *args):
    """``rule(*args)`` (a :mod:`mhaextract.run.validation` rule or the schedule registry's lookup), its
    ValueError turned into a usage error naming the option ``hint`` (exit code 2, no traceback)."""
    try:
        return rule(*args)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint=hint) from None


def _number_or_text(value):
    """A command-line value that may be a number or a word ('auto')."""
    try:
        return None if value is None else float(value)
    except ValueError:
        return value


def _int_or_text(value: str):
    """A command-line value that should be an integer (left as text if it is not, for the message)."""
    try:
        return int(value)
    except ValueError:
        return value


RANK_HELP = ("a bound r on every head's rank, or 'auto' to find it: the float64 low-rank schedule, about "
             "2.1H(2dr - r^2) queries (docs/algorithm.md, 'Low-rank heads')")


def _rank_option(value: str | None):
    """``--rank``: None, ``"auto"`` or an int (its range is checked with the run's other settings)."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"must be an integer r >= 1 or 'auto', got {value!r}", param_hint="--rank") from None


def _common_options(d, precision, seed, schedule) -> None:
    """The options ``demo`` and ``extract`` share, checked before anything runs."""
    _checked("--d", positive_int, "d", d)
    if precision is not None:
        _checked("--precision", positive_int, "precision", precision, 64)
    _checked("--seed", positive_int, "seed", seed, 0)
    if schedule != "auto":
        _checked("--schedule", learner_class, schedule)


def _option_pairs(pairs: list[str]) -> dict:
    """``--option NAME=VALUE`` pairs as keywords of :func:`mhaextract.extract`: true/false/none as
    Python's, numbers as numbers, the rest as text; a name no learner takes is refused."""
    known, options = family_options(), {}
    for pair in pairs:
        name, equals, text = pair.partition("=")
        if not equals or not name:
            raise typer.BadParameter(f"expected NAME=VALUE, got {pair!r}", param_hint="--option")
        if name not in known:
            raise typer.BadParameter(f"no learner takes {name!r}; the family options are {', '.join(sorted(known))} "
                                     "(mhaextract schedules lists them by learner)", param_hint="--option")
        words = {"true": True, "false": False, "none": None}
        options[name] = words[text.lower()] if text.lower() in words and name != "positions" else _number_or_text(text)
    return options


def _robust_options(precision, samples, answer_error, refine, verify_queries=0) -> dict:
    """The float64 options as keywords of :func:`mhaextract.extract` (empty in high precision)."""
    if samples is not None:
        _checked("--samples", positive_int, "samples", samples)
    if answer_error is not None:
        _checked("--answer-error", nonnegative_number, "answer error", answer_error, "a bound on |answer - truth|",
                 ValueError)
    if precision is not None:
        if samples is not None or answer_error is not None or refine or verify_queries:
            raise typer.BadParameter(FLOAT64_ONLY)
        return {}
    # --refine not given: the schedule decides (paper and lean refine noisy answers, docs/algorithm.md,
    # 'The lean schedule')
    return {"samples_per_instance": samples, "refine": True if refine else None, "answer_error": answer_error}


def _writable_folder(path: Path | None, hint: str, suffix: str | None = None) -> None:
    """Refuse, before the run, an output file that could not be written: a wrong ``suffix``, an
    existing folder of that name (or of the ``.npz`` beside a ``.json``), a folder that does not
    exist, is a file or cannot be written."""
    if path is None:
        return
    if suffix is not None and path.suffix != suffix:
        raise typer.BadParameter(f"must be a file name ending in {suffix}, got {str(path)!r}", param_hint=hint)
    for written in (path, path.with_suffix(".npz")) if path.suffix == ".json" else (path,):
        if written.is_dir():
            raise typer.BadParameter(f"{str(written)!r} is a folder; name a file in it", param_hint=hint)
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        raise typer.BadParameter(f"{str(folder)!r} is a file, not a folder", param_hint=hint)
    if not folder.is_dir():
        raise typer.BadParameter(f"the folder {str(folder)!r} does not exist", param_hint=hint)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"the folder {str(folder)!r} is not writable", param_hint=hint)


def _creatable_folder(folder: Path, hint: str) -> None:
    """Refuse, before the run, an output folder that could not be made or written: a file on its path
    or an existing ancestor that cannot be written."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise typer.BadParameter(f"{str(existing)!r} is a file, so {str(folder)!r} cannot be a folder",
                                 param_hint=hint)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"the folder {str(existing)!r} is not writable", param_hint=hint)


def _oracle_failure(error: Exception, spec: str) -> str | None:
    """One line for an exception the user's oracle raised (named by ``spec``): the oracle, the queries
    it was answering (from the note the oracle boundary adds) and the exception; None for any other."""
    if not getattr(error, "raised_by_oracle", False):
        return None
    where = next((note.splitlines()[0] for note in getattr(error, "__notes__", [])
                  if note.startswith("mhaextract: raised by the oracle")), "")
    where = where.removeprefix("mhaextract: raised by the oracle ").split("; the first sequence", 1)[0]
    if isinstance(error, SystemExit):  # sys.exit inside the oracle ends its answers, not the command silently
        message = f"SystemExit (it called sys.exit({error.code!r}))"
    else:
        message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"the oracle {spec} raised {message}" + (f" {where}" if where else "")


def _failure_code(console: Console, error: Exception, spec: str) -> int:
    """Print why the run named by the oracle ``spec`` stopped and return the exit code: 2 for the
    oracle's own exception (one line), bad input, a spent budget or a refused transcript; 1 for an
    extraction whose arithmetic broke down after the queries. Anything else is a bug: re-raised."""
    oracle_line = _oracle_failure(error, spec)
    if oracle_line is not None:
        console.print(f"[bold red]Error:[/] {oracle_line}", highlight=False, soft_wrap=True)
        return 2
    if isinstance(error, (ValueError, OracleError, TranscriptError)):
        console.print(f"[bold red]{type(error).__name__}:[/] {error}", highlight=False)
        for note in getattr(error, "__notes__", []):
            console.print(note, markup=False, highlight=False)
        return 2
    if isinstance(error, ExtractionError):
        console.print(f"[bold red]ExtractionError:[/] {error}", highlight=False)
        return 1
    raise error


def _interrupted(console: Console, transcript: Path | None) -> int:
    """Print what a Ctrl-C left behind and how to go on; the exit code of an interrupted command (130)."""
    if transcript is not None:
        console.print(f"Interrupted. Every answer received is in the transcript {str(transcript)!r}: run the same "
                      "command again (same --seed and --transcript) to resume; it re-asks only the batch that was "
                      "in flight and the few queries of its check that the oracle is the same.", highlight=False,
                      soft_wrap=True)
    else:
        console.print("Interrupted; the answers received are lost, since no transcript was kept. Pass --transcript "
                      "run.sqlite to make a run resumable after an interruption.", highlight=False, soft_wrap=True)
    return 130


@contextmanager
def _failed_check_messages():
    """Collect the messages of ``UnreliableExtractionWarning`` (the failed checks with the hints of
    what to try that ``ExtractionError`` carries in Python) instead of showing them; every other
    warning is shown as usual. Yields the list the messages are appended to."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnreliableExtractionWarning)
        try:
            yield messages
        finally:
            for warning in caught:
                if issubclass(warning.category, UnreliableExtractionWarning):
                    messages.append(str(warning.message))
                else:
                    warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def _print_failed(console: Console, result, messages: list[str], headline: str) -> None:
    """The run's failed checks with what to try (the collected warning messages), else its failed checks."""
    console.print(f"[bold red]{headline}[/]")
    if messages:
        for message in messages:
            for line in message.splitlines()[1:]:  # the first line restates the headline
                console.print(line, highlight=False, soft_wrap=True)
        return
    for check in result.failed_checks:
        console.print(f"  {check}", highlight=False)


def _save_safely(console: Console, result, out: Path) -> bool:
    """Write the finished run to ``out``; if that fails (the folder went away, the disk is full), to a
    fresh temporary folder instead, and say where. False when ``out`` could not be written."""
    try:
        json_path, npz_path = save_extraction(result, out)
        console.print(f"wrote {json_path} and {npz_path}", highlight=False)
        return True
    except OSError as error:
        console.print(f"[bold red]Error:[/] could not write --out {str(out)!r} ({error.strerror or error})",
                      highlight=False)
    import tempfile

    try:
        json_path, npz_path = save_extraction(result, Path(tempfile.mkdtemp(prefix="mhaextract-")) / out.name)
        console.print(f"the finished run was written to {json_path} and {npz_path} instead", highlight=False,
                      soft_wrap=True)
    except OSError as error:  # nowhere to write: the model on the terminal, so the queries are not lost
        model = result.model
        console.print(f"nor to a temporary folder ({error}); the model, in full precision:", highlight=False)
        if model is not None:
            console.print(json.dumps(model.to_document(exact=False)[0]), highlight=False, soft_wrap=True)
    return False


@app.callback()
def main() -> None:
    """mhaextract: extraction of multi-head attention (arXiv 2608.03294)."""


@app.command()
def demo(
    d: int = typer.Option(8, "--d", help="token dimension"),
    heads: int = typer.Option(3, "--heads", help="number of heads of the random target"),
    precision: int = typer.Option(None, "--precision", help="bits for the high-precision path (default float64)"),
    seed: int = typer.Option(0, "--seed", help="seeds the target and the queries"),
    schedule: str = typer.Option("auto", "--schedule", help=SCHEDULE_HELP),
    noise: float = typer.Option(None, "--noise", help="float64: add uniform noise |e| <= NOISE to every answer"),
    samples: int = typer.Option(None, "--samples", help="float64: samples per instance (> 2H+1 oversamples)"),
    refine: bool = typer.Option(False, "--refine", help="float64: least-squares refinement of all parameters"),
    transformer: bool = typer.Option(False, "--transformer", help="target: attention + bias-free ReLU FFN"),
    hidden: int = typer.Option(8, "--hidden", help="hidden units of the --transformer target"),
    rank: str = typer.Option(None, "--rank", help=RANK_HELP + "; the target's heads then have rank r (d // heads "
                             "for 'auto')"),
) -> None:
    """Extract a random target through a simulated oracle, verify it on fresh queries, print what it took."""
    console = Console()
    _common_options(d, precision, seed, schedule)
    _checked("--heads", positive_int, "heads", heads)
    _checked("--hidden", positive_int, "hidden", hidden)
    if noise is not None:
        _checked("--noise", nonnegative_number, "noise", noise, "a bound on |answer error|", ValueError)
    if precision is not None and noise is not None:
        raise typer.BadParameter(FLOAT64_ONLY)
    robust = _robust_options(precision, samples, noise, refine)
    rank = _rank_option(rank)
    if transformer and (noise is not None or samples is not None or refine or rank is not None):
        raise typer.BadParameter("--noise, --samples, --refine and --rank apply to the attention demo, "
                                 "not --transformer")
    if transformer:
        raise typer.Exit(code=_transformer_demo(console, d, heads, hidden, precision, seed))
    target_rank = None if rank is None else max(1, d // heads) if rank == "auto" else rank
    target = _checked("--rank", MultiHeadAttention.random, d, heads, seed, False, target_rank)
    if rank is not None:
        robust["rank"] = rank
    oracle = SimulatedOracle(target, precision=precision)
    if noise is not None:
        oracle = AdditiveNoise(oracle, noise, seed=seed + 2)
    try:
        with _failed_check_messages() as failure_messages:  # printed below, in full, with what to try
            result = extract(oracle, d, heads=heads, precision=precision, seed=seed + 1, schedule=schedule,
                             progress=True, on_failure="warn", **robust)
    except ValueError as error:  # the simulated oracle is sound: a ValueError is about the options
        raise typer.BadParameter(str(error)) from None
    reference = result.model_hp if result.model_hp is not None else result.model
    comparison = compare(reference, target) if reference is not None else None
    if precision is None and result.model is not None:
        result = result.with_verification(verify(result, oracle, verify_queries=256, seed=seed + 3))
    console.print(extraction_table(result, comparison, title=f"mhaextract demo (seed {seed})"))
    if not result.ok:
        _print_failed(console, result, failure_messages,
                      "The extraction failed its own checks; the heads above are not reliable.")
        raise typer.Exit(code=1)


def _transformer_demo(console, d: int, heads: int, hidden: int, precision, seed: int) -> int:
    """``mhaextract demo --transformer``: a random target through a simulated oracle; returns the
    exit code (1 when the extraction failed its checks)."""
    import warnings

    from ..checks.base import UnreliableExtractionWarning
    from ..models.transformer import Transformer1L
    from ..transformer.learn import extract_transformer

    hidden = positive_int("hidden", hidden)
    target = Transformer1L.random(d, heads, hidden, seed=seed)
    with warnings.catch_warnings():  # failed checks are printed below, in full
        warnings.simplefilter("ignore", UnreliableExtractionWarning)
        result = extract_transformer(SimulatedOracle(target, precision=precision), d, heads=heads, hidden=hidden,
                                     precision=precision, seed=seed + 1, progress=True, on_failure="warn")
    found = result.model_hp if result.model_hp is not None else result.model
    comparison = compare(found, target) if found is not None else None
    console.print(extraction_table(result, comparison, title=f"mhaextract demo --transformer (seed {seed})"))
    if not result.ok:
        console.print("[bold red]The extraction failed its own checks; no Transformer is returned as reliable.[/]")
        for check in result.failed_checks:
            console.print(f"  {check}")
        return 1
    return 0


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
    except Exception as error:  # the module itself failed (a syntax error, an exception at import)
        raise typer.BadParameter(f"cannot load {spec!r}: {type(error).__name__}: {error}",
                                 param_hint="--oracle") from None
    if not callable(oracle):
        raise typer.BadParameter(f"{spec!r} is a {type(oracle).__name__}, not a callable oracle", param_hint="--oracle")
    return oracle


@app.command("schedules")
def schedules_command() -> None:
    """List the learners of the registry: name, family, what it learns and the options it takes."""
    from rich.table import Table

    table = Table(title="learners (extract --schedule NAME; family options with --option NAME=VALUE)")
    for column in ("name", "family", "learns", "options"):
        table.add_column(column)
    for row in options_table():
        table.add_row(*row)
    meanings = Table(title="family options: what each means to the learners that take it")
    for column in ("option", "learners", "meaning"):
        meanings.add_column(column)
    for row in option_meanings():
        meanings.add_row(*row)
    console = Console()
    console.print(table)
    console.print(meanings)


@app.command("extract")
def extract_command(
    oracle: str = typer.Option(..., "--oracle", help="the oracle: package.module:callable or file.py:callable"),
    d: int = typer.Option(..., "--d", help="token dimension"),
    heads: int = typer.Option(None, "--heads", help="number of heads H, if known"),
    max_heads: int = typer.Option(None, "--max-heads", help="a bound H0 >= H* (instead of --heads)"),
    precision: int = typer.Option(None, "--precision", help="bits for the high-precision path (default float64)"),
    seed: int = typer.Option(0, "--seed", help="seeds the queries (a resumed run needs the same)"),
    schedule: str = typer.Option("auto", "--schedule", help=SCHEDULE_HELP),
    token_scale: str = typer.Option(None, "--token-scale", help="norm of the query tokens, or 'auto' (found by probe "
                                    "queries; the default for --schedule auto/targeted, d**0.25 for the others)"),
    samples: int = typer.Option(None, "--samples", help="float64: samples per instance (> 2H+1 oversamples)"),
    refine: bool = typer.Option(False, "--refine", help="float64: least-squares refinement of all parameters"),
    answer_error: float = typer.Option(None, "--answer-error",
                                       help="float64: a bound on every answer's absolute error, if known"),
    verify_queries: int = typer.Option(0, "--verify-queries", "--verify", help="float64: fresh random queries to verify the result on "
                                       "after the run (not capped by --max-queries, not in the transcript)"),
    verify_length: int = typer.Option(None, "--verify-length", help="longest fresh query of the run's own "
                                      "verification, in tokens (default 256; 0 turns it off; docs/algorithm.md, "
                                      "'Approximate answers: certificate, oversampling, refinement, verification')"),
    transcript: Path = typer.Option(None, "--transcript", help="SQLite transcript: saves every answer, resumes"),
    max_queries: int = typer.Option(None, "--max-queries", help="cap on the queries asked in this run"),
    batch_size: int = typer.Option(1024, "--batch-size", help="sequences per oracle call"),
    out: Path = typer.Option(None, "--out", help="write the result as JSON (and .npz arrays beside it)"),
    rank: str = typer.Option(None, "--rank", help=RANK_HELP),
    option: list[str] = typer.Option([], "--option", "-o", help="a family option of the learner as NAME=VALUE "
                                     "(repeatable; e.g. -o positions=rotary -o key_bias=true; see `mhaextract "
                                     "schedules`)"),
) -> None:
    """Extract the heads of a user's oracle and print (and save) what it took."""
    console = Console()
    _common_options(d, precision, seed, schedule)
    _checked("--heads/--max-heads", head_count, heads, max_heads)
    token_scale = _checked("--token-scale", token_scale_option, _number_or_text(token_scale))
    if max_queries is not None:
        _checked("--max-queries", positive_int, "max_queries", max_queries, 0)
    _checked("--batch-size", positive_int, "batch_size", batch_size)
    _checked("--verify-queries", positive_int, "verify_queries", verify_queries, 0)
    _checked("--verify-length", verify_length_option, verify_length)
    robust = _robust_options(precision, samples, answer_error, refine, verify_queries)
    rank = _rank_option(rank)
    if rank is not None:
        robust["rank"] = rank
    robust.update(_option_pairs(option))
    _writable_folder(out, "--out", ".json")
    _writable_folder(transcript, "--transcript")
    function = load_oracle(oracle)
    try:
        with _failed_check_messages() as failure_messages:  # printed below, in full, with what to try
            result = extract(function, d, heads=heads, max_heads=max_heads, precision=precision, seed=seed,
                             schedule=schedule, token_scale=token_scale, batch_size=batch_size, progress=True,
                             on_failure="warn", transcript=transcript, max_queries=max_queries,
                             verify_length=verify_length, **robust)
    except KeyboardInterrupt:
        raise typer.Exit(code=_interrupted(console, transcript)) from None
    except (Exception, SystemExit) as error:  # SystemExit: the oracle's own sys.exit (re-raised if not)
        raise typer.Exit(code=_failure_code(console, error, oracle)) from None
    verification_error = None
    if verify_queries and result.model is not None:
        try:  # another stream than the run's (seed): fresh queries
            result = result.with_verification(verify(result, function, verify_queries=verify_queries, seed=seed + 1,
                                                     batch_size=batch_size, progress=True))
        except Exception as error:  # the finished run is still printed and saved below
            verification_error = error
    console.print(extraction_table(result, title=f"mhaextract extract {oracle}"))
    if result.verification is not None:
        console.print(str(result.verification), highlight=False)
    if out is not None and not _save_safely(console, result, out):
        raise typer.Exit(code=2)
    if verification_error is not None:
        console.print("The run finished; its verification on fresh queries did not:", highlight=False)
        raise typer.Exit(code=_failure_code(console, verification_error, oracle))
    verification_failed = result.verification is not None and not result.verification.passed
    if not result.ok or verification_failed:
        _print_failed(console, result, failure_messages,
                      "The extraction failed its own checks or its verification; the heads are not reliable.")
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
    head_values = tuple(_checked("--heads", positive_int, "every head count", _int_or_text(part.strip()))
                        for part in heads.split(",") if part.strip())
    if not head_values:
        raise typer.BadParameter(f"must be comma-separated head counts, got {heads!r}", param_hint="--heads")
    eps_values = _floats(eps, "--eps")
    _checked("--d", positive_int, "d", d)
    _checked("--seeds", positive_int, "seeds", seeds)
    _writable_folder(output, "--output", ".png")
    points = noise_sweep(d, head_values, eps_values, seeds, refine=refine, progress=True)
    moved = False
    try:
        plot_noise_sweep(points, output, d)
    except OSError as error:  # the sweep is done: its figure goes to a temporary folder instead
        import tempfile

        console.print(f"[bold red]Error:[/] could not write --output {str(output)!r} ({error.strerror or error})",
                      highlight=False)
        output = Path(tempfile.mkdtemp(prefix="mhaextract-")) / output.name
        plot_noise_sweep(points, output, d)
        console.print(f"wrote the figure to {output} instead", highlight=False, soft_wrap=True)
        moved = True
    covered = [p for p in points if p.eps < p.valid_below]
    held = sum(p.error <= p.bound for p in covered)
    console.print(f"wrote {output}: {len(points)} runs (d = {d}, H in {head_values}); {len(covered)} with eps below "
                  f"valid_below, the certificate held in {held} of them")
    if moved:
        raise typer.Exit(code=2)


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
    _creatable_folder(Path(out), "--out")
    for written in ("bench.md", "bench.png"):
        if (Path(out) / written).is_dir():
            raise typer.BadParameter(f"{str(Path(out) / written)!r} is a folder", param_hint="--out")
    console = Console(width=400)
    run_bench(settings, out_dir=out, console=console)
    console.print(f"wrote {out}/bench.md and {out}/bench.png")


if __name__ == "__main__":  # pragma: no cover
    app()
