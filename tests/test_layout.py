"""The shape of the code (docs/layout.md): the entry point and the shared run code name no family,
no family imports another family's modules, tools are imported by nothing on the extraction path,
and no module is over 800 lines. Read from the sources' import statements (function-level
imports included), so a lazy import is no way around it."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import mhaextract
from mhaextract.run.learner import LEARNERS

PACKAGE = Path(mhaextract.__file__).parent
#: The families: a folder each, registering its learners (src/mhaextract/families.py).
FAMILIES = {"attention", "lowprecision", "vector", "rotary", "transformer"}
#: What every run shares and the generic dispatch: none of it may import a family's module.
SHARED = ("api", "run", "oracle", "numerics", "checks", "models", "adapters.export", "split")
LIMIT = 800


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


@functools.lru_cache(maxsize=None)
def imports(name: str, path: Path) -> frozenset[str]:
    """The package's modules ``name`` imports, anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return frozenset(target for target in targets if target.startswith("mhaextract"))


def family_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FAMILIES else None


def shared(module: str) -> bool:
    rest = module.split(".", 1)[1] if "." in module else ""
    return any(rest == prefix or rest.startswith(prefix + ".") for prefix in SHARED)


MODULES = modules()


def test_every_family_on_the_list_registers_a_learner_and_every_learner_belongs_to_one():
    assert {learner.family for learner in LEARNERS.values()} >= FAMILIES
    for learner in LEARNERS.values():
        if learner.family in FAMILIES:
            assert learner.__module__.split(".")[1] == learner.family, learner


def test_the_shared_code_names_no_family():
    named = {name: sorted(target for target in imports(name, MODULES[name]) if family_of(target))
             for name in sorted(MODULES) if shared(name)}
    assert {name: targets for name, targets in named.items() if targets} == {}, (
        "register through mhaextract.run.learner instead")
    assert len(named) > 20  # the shared modules were found


def test_no_family_imports_another_familys_modules():
    others = {name: sorted(target for target in imports(name, MODULES[name])
                           if family_of(target) not in (None, family_of(name)))
              for name in sorted(MODULES) if family_of(name)}
    assert {name: targets for name, targets in others.items() if targets} == {}, (
        "use the registry (learner_class(name)) instead")
    assert {family_of(name) for name in others} == FAMILIES


def test_nothing_on_the_extraction_path_imports_the_tools():
    tools = {name: sorted(target for target in imports(name, MODULES[name]) if target.startswith("mhaextract.tools"))
             for name in sorted(MODULES)
             if not name.startswith("mhaextract.tools") and name not in ("mhaextract", "mhaextract.__main__")}
    assert {name: targets for name, targets in tools.items() if targets} == {}


def test_no_module_is_over_the_limit():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: lines for name, lines in long.items() if lines > LIMIT} == {}


def test_the_entry_point_names_no_family_in_its_code():
    """api.py's code (docstrings aside) holds no family or learner name as a string."""
    tree = ast.parse(MODULES["mhaextract.api"].read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = FAMILIES | set(LEARNERS) - {"auto"}
    strings = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    assert not [text for text in strings if any(word in text for word in words)]
