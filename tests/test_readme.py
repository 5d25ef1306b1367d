"""Every Python block of README.md runs as written (the README is what a newcomer tries first)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_is_short_and_has_its_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "mhaextract demo" in text and "python -m pytest -q" in text


def cases():
    # a Hugging Face block imports transformers (seconds): the full suite runs it, the fast tier not
    return [pytest.param(index, marks=[pytest.mark.slow] if "transformers" in block else [])
            for index, block in enumerate(python_blocks())]


@pytest.mark.parametrize("index", cases())
def test_readme_block_runs(index, capsys):
    block = python_blocks()[index]
    if "transformers" in block or "torch" in block:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    exec(compile(block, f"README.md python block {index}", "exec"), {})
    assert capsys.readouterr().out  # every block shows what it computed
