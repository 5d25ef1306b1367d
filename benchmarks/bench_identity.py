"""Refactor safety: the same seeds give bit-identical models, estimates and query counts.

    PYTHONPATH=src python benchmarks/bench_identity.py                       # the table
    PYTHONPATH=src python benchmarks/bench_identity.py --json records.json   # ... and the records
    PYTHONPATH=src python benchmarks/bench_identity.py --compare benchmarks/results/identity-baseline.json
    PYTHONPATH=src python benchmarks/bench_identity.py --only paper-f64 --compare ...

Small extractions from fixed seeds, in a fixed order, one or more per schedule and family: the
core schedules in float64 (targeted, paper, lean, low-rank with a given and a found rank, the
biased grid, a bound on the heads, the torch backend), float32 answers, 256 bits (paper, lean,
the biased grid), the whole layer, the vector split, bfloat16 and float16 whole answers (and
bfloat16 scalar answers, refused), rotary (float64, a key bias, a sliding window, 128 bits), the
one-layer Transformer (float64, with a residual, 192 bits), a noisy oracle refined, a failed run
(a sliding window outside the model: its long verification and model-class probes), a run resumed
from its transcript, and two torch layers (a causal float64 layer, a bfloat16 layer).

Each record holds the learner's name, every query count, the error estimate and the answers'
residual as ``float.hex``, the answers' format, ``ok``, the causal record, and SHA-256 hashes of
the learned model's parameters (field by field), of the high-precision parts where there are any,
of every quantity whose name says it is an estimate, error, residual, misfit or bound (several
where a result nests others), and of every number the result holds (its wall-clock times
excepted). ``--compare`` re-runs the cases and says field by field whether each is bit-identical
to the stored records; it exits 1 on any difference not named by ``--ignore FIELD`` (a field a
change alters on purpose, such as a learner's new name).

Only the public API is used (``import mhaextract as mx``, attributes of results read with
defaults), and the targets and oracles are written here rather than imported from the tests, so
the command and its cases stay the same before and after a refactor that moves modules and edits
tests. BLAS runs on one thread: a reduction split across threads may round differently.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before numpy loads its BLAS; imported (by a test) it leaves the process alone
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = "1"

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import platform
import sys
import time
import types
import warnings

import numpy as np

import mhaextract as mx

#: Leaves whose value is wall-clock time: left out of every hash.
TIMING_WORDS = ("second", "time", "elapsed", "duration", "wall")
#: Leaf names that mark an estimate of the run's own error.
ESTIMATE_WORDS = ("estimate", "error", "residual", "misfit", "bound")


# ------------------------------------------------------------------------------------------ the cases
def low_rank_values(d: int, heads: int, rank: int, seed: int):
    """Heads of width ``rank`` on both sides, biases, whole outputs (d_out = d): a layer the vector
    schedule splits by head."""
    scores = mx.MultiHeadAttention.random(d=d, heads=heads, seed=seed, bias=True, rank=rank, d_out=d)
    rng = np.random.default_rng(seed + 100)
    V = np.einsum("hor,hrd->hod", rng.standard_normal((heads, d, rank)), rng.standard_normal((heads, rank, d)))
    return mx.MultiHeadAttention(scores.W, V / np.sqrt(rank), scores.u, scores.c)


def key_biased_rotary(d=8, heads=2, width=4, seed=0):
    """Two rotary heads sharing one key and value factor, with query, key and value biases
    (Qwen2): ``Q`` (H, r, d), ``K`` and ``W_V`` (r, d) shared, ``W_O`` (d, H r), rotation on
    consecutive pairs; the value bias and the output bias folded into ``c``."""
    rng = np.random.default_rng(seed)
    Q = rng.normal(size=(heads, width, d)) / np.sqrt(d)
    query_bias = rng.normal(size=(heads, width)) * 0.3
    K = rng.normal(size=(width, d)) / np.sqrt(d)
    key_bias = rng.normal(size=width) * 0.5
    W_V = rng.normal(size=(width, d)) / np.sqrt(d)
    value_bias = rng.normal(size=width) * 0.3
    W_O = rng.normal(size=(d, heads * width)) / np.sqrt(heads * width)
    output_bias = rng.normal(size=d) * 0.1
    theta = 10000.0 ** (-np.arange(0, width, 2) / width)
    V = np.einsum("ohr,rd->hod", W_O.reshape(d, heads, width), W_V)
    c = output_bias + W_O @ np.tile(value_bias, heads)
    return mx.RotaryAttention(Q, np.repeat(K[None], heads, axis=0), np.tile(theta, (heads, 1)), V, c, b=query_bias,
                              key_bias=np.repeat(key_bias[None], heads, axis=0))


def case_targeted_f64():
    target = mx.MultiHeadAttention.random(d=6, heads=3, seed=0, bias=True)
    return mx.extract(mx.SimulatedOracle(target), 6, heads=3, seed=1, progress=False)


def case_paper_f64():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0)
    return mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=1, schedule="paper", progress=False)


def case_lean_f64():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=2)
    return mx.extract(mx.SimulatedOracle(target), 4, max_heads=3, seed=1, schedule="lean", progress=False)


def case_lowrank_f64():
    target = mx.MultiHeadAttention.random(d=8, heads=2, seed=5, bias=True, rank=2)
    return mx.extract(mx.SimulatedOracle(target), 8, heads=2, seed=2, schedule="lowrank", rank=2, bias=True,
                      token_scale="auto", progress=False)


def case_float32():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=3, bias=True)
    return mx.extract(mx.Float32Oracle(target), 4, heads=2, seed=1, progress=False)


def case_paper_256():
    target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    return mx.extract(mx.SimulatedOracle(target, precision=256), 3, heads=2, precision=256, seed=1,
                      schedule="paper", progress=False)


def case_biased_grid_256():
    target = mx.MultiHeadAttention.random(d=3, heads=2, seed=4, bias=True)
    return mx.extract(mx.SimulatedOracle(target, precision=256), 3, heads=2, precision=256, seed=1, progress=False)


def case_whole_layer():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=5, bias=True, d_out=3)
    return mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=2, progress=False)


def case_vector_split():
    target = low_rank_values(d=8, heads=2, rank=4, seed=1)
    return mx.extract(mx.SimulatedOracle(target), 8, heads=2, seed=0, schedule="vector", progress=False)


def case_bfloat16_whole():
    target = mx.MultiHeadAttention.random(d=6, heads=2, seed=1, bias=True, d_out=6)
    # 8 significant bits, rounded to nearest even: bfloat16's answers (the run reads the format from them)
    return mx.extract(mx.RoundedAnswers(mx.SimulatedOracle(target), 8), 6, heads=2, seed=3, progress=False)


def case_rotary_f64():
    layer = mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=0, kv_heads=2)
    return mx.extract(mx.SimulatedOracle(layer), 8, heads=2, seed=0, positions="rotary", progress=False)


def case_rotary_key_bias():
    return mx.extract(mx.SimulatedOracle(key_biased_rotary(seed=0)), 8, heads=2, seed=0, positions="rotary",
                      key_bias=True, progress=False)


def case_max_heads_f64():
    target = mx.MultiHeadAttention.random(d=5, heads=2, seed=6, bias=True)
    return mx.extract(mx.SimulatedOracle(target), 5, max_heads=3, seed=2, progress=False)


def case_noisy_paper():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=7)
    oracle = mx.AdditiveNoise(mx.SimulatedOracle(target), 1e-9, seed=0)
    return mx.extract(oracle, 4, heads=2, seed=1, schedule="paper", answer_error=1e-9, refine=True, progress=False)


def case_lowrank_auto_rank():
    target = mx.MultiHeadAttention.random(d=8, heads=2, seed=5, bias=True, rank=3)
    return mx.extract(mx.SimulatedOracle(target), 8, heads=2, seed=2, rank="auto", progress=False)


def case_biased_grid_f64():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=4, bias=True)
    return mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=1, schedule="paper", bias=True, progress=False)


def case_lean_256():
    target = mx.MultiHeadAttention.random(d=3, heads=2, seed=2)
    return mx.extract(mx.SimulatedOracle(target, precision=256), 3, heads=2, precision=256, seed=1, schedule="lean",
                      progress=False)


def case_paper_torch_backend():
    import torch
    torch.set_num_threads(1)
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0)
    return mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=1, schedule="paper", backend="torch-cpu",
                      progress=False)


def case_bfloat16_scalar():
    """Scalar answers in bfloat16: refused (the heads need whole answers), its probes counted."""
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        return mx.extract(mx.BFloat16Oracle(target), 4, heads=2, seed=7, on_failure="warn", progress=False)


class SlidingWindow:
    """A layer that attends only its last ``window`` tokens: outside the model beyond them."""

    def __init__(self, model, window: int):
        self.model, self.window = model, window

    def __call__(self, batch):
        return self.model([np.asarray(X)[-self.window:] for X in batch])


def case_failed_window():
    """A failed run (``on_failure="warn"``): the long verification and the model-class probes."""
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=8, bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mx.UnreliableExtractionWarning)
        return mx.extract(SlidingWindow(target, 8), 4, heads=2, seed=1, on_failure="warn", progress=False)


def case_resumed_transcript():
    """A run stopped by its query budget, then resumed from its transcript."""
    import tempfile
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=9, bias=True)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "run.sqlite")
        try:
            mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=1, transcript=path, max_queries=200,
                       batch_size=64, progress=False)
        except mx.BudgetExceeded:
            pass
        return mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=1, transcript=path, batch_size=64,
                          progress=False)


def case_float16_whole():
    target = mx.MultiHeadAttention.random(d=4, heads=2, seed=4, bias=True, d_out=4)
    return mx.extract(mx.RoundedAnswers(mx.SimulatedOracle(target), 11), 4, heads=2, seed=1, progress=False)


def case_rotary_window():
    layer = mx.RotaryAttention.random(d=8, heads=1, head_width=4, seed=5, bias=True, window=16)
    return mx.extract(mx.SimulatedOracle(layer), 8, heads=1, seed=1, positions="rotary", progress=False)


def case_rotary_128():
    layer = mx.RotaryAttention.random(d=6, heads=1, head_width=2, seed=4, bias=True)
    return mx.extract(mx.SimulatedOracle(layer, precision=128), 6, heads=1, precision=128, seed=0,
                      positions="rotary", verify_length=32, progress=False)


def case_transformer_residual():
    target = mx.Transformer1L.random(3, 2, 5, seed=4, residual=True)
    return mx.extract_transformer(mx.SimulatedOracle(target), 3, heads=2, hidden=5, residual=True, seed=1,
                                  progress=False)


def case_transformer_192():
    target = mx.Transformer1L.random(3, 2, 4, seed=11)
    return mx.extract_transformer(mx.SimulatedOracle(target, precision=192), 3, heads=2, precision=192, seed=1,
                                  progress=False)


def torch_layer(build):
    """A torch layer built under a fixed seed, run on one thread."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return build(torch).eval()


def causal_self_attention(torch):
    """``nn.MultiheadAttention`` (float64) with a decoder's causal mask: outputs at every position."""

    class CausalSelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)

        def forward(self, X):
            mask = torch.ones(X.shape[1], X.shape[1], dtype=torch.bool).triu(1)
            return self.attention(X, X, X, attn_mask=mask, need_weights=False)[0]

    return CausalSelfAttention()


def case_torch_causal():
    """A real causal layer (torch, float64, whole outputs): the causal record from its positions."""
    return mx.extract(mx.TorchOracle(torch_layer(causal_self_attention)), 8, heads=2, seed=0, progress=False)


def case_torch_bfloat16():
    """A real layer in bfloat16 (torch, whole outputs): the low-precision learner on its own rounding."""
    layer = torch_layer(lambda torch: torch.nn.MultiheadAttention(8, 2, batch_first=True).to(torch.bfloat16))
    return mx.extract(mx.TorchOracle(layer), 8, heads=2, seed=0, progress=False)


def case_transformer_f64():
    target = mx.Transformer1L.random(3, 2, 4, seed=11)
    return mx.extract_transformer(mx.SimulatedOracle(target), 3, heads=2, hidden=4, seed=1, progress=False)


CASES = {
    "targeted-f64": case_targeted_f64,
    "paper-f64": case_paper_f64,
    "lean-f64": case_lean_f64,
    "lowrank-f64": case_lowrank_f64,
    "float32-auto": case_float32,
    "paper-256": case_paper_256,
    "biased-grid-256": case_biased_grid_256,
    "whole-layer": case_whole_layer,
    "vector-split": case_vector_split,
    "bfloat16-whole": case_bfloat16_whole,
    "rotary-f64": case_rotary_f64,
    "rotary-key-bias": case_rotary_key_bias,
    "transformer-f64": case_transformer_f64,
    "max-heads-f64": case_max_heads_f64,
    "lowrank-auto-rank": case_lowrank_auto_rank,
    "biased-grid-f64": case_biased_grid_f64,
    "lean-256": case_lean_256,
    "paper-torch-backend": case_paper_torch_backend,
    "bfloat16-scalar-refused": case_bfloat16_scalar,
    "noisy-paper-refined": case_noisy_paper,
    "failed-window": case_failed_window,
    "resumed-transcript": case_resumed_transcript,
    "float16-whole": case_float16_whole,
    "rotary-window": case_rotary_window,
    "rotary-128": case_rotary_128,
    "transformer-residual": case_transformer_residual,
    "transformer-192": case_transformer_192,
    "torch-causal": case_torch_causal,
    "torch-bfloat16": case_torch_bfloat16,
}


# ------------------------------------------------------------------------------------------- hashing
def _exact_number(value) -> str | None:
    """An exact text of one number (float hex, integer digits, an mpf's or arb's mantissa and
    exponent), or None for what is not a number."""
    if isinstance(value, (bool, np.bool_)):
        return f"b:{int(value)}"
    if isinstance(value, (int, np.integer)):
        return f"i:{int(value)}"
    if isinstance(value, (float, np.floating)):
        return f"f:{float(value).hex()}"
    if isinstance(value, (complex, np.complexfloating)):
        return f"z:{complex(value).real.hex()},{complex(value).imag.hex()}"
    if hasattr(value, "man_exp") and not callable(value.man_exp):  # mpmath.mpf
        return f"m:{value.man_exp}"
    if hasattr(value, "mid") and hasattr(value, "rad") and callable(value.mid):  # flint.arb
        return f"a:{value.mid().man_exp()}+-{value.rad().man_exp()}"
    return None


def _array_digest(array: np.ndarray) -> str | None:
    """SHA-256 of an array: shape and float64 (int64, complex128) bytes, or each entry's exact text."""
    digest = hashlib.sha256(repr(array.shape).encode())
    if array.dtype.kind in "fiub":
        digest.update(np.ascontiguousarray(array, dtype="<f8" if array.dtype.kind == "f" else "<i8").tobytes())
    elif array.dtype.kind == "c":
        digest.update(np.ascontiguousarray(array, dtype="<c16").tobytes())
    elif array.dtype.kind == "O":
        texts = [_exact_number(value) for value in array.ravel()]
        if any(text is None for text in texts):
            return None
        digest.update("\n".join(texts).encode())
    else:
        return None
    return "sha:" + digest.hexdigest()[:16]


def leaves(value, path: str = "", ancestors: set | None = None):
    """``(path, exact text)`` of every number below ``value``: fields of dataclasses and objects
    (public names, sorted), dict entries, list items, arrays whole. Strings, callables, private
    attributes and wall-clock times are left out. An object reached twice is read twice (whether a
    result shares an object or holds a copy does not show); only a cycle is cut."""
    ancestors = set() if ancestors is None else ancestors
    if value is None or isinstance(value, (str, bytes, os.PathLike, type, types.ModuleType, types.FunctionType,
                                           types.MethodType, types.BuiltinFunctionType)):
        return
    name = path.rsplit(".", 1)[-1].lower()
    if any(word in name for word in TIMING_WORDS):
        return
    text = _exact_number(value)
    if text is not None:
        yield path, text
        return
    if isinstance(value, np.ndarray):
        digest = _array_digest(value)
        if digest is not None:
            yield path, digest
            return
    if id(value) in ancestors:
        return
    if isinstance(value, dict):
        children = sorted(((str(key), item) for key, item in value.items()), key=lambda pair: pair[0])
    elif isinstance(value, (list, tuple, np.ndarray)):
        children = [(str(index), item) for index, item in enumerate(value)]
    elif hasattr(value, "__dict__"):
        children = sorted(((key, item) for key, item in vars(value).items() if not key.startswith("_")),
                          key=lambda pair: pair[0])
    elif dataclasses.is_dataclass(value):  # with __slots__
        children = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if not f.name.startswith("_")]
    else:
        return
    ancestors.add(id(value))
    for key, item in children:
        yield from leaves(item, f"{path}.{key}" if path else key, ancestors)
    ancestors.discard(id(value))


def sha(lines) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def model_fields(model) -> dict | None:
    """Each public field of a learned model (W, V, u, c; Q, K, theta, b, key_bias, window; W, O, A,
    w, ...) as the hash of its exact value."""
    if model is None:
        return None
    return {path: text for path, text in leaves(model)}


def exact_parts(result) -> str | None:
    """Hash of the high-precision parts of a result (mpf model, balls), None where it has none."""
    parts = {name: getattr(result, name, None) for name in ("model_hp", "W_balls", "v_balls", "u_balls", "c_ball")}
    lines = [f"{path}={text}" for path, text in leaves({k: v for k, v in parts.items() if v is not None})]
    return sha(lines) if lines else None


def estimate_leaves(result) -> list[str]:
    """``name=value`` of every float (or float array) below the result whose own name says it is an
    estimate, an error, a residual, a misfit or a bound, sorted: by leaf name, not path, so that
    moving a field into another object does not change it, while any change of value does."""
    found = []
    for path, text in leaves(result):
        name = path.rsplit(".", 1)[-1]
        numeric = text.startswith(("f:", "m:", "a:", "sha:"))
        if numeric and not name.isdigit() and any(word in name.lower() for word in ESTIMATE_WORDS):
            found.append(f"{name}={text}")
    return sorted(found)


def every_number(result) -> list[str]:
    """Every number the result holds (times excepted), sorted and without their names: a field
    renamed or moved leaves it alone; a number added, removed or changed does not."""
    return sorted(text for _, text in leaves(result))


def hex_or_none(value) -> str | None:
    return None if value is None else float(value).hex()


def record(name: str, result, seconds: float) -> dict:
    fields = model_fields(getattr(result, "model", None))
    estimates, numbers = estimate_leaves(result), every_number(result)
    verification = getattr(result, "verification_queries", getattr(result, "queries_verification", None))
    if verification is None:  # results that keep the count on their Verification only
        verification = getattr(getattr(result, "verification", None), "queries", None)
    return {
        "case": name,
        "learner": getattr(result, "learner", None) or getattr(result, "schedule", None) or type(result).__name__,
        "queries": getattr(result, "queries", None),
        "queries_asked": getattr(result, "queries_asked", None),
        "queries_replayed": getattr(result, "queries_replayed", None),
        "max_query_length": getattr(result, "max_query_length", None),
        "calibration_queries": getattr(result, "calibration_queries", None),
        "verification_queries": verification,
        "model_class_queries": getattr(result, "model_class_queries", None),
        "error_estimate": hex_or_none(getattr(result, "error_estimate", None)),
        "answers_residual": hex_or_none(getattr(result, "answers_residual", None)),
        "answers": getattr(result, "answer_dtype", None),
        "ok": bool(getattr(result, "ok", False)),
        "causal": getattr(getattr(result, "causal", None), "verdict", None),
        "model": None if fields is None else sha(f"{k}={v}" for k, v in sorted(fields.items())),
        "exact": exact_parts(result),
        "estimates": sha(estimates),
        "numbers": sha(numbers),
        # what the hashes were made of, for the differences' report (not compared)
        "detail": {"model_fields": fields, "estimates": estimates, "numbers_count": len(numbers)},
        "seconds": round(seconds, 2),
    }


#: The fields ``--compare`` checks, in the table's order.
COMPARED = ("learner", "queries", "queries_asked", "queries_replayed", "max_query_length", "calibration_queries",
            "verification_queries", "model_class_queries", "error_estimate", "answers_residual", "answers", "ok",
            "causal", "model", "exact", "estimates", "numbers")


# ------------------------------------------------------------------------------------------- running
def run_case(name: str) -> dict:
    start = time.perf_counter()
    try:
        result = CASES[name]()
    except Exception as error:  # a refactor that breaks a case is a difference, reported, not a crash
        error_result = getattr(error, "extraction", None)
        if error_result is None:
            return {"case": name, "failed": f"{type(error).__name__}: {error}", "seconds": 0.0}
        result = error_result
    return record(name, result, time.perf_counter() - start)


def environment() -> dict:
    """What the bits depend on besides the code: the platform and the numerical libraries' builds."""
    versions = {}
    for package in ("numpy", "scipy", "mpmath", "python-flint", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"python": platform.python_version(), "machine": platform.machine(), **versions}


def _float_text(hex_text) -> str:
    return "-" if hex_text is None else f"{float.fromhex(hex_text):.2e}"


#: The stdout table: (header, cell of a record).
COLUMNS = (("case", lambda r: r["case"]), ("learner", lambda r: r["learner"]), ("queries", lambda r: r["queries"]),
           ("asked", lambda r: r["queries_asked"]), ("replayed", lambda r: r["queries_replayed"]),
           ("longest", lambda r: r["max_query_length"]), ("calibration", lambda r: r["calibration_queries"]),
           ("verification", lambda r: r["verification_queries"]), ("model class", lambda r: r["model_class_queries"]),
           ("error estimate", lambda r: _float_text(r["error_estimate"])),
           ("residual", lambda r: _float_text(r["answers_residual"])), ("answers", lambda r: r["answers"]),
           ("ok", lambda r: "yes" if r["ok"] else "NO"), ("causal", lambda r: r["causal"]),
           ("model", lambda r: r["model"] and r["model"][:8]), ("exact", lambda r: r["exact"] and r["exact"][:8]),
           ("estimates", lambda r: r["estimates"][:8]), ("numbers", lambda r: r["numbers"][:8]),
           ("s", lambda r: f"{r['seconds']:.1f}"))


def table(records: list[dict]) -> str:
    rows = ["| " + " | ".join(head for head, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        if "failed" in r:
            cells = [r["case"], f"FAILED: {r['failed']}"] + [""] * (len(COLUMNS) - 2)
        else:
            cells = ["-" if cell(r) is None else str(cell(r)) for _, cell in COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def differences(before: dict, after: dict) -> list[tuple[str, object, object]]:
    if "failed" in before or "failed" in after:
        same = before.get("failed") == after.get("failed")
        return [] if same else [("failed", before.get("failed"), after.get("failed"))]
    return [(field, before.get(field), after.get(field)) for field in COMPARED if before.get(field) != after.get(field)]


def explain(field: str, before: dict, after: dict) -> str:
    """Which parts of a hashed field moved (model fields, estimates)."""
    if field == "model":
        old, new = before["detail"]["model_fields"] or {}, after["detail"]["model_fields"] or {}
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return "model fields that differ: " + ", ".join(changed)
    if field == "estimates":
        old, new = set(before["detail"]["estimates"]), set(after["detail"]["estimates"])
        return f"only before: {sorted(old - new)}; only after: {sorted(new - old)}"
    if field == "numbers":
        return f"numbers held: {before['detail']['numbers_count']} before, {after['detail']['numbers_count']} after"
    return ""


def compare_table(stored: list[dict], fresh: list[dict], ignored: set[str]) -> tuple[str, int]:
    by_case = {r["case"]: r for r in stored}
    rows = ["| case | " + " | ".join(COMPARED) + " |", "|" + "---|" * (len(COMPARED) + 1)]
    notes, failing = [], 0
    for after in fresh:
        before = by_case.get(after["case"])
        if before is None:
            rows.append(f"| {after['case']} | not in the stored records |" + " |" * (len(COMPARED) - 1))
            failing += 1
            continue
        diffs = {field: (old, new) for field, old, new in differences(before, after)}
        if "failed" in diffs:
            rows.append(f"| {after['case']} | failed: {diffs['failed']} |" + " |" * (len(COMPARED) - 1))
            failing += 1
            continue
        excused = {field for field in diffs if field in ignored or f"{after['case']}.{field}" in ignored}
        cells = ["yes" if field not in diffs else ("no (ignored)" if field in excused else "**no**")
                 for field in COMPARED]
        rows.append(f"| {after['case']} | " + " | ".join(cells) + " |")
        for field, (old, new) in diffs.items():
            notes.append(f"- {after['case']}.{field}: {old!r} -> {new!r} {explain(field, before, after)}".rstrip())
        failing += bool(set(diffs) - excused)
    return "\n".join(rows + ([""] + notes if notes else [])), failing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--compare", help="records of an earlier run (its --json): say field by field what differs")
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="run this case only (repeatable)")
    parser.add_argument("--ignore", action="append", default=[], metavar="[CASE.]FIELD",
                        help="with --compare: report a difference in this field (of every case, or of CASE) without "
                             f"failing on it (repeatable); fields: {', '.join(COMPARED)}")
    args = parser.parse_args(argv)
    for name in args.ignore:
        case, _, field = name.rpartition(".")
        if field not in COMPARED or case not in ("", *CASES):
            parser.error(f"--ignore {name}: expected FIELD or CASE.FIELD, FIELD one of {', '.join(COMPARED)} "
                         f"and CASE one of {', '.join(CASES)}")
    names = [name for name in CASES if args.only is None or name in args.only]
    started = time.perf_counter()
    records = []
    for name in names:
        records.append(run_case(name))
        print(f"{name}: {records[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    print(table(records))
    print(f"\n{len(records)} cases in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": environment(), "records": records}, handle, indent=1)
            handle.write("\n")
    if args.compare:
        with open(args.compare) as handle:
            stored = json.load(handle)
        if stored["environment"] != environment():
            print(f"\nnote: stored records from {stored['environment']}, this run {environment()}")
        text, failing = compare_table(stored["records"], records, set(args.ignore))
        print("\n" + text)
        print(f"\n{len(records) - failing} of {len(records)} cases bit-identical"
              + (f" in every field but {', '.join(sorted(set(args.ignore)))}" if args.ignore else ""))
        return 1 if failing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
