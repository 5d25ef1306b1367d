"""The ``>>>`` examples of the public API run as written (fast tier).

Every public name exported by :mod:`mhaextract` and :mod:`mhaextract.adapters.torch` has an
"Examples" section; this file runs them with :mod:`doctest` and checks that none is missing, so an
example that no longer matches the code fails here instead of misleading a reader of the docs.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
from pathlib import Path

import pytest

import mhaextract

#: Optional dependencies: a module that needs one the environment lacks is skipped, not failed.
OPTIONAL = ("torch", "transformers")


def _modules_with_examples() -> list[str]:
    """Every module of the package whose source holds ``>>>``, found from the files (nothing is
    imported to find them, so torch's adapters are collected without importing torch): a new or
    moved module's examples run without being listed here."""
    found = []
    for root in mhaextract.__path__:
        for path in sorted(Path(root).rglob("*.py")):
            if ">>>" in path.read_text(encoding="utf-8"):
                parts = path.relative_to(root).with_suffix("").parts
                found.append(".".join(("mhaextract",) + parts[:-1] + (() if parts[-1] == "__init__" else parts[-1:])))
    return found


MODULES = _modules_with_examples()
#: Modules whose examples run a whole extraction (or load transformers) for a second or more: the
#: slow tier runs them.
SLOW_EXAMPLES = {"mhaextract.lowprecision.learn", "mhaextract.adapters.export", "mhaextract.adapters.rotary",
                 "mhaextract.adapters.normed"}
TORCH_PUBLIC = ["TorchOracle", "to_reduced", "to_torch", "to_state_dict", "suggested_token_scale", "ReducedAttention",
                "ExtractedAttention", "head_factors", "numerical_rank", "UnsupportedLayerError"]
ROTARY_PUBLIC = ["RotaryLayer", "to_rotary", "to_torch_rotary", "float64_layer", "ExtractedRotaryAttention", "causal_mask"]
#: Public names still without an example (strict xfail: once one has it, remove it from this set).
PENDING: set[str] = set()

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _run(module_name: str) -> doctest.TestResults:
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        if error.name and error.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{module_name} needs {error.name}")
        raise
    if module_name == "mhaextract.adapters.rotary":
        pytest.importorskip("transformers")  # its examples build Hugging Face layers
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(module, module_name):  # in the module's namespace, as doctest runs them
        runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("module_name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_EXAMPLES else [])
                                         for name in MODULES])
def test_examples_run(module_name):
    results = _run(module_name)
    assert results.attempted > 0, f"{module_name} holds '>>>' but doctest finds no example in it"
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {module_name} failed (see stdout)"


def test_slow_examples_are_modules_with_examples():
    """A module moved or renamed leaves no stale name here (its examples would run in the fast tier)."""
    assert SLOW_EXAMPLES <= set(MODULES), sorted(SLOW_EXAMPLES - set(MODULES))


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
