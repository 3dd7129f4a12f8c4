"""Checkpoint directories: names, atomic commit, "latest", and keep-last-N.

A root holds one directory per complete checkpoint, ``step_000000120``. A save writes
into ``.tmp-step_000000120`` and is committed by writing the manifest (fsynced) and
renaming the directory (atomic on POSIX), then fsyncing the root. A crash at any point
leaves either the previous set of complete checkpoints or the new one: a directory
without a valid manifest, or still named ``.tmp-*``, is never "latest".

A checkpoint that :func:`fvstep.run` found damaged is renamed ``step_<n>.damaged``
(:func:`set_aside`): kept for inspection, never listed, pruned or counted in ``keep``.
``.lock`` is the lock file of the run that writes the root (:func:`lock_dir`).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

from fvstep.checkpoint.manifest import read_manifest
from fvstep.core.errors import CheckpointError, CheckpointLockedError, NewerFormatError

__all__ = [
    "LOCK_NAME",
    "DirectoryLock",
    "checkpoint_dir",
    "commit",
    "discard",
    "fsync",
    "latest",
    "list_complete",
    "list_step_dirs",
    "lock_dir",
    "prune",
    "set_aside",
    "temp_dir",
]

LOCK_NAME = ".lock"

_NAME = re.compile(r"^step_(\d{9,})$")


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The directory of the checkpoint at ``step`` under ``root``.

    Args:
        root: A directory of checkpoints.
        step: The state's step counter.

    Returns:
        ``root/step_<step:09d>``.
    """
    return Path(root) / f"step_{step:09d}"


def temp_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint at ``step`` is written before it is committed.

    Args:
        root: A directory of checkpoints.
        step: The state's step counter.

    Returns:
        ``root/.tmp-step_<step:09d>``.
    """
    return Path(root) / f".tmp-step_{step:09d}"


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file, or a directory's entries, to disk (``os.fsync``).

    A directory is fsynced after a file in it is created or renamed, so that the new
    name survives a crash. On Windows, where directories cannot be opened for fsync,
    a directory is skipped.

    Raises:
        OSError: If ``path`` cannot be opened or flushed.
    """
    path = Path(path)
    is_dir = path.is_dir()
    if is_dir and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Atomically publish a fully written checkpoint directory ``tmp`` as ``final``.

    Args:
        tmp: The written directory (manifest included).
        final: Its name once committed.

    Raises:
        CheckpointError: If ``final`` exists (the caller decides about overwriting).
        OSError: If the rename or an fsync fails.
    """
    if final.exists():
        raise CheckpointError(f"checkpoint {str(final)!r} already exists")
    fsync(tmp)
    os.replace(tmp, final)
    fsync(final.parent)


def list_complete(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first.

    A directory counts only if its name is ``step_<digits>`` and its manifest is valid.
    One written by a newer format counts too (loading it then says to upgrade), so an
    older fvstep never silently resumes from an older step. A malformed manifest never
    raises here: that directory is simply not listed.

    Args:
        root: A directory of checkpoints.

    Returns:
        ``[(step, path), ...]``; ``[]`` if ``root`` is not a directory.
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


def list_step_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step_<n>`` directory under ``root``, complete or not, oldest first.

    :func:`list_complete` keeps those with a valid manifest; this one also lists the
    damaged ones, so that a resume can say which newer checkpoints it skipped.

    Args:
        root: A directory of checkpoints.

    Returns:
        ``[(step, path), ...]``, by step; ``[]`` if ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint ``step_<n>`` to ``step_<n>.damaged`` (or ``.damaged-<k>``).

    It is kept for inspection but no longer a checkpoint: never "latest", never counted
    in ``keep`` (so it cannot push good checkpoints out), never pruned, and never
    overwritten by a later save of the same step. Delete it yourself when done.

    Args:
        path: The checkpoint directory.

    Returns:
        Its new path.

    Raises:
        OSError: If it cannot be renamed.
    """
    target = path.with_name(f"{path.name}.damaged")
    k = 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.damaged-{k}")
    os.replace(path, target)
    fsync(path.parent)
    return target


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``.

    Args:
        root: A directory of checkpoints.

    Returns:
        The path of the newest complete checkpoint, or ``None`` if there is none.

    Examples:
        >>> path = latest("runs/exp1/checkpoints")
        >>> state = load(path, like=state) if path else state
    """
    complete = list_complete(root)
    return complete[-1][1] if complete else None


def prune(root: str | os.PathLike[str], keep: int | None, *, keep_temp: Path | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints and stale temporaries.

    The newest complete checkpoint is never deleted. ``keep_temp`` (a save in flight)
    is left alone, and so are ``step_<n>.damaged`` directories and ``.lock``.

    Args:
        root: A directory of checkpoints.
        keep: How many complete checkpoints to keep (at least 1); ``None`` keeps all.
        keep_temp: A temporary directory not to delete (a save in flight).
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

    Args:
        path: The checkpoint directory.

    Raises:
        OSError: If it cannot be renamed.
    """
    aside = path.with_name(f".tmp-deleting-{path.name}")
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(path, aside)
    fsync(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


class DirectoryLock:
    """An exclusive ``flock`` on ``<root>/.lock``, held until :meth:`release` (see :func:`lock_dir`).

    Attributes:
        path: The lock file.
    """

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Release the lock (idempotent). The file stays: deleting it would let two runs
        lock two different files of the same name."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> dict[str, Any]:
    try:
        body = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def lock_dir(root: str | os.PathLike[str]) -> DirectoryLock:
    """Take the exclusive lock of a directory of checkpoints, without waiting.

    :func:`fvstep.run` holds it for a whole run, so that a second run writing the same
    directory fails at once instead of both overwriting each other's checkpoints. It is
    an ``flock`` on ``<root>/.lock`` (created if needed, never deleted), into which the
    holder writes its host, pid and start time; the kernel releases it when the holder's
    process ends, so a crashed run leaves no stale lock. Locks conflict between
    processes and between separate calls of one process.

    ``flock`` on a network filesystem may not be honoured (some NFS, Lustre or FUSE
    mounts ignore it, or lock per host only): there the lock is best effort. A
    filesystem that refuses ``flock`` outright gives a warning and an unheld lock.

    Args:
        root: The directory of checkpoints (created if missing).

    Returns:
        The held lock: call :meth:`DirectoryLock.release`, or use it as a context manager.

    Raises:
        CheckpointLockedError: (a ``CheckpointError``) If another process, or another
            call in this one, holds the lock; the message names its host and pid.
        CheckpointError: If the directory or its lock file cannot be created.

    Examples:
        >>> with lock_dir("runs/a/ckpt"):
        ...     ...  # nobody else runs fvstep.run on runs/a/ckpt meanwhile
    """
    root = Path(root)
    path = root / LOCK_NAME
    try:
        import fcntl
    except ImportError:  # not POSIX
        warnings.warn(f"cannot lock {str(path)!r}: no fcntl on this platform", stacklevel=2)
        return DirectoryLock(path, None)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"cannot create the lock file {str(path)!r} of the checkpoint directory: {e}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        who = (
            f"process {holder.get('pid', '?')} on host {holder.get('host', '?')!r}, "
            f"started {holder.get('started', '?')}"
            if holder
            else "a process that has not yet written its name into it"
        )
        raise CheckpointLockedError(
            f"the checkpoint directory {str(root)!r} is in use by another run: {who} "
            f"holds {str(path)!r}. Two runs writing one directory would overwrite each "
            "other's checkpoints: wait for that run to end or stop it, or use another "
            "directory"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise CheckpointError(f"cannot lock {str(path)!r}: {e}") from None
        os.close(fd)
        warnings.warn(
            f"cannot lock {str(path)!r} ({e}): the filesystem does not support flock, so "
            "nothing stops a second run from writing this directory at the same time",
            stacklevel=2,
        )
        return DirectoryLock(path, None)
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError:
        pass  # the lock is held; only the holder's description is missing
    return DirectoryLock(path, fd)
