"""benchmarks/bench_identity.py, the refactor-safety command (docs/benchmarks.md, 'Refactor safety:
bit-identical runs'): its smallest case round-trips through --json and --compare, and one bit
changed anywhere it looks is a difference that fails the comparison."""

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "bench_identity", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_identity.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_a_case_round_trips_through_its_records_and_a_changed_record_fails(tmp_path, capsys):
    path = tmp_path / "records.json"
    assert bench.main(["--only", "paper-f64", "--json", str(path)]) == 0
    assert bench.main(["--only", "paper-f64", "--compare", str(path)]) == 0
    stored = json.loads(path.read_text())
    stored["records"][0]["queries"] += 1
    path.write_text(json.dumps(stored))
    capsys.readouterr()
    assert bench.main(["--only", "paper-f64", "--compare", str(path)]) == 1
    assert "paper-f64.queries: 126 -> 125" in capsys.readouterr().out
    assert bench.main(["--only", "paper-f64", "--compare", str(path), "--ignore", "paper-f64.queries"]) == 0


def replaced(result, **changes):
    """A copy of a result with some attributes changed (whatever class the result is)."""
    copied = copy.copy(result)
    for name, value in changes.items():
        setattr(copied, name, value)
    return copied


def test_one_ulp_in_the_model_or_an_estimate_changes_its_hash_and_wall_clock_does_not():
    result = bench.CASES["paper-f64"]()
    before = bench.record("paper-f64", result, seconds=0.0)
    assert before["error_estimate"] == float(result.error_estimate).hex() and before["queries"] == 125
    W = result.model.W.copy()
    W[0, 0, 0] = np.nextafter(W[0, 0, 0], np.inf)
    moved = bench.record("paper-f64", replaced(result, model=type(result.model)(
        W, result.model.v, result.model.u, result.model.c)), seconds=0.0)
    assert moved["model"] != before["model"] and "model fields that differ: W" in bench.explain("model", before, moved)
    later = bench.record("paper-f64", replaced(result, seconds=result.seconds + 1.0), seconds=1.0)
    assert [later[f] for f in bench.COMPARED] == [before[f] for f in bench.COMPARED]
    estimate = replaced(result, error_estimate=np.nextafter(result.error_estimate, np.inf))
    changed = bench.record("paper-f64", estimate, seconds=0.0)
    assert changed["estimates"] != before["estimates"] and changed["numbers"] != before["numbers"]
