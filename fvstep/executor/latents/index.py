"""The index of a dataset (``index.json``): writing it, reading it, and whole datasets.

The index lists the shards in order with their row counts and each row's shapes; it is
written last, so a dataset is readable only once every shard is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fvstep.core.errors import ShardError
from fvstep.executor.latents.format import (
    FORMAT,
    INDEX_FILE,
    VERSION,
    ShardInfo,
    shard_name,
    temporary_path,
)
from fvstep.executor.latents.shards import write_shard

__all__ = ["read_index", "write_dataset", "write_index"]


def write_index(
    root: str | os.PathLike[str],
    shards: Sequence[ShardInfo],
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``root/index.json`` for ``shards`` (in dataset order), atomically.

    Args:
        extra: JSON-able facts to keep beside the index (``fvstep data encode``'s settings).

    Returns:
        The index's path.
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
    tmp = temporary_path(path)
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_index(root: str | os.PathLike[str]) -> list[ShardInfo]:
    """The shards listed by ``root/index.json``, in dataset order.

    Raises:
        FileNotFoundError: If there is no index (an encode that has not finished).
        ShardError: If the index is malformed or of a newer format version.
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
