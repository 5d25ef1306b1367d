"""Every answer shape at the oracle boundary is a valid answer or a clear OracleError
(docs/algorithm.md, 'The whole layer: vector outputs and a replacement module'): never an internal exception.

Hypothesis (seeded, derandomized) draws a batch and an answer built from one of many forms
(scalars, 0-d, 1-d and 2-d arrays per sequence, stacked arrays, lists, wrong lengths, nan and
inf, ragged nesting, torch tensors, strings, None, mappings, sets). Each form is labelled here,
independently of the boundary, as valid (with the float64 values it stands for) or not: a valid
answer must come back as exactly those values (read out by the boundary's read-out, recomputed
here), an invalid one must raise OracleError, and nothing else may escape.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhaextract as mx
from mhaextract.oracle.boundary import OracleBoundary, OracleError

torch = pytest.importorskip("torch")

D = 3
NUMERIC = ["float64", "float32", "float16", "int64", "uint8"]


def _container(values: np.ndarray, kind: str):
    """``values`` (B,) or (B, k) handed back as a numpy array, a torch tensor or a list of rows."""
    if kind == "numpy":
        return values
    if kind == "torch":
        return torch.as_tensor(values)
    if kind == "list of python":
        return values.tolist()
    return list(values)  # list of numpy rows (0-d or 1-d)


@st.composite
def batches_and_answers(draw):
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    same = draw(st.booleans())
    if same:
        lengths = [lengths[0]] * len(lengths)
    batch = [np.full((n, D), 0.5) for n in lengths]
    B = len(batch)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    form = draw(st.sampled_from([
        "scalars", "vectors", "per position", "stacked positions", "wrong count", "non-finite", "python scalar",
        "0-d", "string", "strings", "none", "nones", "mapping", "set", "ragged", "mixed ranks", "complex",
        "booleans", "bool vectors", "empty vectors", "huge int", "masked"]))
    dtype = draw(st.sampled_from(NUMERIC))
    kind = draw(st.sampled_from(["numpy", "torch", "list of python", "list of rows"]))
    width = draw(st.integers(1, 4))
    values = rng.standard_normal((B, width)) * 4
    cast = values.astype(dtype) if dtype != "uint8" else np.abs(values).astype(dtype)
    # (answer, expected float64 values per sequence (B,) or (B, width), or None: must be refused)
    if form == "scalars":
        column = cast[:, 0]
        return batch, _container(column, kind), column.astype(np.float64)
    if form == "vectors":
        return batch, _container(cast, kind), cast.astype(np.float64)
    if form == "per position":  # the outputs at every position, one (N_i, width) array per sequence
        answer = [rng.standard_normal((n, width)).astype(dtype if dtype != "uint8" else "float32") for n in lengths]
        if kind == "torch":
            answer = [torch.as_tensor(a) for a in answer]
        return batch, answer, None
    if form == "stacked positions":
        stacked = rng.standard_normal((B, max(lengths), width))
        return batch, torch.as_tensor(stacked) if kind == "torch" else stacked, None
    if form == "wrong count":
        extra = draw(st.sampled_from([-1, 1]))
        rows = values[:, 0].tolist() + [1.0]
        return batch, rows[:B + extra] if B + extra >= 0 else [], None
    if form == "non-finite":
        bad = values.copy() if draw(st.booleans()) else values[:, :1].copy()
        bad[draw(st.integers(0, B - 1)), draw(st.integers(0, bad.shape[1] - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
        return batch, _container(bad if bad.shape[1] > 1 else bad[:, 0], kind), None
    if form == "python scalar":
        return batch, 1.5, None
    if form == "0-d":
        return batch, torch.tensor(1.5) if kind == "torch" else np.array(1.5), None
    if form == "string":
        return batch, "x" * B, None
    if form == "strings":  # decimal strings: numbers, read as float64 exactly as float() reads them
        return batch, [repr(float(v)) for v in values[:, 0]], values[:, 0]
    if form == "none":
        return batch, None, None
    if form == "nones":
        return batch, [None] * B, None
    if form == "mapping":
        return batch, {n: float(v) for n, v in enumerate(values[:, 0])}, None
    if form == "set":
        return batch, set(values[:, 0].tolist()), None
    if form == "ragged":
        return batch, [[1.0, [2.0, 3.0]]] * B, None
    if form == "mixed ranks":
        if B < 2:
            return batch, [np.ones((width, 2))], None
        return batch, [1.0] + [np.ones(width)] * (B - 1), None
    if form == "complex":
        return batch, _container(values + 1j, "numpy" if kind == "torch" else kind), None
    if form == "booleans":
        return batch, _container(values[:, 0] > 0, kind), None
    if form == "bool vectors":
        return batch, _container(values > 0, kind), None
    if form == "empty vectors":
        return batch, _container(np.ones((B, 0)), kind), None
    if form == "huge int":
        return batch, [10**400] * B, None
    return batch, np.ma.masked_array(values[:, 0], mask=[n == 0 for n in range(B)]), None  # masked


@pytest.mark.slow
@settings(derandomize=True, max_examples=120, deadline=None)
@given(batches_and_answers())
def test_every_answer_is_read_or_refused_with_an_oracle_error(case):
    batch, answer, expected = case
    boundary = OracleBoundary(lambda sequences: answer, D)
    try:
        scalars = boundary.ask(batch)
    except OracleError as error:
        assert expected is None, f"a valid answer refused: {error}"
        assert str(error) and error.query is not None and 0 <= error.query < len(batch)
        return
    # anything but OracleError propagates and fails the test
    assert expected is not None, f"an invalid answer read as {scalars!r}"
    assert boundary.queries == len(batch)
    if np.ndim(expected) == 1:
        np.testing.assert_array_equal(scalars, expected)
    else:  # the read-out r^T y, recomputed from the boundary's r
        r = boundary.vectors.readout
        assert r.shape == (expected.shape[1],) and abs(np.linalg.norm(r) - 1) < 1e-12
        np.testing.assert_allclose(scalars, expected @ r, rtol=1e-14, atol=1e-14)
        np.testing.assert_array_equal(OracleBoundary(lambda sequences: answer, D).ask(batch, whole=True), expected)


@settings(derandomize=True, max_examples=50, deadline=None)
@given(batches_and_answers())
def test_high_precision_answers_are_read_or_refused(case):
    """At ``precision=bits`` only mpf and decimal strings are answers; the rest is an OracleError."""
    batch, answer, expected = case
    boundary = OracleBoundary(lambda sequences: answer, D, precision=80)
    try:
        balls = boundary.ask(batch)
    except OracleError:
        return
    assert isinstance(answer, list) and all(isinstance(a, str) for a in answer)
    assert [float(ball.mid()) for ball in balls] == list(expected)


@pytest.mark.parametrize("answers", [
    lambda batch: [np.ones((len(X), 4)) for X in batch],  # every position, a list
    lambda batch: torch.ones(len(batch), len(batch[0]), 4),  # every position, stacked
])
def test_outputs_at_every_position_are_refused_with_what_to_return(answers):
    """The crash of issue 64: an oracle answering each sequence with its outputs at every position
    (one shape for the whole batch) is told to return the final token's output."""
    with pytest.raises(OracleError, match=r"outputs at every position\?\): return the output at the final "
                                          r"token only: out\[-1\] per sequence, out\[:, -1, :\]"):
        mx.extract(answers, d=3, heads=1, seed=0)


def test_a_per_position_scalar_oracle_is_told_when_its_width_follows_the_length():
    """One number per position, (B, N): read as vectors of N numbers until a batch of another length
    shows the width follows the length."""
    boundary = OracleBoundary(lambda batch: np.ones((len(batch), len(batch[0]))), 3)
    boundary.ask([np.zeros((2, 3))] * 2)
    with pytest.raises(OracleError, match=r"vectors of 3 numbers after vectors of 2.*final token only"):
        boundary.ask([np.zeros((3, 3))] * 2)
