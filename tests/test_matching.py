"""Unit tests of head matching (mhaextract.matching) on constructed pole and label sets.

Convention checked: ``permutation[h] = g`` means head h of instance a is head g of instance b.
The true permutation is drawn by hypothesis (seeded, derandomized), b's heads are stored in
that permuted order, and link poles are listed in a further shuffled order.

Thresholds the learner applies to ``ambiguity`` (CheckPolicy in learner.py): 0.5 in float64,
0.1 in high precision, and ``label_ambiguity`` 0.01 for lean label matches. A clear match must
sit below all of them; nearly indistinguishable heads must rise above all of them.
"""

import numpy as np
import pytest
from flint import arb
from hypothesis import given, settings
from hypothesis import strategies as st

from mhaextract.numerics.highprec import working_precision
from mhaextract.attention.matching import Side, match_labels, match_links

FLOAT64_AMBIGUITY, HIGHPREC_AMBIGUITY, LABEL_AMBIGUITY = 0.5, 0.1, 0.01
SIGMA = 1e-9  # first-order sensitivity given to every pole and label


def separated(rng, H, low=-1.5, high=1.5, gap=0.2):
    while True:
        values = rng.uniform(low, high, H)
        if H == 1 or np.diff(np.sort(values)).min() > gap:
            return values


def side(m, l, sigma=SIGMA):
    m, l = np.atleast_2d(m), np.atleast_2d(l)
    return Side(m, l, np.full(m.shape, sigma), np.full(l.shape, sigma))


def linked_instances(rng, H, permutation, row_link, noise=0.0):
    """(a, b, link) Sides for one link; b's head permutation[h] is a's head h."""
    m_a, l_a = separated(rng, H), separated(rng, H, 0.2, 2.0)
    m_b_true, l_b_true = separated(rng, H), (separated(rng, H, 0.2, 2.0) if row_link else l_a)
    m_b, l_b = np.empty(H), np.empty(H)
    m_b[permutation], l_b[permutation] = m_b_true, l_b_true
    link_m = m_a + m_b_true + noise * rng.standard_normal(H)
    link_l = (l_a + l_b_true if row_link else l_b_true) + noise * rng.standard_normal(H)
    shuffle = rng.permutation(H)
    return side(m_a, l_a), side(m_b, l_b), side(link_m[shuffle], link_l[shuffle]), shuffle


@given(permutation=st.integers(1, 4).flatmap(lambda H: st.permutations(range(H))),
       seed=st.integers(0, 2**32 - 1), row_link=st.booleans())
@settings(derandomize=True, max_examples=60, deadline=None)
def test_links_recover_the_true_permutation(permutation, seed, row_link):
    H = len(permutation)
    rng = np.random.default_rng(seed)
    permutation = np.array(permutation)
    # Noise of 0.1 sigma: what a correct fit leaves; the chi-square of the right match is O(0.01).
    a, b, link, shuffle = linked_instances(rng, H, permutation, row_link, noise=0.1 * SIGMA)
    result = match_links(a, b, link, labels_add=row_link)
    assert np.array_equal(result.permutation[0], permutation)
    # Head h is link pole p with shuffle[p] = h.
    assert np.array_equal(shuffle[result.link_heads[0]], np.arange(H))
    assert result.bijective[0]
    # Pole residual: the noise, about 0.1 sigma per pole (|N(0,1)| < 5 with a wide margin).
    assert result.pole_residual[0] <= 5 * 0.1 * SIGMA
    # Measured ambiguity <= 2.2e-9 over these examples (competitors are >= 0.2 / sigma away);
    # 1e-3 is far below every threshold of the learner.
    assert result.ambiguity[0] < 1e-3 if H > 1 else result.ambiguity[0] == 0


@pytest.mark.parametrize("row_link", [True, False])
def test_nearly_indistinguishable_heads_are_ambiguous(row_link):
    """Heads 0 and 1 of b differ by 0.05 sigma in pole and label, below the 0.5 sigma noise: the
    match is a coin toss and ambiguity must say so (above every learner threshold)."""
    rng = np.random.default_rng(4)
    H = 3
    permutation = np.array([2, 0, 1])
    a, b, link, _ = linked_instances(rng, H, permutation, row_link, noise=0.5 * SIGMA)
    # Make b's heads perm[0] and perm[1] nearly equal, and the link consistent with that up to noise.
    g0, g1 = permutation[0], permutation[1]
    b.m[0, g1] = b.m[0, g0] + 0.05 * SIGMA
    b.l[0, g1] = b.l[0, g0] + 0.05 * SIGMA
    if not row_link:  # labels equal along a column: a's labels follow b's
        a.l[0, 1] = b.l[0, g1]
    m_link = a.m[0] + b.m[0, permutation] + 0.5 * SIGMA * rng.standard_normal(H)
    l_link = (a.l[0] + b.l[0, permutation] if row_link else b.l[0, permutation]) + 0.5 * SIGMA * rng.standard_normal(H)
    link = side(m_link, l_link)
    result = match_links(a, b, link, labels_add=row_link)
    # Measured 1.18 (row link) and 3.2 (column link).
    assert result.ambiguity[0] > FLOAT64_AMBIGUITY  # hence also above 0.1 (high precision)
    # And the same construction with the two heads 100 sigma apart is clear.
    b.m[0, g1] = b.m[0, g0] + 100 * SIGMA
    b.l[0, g1] = b.l[0, g0] + 100 * SIGMA
    if not row_link:
        a.l[0, 1] = b.l[0, g1]
    link = side(a.m[0] + b.m[0, permutation], a.l[0] + b.l[0, permutation] if row_link else b.l[0, permutation])
    clear = match_links(a, b, link, labels_add=row_link)
    assert np.array_equal(clear.permutation[0], permutation)
    assert clear.ambiguity[0] < LABEL_AMBIGUITY  # measured 5e-11


def test_a_link_with_coincident_poles_loses_its_own_match_not_b_order():
    """A column link whose two poles coincide (m_a + m_b equal for both heads; at d = 128 a paper
    grid of 32k instances has such a link: pole gap 1e-4, condition 1.5e16) gives one pole to both
    heads, but b's order is decided by a's and b's labels: ``order_ambiguity`` stays certain while
    ``ambiguity`` and ``bijective`` say the link itself is unusable."""
    a = side([0.1, 0.5], [1.0, -2.0])
    b = side([0.2, 0.6], [-2.0, 1.0])  # b's head 1 is a's head 0: m 0.1 + 0.6 = 0.5 + 0.2
    # The link's residues at a double pole are undetermined: huge label sensitivities.
    # Its poles: 0.7 each, measured 0.3 and 0.2 sigma off.
    link = Side(np.array([[0.7 + 0.3 * SIGMA, 0.7 - 0.2 * SIGMA]]), np.array([[5.0, 7.0]]), np.full((1, 2), SIGMA),
                np.full((1, 2), 1e6))
    result = match_links(a, b, link, labels_add=False)
    assert list(result.permutation[0]) == [1, 0]
    assert not result.bijective[0]
    assert result.ambiguity[0] > FLOAT64_AMBIGUITY
    assert result.order_ambiguity[0] < 1e-3
    # b's heads alike in pole and label (0.1 sigma apart): nothing decides its order.
    b_alike = side([0.35, 0.35 + 0.1 * SIGMA], [1.0, 1.0 + 0.1 * SIGMA])
    a_alike = side([0.35, 0.35 + 0.1 * SIGMA], [1.0, 1.0 + 0.1 * SIGMA])
    undecided = match_links(a_alike, b_alike, link, labels_add=False)
    assert undecided.order_ambiguity[0] > FLOAT64_AMBIGUITY


def test_a_batch_of_links_is_matched_row_by_row():
    rng = np.random.default_rng(9)
    permutations = [np.array(p) for p in ([0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1])]
    parts = [linked_instances(rng, 3, p, True) for p in permutations]
    stack = lambda which: Side(*(np.vstack([getattr(part[which], f) for part in parts]) for f in ("m", "l", "s_m", "s_l")))
    result = match_links(stack(0), stack(1), stack(2), labels_add=True)
    assert [list(p) for p in result.permutation] == [list(p) for p in permutations]
    assert result.bijective.all()


def test_links_in_balls_high_precision():
    """High-precision path: poles and labels as arb balls, sensitivities their radii."""
    rng = np.random.default_rng(12)
    H, permutation = 3, np.array([1, 2, 0])
    a, b, link, _ = linked_instances(rng, H, permutation, True)
    with working_precision(256):
        to_balls = lambda values: np.array([[arb(float(x)) for x in row] for row in values], dtype=object)
        balls = [Side(to_balls(s.m), to_balls(s.l), np.full((1, H), 1e-60), np.full((1, H), 1e-60))
                 for s in (a, b, link)]
        # float64 link values: the sums are off by float64 rounding, ~1e-16 = 1e44 sigma: still
        # the chosen match costs far less than any competitor (0.2 apart).
        result = match_links(*balls, labels_add=True)
    assert np.array_equal(result.permutation[0], permutation)
    # Measured 3.5e-16 (rounding 1e-16 against gaps >= 0.2).
    assert result.ambiguity[0] < HIGHPREC_AMBIGUITY


@given(permutation=st.integers(2, 4).flatmap(lambda H: st.permutations(range(H))), seed=st.integers(0, 2**32 - 1))
@settings(derandomize=True, max_examples=40, deadline=None)
def test_labels_match_heads_of_a_column(permutation, seed):
    H = len(permutation)
    rng = np.random.default_rng(seed)
    permutation = np.array(permutation)
    l_a = separated(rng, H, -2.0, 2.0, gap=0.1)
    l_b = np.empty(H)
    l_b[permutation] = l_a + 0.1 * SIGMA * rng.standard_normal(H)
    a, b = side(rng.uniform(-1, 1, H), l_a), side(rng.uniform(-1, 1, H), l_b)
    result = match_labels(a, b)
    assert np.array_equal(result.permutation[0], permutation)
    # Chosen cost ~ (0.1 sigma)^2 / 2 sigma^2, competitors >= (0.1 / sigma)^2 / 2: measured
    # ambiguity <= 1.7e-9.
    assert result.ambiguity[0] < 1e-3


def test_equal_labels_call_for_a_link():
    """a's heads 0 and 1 carry labels 0.01 sigma apart, under a label noise of 0.02 sigma: the
    label match cannot tell them apart, and must report an ambiguity above the lean threshold."""
    rng = np.random.default_rng(13)
    l_a = np.array([0.7, 0.7 + 0.01 * SIGMA, 1.1])
    noise = np.array([0.02, -0.015, 0.01]) * SIGMA
    permutation = np.array([0, 2, 1])
    l_b = np.empty(3)
    l_b[permutation] = l_a + noise
    m_a, m_b = rng.uniform(-1, 1, 3), rng.uniform(-1, 1, 3)
    result = match_labels(side(m_a, l_a), side(m_b, l_b))
    assert result.ambiguity[0] > LABEL_AMBIGUITY  # measured 0.67
    # The same noise on well-separated labels: certain, and the right permutation.
    l_a[1] = -0.3
    l_b[permutation] = l_a + noise
    clear = match_labels(side(m_a, l_a), side(m_b, l_b))
    assert np.array_equal(clear.permutation[0], permutation)
    assert clear.ambiguity[0] < LABEL_AMBIGUITY  # measured 5e-11


@pytest.mark.parametrize("r", [2, 3, 4, 5])
def test_all_rows_at_once_assign_what_linear_sum_assignment_assigns_row_by_row(r):
    """The batched assignment (every permutation summed, up to 4 heads; ties and infinite costs
    handed to scipy) against scipy's per-row solution, on random costs with ties and infinities."""
    from scipy.optimize import linear_sum_assignment

    from mhaextract.attention.matching import _assign

    rng = np.random.default_rng(r)
    cost = rng.exponential(size=(400, r, r)) * 10.0 ** rng.integers(-12, 12, size=(400, 1, 1))
    cost[100:200] = np.round(cost[100:200] * 2) / 2  # exact ties between permutations
    cost[200:300][rng.random((100, r, r)) < 0.3] = np.inf
    cost[300:310] = 0.0
    expected = np.array([linear_sum_assignment(np.minimum(row, 1e300))[1] for row in cost])
    assert np.array_equal(_assign(cost), expected)
