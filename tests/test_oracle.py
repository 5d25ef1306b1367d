"""The oracle boundary: counting, validation, user callables, clear errors."""

import mpmath
import numpy as np
import pytest

import mhaextract as mx

from conftest import CountingOracle


def test_a_plain_function_is_an_oracle_in_float64():
    target = mx.MultiHeadAttention.random(3, 2, seed=0)
    seen = []

    def oracle(batch):
        seen.extend(batch)
        assert all(isinstance(X, np.ndarray) and X.dtype == np.float64 for X in batch)
        return [float(value) for value in target(batch)]

    result = mx.extract(oracle, 3, heads=2, seed=1, schedule="paper")
    assert result.queries == len(seen) == 4 * 2 * 9 - 4 + 1
    assert mx.compare(result.model, target).max_rel < 1e-8


def test_a_plain_function_is_an_oracle_in_high_precision_with_decimal_strings():
    target = mx.MultiHeadAttention.random(2, 2, seed=5)

    def oracle(batch):
        assert all(X.dtype == object and isinstance(X[0, 0], mpmath.mpf) for X in batch)
        return [mpmath.nstr(value, 90) for value in target(batch, precision=300)]

    result = mx.extract(oracle, 2, heads=2, precision=256, seed=1, schedule="paper")
    assert float(mx.compare(result.model_hp, target).max_rel) < 1e-40


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_answers_name_the_query(bad):
    target = mx.MultiHeadAttention.random(2, 1, seed=0)

    def oracle(batch):
        out = list(target(batch))
        out[3] = bad
        return out

    with pytest.raises(mx.OracleError, match="query 3") as info:
        mx.extract(oracle, 2, heads=1, seed=0, schedule="paper")
    assert info.value.query == 3
    assert info.value.sequence is not None


def test_missing_answers_are_refused():
    def oracle(batch):
        return [0.0] * (len(batch) - 1)

    with pytest.raises(mx.OracleError, match="missing"):
        mx.extract(oracle, 2, heads=1, schedule="paper")


def test_float_answers_are_refused_in_high_precision():
    target = mx.MultiHeadAttention.random(2, 1, seed=0)

    def oracle(batch):
        return [float(value) for value in target(batch, precision=128)]

    with pytest.raises(mx.OracleError, match="53 bits"):
        mx.extract(oracle, 2, heads=1, precision=128, schedule="paper")


def test_an_exception_inside_the_oracle_propagates_with_the_query():
    class Broken(RuntimeError):
        pass

    def oracle(batch):
        raise Broken("remote oracle down")

    with pytest.raises(Broken, match="remote oracle down") as info:
        mx.extract(oracle, 2, heads=1, batch_size=1, schedule="paper")
    assert any("query 0" in note for note in info.value.__notes__)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d=0, heads=1), "d must be"),
        (dict(d=2.5, heads=1), "d must be"),
        (dict(d=True, heads=1), "d must be"),
        (dict(d=2), "exactly one"),
        (dict(d=2, heads=1, max_heads=2), "exactly one"),
        (dict(d=2, heads=0), "heads must be"),
        (dict(d=2, max_heads=-1), "max_heads must be"),
        (dict(d=2, heads=1, precision=16), "precision must be"),
        (dict(d=2, heads=1, on_failure="ignore"), "on_failure"),
        (dict(d=2, heads=1, token_scale=-1.0), "token_scale"),
        (dict(d=2, heads=1, seed=-1), "seed must be None or an integer >= 0"),
        (dict(d=2, heads=1, seed=1.5), "seed must be None or an integer >= 0"),
        (dict(d=2, heads=1, seed="7"), "seed must be None or an integer >= 0"),
        (dict(d=2, heads=1, seed=(1, 2)), "seed must be None or an integer >= 0"),
        (dict(d=2, heads=1, seed=np.random.default_rng(0)), "seed must be None or an integer >= 0"),
    ],
)
def test_invalid_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mx.extract(lambda batch: [0.0] * len(batch), **kwargs, schedule="paper")


def test_the_oracle_sees_exactly_the_counted_queries_and_the_same_seed_gives_the_same_queries():
    target = mx.MultiHeadAttention.random(3, 2, seed=0)
    transcripts = []
    for _ in range(2):
        asked = []

        def oracle(batch):
            asked.extend(np.array(X) for X in batch)
            return target(batch)

        result = mx.extract(oracle, 3, heads=2, seed=7, batch_size=13, schedule="paper")
        transcripts.append(asked)
        assert result.queries == len(asked)
        assert result.max_query_length == max(len(X) for X in asked)
    assert all(np.array_equal(a, b) for a, b in zip(*transcripts))


def test_copies_sequences_are_k_copies_of_x_minus_z_then_x_in_the_order_asked():
    from mhaextract.oracle.queries import copies_sequences

    rng = np.random.default_rng(3)
    finals, differences = rng.standard_normal((2, 4, 5))
    which, copies = np.array([2, 0, 2, 3, 1, 0]), np.array([0, 3, 2, 3, 1, 0])
    sequences = copies_sequences(finals, differences, which, copies)
    assert len(sequences) == len(copies)
    for sequence, n, k in zip(sequences, which, copies):
        y = finals[n] - differences[n]
        expected = np.array([list(y)] * k + [list(finals[n])])
        assert sequence.shape == (k + 1, 5) and np.array_equal(sequence, expected)
    sequences[1][0, 0] = 99.0  # one query's tokens are its own (views of disjoint rows)
    assert sequences[3][0, 0] != 99.0 and sequences[5][0, 0] == finals[0, 0]


def test_copies_queries_build_the_sequences_of_copies_sequences_bit_for_bit_on_demand():
    from mhaextract.oracle.queries import BUILD_CHUNK, CopiesQueries, copies_sequences

    rng = np.random.default_rng(5)
    d, n = 6, 40
    pool = rng.standard_normal((4, d))
    pool[1] = pool[0]
    pool[1, 2] = -0.0 if pool[0, 2] == 0.0 else pool[1, 2]
    pool[0, 3], pool[1, 3] = 0.0, -0.0  # equal values, different bytes: two final tokens, not one
    final_of = rng.integers(0, 4, n)
    difference_pool = rng.standard_normal((7, d))
    difference_of = rng.integers(0, 7, n)
    finals, differences = pool[final_of], difference_pool[difference_of]
    which = np.repeat(np.arange(n), 3)
    copies = np.tile([0, 2, 5], n)
    queries = CopiesQueries(pool, final_of, difference_pool, which, copies, difference_of)  # rows named, not copied
    expected = copies_sequences(finals, differences, which, copies)
    assert len(queries) == len(expected)
    same = lambda a, b: a.shape == b.shape and a.tobytes() == b.tobytes()  # signs of zeros included
    assert all(same(a, b) for a, b in zip(queries, expected)) and len(list(queries)) == len(expected)
    assert all(same(queries[i], expected[i]) for i in (0, 5, -1, len(expected) - 1))
    assert all(same(a, b) for a, b in zip(queries[7:100:3], expected[7:100:3]))
    with pytest.raises(IndexError):
        queries[len(expected)]
    queries[4][0, 0] = 99.0  # every access builds fresh arrays
    assert same(queries[4], expected[4])
    # Concatenation keeps one CopiesQueries (lean's fallback links); with a list it is a list.
    more = CopiesQueries(finals[:5], np.arange(5), differences[:5], np.arange(5), np.full(5, 1))
    joined = queries + more
    assert isinstance(joined, CopiesQueries)
    assert all(same(a, b) for a, b in zip(joined, expected + copies_sequences(finals[:5], differences[:5],
                                                                              np.arange(5), np.full(5, 1))))
    assert isinstance(queries + [np.ones((1, d))], list) and isinstance([np.ones((1, d))] + queries, list)
    assert BUILD_CHUNK < 10**5  # iteration holds a bounded number of queries at once


def test_round_queries_are_the_copies_instances_of_every_unit_round_by_round_built_on_demand():
    from mhaextract.oracle.queries import BUILD_CHUNK, RoundQueries, copies_sequences

    rng = np.random.default_rng(8)
    U, R, d = 7, 5, 4
    finals = rng.standard_normal((U, R + 2, d))[:, 1:R + 1]  # a strided view, as the targeted stages pass
    differences = rng.standard_normal((U, d))
    finals[2, 1, 3], differences[2, 3] = 0.0, 0.0  # y = 0 - 0 keeps its sign bits like copies_sequences'
    copies = [(1, 2, 3), (1,), (2, 4), (1, 2), (3,)]
    queries = RoundQueries(finals, differences, copies)
    # independently: round by round, k by k, unit by unit, as copies_sequences builds each one
    expected = [copies_sequences(finals[u:u + 1, n], differences[u:u + 1], [0], [k])[0]
                for n, ks in enumerate(copies) for k in ks for u in range(U)]
    same = lambda a, b: a.shape == b.shape and a.tobytes() == b.tobytes()  # noqa: E731
    assert len(queries) == len(expected) == U * 9
    assert all(same(a, b) for a, b in zip(queries, expected)) and len(list(queries)) == len(expected)
    for key in (slice(None), slice(3, 40), slice(5, 60, 4), slice(2, None, 13), slice(6, 7), slice(10, 10),
                slice(None, None, -5)):
        got = queries[key]
        assert len(got) == len(expected[key]) and all(same(a, b) for a, b in zip(got, expected[key])), key
    assert all(same(queries[i], expected[i]) for i in (0, 6, 7, -1, len(expected) - 1, -len(expected)))
    with pytest.raises(IndexError):
        queries[len(expected)]
    queries[9][0, 0] = 99.0  # every access builds fresh arrays: handed to the oracle without a copy
    assert same(queries[9], expected[9]) and queries.fresh_on_access
    assert BUILD_CHUNK < 10**5


def test_kept_queries_hold_round_rows_and_arrays_in_the_order_kept_and_evaluate_as_the_model():
    """The residual sample: every kept query is the one asked, bit for bit, in order (rows of two
    blocks of rounds around a list of other queries); its outputs are the model's on the sequences."""
    from mhaextract.oracle.queries import KeptQueries, RoundQueries

    rng = np.random.default_rng(12)
    U, d = 6, 5
    target = mx.MultiHeadAttention.random(d, 3, seed=12, bias=True)
    blocks = [RoundQueries(rng.standard_normal((U, 4, d))[:, 1:3] * 0.4, rng.standard_normal((U, d)) * 0.4,
                           [(1, 2, 3), (2,)]),
              [rng.standard_normal((n, d)) * 0.4 for n in (1, 3, 2, 4)],
              RoundQueries(rng.standard_normal((U, 1, d)) * 0.4, rng.standard_normal((U, d)) * 0.4, [(1, 5)])]
    kept, expected = KeptQueries(), []
    for block, positions in zip(blocks, [range(1, 24, 5), range(0, 4, 2), range(3, 12, 4)]):
        kept.keep(block, positions)
        expected += [np.array(block[p]) for p in positions]
    kept.keep(blocks[0], range(0))  # nothing kept
    same = lambda a, b: a.shape == b.shape and a.tobytes() == b.tobytes()  # noqa: E731
    assert len(kept) == len(expected) == 5 + 2 + 3
    assert all(same(a, b) for a, b in zip(kept, expected)) and len(list(kept)) == len(expected)
    assert all(same(a, b) for a, b in zip(kept[2:9:3], expected[2:9:3])) and same(kept[-1], expected[-1])
    with pytest.raises(IndexError):
        kept[len(expected)]
    kept.keep(blocks[1], range(3, 4))  # kept after a read: joined again
    expected.append(blocks[1][3])
    assert len(kept) == 11 and same(kept[10], expected[10]) and same(kept[4], expected[4])
    exact = np.array([float(value) for value in target(expected, precision=120)])
    assert np.abs(kept.outputs(target) - exact).max() <= 2e-15 * np.abs(exact).max()


def test_a_block_of_rounds_asked_at_once_measures_what_its_rounds_asked_one_by_one_do():
    from mhaextract.oracle.boundary import OracleBoundary
    from mhaextract.attention.targeted.prober import Prober

    d, U = 6, 9
    target = mx.MultiHeadAttention.random(d, 2, seed=3)
    rng = np.random.default_rng(3)
    finals = rng.standard_normal((U, 4, d)) * 0.3
    differences = rng.standard_normal((U, d)) * 0.3
    copies = [(1, 2, 3), (1, 2), (1,), (2, 3)]
    probers = []
    for _ in range(2):
        oracle = CountingOracle(target)
        prober = Prober(OracleBoundary(oracle, d, batch_size=16), d, 1.0, expected_queries=64)
        prober.learn_vbar(np.eye(d))
        probers.append((prober, oracle))
    (together, once), (apart, each) = probers
    calls = [0]
    inner = once.inner
    once.inner = lambda batch: (calls.__setitem__(0, calls[0] + 1), inner(batch))[1]
    asked = together.rounds_gaps(finals, differences, copies)
    for n, ks in enumerate(copies):
        gaps, rounding = apart.gaps(finals[:, n], differences, ks)
        assert asked[n][0].tobytes() == gaps.tobytes() and asked[n][1].tobytes() == rounding.tobytes()
    queries = U * 8
    assert once.count == each.count == d + queries and together.asked == apart.asked
    assert calls[0] == -(-queries // 16)  # one oracle call per boundary batch, not one per round and k
    # the same residual sample of queries and answers: every stride-th of the run
    assert [s.tobytes() for s in together.sequences] == [s.tobytes() for s in apart.sequences]
    assert together.answers == apart.answers and len(together.answers) == -(-(d + queries) // together.stride)


@pytest.mark.parametrize("d, H, bias", [(1, 1, False), (5, 2, True), (16, 3, False)])
def test_copies_queries_outputs_are_the_model_on_the_sequences(d, H, bias):
    """The O(H d) per instance evaluation against the model on the built sequences (to rounding)."""
    from mhaextract.oracle.queries import CopiesQueries

    target = mx.MultiHeadAttention.random(d, H, seed=d, bias=bias)
    rng = np.random.default_rng(d)
    n = 30
    pool, final_of = rng.standard_normal((3, d)) * d**0.25 / np.sqrt(d), rng.integers(0, 3, n)
    differences = rng.standard_normal((n, d)) * d**0.25 / np.sqrt(d)
    differences[0] = 0.0  # y = x: every token equal
    differences[1] = pool[final_of[1]] * 4  # scores of y far below or above x's
    queries = CopiesQueries(pool, final_of, differences, np.repeat(np.arange(n), 6), np.tile(np.arange(6), n))
    exact = np.array([float(value) for value in target(list(queries), precision=120)])
    scale = np.abs(exact).max()
    assert np.abs(queries.outputs(target) - exact).max() <= 1e-15 * scale  # as close as the model's own evaluation:
    assert np.abs(target(list(queries)) - exact).max() <= 2e-15 * scale
    # one final token per instance (a kept sample's rows)
    own = CopiesQueries(pool[final_of], np.arange(n), differences, np.repeat(np.arange(n), 6), np.tile(np.arange(6), n))
    assert np.abs(own.outputs(target) - exact).max() <= 1e-15 * scale


def test_an_instance_table_is_its_instances_as_arrays_and_asks_what_each_instance_asks():
    from mhaextract.oracle.queries import Instance, InstanceTable

    rng = np.random.default_rng(2)
    d = 3
    table = InstanceTable(d)
    records = []
    for role, count, ks in [("grid", 1, (0, 1, 2, 3)), ("row_link", 0, (1, 2)), ("grid", 4, (1, 2, 3)),
                            ("column_link", 2, (1, 2))]:
        finals, differences = rng.standard_normal((2, count, d))
        i, j = rng.integers(0, d, (2, count))
        assert list(table.add(role, i, j, finals, differences, ks)) == list(range(len(records), len(records) + count))
        records += [Instance(role, int(a), int(b), f, z, ks) for a, b, f, z in zip(i, j, finals, differences)]
    assert len(table) == len(records) == 7
    for got, want in zip(list(table), records):  # iteration and indexing give the same records
        assert (got.role, got.i, got.j, got.ks) == (want.role, want.i, want.j, want.ks)
        assert np.array_equal(got.final, want.final) and np.array_equal(got.difference, want.difference)
    assert table[-1].role == "column_link" and table[3].ks == (1, 2, 3)
    with pytest.raises(IndexError):
        table[7]
    # The arrays: dtype of the roles asked (no instance of an empty block), as np.array of the records' would be.
    assert table.role.dtype == np.array([r.role for r in records]).dtype
    assert list(table.role) == [r.role for r in records] and list(table.j) == [r.j for r in records]
    chosen = [6, 0, 3, 4]
    sequences, owners, copies = table.queries(chosen)
    expected_copies = [k for n in chosen for k in records[n].ks]
    assert list(copies) == expected_copies and list(owners) == [n for n in chosen for _ in records[n].ks]
    expected = [records[n].sequence(k) for n, k in zip(owners, copies)]
    assert len(sequences) == len(expected) and all(np.array_equal(a, b) for a, b in zip(sequences, expected))
    empty, no_owners, no_copies = table.queries([])
    assert len(empty) == len(no_owners) == len(no_copies) == 0


class RowsTaking:
    """An oracle that takes copies-instances as their rows (as TorchOracle does): it answers the
    sequences it builds from what it is handed, and records what that was."""

    takes_copies_rows = True

    def __init__(self, target):
        self.target, self.kinds, self.asked = target, set(), []

    def __call__(self, batch):
        self.kinds.add(type(batch).__name__)
        sequences = list(batch)
        self.asked.extend(np.array(X) for X in sequences)
        return self.target(sequences)


def test_copies_instances_go_as_rows_to_an_oracle_that_takes_them_and_are_the_same_queries(tmp_path):
    """The targeted schedule's queries reach an oracle with ``takes_copies_rows`` as CopiesRows (no
    sequence built by the boundary) and any other oracle as sequences: the same queries in the same
    order, the same counts and longest query, the same model to the bit; the transcript holds them
    as asked, and a resumed run replays every answer."""
    target = mx.MultiHeadAttention.random(8, 2, seed=0)
    plain_asked = []

    def plain(batch):
        plain_asked.extend(np.array(X) for X in batch)
        return target(batch)

    run = dict(heads=2, seed=3, schedule="targeted", batch_size=64, progress=False)
    expected = mx.extract(plain, 8, **run)
    rows = RowsTaking(target)
    result = mx.extract(rows, 8, transcript=tmp_path / "rows.sqlite", **run)
    assert "CopiesRows" in rows.kinds and "CopiesBatch" not in rows.kinds
    assert len(rows.asked) == len(plain_asked) == result.queries == expected.queries
    assert all(np.array_equal(a, b) for a, b in zip(rows.asked, plain_asked))
    assert result.max_query_length == expected.max_query_length == max(map(len, rows.asked))
    np.testing.assert_array_equal(result.model.W, expected.model.W)
    np.testing.assert_array_equal(result.model.v, expected.model.v)
    again = RowsTaking(target)
    replay = mx.extract(again, 8, transcript=tmp_path / "rows.sqlite", resume_check=0, **run)
    assert not again.asked and replay.queries_replayed == result.queries
    np.testing.assert_array_equal(replay.model.W, result.model.W)
