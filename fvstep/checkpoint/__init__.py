"""Checkpoints: DCP of the whole state pytree, atomic, optionally async, reshardable.

:func:`save` / :func:`load` (every rank calls them) and :class:`AsyncSaver` (background
saves); :func:`latest`, :func:`list_complete`, :func:`checkpoint_dir`, :func:`prune` and
:func:`lock_dir`, a run's directory of checkpoints; :func:`read_manifest`,
:func:`frozen_digest` and :func:`base_digest`, what a checkpoint holds; :func:`export`,
:func:`gather_weights` and :func:`merge_weights`, one role's weights for inference.
:class:`CheckpointError` says why a checkpoint cannot be used. Concepts: ``docs/concepts/checkpoints.md``.
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
from fvstep.checkpoint.exporting import MERGED_DTYPE, export, gather_weights, merge_weights
from fvstep.checkpoint.loading import load
from fvstep.checkpoint.saving import (
    FORMAT_VERSION,
    Manifest,
    base_digest,
    frozen_digest,
    read_manifest,
    save,
)
from fvstep.core.errors import (
    CheckpointError,
    CheckpointLockedError,
    DamagedCheckpointError,
    NewerFormatError,
)

__all__ = [
    "FORMAT_VERSION",
    "MERGED_DTYPE",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointSkippedWarning",
    "DamagedCheckpointError",
    "Manifest",
    "NewerFormatError",
    "base_digest",
    "checkpoint_dir",
    "export",
    "frozen_digest",
    "gather_weights",
    "latest",
    "list_complete",
    "load",
    "lock_dir",
    "merge_weights",
    "prune",
    "read_manifest",
    "save",
]
