"""The shifted frame of a key-bias layer (docs/trained-layers.md, Qwen2): from the weights (white box,
a diagnostic, not the extraction), per Qwen2 layer of the zoo the key bias, ``K``'s singular values,
the smallest key-neutral token ``z* = -K^+ k`` and what it makes of the shifted layer (its queries'
bias ``Q z* + b_q`` and its output constant ``V_tot z* + c``, beside the layer's own), and the
smallest output constant along ``z* + null(K)`` for tokens of at most a given norm.

    PYTHONPATH=src python benchmarks/zoo_key_frames.py
    PYTHONPATH=src python benchmarks/zoo_key_frames.py --layers qwen2-d32-h4/0 --norms 10 12 15
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/zoo_key_frames.py --layers qwen2-d32-h4/1 --extract-at 12

``--extract-at NORM``: the layer's float32 row of ``bench_zoo.py`` (``--stages``) with the run's key-neutral
search replaced by that token of the neutral set (white box: what the start and the refinement make of a
shifted frame with a smaller output constant, the search's queries not asked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import minimize_scalar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402


def frame(layer_id: str, norms) -> dict:
    """The table's row (module docstring), and under ``"tokens"`` the neutral tokens it measured."""
    attention = zoo.attention(layer_id, torch.float64)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    weight = {name: getattr(attention, name).weight.detach().numpy() for name in projections}
    bias = {name: getattr(attention, name).bias.detach().numpy() for name in projections[:3]}  # o_proj: none
    heads, kv_heads = attention.config.num_attention_heads, attention.config.num_key_value_heads
    width = weight["k_proj"].shape[0] // kv_heads
    repeat = np.kron(np.kron(np.eye(kv_heads), np.ones((heads // kv_heads, 1))), np.eye(width))  # kv rows to heads
    V_tot, c = weight["o_proj"] @ repeat @ weight["v_proj"], weight["o_proj"] @ repeat @ bias["v_proj"]
    K, k = weight["k_proj"], bias["k_proj"]
    _, singular, right = np.linalg.svd(K)
    z = -np.linalg.pinv(K) @ k
    null = right[K.shape[0]:].T
    A, b = V_tot @ null, -(V_tot @ z + c)

    def along(damping):  # the constant's least squares over null(K), damped towards z*
        y = np.linalg.solve(A.T @ A + damping * np.eye(A.shape[1]), A.T @ b)
        return z + null @ y
    smallest, tokens = {}, {}
    for norm in norms:
        if np.linalg.norm(z) > norm:
            smallest[norm] = np.nan
            continue
        fit = minimize_scalar(lambda t: abs(np.linalg.norm(along(10.0 ** t)) - norm), bounds=(-8, 4), method="bounded")
        tokens[norm] = along(10.0 ** fit.x)
        smallest[norm] = float(np.linalg.norm(V_tot @ tokens[norm] + c))
    return {"layer": layer_id, "key bias": np.linalg.norm(k), "K singular": (singular[0], singular[-1]),
            "|z*|": np.linalg.norm(z), "query bias": (np.linalg.norm(weight["q_proj"] @ z + bias["q_proj"]),
                                                      np.linalg.norm(bias["q_proj"])),
            "constant": (np.linalg.norm(V_tot @ z + c), np.linalg.norm(c)), "smallest": smallest, "tokens": tokens}


def extract_at(layer_id: str, token: np.ndarray) -> None:
    """``--extract-at``: bench_zoo's float32 row with the key-neutral search answering ``token``."""
    import runpy

    import mhaextract.rotary.run as rotary_run
    from mhaextract.rotary.neutral import COARSE_UNIT, NeutralToken

    def given(boundary, c, rng, token_scale, progress=None, window=None, heads=None, coarse=False):
        return NeutralToken(token.copy(), None, boundary.d, -1, np.nan, 0.0, 0, max(boundary.answer_unit, COARSE_UNIT),
                            large_queries=True, self_score_misfit=0.0)
    rotary_run.find_neutral_token = given
    sys.argv = ["bench_zoo.py", "--dtypes", "float32", "--layers", layer_id, "--stages", "--cpu-limit", "900"]
    runpy.run_path(str(Path(__file__).with_name("bench_zoo.py")), run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", nargs="+", default=[i for i in zoo.layer_ids(rotary=True) if i.startswith("qwen2")])
    parser.add_argument("--norms", nargs="+", type=float, default=[8.0, 12.0, 16.0])
    parser.add_argument("--extract-at", type=float, metavar="NORM",
                        help="white box: the float32 extraction from the neutral token of this norm (one layer)")
    arguments = parser.parse_args()
    if arguments.extract_at is not None:
        tokens = frame(arguments.layers[0], [arguments.extract_at])["tokens"]
        if not tokens:
            parser.error(f"--extract-at {arguments.extract_at:g} is below the smallest neutral token's norm")
        extract_at(arguments.layers[0], tokens[arguments.extract_at])
        return
    print("| layer | key bias | K singular values | z* norm | queries' bias (layer's own) | output constant "
          "(layer's own) | " + " | ".join(f"constant at norm <= {n:g}" for n in arguments.norms) + " |")
    print("|---" * (6 + len(arguments.norms)) + "|")
    for layer_id in arguments.layers:
        row = frame(layer_id, arguments.norms)
        print(f"| {row['layer']} | {row['key bias']:.2f} | {row['K singular'][0]:.2f} .. {row['K singular'][1]:.3f} | "
              f"{row['|z*|']:.1f} | {row['query bias'][0]:.1f} ({row['query bias'][1]:.1f}) | "
              f"{row['constant'][0]:.2f} ({row['constant'][1]:.2f}) | "
              + " | ".join("-" if np.isnan(v) else f"{v:.2f}" for v in row["smallest"].values()) + " |", flush=True)


if __name__ == "__main__":
    main()
