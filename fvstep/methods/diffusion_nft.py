"""DiffusionNFT (Zheng et al. 2025): online RL of a flow-matching model on the forward process.

Roles: ``policy`` (trained), ``old`` (frozen: it samples the rollouts and is moved toward
the policy after each outer step) and, for the optional KL term, a frozen ``reference``.
The outer step, equations, defaults and errors: ``docs/methods/diffusion_nft.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.accumulation import Accumulation
from fvstep.core.grads import ClipGradNorm, Sanitize
from fvstep.core.managed import Managed, ManagedContext, managed
from fvstep.core.settings import UNSET, Unset
from fvstep.core.state import TrainState
from fvstep.core.steps import update
from fvstep.methods import _noise
from fvstep.methods._checks import cast_batch, check_batch, check_count
from fvstep.methods.diffusion_nft_loss import Weighting, nft_loss
from fvstep.methods.finetune import TSampling
from fvstep.methods.old_policy import blend_, euler_sample, run_inner_updates
from fvstep.methods.rewards import (
    GroupStd,
    RewardFn,
    check_rewards,
    group_batch,
    optimality_probabilities,
)

__all__ = [
    "RolloutFn",
    "SoftUpdate",
    "diffusion_nft",
    "euler_rollout",
]

RolloutFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rollout(module, noise, text, key) -> x0``: any sampler, run under ``torch.no_grad()``
(e.g. ``lambda m, noise, text, key: sample(m, noise, text, sampler=EulerSampler(10),
key=key)`` of :func:`fvstep.executor.sampling.sample`)."""


def euler_rollout(num_steps: int = 10) -> RolloutFn:
    """:func:`~fvstep.methods.old_policy.euler_sample` without gradient (the key is not read).

    Raises:
        ValueError: If ``num_steps < 1``.
    """
    check_count(num_steps, "num_steps")

    def rollout(
        module: nn.Module, noise: torch.Tensor, text: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            return euler_sample(module, noise, text, num_steps)

    return rollout


@attrs.frozen
class SoftUpdate:
    """The old policy's decay ``eta`` at outer step ``i``: ``0`` before ``flat``, then
    ``min(rate (i - flat), max_decay)`` (``docs/methods/diffusion_nft.md``, step 4).

    Raises:
        ValueError: If ``rate < 0``, ``max_decay`` is not in ``[0, 1]`` or ``flat < 0``.
    """

    rate: float = 0.001
    max_decay: float = 0.5
    flat: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.rate >= 0:
            raise ValueError(f"SoftUpdate rate must be >= 0, got {self.rate}")
        if not 0.0 <= self.max_decay <= 1.0:
            raise ValueError(f"SoftUpdate max_decay must be in [0, 1], got {self.max_decay}")
        check_count(self.flat, "SoftUpdate flat", 0)

    def __call__(self, step: int) -> float:
        """``eta`` at outer step ``step``."""
        if step < self.flat:
            return 0.0
        return min(self.rate * (step - self.flat), self.max_decay)


def diffusion_nft(
    *,
    reward_fn: RewardFn,
    group_size: int = 4,
    num_inner: int = 1,
    minibatches: int = 1,
    beta: float = 1.0,
    std: GroupStd = "group",
    clip_max: float = 5.0,
    weighting: Weighting = "adaptive",
    kl_weight: float = 0.0,
    soft_update: SoftUpdate | Callable[[int], float] = SoftUpdate(),
    rollout: RolloutFn | None = None,
    latent_shape: Sequence[int] | None = None,
    t_sampling: TSampling = "uniform",
    accumulation: Accumulation | None = None,
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
    policy: str = "policy",
    old: str = "old",
    reference: str = "reference",
    name: str = "diffusion_nft",
) -> Managed:
    """DiffusionNFT's outer step as a managed method (see the module docstring).

    Batches need ``"text"`` ``(B, L, D)`` and either ``"latents"`` (only their shape is
    read) or ``latent_shape``; the rollout and the reward see the batch repeated per
    sample (:func:`~fvstep.methods.rewards.group_batch`). The loss options are
    :func:`~fvstep.methods.diffusion_nft_loss.nft_loss`'s, ``std`` and ``clip_max``
    :func:`~fvstep.methods.rewards.optimality_probabilities`'.

    Args:
        reward_fn: ``(samples, batch) -> (N,)`` (:mod:`fvstep.methods.rewards`).
        group_size: Samples per prompt (>= 2).
        num_inner: Passes over the rollouts per outer step.
        minibatches: Optimizer steps per pass (divides ``B * group_size``).
        soft_update: ``eta`` of the old policy as a function of the outer step.
        rollout: The sampler (default ``euler_rollout(10)``).
        latent_shape: ``(C, F, H, W)`` of a sample, when the batch has no ``"latents"``.
        accumulation: Micro-batching of the inner updates; default the compiled step's.
        clip: And ``sanitize``: the inner unit's (default: the compile-wide settings).
        name: The managed step's name and metrics prefix.

    Returns:
        ``fvstep.managed(outer_step, trains=policy, mutates=old, name=name)``.

    Raises:
        ValueError: For out-of-range settings; at a step, before it changes anything, for
            what ``docs/methods/diffusion_nft.md`` (Errors) lists.
        TypeError: If ``reward_fn`` is not callable.
        StepFailedError: At a step, after it has started (the input state is consumed),
            for a reward that :func:`~fvstep.methods.rewards.check_rewards` refuses.

    Examples:
        >>> step = fvstep.compile(diffusion_nft(reward_fn=reward, group_size=4, num_inner=2),
        ...                       accumulation=fvstep.Accumulation(2))
        >>> [e.roles for e in fvstep.plan(step, 0)]
        [('policy',)]
    """
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
    check_count(group_size, "group_size", 2)
    check_count(num_inner, "num_inner")
    check_count(minibatches, "minibatches")
    if std not in ("group", "batch"):
        raise ValueError(f"std must be 'group' or 'batch', got {std!r}")
    if not callable(soft_update):
        raise TypeError("soft_update must be a SoftUpdate or a function of the outer step")
    shape = None if latent_shape is None else tuple(int(s) for s in latent_shape)
    if shape is not None and len(shape) != 4:
        raise ValueError(f"latent_shape must be (C, F, H, W), got {shape}")
    loss = nft_loss(
        beta=beta,
        clip_max=clip_max,
        weighting=weighting,
        kl_weight=kl_weight,
        t_sampling=t_sampling,
        policy=policy,
        old=old,
        reference=reference,
    )
    unit = update(policy, loss, clip=clip, sanitize=sanitize, name=f"{name}_inner")
    sample = rollout or euler_rollout(10)

    def check_input(state: TrainState, batch: Any, compiled: Accumulation) -> None:
        if kl_weight > 0 and reference not in state.roles:
            raise ValueError(
                f"diffusion_nft(kl_weight={kl_weight}) reads a reference role {reference!r} the state lacks "
                f"(roles {sorted(state.roles)}): add fvstep.Role(frozen_copy) as {reference!r}, or kl_weight=0"
            )
        old_names, policy_names = set(state.roles[old].params), set(state.roles[policy].params)
        if old_names != policy_names:
            odd = sorted(old_names ^ policy_names)[:3]
            raise ValueError(
                f"the old policy {old!r} must have the parameters of {policy!r} (the soft "
                f"update blends them name by name); they differ in {odd}"
            )
        if not isinstance(batch, Mapping) or not isinstance(batch.get("text"), torch.Tensor):
            raise ValueError('diffusion_nft needs a batch dict with "text" (B, L, D)')
        if isinstance(batch.get("latents"), torch.Tensor):
            check_batch(state, batch, old)
        elif shape is None:
            raise ValueError(
                "diffusion_nft needs the latents' shape: pass latent_shape=(C, F, H, W) or a "
                'batch["latents"] of that shape (its values are not read by the method)'
            )
        num = batch["text"].shape[0] * group_size
        if num % minibatches:
            raise ValueError(
                f"minibatches={minibatches} must divide the {num} rollouts "
                f"({num // group_size} prompts x group_size={group_size})"
            )
        size = num // minibatches
        inner = accumulation if accumulation is not None else compiled
        if size % inner.microbatches:
            raise ValueError(
                f"accumulation={inner.microbatches} micro-batches must divide each inner "
                f"minibatch of {size} rollouts ({num} rollouts / minibatches={minibatches})"
            )

    def outer_step(
        state: TrainState, batch: Any, key: torch.Tensor, ctx: ManagedContext
    ) -> tuple[TrainState, dict[str, Any]]:
        batch = cast_batch(state, batch, old, keys=("latents", "text"))
        grouped = group_batch(batch, group_size)
        text = grouped["text"]
        num = text.shape[0]
        decay = float(soft_update(ctx.step))
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"soft_update({ctx.step}) = {decay} is not in [0, 1]")
        k_noise, k_rollout, k_inner = fsrandom.split(key, 3)
        if shape is None:
            noise = _noise.randn_like(k_noise, grouped["latents"])
        else:
            noise = _noise.randn(k_noise, (num, *shape), device=text.device, dtype=text.dtype)
        with torch.no_grad():
            samples = sample(state.module(old), noise, text, k_rollout).detach()
            rewards = check_rewards(reward_fn(samples, grouped), num).float()
        probs = optimality_probabilities(rewards, group_size, std=std, clip_max=clip_max)
        rollouts = {"samples": samples, "text": text, "probabilities": probs}
        size = num // minibatches

        def parts() -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            for e in range(num_inner):
                k_perm, k_updates = fsrandom.split(fsrandom.fold_in(k_inner, e), 2)
                order = torch.randperm(num, generator=fsrandom.generator(k_perm))
                order = order.to(samples.device)
                shuffled = {k: v.index_select(0, order) for k, v in rollouts.items()}
                for j in range(minibatches):
                    part = {k: v[j * size : (j + 1) * size] for k, v in shuffled.items()}
                    yield part, fsrandom.fold_in(k_updates, j)

        state, metrics, inner_loss = run_inner_updates(
            ctx, state, unit, parts(), role=policy, accumulation=accumulation
        )
        blend_(state.roles[old].params, state.roles[policy].params, decay)
        metrics[f"{name}/reward_mean"] = rewards.mean()
        metrics[f"{name}/reward_std"] = rewards.std(unbiased=False)
        metrics[f"{name}/probability_mean"] = probs.mean()
        metrics[f"{name}/inner_loss_mean"] = inner_loss
        metrics[f"{name}/old_decay"] = decay
        return state, metrics

    return managed(outer_step, trains=policy, mutates=old, name=name, check=check_input)
