"""Every reference to the docs names a place that exists (fast tier).

Code and pages cite the docs by title, never by number: a renumbered page would leave every
"section 13" pointing elsewhere, a renamed title leaves a reference that this test names.

What is checked, in src/, tests/, benchmarks/, docs/ (``*.py``, ``*.md``, tests/data apart) and
README.md:

* No section sign is left: sections are cited by their titles.
* ``docs/<page>.md, 'Title'``, with more titles after it (``'A', 'B' and 'C'``, ``'A' to 'D'``),
  quoted with ``'`` or ``"`` and free to run over line breaks, comment markers and the joins of
  adjacent string literals: the page exists and every title resolves in it.
* ``docs/<page>.md#<slug>`` anywhere, and in the pages the Markdown links ``(<page>.md#<slug>)``
  and ``(#<slug>)``: the page has a heading whose anchor is that slug (python-markdown's toc slugs:
  markup and punctuation dropped, lowercase, runs of spaces and '-' to one '-'). API anchors
  that mkdocstrings makes (``api.md#mhaextract.X``) are left to ``mkdocs build --strict``.
* A link into a page followed by a quoted part (``[Title](algorithm.md#slug), "Narrow heads"``):
  the part resolves in the linked section.

A title resolves when it is the text of a heading of the page, or the start (at a word boundary)
of a heading or of a paragraph title: a bold run (``**Narrow heads** ...``, ``* **Refuted alternatives**``) or an
italic run that opens a paragraph (``*From float32 answers* ...``). Such a part must be the only
one of the page that starts so, or the only one in the section named just before it in the same
reference (``docs/algorithm.md, 'Low-rank heads', 'Error estimate'``). A title quoted alone where
the file was named earlier in the same sentence (``('The targeted schedule')``) is not found by
these patterns and is not checked here.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SIGN = "\N{SECTION SIGN}"


def _files():
    for folder in ("src", "tests", "benchmarks", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md") and path.is_file() and "data" not in path.relative_to(ROOT).parts[:2]:
                yield path
    yield ROOT / "README.md"


FILES = list(_files())


def slug(text: str) -> str:
    """python-markdown's toc slug of a heading's text (its markup already dropped)."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _words(text: str) -> str:
    return " ".join(text.split())


class Page:
    """A docs page's headings (text, slug, section index) and paragraph titles (section index, text)."""

    def __init__(self, path: Path):
        self.headings, self.parts = [], []
        fenced = False
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if fenced:
                continue
            heading = re.match(r"^(#{1,6})\s+(.+?)\s*#*\s*$", line)
            if heading:
                text = _words(re.sub(r"[`*_]", "", heading.group(2)))
                self.headings.append((text, slug(text), len(heading.group(1))))
                self.parts.append((len(self.headings) - 1, text))
                continue
            section = len(self.headings) - 1
            runs = re.findall(r"\*\*(.+?)\*\*", line)
            runs += re.findall(r"^\s*(?:-\s+|\d+\.\s+)?\*([^*\s][^*]*?)\*(?!\*)", line)
            self.parts.extend((section, _words(run.rstrip(".:"))) for run in runs)
        self.slugs = _unique_slugs([s for _, s, _ in self.headings])

    def section_of(self, title: str):
        """The heading index of ``title`` and the index where its section ends (None if no heading)."""
        for index, (text, _, level) in enumerate(self.headings):
            if text == _words(title):
                end = next((k for k in range(index + 1, len(self.headings)) if self.headings[k][2] <= level),
                           len(self.headings))
                return index, end
        return None

    def parts_starting(self, title: str, within=None) -> list:
        """The distinct (section, part) that start with ``title``: a part named twice in its
        section (``**Windows** below`` and ``**Windows.**``) is one place."""
        want = _words(title).lower()
        found = []
        for section, text in self.parts:
            have = text.lower()
            if have.startswith(want) and (len(have) == len(want) or not have[len(want)].isalnum()):
                if (within is None or within[0] <= section < within[1]) and (section, text) not in found:
                    found.append((section, text))
        return found

    def resolves(self, title: str, previous: str | None) -> bool:
        if self.section_of(title) is not None:
            return True
        if len(self.parts_starting(title)) == 1:
            return True
        within = self.section_of(previous) if previous else None
        return within is not None and len(self.parts_starting(title, within)) == 1


def _unique_slugs(slugs: list) -> set:
    """The anchors the toc makes: a repeated slug gets ``_1``, ``_2`` ..."""
    seen, out = {}, set()
    for value in slugs:
        if value in seen:
            seen[value] += 1
            value = f"{value}_{seen[value]}"
        else:
            seen[value] = 0
        out.add(value)
    return out


PAGES = {path.name: Page(path) for path in DOCS.glob("*.md")}

#: Inside a quoted title: a line break (with its indentation and a comment marker) is a space, the
#: join of two adjacent string literals (``"... "`` newline ``"..."``) nothing (:func:`_read_title`).
LINE_JOIN = re.compile(r"\s*\n\s*(?:#:?\s*)?")
REFERENCE = re.compile(r"docs/(?P<page>[\w.-]+\.md),\s*(?:(?P<join>['\"])\s*\n\s*[rbfuRBFU]*(?P=join))?(?=['\"])")
NEXT_TITLE = re.compile(r"(?:,\s+(?:and\s+)?|\s+and\s+|\s+to\s+)(?=['\"])")


def _read_title(text: str, start: int):
    """The quoted title at ``start`` (joins undone) and the offset after it, or None."""
    quote = text[start]
    other = "\"" if quote == "'" else "'"
    literal_join = re.compile(re.escape(other) + r"\s*\n\s*[rbfuRBFU]*" + re.escape(other))
    pieces, position = [], start + 1
    while position < len(text) and position - start < 400:
        join = literal_join.match(text, position)
        if join:
            position = join.end()
        elif text[position] == quote:
            return _words(LINE_JOIN.sub(" ", "".join(pieces))), position + 1
        else:
            pieces.append(text[position])
            position += 1
    return None


def _titled_references(text: str):
    """(page, [titles], offset) for every ``docs/<page>.md, 'Title' ...`` in ``text``."""
    for match in REFERENCE.finditer(text):
        titles, position = [], match.end()
        while True:
            read = _read_title(text, position)
            if read is None:
                break
            titles.append(read[0])
            position = read[1]
            following = NEXT_TITLE.match(text, position)
            if not following:
                break
            position = following.end()
        yield match.group("page"), titles, match.start()


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def test_no_section_numbers():
    left = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in FILES
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if SIGN in line]
    assert not left, "sections are cited by title, not number:\n" + "\n".join(left)


def test_algorithm_headings_are_not_numbered():
    numbered = [text for text, _, level in PAGES["algorithm.md"].headings if level > 1 and re.match(r"\d", text)]
    assert not numbered, f"numbered headings in docs/algorithm.md (cite by title instead): {numbered}"


def _reference_errors(text: str, name: str) -> list:
    """What is wrong with the titled references of ``text`` (a file called ``name``)."""
    wrong = []
    for page, titles, offset in _titled_references(text):
        where = f"{name}:{_line(text, offset)}"
        if page not in PAGES:
            wrong.append(f"{where}: docs/{page} does not exist")
            continue
        for index, title in enumerate(titles):
            if not PAGES[page].resolves(title, titles[index - 1] if index else None):
                wrong.append(f"{where}: docs/{page} has no heading or paragraph title {title!r}")
    return wrong


def _anchor_errors(text: str, name: str, in_docs: bool) -> list:
    """What is wrong with the anchors ``text`` links to (Markdown links too where ``in_docs``)."""
    links = [(m.group(1), m.group(2), m.start()) for m in re.finditer(r"docs/([\w.-]+\.md)#([\w.-]+)", text)]
    if in_docs:
        links += [(m.group(1) or Path(name).name, m.group(2), m.start())
                  for m in re.finditer(r"\]\(([\w.-]+\.md)?#([^)\s]+)\)", text)]
    wrong = []
    for page, anchor, offset in links:
        if page == "api.md" and anchor.startswith("mhaextract."):
            continue  # mkdocstrings' object anchors: mkdocs build --strict checks them
        if page not in PAGES or anchor not in PAGES[page].slugs:
            wrong.append(f"{name}:{_line(text, offset)}: no anchor #{anchor} in docs/{page}")
    return wrong


def test_titled_references_resolve():
    wrong = [error for path in FILES
             for error in _reference_errors(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not wrong, "\n".join(wrong)


def test_anchors_resolve():
    wrong = [error for path in FILES for error in _anchor_errors(path.read_text(encoding="utf-8"),
                                                                  str(path.relative_to(ROOT)), path.parent == DOCS)]
    assert not wrong, "\n".join(wrong)


def test_parts_after_links_resolve():
    """``[Title](algorithm.md#slug), "Part"``: the part is a paragraph title of that section."""
    wrong = []
    for path in DOCS.glob("*.md"):
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"\]\(([\w.-]+\.md)?#([^)\s]+)\),\s+(?=\")", text):
            page = PAGES.get(match.group(1) or path.name)
            read = _read_title(text, match.end())
            heading = next((t for t, s, _ in page.headings if s == match.group(2)), None) if page else None
            if page is None or read is None or heading is None:
                continue
            if not page.parts_starting(read[0], page.section_of(heading)):
                wrong.append(f"{path.relative_to(ROOT)}:{_line(text, match.start())}: no part {read[0]!r} in "
                             f"'{heading}'")
    assert not wrong, "\n".join(wrong)


def test_the_checks_can_fail():
    """The checks refuse what does not exist: an unknown or renamed title, a part that starts
    several paragraph titles, a part of another section, a missing page, a numbered anchor."""
    algorithm = PAGES["algorithm.md"]
    assert algorithm.resolves("The targeted schedule", None) and algorithm.resolves("Narrow heads", None)
    assert algorithm.resolves("Error estimate", "Low-rank heads")  # one of several: named by its section
    file = "docs/" + "algorithm.md"  # written apart, so that this file holds no such reference itself
    text = (f"(x, {file}, 'The targeted\n    # schedule', \"Memory\" and 'Low-rank \"\n  f\"heads') "
            f"({file}, 'The targeted schedules') ({file}, 'Whole answers') ({file}, 'Error estimate') "
            f"({file}, 'The model', 'Error estimate') ({file}, 'Low-rank heads', 'Design') (docs/{'nope'}.md, 'X')")
    references = list(_titled_references(text))
    assert references[0] == ("algorithm.md", ["The targeted schedule", "Memory", "Low-rank heads"], 4)
    wrong = _reference_errors(text, "example")
    assert [error.split("title ")[-1] for error in wrong] == [
        "'The targeted schedules'", "'Whole answers'", "'Error estimate'", "'Error estimate'", "'Design'",
        "example:3: docs/nope.md does not exist"]
    links = f"[a](algorithm.md#13-the-targeted-schedule) [b](#the-model) [c]({file}#the-model) {file}#anchors"
    assert len(_anchor_errors(links, "docs/algorithm.md", in_docs=True)) == 1
    assert len(_anchor_errors(links, "src/x.py", in_docs=False)) == 0


def test_slugs_are_python_markdowns():
    toc = pytest.importorskip("markdown.extensions.toc")
    for page in PAGES.values():
        for text, value, _ in page.headings:
            assert value == toc.slugify(text, "-"), text
