"""Background saves: :class:`AsyncSaver` stages a state, then writes and commits it on a thread.

The write is :func:`fvstep.checkpoint.save`'s own, run on a background thread with a gloo
group of its own; only the check of the target and the host copy of the state block the
caller. DCP's ``async_save`` would not do: its future never exposes the staged copy, so the
checksums would have to be taken from the live state first (``docs/benchmarks.md``).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fvstep.checkpoint.saving import (
    WRITER_THREADS,
    fingerprint,
    local_checks,
    make_temp_dir,
    prepare_save,
    refuse_nonfinite,
    write_checkpoint,
)
from fvstep.parallel.ranks import rank_and_world

__all__ = ["AsyncSaver"]


class _Stager:
    """Copies a state's tensors (a DTensor's local shard) to host memory, pinned from a GPU,
    reusing its buffers from save to save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def _host(self, path: str, local: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            pin = local.device.type == "cuda"
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            self._buffers[path] = buf
        buf.copy_(local, non_blocking=local.device.type == "cuda")
        return buf

    def stage(self, paths: list[str], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        staged: list[torch.Tensor] = []
        for path, x in zip(paths, leaves):
            if isinstance(x, DTensor):
                host = self._host(path, x.to_local().detach())
                staged.append(
                    DTensor.from_local(
                        host,
                        x.device_mesh,
                        x.placements,
                        run_check=False,
                        shape=x.shape,
                        stride=x.stride(),
                    )
                )
            else:
                staged.append(self._host(path, x.detach()))
        if any(x.device.type == "cuda" for x in leaves):
            torch.cuda.synchronize()
        return staged


class AsyncSaver:
    """Saves in the background; one save in flight at a time.

    :meth:`save` blocks only to check the target and to stage the state (a host copy of
    every tensor, its buffers reused from save to save), so the caller may update the state
    in place as soon as it returns. The write and the commit run on a background thread,
    with a gloo group of their own so that their collectives never interleave with a step's;
    their failure is raised, as a ``CheckpointError`` naming the path, by the next
    :meth:`save`, :meth:`wait` or :meth:`close`.

    Examples:
        >>> with AsyncSaver() as saver:
        ...     for step in ...:
        ...         state, _ = step_fn(state, batch)
        ...         saver.save(state, checkpoint_dir(root, int(state.step)))
    """

    def __init__(self, *, group: Any = None) -> None:
        self._group = group
        self._upload_group: Any = None
        self._pending: concurrent.futures.Future[None] | None = None
        self._stager = _Stager()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fvstep-ckpt"
        )

    def save(
        self,
        state: Any,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        allow_nonfinite: bool = False,
        writer_threads: int = WRITER_THREADS,
    ) -> None:
        """Start saving ``state`` to ``path``; returns once the state has been staged.

        Every rank calls it, with :func:`fvstep.checkpoint.save`'s arguments. A non-finite
        leaf is refused: from a GPU the checksums run before staging, so this call raises;
        from a CPU they run in the background, so the next call raises.

        Raises:
            CheckpointError: If ``path`` exists and ``overwrite`` is false, or (on a GPU)
                a leaf is not finite; or the failure of the previous background save.
            TypeError: If ``writer_threads`` is not an integer.
            ValueError: If ``writer_threads`` is smaller than 1.
        """
        final = Path(path)
        writer_threads, paths, leaves, frozen = prepare_save(
            state, final, writer_threads, self._group
        )
        self.wait()
        if self._upload_group is None and rank_and_world(self._group)[1] > 1:
            self._upload_group = dist.new_group(backend="gloo")
        step = int(getattr(state, "step", 0))
        prints = None
        if any(x.device.type == "cuda" for x in leaves):
            sums, finite = local_checks(leaves, check_finite=not allow_nonfinite)
            if not allow_nonfinite:
                refuse_nonfinite(paths, finite, step, final, self._group)
            prints = fingerprint(paths, leaves, group=self._group, sums=sums)
        tmp = make_temp_dir(final, overwrite, self._group)
        try:
            staged = self._stager.stage(paths, leaves)
        except Exception:
            if rank_and_world(self._group)[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending = self._executor.submit(
            write_checkpoint,
            paths,
            staged,
            step,
            final,
            tmp,
            overwrite,
            self._upload_group,
            prints,
            allow_nonfinite,
            frozen,
            writer_threads,
        )

    def wait(self) -> None:
        """Wait for the save in flight; raise its failure (a ``CheckpointError``)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight (raising its failure), then stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
