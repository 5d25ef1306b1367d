"""Combining redundant per-instance measurements into M and the labels (docs/algorithm.md, 'Assembly').

``combine_poles`` / ``combine_labels`` (mhaextract.numerics.assembly, float64 assembly); they
are tested here through their current names. Per-instance values are built in the test from a
known model, following the schedule's index conventions (mhaextract.attention.paper, 0-based):

* grid (i, j): pole M[j, i], label l[j];
* row link j: pole M[0, 0] + M[j, 0] (labels l[0] + l[j], not combined);
* column link (i, j): pole M[j, 0] + M[j, i], label l[j].
"""

import numpy as np
import pytest

from conftest import run_settings
from mhaextract.numerics.assembly import combine_labels, combine_poles
from mhaextract.attention.paper import PaperSchedule

D, H = 3, 2


@pytest.fixture
def setup():
    schedule = PaperSchedule(run_settings(D, H, seed=0))
    rng = np.random.default_rng(1)
    M = rng.uniform(-1.5, 1.5, (H, D, D))
    labels = rng.uniform(-2.0, 2.0, (H, D))  # l_h[j] = v_h^T z_j
    n = len(schedule.instances)
    m = np.empty((n, H))
    l = np.full((n, H), np.nan)
    for index, instance in enumerate(schedule.instances):
        i, j = instance.i, instance.j
        if instance.role == "grid":
            m[index] = M[:, j, i]
            l[index] = labels[:, j]
        elif instance.role == "row_link":
            m[index] = M[:, 0, 0] + M[:, j, 0]
            l[index] = labels[:, 0] + labels[:, j]
        else:
            m[index] = M[:, j, 0] + M[:, j, i]
            l[index] = labels[:, j]
    return schedule, M, labels, m, l


def index_of(schedule, role, i, j):
    return {"grid": schedule.grid_index[i, j], "row_link": schedule.row_link_index[j],
            "column_link": schedule.column_link_index[i, j]}[role]


def test_instance_count_and_roles(setup):
    schedule, *_ = setup
    roles = [instance.role for instance in schedule.instances]
    assert roles.count("grid") == D * D and roles.count("row_link") == D - 1
    assert roles.count("column_link") == D * (D - 1)


def test_equal_sigmas_reproduce_exact_data(setup):
    schedule, M, labels, m, l = setup
    sigma = np.ones_like(m)
    M_found, M_std = combine_poles(schedule, m, sigma)
    # Exact data: a consistent linear system; measured errors 4.4e-16 (M), 1.1e-16 (labels).
    assert np.abs(M_found - M).max() <= 1e-13
    l_found, l_std = combine_labels(schedule, l, sigma)
    assert np.abs(l_found - labels).max() <= 1e-13
    # Standard deviations with unit variances, along the tree (computed by hand):
    # M[0,0]: 1; M[j,0] (row link j on M[0,0]): direct 1 and linked 1 + 1 -> 1/(1 + 1/2) = 2/3;
    # M[0,i] (column link (i,0) on M[0,0]): also 2/3;
    # M[j,i], j >= 1 (column link (i,j) on M[j,0]): direct 1 and linked 1 + 2/3 -> 1/(1 + 3/5) = 5/8.
    # Labels: d grid instances and d - 1 column links per column, 2d - 1 = 5 measurements.
    expected = np.full((D, D), 5 / 8)
    expected[:, 0] = expected[0, :] = 2 / 3
    expected[0, 0] = 1.0
    assert np.allclose(M_std, np.sqrt(expected)[None], rtol=1e-12, atol=0)
    assert np.allclose(l_std, 1 / np.sqrt(2 * D - 1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("role, i, j", [("grid", 1, 2), ("grid", 0, 1), ("column_link", 2, 1), ("row_link", 0, 2)])
def test_a_bad_instance_with_large_sigma_is_outvoted(setup, role, i, j):
    schedule, M, labels, m, l = setup
    bad = index_of(schedule, role, i, j)
    m = m.copy()
    m[bad] += np.array([0.7, -0.4])  # a gross error in both heads
    sigma = np.ones_like(m)
    # Equal weights: the error leaks into M (this is what the sigma is for).
    leaked, _ = combine_poles(schedule, m, sigma)
    assert np.abs(leaked - M).max() > 1e-2
    # Large sigma (weight 1e-16 relative): the twin measurement decides. Leak ~0.7e-16 plus
    # rounding; measured <= 4.4e-16 (0.19 .. 0.41 with equal sigmas).
    sigma[bad] = 1e8
    M_found, _ = combine_poles(schedule, m, sigma)
    assert np.abs(M_found - M).max() <= 1e-12


def test_a_failed_instance_gets_no_weight(setup):
    schedule, M, labels, m, l = setup
    bad = schedule.grid_index[2, 1]
    m = m.copy()
    m[bad] = np.nan
    sigma = np.ones_like(m)
    sigma[bad] = np.inf  # how a failed fit reports itself
    with np.errstate(divide="ignore"):
        M_found, _ = combine_poles(schedule, m, sigma)
    assert np.abs(M_found - M).max() <= 1e-12


def test_labels_are_combined_over_the_column_and_outvote_a_bad_instance(setup):
    schedule, M, labels, m, l = setup
    bad = schedule.grid_index[1, 2]
    l = l.copy()
    l[bad] += 0.9
    sigma = np.ones_like(l)
    leaked, _ = combine_labels(schedule, l, sigma)
    # Equal weights: column 2 mean moves by 0.9 / 5 = 0.18.
    assert np.abs(leaked[:, 2] - labels[:, 2]) == pytest.approx([0.18, 0.18], rel=1e-9)
    assert np.abs(np.delete(leaked, 2, axis=1) - np.delete(labels, 2, axis=1)).max() <= 1e-13
    sigma[bad] = 1e8
    l_found, _ = combine_labels(schedule, l, sigma)
    # Leak 0.9e-16 / 4 plus rounding; measured 1.1e-16.
    assert np.abs(l_found - labels).max() <= 1e-12
