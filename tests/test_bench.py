"""``mhaextract bench``: one command writes the table and the PNG, with measured numbers."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhaextract.tools.bench import BenchSettings, orthogonal_target, run_bench
from mhaextract.tools.cli import app

pytest.importorskip("torch")

TINY = dict(ds=(3,), heads=(1, 2), restarts=2, adam_steps=30, lbfgs_steps=10)


@pytest.mark.slow
def test_run_bench_measures_every_method_and_marks_baseline_wins(tmp_path):
    rows = run_bench(BenchSettings(**TINY), out_dir=tmp_path)
    general = [row for row in rows if row.table == "general"]
    methods = ["mhaextract", "mhaextract+refine", "single-head", "distillation"]
    assert [(r.H, r.method) for r in general] == [(H, method) for H in (1, 2) for method in methods]
    by = {(r.H, r.method): r for r in general}
    # Queries are the boundary's measurements: the paper's count for ours and the student, d^2 + d for single-head.
    assert by[1, "mhaextract"].queries == by[1, "distillation"].queries == 4 * 9 - 2 + 1
    assert by[2, "mhaextract"].queries == by[2, "distillation"].queries == 8 * 9 - 4 + 1
    assert by[1, "single-head"].queries == by[2, "single-head"].queries == 12
    assert by[1, "mhaextract"].error < 1e-10 and by[2, "mhaextract"].error < 1e-8
    # Refinement spends no query and does not lose accuracy.
    for H in (1, 2):
        assert by[H, "mhaextract+refine"].queries == by[H, "mhaextract"].queries
        assert by[H, "mhaextract+refine"].error <= max(by[H, "mhaextract"].error, 1e-13)
    # H = 1: the prior algorithm finds the head with fewer queries; the table must say so.
    assert by[1, "single-head"].error < 1e-12 and "queries" in by[1, "single-head"].wins
    # H = 2: it finds one head; fewer queries is no win then.
    assert by[2, "single-head"].heads_found == 1 and by[2, "single-head"].error == float("inf")
    assert "queries" not in by[2, "single-head"].wins
    for row in general:
        ours = by[row.H, "mhaextract"]
        if not row.method.startswith("mhaextract"):
            assert row.time_ratio == pytest.approx(row.seconds / ours.seconds)
    orthogonal = [row for row in rows if row.table == "orthogonal"]
    assert [r.method for r in orthogonal] == ["mhaextract", "single-head"]
    assert orthogonal[1].queries == (4 + 2) + (1 + 1) and orthogonal[1].error < 1e-12
    table = (tmp_path / "bench.md").read_text()
    assert table.count("| 3 | 1 |") == 4 and table.count("| 3 | 2 |") == 6 and "**queries**" in table
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_orthogonal_targets_satisfy_the_assumption():
    import numpy as np

    target, bases = orthogonal_target(7, 3, seed=0)
    assert [B.shape[1] for B in bases] == [3, 2, 2]
    for h, B in enumerate(bases):
        P = B @ B.T
        np.testing.assert_array_equal(P @ target.W[h] @ P, target.W[h])
        np.testing.assert_array_equal(P @ target.v[h], target.v[h])
        for g in range(h):
            assert not (bases[g].T @ B).any()


@pytest.mark.slow
def test_cli_bench_prints_and_writes(tmp_path):
    args = ["bench", "--d", "2", "--heads", "1", "--restarts", "1", "--adam-steps", "5", "--lbfgs-steps", "2",
            "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| 2 | 1 | single-head | 6 |" in result.output and "| 2 | 1 | mhaextract | 15 |" in result.output
    assert Path(tmp_path, "bench.md").exists() and Path(tmp_path, "bench.png").exists()


def test_cli_bench_rejects_bad_settings(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--d", "-2", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "ds must be" in result.output
