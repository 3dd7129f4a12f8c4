"""Checkpoints: DCP of the whole state pytree, atomic, optionally async, reshardable.

- :func:`save` / :func:`load` — every rank calls them; ``load`` returns a new state.
- :class:`AsyncSaver` — background saves: a host copy of the state, written and committed
  on a thread of its own.
- :func:`latest`, :func:`list_complete`, :func:`checkpoint_dir`, :func:`prune` — the
  layout of a directory of checkpoints; "latest" never picks an incomplete one.
- :func:`lock_dir` — the exclusive lock ``fvstep.run`` holds on a directory of checkpoints.
- :func:`read_manifest` — what a checkpoint holds; :class:`CheckpointError` — why a
  checkpoint cannot be used (:class:`DamagedCheckpointError`: its files are damaged;
  :class:`CheckpointLockedError`: another run holds the directory);
  :class:`CheckpointSkippedWarning` — ``fvstep.run`` resumed past a damaged checkpoint.
- :func:`export` — one role's consolidated weights for inference, in a format: one
  safetensors file, a diffusers model folder, a complete diffusers pipeline folder (the
  trained role or its EMA plus a base's other parts), and with :mod:`fvstep.lora` a LoRA
  adapter or a merged model; :func:`gather_weights` — the same tensors, returned
  (``fvstep.checkpoint.exporting``).
- :func:`frozen_digest` — the digest by which a checkpoint that leaves a frozen base out
  (``Role(save_frozen=False)``) identifies it; ``load`` verifies it.
"""

from fvstep.checkpoint.async_saving import AsyncSaver
from fvstep.checkpoint.directories import (
    CheckpointSkippedWarning,
    checkpoint_dir,
    latest,
    list_complete,
    lock_dir,
    prune,
)
from fvstep.checkpoint.exporting import export, gather_weights
from fvstep.checkpoint.loading import load
from fvstep.checkpoint.saving import FORMAT_VERSION, Manifest, frozen_digest, read_manifest, save
from fvstep.core.errors import (
    CheckpointError,
    CheckpointLockedError,
    DamagedCheckpointError,
    NewerFormatError,
)

__all__ = [
    "FORMAT_VERSION",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointSkippedWarning",
    "DamagedCheckpointError",
    "Manifest",
    "NewerFormatError",
    "checkpoint_dir",
    "export",
    "frozen_digest",
    "gather_weights",
    "latest",
    "list_complete",
    "load",
    "lock_dir",
    "prune",
    "read_manifest",
    "save",
]
