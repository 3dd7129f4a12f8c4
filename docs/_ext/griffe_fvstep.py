"""A Griffe extension that renders fvstep's docstrings well in mkdocstrings.

fvstep's docstrings are Google style with a few reStructuredText habits. This extension
rewrites each docstring's text before Griffe parses it, so the API pages render cleanly
(and ``mkdocs build --strict`` does not trip over doctest output that looks like Markdown
link syntax):

- an ``Example:`` section title becomes ``Examples:``, the title Griffe parses into
  highlighted ``>>>`` code blocks;
- Sphinx roles (``:class:`~fvstep.core.state.TrainState```) become code spans (``TrainState``);
- a paragraph ending in ``::`` and a ``.. math::`` directive introduce a code block;
- simple reST tables (``====  ====`` rules) become Markdown tables.

It only touches the text handed to the documentation build, never the library. Once the
docstrings use these forms themselves, each rule is a no-op.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_TITLE = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|math):`(~?)([^`]+)`")
_MATH = re.compile(r"^[ \t]*\.\. math::[ \t]*$", re.MULTILINE)
_LITERAL_INTRO = re.compile(r"(\S)::[ \t]*$", re.MULTILINE)
_RULE = re.compile(r"^([ \t]*)(=+(?:[ \t]+=+)+)[ \t]*$")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _columns(rule: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]


def _cells(line: str, spans: list[tuple[int, int]]) -> list[str]:
    cells = []
    for i, (start, _end) in enumerate(spans):
        stop = spans[i + 1][0] if i + 1 < len(spans) else len(line)
        cells.append(line[start:stop].strip().replace("|", "\\|"))
    return cells


def _tables(text: str) -> str:
    """Turn reST simple tables (rule, header, rule, rows, rule) into Markdown tables."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        first = _RULE.match(lines[i])
        if not first or i + 2 >= len(lines) or not _RULE.match(lines[i + 2]):
            out.append(lines[i])
            i += 1
            continue
        indent = first.group(1)
        spans = _columns(lines[i][len(indent) :])
        end = i + 3
        while end < len(lines) and not _RULE.match(lines[end]):
            end += 1
        if end == len(lines):
            out.append(lines[i])
            i += 1
            continue
        header = _cells(lines[i + 1][len(indent) :], spans)
        out += ["", indent + "| " + " | ".join(header) + " |"]
        out.append(indent + "|" + "|".join("---" for _ in spans) + "|")
        for row in lines[i + 3 : end]:
            if row.strip():
                out.append(indent + "| " + " | ".join(_cells(row[len(indent) :], spans)) + " |")
        out.append("")
        i = end + 1
    return "\n".join(out)


def rewrite(text: str) -> str:
    """The docstring ``text`` in the forms mkdocstrings renders."""
    text = _tables(text)  # first: cells are found by column, before roles shorten them
    text = _EXAMPLE_TITLE.sub(r"\1Examples:", text)
    text = _ROLE.sub(_role, text)
    text = _MATH.sub("", text)
    return _LITERAL_INTRO.sub(r"\1:", text)


class FvstepDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded objects (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
