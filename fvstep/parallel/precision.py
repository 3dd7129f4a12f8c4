"""Precision at a role's boundary: frozen roles stored in bf16, activations cast in and out.

What :func:`fvstep.parallel.prepare` does for a role computing in another dtype than its callers.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

__all__ = [
    "FULL_PRECISION_INPUTS",
    "autocast_forward",
    "cast_at_boundary",
    "resolve_full_precision_inputs",
    "store_in_dtype",
]

FULL_PRECISION_INPUTS: tuple[str, ...] = ("timestep", "timesteps", "t", "sigma", "sigmas")
"""The forward arguments a boundary cast of :func:`fvstep.parallel.prepare` leaves in full precision.

Diffusion timesteps (and noise levels) by name, whatever their shape: a per-token
timestep ``(B, S)`` (Wan2.2 TI2V) looks like an activation but rounds to a multiple of 4
near 1000 in bf16. Pass ``prepare(..., full_precision_inputs=...)`` to extend it."""


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor in its tuples, lists and dicts (types kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [map_tensors(fn, v) for v in value]
        if hasattr(value, "_fields"):  # a namedtuple takes its fields as arguments
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = map_tensors(fn, v)
        return out
    return value


def _cast_tree(value: Any, dtype: torch.dtype, *, min_ndim: int = 0) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.ndim >= min_ndim and t.dtype != dtype:
            return t.to(dtype)
        return t

    return map_tensors(cast, value)


def positional_names(forward: Callable[..., Any] | inspect.Signature) -> tuple[str, ...]:
    """The names of a callable's (or a signature's) positional parameters; ``()`` if unknown."""
    try:
        signature = (
            forward if isinstance(forward, inspect.Signature) else inspect.signature(forward)
        )
    except (TypeError, ValueError):  # a builtin or an odd callable
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in signature.parameters.values() if p.kind in kinds)


def resolve_full_precision_inputs(names: Collection[str]) -> frozenset[str]:
    """The argument names a boundary cast leaves alone, as a set; ``TypeError`` on a string."""
    if isinstance(names, str):
        raise TypeError(
            f"full_precision_inputs must be a collection of argument names, got the string {names!r}; "
            f"write ({names!r},)"
        )
    return frozenset(names)


def cast_at_boundary(
    module: nn.Module,
    dtype: torch.dtype,
    *,
    full_precision_inputs: Collection[str] = FULL_PRECISION_INPUTS,
) -> None:
    """Hook ``module`` to cast floating inputs of 2-D and more to ``dtype``, outputs back.

    The ``full_precision_inputs`` (by argument name: the timesteps) are never cast."""
    keep = resolve_full_precision_inputs(full_precision_inputs)
    # A delegating ``forward(*args, **kwargs)`` (LoRAModule) names its inputs by ``forward_signature``.
    signature = getattr(module, "forward_signature", None)
    positional = positional_names(
        signature if isinstance(signature, inspect.Signature) else module.forward
    )
    callers: list[torch.dtype | None] = []

    def cast(name: str | None, value: Any) -> Any:
        return value if name in keep else _cast_tree(value, dtype, min_ndim=2)

    def cast_in(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = [positional[i] if i < len(positional) else None for i in range(len(args))]
        cast_ones = [v for n, v in [*zip(names, args), *kwargs.items()] if n not in keep]
        floating = [v for v in cast_ones if isinstance(v, torch.Tensor) and v.is_floating_point()]
        callers.append(next((v.dtype for v in floating if v.ndim >= 2), None))
        return (
            tuple(cast(n, v) for n, v in zip(names, args)),
            {k: cast(k, v) for k, v in kwargs.items()},
        )

    def cast_out(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        caller = callers.pop()  # also after an error (always_call): the stack stays balanced
        return output if caller is None or output is None else _cast_tree(output, caller)

    module.register_forward_pre_hook(cast_in, with_kwargs=True, prepend=True)
    module.register_forward_hook(cast_out, with_kwargs=True, always_call=True)


def autocast_forward(module: nn.Module, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under ``torch.autocast(dtype)`` on its parameters' device.

    ``ValueError`` unless ``dtype`` is bfloat16 or float16."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast computes in bfloat16 or float16, not {dtype}")
    entered: list[Any] = []

    def enter(mod: nn.Module, args: tuple[Any, ...]) -> None:
        device = next((t.device for t in mod.parameters()), torch.device("cpu"))
        context = torch.autocast(device.type, dtype=dtype)
        context.__enter__()
        entered.append(context)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        entered.pop().__exit__(None, None, None)  # also after an error (always_call)

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)


def _kept_in_fp32(module: nn.Module) -> set[str]:
    """The qualified names of the tensors diffusers keeps in fp32 in ``module``."""
    kept: set[str] = set()
    for prefix, sub in module.named_modules():
        keep = tuple(getattr(sub, "_keep_in_fp32_modules", None) or ())
        if not keep:
            continue
        for name, tensor in [*sub.named_parameters(), *sub.named_buffers()]:
            if tensor.is_floating_point() and any(k in name.split(".") for k in keep):
                kept.add(f"{prefix}.{name}" if prefix else name)
    return kept


def store_in_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Store ``module``'s floating parameters and buffers in ``dtype``, in place (``.data``).

    Those diffusers keeps in fp32 (``_keep_in_fp32_modules``) stay as they are."""
    kept = _kept_in_fp32(module)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and name not in kept:
            tensor.data = tensor.data.to(dtype)
