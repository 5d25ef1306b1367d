"""A kind of layer added from outside the package (docs/adding-a-learner.md): a toy learner
registered from this file alone runs through ``extract``, the transcript, ``save_extraction``,
``load_model`` / ``load_extraction``, ``verify`` and the CLI, with no edit under src.

The toy: one head in dimension d = 1, bias-free, ``f(X) = v sum_j softmax_j(w x_N x_j) x_j``.
Two queries give it: ``((1), (1))`` answers ``v`` (equal scores average two ones), and
``((0), (1))`` answers ``v sigma(w)``, so ``w = logit(f / v)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

import mhaextract as mx
from mhaextract.checks.base import Check
from mhaextract.run.learner import LEARNERS, Learner, register_learner
from mhaextract.run.result import Result


class OneByOneLearner(Learner):
    """One head in d = 1 from two queries (module docstring)."""

    name = "toy-one-by-one"
    family = "toy"
    model = "one bias-free head in d = 1"
    options = {}
    refusal = "the toy learns one bias-free head in d = 1 from two queries"

    def run(self):
        session = self.session
        if session.request.d != 1 or session.request.max_heads != 1:
            raise ValueError("the toy learner takes d = 1 and one head")
        session.open_transcript({"schedule": self.name, "d": 1, "seed": session.request.seed})
        if session.record is not None:
            session.record.start_run({"schedule": self.name})
        boundary = session.boundary()
        try:
            answers = boundary.ask([np.array([[1.0], [1.0]]), np.array([[0.0], [1.0]])], "the toy's two queries")
        finally:
            session.close()
        v = float(answers[0])
        ratio = float(answers[1]) / v
        w = float(np.log(ratio / (1.0 - ratio)))
        model = mx.MultiHeadAttention(np.array([[[w]]]), np.array([[v]]))
        # d w / d ratio = 1 / (ratio (1 - ratio)): the answers' rounding, amplified
        estimate = 4 * 2.0**-52 / min(ratio * (1 - ratio), 1.0)
        result = Result(model=model, d=1, heads=1, queries=boundary.queries + boundary.replayed,
                        queries_asked=boundary.queries, queries_replayed=boundary.replayed,
                        max_query_length=boundary.max_query_length, token_scale=1.0, error_estimate=estimate,
                        answers_residual=0.0, checks=[Check("ratio", 0 < ratio < 1, ratio, 1.0, "f / v in (0, 1)")],
                        schedule=self.name, seed=session.request.seed, transcript=session.transcript)
        return session.finish(result, "toy extraction")


@pytest.fixture
def toy_registered():
    register_learner(OneByOneLearner)  # the one registry line a new learner needs
    yield OneByOneLearner
    del LEARNERS[OneByOneLearner.name]


TARGET = mx.MultiHeadAttention(np.array([[[0.7]]]), np.array([[-1.3]]))


def oracle(batch):
    """The toy's target, computed here from its definition (not by the package's model)."""
    answers = []
    for X in batch:
        x = np.asarray(X, dtype=np.float64)[:, 0]
        scores = 0.7 * x[-1] * x
        weights = np.exp(scores - scores.max())
        answers.append(-1.3 * float(weights @ x / weights.sum()))
    return np.array(answers)


def test_a_learner_registered_outside_the_package_runs_through_extract_save_load_verify(toy_registered, tmp_path):
    transcript = tmp_path / "toy.sqlite"
    result = mx.extract(oracle, 1, heads=1, seed=3, schedule="toy-one-by-one", transcript=transcript)
    assert result.ok and result.schedule == "toy-one-by-one" and result.queries == result.queries_asked == 2
    assert abs(result.model.W[0, 0, 0] - 0.7) < 1e-12 and abs(result.model.v[0, 0] + 1.3) < 1e-12
    again = mx.extract(oracle, 1, heads=1, seed=3, schedule="toy-one-by-one", transcript=transcript)
    # read back; the resume check re-asks what it can of them (both) and finds the same oracle
    assert (again.queries_asked, again.queries_replayed) == (2, 2)
    assert np.array_equal(again.model.W, result.model.W)
    json_path, _ = mx.save_extraction(result, tmp_path / "toy.json")
    loaded = mx.load_model(json_path)
    assert np.array_equal(loaded.W, result.model.W) and np.array_equal(loaded.v, result.model.v)
    back = mx.load_extraction(json_path)
    assert back.schedule == "toy-one-by-one" and back.queries == 2 and back.ok
    verification = mx.verify(result, oracle, verify_queries=16, seed=0, verify_length=6)
    assert verification.passed and verification.max_relative_error < 1e-12


def test_the_cli_runs_a_registered_learner(toy_registered, tmp_path):
    script = tmp_path / "toy_oracle.py"
    script.write_text("import numpy as np\n\ndef oracle(batch):\n    out = []\n    for X in batch:\n"
                      "        x = np.asarray(X, dtype=float)[:, 0]\n        s = 0.7 * x[-1] * x\n"
                      "        e = np.exp(s - s.max())\n        out.append(-1.3 * float(e @ x / e.sum()))\n"
                      "    return np.array(out)\n")
    out = tmp_path / "cli.json"
    runner = CliRunner()
    from mhaextract.tools.cli import app

    outcome = runner.invoke(app, ["extract", "--oracle", f"{script}:oracle", "--d", "1", "--heads", "1",
                                  "--schedule", "toy-one-by-one", "--out", str(out)])
    assert outcome.exit_code == 0, outcome.output
    assert np.isclose(mx.load_model(out).W[0, 0, 0], 0.7, rtol=0, atol=1e-12)


def test_a_learner_refuses_options_it_does_not_take(toy_registered):
    with pytest.raises(ValueError, match=r"schedule='toy-one-by-one' does not take rank \(an option of"):
        mx.extract(oracle, 1, heads=1, seed=3, schedule="toy-one-by-one", rank=1)
