"""The command line."""

import pytest
from typer.testing import CliRunner

from mhaextract.tools.cli import app
from mhaextract.attention.registry import schedule_names

runner = CliRunner()


def test_demo_prints_the_table_with_measured_queries():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "3", "--heads", "2", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "queries (measured)" in result.output
    assert "69" in result.output  # 4*2*9 - 4 + 1
    assert "checks" in result.output and "ok" in result.output


def test_demo_high_precision():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "2", "--heads", "3", "--precision", "256"])
    assert result.exit_code == 0, result.output
    assert "256 bits" in result.output
    assert "certified" in result.output


def test_demo_reports_an_unreliable_float64_run_and_exits_nonzero():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "4", "--heads", "5"])
    assert result.exit_code == 1
    assert "FAILED" in result.output and "float64_head_limit" in result.output


def test_demo_rejects_bad_sizes():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "0"])
    assert result.exit_code != 0


def test_demo_lean_schedule_reports_its_formula_and_bound():
    result = runner.invoke(app, ["demo", "--d", "3", "--heads", "2", "--schedule", "lean", "--precision", "128"])
    assert result.exit_code == 0, result.output
    assert "lean formula" in result.output and "lower bound" in result.output


@pytest.mark.parametrize("arguments, option", [
    (["--precision", "0"], "--precision"),
    (["--samples", "0"], "--samples"),
    (["--schedule", "foo"], "--schedule"),
    (["--seed", "-1"], "--seed"),
    (["--noise", "inf"], "--noise"),
    (["--noise", "-1e-9"], "--noise"),
    (["--transformer", "--hidden", "0"], "--hidden"),
    (["--heads", "0"], "--heads"),
    (["--d", "0"], "--d"),
    (["--precision", "128", "--samples", "9"], "float64 options"),
    (["--samples", "3"], "samples_per_instance"),  # below 2H + 1 = 7: the schedule says so
])
def test_demo_refuses_invalid_options_as_usage_errors(arguments, option):
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "3", "--heads", "3"] + arguments)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not a traceback
    assert "Traceback" not in result.output
    assert option in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("command", ["demo", "extract"])
def test_schedule_help_lists_the_registry(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for name in schedule_names():
        assert repr(name) in text


def test_the_report_shows_every_parameter_the_estimate_covers_when_biases_are_learned():
    """The error estimate covers W, v, u and c (compare's max_rel); with biases learned the table
    shows u's and c's errors beside W's and v's, and without them it does not."""
    import mhaextract as mx
    from mhaextract.tools.report import extraction_table
    from rich.console import Console

    rows = {}
    for bias in (True, False):
        target = mx.MultiHeadAttention.random(4, 2, seed=3, bias=bias)
        result = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=0, bias=bias, progress=False)
        console = Console(width=160, record=True)
        console.print(extraction_table(result, mx.compare(result.model, target)))
        rows[bias] = console.export_text()
    assert "max rel. error u" in rows[True] and "rel. error c" in rows[True]
    assert "max rel. error u" not in rows[False] and "rel. error c" not in rows[False]


@pytest.mark.parametrize("rank, found", [("2", "2"), ("auto", "4")])
def test_demo_with_a_rank_extracts_a_low_rank_target(rank, found):
    # --rank r: the target's heads have rank r (d // heads for 'auto'), the run the low-rank schedule.
    result = runner.invoke(app, ["demo", "--d", "16", "--heads", "4", "--rank", rank])
    assert result.exit_code == 0, result.output
    assert "low-rank schedule" in result.output and "checks" in result.output
    assert any(line.split("│")[1].strip() == "rank" and line.split("│")[2].strip() == found
               for line in result.output.splitlines() if line.count("│") >= 3)


@pytest.mark.parametrize("arguments, message", [
    (["--rank", "x"], "must be an integer r >= 1 or 'auto'"),
    (["--rank", "20"], "rank must be an integer 1 <= rank <= d = 8"),
    (["--rank", "2", "--precision", "128"], "float64 low-rank schedule"),
    (["--rank", "2", "--transformer"], "--rank apply to the attention demo"),
])
def test_demo_refuses_a_bad_rank(arguments, message):
    result = runner.invoke(app, ["demo", *arguments])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())
