"""Rank helpers: who am I, wait for the others, share a value, reduce a few numbers.

Without a process group (or on a group of one rank) every helper returns the
single-process answer at once. The object helpers pickle: small control values only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "barrier",
    "broadcast_object",
    "collective_device",
    "gather_objects",
    "host_group",
    "max_over_ranks",
    "min_over_ranks",
    "rank_and_world",
]


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (default: the world); ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def barrier(group: Any = None) -> None:
    """Wait until every rank of ``group`` gets here; a no-op on one process."""
    if rank_and_world(group)[1] > 1:
        dist.barrier(group=group)


def gather_objects(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), by rank; ``[obj]`` on one process."""
    world = rank_and_world(group)[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, *, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s (a global rank) ``obj`` on every rank; ``obj`` itself on one process.

    The other ranks' ``obj`` is ignored (pass ``None``)."""
    if rank_and_world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor collective of ``group`` runs: this rank's CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group))
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_over_ranks(
    values: Sequence[float], op: Any, device: torch.device | None, group: Any
) -> list[Any]:
    if rank_and_world(group)[1] == 1 or not values:
        return list(values)
    exact = all(isinstance(v, int) for v in values)  # bools too
    dtype = torch.int64 if exact else torch.float64
    t = torch.tensor(list(values), dtype=dtype, device=device or collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return [int(v) if exact else float(v) for v in t.cpu()]


def max_over_ranks(
    values: Sequence[float], *, device: torch.device | None = None, group: Any = None
) -> list[Any]:
    """Element-wise maximum of ``values`` over the ranks of ``group``; ``values`` on one process.

    Integers and bools come back exact, as ``int``; others as float64. Every rank passes as many."""
    return _reduce_over_ranks(values, dist.ReduceOp.MAX, device, group)


def min_over_ranks(
    values: Sequence[float], *, device: torch.device | None = None, group: Any = None
) -> list[Any]:
    """Element-wise minimum of ``values`` over the ranks of ``group`` (see :func:`max_over_ranks`)."""
    return _reduce_over_ranks(values, dist.ReduceOp.MIN, device, group)


@contextlib.contextmanager
def host_group() -> Iterator[Any]:
    """A gloo group over every rank (``None`` on one process), destroyed on exit.

    For control messages that must not wait for the GPU; every rank enters and leaves it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield None
        return
    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)
