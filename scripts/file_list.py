"""Print the file list of ``docs/architecture.md``: every module of ``fvstep/``, its line
count and the first line of its docstring, as a Markdown table.

Usage (from the repository root):
    python scripts/file_list.py            # the table, and a summary line
    python scripts/file_list.py --write    # replace the table in docs/architecture.md
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
HEADER = "| file | lines | what it is |"


def rows() -> list[tuple[str, int, str]]:
    """``(path, lines, first docstring line)`` of every module under ``fvstep/``."""
    out = []
    for path in sorted((ROOT / "fvstep").rglob("*.py")):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        first = doc.strip().splitlines()[0] if doc.strip() else ""
        if len(first) > 110:
            first = first[:107] + "..."
        out.append((str(path.relative_to(ROOT)), len(text.splitlines()), first.replace("|", "\\|")))
    return out


def table() -> str:
    """The Markdown table."""
    lines = [HEADER, "|---|---|---|"]
    lines += [f"| `{p}` | {n} | {d} |" for p, n, d in rows()]
    return "\n".join(lines)


def main() -> None:
    """Print or write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in the doc")
    args = parser.parse_args()
    r = rows()
    summary = f"{len(r)} modules, {sum(n for _, n, _ in r):,} lines; the longest {max(n for _, n, _ in r)}"
    if not args.write:
        print(table())
        print(summary)
        return
    text = DOC.read_text()
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    end = len(text) if end == -1 else end
    DOC.write_text(text[:start] + table() + text[end:])
    print(summary)


if __name__ == "__main__":
    main()
