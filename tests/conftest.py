import os

# Each pytest-xdist worker gets one BLAS thread: the suite runs two workers on two cores, and BLAS
# threads of their own (numpy's default is one a core) only contend on the tests' small matrices (a
# 4.6 s test took 27 s beside other work). Set before numpy is first imported; a value the caller
# exported wins.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import importlib.util

import numpy as np
import pytest

import mhaextract as mx
from mhaextract.attention.base import RunSettings
from mhaextract.run.validation import default_token_scale


if importlib.util.find_spec("torch") is not None:
    import torch

    # The layers in the tests are tiny: torch's intra-op threads only contend (on a loaded 2-core
    # machine a 0.4 s real-layer test took 4 s with the default thread count).
    torch.set_num_threads(1)


#: Tests of a minute or more on one core (trained and rotary float32 layers), started first: the
#: suite's two workers take tests in collection order, and one of these drawn last runs alone while
#: the other worker idles (longest first keeps both busy to the end).
LONGEST_FIRST = (
    "tests/test_rotary_layers.py::test_a_float32_layer_with_a_key_bias_is_extracted_through_large_query_finals",
    "tests/test_zoo.py::test_a_trained_layer_is_replaced_at_every_position[llama-d32-h4/0-float32]",
    "tests/test_rotary_layers.py::test_a_float32_layer_of_four_grouped_heads_is_extracted_within_its_precision",
    "tests/test_zoo.py::test_a_trained_layer_is_replaced_at_every_position[mistral-d32-h4/0-float32]",
    "tests/test_rotary.py::test_a_grouped_rotary_layer_written_here_is_extracted_to_1e_10_at_every_length",
    "tests/test_rotary_high_precision.py::test_a_rotary_layer_is_recovered_at_256_bits",
    "tests/test_low_precision_whole.py::test_a_bfloat16_gpt2_layer_is_as_close_to_its_exact_layer_as_it_is_itself",
    "tests/test_extract.py::test_float64_accuracy[3-16]",
    "tests/test_zoo.py::test_a_trained_layer_is_replaced_at_every_position[gpt2-d32-h2/0-float16]",
)


def pytest_collection_modifyitems(config, items):
    """The tests of :data:`LONGEST_FIRST` first, in its order; the rest as collected."""
    rank = {node: index for index, node in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))


@pytest.fixture
def random_target():
    def make(d, heads, seed):
        return mx.MultiHeadAttention.random(d, heads, seed=seed)
    return make


def paper_count(d, H):
    """The paper's query count ``4Hd^2 - 2H + 1`` (what the measured counts are compared with)."""
    return 4 * H * d * d - 2 * H + 1


def hp_error(extraction, target):
    """Max normwise relative error of the high-precision midpoints against the truth."""
    comparison = mx.compare(extraction.model_hp, target)
    assert comparison.heads_agree, (comparison.heads_a, comparison.heads_b)
    return float(comparison.max_rel)


class Float32Answers:
    """A float-only oracle (as TorchOracle is): a reference layer's or oracle's answers rounded to float32,
    ``answer_dtype`` said, as a float32 torch layer's."""

    answer_dtype = "float32"

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, batch):
        return np.asarray(self.inner(batch), dtype=np.float64).astype(np.float32)


class CountingOracle:
    """An independent count on the user's side of the boundary."""

    def __init__(self, target, precision=None):
        self.inner = mx.SimulatedOracle(target, precision)
        self.count = 0
        self.calls = 0
        self.longest = 0

    def __call__(self, batch):
        self.count += len(batch)
        self.calls += 1
        self.longest = max([self.longest] + [len(X) for X in batch])
        return self.inner(batch)


def run_settings(d, H, seed=None, **options):
    """Validated-looking settings for constructing a schedule directly (H known)."""
    return RunSettings(d, H, H, options.pop("precision", None), seed, default_token_scale(d), **options)
