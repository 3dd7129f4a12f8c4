"""How much of fvstep is prose: raise statements, long module docstrings, long messages.

Run from a checkout: ``python scripts/prose.py [PACKAGE_DIR]``. It prints one row for the
package and one per top-level folder: code lines (not blank, a comment or a docstring), the share of
them inside ``raise`` statements (the lines each ``ast.Raise`` spans), module docstrings
over 10 lines, and error messages over 2 source lines (the first argument of a raised call).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def _is_docstring(node: ast.stmt | None) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def measure_file(path: Path) -> tuple[int, int, int, int]:
    """Return (code lines, lines in raise, long module docstrings, long messages)."""
    text = path.read_text()
    lines = text.splitlines()
    code = {
        i for i, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")
    }
    tree = ast.parse(text)
    for node in ast.walk(tree):  # docstrings are prose, not code
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if _is_docstring(first):
                code -= set(range(first.lineno, first.end_lineno + 1))
    in_raise: set[int] = set()
    long_messages = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise):
            continue
        in_raise.update(range(node.lineno, node.end_lineno + 1))
        exc = node.exc
        if isinstance(exc, ast.Call) and exc.args:
            message = exc.args[0]
            if message.end_lineno - message.lineno + 1 > 2:
                long_messages += 1
    long_doc = 0
    first = tree.body[0] if tree.body else None
    if _is_docstring(first) and first.end_lineno - first.lineno + 1 > 10:
        long_doc = 1
    return len(code), len(in_raise & code), long_doc, long_messages


def main() -> None:
    """Print the table for the package directory (``fvstep`` by default)."""
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "fvstep")
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        group = parts[0] + "/" if len(parts) > 1 else "(top-level files)"
        row = measure_file(path)
        for name in (str(root) + "/", group):
            totals[name] = [a + b for a, b in zip(totals[name], row)]
    print("| folder | code lines | in `raise` | docstrings > 10 lines | messages > 2 lines |")
    print("|---|---|---|---|---|")
    for name in sorted(totals, key=lambda n: (n != str(root) + "/", n)):
        code, raised, docs, messages = totals[name]
        share = 100 * raised / code if code else 0.0
        print(f"| `{name}` | {code} | {share:.1f} % ({raised}) | {docs} | {messages} |")


if __name__ == "__main__":
    main()
