"""Every family resumes from a transcript: an interrupted run re-run with the same transcript and
seed reads back what was answered, asks the rest, and ends with the same model, bit for bit; a
different oracle behind the transcript is refused by the resume check (docs/real-layers-and-transcripts.md).

The attention schedules and the low-precision learner have their own tests (tests/test_resume.py,
tests/test_low_precision_whole.py); here the learners that share the session's generic check
(re-asking replayed queries before the first fresh one): the split of whole answers, rotary and
the Transformer."""

from __future__ import annotations

import numpy as np
import pytest

import mhaextract as mx

pytestmark = pytest.mark.slow  # about 8 s together


class Interrupted(RuntimeError):
    pass


class StopsAfter:
    """The oracle of ``target`` that raises after ``calls`` calls (an interruption mid-run)."""

    def __init__(self, target, calls):
        self.oracle, self.calls = mx.SimulatedOracle(target), calls

    def __call__(self, batch):
        if self.calls == 0:
            raise Interrupted("stopped")
        self.calls -= 1
        return self.oracle(batch)


def rotary_run(oracle, transcript, **options):
    return mx.extract(oracle, 8, heads=2, seed=0, positions="rotary", transcript=transcript, batch_size=64,
                      **options)


def transformer_run(oracle, transcript, **options):
    return mx.extract_transformer(oracle, 4, heads=2, seed=1, hidden=4, transcript=transcript, batch_size=64,
                                  **options)


def vector_layer():
    """Heads of width 4 on both sides, whole outputs: a layer the vector learner splits by head."""
    scores = mx.MultiHeadAttention.random(d=8, heads=2, seed=1, bias=True, rank=4, d_out=8)
    rng = np.random.default_rng(101)
    V = np.einsum("hor,hrd->hod", rng.standard_normal((2, 8, 4)), rng.standard_normal((2, 4, 8)))
    return mx.MultiHeadAttention(scores.W, V / 2.0, scores.u, scores.c)


def vector_run(oracle, transcript, **options):
    return mx.extract(oracle, 8, heads=2, seed=0, schedule="vector", transcript=transcript, batch_size=64, **options)


CASES = {
    "vector": (vector_layer, vector_run),
    "rotary": (lambda: mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=0, kv_heads=2), rotary_run),
    "transformer": (lambda: mx.Transformer1L.random(d=4, heads=2, hidden=4, seed=0), transformer_run),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_interrupted_run_resumes_to_the_same_model(tmp_path, name):
    make, run = CASES[name]
    target = make()
    plain = run(mx.SimulatedOracle(target), None)
    transcript = tmp_path / "run.sqlite"
    with pytest.raises(Interrupted):
        run(StopsAfter(target, 6), transcript)
    resumed = run(mx.SimulatedOracle(target), transcript)
    assert resumed.ok and resumed.queries_replayed > 0 and resumed.schedule == plain.schedule == name
    assert resumed.queries == resumed.queries_asked + resumed.queries_replayed
    assert resumed.queries_replayed + resumed.queries_asked - 3 <= plain.queries <= (
        resumed.queries_replayed + resumed.queries_asked)  # at most the resume check's 3 re-asked on top
    for name_ in ("W", "v", "V", "Q", "K", "theta", "b", "c"):
        a, b = getattr(plain.model, name_, None), getattr(resumed.model, name_, None)
        if a is not None:
            assert np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float)), name_


@pytest.mark.parametrize("name", list(CASES))
def test_a_different_oracle_behind_the_transcript_is_refused(tmp_path, name):
    make, run = CASES[name]
    transcript = tmp_path / "run.sqlite"
    with pytest.raises(Interrupted):
        run(StopsAfter(make(), 6), transcript)
    other = make()
    for attribute in ("V", "v"):
        if hasattr(other, attribute) and getattr(other, attribute) is not None:
            setattr(other, attribute, 2.0 * np.asarray(getattr(other, attribute)))
            break
    else:
        other.w = 2.0 * other.w
    with pytest.raises(mx.TranscriptError, match="different oracle"):
        run(mx.SimulatedOracle(other), transcript)
