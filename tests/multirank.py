"""A small multi-rank test harness: a pool of CPU ranks on gloo that runs test functions.

Spawning ranks costs seconds (each imports torch); the pool spawns ``world_size`` ranks
once, initialises one gloo process group, and then runs any number of module-level
functions on every rank, returning each rank's result. When a function raises on any
rank, or times out, the pool is torn down and re-created for the next test, so a
mismatched collective cannot poison later tests.

Usage (see ``conftest.py``'s ``ranks`` fixture)::

    def check(rank, world_size, x):      # module-level: pickled by reference
        ...
        return something_picklable

    results = ranks.run(check, 3)        # one result per rank
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from fvstep.core.tree import is_dtensor

DEFAULT_TIMEOUT_S = 420.0


def _worker(rank: int, world_size: int, store_path: str, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),  # a loaded 2-core CI box: gloo names the stuck op
    )
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                result = ("ok", fn(rank, world_size, *args, **kwargs))
            except BaseException:
                result = ("error", traceback.format_exc())
            conn.send(result)
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` CPU ranks on gloo that run functions ``fn(rank, world_size, *args)``."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory | None = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="fvstep-ranks-")
        store = os.path.join(self._tmp.name, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, self.world_size, store, child), daemon=True
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return their results.

        Raises:
            AssertionError: With every failing rank's traceback, if any rank raised or
                the call timed out (the pool is then restarted).
        """
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: list[Any] = []
        errors: list[str] = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                errors.append(f"rank {rank}: timed out after {timeout:.0f} s")
                break
            try:
                status, value = conn.recv()
            except (EOFError, ConnectionResetError):
                errors.append(f"rank {rank}: died (exit code {self._procs[rank].exitcode})")
                break
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close()
            raise AssertionError(
                f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors)
            )
        return results


class OneRankReference:
    """The layout of one process, for a 1-rank reference computed on each rank of a pool.

    A step's default layout (``parallelism=None``, one process) refuses a process that is
    one of several ranks, since each would train its own copy of the roles; a reference
    run wants exactly that: every rank computes the whole 1-rank step on plain modules.
    Sharded roles are still refused. A hand-written ``fvstep.core.layout.Parallelism``.
    """

    def check(self, state: Any) -> None:
        for name, rs in state.roles.items():
            if any(is_dtensor(p) for p in rs.params.values()):
                raise ValueError(f"role {name!r} is sharded: not a 1-rank reference")

    def grad_sync(self, state: Any, accumulation: Any) -> None:
        return None  # plain modules hold nothing between units

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        return 0, 1

    def collective_counter(self) -> None:
        return None

    def sum_over_ranks(self, value: Any, like: Any) -> Any:
        return value
