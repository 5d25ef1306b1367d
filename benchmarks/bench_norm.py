"""Attention sublayers of pre-norm blocks (docs/norm.md; docs/algorithm.md, 'Attention behind a norm:
the sublayer of a block').

    python benchmarks/bench_norm.py            # d = 16 cases and the refusals (a few minutes)
    python benchmarks/bench_norm.py --large    # adds GPT-2's, ViT's, Llama's, BertAttention's sublayers at d = 64, H = 4
    python benchmarks/bench_norm.py --large --case "BertAttention (post-LN) d=64"   # the cases whose name has it
    python benchmarks/bench_norm.py --defaults # the norm='auto' cases run without norm= (the defaults)
    python benchmarks/bench_norm.py --float32-floor   # a float32 BertAttention against its weights in float64
    python benchmarks/bench_norm.py --float32-diagnosis  # where the float32 BertAttention's replacement errs (d = 16)
    python benchmarks/bench_norm.py --float32-diagnosis --large  # the same at d = 64, H = 4, the library's fit only
    python benchmarks/bench_norm.py --float32-diagnosis --large --fit-factor 20   # ... with 20 answers per parameter
    python benchmarks/bench_norm.py --float32-diagnosis --tie-factor 0   # ... the fit alone, no refinement at near ties
    python benchmarks/bench_norm.py --qwen2-neutral-tokens  # where a Qwen2 sublayer's neutral tokens lie (white-box)
    python benchmarks/bench_norm.py --read-out [--case "d=32 H=4"]  # GPT-2 sublayers read out by r (one number a query)
    python benchmarks/bench_norm.py --as-run [--large] [--defaults]  # Llama sublayers as transformers runs them, and in float32
    python benchmarks/bench_norm.py --as-run --polish-factor 3 --value-factor 1 --margin 0.9  # ... other choices

Each case: a block with trained-like weights (projections N(0, 1/d), gamma ~ 1 +- 0.2, beta ~ 0.05,
biases on, eps the class's default; tests/norm_blocks.py), its attention sublayer wrapped by
``TorchOracle(attention_sublayer(block))`` and extracted with ``mx.extract(oracle, d, heads=H,
seed=1, norm="auto", on_failure="warn")``. Reported: the norm found, eps's relative error, ok or the
first failed check, queries measured at the raw layer, the queries of the library's defaults on the
same attention without the norm (``mx.extract(TorchOracle(attention), d, heads=H, seed=1)``), and
the replacement's error: the largest ``|model - y| / |y|`` (inf norms) at every position of 100 fresh
sequences of lengths 1..64 with token norms log-uniform in 1e-3..1e3, against the block's own
forward in float64 (the reading, causal or not, the run's causal record found). BertAttention's
"attention without the norm" is its self-attention and output projection (no residual, no norm).
Llama's sublayer (``LlamaDecoderLayer``: RMSNorm, rotary attention with two key/value heads, the
residual) is extracted with ``positions="rotary"`` too, and judged in float64 throughout
(``RotarySublayerFloat64``: its weights, a float64 RMSNorm and float64 angles; transformers'
``LlamaRMSNorm`` and rotary embedding compute in float32 whatever the dtype); its "attention without
the norm" is ``mx.extract(TorchOracle(float64_layer(layer.self_attn)), d, heads=H, seed=1,
positions="rotary")``. The block as transformers runs it (``attention_sublayer(layer)``: its answers
carry float32's rounding) and the block in float32 are ``--as-run``'s, judged against that exact sublayer.
Mistral's (``MistralDecoderLayer``, a sliding window of 16 tokens) likewise.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mhaextract as mx  # noqa: E402
from mhaextract.adapters.normed import attention_sublayer  # noqa: E402
from mhaextract.adapters.torch import TorchOracle  # noqa: E402
from mhaextract.adapters.rotary import float64_layer  # noqa: E402
from mhaextract.models.normed import PostNormAttention  # noqa: E402
from mhaextract.norm import learn, post_norm  # noqa: E402
from norm_blocks import (  # noqa: E402
    RotarySublayerFloat64, RMSSublayer, bert_attention, bert_layer, every_position_error, gpt2_block, rotary_block,
    post_norm_truth, raw_sequences, read_out_error, read_out_truth, rotary_truth, vit_layer,
)

#: The options a rotary sublayer is extracted with, beside norm= (and its baseline with).
ROTARY = {"positions": "rotary"}


class BertSelfAttentionAndProjection(torch.nn.Module):
    """BertAttention without its residual and norm: the self-attention, then the output projection."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, X):
        return self.layer.output.dense(self.layer.self(X)[0])


def cases(large: bool):
    """(name, sublayer module, d, H, declared norm, the attention alone or None, the true eps[, options])."""
    out = []
    for d in [16] + ([64] if large else []):
        llama = rotary_block(d, 4, kv_heads=2)
        out.append((f"Llama sublayer d={d} H=4 (2 key/value heads) float64", RotarySublayerFloat64(llama), d, 4, "auto",
                    float64_layer(llama.self_attn), llama.input_layernorm.variance_epsilon, ROTARY))
    mistral = rotary_block(16, 4, kv_heads=2, family="mistral", sliding_window=16)
    out.append(("Mistral sublayer d=16 H=4 (2 key/value heads, window 16) float64", RotarySublayerFloat64(mistral), 16,
                4, "auto", float64_layer(mistral.self_attn), mistral.input_layernorm.variance_epsilon, ROTARY))
    for d, H in [(16, 2), (16, 4), (24, 2)] + ([(64, 4)] if large else []):
        block = gpt2_block(d, H)
        out.append((f"GPT-2 sublayer d={d} H={H} float64", attention_sublayer(block), d, H, "auto", block.attn,
                    block.ln_1.eps))
        if d == 16 and H == 2 or d == 64:
            out.append((f"GPT-2 sublayer d={d} H={H} float32", attention_sublayer(gpt2_block(d, H).float()), d, H,
                        "auto", gpt2_block(d, H).attn.float(), block.ln_1.eps))
    vit = vit_layer(16, 2)
    out.append(("ViT sublayer d=16 H=2 float64", attention_sublayer(vit), 16, 2, "auto", vit.attention,
                vit.layernorm_before.eps))
    if large:
        vit = vit_layer(64, 4)
        out.append(("ViT sublayer d=64 H=4 float64", attention_sublayer(vit), 64, 4, "auto", vit.attention,
                    vit.layernorm_before.eps))
        out.append(("ViT sublayer d=64 H=4 float32", attention_sublayer(vit_layer(64, 4).float()), 64, 4, "auto",
                    vit_layer(64, 4).attention.float(), vit.layernorm_before.eps))
    rms = RMSSublayer(16, 2)
    out.append(("RMSNorm + MHA + residual d=16 H=2 float64", rms, 16, 2, "auto", None, 1e-6))
    out.append(("the same, declared norm='layernorm'", rms, 16, 2, "layernorm", None, 1e-6))
    out.append(("a whole GPT2Block (with its MLP) d=16 H=2", gpt2_block(16, 2), 16, 2, "auto", None, 1e-5))
    bert = bert_attention(16, 2)
    out.append(("BertAttention (post-LN) d=16 H=2 float64", attention_sublayer(bert), 16, 2, "auto",
                BertSelfAttentionAndProjection(bert), 1e-12))
    out.append(("BertAttention (post-LN) d=16 H=2 float32", attention_sublayer(bert_attention(16, 2).float()), 16, 2,
                "auto", BertSelfAttentionAndProjection(bert_attention(16, 2).float()), 1e-12))
    if large:
        bert = bert_attention(64, 4)
        out.append(("BertAttention (post-LN) d=64 H=4 float64", attention_sublayer(bert), 64, 4, "auto",
                    BertSelfAttentionAndProjection(bert), 1e-12))
        out.append(("BertAttention (post-LN) d=64 H=4 float32", attention_sublayer(bert_attention(64, 4).float()), 64,
                    4, "auto", BertSelfAttentionAndProjection(bert_attention(64, 4).float()), 1e-12))
    out.append(("BertAttention declared norm='layernorm'", attention_sublayer(bert_attention(16, 2)), 16, 2,
                "layernorm", None, 1e-12))
    out.append(("a whole BertLayer (with its MLP) d=16 H=2", bert_layer(16, 2), 16, 2, "auto", None, 1e-12))
    return out


def baseline_queries(attention, d, H, options=None, schedule=None) -> str:
    """The queries ``extract`` asks of the same attention without norm and residual: with the defaults
    (whole answers of plain attention: the split of docs/algorithm.md) or with ``schedule`` named."""
    if attention is None or schedule is not None and options:
        return "-"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return str(mx.extract(TorchOracle(attention), d, heads=H, seed=1, on_failure="warn",
                                  **({"schedule": schedule} if schedule else {}), **(options or {})).queries)
    except Exception as error:  # the baseline's own failure is reported, not hidden
        return f"failed ({type(error).__name__})"


def run_case(name, module, d, H, declared, attention, eps, options=None, defaults=False) -> dict:
    started = time.perf_counter()
    oracle = TorchOracle(module)
    named = {**({} if defaults and declared == "auto" else {"norm": declared}), **(options or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = mx.extract(oracle, d, heads=H, seed=1, on_failure="warn", **named)
    seconds = time.perf_counter() - started
    row = {"case": name, "norm": getattr(result, "norm", None) or "-", "ok": result.ok, "queries": result.queries,
           "first failed check": result.failed_checks[0].name if result.failed_checks else "-",
           "eps error": abs(result.eps - eps) / eps if np.isfinite(getattr(result, "eps", np.nan)) else np.nan,
           "baseline": baseline_queries(attention, d, H, options),
           "scalar baseline": baseline_queries(attention, d, H, options, schedule="targeted"), "seconds": seconds,
           "error": np.nan, "module error": np.nan}
    if result.model is not None and result.schedule == "norm":
        # a rotary model is a decoder's, read causally (RotaryAttention.at_position)
        causal = result.causal is not None and result.causal.verdict == "causal" or options == ROTARY
        reference = module.double() if hasattr(module, "double") else module
        row["error"] = every_position_error(result.model, reference, raw_sequences(np.random.default_rng(11), d, 100),
                                            causal)
        # the replacement a user loads: the same judge on mx.to_torch(result)
        row["module error"] = every_position_error(exact_reading(mx.to_torch(result)), reference,
                                                   raw_sequences(np.random.default_rng(11), d, 100), causal)
    return row


def float32_floor() -> None:
    """The float32 layer's own rounding, the floor of any replacement judged at every position of the
    benchmark's sequences: its exact function (``post_norm_truth`` of its weights, in float64) against it."""
    print("| BertAttention float32 | its weights evaluated in float64, against it at every position |")
    print("|---|---|")
    for d, H in ((16, 2), (64, 4)):
        layer = bert_attention(d, H).float()
        module = attention_sublayer(layer)
        exact = post_norm_truth(layer.double())

        def float32(X, module=module):
            return module(X.float()).double()

        error = every_position_error(exact, float32, raw_sequences(np.random.default_rng(11), d, 100), False)
        print(f"| d={d} H={H} | {error:.1e} |", flush=True)


def _matched_heads(model, exact) -> list[int]:
    """The fitted heads in the exact model's order (the permutation closest in W; ``W_h`` is identifiable)."""
    return list(min(itertools.permutations(range(exact.heads)),
                    key=lambda order: float(np.abs(model.W[list(order)] - exact.W).max())))


def float32_diagnosis(large: bool, fit_factor: float | None = None, tie_factor: int | None = None) -> None:
    """The float32 BertAttention d = 16, H = 2 of the ``--float32-floor`` table (``large``: d = 64, H = 4, the
    library's fit only), extracted as ``run_case`` does with the post-norm fit's answers per parameter
    (``post_norm.FIT_FACTOR``, the library's 5, then more, each run to convergence: ``FLOOR_UNITS = 0``),
    judged against its weights in float64 at every position of the benchmark's sequences; then with parts of
    the exact model put in: the whole attention (the fitted eps, gamma and beta kept), its scores (W, u)
    beside the fitted values, or its values beside the fitted scores. Last, at the default fit's worst
    position, each head's two largest scores (one head's nearly tie): their margin and the fitted scores'
    errors there. ``fit_factor``: only that many answers per parameter, run to convergence. ``tie_factor``: the
    refinement at near ties with ``post_norm.TIE_FACTOR`` set to it (0: none, the fit alone)."""
    d, H = (64, 4) if large else (16, 2)
    exact = post_norm_truth(bert_attention(d, H).float().double())
    sequences = raw_sequences(np.random.default_rng(11), d, 100)

    def judged(model) -> tuple[float, int, int]:
        worst = (0.0, 0, 0)
        for index, X in enumerate(sequences):
            expected, got = exact.every_position(X, False), model.every_position(X, False)
            error = np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)
            worst = max(worst, (float(error.max()), index, int(error.argmax())))
        return worst

    print("| layer | answers per parameter (FIT_FACTOR) | stop | queries | error estimate | W relative error "
          "| error at every position | with the exact attention | exact scores, fitted values "
          "| fitted scores, exact values |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    saved = post_norm.FIT_FACTOR, post_norm.FLOOR_UNITS
    saved_tie = post_norm.TIE_FACTOR, post_norm.TIE_UNIT
    if tie_factor is not None:
        post_norm.TIE_FACTOR, post_norm.TIE_UNIT = tie_factor, (post_norm.TIE_UNIT if tie_factor else np.inf)
    worst_default = None
    try:
        runs = ((saved[0], saved[1]),) + (() if large else ((20, 0.0), (80, 0.0)))
        for factor, floor in runs if fit_factor is None else ((fit_factor, 0.0),):
            post_norm.FIT_FACTOR, post_norm.FLOOR_UNITS = factor, floor
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                oracle = TorchOracle(attention_sublayer(bert_attention(d, H).float()))
                result = mx.extract(oracle, d, heads=H, seed=1, norm="auto", on_failure="warn")
            model, A, B = result.model, result.model.attention, exact.attention
            order = _matched_heads(A, B)
            W_error = float(np.abs(A.W[order] - B.W).max() / np.abs(B.W).max())

            def part(W, u, V, c, model=model):
                return PostNormAttention(model.eps, mx.MultiHeadAttention(W, V, u, c), model.gamma, model.beta)

            error = judged(model)
            worst_default = worst_default or (error, model, order)
            parts = [judged(part(B.W, B.u, B.V, B.c))[0], judged(part(B.W, B.u, A.V[order], A.c))[0],
                     judged(part(A.W[order], A.u[order], B.V, B.c))[0]]
            stop = f"RMS misfit {floor:g} units" if floor else "converged"
            print(f"| d={d} H={H} | {factor:g} | {stop} | {result.queries} | {result.error_estimate:.1e} | "
                  f"{W_error:.1e} | {error[0]:.1e} | " + " | ".join(f"{value:.1e}" for value in parts) + " |",
                  flush=True)
    finally:
        post_norm.FIT_FACTOR, post_norm.FLOOR_UNITS = saved
        post_norm.TIE_FACTOR, post_norm.TIE_UNIT = saved_tie
    (error, index, position), model, order = worst_default
    X, A, B = sequences[index], model.attention, exact.attention
    for h in range(H):
        scores = X @ B.W[h] @ X[position] + X @ B.u[h]
        fitted = X @ A.W[order[h]] @ X[position] + X @ A.u[order[h]]
        top = np.argsort(-scores)[:2]
        print(f"worst position (error {error:.1e}), head {h}: two largest scores {scores[top[0]]:.6g}, "
              f"{scores[top[1]]:.6g} (margin {scores[top[0]] - scores[top[1]]:.3g}; keys of norms "
              f"{np.linalg.norm(X[top[0]]):.3g}, {np.linalg.norm(X[top[1]]):.3g}; query token "
              f"{np.linalg.norm(X[position]):.3g}), fitted scores' errors {fitted[top[0]] - scores[top[0]]:.2e}, "
              f"{fitted[top[1]] - scores[top[1]]:.2e}")


def qwen2_neutral_tokens() -> None:
    """Why a Qwen2 decoder layer's sublayer is refused (docs/algorithm.md, 'Rotary attention behind an RMSNorm'):
    from the weights (white-box), on layers with trained-like weights, the norm of the least-norm token whose
    queries vanish (``Q'_h x_q + b_h = 0``, where the key-neutral search starts) and of the least-norm
    key-neutral token (``K'_h z* + k_h = 0``), gamma folded in, against the ball's radius sqrt(d)."""
    print("| Qwen2 decoder layer | sqrt(d) | query-neutral token x_q | key-neutral token z* |")
    print("|---|---|---|---|")
    for d in (16, 32, 64):
        for seed in range(3):
            model = rotary_truth(rotary_block(d, 4, kv_heads=2, seed=seed, family="qwen2")).attention
            query = -np.linalg.lstsq(model.Q.reshape(-1, d), model.b.reshape(-1), rcond=None)[0]
            key = -np.linalg.lstsq(model.K.reshape(-1, d), model.key_bias.reshape(-1), rcond=None)[0]
            print(f"| d={d} H=4 (2 key/value heads) seed {seed} | {np.sqrt(d):.3g} | {np.linalg.norm(query):.3g} | "
                  f"{np.linalg.norm(key):.3g} |")


def read_out(case: str) -> None:
    """GPT-2 sublayers (d = 16, 32; H = 2, 4) read out by a random r (``TorchOracle(sublayer, readout=r)``,
    ``extract(..., seed=1, norm="auto")``) against the plain attention's scalar run on the same attention
    (``TorchOracle(block.attn, readout=r)``, the defaults, ``seed=1``); the model against ``read_out_truth``
    (canonical error) and against ``r^T`` of the sublayer at every position of 100 fresh sequences of
    lengths 1..64 with token norms 1e-3..1e3 (``read_out_error``: each answer against the size of its skip
    term and the attention's part, docs/algorithm.md, 'A scalar read-out'); CPU seconds of the extraction.
    Then the BertAttention read-out's refusal."""
    print("| case | norm found | eps rel. error | ok (or first failed check) | queries | plain attention's scalar run "
          "| ratio | canonical error | error at every position | error estimate | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for d, H in [(16, 2), (16, 4), (32, 2), (32, 4)]:
        name = f"GPT-2 sublayer d={d} H={H} float64, read out"
        if case not in name:
            continue
        block, r = gpt2_block(d, H), np.random.default_rng(5).standard_normal(d)
        sublayer = attention_sublayer(block)
        started = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = mx.extract(TorchOracle(sublayer, readout=r), d, heads=H, seed=1, norm="auto", on_failure="warn")
        seconds = time.process_time() - started
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = mx.extract(TorchOracle(block.attn, readout=r), d, heads=H, seed=1, on_failure="warn").queries
        verdict = "ok" if result.ok else result.failed_checks[0].name
        canonical = error = np.nan
        if result.model is not None:
            canonical = mx.compare(result.model, read_out_truth(block, r)).max_rel
            causal = result.causal is not None and result.causal.verdict == "causal"
            error = read_out_error(result.model, sublayer, r, raw_sequences(np.random.default_rng(11), d, 100), causal)
        print(f"| {name} | {result.norm} | {abs(result.eps - block.ln_1.eps) / block.ln_1.eps:.1e} | {verdict} | "
              f"{result.queries} | {plain} | {result.queries / plain:.2f} | {canonical:.1e} | {error:.1e} | "
              f"{result.error_estimate:.1e} | {seconds:.1f} |", flush=True)
    if case in "BertAttention (post-LN) d=16 H=2, read out":
        oracle = TorchOracle(attention_sublayer(bert_attention(16, 2)), readout=np.random.default_rng(5).standard_normal(16))
        try:
            mx.extract(oracle, 16, heads=2, seed=1, norm="auto")
        except ValueError as refusal:
            print(f"| BertAttention (post-LN) d=16 H=2, read out | refused, {oracle.sequences} queries: "
                  f"{str(refusal)[:90]}... |")


def as_run_cases(large: bool):
    """(name, the sublayer as run, the exact float64 sublayer of the same weights, d, H): a float64 decoder layer
    as transformers runs it (its RMSNorm and rotary angles in float32) and the block in float32."""
    out = []
    for d in [16] + ([64] if large else []):
        for family, config in (("llama", {}),) + ((("mistral", {"sliding_window": 16}),) if d == 16 else ()):
            name = "Llama" if family == "llama" else "Mistral (window 16)"
            layer = rotary_block(d, 4, kv_heads=2, family=family, **config)
            out.append((f"{name} sublayer d={d} H=4 (2 key/value heads), float64 as transformers runs it",
                        attention_sublayer(layer), RotarySublayerFloat64(layer), d, 4))
        rounded = rotary_block(d, 4, kv_heads=2).float()
        out.append((f"Llama sublayer d={d} H=4 (2 key/value heads), float32", attention_sublayer(rounded),
                    RotarySublayerFloat64(rotary_block(d, 4, kv_heads=2).float().double()), d, 4))
    return out


def as_run(case: str, large: bool, defaults: bool = False) -> None:
    """Rotary sublayers whose answers carry float32's rounding, extracted with ``norm="auto"``, ``positions="rotary"``
    (``seed=1``), the replacement judged at every position of the benchmark's 100 raw sequences against the exact
    float64 sublayer of the same weights (float64 norm and angles; a float32 block's weights in float64), beside the
    layer's own error against it; CPU seconds of the extraction. ``defaults``: without ``norm=`` (the failed rotary
    run hands the session to the norm learner; both runs' queries counted)."""
    print("| case | ok | answers taken as float32 (measured noise) | queries | CPU s | error estimate "
          "| the rotary run's estimate | error at every position | the layer's own error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, module, exact, d, H in as_run_cases(large):
        if case not in name:
            continue
        started = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = mx.extract(TorchOracle(module), d, heads=H, seed=1, on_failure="warn",
                                **({} if defaults else {"norm": "auto"}), **ROTARY)
        seconds = time.process_time() - started
        sequences = raw_sequences(np.random.default_rng(11), d, 100)
        dtype = next(module.parameters()).dtype

        def as_run_float64(X, module=module, dtype=dtype):
            return module(X.to(dtype)).double()

        own = every_position_error(exact_reading(as_run_float64), exact, sequences, True)
        error = "-" if result.model is None else f"{every_position_error(result.model, exact, sequences, True):.1e}"
        noise = next((f"{c.value:.1e}" for c in result.checks if c.name == "answer_noise"), "no (float32 layer)"
                     if str(dtype) == "torch.float32" else "no")
        verdict = "ok" if result.ok else result.failed_checks[0].name
        inner = "-" if getattr(result, "inner", None) is None else f"{result.inner.error_estimate:.1e}"
        print(f"| {name} | {verdict} | {noise} | {result.queries} | {seconds:.1f} | {result.error_estimate:.1e} "
              f"| {inner} | {error} | {own:.1e} |", flush=True)


class exact_reading:
    """A module's outputs at every position as a model's (``every_position``), to judge one module by another."""

    def __init__(self, module):
        self.module = module

    def every_position(self, X, causal):
        with torch.no_grad():
            return self.module(torch.as_tensor(X)[None])[0].double().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="add GPT-2's and ViT's sublayers at d = 64, H = 4")
    parser.add_argument("--case", default="", help="only the cases whose name contains this text")
    parser.add_argument("--defaults", action="store_true",
                        help="run the norm='auto' cases without norm= (the defaults find a pre-norm after a failed run)")
    parser.add_argument("--float32-floor", action="store_true",
                        help="only the float32 BertAttention (d = 16, 64) against its own weights in float64")
    parser.add_argument("--float32-diagnosis", action="store_true",
                        help="only the float32 BertAttention d = 16: its replacement's error taken apart")
    parser.add_argument("--fit-factor", type=float, default=None,
                        help="with --float32-diagnosis: only this many answers per parameter, run to convergence")
    parser.add_argument("--tie-factor", type=int, default=None,
                        help="with --float32-diagnosis: the refinement at near ties with TIE_FACTOR H d queries (0: none)")
    parser.add_argument("--qwen2-neutral-tokens", action="store_true",
                        help="only the norms of Qwen2 sublayers' neutral tokens against the ball (white-box)")
    parser.add_argument("--as-run", action="store_true",
                        help="only rotary sublayers whose answers carry float32 rounding (as transformers runs a "
                             "float64 LlamaDecoderLayer; the block in float32), judged against the exact float64 one")
    parser.add_argument("--polish-factor", type=float, default=None,
                        help="with --as-run: the rotary learner's polish queries per parameter (the library: 6)")
    parser.add_argument("--value-factor", type=float, default=None,
                        help="with --as-run: times the rotary learner's value read-outs (the library: 4)")
    parser.add_argument("--margin", type=float, default=None,
                        help="with --as-run: the instances' token norm and bound over sqrt(d) (the library: 0.99)")
    parser.add_argument("--read-out", action="store_true",
                        help="only GPT-2 sublayers read out by r (one number a query), and BertAttention's refusal")
    args = parser.parse_args()
    if args.read_out:
        read_out(args.case)
        return
    if args.as_run:
        given = {name: getattr(args, name) for name in ("polish_factor", "value_factor") if getattr(args, name)}
        learn.COARSE_ROTARY_FACTORS = {**learn.COARSE_ROTARY_FACTORS, **given}  # variants of the library's choice
        if args.margin is not None:
            learn.COARSE_BALL_MARGIN = args.margin
        as_run(args.case, args.large, args.defaults)
        return
    if args.qwen2_neutral_tokens:
        qwen2_neutral_tokens()
        return
    if args.float32_floor:
        float32_floor()
        return
    if args.float32_diagnosis:
        float32_diagnosis(args.large, args.fit_factor, args.tie_factor)
        return
    print("| case | norm found | eps rel. error | ok (or first failed check) | queries | defaults without the norm "
          "| targeted schedule without the norm | error at every position | the same, `to_torch` module | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases(args.large):
        if args.case not in case[0]:
            continue
        row = run_case(*case, defaults=args.defaults)
        verdict = "ok" if row["ok"] else row["first failed check"]
        error, module_error = ("-" if not np.isfinite(row[key]) else f"{row[key]:.1e}" for key in ("error", "module error"))
        eps = "-" if not np.isfinite(row["eps error"]) else f"{row['eps error']:.1e}"
        print(f"| {row['case']} | {row['norm']} | {eps} | {verdict} | {row['queries']} | {row['baseline']} "
              f"| {row['scalar baseline']} | {error} | {module_error} | {row['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
