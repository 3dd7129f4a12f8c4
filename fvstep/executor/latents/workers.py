"""The worker processes of :class:`~fvstep.executor.latents.WorkerSource`: what they run,
how they take signals, and how they end.

A worker hands a :class:`WorkerFailure` back in place of a batch, to be raised in the call
for that step. Workers ignore SIGINT and SIGTERM (:class:`WorkerInit`): a signal to the
process group is the trainer's, which saves at the next step boundary with its loader
intact. At interpreter exit the workers of every source still open are shut down, then
killed if need be.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

# Imported before the exit hook below is registered: torch's and multiprocessing's hooks
# must be registered first, so that ours runs first (see _stop_all_workers).
from torch.utils.data import DataLoader

from fvstep.core.errors import ShardError
from fvstep.executor.data import MapDataset

__all__ = [
    "StepCollate",
    "StepIndices",
    "StepItems",
    "WorkerFailure",
    "WorkerInit",
    "forget_workers",
    "start_workers",
]


class StepIndices(list[int]):
    """A batch's indices, tagged with its step (travels to the worker and back)."""

    def __init__(self, step: int, indices: list[int]) -> None:
        super().__init__(indices)
        self.step = step

    def __reduce__(self) -> Any:
        return (StepIndices, (self.step, list(self)))


class WorkerFailure:
    """What a worker hands back instead of a batch when reading or collating raised."""

    def __init__(self, error: BaseException, indices: list[int]) -> None:
        self.kind = type(error).__name__
        self.message = str(error)
        self.is_shard = isinstance(error, ShardError)
        self.indices = indices
        self.trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))


class StepItems:
    """The dataset as the DataLoader sees it: a step's items, or the failure to read them."""

    def __init__(self, dataset: MapDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:  # pragma: no cover - __getitems__ is used
        return self.dataset[index]

    def __getitems__(self, indices: StepIndices) -> Any:
        try:
            return indices.step, [self.dataset[i] for i in indices], list(indices)
        except Exception as e:
            return indices.step, WorkerFailure(e, list(indices)), list(indices)


class StepCollate:
    """The DataLoader's ``collate_fn``: ``(step, batch)``, or the failure to collate it."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, fetched: Any) -> tuple[int, Any]:
        step, items, indices = fetched
        if isinstance(items, WorkerFailure):
            return step, items
        try:
            return step, self.collate(items)
        except Exception as e:
            return step, WorkerFailure(e, indices)


_PREEMPTION_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _preemption_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM in this thread while it forks workers: a forked child keeps
    the mask, so a signal before :class:`WorkerInit` runs stays pending instead of killing it."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no process groups to fear
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _discard_preemption_signal(signum: int, frame: Any) -> None:
    """A worker's SIGINT/SIGTERM handler: nothing; the trainer handles the preemption."""


class WorkerInit:
    """The workers' ``worker_init_fn``: ignore SIGINT and SIGTERM, then run the user's
    ``worker_init_fn``, if any."""

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        # A disposition holds for every thread of the process (a mask would not: importing
        # torch starts a thread of its own). A handler that does nothing rather than
        # SIG_IGN: an ignored signal stays ignored across exec, so a helper process the
        # dataset starts (ffmpeg) would ignore terminate(); a handler is reset to the
        # default at exec. siginterrupt(False): system calls it interrupts restart
        # (SA_RESTART), so no read of a C extension sees EINTR.
        for signum in _PREEMPTION_SIGNALS:
            signal.signal(signum, _discard_preemption_signal)
            signal.siginterrupt(signum, False)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _PREEMPTION_SIGNALS)
        if self.user is not None:
            self.user(worker_id)


class _Closable(Protocol):
    def close(self) -> None: ...


_open_sources: weakref.WeakKeyDictionary[_Closable, int] = weakref.WeakKeyDictionary()
"""Every source with workers running, and the pid of the trainer that started them."""
_started_workers: list[tuple[int, multiprocessing.process.BaseProcess]] = []
"""``(pid of the trainer, worker)`` for every worker started and not yet seen ended: a
DataLoader kept alive by a traceback never shuts its workers down, and they ignore SIGTERM,
so the exit hook must know them."""


def _stop_all_workers() -> None:
    """At interpreter exit, end the workers of every ``WorkerSource`` left open.

    It must run before multiprocessing's hook, which would SIGTERM (ignored) and join a
    running worker without a timeout, hanging the exit.
    """
    me = os.getpid()  # a process forked from the trainer inherits this hook, not its workers
    for source, trainer in list(_open_sources.items()):
        if trainer == me:
            source.close()  # the DataLoader's own shutdown: the workers exit and are joined
    # Any left is hung, or its DataLoader is still referenced and never told it to stop.
    stuck = [w for trainer, w in _started_workers if trainer == me and w.is_alive()]
    if stuck:
        # torch's SIGCHLD handler would report the kill below as a worker failure.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for w in stuck:
            w.kill()
            w.join()


atexit.register(_stop_all_workers)


def start_workers(loader: DataLoader[Any], owner: _Closable) -> Iterator[Any]:
    """Start ``loader``'s workers (its iterator); end them at interpreter exit if need be.

    At interpreter exit ``owner.close()`` is called unless :func:`forget_workers` was called
    for it first, and any of these workers still alive after it is killed.

    Args:
        loader: A DataLoader with workers, whose ``worker_init_fn`` is a :class:`WorkerInit`.
        owner: What shuts the workers down (a ``WorkerSource``).
    """
    before = {p.pid for p in multiprocessing.active_children()}
    with _preemption_signals_held():
        iterator = iter(loader)  # starts the workers
    started = [p for p in multiprocessing.active_children() if p.pid not in before]
    trainer = os.getpid()
    _started_workers[:] = [(t, p) for t, p in _started_workers if t != trainer or p.is_alive()] + [
        (trainer, p) for p in started
    ]
    _open_sources[owner] = trainer
    return iterator


def forget_workers(owner: _Closable) -> None:
    """Do not close ``owner`` at interpreter exit: its workers are shut down already."""
    _open_sources.pop(owner, None)
