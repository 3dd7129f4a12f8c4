"""The ``lora_dmd2`` recipe: DMD2 with LoRA adapters over one frozen base.

Roles: ``teacher`` (the base model, frozen, left out of checkpoints by its digest),
``student`` and ``critic`` (each a peft LoRA adapter over that one base:
:func:`fvstep.lora.add_adapters`). Checkpoints hold the adapters, their optimizer state
and EMA, and the base's digest; resuming on another base is refused, and so is
``init_from`` the adapters of a run made on another base.

Examples:
    $ fvstep train lora_dmd2 --model.path Wan2.1-T2V-1.3B-Diffusers --data.path latents/ \\
          --lora.rank 64 --run.out runs/lora_dmd2
"""

from __future__ import annotations

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
    LoRAOptions,
    ModelOptions,
    OptimOptions,
    ParallelOptions,
    PrepareOptions,
    RunOptions,
    TrackerOptions,
    ValidationOptions,
)

__all__ = ["RECIPE", "LoRADMD2Options", "build"]


@dataclass(frozen=True)
class LoRADMD2Options:
    """The options of the ``lora_dmd2`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        lora: The adapters of the student and the critic.
        critic_lr: The critic adapter's learning rate.
        generator_update_interval: The student steps every this many steps.
        guidance_scale: The teacher's classifier-free guidance scale.
        ordering: ``"fused"`` or ``"sequential"``.
    """

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=lambda: OptimOptions(lr=1e-3))
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    run: RunOptions = field(default_factory=lambda: RunOptions(out="runs/lora_dmd2"))
    validation: ValidationOptions = field(default_factory=ValidationOptions)
    trackers: TrackerOptions = field(default_factory=TrackerOptions)
    init_from: InitFrom = field(default_factory=InitFrom)
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    critic_lr: float = 1e-3
    generator_update_interval: int = 2
    guidance_scale: float = 3.5
    ordering: Literal["fused", "sequential"] = "fused"


def build(options: LoRADMD2Options, *, fresh: bool = True) -> RunSpec:
    """The LoRA DMD2 run of ``options``.

    Examples:
        >>> spec = build(LoRADMD2Options(), fresh=True)
        >>> spec.trained
        ('student', 'critic')
    """
    parts.check_lora(options, required=True)
    device = parts.device_for(options.run)
    base = parts.load_transformer(options.model, device=device).to(device)
    lora = parts.add_lora(base, options.lora, ("student", "critic"))
    mesh = parts.make_mesh(device)
    base = parts.prepare_role(base, options.prepare, mesh, trainable=False)
    source = options.init_from
    if fresh and source.path is not None and source.kind == "weights":
        init_.check_base_digest(source.path, base)  # adapters fit only their own base
        init_.init_from(source, dict(lora))
    if mesh is not None:
        for module in lora.values():
            fs.parallel.shard_module(module, mesh=mesh)
    ema = fs.EMA(options.optim.ema) if options.optim.ema is not None else None
    critic_optim = dataclasses.replace(options.optim, lr=options.critic_lr)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                lora["student"], optimizer=parts.make_optimizer(options.optim), ema=ema
            ),
            "teacher": fs.Role(base, save_frozen=False),
            "critic": fs.Role(lora["critic"], optimizer=parts.make_optimizer(critic_optim)),
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
    "lora_dmd2",
    LoRADMD2Options,
    build,
    summary="DMD2 with LoRA adapters (student, critic) over one frozen base (the teacher).",
)
"""The ``lora_dmd2`` recipe (``fvstep train lora_dmd2``)."""
