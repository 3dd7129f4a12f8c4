"""Device meshes (FSDP2, HSDP, context parallel) and FSDP2 sharding of a role's module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fvstep.parallel.ranks import rank_and_world

__all__ = [
    "BlockFilter",
    "block_names",
    "check_axis",
    "data_parallel_rank_and_size",
    "is_block",
    "is_sharded",
    "make_context_mesh",
    "make_mesh",
    "shard_module",
]

BlockFilter = Callable[[str, nn.Module, nn.Module | None], bool]
"""``(qualified_name, submodule, parent) -> bool``: whether a submodule is its own FSDP2 group."""


def is_sharded(module: Any) -> bool:
    """Whether ``module`` is an FSDP2 module (``fully_shard`` was applied to it)."""
    return isinstance(module, FSDPModule)


def _world_size(caller: str) -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialised process group (torchrun or init_process_group)"
        )
    return dist.get_world_size()


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_mesh(
    *, replicate: int = 1, shard: int | None = None, device_type: str | None = None
) -> DeviceMesh:
    """A device mesh for FSDP2 (1-D ``("shard",)``) or HSDP (2-D ``("replicate", "shard")``).

    Args:
        replicate: The number of replicas (HSDP when > 1).
        shard: Ranks per shard group; default ``world_size // replicate``.
        device_type: Default ``"cuda"`` if available, else ``"cpu"``.

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If ``replicate * shard`` is not the world size.

    Examples:
        >>> mesh = make_mesh()                   # FSDP over all ranks
        >>> mesh = make_mesh(replicate=2)        # HSDP: 2 replicas
    """
    world = _world_size("make_mesh")
    shard = shard if shard is not None else world // max(replicate, 1)
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(
            f"replicate ({replicate}) x shard ({shard}) must equal the world size {world}"
        )
    device_type = device_type or _default_device_type()
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def is_block(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    """The default :data:`BlockFilter`: the items of the root's ``nn.ModuleList`` attributes.

    ``blocks.0``, ``blocks.1``, ... of a Wan transformer; not lists nested inside blocks."""
    return isinstance(parent, nn.ModuleList) and name.count(".") == 1


def block_names(module: nn.Module, blocks: BlockFilter = is_block) -> list[str]:
    """The qualified names of the blocks ``blocks`` picks, in module order (``['blocks.0', ...]``)."""
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    return [n for n, m in module.named_modules() if n and blocks(n, m, parents.get(id(m)))]


def shard_module(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    blocks: BlockFilter = is_block,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``module`` with FSDP2: ``fully_shard`` each block ``blocks`` picks, then the root.

    The FSDP2 options (``mp_policy``, ``reshard_after_forward``, ``offload_policy``) apply
    to every group; by default no mixed precision and no CPU offload.

    Args:
        module: The role's module (parameters on the mesh's device type).
        mesh: From :func:`make_mesh`; a 2-D mesh gives HSDP.

    Raises:
        ValueError: If the module is already sharded.
    """
    if is_sharded(module):
        raise ValueError("the module is already sharded (fully_shard was applied)")
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    for name in reversed(block_names(module, blocks)):  # inner groups before outer ones
        fully_shard(module.get_submodule(name), **options)
    fully_shard(module, **options)
    return module


def make_context_mesh(*, context: int, device_type: str | None = None) -> DeviceMesh:
    """A 2-D ``("data", "context")`` device mesh over every rank, context innermost.

    The ranks of one context group are consecutive, so ``rank // context`` is the
    data-parallel replica. Shard the roles with FSDP2 over every rank (:func:`make_mesh`).

    Args:
        context: Ranks per context group (the sequence is split ``context`` ways).

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If ``context < 2`` or it does not divide the world size.

    Examples:
        >>> mesh = make_context_mesh(context=2)          # 8 ranks: 4 replicas x 2
    """
    world = _world_size("make_context_mesh")
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"context must be an int >= 2 (ranks per context group), got {context!r}")
    if world % context:
        raise ValueError(f"context ({context}) must divide the world size {world}")
    device_type = device_type or _default_device_type()
    return init_device_mesh(
        device_type, (world // context, context), mesh_dim_names=("data", "context")
    )


def check_axis(mesh: DeviceMesh, axis: str) -> int:
    """The dim of ``mesh`` named ``axis``, or a ``ValueError`` naming the mesh's axes."""
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise ValueError(
            f"the mesh has no axis {axis!r} (its axes: {tuple(names)}); build one with "
            "make_context_mesh(context=...) or name the context axis with axis="
        )
    return names.index(axis)


def data_parallel_rank_and_size(mesh: DeviceMesh, *, axis: str = "context") -> tuple[int, int]:
    """This rank's data-parallel index on ``mesh``, and the number of replicas.

    The index is this rank's coordinate on every axis but ``axis``, flattened in row-major
    order: the ranks of one context group share it.

    Returns:
        ``(index, size)`` with ``size = mesh.size() // mesh[axis].size()``.

    Raises:
        ValueError: If ``mesh`` has no axis ``axis`` or this rank is not on it.

    Examples:
        >>> data_parallel_rank_and_size(make_context_mesh(context=2))   # rank 3 of 4
        (1, 2)
    """
    dim = check_axis(mesh, axis)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"rank {rank_and_world()[0]} is not on the mesh {mesh}")
    shape = tuple(mesh.mesh.shape)
    index, size = 0, 1
    for d, (c, n) in enumerate(zip(coordinate, shape)):
        if d != dim:
            index, size = index * n + c, size * n
    return index, size
