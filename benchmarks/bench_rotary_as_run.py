"""Trained rotary zoo layers in float64 as their models run them (issue 64's acceptance 2): transformers'
float64 attention with the model's own rotary angles, which it computes in float32 (and, eager, its softmax),
so the answers are float64 numbers accurate to about 1e-7 (docs/trained-layers.md, 'Float64 layers as their
models run them').

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_rotary_as_run.py \\
        --layers llama-d32-h4/0 mistral-d32-h4/0 --implementations sdpa eager

Each row: ``extract(TorchOracle(RotaryLayer(attention)), d, heads=H, seed=0, positions="rotary", schedule=...)``
(``--schedule``: "rotary", the grid route, by default; "auto", the library's defaults, the split first) (plus
``key_bias=True`` for Qwen2) on ``zoo.attention(layer, torch.float64, implementation)``, then the replacement
``to_torch_rotary(result.model)`` judged at every position of the zoo's fresh sequences against the exact layer
(``zoo.exact_layer``: float64 angles, sdpa) and against the layer as run; the layer's own error is the layer as
run against the exact one; the parameter error is ``compare`` against the truth from the weights. A row meets
acceptance 2 where the run is ok and its estimate is at least the output and parameter errors.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mhaextract as mx  # noqa: E402
import zoo  # noqa: E402
from mhaextract.adapters.rotary import RotaryLayer, to_rotary, to_torch_rotary  # noqa: E402
from mhaextract.adapters.torch import TorchOracle  # noqa: E402
from test_replacement_layers import worst_relative_error  # noqa: E402


def row(layer_id: str, implementation: str, schedule: str) -> str:
    layer = RotaryLayer(zoo.attention(layer_id, torch.float64, implementation))  # the model's own angles
    exact = zoo.exact_layer(layer_id, torch.float64)
    d, H = zoo.shape(layer_id)
    cpu = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(TorchOracle(layer), d, heads=H, seed=0, on_failure="warn", progress=False,
                            schedule=schedule, **zoo.extract_options(layer_id))
    cpu = time.process_time() - cpu

    def judged(reference):
        if result.model is None:
            return float("inf")
        return worst_relative_error(to_torch_rotary(result.model), reference, d, zoo.JUDGE_SEQUENCES, zoo.JUDGE_LONGEST)

    own = worst_relative_error(layer, exact, d, zoo.JUDGE_SEQUENCES, zoo.JUDGE_LONGEST)
    parameters = float(mx.compare(result.model, to_rotary(exact.attention)).max_rel) if result.model else float("inf")
    failed = ", ".join(check.name for check in result.failed_checks) or "-"
    return (f"| {layer_id} | {implementation} | {result.schedule} | {'ok' if result.ok else 'FAIL'} | {result.queries:,} | "
            f"{cpu:.0f} | "
            f"{judged(exact):.1e} | {judged(layer):.1e} | {own:.1e} | {parameters:.1e} | {result.error_estimate:.1e} | "
            f"{failed} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=["llama-d32-h4/0"], help='"<model>/<layer>" rotary zoo ids')
    parser.add_argument("--implementations", nargs="+", choices=["sdpa", "eager"], default=["sdpa", "eager"])
    parser.add_argument("--schedule", default="rotary",
                        help="extract's schedule: 'rotary' (the grid route, default) or 'auto' (the library's defaults: "
                             "the split first)")
    args = parser.parse_args()
    print("| layer | attention | schedule | run | queries | CPU s | output error (exact layer) | output error (layer as "
          "run) | layer's own error | parameter error | estimate | failed checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layer_id in args.layers:
        for implementation in args.implementations:
            print(row(layer_id, implementation, args.schedule), flush=True)


if __name__ == "__main__":
    main()
