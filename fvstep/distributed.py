"""FSDP2-sharded roles, the gradient-sync policies of accumulation, and collective counts.

Only this module, ``fvstep.checkpoint`` and the executor call ``torch.distributed``.

- :func:`make_mesh` and :func:`shard_module` shard a role with ``fully_shard`` (per
  block, then the root), optionally HSDP on a 2-D ``("replicate", "shard")`` mesh.
- :class:`FSDPGradSync` applies an :class:`~fvstep.accumulation.Accumulation` policy per
  micro-batch to the FSDP2 roots of the roles a unit trains, and restores FSDP2's
  defaults afterwards, whatever happens.
- :class:`CollectiveCounter` counts the collectives (and their bytes) that run inside it:
  the proof that a policy did what it says.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fvstep.accumulation import Accumulation
from fvstep.state import RoleState, TrainState

__all__ = [
    "CollectiveCounter",
    "FSDPGradSync",
    "barrier",
    "blocks_policy",
    "check_roles_are_data_parallel",
    "data_parallel_index",
    "destroy",
    "gather_objects",
    "grad_sync_for",
    "init_from_env",
    "is_sharded",
    "launch",
    "make_mesh",
    "max_over_ranks",
    "rank_and_world",
    "release_modules",
    "shard_module",
    "unrested_modules",
]

ShardPolicy = Callable[[str, nn.Module, nn.Module | None], bool]


def is_sharded(module: Any) -> bool:
    """Whether ``module`` is an FSDP2 module (``fully_shard`` was applied to it)."""
    return isinstance(module, FSDPModule)


def make_mesh(
    *, replicate: int = 1, shard: int | None = None, device_type: str | None = None
) -> DeviceMesh:
    """A device mesh for FSDP2 (1-D ``("shard",)``) or HSDP (2-D ``("replicate", "shard")``).

    Args:
        replicate: The number of replicas (HSDP when > 1).
        shard: Ranks per shard group; default ``world_size // replicate``.
        device_type: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` if available.

    Returns:
        The mesh (``init_device_mesh``).

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If ``replicate * shard`` is not the world size.

    Examples:
        >>> mesh = make_mesh()                   # FSDP over all ranks
        >>> mesh = make_mesh(replicate=2)        # HSDP: 2 replicas
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh needs an initialised process group (torchrun or init_process_group)"
        )
    world = dist.get_world_size()
    shard = shard if shard is not None else world // max(replicate, 1)
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(
            f"replicate ({replicate}) x shard ({shard}) must equal the world size {world}"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def blocks_policy(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    """The default wrapping policy: the blocks of the root's ``nn.ModuleList`` attributes.

    ``blocks.0``, ``blocks.1``, ... of a Wan transformer (``layers.*`` of a Llama-style
    model); lists nested inside blocks (an attention's ``to_out``) are not wrapped.
    """
    return isinstance(parent, nn.ModuleList) and name.count(".") == 1


def shard_module(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    policy: ShardPolicy = blocks_policy,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``module`` with FSDP2: ``fully_shard`` each block the policy picks, then the root.

    Args:
        module: The role's module (parameters on the mesh's device type).
        mesh: From :func:`make_mesh`; a 2-D mesh gives HSDP.
        policy: ``(qualified_name, submodule, parent) -> bool``: which submodules become
            their own FSDP2 groups (default: the blocks of every ``nn.ModuleList``).
        mp_policy: e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``.
        reshard_after_forward: FSDP2's option, for every group.

    Returns:
        The same module, now an ``FSDPModule``.

    Raises:
        ValueError: If the module is already sharded.

    Examples:
        >>> shard_module(student, mesh=make_mesh(), mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    """
    if is_sharded(module):
        raise ValueError("the module is already sharded (fully_shard was applied)")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    chosen = [m for n, m in module.named_modules() if n and policy(n, m, parents.get(id(m)))]
    for block in reversed(chosen):  # inner groups before outer ones
        fully_shard(
            block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return module


def data_parallel_index(sequence_parallel_size: int = 1) -> int:
    """This rank's data-parallel index: ranks of one sequence-parallel group share it.

    ``0`` without an initialised process group.
    """
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
    if not dist.is_initialized():
        return 0
    world = dist.get_world_size()
    if world % sequence_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by sequence_parallel_size {sequence_parallel_size}"
        )
    return dist.get_rank() // sequence_parallel_size


def _unsharded_grad_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class FSDPGradSync:
    """Applies an accumulation policy to the FSDP2 roots of the roles one unit trains.

    Per micro-batch ``m`` of ``K`` (``last = m == K - 1``):

    - ``every``: FSDP2's defaults (reduce-scatter each backward and wait for it);
    - ``no_sync``: ``set_requires_gradient_sync(last)`` (needs ``Role(allow_no_sync=True)``);
    - ``deferred``: ``set_is_last_backward(last)``;
    - ``keep_params_gathered``: ``set_reshard_after_backward(last)``;
    - HSDP with ``defer_all_reduce``: ``set_requires_all_reduce(last)``.

    :meth:`end` restores FSDP2's defaults (sync on, last backward, reshard, all-reduce)
    on every root it touched, also after an error.
    """

    def __init__(self, accumulation: Accumulation) -> None:
        self.accumulation = accumulation
        self.roots: list[FSDPModule] = []
        self.num_microbatches = 1

    def release(self, state: TrainState, *, after_error: bool = False) -> None:
        """Reshard every FSDP2 group of every role of ``state`` (see :func:`release_modules`)."""
        release_modules(state, after_error=after_error)

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Collect the sharded roots and check the per-role opt-ins."""
        self.num_microbatches = num_microbatches
        self.roots = []
        for rs in roles:
            module = rs.role.module
            if not is_sharded(module):
                continue
            if (
                self.accumulation.sync == "no_sync"
                and num_microbatches > 1
                and not rs.role.allow_no_sync
            ):
                mib = _unsharded_grad_bytes(module) / 2**20
                raise ValueError(
                    f"sync='no_sync' keeps an unsharded gradient of up to {mib:.1f} MiB per rank "
                    f"for a role's module ({type(module).__name__}) between micro-batches; opt in "
                    "with Role(..., allow_no_sync=True), or use sync='deferred' (same result, "
                    "sharded gradients)"
                )
            self.roots.append(module)  # type: ignore[arg-type]

    def before_backward(self, index: int) -> None:
        """Set the FSDP2 flags for micro-batch ``index``."""
        last = index == self.num_microbatches - 1
        acc = self.accumulation
        for root in self.roots:
            if acc.sync == "no_sync":
                root.set_requires_gradient_sync(last)
            elif acc.sync == "deferred":
                root.set_is_last_backward(last)
            if acc.keep_params_gathered:
                root.set_reshard_after_backward(last)
            if acc.defer_all_reduce:
                root.set_requires_all_reduce(last)

    def end(self) -> dict[str, Any]:
        """Restore FSDP2's defaults on every root touched."""
        for root in self.roots:
            root.set_requires_gradient_sync(True)
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_all_reduce(True)
        self.roots = []
        return {}


def _fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def release_modules(state: TrainState, *, after_error: bool = False) -> None:
    """Return every FSDP2 module of every role of ``state`` to rest: all groups sharded.

    FSDP2 does not reshard the root group after forward (its backward would gather it
    again at once), so a role read under ``torch.no_grad()`` keeps its root group
    unsharded, and that group's unsharded parameters keep the ``requires_grad`` they had
    when they were gathered. fvstep calls this before and after every unit, so that no
    such state survives a unit (DESIGN point 9); :func:`unrested_modules` checks it.

    Args:
        state: The state whose roles' modules to release.
        after_error: A forward or backward raised midway: wait for and discard in-flight
            collectives and partial reductions too (FSDP2's ``reset_iter_state`` where the
            installed torch has it).
    """
    for rs in state.roles.values():
        modules = _fsdp_modules(rs.role.module)
        if not modules:
            continue
        root = modules[0]
        reset = getattr(root, "reset_iter_state", None)
        if after_error and reset is not None and root._get_fsdp_state()._is_root:
            reset()
        for m in modules:
            m.reshard()


def unrested_modules(state: TrainState) -> list[str]:
    """What a module of ``state`` holds that the state does not; ``[]`` when at rest.

    At rest (after every unit and every step): each role's module holds exactly the
    state's parameter tensors (no FSDP2 group unsharded), every trainable parameter has
    ``requires_grad`` on and every frozen one off, and no parameter has a ``.grad``.

    Examples:
        >>> state, _ = step(state, batch)
        >>> assert unrested_modules(state) == []
    """
    problems: list[str] = []
    for name, rs in state.roles.items():
        module = rs.role.module
        live = dict(module.named_parameters(remove_duplicate=False))
        trainable = set(rs.trainable_names)
        for pname, tensor in rs.params.items():
            held = live.get(pname)
            if held is not tensor:
                kind = "an unsharded FSDP2 parameter" if is_sharded(module) else "another tensor"
                problems.append(f"{name}.{pname}: the module holds {kind}, not the state's leaf")
            if tensor.requires_grad != (pname in trainable):
                problems.append(f"{name}.{pname}: requires_grad is {tensor.requires_grad}")
            if tensor.grad is not None:
                problems.append(f"{name}.{pname}: has a .grad")
    return problems


def check_roles_are_data_parallel(state: TrainState) -> None:
    """Refuse, on several ranks, a trained role whose module is not sharded or replicated.

    Without FSDP2 every rank would train its own copy of such a role (no gradient is
    reduced) and the copies would silently diverge.

    Raises:
        ValueError: Naming the role and how to shard or replicate it.
    """
    _, world = rank_and_world()
    if world == 1:
        return
    for name, rs in state.roles.items():
        if rs.role.trainable and not is_sharded(rs.role.module):
            raise ValueError(
                f"role {name!r} is trained on {world} ranks but its module is not sharded: "
                "each rank would train its own copy and the copies would diverge. Shard it "
                "before TrainState.create with fvstep.distributed.shard_module(module, "
                "mesh=make_mesh()), or replicate it (plain data parallel) with "
                "shard_module(module, mesh=make_mesh(replicate=world_size))"
            )


def grad_sync_for(state: TrainState, accumulation: Accumulation) -> FSDPGradSync | None:
    """The gradient-sync controller for ``state``'s roles, or ``None`` if none is sharded.

    Raises:
        ValueError: On several ranks, for a trained role that is not sharded
            (:func:`check_roles_are_data_parallel`).
    """
    check_roles_are_data_parallel(state)
    if not any(is_sharded(rs.role.module) for rs in state.roles.values()):
        return None
    return FSDPGradSync(accumulation)


_KINDS = {
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
}


def _kind(op_name: str) -> str:
    base = op_name.split("::")[-1].strip("_").split(".")[0]
    for key, kind in _KINDS.items():
        if base.startswith(key) or base.startswith(key.replace("_", "")):
            return kind
    return base


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued inside it, by kind, with their bytes.

    The bytes are those of each op's first tensor argument: the gathered output of an
    all-gather, the output shard of a reduce-scatter, the buffer of an all-reduce.

    A ``TorchDispatchMode`` that sees every ``c10d`` op (FSDP2's all-gathers and
    reduce-scatters, the all-reduces of a clip norm); it adds Python overhead to every
    op, so use it for checks and debugging, not in timed runs.

    Examples:
        >>> with CollectiveCounter() as counter:
        ...     state, metrics = step(state, batch)
        >>> counter.counts
        {'all_gather': 12, 'reduce_scatter': 6}
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor decompose the op; its own collectives (a clip norm's all-reduce)
            # then come back here as plain c10d ops.
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = _kind(func.name())
            if not kind.startswith(("wait", "wrap_tensor_autograd")):
                self.counts[kind] += 1
                first = args[0] if args else None
                if isinstance(first, (list, tuple)) and first:
                    first = first[0]
                if isinstance(first, (list, tuple)) and first:
                    first = first[0]
                if isinstance(first, torch.Tensor):
                    self.bytes[kind] += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))

    def metrics(self) -> dict[str, int]:
        """``collectives/<kind>`` counts and ``collectives/<kind>_bytes``."""
        out = {f"collectives/{k}": v for k, v in self.counts.items()}
        out.update({f"collectives/{k}_bytes": v for k, v in self.bytes.items()})
        return out


def _launched(entry: tuple[str, str], args: tuple[Any, ...]) -> Any:
    """The body of each launched rank: a gloo (or NCCL) process group from the env, then ``entry``."""
    import importlib

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    try:
        module, name = entry
        fn = getattr(importlib.import_module(module), name)
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks with torch.distributed's elastic launcher.

    Each rank initialises the default process group (NCCL with GPUs, else gloo) from
    the launcher's environment before calling ``fn``, and destroys it after. ``fn``
    must be a module-level function (ranks import it by name); its results must be
    picklable.

    Returns:
        The results, by rank.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: If a rank failed.

    Examples:
        >>> results = launch(train_and_report, "runs/a", nproc=2)
    """
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, _launched)((fn.__module__, fn.__qualname__), args)
    return [results[r] for r in sorted(results)]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), by rank; ``[obj]`` without a process group."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def init_from_env(*, backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Initialise the default process group from torchrun's environment, if not yet done.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available.
        timeout_s: The collectives' timeout (default: torch's).

    Returns:
        Whether this call created the group (the caller then owns :func:`destroy`).
    """
    if dist.is_initialized():
        return False
    import datetime

    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"), **kwargs)
    return True


def destroy() -> None:
    """Wait for every rank, then destroy the default process group (if there is one)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """A barrier over all ranks; a no-op without a process group."""
    if rank_and_world()[1] > 1:
        dist.barrier()


def max_over_ranks(values: Sequence[float], *, device: torch.device | None = None) -> list[float]:
    """Element-wise maximum of ``values`` over ranks (``values`` itself on one process).

    ``device`` is where the reduction runs (a CUDA device under NCCL).
    """
    if rank_and_world()[1] == 1 or not values:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]
