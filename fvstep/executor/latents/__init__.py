"""Real training inputs: precomputed latents on disk, encoded once, read by workers.

The modules: ``format`` (the on-disk format: shards and index), ``dataset`` (its
reader), ``order`` (which items a step reads, by shape bucket), ``loader`` (the worker
loader), and ``encode``, ``clips``, ``encode_identity`` and ``cli`` (``fvstep
data encode``). See docs/concepts/data.md. pyarrow is imported when a shard is read or
written; diffusers, transformers and imageio when clips are encoded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from fvstep.core.errors import ShardError as ShardError
    from fvstep.executor.latents.clips import find_clips as find_clips
    from fvstep.executor.latents.dataset import LatentDataset as LatentDataset
    from fvstep.executor.latents.encode import EncodeResult as EncodeResult
    from fvstep.executor.latents.encode import encode_clips as encode_clips
    from fvstep.executor.latents.format import ShardInfo as ShardInfo
    from fvstep.executor.latents.format import describe_shard as describe_shard
    from fvstep.executor.latents.format import read_index as read_index
    from fvstep.executor.latents.format import shard_name as shard_name
    from fvstep.executor.latents.format import write_dataset as write_dataset
    from fvstep.executor.latents.format import write_index as write_index
    from fvstep.executor.latents.format import write_shard as write_shard
    from fvstep.executor.latents.loader import Order as Order
    from fvstep.executor.latents.loader import WorkerSource as WorkerSource
    from fvstep.executor.latents.loader import latent_source as latent_source
    from fvstep.executor.latents.order import BucketedOrder as BucketedOrder
    from fvstep.executor.latents.order import bucket_key as bucket_key

# Where each public name lives: importing this package (and so ``fvstep data --help``)
# loads no torch; a name's module is imported the first time the name is read (PEP 562).
_NAMES = {
    "fvstep.core.errors": ("ShardError",),
    "fvstep.executor.latents.clips": ("find_clips",),
    "fvstep.executor.latents.dataset": ("LatentDataset",),
    "fvstep.executor.latents.encode": ("EncodeResult", "encode_clips"),
    "fvstep.executor.latents.format": (
        "ShardInfo",
        "describe_shard",
        "read_index",
        "shard_name",
        "write_dataset",
        "write_index",
        "write_shard",
    ),
    "fvstep.executor.latents.loader": ("Order", "WorkerSource", "latent_source"),
    "fvstep.executor.latents.order": ("BucketedOrder", "bucket_key"),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fvstep.executor.latents' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
