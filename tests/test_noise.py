"""Approximate oracles: wrappers, oversampling, the certificate, refinement, verification."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhaextract as mx
from mhaextract.checks.certificate import sensitivity_matrix
from mhaextract.checks.refine import output_jacobian, pack, refine_least_squares, unpack
from mhaextract.oracle.queries import random_queries


def quiet_extract(oracle, d, H, seed, **options):
    # The paper's algebraic certificate: unless asked, no refinement (paper refines noisy answers by
    # default, docs/algorithm.md, 'Refined under noise'; test_paper_refines_noisy_answers_...).
    options.setdefault("refine", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        return mx.extract(oracle, d, heads=H, seed=seed, on_failure="warn", **options, schedule="paper")


class Counting:
    def __init__(self, inner):
        self.inner, self.count, self.longest = inner, 0, 0

    def __call__(self, batch):
        self.count += len(batch)
        self.longest = max([self.longest] + [len(X) for X in batch])
        return self.inner(batch)


# ------------------------------------------------------------------ wrappers
def test_additive_noise_is_bounded_seeded_and_declares_its_bound():
    target = mx.MultiHeadAttention.random(3, 2, seed=0)
    batch = random_queries(np.random.default_rng(0), 500, 3, 1.0, (1, 6))
    exact = target(batch)
    noisy = mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-3, seed=4)(batch)
    again = mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-3, seed=4)(batch)
    assert np.array_equal(noisy, again)
    assert np.abs(noisy - exact).max() <= 1e-3
    assert np.abs(noisy - exact).max() > 0.9e-3  # uniform: it uses the whole box
    assert mx.AdditiveNoise(target, 1e-3).answer_error == 1e-3


def test_gaussian_noise_has_the_stated_spread():
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    batch = random_queries(np.random.default_rng(1), 4000, 3, 1.0, (1, 4))
    errors = mx.GaussianNoise(target, 0.01, seed=2)(batch) - target(batch)
    assert 0.0095 < errors.std() < 0.0105 and abs(errors.mean()) < 1e-3


@given(st.integers(1, 52), st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: x != 0))
@settings(derandomize=True, max_examples=200, deadline=None)
def test_rounded_answers_keep_bits_significant_bits(bits, value):
    rounded = mx.RoundedAnswers(lambda batch: np.full(len(batch), value), bits)([np.zeros((1, 1))])[0]
    assert abs(rounded - value) <= 2.0**-bits * abs(value)
    mantissa, _ = np.frexp(rounded)
    assert float(np.ldexp(mantissa, bits)).is_integer()  # at most `bits` significant bits


def test_float32_oracle_is_float32_accurate_and_not_float64():
    target = mx.MultiHeadAttention.random(8, 2, seed=0)
    batch = random_queries(np.random.default_rng(2), 300, 8, 8**0.25, (1, 9))
    exact = target(batch)
    single = mx.Float32Oracle(target)(batch)
    relative = np.abs(single - exact) / np.sqrt(np.mean(exact**2))
    assert 1e-9 < relative.max() < 1e-5


@pytest.mark.parametrize("make, message", [
    (lambda t: mx.AdditiveNoise(t, -1.0), "eps"),
    (lambda t: mx.AdditiveNoise(t, float("nan")), "eps"),
    (lambda t: mx.GaussianNoise(t, -0.1), "sigma"),
    (lambda t: mx.RoundedAnswers(t, 0), "bits"),
    (lambda t: mx.RoundedAnswers(t, 60), "bits"),
    (lambda t: mx.AdditiveNoise(3, 1.0), "callable"),
    (lambda t: mx.Float32Oracle(mx.SimulatedOracle(t)), "MultiHeadAttention"),
])
def test_wrappers_reject_bad_input(make, message):
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    with pytest.raises((ValueError, TypeError), match=message):
        make(target)


# ------------------------------------------------------------------ oversampling and options
@pytest.mark.parametrize("d, H, K", [(1, 1, 5), (2, 1, 6), (3, 2, 11), (4, 2, 20)])
def test_oversampled_runs_report_their_measured_count_and_length(d, H, K):
    target = mx.MultiHeadAttention.random(d, H, seed=d)
    oracle = Counting(mx.SimulatedOracle(target))
    result = mx.extract(oracle, d, heads=H, seed=1, samples_per_instance=K, schedule="paper")
    assert result.queries == oracle.count == K + (K - 1) * (2 * d * d - 2) == result.promised_queries
    assert result.max_query_length == oracle.longest == K
    assert mx.compare(result.model, target).max_rel < 1e-8


def test_exact_count_stays_the_default():
    target = mx.MultiHeadAttention.random(4, 3, seed=2)
    oracle = Counting(mx.SimulatedOracle(target))
    result = mx.extract(oracle, 4, heads=3, seed=0, schedule="paper")
    assert result.queries == oracle.count == 4 * 3 * 16 - 6 + 1
    assert result.details.samples_per_instance == 7 and result.refinement is None


@pytest.mark.parametrize("options, message", [
    ({"samples_per_instance": 4}, "samples_per_instance"),
    ({"samples_per_instance": 7.5}, "samples_per_instance"),
    ({"refine": "yes"}, "refine"),
    ({"refine": True, "refine_queries": -1}, "refine_queries"),
    ({"answer_error": -1e-9}, "answer_error"),
    ({"answer_error": "small"}, "answer_error"),
    ({"precision": 128, "refine": True}, "float64"),
    ({"precision": 128, "samples_per_instance": 9}, "float64"),
])
def test_bad_robust_options_are_named(options, message):
    target = mx.MultiHeadAttention.random(2, 2, seed=0)
    with pytest.raises(ValueError, match=message):
        mx.extract(mx.SimulatedOracle(target), 2, heads=2, seed=0, **options, schedule="paper")


def test_high_precision_runs_have_no_first_order_certificate():
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    result = mx.extract(mx.SimulatedOracle(target, 128), 2, heads=1, precision=128, seed=0, schedule="paper")
    assert result.certificate is None  # balls instead: W_balls, v_balls, radius
    assert result.error_bound(1e-10) is None and result.amplification is None and result.valid_below is None
    assert result.radius is not None and result.model_hp is not None


# ------------------------------------------------------------------ the certificate
class Replay:
    """The exact oracle plus a fixed perturbation of the q-th answer (in query order)."""

    def __init__(self, target, perturbation=None):
        self.inner, self.perturbation, self.asked = mx.SimulatedOracle(target), perturbation, 0

    def __call__(self, batch):
        answers = self.inner(batch)
        if self.perturbation is not None:
            answers = answers + self.perturbation[self.asked:self.asked + len(batch)]
        self.asked += len(batch)
        return answers


@pytest.mark.parametrize("d, H, seed", [(1, 2, 4), (3, 1, 6), (3, 2, 6), (3, 3, 14), (4, 3, 4)])
def test_the_linearisation_predicts_how_answers_move_the_parameters(d, H, seed):
    """G (instances' J^+, anchors, combination, assembly) against re-running the whole pipeline,
    for perturbations below the run's valid_below."""
    target = mx.MultiHeadAttention.random(d, H, seed=seed)
    clean = quiet_extract(Replay(target), d, H, seed=5)
    G = sensitivity_matrix(clean.certificate)
    assert G.shape == (H * (d * d + d), clean.queries)
    eps = min(1e-13, clean.valid_below / 10)
    assert eps > 1e-14  # well above the rounding of the pipeline itself
    rng = np.random.default_rng(d * H)
    for _ in range(3):
        e = rng.uniform(-eps, eps, clean.queries)
        moved = quiet_extract(Replay(target, e), d, H, seed=5)
        change = pack(moved.model) - pack(clean.model)
        predicted = G @ e
        assert np.abs(change - predicted).max() <= 0.02 * np.abs(predicted).max()
    # The amplification is the worst case of exactly this G (row l1 norms, relative units).
    nW = H * d * d
    rows = np.abs(G).sum(axis=1)
    expected = max(rows[:nW].max() / np.abs(clean.model.W).max(), rows[nW:].max() / np.abs(clean.model.v).max())
    assert clean.amplification == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("d, H, options", [(1, 2, {}), (4, 1, {}), (5, 2, {}), (3, 2, dict(samples_per_instance=7))])
def test_the_instance_operator_built_directly_is_the_sparse_product(d, H, options, monkeypatch):
    """The certificate's d(c, m, l)/d(answers), built block by block, against J^+ S as a sparse product."""
    from mhaextract.checks.linearisation import PipelineOperator

    built, original = [], PipelineOperator._direct_operator
    monkeypatch.setattr(PipelineOperator, "_direct_operator", lambda self, *args: built.append(original(self, *args))
                        or built[-1])
    noisy = mx.AdditiveNoise(mx.SimulatedOracle(mx.MultiHeadAttention.random(d, H, seed=d)), 1e-10, seed=1)
    operator = quiet_extract(noisy, d, H, seed=2, **options).certificate._operator
    direct = operator.G_u
    assert len(built) == 1 and built[0] is direct  # the paper's layout is built directly
    monkeypatch.setattr(PipelineOperator, "_direct_layout", lambda self: None)
    general = PipelineOperator(operator.run)
    product = general.G_u
    product.sort_indices()
    assert direct.nnz > 0 and direct.has_sorted_indices
    for name in ("indptr", "indices", "data"):
        assert np.array_equal(getattr(direct, name), getattr(product, name)), name
    # The row norms taken from the layout's blocks (G_u never formed) are those of the product's rows.
    for what in ("m", "l"):
        for order in (1, 2):
            from_blocks, from_product = operator.row_norms(what, order), general.row_norms(what, order)
            assert np.allclose(from_blocks, from_product, rtol=1e-14, atol=0), (what, order)
            assert (from_product > 0).all()


def test_the_certificate_forms_no_instance_operator_unless_asked(monkeypatch):
    """Validity, noise estimate and row norms come from the layout's blocks; the O(d^3 H^2) G_u is formed
    only for the amplification."""
    from mhaextract.checks.linearisation import PipelineOperator

    calls = []
    original = PipelineOperator._instance_operator
    monkeypatch.setattr(PipelineOperator, "_instance_operator", lambda self: calls.append(1) or original(self))
    result = quiet_extract(mx.SimulatedOracle(mx.MultiHeadAttention.random(5, 2, seed=3)), 5, 2, seed=2)
    assert result.certificate.valid_below > 0 and not calls
    assert result.amplification > 0 and len(calls) == 1


@pytest.mark.slow
def test_acceptance_1_the_bound_holds_in_200_noisy_runs_and_is_not_vacuous():
    ratios, skipped, run = [], 0, 0
    while len(ratios) < 200:
        rng = np.random.default_rng(run)
        d, H, eps = int(rng.integers(2, 9)), int(rng.integers(1, 4)), (1e-13, 1e-11, 1e-9)[run % 3]
        target = mx.MultiHeadAttention.random(d, H, seed=run)
        result = quiet_extract(mx.AdditiveNoise(mx.SimulatedOracle(target), eps, seed=run), d, H, seed=run + 7,
                               answer_error=eps)
        run += 1
        if result.model is None:  # no model at all: said so by a failed check
            skipped += 1
            assert "finite" in [check.name for check in result.failed_checks]
            continue
        if not eps < result.certificate.validity_at(eps):
            # valid_below, less instances verified at eps (docs/algorithm.md, 'Approximate answers: certificate,
            # oversampling, refinement, verification')
            skipped += 1
            assert result.error_bound(eps) == np.inf
            assert "noise_within_validity" in [check.name for check in result.failed_checks]
            continue
        measured = mx.compare(result.model, target).max_rel
        bound = result.error_bound(eps)
        assert measured <= bound, (run - 1, d, H, eps, measured, bound)
        ratios.append(measured / bound)
    assert np.median(ratios) >= 1e-3
    # Not vacuous: the bound applies to most runs, not only a lucky few (the old `skipped < run`
    # held by construction, since the loop only ends after 200 bounded runs). Measured 149 skipped
    # of 349 (all H = 1 runs bounded, most H = 3 runs over their valid_below). Every skipped run
    # said so (asserted above).
    assert skipped <= run // 2, (skipped, run)


def test_noise_above_valid_below_says_so_declared_or_not():
    target = mx.MultiHeadAttention.random(6, 3, seed=1)
    noisy = mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-6, seed=0)
    with pytest.raises(mx.ExtractionError, match="noise_within_validity") as raised:
        mx.extract(noisy, 6, heads=3, seed=0, answer_error=1e-6, schedule="paper")
    result = raised.value.extraction
    assert not 1e-6 < result.valid_below and result.error_bound(1e-6) == np.inf
    assert mx.compare(result.model, target).max_rel > 1e-3  # indeed unreliable
    # Not declared: the redundant measurements reveal the noise.
    undeclared = quiet_extract(mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-9, seed=0), 6, 3, seed=0)
    assert undeclared.model is not None and mx.compare(undeclared.model, target).max_rel > 1e-3
    check = {c.name: c for c in undeclared.checks}["noise_within_validity"]
    assert not check.passed and check.value > check.threshold


def test_exact_runs_estimate_rounding_level_noise_and_pass():
    target = mx.MultiHeadAttention.random(5, 2, seed=4)
    result = mx.extract(mx.SimulatedOracle(target), 5, heads=2, seed=4, schedule="paper")
    assert result.ok
    assert result.certificate.noise_estimate < 1e-14 < result.valid_below
    # Rounding-level noise is judged by the core checks; the validity check joins above it.
    assert "noise_within_validity" not in [check.name for check in result.checks]


def test_error_bound_rejects_bad_eps():
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    result = mx.extract(mx.SimulatedOracle(target), 2, heads=1, seed=0, schedule="paper")
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            result.error_bound(eps)
    with pytest.raises(TypeError, match="eps"):
        result.error_bound("1e-9")


# ------------------------------------------------------------------ refinement
def test_output_jacobian_matches_finite_differences():
    target = mx.MultiHeadAttention.random(3, 2, seed=7)
    batch = random_queries(np.random.default_rng(3), 20, 3, 1.3, (1, 6))
    J = output_jacobian(target, batch)
    theta = pack(target)
    for p in range(len(theta)):
        step = np.zeros_like(theta)
        step[p] = 1e-6
        numeric = (unpack(theta + step, 2, 3)(batch) - unpack(theta - step, 2, 3)(batch)) / 2e-6
        assert np.allclose(J[:, p], numeric, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("d, H", [(4, 1), (4, 2), (4, 3), (8, 3)])
def test_acceptance_6_refinement_reaches_1e_13_on_exact_oracles(d, H):
    target = mx.MultiHeadAttention.random(d, H, seed=40 + d + H)
    oracle = Counting(mx.SimulatedOracle(target))
    result = mx.extract(oracle, d, heads=H, seed=1, refine=True, schedule="paper")
    assert result.refinement.kept == "refined"
    assert mx.compare(result.model, target).max_rel <= 1e-13
    # The polish queries: POLISH_FACTOR = 6 per refined parameter (bias-free: H (d^2 + d)), at least 32.
    assert result.queries == oracle.count == result.promised_queries + max(32, 6 * H * (d * d + d))
    assert result.max_query_length == 2 * H + 1  # the refinement queries keep the schedule's longest


def test_refinement_never_returns_a_worse_fit():
    target = mx.MultiHeadAttention.random(3, 2, seed=8)
    batch = random_queries(np.random.default_rng(4), 80, 3, 3**0.25, (1, 5))
    answers = target(batch)
    rng = np.random.default_rng(5)
    for size in (1e-8, 1e-3, 1.0, 30.0):
        start = unpack(pack(target) + size * rng.standard_normal(len(pack(target))), 2, 3)
        model, record = refine_least_squares(start, batch, answers, max_evaluations=3)
        before = np.sqrt(np.mean((start(batch) - answers) ** 2))
        after = np.sqrt(np.mean((model(batch) - answers) ** 2))
        assert after <= before and record.residual_before == pytest.approx(before)
        assert record.kept in ("refined", "algebraic")
        if record.kept == "algebraic":
            assert model is start


@pytest.mark.slow
def test_refined_certificate_bounds_noisy_runs():
    for seed in range(3):
        target = mx.MultiHeadAttention.random(4, 2, seed=60 + seed)
        result = quiet_extract(mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-11, seed=seed), 4, 2, seed=seed,
                               refine=True, answer_error=1e-11)
        assert result.certificate.kind == "least squares"
        assert mx.compare(result.model, target).max_rel <= result.error_bound(1e-11) < 1e-6


@pytest.mark.slow
def test_acceptance_3_float32_target():
    d, H = 8, 2
    target = mx.MultiHeadAttention.random(d, H, seed=0)
    oracle = mx.Float32Oracle(target)
    result = quiet_extract(oracle, d, H, seed=100, refine=True)  # completes (failed checks are reported)
    measured = mx.compare(result.model, target).max_rel
    assert measured <= result.error_estimate  # the reported estimate is honest (inf when not certified)
    verification = mx.verify(result, oracle, verify_queries=512, seed=0)
    # The floor: the float32 oracle's own error on the very same fresh queries.
    rng = np.random.default_rng(0)
    sequences = []
    for scale, count in zip((0.5, 1.0, 2.0), np.diff(np.linspace(0, 512, 4).astype(int))):
        sequences += random_queries(rng, count, d, scale * d**0.25, (1, 16))
    answers = oracle(sequences)
    floor = np.abs(answers - target(sequences)) / np.sqrt(np.mean(answers**2))
    assert verification.max_relative_error <= 10 * floor.max()
    assert verification.mean_relative_error <= 10 * 2.0**-24


# ------------------------------------------------------------------ verification
def test_verify_counts_records_and_tells_good_from_bad():
    target = mx.MultiHeadAttention.random(4, 2, seed=9)
    result = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=9, schedule="paper")
    oracle = Counting(mx.SimulatedOracle(target))
    verification = mx.verify(result, oracle, verify_queries=90, seed=1, verify_length=12)
    assert verification.queries == oracle.count == 90 and oracle.longest <= 12
    checked = result.with_verification(verification)
    assert verification.passed and checked.verified and checked.verification is verification
    assert result.verification is None and not result.verified  # verify never modifies its argument
    assert verification.max_relative_error < 1e-9
    other = mx.MultiHeadAttention.random(4, 2, seed=10)
    failed = mx.verify(result, mx.SimulatedOracle(other), verify_queries=30, seed=1)
    assert not failed.passed and not result.with_verification(failed).verified


@pytest.mark.parametrize("options, message", [({"verify_queries": 0}, "verify_queries"), ({"verify_length": 0}, "verify_length"),
                                              ({"scales": (1.0, -2.0)}, "scales"), ({"tolerance": 0}, "tolerance")])
def test_verify_rejects_bad_input(options, message):
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    result = mx.extract(mx.SimulatedOracle(target), 2, heads=1, seed=0, schedule="paper")
    with pytest.raises(ValueError, match=message):
        mx.verify(result, mx.SimulatedOracle(target), **options)


def test_instance_pseudo_inverses_by_lu_where_well_conditioned_else_by_the_svd():
    from mhaextract.checks.linearisation import _pseudo_inverse
    from mhaextract.numerics.rational import INVERSE_CHUNK, INVERSE_CONDITION

    rng = np.random.default_rng(4)
    J = rng.standard_normal((6, 5, 5))
    J[1, :, 4] = J[1, :, 3]  # singular: its pseudo-inverse, not an inverse
    J[2, :, 4] = J[2, :, 3] * (1 + 1e-12)  # nearly singular: beyond INVERSE_CONDITION
    out = _pseudo_inverse(J)
    reference = np.linalg.pinv(J)
    for n in (1, 2):
        assert np.array_equal(out[n], reference[n])
    for n in (0, 3, 4, 5):
        assert np.linalg.cond(J[n], 1) < INVERSE_CONDITION
        assert np.abs(out[n] - reference[n]).max() <= 1e-12 * np.abs(reference[n]).max()
        assert np.abs(out[n] @ J[n] - np.eye(5)).max() < 1e-12
    many = rng.standard_normal((3 * INVERSE_CHUNK, 5, 5))
    many[INVERSE_CHUNK + 3, :, 1] = 0.0  # one singular matrix: its chunk goes to pinv, the others to LU
    out, reference = _pseudo_inverse(many), np.linalg.pinv(many)
    assert np.array_equal(out[INVERSE_CHUNK:2 * INVERSE_CHUNK], reference[INVERSE_CHUNK:2 * INVERSE_CHUNK])
    assert np.array_equal(out[:INVERSE_CHUNK], np.linalg.inv(many[:INVERSE_CHUNK]))
    tall = rng.standard_normal((3, 7, 5))  # oversampled instances: the least-squares pseudo-inverse
    assert np.array_equal(_pseudo_inverse(tall), np.linalg.pinv(tall))
    assert _pseudo_inverse(np.zeros((0, 5, 5))).shape == (0, 5, 5)


def test_the_former_verification_names_still_work_with_a_warning():
    """One vocabulary: verify_queries / verify_length (``n`` and ``max_length`` before)."""
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    oracle = mx.SimulatedOracle(target)
    result = mx.extract(oracle, 3, heads=1, seed=1, schedule="paper")
    with pytest.warns(FutureWarning, match="verify_queries"):
        old = mx.verify(result, oracle, n=12, seed=0, max_length=5)
    new = mx.verify(result, oracle, verify_queries=12, seed=0, verify_length=5)
    assert (old.queries, old.lengths, old.max_relative_error) == (new.queries, new.lengths, new.max_relative_error)
    with pytest.raises(ValueError, match="verify_queries= only"):
        mx.verify(result, oracle, 12, n=12)
