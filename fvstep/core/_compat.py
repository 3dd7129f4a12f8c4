"""Every private PyTorch API that fvstep relies on, in one place (private module).

Each is reached here and nowhere else, so a torch release that moves one breaks this
module and its test (``tests/test_compat.py``), not a user's run. Names under
``torch.distributed`` resolve lazily, inside the function: the core imports this module and
nothing of ``torch.distributed`` itself. Not here: the public ``torch.optim.adamw.adamw``
and ``sgd.sgd``, the documented ``torch._foreach_*``, and ``nn.Module``'s
``_parameters``/``_buffers`` dicts (how ``torch.nn.utils`` rebinds tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import _get_scalar_dtype
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "TorchDispatchMode",
    "checkpoint_wrapper",
    "dynamo_counters",
    "flash_attention_registry",
    "forward_pre_hooks",
    "fsdp_casts_inputs",
    "fsdp_lazy_init",
    "fused_kernel_devices",
    "inductor_has_option",
    "inductor_mode_options",
    "is_fsdp_root",
    "local_shape_and_global_offset",
    "optimizer_step_dtype",
    "raise_recompile_limit",
    "register_flash_attention_4",
    "tensor_version",
    "world_size_of_default_group",
]


def fused_kernel_devices() -> list[str]:
    """The device types that have ``fused=True`` optimizer kernels (``cuda``, ``cpu``, ...).

    ``torch.utils._foreach_utils._get_fused_kernels_supported_devices``: the list
    ``torch.optim`` checks ``fused=True`` against.
    """
    return list(_get_fused_kernels_supported_devices())


def optimizer_step_dtype(*, fused: bool = False) -> torch.dtype:
    """The dtype of the per-parameter ``step`` tensor that ``torch.optim.AdamW`` creates.

    ``torch.optim.optimizer._get_scalar_dtype``: float32 (float64 if that is the default
    dtype) for the single-tensor and foreach kernels, float32 for the fused one.
    """
    return _get_scalar_dtype(is_fused=True) if fused else _get_scalar_dtype()


def tensor_version(tensor: torch.Tensor) -> int:
    """The version counter of ``tensor``: bumped by every in-place operation on it.

    ``Tensor._version``, the counter autograd uses to detect in-place changes.
    """
    return int(tensor._version)


def world_size_of_default_group() -> int:
    """The world size of ``torch.distributed``'s default process group (1 without one).

    Public torch, here because the core reaches ``torch.distributed`` only through here.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


def is_fsdp_root(module: nn.Module) -> bool:
    """Whether the FSDP2 module ``module`` is the root of its FSDP2 tree (after lazy init).

    ``module._get_fsdp_state()._is_root`` (``None``, i.e. false, before the first forward).
    """
    state: Any = module._get_fsdp_state()  # type: ignore[operator]
    return bool(state._is_root)


def fsdp_casts_inputs(module: nn.Module) -> bool:
    """Whether FSDP2 casts ``module``'s floating inputs itself (a ``MixedPrecisionPolicy``
    with ``param_dtype`` and ``cast_forward_inputs``); false for a module FSDP2 did not wrap.

    ``module._get_fsdp_state()._mp_policy``, what FSDP2's pre-forward reads.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return False
    policy = getattr(get_state(), "_mp_policy", None)
    return bool(policy is not None and policy.param_dtype and policy.cast_forward_inputs)


def forward_pre_hooks(module: nn.Module) -> list[Any]:
    """The forward pre-hooks registered on ``module`` (``module._forward_pre_hooks``)."""
    return list(module._forward_pre_hooks.values())


def fsdp_lazy_init(module: nn.Module) -> None:
    """Run FSDP2's lazy initialisation of the tree rooted at ``module`` now (idempotent).

    ``module._get_fsdp_state()._lazy_init()``, what FSDP2's first forward does. It fixes
    each group's gradient dtypes (``FSDPParamGroup._init_mp_dtypes``) from the parameters
    that have ``requires_grad`` on at that moment.
    """
    state: Any = module._get_fsdp_state()  # type: ignore[operator]
    state._lazy_init()


def local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's shard of a DTensor and its offset in the global tensor.

    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        torch.Size(global_shape), mesh, placements
    )
    return tuple(shape), tuple(offset)


def checkpoint_wrapper(module: nn.Module, **checkpoint_kwargs: Any) -> nn.Module:
    """``module`` wrapped for (non-reentrant) activation checkpointing, as torchtitan does.

    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper``;
    ``checkpoint_kwargs`` go to ``torch.utils.checkpoint.checkpoint`` (``use_reentrant``
    is fixed to ``False`` by the wrapper's default implementation).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, **checkpoint_kwargs)


def inductor_has_option(option: str) -> bool:
    """Whether Inductor's config has ``option`` (a dotted name, e.g. ``"triton.x"``).

    ``torch._inductor.config``: options come and go between minor releases.
    """
    import torch._inductor.config as inductor

    node: Any = inductor
    for part in option.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The Inductor options a ``torch.compile`` ``mode`` stands for.

    ``torch._inductor.list_mode_options(mode)``.
    """
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A snapshot of dynamo's process-wide counters (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}


def flash_attention_registry() -> Any:
    """``torch.nn.attention``, checked to hold PyTorch's registry of flash attention impls.

    ``register_flash_attention_impl``, ``activate_flash_attention_impl`` and
    ``restore_flash_attention_impl`` are public in ``torch.nn.attention`` (torch 2.11 on);
    a torch without them cannot swap the flash backend's kernels.
    """
    import torch.nn.attention as attention

    names = (
        "register_flash_attention_impl",
        "activate_flash_attention_impl",
        "restore_flash_attention_impl",
    )
    missing = [name for name in names if not hasattr(attention, name)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no registry of flash attention implementations "
            f"(torch.nn.attention lacks {', '.join(missing)}): FlashAttention-4 needs torch >= 2.11"
        )
    return attention


def register_flash_attention_4(module_path: str) -> Any:
    """Override the flash SDPA backend's CUDA kernels with FA4's, imported from ``module_path``.

    ``torch.nn.attention._fa4.register_flash_attention_fa4``: PyTorch's glue from the ATen
    flash attention ops to a module exposing ``_flash_attn_fwd`` and ``_flash_attn_bwd``;
    it returns the handle that keeps the override alive.
    """
    from torch.nn.attention import _fa4

    return _fa4.register_flash_attention_fa4(module_path)


def raise_recompile_limit(limit: int) -> int:
    """Raise dynamo's per-code-object recompile limit to at least ``limit``; the new value.

    ``torch._dynamo.config.recompile_limit`` (default 8) caps the graphs one code object
    may have; past it a ``fullgraph=True`` compile fails (``FailOnRecompileLimitHit``).
    It is a process-wide setting: it is only ever raised here, never lowered.
    """
    import torch._dynamo.config as config

    config.recompile_limit = max(config.recompile_limit, limit)
    return config.recompile_limit


def activation_memory_budget(budget: float) -> Any:
    """A context in which graphs compiled use ``budget`` as the min-cut partitioner's
    activation memory budget (``torch._functorch.config.activation_memory_budget``, 0 to
    1; 1.0, torch's default, saves all it can). A process-wide setting, put back on exit;
    it applies to the graphs compiled inside (a block compiles at its first call)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)
