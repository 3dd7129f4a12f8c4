"""Worker loading in step order: :class:`WorkerSource`, a data source backed by a DataLoader.

A worker hands a failure back in place of a batch, raised in the call for that step. Workers
ignore SIGINT and SIGTERM: a signal to the process group is the trainer's, which saves at the
next step boundary with its loader intact. At interpreter exit the workers of every source
still open are shut down, then killed if need be. See docs/concepts/data.md.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import os
import signal
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, SupportsIndex

import torch

# Imported before the exit hook below is registered: torch's and multiprocessing's hooks
# must be registered first, so that ours runs first (see _stop_all_workers).
from torch.utils.data import DataLoader, default_collate

from fvstep.core._checks import check_int
from fvstep.core.errors import ShardError
from fvstep.executor.data import MapDataset

__all__ = ["Order", "WorkerSource", "latent_source"]


class _StepIndices(list[int]):
    """A batch's indices, tagged with its step (travels to the worker and back)."""

    def __init__(self, step: int, indices: list[int]) -> None:
        super().__init__(indices)
        self.step = step


class _WorkerFailure:
    """What a worker hands back instead of a batch when reading or collating raised."""

    def __init__(self, error: BaseException, indices: list[int]) -> None:
        self.kind = type(error).__name__
        self.message = str(error)
        self.is_shard = isinstance(error, ShardError)
        self.indices = indices
        self.trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))


class _StepItems:
    """The dataset as the DataLoader sees it: a step's items, or the failure to read them."""

    def __init__(self, dataset: MapDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:  # pragma: no cover - __getitems__ is used
        return self.dataset[index]

    def __getitems__(self, indices: _StepIndices) -> Any:
        try:
            return indices.step, [self.dataset[i] for i in indices], list(indices)
        except Exception as e:
            return indices.step, _WorkerFailure(e, list(indices)), list(indices)


class _StepCollate:
    """The DataLoader's ``collate_fn``: ``(step, batch)``, or the failure to collate it."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, fetched: Any) -> tuple[int, Any]:
        step, items, indices = fetched
        if isinstance(items, _WorkerFailure):
            return step, items
        try:
            return step, self.collate(items)
        except Exception as e:
            return step, _WorkerFailure(e, indices)


_PREEMPTION_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _preemption_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM in this thread while it forks workers: a forked child keeps
    the mask, so a signal before ``_WorkerInit`` runs stays pending instead of killing it."""
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


class _WorkerInit:
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


def _start_workers(loader: DataLoader[Any], owner: _Closable) -> Iterator[Any]:
    """Start ``loader``'s workers (its iterator); at exit close ``owner`` and kill any left."""
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


class Order(Protocol):
    """What decides the items of a batch: a ``ShuffledSource``, a ``BucketedOrder``..."""

    def indices(
        self, step: SupportsIndex, *, rank: SupportsIndex = 0, world_size: SupportsIndex = 1
    ) -> list[int]: ...


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class WorkerSource:
    """A data source that reads ``order``'s batches of ``dataset`` in worker processes.

    Asked for any step but the next one, it starts a new DataLoader at that step, so a batch
    never depends on where the run started (docs/concepts/data.md).

    Args:
        dataset: A map-style dataset; with workers it must pickle.
        order: Decides the items of each ``(step, rank, world_size)`` (an :class:`Order`).
        num_workers: Worker processes (``0``: read in the calling process, no prefetch).
        prefetch: Batches each worker prepares ahead (``prefetch_factor``).
        pin_memory: Copy batches into pinned memory (default: when CUDA is available).
        multiprocessing_context: The workers' start method (default: the platform's).
        timeout_s: Give up waiting for a batch after this many seconds (``0``: never).
        device: Move each batch's tensors there, ``non_blocking``; default: host memory.
        worker_init_fn: Called with the worker's id in each worker, after it is made to
            ignore preemption signals.

    Raises:
        ValueError: If ``num_workers < 0`` or ``prefetch < 1``.

    Examples:
        >>> from fvstep import random as fr
        >>> from fvstep.executor.data import ShuffledSource
        >>> items = [{"x": torch.tensor([i])} for i in range(6)]
        >>> order = ShuffledSource(items, key=fr.key(0), batch_size=2)
        >>> with WorkerSource(items, order, num_workers=0) as data:
        ...     torch.equal(data.batch(4)["x"], order.batch(4)["x"])
        True
    """

    def __init__(
        self,
        dataset: MapDataset,
        order: Order,
        *,
        num_workers: int = 2,
        prefetch: int = 2,
        pin_memory: bool | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        multiprocessing_context: str | None = None,
        timeout_s: float = 0.0,
        device: torch.device | str | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        self._dataset = dataset
        self._order = order
        self._num_workers = check_int(num_workers, "num_workers", minimum=0)
        self._prefetch = check_int(prefetch, "prefetch", minimum=1)
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._collate = default_collate if collate is None else collate
        self._context = multiprocessing_context
        self._timeout = float(timeout_s)
        self._device = None if device is None else torch.device(device)
        self._worker_init = worker_init_fn
        self._iter: Iterator[Any] | None = None
        self._next: tuple[int, int, int] | None = None
        self.restarts = 0  # how many DataLoaders were started (tests and benchmarks read it)

    @property
    def order(self) -> Order:
        """The object that decides each batch's items."""
        return self._order

    @property
    def dataset(self) -> MapDataset:
        """The dataset."""
        return self._dataset

    def indices(
        self, step: SupportsIndex, *, rank: SupportsIndex = 0, world_size: SupportsIndex = 1
    ) -> list[int]:
        """The items of ``rank``'s batch at ``step``: ``order.indices(...)``."""
        return self._order.indices(step, rank=rank, world_size=world_size)

    def _start(self, step: int, rank: int, world: int) -> None:
        self._stop()
        workers = self._num_workers
        steps = (  # the batch sampler: the index lists of steps step, step + 1, ..., forever
            _StepIndices(s, self._order.indices(s, rank=rank, world_size=world))
            for s in itertools.count(step)
        )
        loader: DataLoader[Any] = DataLoader(
            _StepItems(self._dataset),  # type: ignore[arg-type]
            batch_sampler=steps,
            num_workers=workers,
            collate_fn=_StepCollate(self._collate),
            pin_memory=self._pin,
            prefetch_factor=self._prefetch if workers else None,
            multiprocessing_context=self._context if workers else None,
            timeout=self._timeout if workers else 0,
            worker_init_fn=_WorkerInit(self._worker_init) if workers else None,
        )
        self._iter = _start_workers(loader, self) if workers else iter(loader)
        self._next = (step, rank, world)
        self.restarts += 1

    def _stop(self) -> None:
        # Dropping the DataLoader's iterator shuts its workers down (its __del__ joins them).
        self._iter, self._next = None, None
        _open_sources.pop(self, None)  # nothing left to close at exit

    def batch(
        self, step: SupportsIndex, *, rank: SupportsIndex = 0, world_size: SupportsIndex = 1
    ) -> Any:
        """``rank``'s batch at ``step``, prefetched when the calls come in step order.

        Raises:
            ShardError: If a shard of the batch is missing or damaged (naming the rank, the
                step, the file and the row).
            RuntimeError: If reading or collating raised anything else (with the worker's
                traceback), or a worker died.
            ValueError: As ``order.indices``.
        """
        s = check_int(step, "step", minimum=0)
        r = check_int(rank, "rank", minimum=0)
        w = check_int(world_size, "world_size", minimum=1)
        self._order.indices(s, rank=r, world_size=w)  # argument errors, in the caller's words
        if self._iter is None or self._next != (s, r, w):
            self._start(s, r, w)
        assert self._iter is not None
        where = f"rank {r} of {w}, step {s}"
        try:
            got, payload = next(self._iter)
        except Exception as e:  # a worker died, timed out, or the sampler raised
            self._stop()
            raise self._report(RuntimeError(f"{where}: the data loader failed: {e}"), w) from e
        self._next = (s + 1, r, w)
        if isinstance(payload, _WorkerFailure):
            self._stop()
            where += f" (items {payload.indices})"
            if payload.is_shard:
                raise self._report(ShardError(f"{where}: {payload.message}"), w)
            trace = f"in the data loader (traceback there):\n{payload.trace}"
            message = f"{where}: {payload.kind}: {payload.message}\n{trace}"
            raise self._report(RuntimeError(message), w)
        assert got == s, f"the loader yielded step {got} for step {s}"
        return payload if self._device is None else _to_device(payload, self._device)

    @staticmethod
    def _report(error: Exception, world: int) -> Exception:
        if world > 1:  # the other ranks may only see a collective time out: say it here
            print(f"fvstep: data error: {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        return error

    def __call__(self, step: SupportsIndex) -> Any:
        """The single-process batch at ``step``: ``batch(step)`` with one rank."""
        return self.batch(step)

    def close(self) -> None:
        """Shut the worker processes down; a later :meth:`batch` starts new ones."""
        self._stop()

    def __enter__(self) -> WorkerSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"WorkerSource({self._dataset!r}, order={self._order!r}, "
            f"num_workers={self._num_workers}, prefetch={self._prefetch}, pin_memory={self._pin})"
        )


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

    ``WorkerSource(LatentDataset(root, ...), BucketedOrder(dataset.shapes, ...), ...)``;
    ``fields`` and ``verify`` are :class:`LatentDataset`'s, ``drop_last``
    :class:`BucketedOrder`'s, ``**loader_options`` :class:`WorkerSource`'s.

    Returns:
        A :class:`WorkerSource`; close it (or use it in a ``with``) when done.

    Raises:
        FileNotFoundError: If ``root`` has no index.
        ShardError: If the index is malformed or lists a missing shard.
    """
    from fvstep.executor.latents.dataset import LatentDataset
    from fvstep.executor.latents.order import BucketedOrder

    dataset = LatentDataset(root, fields=fields, verify=verify)
    order = BucketedOrder(dataset.shapes, key=key, batch_size=batch_size, drop_last=drop_last)
    return WorkerSource(dataset, order, num_workers=num_workers, **loader_options)
