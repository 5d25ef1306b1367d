"""Issue 13, acceptance 4: the biased grid (docs/algorithm.md, 'Biases: affine scores and an output constant') recovers
W, v, u, c at 256 bits.

The targets are drawn here with numpy, the oracle evaluates them with mpmath here (not through
mhaextract's model), the errors are computed here, and the counts are taken on the oracle's side
of the boundary: nothing below trusts the code under test for the truth.
"""

import flint
import mpmath
import numpy as np
import pytest

import mhaextract as mx
from mhaextract.attention.biased_grid import BiasedGridSchedule
from mhaextract.attention.paper import PaperSchedule
from mhaextract.attention.registry import choose

from conftest import paper_count, run_settings
from mhaextract.checks.verify import VERIFY_QUERIES

BITS = 256


def biased_count(d, H):
    """This schedule's count, written independently of the code: 2d^2 + 2d - 1 instances, the first
    with 2H + 1 samples and every other with 2H."""
    return 4 * H * d * d + 4 * H * d - 2 * H + 1


def draw(d, H, seed, bias=True):
    """W_h ~ N(0, 1/d), v_h ~ N(0, 1), u_h ~ N(0, 1/sqrt(d)) (the size of a row of W times the token
    scale d^(1/4), so that z^T u_h is of the order of z^T W_h x), c ~ 2 + N(0, 1)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((H, d, d)) / np.sqrt(d)
    v = rng.standard_normal((H, d))
    u = rng.standard_normal((H, d)) / d**0.25 if bias else np.zeros((H, d))
    c = 2.0 + float(rng.standard_normal()) if bias else 0.0
    return W, v, u, c


class MpmathOracle:
    """f(X) = c + sum_h sum_i softmax_i(x_i^T (W_h x_N + u_h)) v_h^T x_i in mpmath, 64 bits above
    ``BITS``, answered rounded to ``BITS`` bits; counts every query and the longest."""

    def __init__(self, W, v, u, c):
        self.W, self.v, self.u, self.c = W, v, u, c
        self.count = 0
        self.longest = 0

    def one(self, X):
        with mpmath.workprec(BITS + 64):
            tokens = [[mpmath.mpf(float(a)) for a in x] for x in X]
            final = tokens[-1]
            d = len(final)
            total = mpmath.mpf(self.c)
            for W, v, u in zip(self.W, self.v, self.u):
                query = [mpmath.fsum(mpmath.mpf(W[a, b]) * final[b] for b in range(d)) + u[a] for a in range(d)]
                scores = [mpmath.fsum(x[a] * query[a] for a in range(d)) for x in tokens]
                top = max(scores)
                weights = [mpmath.exp(s - top) for s in scores]
                values = [mpmath.fsum(mpmath.mpf(v[a]) * x[a] for a in range(d)) for x in tokens]
                total += mpmath.fsum(w * y for w, y in zip(weights, values)) / mpmath.fsum(weights)
        with mpmath.workprec(BITS):
            return +total

    def __call__(self, batch):
        self.count += len(batch)
        self.longest = max([self.longest] + [len(X) for X in batch])
        return [self.one(np.asarray(X, dtype=np.float64)) for X in batch]


def errors(result, W, v, u, c):
    """Per group: max |estimate - truth| / max |truth| (absolute where the truth is zero), the
    estimate's heads aligned to the truth's by nearest W; all in mpmath."""
    model = result.model_hp
    assert model.heads == len(W)
    order = [int(np.argmin([np.abs(np.asarray(model.W[g], dtype=np.float64) - W[h]).sum()
                            for g in range(model.heads)])) for h in range(len(W))]
    assert sorted(order) == list(range(len(W)))

    def rel(estimate, truth):
        truth = np.asarray(truth, dtype=np.float64)
        miss = max(abs(e - mpmath.mpf(float(t))) for e, t in zip(np.ravel(estimate), np.ravel(truth)))
        scale = float(np.abs(truth).max())
        return float(miss / scale) if scale else float(miss)

    return {"W": rel(model.W[order], W), "v": rel(model.v[order], v), "u": rel(model.u[order], u),
            "c": rel([model.c], [c])}, order


def assert_balls_enclose(result, order, W, v, u, c):
    for balls, truth in ((result.W_balls, W), (result.v_balls, v), (result.u_balls, u)):
        for ball, value in zip(np.ravel(balls[order]), np.ravel(truth)):
            assert ball.contains(flint.arb(float(value))), (ball, value)
    assert result.c_ball.contains(flint.arb(c))


def run(d, H, seed, bias=True, **options):
    W, v, u, c = draw(d, H, seed, bias)
    oracle = MpmathOracle(W, v, u, c)
    counts = {"heads": H} if "max_heads" not in options else {}
    result = mx.extract(oracle, d, precision=BITS, seed=seed, **counts, **options)
    return result, oracle, (W, v, u, c)


# ----------------------------------------------------------------------------- fast
@pytest.mark.parametrize("d, H", [(1, 1), (2, 2), (3, 1)])
def test_defaults_recover_biases_and_count_exactly(d, H):
    result, oracle, truth = run(d, H, seed=10 * d + H)
    assert result.ok and result.certified and result.bias and result.heads == H
    assert "biased grid" in result.schedule_reason
    assert "'Biases: affine scores and an output constant'" in result.schedule_reason
    # Measured on the oracle's side: the schedule's count plus the token-scale probes (docs/algorithm.md, 'Choosing the
    # token scale from queries'). ... and the default verification's fresh long queries (docs/algorithm.md, 'Approximate
    # answers: certificate, oversampling, refinement, verification')
    assert result.queries == oracle.count == biased_count(d, H) + result.calibration_queries + VERIFY_QUERIES
    assert result.promised_queries == biased_count(d, H)
    found, order = errors(result, *truth)
    assert max(found.values()) <= 1e-40, found
    assert_balls_enclose(result, order, *truth)
    assert float(mx.compare(result.model_hp, mx.MultiHeadAttention(*truth)).max_rel) <= 1e-40


def test_with_a_given_token_scale_the_count_and_length_are_the_formula(tmp_path):
    d, H = 2, 2
    result, oracle, truth = run(d, H, seed=5, token_scale=1.3, verify_length=0)
    assert result.calibration_queries == 0
    assert result.queries == oracle.count == biased_count(d, H)
    assert result.max_query_length == oracle.longest == 2 * H + 1
    assert max(errors(result, *truth)[0].values()) <= 1e-40
    # The exact model, u and c included, survives the result file.
    mx.save_extraction(result, tmp_path / "result.json")
    saved = mx.load_model(tmp_path / "result.json", exact=True)
    assert float(mx.compare(saved, mx.MultiHeadAttention(*truth)).max_rel) <= 1e-40


@pytest.mark.parametrize("d, H", [(1, 2), (2, 2)])
def test_a_bias_free_target_gives_zero_biases(d, H):
    result, _, truth = run(d, H, seed=3, bias=False, token_scale=1.2)
    assert result.ok and result.certified
    found, order = errors(result, *truth)
    assert max(found.values()) <= 1e-40, found  # u and c absolute: |u|, |c| <= 1e-40
    assert_balls_enclose(result, order, *truth)


def test_the_paper_schedule_named_alone_stays_bias_free():
    W, v, _, _ = draw(2, 1, seed=1, bias=False)
    oracle = MpmathOracle(W, v, np.zeros((1, 2)), 0.0)
    result = mx.extract(oracle, 2, heads=1, precision=BITS, seed=0, schedule="paper")
    assert not result.bias and result.u_balls is None and result.c_ball is None
    assert result.queries == oracle.count == paper_count(2, 1)
    assert result.max_query_length == 3


def test_auto_in_high_precision_chooses_the_biased_grid():
    choice = choose("auto", 4, 3, BITS, None)
    assert choice.schedule is BiasedGridSchedule and choice.bias
    assert "biased grid" in choice.reason
    assert choose("auto", 4, 3, BITS, False).schedule is PaperSchedule
    assert choose("paper", 4, 3, BITS, None).schedule is PaperSchedule
    assert choose("paper", 4, 3, BITS, True).schedule is BiasedGridSchedule
    # float64 with H0 > d (no targeted schedule): the biased grid too, and the reason says so.
    float64 = choose("auto", 2, 3, None, None)
    assert float64.schedule is BiasedGridSchedule and "biased grid" in float64.reason


def test_auto_names_the_arithmetic_not_the_answers_format():
    """``precision=None`` is the learner's float64 arithmetic, whatever format the answers come in
    (a float32 layer's among them): the reason says which."""
    for choice in (choose("auto", 2, 3, None, None), choose("auto", 8, 2, None, None),
                   choose("auto", 8, 2, None, None, rank=2)):
        assert "float64 arithmetic (precision=None)" in choice.reason


@pytest.mark.parametrize("d", [1, 3])
def test_layout_affine_final_tokens_and_half_sum_links(d):
    H = 2
    schedule = BiasedGridSchedule(run_settings(d, H, seed=0, precision=BITS, bias=True))
    X = schedule.X
    # no zero final token (docs/algorithm.md, 'Biases: affine scores and an output constant')
    assert X.shape == (d, d + 1) and (np.linalg.norm(X, axis=0) > 0).all()
    assert np.linalg.cond(schedule.assembly_basis) < 10
    roles = [instance.role for instance in schedule.instances]
    assert (roles.count("grid"), roles.count("row_link"), roles.count("column_link")) == (d * (d + 1), d - 1, d * d)
    for instance in schedule.instances:
        if instance.role == "column_link":
            assert np.array_equal(instance.final, (X[:, 0] + X[:, instance.i]) / 2)
            assert np.linalg.norm(instance.final) >= 0.25 * schedule.token_scale
    assert len(schedule.fixed_queries()) == schedule.promised_queries == biased_count(d, H)


@pytest.mark.parametrize("options, message", [
    (dict(schedule="lean", bias=True), "learns the bias-free model only"),
    (dict(bias="yes"), "bias must be True, False or None"),
    (dict(samples_per_instance=7), "float64 options"),
])
def test_bad_input_is_refused_before_any_query(options, message):
    oracle = MpmathOracle(*draw(2, 1, seed=0))
    with pytest.raises(ValueError, match=message):
        mx.extract(oracle, 2, heads=1, precision=BITS, **options)
    assert oracle.count == 0


def test_float64_comes_along():
    W, v, u, c = draw(3, 1, seed=2)
    target = mx.MultiHeadAttention(W, v, u, c)
    result = mx.extract(mx.SimulatedOracle(target), 3, heads=1, seed=0, schedule="paper", bias=True)
    comparison = mx.compare(result.model, target)
    assert result.ok and max(comparison.W_rel, comparison.v_rel, comparison.u_rel, comparison.c_rel) < 1e-11


# ----------------------------------------------------------------------------- slow
@pytest.mark.slow
@pytest.mark.parametrize("d", [3, 4])
@pytest.mark.parametrize("H", [1, 2, 3])
def test_random_biased_targets_to_1e_40(d, H):
    result, oracle, truth = run(d, H, seed=100 * d + H, token_scale=d**0.25, verify_length=0)  # the formula
    assert result.ok and result.certified and result.heads == H
    assert result.queries == oracle.count == biased_count(d, H)
    assert result.max_query_length == oracle.longest == 2 * H + 1
    found, order = errors(result, *truth)
    assert max(found.values()) <= 1e-40, found
    assert_balls_enclose(result, order, *truth)


@pytest.mark.slow
@pytest.mark.parametrize("d, H, H0", [(3, 2, 3), (4, 1, 3)])
def test_a_head_bound_costs_the_formula_in_h0_and_finds_h(d, H, H0):
    W, v, u, c = draw(d, H, seed=7 * H0 + d)
    oracle = MpmathOracle(W, v, u, c)
    result = mx.extract(oracle, d, max_heads=H0, precision=BITS, seed=1, token_scale=d**0.25, verify_length=0)
    assert result.ok and result.certified and result.heads == H
    assert result.queries == oracle.count == biased_count(d, H0)
    assert result.max_query_length == oracle.longest == 2 * H0 + 1
    found, order = errors(result, W, v, u, c)
    assert max(found.values()) <= 1e-40, found
    assert_balls_enclose(result, order, W, v, u, c)
