"""Unit tests of the float64 kernels on constructed instances with known answers.

Every expected value is computed here, independently of the code under test: samples of
``F(k) = c + sum_h tau_h l_h / (k + tau_h)`` with mpmath at 200 bits (then rounded once to
float64), barycentric weights from a closed formula, assembly matrices by forward products,
Jacobians by central finite differences.
"""

import mpmath
import numpy as np
import pytest

from mhaextract.numerics import float64 as kf
from mhaextract.numerics.rational import instance_jacobian, sensitivities


def exact_samples(c, m, l, ks):
    """F(k) at 200 bits, rounded once to float64 (the best float64 samples there are)."""
    with mpmath.workprec(200):
        out = []
        for k in ks:
            value = mpmath.mpf(float(c))
            for mh, lh in zip(m, l):
                tau = mpmath.exp(mpmath.mpf(float(mh)))
                value += tau * mpmath.mpf(float(lh)) / (int(k) + tau)
            out.append(float(value))
    return np.array(out)


def random_instances(rng, n, H, min_gap=0.4):
    """n instances with H log-poles in [-1.5, 1.5] at least ``min_gap`` apart, labels of size 0.5..2."""
    cs, ms, ls = [], [], []
    for _ in range(n):
        while True:
            m = np.sort(rng.uniform(-1.5, 1.5, H))
            if H == 1 or np.diff(m).min() > min_gap:
                break
        ms.append(m)
        ls.append(rng.uniform(0.5, 2.0, H) * rng.choice([-1.0, 1.0], H))
        cs.append(rng.uniform(-1.0, 1.0))
    return np.array(cs), np.array(ms), np.array(ls)


def batch(cs, ms, ls, ks):
    return np.array([exact_samples(c, m, l, ks) for c, m, l in zip(cs, ms, ls)])


# Tolerances per H: measured worst errors over 20 random instances (seeded as below), max over
# c, m, l, for the exact count / lean / oversampled paths:
#   H=1: 1.8e-15 / 1.3e-15 / 1.8e-15   -> 1e-13
#   H=2: 4.0e-12 / 4.0e-12 / 1.1e-12   -> 5e-11
#   H=3: 9.5e-10 / 1.5e-10 / 2.5e-10   -> 1e-8
# (about three digits lost per head, as the float64 head limit in the learner says). A wrong
# pole, label or constant is off by O(0.1) or more, far outside any of these.
TOLERANCE = {1: 1e-13, 2: 5e-11, 3: 1e-8}


@pytest.mark.parametrize("H", [1, 2, 3])
@pytest.mark.parametrize("mode", ["exact", "lean", "oversampled"])
def test_fit_recovers_constant_poles_and_labels_of_a_batch(H, mode):
    rng = np.random.default_rng(100 + H)
    cs, ms, ls = random_instances(rng, 20, H)
    K = {"exact": 2 * H + 1, "lean": 2 * H, "oversampled": 2 * H + 7}[mode]
    ks = np.arange(K)
    samples = batch(cs, ms, ls, ks)
    fits = kf.fit(samples, ks, H, constant=cs if mode == "lean" else None)  # all 20 instances in one call
    tol = TOLERANCE[H]
    assert np.abs(fits.c - cs).max() <= tol
    assert np.all(np.diff(fits.log_poles, axis=1) > 0)  # sorted ascending
    assert np.abs(fits.log_poles - ms).max() <= tol
    assert np.abs(fits.labels - ls).max() <= tol
    assert np.abs(fits.residual).max() <= 1e3 * tol
    assert not fits.nonpositive.any() and not fits.certified.any()


def test_batched_fit_keeps_each_instance_its_own_parameters():
    """The batch is not averaged or permuted: each row equals the fit of that row alone."""
    rng = np.random.default_rng(7)
    cs, ms, ls = random_instances(rng, 6, 2)
    ks = np.arange(5)
    samples = batch(cs, ms, ls, ks)
    together = kf.fit(samples, ks, 2)
    for row in range(len(cs)):
        alone = kf.fit(samples[row:row + 1], ks, 2)
        # Same arithmetic per row (batched LAPACK calls): agreement at rounding of the fit (5e-11, above).
        assert np.allclose(together.log_poles[row], alone.log_poles[0], atol=5e-11, rtol=0)
        assert np.allclose(together.labels[row], alone.labels[0], atol=5e-11, rtol=0)
        assert np.abs(together.log_poles[row] - ms[row]).max() <= 5e-11


def test_oversampled_fit_is_the_least_squares_optimum_on_noisy_samples():
    """With K > 2H+1 and noise the polish must reach a stationary point of the squared residual:
    J^T r = 0. The Loewner/Cauchy estimate alone does not (measured: |J^T r| / (|J| |r|) is
    1.3e-2 without the polish, 6.9e-11 after it)."""
    rng = np.random.default_rng(3)
    cs, ms, ls = random_instances(rng, 8, 2)
    ks = np.arange(15)
    samples = batch(cs, ms, ls, ks) + 1e-6 * rng.standard_normal((8, 15))
    fits = kf.fit(samples, ks, 2)
    tau = np.exp(fits.log_poles)
    model = fits.c[:, None] + (tau[:, None, :] * fits.labels[:, None, :] / (ks[None, :, None] + tau[:, None, :])).sum(2)
    r = model - samples
    J = finite_difference_jacobian(ks, fits.c, fits.log_poles, fits.labels)
    gradient = np.einsum("nkp,nk->np", J, r)
    relative = np.linalg.norm(gradient, axis=1) / (np.linalg.norm(J, axis=(1, 2)) * np.linalg.norm(r, axis=1))
    assert relative.max() < 1e-6
    # Noise 1e-6 through cond(J) up to ~1e4: measured pole error 2.3e-3 (3.7e-2 unpolished).
    assert np.abs(fits.log_poles - ms).max() < 1e-2


def channel_instances(rng, n, H, m, ks, gap=0.05):
    """n instances of H log-poles in [0, 4], two of them ``gap`` apart, sharing them over a read-out
    and m channels whose residue vectors are random: (log-poles, read-out samples, channels, labels)."""
    log_poles = np.sort(rng.uniform(0.0, 4.0, (n, H)), axis=1)
    log_poles[:, 1] = log_poles[:, 0] + gap
    log_poles = np.sort(log_poles, axis=1)
    residues = rng.standard_normal((n, H, m + 1)) * np.exp(log_poles)[:, :, None]
    cauchy = 1.0 / (ks[None, :, None] + np.exp(log_poles)[:, None, :])
    values = np.einsum("nkh,nhm->nkm", cauchy, residues)
    return log_poles, values[:, :, 0], values[:, :, 1:], residues[:, :, 0] / np.exp(log_poles)


@pytest.mark.slow
def test_channels_place_poles_that_one_read_out_blurs():
    """Answers rounded at float32's unit share their poles over m channels (a whole layer's
    outputs): with the channels every fit's poles are real and close, without them the same
    read-out's fits give complex, negative or far poles; the residues stay the read-out's own."""
    rng = np.random.default_rng(7)
    ks = np.array([0, 1, 2, 3, 5, 9, 17, 29, 51, 90])
    n, H, m = 200, 4, 8
    log_poles, samples, channels, labels = channel_instances(rng, n, H, m, ks)
    noisy = samples * (1 + 2.0**-24 * rng.standard_normal(samples.shape))
    noisy_channels = channels * (1 + 2.0**-24 * rng.standard_normal(channels.shape))
    alone = kf.fit(noisy, ks, H, constant=np.zeros(n))
    joint = kf.fit(noisy, ks, H, constant=np.zeros(n), channels=noisy_channels, channel_constants=np.zeros((n, m)))
    error_alone = np.nan_to_num(np.abs(alone.log_poles - log_poles).max(axis=1), nan=np.inf)
    error_joint = np.abs(joint.log_poles - log_poles).max(axis=1)
    assert np.isfinite(joint.log_poles).all() and not joint.nonpositive.any()
    assert np.median(error_joint) < 1e-3 and np.median(error_alone) > 30 * np.median(error_joint)
    # exact answers: the joint fit is exact too, residues included
    exact = kf.fit(samples, ks, H, constant=np.zeros(n), channels=channels, channel_constants=np.zeros((n, m)))
    assert np.abs(exact.log_poles - log_poles).max() < 1e-8
    assert np.abs(exact.labels - labels).max() < 1e-6 * np.abs(labels).max()
    # constants unknown: fitted with the poles, every channel its own
    shifted = kf.fit(samples + 0.5, ks, H, channels=channels - 0.25)
    assert np.abs(shifted.log_poles - log_poles).max() < 1e-7 and np.abs(shifted.c - 0.5).max() < 1e-9


def test_common_pole_polish_never_raises_the_misfit_and_parts_conjugate_starts():
    """The polish keeps a step only where it lowers the projected misfit; a conjugate pair of
    Loewner poles starts as two distinct real values, which the polish then moves apart to the
    true ones."""
    rng = np.random.default_rng(8)
    ks = np.array([0, 1, 2, 3, 5, 9, 17, 29, 51, 90], dtype=float)
    log_poles, samples, channels, _ = channel_instances(rng, 50, 3, 6, ks, gap=0.2)
    targets = np.concatenate([samples[:, :, None], channels], axis=2)
    targets = targets / np.abs(targets).max(axis=1, keepdims=True)
    start = log_poles + rng.normal(0.0, 0.3, log_poles.shape)
    before = (kf.projected_misfit(targets, ks, start) ** 2).sum(axis=(1, 2))
    polished = kf.common_pole_polish(targets, ks, start)
    after = (kf.projected_misfit(targets, ks, polished) ** 2).sum(axis=(1, 2))
    assert (after <= before).all()
    assert np.median(np.abs(np.sort(polished, axis=1) - log_poles).max(axis=1)) < 1e-8
    pair = np.array([[-(2.0 + 0.5j), -(2.0 - 0.5j), -7.0 + 0j]])
    started = kf.pole_start(pair, ks)
    assert started[0, 0] != started[0, 1] and np.allclose(sorted(started[0, :2]), [1.5, 2.5])
    # a pole that is not finite or not negative (tau <= 0) starts on the spread 1..ks[-1] + 1
    started = kf.pole_start(np.array([[-1.0 + 0j, np.nan + 0j, 3.0 + 0j]]), ks)
    assert np.allclose(started, [[1.0, np.sqrt(91.0), 91.0]])


# ------------------------------------------------------------------ rank detection
def test_detect_ranks_counts_distinct_poles_with_nonzero_label():
    ks = np.arange(7)  # H0 = 3
    cases = [  # (c, m, l, true rank)
        (0.5, [-0.8, 0.1, 0.9], [1.0, -0.7, 0.4], 3),
        (0.5, [-0.8, 0.9], [1.0, 0.4], 2),
        (0.5, [0.3], [1.0], 1),
        (0.5, [-0.8, 0.3, 0.3], [1.0, 0.7, -0.2], 2),  # merged equal poles count once
        (0.5, [-0.8, 0.3, 0.9], [1.0, 0.0, 0.4], 2),  # a zero-label pole is no pole
        (-0.3, [0.2, 0.2, 0.2], [0.5, 0.25, 0.25], 1),  # three merged
        (0.5, [], [], 0),  # constant
        (0.5, [0.3, 0.3], [0.7, -0.7], 0),  # merged labels cancel: constant
    ]
    samples = np.array([exact_samples(c, m, l, ks) for c, m, l, _ in cases])
    ranks, relative = kf.detect_ranks(samples, ks, 3)
    assert list(ranks) == [case[3] for case in cases]
    assert relative.shape == (len(cases), 3)


def test_detect_ranks_with_known_constant():
    ks = np.arange(6)  # lean: 2 H0 samples, H0 = 3
    cases = [(0.5, [-0.8, 0.1, 0.9], [1.0, -0.7, 0.4], 3), (0.25, [0.1, 0.1], [1.0, 0.5], 1), (0.25, [], [], 0)]
    samples = np.array([exact_samples(c, m, l, ks) for c, m, l, _ in cases])
    ranks, _ = kf.detect_ranks(samples, ks, 3, constant=np.array([case[0] for case in cases]))
    assert list(ranks) == [case[3] for case in cases]


def test_answer_error_raises_the_rank_threshold_but_keeps_real_poles():
    ks = np.arange(5)  # H0 = 2
    eps = 1e-6
    rng = np.random.default_rng(11)
    noise = rng.uniform(-eps, eps, (3, 5))
    samples = np.array([
        exact_samples(0.5, [], [], ks),  # constant
        exact_samples(0.5, [0.2], [1.0], ks),  # one real pole, label far above the noise
        exact_samples(0.5, [-0.5, 0.6], [1.0, -0.8], ks),  # two real poles
    ]) + noise
    undeclared, _ = kf.detect_ranks(samples, ks, 2)
    declared, _ = kf.detect_ranks(samples, ks, 2, answer_error=eps)
    # Without the declaration the noise reads as poles (this is what the threshold is for) ...
    assert undeclared[0] > 0 and undeclared[1] > 1
    # ... with it, noise is not a pole and real poles still are.
    assert list(declared) == [0, 1, 2]


# ------------------------------------------------------------------ poles of the barycentric denominator
@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_poles_from_weights_finds_the_zeros_of_a_constructed_denominator(r):
    """w_a = prod_h (s_a - p_h) / prod_{b != a} (s_a - s_b) makes
    D(k) = sum_a w_a / (k - s_a) = prod_h (k - p_h) / prod_a (k - s_a): zeros exactly at p."""
    rng = np.random.default_rng(r)
    support = np.arange(0, 2 * r + 1, 2)  # r + 1 even support points, as in the fit
    rows = []
    truth = []
    for _ in range(5):
        p = np.sort(-np.exp(rng.uniform(-1.5, 1.5, r)))
        w = np.array([np.prod(s - p) / np.prod([s - t for t in support if t != s]) for s in support])
        rows.append(w * rng.uniform(0.5, 2.0))  # the null vector's scale is arbitrary
        truth.append(p)
    found = kf.poles_from_weights(np.array(rows), support)
    assert found.shape == (5, r)
    # Measured max errors 1.3e-15, 5.3e-14, 2.1e-12, 8.2e-11 for r = 1..4 (closest poles 0.06..0.12
    # apart: eigenvalues of nearby zeros are sensitive); imaginary parts exactly 0. A wrong sign or
    # a misplaced support point moves the zeros by O(0.1).
    tolerance = {1: 1e-13, 2: 1e-12, 3: 5e-11, 4: 1e-9}[r]
    assert np.abs(found.imag).max() <= tolerance
    assert np.abs(np.sort(found.real, axis=1) - np.array(truth)).max() <= tolerance


def test_poles_from_weights_with_no_pole():
    assert kf.poles_from_weights(np.ones((3, 1)), np.array([0])).shape == (3, 0)


# ------------------------------------------------------------------ assembly
def test_assemble_inverts_the_bilinear_measurement():
    rng = np.random.default_rng(21)
    d, H = 4, 3
    W = rng.standard_normal((H, d, d)) / np.sqrt(d)
    v = rng.standard_normal((H, d))
    Z = np.linalg.qr(rng.standard_normal((d, d)))[0] * d**0.25 + 0.1 * rng.standard_normal((d, d))
    X = np.linalg.qr(rng.standard_normal((d, d)))[0] * d**0.25 + 0.1 * rng.standard_normal((d, d))
    M = np.einsum("ji,hjk,kl->hil", Z, W, X)  # Z^T W_h X
    labels = v @ Z  # l_h = Z^T v_h
    W_found, v_found = kf.assemble(Z, X, M, labels)
    # Measured 4.4e-16 (cond(Z), cond(X) ~ 1.3): float64 rounding times the conditioning.
    assert np.abs(W_found - W).max() <= 1e-13
    assert np.abs(v_found - v).max() <= 1e-13
    # Not symmetric in Z and X: swapping them must give something else.
    assert np.abs(kf.assemble(X, Z, M, labels)[0] - W).max() > 1e-3


# ------------------------------------------------------------------ Jacobian and sensitivities
def model_values(ks, c, m, l):
    tau = np.exp(m)
    return c[:, None] + (tau[:, None, :] * l[:, None, :] / (ks[None, :, None] + tau[:, None, :])).sum(2)


def finite_difference_jacobian(ks, c, m, l, step=1e-6):
    n, r = m.shape
    params = np.concatenate([c[:, None], m, l], axis=1)
    J = np.empty((n, len(ks), 2 * r + 1))
    for p in range(2 * r + 1):
        delta = np.zeros_like(params)
        delta[:, p] = step
        plus, minus = params + delta, params - delta
        J[:, :, p] = (model_values(ks, plus[:, 0], plus[:, 1:r + 1], plus[:, r + 1:])
                      - model_values(ks, minus[:, 0], minus[:, 1:r + 1], minus[:, r + 1:])) / (2 * step)
    return J


def test_instance_jacobian_matches_central_differences():
    rng = np.random.default_rng(5)
    cs, ms, ls = random_instances(rng, 4, 3)
    ks = np.arange(7)
    J = instance_jacobian(ks, np.exp(ms), ls)
    numeric = finite_difference_jacobian(ks, cs, ms, ls)
    assert J.shape == numeric.shape == (4, 7, 7)
    # Central differences with step 1e-6: truncation ~1e-12 * |F'''|, rounding ~1e-16/1e-6;
    # measured max difference 3e-10.
    assert np.abs(J - numeric).max() <= 1e-8


@pytest.mark.parametrize("known", [False, True])
def test_sensitivities_are_the_pseudo_inverse_diagonal_of_the_jacobian(known):
    rng = np.random.default_rng(6)
    cs, ms, ls = random_instances(rng, 4, 2)
    ks = np.arange(5)
    scale = np.array([1.0, 2.0, 0.5, 3.0])
    condition, sigma_m, sigma_l = sensitivities(ks, np.exp(ms), ls, scale, constant_known=known)
    J = finite_difference_jacobian(ks, cs, ms, ls)
    if known:
        J = J[:, :, 1:]
    first = 0 if known else 1
    for row in range(4):
        covariance = np.linalg.inv(J[row].T @ J[row])
        expected = scale[row] * np.sqrt(np.diag(covariance))
        # Finite-difference Jacobian (error ~3e-10) through cond(J) up to 8e4: measured 5e-7 relative.
        assert sigma_m[row] == pytest.approx(expected[first:first + 2], rel=1e-5)
        assert sigma_l[row] == pytest.approx(expected[first + 2:], rel=1e-5)
        smallest = np.linalg.svd(J[row], compute_uv=False)[-1]
        if known:  # tall (5 x 4): by the SVD
            assert condition[row] == pytest.approx(scale[row] / smallest, rel=1e-5)
        else:  # square: LU's inverse, an upper bound at most 5^(1/8) too large
            assert scale[row] / smallest * (1 - 1e-5) <= condition[row] <= 5**0.125 * scale[row] / smallest * (1 + 1e-5)


def test_sensitivities_of_an_unidentifiable_pole_are_enormous():
    # l_1 = 0: the column dF/dm_1 vanishes, J is singular; LU refuses its chunk, the SVD says so
    # (its least singular value is 0 or rounding: measured 1e-17, condition 7e16).
    rng = np.random.default_rng(8)
    cs, ms, ls = random_instances(rng, 300, 2)
    ls[17, 0] = 0.0
    condition, sigma_m, sigma_l = sensitivities(np.arange(5), np.exp(ms), ls, np.ones(300))
    assert condition[17] > 1e15 and sigma_m[17, 0] > 1e15
    others = np.delete(np.arange(300), 17)
    assert np.isfinite(condition[others]).all() and np.isfinite(sigma_m[others]).all()


def test_small_matrix_helpers_against_numpy():
    from mhaextract.numerics.rational import lu_inverses, spectral_norm_bound, triangular_inverse

    rng = np.random.default_rng(9)
    A = rng.standard_normal((50, 5, 5))
    R = np.triu(A) + 3 * np.eye(5)
    assert np.abs(triangular_inverse(R) @ R - np.eye(5)).max() < 1e-14
    R[3, 2, 2] = 0.0  # a zero pivot: that matrix has no inverse, the others are untouched
    with np.errstate(all="ignore"):
        inverse = triangular_inverse(R)
    assert not np.isfinite(inverse[3]).all() and np.isfinite(np.delete(inverse, 3, axis=0)).all()
    exact = np.linalg.norm(A, 2, axis=(1, 2))
    bound = spectral_norm_bound(A)
    assert (exact * (1 - 1e-13) <= bound).all() and (bound <= 5**0.125 * exact).all()
    assert spectral_norm_bound(1e300 * A) == pytest.approx(1e300 * bound, rel=1e-13)  # no overflow
    assert spectral_norm_bound(np.zeros((2, 3, 3))).tolist() == [0.0, 0.0]
    inverse, inverted = lu_inverses(A)
    assert inverted.all() and np.abs(inverse @ A - np.eye(5)).max() < 1e-10
    assert not lu_inverses(rng.standard_normal((4, 7, 5)))[1].any()  # tall: the caller's SVD


def test_null_vectors_and_least_squares_match_the_svd():
    rng = np.random.default_rng(10)
    L = rng.standard_normal((40, 3, 4))
    w = kf.null_vectors(L)
    assert np.abs(np.einsum("nij,nj->ni", L, w)).max() < 1e-14
    assert np.allclose(np.linalg.norm(w, axis=1), 1.0)
    tall = rng.standard_normal((40, 6, 4))  # oversampled: the least right singular vector
    reference = np.linalg.svd(tall)[2][:, -1]
    assert np.abs(np.abs(np.einsum("ni,ni->n", kf.null_vectors(tall), reference)) - 1).max() < 1e-12
    C, t = rng.standard_normal((40, 5, 3)), rng.standard_normal((40, 5))
    x = kf.least_squares_qr(C, t)
    for n in range(40):
        assert np.allclose(x[n], np.linalg.lstsq(C[n], t[n], rcond=None)[0], rtol=1e-12, atol=1e-13)
    C[7, :, 2] = C[7, :, 1]  # rank 2: the SVD's (finite) solution instead of R^{-1}'s infinities
    x = kf.least_squares_qr(C, t)
    assert np.isfinite(x).all()
