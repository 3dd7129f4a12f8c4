"""Streaming self-forcing: one long rollout spans several steps, its state in ``TrainState.extra``.

Each step continues the stream of the step before: the causal student generates the next
``F`` latent frames (``batch["latents"]``'s shape, a multiple of the chunk) chunk by chunk
from the stream's KV cache (:func:`fvstep.methods.causal_rollout.rollout`), the student
and critic train on them by the DMD losses of :mod:`fvstep.methods.self_forcing`, and the
stream moves on. What the stream keeps between steps is a :class:`StreamState` under
``state.extra[name]``, so it is checkpointed and restored like every other leaf; no
module or Python object holds any of it:

- ``cache``: a rolling :class:`~fvstep.methods.causal_wan.KVCache` of
  ``sink_frames + window_frames`` frames: the stream's first ``sink_frames`` frames (an
  attention sink, kept for the whole stream) and its latest ``window_frames``;
- ``frames``: the latest ``window_frames`` generated latent frames, oldest first (zeros
  before the stream has made them): the stream's tail, for validation and decoding;
- ``text``: the stream's prompt (``batch["text"]`` of the step that started it);
- ``num_frames``: 0-d int64, the frames the stream has generated.

A stream starts (empty cache, the batch's text) at every step ``i`` with
``i % steps_per_stream == 0``: a pure function of the step, so a resumed run restarts its
streams where the uninterrupted one did. Within a step: the rollout runs without
gradient on the whole per-rank batch; the generator unit recomputes the chunks from their
exit steps with gradient (:func:`~fvstep.methods.causal_rollout.regenerate`: one more
forward a chunk, the same frames) and trains the student by the DMD loss; the critic
trains on the detached frames. Both units split their inputs (exit inputs, contexts,
frames) into the step's micro-batches like any batch.

**Per rank.** Each data-parallel rank runs its own stream (its own samples, noise and
text), so the leaves of ``extra[name]`` differ between ranks and are saved per rank
(:mod:`fvstep.checkpoint`). Such a checkpoint resumes on the same world size only: on
another one, loading raises ``CheckpointError`` (the streams cannot be split or merged
between ranks); start new streams instead (a fresh ``extra``). Exit steps come from the
shared key (the same on every rank, :func:`~fvstep.methods.causal_rollout.exit_steps`);
every other draw from the managed step's key, per rank: ``split(key, 3) = (rollout,
generator, critic)``.

Examples:
    >>> student = make_causal(tiny_wan(seed=0), chunk_frames=1)
    >>> batch = synthetic_batch(fvstep.random.key(0), batch_size=2, frames=1)
    >>> stream = init_stream(student, batch, window_frames=2, sink_frames=1)
    >>> state = fvstep.TrainState.create(roles, key=fvstep.random.key(0),
    ...                                  extra={"stream": stream})
    >>> step = fvstep.compile(streaming(steps_per_stream=4, window_frames=2, sink_frames=1))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fvstep import random as fsrandom
from fvstep.core.managed import Managed, managed
from fvstep.core.steps import update
from fvstep.methods.causal_rollout import exit_steps, regenerate, rollout, shifted_steps
from fvstep.methods.causal_wan import KVCache, chunk_frames_of, init_cache
from fvstep.methods.self_forcing import critic_loss_on, dmd_loss_on
from fvstep.state import TrainState
from fvstep.tree import frozen

__all__ = ["StreamState", "init_stream", "streaming"]


@frozen
class StreamState:
    """A stream's state between steps (see the module docstring).

    Attributes:
        cache: The rolling KV cache (sink, then the latest frames).
        frames: ``(B, C, window_frames, H, W)``: the latest generated frames.
        text: ``(B, L, D)``: the stream's prompt.
        num_frames: 0-d int64: frames generated in this stream.
    """

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
        student: The causal student (:func:`fvstep.methods.causal_wan.make_causal`).
        batch: A batch of the run: ``"latents"`` (a step's frames) and ``"text"``.
        window_frames: The latest frames the cache and ``frames`` keep; at least a step's.
        sink_frames: The stream's first frames the cache keeps for the whole stream.
        cache_dtype: The cache's dtype (:func:`~fvstep.methods.causal_wan.init_cache`'s
            ``dtype``; e.g. ``torch.bfloat16`` for a run under bf16 autocast, where the
            keys are computed in bf16: half the memory, the same attention).

    Returns:
        A :class:`StreamState` holding no frame.

    Raises:
        ValueError: If the window is smaller than a step's frames or the chunk, or the
            student is not causal.

    Examples:
        >>> stream = init_stream(student, batch, window_frames=6, sink_frames=3)
    """
    like, text = batch["latents"], batch["text"]
    chunk = chunk_frames_of(student)
    if window_frames < max(like.shape[2], chunk):
        raise ValueError(
            f"window_frames={window_frames} must hold a step's {like.shape[2]} frames "
            f"and a chunk of {chunk}"
        )
    batch_size, channels, _, height, width = like.shape
    return StreamState(
        cache=init_cache(
            student,
            like,
            capacity_frames=sink_frames + window_frames,
            sink_frames=sink_frames,
            dtype=cache_dtype,
        ),
        frames=like.new_zeros((batch_size, channels, window_frames, height, width)),
        text=torch.zeros_like(text),
        num_frames=torch.zeros((), dtype=torch.int64),
    )


def _restarted(stream: StreamState, text: torch.Tensor) -> StreamState:
    cache = stream.cache
    return StreamState(
        cache=KVCache(
            keys=torch.zeros_like(cache.keys),
            values=torch.zeros_like(cache.values),
            num_frames=torch.zeros_like(cache.num_frames),
            frame_tokens=cache.frame_tokens,
            sink_frames=cache.sink_frames,
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
    state needs ``extra[name]`` from :func:`init_stream` with the same window and sink.

    Args:
        steps_per_stream: A stream starts at every step ``i % steps_per_stream == 0``.
        window_frames: The latest frames the stream keeps (as :func:`init_stream`'s).
        sink_frames: The stream's first frames its cache keeps (as :func:`init_stream`'s).
        generator_update_interval: The student trains at ``i % n == 0``; the critic at
            every step.
        denoising_steps: The student's few-step schedule.
        guidance_scale: The teacher's classifier-free guidance scale.
        shift: The score timestep shift.
        min_ratio: Lower clamp of the score time.
        max_ratio: Upper clamp of the score time.
        context_time: Time of the cache's context pass (0: clean chunks).
        name: The key of the stream in ``state.extra``, and the managed step's name.

    Returns:
        A managed step that trains ``student`` and ``critic``.

    Raises:
        ValueError: For out-of-range settings; at a step, if ``state.extra`` has no
            stream of this shape.

    Examples:
        >>> step = fvstep.compile(streaming(steps_per_stream=8, window_frames=6),
        ...                       accumulation=fvstep.Accumulation(2))
    """
    for label, value, low in (
        ("steps_per_stream", steps_per_stream, 1),
        ("window_frames", window_frames, 1),
        ("sink_frames", sink_frames, 0),
        ("generator_update_interval", generator_update_interval, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an int >= {low}, got {value!r}")
    steps = tuple(float(s) for s in denoising_steps)
    score: dict[str, Any] = {"shift": shift, "min_ratio": min_ratio, "max_ratio": max_ratio}
    capacity = sink_frames + window_frames

    def exits_at(state: TrainState, frames: int) -> tuple[int, ...]:
        chunk = chunk_frames_of(state.module("student"))
        return exit_steps(state.key, int(state.step), frames // chunk, len(steps))

    def generator_loss(
        state: TrainState, inputs: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        exits = exits_at(state, inputs["video"].shape[2])
        contexts = [
            KVCache(
                keys=k,
                values=v,
                num_frames=n,
                frame_tokens=k.shape[2] // capacity,
                sink_frames=sink_frames,
            )
            for k, v, n in zip(
                inputs["context_keys"],
                inputs["context_values"],
                inputs["context_frames"],
                strict=True,
            )
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

    def stream_step(
        state: TrainState, batch: Any, key: torch.Tensor, ctx: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        stream = state.extra.get(name)
        if not isinstance(stream, StreamState) or stream.cache.capacity_frames != capacity:
            raise ValueError(
                f"streaming needs state.extra[{name!r}] = init_stream(student, batch, "
                f"window_frames={window_frames}, sink_frames={sink_frames}), got "
                f"{type(stream).__name__}"
            )
        step = int(state.step)
        if step % steps_per_stream == 0:
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
            "context_keys": tuple(c.keys for c in ro.contexts),
            "context_values": tuple(c.values for c in ro.contexts),
            "context_frames": tuple(c.num_frames for c in ro.contexts),
        }
        metrics: dict[str, Any] = {}
        if step % generator_update_interval == 0:
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

    return managed(stream_step, trains=("student", "critic"), name=name)
