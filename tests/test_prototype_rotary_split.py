"""benchmarks/prototype_rotary_split.py, the measured prototype of docs/algorithm.md, 'Rotary layers from
whole answers (derived, prototyped)': its closed-form Jacobian of the whole answers against central
differences, and its head groups from value row spaces. The prototype reads the library's internals (the split, the weights' solve): these
tests fail where a change of them breaks it."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest


pytest.importorskip("torch")
_spec = importlib.util.spec_from_file_location(
    "prototype_rotary_split", Path(__file__).resolve().parents[1] / "benchmarks" / "prototype_rotary_split.py")
prototype = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prototype)


def _parameters(rng, heads=4, groups=2, r=4, d=6, d_out=5):
    return dict(Q=rng.normal(size=(heads, r, d)) * 0.4, b=rng.normal(size=(heads, r)) * 0.4,
                K=rng.normal(size=(groups, r, d)) * 0.4, k=rng.normal(size=(groups, r)) * 0.4,
                t=rng.uniform(0.0, 1.0, size=(groups, r // 2)), O=rng.normal(size=(heads, d_out, r)),
                P=rng.normal(size=(heads, r, d)), c=rng.normal(size=d_out))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_whole_answers_jacobian_is_the_derivative_of_the_answers(seed):
    rng = np.random.default_rng(seed)
    p, labels = _parameters(rng), [0, 1, 1, 0]
    X = rng.normal(size=(3, 7, 6))
    f, J = prototype.whole_answers(p, labels, X)
    flat = np.concatenate([p[name].ravel() for name in prototype.NAMES])
    shapes = [p[name].shape for name in prototype.NAMES]

    def answers(x):
        parts, start = {}, 0
        for name, shape in zip(prototype.NAMES, shapes):
            size = int(np.prod(shape))
            parts[name], start = x[start:start + size].reshape(shape), start + size
        return prototype.whole_answers(parts, labels, X, jacobian=False)[0]

    assert np.allclose(answers(flat), f, rtol=0, atol=1e-13)
    step = 1e-6
    numeric = np.stack([(answers(flat + step * e) - answers(flat - step * e)) / (2 * step)
                        for e in np.eye(len(flat))], axis=-1)
    assert np.abs(numeric - J).max() <= 1e-7 * np.abs(J).max()


def test_heads_sharing_a_value_row_space_are_one_group():
    rng = np.random.default_rng(5)
    shared, other = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
    split = SimpleNamespace(P=[shared, other, rng.normal(size=(3, 3)) @ shared, rng.normal(size=(3, 3)) @ other])
    assert prototype.head_groups(split) == [0, 1, 0, 1]
    split.P[2] = split.P[2] + 1e-2 * rng.normal(size=(3, 8))
    assert prototype.head_groups(split) == [0, 1, 2, 1]
