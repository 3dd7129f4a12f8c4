"""What the reference methods check and cast at their boundary: the batch they are given (private).

Each method's loss function starts with one call, ``batch = check_batch(state, batch, role)``,
so that a batch made for another model fails with an error naming the key, the shape it
has and the shape the role's module expects, instead of a raw error deep in a forward
pass. The checks read shapes and dtypes only (metadata: no host synchronisation on GPU
tensors), against the module's diffusers config when it has one (``in_channels``,
``text_dim``, ``patch_size``).

**The cast rule.** ``fvstep data encode`` stores latents and text embeddings in bf16 by
default. A floating batch tensor of *lower* precision than the role's parameters (bf16
latents, an fp32 model) is upcast to the parameters' dtype, unless something already
decides the compute dtype: an active autocast on the tensor's device, or an input cast
on the role's module (``fvstep.parallel.prepare``'s boundary cast of ``param_dtype`` or
``frozen_dtype``, or FSDP2's mixed precision with ``cast_forward_inputs``). A module
sharded without mixed precision computes in its parameters' dtype: its batch is upcast. A tensor is never downcast, and a batch in
the parameters' dtype is returned as it is: a run that worked before computes exactly
what it computed before.

Examples:
    >>> batch = check_batch(state, {"latents": x0.bfloat16(), "text": text}, "student")
    >>> batch["latents"].dtype   # an fp32 student
    torch.float32
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fvstep._compat import forward_pre_hooks, fsdp_casts_inputs
from fvstep.state import TrainState

__all__ = ["check_batch"]


def check_batch(
    state: TrainState,
    batch: Any,
    role: str,
    *,
    video: str = "latents",
    text: str = "text",
    required: Sequence[str] = (),
) -> Any:
    """``batch`` checked against ``role``'s module, its low-precision tensors upcast.

    Args:
        state: The state whose role computes on the batch.
        batch: A mapping with a video-latent tensor ``(B, C, F, H, W)`` under ``video`` and
            text embeddings ``(B, L, D)`` under ``text`` (anything else is returned as is).
        role: The role whose module first sees the batch.
        video: The key of the latents.
        text: The key of the text embeddings.
        required: Further keys the method reads.

    Returns:
        ``batch``, or a copy of it with ``video`` and ``text`` upcast (the module
        docstring's rule).

    Raises:
        KeyError: A key the method reads is missing; the message names it and the keys
            the batch has.
        ValueError: A tensor's rank, channels, text width or spatial size does not fit
            the module; the message names the key, the shape and the expected one.

    Examples:
        >>> batch = check_batch(state, batch, "student")
    """
    if not isinstance(batch, Mapping):
        return batch
    for key in (video, text, *required):
        if key not in batch:
            raise KeyError(
                f"the batch has no {key!r} (it has {sorted(map(str, batch))}); the method "
                f"reads {sorted({video, text, *required})}"
            )
    x, emb = batch[video], batch[text]
    if not isinstance(x, torch.Tensor) or not isinstance(emb, torch.Tensor):
        return batch
    if not isinstance(state, TrainState):  # a duck-typed view of a state: shapes only
        _check_shapes(x, emb, video, text, role, {})
        return batch
    role_state = state.role(role)
    module = role_state.role.module
    _check_shapes(x, emb, video, text, role, _config(module))
    dtype = _param_dtype(role_state.params)
    if dtype is None or _decides_dtype(module, x.device):
        return batch
    cast = {k: _upcast(batch[k], dtype) for k in (video, text)}
    if all(cast[k] is batch[k] for k in cast):
        return batch
    return {**batch, **cast}


def _check_shapes(
    x: torch.Tensor, emb: torch.Tensor, video: str, text: str, role: str, config: Mapping[str, Any]
) -> None:
    if x.dim() != 5:
        raise ValueError(
            f"batch[{video!r}] must be video latents (batch, channels, frames, height, width), "
            f"got shape {tuple(x.shape)}"
        )
    if emb.dim() != 3:
        raise ValueError(
            f"batch[{text!r}] must be text embeddings (batch, tokens, dim), "
            f"got shape {tuple(emb.shape)}"
        )
    if emb.shape[0] != x.shape[0]:
        raise ValueError(
            f"batch[{text!r}] has {emb.shape[0]} samples and batch[{video!r}] {x.shape[0]}: "
            "they must agree"
        )
    channels, text_dim = config.get("in_channels"), config.get("text_dim")
    if isinstance(channels, int) and x.shape[1] != channels:
        raise ValueError(
            f"batch[{video!r}] has {x.shape[1]} channels, shape {tuple(x.shape)}; role "
            f"{role!r}'s module expects in_channels={channels}: (B, {channels}, F, H, W). "
            "Were the latents encoded with another VAE?"
        )
    if isinstance(text_dim, int) and emb.shape[-1] != text_dim:
        raise ValueError(
            f"batch[{text!r}] has width {emb.shape[-1]}, shape {tuple(emb.shape)}; role "
            f"{role!r}'s module expects text_dim={text_dim}: (B, L, {text_dim}). "
            "Were the captions encoded with another text encoder?"
        )
    patch = config.get("patch_size")
    if isinstance(patch, Sequence) and len(patch) == 3:
        sizes = tuple(x.shape[2:])
        if any(int(p) > 0 and s % int(p) for s, p in zip(sizes, patch)):
            raise ValueError(
                f"batch[{video!r}] has (frames, height, width) = {sizes}, which role "
                f"{role!r}'s patch_size {tuple(patch)} does not divide: each must be a "
                "multiple of its patch size"
            )


def _config(module: nn.Module) -> Mapping[str, Any]:
    """The diffusers config of ``module`` (or of the model a wrapper holds), else empty."""
    for candidate in (module, getattr(module, "base", None), getattr(module, "module", None)):
        config = getattr(candidate, "config", None)
        if isinstance(config, Mapping):
            return config
    return {}


def _param_dtype(params: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the first floating parameter: the one the input meets first."""
    return next((p.dtype for p in params.values() if p.is_floating_point()), None)


def _decides_dtype(module: nn.Module, device: torch.device) -> bool:
    """Whether something other than the batch sets the compute dtype: autocast, or an
    input cast on the module (``prepare``'s boundary cast, FSDP2's mixed precision)."""
    if torch.is_autocast_enabled(device.type):
        return True
    held = (module, getattr(module, "base", None))  # a LoRA role computes through its base
    return any(isinstance(m, nn.Module) and _casts_inputs(m) for m in held)


def _casts_inputs(module: nn.Module) -> bool:
    boundary = any(
        "cast_at_boundary" in getattr(h, "__qualname__", "") for h in forward_pre_hooks(module)
    )
    return boundary or fsdp_casts_inputs(module)


def _upcast(value: Any, dtype: torch.dtype) -> Any:
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != dtype
        and torch.finfo(value.dtype).bits < torch.finfo(dtype).bits
    ):
        return value.to(dtype)
    return value
