"""One Result base for every family: the common fields, saved and loaded for every family, the
loaded model evaluating bit for bit as the run's, the summary's common entries kept, ``verify``,
``compare`` and the report working for every result.

The truth is each run's own model (evaluated on fresh sequences) and the summary the run itself
computed; the files of format 1 (tests/data/format1, written by the code before this base) are
compared with the arrays the old code wrote beside them.
"""

import copy
import dataclasses
import json
from pathlib import Path

import mpmath
import numpy as np
import pytest
from rich.console import Console

import mhaextract as mx
from mhaextract.numerics.highprec import mpf_to_hex
from mhaextract.oracle.noise import round_bfloat16
from mhaextract.run.learner import learner_names
from mhaextract.run.result import _jsonable
from mhaextract.tools.report import extraction_table

FORMAT1 = Path(__file__).parent / "data" / "format1"
COMMON = {field.name for field in dataclasses.fields(mx.Result)}


def _bfloat16_run():
    layer = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True, d_out=4)

    def oracle(batch):  # whole outputs rounded to 8 bits, as a bfloat16 layer answers
        return round_bfloat16(layer(batch).astype(np.float32)).astype(np.float64)

    return mx.extract(oracle, d=4, heads=2, seed=0), oracle, layer


def _vector_run():
    scores = mx.MultiHeadAttention.random(d=6, heads=2, seed=4, bias=True, rank=3, d_out=6)
    rng = np.random.default_rng(104)
    V = np.einsum("hor,hrd->hod", rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 3, 6)))
    layer = mx.MultiHeadAttention(scores.W, V / np.sqrt(3), scores.u, scores.c)
    oracle = mx.SimulatedOracle(layer)
    return mx.extract(oracle, 6, heads=2, seed=2, schedule="vector"), oracle, layer


def _attention_run(precision=None):
    target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    oracle = mx.SimulatedOracle(target, precision=precision)
    return mx.extract(oracle, d=3, heads=2, seed=1, schedule="paper", precision=precision), oracle, target


def _rotary_run():
    target = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    oracle = mx.SimulatedOracle(target)
    return mx.extract(oracle, d=4, heads=1, positions="rotary", seed=1), oracle, target


def _transformer_run():
    target = mx.Transformer1L.random(d=3, heads=1, hidden=4, seed=0)
    oracle = mx.SimulatedOracle(target)
    return mx.extract_transformer(oracle, d=3, heads=1, hidden=4, seed=1), oracle, target


FAMILIES = {
    "attention-f64": (_attention_run, mx.Extraction, "paper"),
    "attention-hp": (lambda: _attention_run(128), mx.Extraction, "paper"),
    "low-precision-bf16": (_bfloat16_run, mx.LowPrecisionExtraction, "saturated"),
    "vector": (_vector_run, mx.VectorExtraction, "vector"),
    "rotary": (_rotary_run, mx.RotaryExtraction, "rotary"),
    "transformer": (_transformer_run, mx.TransformerExtraction, "transformer"),
}


def _in_c_order(model):
    """The same model with every parameter array in C order (copies, the values untouched)."""
    model = copy.copy(model.to_float64())
    for name, value in vars(model).items():
        if isinstance(value, np.ndarray):
            setattr(model, name, np.ascontiguousarray(value))
    return model


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_saves_and_loads_its_result(family, tmp_path):
    run, cls, schedule = FAMILIES[family]
    result, oracle, target = run()
    assert type(result) is cls and result.ok and result.schedule == schedule
    assert schedule in learner_names()  # the registry's own name for what ran
    assert result.d == result.model.d and result.heads == result.model.heads
    json_path, npz_path = mx.save_extraction(result, tmp_path / "result.json")
    assert npz_path.exists()
    loaded, model = mx.load_extraction(json_path), mx.load_model(json_path)
    assert isinstance(loaded, mx.Result) and loaded.result_type == cls.__name__
    assert type(model) is type(result.model) is type(loaded.model)

    # the loaded model is the run's model: every parameter bit for bit, and its outputs on fresh
    # sequences bit for bit those of the run's model held in C order (numpy's einsum rounds a
    # transposed view's products in another order: the run's own model is within a few ulps)
    arrays = result.model.to_document(exact=False)[1]
    for again in (model, loaded.model):
        assert arrays.keys() == again.to_document(exact=False)[1].keys()
        for name, array in again.to_document(exact=False)[1].items():
            assert np.array_equal(array, arrays[name]) and array.dtype == arrays[name].dtype, name
    rng = np.random.default_rng(7)
    sequences = [rng.standard_normal((n, result.d)) for n in (1, 2, 5, 17, 40)]
    expected = np.asarray(_in_c_order(result.model)(sequences))
    for again in (model, loaded.model):
        assert np.array_equal(np.asarray(again(sequences)), expected)
    assert np.allclose(np.asarray(result.model(sequences), dtype=np.float64), expected, rtol=1e-14, atol=1e-15)

    # the summary: the common entries with the run's values, the family's as JSON holds them
    summary, saved = result.summary(), loaded.summary()
    common_keys = {"schedule", "d", "heads", "queries", "queries_asked", "queries_replayed", "max_query_length",
                   "token_scale", "error_estimate", "answers_residual", "ok", "failed_checks", "verification",
                   "verification_queries", "verification_length", "calibration_queries", "seconds",
                   "schedule_reason", "precision", "seed", "answer_dtype", "transcript", "causal"}
    assert common_keys <= set(summary) and set(saved) == set(summary)
    assert not set(result._summary_extra()) & common_keys  # the family's entries add, never replace
    for key in common_keys:
        assert _same(saved[key], summary[key]), key
    assert saved == {**json.loads(json.dumps(_jsonable(summary))), **{key: saved[key] for key in common_keys}}
    assert [check.as_dict() for check in loaded.checks] == [check.as_dict() for check in result.checks]
    assert loaded.ok == result.ok and repr(loaded) == repr(result)
    assert (loaded.verification is None) == (result.verification is None)
    if result.verification is not None:
        assert str(loaded.verification) == str(result.verification) and loaded.verified == result.verified

    # verify, for the run and for the loaded result, asks the oracle and judges the model
    for judged in (result, loaded):
        verification = mx.verify(judged, oracle, verify_queries=24, seed=3)
        assert verification.queries == 24 and verification.passed, verification

    # the report table of every family
    console = Console(width=200, record=True)
    console.print(extraction_table(result, mx.compare(result.model, target)))
    console.print(extraction_table(loaded))
    text = console.export_text()
    assert "queries (measured)" in text and f" {result.queries} " in text and schedule in text


def test_a_high_precision_result_loads_its_exact_models(tmp_path):
    for run, exact_of in ((lambda: _attention_run(128), lambda result: result.model_hp),):
        result, _, _ = run()
        path, _ = result.save(tmp_path / "hp.json")
        exact = mx.load_model(path, exact=True)
        truth = exact_of(result)
        assert exact.is_high_precision and all(a == b for a, b in zip(exact.W.ravel(), truth.W.ravel()))
        assert mx.load_extraction(path, exact=True).model_exact.is_high_precision


def test_a_high_precision_transformer_result_keeps_every_bit(tmp_path):
    oracle = mx.SimulatedOracle(mx.Transformer1L.random(d=3, heads=1, hidden=3, seed=0), precision=160)
    result = mx.extract_transformer(oracle, d=3, heads=1, hidden=3, seed=1, precision=160)
    assert result.ok and result.model_hp is not None
    path, _ = mx.save_extraction(result, tmp_path / "hp.json")
    exact = mx.load_model(path, exact=True)
    for name in ("W", "O", "A", "w"):
        assert all(a == b for a, b in zip(getattr(exact, name).ravel(), getattr(result.model_hp, name).ravel()))


def test_every_result_is_a_result_and_none_redefines_a_common_field():
    classes = (mx.Extraction, mx.RotaryExtraction, mx.LowPrecisionExtraction, mx.VectorExtraction,
               mx.TransformerExtraction, mx.SavedResult)
    for cls in classes:
        assert issubclass(cls, mx.Result) and dataclasses.is_dataclass(cls)
        own = set(vars(cls).get("__annotations__", {}))
        assert not own & COMMON, f"{cls.__name__} redefines {own & COMMON}"
        assert "__repr__" not in vars(cls), f"{cls.__name__} has its own repr"


def test_files_of_format_1_still_load():
    """Written by the code before the base (attention and rotary, float64 and 128 bits)."""
    for name in ("attention", "attention_hp", "rotary", "rotary_hp"):
        path = FORMAT1 / f"{name}.json"
        document, arrays = json.loads(path.read_text()), np.load(FORMAT1 / f"{name}.npz")
        model = mx.load_model(path)
        for key in ("W", "v", "u", "Q", "K", "b", "theta"):
            if key in arrays:
                assert np.array_equal(getattr(model, key), arrays[key]), (name, key)
        loaded = mx.load_extraction(path)
        assert loaded.heads == document["summary"]["heads"] and loaded.ok == document["summary"]["ok"]
        if name.endswith("_hp"):
            exact = mx.load_model(path, exact=True)
            key = "W" if "W" in document["model_exact"] else "Q"
            expected = np.array(document["model_exact"][key], dtype=object).ravel()
            assert [mpf_to_hex(value) for value in getattr(exact, key).ravel()] == list(expected)
            assert all(isinstance(value, mpmath.mpf) for value in getattr(exact, key).ravel())


def test_compare_dispatches_on_the_model_type():
    T = mx.Transformer1L.random(d=3, heads=2, hidden=4, seed=0)
    comparison = mx.compare(mx.Transformer1L(T.W[::-1], T.O[::-1], T.A, T.w), T)
    assert isinstance(comparison, mx.TransformerComparison) and comparison.max_rel < 1e-14
    rotary = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    assert mx.compare(rotary, rotary).max_rel == 0
    with pytest.raises(ValueError, match="compare a RotaryAttention with a RotaryAttention"):
        mx.compare(rotary, mx.MultiHeadAttention.random(d=4, heads=1, seed=0))
    with pytest.raises(TypeError, match="compare takes models of the kinds mhaextract knows"):
        mx.compare(np.zeros(3), np.zeros(3))


def test_save_refuses_what_is_not_a_result(tmp_path):
    with pytest.raises(TypeError, match="a mhaextract.Result"):
        mx.save_extraction(mx.MultiHeadAttention.random(d=3, heads=1, seed=0), tmp_path / "x.json")


BFLOAT16_MODULE = '''
import numpy as np
import mhaextract as mx
from mhaextract.oracle.noise import round_bfloat16

LAYER = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True, d_out=4)


def oracle(batch):
    return round_bfloat16(LAYER(batch).astype(np.float32)).astype(np.float64)
'''


def test_the_cli_prints_and_saves_a_low_precision_result(tmp_path, monkeypatch):
    """``mhaextract extract`` on a bfloat16 layer (the low-precision family): the table from the
    common fields, the file, and the model read back (as close to the layer as the run's own)."""
    from typer.testing import CliRunner

    from mhaextract.tools.cli import app

    (tmp_path / "bf16_layer.py").write_text(BFLOAT16_MODULE)
    monkeypatch.chdir(tmp_path)
    outcome = CliRunner().invoke(app, ["extract", "--oracle", "bf16_layer.py:oracle", "--d", "4", "--heads", "2",
                                       "--out", "bf16.json"])
    assert outcome.exit_code == 0, outcome.output
    text = " ".join(outcome.output.split())
    assert "saturated" in text and "answers in bfloat16" in text and "queries (measured)" in text
    loaded = mx.load_extraction(tmp_path / "bf16.json")
    assert loaded.result_type == "LowPrecisionExtraction" and loaded.ok and loaded.answer_dtype == "bfloat16"
    layer = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True, d_out=4)
    assert mx.compare(mx.load_model(tmp_path / "bf16.json"), layer).max_rel < 2e-2
