"""ParallelOracle (docs/parallel.md): a batch split over Ray actors answers as the oracle itself.

The fast tier checks what needs no Ray (the splitting, packing and conversions; the errors for bad
sizes and for Ray missing; that importing mhaextract leaves Ray alone). The Ray tests start one
local 2-worker instance for the module (a few seconds) and are in the slow tier: they compare
against the plain oracle called in this process, answer for answer and model for model
(np.array_equal), with counts measured at the boundary by ``extract`` itself.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.oracle.parallel import (
    driver_path, pack_sequences, pack_share, plain_answers, share_bounds, unpack_sequences,
)
from mhaextract.oracle.queries import CopiesBatch, CopiesRows, RoundQueries

TARGET = mx.MultiHeadAttention.random(d=3, heads=2, seed=4)


def batch_of(lengths, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((int(n), d)) for n in lengths]


# -- factories and oracles the workers build (module level: the workers import this module) ----------

def torch_layer_oracle(d: int, heads: int, dtype: str, seed: int):
    """A TorchOracle of a freshly initialised nn.MultiheadAttention (the same weights in every
    process: torch's generator seeded)."""
    import torch

    from mhaextract.adapters.torch import TorchOracle

    torch.manual_seed(seed)
    layer = torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=getattr(torch, dtype))
    return TorchOracle(layer)


class WhoAnswered:
    """Answers (f(X), process id): which worker answered each sequence."""

    def __init__(self, target):
        self.inner = mx.SimulatedOracle(target)

    def __call__(self, batch):
        return np.column_stack([self.inner(batch), np.full(len(batch), float(os.getpid()))])


class FailsOnce:
    """A simulated oracle whose first call anywhere fails (a marker file remembers across workers):
    raising ``ConnectionError``, or with ``crash`` ending its worker process."""

    def __init__(self, target, marker: str, crash: bool = False):
        self.inner, self.marker, self.crash = mx.SimulatedOracle(target), marker, crash

    def __call__(self, batch):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return self.inner(batch)
        if self.crash:
            os._exit(3)
        raise ConnectionError("the remote service dropped the connection")


class AlwaysFails:
    def __call__(self, batch):
        raise TypeError("this oracle wants torch tensors, not numpy arrays")


class AnswersTooFew:
    def __call__(self, batch):
        return np.zeros(max(len(batch) - 1, 0))


def broken_factory():
    raise RuntimeError("no API key in this worker's environment")


def simulated(target=TARGET, precision=None):
    return mx.SimulatedOracle(target, precision)


def assert_same_model(a: mx.MultiHeadAttention, b: mx.MultiHeadAttention):
    for name in ("W", "V", "u", "c"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


# -- fast tier: no Ray ----------------------------------------------------------------------------

@pytest.mark.parametrize("lengths, workers", [
    ([3], 2), ([3, 3], 2), ([1, 2, 3], 2), ([5] * 7, 2), ([1, 1, 1, 30], 2), ([30, 1, 1, 1], 3),
    ([0, 0, 0], 2), ([2] * 10, 16), ([4, 9, 1, 1, 7, 3], 4),
])
def test_shares_are_contiguous_nonempty_and_cover_the_batch(lengths, workers):
    bounds = share_bounds(np.array(lengths), workers)
    assert len(bounds) == min(workers, len(lengths))
    assert bounds[0][0] == 0 and bounds[-1][1] == len(lengths)
    assert all(start < stop for start, stop in bounds)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_shares_balance_tokens():
    """Equal lengths split evenly; one long sequence gets a share of its own."""
    assert share_bounds(np.full(8, 3), 2) == [(0, 4), (4, 8)]
    assert share_bounds(np.full(9, 3), 3) == [(0, 3), (3, 6), (6, 9)]
    assert share_bounds(np.array([1, 1, 1, 30]), 2) == [(0, 3), (3, 4)]
    assert share_bounds(np.array([30, 1, 1, 1]), 2) == [(0, 1), (1, 4)]


def test_packing_round_trips_and_copies():
    batch = batch_of([1, 4, 2, 2])
    packed = pack_sequences(batch)
    assert packed[0] == "rows" and packed[1].shape == (9, 3)
    rows = packed[1]
    rows.flags.writeable = False  # as Ray hands it over
    unpacked = unpack_sequences(packed)
    assert [s.shape for s in unpacked] == [s.shape for s in batch]
    assert all(np.array_equal(a, b) for a, b in zip(unpacked, batch))
    unpacked[0][0, 0] = 99.0  # the oracle may write to its arrays
    assert batch[0][0, 0] != 99.0
    # widths or dtypes that differ, and object arrays (high precision), travel as the list itself
    for irregular in ([np.ones((2, 3)), np.ones((2, 4))], [np.ones((2, 3)), np.ones((2, 3), np.float32)],
                      [np.array([[1, 2]], dtype=object)]):
        assert pack_sequences(irregular)[0] == "list"
        assert all(a is b for a, b in zip(unpack_sequences(pack_sequences(irregular)), irregular))


def test_a_copies_batch_travels_as_its_rows_and_arrives_bit_for_bit():
    """The targeted schedule's batches (a CopiesBatch from RoundQueries) go to the workers as two rows
    a query (final token, difference) instead of its k + 1 tokens, and are built again there: the
    same sequences to the bit, whatever share boundaries cut the segments."""
    rng = np.random.default_rng(3)
    finals, differences = rng.standard_normal((5, 2, 4)), rng.standard_normal((5, 4))  # 5 units, 2 rounds
    queries = RoundQueries(finals, differences, [(1, 2), (4,)])  # (round, k): (0, 1), (0, 2), (1, 4)
    batch = queries[2:14]  # cuts the first and last segments
    assert isinstance(batch, CopiesBatch) and batch.intact() and len(batch) == 12
    expected = [np.array(queries[i]) for i in range(2, 14)]
    assert all(np.array_equal(a, b) for a, b in zip(batch, expected))
    for start, stop in [(0, 12), (0, 5), (5, 12), (3, 4)]:
        packed = pack_share(batch, start, stop)
        assert packed[0] == "copies"
        assert sum(len(f) for f, _, _ in packed[1]) == stop - start  # two rows a query, not k + 1
        for f, z, _ in packed[1]:
            f.flags.writeable = z.flags.writeable = False  # as Ray hands them over
        unpacked = unpack_sequences(packed)
        assert [s.shape for s in unpacked] == [s.shape for s in expected[start:stop]]
        assert all(np.array_equal(a, b) for a, b in zip(unpacked, expected[start:stop]))
        unpacked[0][0, 0] = 99.0  # the oracle may write to its arrays
        # an oracle that takes copies-instances as rows is handed the rows, copied, whole
        rows = unpack_sequences(pack_share(queries.copies_rows(2, 14), start, stop), as_rows=True)
        assert isinstance(rows, CopiesRows) and len(rows) == stop - start
        assert all(np.array_equal(a, b) for a, b in zip(rows, expected[start:stop]))
        rows.segments[0][0][0, 0] = 99.0
    assert finals[0, 0, 0] != 99.0 and batch[0][0, 0] != 99.0
    # a list changed after it was built is no longer its segments': it travels as rows
    batch.append(np.ones((2, 4)))
    assert not batch.intact() and pack_share(batch, 0, 13)[0] == "rows"


def test_answers_convert_as_the_boundary_accepts_them():
    torch = pytest.importorskip("torch")
    values = plain_answers(torch.tensor([1.5, 2.25], dtype=torch.bfloat16))
    assert values.dtype == np.float64 and values.tolist() == [1.5, 2.25]
    assert plain_answers(np.float32([0.1])).tolist() == [float(np.float32(0.1))]
    assert plain_answers([1.0, 2, np.float32(0.5)]).dtype == np.float64
    # what the boundary refuses is left for it to refuse: booleans, strings, None
    assert plain_answers([True, 1.0]) == [True, 1.0]
    assert plain_answers(["1.5", None]) == ["1.5", None]


@pytest.mark.parametrize("name, value", [("workers", 0), ("workers", -1), ("workers", 2.5), ("workers", True),
                                         ("threads_per_worker", 0), ("retries", -1), ("gpus_per_worker", -1)])
def test_bad_sizes_are_refused_naming_the_parameter(name, value):
    options = {"workers": 2, name: value}
    with pytest.raises(ValueError, match=name):
        mx.ParallelOracle(simulated, **options)


def test_factory_must_be_callable():
    with pytest.raises(TypeError, match="factory must be a zero-argument callable"):
        mx.ParallelOracle("SimulatedOracle", workers=2)


def test_without_ray_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mhaextract\[ray\]'"):
        mx.ParallelOracle(simulated, workers=2)


@pytest.mark.slow
def test_importing_mhaextract_does_not_import_ray():
    code = "import sys, mhaextract; print('ray' in sys.modules, hasattr(mhaextract, 'ParallelOracle'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split() == ["False", "True"]


# -- Ray: one local instance of 2 workers for the module ------------------------------------------

@pytest.fixture(scope="module")
def local():
    """A local Ray instance of 4 CPUs started here (as a user would), with a ParallelOracle of 2
    workers on it; each test's own oracles take the other 2 CPUs while they are open."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": driver_path()}})  # the workers import this module
    try:
        with mx.ParallelOracle(simulated, workers=2) as oracle:
            yield oracle
        assert ray.is_initialized()  # closing leaves an instance the user started running
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[], [4], [2, 5], [3, 1, 6], [1, 2, 3, 4, 5, 6, 7], [6] * 9])
def test_answers_in_order_for_batches_below_at_and_above_the_worker_count(local, lengths):
    batch = batch_of(lengths, seed=len(lengths))
    answers = local(batch)
    assert isinstance(answers, np.ndarray) and answers.dtype == np.float64 and answers.shape == (len(batch),)
    assert np.array_equal(answers, mx.SimulatedOracle(TARGET)(batch))


@pytest.mark.slow
def test_vector_answers_come_back_whole_and_each_share_from_one_worker(local):
    batch = batch_of([2, 3, 4, 1, 1, 5, 2])
    with mx.ParallelOracle(functools.partial(WhoAnswered, TARGET), workers=2) as oracle:
        answers = oracle(batch)
        single = oracle(batch[:1])
    assert answers.shape == (7, 2)
    assert np.array_equal(answers[:, 0], mx.SimulatedOracle(TARGET)(batch))
    workers = answers[:, 1]
    # two contiguous shares, answered by two processes, neither of them this one
    changes = np.flatnonzero(np.diff(workers))
    assert len(changes) == 1 and len(set(workers)) == 2 and os.getpid() not in workers
    assert single.shape == (1, 2)


@pytest.mark.slow
def test_local_workers_share_memory_blocks_that_grow_and_are_unlinked_at_close(local):
    """Workers on this machine take their shares and give their answers through the driver's
    blocks of shared memory: the same answers to the bit, a block replaced when a larger batch
    needs more (the worker lets the old one go), every block gone from /dev/shm after close."""
    oracle = mx.ParallelOracle(functools.partial(WhoAnswered, TARGET), workers=2)
    try:
        assert oracle._local == [True, True]
        for lengths in ([2, 3, 1], [2, 3, 1], [5] * 40, [1]):  # the second call answers into shared memory
            batch = batch_of(lengths, seed=len(lengths))
            answers = oracle(batch)
            assert answers.shape == (len(batch), 2) and np.array_equal(answers[:, 0], mx.SimulatedOracle(TARGET)(batch))
        rng = np.random.default_rng(5)
        copies = RoundQueries(rng.standard_normal((30, 1, 3)), rng.standard_normal((30, 3)), [(1, 2)])[:]
        assert np.array_equal(oracle(copies)[:, 0], mx.SimulatedOracle(TARGET)(list(copies)))
        names = [block.name for block in oracle._shared.blocks.values()]
        assert {direction for _, direction in oracle._shared.blocks} == {"in", "out"}
        assert all(os.path.exists(f"/dev/shm/{name}") for name in names)
    finally:
        oracle.close()
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in names)


@pytest.mark.slow
def test_high_precision_tokens_and_answers_pass_through(local):
    batch = [np.vectorize(__import__("mpmath").mpf, otypes=[object])(X) for X in batch_of([2, 3, 1])]
    with mx.ParallelOracle(functools.partial(simulated, TARGET, 80), workers=2) as oracle:
        answers = oracle(batch)
    assert isinstance(answers, list) and answers == mx.SimulatedOracle(TARGET, 80)(batch)


@pytest.mark.slow
def test_extraction_is_bit_for_bit_the_single_process_one(local):
    plain = mx.extract(mx.SimulatedOracle(TARGET), d=3, heads=2, seed=1)
    parallel = mx.extract(local, d=3, heads=2, seed=1)
    assert parallel.queries == plain.queries and parallel.max_query_length == plain.max_query_length
    assert_same_model(parallel.model, plain.model)
    assert mx.compare(parallel.model, TARGET).max_rel < 1e-12


@pytest.mark.slow
def test_torch_layer_answers_are_the_layers_own_for_each_share(local):
    """torch's CPU kernels round a sequence's answer differently with the batch around it (by an
    ulp): the parallel answers are bit-for-bit the layer's answers to the same shares."""
    pytest.importorskip("torch")
    factory = functools.partial(torch_layer_oracle, 4, 2, "float64", 0)
    layer = factory()
    batch = batch_of([3, 3, 1, 3, 5, 3, 3, 2, 3], d=4)
    with mx.ParallelOracle(factory, workers=2) as oracle:
        assert oracle.answer_dtype == "float64"
        answers = oracle(batch)
    shares = [layer(batch[start:stop]) for start, stop in share_bounds(np.array([len(X) for X in batch]), 2)]
    assert answers.shape == (9, 4) and np.array_equal(answers, np.concatenate(shares))


@pytest.mark.slow
def test_torch_layer_whole_outputs_identical_model_and_transcript(local, tmp_path):
    """One worker answers the boundary's batches whole: the run is the layer's own, bit for bit,
    transcript included. Two agree to the answers' rounding, with the same queries."""
    pytest.importorskip("torch")
    factory = functools.partial(torch_layer_oracle, 4, 2, "float64", 0)
    plain = mx.extract(factory(), d=4, heads=2, seed=2, transcript=str(tmp_path / "plain.sqlite"))
    with mx.ParallelOracle(factory, workers=1) as oracle:
        parallel = mx.extract(oracle, d=4, heads=2, seed=2, transcript=str(tmp_path / "parallel.sqlite"))
    assert parallel.queries == plain.queries
    assert_same_model(parallel.model, plain.model)
    assert parallel.answer_dtype == plain.answer_dtype == "float64"
    # the parallel transcript holds the layer's answers: a run resumed from it with the layer itself
    # passes the resume check (it re-asks recorded queries and compares) and replays everything else
    resumed = mx.extract(factory(), d=4, heads=2, seed=2, transcript=str(tmp_path / "parallel.sqlite"))
    assert resumed.queries_replayed == plain.queries
    assert_same_model(resumed.model, plain.model)
    with mx.ParallelOracle(factory, workers=2) as oracle:
        split = mx.extract(oracle, d=4, heads=2, seed=2)
    assert split.queries == plain.queries
    for name in ("W", "V", "u", "c"):  # (the layer's biases start at 0: u and c are rounding alone)
        assert np.allclose(getattr(split.model, name), getattr(plain.model, name), rtol=1e-12, atol=1e-14), name


@pytest.mark.slow
def test_float32_layer_answer_dtype_forwarded_and_run_unchanged(local):
    """A float32 layer's answers: extract reads answer_dtype (the read-out rounded to float32,
    the checks' precision) from the ParallelOracle exactly as from the TorchOracle."""
    pytest.importorskip("torch")
    factory = functools.partial(torch_layer_oracle, 4, 2, "float32", 1)
    plain = mx.extract(factory(), d=4, heads=2, seed=3, on_failure="warn")
    with mx.ParallelOracle(factory, workers=1) as oracle:
        assert oracle.answer_dtype == "float32"
        parallel = mx.extract(oracle, d=4, heads=2, seed=3, on_failure="warn")
    assert parallel.answer_dtype == plain.answer_dtype == "float32"
    assert parallel.queries == plain.queries
    assert_same_model(parallel.model, plain.model)
    assert [c.passed for c in parallel.checks] == [c.passed for c in plain.checks]


@pytest.mark.slow
def test_an_oracle_without_answer_dtype_gives_none(local):
    assert not hasattr(local, "answer_dtype")
    assert mx.extract(local, d=3, heads=2, seed=1).answer_dtype == "float64"


@pytest.mark.slow
@pytest.mark.parametrize("crash", [False, True], ids=["raises", "worker dies"])
def test_a_share_that_fails_once_is_asked_again_and_the_run_is_unchanged(local, tmp_path, crash):
    plain = mx.extract(mx.SimulatedOracle(TARGET), d=3, heads=2, seed=1)
    factory = functools.partial(FailsOnce, TARGET, str(tmp_path / "failed"), crash)
    with mx.ParallelOracle(factory, workers=2) as oracle:
        parallel = mx.extract(oracle, d=3, heads=2, seed=1)
        assert len(oracle.failures) == 1
        worker, error = oracle.failures[0]
        assert worker in (0, 1)
        if not crash:
            assert isinstance(error, ConnectionError)
    assert parallel.queries == plain.queries
    assert_same_model(parallel.model, plain.model)


@pytest.mark.slow
def test_an_oracle_that_always_fails_gives_a_clear_oracle_error(local):
    with mx.ParallelOracle(AlwaysFails, workers=2, retries=1) as oracle:
        with pytest.raises(mx.OracleError, match=r"failed 2 times \(retries=1\).*worker \d: TypeError: this oracle "
                                                 r"wants torch tensors") as caught:
            mx.extract(oracle, d=3, heads=2, seed=1)
    assert isinstance(caught.value.__cause__, TypeError)
    # the boundary names the queries it was asking
    assert any("raised by the oracle while answering" in note for note in caught.value.__notes__)


@pytest.mark.slow
def test_a_failing_factory_is_named_at_construction(local):
    with pytest.raises(mx.OracleError, match="factory\\(\\) failed in worker 0: RuntimeError: no API key"):
        mx.ParallelOracle(broken_factory, workers=2)


@pytest.mark.slow
def test_an_oracle_passed_as_the_factory_is_named(local):
    with pytest.raises(mx.OracleError, match="factory\\(\\) failed in worker 0: TypeError.*not the oracle itself"):
        mx.ParallelOracle(mx.SimulatedOracle(TARGET), workers=2)


@pytest.mark.slow
def test_a_factory_ray_cannot_send_is_named(local):
    import threading

    with pytest.raises(TypeError, match="factory must be picklable"):
        mx.ParallelOracle(functools.partial(simulated, threading.Lock()), workers=2)


@pytest.mark.slow
def test_too_few_answers_from_a_worker_are_refused(local):
    with mx.ParallelOracle(AnswersTooFew, workers=2) as oracle:
        with pytest.raises(mx.OracleError, match="worker 0's oracle returned 1 answers for its share of 2"):
            oracle(batch_of([2, 2, 2, 2]))


@pytest.mark.slow
def test_more_workers_than_the_instance_has_cpus_are_refused(local):
    with pytest.raises(ValueError, match="need 5 CPUs.*has 4 CPUs"):
        mx.ParallelOracle(simulated, workers=5)


@pytest.mark.slow
def test_a_closed_oracle_says_so(local):
    oracle = mx.ParallelOracle(simulated, workers=1)
    assert np.array_equal(oracle(batch_of([2])), mx.SimulatedOracle(TARGET)(batch_of([2])))
    oracle.close()
    with pytest.raises(mx.OracleError, match="closed"):
        oracle(batch_of([2]))
    assert local(batch_of([2])).shape == (1,)  # the instance and its other oracles run on


@pytest.mark.slow
def test_the_docs_local_example_runs_as_written(tmp_path):
    """docs/parallel.md's example on one machine, as a script: address=None without a running
    instance starts a local one of workers x threads CPUs, shut down when the oracle closes."""
    pytest.importorskip("ray")
    pytest.importorskip("torch")
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "parallel.md").read_text()
    script = next(block for block in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "__main__" in block)
    script = script.replace("    with mx.ParallelOracle(", "    import ray\n    with mx.ParallelOracle(")
    script = script.replace("        result = mx.extract(", "        print(ray.cluster_resources()['CPU'])\n        result = mx.extract(")
    (tmp_path / "example.py").write_text(script + "    print(ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    cpus, queries, ok, dtype, running = out.stdout.split()[-5:]
    assert float(cpus) == max(2, os.cpu_count()) and int(queries) > 0 and ok == "True" and dtype == "float64"
    assert running == "False"


UNCLOSED = """
import functools
import gc
import mhaextract as mx
import ray

target = mx.MultiHeadAttention.random(d=3, heads=2, seed=4)
factory = functools.partial(mx.SimulatedOracle, target)

if __name__ == "__main__":
    result = mx.extract(mx.ParallelOracle(factory, workers=1), d=3, heads=2, seed=1)  # never closed
    print(result.ok, ray.is_initialized())
    kept = mx.ParallelOracle(factory, workers=1)  # open, not closed
    print(ray.cluster_resources()["CPU"])
    del kept
    gc.collect()  # the oracle's last reference may sit in a cycle: collected, not freed by its refcount
    print(ray.is_initialized())
    with mx.ParallelOracle(factory, workers=2) as oracle:
        print(mx.extract(oracle, d=3, heads=2, seed=1).ok)
"""


@pytest.mark.slow
def test_a_local_instance_takes_the_machines_cpus_and_ends_with_an_oracle_never_closed(tmp_path):
    """Issue 64: extract(ParallelOracle(factory, workers=1)) outside a with block left its 1-CPU
    local instance running, and a later 2-worker oracle was refused. Now the instance the library
    starts has the machine's CPUs and is shut down when its last oracle is garbage-collected."""
    pytest.importorskip("ray")
    (tmp_path / "unclosed.py").write_text(UNCLOSED)
    out = subprocess.run([sys.executable, "unclosed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    ok, running, cpus, running_after, second_ok = out.stdout.split()[-5:]
    assert (ok, running, running_after, second_ok) == ("True", "False", "False", "True")
    assert float(cpus) == os.cpu_count()
