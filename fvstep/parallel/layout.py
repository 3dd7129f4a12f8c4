"""The process layout of a call: data-parallel replicas, context-parallel groups, FSDP2.

:class:`Layout` is the :class:`~fvstep.core.layout.Parallelism` a step is called with on
several ranks. Like torchtitan's ``ParallelDims``, one object owns the rank mapping: this
rank's replica (its noise and batch), its context group, and how gradients are synced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from fvstep.core.accumulation import Accumulation
from fvstep.core.layout import GradSync
from fvstep.core.state import TrainState
from fvstep.core.tree import any_dtensor, is_dtensor
from fvstep.parallel.collectives import CollectiveCounter
from fvstep.parallel.context import applied_context_group
from fvstep.parallel.grad_sync import FSDPGradSync
from fvstep.parallel.mesh import data_parallel_rank_and_size, is_sharded
from fvstep.parallel.ranks import rank_and_world

__all__ = ["Layout", "default_layout"]


@attrs.frozen
class Layout:
    """Data parallel over every rank, or over the replicas of a context-parallel mesh.

    - ``Layout()``: every rank is a data-parallel replica (``rank`` of ``world``); the
      roles are sharded or replicated with FSDP2 (:func:`~fvstep.parallel.shard_module`,
      :func:`~fvstep.parallel.prepare`).
    - ``Layout(mesh)``: ``mesh`` has a context axis (:func:`~fvstep.parallel.make_context_mesh`);
      the ranks of one context group are one replica (the same noise and the same batch),
      and every context-parallel role must have been prepared on this mesh's groups.

    Attributes:
        count_collectives: Report ``collectives/*`` counts and bytes in a step's metrics.

    Examples:
        >>> state, metrics = step(state, batch, parallelism=Layout())
        >>> fvstep.run(step, state, data, num_steps=100,
        ...            parallelism=Layout(make_context_mesh(context=2)))
    """

    mesh: DeviceMesh | None = None
    context_axis: str = "context"
    count_collectives: bool = False

    def __attrs_post_init__(self) -> None:
        if self.mesh is not None:
            data_parallel_rank_and_size(self.mesh, axis=self.context_axis)  # checks the axis

    def check(self, state: TrainState) -> None:
        """Refuse a role this layout cannot train correctly.

        Raises:
            ValueError: On several ranks, if a trained role is neither sharded nor replicated
                (its copies would diverge); if a context-parallel role was prepared for
                other groups than this mesh's.
        """
        _, world = rank_and_world()
        for name, rs in state.roles.items():
            if world > 1 and rs.role.trainable and not is_sharded(rs.role.module):
                raise ValueError(
                    f"role {name!r} is trained on {world} ranks but its module is not sharded (the copies would "
                    "diverge): fvstep.parallel.shard_module(module, mesh=make_mesh()) before TrainState.create"
                )
        mine = None
        if self.mesh is not None:
            mine = tuple(dist.get_process_group_ranks(self.mesh[self.context_axis].get_group()))
        for name, rs in state.roles.items():
            theirs = applied_context_group(rs.role.module)
            if theirs is not None and theirs != mine:
                where = f"this call's groups are {list(mine)}" if mine else "this call has none"
                raise ValueError(
                    f"role {name!r} runs context parallel over ranks {list(theirs)}, but "
                    f"{where}: pass parallelism=Layout(mesh) with the mesh it was prepared on"
                )

    def grad_sync(self, state: TrainState, accumulation: Accumulation) -> GradSync | None:
        """The FSDP2 gradient-sync controller of one unit (``None`` without FSDP2)."""
        if not any(is_sharded(rs.role.module) for rs in state.roles.values()):
            return None
        return FSDPGradSync(accumulation)

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """This rank's replica and the number of replicas (``(rank, world)`` without a mesh)."""
        if self.mesh is None:
            return rank_and_world()
        return data_parallel_rank_and_size(self.mesh, axis=self.context_axis)

    def collective_counter(self) -> CollectiveCounter | None:
        """A fresh counter when ``count_collectives``, else ``None``."""
        return CollectiveCounter() if self.count_collectives else None

    def sum_over_ranks(self, value: torch.Tensor, like: Sequence[torch.Tensor]) -> torch.Tensor:
        """``value`` summed over the mesh of the first DTensor of ``like`` (as it is if none)."""
        mesh = next((cast(DTensor, x).device_mesh for x in like if is_dtensor(x)), None)
        if mesh is None:
            return value
        out = value.reshape(1).to(mesh.device_type)
        for dim in range(mesh.ndim):  # one mesh dim at a time: DTensor warns about several
            placements: list[Any] = [Replicate()] * mesh.ndim
            placements[dim] = Partial()
            out = DTensor.from_local(out, mesh, placements).full_tensor()
        return out[0]


def default_layout(state: TrainState) -> Layout | None:
    """``Layout()`` on several ranks or for a state with sharded roles, else ``None``
    (the layout of one process). What ``fvstep.run`` uses when given no ``parallelism``.
    """
    sharded = any_dtensor(p for rs in state.roles.values() for p in rs.params.values())
    return Layout() if sharded or rank_and_world()[1] > 1 else None
