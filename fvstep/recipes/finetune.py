"""The ``finetune`` recipe: flow-matching fine-tuning (:func:`fvstep.methods.finetune`) of
the ``student``; with ``lora.rank`` above 0, a LoRA adapter over a frozen ``base`` role.

Examples:
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
from fvstep.recipes.options import LoRAOptions, RecipeOptions, RunOptions

__all__ = ["RECIPE", "FinetuneOptions", "build"]


@dataclass(frozen=True)
class FinetuneOptions(RecipeOptions):
    """The options of the ``finetune`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        t_sampling: How flow-matching times are drawn: ``"uniform"`` or ``"logit_normal"``.
        lora: LoRA adapters trained over a frozen base; ``rank: 0`` trains the whole model.
    """

    run: RunOptions = field(
        default_factory=lambda: RunOptions(out="runs/finetune", num_steps=10, every=5)
    )
    t_sampling: Literal["uniform", "logit_normal"] = "uniform"
    lora: LoRAOptions = field(default_factory=lambda: LoRAOptions(rank=0))


def build(options: FinetuneOptions, *, fresh: bool = True) -> RunSpec:
    """The fine-tuning run of ``options`` (``fresh``: :class:`~fvstep.recipes.Recipe`'s).

    Examples:
        >>> spec = build(FinetuneOptions(), fresh=True)
        >>> int(spec.state.step), spec.trained
        (0, ('student',))
    """
    parts.check_lora(options, required=False)
    device = parts.device_for(options.run)
    model = parts.load_transformer(options.model, device=device)
    mesh = parts.make_mesh(device)
    roles: dict[str, fs.Role] = {}
    if options.lora.rank:  # an adapter over a frozen base, as lora_dmd2's
        base, adapters = parts.lora_over_base(
            options, model.to(device), ("student",), fresh=fresh, mesh=mesh, base_role="base"
        )
        student = adapters["student"]
        roles["base"] = fs.Role(base, save_frozen=False)
    else:
        if parts.takes_init_weights(options, fresh=fresh):
            init_.init_from(options.init_from, {"student": model})
        student = parts.prepare_role(model.to(device), options.prepare, mesh, trainable=True)
    roles["student"] = parts.trained_role(student, options.optim)
    return parts.run_spec(
        options, roles, finetune(t_sampling=options.t_sampling), trained=("student",), device=device
    )


RECIPE = Recipe(
    "finetune",
    FinetuneOptions,
    build,
    summary="Flow-matching fine-tuning of a transformer (default: a tiny Wan on synthetic "
    "latents, on the CPU).",
)
