"""Issue 39 item 4: float32 layers with narrow heads (head width 8), the targeted schedule's defaults.

Ground truth is written here from the GPT-2 layer's own float32 weights, taken to float64: the
layer's rounding of its parameters is not part of the error measured.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import TorchOracle  # noqa: E402
from test_real_layers import build  # noqa: E402


def gpt2_truth(layer) -> mx.MultiHeadAttention:
    """The whole-output model of a ``GPT2Attention`` layer from its weights (Conv1D: ``y = x W + b``):
    scores ``(x_N Wq_h + bq_h) . (x_i Wk_h + bk_h) / sqrt(r)``, so ``W_h = Wk_h Wq_h^T / sqrt(r)`` and
    ``u_h = Wk_h bq_h / sqrt(r)`` (terms without x_i cancel in the softmax); values
    ``(x_i Wv_h + bv_h) P_h`` with ``P_h`` head h's rows of the output projection, so
    ``V_h = (Wv_h P_h)^T`` and ``c = sum_h bv_h P_h + b_proj``."""
    weight = layer.c_attn.weight.detach().double().numpy()
    bias = layer.c_attn.bias.detach().double().numpy()
    projection = layer.c_proj.weight.detach().double().numpy()
    d, H = weight.shape[0], layer.num_heads
    r = d // H
    W, V, u, c = [], [], [], layer.c_proj.bias.detach().double().numpy().copy()
    for h in range(H):
        q, k, v = (slice(part * d + h * r, part * d + (h + 1) * r) for part in range(3))
        rows = projection[h * r:(h + 1) * r]
        W.append(weight[:, k] @ weight[:, q].T / np.sqrt(r))
        u.append(weight[:, k] @ bias[q] / np.sqrt(r))
        V.append((weight[:, v] @ rows).T)
        c += bias[v] @ rows
    return mx.MultiHeadAttention(np.array(W), np.array(V), np.array(u), c)


@pytest.mark.slow
@pytest.mark.parametrize("seed, read_out", [(0, False), (11, False), (11, True), (1, True)])
def test_a_float32_gpt2_layer_with_heads_of_width_8_is_extracted(seed, read_out):
    """d = 64, H = 8, biases at the weights' std: the final units read the score biases u_h through
    a coordinate of 1 beside tokens that aim log-poles of 70, and GPT-2's u is small beside
    ``W_h x`` there: at the float64 length of the final differences (64 token scales) u is read
    3e-6..1e-5 off (W 1e-6; seed 11: 9.8e-6 whole, 9.9e-6 read out). Noisy answers lengthen them
    (docs/algorithm.md, 'Narrow heads'): 0.9e-6..2.1e-6 over 60 runs. The issue
    asks 1e-5; 4e-6 is asserted so that the test tells the two apart (float32 rounding moves with
    the machine's kernels). Whole outputs (what users run) and scalar read-outs; read out, seed 1's
    calibration reads the noise at 1.2e-6 (its bias-dominated answers at the default token norm
    cancel), and with lines sized by that phase 1 missed a head in each of 8 groups (loud); its
    lines are sized by the noise at the run's token scale. The targeted schedule, named: the defaults split
    the whole answers by head (docs/algorithm.md, 'Whole answers near the vector bound'; 80..100 s each here
    on the shared machine, passing this test's bounds), and the narrow heads' reading of u is the targeted
    schedule's."""
    d, H = 64, 8
    layer = build("GPT2Attention", d, H, seed=seed, implementation="sdpa").float()
    truth = gpt2_truth(layer)
    readout = np.random.default_rng(seed).standard_normal(d) if read_out else None
    if read_out:
        truth = truth.readout(readout)
    result = mx.extract(TorchOracle(layer, readout), d, heads=H, seed=seed, on_failure="warn", progress=False,
                        schedule="targeted")
    assert result.ok, [check.name for check in result.failed_checks]
    error = mx.compare(result.model, truth).max_rel
    assert error <= 4e-6
    assert error <= result.error_estimate
