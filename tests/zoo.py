"""The trained zoo (issue 64): small Hugging Face models trained from scratch on this machine, their
attention layers cached in ``tests/data/zoo/`` and loaded back as modules in any dtype.

``python benchmarks/train_zoo.py`` trains every model of :data:`SPECS` (no download: the text is the
Python standard library's own source, read as characters; the images are synthetic), one thread,
seeded, deterministic, and writes each model's attention weights (float32, ``<name>.npz``) and
``manifest.json`` (the zoo's :data:`VERSION`, :data:`SEED`, each model's config, steps, final loss,
training seconds and the file's sha256). The tests read only the cache; ``stale_reasons()`` says
why a cache no longer matches this module (another version, seed or spec, or a changed file).

Families:

* ``gpt2``: ``GPT2LMHeadModel``, character-level next-token prediction; layers are ``GPT2Attention``.
* ``bert``: ``BertForMaskedLM``, characters, 15 % masked; layers are ``BertSelfAttention``.
* ``vit``: ``ViTForImageClassification`` on synthetic 16 x 16 images (which quadrant holds a cross),
  4 x 4 patches; layers are ``ViTAttention``.
* ``llama``, ``mistral``, ``qwen2``: ``<Family>ForCausalLM`` on characters, rotary positions,
  grouped queries (4 heads, 2 key/value heads, head width d / 4); Mistral's sliding window of 16
  tokens, Qwen2's query, key and value biases. Layers are ``<Family>Attention``, run as their model
  runs them by ``mhaextract.adapters.rotary.RotaryLayer``.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

#: Bump when training changes (data, steps, optimiser): a cache of another version is stale.
VERSION = 1
SEED = 0
CACHE = Path(__file__).resolve().parent / "data" / "zoo"
VOCABULARY = 128  # ASCII characters; anything else reads as "?"
LENGTH = 128      # training sequence length

ROTARY = ("llama", "mistral", "qwen2")


#: name -> family, shape (d, H, key/value heads, head width), family options, training steps.
SPECS = {
    "gpt2-d64-h4": dict(family="gpt2", d=64, H=4, steps=1200),
    "gpt2-d64-h8": dict(family="gpt2", d=64, H=8, steps=1200),
    "gpt2-d32-h2": dict(family="gpt2", d=32, H=2, steps=1500),
    "bert-d64-h4": dict(family="bert", d=64, H=4, steps=1200),
    "vit-d64-h4": dict(family="vit", d=64, H=4, steps=2000),
    "llama-d64-h4": dict(family="llama", d=64, H=4, H_kv=2, steps=1500),
    "mistral-d64-h4": dict(family="mistral", d=64, H=4, H_kv=2, steps=1500, options={"sliding_window": 16}),
    "qwen2-d64-h4": dict(family="qwen2", d=64, H=4, H_kv=2, steps=1500),
    "llama-d32-h4": dict(family="llama", d=32, H=4, H_kv=2, steps=1500),
    "mistral-d32-h4": dict(family="mistral", d=32, H=4, H_kv=2, steps=1500, options={"sliding_window": 16}),
    "qwen2-d32-h4": dict(family="qwen2", d=32, H=4, H_kv=2, steps=1500),
}
LAYERS = 2


def config(name: str):
    """The transformers config of a zoo model (sdpa attention; 2 layers, MLP width 2 d)."""
    import transformers

    spec = SPECS[name]
    family, d, H = spec["family"], spec["d"], spec["H"]
    common = dict(num_hidden_layers=LAYERS, intermediate_size=2 * d, attn_implementation="sdpa")
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=d, n_head=H, n_layer=LAYERS, n_positions=LENGTH, n_inner=2 * d,
                                       vocab_size=VOCABULARY, bos_token_id=0, eos_token_id=0,
                                       attn_implementation="sdpa")
    if family == "bert":
        return transformers.BertConfig(hidden_size=d, num_attention_heads=H, max_position_embeddings=LENGTH,
                                       vocab_size=VOCABULARY + 1, **common)  # + the mask token
    if family == "vit":
        return transformers.ViTConfig(hidden_size=d, num_attention_heads=H, image_size=16, patch_size=4,
                                      num_channels=1, num_labels=4, **common)
    Config = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
              "qwen2": transformers.Qwen2Config}[family]
    return Config(hidden_size=d, num_attention_heads=H, num_key_value_heads=spec["H_kv"], head_dim=d // H,
                  vocab_size=VOCABULARY, max_position_embeddings=4 * LENGTH, **common, **spec.get("options", {}))


def config_record(name: str) -> dict:
    """The config as the manifest stores it (JSON: ViT's label keys become strings)."""
    return json.loads(json.dumps(config(name).to_diff_dict()))


def model(name: str):
    """A fresh (untrained) model of the zoo entry, float32."""
    import transformers

    family = SPECS[name]["family"]
    Model = {"gpt2": transformers.GPT2LMHeadModel, "bert": transformers.BertForMaskedLM,
             "vit": transformers.ViTForImageClassification, "llama": transformers.LlamaForCausalLM,
             "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[family]
    return Model(config(name))


def attention_modules(network) -> list:
    """The attention layers of a zoo model, in order: the modules the tests extract."""
    name = type(network).__name__
    if name == "GPT2LMHeadModel":
        return [block.attn for block in network.transformer.h]
    if name == "BertForMaskedLM":
        return [block.attention.self for block in network.bert.encoder.layer]
    if name == "ViTForImageClassification":
        return [block.attention for block in network.vit.layers]
    return [block.self_attn for block in network.model.layers]


def corpus() -> np.ndarray:
    """The Python standard library's top-level ``*.py`` files, sorted by name, as ASCII codes
    (uint8, anything else read as ``?``): text on every machine with Python, no download. Its
    content depends on the Python version (the manifest records which)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(path.read_text(encoding="utf-8", errors="replace") for path in sorted(root.glob("*.py")))
    return np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest() -> dict:
    return json.loads((CACHE / "manifest.json").read_text())


def stale_reasons() -> list[str]:
    """Why the cache does not match this module ([] when it does): missing, another version, seed,
    model list or spec, or a weight file that is not the one trained. (Cheap: no transformers
    import; a change to :func:`config` or to the training bumps :data:`VERSION`.)"""
    if not (CACHE / "manifest.json").exists():
        return [f"no {CACHE / 'manifest.json'}: run python benchmarks/train_zoo.py"]
    stored = manifest()
    reasons = []
    if stored.get("version") != VERSION or stored.get("seed") != SEED:
        reasons.append(f"cache of version {stored.get('version')} seed {stored.get('seed')}, "
                       f"this zoo is version {VERSION} seed {SEED}")
    if sorted(stored.get("models", {})) != sorted(SPECS):
        reasons.append(f"cached models {sorted(stored.get('models', {}))} != {sorted(SPECS)}")
    for name, entry in stored.get("models", {}).items():
        if name not in SPECS:
            continue
        if entry.get("spec") != SPECS[name]:  # config() changing is a new VERSION
            reasons.append(f"{name}: its spec changed since it was trained")
        path = CACHE / f"{name}.npz"
        if not path.exists() or _digest(path) != entry.get("sha256"):
            reasons.append(f"{name}: {path.name} missing or not the file trained")
    return reasons


def names(rotary: bool | None = None) -> list[str]:
    """The zoo's model names; ``rotary=True`` / ``False``: only the rotary / the other families."""
    return [n for n in SPECS if rotary is None or (SPECS[n]["family"] in ROTARY) == rotary]


def layer_ids(rotary: bool | None = None) -> list[str]:
    """``"<model>/<layer>"`` for every attention layer of the zoo."""
    return [f"{name}/{index}" for name in names(rotary) for index in range(LAYERS)]


def attention(layer_id: str, dtype=None, implementation: str = "sdpa"):
    """The cached attention layer ``"<model>/<index>"`` as its transformers module, weights converted
    to ``dtype`` (torch dtype; default float32, as trained), in eval mode, on ``implementation``."""
    import torch
    import transformers

    name, index = layer_id.split("/")
    family, index = SPECS[name]["family"], int(index)
    settings = config(name)
    settings._attn_implementation = implementation
    if family == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention as Attention
    elif family == "bert":
        from transformers.models.bert.modeling_bert import BertSelfAttention as Attention
    elif family == "vit":
        from transformers.models.vit.modeling_vit import ViTAttention as Attention
    else:
        Attention = {"llama": transformers.models.llama.modeling_llama.LlamaAttention,
                     "mistral": transformers.models.mistral.modeling_mistral.MistralAttention,
                     "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2Attention}[family]
    module = Attention(settings) if family in ("bert", "vit") else Attention(settings, layer_idx=index)
    with np.load(CACHE / f"{name}.npz") as stored:
        with torch.no_grad():
            for key, parameter in module.named_parameters():
                parameter.copy_(torch.from_numpy(stored[f"{index}.{key}"]))
    return module.to(torch.float32 if dtype is None else dtype).eval()


def layer_as_run(layer_id: str, dtype, implementation: str = "sdpa"):
    """The module an oracle runs: the attention layer, or for the rotary families the layer as its
    model runs it (``RotaryLayer``, the model's own angles, computed in float32 by transformers),
    but in float64 with float64 angles (``angles="float64"``): the float64 layer of acceptance 1,
    whose answers are exact to float64 (the model's float32 angles in a float64 layer are
    acceptance 2's case)."""
    module = attention(layer_id, dtype, implementation)
    if SPECS[layer_id.split("/")[0]]["family"] in ROTARY:
        import torch

        from mhaextract.adapters.rotary import RotaryLayer
        return RotaryLayer(module, angles="float64" if dtype == torch.float64 else "model")
    return module


def exact_layer(layer_id: str, dtype):
    """The exact layer in float64 from the weights of the ``dtype`` layer (rounded to it first):
    the sdpa module (transformers' eager paths take some softmaxes in float32), and for the rotary
    families ``float64_layer`` (float64 angles, the key bias kept)."""
    import torch

    rounded = attention(layer_id, dtype)
    exact = attention(layer_id, torch.float64, "sdpa")
    exact.load_state_dict({key: value.to(torch.float64) for key, value in rounded.state_dict().items()})
    if SPECS[layer_id.split("/")[0]]["family"] in ROTARY:
        from mhaextract.adapters.rotary import float64_layer
        return float64_layer(exact)
    return exact


def is_causal(layer_id: str) -> bool:
    """Whether the layer alone masks the future (sdpa GPT-2 and the rotary families; BERT and ViT see every token)."""
    return SPECS[layer_id.split("/")[0]]["family"] in ("gpt2",) + ROTARY


def shape(layer_id: str) -> tuple[int, int]:
    """(d, H) of a zoo layer."""
    spec = SPECS[layer_id.split("/")[0]]
    return spec["d"], spec["H"]


def extract_options(layer_id: str) -> dict:
    """What the docs tell a user to add to the defaults: ``positions="rotary"`` for the rotary
    families, and ``key_bias=True`` where the layer has a key bias (Qwen2's ``k_proj.bias``)."""
    family = SPECS[layer_id.split("/")[0]]["family"]
    if family not in ROTARY:
        return {}
    return dict(positions="rotary", key_bias=True) if family == "qwen2" else dict(positions="rotary")


#: Fresh sequences the replacement is judged on: 100 of lengths 1..128 (unit-variance tokens, a
#: normalisation's output), at every position.
JUDGE_SEQUENCES, JUDGE_LONGEST = 100, 128
#: Where an estimate is of the outputs (``error_measure == "outputs"``), it speaks for every position of
#: fresh sequences of up to 64 tokens whose norms reach the run's token scale, each position relative to
#: its own largest output: it is judged there too, on sequences of Gaussian tokens of norm about these
#: fractions of the token scale.
SCOPE_FRACTIONS, SCOPE_SEQUENCES, SCOPE_LONGEST = (0.5, 1.0), 40, 64


def scope_error(replacement, exact, d: int, token_scale: float, seed: int = 13) -> float:
    """The largest error at every position of the sequences an estimate of the outputs speaks for
    (:data:`SCOPE_FRACTIONS`), each position's error relative to that position's largest output."""
    import torch

    from test_replacement_layers import outputs

    rng, worst = np.random.default_rng(seed), 0.0
    dtype = next(iter(replacement.parameters())).dtype
    for fraction in SCOPE_FRACTIONS:
        for n in rng.integers(1, SCOPE_LONGEST + 1, size=SCOPE_SEQUENCES):
            X = torch.as_tensor(rng.standard_normal((1, int(n), d)) * (fraction * token_scale / np.sqrt(d)))
            expected = outputs(exact, X)
            got = outputs(replacement, X.to(dtype)).to(torch.float64)
            relative = (got - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)
            worst = max(worst, float(relative.max()))
    return worst


def readout_vector(d: int) -> np.ndarray:
    """The read-out of :func:`run_and_judge`'s read-out runs: a unit vector of d entries, seeded."""
    r = np.random.default_rng(5).standard_normal(d)
    return r / np.linalg.norm(r)


class ReadOut:
    """A layer's outputs read out through r, at every position (B, N, 1): the exact layer's, judged
    against a read-out run's scalar model."""

    def __init__(self, layer, r):
        self.layer, self.r = layer, r

    def parameters(self):  # the layer's own (its dtype is the one a judged layer runs in)
        return self.layer.parameters()

    def __call__(self, X):
        import torch

        out = self.layer(X)
        out = out[0] if isinstance(out, tuple) else out
        return (out @ torch.as_tensor(self.r, dtype=out.dtype))[..., None]


def run_and_judge(layer_id: str, dtype, readout: bool = False, seed: int = 0, **options) -> dict:
    """Extract the layer (its ``dtype`` version, as its model runs it) with the library's defaults
    plus :func:`extract_options`, then judge the replacement against the exact float64 layer of the
    same weights at every position of the fresh sequences. Returns a dict: ``result`` (None if the
    run raised), ``error`` (the exception's text), ``seconds`` and ``cpu_seconds`` of the run, ``queries``, ``output_error``,
    ``own_error`` (the ``dtype`` layer's own outputs against the exact layer: 0 in float64),
    ``parameter_error`` (``compare`` against the truth from the weights) and ``estimate``; where the
    estimate is of the outputs, ``scope_error`` (:func:`scope_error`) as well.
    ``readout``: the oracle answers the outputs read out through :func:`readout_vector` (the
    non-rotary families), the run learns that scalar model, and every output is judged read out.
    ``seed``: the extraction's. ``options``: more of ``extract``'s options on top of the defaults
    (``schedule="lowrank", rank=16``)."""
    import time

    import torch

    import mhaextract as mx
    from mhaextract.adapters.rotary import to_rotary, to_torch_rotary
    from mhaextract.adapters.torch import TorchOracle, to_reduced, to_torch
    from test_replacement_layers import worst_relative_error

    d, H = shape(layer_id)
    rotary = SPECS[layer_id.split("/")[0]]["family"] in ROTARY
    if readout and rotary:
        raise ValueError("read-out runs are judged for the non-rotary families only")
    r = readout_vector(d) if readout else None
    oracle = TorchOracle(layer_as_run(layer_id, dtype), readout=r)
    row = dict(layer=layer_id, dtype=str(dtype).removeprefix("torch."), result=None, error=None)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        result = mx.extract(oracle, d, heads=H, seed=seed, on_failure="warn", progress=False,
                            **{**extract_options(layer_id), **options})
    except mx.ExtractionError as failure:
        result, row["error"] = failure.extraction, str(failure).splitlines()[0]
    row.update(seconds=time.perf_counter() - started, cpu_seconds=time.process_time() - cpu, queries=oracle.sequences,
               result=result)
    exact, as_run = exact_layer(layer_id, dtype), layer_as_run(layer_id, dtype)
    if readout:
        exact, as_run = ReadOut(exact, r), ReadOut(as_run, r)
    row["own_error"] = (0.0 if dtype == torch.float64 else
                        worst_relative_error(as_run, exact, d, JUDGE_SEQUENCES, JUDGE_LONGEST))
    if result is None or result.model is None:
        row.update(output_error=np.inf, parameter_error=np.inf, estimate=np.nan)
        return row
    replacement = to_torch_rotary(result.model) if rotary else to_torch(result.model, causal=is_causal(layer_id))
    truth = (to_rotary(exact.attention) if rotary else
             to_reduced(exact.layer, r) if readout else to_reduced(exact))
    row.update(output_error=worst_relative_error(replacement, exact, d, JUDGE_SEQUENCES, JUDGE_LONGEST),
               parameter_error=float(mx.compare(result.model, truth).max_rel), estimate=float(result.error_estimate))
    if result.error_measure == "outputs":
        row["scope_error"] = scope_error(replacement, exact, d, result.token_scale)
    return row


#: The acceptance's limits on the output error at every position.
OUTPUT_LIMITS = {"float64": 1e-12, "float32": 1e-5}


def failures(row: dict) -> list[str]:
    """What fails in a judged row of issue 64's acceptance 1, the estimate's tightness aside ([]
    when it passes): no model, failed checks, the output error's limit (float64, float32) or the
    layer's own error (bfloat16, float16), an estimate below the model's error (float64, float32)."""
    result, found = row["result"], []
    if result is None or result.model is None:
        why = row["error"] or ", ".join(check.name for check in getattr(result, "failed_checks", []))
        return [f"no model ({why})"]
    if not result.ok:
        found.append("checks failed: " + ", ".join(check.name for check in result.failed_checks))
    limit = OUTPUT_LIMITS.get(row["dtype"], row["own_error"])
    if not row["output_error"] <= limit:
        found.append(f"output error {row['output_error']:.1e} > {limit:.1e}")
    if row["dtype"] in OUTPUT_LIMITS and not row["estimate"] >= estimated_error(row):
        found.append(f"estimate {row['estimate']:.1e} below the error {estimated_error(row):.1e}")
    return found


def estimated_error(row: dict) -> float:
    """The error the row's estimate speaks for (the result's ``error_measure``): the parameter error,
    or for families whose estimate is of the outputs the larger of the output error and the error
    where the estimate claims it (:func:`scope_error`)."""
    if row["result"].error_measure != "outputs":
        return row["parameter_error"]
    return max(row["output_error"], row.get("scope_error", 0.0))


#: The acceptance's bound on the estimate over the model's error (float64, float32).
TIGHT = 100.0


def loose(row: dict) -> str | None:
    """``"estimate N x the error"`` where a float64 or float32 row's estimate exceeds :data:`TIGHT`
    times the model's error, else None."""
    if row["dtype"] not in OUTPUT_LIMITS or not np.isfinite(row["parameter_error"]):
        return None
    ratio = row["estimate"] / estimated_error(row)
    return f"estimate {ratio:.0f} x the error" if not ratio <= TIGHT else None


def verdicts(row: dict) -> list[str]:
    """Every way a judged row misses acceptance 1 (:func:`failures`, then :func:`loose`)."""
    return failures(row) + [message for message in [loose(row)] if message]
