"""Queries inside the range the layer's dtype can answer (issue 64, float16 headroom).

A float16 layer's scores overflow (65504) at tokens the calibration's ladder and the saturated
start ask on purpose; its answer is then not finite. That is evidence of overflow, not of a broken
oracle: the calibration leaves those probes out, the start asks nearer keys, every query counted.

The simulated layers here overflow by construction: ``Overflowing`` answers NaN wherever a score
``x_i^T (W_h x_N + u_h)`` of its float64 truth exceeds a limit (as a float16 layer's would its
range), else the RoundedLayer's rounded answer. The torch layers are float16 GPT-2 and BERT on the
eager path (scores computed in float16) with weights of std 0.2 and 0.25, judged against their
own exact float64 copy at every position.
"""

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.run.calibration import calibrate
from mhaextract.oracle.boundary import OracleBoundary, OracleError
from mhaextract.oracle.transcript import RUN, Transcript
from test_low_precision_whole import RoundedLayer


class Overflowing(RoundedLayer):
    """A RoundedLayer whose answer is NaN where any score exceeds ``limit`` in magnitude."""

    def __init__(self, d, heads, bits, seed, limit):
        super().__init__(d, heads, bits, seed)
        self.limit, self.nonfinite = limit, 0

    def __call__(self, batch):
        answers = super().__call__(batch)
        for n, X in enumerate(batch):
            if max(np.abs(X @ (W @ X[-1] + u)).max() for W, u in zip(self.W, self.u)) > self.limit:
                answers[n] = np.nan
                self.nonfinite += 1
        return answers


def test_overflowed_answers_come_back_nan_counted_and_unrecorded(tmp_path):
    """``ask(..., overflow=True)``: a non-finite answer is NaN (the whole vector), counted in
    queries and overflowed, left out of the answers' bits and of the transcript; without it, an
    OracleError as before."""
    def layer(batch):
        answers = np.stack([X.sum(axis=0) for X in batch]).astype(np.float16).astype(np.float64)
        answers[[n for n, X in enumerate(batch) if np.abs(X).max() > 100]] = np.inf
        return answers
    batch = [np.full((2, 3), 0.5 + n) for n in range(4)] + [np.full((2, 3), 1000.0)]
    with pytest.raises(OracleError, match="answer to query 4, output 0 of 3, is inf"):
        OracleBoundary(layer, 3).ask(batch, whole=True)
    record = Transcript(tmp_path / "t.sqlite", dict(d=3, max_heads=1, seed=1, precision=None, schedule="paper",
                                                   bias=False, rank=None, token_scale="auto"))
    record.start_run({"queries": 5})
    boundary = OracleBoundary(layer, 3, transcript=record.section(RUN))
    answers = boundary.ask(batch, whole=True, overflow=True)
    assert np.isnan(answers[4]).all() and np.isfinite(answers[:4]).all()
    np.testing.assert_array_equal(answers[:4], layer(batch[:4]))
    assert (boundary.queries, boundary.overflowed) == (5, 1)
    assert boundary.stats.precision_name == "float16"  # read from the finite answers alone
    assert record.answered_in(RUN) == 4  # the overflowed query is asked again on resume
    record.close()


def test_the_calibration_leaves_overflowed_probes_out_and_keeps_its_token_scale():
    """The ladder's top rungs overflow: the same token scale as the layer that does not, the
    overflow scale reported; the probes counted at the oracle."""
    plain, capped = RoundedLayer(6, 2, 11, seed=1), Overflowing(6, 2, 11, seed=1, limit=200.0)
    free = calibrate(OracleBoundary(plain, 6), 6, np.random.default_rng(0))
    boundary = OracleBoundary(capped, 6)
    found = calibrate(boundary, 6, np.random.default_rng(0))
    assert capped.nonfinite > 0 and boundary.overflowed == capped.nonfinite and found.queries == capped.sequences
    assert found.token_scale == free.token_scale and free.overflow_scale is None
    assert found.overflow_scale is not None and found.overflow_scale > 4 * found.token_scale
    assert "overflowed" in found.message


def test_a_non_finite_answer_at_the_smallest_probe_is_no_overflow():
    """NaN for every two-token query, the smallest included: a broken oracle, named as one."""
    layer = RoundedLayer(6, 2, 11, seed=1)

    def broken(batch):
        answers = layer(batch)
        answers[[n for n, X in enumerate(batch) if len(X) == 2]] = np.nan
        return answers
    with pytest.raises(OracleError, match=r"answer to query 17 \(length 2\) is not finite: .* smallest token norm "
                                          r".* the oracle cannot answer"):
        calibrate(OracleBoundary(broken, 6), 6, np.random.default_rng(0))


@pytest.mark.slow  # 5 s
@pytest.mark.parametrize("bits, limit", [(8, 2e-2), (11, 3e-3)])
def test_a_layer_whose_scores_overflow_is_extracted_with_every_query_counted(bits, limit):
    """Scores beyond 200 overflow: the calibration's top rungs and the start's saturated keys
    (400 token scales) among them. The run backs off and extracts the layer as one that does not
    overflow; every answer, NaN ones included, is counted at the oracle."""
    oracle = Overflowing(6, 2, bits, seed=1, limit=200.0)
    result = mx.extract(oracle, 6, heads=2, seed=3)
    assert result.ok and oracle.nonfinite > 1000
    assert result.queries == oracle.sequences
    error = mx.compare(result.model, oracle.truth).max_rel
    assert error <= limit and result.error_estimate >= error / 10


def float16_layer(kind, d, heads, std, seed):
    """A float16 layer on the eager path (its scores in float16), every weight and bias N(0, std^2),
    and its exact float64 copy (the same rounded weights)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_real_layers import build, with_std
    low = with_std(build(kind, d, heads, seed=seed, implementation="eager").eval(), std, seed).to(torch.float16)
    exact = build(kind, d, heads, seed=seed, implementation="eager").eval().double()
    exact.load_state_dict({key: value.double() for key, value in low.state_dict().items()})
    return low, exact


@pytest.mark.slow
@pytest.mark.parametrize("kind, d, heads, std", [
    ("GPT2Attention", 32, 2, 0.2),  # the layer: 'answer to query 129/130 ... is nan' in the calibration
    ("BertSelfAttention", 32, 2, 0.25),
])  # d = 64 and 128 (29..1,108 non-finite answers): benchmarks/bench_low_precision.py --whole --std, docs/low-precision.md
def test_a_float16_layer_with_large_weights_is_as_close_to_its_exact_layer_as_it_is_itself(kind, d, heads, std):
    """The low-precision acceptance (docs/low-precision.md): the replacement's outputs at every
    position of fresh sequences of 1..32 tokens are no further from the exact float64 layer than
    the float16 layer's own; the layer answered some queries with non-finite numbers."""
    import torch
    from mhaextract.adapters.torch import TorchOracle, to_torch
    from test_replacement_layers import outputs
    low, exact = float16_layer(kind, d, heads, std, seed=d + heads)
    oracle = TorchOracle(low)
    result = mx.extract(oracle, d, heads=heads, seed=0, progress=False)
    assert result.ok and result.answer_dtype == "float16" and result.queries == oracle.sequences
    replacement = to_torch(result.model, causal=False)  # a bare eager layer attends to every position
    rng = np.random.default_rng(9)
    own = mine = 0.0
    for n in rng.integers(1, 33, size=60):
        X = torch.as_tensor(rng.standard_normal((1, int(n), d)))
        truth = outputs(exact, X)
        own = max(own, float((outputs(low, X.half()).double() - truth).abs().max()))
        mine = max(mine, float((outputs(replacement, X) - truth).abs().max()))
    assert mine <= own, (mine, own)
