"""The command line."""

from typer.testing import CliRunner

from mhaextract.cli import app

runner = CliRunner()


def test_demo_prints_the_table_with_measured_queries():
    result = runner.invoke(app, ["demo", "--d", "3", "--heads", "2", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "queries (measured)" in result.output
    assert "69" in result.output  # 4*2*9 - 4 + 1
    assert "checks" in result.output and "ok" in result.output


def test_demo_high_precision():
    result = runner.invoke(app, ["demo", "--d", "2", "--heads", "3", "--precision", "256"])
    assert result.exit_code == 0, result.output
    assert "256 bits" in result.output
    assert "certified" in result.output


def test_demo_reports_an_unreliable_float64_run_and_exits_nonzero():
    result = runner.invoke(app, ["demo", "--d", "4", "--heads", "5"])
    assert result.exit_code == 1
    assert "FAILED" in result.output and "float64_head_limit" in result.output


def test_demo_rejects_bad_sizes():
    result = runner.invoke(app, ["demo", "--d", "0"])
    assert result.exit_code != 0


def test_demo_lean_schedule_reports_its_formula_and_bound():
    result = runner.invoke(app, ["demo", "--d", "3", "--heads", "2", "--schedule", "lean", "--precision", "128"])
    assert result.exit_code == 0, result.output
    assert "lean formula" in result.output and "lower bound" in result.output
