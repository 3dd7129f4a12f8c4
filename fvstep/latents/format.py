"""The on-disk format of precomputed samples: Parquet shards and a JSON index.

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
Parquet costs is small next to the step (``fvstep bench data`` measures it).

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
(:mod:`fvstep.latents.order`) without opening a shard. Item ``i`` of the dataset is row
``i - start`` of the shard whose rows start at ``start``.

Examples:
    >>> import tempfile, torch
    >>> from fvstep.latents import LatentDataset, write_dataset
    >>> root = tempfile.mkdtemp()
    >>> rows = [{"latents": torch.zeros(4, 1, 2, 2), "caption": f"clip {i}"} for i in range(3)]
    >>> _ = write_dataset(root, [rows[:2], rows[2:]])
    >>> ds = LatentDataset(root)
    >>> len(ds), ds[2]["caption"], ds[2]["latents"].shape
    (3, 'clip 2', torch.Size([4, 1, 2, 2]))
"""

from __future__ import annotations

import json
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
    "ShardError",
    "ShardInfo",
    "describe_shard",
    "read_index",
    "shard_name",
    "write_dataset",
    "write_index",
    "write_shard",
]

FORMAT = "fvstep-latents"
VERSION = 1
INDEX_FILE = "index.json"
_META_KEY = b"fvstep"

# A row's shapes: {tensor field: shape}; a shard's: runs of equal shapes [(shapes, count)].
Shapes = dict[str, tuple[int, ...]]


class ShardError(Exception):
    """A shard is missing, damaged, or does not match the index; the message names the file
    and, where one is being read, the row (and, from a loader, the rank and step)."""


def _arrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is installed where tests run
        raise ImportError(
            "fvstep.latents needs pyarrow: pip install 'fvstep[data]' (or pyarrow)"
        ) from e
    return pa, pq


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


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


def _runs(rows: Sequence[Shapes]) -> list[tuple[Shapes, int]]:
    runs: list[tuple[Shapes, int]] = []
    for s in rows:
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


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
            cols[f"{name}_dtype"] = [_dtype_name(v.dtype) for v in dense]
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

    Every row must have the same fields; tensor fields may differ in shape and dtype from
    row to row. The file is written under a temporary name, flushed to disk and renamed, so
    ``path`` either does not exist or holds the whole shard.

    Args:
        path: The shard's path (conventionally ``DIR / shard_name(k)``).
        rows: The samples, at least one.
        compression: Parquet compression codec of every column (``"none"``, ``"zstd"``...).

    Returns:
        The shard's :class:`ShardInfo` (for :func:`write_index`).

    Raises:
        ValueError: If ``rows`` is empty or its rows have different fields.

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / shard_name(0)
        >>> write_shard(path, [{"latents": torch.ones(2, 3), "caption": "a"}]).num_rows
        1
    """
    if not rows:
        raise ValueError("a shard needs at least one row")
    pa, pq = _arrow()
    cols, tensors = _columns(rows)
    meta = {"format": FORMAT, "version": VERSION, "tensors": tensors}
    table = pa.table(cols).replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
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
    shapes = [
        {t: tuple(s) for t in tensors for s in [cols[f"{t}_shape"][i]]} for i in range(len(rows))
    ]
    return ShardInfo(path.name, len(rows), _runs(shapes))


def _open(path: Path, *, verify: bool = True) -> tuple[Any, list[str]]:
    """An open ``ParquetFile`` of an fvstep shard, and its tensor fields."""
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
    """Read a shard's row count and shapes (only its small ``*_shape`` columns).

    Args:
        path: The shard file.

    Returns:
        Its :class:`ShardInfo`.

    Raises:
        ShardError: If the file is missing, is not an fvstep shard, or is damaged.

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / shard_name(0)
        >>> _ = write_shard(path, [{"x": torch.ones(2)}, {"x": torch.ones(3)}])
        >>> describe_shard(path).shapes
        [({'x': (2,)}, 1), ({'x': (3,)}, 1)]
    """
    path = Path(path)
    pf, tensors = _open(path)
    try:
        table = pf.read(columns=[f"{t}_shape" for t in tensors])
    except (OSError, ValueError) as e:
        raise ShardError(f"damaged shard {str(path)!r}: {e}") from e
    cols = {t: table.column(f"{t}_shape").to_pylist() for t in tensors}
    n = pf.metadata.num_rows
    return ShardInfo(
        path.name, n, _runs([{t: tuple(cols[t][i]) for t in tensors} for i in range(n)])
    )


def write_index(
    root: str | os.PathLike[str],
    shards: Sequence[ShardInfo],
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``root/index.json`` for ``shards`` (in dataset order), atomically.

    Args:
        root: The dataset directory.
        shards: The shards' :class:`ShardInfo`, in the order their rows are numbered.
        extra: JSON-able facts to keep beside the index (``fvstep data encode`` puts its
            settings here).

    Returns:
        The index's path.

    Examples:
        >>> import tempfile
        >>> write_index(tempfile.mkdtemp(), []).name
        'index.json'
    """
    root = Path(root)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "num_rows": sum(s.num_rows for s in shards),
        "shards": [s.to_json() for s in shards],
        **({"extra": dict(extra)} if extra else {}),
    }
    path = root / INDEX_FILE
    tmp = root / f"{INDEX_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_index(root: str | os.PathLike[str]) -> list[ShardInfo]:
    """The shards listed by ``root/index.json``, in dataset order.

    Args:
        root: The dataset directory.

    Returns:
        One :class:`ShardInfo` per shard.

    Raises:
        FileNotFoundError: If there is no index (an encode that has not finished).
        ShardError: If the index is malformed or of a newer format version.

    Examples:
        >>> import tempfile
        >>> root = tempfile.mkdtemp(); _ = write_index(root, [])
        >>> read_index(root)
        []
    """
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

    Args:
        root: The dataset directory (created if needed).
        shards: The rows of each shard, in dataset order.

    Returns:
        The shards' :class:`ShardInfo`.

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
