"""Issue 64's trained zoo (tests/zoo.py, trained by benchmarks/train_zoo.py): every attention layer
of small GPT-2, BERT, ViT, Llama, Mistral and Qwen2 models trained on this machine, extracted with
the library's defaults (plus ``positions="rotary"``, and ``key_bias=True`` for Qwen2; whole float64
and float32 answers of the other families with ``schedule="targeted"``, :func:`judged`) and judged
against the exact float64 layer of its own weights at every position of 100 fresh sequences of
1..128 tokens (``zoo.run_and_judge``, ``zoo.verdicts``). The fast tier checks the cache and runs one float64 layer; the
rest are slow, and the full table is ``benchmarks/bench_zoo.py`` (docs/trained-layers.md). A case
the library fails is carried as a strict xfail naming the measured cause, so that it turns red when fixed."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import zoo  # noqa: E402


def test_the_cache_is_the_zoo_this_code_trains():
    assert zoo.stale_reasons() == []
    stored = zoo.manifest()
    for name, entry in stored["models"].items():
        assert entry["final_loss"] < 0.8 * entry["first_loss"], name  # trained, not initial weights
    assert sum(entry["bytes"] for entry in stored["models"].values()) < 2 ** 20


@pytest.mark.slow
def test_a_cached_layer_loads_in_every_dtype_and_answers_as_its_model_runs_it():
    """The cached weights are float32; every dtype is their conversion, the exact layer their float64 copy."""
    X = torch.as_tensor(np.random.default_rng(0).standard_normal((2, 9, 32)))
    exact = zoo.exact_layer("qwen2-d32-h4/1", torch.float32)
    for dtype, tolerance in [(torch.float64, 1e-6), (torch.float32, 1e-5), (torch.bfloat16, 5e-2)]:
        layer = zoo.layer_as_run("qwen2-d32-h4/1", dtype)
        with torch.no_grad():
            got, expected = layer(X.to(dtype)).double(), exact(X)
        assert float((got - expected).abs().max() / expected.abs().max()) <= tolerance
    assert zoo.attention("qwen2-d32-h4/1").k_proj.bias.abs().max() > 0.01  # Qwen2's key bias is trained


@functools.cache
def judged(layer_id, dtype):
    """One run per layer and dtype, shared by the tests below (``zoo.run_and_judge``). Whole float64
    and float32 answers of the non-rotary layers run the targeted schedule, named: the defaults split
    them by head at these sizes (docs/algorithm.md, 'Whole answers near the vector bound', 'When auto
    splits the answers'), whose rows are docs/trained-layers.md's 'Measured: the split of whole
    answers' and whose trained cases are tests/test_vector_split.py's; the split here would add about
    500 s of CPU to the suite (vit-d64-h4 in float32: about 180 s each)."""
    named = {"schedule": "targeted"} if dtype in ("float64", "float32") and not zoo.extract_options(layer_id) else {}
    return zoo.run_and_judge(layer_id, getattr(torch, dtype), **named)


#: Layer and dtype, each replaced at every position within acceptance 1's limits, its estimate not
#: below the model's error; one float64 layer in the fast tier, the rest slow (about 90 s of CPU, 64 of them
#: the float32 rotary cases: docs/trained-layers.md).
REPLACED = [
    pytest.param("gpt2-d32-h2/0", "float64", id="gpt2-d32-h2/0-float64"),
    pytest.param("bert-d64-h4/1", "float64", id="bert-d64-h4/1-float64", marks=pytest.mark.slow),
    pytest.param("gpt2-d64-h8/1", "float64", id="gpt2-d64-h8/1-float64", marks=pytest.mark.slow),
    pytest.param("bert-d64-h4/0", "float32", id="bert-d64-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("vit-d64-h4/0", "float32", id="vit-d64-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("gpt2-d32-h2/1", "bfloat16", id="gpt2-d32-h2/1-bfloat16", marks=pytest.mark.slow),
    pytest.param("gpt2-d32-h2/0", "float16", id="gpt2-d32-h2/0-float16", marks=pytest.mark.slow),
    # vit-d64-h4/0 in bfloat16 (about 120 CPU-seconds: the low-precision start's 48 lines find its labels)
    # and gpt2-d64-h8/0 in float16 (about 240) are measured by benchmarks/bench_zoo.py
    # (docs/trained-layers.md), keeping the full suite under ten minutes on two cores
    # the rotary layers' whole float32 answers split by head (docs/algorithm.md, 'Rotary layers from whole
    # answers'): about 28 s of CPU; under a sliding window of 16 tokens, about 8 s; with Qwen2's key bias
    # (no key-neutral token, which the grid route does not find in float32), about 28 s
    pytest.param("llama-d32-h4/0", "float32", id="llama-d32-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("mistral-d32-h4/0", "float32", id="mistral-d32-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("qwen2-d32-h4/1", "float32", id="qwen2-d32-h4/1-float32", marks=pytest.mark.slow),
    # 8 heads of width 8: the saturation check's margins bounded within the design's span
    # (docs/algorithm.md, 'The targeted schedule', 'Margins without the tokens')
    pytest.param("gpt2-d64-h8/0", "float32", id="gpt2-d64-h8/0-float32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layer_id, dtype", REPLACED)
def test_a_trained_layer_is_replaced_at_every_position(layer_id, dtype):
    row = judged(layer_id, dtype)
    assert row["queries"] > 0 and row["result"].queries == row["queries"]  # measured at the oracle
    assert zoo.failures(row) == []


#: The estimate within 100 times the model's error (acceptance 1), runs shared with REPLACED where both list
#: them: float64 and float32 estimates 5..61 times the error over the non-rotary zoo, 3..12 over the rotary
#: layers split by head (docs/trained-layers.md).
TIGHT = [
    pytest.param("gpt2-d32-h2/0", "float64", id="gpt2-d32-h2/0-float64"),
    pytest.param("bert-d64-h4/1", "float64", id="bert-d64-h4/1-float64", marks=pytest.mark.slow),
    pytest.param("gpt2-d64-h8/1", "float64", id="gpt2-d64-h8/1-float64", marks=pytest.mark.slow),
    pytest.param("gpt2-d64-h4/0", "float32", id="gpt2-d64-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("vit-d64-h4/1", "float64", id="vit-d64-h4/1-float64", marks=pytest.mark.slow),
    pytest.param("bert-d64-h4/0", "float32", id="bert-d64-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("vit-d64-h4/0", "float32", id="vit-d64-h4/0-float32", marks=pytest.mark.slow),
    pytest.param("vit-d64-h4/1", "float32", id="vit-d64-h4/1-float32", marks=pytest.mark.slow),
    pytest.param("qwen2-d32-h4/1", "float32", id="qwen2-d32-h4/1-float32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("layer_id, dtype", TIGHT)
def test_the_estimate_of_a_trained_layer_is_within_100_times_its_error(layer_id, dtype):
    row = judged(layer_id, dtype)
    assert zoo.failures(row) == [] and zoo.loose(row) is None


@pytest.mark.slow
def test_the_named_low_rank_schedule_takes_the_defaults_a_trained_layer_needs():
    """``schedule="lowrank", rank=16`` (the head width) on a trained GPT-2 layer: named, it learns the
    biases and calibrates the token scale as ``"targeted"`` does. With the bias-free model at ``d ** 0.25``
    every first-group instance failed its saturation and no model came (docs/trained-layers.md, 'Measured:
    the low-rank schedule at the heads' width'). The estimate, near 100 times the error there (most of it
    the basis's rounding term of docs/algorithm.md, 'Low-rank heads'), is held only to cover the error:
    rounding-level errors move by tens of percent between machines."""
    row = zoo.run_and_judge("gpt2-d64-h4/0", torch.float64, schedule="lowrank", rank=16)
    result = row["result"]
    assert result.schedule == "lowrank" and result.details.rank == 16 and result.bias
    assert result.calibration_queries > 0 and row["queries"] == result.queries
    assert zoo.failures(row) == []


@pytest.mark.slow
def test_finals_at_half_weight_see_the_slow_key_the_large_query_criterion_misses_in_float32():
    """qwen2-d32-h4/1 in float32 (docs/algorithm.md, 'Finals at half weight for the slow blocks'): the large-query
    search's token left a key of 4e-4 in the slowest blocks (theta = 1e-3), where the start needs 1e-4.
    From the weights: at the key-neutral token and at one with such a key, the large-query criterion (finals
    at self-score 0) tells them apart by less than the half-weight criterion (finals held at half weight
    after 256 copies), which sees the key far above the float32 answers' noise."""
    from mhaextract.adapters.rotary import to_rotary
    from mhaextract.adapters.torch import TorchOracle
    from mhaextract.oracle.boundary import OracleBoundary
    from mhaextract.rotary.neutral import (HALF_WEIGHT_LENGTHS, LARGE_QUERY_LENGTHS, half_weight_misfit,
                                           hold_self_scores, off_shape_misfit)
    layer_id = "qwen2-d32-h4/1"
    d, H = zoo.shape(layer_id)
    truth = to_rotary(zoo.exact_layer(layer_id, torch.float32).attention)
    K, k = truth.K[::2].reshape(-1, d), truth.key_bias[::2].ravel()   # two heads a key/value head
    assert truth.theta[0, -1] == pytest.approx(1e-3)
    neutral = -np.linalg.lstsq(K, k, rcond=None)[0]
    slow = np.zeros_like(k)
    slow[[6, 7, 14, 15]] = 4e-4 / np.sqrt(2)                           # the slowest block of each key/value head
    keyed = neutral + np.linalg.lstsq(K, slow, rcond=None)[0]
    boundary = OracleBoundary(TorchOracle(zoo.layer_as_run(layer_id, torch.float32)), d)

    def whole(sequences, description):
        return np.asarray(boundary.ask(sequences, description, whole=True), dtype=np.float64)
    rng, scale = np.random.default_rng(0), d ** 0.25
    finals = []
    for w in rng.standard_normal((2, d)) * 3 * scale / np.sqrt(d):
        for count in (2, 3, 5, 9, 17, 33, 65, 129, 257):
            w, misfit = hold_self_scores(whole, neutral, w, H, rng, count, 3)
        assert misfit <= 1e-5
        finals.append(neutral + w)
    zeroed = [hold_self_scores(whole, neutral, w, H, rng)[0] for w in rng.standard_normal((2, d)) * 3 * scale / np.sqrt(d)]
    # the key's response against the criterion's noise (its value at the neutral token), over all its entries
    large = [off_shape_misfit(whole, z, zeroed, LARGE_QUERY_LENGTHS) for z in (neutral, keyed)]
    half = [half_weight_misfit(whole, z, finals, HALF_WEIGHT_LENGTHS, 256.0) for z in (neutral, keyed)]
    seen_large = np.linalg.norm(large[1] - large[0]) / np.linalg.norm(large[0])
    seen_half = np.linalg.norm(half[1] - half[0]) / np.linalg.norm(half[0])
    assert seen_half >= 4 and seen_half >= 3 * seen_large
