"""The attention of the causal Wan (private): its processor, rotary hooks and mask.

:func:`fvstep.methods.causal_wan.causal_forward` opens a context for one call (the cache to
read, where to collect this call's keys and values); the rotary embedding's forward hook
reads it once, at the root of the forward, and hands it to every block's self-attention
processor as the block's ``rotary_emb`` argument (so activation checkpointing's
recomputation gets the same inputs). Nothing is kept on a module between calls.
"""

from __future__ import annotations

import contextvars
from typing import Any

import attrs
import torch

from fvstep.core._optional import needs_extra

__all__ = [
    "CAUSAL_ATTR",
    "Call",
    "CausalWanAttnProcessor",
    "call_context",
    "is_causal",
    "rope_check",
    "rope_hook",
]

CAUSAL_ATTR = "_fvstep_causal_chunk_frames"  # on the rotary module: a plain int, static config


@attrs.frozen(eq=False)
class _Rotary:
    """One forward's inputs to the processors (as ``rotary_emb``), of shapes fixed by the
    call's frames and the cache's capacity, so a compiled block sees the same at every chunk."""

    cos_q: torch.Tensor  # (1, queries, 1, head_dim): this call's tokens' rotation
    sin_q: torch.Tensor
    cos_k: torch.Tensor  # (1, keys, 1, head_dim): every key's, the cache's slots first
    sin_k: torch.Tensor
    # (queries, keys) bool, True = attend ((1, keys) for one chunk); None without a cache
    mask: torch.Tensor | None
    # without a cache: per chunk of queries, (query end, key end) in tokens; (): every key
    chunks: tuple[tuple[int, int], ...]
    cache_keys: torch.Tensor | None  # (B, layers, buffer tokens, heads, head_dim)
    cache_values: torch.Tensor | None
    cache_slots: torch.Tensor | None  # None, or the buffer's token for each cache slot
    collected: list[Any] | None  # per layer (k, v) of this call, when the cache is updated


@attrs.frozen
class Call:
    cache: Any  # a KVCache, or None
    cached_frames: int
    collected: list[Any] | None


call_context: contextvars.ContextVar[Call | None] = contextvars.ContextVar(
    "fvstep_causal_wan_call", default=None
)


def is_causal(model: Any) -> bool:
    """Whether ``model`` is a causal Wan (made so by :func:`~fvstep.methods.causal_wan.make_causal`)."""
    return hasattr(getattr(model, "rope", None), CAUSAL_ATTR)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan rotary embedding (WanAttnProcessor), on (B, S, H, D)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _local_mask(frames: int, frame_tokens: int, chunk: int, device: torch.device) -> torch.Tensor:
    """``(tokens, tokens)``: frame ``i`` sees this call's frames of chunks ``<= i // chunk``."""
    chunk_of = torch.arange(frames, device=device) // chunk
    local = chunk_of[:, None] >= chunk_of[None, :]
    return local.repeat_interleave(frame_tokens, 0).repeat_interleave(frame_tokens, 1)


def _chunks(frames: int, frame_tokens: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """Per chunk, (query end, key end) without a cache; ``()`` for one chunk (every key)."""
    if frames <= chunk:
        return ()
    ends = [min(start + chunk, frames) * frame_tokens for start in range(0, frames, chunk)]
    return tuple((end, end) for end in ends)


def _table_frames(cache: Any, cached_frames: int, frames: int) -> int:
    capacity = cache.capacity_frames if cache is not None else 0
    return max(capacity, cached_frames + frames)


def rope_check(module: Any, args: tuple[Any, ...]) -> None:
    """Refuse more frames than the rotary table has (diffusers' error would not say why)."""
    call = call_context.get() or Call(None, 0, None)
    frames = args[0].shape[2]
    total = _table_frames(call.cache, call.cached_frames, frames)
    if total > module.max_seq_len:
        capacity = call.cache.capacity_frames if call.cache is not None else 0
        raise ValueError(
            f"the causal Wan attends over {total} latent frames (cached {call.cached_frames} + {frames}, capacity "
            f"{capacity}), past its rotary table ({module.max_seq_len}): use sink_frames and a smaller capacity_frames"
        )


def rope_hook(module: Any, args: tuple[Any, ...], output: Any) -> _Rotary:
    """Wan's rotary embedding over the cache's slots, with this call's inputs (run eagerly:
    the fill level becomes tensors of fixed shapes here)."""
    hidden = args[0]
    _, _, frames, height, width = hidden.shape
    p_t, p_h, p_w = module.patch_size
    frames //= p_t
    frame_tokens = (height // p_h) * (width // p_w)
    call = call_context.get() or Call(None, 0, None)
    chunk = int(getattr(module, CAUSAL_ATTR))
    cos, sin = output
    if call.cache is None:
        return _Rotary(
            cos_q=cos, sin_q=sin, cos_k=cos, sin_k=sin, mask=None,
            chunks=_chunks(frames, frame_tokens, chunk), cache_keys=None, cache_values=None,
            cache_slots=None, collected=call.collected,
        )  # fmt: skip
    table = _table_frames(call.cache, call.cached_frames, frames)
    if table != frames:
        cos, sin = module.forward(torch.empty((1, 1, table, height, width), device="meta"))
    start = call.cached_frames * frame_tokens
    own = slice(start, start + frames * frame_tokens)
    slots = call.cache.capacity_frames * frame_tokens
    filled = torch.arange(slots, device=cos.device) < start
    if frames <= chunk:  # one chunk (a rollout's call): one row, broadcast over the queries
        mask = torch.cat([filled, filled.new_ones(frames * frame_tokens)])[None]
    else:
        local = _local_mask(frames, frame_tokens, chunk, cos.device)
        mask = torch.cat([filled.expand(local.shape[0], slots), local], dim=1)
    return _Rotary(
        cos_q=cos[:, own],
        sin_q=sin[:, own],
        cos_k=torch.cat([cos[:, :slots], cos[:, own]], 1),
        sin_k=torch.cat([sin[:, :slots], sin[:, own]], 1),
        mask=mask,
        chunks=(),
        cache_keys=call.cache.keys,
        cache_values=call.cache.values,
        cache_slots=call.cache.slots,
        collected=call.collected,
    )


class CausalWanAttnProcessor:
    """A Wan self-attention processor: block-causal, reading (and collecting) a KV cache.

    Its per-call inputs come as ``rotary_emb`` from the rotary hook. The layer index is
    also a tensor, so that a compiled block's graph is one for every layer.
    """

    _attention_backend: Any = None

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.layer_index = torch.tensor([layer])

    @property
    def _parallel_config(self) -> None:
        return None

    @_parallel_config.setter
    def _parallel_config(self, value: Any) -> None:
        if value is not None:
            raise ValueError(
                "context parallel is not supported by the causal Wan (its rotary embedding and "
                "KV cache follow the whole sequence): prepare the causal role without context_mesh"
            )

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        with needs_extra("models", "causal attention"):
            from diffusers.models.attention_dispatch import dispatch_attention_fn

        if not isinstance(rotary_emb, _Rotary):
            raise ValueError(
                "CausalWanAttnProcessor needs the causal model's rotary embedding: install "
                "it with fvstep.methods.causal_wan.make_causal(model), not by hand"
            )
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("CausalWanAttnProcessor is for self-attention (attn1) only")
        call = rotary_emb
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = (
                attn.to_q(hidden_states),
                attn.to_k(hidden_states),
                attn.to_v(hidden_states),
            )
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if call.collected is not None:
            call.collected[self.layer] = (key.detach(), value.detach())
        if call.cache_keys is not None and call.cache_values is not None:
            index = self.layer_index.to(call.cache_keys.device)

            def with_cached(buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
                cached = buffer.index_select(1, index)[:, 0]
                if call.cache_slots is not None:
                    cached = cached.index_select(1, call.cache_slots.to(cached.device))
                return torch.cat([cached.to(new.dtype), new], 1)

            key, value = with_cached(call.cache_keys, key), with_cached(call.cache_values, value)
        query = _rotate(query, call.cos_q, call.sin_q)
        key = _rotate(key, call.cos_k, call.sin_k)
        # Without a cache, the block-causal attention is one call per chunk of queries over
        # the keys up to its end (no tokens x tokens mask); with one, a mask of the filled
        # slots (fixed shape, whatever the fill level).
        spans = call.chunks or ((query.shape[1], key.shape[1]),)
        outs, begin = [], 0
        for q_end, k_end in spans:
            outs.append(
                dispatch_attention_fn(
                    query[:, begin:q_end],
                    key[:, :k_end],
                    value[:, :k_end],
                    attn_mask=call.mask,
                    dropout_p=0.0,
                    is_causal=False,
                    backend=self._attention_backend,
                    parallel_config=None,
                )
            )
            begin = q_end
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
