"""The whole layer: vector answers in, a drop-in replacement module out (docs/algorithm.md, 'The whole layer: vector
outputs and a replacement module').

Truth is computed here, independently of the library: a numpy vector attention written in this file,
and real torch / Hugging Face layers run as themselves (their outputs at every position, float64).
"""

import json

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.oracle.boundary import OracleBoundary, OracleError


def reference_outputs(W, V, u, c, X):
    """f(X) = c + sum_h V_h sum_i softmax_i(x_i^T (W_h x_N + u_h)) x_i for one sequence X (N, d)."""
    total = np.array(c, dtype=np.float64).copy()
    for h in range(len(W)):
        scores = X @ (W[h] @ X[-1] + u[h])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        total += V[h] @ (weights @ X)
    return total


class CountingOracle:
    """Counts every sequence it answers (the truth about queries, outside the library's counters)."""

    def __init__(self, answer):
        self.answer, self.sequences = answer, 0

    def __call__(self, batch):
        self.sequences += len(batch)
        return self.answer(batch)


def vector_target(d=6, heads=2, d_out=5, seed=0):
    return mx.MultiHeadAttention.random(d, heads, seed=seed, bias=True, d_out=d_out)


# ----------------------------------------------------------------------------------------- the model
def test_vector_model_evaluates_like_the_reference():
    model = vector_target(d=5, heads=3, d_out=4, seed=1)
    rng = np.random.default_rng(0)
    batch = [rng.standard_normal((n, 5)) for n in (1, 2, 7, 7)]
    expected = np.array([reference_outputs(model.W, model.V, model.u, model.c, X) for X in batch])
    assert model(batch).shape == (4, 4)
    np.testing.assert_allclose(model(batch), expected, rtol=1e-13, atol=1e-13)
    r = rng.standard_normal(4)
    np.testing.assert_allclose(model.readout(r)(batch), expected @ r, rtol=1e-12, atol=1e-12)


def test_vector_model_in_high_precision_agrees_with_float64():
    model = vector_target(d=3, heads=2, d_out=2, seed=2)
    batch = [np.random.default_rng(1).standard_normal((4, 3))]
    exact = model(batch, precision=120)
    assert exact.shape == (1, 2)
    np.testing.assert_allclose(np.vectorize(float)(exact), model(batch), rtol=1e-14)


def test_vector_canonical_form_merges_and_drops():
    rng = np.random.default_rng(3)
    W = rng.standard_normal((2, 4, 4))
    V = rng.standard_normal((2, 3, 4))
    model = mx.MultiHeadAttention(np.stack([W[0], W[0], W[1], W[1]]), np.stack([V[0], V[1], V[1], -V[1]]),
                                  c=np.ones(3))
    canonical = model.canonical()
    assert canonical.heads == 1 and canonical.is_vector and canonical.d_out == 3
    np.testing.assert_array_equal(canonical.V[0], V[0] + V[1])


def test_vector_model_validates_its_shapes():
    W = np.zeros((2, 3, 3))
    with pytest.raises(ValueError, match="V must have shape"):
        mx.MultiHeadAttention(W, np.zeros((2, 4, 2)))
    with pytest.raises(ValueError, match=r"c must have shape \(d_out,\)"):
        mx.MultiHeadAttention(W, np.zeros((2, 4, 3)), c=1.0)
    with pytest.raises(ValueError, match="c must be a scalar"):
        mx.MultiHeadAttention(W, np.zeros((2, 3)), c=np.ones(3))
    with pytest.raises(AttributeError, match="readout"):
        mx.MultiHeadAttention(W, np.zeros((2, 4, 3))).v
    with pytest.raises(ValueError, match="d_out"):
        mx.compare(mx.MultiHeadAttention(W, np.zeros((2, 4, 3))), mx.MultiHeadAttention(W, np.zeros((2, 3))))


# -------------------------------------------------------------------------------------- the boundary
def boundary_for(answer, d=3):
    return OracleBoundary(answer, d)


@pytest.mark.parametrize("form", ["array", "list", "float32"])
def test_vector_answers_cross_the_boundary_read_out(form):
    model = vector_target(d=3, heads=1, d_out=4)
    convert = {"array": lambda a: a, "list": lambda a: [row for row in a], "float32": lambda a: a.astype(np.float32)}
    boundary = boundary_for(lambda batch: convert[form](model(batch)))
    batch = [np.random.default_rng(n).standard_normal((2, 3)) for n in range(5)]
    scalars = boundary.ask(batch)
    expected = np.asarray(convert[form](model(batch)), dtype=np.float64)
    np.testing.assert_array_equal(scalars, (expected * boundary.vectors.readout).sum(axis=1))
    np.testing.assert_array_equal(boundary.ask(batch, whole=True), expected)
    assert boundary.vectors.d_out == 4 and boundary.queries == 10


def test_bad_vector_answers_are_named_by_query_and_output():
    def nan_in_output_2(batch):
        answers = np.ones((len(batch), 4))
        answers[1, 2] = np.nan
        return answers
    with pytest.raises(OracleError, match=r"answer to query 1, output 2 of 4, is nan"):
        boundary_for(nan_in_output_2).ask([np.zeros((1, 3))] * 3)
    width = iter([4, 5])
    changing = boundary_for(lambda batch: np.ones((len(batch), next(width))))
    changing.ask([np.zeros((1, 3))])
    with pytest.raises(OracleError, match="vectors of 5 numbers after vectors of 4"):
        changing.ask([np.zeros((1, 3))])
    ragged = boundary_for(lambda batch: [np.ones(2), np.ones(3)])
    with pytest.raises(OracleError, match="has shape"):
        ragged.ask([np.zeros((1, 3))] * 2)
    with pytest.raises(OracleError, match="in high precision"):
        OracleBoundary(lambda batch: np.ones((len(batch), 2)), 3, precision=80).ask([np.zeros((1, 3))])


def test_torch_tensor_answers_that_require_grad_or_are_bfloat16():
    torch = pytest.importorskip("torch")
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    boundary = boundary_for(lambda batch: torch.as_tensor(np.stack([s[-1] for s in batch])) @ weight)
    np.testing.assert_array_equal(boundary.ask([np.full((2, 3), 0.5)]), [1.5])
    halves = boundary_for(lambda batch: torch.full((len(batch), 2), 1 / 3, dtype=torch.bfloat16))
    whole = halves.ask([np.zeros((1, 3))], whole=True)
    assert whole[0, 0] == float(torch.tensor(1 / 3, dtype=torch.bfloat16))  # converted exactly


# ------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize("schedule", ["auto", "targeted", "lowrank", "paper", "lean"])
def test_vector_run_asks_the_scalar_runs_queries_and_recovers_the_layer(schedule):
    """The schedule part of a vector run is the scalar run of the read-out r^T f, bit for bit; the value
    fit adds its fresh queries; the whole model is the target's. "auto" first tries the split of whole
    answers, which full-rank heads (H r = 8 > d_out = 3) make give way: its queries add to the count."""
    d, heads, rank = (8, 2, 2) if schedule == "lowrank" else (4, 2, None)
    bias = schedule in ("auto", "targeted", "lowrank")
    target = mx.MultiHeadAttention.random(d, heads, seed=5, bias=bias, d_out=3, rank=rank)
    options = dict(heads=heads, seed=2, schedule=schedule,
                   **({"rank": rank, "bias": True, "token_scale": "auto"} if rank else {}))
    vector_oracle = CountingOracle(lambda batch: target(batch))
    result = mx.extract(vector_oracle, d, **options)
    r = result.readout
    scalar_oracle = CountingOracle(lambda batch: (target(batch) * r).sum(axis=1))
    scalar = mx.extract(scalar_oracle, d, **options)
    np.testing.assert_array_equal(result.scalar_model.W, scalar.model.W)
    np.testing.assert_array_equal(result.scalar_model.v, scalar.model.v)
    fit_queries = result.value_fit.rows
    assert fit_queries == heads * d + 1 + 32
    split = result.split_queries if schedule == "auto" else 0
    assert (split > 0) == (schedule == "auto") and ("vector: whole answers could not be split" in
                                                    result.schedule_reason) == (schedule == "auto")
    assert vector_oracle.sequences == result.queries == scalar_oracle.sequences + fit_queries + split
    assert result.ok and result.d_out == 3 and result.model.is_vector
    comparison = mx.compare(result.model, target)
    assert comparison.max_rel <= max(1e-11, 10 * result.error_estimate) and comparison.max_rel <= 1e-6
    # the value fit adds no error of its own beyond the scores': V as good as the schedule's v
    assert comparison.v_rel <= max(1e-12, 10 * mx.compare(scalar.model, target.readout(r)).max_rel)


def test_one_output_needs_no_value_queries():
    target = mx.MultiHeadAttention.random(4, 2, seed=1, bias=True)
    oracle = CountingOracle(lambda batch: target(batch)[:, None])  # (B, 1)
    result = mx.extract(oracle, 4, heads=2, seed=0)
    scalar = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=0)
    assert result.model.is_vector and result.model.d_out == 1 and result.queries == scalar.queries
    np.testing.assert_array_equal(result.model.V[:, 0], scalar.model.v)


def test_vector_result_saves_and_loads(tmp_path):
    target = vector_target()
    result = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0)
    json_path, _ = mx.save_extraction(result, tmp_path / "layer.json")
    loaded = mx.load_model(json_path)
    assert loaded.is_vector and loaded.d_out == 5
    np.testing.assert_array_equal(loaded.V, result.model.V)
    np.testing.assert_array_equal(loaded.c, result.model.c)
    assert json.loads(json_path.read_text())["summary"]["d_out"] == 5


def test_outputs_that_are_not_attention_of_the_learned_scores_fail_loudly():
    """A coordinate bent by a non-linearity orthogonal to the run's read-out: the schedule's scalar run is
    the target's and passes, and only the value fit can see the rest; its residual fails loudly."""
    from mhaextract.oracle.vector_answers import VectorAnswers
    target = vector_target(d=4, heads=2, d_out=3, seed=4)
    readout = VectorAnswers(0)
    readout.start(3)
    bend = np.array([1.0, 0.0, 0.0]) - readout.readout[0] * readout.readout  # orthogonal to r

    def bent(batch):
        answers = target(batch)
        return answers + 0.05 * np.array([float(np.sum(X[-1] ** 2)) for X in batch])[:, None] * bend
    result = mx.extract(bent, 4, heads=2, seed=0, on_failure="warn")
    assert result.scalar_model is not None and mx.compare(result.scalar_model, target.readout(readout.readout)).max_rel < 1e-9
    # the value fit's residual, and the default verification of the whole model on long queries
    assert {check.name for check in result.failed_checks} == {"value_fit_residual", "long_verification"}


VECTOR_MODULE = '''
import numpy as np

# A "remote" layer answering all 4 outputs at the final token: d = 3, two heads, known only here.
_rng = np.random.default_rng(7)
W = _rng.standard_normal((2, 3, 3)) / np.sqrt(3)
V = _rng.standard_normal((2, 4, 3))
c = _rng.standard_normal(4)


def oracle(batch):
    answers = []
    for X in batch:
        out = c.copy()
        for W_h, V_h in zip(W, V):
            scores = X @ W_h @ X[-1]
            weights = np.exp(scores - scores.max())
            out += V_h @ (weights @ X) / weights.sum()
        answers.append(out)
    return np.array(answers)
'''


def test_cli_extract_writes_the_whole_layer(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mhaextract.tools.cli import app
    (tmp_path / "layer_oracle.py").write_text(VECTOR_MODULE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "layer.json"
    result = CliRunner().invoke(app, ["extract", "--oracle", "layer_oracle.py:oracle", "--d", "3", "--heads", "2",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "outputs per answer" in result.output
    namespace = {}
    exec(VECTOR_MODULE, namespace)
    truth = mx.MultiHeadAttention(namespace["W"], namespace["V"], c=namespace["c"])
    loaded = mx.load_model(out)
    assert loaded.d_out == 4 and mx.compare(loaded, truth).max_rel <= 1e-11


def test_a_vector_run_resumes_from_its_transcript_bit_for_bit(tmp_path):
    """Vector answers are recorded whole: an interrupted run re-pays at most the batch in flight and
    the resume check, and returns the uninterrupted run's model (V and c included)."""
    target = vector_target(d=4, heads=2, d_out=3, seed=6)
    whole = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=3, batch_size=64)
    calls = {"left": whole.queries // 2}

    def failing(batch):
        if calls["left"] < len(batch):
            raise ConnectionError("the layer's server went away")
        calls["left"] -= len(batch)
        return target(batch)
    path = tmp_path / "run.sqlite"
    with pytest.raises(ConnectionError):
        mx.extract(failing, 4, heads=2, seed=3, batch_size=64, transcript=path)
    counting = CountingOracle(lambda batch: target(batch))
    resumed = mx.extract(counting, 4, heads=2, seed=3, batch_size=64, transcript=path)
    paid_before = whole.queries // 2 - calls["left"]
    assert paid_before + counting.sequences - whole.queries <= 64 + 3
    np.testing.assert_array_equal(resumed.model.V, whole.model.V)
    np.testing.assert_array_equal(resumed.model.c, whole.model.c)
    np.testing.assert_array_equal(resumed.model.W, whole.model.W)


@pytest.mark.parametrize("wrap", ["gaussian", "float32"])
def test_noisy_and_float32_whole_answers_are_extracted_within_their_estimate(wrap):
    target = vector_target(d=6, heads=2, d_out=4, seed=1)
    oracle = mx.GaussianNoise(mx.SimulatedOracle(target), 1e-10, seed=0) if wrap == "gaussian" else mx.Float32Oracle(target)
    result = mx.extract(oracle, 6, heads=2, seed=0)
    error = mx.compare(result.model, target).max_rel
    assert result.ok and result.model.d_out == 4
    assert error <= result.error_estimate and error <= (1e-8 if wrap == "gaussian" else 1e-5)


def test_the_chunked_normal_equations_agree_with_the_dense_fit(monkeypatch):
    """Large fits form normal equations in chunks and refine them (memory O(p^2)); on a small fit
    forced down that path they give the dense QR's values, and the same estimate to within its probes."""
    import mhaextract.run.value_fit as outputs
    layer = vector_target(d=5, heads=3, d_out=4, seed=8)
    rng = np.random.default_rng(0)
    queries = [rng.standard_normal((int(n), 5)) for n in rng.integers(2, 9, size=300)]
    answers = layer(queries) + 1e-9 * rng.standard_normal((300, 4))  # a little noise for the estimate
    r = np.ones(4) / 2
    dense = outputs.fit_values(layer.readout(r), queries, answers, True, r, (1e-12, 1e-12))
    monkeypatch.setattr(outputs, "DENSE_ENTRIES", 0)
    monkeypatch.setattr(outputs, "CHUNK", 64)
    chunked = outputs.fit_values(layer.readout(r), queries, answers, True, r, (1e-12, 1e-12))
    np.testing.assert_allclose(chunked.model.V, dense.model.V, rtol=0, atol=1e-12)
    np.testing.assert_allclose(chunked.model.c, dense.model.c, rtol=0, atol=1e-12)
    assert mx.compare(chunked.model, layer).max_rel <= chunked.error_estimate
    assert 0.3 <= chunked.error_estimate / dense.error_estimate <= 3
    # chunks rebuilt on every pass (a design over the memory budget) give the kept chunks' numbers
    monkeypatch.setattr(outputs, "DESIGN_CACHE_BYTES", 0)
    rebuilt = outputs.fit_values(layer.readout(r), queries, answers, True, r, (1e-12, 1e-12))
    assert np.array_equal(rebuilt.model.V, chunked.model.V) and rebuilt.error_estimate == chunked.error_estimate


def test_the_value_fit_moved_entry_by_entry_covers_the_values_error_of_uneven_score_errors():
    """Scores off by errors of very uneven size per entry (a few entries 100 times the rest, as a
    targeted run's deviations can be) and exact whole answers: the values and the constant fitted
    under those scores are off by what the score errors move them, which the estimate from each
    entry's deviation (``score_deviations``) must cover, V and c each against its own scale, while
    it stays below the estimate of every entry moved at the largest's (docs/algorithm.md, 'The whole
    layer: vector outputs and a replacement module')."""
    from mhaextract.run.value_fit import fit_values
    tighter = []
    for seed in range(6):
        layer = vector_target(d=6, heads=2, d_out=5, seed=20 + seed)
        rng = np.random.default_rng(seed)
        queries = [rng.standard_normal((int(n), 6)) for n in rng.integers(2, 9, size=120)]
        answers = layer(queries)  # exact: the values' error is the scores' alone
        r = rng.standard_normal(5)
        r /= np.linalg.norm(r)
        W_deviation = 1e-9 * np.abs(layer.W).max() * np.where(rng.random(layer.W.shape) < 0.05, 100.0, 1.0)
        u_deviation = 1e-9 * np.abs(layer.u).max() * np.ones(layer.u.shape)
        scalar = layer.readout(r)
        moved = mx.MultiHeadAttention(scalar.W + W_deviation * rng.standard_normal(scalar.W.shape), scalar.v,
                                      scalar.u + u_deviation * rng.standard_normal(scalar.u.shape), scalar.c)
        largest = 3.0 * float(W_deviation.max()) / np.abs(scalar.W).max()  # the uniform probe's relative error
        uniform = fit_values(moved, queries, answers, True, r, (largest, largest), seed=seed)
        fit = fit_values(moved, queries, answers, True, r, (largest, largest), seed=seed,
                         score_deviations=(W_deviation, u_deviation))
        truth = mx.compare(fit.model, layer)
        assert max(truth.v_rel, truth.c_rel) <= fit.error_estimate, seed
        tighter.append(fit.error_estimate / uniform.error_estimate)
    assert max(tighter) < 1.0
