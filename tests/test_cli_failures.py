"""The command line's failures after it has started: an oracle's own exception, output paths that
cannot be written, a save that fails after the run. Each is one line and exit code 2, never a
traceback, and a finished run is never lost."""

import json
import pathlib

import pytest
from typer.testing import CliRunner

import mhaextract as mx
from mhaextract.tools.cli import app
from mhaextract.run.result import load_model

runner = CliRunner()

ORACLE_MODULE = '''
import pathlib
import shutil

import numpy as np

_rng = np.random.default_rng(42)
W = _rng.standard_normal((2, 3, 3)) / np.sqrt(3)
v = _rng.standard_normal((2, 3))
CALLS = [0]


def oracle(batch):
    pathlib.Path("oracle_was_called").touch()
    answers = []
    for X in batch:
        out = 0.0
        for W_h, v_h in zip(W, v):
            scores = X @ W_h @ X[-1]
            weights = np.exp(scores - scores.max())
            out += weights @ (X @ v_h) / weights.sum()
        answers.append(out)
    return answers


def _fails_on_third_call(error):
    def failing(batch):
        CALLS[0] += 1
        if CALLS[0] == 3:
            raise error
        return oracle(batch)
    return failing


key_error = _fails_on_third_call(KeyError("token 7"))
exits = _fails_on_third_call(SystemExit(3))
interrupted = _fails_on_third_call(KeyboardInterrupt())
connection_error = _fails_on_third_call(ConnectionError("the server closed the connection"))
memory_error = _fails_on_third_call(MemoryError())


def removes_the_output_folder(batch):
    shutil.rmtree("results", ignore_errors=True)  # the folder --out names goes away during the run
    return oracle(batch)
'''


@pytest.fixture
def oracle_file(tmp_path, monkeypatch):
    (tmp_path / "remote.py").write_text(ORACLE_MODULE)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(ORACLE_MODULE, namespace)
    return tmp_path, mx.MultiHeadAttention(namespace["W"], namespace["v"])


def _extract(name, *arguments):
    return runner.invoke(app, ["extract", "--schedule", "paper", "--oracle", f"remote.py:{name}", "--d", "3",
                               "--heads", "2", "--batch-size", "8", *arguments])


def _error_lines(output):
    return [line for line in output.splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize("name, shown", [
    ("key_error", "KeyError: 'token 7'"),
    ("connection_error", "ConnectionError: the server closed the connection"),
    ("memory_error", "MemoryError"),
])
def test_an_oracle_exception_is_one_line_naming_the_oracle_the_queries_and_the_exception(oracle_file, name, shown):
    result = _extract(name)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    lines = _error_lines(result.output)
    assert len(lines) == 1, result.output
    # The third call of 8 sequences: queries 16..23.
    assert f"the oracle remote.py:{name} raised {shown} while answering queries 16..23" in lines[0]
    assert len(result.output.strip().splitlines()) <= 2  # nothing else but (at most) the progress line


def test_the_library_still_raises_the_oracles_own_exception_with_its_note(oracle_file):
    namespace = {}
    exec(ORACLE_MODULE, namespace)
    with pytest.raises(KeyError) as raised:
        mx.extract(namespace["key_error"], 3, heads=2, schedule="paper", batch_size=8, progress=False)
    assert any("raised by the oracle while answering queries 16..23" in note for note in raised.value.__notes__)


def test_an_oracle_exception_during_verification_keeps_the_finished_run(oracle_file):
    folder, truth = oracle_file
    # The paper schedule's d = 3, H = 2 run asks 69 queries: 9 calls of 8; the 10th call is the
    # verification's first, and raises.
    module = ORACLE_MODULE.replace("if CALLS[0] == 3", "if CALLS[0] == 10")
    (folder / "remote.py").write_text(module)
    result = _extract("key_error", "--verify", "16", "--out", "run.json")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "raised KeyError" in " ".join(_error_lines(result.output))
    assert mx.compare(load_model(folder / "run.json"), truth).max_rel < 1e-8


@pytest.mark.parametrize("make, arguments, hint, cause", [
    (lambda f: (f / "result.json").mkdir(), ["--out", "result.json"], "--out", "is a folder"),
    (lambda f: (f / "result.npz").mkdir(), ["--out", "result.json"], "--out", "is a folder"),
    (lambda f: (f / "plain").write_text(""), ["--out", "plain/result.json"], "--out", "is a file, not a folder"),
    (lambda f: (f / "run.sqlite").mkdir(), ["--transcript", "run.sqlite"], "--transcript", "is a folder"),
])
def test_unwritable_output_paths_are_refused_before_the_first_query(oracle_file, make, arguments, hint, cause):
    folder, _ = oracle_file
    make(folder)
    result = _extract("oracle", *arguments)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    text = " ".join(result.output.replace("│", " ").split())
    assert hint in text and cause in text, text
    assert not (folder / "oracle_was_called").exists()


def test_a_save_that_fails_after_the_run_writes_the_result_elsewhere_and_says_where(oracle_file, monkeypatch):
    import tempfile

    folder, truth = oracle_file
    monkeypatch.setattr(tempfile, "tempdir", str(folder))  # the fallback's temporary folder, cleaned up
    (folder / "results").mkdir()
    result = _extract("removes_the_output_folder", "--out", "results/run.json")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "could not write --out 'results/run.json'" in text
    written = text.split("the finished run was written to ")[1].split(" and ")[0]
    assert written.endswith("run.json")
    assert mx.compare(load_model(written), truth).max_rel < 1e-8
    assert json.loads(pathlib.Path(written).read_text())["summary"]["queries"] == 69


def _usage_error(result, hint, cause):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    text = " ".join(result.output.replace("│", " ").split())
    assert hint in text and cause in text, text


@pytest.mark.parametrize("arguments, hint, cause", [
    (["--heads", "0.4"], "--heads", "got '0.4'"),
    (["--heads", "0"], "--heads", "got 0"),
    (["--heads", ","], "--heads", "comma-separated head counts"),
    (["--seeds", "0"], "--seeds", "seeds must be an integer >= 1"),
    (["-o", "figure"], "--output", "ending in .png"),
    (["-o", "folder.png"], "--output", "is a folder"),
])
def test_report_noise_refuses_bad_options_before_the_sweep(tmp_path, monkeypatch, arguments, hint, cause):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.png").mkdir()
    _usage_error(runner.invoke(app, ["report", "noise", "--d", "2", *arguments]), hint, cause)
    assert not (tmp_path / "figure.png").exists() and not (tmp_path / "noise.png").exists()


@pytest.mark.parametrize("out, cause", [
    ("plain/sub", "is a file, so 'plain/sub' cannot be a folder"),
    ("plain", "is a file, so 'plain' cannot be a folder"),
    ("made/bench.md", "is a file, so"),
])
def test_bench_refuses_an_output_folder_below_a_file_before_the_run(tmp_path, monkeypatch, out, cause):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("")
    (tmp_path / "made").mkdir()
    (tmp_path / "made" / "bench.md").write_text("")
    _usage_error(runner.invoke(app, ["bench", "--quick", "--out", out]), "--out", cause)


@pytest.mark.slow  # 2 s (matplotlib)
def test_report_noise_keeps_a_finished_sweep_whose_folder_went_away(tmp_path, monkeypatch):
    import shutil
    import tempfile

    import mhaextract.tools.noise_sweep as sweep_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the fallback's temporary folder, cleaned up
    (tmp_path / "figures").mkdir()
    real_sweep = sweep_module.noise_sweep

    def sweep_then_remove_the_folder(*arguments, **keywords):
        points = real_sweep(*arguments, **keywords)
        shutil.rmtree(tmp_path / "figures")
        return points
    monkeypatch.setattr(sweep_module, "noise_sweep", sweep_then_remove_the_folder)
    result = runner.invoke(app, ["report", "noise", "--d", "2", "--heads", "1", "--eps", "1e-12", "--seeds", "1",
                                 "-o", "figures/noise.png"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "could not write --output 'figures/noise.png'" in text
    written = text.split("wrote the figure to ")[1].split(" instead")[0]
    assert open(written, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_oracle_that_calls_sys_exit_gets_one_line_and_exit_code_2(oracle_file):
    """``sys.exit(3)`` inside the oracle is its failure, named, not a silent end of the command."""
    result = _extract("exits")
    assert result.exit_code == 2, result.output
    lines = _error_lines(result.output)
    assert len(lines) == 1 and "remote.py:exits raised SystemExit" in lines[0] and "sys.exit(3)" in lines[0]
    assert "Traceback" not in result.output


def test_ctrl_c_says_how_to_resume_and_the_rerun_finishes(oracle_file):
    """An interrupted run (Ctrl-C while the oracle answers) exits 130 and says how to resume; the
    same command with the same transcript then finishes with the right heads."""
    folder, truth = oracle_file
    result = _extract("interrupted", "--transcript", "run.sqlite")
    assert result.exit_code == 130, result.output
    text = " ".join(result.output.split())
    assert "Interrupted" in text and "'run.sqlite'" in text and "resume" in text
    result = _extract("oracle", "--transcript", "run.sqlite", "--out", "done.json")
    assert result.exit_code == 0, result.output
    assert mx.compare(load_model(folder / "done.json"), truth).max_rel < 1e-6


def test_ctrl_c_without_a_transcript_names_the_option_that_would_have_kept_the_answers(oracle_file):
    result = _extract("interrupted")
    assert result.exit_code == 130, result.output
    assert "--transcript" in " ".join(result.output.split())


def test_a_failed_run_prints_what_to_try_as_the_python_error_does(oracle_file):
    """Two heads declared as one: the command prints the failed checks and the hint that
    ``ExtractionError`` carries in Python (more heads than declared, and which option to pass)."""
    result = runner.invoke(app, ["extract", "--oracle", "remote.py:oracle", "--d", "3", "--heads", "1"])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    with pytest.raises(mx.ExtractionError) as raised:
        namespace = {}
        exec(ORACLE_MODULE, namespace)
        mx.extract(namespace["oracle"], 3, heads=1, seed=0)
    hint = str(raised.value).splitlines()[-1]
    assert "more heads than declared" in hint and " ".join(hint.split()) in text
