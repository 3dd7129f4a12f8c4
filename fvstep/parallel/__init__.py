"""The parallel layer: everything of fvstep that knows about ranks, FSDP2 and collectives.

One module a concern, as torchtitan's ``distributed/``. The core imports nothing from
here. The table of modules: ``docs/architecture.md``; the API: ``docs/api/parallel.md``.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from fvstep.core.errors import CompiledGradientError
from fvstep.parallel.activation_checkpoint import ActivationCheckpointing
from fvstep.parallel.activation_offload import ActivationOffloading
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.collectives import CollectiveCounter
from fvstep.parallel.compile_check import (
    CompiledGradientReport,
    compare_compiled_gradients,
    compile_check_reports,
)
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
    release_modules,
    unrested_modules,
)
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
