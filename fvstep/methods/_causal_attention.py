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

from fvstep._optional import needs_extra

__all__ = [
    "CAUSAL_ATTR",
    "Call",
    "CausalWanAttnProcessor",
    "call_context",
    "rope_check",
    "rope_hook",
]

CAUSAL_ATTR = "_fvstep_causal_chunk_frames"  # on the rotary module: a plain int, static config


@attrs.frozen(eq=False)
class _Rotary:
    """What one forward's self-attention processors are given (as ``rotary_emb``)."""

    cos: torch.Tensor  # (1, key tokens, 1, head_dim): every key's rotation, cached first
    sin: torch.Tensor
    num_queries: int
    mask: torch.Tensor | None  # (queries, keys) bool, True = attend; None: attend to all
    cache: Any  # a KVCache, or None
    cached_tokens: int
    collected: list[Any] | None  # per layer (k, v) of this call, when the cache is updated


@attrs.frozen
class Call:
    cache: Any  # a KVCache, or None
    cached_frames: int
    collected: list[Any] | None


call_context: contextvars.ContextVar[Call | None] = contextvars.ContextVar(
    "fvstep_causal_wan_call", default=None
)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan rotary embedding (WanAttnProcessor), on (B, S, H, D)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _block_mask(
    num_frames: int, cached_frames: int, frame_tokens: int, chunk: int, device: torch.device
) -> torch.Tensor | None:
    """Queries of frame ``i`` (this call's) see every cached key and this call's keys of
    chunks ``<= i // chunk``; ``None`` when that is every key (one chunk or less)."""
    if num_frames <= chunk:
        return None
    chunk_of = torch.arange(num_frames, device=device) // chunk
    local = chunk_of[:, None] >= chunk_of[None, :]
    local = local.repeat_interleave(frame_tokens, 0).repeat_interleave(frame_tokens, 1)
    cached = torch.ones(local.shape[0], cached_frames * frame_tokens, dtype=torch.bool)
    return torch.cat([cached.to(device), local], dim=1)


def rope_check(module: Any, args: tuple[Any, ...]) -> None:
    """Refuse more frames than the rotary table has (diffusers' error would not say why)."""
    call = call_context.get() or Call(None, 0, None)
    frames = args[0].shape[2]
    total = call.cached_frames + frames
    if total > module.max_seq_len:
        raise ValueError(
            f"the causal Wan attends over {total} latent frames (cached "
            f"{call.cached_frames} + {frames}), more than its rotary table "
            f"(rope_max_seq_len={module.max_seq_len}); use a rolling cache (sink_frames and "
            "a smaller capacity_frames) or a model with a longer table"
        )


def rope_hook(module: Any, args: tuple[Any, ...], output: Any) -> _Rotary:
    """Wan's rotary embedding, extended over the cached frames, with this call's inputs."""
    hidden = args[0]
    _, _, frames, height, width = hidden.shape
    p_t, p_h, p_w = module.patch_size
    frame_tokens = (height // p_h) * (width // p_w)
    call = call_context.get() or Call(None, 0, None)
    total = call.cached_frames + frames // p_t
    if call.cached_frames:
        cos, sin = module.forward(torch.empty((1, 1, total, height, width), device="meta"))
    else:
        cos, sin = output
    chunk = int(getattr(module, CAUSAL_ATTR))
    mask = _block_mask(frames // p_t, call.cached_frames, frame_tokens, chunk, cos.device)
    return _Rotary(
        cos=cos,
        sin=sin,
        num_queries=(frames // p_t) * frame_tokens,
        mask=mask,
        cache=call.cache,
        cached_tokens=call.cached_frames * frame_tokens,
        collected=call.collected,
    )


class CausalWanAttnProcessor:
    """A Wan self-attention processor: block-causal, reading (and collecting) a KV cache.

    Installed by :func:`make_causal` on every block's ``attn1``; it takes the signature of
    diffusers' ``WanAttnProcessor`` and is given its per-call inputs as ``rotary_emb`` by
    the causal model's rotary hook. It holds only its layer index (static).

    Examples:
        >>> model = make_causal(tiny_wan())
        >>> type(model.blocks[0].attn1.processor).__name__
        'CausalWanAttnProcessor'
    """

    _attention_backend: Any = None

    def __init__(self, layer: int) -> None:
        self.layer = layer

    @property
    def _parallel_config(self) -> None:
        return None

    @_parallel_config.setter
    def _parallel_config(self, value: Any) -> None:
        if value is not None:
            raise ValueError(
                "context parallel is not supported by the causal Wan (fvstep.methods."
                "causal_wan): its plan splits the rotary embedding that the causal model "
                "extends over the KV cache, and shards the sequence a cache follows; prepare "
                "the causal role without context_mesh"
            )

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        """Self-attention of ``hidden_states`` (this call's tokens) over cache and self."""
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
        if call.cache is not None and call.cached_tokens:
            cached = slice(0, call.cached_tokens)
            key = torch.cat([call.cache.keys[self.layer][:, cached].to(key.dtype), key], 1)
            value = torch.cat([call.cache.values[self.layer][:, cached].to(value.dtype), value], 1)
        n = call.num_queries
        query = _rotate(query, call.cos[:, -n:], call.sin[:, -n:])
        key = _rotate(key, call.cos, call.sin)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=call.mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=None,
        )
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
