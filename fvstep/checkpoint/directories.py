"""The directory of a run's checkpoints: names, "latest", keep-last-N, set-aside and the lock.

A root holds one ``step_<n>`` directory per complete checkpoint (committed by
:func:`fvstep.checkpoint.save`); a directory without a valid manifest, or still named
``.tmp-*``, is never "latest". A checkpoint :func:`fvstep.run` found damaged is renamed
``step_<n>.damaged`` (:func:`set_aside`). ``.lock`` is the run's lock (:func:`lock_dir`).
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

from fvstep.checkpoint.saving import discard, fsync, read_manifest
from fvstep.core.errors import CheckpointError, CheckpointLockedError, NewerFormatError

__all__ = [
    "LOCK_NAME",
    "CheckpointSkippedWarning",
    "DirectoryLock",
    "checkpoint_dir",
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


class CheckpointSkippedWarning(UserWarning):
    """:func:`fvstep.run` skipped a damaged checkpoint and resumed from an older one."""


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The directory of the checkpoint at ``step`` under ``root``: ``root/step_<step:09d>``."""
    return Path(root) / f"step_{step:09d}"


def temp_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint at ``step`` is written before its commit: ``root/.tmp-step_<step:09d>``."""
    return Path(root) / f".tmp-step_{step:09d}"


def list_complete(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first.

    A ``step_<n>`` directory counts if its manifest is valid, or written by a newer format
    (loading it then says to upgrade, so an older fvstep never resumes from an older
    step). A malformed manifest never raises here: its directory is not listed.

    Returns:
        ``[(step, path), ...]``; ``[]`` if ``root`` is not a directory.
    """
    found = []
    for step, entry in list_step_dirs(root):
        try:
            read_manifest(entry)
        except NewerFormatError:
            pass
        except (CheckpointError, OSError):
            continue
        found.append((step, entry))
    return found


def list_step_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step_<n>`` directory under ``root`` as ``(step, path)``, complete or not,
    oldest first (``[]`` if ``root`` is not a directory)."""
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
    """Rename a damaged checkpoint ``step_<n>`` to ``step_<n>.damaged`` (or ``.damaged-<k>``)
    and return its new path; an ``OSError`` if it cannot be renamed."""
    target = path.with_name(f"{path.name}.damaged")
    k = 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.damaged-{k}")
    os.replace(path, target)
    fsync(path.parent)
    return target


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (:func:`list_complete`), or ``None``.

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
        keep: How many complete checkpoints to keep (at least 1); ``None`` keeps all.
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


class DirectoryLock:
    """An exclusive ``flock`` on the lock file ``path``, held until :meth:`release` (see :func:`lock_dir`)."""

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

    An ``flock`` on ``<root>/.lock`` (created if needed, never deleted) into which the holder
    writes its host, pid and start time; where the filesystem ignores or refuses ``flock``:
    ``docs/concepts/checkpoints.md`` ("One run per directory").

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
            f"the checkpoint directory {str(root)!r} is in use by another run: {who} holds "
            f"{str(path)!r}; wait for that run to end or stop it, or use another directory"
        ) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise CheckpointError(f"cannot lock {str(path)!r}: {e}") from None
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
