"""Oracle evaluation spread over Ray actors (docs/parallel.md): the learner stays on the driver.

:class:`ParallelOracle` is an oracle (``oracle(batch) -> answers``, docs/algorithm.md, 'The paper schedule') that
splits each batch the boundary sends into contiguous shares, one per worker, answers each share in
its own Ray actor holding its own copy of the user's oracle (built there by ``factory()``), and
gathers the answers in the order asked. The boundary (:mod:`mhaextract.oracle.boundary`) still
counts, validates and records every query exactly as for the oracle itself, so transcripts and
counts are unchanged; where the oracle's answer to a sequence does not depend on what else is in
its batch, the model is bit-for-bit the single-process one.

Workers on the driver's own machine take their shares and give their answers through blocks of
shared memory the driver owns (:class:`SharedBlocks`): one copy each way, where Ray's object store
costs a serialisation, a store and a fetch per share. Workers on other machines (and a share asked
again after a failure) go through Ray.

Ray is an optional extra (``pip install 'mhaextract[ray]'``), imported only when a
:class:`ParallelOracle` is built.
"""

from __future__ import annotations

import os
import secrets
import sys
import weakref
from multiprocessing import shared_memory

import numpy as np

from ..run.validation import nonnegative_number, positive_int, positive_number
from .boundary import OracleError, plain_numbers
from .queries import CopiesRows, rows_of

#: How to install the optional dependency (said by every error about it).
INSTALL_HINT = "pip install 'mhaextract[ray]'"
#: Variables that size the BLAS and OpenMP thread pools of a worker process.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# The Ray connection a ParallelOracle opened (a local instance it started, or a cluster it connected
# to) is closed when the last ParallelOracle using it closes (or is garbage-collected); one the user
# opened is never closed here.
_opened_here = {"users": 0}


def import_ray():
    """The ``ray`` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(f"ParallelOracle needs Ray, an optional dependency of mhaextract: {INSTALL_HINT} "
                          f"(Ray could not be imported: {error})") from error
    return ray


def driver_path() -> str:
    """This process's import path (``sys.path``, mhaextract's own folder first) as a PYTHONPATH value."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folders = [package_root] + [os.path.abspath(p or os.curdir) for p in sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in folders if os.path.isdir(p)))


def share_bounds(lengths: np.ndarray, workers: int) -> list[tuple[int, int]]:
    """Contiguous shares ``[(start, stop), ...]`` of a batch of sequences of ``lengths`` tokens for
    ``workers`` workers: about equal token counts (a forward pass costs about its tokens), none
    empty, at most one per sequence."""
    n = len(lengths)
    parts = min(workers, n)
    tokens = np.cumsum(np.maximum(np.asarray(lengths, dtype=np.int64), 1))
    bounds = [0]
    for k in range(1, parts):
        # the first cut after which the tokens so far reach k / parts of the batch's
        cut = int(np.searchsorted(tokens, tokens[-1] * k / parts, side="left")) + 1
        bounds.append(min(max(cut, bounds[-1] + 1), n - (parts - k)))
    bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:]))


def pack_sequences(sequences: list) -> tuple:
    """One share's sequences for the trip to a worker: float arrays of one width and dtype as one
    stacked array of rows and their lengths (one buffer to serialise instead of many small ones);
    anything else (high-precision object arrays, lists) as the list itself."""
    if (sequences and all(isinstance(s, np.ndarray) and s.ndim == 2 and s.dtype.kind == "f" for s in sequences)
            and len({(s.shape[1], s.dtype) for s in sequences}) == 1):
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        return "rows", np.concatenate(sequences), lengths
    return "list", list(sequences)


def pack_share(batch, start: int, stop: int) -> tuple:
    """Sequences ``start .. stop - 1`` of ``batch`` for the trip to a worker: copies-instances
    (:func:`~mhaextract.oracle.queries.rows_of`) as their segments (two rows per query instead
    of its ``k + 1`` tokens), any other batch's by :func:`pack_sequences`."""
    rows = rows_of(batch)
    if rows is not None:
        return "copies", rows.share(start, stop)
    return pack_sequences(batch[start:stop])


def unpack_sequences(packed: tuple, as_rows: bool = False):
    """The sequences :func:`pack_share` packed, as new writable arrays the oracle may keep;
    copies-instances as :class:`~mhaextract.oracle.queries.CopiesRows` with ``as_rows`` (for an
    oracle with ``takes_copies_rows``), else as their sequences."""
    if packed[0] == "copies":
        copies = CopiesRows([(np.array(finals), np.array(differences), k) for finals, differences, k in packed[1]])
        return copies if as_rows else copies.sequences()
    if packed[0] == "rows":
        _, rows, lengths = packed
        return np.split(np.array(rows), np.cumsum(lengths)[:-1])  # one copy: Ray's buffers are read-only
    return list(packed[1])


def plain_answers(raw):
    """A worker's answers for the trip back: torch tensors as numpy arrays (exactly, as the boundary
    converts them), float arrays and lists of real numbers as float64 arrays; anything else (mpf,
    strings, booleans, wrong shapes) unchanged, for the boundary to judge."""
    raw = plain_numbers(raw)
    if isinstance(raw, np.ndarray) and raw.dtype.kind == "f":
        return raw.astype(np.float64, copy=False)
    if isinstance(raw, (list, tuple)):
        values = [plain_numbers(value) for value in raw]
        if values and all(isinstance(v, (float, int, np.floating, np.integer)) and not isinstance(v, (bool, np.bool_))
                          for v in values):
            return np.array(values, dtype=np.float64)
        return values
    return raw


#: Arrays in a shared block start at multiples of this many bytes.
ALIGNMENT = 64


def attach_block(name: str) -> shared_memory.SharedMemory:
    """A block another process created, attached without taking ownership: Python before 3.13
    registers an attached block with this process's resource tracker, which would unlink it when
    this process ends; the driver that created it unlinks it."""
    block = shared_memory.SharedMemory(name=name)
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(block._name, "shared_memory")  # noqa: SLF001 (the tracker's own key)
    except Exception:  # a Python that does not track attached blocks
        pass
    return block


def write_arrays(block: shared_memory.SharedMemory, arrays: list) -> list:
    """Write float64 ``arrays`` into ``block`` one after another; their ``(offset, shape)``."""
    layout, offset = [], 0
    for array in arrays:
        view = np.ndarray(array.shape, np.float64, block.buf, offset)
        view[...] = array
        layout.append((offset, array.shape))
        offset += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
    return layout


def read_arrays(block: shared_memory.SharedMemory, layout: list) -> list:
    """Views of ``block`` at ``layout`` (:func:`write_arrays`): the block is written again by the next
    call, so a reader copies what it keeps (:func:`unpack_sequences` does)."""
    return [np.ndarray(shape, np.float64, block.buf, offset) for offset, shape in layout]


def packed_arrays(packed: tuple):
    """The float64 arrays of a packed share (:func:`pack_share`) and what rebuilds it from them, or
    None where it holds something else (object arrays of high precision, other dtypes)."""
    if packed[0] == "copies" and all(f.dtype == np.float64 and z.dtype == np.float64 for f, z, _ in packed[1]):
        arrays = [array for f, z, _ in packed[1] for array in (f, z)]
        return arrays, ("copies", [k for _, _, k in packed[1]])
    if packed[0] == "rows" and packed[1].dtype == np.float64:
        return [packed[1], packed[2].astype(np.float64)], ("rows", None)
    return None


def repacked(arrays: list, recipe: tuple) -> tuple:
    """The packed share :func:`packed_arrays` took apart, from its arrays."""
    kind, ks = recipe
    if kind == "copies":
        return "copies", [(arrays[2 * i], arrays[2 * i + 1], k) for i, k in enumerate(ks)]
    return "rows", arrays[0], arrays[1].astype(np.int64)


class SharedBlocks:
    """The driver's blocks of shared memory, one per worker and direction (its share in, its answers
    out), grown as needed and unlinked by :meth:`close` (or when the driver's process ends)."""

    def __init__(self):
        self.blocks: dict[tuple[int, str], shared_memory.SharedMemory] = {}
        self._finalizer = weakref.finalize(self, SharedBlocks._unlink_all, self.blocks)

    def block(self, worker: int, direction: str, nbytes: int) -> shared_memory.SharedMemory:
        """Worker's block for ``direction`` ("in", "out") of at least ``nbytes`` bytes."""
        key = (worker, direction)
        block = self.blocks.get(key)
        if block is None or block.size < nbytes:
            if block is not None:
                SharedBlocks._unlink(block)
            size = max(nbytes + nbytes // 2, 1 << 16)  # room to grow before the next new block
            name = f"mhx{os.getpid()}_{worker}_{direction}_{secrets.token_hex(6)}"  # the worker lets a replaced one go
            block = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.blocks[key] = block
        return block

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _unlink(block) -> None:
        try:
            block.close()
            block.unlink()
        except (FileNotFoundError, BufferError):  # gone already, or a view of it still alive
            pass

    @staticmethod
    def _unlink_all(blocks: dict) -> None:
        for block in blocks.values():
            SharedBlocks._unlink(block)
        blocks.clear()


class OracleWorker:
    """What runs in each Ray actor: one copy of the user's oracle, built by ``factory()``.

    An exception of the factory is kept and raised by every call, so that the driver reports it
    (an exception in an actor's constructor would only say that the actor died)."""

    def __init__(self, factory, threads: int):
        for name in THREAD_VARIABLES:  # libraries the factory loads size their pools from these
            os.environ[name] = str(threads)
        self.error, self.oracle = None, None
        try:
            self.oracle = factory()
            if not callable(self.oracle):
                raise TypeError(f"factory() must return an oracle (a callable on a batch), got "
                                f"{type(self.oracle).__name__}")
        except Exception as error:  # raised again, whole, at every call
            self.error = error
        if "torch" in sys.modules:  # torch keeps its own pool, sized at import from the machine's cores
            sys.modules["torch"].set_num_threads(threads)
        #: whether the oracle is handed copies-instances as their rows (it builds their sequences)
        self.takes_rows = bool(getattr(self.oracle, "takes_copies_rows", False))

    def answer_dtype(self):
        """The oracle's ``answer_dtype`` (None when it has none)."""
        if self.error is not None:
            raise self.error
        return getattr(self.oracle, "answer_dtype", None)

    def answer(self, packed: tuple):
        """The oracle's answers to one share (see :func:`plain_answers`)."""
        if self.error is not None:
            raise self.error
        return plain_answers(self.oracle(unpack_sequences(packed, self.takes_rows)))

    def node(self) -> str:
        """The Ray node this worker runs on."""
        import ray
        return ray.get_runtime_context().get_node_id()

    def answer_shared(self, share_in: tuple, answers_out: tuple):
        """:meth:`answer` for a share the driver wrote into shared memory, ``(block name, layout,
        recipe)`` (:func:`write_arrays`, :func:`packed_arrays`); float64 answers that fit the driver's
        block ``answers_out = (name, capacity)`` are written there (``("shared", shape)`` comes back),
        others come back themselves (``("value", answers)``)."""
        if self.error is not None:
            raise self.error
        name, layout, recipe = share_in
        answers = plain_answers(self.oracle(unpack_sequences(repacked(read_arrays(self._block(name), layout), recipe),
                                                             self.takes_rows)))
        out_name, capacity = answers_out
        if (out_name is not None and isinstance(answers, np.ndarray) and answers.dtype == np.float64
                and answers.nbytes <= capacity):
            write_arrays(self._block(out_name), [answers])
            return "shared", answers.shape
        return "value", answers

    def _block(self, name: str) -> shared_memory.SharedMemory:
        """The driver's block ``name``, attached once (a block it replaced is let go)."""
        blocks = self.__dict__.setdefault("_blocks", {})
        if name not in blocks:
            prefix = name.rsplit("_", 1)[0]
            for old in [key for key in blocks if key.rsplit("_", 1)[0] == prefix]:
                try:
                    blocks.pop(old).close()
                except BufferError:  # a view still held (an oracle's exception keeps its frames): the driver unlinks it
                    pass
            blocks[name] = attach_block(name)
        return blocks[name]


class ParallelOracle:
    """An oracle answered by ``workers`` Ray actors, each holding its own copy built by ``factory()``.

    Used as any oracle: ``ParallelOracle(factory, workers=N)(batch) -> answers``, passed to
    :func:`mhaextract.extract` unchanged; the learner stays in this process (the driver). Each
    batch of sequences (a list of (N_i, d) arrays) is split into contiguous shares of about equal
    token counts, one per worker; the answers are gathered in the order asked, as one float64 array
    (B,) or (B, d_out) (or, when an oracle answers something else, such as ``mpmath.mpf`` in high
    precision, the workers' answers concatenated as a list, for the boundary to validate).

    Parameters
    ----------
    factory : zero-argument callable, picklable (a module-level function, a ``functools.partial``
        of one, a class), returning an oracle. Called once in each worker: a torch module wrapped
        in :class:`~mhaextract.adapters.torch.TorchOracle`, a client of a remote API, ...
    workers : int >= 1, the number of Ray actors (each reserves ``threads_per_worker`` CPUs).
    address : None (default): the Ray instance this process is connected to, or else a new local
        one of the machine's CPUs (at least ``workers * threads_per_worker``), shut down when the
        last ParallelOracle using it closes or is garbage-collected (an oracle passed to ``extract``
        outside a ``with`` block ends with it). ``"auto"`` or ``"ray://host:10001"``: an existing cluster (``ray start``),
        disconnected from when the last ParallelOracle using the connection closes. A process
        already connected to Ray uses that connection.
    threads_per_worker : int >= 1, CPUs each actor reserves and the size of its OpenMP, BLAS and
        torch thread pools (1: one core per worker).
    gpus_per_worker : number >= 0, GPUs each actor reserves (its oracle then sees its own device).
    retries : int >= 0, how many times a failed share is asked again (on the next worker; an actor
        that died is replaced by a new one first) before the failure is raised.
    start_timeout : seconds to wait for the workers to be placed and their oracles built.

    Attributes
    ----------
    workers : int
    answer_dtype : the wrapped oracle's ``answer_dtype`` (``"float32"`` for a float32 torch layer,
        ...), present only when it has one, as on the oracle itself.
    failures : list of (worker, exception) for every share that failed and was asked again.

    Raises
    ------
    ValueError : a bad ``workers``, ``threads_per_worker``, ``gpus_per_worker`` or ``retries``; a
        Ray instance too small for the workers.
    ImportError : Ray is not installed (``pip install 'mhaextract[ray]'``).
    OracleError : ``factory()`` failed in a worker; a share still failed after ``retries``
        retries (the message names the worker and the original exception, chained as its cause).

    Examples
    --------
    With a module-level factory (run as a script: Ray's workers import it; a factory typed into an
    interactive session is sent by value):

    >>> import functools
    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0)
    >>> factory = functools.partial(mx.SimulatedOracle, target)
    >>> with mx.ParallelOracle(factory, workers=2) as oracle:            # doctest: +SKIP
    ...     result = mx.extract(oracle, d=4, heads=2, seed=1)
    >>> bool(mx.compare(result.model, target).max_rel < 1e-12)           # doctest: +SKIP
    True

    Bad sizes are refused before Ray is started:

    >>> mx.ParallelOracle(factory, workers=0)
    Traceback (most recent call last):
    ...
    ValueError: workers must be an integer >= 1, got 0
    """

    #: Handed copies-instances as their rows (:class:`~mhaextract.oracle.queries.CopiesRows`): the
    #: workers are sent two rows a query whatever their oracle, and build the sequences only for an
    #: oracle that does not take the rows itself.
    takes_copies_rows = True

    def __init__(self, factory, workers: int, address: str | None = None, *, threads_per_worker: int = 1,
                 gpus_per_worker: float = 0, retries: int = 2, start_timeout: float = 300.0):
        if not callable(factory):
            raise TypeError(f"factory must be a zero-argument callable returning an oracle, got "
                            f"{type(factory).__name__} (to spread an oracle you have, pass a function that builds it)")
        self.workers = positive_int("workers", workers)
        self.threads_per_worker = positive_int("threads_per_worker", threads_per_worker)
        self.retries = positive_int("retries", retries, minimum=0)
        self.gpus_per_worker = nonnegative_number("gpus_per_worker", gpus_per_worker, "GPUs each worker reserves",
                                                  wrong_type=ValueError)
        start_timeout = positive_number("start_timeout", start_timeout)
        if address is not None and not isinstance(address, str):
            raise ValueError(f"address must be None, 'auto' or a Ray address such as 'ray://host:10001', "
                             f"got {address!r}")
        self.factory, self.address = factory, address
        self.failures: list[tuple[int, BaseException]] = []
        self._actors: list = []
        self._shared, self._local = SharedBlocks(), []
        self._ownership = {"owns": False}  # this oracle counts among the users of a connection it opened
        ray = self._ray = import_ray()
        # close() runs it; so does the garbage collector (or the interpreter's exit) for an oracle
        # never closed: its workers stop and a Ray instance it started ends with its last user
        self._release = weakref.finalize(self, _release, ray, self._actors, self._shared, self._ownership)
        self._connect(address)
        try:
            self._check_room()
            self._worker_class = ray.remote(num_cpus=self.threads_per_worker, num_gpus=self.gpus_per_worker)(
                OracleWorker)
            try:
                self._actors.extend(self._start_worker() for _ in range(self.workers))
            except (TypeError, ValueError) as error:  # serialising the factory
                if "pickl" not in str(error).lower() and "serializ" not in str(error).lower():
                    raise
                raise TypeError(f"factory must be picklable (a module-level function, a functools.partial of "
                                f"one, or a class): {error}") from error
            dtypes = self._start(start_timeout)
            here = ray.get_runtime_context().get_node_id()
            self._local = [node == here for node in ray.get([actor.node.remote() for actor in self._actors])]
        except BaseException:
            self.close()
            raise
        if len(set(dtypes)) > 1:
            self.close()
            raise OracleError(f"the workers' oracles declare different answer_dtype values {dtypes}: factory() "
                              "must build the same oracle in every worker")
        if dtypes[0] is not None:  # as on the oracle itself: absent when it has none
            self.answer_dtype = dtypes[0]

    # -- setting up and closing ------------------------------------------------------------------

    def _connect(self, address) -> None:
        ray = self._ray
        if ray.is_initialized():  # the connection there is, whatever the address
            if _opened_here["users"]:
                self._use_connection()
            return
        options = dict(log_to_driver=False, logging_level="ERROR")
        if address is None:
            # The workers on this machine import what this process imports, from where it found it
            # (mhaextract from a checkout as well as installed; the factory's own module). The
            # machine's CPUs: a later ParallelOracle of more workers, while this one is open, fits.
            ray.init(num_cpus=max(self.workers * self.threads_per_worker, os.cpu_count() or 1),
                     include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": driver_path()}}, **options)
        else:  # closing disconnects; the cluster goes on
            ray.init(address=address, **options)
        self._use_connection()

    def _use_connection(self) -> None:
        _opened_here["users"] += 1
        self._ownership["owns"] = True

    def _check_room(self) -> None:
        """Refuse workers the Ray instance can never place (they would wait forever)."""
        resources = self._ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
        if cpus < self.workers * self.threads_per_worker or gpus < self.workers * self.gpus_per_worker:
            raise ValueError(
                f"workers={self.workers} x threads_per_worker={self.threads_per_worker} (gpus_per_worker="
                f"{self.gpus_per_worker:g}) need {self.workers * self.threads_per_worker} CPUs and "
                f"{self.workers * self.gpus_per_worker:g} GPUs; the Ray instance has {cpus:g} CPUs and {gpus:g} "
                "GPUs: use fewer workers, or add nodes (ray start --address=...)")

    def _start_worker(self):
        return self._worker_class.remote(self.factory, self.threads_per_worker)

    def _start(self, timeout: float) -> list:
        """Every worker's ``answer_dtype``, once its oracle is built; the factory's failure, named."""
        ray = self._ray
        dtypes = []
        for index, actor in enumerate(self._actors):
            try:
                dtypes.append(ray.get(actor.answer_dtype.remote(), timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                raise OracleError(f"worker {index} was not placed and ready after start_timeout={timeout:g} s: "
                                  "the Ray instance's CPUs are held by other actors (close other ParallelOracles) "
                                  "or its nodes are still starting") from None
            except ray.exceptions.RayError as error:
                cause = self._cause(error)
                hint = (" (factory is called with no argument and returns an oracle: pass a function that builds "
                        "the oracle, such as functools.partial(mx.SimulatedOracle, model), not the oracle itself)"
                        if isinstance(cause, TypeError) else "")
                raise OracleError(f"factory() failed in worker {index}: {_describe(cause)}{hint}") from cause
        return dtypes

    def close(self) -> None:
        """Stop the workers; close the Ray connection this oracle opened (a local instance it
        started is shut down, a cluster disconnected from) once no other ParallelOracle uses it. A
        Ray instance or connection the caller opened stays. An oracle never closed is closed so
        when it is garbage-collected."""
        self._release()

    def __enter__(self) -> "ParallelOracle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "local" if self.address is None else repr(self.address)
        name = getattr(self.factory, "__qualname__", None) or repr(self.factory)
        return f"ParallelOracle({name}, workers={self.workers}, address={where})"

    # -- answering ---------------------------------------------------------------------------------

    def __call__(self, batch):
        if not self._actors:
            raise OracleError("this ParallelOracle is closed: build a new one")
        rows = rows_of(batch)
        sequences = rows if rows is not None else batch if isinstance(batch, list) else list(batch)
        if not len(sequences):
            return np.empty(0)
        lengths = (rows.lengths() if rows is not None
                   else np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences)))
        bounds = share_bounds(lengths, self.workers)
        shares = [pack_share(sequences, start, stop) for start, stop in bounds]
        asked = [self._ask(worker, share) for worker, share in enumerate(shares)]
        answers = [self._gather(worker, asked[worker], shares[worker], bounds[worker], len(sequences))
                   for worker in range(len(shares))]
        return _concatenated(answers)

    def _ask(self, worker: int, share: tuple):
        """Send ``share`` to ``worker``: through shared memory where it runs on this machine and the
        share is float64 arrays, else through Ray. Returns ``(reference, shared)``."""
        parts = packed_arrays(share) if self._local[worker] else None
        if parts is None:
            return self._actors[worker].answer.remote(share), False
        arrays, recipe = parts
        block = self._shared.block(worker, "in", sum(-(-a.nbytes // ALIGNMENT) * ALIGNMENT for a in arrays))
        layout = write_arrays(block, arrays)
        out = self._shared.blocks.get((worker, "out"))
        answers_out = (None, 0) if out is None else (out.name, out.size)
        return self._actors[worker].answer_shared.remote((block.name, layout, recipe), answers_out), True

    def _gather(self, worker: int, asked: tuple, share: tuple, bounds: tuple[int, int], total: int):
        """One share's answers, asking again on the next worker (a dead one replaced) when it fails."""
        ray = self._ray
        start, stop = bounds
        reference, shared = asked
        tried = []
        while True:
            try:
                answers = ray.get(reference)
                if shared:
                    answers = self._received(worker, answers)
            except ray.exceptions.RayError as error:
                cause = self._cause(error)
                tried.append((worker, cause))
                self.failures.append((worker, cause))
                if not isinstance(error, ray.exceptions.RayTaskError):  # the actor died or was lost
                    self._replace(worker)
                if len(tried) > self.retries:
                    what = "; ".join(f"worker {w}: {_describe(c)}" for w, c in tried)
                    raise OracleError(
                        f"ParallelOracle: the share of sequences {start}..{stop - 1} of a batch of {total} failed "
                        f"{len(tried)} times (retries={self.retries}): {what}") from cause
                worker = (worker + 1) % len(self._actors)
                reference, shared = self._actors[worker].answer.remote(share), False  # through Ray
                continue
            try:
                count = len(answers)
            except TypeError:
                count = None
            if count != stop - start:
                raise OracleError(
                    f"ParallelOracle: worker {worker}'s oracle returned "
                    f"{'no sequence of answers' if count is None else f'{count} answers'} for its share of "
                    f"{stop - start} sequences ({start}..{stop - 1} of a batch of {total}); one answer per "
                    "sequence is needed")
            return answers

    def _received(self, worker: int, reply: tuple):
        """The answers of a share sent through shared memory (:meth:`OracleWorker.answer_shared`);
        the worker's block for answers made large enough for the next ones."""
        how, value = reply
        if how == "shared":
            return np.array(read_arrays(self._shared.blocks[(worker, "out")], [(0, value)])[0])
        if isinstance(value, np.ndarray) and value.dtype == np.float64:
            self._shared.block(worker, "out", value.nbytes)
        return value

    def _replace(self, worker: int) -> None:
        try:
            self._ray.kill(self._actors[worker])
        except Exception:  # it is dead already
            pass
        self._actors[worker] = self._start_worker()
        self._local[worker] = False  # wherever Ray placed it: its shares go through Ray

    def _cause(self, error):
        """The oracle's own exception inside a Ray error, where Ray kept it."""
        if isinstance(error, self._ray.exceptions.RayTaskError):
            cause = getattr(error, "cause", None)
            if isinstance(cause, BaseException):
                return cause
        return error


def _release(ray, actors: list, shared: SharedBlocks, ownership: dict) -> None:
    """:meth:`ParallelOracle.close`, on what the oracle holds (not on the oracle: the garbage
    collector runs it for an oracle never closed)."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already gone with its Ray instance: nothing to stop
            pass
    actors.clear()
    shared.close()
    if ownership["owns"]:
        ownership["owns"] = False
        _opened_here["users"] -= 1
        if _opened_here["users"] == 0 and ray.is_initialized():
            ray.shutdown()


def _describe(error: BaseException) -> str:
    """``Type: message`` of an exception, first line only (Ray's own errors run to many lines)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _concatenated(answers: list):
    """The shares' answers in order: one float64 array where every share is one of the same trailing
    shape, else one list of every answer (for the boundary to validate as the oracle's own)."""
    if all(isinstance(a, np.ndarray) and a.dtype == np.float64 and a.ndim in (1, 2) for a in answers) and \
            len({a.shape[1:] for a in answers}) == 1:
        return np.concatenate(answers)
    return [value for share in answers for value in share]
