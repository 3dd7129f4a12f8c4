"""A causal Wan: block-causal self-attention over chunks of latent frames, with a KV cache.

:func:`make_causal` makes a diffusers Wan frame-causal in place, before
:func:`fvstep.parallel.prepare`; a plain call is teacher forcing, and
:func:`causal_forward` with a :class:`KVCache` (a value of fixed capacity) runs the
frames after the cached ones. The design: ``docs/methods/causal_wan.md``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fvstep.core._optional import needs_extra
from fvstep.core.tree import field, frozen
from fvstep.methods._causal_attention import (
    CAUSAL_ATTR,
    Call,
    CausalWanAttnProcessor,
    call_context,
    is_causal,
    rope_check,
    rope_hook,
)
from fvstep.methods._checks import check_count

__all__ = [
    "CAUSAL_CONFIG_KEY",
    "CausalWanAttnProcessor",
    "KVCache",
    "causal_forward",
    "chunk_frames_of",
    "init_cache",
    "is_causal",
    "load_causal",
    "make_causal",
    "recorded_chunk_frames",
]

CAUSAL_CONFIG_KEY = "_fvstep_causal"
"""Where :func:`make_causal` records ``{"chunk_frames": n}`` in the config (``docs/methods/causal_wan.md``)."""


@frozen
class KVCache:
    """Self-attention keys and values of the frames seen so far, per layer (a pytree).

    Attributes:
        keys: ``(B, layers, capacity_frames * frame_tokens, heads, head_dim)`` (a longer
            buffer with ``slots``), before the rotary embedding; slots past ``num_frames``
            are masked. ``values`` likewise.
        num_frames: 0-d int64 tensor: the frames held (a prefix of the slots).
        sink_frames: Frames kept forever at the start when the cache is full (static).
        slots: ``None``, or (a rollout's context in a longer buffer) each slot's token in it.
    """

    keys: torch.Tensor
    values: torch.Tensor
    num_frames: torch.Tensor
    frame_tokens: int = field(pytree_node=False)
    sink_frames: int = field(pytree_node=False, default=0)
    slots: torch.Tensor | None = None

    @property
    def capacity_frames(self) -> int:
        """The frames the cache holds at most."""
        tokens = self.keys.shape[2] if self.slots is None else self.slots.shape[0]
        return int(tokens) // self.frame_tokens


def chunk_frames_of(model: nn.Module) -> int:
    """The chunk size (latent frames) of a causal model.

    Raises:
        ValueError: If ``model`` is not causal.
    """
    rope = getattr(model, "rope", None)
    chunk = getattr(rope, CAUSAL_ATTR, None)
    if chunk is None:
        recorded = recorded_chunk_frames(model)
        if recorded is not None:
            raise ValueError(
                f"{type(model).__name__} was exported causal (chunk_frames={recorded}) but "
                "loaded bidirectional (a plain from_pretrained): use causal_wan.load_causal"
            )
        raise ValueError(
            f"{type(model).__name__} is not a causal Wan: build it with "
            "fvstep.methods.causal_wan.make_causal(model)"
        )
    return int(chunk)


def recorded_chunk_frames(model_or_config: Any) -> int | None:
    """The chunk a module's config (or a config mapping) records, if any; ``ValueError`` if
    the record is not ``{"chunk_frames": n}``, ``n`` an int ``>= 1``."""
    config = getattr(model_or_config, "config", model_or_config)
    record: Any = config.get(CAUSAL_CONFIG_KEY) if hasattr(config, "get") else None
    chunk = record.get("chunk_frames") if hasattr(record, "get") else record
    if record is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{CAUSAL_CONFIG_KEY!r} must be {{'chunk_frames': n}}, got {record!r}")
    return chunk


def make_causal(model: nn.Module, *, chunk_frames: int | None = None) -> nn.Module:
    """Make a diffusers ``WanTransformer3DModel`` block-causal over chunks of latent frames.

    In place; the parameters and their names do not change, and the config records it
    (:data:`CAUSAL_CONFIG_KEY`), so :func:`load_causal` restores it from an export.

    Args:
        model: A ``WanTransformer3DModel`` (temporal patch size 1), not yet prepared.
        chunk_frames: Latent frames a chunk. Default: the chunk the model's config
            records, else 3 (Self-Forcing's Wan2.1).

    Returns:
        The same model.

    Raises:
        ValueError: If ``chunk_frames < 1``, the model is not a Wan transformer, has a
            temporal patch size other than 1, is causal, prepared, sharded or
            context-parallel already, or records another ``chunk_frames``.
    """
    with needs_extra("models", "make_causal"):
        from diffusers import WanTransformer3DModel

    wan: Any = model
    if not isinstance(model, WanTransformer3DModel):
        raise ValueError(
            f"make_causal takes a diffusers WanTransformer3DModel, got {type(model).__name__}"
        )
    recorded = recorded_chunk_frames(model)
    if chunk_frames is None:
        chunk_frames = 3 if recorded is None else recorded
    check_count(chunk_frames, "chunk_frames")
    if recorded is not None and recorded != chunk_frames:
        raise ValueError(
            f"the model's config records a causal model of chunk_frames={recorded} (an "
            f"export), not {chunk_frames}: leave chunk_frames unset to restore it"
        )
    if wan.config.patch_size[0] != 1:
        raise ValueError(
            f"make_causal needs a temporal patch size of 1, got {tuple(wan.config.patch_size)}"
        )
    if hasattr(wan.rope, CAUSAL_ATTR):
        raise ValueError("the model is causal already (make_causal was called on it)")
    if getattr(model, "_fvstep_preparation", None) is not None or any(
        hasattr(m, "_fsdp_state") or type(m).__name__.startswith("FSDP") for m in model.modules()
    ):
        raise ValueError("make_causal comes before fvstep.parallel.prepare and fully_shard")
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(
            "the model is context-parallel: the causal Wan does not support context parallel"
        )
    processors = dict(wan.attn_processors)
    for i in range(len(wan.blocks)):
        processors[f"blocks.{i}.attn1.processor"] = CausalWanAttnProcessor(i)
    wan.set_attn_processor(processors)
    object.__setattr__(wan.rope, CAUSAL_ATTR, chunk_frames)
    wan.rope.register_forward_pre_hook(rope_check)
    wan.rope.register_forward_hook(rope_hook)
    wan.register_to_config(**{CAUSAL_CONFIG_KEY: {"chunk_frames": chunk_frames}})
    return model


def load_causal(
    path: str | os.PathLike[str], *, chunk_frames: int | None = None, **kwargs: Any
) -> nn.Module:
    """A causal Wan from a diffusers folder: ``from_pretrained``, then :func:`make_causal`.

    Args:
        path: A model folder (``config.json``) or a pipeline folder (``model_index.json``;
            its ``transformer`` unless ``subfolder`` is given).
        chunk_frames: Only for a bidirectional folder (a Wan to start a student from).
        **kwargs: Passed to ``from_pretrained`` (``torch_dtype``, ``subfolder``, ...).

    Raises:
        ValueError: For a bidirectional folder without ``chunk_frames``, or a
            ``chunk_frames`` other than the recorded one.
    """
    with needs_extra("models", "load_causal"):
        from diffusers import WanTransformer3DModel

    if (Path(path) / "model_index.json").is_file():
        kwargs.setdefault("subfolder", "transformer")
    model = WanTransformer3DModel.from_pretrained(path, **kwargs)
    if chunk_frames is None and recorded_chunk_frames(model) is None:
        raise ValueError(
            f"{str(path)!r} holds a bidirectional model (its config records no causal chunk): "
            "pass chunk_frames= to make it causal"
        )
    return make_causal(model, chunk_frames=chunk_frames)


def _frame_tokens(model: Any, x: torch.Tensor) -> int:
    """Tokens per latent frame of ``x`` ``(B, C, F, H, W)`` in ``model``'s patches."""
    _, p_h, p_w = tuple(model.config.patch_size)
    return (x.shape[3] // p_h) * (x.shape[4] // p_w)


def init_cache(
    model: nn.Module,
    like: torch.Tensor,
    *,
    capacity_frames: int,
    sink_frames: int = 0,
    dtype: torch.dtype | None = None,
) -> KVCache:
    """An empty :class:`KVCache` for ``model`` and latents shaped like ``like``.

    Args:
        like: Latents ``(B, C, F, H, W)``: their batch size, frame size, device and (unless
            ``dtype``) dtype are the cache's.
        capacity_frames: The frames the cache holds at most; a full cache keeps its first
            ``sink_frames`` (an attention sink) and drops the oldest of the others.
        dtype: The buffers' dtype. Default: the autocast dtype when autocast is on, else
            ``like``'s.

    Raises:
        ValueError: If the model is not causal, or the capacities are out of range.
    """
    chunk_frames_of(model)
    if not 0 <= sink_frames < capacity_frames:
        raise ValueError(
            f"need 0 <= sink_frames < capacity_frames, got sink_frames={sink_frames}, "
            f"capacity_frames={capacity_frames}"
        )
    wan: Any = model
    config = wan.config
    frame_tokens = _frame_tokens(model, like)
    shape = (
        like.shape[0],
        len(wan.blocks),
        capacity_frames * frame_tokens,
        int(config.num_attention_heads),
        int(config.attention_head_dim),
    )
    if dtype is None:
        device = like.device.type
        on = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if on else like.dtype
    return KVCache(
        keys=torch.zeros(shape, dtype=dtype, device=like.device),
        values=torch.zeros(shape, dtype=dtype, device=like.device),
        num_frames=torch.zeros((), dtype=torch.int64),
        frame_tokens=frame_tokens,
        sink_frames=sink_frames,
    )


def _append(cache: KVCache, collected: list[Any], frames: int) -> KVCache:
    """``cache`` with this call's ``collected`` keys and values; a full one keeps its sink."""
    if cache.slots is not None:  # a rollout's context is a view of a shared buffer
        raise ValueError("cannot append to a KVCache with slots (a rollout's context)")
    cached = int(cache.num_frames)
    capacity, sink, ft = cache.capacity_frames, cache.sink_frames, cache.frame_tokens
    if frames > capacity - sink:
        raise ValueError(
            f"{frames} new frames do not fit a cache of {capacity} frames with "
            f"{sink} sink frames; raise capacity_frames"
        )
    total = cached + frames
    keep = min(total, capacity)

    def add(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        full = torch.cat([old[:, :, : cached * ft], new.to(old.dtype)], 2)
        if total > capacity:
            full = torch.cat(
                [full[:, :, : sink * ft], full[:, :, (total - capacity + sink) * ft :]], 2
            )
        pad = old.new_zeros((*old.shape[:2], (capacity - keep) * ft, *old.shape[3:]))
        return torch.cat([full, pad], 2)

    return KVCache(
        keys=add(cache.keys, torch.stack([k for k, _ in collected], 1)),
        values=add(cache.values, torch.stack([v for _, v in collected], 1)),
        num_frames=torch.tensor(keep, dtype=torch.int64),
        frame_tokens=ft,
        sink_frames=sink,
    )


def causal_forward(
    model: nn.Module,
    x: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    *,
    cache: KVCache | None = None,
    update_cache: bool = False,
) -> tuple[torch.Tensor, KVCache | None]:
    """The velocity of a causal Wan at frames ``x`` that follow the cached ones.

    Without a cache: teacher forcing over ``x`` (block-causal). With one: ``x``'s queries
    see every cached frame and, block-causally, ``x``'s own.

    Args:
        timestep: ``(B,)`` or per frame ``(B, F)``, flow-matching time times 1000.
        cache: The keys and values of the frames before ``x``.
        update_cache: Return the cache with ``x``'s keys and values appended. Needs ``cache``.

    Returns:
        ``(velocity, cache)``: the velocity, shaped like ``x``, and the updated cache
        (``cache`` itself unless ``update_cache``).

    Raises:
        ValueError: If the model is not causal, ``update_cache`` has no cache, the
            timestep's shape is wrong, the cache does not fit ``x`` or the frames exceed
            the rotary table.
    """
    chunk_frames_of(model)
    if update_cache and cache is None:
        raise ValueError("update_cache needs a cache (fvstep.methods.causal_wan.init_cache)")
    batch, _, frames, _, _ = x.shape
    frame_tokens = _frame_tokens(model, x)
    if cache is not None and (cache.frame_tokens != frame_tokens or cache.keys.shape[0] != batch):
        raise ValueError(
            f"the cache holds {cache.keys.shape[0]} samples of {cache.frame_tokens} tokens "
            f"a frame; x has {batch} of {frame_tokens}"
        )
    if timestep.shape == (batch, frames):
        timestep = timestep.repeat_interleave(frame_tokens, dim=1)
    elif timestep.shape != (batch,):
        raise ValueError(
            f"timestep must be (B,) or (B, F) = ({batch}, {frames}), got {tuple(timestep.shape)}"
        )
    cached = int(cache.num_frames) if cache is not None else 0
    num_layers = len(model.get_submodule("blocks"))  # type: ignore[arg-type]
    collected: list[Any] | None = [None] * num_layers if update_cache else None
    token = call_context.set(Call(cache, cached, collected))
    # A cache-filling pass collects each layer's keys and values as it goes: a side effect
    # that a compiled, checkpointed block cannot trace, so that pass runs eagerly.
    eager = torch.compiler.set_stance("force_eager") if update_cache else contextlib.nullcontext()
    try:
        with eager:
            out = model(
                hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False
            )
    finally:
        call_context.reset(token)
    velocity = out[0]
    if update_cache:
        assert cache is not None and collected is not None
        if any(c is None for c in collected):
            raise ValueError("a block did not run the causal processor (was make_causal undone?)")
        cache = _append(cache, collected, frames)
    return velocity, cache
