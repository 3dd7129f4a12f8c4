"""How :func:`fvstep.run` saves and resumes: :class:`Checkpoints`, the lock of the run's
folder, the resume from the newest checkpoint that loads (damaged ones set aside), and
each save with its pruning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import attrs

from fvstep import checkpoint as ckpt
from fvstep.checkpoint import directories
from fvstep.checkpoint.directories import CheckpointSkippedWarning
from fvstep.core.errors import CheckpointError, DamagedCheckpointError
from fvstep.core.state import TrainState
from fvstep.parallel.ranks import broadcast_object, rank_and_world

__all__ = ["Checkpoints", "lock_run_dir", "resume", "save_run_state"]


def _paths(value: Any) -> tuple[str, ...]:
    """One leaf path (a str) or several, as a tuple."""
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class Checkpoints:
    """Where and how often :func:`run` saves.

    Attributes:
        dir: The directory of checkpoints (one ``step_<n>`` directory each).
        every: Save after every ``every`` steps (and always at the end).
        keep: Keep the newest ``keep`` complete checkpoints (``None``: all). When
            :func:`run` returns, exactly ``keep`` remain (also with ``async_save``).
        async_save: Write in the background (:class:`fvstep.checkpoint.AsyncSaver`).
        on_damaged: For a damaged checkpoint newer than the one :func:`run` resumes from:
            ``"skip"`` warns, sets it aside as ``step_<n>.damaged`` and tries the next
            older one; ``"error"`` raises (``docs/concepts/checkpoints.md``).
        reset: Leaf paths a resume takes from the initial state instead of the checkpoint
            (:func:`fvstep.checkpoint.load`'s ``reset``), e.g. ``("extra.stream",)``.
        lock: A lock of ``dir`` (:func:`fvstep.checkpoint.lock_dir`) the caller holds on
            rank 0, which :func:`run` leaves held; ``None``: :func:`run` takes and releases it.

    Examples:
        >>> Checkpoints("runs/a/ckpt", every=100, keep=3, async_save=True)
    """

    dir: Path = attrs.field(converter=Path)
    every: int = 100
    keep: int | None = 3
    async_save: bool = False
    on_damaged: str = "skip"
    reset: tuple[str, ...] = attrs.field(default=(), converter=_paths)
    lock: directories.DirectoryLock | None = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not all(isinstance(p, str) and p for p in self.reset):
            raise ValueError(f"Checkpoints.reset must be leaf paths (str), got {self.reset!r}")
        if self.every < 1:
            raise ValueError(f"Checkpoints.every must be >= 1, got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"Checkpoints.keep must be >= 1 or None, got {self.keep}")
        if self.on_damaged not in ("skip", "error"):
            raise ValueError(
                f"Checkpoints.on_damaged must be 'skip' or 'error', got {self.on_damaged!r}"
            )


def lock_run_dir(
    root: Path, rank: int, held: directories.DirectoryLock | None = None
) -> directories.DirectoryLock | None:
    """Collective: rank 0 locks ``root``, unless it passes ``held``, a lock of ``root`` it
    holds already (then it takes none and returns ``None``); every rank raises rank 0's
    error, if any."""
    lock: directories.DirectoryLock | None = None
    error: Exception | None = None
    if rank == 0:
        try:
            if held is None:
                lock = directories.lock_dir(root)
            elif Path(held.path).resolve() != (root / directories.LOCK_NAME).resolve():
                error = ValueError(
                    f"Checkpoints.lock is the lock {str(held.path)!r}, not the one of "
                    f"Checkpoints.dir {str(root)!r}: pass lock_dir(dir), or no lock"
                )
        except CheckpointError as e:
            error = e
    error = broadcast_object(error)
    if error is not None:
        raise error
    return lock


def resume(
    state: TrainState, checkpoints: Checkpoints, num_steps: int, rank: int
) -> tuple[TrainState, Path | None]:
    """Collective: the state loaded from the newest checkpoint that verifies (damaged ones
    skipped or refused) and its path (``None``: none); every rank tries rank 0's listing."""
    root = checkpoints.dir
    listed = broadcast_object(
        (directories.list_step_dirs(root), directories.list_complete(root)) if rank == 0 else None
    )
    assert listed is not None
    candidates, complete = listed
    # Only a committed checkpoint can be past num_steps: a folder without a manifest is an
    # unfinished save, set aside below like a damaged one, never a reason to refuse the run.
    if complete and complete[-1][0] > num_steps:
        newest = complete[-1][0]
        raise ValueError(
            f"the newest checkpoint under {str(root)!r} is at step {newest}, past num_steps={num_steps} "
            f"(the step to reach, not a count to add): pass num_steps >= {newest}, or another directory"
        )
    skipped: list[tuple[Path, DamagedCheckpointError]] = []
    for _, path in reversed(candidates):
        try:
            loaded = ckpt.load(path, like=state, reset=checkpoints.reset)
        except DamagedCheckpointError as e:
            if checkpoints.on_damaged == "error":
                raise
            skipped.append((path, e))
            continue
        _set_aside(skipped, path, rank)
        return loaded, path
    if skipped:
        causes = "; ".join(f"{p.name}: {e}" for p, e in skipped)
        raise CheckpointError(
            f"no checkpoint under {str(root)!r} can be loaded, every one is damaged: {causes}. "
            "Move them away to start afresh"
        )
    return state, None


def _set_aside(skipped: list[tuple[Path, DamagedCheckpointError]], used: Path, rank: int) -> None:
    """Warn about each damaged checkpoint newer than ``used``; rank 0 renames it aside, so
    that it is neither "latest" nor counted in ``keep`` (it is kept, for inspection)."""
    for path, error in skipped:
        where = ""
        if rank == 0:
            try:
                where = f"; it was renamed {directories.set_aside(path).name!r}"
            except OSError as e:
                where = f"; it could not be renamed aside ({e})"
        warnings.warn(
            CheckpointSkippedWarning(
                f"skipped the damaged checkpoint {str(path)!r} and resumed from the older "
                f"{used.name!r}: {error}{where}"
            ),
            stacklevel=4,
        )


def save_run_state(
    state: TrainState, checkpoints: Checkpoints, saver: ckpt.AsyncSaver | None
) -> None:
    """Save ``state`` at its step under ``checkpoints.dir`` (in the background with
    ``saver``), then prune to ``checkpoints.keep`` (rank 0)."""
    root, step = checkpoints.dir, int(state.step)
    path = ckpt.checkpoint_dir(root, step)
    if saver is not None:
        saver.save(state, path, overwrite=True)
    else:
        ckpt.save(state, path, overwrite=True)
    if rank_and_world()[0] == 0:
        ckpt.prune(root, checkpoints.keep, keep_temp=directories.temp_dir(root, step))
