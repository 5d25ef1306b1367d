"""A griffe extension for the API reference (mkdocs.yml): the project's docstrings, as rendered.

The docstrings are numpydoc with two habits a numpydoc renderer reads otherwise:

* ``name : what it is`` in Parameters and Attributes puts a description where numpydoc puts a
  type; rendered as is, the description lands in the "Type" column. Where that slot holds prose
  (a word that is no type word), it is moved into the description.
* Sphinx roles (``:class:`~mhaextract.Extraction```, ``:func:`extract```) mean nothing to Markdown;
  they become code spans of the name (the last component where the target starts with ``~``).

The source is untouched: this runs on griffe's copy when mkdocstrings collects the package.
"""

from __future__ import annotations

import re

import griffe

#: Words that appear in the project's type slots ("array of shape (H, d, d)", "float or None").
TYPE_WORDS = {
    "int", "float", "bool", "str", "none", "array", "arrays", "object", "callable", "list", "dict", "tuple", "of",
    "or", "shape", "optional", "scalar", "sequence", "path", "ndarray", "any", "float64", "mpf", "default",
}
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(~?)([^`]+)`")
SECTIONS = {"parameters", "other parameters", "attributes"}


def _role(match: re.Match) -> str:
    short, target = match.groups()
    return f"``{target.rsplit('.', 1)[-1] if short else target}``"


def _is_prose(text: str) -> bool:
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text.replace("``", " "))
    return any(word.islower() and len(word) >= 3 and word not in TYPE_WORDS for word in words)


def _objects(obj):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


class ProseAnnotations(griffe.Extension):
    """Move prose out of numpydoc's type slot and turn Sphinx roles into code, for every object."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            docstring = obj.docstring
            if docstring is None:
                continue
            docstring.value = ROLE.sub(_role, docstring.value)
            sections = docstring.parse()
            for section in sections:
                if section.kind.value not in SECTIONS:
                    continue
                for item in section.value:
                    annotation = item.annotation
                    if isinstance(annotation, str) and _is_prose(annotation):
                        item.description = (annotation + "\n" + (item.description or "")).strip()
                        item.annotation = None
            docstring.__dict__["parsed"] = sections  # the cached property, as mkdocstrings reads it
