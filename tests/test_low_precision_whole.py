"""Layers answering whole outputs in bfloat16 or float16 (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated
lines, then least squares'): the saturated start and the fit on whole answers, with library defaults.

The oracles are written here: a vector attention computed in float64 from its parameters and
rounded to bfloat16 (round to nearest even, by bit arithmetic on float32) or float16, and a
torch GPT-2 layer run in bfloat16 whose truth is written from its own rounded weights.
"""

import numpy as np
import pytest

import mhaextract as mx
from test_resume import PaidOracle, Stop  # counts what it answers; raises as a batch in flight


def round_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Round to bfloat16 (``bits = 8``: to nearest even on the float32 bit pattern) or float16
    (``bits = 11``: numpy's own float16, with its range and subnormals)."""
    if bits == 11:
        return np.asarray(values).astype(np.float16).astype(np.float64)
    single = np.asarray(values, dtype=np.float32)
    raw = single.view(np.uint32)
    half = np.uint32(0x7FFF) + ((raw >> np.uint32(16)) & np.uint32(1))
    return ((raw + half) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)


def attention(W, V, u, c, X):
    """f(X) = c + sum_h V_h sum_i softmax_i(x_i^T (W_h x_N + u_h)) x_i, float64, one sequence."""
    total = np.array(c, dtype=np.float64)
    for h in range(len(W)):
        scores = X @ (W[h] @ X[-1] + u[h])
        weights = np.exp(scores - scores.max())
        total = total + V[h] @ (weights @ X) / weights.sum()
    return total


class RoundedLayer:
    """Whole outputs of a random layer with biases, rounded to ``bits``; counts what it answers."""

    def __init__(self, d, heads, bits, seed):
        rng = np.random.default_rng(seed)
        self.W = rng.standard_normal((heads, d, d)) / d
        self.V = rng.standard_normal((heads, d, d)) / np.sqrt(d)
        self.u = rng.standard_normal((heads, d)) / np.sqrt(d)
        self.c = rng.standard_normal(d) / 4
        self.bits, self.sequences = bits, 0

    def __call__(self, batch):
        self.sequences += len(batch)
        return round_bits(np.stack([attention(self.W, self.V, self.u, self.c, X) for X in batch]), self.bits)

    @property
    def truth(self):
        return mx.MultiHeadAttention(self.W, self.V, self.u, self.c)


@pytest.mark.parametrize("bits, name, limit", [(8, "bfloat16", 2e-2), pytest.param(11, "float16", 3e-3, marks=pytest.mark.slow)])
def test_a_layer_answering_few_bits_is_extracted_whole(bits, name, limit):
    oracle = RoundedLayer(6, 2, bits, seed=1)
    result = mx.extract(oracle, 6, heads=2, seed=3)
    assert result.answer_dtype == name and result.ok and result.model.is_vector
    error = mx.compare(result.model, oracle.truth).max_rel
    assert error <= limit
    assert result.error_estimate >= error / 10  # never far below the truth
    assert result.queries == oracle.sequences  # the calibration's probes included, counted by the oracle
    assert result.max_query_length <= 64


@pytest.mark.slow  # 4 s
def test_the_start_alone_is_near_and_the_fit_reaches_the_answers_noise():
    oracle = RoundedLayer(8, 3, 8, seed=2)
    result = mx.extract(oracle, 8, heads=3, seed=0)
    start = mx.compare(result.start.model, oracle.truth).max_rel
    final = mx.compare(result.model, oracle.truth).max_rel
    assert start < 0.2 and final < start / 5
    assert result.answers_residual <= 4 * 2.0**-8


@pytest.mark.slow
def test_a_result_is_saved_and_loaded(tmp_path):
    oracle = RoundedLayer(4, 2, 11, seed=4)
    result = mx.extract(oracle, 4, heads=2, seed=1)
    json_path, _ = mx.save_extraction(result, tmp_path / "layer.json")
    loaded = mx.load_model(json_path)
    np.testing.assert_array_equal(loaded.V, result.model.V)
    np.testing.assert_array_equal(loaded.W, result.model.W)
    assert result.summary()["answer_dtype"] == "float16"


def test_outputs_that_are_not_attention_fail_loudly():
    """A whole output bent by a non-linearity, rounded to 8 bits: no silent model."""
    layer = RoundedLayer(5, 2, 8, seed=3)

    def bent(batch):
        return round_bits(np.tanh(3 * np.stack([attention(layer.W, layer.V, layer.u, layer.c, X) for X in batch])), 8)
    with pytest.raises(mx.ExtractionError):
        mx.extract(bent, 5, heads=2, seed=0)


def test_a_declared_format_with_a_given_token_scale_and_scalar_answers():
    """No calibration (token_scale given): the declared answer_dtype routes the run; a scalar
    oracle at 8 bits fails loudly, saying to answer whole outputs."""
    layer = RoundedLayer(4, 2, 8, seed=0)
    layer.answer_dtype = "bfloat16"
    result = mx.extract(layer, 4, heads=2, seed=0, token_scale=3.0)
    assert result.schedule == "saturated" and result.ok and result.calibration_queries == 0

    def scalar(batch):
        return layer(batch)[:, 0]
    scalar.answer_dtype = "bfloat16"
    with pytest.raises(mx.ExtractionError, match="whole output"):
        mx.extract(scalar, 4, heads=2, seed=0, token_scale=3.0)


@pytest.mark.parametrize("options, named", [
    ({"max_heads": 3}, "max_heads"), ({"heads": 2, "rank": 2}, "rank"), ({"heads": 2, "bias": False}, "bias=False"),
    ({"heads": 2, "refine": True}, "refine"), ({"heads": 2, "answer_error": 1e-3}, "answer_error"),
])
def test_options_the_low_precision_run_does_not_take_are_refused_before_queries_are_paid(options, named):
    """Counted at the oracle: a declared format refuses before any query; a format read from the
    answers' bits refuses after the calibration's 1 + 2P = 17 one-token probes, not its 147."""
    oracle = RoundedLayer(4, 2, 8, seed=0)
    with pytest.raises(ValueError, match=f"bfloat16.*calibration's first 17 answers.*{named}"):
        mx.extract(oracle, 4, seed=0, **options)
    assert oracle.sequences == 17
    declared = RoundedLayer(4, 2, 11, seed=0)
    declared.answer_dtype = "float16"
    with pytest.raises(ValueError, match=f"float16.*declares answer_dtype='float16'.*{named}"):
        mx.extract(declared, 4, seed=0, **options)
    assert declared.sequences == 0


def test_a_torch_layer_in_bfloat16_refuses_max_heads_before_any_query():
    torch = pytest.importorskip("torch")
    from mhaextract.adapters.torch import TorchOracle
    layer = torch.nn.MultiheadAttention(4, 2, batch_first=True).to(torch.bfloat16)
    for oracle in (TorchOracle(layer), TorchOracle(layer, np.ones(4))):  # a read-out runs the same learner
        with pytest.raises(ValueError, match="max_heads"):
            mx.extract(oracle, 4, max_heads=2, seed=0)
        assert oracle.sequences == 0


@pytest.mark.slow
def test_a_bfloat16_gpt2_layer_is_as_close_to_its_exact_layer_as_it_is_itself():
    """GPT-2 at d = 32, H = 2 in bfloat16, biases: the extracted model's outputs at every position
    of fresh sequences of 1..32 tokens are at least as close to the exact layer (its own bfloat16
    weights in float64) as the bfloat16 layer's are."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mhaextract.adapters.torch import TorchOracle, to_torch
    from test_narrow_heads import gpt2_truth
    from test_real_layers import build
    d, H = 32, 2
    layer = build("GPT2Attention", d, H, seed=5, implementation="sdpa").to(torch.bfloat16)
    exact = build("GPT2Attention", d, H, seed=5, implementation="sdpa").double()
    exact.load_state_dict({key: value.double() for key, value in layer.state_dict().items()})
    result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, progress=False)
    assert result.ok and result.answer_dtype == "bfloat16"
    error = mx.compare(result.model, gpt2_truth(exact)).max_rel
    assert error <= 2e-2 and result.error_estimate >= error / 10
    replacement = to_torch(result.model, causal=True)
    rng = np.random.default_rng(9)
    own = mine = top = 0.0
    with torch.no_grad():
        for n in rng.integers(1, 33, size=60):
            X = torch.as_tensor(rng.standard_normal((1, int(n), d)))
            truth = exact(X)[0]
            top = max(top, float(truth.abs().max()))
            own = max(own, float((layer(X.to(torch.bfloat16))[0].double() - truth).abs().max()))
            mine = max(mine, float((replacement(X) - truth).abs().max()))
    assert mine <= own, (mine / top, own / top)


def test_the_fit_design_and_its_subset_predict_every_answer():
    """The fit's misfit on a design and on every 4th query of it: every prediction is computed
    (an unfilled entry would be read as a misfit), the model's own outputs to float64 rounding."""
    from mhaextract.lowprecision.fit import Design, predictions
    from mhaextract.oracle.queries import random_queries
    layer = RoundedLayer(5, 2, 8, seed=6)
    sequences = random_queries(np.random.default_rng(0), 41, 5, 2.0, (1, 6))
    expected = np.stack([attention(layer.W, layer.V, layer.u, layer.c, X) for X in sequences])
    design = Design(sequences, expected)
    np.testing.assert_allclose(predictions(layer.truth, design), expected, rtol=1e-12, atol=1e-12)
    part = design.subset(4)
    np.testing.assert_allclose(predictions(layer.truth, part), part.answers, rtol=1e-12, atol=1e-12)
    assert len(part.answers) < len(sequences) and part.scale == design.scale


def test_the_fit_stops_where_its_misfit_stalls_and_is_as_close_as_one_run_to_its_cap(monkeypatch):
    """L-BFGS stops once ten iterations lower the misfit by less than a thousandth of what the
    parameters' statistical error adds to it (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then
    least squares'): well before its cap, and the fit run on to the cap is no closer to the truth."""
    import mhaextract.lowprecision.fit as fit
    from mhaextract.oracle.queries import random_queries
    layer = RoundedLayer(5, 2, 8, seed=6)
    sequences = random_queries(np.random.default_rng(0), 1500, 5, 2.0, (2, 8))
    design = fit.Design(sequences, layer(sequences))
    rng = np.random.default_rng(1)
    truth = layer.truth
    start = mx.MultiHeadAttention(*(p * (1 + 1e-2 * rng.standard_normal(np.shape(p)))
                                    for p in (truth.W, truth.V, truth.u, truth.c)))
    stalled = fit.fit_whole(start, design, iterations=3000)
    monkeypatch.setattr(fit, "STALL_FRACTION", 0.0)
    capped = fit.fit_whole(start, design, iterations=3000)
    assert stalled.iterations < capped.iterations
    error, floor = (mx.compare(f.model, truth).max_rel for f in (stalled, capped))
    assert error <= 1.1 * floor and error < mx.compare(start, truth).max_rel / 3


def test_a_fit_larger_than_the_memory_available_is_refused_before_the_start(monkeypatch):
    """The fit's queries and answers are held at once; where they would not fit the machine's
    available memory the run fails loudly, naming the size, before the start asks its queries."""
    import mhaextract.lowprecision.learn as learn
    from mhaextract.lowprecision.fit import fit_memory
    monkeypatch.setattr(learn, "available_memory", lambda: 10**5)
    oracle = RoundedLayer(4, 2, 8, seed=4)
    with pytest.raises(mx.ExtractionError, match="fit_memory.*GiB.*more memory") as caught:
        mx.extract(oracle, 4, heads=2, seed=1)
    result = caught.value.extraction
    assert result.model is None and [c.name for c in result.failed_checks] == ["fit_memory"]
    assert result.failed_checks[0].value == fit_memory(learn.fit_query_count(2, 4, 4), 2, 4, 4, learn.FIT_LONGEST) > 10**5
    assert result.start is None and result.queries == oracle.sequences < 200  # the calibration's probes only


@pytest.mark.slow
@pytest.mark.parametrize("stop_after", [100, 1000, 3000])  # in the calibration, the start, the fit
def test_an_interrupted_run_resumes_from_its_transcript_to_the_same_model(tmp_path, stop_after):
    """With ``transcript=``, a run stopped part way loses at most the batch in flight: the re-run
    reads the answers back, asks the oracle only for the rest (and the resume check's probes), and
    returns the uninterrupted run's model bit for bit."""
    plain = mx.extract(RoundedLayer(4, 2, 8, seed=5), 4, heads=2, seed=2, batch_size=64)
    path = tmp_path / "run.sqlite"
    first = PaidOracle(RoundedLayer(4, 2, 8, seed=5), stop_after)
    with pytest.raises(Stop):
        mx.extract(first, 4, heads=2, seed=2, batch_size=64, transcript=path)
    again = PaidOracle(RoundedLayer(4, 2, 8, seed=5))
    resumed = mx.extract(again, 4, heads=2, seed=2, batch_size=64, transcript=path, resume_check=3)
    assert resumed.schedule == "saturated" and resumed.ok
    for name in ("W", "V", "u", "c"):
        assert np.array_equal(getattr(resumed.model, name), getattr(plain.model, name)), name
    assert resumed.error_estimate == plain.error_estimate
    saved = first.paid - 64  # all but the batch in flight
    # the resume check's 3 probes are asked and counted beside the answers read back
    assert resumed.queries == plain.queries + 3 == resumed.queries_asked + resumed.queries_replayed
    assert resumed.queries_replayed >= saved and again.paid == resumed.queries_asked
    assert again.paid <= plain.queries - saved + 3
    # a complete transcript: only the resume check's probes are asked
    last = PaidOracle(RoundedLayer(4, 2, 8, seed=5))
    replayed = mx.extract(last, 4, heads=2, seed=2, batch_size=64, transcript=path, resume_check=3)
    assert last.paid == 3 and np.array_equal(replayed.model.W, plain.model.W)


@pytest.mark.slow
def test_a_transcript_of_another_layer_is_refused_on_resume(tmp_path):
    path = tmp_path / "run.sqlite"
    mx.extract(RoundedLayer(4, 2, 8, seed=5), 4, heads=2, seed=2, transcript=path)
    with pytest.raises(mx.TranscriptError, match="different oracle"):
        mx.extract(RoundedLayer(4, 2, 8, seed=6), 4, heads=2, seed=2, transcript=path)


def test_a_window_beyond_the_fits_queries_fails_the_long_verification():
    """A layer that attends to its last 10 tokens only answers the fit's queries (up to 8 tokens)
    as one without a window; the verification's longer queries, at the fit's token scale and half
    of it, show the difference and the run fails loudly, naming the lengths."""
    layer = RoundedLayer(4, 2, 8, seed=7)

    def windowed(batch):
        return layer([X[-10:] for X in batch])
    with pytest.raises(mx.ExtractionError, match="long_verification.*fits every query up to"):
        mx.extract(windowed, 4, heads=2, seed=0)


@pytest.mark.slow  # about 30 s of CPU in all, 20 of them nn.MultiheadAttention's
@pytest.mark.parametrize("kind, dtype, d, std, seed", [
    ("GPT2Attention", "float16", 12, 0.15, 201), ("BertSelfAttention", "bfloat16", 12, 0.1, 202),
    # three times one refit's move on permuted residuals was 0.63 of this layer's error
    ("nn.MultiheadAttention", "bfloat16", 16, 0.1, 18)])
def test_the_error_estimate_bounds_the_true_error_of_a_rounding_layer(kind, dtype, d, std, seed):
    """The error estimate, a wild bootstrap plus two units (docs/algorithm.md, 'Whole answers at 8 or
    11 bits: saturated lines, then least squares'), is at least the parameter error and within 100
    times it, on torch
    layers answering in float16 or bfloat16 (H = 2, eager attention, every weight and bias
    N(0, std^2)); the truth is the float64 layer of the same rounded weights, reduced from them here.
    nn.MultiheadAttention's half arithmetic errs the same way for every set of queries, which no
    bootstrap sees: the estimate's units term covers it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mhaextract.adapters.torch import TorchOracle, to_reduced
    from test_real_layers import build, with_std
    H = 2
    layer = with_std(build(kind, d, H, seed=seed, implementation="eager").eval(), std, seed).to(getattr(torch, dtype))
    exact = build(kind, d, H, seed=seed, implementation="eager").eval().double()
    exact.load_state_dict({key: value.double() for key, value in layer.state_dict().items()})
    result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, on_failure="warn", progress=False)
    assert result.answer_dtype == dtype and result.model is not None
    error = float(mx.compare(result.model, to_reduced(exact)).max_rel)
    assert error <= result.error_estimate <= 100 * error, (result.error_estimate, error)
