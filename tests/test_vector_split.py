"""Whole answers split by head (docs/algorithm.md, 'Whole answers near the vector bound').

The truth is the target's own parameters (a MultiHeadAttention with low-rank values, or a torch
layer's weights through ``to_reduced``), evaluated at every position of fresh sequences longer
than any query the run asked.
"""

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.vector import VectorExtraction, vector_bound


def low_rank_layer(d, heads, rank, seed=1):
    """Heads of width ``rank`` on both sides, biases, whole outputs (d_out = d)."""
    scores = mx.MultiHeadAttention.random(d=d, heads=heads, seed=seed, bias=True, rank=rank, d_out=d)
    rng = np.random.default_rng(seed + 100)
    V = np.einsum("hor,hrd->hod", rng.standard_normal((heads, d, rank)), rng.standard_normal((heads, rank, d)))
    return mx.MultiHeadAttention(scores.W, V / np.sqrt(rank), scores.u, scores.c)


def worst_position_error(model, truth, d, seed=7, longest=64, scale=None, lengths=(1, 2, 5, 16)):
    """Largest error over every position of fresh sequences of up to ``longest`` tokens (``lengths``,
    then ``longest``), each relative to the largest output of its prefix; tokens of norm about
    ``scale`` (default ``d^(1/4)``, the random layers' token scale)."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for n in tuple(lengths) + (longest,):
        X = rng.standard_normal((n, d)) * (d ** 0.25 if scale is None else scale) / np.sqrt(d)
        prefixes = [X[:i] for i in range(1, n + 1)]
        expected, got = truth(prefixes), model(prefixes)
        worst = max(worst, float((np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)).max()))
    return worst


@pytest.mark.slow
def test_a_low_rank_layer_is_split_by_head_to_machine_precision():
    d, heads, rank = 8, 2, 4
    target = low_rank_layer(d, heads, rank)
    result = mx.extract(mx.SimulatedOracle(target), d, heads=heads, seed=0, schedule="vector")
    assert isinstance(result, VectorExtraction) and result.ok and result.schedule == "vector"
    assert "split the answers" in result.schedule_reason
    assert result.value_ranks == [rank, rank] and result.refined
    error = worst_position_error(result.model, target, d)
    assert error <= 1e-12 and result.error_estimate >= error
    # the estimate's claim: every position of sequences of up to 64 tokens at norms up to the token scale
    claimed = max(worst_position_error(result.model, target, d, scale=factor * result.token_scale,
                                       lengths=range(1, 64, 4)) for factor in (0.5, 1.0))
    assert claimed <= result.error_estimate <= 100 * claimed
    assert result.vector_bound == vector_bound(d, heads, rank, d)
    assert result.queries <= 25 * result.vector_bound  # at d = 8 the fixed costs dominate (calibration, holdout)


@pytest.mark.slow
def test_the_estimate_covers_a_perturbed_models_error_at_every_position_within_100_times():
    """docs/algorithm.md, 'Whole answers near the vector bound', 'The error estimate': the run's
    held-out design and estimate on a model whose error is known and far above the rounding: the
    layer with one of W, u, V, c moved by 1e-9 of its largest entry at random. The estimate from the
    held-out answers (exact, float64) must cover the error at every position of fresh sequences of up
    to 64 tokens at 0.25, 0.5 and 1 times the token scale, computed from the weights, and stay within
    100 times it."""
    from mhaextract.split.estimate import error_estimate, relative_misfits
    from mhaextract.vector.learn import HOLDOUT_LONGEST, holdout_queries

    d, heads, rank, scale = 8, 2, 4, 8 ** 0.25
    for seed, which in enumerate("WuVc"):
        target = low_rank_layer(d, heads, rank, seed=seed + 1)
        rng = np.random.default_rng(seed)
        moved = {name: getattr(target, name).copy() for name in "WVuc"}
        moved[which] += 1e-9 * np.abs(moved[which]).max() * rng.standard_normal(moved[which].shape)
        model = mx.MultiHeadAttention(moved["W"], moved["V"], moved["u"], moved["c"])
        held = holdout_queries(np.random.default_rng(seed + 10), d, scale)
        estimate = error_estimate(float(relative_misfits(model, held, target(held)).max()), 2.0 ** -53, HOLDOUT_LONGEST)
        error = max(worst_position_error(model, target, d, scale=factor * scale, lengths=range(1, 64, 3))
                    for factor in (0.25, 0.5, 1.0))
        assert error <= estimate <= 100 * error, (which, error, estimate)


@pytest.mark.slow
@pytest.mark.parametrize("d, heads, rank", [(16, 4, 2), (16, 2, 4)])
def test_auto_splits_heads_narrower_than_d_over_h(d, heads, rank):
    """Heads of width r < d / H (W_h, V_h of rank r; ``[W_h | u_h]`` of rank r + 1), so the heads'
    output subspaces span H r < d_out: "auto" splits the whole answers, finds every head's rank,
    the bound counts r, and the model is the layer's to 1e-12 at every position of fresh sequences
    (r = 2: one token before the final one per score query)."""
    target = low_rank_layer(d, heads, rank, seed=1)
    result = mx.extract(mx.SimulatedOracle(target), d, heads=heads, seed=0)
    assert result.schedule == "vector" and result.ok and result.refinement == "full", result.schedule_reason
    assert result.value_ranks == [rank] * heads and result.score_ranks == [rank + 1] * heads
    assert result.vector_bound == vector_bound(d, heads, rank, d)
    error = max(worst_position_error(result.model, target, d, seed=seed) for seed in (7, 8))
    assert error <= 1e-12 and result.error_estimate >= error


def test_whole_answers_that_cannot_split_run_todays_schedule_with_the_reason():
    """Full-rank values (H rank V_h > d_out): the split says so and the targeted schedule runs, its model
    the same bits as the targeted schedule named, its count the same plus the split's queries."""
    target = mx.MultiHeadAttention.random(6, 2, seed=3, bias=True, d_out=6)
    result = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="vector")
    named = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="targeted")
    assert result.schedule == "targeted" and "could not be split" in result.schedule_reason
    assert result.schedule_reason.startswith("schedule='vector' given, which gave way to schedule='targeted'")
    np.testing.assert_array_equal(result.model.W, named.model.W)
    np.testing.assert_array_equal(result.model.V, named.model.V)
    assert result.queries == named.queries + result.split_queries and result.split_queries > 0


def test_scalar_answers_never_try_the_split():
    target = low_rank_layer(6, 2, 3).readout(np.arange(1.0, 7.0))
    result = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="vector")
    named = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="targeted")
    assert result.schedule == "targeted" and result.split_queries == 0 and "could not be split" not in result.schedule_reason
    np.testing.assert_array_equal(result.model.W, named.model.W)
    assert result.queries == named.queries


@pytest.mark.slow
def test_auto_splits_the_whole_answers_of_a_small_float64_layer():
    """Whole float64 answers, H declared, heads that fit in d_out and a refinement that runs in full:
    "auto" runs the split, and its model is the layer's to 1e-12 at every position."""
    d, heads, rank = 8, 2, 4
    target = low_rank_layer(d, heads, rank, seed=5)
    asked = []
    result = mx.extract(lambda batch: asked.extend(batch) or target(batch), d, heads=heads, seed=0)
    assert isinstance(result, VectorExtraction) and result.schedule == "vector" and result.ok
    assert result.schedule_reason.startswith("auto: heads of width r = 4 (at most d_out / H)")
    assert "every parameter is refined" in result.schedule_reason and result.refinement == "full"
    assert result.queries == len(asked)  # measured at the oracle
    error = worst_position_error(result.model, target, d)
    assert error <= 1e-12 and result.error_estimate >= error


def test_auto_gives_way_on_full_rank_heads_beyond_d_out_to_todays_schedule_bit_for_bit():
    """Full-rank heads, H r = 8 > d_out = 3 (rank not declared): the split finds it out, in few
    queries, and the targeted schedule runs as it does alone: the same model and estimate, bit for
    bit, its count plus the split's."""
    target = mx.MultiHeadAttention.random(4, 2, seed=5, bias=True, d_out=3)
    result = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=2)
    named = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=2, schedule="targeted")
    assert result.schedule == "targeted" and result.ok
    for name in ("W", "V", "u", "c"):
        assert np.array_equal(getattr(result.model, name), getattr(named.model, name)), name
    assert result.error_estimate == named.error_estimate
    assert 0 < result.split_queries <= 200  # value map, half circles, one round of perturbed differences
    assert result.queries == named.queries + result.split_queries
    assert (f"vector: whole answers could not be split by head (the heads' output subspaces have dimensions "
            f"[3, 3]") in result.schedule_reason and f"after {result.split_queries} queries" in result.schedule_reason


def test_auto_never_tries_the_split_on_a_scalar_read_out():
    target = low_rank_layer(6, 2, 3).readout(np.arange(1.0, 7.0))
    result = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0)
    named = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="targeted")
    assert result.schedule == "targeted" and result.split_queries == 0 and "vector" not in result.schedule_reason
    assert result.queries == named.queries
    np.testing.assert_array_equal(result.model.W, named.model.W)
    np.testing.assert_array_equal(result.model.v, named.model.v)


def test_auto_asks_no_split_query_where_the_declared_rank_leaves_no_room():
    """rank = 5 with H = 2 and d_out = 8: H rank > d_out, so the low-rank schedule runs at once, as named."""
    target = low_rank_layer(8, 2, 4, seed=1)
    result = mx.extract(mx.SimulatedOracle(target), 8, heads=2, seed=0, rank=5)
    named = mx.extract(mx.SimulatedOracle(target), 8, heads=2, seed=0, schedule="lowrank", rank=5)
    assert result.schedule == "lowrank" and result.split_queries == 0 and result.queries == named.queries
    assert "vector: not tried: H rank = 10 > d_out = 8" in result.schedule_reason
    np.testing.assert_array_equal(result.model.W, named.model.W)
    np.testing.assert_array_equal(result.model.V, named.model.V)
    as_named = mx.extract(mx.SimulatedOracle(target), 8, heads=2, seed=0, schedule="vector", rank=5)
    assert as_named.schedule == "lowrank" and as_named.split_queries == 0 and as_named.queries == named.queries
    np.testing.assert_array_equal(as_named.model.W, named.model.W)


def test_when_auto_splits_whole_answers():
    """The rule of docs/algorithm.md, 'Whole answers near the vector bound', 'When auto splits the
    answers', before any query: the split where its full refinement runs (d = 64 and 128 measured to
    pass) and, in float64 and float32 alike, where its scores-only refinement runs (d = 256, H = 8 and
    4 measured to pass in both); the scalar schedules past that line (d = 768 in either format), and
    where the heads cannot fit in d_out, where the answers are not whole float64 or float32, or where H
    is unknown."""
    from types import SimpleNamespace

    from mhaextract.vector.learner import split_expected

    def expected(d, heads, d_out, answers="float64", precision=None, **options):
        return split_expected(options, SimpleNamespace(d=d, heads=heads, precision=precision), answers, d_out)

    assert expected(64, 4, 64)[0] and expected(128, 8, 128)[0] and expected(64, 4, 64, "float32")[0]
    assert expected(128, 8, 128, rank=16, bias=True)[0] and expected(256, 8, 256)[0]
    for d, heads in [(256, 8), (256, 4), (128, 2)]:  # float32 past the full refinement, inside the scores-only line
        taken, why = expected(d, heads, d, "float32")
        assert taken and "above 1e+09" in why and "<= 2e+09: the scores' parameters are refined" in why, why
    assert "every parameter is refined" in expected(128, 8, 128, "float32")[1]
    for refused, why in [(expected(768, 12, 768), "above 2e+09"), (expected(768, 12, 768, "float32"), "above 2e+09"),
                         (expected(384, 8, 384, "float32"), "above 2e+09"),
                         (expected(8, 2, 8, rank=5), "H rank = 10 > d_out = 8"), (expected(8, 3, 2), "H = 3 heads"),
                         (expected(8, None, 8), "heads=H"), (expected(8, 2, 8, "bfloat16"), "float64 or float32"),
                         (expected(8, 2, 1), "float64 or float32"), (expected(8, 2, 8, precision=128), "precision"),
                         (expected(8, 2, 8, answer_error=1e-9), "answer_error"), (expected(8, 2, 8, bias=False), "bias")]:
        assert not refused[0] and why in refused[1], (why, refused)


def test_the_split_takes_no_option_it_does_not_use():
    target = low_rank_layer(6, 2, 3, seed=5)
    for option in ({"bias": False}, {"answer_error": 1e-9}, {"precision": 128}, {"rank": 7}, {"rank": "two"}):
        with pytest.raises(ValueError, match="schedule='vector'|rank must be"):
            mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="vector", **option)


@pytest.mark.slow
def test_a_resumed_auto_split_replays_its_answers(tmp_path):
    target = low_rank_layer(6, 2, 3, seed=4)
    path = tmp_path / "run.sqlite"
    first = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=2, transcript=path)
    again = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=2, transcript=path)
    assert first.schedule == again.schedule == "vector" and again.queries_asked <= 3
    np.testing.assert_array_equal(again.model.W, first.model.W)


@pytest.mark.slow
def test_a_resumed_vector_run_replays_its_answers(tmp_path):
    target = low_rank_layer(6, 2, 3, seed=4)
    path = tmp_path / "run.sqlite"
    first = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=2, transcript=path, schedule="vector")
    again = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=2, transcript=path, schedule="vector")
    # nothing asked again but the resume check's re-asked calibration probes (3 by default)
    assert isinstance(again, VectorExtraction) and again.queries_asked <= 3
    assert again.queries == first.queries + again.queries_asked
    np.testing.assert_array_equal(again.model.W, first.model.W)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_layers_are_split_by_head(dtype):
    torch = pytest.importorskip("torch")
    from mhaextract.adapters.torch import TorchOracle, to_reduced

    torch.manual_seed(0)
    d, heads = 16, 4
    exact = torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        exact.in_proj_bias.normal_(0, 0.2)
        exact.out_proj.bias.normal_(0, 0.2)
    layer = exact if dtype == "float64" else torch.nn.MultiheadAttention(d, heads, batch_first=True).float()
    if dtype == "float32":
        layer.load_state_dict({k: v.float() for k, v in exact.state_dict().items()})
    result = mx.extract(TorchOracle(layer.eval()), d, heads=heads, seed=0, schedule="vector")
    assert isinstance(result, VectorExtraction) and result.ok and result.answer_dtype == dtype
    error = worst_position_error(result.model, to_reduced(exact.eval()), d)
    assert error <= (1e-12 if dtype == "float64" else 1e-5) and result.error_estimate >= error
    # at d = 16 the calibration's probes and the 64 held-out and verification queries are a third of it;
    # float32 asks the oversampled score design (3, 1): twice the score queries
    assert result.queries <= (15 if dtype == "float64" else 16) * result.vector_bound


@pytest.mark.slow
def test_a_split_whose_model_fails_its_checks_gives_way_to_the_scalar_schedule(monkeypatch):
    """Never a guess: a vector model failing a check (here the estimate inflated past its limit) is
    dropped, the targeted schedule runs, and the reason names the failed check."""
    import mhaextract.split.estimate as estimate

    monkeypatch.setattr(estimate, "ESTIMATE_FACTOR", 1e30)
    target = low_rank_layer(6, 2, 3, seed=6)
    result = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="vector")
    named = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="targeted")
    assert result.schedule == "targeted" and "error_estimate" in result.schedule_reason and result.ok
    np.testing.assert_array_equal(result.model.W, named.model.W)
    assert result.queries == named.queries + result.split_queries


def test_full_rank_heads_with_room_in_the_outputs_are_split():
    """H heads of full rank d (W_h and V_h) with d_out = H d: the split works and reaches the rounding."""
    d, heads = 6, 2
    target = mx.MultiHeadAttention.random(d=d, heads=heads, seed=2, bias=True, d_out=heads * d)
    result = mx.extract(mx.SimulatedOracle(target), d, heads=heads, seed=0, schedule="vector")
    assert result.schedule == "vector" and result.ok and result.value_ranks == [d, d] and result.score_ranks == [d, d]
    error = worst_position_error(result.model, target, d)
    assert error <= 1e-12 and result.error_estimate >= error


def test_the_unrefined_route_takes_its_values_from_the_split_to_near_the_rounding(monkeypatch):
    """The route of layers too large for any refinement (GPT-2 small, d = 768), forced here at d = 32:
    the model's values are the split's, ``V_h = O_h [O^+]_h V_tot``, so V_tot and each head's subspace
    must come to the answers' rounding (docs/algorithm.md, 'Whole answers near the vector bound', 'What
    limits the split's values'). Against the layer's own V_h and outputs: V_h within 1.5e-14 and 5e-13
    at every position of fresh sequences (V_tot by LU with r + 2 columns against the value map's
    reference gives 3.2e-14 and 4.6e-14, 1.0e-12 and 5.5e-13 on these two layers: the bounds tell the two apart)."""
    import mhaextract.vector.learn as learn

    monkeypatch.setattr(learn, "REFINE_WORK", 0.0)
    monkeypatch.setattr(learn, "SCORE_REFINE_WORK", 0.0)
    d, heads, rank = 32, 4, 8
    for seed in (1, 3):
        target = low_rank_layer(d, heads, rank, seed=seed)
        result = mx.extract(mx.SimulatedOracle(target), d, heads=heads, seed=0, schedule="vector", on_failure="warn")
        assert result.schedule == "vector" and result.refinement == "" and result.ok
        error = max(worst_position_error(result.model, target, d, seed=position) for position in (7, 8))
        assert mx.compare(result.model, target).v_rel <= 1.5e-14
        assert error <= 5e-13 and result.error_estimate >= error


@pytest.mark.slow
def test_a_d32_layer_reaches_the_rounding_at_every_position():
    """d = 32, H = 4, heads of width 8 with biases (the full refinement's route): 1e-12 at every
    position of fresh sequences of up to 64 tokens, against the layer's own weights, in at most 10
    times the vector bound (d = 64 and 128: benchmarks/bench_vector.py, docs/scale.md)."""
    d, heads, rank = 32, 4, 8
    target = low_rank_layer(d, heads, rank, seed=3)
    result = mx.extract(mx.SimulatedOracle(target), d, heads=heads, seed=0, schedule="vector")
    assert result.schedule == "vector" and result.ok and result.refinement == "full"
    error = max(worst_position_error(result.model, target, d, seed=seed) for seed in (7, 8))
    assert error <= 1e-12 and result.error_estimate >= error
    assert result.queries <= 10 * result.vector_bound


@pytest.mark.slow
def test_the_scores_only_route_is_near_the_rounding_and_its_estimate_covers_it(monkeypatch):
    """The route of layers too large for the full refinement (d >= 256), forced here at d = 32: the
    oversampled scores and the scores-only Gauss-Newton keep the split's values, whose per-head error
    (cond(O) times the rounding) bounds the model (d = 256: 3.4e-14, docs/scale.md); the estimate
    covers the error."""
    import mhaextract.vector.learn as learn

    monkeypatch.setattr(learn, "REFINE_WORK", 0.0)
    d, heads, rank = 32, 4, 8
    target = low_rank_layer(d, heads, rank, seed=3)
    result = mx.extract(mx.SimulatedOracle(target), d, heads=heads, seed=0, schedule="vector", on_failure="warn")
    assert result.schedule == "vector" and result.refinement == "scores"
    error = max(worst_position_error(result.model, target, d, seed=seed) for seed in (7, 8))
    assert error <= 1e-11 and result.error_estimate >= error


@pytest.mark.slow
def test_a_trained_float32_layer_splits_into_its_heads_full_widths(monkeypatch):
    """GPT-2-d32-h2 layer 0 of the trained zoo (tests/zoo.py), float32: its value maps fall 60..80-fold
    in singular value, so a random set of r + 2 perturbed columns shows the weakest direction at
    about 1e-3; the split must count it (width 16 per head, as the weights say) and find the weights'
    cond([O_1 .. O_H]). The truth is the layer's own weights (``to_reduced``)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import zoo
    from mhaextract.adapters.torch import TorchOracle, to_reduced
    from mhaextract.vector import learner

    layer_id = "gpt2-d32-h2/0"
    d, heads = zoo.shape(layer_id)
    truth = to_reduced(zoo.exact_layer(layer_id, torch.float32))
    bases = []
    for V in truth.V:
        U, s, _ = np.linalg.svd(V)
        bases.append(U[:, : int((s > 1e-10 * s[0]).sum())])
    widths = [basis.shape[1] for basis in bases]
    conditioning = np.linalg.cond(np.concatenate(bases, axis=1))
    from mhaextract.vector import learn

    monkeypatch.setattr(learner, "SPLIT_FAILURE_FALLS_BACK", False)  # the split's own result, judged here
    monkeypatch.setattr(learn, "REFINE_WORK", 0)  # the split is judged, not the refined model: no refinement
    monkeypatch.setattr(learn, "SCORE_REFINE_WORK", 0)
    result = mx.extract(TorchOracle(zoo.layer_as_run(layer_id, torch.float32)), d, heads=heads, seed=0,
                        schedule="vector", verify_length=0, on_failure="warn", progress=False)
    assert result.value_ranks == widths == [16, 16]
    assert abs(result.split_conditioning / conditioning - 1) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["gpt2-d32-h2/0", "gpt2-d32-h2/1"])
def test_a_trained_float64_layer_is_split_to_the_answers_rounding(layer):
    """Two layers of the trained zoo's GPT-2-d32-h2, float64, each with what random layers lack.
    Layer 0: cond([O_1 .. O_H]) about 2,000, value maps falling 80-fold and score maps 500-fold leave
    the refinement's Jacobian ill-conditioned, and the whitened refinement must still reach the
    answers' rounding. Layer 1: its two heads choose alike at every one of the 2H + 6 first final
    tokens of one independent difference (their scores' signs agree on about 60% of random tokens),
    so the split asks more final tokens for that difference until the 0/1 patterns have rank H. Each
    keeps the split's model: <= 1e-12 at every position of 100 fresh sequences of 1..128 tokens
    against the exact layer's weights, estimate >= the error. With the defaults: "auto" splits them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import zoo

    row = zoo.run_and_judge(layer, torch.float64)
    assert row["result"].schedule == "vector", row["result"].schedule_reason
    assert row["output_error"] <= 1e-12
    assert row["estimate"] >= row["output_error"]


@pytest.mark.slow
def test_a_trained_float32_layer_keeps_only_its_score_directions():
    """GPT-2-d32-h2 layer 0 of the trained zoo, float32: its weakest score direction stands at about
    twice the norm of phase 1's noise (a fixed cut at ``1e4 unit`` drops it, one at ``1e3 unit`` keeps
    noise directions), so phase 1's noise floor must count 16 directions per head (a direction more
    would be cut after the refinement, one fewer is a wrong model). The split's model is kept, <= 1e-5 at every
    position of 100 fresh sequences of 1..128 tokens against the exact float64 layer of the same
    weights, estimate >= the error. With the defaults: "auto" splits it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import zoo

    row = zoo.run_and_judge("gpt2-d32-h2/0", torch.float32)
    assert row["result"].schedule == "vector", row["result"].schedule_reason
    assert row["result"].score_ranks == [16, 16]
    assert row["output_error"] <= 1e-5
    assert row["estimate"] >= row["output_error"]


def test_a_budget_the_split_used_up_before_giving_way_says_so():
    """max_queries covers the targeted schedule alone but not the split that auto tried first: the run
    stops without asking past the budget, and the message says what took the rest of it."""
    target = mx.MultiHeadAttention.random(6, 2, seed=3, bias=True, d_out=6)  # full rank: H r > d_out
    alone = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="targeted")
    simulated, asked = mx.SimulatedOracle(target), []

    def oracle(batch):
        asked.append(len(batch))
        return simulated(batch)

    budget = alone.queries + 10
    with pytest.raises(mx.BudgetExceeded) as raised:
        mx.extract(oracle, 6, heads=2, seed=0, max_queries=budget)
    message = str(raised.value)
    assert f"max_queries={budget} after the calibration's probes" in message and "vector, which gave way" in message
    assert sum(asked) <= budget


def test_phase_one_counts_a_weak_score_direction_above_the_measured_noise_and_no_noise_direction():
    """docs/algorithm.md, 'Whole answers near the vector bound', 'The score rank of phase 1': two heads
    whose ``[W_h | u_h]`` (built here) share five directions, the first with a sixth 4e-3 times weaker;
    their attention weights carry an absolute noise of 3e-6 (float32 answers through the split). The
    rule keeps the weak direction and counts no noise direction, where the fixed cut of
    ``SCORE_RANK_UNITS`` units counts every noise direction above float32's 6e-5; the noise draws are
    the size of the solutions' true errors (from the weights)."""
    from mhaextract.split.weights import log_ratios
    from mhaextract.vector.scores import _solve_heads, score_rank

    d, m, per_final, finals_count, k = 32, 8, 12, 24, 6
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        U = np.linalg.qr(rng.standard_normal((d, k)))[0]
        R = np.linalg.qr(rng.standard_normal((d + 1, k)))[0]
        finals = rng.standard_normal((finals_count, d)) / np.sqrt(d)
        others = rng.standard_normal((finals_count, per_final, m, d)) / np.sqrt(d)
        tokens = np.concatenate([others, np.broadcast_to(finals[:, None, None], (finals_count, per_final, 1, d))], 2)
        rows = (others - finals[:, None, None]).reshape(finals_count, per_final * m, d)
        per_head, truth = [], []
        for weakest in (0.0012, 0.0):  # the weak direction's singular value beside 1 .. 0.25
            Wu = U @ np.diag(np.r_[np.geomspace(1.0, 0.25, k - 1), weakest]) @ R.T
            q = finals @ Wu[:, :d].T + Wu[:, d]  # q_h(t) = W_h t + u_h
            scores = np.einsum("fpnd,fd->fpn", tokens, q)
            a = np.exp(scores - scores.max(axis=-1, keepdims=True))
            a = a / a.sum(axis=-1, keepdims=True) + 3e-6 * rng.standard_normal(a.shape)
            ratios, weight = log_ratios(a.reshape(-1, m + 1))
            per_head.append((ratios.reshape(finals_count, -1), weight.reshape(finals_count, -1)))
            truth.append(q)
        solved, noise = _solve_heads(rows, per_head, np.random.default_rng(seed + 10))
        unit = 2.0 ** -24
        assert [score_rank(q, unit, e) for q, e in zip(solved, noise)] == [k, k - 1]
        assert all(score_rank(q, unit) > k + 5 for q in solved)  # the noise stands above the fixed cut
        for q, e, q_true in zip(solved, noise, truth):
            assert 0.5 < np.linalg.norm(q - q_true, 2) / np.linalg.norm(e, 2) < 2


def test_the_unrefined_route_sharpens_the_split_where_the_answers_are_rounded():
    """Where no refinement follows, the split's values are the model: its second round asks
    ``UNREFINED_DIRECTIONS r + 2`` differences at ``UNREFINED_DIFFERENCE_SCALE`` times the token scale
    and V_tot is the mean over ``UNREFINED_VALUE_BASES`` random bases (docs/algorithm.md, 'Whole answers
    near the vector bound', 'What limits the split's values'). On answers rounded to float32 (d = 32,
    H = 4, heads of width 8) each head's ``V_h = O_h P_h`` comes out at least twice as close to the
    layer's own than with the scores route's ``EXACT_DIRECTIONS r + 2`` differences at the token scale
    and one basis (measured 2.5 and 2.8 times on these two layers: 1.1e-7 and 1.3e-7 against 2.9e-7
    and 3.6e-7)."""
    from mhaextract.vector.learn import UNREFINED_VALUE_BASES
    from mhaextract.split.subspaces import _Saturated, output_subspaces
    from mhaextract.split.values import more_bases, value_map

    class Answers:  # the boundary's one method the split uses: the layer's answers rounded to float32
        def __init__(self, oracle):
            self.oracle = oracle

        def ask(self, sequences, description, whole=True, overflow=False):
            return np.asarray(self.oracle(sequences)).astype(np.float32).astype(np.float64)

    d, heads, rank, unit = 32, 4, 8, 2.0 ** -24
    scale = d ** 0.25
    for seed in (1, 3):
        target = low_rank_layer(d, heads, rank, seed=seed)
        errors = {}
        for route in ("scores", ""):
            boundary = Answers(mx.SimulatedOracle(target))
            values_rng = np.random.default_rng([seed, 1])
            values = value_map(boundary, values_rng, d, scale)
            split = output_subspaces(_Saturated(boundary, values, unit), np.random.default_rng([seed, 2]), d, d,
                                     scale, heads, values, unit, lambda ranks, route=route: route,
                                     lambda: more_bases(values, boundary, values_rng, d, scale,
                                                        UNREFINED_VALUE_BASES - 1))
            assert values.bases == (1 if route else UNREFINED_VALUE_BASES)
            learned = [O @ P for O, P in zip(split.O, split.P)]
            errors[route] = max(min(np.linalg.norm(V - V_true) for V_true in target.V) / np.linalg.norm(V)
                                for V in learned)
        assert errors[""] <= errors["scores"] / 2, errors


@pytest.mark.slow
def test_phase_one_asks_more_final_tokens_where_no_refinement_follows():
    """Phase 2 reads each head's score vector inside phase 1's ``K_h`` only, so where no refinement
    follows ``K_h``'s error stays in ``W_h``: it is phase 1's noise over the k-th singular value of its F
    score vectors, which grows as ``sqrt(F) - sqrt(k)`` (docs/algorithm.md, 'Whole answers near the
    vector bound', 'Where no refinement follows'). With the layer's own values (d = 48, H = 2, heads
    of width 24, answers rounded to float32), phase 1's end where no refinement follows
    (``PHASE_ONE[""]``: 2 k = 48 final tokens, against the full refinement's k + 3 = 27) brings the
    part of ``W_h``'s error off the layer's own score subspace at least 2 times closer
    (``sqrt(F) - sqrt(k)`` says 6.8)."""
    from mhaextract.vector.scores import OVERSAMPLED, PHASE_ONE, learn_scores
    from mhaextract.split.subspaces import Split

    class Answers:  # the boundary's one method the scores use: the layer's answers rounded to float32
        def __init__(self, oracle):
            self.oracle = oracle

        def ask(self, sequences, description, whole=True):
            return np.asarray(self.oracle(sequences)).astype(np.float32).astype(np.float64)

    d, heads, rank = 48, 2, 24
    target = low_rank_layer(d, heads, rank, seed=1)
    O = [np.linalg.svd(V)[0][:, :rank] for V in target.V]
    split = Split(O, [basis.T @ V for basis, V in zip(O, target.V)], [rank] * heads,
                  float(np.linalg.cond(np.concatenate(O, axis=1))), 0)
    off = {}
    for phase_one in (PHASE_ONE["full"], PHASE_ONE[""]):
        K, G, beta, _, _ = learn_scores(Answers(mx.SimulatedOracle(target)), np.random.default_rng(5), d, d ** 0.25,
                                        split, target.c, 2.0 ** -24, OVERSAMPLED, phase_one)
        errors = []
        for h in range(heads):
            U, singular, _ = np.linalg.svd(np.concatenate([target.W[h], target.u[h][:, None]], axis=1))
            U = U[:, singular > 1e-10 * singular[0]]
            error = K[h] @ G[h] - target.W[h]
            errors.append(np.linalg.norm(error - U @ (U.T @ error)) / np.linalg.norm(target.W[h]))
        off[phase_one] = max(errors)
    assert off[PHASE_ONE[""]] <= off[PHASE_ONE["full"]] / 2, off


def test_the_split_in_small_chunks_asks_and_learns_what_it_does_whole(monkeypatch):
    """The saturated pairs (``SUMS_CHUNK_CALLS``) are built an oracle call at a time so that a round's
    memory stays bounded at d = 4096; the chunks change nothing: the same queries in the same oracle
    calls, and a bit-identical model and estimate. On the route where no refinement follows (the
    one-token answers at the split's final tokens, more bases of V_tot, phase 2 of the scores), with
    oracle calls, weight chunks and forward chunks a few queries long."""
    import mhaextract.vector.learn as learn
    import mhaextract.split.subspaces as split
    import mhaextract.split.weights as weights
    import mhaextract.vector.scores as scores

    monkeypatch.setattr(learn, "REFINE_WORK", 0.0)
    monkeypatch.setattr(learn, "SCORE_REFINE_WORK", 0.0)
    monkeypatch.setattr(split, "ASK_TOKENS", 14)
    monkeypatch.setattr(scores, "ASK_TOKENS", 14)
    monkeypatch.setattr(weights, "WEIGHT_CHUNK", 5)
    monkeypatch.setattr(learn, "FORWARD_CHUNK", 7)
    d, heads, rank = 16, 2, 4
    target = low_rank_layer(d, heads, rank, seed=2)

    class Recorded(mx.SimulatedOracle):  # every call's tokens, in order
        def __init__(self, target):
            super().__init__(target)
            self.calls = []

        def __call__(self, sequences):
            self.calls.append(b"".join(np.asarray(X, dtype=np.float64).tobytes() for X in sequences))
            return super().__call__(sequences)

    runs = []
    for calls in (1, 10 ** 9):
        monkeypatch.setattr(split, "SUMS_CHUNK_CALLS", calls)
        oracle = Recorded(target)
        result = mx.extract(oracle, d, heads=heads, seed=0, schedule="vector", on_failure="warn")
        assert result.schedule == "vector" and result.refinement == ""
        runs.append((oracle.calls, result))
    (calls, chunked), (whole_calls, whole) = runs
    assert len(calls) > 100 and calls == whole_calls
    assert chunked.queries == whole.queries and chunked.error_estimate == whole.error_estimate
    for name in ("W", "V", "u", "c"):
        assert all(np.array_equal(a, b) for a, b in zip(np.atleast_1d(getattr(chunked.model, name)),
                                                        np.atleast_1d(getattr(whole.model, name)))), name


@pytest.mark.slow
def test_the_first_round_and_phase_one_ask_only_what_their_stops_need(monkeypatch):
    """Once no head's rank grows with every column, the split's first round asks only the perturbed
    directions its stop needs (``r + 2``: ``r + 3`` columns with the base), and phase 1 of the scores,
    before the full refinement, ends at ``k + 3`` final tokens (docs/algorithm.md, 'Whole answers near
    the vector bound'), counted where they are asked."""
    import mhaextract.vector.scores as scores
    import mhaextract.split.subspaces as split

    d, heads, rank = 32, 2, 8
    asked = {"directions": [], "finals": 0, "ranks": None}
    labels_along, ask, score_rank = split._labels_along, scores._ask, scores.score_rank

    def counted_labels_along(saturated, finals, deltas, *args, **kwargs):
        asked["directions"].append(len(deltas))
        return labels_along(saturated, finals, deltas, *args, **kwargs)

    def counted_ask(boundary, rng, finals, per_final, m, scale, unit, full, description):
        if full and description == "weights: whole score vectors":
            asked["finals"] += len(finals)
        return ask(boundary, rng, finals, per_final, m, scale, unit, full, description)

    ranks = []
    monkeypatch.setattr(split, "_labels_along", counted_labels_along)
    monkeypatch.setattr(scores, "_ask", counted_ask)
    monkeypatch.setattr(scores, "score_rank", lambda *a, **k: ranks.append(score_rank(*a, **k)) or ranks[-1])
    result = mx.extract(mx.SimulatedOracle(low_rank_layer(d, heads, rank)), d, heads=heads, seed=0, schedule="vector")
    assert result.ok and result.refinement == "full" and result.value_ranks == [rank, rank]
    first_round, second_round = asked["directions"][:-1], asked["directions"][-1]
    assert first_round == [split.DIRECTIONS_PER_ROUND, rank + 3 - (1 + split.DIRECTIONS_PER_ROUND)]
    assert second_round == rank + 2  # the full route's independent differences
    assert asked["finals"] == max(ranks[-heads:]) + 3


def test_one_dimensional_tokens_run_the_targeted_schedule_with_the_reason():
    """d = 1 has no half circle of final tokens: auto does not try the split, schedule='vector' gives
    way before any split query, and the targeted schedule learns the layer."""
    target = mx.MultiHeadAttention.random(d=1, heads=1, seed=0, bias=True, d_out=2)
    named = mx.extract(mx.SimulatedOracle(target), 1, heads=1, seed=0, schedule="targeted")
    for schedule in ("auto", "vector"):
        result = mx.extract(mx.SimulatedOracle(target), 1, heads=1, seed=0, schedule=schedule)
        assert result.schedule == "targeted" and result.ok and result.split_queries == 0
        assert "d = 1" in result.schedule_reason and result.queries == named.queries
        assert mx.compare(result.model, target).max_rel < 1e-12


def test_an_oracles_own_linalg_error_is_raised_unchanged_not_taken_for_the_splits():
    """An exception the oracle raises is the oracle's, whatever its type: a LinAlgError from inside the
    oracle (its own solve) reaches the caller with the note naming the queries, the split does not
    give way as if its own factorisation had failed."""
    target, asked, raised_once = low_rank_layer(6, 2, 3, seed=6), [], []
    simulated = mx.SimulatedOracle(target)

    def oracle(batch):
        if sum(asked) >= 200 and not raised_once:  # inside the split's saturated queries (the calibration asks 147)
            raised_once.append(True)
            raise np.linalg.LinAlgError("the oracle's own solve failed")
        asked.append(len(batch))
        return simulated(batch)

    with pytest.raises(np.linalg.LinAlgError, match="the oracle's own solve") as raised:
        mx.extract(oracle, 6, heads=2, seed=0, schedule="vector", batch_size=16)
    assert any("raised by the oracle while answering" in note for note in raised.value.__notes__)


def test_a_layer_that_overflows_only_at_the_splits_saturated_tokens_runs_the_targeted_schedule():
    """An oracle answering NaN beyond token norm 1000 (past the calibration's probes, inside the
    split's saturated queries at 1000 times the token scale): the split gives way with the reason,
    and auto's run is the targeted schedule's, its model the layer's."""
    target = low_rank_layer(6, 2, 3, seed=6)
    simulated = mx.SimulatedOracle(target)

    def oracle(batch):
        answers = np.array(simulated(batch), dtype=float)
        answers[[np.linalg.norm(X, axis=1).max() > 1000 for X in batch]] = np.nan
        return answers

    named = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=0, schedule="targeted")
    result = mx.extract(oracle, 6, heads=2, seed=0)
    assert result.schedule == "targeted" and result.ok and "saturated queries with non-finite" in result.schedule_reason
    assert result.queries == named.queries + result.split_queries and result.split_queries > 0
    np.testing.assert_array_equal(result.model.W, named.model.W)


@pytest.mark.parametrize("failure", ["nan", "raises"])
def test_an_oracle_that_fails_on_the_held_out_queries_is_told_what_they_are(failure):
    """An oracle that cannot answer sequences longer than 20 tokens, first met at the split's held-out
    queries (1..64 tokens): the OracleError (a NaN answer) or the oracle's own exception says which
    queries these were and what runs with shorter ones."""
    target = low_rank_layer(4, 1, 2, seed=6)
    simulated = mx.SimulatedOracle(target)

    def oracle(batch):
        if failure == "raises" and max(map(len, batch)) > 20:
            raise ConnectionError("sequence too long for the remote model")
        answers = np.array(simulated(batch), dtype=float)
        answers[[len(X) > 20 for X in batch]] = np.nan
        return answers

    with pytest.raises(mx.OracleError if failure == "nan" else ConnectionError) as raised:
        mx.extract(oracle, 4, heads=1, seed=0, schedule="vector")
    assert any("held-out queries of 1..64 tokens" in note and "verify_length" in note
               for note in raised.value.__notes__)
