"""Resuming an interrupted run re-pays at most the batch in flight and the resume check.

Every schedule (auto, targeted, lowrank, paper, lean; with and without biases where they apply),
two kinds of interruption: the oracle raises after k answers (the run stops with the exception),
and SIGKILL of a child process mid-run. The answers paid for are counted AT THE ORACLE by the
wrapper below, independently of the library's counters:

    paid(interrupted) + paid(resumed) - paid(uninterrupted) <= batch in flight + resume check

and the resumed run decides what the uninterrupted one did: the same token scale to the bit, the
same model bit for bit. docs/real-layers-and-transcripts.md's table is measured by
``python tests/test_resume.py [case ...]`` (the same cases, printed).
"""

import functools
import json
import os
import signal
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.oracle.transcript import TranscriptError

BATCH = 16
RESUME_CHECK = 3

#: (name, d, H, extract's options, target with biases): every schedule, biases on and off where
#: they apply. auto, targeted and lowrank calibrate their token scale (147 probes).
CASES = {
    "auto": (3, 2, dict(schedule="auto"), True),
    "targeted-bias": (3, 2, dict(schedule="targeted"), True),
    "targeted-no-bias": (3, 2, dict(schedule="targeted", bias=False), False),
    "auto-rank": (6, 2, dict(schedule="auto", rank=2), True),
    "lowrank": (6, 2, dict(schedule="lowrank", rank=2, bias=False), False),
    "lowrank-bias": (6, 2, dict(schedule="lowrank", rank=2, bias=True), True),
    "paper": (3, 2, dict(schedule="paper"), False),
    "paper-bias": (3, 2, dict(schedule="paper", bias=True), True),
    "lean": (3, 2, dict(schedule="lean"), False),
    "lean-auto-scale": (3, 2, dict(schedule="lean", token_scale="auto"), False),
    "paper-128-bits-auto-scale": (2, 1, dict(schedule="paper", precision=128, token_scale="auto"), False),
}


def make_target(name):
    """The case's target, from its own seeded weights (ground truth independent of the library's run)."""
    d, H, options, biased = CASES[name]
    rank = options.get("rank")
    base = mx.MultiHeadAttention.random(d, H, seed=3, rank=rank)
    if not biased:
        return base
    rng = np.random.default_rng(7)
    return mx.MultiHeadAttention(base.W, base.v, rng.standard_normal((H, d)) / np.sqrt(d), 0.3)


def make_oracle(name):
    return mx.SimulatedOracle(make_target(name), CASES[name][2].get("precision"))


class Stop(RuntimeError):
    pass


class PaidOracle:
    """Counts every answer it hands back (what the user pays for). ``stop_after``: the call whose
    answers would pass that many is computed and paid, then lost: the oracle raises (``how="raise"``)
    or the process is killed (``how="kill"``), as a batch in flight. ``log``: a file descriptor the
    count is written to after every call (the parent reads what a killed child paid)."""

    def __init__(self, oracle, stop_after=None, how="raise", log=None):
        self.oracle, self.stop_after, self.how, self.log = oracle, stop_after, how, log
        self.paid = 0
        self.in_flight = 0

    def __call__(self, batch):
        answers = self.oracle(batch)
        self.paid += len(batch)
        if self.log is not None:
            os.write(self.log, f"{self.paid} {len(batch)}\n".encode())
        if self.stop_after is not None and self.paid > self.stop_after:
            self.in_flight = len(batch)
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise Stop(f"stopped after paying {self.paid} answers")
        return answers


def run(name, oracle, **more):
    d, H, options, _ = CASES[name]
    return mx.extract(oracle, d, heads=H, seed=5, batch_size=BATCH, progress=False, on_failure="warn",
                      **options, **more)


def assert_same_decisions(resumed, plain):
    assert resumed.token_scale.hex() == plain.token_scale.hex()
    assert resumed.schedule == plain.schedule
    for name in ("W", "v", "u"):
        assert np.array_equal(getattr(resumed.model, name), getattr(plain.model, name)), name
    assert np.float64(resumed.model.c).tobytes() == np.float64(plain.model.c).tobytes()
    assert resumed.error_estimate == plain.error_estimate and resumed.answers_residual == plain.answers_residual
    if plain.W_balls is not None:  # high precision: the certified balls, midpoint and radius
        for ours, theirs in zip(resumed.W_balls.ravel(), plain.W_balls.ravel()):
            assert ours.mid() == theirs.mid() and ours.rad() == theirs.rad()
    assert resumed.queries_asked + resumed.queries_replayed == resumed.queries


@functools.lru_cache(maxsize=None)
def uninterrupted(name):
    """``(result, answers paid)`` of the case run without interruption nor transcript (once per case)."""
    oracle = PaidOracle(make_oracle(name))
    return run(name, oracle), oracle.paid


def interrupted_by_exception(name, path, stop_after):
    """``(paid by the interrupted run, its batch in flight)``."""
    oracle = PaidOracle(make_oracle(name), stop_after=stop_after)
    try:
        run(name, oracle, transcript=path)
    except Stop:
        return oracle.paid, oracle.in_flight
    raise AssertionError(f"{name} finished before its oracle stopped after {stop_after} answers")


CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import mhaextract as mx
from test_resume import PaidOracle, make_oracle, run
log = os.open({log!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
run({name!r}, PaidOracle(make_oracle({name!r}), {stop_after}, "kill", log), transcript={path!r})
"""


def interrupted_by_sigkill(name, path, stop_after):
    """A child process runs the extraction and is killed (SIGKILL) with a batch in flight, after
    paying for it. ``(paid by the child, its batch in flight)``, read from the child's log."""
    log = f"{path}.paid"
    code = CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), log=log, name=name,
                        stop_after=stop_after, path=str(path))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        "src"), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    paid, in_flight = map(int, open(log).read().split("\n")[-2].split())
    return paid, in_flight


def re_paid(name, path, how, fraction):
    """Interrupt ``name`` after ``fraction`` of its uninterrupted answers, resume it, and return
    ``(re-paid answers, batch in flight, resumed result, uninterrupted result)``."""
    plain, paid = uninterrupted(name)
    stop_after = max(1, int(fraction * paid))
    interrupt = interrupted_by_exception if how == "exception" else interrupted_by_sigkill
    first, in_flight = interrupt(name, path, stop_after)
    second = PaidOracle(make_oracle(name))
    resumed = run(name, second, transcript=path)
    return first + second.paid - paid, in_flight, resumed, plain


# 0.2: inside the calibration of the schedules that calibrate, early in the others; 0.6 in the
# schedule's queries; 0.97 in the last queries (noise probe, polish queries).
@pytest.mark.parametrize("fraction", [0.2, pytest.param(0.6, marks=pytest.mark.slow), 0.97])
@pytest.mark.parametrize("name", list(CASES))
def test_an_oracle_exception_re_pays_at_most_the_batch_in_flight(tmp_path, name, fraction):
    extra, in_flight, resumed, plain = re_paid(name, tmp_path / "run.sqlite", "exception", fraction)
    assert in_flight <= BATCH
    assert in_flight <= extra <= in_flight + RESUME_CHECK
    assert_same_decisions(resumed, plain)
    assert resumed.ok == plain.ok


@pytest.mark.slow
def test_sigkill_mid_run_re_pays_at_most_the_batch_in_flight(tmp_path):
    """A child process killed inside the calibration (about 2 s: the child imports mhaextract)."""
    extra, in_flight, resumed, plain = re_paid("auto", tmp_path / "run.sqlite", "kill", 0.2)
    assert 1 <= in_flight <= BATCH
    assert in_flight <= extra <= in_flight + RESUME_CHECK
    assert_same_decisions(resumed, plain)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.2, 0.6, 0.97])
@pytest.mark.parametrize("name", list(CASES))
def test_sigkill_of_every_schedule_re_pays_at_most_the_batch_in_flight(tmp_path, name, fraction):
    extra, in_flight, resumed, plain = re_paid(name, tmp_path / "run.sqlite", "kill", fraction)
    assert in_flight <= extra <= in_flight + RESUME_CHECK
    assert_same_decisions(resumed, plain)


def test_the_calibration_is_in_the_transcript_and_a_complete_transcript_asks_only_the_check(tmp_path):
    path = tmp_path / "run.sqlite"
    first = run("auto", PaidOracle(make_oracle("auto")), transcript=path)
    with sqlite3.connect(path) as connection:
        sections = dict(connection.execute("SELECT section, count(*) FROM queries GROUP BY section").fetchall())
    assert sections == {"calibration": first.calibration_queries, "run": first.queries - first.calibration_queries}
    again = PaidOracle(make_oracle("auto"))
    offline = run("auto", again, transcript=path)
    assert again.paid == RESUME_CHECK == offline.queries_asked
    assert offline.queries_replayed == first.queries
    assert_same_decisions(offline, first)
    silent = run("auto", PaidOracle(make_oracle("auto"), stop_after=0), transcript=path,
                 resume_check=0)
    assert silent.queries_asked == 0


def test_a_noisy_oracle_resumes_on_the_scale_its_calibration_found(tmp_path):
    """A random-noise oracle answers every call differently: re-asked, the calibration would land
    on another scale in its last bits (so the run's fingerprint, and the transcript, would not
    match). Replayed, the resumed run has the interrupted run's scale to the bit."""
    target = make_target("auto")
    path = tmp_path / "run.sqlite"

    def noisy(seed):
        return mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-9, seed=seed)

    plain = run("auto", noisy(1))
    asked_again = run("auto", noisy(2))
    assert asked_again.token_scale != plain.token_scale  # what re-asking the probes would decide

    for stop_after in (60, 200):  # in the calibration; in the schedule's queries
        path = tmp_path / f"run{stop_after}.sqlite"
        first = PaidOracle(noisy(1), stop_after=stop_after)
        with pytest.raises(Stop):
            run("auto", first, transcript=path)
        second = PaidOracle(noisy(2))  # the same oracle, its noise drawn again
        resumed = run("auto", second, transcript=path)
        assert first.in_flight <= first.paid + second.paid - plain.queries <= first.in_flight + RESUME_CHECK
        assert resumed.ok and mx.compare(resumed.model, target).max_rel < 1e-5
        if stop_after > plain.calibration_queries:  # a complete calibration: replayed, the same decisions
            assert resumed.token_scale.hex() == plain.token_scale.hex()
            assert resumed.calibration.answer_noise == plain.calibration.answer_noise
        else:  # the probes recorded are replayed, the rest asked: a scale as good, from other answers
            assert resumed.token_scale != plain.token_scale
            assert abs(resumed.token_scale / plain.token_scale - 1) < 1e-3


def test_a_noisy_bias_free_layer_resumes_although_its_zero_query_answers_noise_alone(tmp_path):
    """The default schedule learns biases and asks the zero query first, whose exact answer is c = 0
    for a bias-free layer: its recorded and re-asked answers are two draws of the noise, relative to
    each other of order one. The resume check compares them with the largest answer re-asked."""
    target = make_target("paper")  # bias-free
    path = tmp_path / "run.sqlite"

    def noisy(seed):
        return mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-9, seed=seed)

    first = PaidOracle(noisy(1), stop_after=200)
    with pytest.raises(Stop):
        mx.extract(first, 3, heads=2, seed=5, batch_size=BATCH, transcript=path)
    with sqlite3.connect(path) as connection:
        zero = connection.execute("SELECT answer FROM queries WHERE section = 'run' AND id = 0").fetchone()[0]
    assert abs(float.fromhex(zero)) <= 1e-9  # the zero query, recorded: noise alone
    resumed = mx.extract(PaidOracle(noisy(2)), 3, heads=2, seed=5, batch_size=BATCH, transcript=path)
    assert resumed.ok and resumed.queries_replayed > resumed.calibration_queries  # the run section resumed


def test_the_resume_check_tolerates_the_noise_the_calibration_measured_and_not_another_oracle(tmp_path):
    """Noise of 1e-5 (relative to the largest answer, above the check's 1e-6): the recorded and
    re-asked answers of the same oracle differ by the noise, within 30 times the noise the
    calibration measured; another layer's answers differ by far more and are refused."""
    target = make_target("auto")
    d, H, _, _ = CASES["auto"]

    def noisy(layer, seed):
        return mx.AdditiveNoise(mx.SimulatedOracle(layer), 1e-5, seed=seed)

    for other, path in ((None, tmp_path / "same.sqlite"), (mx.MultiHeadAttention.random(d, H, seed=99),
                                                            tmp_path / "other.sqlite")):
        with pytest.raises(Stop):
            run("auto", PaidOracle(noisy(target, 1), stop_after=200), transcript=path)
        again = PaidOracle(noisy(target if other is None else other, 2))
        if other is None:
            resumed = run("auto", again, transcript=path)
            assert resumed.calibration.answer_noise > 1e-6 and resumed.queries_replayed > resumed.calibration_queries
        else:
            with pytest.raises(TranscriptError, match="different oracle"):
                run("auto", again, transcript=path)
        assert again.paid >= RESUME_CHECK


@pytest.mark.parametrize("stop_after", [40, 147])  # inside the calibration; just after it
def test_another_oracle_is_refused_after_an_interrupted_calibration(tmp_path, stop_after):
    path = tmp_path / "run.sqlite"
    with pytest.raises(Stop):
        run("auto", PaidOracle(make_oracle("auto"), stop_after=stop_after), transcript=path)
    before = path.read_bytes()
    d, H, _, _ = CASES["auto"]
    other = PaidOracle(mx.SimulatedOracle(mx.MultiHeadAttention.random(d, H, seed=99)))
    with pytest.raises(TranscriptError, match="different oracle.*calibration"):
        run("auto", other, transcript=path)
    assert other.paid == RESUME_CHECK and path.read_bytes() == before


def test_a_budget_spent_inside_the_calibration_is_saved(tmp_path):
    path = tmp_path / "run.sqlite"
    plain, paid = uninterrupted("auto")
    first = PaidOracle(make_oracle("auto"))
    with pytest.raises(mx.BudgetExceeded):
        run("auto", first, transcript=path, max_queries=100)
    assert first.paid == 100
    second = PaidOracle(make_oracle("auto"))
    resumed = run("auto", second, transcript=path, resume_check=0)
    assert first.paid + second.paid == paid
    assert_same_decisions(resumed, plain)


if __name__ == "__main__":  # the table of docs/real-layers-and-transcripts.md
    import tempfile

    print("| schedule | options | interruption | stopped after | batch in flight | re-paid | resume check |")
    print("|---|---|---|---|---|---|---|")
    for name, (d, H, options, biased) in CASES.items():
        if sys.argv[1:] and name not in sys.argv[1:]:  # python tests/test_resume.py [case ...]
            continue
        for how in ("exception", "kill"):
            for fraction in (0.2, 0.6, 0.97):
                with tempfile.TemporaryDirectory() as folder:
                    extra, in_flight, resumed, plain = re_paid(name, os.path.join(folder, "run.sqlite"), how, fraction)
                    stopped = int(fraction * (plain.queries))
                    assert_same_decisions(resumed, plain)
                    print(f"| {name} | d={d}, H={H}, {json.dumps(options)} | {how} | {stopped} of {plain.queries} | "
                          f"{in_flight} | {extra} | {extra - in_flight} |")
