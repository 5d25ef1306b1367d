"""The ``>>>`` examples of the public API run as written (fast tier).

Every public name exported by :mod:`mhaextract` and :mod:`mhaextract.adapters.torch` has an
"Examples" section; this file runs them with :mod:`doctest` and checks that none is missing, so an
example that no longer matches the code fails here instead of misleading a reader of the docs.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import mhaextract

#: Modules that need torch (and, for rotary layers, transformers) to import: the torch examples.
TORCH_MODULES = ["mhaextract.adapters.torch", "mhaextract.adapters.export", "mhaextract.adapters.attention",
                 "mhaextract.adapters.rotary"]


def _modules_with_examples() -> list[str]:
    """Every module of the package whose docstrings hold ``>>>`` examples, found by walking the
    package (a new module's examples run without being listed here), torch's adapters apart."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for info in pkgutil.walk_packages(mhaextract.__path__, "mhaextract."):
        if info.name.startswith("mhaextract.adapters"):  # torch's: TORCH_MODULES
            continue
        module = importlib.import_module(info.name)
        if any(test.examples for test in finder.find(module, info.name, globs={})):
            found.append(info.name)
    return found


MODULES = _modules_with_examples()
#: Modules whose examples run a whole extraction of a second or more: the slow tier runs them.
SLOW_EXAMPLES = {"mhaextract.lowprecision.learn"}
TORCH_PUBLIC = ["TorchOracle", "to_reduced", "to_torch", "to_state_dict", "suggested_token_scale", "ReducedAttention",
                "ExtractedAttention", "head_factors", "numerical_rank", "UnsupportedLayerError"]
ROTARY_PUBLIC = ["RotaryLayer", "to_rotary", "to_torch_rotary", "float64_layer", "ExtractedRotaryAttention", "causal_mask"]
#: Public names still without an example (strict xfail: once one has it, remove it from this set).
PENDING: set[str] = set()

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _run(module_name: str) -> doctest.TestResults:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(module, module_name):  # in the module's namespace, as doctest runs them
        runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("module_name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_EXAMPLES else [])
                                         for name in MODULES])
def test_examples_run(module_name):
    results = _run(module_name)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {module_name} failed (see stdout)"


@pytest.mark.parametrize("module_name", [TORCH_MODULES[0]] + [pytest.param(name, marks=pytest.mark.slow)
                                                               for name in TORCH_MODULES[1:]])
def test_torch_examples_run(module_name):
    pytest.importorskip("torch")
    if module_name == "mhaextract.adapters.rotary":
        pytest.importorskip("transformers")
    results = _run(module_name)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {module_name} failed (see stdout)"


def _public():
    names = [(name, getattr(mhaextract, name)) for name in mhaextract.__all__]
    try:
        torch_adapter = importlib.import_module("mhaextract.adapters.torch")
    except ImportError:
        return names
    names += [(name, getattr(torch_adapter, name)) for name in TORCH_PUBLIC]
    try:
        rotary_adapter = importlib.import_module("mhaextract.adapters.rotary")
        importlib.import_module("transformers")
    except ImportError:
        return names
    return names + [(name, getattr(rotary_adapter, name)) for name in ROTARY_PUBLIC]


def _cases():
    pending = pytest.mark.xfail(strict=True, reason="examples pending on the lead's branch")
    return [pytest.param(name, obj, id=name, marks=[pending] if name in PENDING else []) for name, obj in _public()]


@pytest.mark.parametrize("name, obj", _cases())
def test_every_public_name_has_an_example(name, obj):
    docstring = inspect.getdoc(obj) or ""
    assert "Examples\n--------" in docstring and ">>>" in docstring, f"{name} has no Examples section"
