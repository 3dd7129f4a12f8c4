"""Self-forcing: a causal student rolls out its own video chunk by chunk, trained by DMD.

Huang et al. 2025 (arXiv 2506.08009). Roles: ``student`` (a causal Wan,
:func:`fvstep.methods.causal_wan.make_causal`; trained), ``teacher`` (bidirectional,
frozen), ``critic`` (bidirectional, trained). The rollout is
:func:`fvstep.methods.causal_rollout.rollout`, the losses those of
:mod:`fvstep.methods.dmd2`; the exit steps come from the shared key
(:func:`~fvstep.methods.causal_rollout.exit_steps`), every other draw from the unit's key:
``split(key, 3) = (rollout, generator, critic)``. The rollout, the formulas and the draw
rules: ``docs/methods/self_forcing.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs
import torch

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState
from fvstep.core.steps import Cond, cond, update
from fvstep.methods._checks import (
    check_batch,
    check_bidirectional,
    check_denoising_steps,
    check_score_options,
)
from fvstep.methods.causal_rollout import exit_steps, regenerate, rollout, shifted_steps
from fvstep.methods.causal_wan import chunk_frames_of
from fvstep.methods.dmd2 import FusedLossFn, critic_denoising_loss, distribution_matching_loss
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
    """DMD's generator loss on a generated ``video`` (with gradient), keyed by ``key``.

    :func:`fvstep.methods.dmd2.distribution_matching_loss` with ``split(key, 2)`` as its
    score-time and noise keys.

    Examples:
        >>> loss, metrics = dmd_loss_on(state, video, text, k)
    """
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
    """The critic's denoising loss on a generated ``video`` (detached), keyed by ``key``.

    :func:`fvstep.methods.dmd2.critic_denoising_loss` with ``split(key, 2)`` as its
    score-time and noise keys.

    Examples:
        >>> loss, metrics = critic_loss_on(state, video, text, k)
    """
    k_t, k_noise = fsrandom.split(key, 2)
    return critic_denoising_loss(
        state, video, text, k_t, k_noise, shift=shift, min_ratio=min_ratio,
        max_ratio=max_ratio, critic=critic,
    )  # fmt: skip


class SelfForcingLosses(NamedTuple):
    """The loss functions of self-forcing (each ``(state, batch, key) -> ...``).

    Attributes:
        critic_loss: ``(loss, metrics)`` on a no-grad rollout.
        fused_loss: ``({"student": dmd_loss, "critic": critic_loss}, metrics)`` from one
            rollout (the critic's on the detached video).
    """

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
    """Self-forcing's loss functions (formulas and keys: the module docstring).

    Batches need ``"text"`` ``(B, L, D)`` and ``"latents"`` (only its shape, dtype and
    device: the video to generate). Latents or text of lower precision than the student
    (a bf16 dataset, an fp32 model) are upcast as :func:`fvstep.methods.dmd2.dmd2` does.

    Args:
        denoising_steps: The student's few-step schedule, decreasing in ``(0, 1]``
            (default: Self-Forcing's ``(1, .75, .5, .25)`` shifted by 5).
        guidance_scale: The teacher's classifier-free guidance scale.
        shift: The score timestep shift.
        min_ratio: Lower clamp of the score time.
        max_ratio: Upper clamp of the score time.
        context_time: Time of the cache's context pass (0: clean chunks).
        same_step_across_chunks: One exit step for every chunk of a rollout.
        last_step_only: Always exit at the last step.
        cache_dtype: The rollout's KV cache dtype; default
            :func:`~fvstep.methods.causal_wan.init_cache`'s (autocast's, else the
            latents'). Give the student's compute dtype when it computes in a lower one
            than the latents (a prepared bf16 role): its keys are in it already.
        student: The causal student role's name.
        teacher: The teacher role's name.
        critic: The critic role's name.

    Returns:
        A :class:`SelfForcingLosses`.

    Raises:
        ValueError: For a schedule that is not decreasing in ``(0, 1]``, a
            ``context_time`` outside ``[0, 1)``, ``guidance_scale < 0``, ``shift <= 0`` or
            not ``0 <= min_ratio <= max_ratio <= 1``; at a step (before it changes
            anything, the state stays usable), for a student that is not causal, a causal
            teacher or critic, or a batch that does not fit the student.

    Examples:
        >>> losses = self_forcing_losses(denoising_steps=(1.0, 0.5))
    """
    steps = check_denoising_steps(denoising_steps)
    check_score_options(
        guidance_scale=guidance_scale, shift=shift, min_ratio=min_ratio, max_ratio=max_ratio
    )
    if not 0.0 <= context_time < 1.0:
        raise ValueError(f"context_time must be in [0, 1), got {context_time}")
    score: dict[str, Any] = {"shift": shift, "min_ratio": min_ratio, "max_ratio": max_ratio}

    def checked(state: TrainState, batch: Any) -> Any:
        """The batch checked and cast for the student; causal student, bidirectional
        teacher and critic (a loss's error, before any change: the state stays usable)."""
        chunk_frames_of(state.module(student))  # raises for a student that is not causal
        check_bidirectional(state, (teacher, critic), method="self_forcing")
        return check_batch(state, batch, student)

    def generate(state: TrainState, batch: Any, key: torch.Tensor) -> torch.Tensor:
        module = state.module(student)
        like = batch["latents"]
        exits = exit_steps(
            state.key,
            int(state.step),
            like.shape[2] // chunk_frames_of(module),
            len(steps),
            same_step_across_chunks=same_step_across_chunks,
            last_step_only=last_step_only,
        )
        with torch.no_grad():
            ro = rollout(
                module, like, batch["text"], key, exits=exits, denoising_steps=steps,
                context_time=context_time, cache_dtype=cache_dtype,
            )  # fmt: skip
        if not torch.is_grad_enabled():
            return ro.video
        # the exit steps again, with gradient, each reading its prefix of the one final
        # cache (a rollout under grad would keep every chunk's cache for the backward)
        return regenerate(module, ro.exit_inputs, ro.exit_times, ro.contexts, batch["text"])

    def critic_of(
        state: TrainState, video: torch.Tensor, text: torch.Tensor, keys: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return critic_loss_on(state, video, text, keys[_CRITIC], critic=critic, **score)

    def critic_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        batch = checked(state, batch)
        keys = fsrandom.split(key, _NUM_KEYS)
        with torch.no_grad():
            video = generate(state, batch, keys[_ROLLOUT])
        return critic_of(state, video, batch["text"], keys)

    def fused_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        batch = checked(state, batch)
        keys = fsrandom.split(key, _NUM_KEYS)
        video = generate(state, batch, keys[_ROLLOUT])
        g_loss, g_metrics = dmd_loss_on(
            state, video, batch["text"], keys[_GENERATOR], teacher=teacher, critic=critic,
            guidance_scale=guidance_scale, **score,
        )  # fmt: skip
        c_loss, c_metrics = critic_of(state, video, batch["text"], keys)
        return {student: g_loss, critic: c_loss}, {**g_metrics, **c_metrics}

    return SelfForcingLosses(critic_loss, fused_loss)


@attrs.frozen
class _EveryNth:
    """The predicate ``step % n == 0`` (a named, comparable callable for ``cond``)."""

    n: int

    def __call__(self, step: int) -> bool:
        return step % self.n == 0


def self_forcing(*, generator_update_interval: int = 5, **loss_options: Any) -> Cond:
    """Self-forcing as a composed method: the critic every step, with the student every ``n``.

    ``cond(i % n == 0, update(("student", "critic"), fused_loss, name="self_forcing_fused"),
    update("critic", critic_loss, name="self_forcing_critic"))``.

    Args:
        generator_update_interval: ``n``.
        **loss_options: :func:`self_forcing_losses`'s options.

    Returns:
        The method, for :func:`fvstep.compile`.

    Raises:
        ValueError: If ``n < 1``, or for the loss options' errors.

    Examples:
        >>> step = fvstep.compile(self_forcing(generator_update_interval=2),
        ...                       accumulation=fvstep.Accumulation(2))
    """
    n = generator_update_interval
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"generator_update_interval must be an int >= 1, got {n!r}")
    losses = self_forcing_losses(**loss_options)
    fused = update(("student", "critic"), losses.fused_loss, name="self_forcing_fused")
    critic = update("critic", losses.critic_loss, name="self_forcing_critic")
    return cond(_EveryNth(n), fused, critic)
