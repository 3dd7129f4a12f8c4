"""Self-forcing: a causal student rolls out its own video chunk by chunk, trained by DMD.

Huang et al. 2025 (arXiv 2506.08009). Roles: ``student`` (a causal Wan,
:func:`fvstep.methods.causal_wan.make_causal`; trained), ``teacher`` (bidirectional,
frozen), ``critic`` (bidirectional, trained). The rollout is
:func:`fvstep.methods.causal_rollout.rollout`, the losses those of
:mod:`fvstep.methods.dmd2`. The formulas and keys: ``docs/methods/self_forcing.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState
from fvstep.core.steps import Cond, cond, update
from fvstep.methods._checks import (
    check_batch,
    check_bidirectional,
    check_count,
    check_rollout_options,
)
from fvstep.methods.causal_rollout import exit_steps, regenerate, rollout, shifted_steps
from fvstep.methods.causal_wan import chunk_frames_of
from fvstep.methods.dmd2 import (
    FusedLossFn,
    IsMultiple,
    critic_denoising_loss,
    distribution_matching_loss,
)
from fvstep.methods.finetune import RoleLossFn

__all__ = [
    "SelfForcingLosses",
    "critic_loss_on",
    "dmd_loss_on",
    "self_forcing",
    "self_forcing_losses",
]

_NUM_KEYS = 3
_ROLLOUT, _GENERATOR, _CRITIC = range(_NUM_KEYS)


def dmd_loss_on(
    state: Any,
    video: torch.Tensor,
    text: torch.Tensor,
    key: torch.Tensor,
    *,
    teacher: str = "teacher",
    critic: str = "critic",
    guidance_scale: float = 3.0,
    shift: float = 3.0,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """:func:`~fvstep.methods.dmd2.distribution_matching_loss` on ``video``, keys ``split(key, 2)``."""
    k_t, k_noise = fsrandom.split(key, 2)
    return distribution_matching_loss(
        state, video, text, k_t, k_noise, guidance_scale=guidance_scale, shift=shift,
        min_ratio=min_ratio, max_ratio=max_ratio, teacher=teacher, critic=critic,
    )  # fmt: skip


def critic_loss_on(
    state: Any,
    video: torch.Tensor,
    text: torch.Tensor,
    key: torch.Tensor,
    *,
    critic: str = "critic",
    shift: float = 3.0,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """:func:`~fvstep.methods.dmd2.critic_denoising_loss` on ``video``, keys ``split(key, 2)``."""
    k_t, k_noise = fsrandom.split(key, 2)
    return critic_denoising_loss(
        state, video, text, k_t, k_noise, shift=shift, min_ratio=min_ratio,
        max_ratio=max_ratio, critic=critic,
    )  # fmt: skip


class SelfForcingLosses(NamedTuple):
    """The loss functions of self-forcing; ``fused_loss`` gives both roles' from one rollout."""

    critic_loss: RoleLossFn
    fused_loss: FusedLossFn


def self_forcing_losses(
    *,
    denoising_steps: Sequence[float] = shifted_steps((1.0, 0.75, 0.5, 0.25), 5.0),
    guidance_scale: float = 3.0,
    shift: float = 3.0,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
    context_time: float = 0.0,
    same_step_across_chunks: bool = False,
    last_step_only: bool = False,
    cache_dtype: torch.dtype | None = None,
    student: str = "student",
    teacher: str = "teacher",
    critic: str = "critic",
) -> SelfForcingLosses:
    """Self-forcing's loss functions (formulas, batch and keys: ``docs/methods/self_forcing.md``).

    The score options are :func:`~fvstep.methods.dmd2.dmd2_losses`'s.

    Args:
        context_time: Time of the cache's context pass (0: clean chunks).
        same_step_across_chunks: One exit step for every chunk of a rollout.
        last_step_only: Always exit at the last step.
        cache_dtype: The rollout's KV cache dtype; give the student's compute dtype when it
            is lower than the latents' (a prepared bf16 role).

    Raises:
        ValueError: For out-of-range settings; at a step, before it changes anything, for
            a student that is not causal, a causal teacher or critic, or a batch that does
            not fit the student.
    """
    steps = check_rollout_options(
        denoising_steps, guidance_scale=guidance_scale, shift=shift, min_ratio=min_ratio,
        max_ratio=max_ratio, context_time=context_time,
    )  # fmt: skip
    score: dict[str, Any] = {"shift": shift, "min_ratio": min_ratio, "max_ratio": max_ratio}

    def rolled_out(state: TrainState, batch: Any, key: torch.Tensor) -> tuple[Any, Any, Any]:
        module = state.module(student)
        chunk = chunk_frames_of(module)  # raises for a student that is not causal
        check_bidirectional(state, (teacher, critic), method="self_forcing")
        batch = check_batch(state, batch, student)
        keys = fsrandom.split(key, _NUM_KEYS)
        like, text = batch["latents"], batch["text"]
        exits = exit_steps(
            state.key,
            int(state.step),
            like.shape[2] // chunk,
            len(steps),
            same_step_across_chunks=same_step_across_chunks,
            last_step_only=last_step_only,
        )
        with torch.no_grad():
            ro = rollout(
                module, like, text, keys[_ROLLOUT], exits=exits, denoising_steps=steps,
                context_time=context_time, cache_dtype=cache_dtype,
            )  # fmt: skip
        if not torch.is_grad_enabled():
            return ro.video, text, keys
        # the exit steps again, with gradient, each reading its prefix of the one final
        # cache (a rollout under grad would keep every chunk's cache for the backward)
        video = regenerate(module, ro.exit_inputs, ro.exit_times, ro.contexts, text)
        return video, text, keys

    def critic_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        with torch.no_grad():
            video, text, keys = rolled_out(state, batch, key)
        return critic_loss_on(state, video, text, keys[_CRITIC], critic=critic, **score)

    def fused_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        video, text, keys = rolled_out(state, batch, key)
        g_loss, g_metrics = dmd_loss_on(
            state, video, text, keys[_GENERATOR], teacher=teacher, critic=critic,
            guidance_scale=guidance_scale, **score,
        )  # fmt: skip
        c_loss, c_metrics = critic_loss_on(
            state, video, text, keys[_CRITIC], critic=critic, **score
        )
        return {student: g_loss, critic: c_loss}, {**g_metrics, **c_metrics}

    return SelfForcingLosses(critic_loss, fused_loss)


def self_forcing(*, generator_update_interval: int = 5, **loss_options: Any) -> Cond:
    """Self-forcing as a composed method: the critic every step, with the student every ``n``.

    Args:
        generator_update_interval: ``n``.
        **loss_options: :func:`self_forcing_losses`'s options.

    Raises:
        ValueError: If ``n < 1``, or for the loss options' errors.
    """
    n = generator_update_interval
    check_count(n, "generator_update_interval")
    losses = self_forcing_losses(**loss_options)
    fused = update(("student", "critic"), losses.fused_loss, name="self_forcing_fused")
    critic = update("critic", losses.critic_loss, name="self_forcing_critic")
    return cond(IsMultiple(n), fused, critic)
