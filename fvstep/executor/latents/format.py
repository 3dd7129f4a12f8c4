"""The on-disk format of precomputed samples: Parquet shards and a JSON index.

The format's names, :class:`ShardInfo`, the shards' writer and reader and the index. The
format itself (a tensor field ``F`` is the columns ``F``, ``F_shape`` and ``F_dtype``), why
Parquet, and reading a shard without fvstep: docs/concepts/data.md.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fvstep.core._optional import needs_extra
from fvstep.core.errors import ShardError

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "VERSION",
    "Shapes",
    "ShardInfo",
    "describe_shard",
    "dtype_name",
    "open_shard",
    "parse_dtype",
    "read_index",
    "shard_name",
    "temporary_path",
    "write_dataset",
    "write_index",
    "write_shard",
]

FORMAT = "fvstep-latents"
VERSION = 1
INDEX_FILE = "index.json"

# A row's shapes: {tensor field: shape}; a shard's: runs of equal shapes [(shapes, count)].
Shapes = dict[str, tuple[int, ...]]


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``shard-00007.parquet`` for 7."""
    return f"shard-{operator.index(index):05d}.parquet"


def dtype_name(dtype: torch.dtype) -> str:
    """The name a shard (and ``encode.json``) records for ``dtype``: ``bfloat16``, no ``torch.``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype that :func:`dtype_name` names; ValueError if there is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def temporary_path(path: Path) -> Path:
    """Where a file is written before it is renamed to ``path``: ``NAME.tmp-PID`` beside it."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


class ShardInfo:
    """What the index records of one shard: its file name (relative to the dataset directory),
    row count and rows' shapes as runs ``[({field: shape}, count), ...]``; ValueError if the runs
    do not cover ``num_rows``."""

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
        """The inverse of :meth:`to_json` (KeyError for a missing key)."""
        runs = [({k: tuple(v) for k, v in s.items()}, n) for s, n in entry["shapes"]]
        return cls(str(entry["file"]), int(entry["num_rows"]), runs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardInfo) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (
            f"ShardInfo({self.file!r}, num_rows={self.num_rows}, {len(self.shapes)} shape run(s))"
        )


_META_KEY = b"fvstep"


def _arrow() -> Any:
    with needs_extra("data", "fvstep.executor.latents (Parquet shards)"):
        import pyarrow as pa
        import pyarrow.parquet as pq
    return pa, pq


def _shard_info(file: str, num_rows: int, shapes: Mapping[str, Sequence[Any]]) -> ShardInfo:
    """A shard's :class:`ShardInfo` from its shape columns ``{tensor field: each row's shape}``."""
    runs: list[tuple[Shapes, int]] = []
    for i in range(num_rows):
        row = {t: tuple(column[i]) for t, column in shapes.items()}
        if runs and runs[-1][0] == row:
            runs[-1] = (row, runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return ShardInfo(file, num_rows, runs)


def _columns(rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, list[Any]], list[str]]:
    names = list(rows[0])
    for i, row in enumerate(rows):
        if set(row) != set(names):
            raise ValueError(f"row {i} has fields {sorted(row)}, row 0 has {sorted(names)}")
    tensors = [n for n in names if isinstance(rows[0][n], torch.Tensor)]
    cols: dict[str, list[Any]] = {}
    for name in names:
        if name in tensors:
            values = [row[name] for row in rows]
            if not all(isinstance(v, torch.Tensor) for v in values):
                raise ValueError(f"field {name!r} is a tensor in row 0 but not in every row")
            dense = [v.detach().to("cpu").contiguous() for v in values]
            cols[name] = [v.reshape(-1).view(torch.uint8).numpy().tobytes() for v in dense]
            cols[f"{name}_shape"] = [list(v.shape) for v in dense]
            cols[f"{name}_dtype"] = [dtype_name(v.dtype) for v in dense]
        else:
            if name.endswith(("_shape", "_dtype")) and name.rsplit("_", 1)[0] in tensors:
                raise ValueError(
                    f"field {name!r} clashes with tensor field {name.rsplit('_', 1)[0]!r}"
                )
            cols[name] = [row[name] for row in rows]
    return cols, tensors


def write_shard(
    path: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    compression: str = "none",
) -> ShardInfo:
    """Write ``rows`` (dicts of tensors, strings, numbers) as one shard; its :class:`ShardInfo`.

    Atomic; tensor fields may differ in shape and dtype; ValueError for no rows or unlike ones."""
    if not rows:
        raise ValueError("a shard needs at least one row")
    pa, pq = _arrow()
    cols, tensors = _columns(rows)
    meta = {"format": FORMAT, "version": VERSION, "tensors": tensors}
    table = pa.table(cols).replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
    path = Path(path)
    tmp = temporary_path(path)
    try:
        pq.write_table(
            table,
            tmp,
            row_group_size=1,
            compression=compression,
            use_dictionary=False,
            write_statistics=False,
            write_page_checksum=True,
        )
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return _shard_info(path.name, len(rows), {t: cols[f"{t}_shape"] for t in tensors})


def open_shard(path: Path, *, verify: bool = True) -> tuple[Any, list[str]]:
    """``(parquet_file, tensor_fields)`` of an fvstep shard, its pages' checksums verified on read.

    ShardError if the file is missing, damaged, or no fvstep shard (or of a newer version)."""
    _, pq = _arrow()
    if not path.exists():
        raise ShardError(f"missing shard {str(path)!r}")
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=verify)
        meta = json.loads((pf.schema_arrow.metadata or {}).get(_META_KEY, b"null"))
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
        raise ShardError(f"damaged shard {str(path)!r}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardError(f"{str(path)!r} is not an fvstep latents shard (no {FORMAT} metadata)")
    if meta.get("version", 0) > VERSION:
        raise ShardError(
            f"{str(path)!r} is format version {meta['version']}; this fvstep reads <= {VERSION}"
        )
    return pf, list(meta["tensors"])


def describe_shard(path: str | os.PathLike[str]) -> ShardInfo:
    """Read a shard's :class:`ShardInfo` (only its small ``*_shape`` columns).

    ShardError if the file is missing, damaged, or no fvstep shard."""
    path = Path(path)
    pf, tensors = open_shard(path)
    try:
        table = pf.read(columns=[f"{t}_shape" for t in tensors])
    except (OSError, ValueError) as e:
        raise ShardError(f"damaged shard {str(path)!r}: {e}") from e
    shapes = {t: table.column(f"{t}_shape").to_pylist() for t in tensors}
    return _shard_info(path.name, pf.metadata.num_rows, shapes)


def write_index(
    root: str | os.PathLike[str],
    shards: Sequence[ShardInfo],
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``root/index.json`` for ``shards`` (in dataset order) atomically; return its path.

    ``extra``: JSON-able facts kept beside the index (``fvstep data encode``'s settings)."""
    root = Path(root)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "num_rows": sum(s.num_rows for s in shards),
        "shards": [s.to_json() for s in shards],
        **({"extra": dict(extra)} if extra else {}),
    }
    path = root / INDEX_FILE
    tmp = temporary_path(path)
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_index(root: str | os.PathLike[str]) -> list[ShardInfo]:
    """The shards listed by ``root/index.json``, in dataset order.

    FileNotFoundError without an index (unfinished encode); ShardError if malformed or newer."""
    path = Path(root) / INDEX_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"no {INDEX_FILE} in {str(root)!r}: not an fvstep latents dataset, or its "
            "encode has not finished (run `fvstep data encode` again to complete it)"
        )
    try:
        index = json.loads(path.read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"format is {index.get('format')!r}, not {FORMAT!r}")
        if index.get("version", 0) > VERSION:
            raise ValueError(f"version {index['version']} is newer than this fvstep's {VERSION}")
        return [ShardInfo.from_json(e) for e in index["shards"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ShardError(f"malformed index {str(path)!r}: {e}") from e


def write_dataset(
    root: str | os.PathLike[str], shards: Sequence[Sequence[Mapping[str, Any]]]
) -> list[ShardInfo]:
    """Write each list of rows as a shard of ``root`` and then the index: a whole dataset.

    Raises:
        ValueError: As :func:`write_shard`.

    Examples:
        >>> import tempfile, torch
        >>> infos = write_dataset(tempfile.mkdtemp(), [[{"x": torch.ones(1)}]] * 2)
        >>> [i.file for i in infos]
        ['shard-00000.parquet', 'shard-00001.parquet']
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    infos = [write_shard(root / shard_name(k), rows) for k, rows in enumerate(shards)]
    write_index(root, infos)
    return infos
