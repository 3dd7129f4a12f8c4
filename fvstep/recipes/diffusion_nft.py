"""The ``diffusion_nft`` recipe: online RL of the ``student`` by DiffusionNFT
(:func:`fvstep.methods.diffusion_nft`); the ``old`` policy (and, with ``kl_weight > 0``, the
``reference``) a frozen copy of the starting student.

Examples:
    $ fvstep train diffusion_nft --model.path Wan2.1-T2V-1.3B-Diffusers --data.path latents/
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

import fvstep as fs
from fvstep.methods import SoftUpdate, diffusion_nft
from fvstep.methods.diffusion_nft import euler_rollout
from fvstep.methods.rewards import RewardFn, colorfulness, decoded, latent_mse_reward
from fvstep.recipes import Recipe, RunSpec, parts
from fvstep.recipes import init as init_
from fvstep.recipes.options import OptimOptions, RecipeOptions, RunOptions

__all__ = ["RECIPE", "DiffusionNFTOptions", "SoftUpdateOptions", "build"]


@dataclass(frozen=True)
class SoftUpdateOptions:
    """The old policy's decay at step ``i`` (:class:`fvstep.methods.SoftUpdate`):
    ``0`` before ``flat``, then ``min(rate (i - flat), max_decay)``.

    Attributes:
        rate: Growth of the decay per step.
        max_decay: Its cap, in ``[0, 1]``.
        flat: Steps of decay 0 (the old policy a copy of the student) first.
    """

    rate: float = 0.001
    max_decay: float = 0.5
    flat: int = 0


@dataclass(frozen=True)
class DiffusionNFTOptions(RecipeOptions):
    """The options of the ``diffusion_nft`` recipe (see :mod:`fvstep.recipes.options`).

    Attributes:
        reward: The reward (:mod:`fvstep.methods.rewards`): ``"latent_mse"`` or
            ``"colorfulness"`` (needs a pipeline folder's VAE at ``model.path``).
        group_size: Rollouts a prompt (>= 2); a step rolls out ``data.batch_size *
            group_size`` samples.
        rollout_steps: Euler steps of the old policy's rollouts.
        num_inner: Passes over the rollouts a step.
        minibatches: Optimizer steps a pass (divides ``data.batch_size * group_size``).
        beta: The loss's guidance strength.
        kl_weight: The weight of the loss's term toward a frozen ``reference`` copy of
            the starting student (``0``: no reference role).
        soft_update: The old policy's decay.
    """

    optim: OptimOptions = field(default_factory=lambda: OptimOptions(lr=3e-4))
    run: RunOptions = field(
        default_factory=lambda: RunOptions(out="runs/diffusion_nft", num_steps=10, every=5)
    )
    reward: Literal["latent_mse", "colorfulness"] = "latent_mse"
    group_size: int = 4
    rollout_steps: int = 10
    num_inner: int = 1
    minibatches: int = 1
    beta: float = 1.0
    kl_weight: float = 0.0
    soft_update: SoftUpdateOptions = field(default_factory=SoftUpdateOptions)


def _reward(options: DiffusionNFTOptions, device: torch.device) -> RewardFn:
    """The reward named by ``options.reward``."""
    if options.reward == "latent_mse":
        return latent_mse_reward
    path = options.model.path
    if path is None or not (Path(path) / "vae" / "config.json").is_file():
        raise ValueError(
            f"reward 'colorfulness' decodes videos and needs a VAE: model.path ({path!r}) must be a pipeline folder "
            "with a vae/ (save_tiny_pipeline writes a tiny one), or choose --reward latent_mse"
        )
    import diffusers

    from fvstep.executor.sampling import decode_latents

    vae = diffusers.AutoencoderKLWan.from_pretrained(str(path), subfolder="vae").to(device)
    return decoded(colorfulness, functools.partial(decode_latents, vae.eval()))


def build(options: DiffusionNFTOptions, *, fresh: bool = True) -> RunSpec:
    """The DiffusionNFT run of ``options``: the student (from ``model``, or ``init_from``
    on a fresh run), the old policy a copy of it, and a reference with ``kl_weight > 0``.

    Raises:
        ValueError: For settings out of range, or ``reward="colorfulness"`` without a
            pipeline folder's VAE (before any role is built).

    Examples:
        >>> spec = build(DiffusionNFTOptions(), fresh=True)
        >>> sorted(spec.state.roles), spec.trained
        (['old', 'student'], ('student',))
    """
    device = parts.device_for(options.run)
    method = diffusion_nft(
        reward_fn=_reward(options, device),
        group_size=options.group_size,
        num_inner=options.num_inner,
        minibatches=options.minibatches,
        beta=options.beta,
        kl_weight=options.kl_weight,
        soft_update=SoftUpdate(**dataclasses.asdict(options.soft_update)),
        rollout=euler_rollout(options.rollout_steps),
        policy="student",
    )
    student = parts.load_transformer(options.model, device=device)
    if parts.takes_init_weights(options, fresh=fresh):
        init_.init_from(options.init_from, {"student": student})
    frozen = {"old": copy.deepcopy(student)}  # copies of the starting student
    if options.kl_weight > 0:
        frozen["reference"] = copy.deepcopy(student)
    mesh = parts.make_mesh(device)
    # old blends toward the student in the student's storage dtype, never rounded to bf16
    in_place = dataclasses.replace(options.prepare, frozen_dtype=options.model.dtype)
    student = parts.prepare_role(student.to(device), options.prepare, mesh, trainable=True)
    roles = {"student": parts.trained_role(student, options.optim)}
    for name, module in frozen.items():
        prepare = in_place if name == "old" else options.prepare
        roles[name] = fs.Role(parts.prepare_role(module.to(device), prepare, mesh, trainable=False))
    return parts.run_spec(options, roles, method, trained=("student",), device=device)


RECIPE = Recipe(
    "diffusion_nft",
    DiffusionNFTOptions,
    build,
    summary="DiffusionNFT: online RL of the student by a reward (default: the stated latent "
    "reward), its rollouts by an old copy moved toward it.",
)
