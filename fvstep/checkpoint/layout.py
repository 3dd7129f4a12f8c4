"""Checkpoint directories: names, atomic commit, "latest", and keep-last-N.

A root holds one directory per complete checkpoint, ``step_000000120``. A save writes
into ``.tmp-step_000000120`` and is committed by writing the manifest (fsynced) and
renaming the directory (atomic on POSIX), then fsyncing the root. A crash at any point
leaves either the previous set of complete checkpoints or the new one: a directory
without a valid manifest, or still named ``.tmp-*``, is never "latest".
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from fvstep.checkpoint.manifest import CheckpointError, NewerFormatError, read_manifest

__all__ = [
    "checkpoint_dir",
    "commit",
    "discard",
    "latest",
    "list_complete",
    "prune",
    "temp_dir",
]

_NAME = re.compile(r"^step_(\d{9,})$")


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The directory of the checkpoint at ``step`` under ``root``."""
    return Path(root) / f"step_{step:09d}"


def temp_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint at ``step`` is written before it is committed."""
    return Path(root) / f".tmp-step_{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Atomically publish a fully written checkpoint directory ``tmp`` as ``final``.

    Raises:
        CheckpointError: If ``final`` exists (the caller decides about overwriting).
    """
    if final.exists():
        raise CheckpointError(f"checkpoint {str(final)!r} already exists")
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def list_complete(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first.

    A directory counts only if its name is ``step_<digits>`` and its manifest is valid.
    One written by a newer format counts too (loading it then says to upgrade), so an
    older fvstep never silently resumes from an older step.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if not match or not entry.is_dir():
            continue
        try:
            read_manifest(entry)
        except NewerFormatError:
            pass
        except (CheckpointError, OSError):
            continue
        found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``.

    Examples:
        >>> path = latest("runs/exp1/checkpoints")
        >>> state = load(path, like=state) if path else state
    """
    complete = list_complete(root)
    return complete[-1][1] if complete else None


def prune(root: str | os.PathLike[str], keep: int | None, *, keep_temp: Path | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints and stale temporaries.

    The newest complete checkpoint is never deleted. ``keep_temp`` (a save in flight)
    is left alone.
    """
    root = Path(root)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-") and entry != keep_temp:
            shutil.rmtree(entry, ignore_errors=True)
    if keep is None:
        return
    complete = list_complete(root)
    for _, path in complete[: max(len(complete) - max(keep, 1), 0)]:
        discard(path)


def discard(path: Path) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves a listed, broken one.

    It is first renamed to ``.tmp-deleting-<name>`` (atomic; temporaries are never
    listed and are swept by later prunes), then deleted.
    """
    aside = path.with_name(f".tmp-deleting-{path.name}")
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(path, aside)
    _fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)
