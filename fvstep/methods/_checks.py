"""What the reference methods check and cast at their boundary (private).

Each loss starts with ``batch = check_batch(state, batch, role)``: a batch made for another
model fails naming the key, its shape and the shape the role's module expects (metadata
only, no host sync), and low-precision tensors are upcast by the rule of
``docs/concepts/data.md`` (Dtypes).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fvstep.core._compat import forward_pre_hooks, fsdp_casts_inputs
from fvstep.core.state import TrainState
from fvstep.methods._causal_attention import is_causal

__all__ = [
    "cast_batch",
    "check_batch",
    "check_bidirectional",
    "check_cache_fits",
    "check_count",
    "check_denoising_steps",
    "check_rollout_options",
    "check_step_index",
    "upcast_for",
]


def check_count(value: object, name: str, minimum: int = 1) -> None:
    """Refuse a ``value`` that is not an int (a bool is not) ``>= minimum``, naming it ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_step_index(index: object, num_steps: int, name: str) -> None:
    """Refuse an ``index`` (named ``name``) that is not an int in ``0 .. num_steps - 1``."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_steps:
        raise ValueError(
            f"{name}={index!r} must index the {num_steps} denoising steps: an int in "
            f"0 .. {num_steps - 1}"
        )


def check_batch(
    state: TrainState,
    batch: Any,
    role: str,
    *,
    video: str = "latents",
    text: str = "text",
    required: Sequence[str] = (),
) -> Any:
    """``batch`` (latents under ``video``, text under ``text``) checked against ``role``'s
    module, and a copy with those two upcast when they are of lower precision."""
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
    _check_shapes(x, emb, video, text, role, _config(state.role(role).role.module))
    return cast_batch(state, batch, role, keys=(video, text))


def cast_batch(
    state: TrainState, batch: Mapping[str, Any], role: str, *, keys: Sequence[str]
) -> Mapping[str, Any]:
    """``batch`` with its floating tensors under ``keys`` upcast for ``role``, shapes unchecked."""
    role_state = state.role(role)
    module = role_state.role.module
    dtype = _param_dtype(role_state.params.values())
    present = [k for k in keys if isinstance(batch.get(k), torch.Tensor)]
    if dtype is None or not present or _decides_dtype(module, batch[present[0]].device):
        return batch
    cast = {k: _upcast(batch[k], dtype) for k in present}
    if all(cast[k] is batch[k] for k in cast):
        return batch
    return {**batch, **cast}


def upcast_for(module: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``value`` upcast for ``module`` (for code that has a module, not a state)."""
    dtype = _param_dtype(module.parameters())
    if dtype is None or _decides_dtype(module, value.device):
        return value
    result: torch.Tensor = _upcast(value, dtype)
    return result


def check_bidirectional(state: Any, roles: Iterable[str], *, method: str) -> None:
    """Refuse a causal module in any of ``roles`` the state has (``state``: anything with ``module``)."""
    for role in roles:
        if isinstance(state, TrainState) and role not in state.roles:
            continue  # a missing role is the engine's error, or the loss's
        if _computes_causally(state.module(role)):
            raise ValueError(
                f"{method} needs a bidirectional {role!r}, and its module is causal (make_causal, or a copy "
                "of the causal student): give it a model never made causal, e.g. a fresh copy of the base"
            )


def _held(module: nn.Module) -> tuple[Any, ...]:
    """``module`` and the model a wrapper (LoRA's ``base``, a ``module`` attribute) holds."""
    return (module, getattr(module, "base", None), getattr(module, "module", None))


def _computes_causally(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Module) and is_causal(m) for m in _held(module))


def check_cache_fits(student: nn.Module, cache: Any, *, what: str = "the cache") -> None:
    """Refuse a KV cache whose layers, heads or head size are not ``student``'s."""
    config = _config(student)
    blocks = getattr(student, "blocks", None)
    expected = (
        len(blocks) if isinstance(blocks, nn.ModuleList) else None,
        config.get("num_attention_heads"),
        config.get("attention_head_dim"),
    )
    keys = cache.keys
    got = (int(keys.shape[1]), int(keys.shape[3]), int(keys.shape[4]))
    for label, want, have in zip(("layers", "heads", "head_dim"), expected, got, strict=True):
        if isinstance(want, int) and want != have:
            raise ValueError(
                f"{what} has {have} {label} and the student {want} (layers, heads, head_dim {got}; the "
                f"student's {expected}): build it with init_cache (or init_stream) from this student"
            )


def check_denoising_steps(denoising_steps: Iterable[float]) -> tuple[float, ...]:
    """The few-step schedule as floats, refused unless strictly decreasing in ``(0, 1]``."""
    steps = tuple(float(s) for s in denoising_steps)
    if not steps or any(not 0.0 < s <= 1.0 for s in steps):
        raise ValueError(f"denoising_steps must be non-empty times in (0, 1], got {steps}")
    if any(a <= b for a, b in itertools.pairwise(steps)):
        raise ValueError(f"denoising_steps must be strictly decreasing, got {steps}")
    return steps


def check_rollout_options(
    denoising_steps: Iterable[float],
    *,
    guidance_scale: float,
    shift: float,
    min_ratio: float,
    max_ratio: float,
    context_time: float = 0.0,
) -> tuple[float, ...]:
    """The checks of the DMD methods' options (DMD2, self-forcing, streaming); the schedule."""
    steps = check_denoising_steps(denoising_steps)
    if not guidance_scale >= 0:
        raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if not 0.0 <= min_ratio <= max_ratio <= 1.0:
        raise ValueError(
            f"need 0 <= min_ratio <= max_ratio <= 1, got min_ratio={min_ratio}, max_ratio={max_ratio}"
        )
    if not 0.0 <= context_time < 1.0:
        raise ValueError(f"context_time must be in [0, 1), got {context_time}")
    return steps


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
            f"batch[{video!r}] has {x.shape[1]} channels, shape {tuple(x.shape)}; role {role!r} expects "
            f"in_channels={channels}: (B, {channels}, F, H, W). Were the latents encoded with another VAE?"
        )
    if isinstance(text_dim, int) and emb.shape[-1] != text_dim:
        raise ValueError(
            f"batch[{text!r}] has width {emb.shape[-1]}, shape {tuple(emb.shape)}; role {role!r} expects "
            f"text_dim={text_dim}: (B, L, {text_dim}). Were the captions encoded with another text encoder?"
        )
    patch = config.get("patch_size")
    if isinstance(patch, Sequence) and len(patch) == 3:
        sizes = tuple(x.shape[2:])
        if any(int(p) > 0 and s % int(p) for s, p in zip(sizes, patch)):
            raise ValueError(
                f"batch[{video!r}] has (frames, height, width) = {sizes}, which role {role!r}'s "
                f"patch_size {tuple(patch)} does not divide: make each a multiple of its patch size"
            )


def _config(module: nn.Module) -> Mapping[str, Any]:
    """The diffusers config of ``module`` (or of the model a wrapper holds), else empty."""
    for candidate in _held(module):
        config = getattr(candidate, "config", None)
        if isinstance(config, Mapping):
            return config
    return {}


def _param_dtype(params: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The dtype of the first floating parameter: the one the input meets first."""
    return next((p.dtype for p in params if p.is_floating_point()), None)


def _decides_dtype(module: nn.Module, device: torch.device) -> bool:
    """Whether autocast or an input cast on the module (``prepare``'s, FSDP2's) sets the dtype."""
    if torch.is_autocast_enabled(device.type):
        return True
    held = (module, getattr(module, "base", None))  # a LoRA role computes through its base
    return any(isinstance(m, nn.Module) and _casts_inputs(m) for m in held)


def _casts_inputs(module: nn.Module) -> bool:
    boundary = any(
        name in getattr(h, "__qualname__", "")
        for h in forward_pre_hooks(module)
        for name in ("cast_at_boundary", "autocast_forward")
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
