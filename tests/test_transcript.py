"""Runs that lose nothing: SQLite transcripts, resumption, budgets, refusal of foreign transcripts."""

import hashlib
import sqlite3

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhaextract as mx
from mhaextract.numerics.highprec import mpf_from_hex, mpf_to_hex
from mhaextract.oracle.transcript import CALIBRATION, Transcript, TranscriptError

from conftest import paper_count


class Interrupted(RuntimeError):
    pass


class FlakyOracle:
    """Answers a simulated target, logging every sequence it answered; after ``fail_after``
    answers it raises instead of answering (a remote oracle going down)."""

    def __init__(self, target, precision=None, fail_after=None):
        self.inner = mx.SimulatedOracle(target, precision)
        self.fail_after = fail_after
        self.answered = []
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        if self.fail_after is not None and len(self.answered) + len(batch) > self.fail_after:
            raise Interrupted(f"oracle down after {len(self.answered)} answers")
        self.answered.extend(np.array(X, dtype=np.float64) for X in batch)
        return self.inner(batch)


def key(sequence):
    return hashlib.sha256(np.ascontiguousarray(sequence, dtype=np.float64).tobytes() + bytes(len(sequence))).hexdigest()


def file_digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_same_balls(a, b):
    assert a.shape == b.shape
    for x, y in zip(a.ravel(), b.ravel()):
        assert x.mid() == y.mid() and x.rad() == y.rad(), (x, y)


CASES = [
    # (d, H, precision, batch_size, fail_after): float64 and high precision, failures inside and
    # at the edge of a batch.
    (3, 2, None, 10, 37),
    (3, 2, None, 8, 40),
    (2, 2, 128, 4, 13),
]


@pytest.mark.parametrize("d, H, precision, batch_size, fail_after", CASES)
def test_an_interrupted_run_resumes_without_asking_twice_and_equals_an_uninterrupted_one(
        tmp_path, d, H, precision, batch_size, fail_after):
    target = mx.MultiHeadAttention.random(d, H, seed=3)
    path = tmp_path / "run.sqlite"
    # resume_check=0: this test counts every query exactly (the resume check's re-asks are tested apart)
    run = dict(heads=H, precision=precision, seed=11, batch_size=batch_size, transcript=path, resume_check=0)

    first = FlakyOracle(target, precision, fail_after=fail_after)
    with pytest.raises(Interrupted):
        mx.extract(first, d, **run, schedule="paper")
    committed = (fail_after // batch_size) * batch_size  # whole batches answered before the failure
    assert len(first.answered) == committed

    second = FlakyOracle(target, precision)
    resumed = mx.extract(second, d, **run, schedule="paper")

    # Exactly the paper's count of distinct queries over both runs, none answered twice.
    both = [key(X) for X in first.answered + second.answered]
    assert len(both) == paper_count(d, H)
    assert len(set(both)) == len(both)
    assert resumed.queries == paper_count(d, H)
    assert resumed.queries_asked == len(second.answered) == paper_count(d, H) - committed
    assert resumed.queries_replayed == committed
    assert resumed.max_query_length == 2 * H + 1

    plain = mx.extract(FlakyOracle(target, precision), d, heads=H, precision=precision, seed=11, schedule="paper")
    assert np.array_equal(resumed.model.W, plain.model.W) and np.array_equal(resumed.model.v, plain.model.v)
    assert resumed.error_estimate == plain.error_estimate
    assert resumed.answers_residual == plain.answers_residual
    if precision is not None:
        assert_same_balls(resumed.W_balls, plain.W_balls)
        assert_same_balls(resumed.v_balls, plain.v_balls)
        assert resumed.certified

    # A third run over the complete transcript asks nothing and returns the same result again.
    offline = mx.extract(FlakyOracle(target, precision, fail_after=0), d, **run, schedule="paper")
    assert (offline.queries_asked, offline.queries_replayed) == (0, paper_count(d, H))
    assert np.array_equal(offline.model.W, plain.model.W)


@pytest.mark.parametrize("fail_after", [30, 130])  # in the fixed queries / in the adaptive fallback links
def test_an_adaptive_lean_run_with_fallback_links_resumes_bit_for_bit(tmp_path, fail_after):
    rng = np.random.default_rng(3)
    W = rng.standard_normal((3, 4, 4)) / 2
    v = rng.standard_normal((3, 4))
    v[1] = v[0]  # equal residue labels: the lean schedule must ask fallback links, adaptively
    target = mx.MultiHeadAttention(W, v)
    run = dict(heads=3, seed=2, schedule="lean", batch_size=16, transcript=tmp_path / "lean.sqlite", resume_check=0)
    plain = mx.extract(FlakyOracle(target), 4, heads=3, seed=2, schedule="lean")
    fixed = plain.queries - plain.verification_queries - plain.details.fallback_links * (2 * 3 - 1)
    assert plain.details.fallback_links > 0 and fixed < 130 < plain.queries

    first = FlakyOracle(target, fail_after=fail_after)
    with pytest.raises(Interrupted):
        mx.extract(first, 4, **run)
    second = FlakyOracle(target)
    resumed = mx.extract(second, 4, **run)
    both = [key(X) for X in first.answered + second.answered]
    assert len(both) == len(set(both)) == plain.queries == resumed.queries
    assert resumed.details.fallback_links == plain.details.fallback_links
    assert np.array_equal(resumed.model.W, plain.model.W) and np.array_equal(resumed.model.v, plain.model.v)


def test_ctrl_c_keeps_every_committed_batch(tmp_path):
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    path = tmp_path / "run.sqlite"
    calls = []

    def oracle(batch):
        calls.append(len(batch))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return target(batch)

    with pytest.raises(KeyboardInterrupt):
        mx.extract(oracle, 2, heads=1, seed=1, batch_size=4, transcript=path, schedule="paper")
    resumed = mx.extract(FlakyOracle(target), 2, heads=1, seed=1, batch_size=4, transcript=path, schedule="paper")
    # + 3: the resume check re-asks three recorded queries (counted, not recorded)
    assert (resumed.queries_replayed, resumed.queries_asked) == (8, paper_count(2, 1) - 8 + 3)


def test_high_precision_answers_given_as_decimal_strings_round_trip_exactly(tmp_path):
    target = mx.MultiHeadAttention.random(2, 1, seed=4)
    path = tmp_path / "run.sqlite"

    def oracle(batch):
        return [mpmath.nstr(value, 80) for value in target(batch, precision=300)]

    asked = []

    def counting(batch):
        asked.append(len(batch))
        return oracle(batch)

    first = mx.extract(counting, 2, heads=1, precision=200, seed=2, transcript=path, schedule="paper")
    again = mx.extract(lambda batch: pytest.fail("asked again"), 2, heads=1, precision=200, seed=2, transcript=path,
                       resume_check=0, schedule="paper")
    assert sum(asked) == first.queries == again.queries_replayed == paper_count(2, 1)
    assert_same_balls(first.W_balls, again.W_balls)
    assert_same_balls(first.v_balls, again.v_balls)


# ---------------------------------------------------------------------- budgets

def test_a_budget_with_a_transcript_spends_it_saves_it_and_says_what_is_left(tmp_path):
    target = mx.MultiHeadAttention.random(3, 2, seed=0)
    path = tmp_path / "run.sqlite"
    oracle = FlakyOracle(target)
    with pytest.raises(mx.BudgetExceeded, match=r"still needs 39 more queries") as info:
        mx.extract(oracle, 3, heads=2, seed=5, transcript=path, max_queries=30, batch_size=7, schedule="paper")
    assert (info.value.needed, info.value.answered) == (39, 30)
    assert str(path) in str(info.value)
    assert len(oracle.answered) == 30
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT count(*) FROM queries").fetchone()[0] == 30

    # The next session has a budget of 39: exactly enough.
    rest = FlakyOracle(target)
    result = mx.extract(rest, 3, heads=2, seed=5, transcript=path, max_queries=39, resume_check=0, schedule="paper")
    assert len(rest.answered) == 39 and result.queries == paper_count(3, 2)
    assert mx.compare(result.model, target).max_rel < 1e-8


def test_a_budget_without_a_transcript_asks_nothing():
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    oracle = FlakyOracle(target)
    with pytest.raises(mx.BudgetExceeded, match=r"still needs 15 more queries.*nothing was asked") as info:
        mx.extract(oracle, 2, heads=1, max_queries=10, schedule="paper")
    assert oracle.calls == 0 and info.value.needed == 15


def test_max_queries_zero_replays_a_complete_transcript(tmp_path):
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    path = tmp_path / "run.sqlite"
    mx.extract(FlakyOracle(target), 2, heads=1, seed=1, transcript=path, schedule="paper")
    result = mx.extract(FlakyOracle(target, fail_after=0), 2, heads=1, seed=1, transcript=path, max_queries=0,
                        resume_check=0, schedule="paper")
    assert result.queries_asked == 0 and result.ok


@pytest.mark.parametrize("kwargs, message", [
    (dict(transcript="x.sqlite"), "integer seed"),
    (dict(transcript="x.sqlite", seed=True), "seed must be None or an integer >= 0"),
    (dict(max_queries=-1), "max_queries must be"),
    (dict(max_queries=2.5), "max_queries must be"),
])
def test_bad_transcript_and_budget_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mx.extract(lambda batch: [0.0] * len(batch), 2, heads=1, **kwargs, schedule="paper")


# ---------------------------------------------------------------------- refusal

@pytest.fixture
def recorded(tmp_path):
    """A complete float64 transcript of d=2, H=1, seed=1, and its digest."""
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    path = tmp_path / "run.sqlite"
    mx.extract(FlakyOracle(target), 2, heads=1, seed=1, transcript=path, schedule="paper")
    return target, path


@pytest.mark.parametrize("change, named", [
    (dict(d=3), "d: transcript 2, this run 3"),
    (dict(seed=2), "seed: transcript 1, this run 2"),
    (dict(heads=2), "max_heads: transcript 1, this run 2"),
    (dict(max_heads=1), None),  # a bound H0 = 1 asks the same queries as heads=1: accepted
    (dict(precision=128), "precision: transcript None, this run 128"),
    (dict(token_scale=1.5), "token_scale"),
])
def test_a_mismatched_transcript_is_refused_and_left_untouched(recorded, change, named):
    target, path = recorded
    before = file_digest(path)
    run = dict(heads=1, seed=1) | change
    if "max_heads" in change:
        del run["heads"]
    d = run.pop("d", 2)
    oracle = FlakyOracle(mx.MultiHeadAttention.random(d, 2, seed=0), run.get("precision"), fail_after=0)
    if named is None:
        # another oracle on purpose (it must not be asked): the fingerprint is under test, not the oracle
        assert mx.extract(oracle, d, transcript=path, resume_check=0, **run, schedule="paper").queries_replayed == \
            paper_count(2, 1)
    else:
        with pytest.raises(TranscriptError, match="recorded by a different run") as info:
            mx.extract(oracle, d, transcript=path, **run, schedule="paper")
        assert named in str(info.value) and "not modified" in str(info.value)
        assert oracle.calls == 0
    assert file_digest(path) == before


def test_another_schedule_is_refused(recorded):
    target, path = recorded
    before = file_digest(path)
    with pytest.raises(TranscriptError, match="schedule: transcript 'paper', this run 'lean'"):
        mx.extract(FlakyOracle(target, fail_after=0), 2, heads=1, seed=1, transcript=path, schedule="lean")
    assert file_digest(path) == before


def edit_answer(path):
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE queries SET answer = ? WHERE id = 3", ((0.25).hex(),))


def edit_fingerprint(path):
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE meta SET value = '{broken' WHERE key = 'fingerprint'")


def drop_meta(path):
    with sqlite3.connect(path) as connection:
        connection.execute("DROP TABLE meta")


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path):
    path.write_bytes(b"these are not the answers you are looking for" * 100)


def flip_page_bytes(path):
    data = bytearray(path.read_bytes())
    for offset in range(len(data) - 600, len(data) - 100):
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (edit_answer, "fails its checksum"),
    (edit_fingerprint, "no readable fingerprint"),
    (drop_meta, "not a mhaextract transcript"),
    (truncate, "damaged|not a readable SQLite|corrupt"),
    (garbage, "not a readable SQLite database"),
    (flip_page_bytes, "damaged|not a readable SQLite|corrupt"),
])
def test_a_corrupt_transcript_is_refused_and_left_untouched(recorded, damage, message):
    target, path = recorded
    damage(path)
    before = file_digest(path)
    oracle = FlakyOracle(target, fail_after=0)
    with pytest.raises(TranscriptError, match=message):
        mx.extract(oracle, 2, heads=1, seed=1, transcript=path, schedule="paper")
    assert oracle.calls == 0
    assert file_digest(path) == before


def test_an_empty_file_is_a_new_transcript(tmp_path):
    path = tmp_path / "run.sqlite"
    path.touch()
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    result = mx.extract(FlakyOracle(target), 2, heads=1, seed=1, transcript=path, schedule="paper")
    assert result.queries_asked == paper_count(2, 1) and result.transcript == str(path)


# ---------------------------------------------------------------------- exact answers

@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_float_answers_are_stored_exactly(value):
    assert float.fromhex(float(value).hex()) == value
    assert mpf_from_hex(mpf_to_hex(mpmath.mpf(value))) == mpmath.mpf(value)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.integers(min_value=-(2**400), max_value=2**400), st.integers(min_value=-3000, max_value=3000))
@pytest.mark.slow
def test_mpf_answers_are_stored_exactly_at_any_mpmath_precision(mantissa, exponent):
    with mpmath.workprec(600):
        value = mpmath.ldexp(mpmath.mpf(mantissa), exponent)
    with mpmath.workprec(53):  # reading back must not round to the ambient precision
        back = mpf_from_hex(mpf_to_hex(value))
    assert back._mpf_ == value._mpf_


def test_an_oracle_that_overwrites_its_batch_changes_neither_the_transcript_nor_the_messages(tmp_path):
    """The grid's batches reach the oracle without a copy (they are built for it); the transcript's
    hashes and an error's sequence are of the queries as asked, whatever the oracle does to its arrays."""
    target = mx.MultiHeadAttention.random(3, 1, seed=4)
    simulated = mx.SimulatedOracle(target)

    def vandal(batch):
        answers = simulated(batch)
        for X in batch:
            X[...] = 7.0  # overwrites every token it was handed
        return answers

    path = str(tmp_path / "run.sqlite")
    first = mx.extract(vandal, 3, heads=1, seed=5, schedule="paper", transcript=path, progress=False)
    clean = mx.extract(simulated, 3, heads=1, seed=5, schedule="paper", progress=False)
    assert np.array_equal(first.model.W, clean.model.W) and first.answers_residual == clean.answers_residual
    resumed = mx.extract(simulated, 3, heads=1, seed=5, schedule="paper", transcript=path, progress=False,
                         resume_check=0)
    assert resumed.queries_replayed == first.queries and resumed.queries_asked == 0
    assert np.array_equal(resumed.model.W, first.model.W)

    asked = []

    def vandal_with_a_nan(batch):
        asked.extend(np.array(X) for X in batch)
        answers = np.asarray(simulated(batch), dtype=float)
        for X in batch:
            X[...] = 7.0
        answers[5] = np.nan
        return answers

    with pytest.raises(mx.OracleError) as error:
        mx.extract(vandal_with_a_nan, 3, heads=1, seed=5, schedule="paper", progress=False)
    assert error.value.query == 5 and np.array_equal(error.value.sequence, asked[5])
    assert not np.all(error.value.sequence == 7.0)


# ---------------------------------------------------------------------- sections and vector answers

HEADER = dict(d=2, max_heads=1, seed=1, precision=None, schedule="paper", bias=False, rank=None, token_scale="auto")


def queries(count, d=2, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1 + n % 3, d)) for n in range(count)]


def awkward_floats(shape, seed=0):
    """float64 answers that a decimal round trip would not keep: subnormals, -0.0, huge, tiny, random bits."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * 10.0 ** rng.integers(-300, 300, size=shape)
    flat = values.reshape(-1)
    flat[:4] = [-0.0, 5e-324, -np.finfo(float).max, np.nextafter(1.0, 2.0)]
    return values


def bits(values):
    return np.asarray(values, dtype=np.float64).view(np.uint64)


@pytest.mark.parametrize("d_out", [None, 1, 5])
def test_scalar_and_vector_answers_round_trip_bit_for_bit(tmp_path, d_out):
    path = tmp_path / "run.sqlite"
    asked = queries(9)
    shape = (9,) if d_out is None else (9, d_out)
    values = awkward_floats(shape)
    with Transcript(path, HEADER) as record:
        stored = record.record(0, range(4), asked[:4], values[:4], section=CALIBRATION)
        record.start_run({"queries": 5})
        stored += record.record(0, [0, 2, 1], asked[4:7], values[[4, 6, 5]])
        stored += record.record(3, [0, 1], asked[7:9], values[7:9])
    reordered = values[[0, 1, 2, 3, 4, 6, 5, 7, 8]]
    for returned, value in zip(stored, reordered):
        if d_out is None:
            assert type(returned) is float
        else:
            assert isinstance(returned, np.ndarray) and returned.shape == (d_out,) and returned.dtype == np.float64
        assert np.array_equal(bits(returned), bits(value))
    with Transcript(path, HEADER) as again:
        assert again.d_out == d_out
        again.start_run({"queries": 5})
        replayed = list(again.replay(0, asked[:4], section=CALIBRATION).values())
        run = again.replay(0, [asked[4], asked[6], asked[5], asked[7], asked[8]])
        replayed += [run[p] for p in (0, 2, 1, 3, 4)]  # in the order recorded
    for returned, back in zip(stored, replayed):
        assert type(back) is type(returned) and np.array_equal(bits(back), bits(returned))


def test_vector_answers_of_another_length_or_kind_are_refused(tmp_path):
    path = tmp_path / "run.sqlite"
    asked = queries(4)
    with Transcript(path, HEADER) as record:
        record.record(0, [0, 1], asked[:2], np.ones((2, 3)), section=CALIBRATION)
        with pytest.raises(TranscriptError, match="vector answers of length d_out = 3.*d_out = 4"):
            record.record(2, [0], asked[2:3], np.ones((1, 4)), section=CALIBRATION)
        with pytest.raises(TranscriptError, match="d_out = 3.*scalar answers"):
            record.record(2, [0], asked[2:3], np.ones(1), section=CALIBRATION)
        with pytest.raises(TranscriptError, match=r"got shape \(1, 2, 2\)"):
            record.record(2, [0], asked[2:3], np.ones((1, 2, 2)), section=CALIBRATION)
    with Transcript(path, HEADER) as again:  # the length is the file's, read back
        with pytest.raises(TranscriptError, match="d_out = 3.*d_out = 2"):
            again.record(2, [0], asked[2:3], np.ones((1, 2)), section=CALIBRATION)
    scalar = tmp_path / "scalar.sqlite"
    with Transcript(scalar, HEADER) as record:
        record.record(0, [0], asked[:1], [0.5], section=CALIBRATION)
        with pytest.raises(TranscriptError, match="holds scalar answers.*d_out = 2"):
            record.record(1, [0], asked[1:2], np.ones((1, 2)), section=CALIBRATION)


def test_high_precision_vector_answers_round_trip_exactly(tmp_path):
    path = tmp_path / "run.sqlite"
    header = HEADER | dict(precision=128)
    with mpmath.workprec(300):
        values = [[mpmath.mpf(1) / 3, -mpmath.sqrt(2) * 2**-900], [+mpmath.pi, mpmath.mpf(0)]]
    with Transcript(path, header) as record:
        stored = record.record(0, [0, 1], queries(2), values, section=CALIBRATION)
    with Transcript(path, header) as again:
        back = again.replay(0, queries(2), section=CALIBRATION)
    for position, row in enumerate(values):
        assert [entry._mpf_ for entry in stored[position]] == [entry._mpf_ for entry in row]
        assert [entry._mpf_ for entry in back[position]] == [entry._mpf_ for entry in row]


def test_a_format_1_transcript_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as connection:  # the layout of transcripts without sections
        connection.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        connection.execute("CREATE TABLE queries (id INTEGER PRIMARY KEY, length INTEGER NOT NULL, "
                           "tokens_sha256 TEXT NOT NULL, answer TEXT NOT NULL, checksum TEXT NOT NULL)")
        connection.execute("INSERT INTO meta VALUES ('fingerprint', ?)", ('{"format": 1, "d": 2}',))
    before = file_digest(path)
    target = mx.MultiHeadAttention.random(2, 1, seed=0)
    oracle = FlakyOracle(target, fail_after=0)
    with pytest.raises(TranscriptError, match="format 1.*cannot resume it.*new transcript"):
        mx.extract(oracle, 2, heads=1, seed=1, transcript=path, schedule="paper")
    assert oracle.calls == 0 and file_digest(path) == before


def test_the_run_section_needs_its_fingerprint_first(tmp_path):
    with Transcript(tmp_path / "run.sqlite", HEADER) as record:
        with pytest.raises(RuntimeError, match="start_run"):
            record.record(0, [0], queries(1), [1.0])
