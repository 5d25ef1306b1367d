"""Whole answers split by head (docs/algorithm.md, 'Whole answers near the vector bound'): queries
against the vector bound, today's scalar schedules and the scalar bound, on GPT-2-class layers.

    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 64:4 128:8 256:8 --dtypes float64
    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 64:4:8 256:2 --dtypes float64 --schedule auto
    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 768:12 --dtypes float64 float32 --split-only
    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 1024:8:128 4096:32:128 --dtypes float32 float64 --no-fallback
    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 768:12 --dtypes float32 --split-only --diagnose \
        [--exact-split [--split-error 2.4e-5]] [--score-spread 0.1] [--refinement none|scores|full] \
        [--unrefined-split 2 1 1 0]
    OMP_NUM_THREADS=1 python benchmarks/bench_vector.py --cells 256:8 --dtypes float64 --split-only --score-design 3 1

Each cell ``d:H[:r]`` is a ``GPT2Attention`` (sdpa, head width d / H, every bias drawn like its
weights) run as a ``TorchOracle`` in the given dtype; the truth is the layer's own weights in float64
(``to_reduced``). With ``r < d / H`` each head keeps r of its d / H query, key and value coordinates
(the others' weights, biases and output rows zero, its queries scaled by ``sqrt(d / (H r))``: the
scores of a head of width r), so ``W_h``, ``u_h`` and ``V_h`` have rank r and the heads' output
subspaces span ``H r < d`` dimensions. The output error is the largest over every position of 40
fresh sequences of 1..64 tokens, each relative to the largest output of its prefix. "today" is the
default run's count on main before the split (issue 62's table), where it was measured. The runs
name ``schedule="vector"`` unless ``--schedule auto`` (the library's default), which prints its
reason under each row, or ``--schedule targeted`` (the scalar schedule, for the comparison).

``--diagnose`` says, white box (the benchmark's own layer; nothing of it reaches the run), which part
of the model is off: per head the relative errors of W_h, u_h and V_h (matched to the layer's heads by
V_h), and the output error with the learned scores and the true values, the reverse, and one block
learned at a time. The variants change one step of the run to find what limits it: ``--exact-split``
replaces the split's O_h, P_h by the layer's own (every query the same), ``--score-spread`` the log-
ratio RMS the scores' token scale aims at, ``--refinement`` forces a refinement route,
``--unrefined-split`` the design of the start where no refinement follows (the split's second
round's differences per head width and their scale, V_tot's random bases, phase 1's final tokens per
score rank), ``--unrefined-extra`` its phase 2's final tokens; ``--score-design`` the score queries' design where float64 answers refine the scores only.
``--no-fallback``: where the split gives way, the cell ends there with its reason (the queries asked
until then, the time, the peak memory) instead of running the scalar schedules.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import mhaextract as mx  # noqa: E402
from mhaextract.adapters.torch import TorchOracle, to_reduced  # noqa: E402
from mhaextract.vector import learn as vector_learn, learner as vector_learner, scores as vector_scores  # noqa: E402
from mhaextract.vector import split as vector_split  # noqa: E402
from mhaextract.vector import vector_bound  # noqa: E402

#: The defaults' counts on main before the split, whole answers (issue 62).
TODAY = {(64, 4): 36_997, (128, 8): 286_381, (768, 12): 3_847_746}


def gpt2_layer(d: int, heads: int, seed: int, rank: int | None = None):
    """The cell's layer; ``rank`` (default d / H): each head's width (module docstring)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config

    torch.manual_seed(seed)
    layer = GPT2Attention(GPT2Config(n_embd=d, n_head=heads, attn_implementation="sdpa"), layer_idx=0).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        std = float(torch.cat([p.flatten() for n, p in layer.named_parameters() if not n.endswith("bias")]).std())
        for name, parameter in layer.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)
        width = d // heads
        if rank is not None and rank < width:
            dropped = torch.cat([torch.arange(h * width + rank, (h + 1) * width) for h in range(heads)])
            for part in range(3):  # query, key and value columns of c_attn (Conv1D: x @ weight + bias)
                layer.c_attn.weight[:, part * d + dropped] = 0.0
                layer.c_attn.bias[part * d + dropped] = 0.0
            kept = torch.cat([torch.arange(h * width, h * width + rank) for h in range(heads)])
            layer.c_attn.weight[:, kept] *= (width / rank) ** 0.5  # score scale 1/sqrt(r), not 1/sqrt(d/H)
            layer.c_attn.bias[kept] *= (width / rank) ** 0.5
            layer.c_proj.weight[dropped] = 0.0
    return layer.eval()


def position_error(model, truth, d: int, seed: int = 11, norm: float | None = None, count: int = 40,
                   rng: np.random.Generator | None = None) -> float:
    """The largest error at every position of ``count`` fresh sequences of 1..64 tokens, each relative
    to its prefix's largest output; unit-variance tokens, or Gaussian ones of norm about ``norm``
    (drawn from ``rng``, else from ``seed``)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    worst = 0.0
    for n in rng.integers(1, 65, size=count):
        X = rng.standard_normal((int(n), d))
        if norm is not None:
            X *= norm / np.sqrt(d)
        prefixes = [X[:i] for i in range(1, int(n) + 1)]
        expected, got = truth(prefixes), model(prefixes)
        worst = max(worst, float((np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)).max()))
    return worst


def run(d: int, heads: int, dtype: str, seed: int, rank: int | None = None, schedule: str = "vector",
        progress: bool = False) -> dict:
    r = rank or d // heads
    exact = gpt2_layer(d, heads, seed, r)
    layer = exact if dtype == "float64" else gpt2_layer(d, heads, seed, r).float()
    started, oracle = time.perf_counter(), TorchOracle(layer)
    try:
        result = mx.extract(oracle, d, heads=heads, seed=0, schedule=schedule, on_failure="warn", progress=progress)
    except GaveWay as why:
        why.queries, why.seconds = oracle.sequences, time.perf_counter() - started
        raise
    seconds = time.perf_counter() - started
    truth = to_reduced(exact)
    parameters = heads * (2 * d * r - r * r + d + 2 * d * r - r * r) + d
    return {"d": d, "H": heads, "r": r, "dtype": dtype, "schedule": result.schedule, "queries": result.queries,
            "bound": vector_bound(d, heads, r, d), "today": TODAY.get((d, heads)) if r == d // heads else None,
            "scalar_bound": parameters, "reason": result.schedule_reason,
            "error": position_error(result.model, truth, d), "estimate": result.error_estimate, "ok": result.ok,
            "refinement": getattr(result, "refinement", ""), "seconds": seconds, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "model": result.model, "truth": truth}


class GaveWay(RuntimeError):
    """``--no-fallback``: the split gave way (its reason), after ``queries`` at the oracle."""
    queries, seconds = 0, 0.0


def stop_where_the_split_gives_way() -> None:
    """``--no-fallback``: a split that gives way ends the cell with its reason instead of running the
    scalar schedules (at Llama-7B's dimensions those would ask about 7e7 queries)."""
    def give_way(self, reason, boundary=None):
        raise GaveWay(reason)

    vector_learner.VectorLearner.give_way = give_way


def with_exact_split(truth, error: float = 0.0):
    """``output_subspaces`` answering the layer's own O_h (a basis of col V_h) and P_h = O_h^T V_h in the
    order and widths of the split it replaces (white box: what the split's values cost); ``error``:
    each V_h moved inside its subspace and each subspace turned, by that much relative, at random."""
    learned = vector_learn.output_subspaces
    rng = np.random.default_rng(5)

    def exact(*args, **kwargs):
        split = learned(*args, **kwargs)
        O, V = [], []
        for basis, part, rank in zip(split.O, split.P, split.ranks):
            j = int(np.argmin([np.linalg.norm(basis @ part - V_j) for V_j in truth.V]))
            O.append(np.linalg.svd(truth.V[j])[0][:, :rank])
            V.append(truth.V[j])
        if error:
            V = [v + error * (basis @ basis.T) @ rng.standard_normal(v.shape) * np.linalg.norm(v) / np.sqrt(v.size)
                 for basis, v in zip(O, V)]
            O = [np.linalg.qr(basis + error * rng.standard_normal(basis.shape) / np.sqrt(basis.shape[0]))[0]
                 for basis in O]
        split.O, split.P, split._inverse, split._metric = O, [basis.T @ v for basis, v in zip(O, V)], None, None
        return split
    return exact


def diagnose(model, truth, d: int) -> None:
    """Which block of the model is off (module docstring, ``--diagnose``)."""
    H = model.heads
    order = [int(np.argmin([np.linalg.norm(model.V[h] - V) for V in truth.V])) for h in range(H)]
    W, V, u = truth.W[order], truth.V[order], truth.u[order]

    def spread(learned, true):
        errors = [np.linalg.norm(learned[h] - true[h]) / np.linalg.norm(true[h]) for h in range(H)]
        return f"{min(errors):.2g}..{max(errors):.2g}"

    print(f"W_h {spread(model.W, W)}, u_h {spread(model.u, u)}, V_h {spread(model.V, V)}, "
          f"V_tot {np.linalg.norm(model.V.sum(0) - V.sum(0)) / np.linalg.norm(V.sum(0)):.2g}, "
          f"c {np.linalg.norm(model.c - truth.c) / np.linalg.norm(truth.c):.2g} (relative)")
    subspaces = []  # the largest sine of a principal angle between col V_h learned and the layer's
    for h in range(H):
        U, singular, _ = np.linalg.svd(V[h])
        true = U[:, :int((singular > 1e-10 * singular[0]).sum())]
        learned = np.linalg.svd(model.V[h])[0][:, :true.shape[1]]
        subspaces.append(np.linalg.norm(learned - true @ (true.T @ learned), 2))
    print(f"col V_h off the layer's: {min(subspaces):.2g}..{max(subspaces):.2g} (largest sine)")
    learned_bases = [np.linalg.svd(model.V[h])[0][:, :np.linalg.matrix_rank(V[h])] for h in range(H)]
    true_bases = [np.linalg.svd(V[h])[0][:, :np.linalg.matrix_rank(V[h])] for h in range(H)]
    for name, (bases, total) in {"the layer's own subspaces, the split's V_tot": (true_bases, model.V.sum(0)),
                                 "the split's subspaces, the layer's own V_tot": (learned_bases, V.sum(0))}.items():
        stacked = np.linalg.lstsq(np.concatenate(bases, axis=1), total, rcond=None)[0]  # V_h = O_h [O^+]_h V_tot
        starts = np.cumsum([0] + [basis.shape[1] for basis in bases])
        split = [basis @ stacked[start:start + basis.shape[1]] for basis, start in zip(bases, starts)]
        print(f"V_h split again with {name}: {spread(split, V)}")
    outside = []  # the part of W_h's error off the layer's own score subspace col [W_h | u_h] (phase 1's K_h)
    for h in range(H):
        U, singular, _ = np.linalg.svd(np.concatenate([W[h], u[h][:, None]], axis=1), full_matrices=False)
        U = U[:, singular > 1e-10 * singular[0]]
        error = model.W[h] - W[h]
        outside.append(np.linalg.norm(error - U @ (U.T @ error)) / np.linalg.norm(W[h]))
    print(f"W_h off the layer's score subspace: {min(outside):.2g}..{max(outside):.2g} (relative)")
    for name, (Wx, Vx, ux, cx) in {"learned scores, true values": (model.W, V, model.u, truth.c),
                                   "true scores, learned values": (W, model.V, u, model.c),
                                   "learned W_h alone": (model.W, V, u, truth.c),
                                   "learned u_h alone": (W, V, model.u, truth.c)}.items():
        print(f"{name}: {position_error(mx.MultiHeadAttention(Wx, Vx, ux, cx), truth, d):.2g} at every position",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["64:4", "128:8", "256:8"],
                        help="d:H[:r] per cell (r, each head's width: d / H unless given)")
    parser.add_argument("--schedule", default="vector", choices=["vector", "auto", "targeted"],
                        help="the run's schedule (auto: the library's default; its reason is printed under the row; "
                             "targeted: the scalar schedule the split is compared with)")
    parser.add_argument("--dtypes", nargs="+", default=["float64"], choices=["float64", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-only", action="store_true",
                        help="report the split's model even where it fails its checks (the defaults then run the "
                             "scalar schedules instead)")
    parser.add_argument("--diagnose", action="store_true", help="white box: which block of the model is off")
    parser.add_argument("--exact-split", action="store_true", help="white box: the layer's own O_h, P_h for the split's")
    parser.add_argument("--split-error", type=float, default=0.0,
                        help="with --exact-split: the layer's own values and subspaces off by this much, at random")
    parser.add_argument("--score-spread", type=float, help="the log-ratio RMS the scores' token scale aims at")
    parser.add_argument("--refinement", choices=["none", "scores", "full"], help="force a refinement route")
    parser.add_argument("--unrefined-extra", type=float,
                        help="where no refinement follows: phase 2's final tokens beyond d + 1, as a fraction of d "
                             "(the UNREFINED design's second number)")
    parser.add_argument("--score-design", nargs=2, type=float, metavar=("OVERSAMPLE", "EXTRA"),
                        help="the score queries' design of float64 answers where only the scores are refined "
                             "(REFINED_DESIGN['scores'])")
    parser.add_argument("--unrefined-split", nargs=4, type=float, metavar=("DIRECTIONS", "SCALE", "BASES", "PHASE1"),
                        help="where no refinement follows: the split's second round of DIRECTIONS r + 2 differences "
                             "at SCALE times the token scale, V_tot over BASES random bases, phase 1 of the scores "
                             "on at least PHASE1 k final tokens (0: k + 8)")
    parser.add_argument("--no-fallback", action="store_true",
                        help="where the split gives way, print its reason, queries, time and memory, and go on to the "
                             "next cell instead of running the scalar schedules")
    parser.add_argument("--progress", action="store_true",
                        help="show the run's stage on stderr (rich's progress display), for long cells")
    args = parser.parse_args()
    if args.no_fallback:
        stop_where_the_split_gives_way()
    vector_learner.SPLIT_FAILURE_FALLS_BACK = not args.split_only
    if args.score_spread:
        vector_scores.SCORE_SPREAD = args.score_spread
    if args.unrefined_split:
        directions, difference_scale, bases, phase_one = args.unrefined_split
        vector_split.UNREFINED_DIRECTIONS, vector_split.UNREFINED_DIFFERENCE_SCALE = int(directions), difference_scale
        vector_learn.UNREFINED_VALUE_BASES, vector_scores.PHASE_ONE[""] = int(bases), (8, phase_one)
    if args.unrefined_extra is not None:
        vector_learn.UNREFINED = (vector_learn.UNREFINED[0], args.unrefined_extra)
    if args.score_design:
        vector_scores.REFINED_DESIGN["scores"] = tuple(args.score_design)
    if args.refinement:
        vector_learn.REFINE_WORK = float("inf") if args.refinement == "full" else 0.0
        vector_learn.SCORE_REFINE_WORK = 0.0 if args.refinement == "none" else float("inf")
    print("| d, H, r | answers | schedule | queries | vector bound | ratio | today | scalar bound | output error "
          "| estimate | ok | time | peak memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in args.cells:
        parts = [int(part) for part in cell.split(":")]
        if len(parts) not in (2, 3) or (len(parts) == 3 and not 1 <= parts[2] <= parts[0] // parts[1]):
            parser.error(f"cell {cell!r}: d:H or d:H:r with 1 <= r <= d / H")
        d, heads, rank = parts[0], parts[1], (parts[2] if len(parts) == 3 else None)
        for dtype in args.dtypes:
            if args.exact_split:
                vector_learn.output_subspaces = with_exact_split(to_reduced(gpt2_layer(d, heads, args.seed, rank)),
                                                                 args.split_error)
            try:
                row = run(d, heads, dtype, args.seed, rank, args.schedule, args.progress)
            except GaveWay as why:
                cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime
                print(f"| {d}, {heads}, {rank or d // heads} | {dtype} | gave way after {why.queries:,} queries, "
                      f"{why.seconds:.0f} s ({cpu:.0f} s of CPU in the process), "
                      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB: {why} |", flush=True)
                continue
            today = f"{row['today']:,}" if row["today"] else "not measured"
            print(f"| {d}, {heads}, {row['r']} | {dtype} | {row['schedule']} | {row['queries']:,} | {row['bound']:,} "
                  f"| {row['queries'] / row['bound']:.1f} | {today} | {row['scalar_bound']:,} | {row['error']:.2e} "
                  f"| {row['estimate']:.2g} | {row['ok']} | {row['seconds']:.0f} s | {row['peak_gb']:.2f} GB |",
                  flush=True)
            if args.schedule == "auto":
                print(f"  reason: {row['reason']}", flush=True)
            if args.diagnose:
                diagnose(row["model"], row["truth"], d)


if __name__ == "__main__":
    main()
