"""The torch backend (numerics/torch.py, oracle TorchSimulatedOracle): the same numbers as numpy.

Runs on CPU here (CUDA when a GPU is present); the truth is the numpy float64 path and the target.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mhaextract as mx  # noqa: E402
from mhaextract.numerics import float64 as numpy_kernel  # noqa: E402
from mhaextract.numerics.torch import TorchKernels  # noqa: E402
from mhaextract.oracle.queries import random_queries  # noqa: E402
from mhaextract.oracle.simulated import TorchSimulatedOracle  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _samples(rng, n, H, K, known=False):
    """F(k) = c + sum_h tau_h l_h / (k + tau_h) at k = 0..K-1 for random (c, m, l), computed here."""
    c = rng.standard_normal(n)
    m = np.sort(rng.uniform(-1.5, 1.5, (n, H)), axis=1) + np.arange(H) * 0.6
    l = rng.standard_normal((n, H))
    k = np.arange(K)[None, :, None]
    tau = np.exp(m)[:, None, :]
    F = c[:, None] + (tau * l[:, None, :] / (k + tau)).sum(axis=2)
    return F, c, m, l


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H, known", [(1, False), (2, False), (3, False), (2, True)])
def test_torch_fit_equals_numpy_fit_and_the_truth(H, known, device):
    rng = np.random.default_rng(H)
    K = 2 * H + 1
    F, c, m, l = _samples(rng, 40, H, K)
    ks = np.arange(K)
    if known:  # both anchors known: the last sample dropped, c given
        F, ks = F[:, :-1], ks[:-1]
    constant = c if known else None
    ours = TorchKernels(device).fit(F, ks, H, constant=constant)
    reference = numpy_kernel.fit(F, ks, H, constant=constant)
    for name in ("c", "log_poles", "labels"):
        np.testing.assert_allclose(getattr(ours, name), getattr(reference, name), rtol=0, atol=1e-9)
    # Both are the truth to the conditioning of the instance (3 digits per head, docs/algorithm.md, 'Numerics in float64
    # and the token scale').
    assert np.abs(ours.log_poles - m).max() < 10.0 ** (-13 + 3 * H)
    ranks, _ = TorchKernels(device).detect_ranks(F, ks, H, constant=constant)
    assert (ranks == H).all()


def test_torch_assemble_equals_numpy():
    rng = np.random.default_rng(0)
    Z, X = rng.standard_normal((5, 5)), rng.standard_normal((5, 5))
    M, labels = rng.standard_normal((3, 5, 5)), rng.standard_normal((3, 5))
    for ours, reference in zip(TorchKernels("cpu").assemble(Z, X, M, labels), numpy_kernel.assemble(Z, X, M, labels)):
        np.testing.assert_allclose(ours, reference, rtol=1e-12, atol=1e-13)


def test_extract_with_the_torch_backend_agrees_with_numpy_and_counts_the_same():
    target = mx.MultiHeadAttention.random(6, 2, seed=3)
    numpy_run = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=4, schedule="paper")
    torch_run = mx.extract(mx.SimulatedOracle(target), 6, heads=2, seed=4, schedule="paper", backend="torch-cpu")
    assert torch_run.queries == numpy_run.queries == 4 * 2 * 36 - 4 + 1 and torch_run.ok
    difference = mx.compare(torch_run.model, numpy_run.model).max_rel
    assert difference <= max(numpy_run.error_estimate, 1e-14)  # agree within the run's own rounding estimate
    assert mx.compare(torch_run.model, target).max_rel < 1e-9


@pytest.mark.parametrize("device", DEVICES)
def test_torch_simulated_oracle_answers_like_the_numpy_one(device):
    target = mx.MultiHeadAttention.random(7, 3, seed=1)
    queries = random_queries(np.random.default_rng(2), 300, 7, 1.6, (1, 10))
    np.testing.assert_allclose(TorchSimulatedOracle(target, device)(queries), mx.SimulatedOracle(target)(queries),
                               rtol=1e-13, atol=1e-14)


def test_backends_are_validated_by_name():
    target = mx.MultiHeadAttention.random(3, 1, seed=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        mx.extract(mx.SimulatedOracle(target), 3, heads=1, backend="jax")
    with pytest.raises(ValueError, match="does not take backend"):
        mx.extract(mx.SimulatedOracle(target), 3, heads=1, schedule="targeted", backend="torch-cpu")
    with pytest.raises(ValueError, match="float64"):
        mx.extract(mx.SimulatedOracle(target, 128), 3, heads=1, precision=128, backend="torch-cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            mx.extract(mx.SimulatedOracle(target), 3, heads=1, backend="torch-cuda")
