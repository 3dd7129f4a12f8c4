"""The ``self_forcing`` recipe: a causal ``student`` (a causal copy of the model) trained by
DMD on its own chunked rollouts (:func:`fvstep.methods.self_forcing`), as ``dmd2``'s roles.

Examples:
    $ fvstep train self_forcing --model.path Wan2.1-T2V-1.3B-Diffusers \\
          --data.path latents/ --chunk_frames 3 --optim.lr 2e-6 --critic_lr 4e-7
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.methods import make_causal, self_forcing, self_forcing_losses
from fvstep.methods.causal_rollout import shifted_steps
from fvstep.recipes import Recipe, RunSpec, parts
from fvstep.recipes.options import DataOptions, OptimOptions, RecipeOptions, RunOptions

__all__ = [
    "RECIPE",
    "SelfForcingOptions",
    "build",
    "causal_roles",
    "check_latent_frames",
    "student_cache_dtype",
]


@dataclass(frozen=True)
class SelfForcingOptions(RecipeOptions):
    """The options of the ``self_forcing`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        chunk_frames: Latent frames a chunk of the causal student (the latents' frames
            must be a multiple of it; Self-Forcing's Wan2.1 uses 3).
        critic_lr: The critic's learning rate (its other optimizer options are ``optim``'s;
            it has no EMA).
        generator_update_interval: The student steps every this many steps.
        denoising_steps: The student's few-step schedule, decreasing in ``(0, 1]``,
            before ``denoising_shift``.
        denoising_shift: Warps the schedule, ``shift t / (1 + (shift - 1) t)`` (``1``:
            as given; Self-Forcing's Wan2.1 uses 5).
        guidance_scale: The teacher's classifier-free guidance scale.
    """

    data: DataOptions = field(default_factory=lambda: DataOptions(latent_shape=(4, 6, 4, 4)))
    optim: OptimOptions = field(default_factory=lambda: OptimOptions(lr=2e-4))
    run: RunOptions = field(
        default_factory=lambda: RunOptions(out="runs/self_forcing", num_steps=10, every=5)
    )
    chunk_frames: int = 3
    critic_lr: float = 4e-4
    generator_update_interval: int = 2
    denoising_steps: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
    denoising_shift: float = 5.0
    guidance_scale: float = 3.0


def check_latent_frames(data: DataOptions, chunk_frames: int) -> None:
    """Refuse (``ValueError``) latents whose frames are not a multiple of the causal
    student's chunk: the synthetic ``data.latent_shape``, or every item's shape in the
    index of the dataset at ``data.path`` (no tensor is read)."""
    if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
        raise ValueError(f"chunk_frames must be an int >= 1, got {chunk_frames!r}")
    if data.path is None:
        frames, where = {data.latent_shape[1]}, f"data.latent_shape {data.latent_shape}"
    else:
        from fvstep.executor.latents import LatentDataset

        shapes = LatentDataset(data.path, fields=("latents",)).shapes
        frames, where = {s["latents"][1] for s in shapes}, f"the dataset at {data.path!r}"
    odd = sorted(f for f in frames if f % chunk_frames)
    if odd:
        raise ValueError(
            f"{where} has latents of {odd[0]} frames, not a multiple of chunk_frames={chunk_frames}: "
            "set --chunk_frames to a divisor of the frames (1 always fits)"
        )


def causal_roles(options: Any, *, fresh: bool, device: torch.device) -> dict[str, fs.Role]:
    """The prepared roles of the causal recipes: the frozen ``teacher``, a causal copy of it
    as ``student`` and a plain copy as ``critic`` (both from ``init_from`` on a fresh run)."""
    teacher = parts.load_transformer(options.model, device=device)
    student = make_causal(copy.deepcopy(teacher), chunk_frames=options.chunk_frames)
    return parts.copied_roles(options, teacher, student, fresh=fresh, device=device)


def student_cache_dtype(roles: dict[str, fs.Role]) -> torch.dtype | None:
    """The student's compute dtype, which its KV cache keeps (the keys are computed in it)."""
    prepared = fsp.preparation(roles["student"].module)
    return None if prepared is None else prepared.param_dtype


def build(options: SelfForcingOptions, *, fresh: bool = True) -> RunSpec:
    """The self-forcing run of ``options``: a causal student and a critic, both copies of
    the teacher (or from ``init_from`` on a fresh run).

    Raises:
        ValueError: If the latents' frames are not a multiple of ``chunk_frames``, or for
            the method's settings out of range (before any role is built).

    Examples:
        >>> spec = build(SelfForcingOptions(), fresh=True)
        >>> sorted(spec.state.roles), spec.trained
        (['critic', 'student', 'teacher'], ('student', 'critic'))
    """
    check_latent_frames(options.data, options.chunk_frames)
    steps = shifted_steps(options.denoising_steps, options.denoising_shift)
    self_forcing_losses(denoising_steps=steps, guidance_scale=options.guidance_scale)  # checks
    device = parts.device_for(options.run)
    roles = causal_roles(options, fresh=fresh, device=device)
    method = self_forcing(
        generator_update_interval=options.generator_update_interval,
        denoising_steps=steps,
        guidance_scale=options.guidance_scale,
        cache_dtype=student_cache_dtype(roles),
    )
    return parts.distilled_run_spec(options, roles, method, steps=steps, device=device)


RECIPE = Recipe(
    "self_forcing",
    SelfForcingOptions,
    build,
    summary="Self-forcing: a causal student trained by DMD on its own chunk-by-chunk "
    "rollouts, with a frozen teacher and a trained critic.",
)
