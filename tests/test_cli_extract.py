"""``mhaextract extract`` on a user's oracle module, and the JSON it writes."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import mhaextract as mx
from mhaextract.cli import app
from mhaextract.results import load_model, save_extraction

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
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2",
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
    arguments = ["extract", "--oracle", f"{folder / name}.py:oracle", "--d", "3", "--heads", "2",
                 "--transcript", "run.sqlite", "--batch-size", "10"]
    stopped = runner.invoke(app, arguments + ["--max-queries", "25"])
    assert stopped.exit_code == 2
    assert "BudgetExceeded" in stopped.output and "44 more" in stopped.output
    resumed = runner.invoke(app, arguments + ["--out", "result.json"])
    assert resumed.exit_code == 0, resumed.output
    assert "44 / 25" in resumed.output  # asked in this run / read back
    summary = json.loads((folder / "result.json").read_text())["summary"]
    assert (summary["queries"], summary["queries_asked"], summary["queries_replayed"]) == (69, 44, 25)
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
    base = ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2", "--transcript", "run.sqlite"]
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
    result = runner.invoke(app, ["extract", "--oracle", spec.format(name=name), "--d", "3", "--heads", "2"])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_sizes_and_outputs_are_refused(user_module):
    name, _, _ = user_module
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3"])
    assert result.exit_code == 2 and "exactly one" in result.output
    result = runner.invoke(app, ["extract", "--oracle", f"{name}:oracle", "--d", "3", "--heads", "2", "--out", "x.txt"])
    assert result.exit_code == 2 and ".json" in result.output


def test_a_high_precision_result_round_trips_exactly(tmp_path):
    target = mx.MultiHeadAttention.random(2, 2, seed=1)
    result = mx.extract(mx.SimulatedOracle(target, 200), 2, heads=2, precision=200, seed=0)
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
    save_extraction(mx.extract(mx.SimulatedOracle(target), 2, heads=1, seed=0), tmp_path / "f.json")
    with pytest.raises(ValueError, match="no exact"):
        load_model(tmp_path / "f.json", exact=True)
