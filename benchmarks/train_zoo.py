"""Train the zoo of issue 64 from scratch and cache its attention layers (``tests/data/zoo/``).

    python benchmarks/train_zoo.py                 # every model of tests/zoo.py's SPECS
    python benchmarks/train_zoo.py --only gpt2-d64-h4 --steps 50   # a quick look (not cached)
    python benchmarks/train_zoo.py --verify vit-d64-h4              # trains again, compares with the cache

One thread, seeded, deterministic algorithms, a fixed number of steps (no time limit, so the same
machine and versions give the same weights). Text models read random windows of LENGTH characters
of the standard library's source (``zoo.corpus()``); BERT masks 15 % of them; ViT classifies
synthetic 16 x 16 images by the quadrant that holds a cross. AdamW, learning rate 3e-3 falling
linearly to 3e-4, batch 16. Writes ``<name>.npz`` (each attention layer's parameters, float32, keys
``"<layer>.<parameter>"``) and ``manifest.json`` (version, seed, versions of Python, torch and
transformers, and per model its spec, config, steps, final loss (mean of the last 50 steps) and
training seconds, and the file's sha256).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

BATCH = 16


def text_batch(rng, text, mask_id=None):
    starts = rng.integers(0, len(text) - zoo.LENGTH, BATCH)
    ids = torch.as_tensor(np.stack([text[s: s + zoo.LENGTH] for s in starts]).astype(np.int64))
    if mask_id is None:
        return dict(input_ids=ids, labels=ids)
    masked = torch.as_tensor(rng.random(ids.shape) < 0.15)
    return dict(input_ids=torch.where(masked, mask_id, ids), labels=torch.where(masked, ids, -100))


def image_batch(rng):
    """Noise with a cross of 5 x 5 pixels somewhere; the label is its quadrant."""
    images = rng.normal(0.0, 0.3, size=(BATCH, 1, 16, 16))
    labels = rng.integers(0, 4, BATCH)
    for image, label in zip(images, labels):
        row = rng.integers(0, 4) + 8 * (label // 2) + 2
        column = rng.integers(0, 4) + 8 * (label % 2) + 2
        image[0, row - 2: row + 3, column] += 1.0
        image[0, row, column - 2: column + 3] += 1.0
    return dict(pixel_values=torch.as_tensor(images, dtype=torch.float32), labels=torch.as_tensor(labels))


def train(name, steps=None, text=None):
    spec = zoo.SPECS[name]
    steps = spec["steps"] if steps is None else steps
    torch.manual_seed(zoo.SEED)
    rng = np.random.default_rng([zoo.SEED, zlib.crc32(name.encode())])
    network = zoo.model(name).train()
    optimiser = torch.optim.AdamW(network.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: 1.0 - 0.9 * step / steps)
    losses = []
    started = time.process_time()
    for step in range(steps):
        if spec["family"] == "vit":
            batch = image_batch(rng)
        else:
            batch = text_batch(rng, text, zoo.VOCABULARY if spec["family"] == "bert" else None)
        loss = network(**batch).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0:
            print(f"  {name} step {step}: loss {loss:.3f}", flush=True)
    seconds = time.process_time() - started
    layers = {f"{i}.{key}": p.detach().numpy().astype(np.float32)
              for i, module in enumerate(zoo.attention_modules(network)) for key, p in module.named_parameters()}
    return layers, float(np.mean(losses[-50:])), float(losses[0]), seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=list(zoo.SPECS), help="train these only (nothing cached)")
    parser.add_argument("--steps", type=int, help="override the steps (nothing cached)")
    parser.add_argument("--verify", nargs="+", choices=list(zoo.SPECS),
                        help="train these again and compare their weights with the cache (nothing written)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    text = zoo.corpus()
    if arguments.verify:
        for name in arguments.verify:
            layers = train(name, None, text)[0]
            with np.load(zoo.CACHE / f"{name}.npz") as stored:
                same = sorted(stored.files) == sorted(layers) and all(np.array_equal(stored[k], layers[k]) for k in layers)
            print(f"{name}: {'the same weights as the cache' if same else 'NOT the cached weights'}")
        return
    cache = arguments.only is None and arguments.steps is None
    models = {}
    for name in arguments.only or zoo.SPECS:
        layers, loss, first, seconds = train(name, arguments.steps, text)
        print(f"{name}: loss {first:.3f} -> {loss:.3f} in {seconds:.1f} s of CPU", flush=True)
        if cache:
            path = zoo.CACHE / f"{name}.npz"
            np.savez_compressed(path, **layers)
            models[name] = dict(spec=zoo.SPECS[name], config=zoo.config_record(name),
                                steps=zoo.SPECS[name]["steps"], first_loss=round(first, 4), final_loss=round(loss, 4),
                                cpu_seconds=round(seconds, 1), bytes=path.stat().st_size, sha256=zoo._digest(path))
    if cache:
        (zoo.CACHE / "manifest.json").write_text(json.dumps(dict(
            version=zoo.VERSION, seed=zoo.SEED, python=platform.python_version(), torch=torch.__version__,
            transformers=transformers.__version__, corpus_characters=len(text), models=models), indent=1) + "\n")


if __name__ == "__main__":
    main()
