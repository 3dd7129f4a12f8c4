"""fvstep's import graph: which module imports which, by layer, and whether it has a cycle.

Reads the source with the scan and the layer table of ``tests/test_architecture.py``: every import of
an fvstep module, at any depth but under ``if TYPE_CHECKING:``. Prints the layer graph
(how many module-to-module imports go from one layer to another) and any cycle.

Usage (from the repository root):
    python scripts/import_graph.py           # the layer table and the verdict
    python scripts/import_graph.py --edges   # also every module's fvstep imports
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fvstep"

sys.path.insert(0, str(PACKAGE.parent))
from tests.test_architecture import (  # noqa: E402  the one table of layers, one scan
    LAYERS,
    MODULES,
    _layer,
    find_import_cycle,
    runtime_import_graph,
)


def layer_of(module: str) -> str:
    """The layer of ``module`` (``tests/test_architecture.py``'s table)."""
    return _layer(module)


def main(argv: list[str] | None = None) -> int:
    """Print the layer graph and the cycle verdict; exit 1 on a cycle."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="every module's fvstep imports")
    args = parser.parse_args(argv)
    graph = runtime_import_graph()
    counts: collections.Counter[tuple[str, str]] = collections.Counter(
        (layer_of(m), layer_of(n)) for m, ns in graph.items() for n in ns
    )
    print("| from layer | imports (layer: module imports) |")
    print("|---|---|")
    for layer in LAYERS:
        row = ", ".join(f"{b}: {n}" for (a, b), n in sorted(counts.items()) if a == layer)
        print(f"| {layer} | {row or '-'} |")
    cycle = find_import_cycle(graph)
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
