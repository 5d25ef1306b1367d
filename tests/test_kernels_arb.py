"""Unit tests of the ball-arithmetic kernels (python-flint) on constructed instances.

Samples of ``F(k) = c + sum_h tau_h l_h / (k + tau_h)`` are computed here with mpmath at 512
bits, rounded to 256-bit midpoints and given a radius 2^-254 |F| that covers that rounding: the
sample balls provably contain the true F(k). Krawczyk with such parameter balls encloses every
solution for samples inside them, so the returned balls must contain the true (c, m, l), as a
theorem, not up to a tolerance. A second variant uses exact (zero-radius) balls, as the oracle
delivers them.
"""

import mpmath
import numpy as np
import pytest
from flint import arb

from mhaextract.numerics.highprec import mid_float, mpf_to_arb, radius_float, to_arb, working_precision
from mhaextract.numerics import arb as ka

BITS = 256


def true_values(c, m, l, ks):
    with mpmath.workprec(512):
        out = []
        for k in ks:
            value = mpmath.mpf(c)
            for mh, lh in zip(m, l):
                tau = mpmath.exp(mpmath.mpf(mh))
                value += tau * mpmath.mpf(lh) / (int(k) + tau)
            out.append(value)
    return out


def enclosing_balls(values):
    """256-bit midpoints with a radius covering the rounding from 512 bits (and far more)."""
    out = []
    for value in values:
        with mpmath.workprec(BITS):
            mid = +value
        out.append(arb(mpf_to_arb(mid).mid(), mpf_to_arb(abs(mid)).mid() * arb(2) ** -(BITS - 2)))
    return out


def exact_balls(values):
    out = []
    for value in values:
        with mpmath.workprec(BITS):
            out.append(mpf_to_arb(+value))
    return out


def exact(x):
    """The exact ball of a float or mpf parameter (floats are dyadic: no rounding)."""
    return mpf_to_arb(mpmath.mpf(x))


INSTANCES = [  # (c, log-poles, labels): well separated (gaps >= 0.5)
    (0.25, [0.3], [1.5]),
    (0.25, [-0.5, 0.7], [1.5, -0.75]),
    (-0.5, [-1.0, 0.0, 1.0], [1.0, -0.5, 0.75]),
]


def contains_all(balls, truths):
    return all(ball.contains(exact(t)) for ball, t in zip(balls, truths))


@pytest.mark.parametrize("c, m, l", INSTANCES)
def test_fit_certifies_and_encloses_the_truth(c, m, l):
    H = len(m)
    ks = np.arange(2 * H + 1)
    with working_precision(BITS):
        samples = np.array([enclosing_balls(true_values(c, m, l, ks))], dtype=object)
        fits = ka.fit(samples, ks, H)
        assert fits.certified[0]
        assert fits.c[0].contains(exact(c))
        assert contains_all(fits.log_poles[0], m)
        assert contains_all(fits.labels[0], l)
        # Tiny: measured radii up to 5e-75, 2e-73, 7e-71 for H = 1, 2, 3, against 2^-150 = 7e-46.
        radii = np.concatenate([radius_float(fits.log_poles[0]), radius_float(fits.labels[0]),
                                radius_float(fits.c[:1])])
        truths = np.abs(np.array([*m, *l, c]))
        assert np.all(radii <= 2.0**-150 * np.maximum(truths, 1.0))
        assert radii.max() > 0  # real balls (the samples have radii)


@pytest.mark.parametrize("c, m, l", INSTANCES[1:])
def test_lean_fit_with_known_constant_encloses_the_truth(c, m, l):
    H = len(m)
    ks = np.arange(2 * H)
    with working_precision(BITS):
        samples = np.array([enclosing_balls(true_values(c, m, l, ks))], dtype=object)
        fits = ka.fit(samples, ks, H, constant=np.array([exact(c)], dtype=object))
        assert fits.certified[0]
        assert contains_all(fits.log_poles[0], m) and contains_all(fits.labels[0], l)
        assert radius_float(fits.log_poles[0]).max() <= 2.0**-150


def test_fit_on_exact_oracle_balls_is_accurate_to_the_working_precision():
    """Zero-radius samples (the oracle's rounded answers): the fit is of the rounded samples,
    so the truth is within cond * 2^-256 of the balls; measured |ball - truth| <= 5e-71
    (H = 3), tolerance 2^-150 = 7e-46."""
    c, m, l = INSTANCES[2]
    ks = np.arange(7)
    with working_precision(BITS):
        samples = np.array([exact_balls(true_values(c, m, l, ks))], dtype=object)
        fits = ka.fit(samples, ks, 3)
        assert fits.certified[0]
        assert np.abs(mid_float(fits.log_poles[0]) - m).max() <= 2.0**-150
        assert np.abs(mid_float(fits.labels[0]) - l).max() <= 2.0**-150


def test_batched_fit_keeps_each_row():
    ks = np.arange(5)
    instances = [(0.25, [-0.5, 0.7], [1.5, -0.75]), (1.0, [0.1, 1.2], [-0.3, 2.0]), (-2.0, [-1.4, -0.2], [0.5, 0.5])]
    with working_precision(BITS):
        samples = np.array([enclosing_balls(true_values(c, m, l, ks)) for c, m, l in instances], dtype=object)
        fits = ka.fit(samples, ks, 2)
        assert fits.certified.all()
        for row, (c, m, l) in enumerate(instances):
            assert fits.c[row].contains(exact(c))
            assert contains_all(fits.log_poles[row], m) and contains_all(fits.labels[row], l)


def test_detect_ranks_finds_the_distinct_poles():
    ks = np.arange(7)  # H0 = 3
    cases = [
        (0.5, [-0.8, 0.1, 0.9], [1.0, -0.7, 0.4], 3),
        (0.5, [-0.5, 0.3, 0.3], [1.0, 1.0, -0.5], 2),  # merged equal poles count once
        (0.5, [-0.5, 0.3, 0.9], [1.0, 1.0, 0.0], 2),  # zero label: no pole
        (0.5, [0.2], [1.0], 1),
        (0.5, [], [], 0),
    ]
    with working_precision(BITS):
        samples = np.array([enclosing_balls(true_values(c, m, l, ks)) for c, m, l, _ in cases], dtype=object)
        ranks, relative = ka.detect_ranks(samples, ks, 3)
    assert list(ranks) == [case[3] for case in cases]
    # The gap is enormous at 256 bits: the dropped singular values sit at ~1e-77 (rounding),
    # the kept ones above 1e-5, the threshold 2^-128 = 3e-39 in between.
    kept = relative[0]
    assert kept.min() > 1e-10


def test_assemble_in_balls_contains_the_truth():
    rng = np.random.default_rng(8)
    d, H = 3, 2
    W = rng.standard_normal((H, d, d))
    v = rng.standard_normal((H, d))
    Z = np.linalg.qr(rng.standard_normal((d, d)))[0] + 0.1 * rng.standard_normal((d, d))
    X = np.linalg.qr(rng.standard_normal((d, d)))[0] + 0.1 * rng.standard_normal((d, d))
    with working_precision(BITS):
        # M_h = Z^T W_h X and l_h = Z^T v_h exactly, in balls built from the exact float entries.
        Zb = np.array([[exact(x) for x in row] for row in Z], dtype=object)
        Xb = np.array([[exact(x) for x in row] for row in X], dtype=object)
        Wb = np.array([[[exact(x) for x in row] for row in Wh] for Wh in W], dtype=object)
        vb = np.array([[exact(x) for x in row] for row in v], dtype=object)
        M = np.array([Zb.T @ Wb[h] @ Xb for h in range(H)], dtype=object)
        labels = np.array([Zb.T @ vb[h] for h in range(H)], dtype=object)
        W_found, v_found = ka.assemble(Z, X, M, labels)
        assert all(ball.contains(exact(t)) for ball, t in zip(W_found.ravel(), W.ravel()))
        assert all(ball.contains(exact(t)) for ball, t in zip(v_found.ravel(), v.ravel()))
        # Measured radii <= 4e-76; a ball of radius 1 would contain everything.
        assert radius_float(W_found).max() <= 2.0**-150 and radius_float(v_found).max() <= 2.0**-150


@pytest.mark.parametrize("gap", [1e-30, 1e-10, 1e-6])
def test_nearly_equal_poles_are_honest(gap):
    """Two poles ``gap`` apart at 256 bits. Recorded behaviour:

    * 1e-30: the pair's singular value (~gap^2 = 1e-60) is under the rank threshold 2^-128, so
      detect_ranks reads one pole; a forced two-pole fit fails (NaN) and is not certified.
    * 1e-10: detected as two poles; the two-pole fit is NOT certified (Krawczyk fails) although
      its balls happen to contain the truth.
    * 1e-6: certified.

    Asserted: the honest property (certified implies containment), and the rank above/below
    the resolution 2^-(bits/4) ~ 1e-19 in the pole gap.
    """
    ks = np.arange(5)
    with mpmath.workprec(512):
        m = [mpmath.mpf(0.25), mpmath.mpf(0.25) + mpmath.mpf(gap)]
    l = [1.0, -0.5]
    with working_precision(BITS):
        samples = np.array([enclosing_balls(true_values(0.25, m, l, ks))], dtype=object)
        ranks, _ = ka.detect_ranks(samples, ks, 2)
        fits = ka.fit(samples, ks, 2)
        assert ranks[0] == (1 if gap < 1e-19 else 2)
        if fits.certified[0]:
            assert all(ball.contains(mpf_to_arb(t)) for ball, t in zip(fits.log_poles[0], m))
            assert all(ball.contains(exact(t)) for ball, t in zip(fits.labels[0], l))
        if gap >= 1e-6:
            assert fits.certified[0]  # well resolved at 256 bits: cond(J)^2 * 2^-256 << 1
