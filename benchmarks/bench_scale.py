"""Scaling benchmark (issue 14): queries, seconds, learner/oracle time, peak memory and error
against d, for full-rank heads (schedule="targeted"; kind "default": the library's defaults,
schedule="auto" with calibration and biases; kinds "paper" and "lean": the grid schedules, float64)
and heads of rank r = d / H (schedule="lowrank", rank=r).

    OMP_NUM_THREADS=1 python benchmarks/bench_scale.py --d 64 128 --heads 2 4 8 [--kinds full low] [--cells d:H:kind ...]
        [--json rows.json] [--rows earlier.json ...] [--project 4096:32:128 ...]

Each cell runs in its own process (peak memory = that process's max resident set, ru_maxrss).
The oracle is a plain vectorised numpy oracle (BLAS matmuls, grouped by length) timed inside the
same run: ``learner s`` = wall seconds of ``extract`` minus the oracle's own seconds. The error is
the normwise relative error of the canonical heads after alignment (``mx.compare(...).max_rel``).
Prints a markdown table and fits the exponents of time and memory in d (least squares on logs,
per (H, kind)).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

import mhaextract as mx


class NumpyOracle:
    """f(X) for a batch, one BLAS matmul per step, sequences grouped by length; times itself."""

    def __init__(self, model: mx.MultiHeadAttention):
        H, d, _ = model.W.shape
        self.H, self.d = H, d
        self.W_cat = np.ascontiguousarray(model.W.transpose(2, 0, 1).reshape(d, H * d))  # x_N -> (W_h x_N)_h
        self.v = model.v
        self.u = np.zeros((H, d)) if model.u is None else np.asarray(model.u, dtype=np.float64)
        self.c = 0.0 if model.c is None else float(model.c)
        self.seconds = 0.0
        self.count = 0

    def __call__(self, batch):
        started = time.perf_counter()
        lengths = np.array([len(X) for X in batch])
        out = np.empty(len(batch))
        for length in np.unique(lengths):
            index = np.flatnonzero(lengths == length)
            X = np.stack([batch[i] for i in index])  # (B, N, d)
            queries = (X[:, -1] @ self.W_cat).reshape(len(index), self.H, self.d) + self.u  # W_h x_N + u_h
            scores = np.matmul(X, queries.transpose(0, 2, 1))  # (B, N, H)
            scores -= scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=1, keepdims=True)
            out[index] = (weights * (X @ self.v.T)).sum(axis=(1, 2)) + self.c
        self.seconds += time.perf_counter() - started
        self.count += len(batch)
        return out


def target(d: int, H: int, rank: int | None, seed: int, bias: bool = False) -> mx.MultiHeadAttention:
    """``MultiHeadAttention.random``; ``bias``: with score biases and an output constant (the "lowb"
    cells, docs/algorithm.md, 'Biases: affine scores and an output constant' and 'Low-rank heads')."""
    model = mx.MultiHeadAttention.random(d, H, seed=seed, rank=rank)
    if not bias:
        return model
    rng = np.random.default_rng(seed + 100)
    return mx.MultiHeadAttention(model.W, model.v, rng.standard_normal((H, d)) / np.sqrt(d), 0.3)


def cell(d: int, H: int, kind: str, seed: int = 0) -> dict:
    rank = None if kind in ("full", "default", "paper", "lean") else d // H
    model = target(d, H, rank, seed, bias=kind == "lowb")
    oracle = NumpyOracle(model)
    check = mx.SimulatedOracle(model)([np.ones((3, d))])[0]
    assert abs(oracle([np.ones((3, d))])[0] - check) <= 1e-12 * max(1.0, abs(check))
    oracle.seconds, oracle.count = 0.0, 0
    # "default": the library's defaults (schedule="auto": calibration, biases, targeted); "full":
    # schedule="targeted" named (the targeted schedule fixed; its defaults, calibration and biases, as "auto"'s);
    # "paper", "lean": the grid schedules
    # (float64: H <= 3 is their envelope, the error column shows what they reach); "low": schedule="lowrank",
    # rank=d/H, the bias-free model at token scale d ** 0.25 (named alone, lowrank learns biases and calibrates);
    # "lowb": bias=True on a target with biases.
    options = {"default": {}, "full": dict(schedule="targeted"), "paper": dict(schedule="paper"),
               "lean": dict(schedule="lean"),
               "lowb": dict(schedule="lowrank", rank=rank, bias=True, token_scale=d ** 0.25)}.get(
                   kind, dict(schedule="lowrank", rank=rank, bias=False, token_scale=d ** 0.25))
    started = time.perf_counter()
    result = mx.extract(oracle, d, heads=H, seed=seed + 1, on_failure="warn", progress=False, **options)
    seconds = time.perf_counter() - started
    label = kind if rank is None else f"r={rank}" + (", biases" if kind == "lowb" else "")
    return dict(d=d, H=H, kind=label, queries=result.queries, oracle_count=oracle.count,
                paper=4 * H * d * d - 2 * H + 1, bound=information_bound(d, H, rank, kind in ("default", "lowb")),
                seconds=seconds, oracle_s=oracle.seconds,
                learner_s=seconds - oracle.seconds, ratio=(seconds - oracle.seconds) / oracle.seconds,
                estimate=float(result.error_estimate),
                peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                error=float(mx.compare(result.model, model).max_rel) if result.model is not None else float("inf"),
                ok=result.ok)


def information_bound(d: int, H: int, rank: int | None, bias: bool) -> int:
    """The numbers that determine the model: per head ``W_h`` (``d^2``, or ``2dr - r^2`` at rank r),
    ``v_h`` (d) and with biases ``u_h`` (d), and the constant c: one answer cannot carry more than
    one of them, so no schedule asks fewer queries."""
    scores = d * d if rank is None else 2 * d * rank - rank * rank
    return H * (scores + (2 if bias else 1) * d) + int(bias)


def table(rows: list[dict]) -> str:
    lines = ["| d | H | heads | queries (measured) | / paper | / bound | seconds | oracle s | learner / oracle | "
             "peak memory | rel. error | checks |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = r.get("bound") or information_bound(r["d"], r["H"], None if "r=" not in r["kind"] else
                                                    int(r["kind"].split("=")[1].split(",")[0]),
                                                    r["kind"] == "default" or "biases" in r["kind"])
        lines.append(f"| {r['d']} | {r['H']} | {r['kind']} | {r['queries']:,} | {r['queries'] / r['paper']:.3f} | "
                     f"{r['queries'] / bound:.2f} | "
                     f"{r['seconds']:.1f} | {r['oracle_s']:.1f} | {r['ratio']:.2f} | {r['peak_gb']:.2f} GB | "
                     f"{r['error']:.1e} | {'ok' if r['ok'] else 'FAILED'} |")
    return "\n".join(lines)


def exponents(rows: list[dict]) -> list[str]:
    out = []
    for key in sorted({(r["H"], r["kind"].split("=")[0]) for r in rows}):
        group = [r for r in rows if (r["H"], r["kind"].split("=")[0]) == key]
        if len({r["d"] for r in group}) < 2:
            continue
        logd = np.log([r["d"] for r in group])
        fit = {name: np.polyfit(logd, np.log([r[name] for r in group]), 1)[0]
               for name in ("seconds", "learner_s", "oracle_s", "peak_gb", "queries")}
        label = {"full": "full rank", "r": "rank d/H"}.get(key[1], key[1])
        out.append(f"H = {key[0]}, {label}: " +
                   ", ".join(f"{name} ~ d^{value:.2f}" for name, value in fit.items()))
    return out


def projection(rows: list[dict], cells: list[str]) -> list[str]:
    """Queries, seconds and peak memory of larger cells ``d:H:r`` (with biases) projected from the
    measured rank-d/H cells: least squares of ``log(y) = a + b log d + c log H`` for y = queries /
    information bound, learner and oracle seconds per query, and peak memory (this benchmark's
    numpy oracle: a real layer's own cost per query differs)."""
    measured = [r for r in rows if r["kind"].startswith("r=")]
    if len({r["d"] for r in measured}) < 3 or len({r["H"] for r in measured}) < 2:
        return ["(a projection needs rank-d/H cells at 3 or more d and 2 or more H)"]
    design = np.array([[1.0, np.log(r["d"]), np.log(r["H"])] for r in measured])
    columns = {"queries / bound": [r["queries"] / r.get("bound", information_bound(r["d"], r["H"], r["d"] // r["H"],
                                                                                  "biases" in r["kind"]))
                                   for r in measured],
               "learner s / query": [r["learner_s"] / r["queries"] for r in measured],
               "oracle s / query": [r["oracle_s"] / r["queries"] for r in measured],
               "peak GB": [r["peak_gb"] for r in measured]}
    fits = {name: np.linalg.lstsq(design, np.log(values), rcond=None)[0] for name, values in columns.items()}
    out = [f"fitted on {len(measured)} rank-d/H cells (d {min(r['d'] for r in measured)}..{max(r['d'] for r in measured)}): "
           + "; ".join(f"{name} ~ d^{fit[1]:.2f} H^{fit[2]:.2f}" for name, fit in fits.items()), "",
           "| d | H | r | information bound | queries | learner s | oracle s | learner / oracle | peak memory |",
           "|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        d, H, r = (int(value) for value in cell.split(":"))
        at = {name: float(np.exp(fit @ [1.0, np.log(d), np.log(H)])) for name, fit in fits.items()}
        bound = information_bound(d, H, r, True)
        queries = bound * at["queries / bound"]
        learner, oracle = queries * at["learner s / query"], queries * at["oracle s / query"]
        out.append(f"| {d} | {H} | {r} | {bound:,} | {queries:.2e} | {learner:,.0f} | {oracle:,.0f} | "
                   f"{learner / oracle:.2f} | {at['peak GB']:.1f} GB |")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--heads", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--kinds", nargs="*", default=["full", "low"])
    parser.add_argument("--cells", nargs="*", default=[],
                        help="extra cells d:H:kind (kind full, low, lowb, default, paper or lean)")
    parser.add_argument("--cell", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--rows", nargs="*", default=[], help="rows of earlier runs (their --json files) to table "
                        "and project with this run's")
    parser.add_argument("--project", nargs="*", default=[], help="cells d:H:r to project from the rank-d/H rows")
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(int(args.cell[0]), int(args.cell[1]), args.cell[2])))
        return
    plan = [(d, H, kind) for d in args.d for H in args.heads for kind in args.kinds]
    plan += [(int(d), int(H), kind) for d, H, kind in (c.split(":") for c in args.cells)]
    rows = [row for path in args.rows for row in json.load(open(path))]
    for d, H, kind in plan:
        done = subprocess.run([sys.executable, __file__, "--cell", str(d), str(H), kind], capture_output=True, text=True)
        if done.returncode:
            print(f"d={d} H={H} {kind}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    print()
    print("\n".join(exponents(rows)))
    if args.project:
        print()
        print("\n".join(projection(rows, args.project)))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
