"""The parallel package: rank helpers on one process and on 2 CPU ranks (gloo), the
executor calling no ``torch.distributed``,
and the checkpoint's version read without the package face (the layering itself is
``tests/test_architecture.py``).

Each ``check_*`` function runs on every rank of the ``ranks`` pool (tests/multirank.py).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import tempfile
from pathlib import Path

import pytest
import torch

import fvstep
from fvstep import parallel as fsp
from fvstep.checkpoint import saving
from fvstep.checkpoint.directories import checkpoint_dir
from fvstep.checkpoint.saving import fsync, read_manifest

PACKAGE = Path(fvstep.__file__).parent

# --------------------------------------------------------------- rank helpers, 1 process


def test_rank_helpers_without_a_process_group_are_the_single_process_answers():
    assert not torch.distributed.is_initialized()
    assert fsp.rank_and_world() == (0, 1)
    fsp.barrier()  # returns at once
    value = {"a": [1, 2]}
    assert fsp.gather_objects(value) == [value]
    assert fsp.gather_objects(value)[0] is value
    assert fsp.broadcast_object(value) is value
    assert fsp.max_over_ranks([3, 1.5]) == [3, 1.5]
    assert fsp.min_over_ranks([]) == []
    assert fsp.collective_device() == torch.device("cpu")
    assert fsp.Layout().data_parallel_rank_and_size() == (0, 1)


# --------------------------------------------------------------- rank helpers, 2 ranks


def check_rank_helpers(rank: int, world_size: int) -> dict:
    group = torch.distributed.new_group([0, 1], backend="gloo")
    fsp.barrier()
    fsp.barrier(group)
    big = 2**60 + rank  # not representable in float64: an exact reduction keeps it
    return {
        "rank_and_world": fsp.rank_and_world(),
        "in_group": fsp.rank_and_world(group),
        "gathered": fsp.gather_objects(("rank", rank)),
        "gathered_in_group": fsp.gather_objects(rank * 10, group=group),
        "from_0": fsp.broadcast_object(f"from {rank}" if rank == 0 else None),
        "from_1": fsp.broadcast_object([rank] if rank == 1 else None, src=1, group=group),
        "max": fsp.max_over_ranks([big, rank == 1]),
        "max_float": fsp.max_over_ranks([float(rank) + 0.5, 2]),
        "min": fsp.min_over_ranks([big, -rank], group=group),
        "device": str(fsp.collective_device()),
        "dp": fsp.Layout().data_parallel_rank_and_size(),
    }


def test_rank_helpers_on_two_ranks(ranks):
    results = ranks.run(check_rank_helpers)
    for rank, r in enumerate(results):
        assert r["rank_and_world"] == r["in_group"] == (rank, 2)
        assert r["gathered"] == [("rank", 0), ("rank", 1)]
        assert r["gathered_in_group"] == [0, 10]
        assert r["from_0"] == "from 0"
        assert r["from_1"] == [1]
        assert r["max"] == [2**60 + 1, 1]
        assert all(type(v) is int for v in r["max"] + r["min"])
        assert r["max_float"] == [1.5, 2.0]  # any float: all reduced in float64
        assert all(type(v) is float for v in r["max_float"])
        assert r["min"] == [2**60, -1]
        assert r["device"] == "cpu"
        assert r["dp"] == (rank, 2)


def test_every_public_name_of_the_package_is_exported_by_its_module():
    for name in fsp.__all__:
        obj = getattr(fsp, name)
        module = getattr(obj, "__module__", "")
        if module.startswith("fvstep.parallel."):
            assert name in importlib.import_module(module).__all__, (name, module)


# --------------------------------------------------------------- import rules


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import in ``path`` (``names`` empty for ``import x``)."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module or "", [a.name for a in node.names]))
    return found


def test_the_executor_calls_no_torch_distributed():
    source = PACKAGE / "executor" / "loop.py"
    assert not [m for m, _ in _imports(source) if m.startswith("torch.distributed")]
    assert "dist." not in source.read_text()


def test_a_checkpoint_records_the_installed_version(tmp_path):
    state = {"w": torch.arange(4.0)}
    path = saving.save(state, checkpoint_dir(tmp_path, 0))
    assert read_manifest(path).fvstep_version == importlib.metadata.version("fvstep")


def test_the_version_of_an_uninstalled_checkout_is_a_placeholder(monkeypatch):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert saving._installed_version() == "0+unknown"


def test_fsync_flushes_files_and_directories():
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "f"
        file.write_bytes(b"x")
        fsync(file)
        fsync(tmp)
        with pytest.raises(FileNotFoundError):
            fsync(Path(tmp) / "missing")
