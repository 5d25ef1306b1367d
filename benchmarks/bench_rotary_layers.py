"""Hugging Face rotary layers through the adapter (docs/rotary.md, "Real layers").

    python benchmarks/bench_rotary_layers.py

Part 1: how far a float64 ``LlamaAttention`` (d = 64, H = 4, two key/value heads, head width 16,
weights N(0, 1/d)) answers from its exact model ``to_rotary(layer)``, for the two angle sources of
``RotaryLayer`` and the two attention implementations: max relative error of the final-token
outputs over 50 sequences of lengths 1..64 and over two of lengths 256 and 1024 (tokens N(0, 1)).

Part 2: ``mx.extract(TorchOracle(RotaryLayer(layer, angles=...)), positions="rotary")`` on small
float64 layers (d = 16, head width 8): one Llama head, one Mistral head with a window of 16, and
grouped-query Llama layers (two query heads, one key/value head), seeds 0..5. Per run: ok or the
first failed check, queries measured at the oracle, the error estimate, the model's error against
``to_rotary(layer).readout(result.readout)`` (``mx.compare``'s max_rel) and on 100 fresh sequences
of lengths 1..256, and seconds.

    python benchmarks/bench_rotary_layers.py --large

Part 2 only, on a larger layer: a Llama attention with d = 64, H = 4, two key/value heads, head
width 16, in float64 (``angles="float64"``) and in float32 (the layer's own float32 angles; the
truth ``to_rotary`` of its float32 weights in float64). About 33 minutes on one core (11 and 22).

    python benchmarks/bench_rotary_layers.py --float32

Part 2 only, in float32 (the layer's own float32 angles): Llama attentions with d = 32, H = 4, two
key/value heads, head width 8, seeds 0..3. About 3 minutes on one core.

    python benchmarks/bench_rotary_layers.py --model-angles

Part 2 only, on float64 layers as their models run them (``angles="model"``: angles in float32,
and the eager softmax in float32), eager and sdpa: Llama, Mistral (window 16) and Qwen2 (query
and value biases, no key bias), d = 16, H = 2, one key/value head, head width 8, seed 0, with
the answer noise the run measured and the layer's own error on the fresh sequences. About 3
minutes on one core.

    python benchmarks/bench_rotary_layers.py --key-bias

Part 2 only, on Qwen2 attentions with query, key and value biases (every parameter N(0, 1/d)),
extracted with ``key_bias=True`` (docs/algorithm.md, 'A key bias'): d = 16, H = 2, one
key/value head, seeds 0..2, and d = 64, H = 4, two key/value heads, head width 16, in float64;
then under sliding windows of 8, 9 and 16 tokens (d = 16 with H = 1 and 2, d = 32 with H = 4). The
queries include the key-neutral search's (its share in the last column). About 15 minutes on one
core.

    python benchmarks/bench_rotary_layers.py --key-bias-float32

The same layers in float32 (their own float32 angles), where the key-neutral token comes from the
large-query search (docs/algorithm.md, 'From float32 answers'): d = 16, seeds 0..2, d = 32
(H = 4, two key/value heads, width 8) and d = 64 (H = 4, two key/value heads, width 16). About 5
minutes on one core up to d = 32; the d = 64 row alone runs about 45 minutes.

    python benchmarks/bench_rotary_layers.py --probe-scales

The key-neutral search's first step alone (``rotary/neutral.py``): Levenberg-Marquardt from 0 to the
final token whose query is zero, with probe tokens at 1, 3 and 10 times the token scale, on Qwen2
attentions with biases (d = 16, H = 2, one key/value head, seeds 0..5; d = 64, H = 4, two, seeds
0..2): the misfit reached and the distance to the true token (from the weights). About 5 minutes.

    python benchmarks/bench_rotary_layers.py --instances

Part 3 only: the instances of one run on that layer (float64 with ``angles="float64"``, and
float32), fitted from the scalar read-out alone and with the whole answers' channels
(docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'): failed fits, log-pole and
numerator errors against the layer's true poles (the fits that held), and the start model's error against the read-out's
exact model. About a minute.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

import mhaextract as mx
from mhaextract.adapters.rotary import RotaryLayer, to_rotary
from mhaextract.adapters.torch import TorchOracle


def layer(kind, d, H, H_kv, r, seed, implementation="sdpa", window=None):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    options = dict(hidden_size=d, num_attention_heads=H, num_key_value_heads=H_kv, head_dim=r,
                   attn_implementation=implementation)
    if kind == "mistral":
        attention = MistralAttention(MistralConfig(sliding_window=window, **options), layer_idx=0)
    elif kind == "qwen2":  # query, key and value biases
        attention = Qwen2Attention(Qwen2Config(**options), layer_idx=0)
    else:
        attention = LlamaAttention(LlamaConfig(**options), layer_idx=0)
    generator = torch.Generator().manual_seed(seed)
    attention = attention.double()
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * d ** -0.5)
    return attention


def relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def exactness():
    rng = np.random.default_rng(0)
    short = [rng.normal(size=(int(n), 64)) for n in rng.integers(1, 65, 50)]
    long = [rng.normal(size=(n, 64)) for n in (256, 1024)]
    print("| attention | angles | lengths 1..64 | lengths 256, 1024 |")
    print("|---|---|---|---|")
    for implementation in ("sdpa", "eager"):
        attention = layer("llama", 64, 4, 2, 16, seed=0, implementation=implementation)
        truth = to_rotary(attention)
        for angles in ("model", "float64"):
            oracle = TorchOracle(RotaryLayer(attention, angles=angles))
            errors = [relative(oracle(batch), truth(batch)) for batch in (short, long)]
            print(f"| {implementation} | {angles} | {errors[0]:.1e} | {errors[1]:.1e} |")


def extraction(name, attention, heads, angles, key_bias=False, window=None, noise=False):
    """One row; ``noise``: two more columns, the answer noise the run measured (its ``answer_noise``
    check, "-" where it measured none) and the layer's own error on the fresh outputs."""
    oracle = TorchOracle(RotaryLayer(attention, angles=angles, window=window))
    d = attention.config.hidden_size
    start = time.perf_counter()
    try:
        result = mx.extract(oracle, d=d, heads=heads, positions="rotary", schedule="rotary", seed=0, key_bias=key_bias)
        outcome = "ok"
    except mx.ExtractionError as error:
        # A failed run's model is still measured: its error says whether the model or the
        # estimate is what failed.
        result = error.extraction
        outcome = str(error).splitlines()[1].strip().split(" (")[0]
    seconds = time.perf_counter() - start
    exact = to_rotary(attention, window=window)  # whole outputs; a scalar model is its read-out's
    searched = ""
    if result.neutral is not None:  # the search's queries, and the found token's key from the weights
        found = result.neutral.token
        key = ("" if found is None or exact.key_bias is None else
               f"{np.abs(np.einsum('hrd,d->hr', exact.K, found) + exact.key_bias).max():.1e}")
        sizes = ("" if found is None else  # |z| and its query, first among the value-invisible tokens
                 " / ".join("-" if z is None else
                            f"{np.linalg.norm(z):.2g}, {np.abs(np.einsum('hrd,d->hr', exact.Q, z) + exact.b).max():.2g}"
                            for z in (result.neutral.invisible_token, found)) + f" / {np.abs(exact.b).max():.2g}")
        searched = f" | {result.neutral.queries} | {key} | {sizes}"
    if result.model is None:
        print(f"| {name} | {angles} | {outcome} | {oracle.sequences} | | | | {seconds:.1f}{searched} |")
        return
    truth = exact if result.model.is_vector else exact.readout(result.readout)
    rng = np.random.default_rng(11)
    fresh = [rng.normal(size=(int(n), d)) * d ** -0.25 for n in rng.integers(1, 257, 100)]
    if noise:
        measured = [f"{check.value:.1e}" for check in result.checks if check.name == "answer_noise"] or ["-"]
        own = relative(oracle(fresh) if result.model.is_vector else oracle(fresh) @ result.readout, truth(fresh))
        searched += f" | {measured[0]} | {own:.1e}"
    print(f"| {name} | {angles} | {outcome} | {result.queries} | {result.error_estimate:.1e} | "
          f"{mx.compare(result.model, truth).max_rel:.1e} | {relative(result.model(fresh), truth(fresh)):.1e} | "
          f"{seconds:.1f}{searched} |")


def true_poles(truth, readout, patterns):
    """Each instance pattern's poles P_h and read-out numerators N_h from the layer's exact model,
    sorted by pole: (n, H) each."""
    v = np.einsum("o,hod->hd", readout, truth.V)
    P, N = [], []
    for pattern in patterns:
        keys = np.abs(pattern).sum(axis=1) > 0
        weights = np.exp(truth.scores(pattern)) * keys
        P.append(weights.sum(axis=1) + (~keys).sum())
        N.append((weights * (pattern @ v.T).T).sum(axis=1))
    order = np.argsort(P, axis=1)
    return np.take_along_axis(np.array(P), order, 1), np.take_along_axis(np.array(N), order, 1)


def instance_precision():
    """Part 3: one run's instances fitted from the read-out alone and with the whole answers'
    channels, against the layer's true poles; and the start model from each."""
    from mhaextract.oracle.boundary import OracleBoundary
    from mhaextract.oracle.vector_answers import VectorAnswers
    from mhaextract.rotary import learn
    from mhaextract.run.validation import spawn_rng

    print("| layer | fit | failed fits | log-pole error median | 90th pct | numerator error median | "
          "start model error |")
    print("|---|---|---|---|---|---|---|")
    d, H = 64, 4
    for dtype in ("float64", "float32"):
        attention = layer("llama", d, H, 2, 16, seed=0)
        if dtype == "float32":
            attention = attention.float()
        oracle = TorchOracle(RotaryLayer(attention, angles="float64" if dtype == "float64" else "model"))
        vectors = VectorAnswers(0, getattr(oracle, "answer_dtype", None))
        boundary = OracleBoundary(oracle, d, vectors=vectors)
        c_whole = boundary.ask([np.zeros((1, d))], "c", whole=True)[0]
        c = float(vectors.scalars(c_whole[None])[0])
        projection = learn.channel_projection(spawn_rng(0, 23), len(c_whole), H)
        learner = learn.RotaryLearner(d, H, 0, d ** 0.25, True, None)

        def ask(patterns, description):
            return learn.ask_instances(boundary, vectors, projection, patterns, learner.ks, description)

        # the token scale as the extraction chooses it
        learn.choose_token_scale(learner, ask, c, c_whole @ projection,
                                 boundary.answer_unit > learn.FIRST_LOOK_UNIT)
        patterns = learner.patterns()
        _, answers, channels_asked = ask(patterns, "instances")
        unit = boundary.answer_unit
        P, N = true_poles(to_rotary(attention), vectors.readout, patterns)
        truth = to_rotary(attention).readout(vectors.readout)
        limit = max(learn.INSTANCE_LIMIT, learn.INSTANCE_UNITS * unit)  # the run's own limit on a fit
        for name, channels in (("read-out alone", (None, None)),
                               ("read-out and channels", (channels_asked, c_whole @ projection))):
            fits = learn.fit_instances(answers, c, learner.ks, H, *channels)
            failed = ~np.isfinite(fits.P).all(axis=1) | ~(fits.residual <= limit)
            order = np.argsort(np.nan_to_num(fits.P, nan=np.inf), axis=1)
            pole_error = np.abs(np.log(np.take_along_axis(fits.P, order, 1) / P)).max(axis=1)
            numerator_error = (np.abs(np.take_along_axis(fits.N, order, 1) - N).max(axis=1)
                               / np.abs(N).max(axis=1))
            start, _ = learner.learn(answers, c, unit, *channels)
            start_error = f"{mx.compare(start, truth).max_rel:.1e}" if start is not None else "no start"
            quantiles = np.nanquantile(np.where(failed, np.nan, pole_error), [0.5, 0.9])
            print(f"| Llama d = 64, H = 4, {dtype} | {name} | {failed.mean():.1%} | {quantiles[0]:.1e} | "
                  f"{quantiles[1]:.1e} | {np.nanmedian(np.where(failed, np.nan, numerator_error)):.1e} | "
                  f"{start_error} |")


def probe_scales():
    from mhaextract.oracle.boundary import OracleBoundary
    from mhaextract.rotary.neutral import _query_neutral
    print("| layer | distance of x_q from 0 | probes at 1 | at 3 | at 10 |")
    print("|---|---|---|---|---|")
    for d, H, H_kv, r, seeds in ((16, 2, 1, 8, 6), (64, 4, 2, 16, 3)):
        for seed in range(seeds):
            attention = layer("qwen2", d, H, H_kv, r, seed=seed)
            truth = to_rotary(attention)
            x_q = np.linalg.lstsq(truth.Q.reshape(-1, d), -truth.b.ravel(), rcond=None)[0]
            boundary = OracleBoundary(TorchOracle(RotaryLayer(attention, angles="float64")), d)
            c = boundary.ask([np.zeros((1, d))], whole=True)[0]
            scale = d ** 0.25
            V = (boundary.ask([row[None] for row in np.eye(d) * scale], whole=True) - c).T / scale

            def whole(sequences, description):
                return boundary.ask(sequences, description, whole=True)

            cells = []
            for size in (1.0, 3.0, 10.0):
                found, misfit = _query_neutral(whole, c, V, np.random.default_rng(0), d, size * scale, 2.0 ** -53)
                cells.append(f"misfit {misfit:.0e}, {np.linalg.norm(found - x_q):.0e} from x_q")
            print(f"| Qwen2, d = {d}, H = {H}, seed {seed} | {np.linalg.norm(x_q):.1f} | " + " | ".join(cells) + " |",
                  flush=True)


def model_angles():
    """Float64 layers as their models run them: angles in float32, eager softmax in float32."""
    print("| layer | angles | outcome | queries | estimate | model error | fresh outputs | seconds | "
          "answer noise measured | the layer's own error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for implementation in ("eager", "sdpa"):
        extraction(f"Llama, H = 2, one kv head, {implementation}",
                   layer("llama", 16, 2, 1, 8, seed=0, implementation=implementation), 2, "model", noise=True)
        extraction(f"Mistral, H = 2, one kv head, window 16, {implementation}",
                   layer("mistral", 16, 2, 1, 8, seed=0, implementation=implementation, window=16), 2, "model",
                   noise=True)
        qwen2 = layer("qwen2", 16, 2, 1, 8, seed=0, implementation=implementation)
        with torch.no_grad():  # query and value biases; no key bias (key_bias=True seeks a token in float64)
            qwen2.k_proj.bias.zero_()
        extraction(f"Qwen2, H = 2, one kv head, no key bias, {implementation}", qwen2, 2, "model", noise=True)


def main(large: bool = False, instances: bool = False, float32: bool = False, key_bias: bool = False,
         scales: bool = False, key_bias_float32: bool = False, angles: bool = False):
    warnings.simplefilter("ignore")
    if angles:
        model_angles()
        return
    if instances:
        instance_precision()
        return
    if scales:
        probe_scales()
        return
    if key_bias:
        print("| layer | angles | outcome | queries | estimate | model error | fresh outputs | seconds | "
              "key-neutral search queries | max key of the token found | "
              "its norm, max query: first / smallest / the layer's query bias |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for seed in range(3):
            extraction(f"Qwen2, d = 16, H = 2, one kv head, seed {seed}", layer("qwen2", 16, 2, 1, 8, seed=seed), 2,
                       "float64", key_bias=True)
        extraction("Qwen2, d = 64, H = 4, two kv heads", layer("qwen2", 64, 4, 2, 16, seed=0), 4, "float64",
                   key_bias=True)
        # sliding windows: the shortest the instances allow at H = 1 and H = 2, and a grouped layer
        extraction("Qwen2, d = 16, H = 1, window 8", layer("qwen2", 16, 1, 1, 8, seed=0), 1, "float64",
                   key_bias=True, window=8)
        extraction("Qwen2, d = 16, H = 2, one kv head, window 9", layer("qwen2", 16, 2, 1, 8, seed=0), 2,
                   "float64", key_bias=True, window=9)
        extraction("Qwen2, d = 32, H = 4, two kv heads, r = 8, window 16", layer("qwen2", 32, 4, 2, 8, seed=0), 4,
                   "float64", key_bias=True, window=16)
        return
    if key_bias_float32:  # the large-query search: float32 answers (the layer's own float32 angles)
        print("| layer | angles | outcome | queries | estimate | model error | fresh outputs | seconds | "
              "key-neutral search queries | max key of the token found | "
              "its norm, max query: - / found / the layer's query bias |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for seed in range(3):
            extraction(f"Qwen2, d = 16, H = 2, one kv head, float32, seed {seed}",
                       layer("qwen2", 16, 2, 1, 8, seed=seed).float(), 2, "model", key_bias=True)
        extraction("Qwen2, d = 32, H = 4, two kv heads, r = 8, float32", layer("qwen2", 32, 4, 2, 8, seed=0).float(),
                   4, "model", key_bias=True)
        extraction("Qwen2, d = 64, H = 4, two kv heads, float32", layer("qwen2", 64, 4, 2, 16, seed=0).float(), 4,
                   "model", key_bias=True)
        return
    if not (large or float32):
        exactness()
        print()
    print("| layer | angles | outcome | queries | estimate | model error | fresh outputs | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    if float32:  # four grouped heads in float32, at the size of acceptance 1 (about 40 s a seed)
        for seed in range(4):
            extraction(f"Llama, d = 32, H = 4, two kv heads, r = 8, float32, seed {seed}",
                       layer("llama", 32, 4, 2, 8, seed=seed).float(), 4, "model")
        return
    if large:
        extraction("Llama, d = 64, H = 4, two kv heads", layer("llama", 64, 4, 2, 16, seed=0), 4, "float64")
        extraction("Llama, d = 64, H = 4, two kv heads, float32", layer("llama", 64, 4, 2, 16, seed=0).float(), 4,
                   "model")
        return
    extraction("Llama, H = 1", layer("llama", 16, 1, 1, 8, seed=0), 1, "float64")
    extraction("Llama, H = 1", layer("llama", 16, 1, 1, 8, seed=0), 1, "model")
    extraction("Mistral, H = 1, window 16", layer("mistral", 16, 1, 1, 8, seed=0, window=16), 1, "float64")
    for seed in range(6):
        extraction(f"Llama, H = 2, one kv head, seed {seed}", layer("llama", 16, 2, 1, 8, seed=seed), 2, "float64")


if __name__ == "__main__":
    import sys

    main(large="--large" in sys.argv[1:], instances="--instances" in sys.argv[1:], float32="--float32" in sys.argv[1:],
         key_bias="--key-bias" in sys.argv[1:], scales="--probe-scales" in sys.argv[1:],
         key_bias_float32="--key-bias-float32" in sys.argv[1:], angles="--model-angles" in sys.argv[1:])
