"""The way back into torch, measured: the causal record, a bfloat16 result into its class, rotary
results into theirs (docs/full-layer.md, "Causal or not" and "Put back into the layer's own class").

``OMP_NUM_THREADS=1 python benchmarks/bench_exports.py`` prints three tables (library defaults;
layers built by ``tests/test_real_layers.build`` and ``tests/test_rotary_layers.attention``):

* causal record: per class and dtype, the record of a d = 16, H = 2 layer (seed 3) extracted with
  the defaults, and the replacement ``to_torch(result)`` against the layer (run in float64 from its
  own weights) at every position of 30 tokens;
* bfloat16 GPT-2 (d = 32, H = 4, seed 5): ``to_state_dict(result, like=fresh float64 layer)``: the
  cuts and the loaded layer's error against the exact layer at every position of 100 fresh
  sequences of 1..64 tokens, beside the bfloat16 layer's own;
* rotary: d = 16, H = 2, one key/value head, width 8 (Mistral: window 16; Qwen2: key bias),
  extracted in float64, exported into a fresh layer of its class and run against the original at
  every position of 256 tokens (both exact: sdpa, float64 angles).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mhaextract as mx  # noqa: E402
from mhaextract.adapters.rotary import RotaryLayer  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_state_dict, to_torch  # noqa: E402
from test_real_layers import build  # noqa: E402
from test_replacement_layers import outputs  # noqa: E402
from test_rotary_layers import attention  # noqa: E402


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def causal_rows() -> None:
    print("| layer | dtype | record | prefix reading | every token a key | model at final positions "
          "| to_torch(result) error |")
    print("|---|---|---|---|---|---|---|")
    d, H = 16, 2
    X = torch.as_tensor(np.random.default_rng(0).standard_normal((1, 30, d)))
    for kind, implementation in [("GPT2Attention", "sdpa"), ("OPTAttention", "sdpa"), ("GPT2Attention", "eager"),
                                 ("nn.MultiheadAttention", "eager")]:
        for dtype in (torch.float64, torch.float32):
            layer = build(kind, d, H, seed=3, implementation=implementation).eval().to(dtype)
            result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, progress=False)
            record = result.causal
            with torch.no_grad():
                error = relative(to_torch(result)(X), outputs(layer.double(), X))
            print(f"| {kind} ({implementation}) | {str(dtype)[6:]} | {record.verdict} | {record.prefix_error:.1e} | "
                  f"{record.all_tokens_error:.1e} | {record.final_error:.1e} | {error:.1e} |")


def bfloat16_row(d=32, H=4) -> None:
    layer = build("GPT2Attention", d, H, seed=5, implementation="sdpa").to(torch.bfloat16).eval()
    exact = build("GPT2Attention", d, H, seed=5, implementation="sdpa").eval()
    exact.load_state_dict({key: value.double() for key, value in layer.state_dict().items()})
    result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, progress=False)
    fresh = build("GPT2Attention", d, H, seed=99, implementation="sdpa").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = to_state_dict(result, like=fresh)
    fresh.load_state_dict(state)
    rng = np.random.default_rng(9)
    own = mine = top = 0.0
    with torch.no_grad():
        for n in rng.integers(1, 65, size=100):
            X = torch.as_tensor(rng.standard_normal((1, int(n), d)))
            truth = outputs(exact, X)
            top = max(top, float(truth.abs().max()))
            own = max(own, float((outputs(layer, X.to(torch.bfloat16)).double() - truth).abs().max()))
            mine = max(mine, float((outputs(fresh, X) - truth).abs().max()))
    cuts = [size for _, size in state.report.beyond_gap]
    print(f"\nbfloat16 GPT2Attention d = {d}, H = {H}: record {result.causal.verdict}, estimate "
          f"{result.error_estimate:.1e}, cuts {min(cuts):.1e}.."
          f"{max(cuts):.1e}, report: {state.report.output_error:.1e} in outputs; loaded layer {mine / top:.1e} from "
          f"the exact layer, the bfloat16 layer {own / top:.1e}")


def rotary_rows() -> None:
    print("\n| class | queries | record | loaded class vs original, every position of 256 tokens |")
    print("|---|---|---|---|")
    for kind, options in [("llama", {}), ("mistral", {"sliding_window": 16}), ("qwen2", {"key_bias": True})]:
        layer = attention(kind, seed=0, d=16, H=2, H_kv=1, r=8, **options)
        result = mx.extract(TorchOracle(RotaryLayer(layer, angles="float64")), d=16, heads=2, positions="rotary",
                            schedule="rotary", key_bias=kind == "qwen2", seed=0, progress=False)
        fresh = attention(kind, seed=7, d=16, H=2, H_kv=1, r=8, **options)
        fresh.load_state_dict(to_state_dict(result, like=fresh))
        X = torch.as_tensor(np.random.default_rng(0).standard_normal((2, 256, 16)))
        with torch.no_grad():
            error = relative(RotaryLayer(fresh, angles="float64")(X), RotaryLayer(layer, angles="float64")(X))
        print(f"| {type(layer).__name__} | {result.queries:,} | {result.causal.verdict} | {error:.1e} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    causal_rows()
    bfloat16_row()
    rotary_rows()
