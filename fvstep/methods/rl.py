"""An RL-style managed step (DiffusionNFT / GRPO flavoured, deliberately simple).

Roles: ``student`` (trained), ``old`` (frozen; samples, then is blended toward the
student) and ``reference`` (frozen; the KL anchor). One outer step (:func:`rl`): sample
``group_size`` videos a prompt with the old policy, turn their rewards into per-group
advantages, update the student ``num_inner`` times on :func:`rl_inner_loss`, blend.
"""

from __future__ import annotations

from typing import Any

import torch

from fvstep.core import random as fsrandom
from fvstep.core.accumulation import Accumulation
from fvstep.core.grads import ClipGradNorm, Sanitize
from fvstep.core.managed import Managed, ManagedContext, managed
from fvstep.core.settings import UNSET, Unset
from fvstep.core.state import TrainState
from fvstep.core.steps import update
from fvstep.methods import _noise
from fvstep.methods._checks import check_batch, check_count
from fvstep.methods.finetune import RoleLossFn, sample_x_t
from fvstep.methods.models import predict
from fvstep.methods.old_policy import (
    blend_,
    euler_sample,
    reference_kl,
    run_inner_updates,
)
from fvstep.methods.rewards import (
    RewardFn,
    check_rewards,
    group_advantages,
    group_batch,
    latent_mse_reward,
)

__all__ = ["rl", "rl_inner_loss"]


def rl_inner_loss(
    *, kl_weight: float = 0.1, student: str = "student", reference: str = "reference"
) -> RoleLossFn:
    """The inner loss: advantage-weighted flow matching on samples, plus a KL-like anchor.

    The batch holds ``"samples"`` (``x0``, no gradient), ``"text"`` and ``"advantages"``
    ``(N,)``; the loss is ``mean(A_i fm_i) + kl_weight *``
    :func:`~fvstep.methods.old_policy.reference_kl`, ``fm_i`` sample ``i``'s flow-matching error.

    Returns:
        ``loss_fn(state, batch, key) -> (loss, {"policy_loss", "kl"})``.

    Raises:
        ValueError: If ``kl_weight < 0``.
    """
    if not kl_weight >= 0:
        raise ValueError(f"kl_weight must be >= 0, got {kl_weight}")

    def loss_fn(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        batch = check_batch(state, batch, student, video="samples", required=("advantages",))
        x0, text, adv = batch["samples"], batch["text"], batch["advantages"]
        t, eps, x_t = sample_x_t(key, x0)
        v = predict(state.module(student), x_t, t * 1000, text).float()
        per_sample = ((v - (eps - x0).float()) ** 2).flatten(1).mean(1)
        policy = (adv.float() * per_sample).mean()
        kl = reference_kl(state, reference, v, x_t, t * 1000, text, kl_weight)
        loss = policy + kl_weight * kl
        return loss, {"policy_loss": policy.detach(), "kl": kl.detach()}

    return loss_fn


def rl(
    *,
    num_inner: int = 2,
    blend: float = 0.9,
    kl_weight: float = 0.1,
    group_size: int = 2,
    sample_steps: int = 2,
    reward_fn: RewardFn | None = None,
    accumulation: Accumulation | None = None,
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
    name: str = "rl",
) -> Managed:
    """The RL outer step as a managed method (see the module docstring).

    Batches need ``"text"`` ``(B, L, D)`` and ``"latents"`` (the samples' shape, and the
    default reward's target).

    Args:
        num_inner: Inner student updates per outer step.
        blend: ``beta`` of ``old = beta * old + (1 - beta) * student`` (in ``[0, 1]``).
        kl_weight: Weight of the reference term of :func:`rl_inner_loss`.
        group_size: Samples per prompt (>= 2); advantages are normalised within a group.
        sample_steps: Euler steps of the old policy's sampler.
        reward_fn: A :class:`~fvstep.methods.rewards.RewardFn`; default
            :func:`~fvstep.methods.rewards.latent_mse_reward`.
        accumulation: Micro-batching of the inner updates; default the compiled step's.
        clip: And ``sanitize``: the inner unit's (default: the compile-wide settings).
        name: The managed step's name and metrics prefix.

    Returns:
        ``fvstep.managed(outer_step, trains="student", mutates="old", name=name)``.

    Raises:
        ValueError: For out-of-range settings.

    Examples:
        >>> step = fvstep.compile(rl(num_inner=2, accumulation=fvstep.Accumulation(2)))
        >>> [e.roles for e in fvstep.plan(step, 0)]
        [('student',)]
    """
    check_count(num_inner, "num_inner")
    if not 0.0 <= blend <= 1.0:
        raise ValueError(f"blend must be in [0, 1], got {blend}")
    check_count(group_size, "group_size", 2)
    check_count(sample_steps, "sample_steps")
    reward = reward_fn or latent_mse_reward
    unit = update(
        "student",
        rl_inner_loss(kl_weight=kl_weight),
        clip=clip,
        sanitize=sanitize,
        name=f"{name}_inner",
    )

    def outer_step(
        state: TrainState, batch: Any, key: torch.Tensor, ctx: ManagedContext
    ) -> tuple[TrainState, dict[str, Any]]:
        batch = check_batch(state, batch, "old")
        k_noise, k_scope, k_inner = fsrandom.split(key, 3)
        grouped = group_batch(batch, group_size)
        text, like = grouped["text"], grouped["latents"]
        noise = _noise.randn_like(k_noise, like)
        with torch.no_grad(), fsrandom.rng_scope(k_scope):
            samples = euler_sample(state.module("old"), noise, text, sample_steps)
            rewards = check_rewards(reward(samples, grouped), samples.shape[0])
        advantages = group_advantages(rewards.float(), group_size)
        inner_batch = {"samples": samples, "text": text, "advantages": advantages}
        parts = ((inner_batch, fsrandom.fold_in(k_inner, i)) for i in range(num_inner))
        state, metrics, inner_loss = run_inner_updates(
            ctx, state, unit, parts, role="student", accumulation=accumulation
        )
        blend_(state.roles["old"].params, state.roles["student"].params, blend)
        metrics[f"{name}/reward_mean"] = rewards.float().mean()
        metrics[f"{name}/reward_std"] = rewards.float().std(unbiased=False)
        metrics[f"{name}/inner_loss_mean"] = inner_loss
        return state, metrics

    return managed(outer_step, trains="student", mutates="old", name=name)
