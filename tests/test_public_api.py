"""Every result type, error and the torch adapter's entry points are importable from the package
itself; torch's names are loaded on first use, so ``import mhaextract`` needs no torch."""

import subprocess
import sys

import pytest

import mhaextract as mx


def test_every_result_type_is_exported():
    from mhaextract.lowprecision.learn import LowPrecisionExtraction
    from mhaextract.rotary.learn import RotaryExtraction

    assert mx.RotaryExtraction is RotaryExtraction and mx.LowPrecisionExtraction is LowPrecisionExtraction
    for name in ("Extraction", "RotaryExtraction", "LowPrecisionExtraction", "TransformerExtraction"):
        assert name in mx.__all__


def test_one_error_base_for_every_family():
    assert issubclass(mx.TransformerExtractionError, mx.ExtractionError)


def test_the_torch_adapter_is_importable_from_the_package():
    pytest.importorskip("torch")
    from mhaextract.adapters import torch as adapter

    from mhaextract import TorchOracle, to_state_dict, to_torch

    assert (TorchOracle, to_torch, to_state_dict) == (adapter.TorchOracle, adapter.to_torch, adapter.to_state_dict)
    with pytest.raises(AttributeError, match="no attribute 'TorchOracles'"):
        mx.TorchOracles  # noqa: B018


@pytest.mark.slow  # a fresh interpreter (about 2 s)
def test_importing_the_package_does_not_import_torch():
    code = "import sys, mhaextract; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
