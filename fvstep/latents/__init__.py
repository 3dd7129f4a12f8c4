"""Real training inputs: precomputed latents on disk, encoded once, read by workers.

- :mod:`fvstep.latents.format` — the on-disk format (Parquet shards + ``index.json``)
  and its writers; :mod:`fvstep.latents.dataset` — :class:`LatentDataset` (map-style).
- :mod:`fvstep.latents.order` — :class:`BucketedOrder`: shape buckets as a pure function
  of ``(step, rank, world_size)``, with :class:`fvstep.data.ShuffledSource`'s laws.
- :mod:`fvstep.latents.loader` — :class:`WorkerSource`: a ``DataLoader`` with worker
  processes, prefetch and pinned memory, fed by that order; what ``fvstep.run`` takes.
- :mod:`fvstep.latents.encode` — :func:`encode_clips`: videos (or frame folders) plus
  captions -> shards, with a diffusers ``AutoencoderKLWan`` and a text encoder; batched,
  resumable, on any number of ranks (``fvstep data encode``).

pyarrow is imported when a shard is read or written, diffusers, transformers and
imageio when clips are encoded: importing this package needs only torch.

Examples:
    >>> import tempfile, torch
    >>> from fvstep import random as fr
    >>> from fvstep.latents import latent_source, write_dataset
    >>> root = tempfile.mkdtemp()
    >>> _ = write_dataset(root, [[{"latents": torch.zeros(4, 1, 2, 2)} for _ in range(4)]])
    >>> with latent_source(root, key=fr.key(0), batch_size=2, num_workers=0) as data:
    ...     data.batch(0, rank=1, world_size=2)["latents"].shape
    torch.Size([2, 4, 1, 2, 2])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from fvstep.latents.dataset import LatentDataset
from fvstep.latents.encode import EncodeResult, encode_clips, find_clips
from fvstep.latents.format import (
    ShardError,
    ShardInfo,
    describe_shard,
    read_index,
    shard_name,
    write_dataset,
    write_index,
    write_shard,
)
from fvstep.latents.loader import Order, WorkerSource
from fvstep.latents.order import BucketedOrder, bucket_key

__all__ = [
    "BucketedOrder",
    "EncodeResult",
    "LatentDataset",
    "Order",
    "ShardError",
    "ShardInfo",
    "WorkerSource",
    "bucket_key",
    "describe_shard",
    "encode_clips",
    "find_clips",
    "latent_source",
    "read_index",
    "shard_name",
    "write_dataset",
    "write_index",
    "write_shard",
]


def latent_source(
    root: str | os.PathLike[str],
    *,
    key: torch.Tensor,
    batch_size: int,
    num_workers: int = 2,
    fields: Sequence[str] | None = None,
    drop_last: bool = True,
    verify: bool = True,
    **loader_options: Any,
) -> WorkerSource:
    """The usual data of a run: a dataset directory, shape-bucketed, read by workers.

    ``WorkerSource(LatentDataset(root, fields=fields, verify=verify), BucketedOrder(dataset.shapes,
    key=key, batch_size=batch_size, drop_last=drop_last), num_workers=num_workers,
    **loader_options)``.

    Args:
        root: The dataset directory (``fvstep data encode``'s output).
        key: An fvstep key; it alone decides the order.
        batch_size: The per-rank batch size.
        num_workers: Worker processes (``0``: read in the calling process).
        fields: The fields to read (default all).
        drop_last: As :class:`BucketedOrder`.
        verify: Check the shards' page checksums on read (as :class:`LatentDataset`).
        **loader_options: More options of :class:`WorkerSource` (``prefetch``,
            ``pin_memory``, ``multiprocessing_context``, ``timeout_s``, ``collate``).

    Returns:
        A :class:`WorkerSource`; close it (or use it in a ``with``) when done.

    Raises:
        FileNotFoundError: If ``root`` has no index.
        ShardError: If the index is malformed or lists a missing shard.

    Examples:
        >>> import tempfile
        >>> from fvstep import random as fr
        >>> root = tempfile.mkdtemp()
        >>> _ = write_dataset(root, [[{"x": torch.ones(1)}] * 2])
        >>> latent_source(root, key=fr.key(0), batch_size=1, num_workers=0).batch(1)["x"]
        tensor([[1.]])
    """
    dataset = LatentDataset(root, fields=fields, verify=verify)
    order = BucketedOrder(dataset.shapes, key=key, batch_size=batch_size, drop_last=drop_last)
    return WorkerSource(dataset, order, num_workers=num_workers, **loader_options)
