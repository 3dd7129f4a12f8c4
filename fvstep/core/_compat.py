"""Every private PyTorch API that fvstep relies on, in one place (private module).

A torch release that moves one breaks this module and ``tests/test_compat.py``, not a
user's run. Names under ``torch.distributed`` resolve lazily, inside the function, so the
core imports nothing of ``torch.distributed`` itself.
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
    """Device types with fused optimizer kernels (``_get_fused_kernels_supported_devices``)."""
    return list(_get_fused_kernels_supported_devices())


def optimizer_step_dtype(*, fused: bool = False) -> torch.dtype:
    """The dtype of ``torch.optim.AdamW``'s per-parameter ``step`` (``_get_scalar_dtype``)."""
    return _get_scalar_dtype(is_fused=True) if fused else _get_scalar_dtype()


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor._version``: bumped by every in-place operation on it."""
    return int(tensor._version)


def world_size_of_default_group() -> int:
    """The default process group's world size (1 without one); public, but ``torch.distributed``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


def is_fsdp_root(module: nn.Module) -> bool:
    """``module._get_fsdp_state()._is_root`` (false before the first forward)."""
    state: Any = module._get_fsdp_state()  # type: ignore[operator]
    return bool(state._is_root)


def fsdp_casts_inputs(module: nn.Module) -> bool:
    """Whether FSDP2's ``_mp_policy`` casts ``module``'s floating inputs (false if not FSDP2)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return False
    policy = getattr(get_state(), "_mp_policy", None)
    return bool(policy is not None and policy.param_dtype and policy.cast_forward_inputs)


def forward_pre_hooks(module: nn.Module) -> list[Any]:
    """The forward pre-hooks registered on ``module`` (``module._forward_pre_hooks``)."""
    return list(module._forward_pre_hooks.values())


def fsdp_lazy_init(module: nn.Module) -> None:
    """``module._get_fsdp_state()._lazy_init()`` now (idempotent), as FSDP2's first forward
    (it fixes each group's gradient dtypes from the parameters that require grad then)."""
    state: Any = module._get_fsdp_state()  # type: ignore[operator]
    state._lazy_init()


def local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and global offset (``compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        torch.Size(global_shape), mesh, placements
    )
    return tuple(shape), tuple(offset)


def checkpoint_wrapper(module: nn.Module, **checkpoint_kwargs: Any) -> nn.Module:
    """``module`` under torch's private non-reentrant ``checkpoint_wrapper``, as torchtitan does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, **checkpoint_kwargs)


def inductor_has_option(option: str) -> bool:
    """Whether ``torch._inductor.config`` has the dotted ``option`` (they come and go)."""
    import torch._inductor.config as inductor

    node: Any = inductor
    for part in option.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The Inductor options a ``torch.compile`` ``mode`` stands for (``list_mode_options``)."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A snapshot of dynamo's process-wide counters (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}


def flash_attention_registry() -> Any:
    """``torch.nn.attention``, checked to hold the registry of flash attention impls (2.11 on)."""
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
    """Override flash SDPA's CUDA kernels with FA4's from ``module_path`` (``_fa4``); the handle."""
    from torch.nn.attention import _fa4

    return _fa4.register_flash_attention_fa4(module_path)


def raise_recompile_limit(limit: int) -> int:
    """Raise dynamo's process-wide ``recompile_limit`` to at least ``limit`` (never lower it)."""
    import torch._dynamo.config as config

    config.recompile_limit = max(config.recompile_limit, limit)
    return config.recompile_limit


def activation_memory_budget(budget: float) -> Any:
    """A context setting ``torch._functorch.config.activation_memory_budget`` (0 to 1)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)
