"""The on-disk format of precomputed samples: Parquet shards and a JSON index.

A dataset is a directory of ``index.json`` (the shards in order, their row counts and each
row's shapes, run-length encoded), ``encode.json`` (how ``fvstep data encode`` made it) and
``shard-00000.parquet``, ... (one row, and one row group, per sample). A tensor field ``F``
is three columns: ``F`` (its bytes, C order, little endian), ``F_shape`` (list of int32)
and ``F_dtype`` (a torch dtype name); other fields are plain columns. This module holds the
format's names and :class:`ShardInfo`; why Parquet, and reading a shard without fvstep:
docs/concepts/data.md.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "VERSION",
    "Shapes",
    "ShardInfo",
    "dtype_name",
    "parse_dtype",
    "shard_name",
    "temporary_path",
]

FORMAT = "fvstep-latents"
VERSION = 1
INDEX_FILE = "index.json"

# A row's shapes: {tensor field: shape}; a shard's: runs of equal shapes [(shapes, count)].
Shapes = dict[str, tuple[int, ...]]


def shard_name(index: int) -> str:
    """The file name of shard ``index``.

    Examples:
        >>> shard_name(7)
        'shard-00007.parquet'
    """
    return f"shard-{operator.index(index):05d}.parquet"


def dtype_name(dtype: torch.dtype) -> str:
    """The name a shard (and ``encode.json``) records for ``dtype``, without ``torch.``.

    Examples:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype that :func:`dtype_name` names.

    Raises:
        ValueError: If ``name`` is no torch dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def temporary_path(path: Path) -> Path:
    """Where a file is written before it is renamed to ``path``: ``NAME.tmp-PID`` beside it."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


class ShardInfo:
    """What the index records of one shard: its file name, row count and rows' shapes.

    Args:
        file: The shard's file name, relative to the dataset directory.
        shapes: Runs of rows with equal tensor shapes, ``[({field: shape}, count), ...]``.

    Examples:
        >>> info = ShardInfo("shard-00000.parquet", 2, [({"latents": (4, 1, 2, 2)}, 2)])
        >>> info.row_shapes()[1]
        {'latents': (4, 1, 2, 2)}
    """

    def __init__(self, file: str, num_rows: int, shapes: Sequence[tuple[Shapes, int]]) -> None:
        self.file = file
        self.num_rows = int(num_rows)
        self.shapes = [(dict(s), int(n)) for s, n in shapes]
        if sum(n for _, n in self.shapes) != self.num_rows:
            raise ValueError(
                f"{file}: shape runs cover {sum(n for _, n in shapes)} rows, not {num_rows}"
            )

    def row_shapes(self) -> list[Shapes]:
        """Each row's ``{field: shape}``, in row order."""
        return [s for s, n in self.shapes for _ in range(n)]

    def to_json(self) -> dict[str, Any]:
        """The index entry (JSON-able): ``{"file", "num_rows", "shapes"}``."""
        runs = [[{k: list(v) for k, v in s.items()}, n] for s, n in self.shapes]
        return {"file": self.file, "num_rows": self.num_rows, "shapes": runs}

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> ShardInfo:
        """The inverse of :meth:`to_json`.

        Raises:
            KeyError: If a key is missing.
            ValueError: If the shape runs do not cover ``num_rows``.
        """
        runs = [({k: tuple(v) for k, v in s.items()}, n) for s, n in entry["shapes"]]
        return cls(str(entry["file"]), int(entry["num_rows"]), runs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardInfo) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (
            f"ShardInfo({self.file!r}, num_rows={self.num_rows}, {len(self.shapes)} shape run(s))"
        )
