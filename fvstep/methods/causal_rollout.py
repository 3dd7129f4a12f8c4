"""A causal student's chunk-by-chunk rollout with its KV cache, and its exit steps.

The generation of :mod:`fvstep.methods.self_forcing` and :mod:`fvstep.methods.streaming`
(``docs/methods/self_forcing.md``): :func:`rollout` generates a video chunk by chunk, with
gradient only through each chunk's exit step (:func:`exit_steps`, from a key shared by
every rank); :func:`regenerate` recomputes a rollout's frames from its exit steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.tree import replace
from fvstep.methods import _noise
from fvstep.methods._checks import check_cache_fits, check_count, check_step_index
from fvstep.methods.causal_wan import KVCache, causal_forward, chunk_frames_of, init_cache
from fvstep.methods.finetune import add_noise, x0_from_velocity

__all__ = ["Rollout", "exit_steps", "regenerate", "rollout", "shifted_steps"]


def shifted_steps(steps: Sequence[float], shift: float) -> tuple[float, ...]:
    """The few-step schedule warped by a timestep shift: ``shift t / (1 + (shift - 1) t)``.

    Examples:
        >>> shifted_steps((1.0, 0.75, 0.5, 0.25), 5.0)
        (1.0, 0.9375, 0.8333333333333334, 0.625)
    """
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return tuple(shift * t / (1 + (shift - 1) * t) for t in steps)


def exit_steps(
    key: torch.Tensor,
    step: int,
    num_chunks: int,
    num_steps: int,
    *,
    same_step_across_chunks: bool = False,
    last_step_only: bool = False,
) -> tuple[int, ...]:
    """Each chunk's exit step, drawn from the shared key of ``step`` (``docs/methods/self_forcing.md``).

    Args:
        key: The state's base key (``state.key``), not a per-rank key.
        same_step_across_chunks: One draw for every chunk.
        last_step_only: Always the last step (no draw).

    Raises:
        ValueError: If ``num_steps < 1`` or ``num_chunks < 0``.
    """
    check_count(num_steps, "exit_steps: num_steps")
    check_count(num_chunks, "exit_steps: num_chunks", 0)
    if last_step_only:
        return (num_steps - 1,) * num_chunks
    shared = fsrandom.fold_in(fsrandom.fold_in_name(key, "self_forcing_exit"), step)
    draws = torch.randint(num_steps, (num_chunks,), generator=fsrandom.generator(shared))
    if same_step_across_chunks:
        draws = draws[:1].expand(num_chunks)
    return tuple(int(j) for j in draws.tolist())


class Rollout(NamedTuple):
    """A chunk-by-chunk rollout, and per chunk what :func:`regenerate` needs: its exit step's
    input and time, and the cache it read (views of one buffer)."""

    video: torch.Tensor
    cache: KVCache
    exit_inputs: tuple[torch.Tensor, ...]
    exit_times: tuple[float, ...]
    contexts: tuple[KVCache, ...]


def _time(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((like.shape[0],), value, device=like.device)


def rollout(
    student: nn.Module,
    like: torch.Tensor,
    text: torch.Tensor,
    key: torch.Tensor,
    *,
    exits: Sequence[int],
    denoising_steps: Sequence[float],
    cache: KVCache | None = None,
    context_time: float = 0.0,
    cache_dtype: torch.dtype | None = None,
) -> Rollout:
    """The causal student's video, chunk by chunk with its KV cache.

    Args:
        like: Latents giving the video's shape ``(B, C, F, H, W)``, dtype and device.
        exits: Each chunk's exit step (:func:`exit_steps`).
        cache: The cache to continue from (a stream); default an empty one of ``F`` frames.
        context_time: The time at which the clean chunks are fed to the cache (0: clean).
        cache_dtype: The new cache's dtype, without ``cache``.

    Returns:
        A :class:`Rollout`; ``video`` has gradient through the exit steps when grad is on.

    Raises:
        ValueError: If ``F`` is not a multiple of the chunk, ``exits`` has the wrong length
            or an index outside the schedule, or ``cache`` was made for another model.
    """
    chunk = chunk_frames_of(student)
    batch, channels, frames, height, width = like.shape
    if frames % chunk:
        raise ValueError(f"the video's {frames} frames are not a multiple of the chunk ({chunk})")
    num_chunks = frames // chunk
    if len(exits) != num_chunks:
        raise ValueError(f"need one exit step for each of {num_chunks} chunks, got {len(exits)}")
    steps = tuple(float(s) for s in denoising_steps)
    for c, j in enumerate(exits):
        check_step_index(j, len(steps), f"exits[{c}]")
    if cache is None:
        cache = init_cache(student, like, capacity_frames=frames, dtype=cache_dtype)
    else:
        check_cache_fits(student, cache)
    current, held = cache, int(cache.num_frames)
    # Without eviction every chunk's context is a prefix of the final cache: one buffer,
    # read by each chunk up to its fill level (the slots past it are masked, never used).
    grows = held + frames <= cache.capacity_frames
    shape = (batch, channels, chunk, height, width)
    chunks: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []
    filled: list[torch.Tensor] = []
    new_frames: list[tuple[torch.Tensor, torch.Tensor]] = []
    for c in range(num_chunks):
        k_noise, k_renoise, k_context = fsrandom.split(fsrandom.fold_in(key, c), 3)
        x = _noise.randn(k_noise, shape, device=like.device, dtype=like.dtype)
        j = exits[c]
        with torch.no_grad():
            for i in range(j):
                t_i = _time(steps[i], x)
                v, _ = causal_forward(student, x, t_i * 1000, text, cache=current)
                eps = _noise.randn_like(fsrandom.fold_in(k_renoise, i), x)
                x = add_noise(x0_from_velocity(x, t_i, v), eps, _time(steps[i + 1], x))
        t_j = _time(steps[j], x)
        v, _ = causal_forward(student, x, t_j * 1000, text, cache=current)
        x0 = x0_from_velocity(x, t_j, v)
        chunks.append(x0)
        inputs.append(x)
        if grows:
            filled.append(current.num_frames)
        with torch.no_grad():
            clean = x0.detach()
            t_c = _time(context_time, clean)
            if context_time > 0:
                clean = add_noise(clean, _noise.randn_like(k_context, clean), t_c)
            _, updated = causal_forward(
                student, clean, t_c * 1000, text, cache=current, update_cache=True
            )
            assert updated is not None
            current = updated
            if not grows:  # this chunk's keys and values: the newest slots
                end = int(current.num_frames) * current.frame_tokens
                begin = end - chunk * current.frame_tokens
                new_frames.append(
                    (current.keys[:, :, begin:end].clone(), current.values[:, :, begin:end].clone())
                )
    if grows:
        contexts = [replace(current, num_frames=n) for n in filled]
    else:  # with eviction, windows of the input cache's frames and the new ones
        contexts = _windows(cache, held, new_frames, chunk)
    times = tuple(steps[j] for j in exits)
    return Rollout(torch.cat(chunks, 2), current, tuple(inputs), times, tuple(contexts))


def _windows(
    start: KVCache, held: int, new: list[tuple[torch.Tensor, torch.Tensor]], chunk: int
) -> list[KVCache]:
    """Each chunk's context in a rolling cache (the sink and the latest frames), as views of
    one buffer: ``start``'s ``held`` frames, then each chunk's new ones."""
    ft, capacity, sink = start.frame_tokens, start.capacity_frames, start.sink_frames
    keys = torch.cat([start.keys[:, :, : held * ft], *(k for k, _ in new)], 2)
    values = torch.cat([start.values[:, :, : held * ft], *(v for _, v in new)], 2)
    tokens = torch.arange(capacity * ft, device=keys.device)
    contexts = []
    for c in range(len(new)):
        seen = held + c * chunk
        if seen <= capacity:  # a prefix; the slots past it are masked (any token will do)
            slots, frames = torch.where(tokens < seen * ft, tokens, 0), seen
        else:  # the sink, then the latest capacity - sink frames
            slots = torch.where(tokens < sink * ft, tokens, tokens + (seen - capacity) * ft)
            frames = capacity
        contexts.append(
            KVCache(
                keys=keys,
                values=values,
                num_frames=torch.tensor(frames, dtype=torch.int64),
                frame_tokens=ft,
                sink_frames=sink,
                slots=slots,
            )
        )
    return contexts


def regenerate(
    student: nn.Module,
    exit_inputs: Sequence[torch.Tensor],
    exit_times: Sequence[float],
    contexts: Sequence[KVCache],
    text: torch.Tensor,
) -> torch.Tensor:
    """A rollout's video recomputed from its exit steps (with gradient when grad is on).

    For a caller that rolled out without gradient: the rollout's ``video``, bitwise.
    """
    out = []
    for x, t, cache in zip(exit_inputs, exit_times, contexts, strict=True):
        t_j = _time(t, x)
        v, _ = causal_forward(student, x, t_j * 1000, text, cache=cache)
        out.append(x0_from_velocity(x, t_j, v))
    return torch.cat(out, 2)
