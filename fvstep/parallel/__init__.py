"""The parallel layer: everything of fvstep that knows about ranks, FSDP2 and collectives.

Split by concern (as torchtitan's ``distributed/`` folder):

- :mod:`fvstep.parallel.mesh`: device meshes and FSDP2 sharding of a role's module
  (:func:`make_mesh`, :func:`shard_module`, :func:`is_block`, :func:`is_sharded`);
- :mod:`fvstep.parallel.layout`: :class:`Layout`, the process layout a step is called
  with on several ranks (``step(state, batch, parallelism=Layout())``): data-parallel
  replicas, context-parallel groups and FSDP2's handling, behind the core's
  :class:`~fvstep.core.layout.Parallelism`; :func:`default_layout`, what ``fvstep.run``
  picks;
- :mod:`fvstep.parallel.grad_sync`: the FSDP2 gradient-sync policy of accumulation and
  modules returned to rest (:class:`FSDPGradSync`, :func:`release_modules`,
  :func:`unrested_modules`, :func:`check_roles_are_data_parallel`,
  :func:`grad_sync_for`);
- :mod:`fvstep.parallel.prepare`: one call that prepares a role's module for real scale
  (:func:`prepare`: activation checkpointing, ``torch.compile`` per block, FSDP2/HSDP
  with mixed precision and offload, frozen roles in bf16, the attention backend), built
  from one module per step:
  :mod:`fvstep.parallel.activation_checkpoint` (:class:`ActivationCheckpointing`),
  :mod:`fvstep.parallel.activation_offload` (:class:`ActivationOffloading`: saved
  activations in pinned host memory),
  :mod:`fvstep.parallel.block_compile` (compile options, the recompile limit,
  :func:`compile_counts`) and :mod:`fvstep.parallel.precision` (casts at a role's
  boundary, :data:`FULL_PRECISION_INPUTS`);
- :mod:`fvstep.parallel.flash_attention`: FlashAttention-4 as the kernel of PyTorch's
  flash SDPA backend, process-wide and opt-in (:func:`enable_flash_attention_4`,
  :func:`disable_flash_attention_4`, :func:`flash_attention_4_enabled`); a role takes it
  with ``prepare(..., attention_backend="_native_flash")``;
- :mod:`fvstep.parallel.compile_check`: compiled gradients checked against eager ones,
  block by block, before training on them (``prepare(..., verify_compile=True)``): the
  verdict (:class:`CompiledGradientError`, :class:`CompiledGradientReport`, the
  tolerances), the comparison of one block
  (:mod:`fvstep.parallel.gradient_comparison`: :func:`compare_compiled_gradients`) and
  the checks installed on compiled blocks (:mod:`fvstep.parallel.compile_check_hooks`:
  :func:`compile_check_reports`);
- :mod:`fvstep.parallel.context`: context (sequence) parallelism with diffusers' Ulysses
  attention (:func:`make_context_mesh`, :func:`apply_context_parallel`,
  :func:`data_parallel_rank_and_size`, :func:`applied_context_group`);
- :mod:`fvstep.parallel.collectives`: :class:`CollectiveCounter`;
- :mod:`fvstep.parallel.launcher`: :func:`launch`, :func:`init_from_env`, :func:`destroy`;
- :mod:`fvstep.parallel.ranks`: the rank helpers every other module uses
  (:func:`rank_and_world`, :func:`barrier`, :func:`gather_objects`,
  :func:`broadcast_object`, :func:`max_over_ranks`, :func:`min_over_ranks`,
  :func:`collective_device`).

The core (``fvstep/core``, ``tree``, ``random``, ``state``, ``optim``, ...) imports
nothing from here: a call is given its :class:`Layout`. The executor and
``fvstep.checkpoint`` use the rank helpers instead of calling ``torch.distributed``
themselves.

Examples:
    >>> from fvstep import parallel
    >>> mesh = parallel.make_mesh()
    >>> student = parallel.shard_module(student, mesh=mesh)
    >>> critic = parallel.prepare(critic, mesh=mesh, checkpointing="selective", compile=True)
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from fvstep.core.errors import CompiledGradientError
from fvstep.parallel.activation_checkpoint import ActivationCheckpointing
from fvstep.parallel.activation_offload import ActivationOffloading
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.collectives import CollectiveCounter
from fvstep.parallel.compile_check import CompiledGradientReport
from fvstep.parallel.compile_check_hooks import compile_check_reports
from fvstep.parallel.context import (
    ContextParallelMode,
    applied_context_group,
    apply_context_parallel,
    context_parallel_degree,
)
from fvstep.parallel.flash_attention import (
    disable_flash_attention_4,
    enable_flash_attention_4,
    flash_attention_4_enabled,
)
from fvstep.parallel.grad_sync import (
    FSDPGradSync,
    check_roles_are_data_parallel,
    grad_sync_for,
    release_modules,
    unrested_modules,
)
from fvstep.parallel.gradient_comparison import compare_compiled_gradients
from fvstep.parallel.launcher import destroy, init_from_env, launch
from fvstep.parallel.layout import Layout, default_layout
from fvstep.parallel.mesh import (
    BlockFilter,
    data_parallel_rank_and_size,
    is_block,
    is_sharded,
    make_context_mesh,
    make_mesh,
    shard_module,
)
from fvstep.parallel.precision import FULL_PRECISION_INPUTS
from fvstep.parallel.prepare import Preparation, preparation, prepare
from fvstep.parallel.ranks import (
    barrier,
    broadcast_object,
    collective_device,
    gather_objects,
    max_over_ranks,
    min_over_ranks,
    rank_and_world,
)

__all__ = [
    "FULL_PRECISION_INPUTS",
    "ActivationCheckpointing",
    "ActivationOffloading",
    "BlockFilter",
    "CollectiveCounter",
    "CompiledGradientError",
    "CompiledGradientReport",
    "ContextParallelMode",
    "FSDPGradSync",
    "Layout",
    "MixedPrecisionPolicy",
    "Preparation",
    "applied_context_group",
    "apply_context_parallel",
    "barrier",
    "broadcast_object",
    "check_roles_are_data_parallel",
    "collective_device",
    "compare_compiled_gradients",
    "compile_check_reports",
    "compile_counts",
    "context_parallel_degree",
    "data_parallel_rank_and_size",
    "default_layout",
    "destroy",
    "disable_flash_attention_4",
    "enable_flash_attention_4",
    "flash_attention_4_enabled",
    "gather_objects",
    "grad_sync_for",
    "init_from_env",
    "is_block",
    "is_sharded",
    "launch",
    "make_context_mesh",
    "make_mesh",
    "max_over_ranks",
    "min_over_ranks",
    "preparation",
    "prepare",
    "rank_and_world",
    "release_modules",
    "shard_module",
    "unrested_modules",
]
