"""The causal record (issue 61, item 6): whether a layer is causal, judged from its outputs at the
earlier positions of queries the run asked, and ``to_torch(result)`` following it.

The truth is the layer itself: its own outputs at every position of fresh sequences.
"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import CausalityWarning, TorchOracle, to_state_dict, to_torch  # noqa: E402
from mhaextract.adapters.torch import ExtractedAttention, ReducedAttention  # noqa: E402
from test_real_layers import build  # noqa: E402
from test_replacement_layers import outputs, worst_relative_error  # noqa: E402


class CausalSelfAttention(torch.nn.Module):
    """nn.MultiheadAttention with the causal mask a decoder gives it."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, X):
        N = X.shape[1]
        mask = torch.ones(N, N, dtype=torch.bool).triu(1)
        return self.attention(X, X, X, attn_mask=mask, need_weights=False)[0]


def extracted(layer, d, H, **options):
    oracle = TorchOracle(layer, **options)
    result = mx.extract(oracle, d, heads=H, seed=0, progress=False)
    assert result.ok and result.queries == oracle.sequences  # the record asks nothing
    return result


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_the_default_replacement_follows_what_the_layer_is(causal):
    d, H = 8, 2
    attention = torch.nn.MultiheadAttention(d, H, batch_first=True, dtype=torch.float64).eval()
    layer = CausalSelfAttention(attention) if causal else attention
    result = extracted(layer, d, H)
    assert result.causal.verdict == ("causal" if causal else "bidirectional"), str(result.causal)
    assert result.summary()["causal"] == result.causal.verdict
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replacement = to_torch(result)  # nothing said: the record decides
    assert isinstance(replacement, ExtractedAttention) and replacement.causal == causal
    assert worst_relative_error(replacement, layer, d) <= 1e-12
    with pytest.warns(CausalityWarning, match="contradicts"):
        wrong = to_torch(result, causal=not causal)  # an explicit choice wins, but not silently
    assert wrong.causal == (not causal) and worst_relative_error(wrong, layer, d) > 1e-2


@pytest.mark.slow  # about 1.8 s each (a GPT-2 layer extracted whole); test_the_default_replacement_follows_... is the fast tier's
@pytest.mark.parametrize("implementation, verdict", [("sdpa", "causal"), ("eager", "bidirectional")])
def test_gpt2_standalone_is_recorded_as_its_path_computes(implementation, verdict):
    """transformers' GPT2Attention called alone masks the future on its sdpa path, not on its eager one."""
    d, H = 8, 2
    layer = build("GPT2Attention", d, H, seed=1, implementation=implementation).eval()
    result = extracted(layer, d, H)
    assert result.causal.verdict == verdict
    assert worst_relative_error(to_torch(result), layer, d) <= 1e-12
    fresh = build("GPT2Attention", d, H, seed=2, implementation=implementation).eval()
    assert fresh.is_causal  # inside GPT2Model: causal on both paths
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(to_state_dict(result, like=fresh))
    told = [w for w in caught if issubclass(w.category, CausalityWarning)]
    assert len(told) == (verdict == "bidirectional")  # the stolen layer attended to every token


def test_a_read_out_run_is_recorded_too():
    d, H = 8, 2
    layer = CausalSelfAttention(torch.nn.MultiheadAttention(d, H, batch_first=True, dtype=torch.float64).eval())
    readout = np.linspace(-1, 1, d)
    result = extracted(layer, d, H, readout=readout)
    assert result.causal.verdict == "causal" and result.causal.prefix_error <= 1e-12
    X = torch.as_tensor(np.random.default_rng(2).standard_normal((1, 20, d)))
    expected = outputs(layer, X) @ torch.as_tensor(readout)
    with torch.no_grad():
        assert float((to_torch(result)(X)[..., 0] - expected).abs().max() / expected.abs().max()) <= 1e-12


def test_without_evidence_there_is_no_record_and_the_default_is_the_final_token_function():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, d_out=4, bias=True)
    result = mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=0)
    assert result.causal is None
    assert isinstance(to_torch(result), ReducedAttention)


def test_evidence_skips_repeated_tokens_and_keeps_few_sequences():
    layer = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64).eval()
    oracle = TorchOracle(layer)
    rng = np.random.default_rng(0)
    token = rng.standard_normal(4)
    oracle([np.stack([token, token, rng.standard_normal(4)])])  # a copies-instance: cannot tell
    assert oracle.position_evidence == []
    oracle([rng.standard_normal((n, 4)) for n in range(3, 30)])
    kept = oracle.position_evidence
    assert 1 <= len(kept) <= 8
    X, out = kept[-1]
    np.testing.assert_array_equal(out, outputs(layer, torch.as_tensor(X[None]))[0].numpy())
