"""fvstep's import graph: which module imports which, by layer, and whether it has a cycle.

Reads the source (an AST scan, with ``tests/test_architecture.py``'s table of layers): every import of
an fvstep module, at any depth but under ``if TYPE_CHECKING:``. Prints the layer graph
(how many module-to-module imports go from one layer to another) and any cycle.

Usage (from the repository root):
    python scripts/import_graph.py           # the layer table and the verdict
    python scripts/import_graph.py --edges   # also every module's fvstep imports
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fvstep"

sys.path.insert(0, str(PACKAGE.parent))
from tests.test_architecture import LAYERS, _layer  # noqa: E402  the one table of layers


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer of ``module`` (``tests/test_architecture.py``'s table)."""
    return _layer(module)


def imports_of(module: str) -> set[str]:
    """The fvstep modules ``module`` imports at run time."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name not in (module, "fvstep"):
                out.add(name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (a package reached from its own submodule does not count)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        if m in path:
            return [*path[path.index(m) :], m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph[m]):
            own_package = m.startswith(n + ".") and MODULES[n].name == "__init__.py"
            if not own_package and (found := visit(n)):
                return found
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        if found := visit(m):
            return found
    return None


def main(argv: list[str] | None = None) -> int:
    """Print the layer graph and the cycle verdict; exit 1 on a cycle."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="every module's fvstep imports")
    args = parser.parse_args(argv)
    graph = {m: imports_of(m) for m in MODULES}
    counts: collections.Counter[tuple[str, str]] = collections.Counter(
        (layer_of(m), layer_of(n)) for m, ns in graph.items() for n in ns
    )
    print("| from layer | imports (layer: module imports) |")
    print("|---|---|")
    for layer in LAYERS:
        row = ", ".join(f"{b}: {n}" for (a, b), n in sorted(counts.items()) if a == layer)
        print(f"| {layer} | {row or '-'} |")
    cycle = find_cycle(graph)
    print(
        f"\n{len(MODULES)} modules, {sum(map(len, graph.values()))} imports between them; "
        + ("import cycle: " + " -> ".join(cycle) if cycle else "no import cycle")
    )
    if args.edges:
        for m in sorted(graph):
            print(f"{m}: {', '.join(sorted(graph[m])) or '-'}")
    return 1 if cycle else 0


if __name__ == "__main__":
    sys.exit(main())
