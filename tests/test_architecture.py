"""The layering of ``docs/architecture.md``, checked on the source (an AST scan, no imports).

- Each layer imports only itself and the layers it builds on (``LAYERS``, ``MAY_IMPORT``).
- The core imports nothing from ``torch.distributed``, FSDP2, DTensor or fvstep's parallel
  layer: a call is given its process layout.
- The reference methods never touch processes (they are loss math over the state).
- No library module imports the package face (``fvstep/__init__.py``); only the
  applications at the top (the command line, the demo) may, and no library
  module imports them.
- Private torch APIs are reached through ``fvstep/core/_compat.py`` alone, where the
  ``torch.distributed`` ones are imported lazily (inside the function that needs them).
- No import cycle between fvstep's modules (imports inside functions count; those under
  ``if TYPE_CHECKING:`` do not), and no new import of another module's private name (the
  rule that replaced a 450-line cap: cohesion over a cap).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

# The package that `import fvstep` finds: the checkout's, or an installed wheel's (the
# layering holds for what is shipped; scripts/check_dist.sh --full runs these on it).
PACKAGE = Path(importlib.util.find_spec("fvstep").submodule_search_locations[0]).resolve()  # type: ignore[union-attr,index]

CORE = "fvstep.core"
"""The core: what a state and a step are made of (the state, its keys, optimizers and
schedules, the steps and the engine). ``fvstep.core.layout`` is the protocol a call is
given."""

COMPAT = "fvstep.core._compat"
"""The one door to private torch APIs and to ``torch.distributed`` (imported lazily)."""

APPLICATIONS = ("fvstep.__main__", "fvstep.cli", "fvstep.recipes")
"""The package's own users, at the top: they may import the face, nothing imports them."""

FORBIDDEN_IN_CORE = ("torch.distributed", "fvstep.parallel")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported module or module.name, line, at module level)`` for every import."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    top_level = {id(node) for node in tree.body}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        at_top = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, at_top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(f"{base}.{alias.name}", node.lineno, at_top) for alias in node.names]
    return found


def _fvstep_target(imported: str) -> str | None:
    """The fvstep module an import reaches (``fvstep`` itself for a name of the face)."""
    if not _is_within(imported, "fvstep"):
        return None
    while imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported


def _violations(modules: list[str], bad: object) -> list[str]:
    out = []
    for module in modules:
        for imported, line, at_top in _imports(module):
            reason = bad(module, imported, at_top)  # type: ignore[operator]
            if reason:
                out.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {reason}")
    return out


def _assert_none(violations: list[str]) -> None:
    assert not violations, "\n".join(["", *violations])


def test_the_layer_lists_name_existing_modules() -> None:
    for module in (COMPAT, *(p for prefixes in LAYERS.values() for p in prefixes)):
        assert module in MODULES, f"{module} is not a module"


def test_the_core_imports_nothing_from_torch_distributed_fsdp2_or_the_parallel_layer() -> None:
    def bad(module: str, imported: str, at_top: bool) -> str | None:
        # `from torch import distributed` reaches it too
        if _is_within(imported, FORBIDDEN_IN_CORE) or imported == "torch.distributed":
            return f"imports {imported} (the core is given a sync policy)"
        return None

    # the compat module reaches torch.distributed lazily, for the layers above the core
    core = [m for m in MODULES if _is_within(m, CORE) and m != COMPAT]
    _assert_none(_violations(core, bad))


LAYERS = {
    "core": (CORE,),
    "parallel": ("fvstep.parallel",),
    "checkpoint": ("fvstep.checkpoint",),
    "executor": ("fvstep.executor", "fvstep.testing"),
    "methods": ("fvstep.methods",),
    "face": ("fvstep",),
    "applications": APPLICATIONS,
}
"""Every module of the package, by layer (docs/architecture.md): one folder a layer, but
``fvstep.testing``, the resume law for users' own methods, whose import path is public
(as ``torch.testing``'s), and the applications' two folders and ``python -m fvstep``."""

MAY_IMPORT = {
    "core": {"core"},
    "parallel": {"core", "parallel"},
    "methods": {"core", "methods"},
    "checkpoint": {"core", "parallel", "methods", "checkpoint"},
    "executor": {"core", "parallel", "methods", "checkpoint", "executor"},
    "face": {"core", "parallel", "methods", "checkpoint", "executor", "face"},
    "applications": set(LAYERS),
}


def _layer(module: str) -> str:
    # the longest matching prefix decides (fvstep.parallel before fvstep itself)
    found = [
        (len(prefix), layer)
        for layer, prefixes in LAYERS.items()
        for prefix in prefixes
        if module == prefix or (prefix != "fvstep" and module.startswith(prefix + "."))
    ]
    if not found:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (docs/architecture.md)")
    return max(found)[1]


def test_every_module_belongs_to_a_layer() -> None:
    for module in MODULES:
        _layer(module)


TOP_LEVEL_MAX = 8
"""Entries of ``fvstep/`` (folders and modules) besides the package's own ``__init__`` and
``__main__``: the seven layers' folders and ``testing``. A new concept goes into the folder
of its layer."""


def test_the_top_level_of_the_package_is_the_layers_folders() -> None:
    entries = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.name not in ("__pycache__", "__init__.py", "__main__.py")
    )
    assert len(entries) <= TOP_LEVEL_MAX, (
        f"fvstep/ has {len(entries)} entries (at most {TOP_LEVEL_MAX}): put a new module "
        f"into the folder of its layer (docs/architecture.md): {entries}"
    )
    folders = {f"fvstep.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    loose = {_module_name(p) for p in PACKAGE.glob("*.py")}
    assert loose == {"fvstep", "fvstep.__main__", "fvstep.testing"}, sorted(loose)
    layered = {p for prefixes in LAYERS.values() for p in prefixes}
    assert folders <= layered, f"folders in no layer: {sorted(folders - layered)}"


def test_each_layer_imports_only_itself_and_the_layers_it_builds_on() -> None:
    def bad(module: str, imported: str, at_top: bool) -> str | None:
        target = _fvstep_target(imported)
        if target is None:
            return None
        mine, theirs = _layer(module), _layer(target)
        if theirs not in MAY_IMPORT[mine]:
            return f"the {mine} layer imports {target} of the {theirs} layer"
        return None

    _assert_none(_violations(list(MODULES), bad))


def test_the_reference_methods_never_touch_processes() -> None:
    methods = [m for m in MODULES if _is_within(m, "fvstep.methods")]

    def bad(module: str, imported: str, at_top: bool) -> str | None:
        if _is_within(imported, FORBIDDEN_IN_CORE) or imported == "torch.distributed":
            return f"imports {imported} (a method is loss math over the state)"
        return None

    assert methods
    _assert_none(_violations(methods, bad))


def _face_names() -> set[str]:
    """Names that ``fvstep/__init__.py`` itself defines or re-exports (not submodules)."""
    tree = ast.parse(MODULES["fvstep"].read_text())
    names = set()
    body = list(tree.body)
    for node in tree.body:  # the lazy face's `if TYPE_CHECKING:` imports name its exports
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            body += node.body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    names = {n for n in names if f"fvstep.{n}" not in MODULES}
    assert {"TrainState", "Validation", "run", "plan"} <= names, "the face's names were not found"
    return names


def test_no_library_module_imports_the_package_face_or_an_application() -> None:
    face = _face_names()
    library = [m for m in MODULES if m != "fvstep" and not _is_within(m, APPLICATIONS)]

    def bad(module: str, imported: str, at_top: bool) -> str | None:
        if imported == "fvstep":
            return "imports the package face (`import fvstep`)"
        if imported.rpartition(".")[0] == "fvstep" and imported.rpartition(".")[2] in face:
            return f"imports {imported} from the package face"
        target = _fvstep_target(imported)
        if target is not None and _is_within(target, APPLICATIONS):
            return f"imports the application {target}"
        return None

    _assert_none(_violations(library, bad))


def _is_private_torch(imported: str) -> bool:
    parts = imported.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts[1:])


def test_private_torch_apis_are_reached_through_the_compat_module_only() -> None:
    def bad(module: str, imported: str, at_top: bool) -> str | None:
        if module != COMPAT and _is_private_torch(imported):
            return f"imports the private {imported}: add a shim to fvstep/core/_compat.py"
        return None

    _assert_none(_violations(list(MODULES), bad))


PRIVATE_TORCH_ATTRIBUTES = ("_get_fsdp_state", "_is_root", "_version")
"""Private attributes of torch objects that fvstep reads (FSDP2 state, version counters)."""


def test_private_torch_attributes_are_read_through_the_compat_module_only() -> None:
    found = []
    for module, path in MODULES.items():
        if module == COMPAT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH_ATTRIBUTES:
                found.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: reads .{node.attr}: "
                    "use fvstep.core._compat"
                )
    _assert_none(found)


def test_the_compat_module_imports_torch_distributed_lazily() -> None:
    def bad(module: str, imported: str, at_top: bool) -> str | None:
        if at_top and _is_within(imported, "torch.distributed"):
            return f"imports {imported} at module level (the core imports this module)"
        return None

    _assert_none(_violations([COMPAT], bad))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch.distributed as dist", ["torch.distributed"]),
        ("from torch.distributed.fsdp import fully_shard", ["torch.distributed.fsdp.fully_shard"]),
        ("def f():\n    from fvstep import parallel", ["fvstep.parallel"]),
    ],
)
def test_the_scan_sees_module_level_and_nested_imports(tmp_path, monkeypatch, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "fvstep.probe", path)
    assert [name for name, _, _ in _imports("fvstep.probe")] == expected


def _private_imports() -> list[str]:
    """``module:line imports target._name`` for every import of a ``_name`` defined in
    another fvstep module (the package's private modules, ``fvstep.core._compat`` and the like,
    are the package's shared internals: importing them is their purpose)."""
    found = []
    for module in MODULES:
        for imported, line, _ in _imports(module):
            target = _fvstep_target(imported)
            if target is None or target == module or target == "fvstep":
                continue
            name = imported[len(target) + 1 :] if imported != target else ""
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"{module}:{line} imports {imported}")
    return found


PRIVATE_IMPORTS_LEFT = 0
"""Imports of another module's private names still in the code (issue 36 took them to 0:
a name shared between modules is public in its home module): the number may only go down."""


def test_no_module_adds_an_import_of_another_modules_private_name() -> None:
    # Cohesion over a line cap: a module that needs another's private names is one idea
    # split in two. The cap this replaces (450 lines) caused most of these imports.
    found = _private_imports()
    assert len(found) <= PRIVATE_IMPORTS_LEFT, (
        f"{len(found)} imports of another module's private names (at most "
        f"{PRIVATE_IMPORTS_LEFT}): make the name public, or merge the modules:\n" + "\n".join(found)
    )


def _runtime_imports(module: str) -> set[str]:
    """The fvstep modules ``module`` imports, at any depth but ``if TYPE_CHECKING:``."""
    tree = ast.parse(MODULES[module].read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    out = set()
    for imported, line, _ in _imports(module):
        nodes = [n for n in ast.walk(tree) if getattr(n, "lineno", None) == line]
        if any(id(n) in typing_only for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))):
            continue
        target = _fvstep_target(imported)
        if target is not None and target != module and target != "fvstep":
            out.add(target)
    return out


def runtime_import_graph() -> dict[str, set[str]]:
    """Every module of the package and the fvstep modules it imports at run time."""
    return {m: _runtime_imports(m) for m in MODULES}


def find_import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as ``[m, ..., m]``, or ``None``. A submodule's import of its
    own package (whose ``__init__`` re-exports it) is not a cycle; any other path through
    a package's ``__init__`` is."""
    done: set[str] = set()
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        if m in path:
            return [*path[path.index(m) :], m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph.get(m, ())):
            own_package = _is_within(m, n) and n in MODULES and MODULES[n].name == "__init__.py"
            if not own_package and (cycle := visit(n)):
                return cycle
        path.pop()
        done.add(m)
        return None

    return next((c for m in sorted(graph) if (c := visit(m))), None)


def test_there_is_no_import_cycle() -> None:
    cycle = find_import_cycle(runtime_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_search_finds_a_cycle_and_ignores_a_package_reexport() -> None:
    assert find_import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_import_cycle({"a": {"b"}, "b": set()}) is None
    # a package that re-exports its submodule, which imports the package: no cycle
    graph = {
        "fvstep.core": {"fvstep.core.tree"},
        "fvstep.core.tree": {"fvstep.core"},
    }
    assert find_import_cycle(graph) is None


REMOVED_NAMES = (
    "FSDP2Parallelism",
    "ContextParallelism",
    "ContextParallelData",
    "sequence_parallel_size",
    "DeprecationWarning",
    "is deprecated",
)
"""Names and words of the aliases that were removed (the package was never released)."""


def test_no_deprecated_or_alias_name_is_left_in_the_package() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{i}: {word}"
        for path in MODULES.values()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for word in REMOVED_NAMES
        if word in line
    ]
    _assert_none(found)


OUTSIDE_DOCUMENTS = ("DESIGN.md", "DESIGN point", "REFERENCE.md", "STYLE.md")
"""Documents that are not in the repository: the code explains itself instead."""


def test_the_code_cites_no_document_outside_the_repository() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{i}: {word}"
        for path in MODULES.values()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for word in OUTSIDE_DOCUMENTS
        if word in line
    ]
    _assert_none(found)


DTENSOR_PROBES = ('"to_local")', '"device_mesh", None)', '"full_tensor", None)')
"""The duck-typed "is this a DTensor?" tests: written once, in ``fvstep.core.tree``."""


def test_the_dtensor_vocabulary_is_the_only_dtensor_probe() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()} (use fvstep.core.tree.is_dtensor, "
        "any_dtensor, local_tensor, local_tensors or full_tensor)"
        for module, path in MODULES.items()
        if module != "fvstep.core.tree"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if any(probe in line for probe in DTENSOR_PROBES)
    ]
    _assert_none(found)
