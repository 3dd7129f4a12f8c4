"""The on-disk format of precomputed samples: Parquet shards and a JSON index.

This module holds the format's names (constants, :func:`shard_name`, dtype names) and
:class:`ShardInfo`, what the index records of a shard; :mod:`fvstep.executor.latents.shards` writes
and opens shards, :mod:`fvstep.executor.latents.index` writes and reads the index.

A dataset is a directory::

    index.json              the list of shards, their row counts and each row's shapes
    encode.json             how ``fvstep data encode`` made it (absent for other writers)
    shard-00000.parquet     samples 0 .. n-1, one row per sample
    shard-00001.parquet     ...

**Why Parquet.** A sample is a few tensors (VAE latents, text embeddings) *and* strings
and numbers (a caption, the source clip's name, the number of real text tokens).
Parquet holds all of them as typed columns of one self-describing file that pyarrow,
pandas, DuckDB, Spark and Hugging Face ``datasets`` read without fvstep; it has per-page
CRC checksums, which its reader verifies, so a flipped bit in a latent is an error, not a
silently different sample; and each sample is a *row group*, so reading sample ``i``
reads its own bytes and nothing else. Safetensors shards would give zero-copy tensors and
native ``bfloat16``, but strings only in the JSON header, no checksums, and a second
index format for the rest; at the sizes of a video sample (megabytes) the one extra copy
Parquet costs is small next to the step (``python -m benchmarks.data`` measures it).

**A shard** has one row per sample and, for each tensor field ``F``, three columns:
``F`` (binary: the tensor's bytes, C order, little endian), ``F_shape`` (list of int32)
and ``F_dtype`` (string, a ``torch`` dtype name such as ``"bfloat16"``); other fields are
plain ``string``, ``int64`` or ``double`` columns. Without fvstep::

    import pyarrow.parquet as pq, torch
    row = pq.ParquetFile("shard-00000.parquet").read_row_group(0).to_pylist()[0]
    latents = torch.frombuffer(bytearray(row["latents"]), dtype=getattr(torch, row["latents_dtype"]))
    latents = latents.reshape(row["latents_shape"])

Statistics and dictionary encoding are off (they would copy megabyte blobs into the
footer), compression is off by default (latents hardly compress) and page checksums are
on. Shards are written to a temporary name and renamed, so a shard that exists is whole.

**The index** (``index.json``) lists the shards in order with their row counts and the
shapes of each row (run-length encoded), so that a reader can plan shape buckets
(:mod:`fvstep.executor.latents.order`) without opening a shard. Item ``i`` of the dataset is row
``i - start`` of the shard whose rows start at ``start``.

Examples:
    >>> import tempfile, torch
    >>> from fvstep.executor.latents import LatentDataset, write_dataset
    >>> root = tempfile.mkdtemp()
    >>> rows = [{"latents": torch.zeros(4, 1, 2, 2), "caption": f"clip {i}"} for i in range(3)]
    >>> _ = write_dataset(root, [rows[:2], rows[2:]])
    >>> ds = LatentDataset(root)
    >>> len(ds), ds[2]["caption"], ds[2]["latents"].shape
    (3, 'clip 2', torch.Size([4, 1, 2, 2]))
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
    """The file name of shard ``index``: ``shard-00007.parquet``.

    Args:
        index: The shard's position, ``>= 0``.

    Returns:
        The file name.

    Examples:
        >>> shard_name(7)
        'shard-00007.parquet'
    """
    return f"shard-{operator.index(index):05d}.parquet"


def dtype_name(dtype: torch.dtype) -> str:
    """The name a shard (and ``encode.json``) records for ``dtype``: ``"bfloat16"``.

    Args:
        dtype: A torch dtype.

    Returns:
        Its name without the ``torch.`` prefix.

    Examples:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype that :func:`dtype_name` names.

    Args:
        name: A dtype name such as ``"bfloat16"``.

    Returns:
        The dtype.

    Raises:
        ValueError: If ``name`` is no torch dtype.

    Examples:
        >>> parse_dtype("float16")
        torch.float16
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def temporary_path(path: Path) -> Path:
    """Where a file is written before it is renamed to ``path``: ``NAME.tmp-PID`` beside it.

    So a file that exists under its own name is whole, and processes writing the same file
    at once never write into each other's temporary file.

    Args:
        path: The file's final path.

    Returns:
        The temporary path of this process.

    Examples:
        >>> temporary_path(Path("out") / "index.json").name.startswith("index.json.tmp-")
        True
    """
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


class ShardInfo:
    """What the index records of one shard: its file name, row count and rows' shapes.

    Args:
        file: The shard's file name, relative to the dataset directory.
        num_rows: The number of rows (samples).
        shapes: Runs of rows with equal tensor shapes: ``[(shapes, count), ...]`` in row
            order, ``shapes`` mapping each tensor field to its shape.

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
        """Each row's shapes, in row order.

        Returns:
            One ``{field: shape}`` a row.

        Examples:
            >>> ShardInfo("s.parquet", 2, [({"x": (1,)}, 2)]).row_shapes()
            [{'x': (1,)}, {'x': (1,)}]
        """
        return [s for s, n in self.shapes for _ in range(n)]

    def to_json(self) -> dict[str, Any]:
        """The index entry (JSON-able).

        Returns:
            ``{"file", "num_rows", "shapes"}``.

        Examples:
            >>> ShardInfo("s.parquet", 1, [({"x": (2,)}, 1)]).to_json()["shapes"]
            [[{'x': [2]}, 1]]
        """
        runs = [[{k: list(v) for k, v in s.items()}, n] for s, n in self.shapes]
        return {"file": self.file, "num_rows": self.num_rows, "shapes": runs}

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> ShardInfo:
        """The inverse of :meth:`to_json`.

        Args:
            entry: An index entry.

        Returns:
            The shard's :class:`ShardInfo`.

        Raises:
            KeyError: If a key is missing.
            ValueError: If the shape runs do not cover ``num_rows``.

        Examples:
            >>> info = ShardInfo("s.parquet", 1, [({"x": (2,)}, 1)])
            >>> ShardInfo.from_json(info.to_json()) == info
            True
        """
        runs = [({k: tuple(v) for k, v in s.items()}, n) for s, n in entry["shapes"]]
        return cls(str(entry["file"]), int(entry["num_rows"]), runs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardInfo) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (
            f"ShardInfo({self.file!r}, num_rows={self.num_rows}, {len(self.shapes)} shape run(s))"
        )
