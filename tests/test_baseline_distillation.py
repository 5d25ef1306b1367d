"""The gradient-distillation baseline: measured budget, batched students, a fidelity on an easy case."""

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.baselines import distill
from mhaextract.baselines.distillation import _forward, paper_budget
from mhaextract.oracle.queries import padded, random_queries

from conftest import CountingOracle

torch = pytest.importorskip("torch")




def test_random_queries_have_the_stated_lengths_and_scales():
    rng = np.random.default_rng(0)
    sequences = random_queries(rng, 2000, 5, 2.0, (1, 7), spread=1.0)
    lengths = np.array([len(s) for s in sequences])
    assert len(sequences) == 2000 and lengths.min() == 1 and lengths.max() == 7
    assert all(s.shape[1] == 5 for s in sequences)
    norms = np.array([np.linalg.norm(s, axis=1).mean() for s in sequences])
    assert 0.5 < norms.min() and norms.max() < 10.0  # 2 * 2**[-1, 1] times a chi factor
    assert np.isclose(np.median(norms), 2.0, rtol=0.25)


def test_batched_students_equal_the_model_one_by_one():
    """Padding and masking: every restart of the batched forward is the model's own f(X)."""
    rng = np.random.default_rng(1)
    students = [mx.MultiHeadAttention.random(4, 3, seed=s) for s in range(5)]
    sequences = random_queries(rng, 50, 4, 1.5, (1, 6), spread=1.0)
    X, mask = (torch.from_numpy(array) for array in padded(sequences))
    W = torch.from_numpy(np.stack([m.W for m in students]))
    v = torch.from_numpy(np.stack([m.v for m in students]))
    batched = _forward(torch, W, v, X, mask).numpy()
    for r, model in enumerate(students):
        np.testing.assert_allclose(batched[r], model(sequences), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(_forward(torch, W[r], v[r], X, mask).numpy(), batched[r], rtol=1e-13, atol=1e-13)


@pytest.mark.slow
def test_distillation_of_an_easy_target_reaches_1e_9_parameters_and_fidelity():
    d, H = 3, 1
    target = mx.MultiHeadAttention.random(d, H, seed=5)
    oracle = CountingOracle(target)
    result = distill(oracle, d, H, restarts=6, adam_steps=400, lbfgs_steps=200, polish=2, seed=0)
    assert result.queries == oracle.count == paper_budget(d, H) == 35
    assert result.max_query_length == oracle.longest <= 2 * H + 1
    assert result.ok and result.best_misfit < 1e-10
    assert 0 < result.converged <= 1 and result.training_misfit.shape == (6,)
    assert float(mx.compare(result.model, target).max_rel) < 1e-9
    fresh = random_queries(np.random.default_rng(99), 500, d, d ** 0.25, (1, 8), spread=1.0)
    truth = target(fresh)
    assert np.sqrt(np.mean((result.model(fresh) - truth) ** 2) / np.mean(truth**2)) < 1e-9


@pytest.mark.slow  # the first torch.optim step imports torch._dynamo (~3 s of the fast tier)
def test_an_undertrained_student_fails_its_own_check():
    """Five Adam steps cannot fit 200 answers: the result says so instead of passing it off
    (an ExtractionError by default, a warning and the result with on_failure="warn")."""
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    run = dict(n_queries=200, restarts=2, adam_steps=5, lbfgs_steps=0, seed=0)
    with pytest.raises(mx.ExtractionError, match="training_fit") as info:
        distill(mx.SimulatedOracle(target), 4, 2, **run)
    assert info.value.extraction.queries == 200
    with pytest.warns(mx.UnreliableExtractionWarning, match="training_fit"):
        result = distill(mx.SimulatedOracle(target), 4, 2, on_failure="warn", **run)
    assert result.queries == 200 and result.polished == 0
    assert not result.ok and result.checks[0].name == "training_fit"


def test_max_queries_below_n_queries_raises_before_any_query():
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    oracle = CountingOracle(target)
    with pytest.raises(mx.BudgetExceeded, match="max_queries=34") as info:
        distill(oracle, 3, 1, max_queries=34, restarts=1, adam_steps=1, lbfgs_steps=0, seed=0)
    assert oracle.count == 0 and info.value.needed == 35 and info.value.answered == 0


@pytest.mark.slow  # trains (one Adam step): the first torch.optim step imports torch._dynamo (~3 s)
def test_a_budget_that_covers_n_queries_is_spent_exactly():
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    oracle = CountingOracle(target)
    result = distill(oracle, 3, 1, n_queries=20, max_queries=20, restarts=1, adam_steps=1, lbfgs_steps=0, seed=0,
                     converged_tol=1e3)
    assert result.queries == oracle.count == 20


@pytest.mark.parametrize("kwargs, message", [
    (dict(d=0, heads=1), "d must be"),
    (dict(d=3, heads=0), "heads must be"),
    (dict(d=3, heads=1, n_queries=0), "n_queries"),
    (dict(d=3, heads=1, on_failure="ignore"), "on_failure"),
    (dict(d=3, heads=1, max_queries=-1), "max_queries"),
    (dict(d=3, heads=1, max_queries=2.5), "max_queries"),
    (dict(d=3, heads=1, restarts=0), "restarts"),
    (dict(d=3, heads=1, learning_rate=-1.0), "learning_rate"),
    (dict(d=3, heads=1, init_scale=float("nan")), "init_scale"),
    (dict(d=3, heads=1, converged_tol=0.0), "converged_tol"),
])
def test_bad_input_is_named(kwargs, message):
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    with pytest.raises(ValueError, match=message):
        distill(mx.SimulatedOracle(target), **kwargs)
