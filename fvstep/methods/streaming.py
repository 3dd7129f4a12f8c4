"""Streaming self-forcing: one long rollout spans several steps, its state in ``TrainState.extra``.

Each step continues the stream of the step before: the causal student generates the next
frames from the stream's KV cache, student and critic train on them by the DMD losses of
:mod:`fvstep.methods.self_forcing`, and the stream moves on. The step, resets, world sizes
and refusals: ``docs/methods/streaming.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.accumulation import Accumulation
from fvstep.core.managed import Managed, managed
from fvstep.core.state import TrainState
from fvstep.core.steps import update
from fvstep.core.tree import frozen, replace
from fvstep.methods._checks import (
    check_batch,
    check_bidirectional,
    check_cache_fits,
    check_count,
    check_rollout_options,
    upcast_for,
)
from fvstep.methods.causal_rollout import exit_steps, regenerate, rollout, shifted_steps
from fvstep.methods.causal_wan import KVCache, chunk_frames_of, init_cache
from fvstep.methods.self_forcing import critic_loss_on, dmd_loss_on

__all__ = ["StreamState", "init_stream", "streaming"]


@frozen
class StreamState:
    """A stream's state between steps, under ``state.extra[name]`` (``docs/methods/streaming.md``)."""

    cache: KVCache
    frames: torch.Tensor
    text: torch.Tensor
    num_frames: torch.Tensor


def init_stream(
    student: nn.Module,
    batch: Any,
    *,
    window_frames: int,
    sink_frames: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> StreamState:
    """An empty stream for ``student`` and batches like ``batch`` (for ``TrainState.create``).

    Args:
        batch: A batch of the run: ``"latents"`` (a step's frames) and ``"text"``.
        window_frames: The latest frames the cache and ``frames`` keep; at least a step's.
        sink_frames: The stream's first frames the cache keeps for the whole stream.
        cache_dtype: The cache's dtype; ``torch.bfloat16`` halves its memory (the
            attention then close to, not bitwise, that of an fp32 cache).

    Returns:
        A :class:`StreamState` holding no frame, in the dtype the step casts batches to.

    Raises:
        ValueError: If the window is smaller than a step's frames or the chunk, either is
            not a multiple of the chunk, or the student is not causal.
    """
    like, text = upcast_for(student, batch["latents"]), upcast_for(student, batch["text"])
    chunk = chunk_frames_of(student)
    check_count(window_frames, "window_frames")
    if window_frames < max(like.shape[2], chunk):
        raise ValueError(
            f"window_frames={window_frames} must hold a step's {like.shape[2]} frames "
            f"and a chunk of {chunk}"
        )
    for label, value in (("window_frames", window_frames), ("a step's frames", like.shape[2])):
        if value % chunk:
            raise ValueError(
                f"{label} ({value}) must be a multiple of the student's chunk of {chunk} "
                "frames (the stream moves a chunk at a time)"
            )
    batch_size, channels, _, height, width = like.shape
    empty = init_cache(
        student, like, capacity_frames=sink_frames + window_frames, sink_frames=sink_frames,
        dtype=cache_dtype,
    )  # fmt: skip
    # A stream holding no frame is restarted by its first step, which never reads this
    # cache: it stays one zero, expanded. The state a caller passes to fvstep.run lives
    # as long as the run, so a full cache here would be a second one for the whole run.
    zero = torch.zeros((), dtype=empty.keys.dtype, device=empty.keys.device)
    return StreamState(
        cache=replace(
            empty, keys=zero.expand(empty.keys.shape), values=zero.expand(empty.values.shape)
        ),
        frames=like.new_zeros((batch_size, channels, window_frames, height, width)),
        text=torch.zeros_like(text),
        num_frames=torch.zeros((), dtype=torch.int64),
    )


@attrs.frozen
class _Whole:
    """A value every micro-batch gets whole (not a pytree leaf, so never split)."""

    value: Any


def _restarted(stream: StreamState, text: torch.Tensor) -> StreamState:
    cache = stream.cache
    return StreamState(
        cache=replace(
            cache,
            keys=torch.zeros_like(cache.keys),
            values=torch.zeros_like(cache.values),
            num_frames=torch.zeros_like(cache.num_frames),
            slots=None,
        ),
        frames=torch.zeros_like(stream.frames),
        text=text.detach().to(stream.text.dtype).clone(),
        num_frames=torch.zeros_like(stream.num_frames),
    )


def streaming(
    *,
    steps_per_stream: int,
    window_frames: int,
    sink_frames: int = 0,
    generator_update_interval: int = 1,
    denoising_steps: Sequence[float] = shifted_steps((1.0, 0.75, 0.5, 0.25), 5.0),
    guidance_scale: float = 3.0,
    shift: float = 3.0,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
    context_time: float = 0.0,
    name: str = "stream",
) -> Managed:
    """Streaming self-forcing as a managed step (see the module docstring).

    Roles: ``student`` (causal, trained), ``teacher`` (frozen), ``critic`` (trained). The
    state needs ``extra[name]`` from :func:`init_stream` with the same window and sink; the
    other options are :func:`~fvstep.methods.self_forcing.self_forcing_losses`'s.

    Args:
        steps_per_stream: A stream starts at every step ``i % steps_per_stream == 0``
            (and at any step its stream has generated no frame yet).
        generator_update_interval: The student trains at ``i % n == 0``; the critic at
            every step.
        name: The key of the stream in ``state.extra``, and the managed step's name.

    Returns:
        A managed step that trains ``student`` and ``critic``.

    Raises:
        ValueError: For out-of-range settings; at a step, before it changes anything, for
            the refusals that ``docs/methods/streaming.md`` lists.

    Examples:
        >>> step = fvstep.compile(streaming(steps_per_stream=8, window_frames=6),
        ...                       accumulation=fvstep.Accumulation(2))
    """
    check_count(steps_per_stream, "steps_per_stream")
    check_count(window_frames, "window_frames")
    check_count(sink_frames, "sink_frames", 0)
    check_count(generator_update_interval, "generator_update_interval")
    steps = check_rollout_options(
        denoising_steps, guidance_scale=guidance_scale, shift=shift, min_ratio=min_ratio,
        max_ratio=max_ratio, context_time=context_time,
    )  # fmt: skip
    score: dict[str, Any] = {"shift": shift, "min_ratio": min_ratio, "max_ratio": max_ratio}
    capacity = sink_frames + window_frames

    def exits_at(state: TrainState, frames: int) -> tuple[int, ...]:
        chunk = chunk_frames_of(state.module("student"))
        return exit_steps(state.key, int(state.step), frames // chunk, len(steps))

    def generator_loss(
        state: TrainState, inputs: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        exits = exits_at(state, inputs["video"].shape[2])
        contexts = [  # views of the rollout's one buffer (this micro-batch's rows)
            KVCache(
                keys=inputs["context_keys"],
                values=inputs["context_values"],
                num_frames=n,
                frame_tokens=inputs["frame_tokens"],
                sink_frames=sink_frames,
                slots=slots.value,
            )
            for n, slots in zip(inputs["context_frames"], inputs["context_slots"], strict=True)
        ]
        video = regenerate(
            state.module("student"), inputs["exit_inputs"], [steps[j] for j in exits],
            contexts, inputs["text"],
        )  # fmt: skip
        return dmd_loss_on(
            state, video, inputs["text"], key, guidance_scale=guidance_scale, **score
        )

    def critic_loss(
        state: TrainState, inputs: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return critic_loss_on(state, inputs["video"], inputs["text"], key, **score)

    generator_unit = update("student", generator_loss, name=f"{name}_generator")
    critic_unit = update("critic", critic_loss, name=f"{name}_critic")

    def starts(state: TrainState, stream: StreamState) -> bool:
        return int(state.step) % steps_per_stream == 0 or int(stream.num_frames) == 0

    def check_input(state: TrainState, batch: Any, accumulation: Accumulation) -> None:
        student = state.module("student")
        chunk = chunk_frames_of(student)  # raises for a student that is not causal
        check_bidirectional(state, ("teacher", "critic"), method="streaming")
        if not isinstance(batch, Mapping):
            raise ValueError('streaming needs a batch dict with "latents" and "text"')
        batch = check_batch(state, batch, "student")
        stream = state.extra.get(name)
        if not (
            isinstance(stream, StreamState)
            and stream.cache.capacity_frames == capacity
            and stream.cache.sink_frames == sink_frames
            and stream.frames.shape[2] == window_frames
        ):
            got = (
                f"a stream of window_frames={stream.frames.shape[2]}, sink_frames="
                f"{stream.cache.sink_frames}"
                if isinstance(stream, StreamState)
                else f"{'no stream' if stream is None else type(stream).__name__} "
                f"(state.extra has keys {sorted(state.extra)})"
            )
            raise ValueError(
                f"streaming needs state.extra[{name!r}] = init_stream(student, batch, "
                f"window_frames={window_frames}, sink_frames={sink_frames}), got {got}"
            )
        check_cache_fits(student, stream.cache, what=f"state.extra[{name!r}].cache")
        like, text = batch["latents"], batch["text"]
        frames = like.shape[2]
        if frames > window_frames or frames % chunk:
            raise ValueError(
                f'batch["latents"] has {frames} frames: give a multiple of the chunk ({chunk}) and at most '
                f"window_frames={window_frames} (more would evict the step's own chunks from the cache)"
            )
        want = (stream.frames.shape[0], stream.frames.shape[1], *stream.frames.shape[3:])
        have = (like.shape[0], like.shape[1], *like.shape[3:])
        if have != want:
            raise ValueError(
                f'batch["latents"] has (batch, channels, height, width) = {have}; the stream was made for '
                f"{want} (init_stream's batch): give batches of that shape, or start a new stream"
            )
        if like.shape[0] % accumulation.microbatches:
            raise ValueError(
                f"the step's accumulation of {accumulation.microbatches} micro-batches does "
                f'not divide the batch of {like.shape[0]} samples (batch["latents"])'
            )
        if starts(state, stream) and text.shape != stream.text.shape:
            raise ValueError(
                f'batch["text"] has shape {tuple(text.shape)}; a new stream takes it as its '
                f"prompt, which must be shaped like init_stream's, {tuple(stream.text.shape)}"
            )

    def stream_step(
        state: TrainState, batch: Any, key: torch.Tensor, ctx: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        batch = check_batch(state, batch, "student")  # also for a caller of `.fn` alone
        stream = state.extra[name]
        if starts(state, stream):
            stream = _restarted(stream, batch["text"])
        like = batch["latents"]
        k_rollout, k_generator, k_critic = fsrandom.split(key, 3)
        with torch.no_grad():
            ro = rollout(
                state.module("student"), like, stream.text, k_rollout,
                exits=exits_at(state, like.shape[2]), denoising_steps=steps,
                cache=stream.cache, context_time=context_time,
            )  # fmt: skip
        inputs = {
            "text": stream.text,
            "video": ro.video,
            "exit_inputs": ro.exit_inputs,
            "context_keys": ro.contexts[0].keys,  # every context reads this one buffer
            "context_values": ro.contexts[0].values,
            "context_frames": tuple(c.num_frames for c in ro.contexts),
            "context_slots": tuple(_Whole(c.slots) for c in ro.contexts),  # not split
            "frame_tokens": ro.cache.frame_tokens,
        }
        metrics: dict[str, Any] = {}
        if int(state.step) % generator_update_interval == 0:
            state, metrics = ctx.update(state, generator_unit, inputs, k_generator)
        state, critic_metrics = ctx.update(state, critic_unit, inputs, k_critic)
        moved = StreamState(
            cache=ro.cache,
            frames=torch.cat([stream.frames, ro.video.to(stream.frames.dtype)], 2)[
                :, :, -window_frames:
            ],
            text=stream.text,
            num_frames=stream.num_frames + like.shape[2],
        )
        metrics = {**metrics, **critic_metrics, f"{name}/frames": moved.num_frames}
        return state.replace(extra={**state.extra, name: moved}), metrics

    return managed(stream_step, trains=("student", "critic"), name=name, check=check_input)
