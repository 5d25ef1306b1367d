"""Head widths the rotary run reads itself (docs/algorithm.md, 'Rotary attention: positions, grouped heads and
sliding windows', 'Assembly'): random layers whose heads are wide, ``H r > d / 2`` up to ``r = d``, no ``rank=``.

    OMP_NUM_THREADS=1 python benchmarks/bench_rotary_widths.py [--layers 40] [--seed 7]

Draws ``--layers`` layers ``RotaryAttention.random(d, H, r, kv_heads, bias, d_out=d)`` (d in 6..16, H in 1..3,
r even with ``H r > d / 2``; one or H key/value heads; the draw seeded by ``--seed``), answering alternately
rounded to float32's 24 bits (``RoundedAnswers``) and in float64 (whole outputs), extracts each with the
defaults plus ``positions="rotary"``, and prints a row per layer: the widths read, passed or failed (and which
checks), the error against the layer (``compare(...).max_rel``), the queries and the seconds; then per answer
format how many layers passed within 1e-12 (float64) or 1e-5 (float32) of the layer. A layer that passes its
checks farther off is marked SILENT.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import mhaextract as mx

LIMITS = {"float32": 1e-5, "float64": 1e-12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
    rng = np.random.default_rng(args.seed)
    passed = {dtype: [0, 0] for dtype in LIMITS}
    print("| d | H | r | kv | bias | answers | widths read | ok | failed checks | error | queries | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for index in range(args.layers):
        d = int(rng.choice([6, 8, 10, 12, 16]))
        H = int(rng.choice([1, 2, 3]))
        r = int(rng.choice([w for w in range(2, d + 1, 2) if H * w > d // 2]))
        kv = int(rng.choice([k for k in (1, H) if H % k == 0]))
        bias = bool(rng.random() < 0.5)
        dtype = list(LIMITS)[index % 2]
        layer = mx.RotaryAttention.random(d=d, heads=H, head_width=r, seed=int(rng.integers(100)), kv_heads=kv,
                                          bias=bias, d_out=d)
        started = time.perf_counter()
        result = mx.extract(mx.RoundedAnswers(layer, bits=24) if dtype == "float32" else layer, d=d, heads=H,
                            positions="rotary", schedule="rotary", seed=0, on_failure="warn")
        seconds = time.perf_counter() - started
        error = float(mx.compare(result.model, layer).max_rel) if result.model is not None else np.inf
        within = result.ok and error <= LIMITS[dtype]
        passed[dtype][0] += within
        passed[dtype][1] += 1
        failed = ", ".join(check.name for check in result.failed_checks) or "-"
        print(f"| {d} | {H} | {r} | {kv} | {bias} | {dtype} | {result.diagnostics.get('widths')} | {result.ok} | "
              f"{failed} | {error:.1e} | {result.queries} | {seconds:.1f} |" + (" SILENT" if result.ok and not within
                                                                                 else ""), flush=True)
    print()
    for dtype, (good, total) in passed.items():
        print(f"{dtype}: {good} of {total} layers within {LIMITS[dtype]:.0e} of the layer")


if __name__ == "__main__":
    main()
