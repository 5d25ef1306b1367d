"""Issue 12: the certificate repair of the biased grid (docs/algorithm.md, 'Certificate repair: failed instances
measured again with their poles pulled apart').

Targets are drawn here and given, for one instance of the schedule's layout, two heads whose
log-poles differ by rounding only (the Krawczyk test fails there, 'Kernels in ball arithmetic and certification'). The
oracle is the mpmath one of test_biased_grid (it counts every query on its side of the boundary); the truth the balls
must contain is the target's weights. Without the repair (``repair=False``: the code before 'Certificate repair: failed
instances measured again with their poles pulled apart') the same run is uncertified.
"""

import flint
import numpy as np
import pytest

import mhaextract as mx
from mhaextract.attention.biased_grid import BiasedGridSchedule
from mhaextract.attention.paper import PaperSchedule

from conftest import paper_count, run_settings
from mhaextract.checks.verify import VERIFY_QUERIES
from test_biased_grid import BITS, MpmathOracle, assert_balls_enclose, biased_count, draw, errors

D, H, SEED = 2, 2, 1
K = 2 * H + 1  # samples of a self-anchored instance: every asked repair instance costs K queries


def layout():
    """The instances the run will ask (same settings as :func:`extract_with`: the token scale given)."""
    return BiasedGridSchedule(run_settings(D, H, SEED, precision=BITS))


def close_heads(index):
    """A target whose heads 0 and 1 have (to rounding) equal log-poles at instance ``index``:
    ``u_1`` moves along that instance's difference z by the pole gap ``z^T (W_h x + u_h)``."""
    W, v, u, c = draw(D, H, SEED)
    instance = layout().instances[index]
    x, z = instance.final, instance.difference
    gap = z @ (W[1] @ x + u[1]) - z @ (W[0] @ x + u[0])
    u = u.copy()
    u[1] -= gap * z / (z @ z)
    return W, v, u, c


def extract_with(truth, repair=None):
    oracle = MpmathOracle(*truth)
    result = mx.extract(oracle, D, heads=H, precision=BITS, seed=SEED, token_scale=D**0.25, on_failure="warn",
                        repair=repair)
    return result, oracle


def index_of(role, i, j):
    schedule = layout()
    return {"grid": schedule.grid_index[i, j], "column_link": schedule.column_link_index[i, j],
            "row_link": schedule.row_link_index[j]}[role]


# role, i, j of the instance with close poles, and the queries its repair asks:
# row 0 (and row links) have no certified partner yet: partner and mix are asked (2K);
# a column link's partner is grid (0, j), its mix is asked (K); grid (1, j)'s mix with grid (0, j)
# is column link (1, j), already asked (0).
CASES = [("grid", 0, 1, 2 * K), ("row_link", 0, 1, 2 * K), ("column_link", 1, 0, K), ("grid", 1, 1, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("role, i, j, extra", CASES)
def test_a_failed_instance_is_repaired_with_counted_queries_and_balls_that_hold_the_truth(
        role, i, j, extra):
    truth = close_heads(index_of(role, i, j))
    before, _ = extract_with(truth, repair=False)
    diag = before.details.instances
    assert not before.certified
    assert np.flatnonzero(~diag.certified).tolist() == [index_of(role, i, j)]

    result, oracle = extract_with(truth)
    assert result.ok and result.certified and result.heads == H
    # Counted on the oracle's side: the schedule's formula plus the repair's queries.
    assert oracle.count == result.queries == biased_count(D, H) + extra + VERIFY_QUERIES
    assert result.details.repair_queries == extra == result.details.summary()["repair_queries"]
    assert result.details.repairs == [line for line in result.details.repairs if f"{role} ({i}, {j}): repaired" in line]
    assert len(result.details.repairs) == 1
    found, order = errors(result, *truth)
    assert max(found.values()) <= 1e-40, found
    assert_balls_enclose(result, order, *truth)


@pytest.mark.slow
def test_a_column_where_two_heads_coincide_stays_uncertified_and_says_why():
    """Heads 0 and 1 with ``z_0^T W_h`` and ``z_0^T u_h`` equal (to rounding): every instance of
    column 0 has a double pole, no partner or mix can separate them; the run stays uncertified
    and each failed instance is listed with its reason."""
    W, v, u, c = draw(D, H, SEED)
    z = layout().Z[:, 0]
    projector = np.eye(D) - np.outer(z, z) / (z @ z)
    W = W.copy()
    u = u.copy()
    W[1] = W[0] + projector @ (W[1] - W[0])
    u[1] = u[0] + projector @ (u[1] - u[0])
    result, oracle = extract_with((W, v, u, c))
    assert not result.certified
    lines = result.details.summary()["unrepaired_instances"]
    assert lines and all("not repaired" in line for line in lines)
    assert any("did not certify" in line for line in lines), lines
    assert oracle.count == result.queries == biased_count(D, H) + result.details.repair_queries + VERIFY_QUERIES
    assert result.details.repair_queries > 0


def test_the_paper_schedule_keeps_its_exact_count_unless_asked_to_repair():
    """``schedule="paper"`` (bias-free, docs/algorithm.md, 'The paper schedule') does not repair by default: a failed
    instance leaves the run uncertified and the count is the paper's, measured at the oracle. ``repair=True``
    repairs it (grid (1, 1): its mix with grid (0, 1) is asked, K queries; the bias-free column
    link (1, 1) has final token ``x_0 + x_1``, not the mix)."""
    schedule = PaperSchedule(run_settings(D, H, SEED, precision=BITS))
    failed = schedule.grid_index[1, 1]
    instance = schedule.instances[failed]
    x, z = instance.final, instance.difference
    W, v, _, _ = draw(D, H, SEED, bias=False)
    W = W.copy()
    W[1] -= (z @ (W[1] - W[0]) @ x) * np.outer(z, x) / ((z @ z) * (x @ x))
    truth = (W, v, np.zeros((H, D)), 0.0)
    results = {}
    for repair in (None, True):
        oracle = MpmathOracle(*truth)
        results[repair] = mx.extract(oracle, D, heads=H, precision=BITS, seed=SEED, schedule="paper",
                                     on_failure="warn", repair=repair), oracle.count
    plain, count = results[None]
    assert not plain.certified and not plain.details.instances.certified[failed]
    assert count == plain.queries == paper_count(D, H)
    assert plain.details.repair_queries == 0 and plain.details.repairs == []
    repaired, count = results[True]
    assert repaired.ok and repaired.certified
    assert count == repaired.queries == paper_count(D, H) + K == paper_count(D, H) + repaired.details.repair_queries
    assert repaired.details.repairs == [f"grid (1, 1): repaired (partner grid (0, 1), mix asked, {K} queries)"]
    found, order = errors(repaired, *truth)
    assert max(found.values()) <= 1e-40, found
    for balls, exact in ((repaired.W_balls, W), (repaired.v_balls, v)):  # bias-free: no u or c balls
        for ball, value in zip(np.ravel(balls[order]), np.ravel(exact)):
            assert ball.contains(flint.arb(float(value))), (ball, value)


def test_repair_is_a_high_precision_option_of_the_grid():
    with pytest.raises(ValueError, match="high-precision"):
        mx.extract(MpmathOracle(*draw(D, H, SEED)), D, heads=H, repair=True)
    with pytest.raises(ValueError, match="repair"):
        mx.extract(MpmathOracle(*draw(D, H, SEED)), D, heads=H, precision=BITS, schedule="lean", repair=True)


class CountingOracle:
    """The target at 256 bits (the library's ball evaluation), counting every query it answers."""

    def __init__(self, target):
        self.oracle = mx.SimulatedOracle(target, precision=BITS)
        self.count = 0

    def __call__(self, batch):
        self.count += len(batch)
        return self.oracle(batch)


@pytest.mark.slow
def test_a_drawn_target_whose_column_link_failed_is_certified():
    """d = H = 8, ``MultiHeadAttention.random(8, 8, seed=2)``, extraction seed 1002 (the precision
    benchmark's convention), defaults: column link (3, 1) fails the Krawczyk test (without docs/algorithm.md,
    'Certificate repair: failed instances measured again with their poles pulled apart' the run is uncertified); its
    repair asks one mix instance, K = 17 queries (~1 minute)."""
    d, H = 8, 8
    target = mx.MultiHeadAttention.random(d, H, seed=2)
    oracle = CountingOracle(target)
    result = mx.extract(oracle, d, heads=H, precision=BITS, seed=1002)
    assert result.ok and result.certified
    [line] = result.details.repairs  # the partner: the column's instance whose mix separates the poles most
    assert line.startswith("column_link (3, 1): repaired (partner grid (") and line.endswith("mix asked, 17 queries)")
    assert oracle.count == result.queries == biased_count(d, H) + result.calibration_queries + 17 + VERIFY_QUERIES
    zeros = np.zeros((H, d))
    found, order = errors(result, target.W, target.v, zeros, 0.0)
    assert max(found.values()) <= 1e-40, found
    assert_balls_enclose(result, order, target.W, target.v, zeros, 0.0)
