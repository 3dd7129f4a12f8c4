"""Reading a dataset: :class:`LatentDataset`, a map-style dataset over the shards."""

from __future__ import annotations

import itertools
import math
import operator
import os
import warnings
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fvstep.core.errors import ShardError
from fvstep.executor.latents.format import Shapes, ShardInfo, open_shard, parse_dtype, read_index

__all__ = ["LatentDataset"]


class LatentDataset:
    """A map-style dataset over a directory of shards: item ``i`` is one sample's dict.

    Tensors come back in their stored dtype (their bytes copied once, by torch), strings
    and numbers as Python values. Files open lazily, once per process; a missing, damaged
    or inconsistent shard is a :class:`~fvstep.core.errors.ShardError` naming the file and row.

    Args:
        fields: The fields to read (default: all).
        verify: Check Parquet page checksums on read (a CRC32 pass).

    Raises:
        FileNotFoundError: If ``root`` has no index.
        ShardError: If the index is malformed or a listed shard file is missing.

    Examples:
        >>> import tempfile
        >>> from fvstep.executor.latents import write_dataset
        >>> root = tempfile.mkdtemp()
        >>> _ = write_dataset(root, [[{"x": torch.arange(3.0), "caption": "a"}]])
        >>> LatentDataset(root, fields=["x"])[0]
        {'x': tensor([0., 1., 2.])}
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fields: Sequence[str] | None = None,
        verify: bool = True,
    ) -> None:
        self._root = Path(root)
        self._shards = read_index(self._root)
        for info in self._shards:
            if not (self._root / info.file).exists():
                raise ShardError(
                    f"missing shard {str(self._root / info.file)!r} (listed in the index)"
                )
        sizes = [info.num_rows for info in self._shards]
        self._starts = [0, *itertools.accumulate(sizes)][:-1]
        self._len = sum(sizes)
        self._fields = None if fields is None else list(fields)
        self._verify = bool(verify)
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}}  # open files stay in their process

    @property
    def root(self) -> Path:
        """The dataset directory."""
        return self._root

    @property
    def shards(self) -> list[ShardInfo]:
        """The index: the shards in dataset order."""
        return list(self._shards)

    @property
    def shapes(self) -> list[Shapes]:
        """Each item's tensor shapes (``{field: shape}``), from the index alone."""
        return [s for info in self._shards for s in info.row_shapes()]

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return (
            f"LatentDataset({str(self._root)!r}, {self._len} items in {len(self._shards)} shards)"
        )

    def locate(self, index: int) -> tuple[Path, int]:
        """The shard file and row of item ``index``: ``(path, row)``; IndexError if out of range."""
        i = operator.index(index)
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for a dataset of {self._len} items")
        k = bisect_right(self._starts, i) - 1
        return self._root / self._shards[k].file, i - self._starts[k]

    def _file(self, k: int) -> tuple[Any, list[str], list[int]]:
        if self._pid != os.getpid():  # a forked worker: never share the parent's handles
            self._files, self._pid = {}, os.getpid()
        cached = self._files.get(k)
        if cached is None:
            path = self._root / self._shards[k].file
            pf, tensors = open_shard(path, verify=self._verify)
            expected = self._shards[k].num_rows
            if pf.metadata.num_rows != expected:
                raise ShardError(
                    f"shard {str(path)!r} has {pf.metadata.num_rows} rows, the index says {expected}"
                )
            groups = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            starts = [sum(groups[:g]) for g in range(len(groups))]
            cached = self._files[k] = (pf, tensors, starts)
        return cached

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, row = self.locate(index)
        k = bisect_right(self._starts, operator.index(index)) - 1
        try:
            pf, tensors, starts = self._file(k)
        except ShardError as e:
            raise ShardError(f"{e} (reading row {row}, item {index})") from e
        group = bisect_right(starts, row) - 1
        names = self._fields
        columns = None
        if names is not None:
            columns = [
                c for n in names for c in ([n, f"{n}_shape", f"{n}_dtype"] if n in tensors else [n])
            ]
        try:
            table = pf.read_row_group(group, columns=columns)
            at = row - starts[group]
            values = {
                name: _cell(table.column(name), at, binary=name in tensors)
                for name in table.column_names
            }
        except (OSError, ValueError, KeyError) as e:
            raise ShardError(f"damaged shard {str(path)!r}, row {row} (item {index}): {e}") from e
        return _decode(values, tensors, path, row)

    def close(self) -> None:
        """Forget the open files (they close when collected); reading opens them again."""
        self._files = {}


def _decode(values: dict[str, Any], tensors: list[str], path: Path, row: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if any(name == f"{t}_shape" or name == f"{t}_dtype" for t in tensors):
            continue
        if name not in tensors:
            out[name] = value
            continue
        shape, dtype_name = values[f"{name}_shape"], values[f"{name}_dtype"]
        try:
            dtype = parse_dtype(dtype_name)
        except ValueError as e:
            raise ShardError(f"damaged shard {str(path)!r}, row {row}: field {name!r}: {e}") from e
        numel = math.prod(shape)
        expected = numel * dtype.itemsize
        if value is None or value.size != expected:
            got = "null" if value is None else f"{value.size} bytes"
            raise ShardError(
                f"damaged shard {str(path)!r}, row {row}: field {name!r} has {got}, its shape "
                f"{list(shape)} and dtype {dtype_name} need {expected}"
            )
        out[name] = _tensor(value, dtype, numel).reshape(shape)
    return out


def _cell(column: Any, at: int, *, binary: bool) -> Any:
    """Row ``at`` of a column: a Python value, or for a tensor's bytes an Arrow buffer (no copy)."""
    scalar = column[at]
    if binary:
        return scalar.as_buffer() if scalar.is_valid else None
    return scalar.as_py()


def _tensor(buffer: Any, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A tensor owning a copy of ``buffer``'s bytes, made by torch (without the GIL)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # The view is read-only; it is only read, by the clone.
        warnings.simplefilter("ignore", UserWarning)
        # Through a memoryview: torch.frombuffer fails on pyarrow's own Buffer before
        # pyarrow 26 ("could not retrieve buffer from object"); a memoryview of it is
        # the same bytes, with no copy.
        view = torch.frombuffer(memoryview(buffer), dtype=torch.uint8)
    return view.clone().view(dtype)
