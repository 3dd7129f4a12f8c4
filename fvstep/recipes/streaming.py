"""The ``streaming`` recipe: self-forcing on a long rollout that spans several steps
(:func:`fvstep.methods.streaming`), the stream in ``state.extra["stream"]``.

Examples:
    $ fvstep train streaming --model.path Wan2.1-T2V-1.3B-Diffusers --data.path latents/ \\
          --window_frames 21 --sink_frames 3 --steps_per_stream 8
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from fvstep import parallel as fsp
from fvstep.methods import init_stream, streaming
from fvstep.methods.causal_rollout import shifted_steps
from fvstep.recipes import Recipe, RunSpec, parts
from fvstep.recipes.options import DataOptions, RunOptions
from fvstep.recipes.self_forcing import (
    SelfForcingOptions,
    causal_roles,
    check_latent_frames,
    student_cache_dtype,
)

__all__ = ["RECIPE", "StreamingOptions", "build"]


@dataclass(frozen=True)
class StreamingOptions(SelfForcingOptions):
    """The options of the ``streaming`` recipe: ``self_forcing``'s, and the stream's.

    Attributes:
        window_frames: The latest frames the stream's cache keeps (a multiple of
            ``chunk_frames``, at least a step's frames).
        sink_frames: The stream's first frames its cache keeps for the whole stream.
        steps_per_stream: A new stream starts at every step ``i % steps_per_stream == 0``.
    """

    data: DataOptions = field(default_factory=lambda: DataOptions(latent_shape=(4, 3, 4, 4)))
    run: RunOptions = field(
        default_factory=lambda: RunOptions(out="runs/streaming", num_steps=10, every=5)
    )
    generator_update_interval: int = 1
    window_frames: int = 6
    sink_frames: int = 3
    steps_per_stream: int = 4


def _first_batch(options: StreamingOptions, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's batch of step 0 on ``device``, as the run's data gives it (read in this
    process: no workers)."""
    source = parts.make_data(
        dataclasses.replace(options.data, num_workers=0),
        held_out=options.validation.num_samples,
    )
    try:
        rank, world = fsp.rank_and_world()
        batch = source.batch(0, rank=rank, world_size=world)
    finally:
        parts.close_data(source)
    return {k: batch[k].to(device) for k in ("latents", "text")}


def build(options: StreamingOptions, *, fresh: bool = True) -> RunSpec:
    """The streaming run of ``options``: the roles of ``self_forcing`` and an empty stream.

    Raises:
        ValueError: If the latents' frames are not a multiple of ``chunk_frames``, the
            window does not hold a step's frames, or for the method's settings out of
            range (before any role is built).

    Examples:
        >>> spec = build(StreamingOptions(), fresh=True)
        >>> sorted(spec.state.extra), int(spec.state.extra["stream"].num_frames)
        (['stream'], 0)
    """
    check_latent_frames(options.data, options.chunk_frames)
    steps = shifted_steps(options.denoising_steps, options.denoising_shift)
    method = streaming(
        steps_per_stream=options.steps_per_stream,
        window_frames=options.window_frames,
        sink_frames=options.sink_frames,
        generator_update_interval=options.generator_update_interval,
        denoising_steps=steps,
        guidance_scale=options.guidance_scale,
    )
    device = parts.device_for(options.run)
    roles = causal_roles(options, fresh=fresh, device=device)
    stream = init_stream(
        roles["student"].module,
        _first_batch(options, device),
        window_frames=options.window_frames,
        sink_frames=options.sink_frames,
        cache_dtype=student_cache_dtype(roles),
    )
    extra = {"stream": stream}
    return parts.distilled_run_spec(options, roles, method, steps=steps, device=device, extra=extra)


RECIPE = Recipe(
    "streaming",
    StreamingOptions,
    build,
    summary="Streaming self-forcing: one long rollout across steps, its KV cache in the "
    "state (TrainState.extra), with a frozen teacher and a trained critic.",
)
