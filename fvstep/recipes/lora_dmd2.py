"""The ``lora_dmd2`` recipe: DMD2 with the ``student`` and the ``critic`` LoRA adapters
over one frozen base, the ``teacher``; adapters trained on another base are refused.

Examples:
    $ fvstep train lora_dmd2 --model.path Wan2.1-T2V-1.3B-Diffusers --data.path latents/ \\
          --lora.rank 64 --run.out runs/lora_dmd2
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fvstep.recipes import Recipe, RunSpec, parts
from fvstep.recipes.dmd2 import DMD2Options, dmd2_run_spec
from fvstep.recipes.options import LoRAOptions, OptimOptions, RunOptions

__all__ = ["RECIPE", "LoRADMD2Options", "build"]


@dataclass(frozen=True)
class LoRADMD2Options(DMD2Options):
    """The options of the ``lora_dmd2`` recipe: ``dmd2``'s, and the adapters.

    Attributes:
        lora: The adapters of the student and the critic.
    """

    optim: OptimOptions = field(default_factory=lambda: OptimOptions(lr=1e-3))
    run: RunOptions = field(default_factory=lambda: RunOptions(out="runs/lora_dmd2"))
    critic_lr: float = 1e-3
    lora: LoRAOptions = field(default_factory=LoRAOptions)


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
    base, lora = parts.lora_over_base(
        options,
        base,
        ("student", "critic"),
        fresh=fresh,
        mesh=parts.make_mesh(device),
        base_role="teacher",
    )
    roles = parts.dmd2_roles(options, lora["student"], base, lora["critic"])
    return dmd2_run_spec(options, roles, device=device)


RECIPE = Recipe(
    "lora_dmd2",
    LoRADMD2Options,
    build,
    summary="DMD2 with LoRA adapters (student, critic) over one frozen base (the teacher).",
)
