"""The ``dmd2`` recipe: DMD2 distillation of a few-step student from a frozen teacher.

Roles: ``student`` and ``critic`` (trained, each a copy of the model), ``teacher`` (the
model, frozen, left out of checkpoints by its digest: ``Role(save_frozen=False)``). The
method is :func:`fvstep.methods.dmd2`: the critic steps every step, the student every
``generator_update_interval`` steps (so ``run.num_steps`` counts steps, and the student's
schedule counts its own updates).

Examples:
    $ fvstep train dmd2 --model.path Wan2.1-T2V-1.3B-Diffusers --data.path latents/ \\
          --optim.lr 2e-6 --critic_lr 4e-6 --run.out runs/dmd2
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import fvstep as fs
from fvstep.methods import dmd2
from fvstep.observe.sampling import FewStepSampler
from fvstep.recipes import Recipe, RunSpec, parts
from fvstep.recipes import init as init_
from fvstep.recipes.options import (
    DataOptions,
    InitFrom,
    ModelOptions,
    OptimOptions,
    ParallelOptions,
    PrepareOptions,
    RunOptions,
    TrackerOptions,
    ValidationOptions,
)

__all__ = ["RECIPE", "DMD2Options", "build"]


@dataclass(frozen=True)
class DMD2Options:
    """The options of the ``dmd2`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        critic_lr: The critic's learning rate (its other optimizer options are ``optim``'s;
            it has no EMA).
        generator_update_interval: The student steps every this many steps.
        guidance_scale: The teacher's classifier-free guidance scale.
        ordering: ``"fused"`` (one student forward for both roles) or ``"sequential"``.
    """

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=lambda: OptimOptions(lr=2e-4))
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    run: RunOptions = field(default_factory=lambda: RunOptions(out="runs/dmd2"))
    validation: ValidationOptions = field(default_factory=ValidationOptions)
    trackers: TrackerOptions = field(default_factory=TrackerOptions)
    init_from: InitFrom = field(default_factory=InitFrom)
    critic_lr: float = 4e-4
    generator_update_interval: int = 2
    guidance_scale: float = 3.5
    ordering: Literal["fused", "sequential"] = "fused"


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
    student, critic = copy.deepcopy(teacher), copy.deepcopy(teacher)
    if fresh and options.init_from.path is not None and options.init_from.kind == "weights":
        init_.init_from(options.init_from, {"student": student, "critic": critic})
    mesh = parts.make_mesh(device)
    prepared = {
        name: parts.prepare_role(m.to(device), options.prepare, mesh, trainable=name != "teacher")
        for name, m in (("student", student), ("teacher", teacher), ("critic", critic))
    }
    ema = fs.EMA(options.optim.ema) if options.optim.ema is not None else None
    critic_optim = dataclasses.replace(options.optim, lr=options.critic_lr)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                prepared["student"], optimizer=parts.make_optimizer(options.optim), ema=ema
            ),
            "teacher": fs.Role(prepared["teacher"], save_frozen=False),
            "critic": fs.Role(prepared["critic"], optimizer=parts.make_optimizer(critic_optim)),
        },
        key=fs.random.key(options.run.seed),
    )
    return parts.run_spec(
        options,
        state,
        dmd2(
            generator_update_interval=options.generator_update_interval,
            guidance_scale=options.guidance_scale,
            ordering=options.ordering,
        ),
        trained=("student", "critic"),
        device=device,
        sampler=FewStepSampler((1.0,)),  # the student's schedule: dmd2's default, one step
    )


RECIPE = Recipe(
    "dmd2",
    DMD2Options,
    build,
    summary="DMD2 distillation: a few-step student, a frozen teacher and a trained critic.",
)
"""The ``dmd2`` recipe (``fvstep train dmd2``)."""
