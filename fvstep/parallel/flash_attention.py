"""FlashAttention-4 behind PyTorch's flash SDPA backend: opt-in, for the whole process.

On Hopper, the CuTe kernels of the ``flash-attn-4`` package are faster than cuDNN's at a
video model's sequence lengths. On one H200 at Wan's 480×832×81 shape (12 heads of 128,
32,760 tokens, bf16), self-attention ran at 718 TFLOP/s forward and 627 forward +
backward, against cuDNN's 555 and 528 (``docs/benchmarks.md``).

:func:`enable_flash_attention_4` hands them to PyTorch's own registry of flash attention
implementations (``torch.nn.attention.register_flash_attention_impl`` and
``activate_flash_attention_impl``). From then on, in this process, every
``scaled_dot_product_attention`` that runs on the flash backend runs FA4, eager or
compiled: Inductor calls the ATen flash attention op, and the registry overrides that
op's CUDA kernel. A role takes the flash backend with
``prepare(..., attention_backend="_native_flash")``. Roles on another backend keep
their kernels, with one exception seen on the H200: blocks compiled with torch's defaults
on SDPA's default backend (diffusers' ``"native"``) reached the flash backend, and so
FA4 (the benchmark's by-hand side). Eager calls on the default backend picked cuDNN's
kernel in every layout tried. The state is PyTorch's registry's and process-wide, by
PyTorch's design. fvstep holds none of it, and
:func:`disable_flash_attention_4` restores PyTorch's own kernels.

What to know (found in review, ``docs/concepts/prepare.md``):

- Inductor's default (Python) wrapper calls the flash op through the dispatcher, so
  enabling before or after ``compile`` works alike. With Inductor's ``cpp_wrapper`` or
  AOTInductor the op is called past the dispatcher and runs PyTorch's own kernel; CUDA
  graphs (``mode="reduce-overhead"``) replay the kernel they captured.
- The tensors must be on the current CUDA device (``torch.cuda.set_device``, as fvstep's
  launcher does): FA4 launches on the current device's stream.
- Under ``torch.use_deterministic_algorithms(True)`` the glue asks FA4 for its
  deterministic backward, which 4.0.0b36 has on Hopper.
- The choice is not part of a ``TrainState``: a resumed run must enable it again (the
  recipes' ``prepare.flash_attention_4`` does, from the run's ``config.yaml``).
  ``preparation(module).describe()["flash_attention_4"]`` says what is on.

Why this module sits in between: PyTorch's FA4 glue (``torch.nn.attention._fa4``, torch
2.11 to 2.13) unpacks two values from FA4's ``_flash_attn_fwd``, which returns five in
the releases on PyPI (4.0.0b36), so PyTorch's own ``activate_flash_attention_impl("FA4")``
fails at its first call. The glue imports the kernels from a module path. This module
is that path: :func:`_flash_attn_fwd` and :func:`_flash_attn_bwd` return what the glue
expects, and the glue does the rest (layouts, the log-sum-exp, the checks).

Examples:
    >>> from fvstep.parallel import enable_flash_attention_4, prepare
    >>> enable_flash_attention_4()  # needs flash-attn-4 and a compute capability 9.x/10.x GPU
    >>> student = prepare(student, attention_backend="_native_flash", compile=True)
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
    "FLASH_ATTENTION_4",
    "disable_flash_attention_4",
    "enable_flash_attention_4",
    "flash_attention_4_enabled",
]

FLASH_ATTENTION_4 = "fvstep-FA4"  # the name in PyTorch's registry of flash attention impls
_INTERFACE = "flash_attn.cute.interface"  # where flash-attn-4 keeps its kernels


def _interface() -> ModuleType:
    return importlib.import_module(_INTERFACE)


def _unbroadcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with every size-1 dimension's stride 0 replaced: the same memory, a view.

    A size-1 dimension's stride addresses nothing, and Inductor's outputs sometimes give it
    0. PyTorch's glue allocates FA4's output like the query, and FA4 asserts that the
    output has no zero stride ("out must not have broadcast dimensions").
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
    """FA4's forward as PyTorch's glue calls it: ``(out, lse)`` of FA4's longer tuple.

    The output buffer the glue passes (``out``) and the inputs lose the zero strides of
    their size-1 dimensions first (:func:`_unbroadcast`); FA4 writes into the same memory.
    """
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

    Idempotent. Roles whose attention backend is ``"_native_flash"`` (``prepare``'s
    ``attention_backend``) then run FA4. Call it before their first step; compiled
    blocks call the overridden op at run time, so the order with ``compile`` does not
    matter.

    Args:
        device: The CUDA device whose compute capability is checked (default: the
            current one).

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
            f"FlashAttention-4 runs on compute capability 9.x (Hopper) or 10.x (Blackwell), "
            f"not {major}.{minor} ({torch.cuda.get_device_name(device)}): keep the default "
            "attention backend there"
        )
    if flash_attention_4_enabled():
        return
    registry = _compat.flash_attention_registry()
    registry.register_flash_attention_impl(
        FLASH_ATTENTION_4,
        register_fn=functools.partial(_compat.register_flash_attention_4, __name__),
    )
    registry.activate_flash_attention_impl(FLASH_ATTENTION_4)


def flash_attention_4_enabled() -> bool:
    """Whether PyTorch's flash SDPA backend currently runs FlashAttention-4 through fvstep."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current is not None and current() == FLASH_ATTENTION_4


def disable_flash_attention_4() -> None:
    """Give PyTorch's flash SDPA backend its own kernels back (a no-op if not enabled)."""
    if flash_attention_4_enabled():
        _compat.flash_attention_registry().restore_flash_attention_impl()
