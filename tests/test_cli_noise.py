"""The command line for approximate oracles: demo with noise, refinement, verification; report noise."""

import pytest
from typer.testing import CliRunner

from mhaextract.tools.cli import app

runner = CliRunner()


def test_demo_verifies_on_fresh_queries():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "3", "--heads", "2", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "verification" in result.output and "passed" in result.output
    assert "amplification C" in result.output and "valid below" in result.output


@pytest.mark.slow
def test_demo_with_noise_beyond_valid_below_says_so_and_exits_nonzero():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "4", "--heads", "3", "--noise", "1e-7"])
    assert result.exit_code == 1
    assert "noise_within_validity" in result.output and "not reliable" in result.output


def test_demo_with_small_noise_and_refinement_is_certified():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "4", "--heads", "2", "--noise", "1e-11", "--refine"])
    assert result.exit_code == 0, result.output
    assert "error bound" in result.output and "refined" in result.output
    assert "least squares" in result.output


def test_demo_rejects_robust_options_in_high_precision():
    result = runner.invoke(app, ["demo", "--schedule", "paper", "--d", "2", "--heads", "1", "--precision", "128", "--refine"])
    assert result.exit_code != 0


@pytest.mark.slow
def test_report_noise_writes_the_png(tmp_path):
    output = tmp_path / "noise.png"
    result = runner.invoke(app, ["report", "noise", "--output", str(output), "--d", "2", "--heads", "1,2",
                                 "--eps", "1e-12,1e-10", "--seeds", "2"])
    assert result.exit_code == 0, result.output
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "certificate held in" in " ".join(result.output.split())  # rich wraps at the terminal width


def test_report_noise_rejects_bad_input(tmp_path):
    assert runner.invoke(app, ["report", "noise", "--eps", "-1", "-o", str(tmp_path / "x.png")]).exit_code != 0
    assert runner.invoke(app, ["report", "noise", "-o", str(tmp_path / "missing" / "x.png")]).exit_code != 0
