import pytest

import mhaextract as mx


@pytest.fixture
def random_target():
    def make(d, heads, seed):
        return mx.MultiHeadAttention.random(d, heads, seed=seed)
    return make


def hp_error(extraction, target):
    """Max normwise relative error of the high-precision midpoints against the truth."""
    comparison = mx.compare(extraction.model_hp, target)
    assert comparison.heads_agree, (comparison.heads_a, comparison.heads_b)
    return float(comparison.max_rel)
