"""FlashAttention-4 behind PyTorch's flash SDPA backend: opt-in, for the whole process.

This module is also the import path PyTorch's FA4 glue reads, adapting FA4's return
values to what the glue expects. What to know and why: ``docs/concepts/prepare.md``
(FlashAttention-4).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from fvstep.core import _compat
from fvstep.core._optional import needs_extra

__all__ = [
    "disable_flash_attention_4",
    "enable_flash_attention_4",
    "flash_attention_4_enabled",
]

_FLASH_ATTENTION_4 = "fvstep-FA4"  # the name in PyTorch's registry of flash attention impls
_INTERFACE = "flash_attn.cute.interface"  # where flash-attn-4 keeps its kernels


def _interface() -> ModuleType:
    return importlib.import_module(_INTERFACE)


def _unbroadcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with every size-1 dimension's stride 0 replaced: the same memory, a view.

    Inductor sometimes gives a size-1 dimension stride 0, which FA4 refuses ("out must not
    have broadcast dimensions"); PyTorch's glue allocates FA4's output like the query.
    """
    strides = list(tensor.stride())
    for i in reversed(range(tensor.dim())):  # the next dimension's stride is real by then
        if tensor.shape[i] == 1 and strides[i] == 0:
            strides[i] = 1 if i == tensor.dim() - 1 else strides[i + 1] * tensor.shape[i + 1]
    if strides == list(tensor.stride()):
        return tensor
    return tensor.as_strided(tensor.shape, strides)


def _flash_attn_fwd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's forward as PyTorch's glue calls it: ``(out, lse)``, inputs and ``out`` unbroadcast."""
    if kwargs.get("out") is not None:
        kwargs["out"] = _unbroadcast(kwargs["out"])
    query, key, value = (_unbroadcast(t) for t in (query, key, value))
    result = _interface()._flash_attn_fwd(query, key, value, **kwargs)
    return result[0], result[1]


def _flash_attn_bwd(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's backward as PyTorch's glue calls it: ``(dq, dk, dv)``."""
    result = _interface()._flash_attn_bwd(*args, **kwargs)
    return result[0], result[1], result[2]


def enable_flash_attention_4(device: torch.device | int | None = None) -> None:
    """Run PyTorch's flash SDPA backend on FlashAttention-4, in this whole process.

    Idempotent. Roles whose attention backend is ``"_native_flash"`` then run FA4; call
    it before their first step (the order with ``compile`` does not matter).

    Args:
        device: The CUDA device whose compute capability is checked (default: current).

    Raises:
        MissingExtraError: If ``flash_attn.cute.interface`` cannot be imported;
            it names ``pip install 'fvstep[flash4]'``.
        RuntimeError: If there is no CUDA device, if its compute capability is not 9.x
            or 10.x (FA4's kernels are Hopper's and Blackwell's), or if this torch has no
            registry of flash attention implementations.
    """
    with needs_extra("flash4", "enable_flash_attention_4 (FlashAttention-4)"):
        importlib.import_module(_INTERFACE)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "enable_flash_attention_4 needs a CUDA GPU of compute capability 9.x or 10.x; "
            "no CUDA device is available"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        raise RuntimeError(
            f"FlashAttention-4 runs on compute capability 9.x or 10.x, not {major}.{minor} "
            f"({torch.cuda.get_device_name(device)}): keep the default attention backend there"
        )
    if flash_attention_4_enabled():
        return
    registry = _compat.flash_attention_registry()
    registry.register_flash_attention_impl(
        _FLASH_ATTENTION_4,
        register_fn=functools.partial(_compat.register_flash_attention_4, __name__),
    )
    registry.activate_flash_attention_impl(_FLASH_ATTENTION_4)


def flash_attention_4_enabled() -> bool:
    """Whether PyTorch's flash SDPA backend currently runs FlashAttention-4 through fvstep."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current is not None and current() == _FLASH_ATTENTION_4


def disable_flash_attention_4() -> None:
    """Give PyTorch's flash SDPA backend its own kernels back (a no-op if not enabled)."""
    if flash_attention_4_enabled():
        _compat.flash_attention_registry().restore_flash_attention_impl()
