"""A causal Wan: block-causal self-attention over chunks of latent frames, with a KV cache.

:func:`make_causal` turns a diffusers ``WanTransformer3DModel`` into an autoregressive
(frame-causal) model *in place*, through the model's attention-processor machinery: each
block's self-attention gets a :class:`CausalWanAttnProcessor` and the rotary embedding a
forward hook. No parameter is added, renamed or removed, so a bidirectional Wan checkpoint
(a ``state_dict`` or a diffusers model directory) loads into the causal model and back.

The latent frames are grouped in chunks of ``chunk_frames`` (3, as Self-Forcing trains
Wan2.1-1.3B). A token of chunk ``i`` attends to every token of chunks ``<= i``:

- **Teacher forcing.** A plain call (``model(hidden_states=x, ...)``, e.g. through
  :func:`fvstep.models.predict`) runs the whole sequence in one forward, block-causal:
  each chunk's queries attend in one call to the keys up to their chunk's end (no
  tokens x tokens mask).
- **Cached rollout.** :func:`causal_forward` with a :class:`KVCache` runs frames that
  follow the cached ones: their queries attend to the cached keys and values and,
  block-causally, to their own. ``update_cache=True`` returns the cache with their keys
  and values appended. Running the chunks one by one with the cache gives the frames of the
  teacher-forcing forward (fp32: within ~1e-5; ``tests/test_causal_wan.py``).

The cache is a value: a frozen pytree (:class:`KVCache`) that is passed in and returned,
never held by a module between calls (a call's inputs reach the processors through a
context that exists only during the call; activation checkpointing's recomputation gets
them as the blocks' saved ``rotary_emb`` argument). Its buffers have a fixed capacity
(``capacity_frames``), so that a cache kept in ``TrainState.extra`` has the same shapes at
every step (a checkpoint loads into it). It holds keys *before* the rotary embedding:
positions are given at attention time, by slot (cached frames ``0 .. m-1``, then the new
ones), so a rolling cache (a window of the latest frames after ``sink_frames`` kept
forever, an attention sink) never runs past the rotary table. Without eviction the slot
is the frame's position in the video, as in teacher forcing. The cache never carries
gradient (its tensors are detached).

Compiled blocks (``prepare(..., compile=...)``) see the same shapes and constants at every
chunk of a rollout and at every layer, so the graphs do not grow with the video: a cached
call attends over the cache's full capacity, its empty slots masked (so its attention
costs the full capacity and, masked, does not use the flash kernel), and each block reads
its layer of the cache through a tensor index.

Preparation: call :func:`make_causal` before :func:`fvstep.parallel.prepare`
(checkpointing, compile and FSDP2 work on the causal model). Context parallel is refused:
its plan splits the rotary embedding this model extends and shards the sequence a cache
follows (``ValueError`` from :func:`fvstep.parallel.apply_context_parallel`).

Examples:
    >>> model = make_causal(tiny_wan(), chunk_frames=1)
    >>> x = torch.randn(1, 4, 2, 4, 4); text = torch.randn(1, 3, 16)
    >>> t = torch.zeros(1, 2)
    >>> whole, _ = causal_forward(model, x, t, text)             # teacher forcing
    >>> cache = init_cache(model, x, capacity_frames=2)
    >>> first, cache = causal_forward(model, x[:, :, :1], t[:, :1], text,
    ...                               cache=cache, update_cache=True)
    >>> second, cache = causal_forward(model, x[:, :, 1:], t[:, 1:], text, cache=cache)
    >>> torch.testing.assert_close(torch.cat([first, second], 2), whole, rtol=0, atol=1e-5)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from fvstep._optional import needs_extra
from fvstep.methods._causal_attention import (
    CAUSAL_ATTR,
    Call,
    CausalWanAttnProcessor,
    call_context,
    rope_check,
    rope_hook,
)
from fvstep.tree import field, frozen

__all__ = [
    "CausalWanAttnProcessor",
    "KVCache",
    "causal_forward",
    "chunk_frames_of",
    "init_cache",
    "make_causal",
]


@frozen
class KVCache:
    """Self-attention keys and values of the frames seen so far, per layer (a pytree).

    Attributes:
        keys: ``(B, layers, capacity_frames * frame_tokens, heads, head_dim)``, before the
            rotary embedding (batch first: micro-batches split it). Slots past
            ``num_frames`` frames are never read (masked); they hold zeros, or a later
            chunk's keys in a rollout's context (a prefix of the final cache).
        values: Like ``keys``.
        num_frames: 0-d int64 tensor: the frames held (a prefix of the slots).
        frame_tokens: Tokens per latent frame (static).
        sink_frames: Frames kept forever at the start when the cache is full (static).
    """

    keys: torch.Tensor
    values: torch.Tensor
    num_frames: torch.Tensor
    frame_tokens: int = field(pytree_node=False)
    sink_frames: int = field(pytree_node=False, default=0)

    @property
    def capacity_frames(self) -> int:
        """The frames the buffers hold at most."""
        return int(self.keys.shape[2]) // self.frame_tokens


def chunk_frames_of(model: nn.Module) -> int:
    """The chunk size (latent frames) of a model made causal by :func:`make_causal`.

    Raises:
        ValueError: If ``model`` is not causal.

    Examples:
        >>> chunk_frames_of(make_causal(tiny_wan(), chunk_frames=3))
        3
    """
    rope = getattr(model, "rope", None)
    chunk = getattr(rope, CAUSAL_ATTR, None)
    if chunk is None:
        raise ValueError(
            f"{type(model).__name__} is not a causal Wan: build it with "
            "fvstep.methods.causal_wan.make_causal(model)"
        )
    return int(chunk)


def make_causal(model: nn.Module, *, chunk_frames: int = 3) -> nn.Module:
    """Make a diffusers ``WanTransformer3DModel`` block-causal over chunks of latent frames.

    In place: every block's self-attention processor becomes a
    :class:`CausalWanAttnProcessor` and the rotary embedding gets a forward hook; the
    parameters, their names and the state-dict keys do not change. Call it before
    :func:`fvstep.parallel.prepare`.

    Args:
        model: A ``WanTransformer3DModel`` (temporal patch size 1), not yet prepared.
        chunk_frames: Latent frames a chunk (3: Self-Forcing's Wan2.1 setting).

    Returns:
        The same model.

    Raises:
        ValueError: If ``chunk_frames < 1``, the model is not a Wan transformer, has a
            temporal patch size other than 1, is causal already, is prepared or sharded
            already, or is context-parallel.

    Examples:
        >>> causal = make_causal(tiny_wan(seed=0), chunk_frames=3)
        >>> causal.load_state_dict(tiny_wan(seed=1).state_dict())
        <All keys matched successfully>
    """
    with needs_extra("models", "make_causal"):
        from diffusers import WanTransformer3DModel

    if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
        raise ValueError(f"chunk_frames must be an int >= 1, got {chunk_frames!r}")
    if not isinstance(model, WanTransformer3DModel):
        raise ValueError(
            f"make_causal takes a diffusers WanTransformer3DModel, got {type(model).__name__}"
        )
    if _wan(model).config.patch_size[0] != 1:
        raise ValueError(
            f"make_causal needs a temporal patch size of 1, got {tuple(_wan(model).config.patch_size)}"
        )
    if hasattr(_wan(model).rope, CAUSAL_ATTR):
        raise ValueError("the model is causal already (make_causal was called on it)")
    if getattr(model, "_fvstep_preparation", None) is not None or any(
        hasattr(m, "_fsdp_state") or type(m).__name__.startswith("FSDP") for m in model.modules()
    ):
        raise ValueError("make_causal comes before fvstep.parallel.prepare and fully_shard")
    if getattr(model, "_parallel_config", None) is not None:
        raise ValueError(
            "the model is context-parallel: the causal Wan does not support context parallel"
        )
    processors = dict(_wan(model).attn_processors)
    for i, _block in enumerate(_wan(model).blocks):
        processors[f"blocks.{i}.attn1.processor"] = CausalWanAttnProcessor(i)
    _wan(model).set_attn_processor(processors)
    object.__setattr__(_wan(model).rope, CAUSAL_ATTR, chunk_frames)
    _wan(model).rope.register_forward_pre_hook(rope_check)
    _wan(model).rope.register_forward_hook(rope_hook)
    return model


def _wan(model: nn.Module) -> Any:
    """``model`` as a diffusers Wan transformer (its config, blocks and rotary module)."""
    return model


def _layer_shapes(model: nn.Module) -> tuple[int, int, int]:
    config = _wan(model).config
    return len(_wan(model).blocks), int(config.num_attention_heads), int(config.attention_head_dim)


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
        model: A causal Wan (:func:`make_causal`).
        like: Latents ``(B, C, F, H, W)``: their batch size, frame size, device and (unless
            ``dtype``) dtype are the cache's.
        capacity_frames: The frames the cache holds at most; a full cache keeps its first
            ``sink_frames`` and drops the oldest of the others.
        sink_frames: Frames kept forever (an attention sink), ``< capacity_frames``.
        dtype: The buffers' dtype. Default: the autocast dtype when autocast is on for
            ``like``'s device (the keys and values are computed in it), else ``like``'s.

    Returns:
        A cache holding no frame.

    Raises:
        ValueError: If the model is not causal, or the capacities are out of range.

    Examples:
        >>> cache = init_cache(model, batch["latents"], capacity_frames=21)
    """
    chunk_frames_of(model)
    if not 0 <= sink_frames < capacity_frames:
        raise ValueError(
            f"need 0 <= sink_frames < capacity_frames, got sink_frames={sink_frames}, "
            f"capacity_frames={capacity_frames}"
        )
    _, _, _, height, width = like.shape
    _, p_h, p_w = tuple(_wan(model).config.patch_size)
    frame_tokens = (height // p_h) * (width // p_w)
    num_layers, heads, head_dim = _layer_shapes(model)
    shape = (like.shape[0], num_layers, capacity_frames * frame_tokens, heads, head_dim)
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
    """``cache`` with ``collected`` (this call's keys and values, ``frames`` frames) added;
    a full cache keeps its sink and the latest frames."""
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

    Without a cache: teacher forcing over ``x`` (block-causal). With one: ``x``'s frames
    come after the cache's; their queries see every cached frame and, block-causally
    (chunks counted from ``x``'s first frame), ``x``'s own.

    Args:
        model: A causal Wan (:func:`make_causal`), prepared or not.
        x: Latents ``(B, C, F, H, W)``.
        timestep: ``(B,)`` or per frame ``(B, F)``, flow-matching time times 1000.
        text: Text embeddings ``(B, L, D)``.
        cache: The keys and values of the frames before ``x``.
        update_cache: Return the cache with ``x``'s keys and values appended (computed at
            ``timestep``: clean frames at 0 for a rollout's context). Needs ``cache``.

    Returns:
        ``(velocity, cache)``: the velocity, shaped like ``x``, and the updated cache
        (``cache`` itself unless ``update_cache``).

    Raises:
        ValueError: If the model is not causal, ``update_cache`` has no cache, the
            timestep's shape is wrong, the cache does not fit ``x`` or the frames exceed
            the rotary table.

    Examples:
        >>> v, cache = causal_forward(model, chunk, t, text, cache=cache, update_cache=True)
    """
    chunk_frames_of(model)
    if update_cache and cache is None:
        raise ValueError("update_cache needs a cache (fvstep.methods.causal_wan.init_cache)")
    batch, _, frames, height, width = x.shape
    _, p_h, p_w = tuple(_wan(model).config.patch_size)
    frame_tokens = (height // p_h) * (width // p_w)
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
    collected: list[Any] | None = [None] * len(_wan(model).blocks) if update_cache else None
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
