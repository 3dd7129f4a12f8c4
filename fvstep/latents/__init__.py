"""Real training inputs: precomputed latents on disk, encoded once, read by workers.

- :mod:`fvstep.latents.format` — the on-disk format (Parquet shards + ``index.json``):
  its names and :class:`ShardInfo`; :mod:`fvstep.latents.shards` writes and opens shards,
  :mod:`fvstep.latents.index` writes and reads the index;
  :mod:`fvstep.latents.dataset` — :class:`LatentDataset` (map-style).
- :mod:`fvstep.latents.order` — :class:`BucketedOrder`: shape buckets as a pure function
  of ``(step, rank, world_size)``, with :class:`fvstep.data.ShuffledSource`'s laws.
- :mod:`fvstep.latents.loader` — :class:`WorkerSource`: a ``DataLoader`` with worker
  processes, prefetch and pinned memory, fed by that order; what ``fvstep.run`` takes.
  :mod:`fvstep.latents.workers` — what runs in those processes, their signals and end.
- :mod:`fvstep.latents.encode` — :func:`encode_clips`: videos (or frame folders) plus
  captions -> shards, with a diffusers ``AutoencoderKLWan`` and a text encoder; batched,
  resumable, on any number of ranks (``fvstep data encode``). Its inputs
  (:func:`find_clips`) are :mod:`fvstep.latents.clips`; the identity it checks on reruns
  (``encode.json``) is :mod:`fvstep.latents.encode_identity`.

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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from fvstep.latents.clips import (
        find_clips as find_clips,
    )
    from fvstep.latents.dataset import LatentDataset as LatentDataset
    from fvstep.latents.encode import (
        EncodeResult as EncodeResult,
    )
    from fvstep.latents.encode import (
        encode_clips as encode_clips,
    )
    from fvstep.latents.format import (
        ShardError as ShardError,
    )
    from fvstep.latents.format import (
        ShardInfo as ShardInfo,
    )
    from fvstep.latents.format import (
        shard_name as shard_name,
    )
    from fvstep.latents.index import (
        read_index as read_index,
    )
    from fvstep.latents.index import (
        write_dataset as write_dataset,
    )
    from fvstep.latents.index import (
        write_index as write_index,
    )
    from fvstep.latents.loader import (
        Order as Order,
    )
    from fvstep.latents.loader import (
        WorkerSource as WorkerSource,
    )
    from fvstep.latents.loader import (
        latent_source as latent_source,
    )
    from fvstep.latents.order import BucketedOrder as BucketedOrder
    from fvstep.latents.order import bucket_key as bucket_key
    from fvstep.latents.shards import (
        describe_shard as describe_shard,
    )
    from fvstep.latents.shards import (
        write_shard as write_shard,
    )

# Where each public name lives: importing this package (and so ``fvstep data --help``)
# loads no torch; a name's module is imported the first time the name is read (PEP 562).
_WHERE = {
    "bucket_key": "fvstep.latents.order",
    "BucketedOrder": "fvstep.latents.order",
    "describe_shard": "fvstep.latents.shards",
    "encode_clips": "fvstep.latents.encode",
    "EncodeResult": "fvstep.latents.encode",
    "find_clips": "fvstep.latents.clips",
    "latent_source": "fvstep.latents.loader",
    "LatentDataset": "fvstep.latents.dataset",
    "Order": "fvstep.latents.loader",
    "read_index": "fvstep.latents.index",
    "shard_name": "fvstep.latents.format",
    "ShardError": "fvstep.latents.format",
    "ShardInfo": "fvstep.latents.format",
    "WorkerSource": "fvstep.latents.loader",
    "write_dataset": "fvstep.latents.index",
    "write_index": "fvstep.latents.index",
    "write_shard": "fvstep.latents.shards",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fvstep.latents' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
