"""``mhaextract extract`` on a user's oracle module, and the JSON it writes."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import mhaextract as mx
from mhaextract.tools.cli import app
from mhaextract.run.result import load_model, save_extraction

runner = CliRunner()

USER_MODULE = '''
import numpy as np

# A "remote" attention layer: d = 3, two heads, known only to this file.
_rng = np.random.default_rng(42)
W = _rng.standard_normal((2, 3, 3)) / np.sqrt(3)
v = _rng.standard_normal((2, 3))
CALLS = []


def oracle(batch):
    """f(X) for each sequence X (N, 3): plain numpy, no mhaextract."""
    answers = []
    for X in batch:
        CALLS.append(len(X))
        out = 0.0
        for W_h, v_h in zip(W, v):
            scores = X @ W_h @ X[-1]
            weights = np.exp(scores - scores.max())
            out += weights @ (X @ v_h) / weights.sum()
        answers.append(out)
    return answers


not_callable = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """Writes the user's module under a name unique to the test, and runs from its directory."""
    name = "user_oracle_" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(USER_MODULE, namespace)
    truth = mx.MultiHeadAttention(namespace["W"], namespace["v"])
    return name, truth, tmp_path


def test_extract_runs_a_plain_function_and_its_json_round_trips(user_module):
    name, truth, folder = user_module
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--seed", "1", "--out", "result.json"])
    assert result.exit_code == 0, result.output
    assert "queries (measured)" in result.output and "69" in result.output  # 4*2*9 - 4 + 1
    document = json.loads((folder / "result.json").read_text())
    assert document["summary"]["queries"] == 69 and document["summary"]["ok"] is True
    assert {check["name"] for check in document["checks"]} >= {"matching", "answers_residual"}
    model = load_model(folder / "result.json")
    assert isinstance(model, mx.MultiHeadAttention) and model.heads == 2
    assert mx.compare(model, truth).max_rel < 1e-8
    arrays = np.load(folder / "result.npz")
    assert np.array_equal(arrays["W"], model.W)  # JSON floats are exact
    assert arrays["instances_rank"].shape == (2 * 9 - 1,)


def test_extract_from_a_file_path_with_a_transcript_resumes(user_module):
    name, truth, folder = user_module
    arguments = ["extract", "--schedule", "paper", "--oracle", f"{folder / name}.py:oracle", "--d", "3", "--heads", "2",
                 "--transcript", "run.sqlite", "--batch-size", "10"]
    stopped = runner.invoke(app, arguments + ["--max-queries", "25"])
    assert stopped.exit_code == 2
    assert "BudgetExceeded" in stopped.output and "44 more" in stopped.output
    resumed = runner.invoke(app, arguments + ["--out", "result.json"])
    assert resumed.exit_code == 0, resumed.output
    assert "47 / 25" in resumed.output  # asked in this run (44 + 3 re-asked by the resume check) / read back
    summary = json.loads((folder / "result.json").read_text())["summary"]
    assert (summary["queries"], summary["queries_asked"], summary["queries_replayed"]) == (72, 47, 25)
    assert mx.compare(load_model(folder / "result.json"), truth).max_rel < 1e-8


def test_extract_with_the_lean_schedule(user_module):
    name, truth, folder = user_module
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--schedule", "lean", "--out", "lean.json"])
    assert result.exit_code == 0, result.output
    assert "lean formula" in result.output
    assert mx.compare(load_model(folder / "lean.json"), truth).max_rel < 1e-8


def test_a_foreign_transcript_is_refused_on_the_command_line(user_module):
    name, truth, folder = user_module
    base = ["extract", "--schedule", "paper", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2", "--transcript", "run.sqlite"]
    assert runner.invoke(app, base + ["--seed", "1"]).exit_code == 0
    before = (folder / "run.sqlite").read_bytes()
    refused = runner.invoke(app, base + ["--seed", "2"])
    assert refused.exit_code == 2 and "TranscriptError" in refused.output and "seed" in refused.output
    assert (folder / "run.sqlite").read_bytes() == before


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "package.module:callable"),
    ("no_such_module_xyz:oracle", "cannot load"),
    ("{name}:missing", "cannot load"),
    ("{name}:not_callable", "not a callable"),
    ("missing_file.py:oracle", "cannot load"),
])
def test_bad_oracle_specs_are_named(user_module, spec, message):
    name, _, _ = user_module
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", spec.format(name=name), "--d", "3", "--heads", "2"])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_sizes_and_outputs_are_refused(user_module):
    name, _, _ = user_module
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", f"{name}:oracle", "--d", "3"])
    assert result.exit_code == 2 and "exactly one" in result.output
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2", "--out", "x.txt"])
    assert result.exit_code == 2 and ".json" in result.output


def test_a_high_precision_result_round_trips_exactly(tmp_path):
    target = mx.MultiHeadAttention.random(2, 2, seed=1)
    result = mx.extract(mx.SimulatedOracle(target, 200), 2, heads=2, precision=200, seed=0, schedule="paper")
    save_extraction(result, tmp_path / "hp.json")
    exact = load_model(tmp_path / "hp.json", exact=True)
    assert exact.is_high_precision
    assert all(a._mpf_ == b._mpf_ for a, b in zip(exact.W.ravel(), result.model_hp.W.ravel()))
    assert all(a._mpf_ == b._mpf_ for a, b in zip(exact.v.ravel(), result.model_hp.v.ravel()))
    assert float(mx.compare(exact, target).max_rel) < 1e-40
    assert np.array_equal(load_model(tmp_path / "hp.json").W, result.model.W)


def test_load_model_refuses_other_files(tmp_path):
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a mhaextract extraction"):
        load_model(tmp_path / "other.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_model(tmp_path / "bad.json")
    target = mx.MultiHeadAttention.random(2, 1, seed=1)
    save_extraction(mx.extract(mx.SimulatedOracle(target), 2, heads=1, seed=0, schedule="paper"), tmp_path / "f.json")
    with pytest.raises(ValueError, match="no exact"):
        load_model(tmp_path / "f.json", exact=True)


MARKING_MODULE = '''
import pathlib
import numpy as np

_rng = np.random.default_rng(42)
W = _rng.standard_normal((2, 3, 3)) / np.sqrt(3)
v = _rng.standard_normal((2, 3))


def oracle(batch):
    pathlib.Path("oracle_was_called").touch()
    answers = []
    for X in batch:
        out = 0.0
        for W_h, v_h in zip(W, v):
            scores = X @ W_h @ X[-1]
            weights = np.exp(scores - scores.max())
            out += weights @ (X @ v_h) / weights.sum()
        answers.append(out + (1e-3 if len(X) > 5 else 0.0))  # off on queries longer than the run asks
    return answers
'''


@pytest.fixture
def marking_module(tmp_path, monkeypatch):
    """An oracle file that leaves a mark when called (and answers wrongly on long queries)."""
    (tmp_path / "marking.py").write_text(MARKING_MODULE)
    (tmp_path / "broken.py").write_text("def oracle(batch):\n    return [0.0 for X in batch\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arguments, option", [
    (["--out", "missing/result.json"], "--out"),
    (["--transcript", "missing/run.sqlite"], "--transcript"),
    (["--precision", "0"], "--precision"),
    (["--samples", "0"], "--samples"),
    (["--schedule", "foo"], "--schedule"),
    (["--seed", "-1"], "--seed"),
    (["--answer-error", "inf"], "--answer-error"),
    (["--answer-error", "-1"], "--answer-error"),
    (["--verify", "-1"], "--verify-queries"),
    (["--verify-length", "-1"], "--verify-length"),
    (["--verify-length", "5000"], "--verify-length"),
    (["--max-queries", "-1"], "--max-queries"),
    (["--batch-size", "0"], "--batch-size"),
    (["--token-scale", "0"], "--token-scale"),
    (["--precision", "128", "--verify", "10"], "float64 options"),
    (["--max-heads", "2"], "--heads/--max-heads"),  # both given
])
def test_extract_refuses_invalid_options_before_the_run(marking_module, arguments, option):
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", "marking.py:oracle", "--d", "3", "--heads", "2"] + arguments)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert option in " ".join(result.output.split()), result.output
    assert not (marking_module / "oracle_was_called").exists()  # refused before any query
    assert not (marking_module / "missing").exists()


def test_an_oracle_file_with_a_syntax_error_is_a_usage_error(marking_module):
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", "broken.py:oracle", "--d", "3", "--heads", "2"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "--oracle" in text and "SyntaxError" in text


def test_extract_with_samples_refine_and_answer_error(user_module):
    name, truth, folder = user_module
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--samples", "7", "--refine", "--answer-error", "1e-12", "--out", "robust.json"])
    assert result.exit_code == 0, result.output
    summary = json.loads((folder / "robust.json").read_text())["summary"]
    assert summary["ok"] is True
    assert mx.compare(load_model(folder / "robust.json"), truth).max_rel < 1e-8


def test_extract_verify_attaches_and_prints_the_verification(user_module):
    name, _, folder = user_module
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--verify", "32", "--out", "verified.json"])
    assert result.exit_code == 0, result.output
    assert "verification passed: 32 fresh queries" in " ".join(result.output.split())
    document = json.loads((folder / "verified.json").read_text())
    assert document["summary"]["verification"].startswith("verification passed")


def test_a_failed_verification_exits_1(marking_module):
    """The oracle is off by 1e-3 only on queries longer than the run asks: the checks pass, the
    verification (lengths up to 16) does not."""
    result = runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", "marking.py:oracle", "--d", "3", "--heads", "2",
                                 "--verify", "64"])
    assert result.exit_code == 1, result.output
    assert "verification FAILED" in " ".join(result.output.split())


def test_the_default_run_verifies_itself_on_long_queries_and_exits_1(marking_module):
    """The same oracle with the defaults (auto): the run's own verification (up to 256 tokens)
    fails ``long_verification``; ``--verify-length 0`` turns it off and the run passes."""
    arguments = ["extract", "--oracle", "marking.py:oracle", "--d", "3", "--heads", "2"]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "long_verification: FAILED" in text and "verification FAILED: 32 fresh queries (lengths 1..256" in text
    result = runner.invoke(app, arguments + ["--verify-length", "0"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("rank", ["3", "auto"])
def test_extract_with_a_rank_runs_the_low_rank_schedule(user_module, rank):
    # The user's heads are full rank (3 = d): rank=3 is a true bound, and "auto" finds 3.
    name, truth, folder = user_module
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--rank", rank, "--out", "low.json"])
    assert result.exit_code == 0, result.output
    assert "lowrank" in result.output
    assert mx.compare(load_model(folder / "low.json"), truth).max_rel < 1e-12


def test_extract_refuses_a_bad_rank(user_module):
    name, _, _ = user_module
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--rank", "big"])
    assert result.exit_code == 2 and "--rank" in result.output
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
                                 "--rank", "4"])
    assert result.exit_code == 2 and "rank must be at most d = 3" in result.output


ROTARY_MODULE = '''
import mhaextract as mx

oracle = mx.SimulatedOracle(mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=0, kv_heads=2))
'''


@pytest.mark.slow  # a rotary run, about 2 s
def test_family_options_reach_their_learner_by_name(tmp_path, monkeypatch):
    """``--option positions=rotary`` picks the rotary learner (the registry's option, no flag of its own)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rotary_layer.py").write_text(ROTARY_MODULE)
    outcome = runner.invoke(app, ["extract", "--oracle", "rotary_layer:oracle", "--d", "8", "--heads", "2",
                                  "--option", "positions=rotary", "--out", "rotary.json"])
    assert outcome.exit_code == 0, outcome.output
    assert mx.load_extraction(tmp_path / "rotary.json").schedule == "rotary"
    assert type(load_model(tmp_path / "rotary.json")).__name__ == "RotaryAttention"
    refused = runner.invoke(app, ["extract", "--oracle", "rotary_layer:oracle", "--d", "8", "--heads", "2",
                                  "--option", "windows=3"])
    assert refused.exit_code == 2 and "no learner takes 'windows'" in refused.output
