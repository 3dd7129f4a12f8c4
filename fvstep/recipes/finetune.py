"""The ``finetune`` recipe: flow-matching fine-tuning of one transformer (the student).

Roles: ``student`` (trained, AdamW, an EMA when ``optim.ema`` is set). With
``lora.rank`` above 0 the student is a peft LoRA adapter over a frozen ``base`` role (left
out of checkpoints by its digest, as in ``lora_dmd2``), and only the adapter trains. The
method is :func:`fvstep.methods.finetune`; the step accumulates ``run.microbatches``
micro-batches and clips at ``optim.clip``. With no options it trains the embedded tiny Wan
on synthetic latents on the CPU, in a few seconds.

Examples:
    $ fvstep train finetune --model.path Wan2.1-T2V-1.3B-Diffusers \\
          --data.path latents/ --optim.lr 1e-5 --run.num_steps 2000 --run.out runs/ft
    $ fvstep train finetune --model.path Wan2.1-T2V-14B-Diffusers --data.path latents/ \\
          --lora.rank 64 --optim.lr 1e-4 --run.out runs/lora_ft
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import fvstep as fs
from fvstep.methods import finetune
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

__all__ = ["RECIPE", "FinetuneOptions", "build"]


@dataclass(frozen=True)
class FinetuneOptions:
    """The options of the ``finetune`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        t_sampling: How flow-matching times are drawn: ``"uniform"`` or ``"logit_normal"``.
        lora: LoRA adapters trained over a frozen base; ``rank: 0`` trains the whole model.
    """

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    run: RunOptions = field(
        default_factory=lambda: RunOptions(out="runs/finetune", num_steps=10, every=5)
    )
    validation: ValidationOptions = field(default_factory=ValidationOptions)
    trackers: TrackerOptions = field(default_factory=TrackerOptions)
    init_from: InitFrom = field(default_factory=InitFrom)
    t_sampling: Literal["uniform", "logit_normal"] = "uniform"
    lora: LoRAOptions = field(default_factory=lambda: LoRAOptions(rank=0))


def build(options: FinetuneOptions, *, fresh: bool = True) -> RunSpec:
    """The fine-tuning run of ``options``.

    Args:
        options: The recipe's options.
        fresh: Whether the run starts afresh (then ``options.init_from`` with
            ``kind="weights"`` fills the student before it is sharded).

    Returns:
        The run's :class:`~fvstep.recipes.RunSpec`.

    Examples:
        >>> spec = build(FinetuneOptions(), fresh=True)
        >>> int(spec.state.step), spec.trained
        (0, ('student',))
    """
    parts.check_lora(options, required=False)
    device = parts.device_for(options.run)
    model = parts.load_transformer(options.model, device=device)
    source = options.init_from
    init_weights = fresh and source.path is not None and source.kind == "weights"
    mesh = parts.make_mesh(device)
    ema = fs.EMA(options.optim.ema) if options.optim.ema is not None else None
    roles: dict[str, fs.Role] = {}
    if options.lora.rank:  # an adapter over a frozen base, as lora_dmd2's
        base = model.to(device)
        student = parts.add_lora(base, options.lora, ("student",))["student"]
        base = parts.prepare_role(base, options.prepare, mesh, trainable=False)
        if init_weights and source.path is not None:
            init_.check_base_digest(source.path, base, base_role="base")
            init_.init_from(source, {"student": student})
        if mesh is not None:
            fs.parallel.shard_module(student, mesh=mesh)
        roles["base"] = fs.Role(base, save_frozen=False)
    else:
        if init_weights:
            init_.init_from(source, {"student": model})
        student = parts.prepare_role(model.to(device), options.prepare, mesh, trainable=True)
    roles["student"] = fs.Role(student, optimizer=parts.make_optimizer(options.optim), ema=ema)
    state = fs.TrainState.create(roles, key=fs.random.key(options.run.seed))
    return parts.run_spec(
        options, state, finetune(t_sampling=options.t_sampling), trained=("student",), device=device
    )


RECIPE = Recipe(
    "finetune",
    FinetuneOptions,
    build,
    summary="Flow-matching fine-tuning of a transformer (default: a tiny Wan on synthetic "
    "latents, on the CPU).",
)
"""The ``finetune`` recipe (``fvstep train finetune``)."""
