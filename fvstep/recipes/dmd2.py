"""The ``dmd2`` recipe: DMD2 distillation (:func:`fvstep.methods.dmd2`) of a few-step
``student`` from a frozen ``teacher``, with a trained ``critic`` (both copies of the model).

Examples:
    $ fvstep train dmd2 --model.path Wan2.1-T2V-1.3B-Diffusers --data.path latents/ \\
          --optim.lr 2e-6 --critic_lr 4e-6 --run.out runs/dmd2
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

import fvstep as fs
from fvstep.methods import dmd2
from fvstep.recipes import Recipe, RunSpec, parts
from fvstep.recipes.options import OptimOptions, RecipeOptions, RunOptions

__all__ = ["RECIPE", "DMD2Options", "build", "dmd2_run_spec"]


@dataclass(frozen=True)
class DMD2Options(RecipeOptions):
    """The options of the ``dmd2`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        critic_lr: The critic's learning rate (its other optimizer options are ``optim``'s;
            it has no EMA).
        generator_update_interval: The student steps every this many steps.
        guidance_scale: The teacher's classifier-free guidance scale.
        ordering: ``"fused"`` (one student forward for both roles) or ``"sequential"``.
    """

    optim: OptimOptions = field(default_factory=lambda: OptimOptions(lr=2e-4))
    run: RunOptions = field(default_factory=lambda: RunOptions(out="runs/dmd2"))
    critic_lr: float = 4e-4
    generator_update_interval: int = 2
    guidance_scale: float = 3.5
    ordering: Literal["fused", "sequential"] = "fused"


def dmd2_run_spec(options: Any, roles: dict[str, fs.Role], *, device: torch.device) -> RunSpec:
    """The run of DMD2 over ``roles`` (``student``, ``teacher``, ``critic``), as the
    ``dmd2`` and ``lora_dmd2`` recipes make it."""
    method = dmd2(
        generator_update_interval=options.generator_update_interval,
        guidance_scale=options.guidance_scale,
        ordering=options.ordering,
    )
    # the student's schedule: dmd2's default, one step
    return parts.distilled_run_spec(options, roles, method, steps=(1.0,), device=device)


def build(options: DMD2Options, *, fresh: bool = True) -> RunSpec:
    """The DMD2 run of ``options``: student and critic start as copies of the teacher
    (or from ``init_from`` on a fresh run).

    Examples:
        >>> spec = build(DMD2Options(), fresh=True)
        >>> sorted(spec.state.roles), spec.trained
        (['critic', 'student', 'teacher'], ('student', 'critic'))
    """
    device = parts.device_for(options.run)
    teacher = parts.load_transformer(options.model, device=device)
    roles = parts.copied_roles(options, teacher, copy.deepcopy(teacher), fresh=fresh, device=device)
    return dmd2_run_spec(options, roles, device=device)


RECIPE = Recipe(
    "dmd2",
    DMD2Options,
    build,
    summary="DMD2 distillation: a few-step student, a frozen teacher and a trained critic.",
)
