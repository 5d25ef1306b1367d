"""Smoke tests of benchmarks/bench_reliability.py's issue-38 classes: one case of each runs and is
judged as the table would judge it (the table's numbers are docs/reliability.md's)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import mhaextract as mx

pytest.importorskip("torch")
_spec = importlib.util.spec_from_file_location(
    "bench_reliability", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_reliability.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

DEFAULT = ("auto (default)", {})


def _first(generator, starts):
    return next(case for case in generator if case[1].startswith(starts))


def _outcome(case):
    _, _, run, target, expect = case
    return bench.judge(run, target, expect)[0]


def test_the_windowed_reference_is_the_layer_where_the_window_holds_every_token():
    target = mx.MultiHeadAttention.random(3, 2, seed=0, bias=True)
    rng = np.random.default_rng(0)
    batch = [rng.standard_normal((n, 3)) for n in (1, 4, 9)]
    assert np.allclose(bench.windowed_answers(target, 9, batch), target(batch), rtol=1e-13, atol=1e-13)
    cut = bench.windowed_answers(target, 4, batch)
    assert np.isclose(cut[2], target([batch[2][-4:]])[0], rtol=1e-13) and not np.isclose(cut[2], target(batch)[2])


def test_a_window_of_five_fails_loudly_with_the_defaults():
    assert _outcome(_first(bench.mismatch_cases(*DEFAULT, 1), "mismatch: sliding window 5 ")) == "clean error"


def test_paper_named_alone_gets_its_verification_explicitly():
    case = _first(bench.mismatch_cases("paper", dict(schedule="paper"), 1), "mismatch: another model")
    assert _outcome(case) == "clean error"


@pytest.mark.slow  # about 1 s: three runs
def test_an_interrupted_run_re_pays_at_most_a_batch_and_the_resume_check():
    bench.REPAID.clear()
    assert _outcome(_first(bench.interrupted_cases(*DEFAULT, 1), "interrupted: at 0.5")) == "correct"
    most, runs, over = bench.REPAID["auto (default)"]
    assert runs == 1 and over == 0 and 0 < most <= bench.INTERRUPT_BATCH + bench.RESUME_CHECK


@pytest.mark.slow  # 10..20 s: a whole bfloat16 layer's run
def test_a_float32_layer_passes_and_a_bfloat16_layer_is_never_silent():
    cases = list(bench.low_precision_cases(*DEFAULT, 1))
    assert _outcome(_first(cases, "float32 layer: read-out")) == "correct"
    assert _outcome(_first(cases, "bfloat16 layer: whole")) in ("clean error", "correct")


def test_an_oracle_exception_through_the_command_line_is_a_clean_error():
    assert _outcome(_first(bench.cli_cases(), "cli: oracle raising key_error (paper)")) == "clean error"
    assert _outcome(_first(bench.cli_cases(), "cli: extract --out under a file")) == "clean error"


def test_a_traceback_through_the_command_line_is_a_crash(monkeypatch):
    import mhaextract.tools.cli as cli

    def broken(*arguments, **keywords):
        raise RuntimeError("internal")
    monkeypatch.setattr(cli, "load_oracle", broken)
    assert _outcome(_first(bench.cli_cases(), "cli: oracle raising key_error (paper)")).startswith("crash")
