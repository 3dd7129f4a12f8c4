"""Parquet shards of the format (:mod:`fvstep.executor.latents.format`): writing, opening, describing."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fvstep.core._optional import needs_extra
from fvstep.core.errors import ShardError
from fvstep.executor.latents.format import (
    FORMAT,
    VERSION,
    Shapes,
    ShardInfo,
    dtype_name,
    temporary_path,
)

__all__ = ["describe_shard", "open_shard", "write_shard"]

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
    """Write ``rows`` (dicts of tensors, strings and numbers) as one Parquet shard, atomically.

    Every row must have the same fields; tensor fields may differ in shape and dtype. The
    file is written under a temporary name, synced and renamed: a shard that exists is whole.

    Args:
        compression: Parquet compression codec of every column (``"none"``, ``"zstd"``...).

    Returns:
        The shard's :class:`ShardInfo` (for :func:`write_index`).

    Raises:
        ValueError: If ``rows`` is empty or its rows have different fields.
    """
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

    Raises:
        ShardError: If the file is missing, is not an fvstep shard (or of a newer format
            version), or is damaged.
    """
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

    Raises:
        ShardError: If the file is missing, is not an fvstep shard, or is damaged.

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "shard-00000.parquet"
        >>> _ = write_shard(path, [{"x": torch.ones(2)}, {"x": torch.ones(3)}])
        >>> describe_shard(path).shapes
        [({'x': (2,)}, 1), ({'x': (3,)}, 1)]
    """
    path = Path(path)
    pf, tensors = open_shard(path)
    try:
        table = pf.read(columns=[f"{t}_shape" for t in tensors])
    except (OSError, ValueError) as e:
        raise ShardError(f"damaged shard {str(path)!r}: {e}") from e
    shapes = {t: table.column(f"{t}_shape").to_pylist() for t in tensors}
    return _shard_info(path.name, pf.metadata.num_rows, shapes)
