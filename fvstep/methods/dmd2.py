"""DMD2 distillation: a few-step student, a frozen teacher and a trained critic ("fake score").

Roles: ``student`` (trained), ``teacher`` (frozen), ``critic`` (trained). The critic
learns the student's score, the student follows the teacher's guided score minus the
critic's. The losses and draw rules: ``docs/methods/dmd2.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState
from fvstep.core.steps import Chain, Cond, cond, every, sequence, update
from fvstep.methods import _noise
from fvstep.methods._checks import (
    check_batch,
    check_count,
    check_rollout_options,
    check_step_index,
)
from fvstep.methods.finetune import RoleLossFn, add_noise, x0_from_velocity
from fvstep.methods.models import predict

__all__ = [
    "DMD2Losses",
    "FusedLossFn",
    "IsMultiple",
    "Ordering",
    "critic_denoising_loss",
    "distribution_matching_loss",
    "dmd2",
    "dmd2_losses",
    "rollout",
    "score_time",
    "target_step",
]

Ordering = Literal["fused", "sequential"]
FusedLossFn = Callable[
    [TrainState, Any, torch.Tensor], tuple[dict[str, torch.Tensor], dict[str, Any]]
]

_NUM_KEYS = 5
_ROLLOUT, _GEN_T, _GEN_NOISE, _CRITIC_T, _CRITIC_NOISE = range(_NUM_KEYS)


class DMD2Losses(NamedTuple):
    """The loss functions of DMD2; ``fused_loss`` gives both roles' losses from one rollout."""

    generator_loss: RoleLossFn
    critic_loss: RoleLossFn
    fused_loss: FusedLossFn


def score_time(
    key: torch.Tensor,
    batch_size: int,
    *,
    shift: float,
    min_ratio: float,
    max_ratio: float,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``(batch_size,)`` score times: ``t ~ U[0, 1)`` shifted, clamped to ``[min_ratio, max_ratio]``."""
    t = _noise.rand(key, (batch_size,), device=device)
    t = shift * t / (1 + (shift - 1) * t)
    return t.clamp(min_ratio, max_ratio)


def distribution_matching_loss(
    state: Any,
    x0_hat: torch.Tensor,
    text: torch.Tensor,
    time_key: torch.Tensor,
    noise_key: torch.Tensor,
    *,
    guidance_scale: float,
    shift: float,
    min_ratio: float,
    max_ratio: float,
    teacher: str = "teacher",
    critic: str = "critic",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """DMD's generator loss ``0.5 * MSE(x0_hat, sg(x0_hat - g))`` (``g``: ``docs/methods/dmd2.md``).

    The critic and the guided teacher run without gradient: it reaches ``x0_hat`` only.

    Args:
        state: Anything with ``module(name)`` (a :class:`~fvstep.TrainState`).
        guidance_scale: The teacher's classifier-free guidance scale (``1``: no
            unconditional pass); the other options as :func:`score_time`'s.

    Returns:
        ``(loss, {"score_t_mean", "dmd_denominator"})``.
    """
    with torch.no_grad():
        x0 = x0_hat.detach()
        t = score_time(time_key, len(x0), shift=shift, min_ratio=min_ratio,
                       max_ratio=max_ratio, device=x0.device)  # fmt: skip
        x_t = add_noise(x0, _noise.randn_like(noise_key, x0), t)
        timestep = t * 1000
        v_critic = predict(state.module(critic), x_t, timestep, text)
        v_teacher = predict(state.module(teacher), x_t, timestep, text)
        if guidance_scale != 1.0:
            v_uncond = predict(state.module(teacher), x_t, timestep, torch.zeros_like(text))
            v_teacher = v_uncond + guidance_scale * (v_teacher - v_uncond)
        x0_critic = x0_from_velocity(x_t, t, v_critic).float()
        x0_teacher = x0_from_velocity(x_t, t, v_teacher).float()
        per_sample = tuple(range(1, x0.dim()))
        denom = (x0.float() - x0_teacher).abs().mean(dim=per_sample, keepdim=True)
        g = torch.nan_to_num((x0_critic - x0_teacher) / denom)
        target = x0.float() - g
    loss = 0.5 * F.mse_loss(x0_hat.float(), target)
    return loss, {"score_t_mean": t.mean(), "dmd_denominator": denom.mean()}


def critic_denoising_loss(
    state: Any,
    x0_hat: torch.Tensor,
    text: torch.Tensor,
    time_key: torch.Tensor,
    noise_key: torch.Tensor,
    *,
    shift: float,
    min_ratio: float,
    max_ratio: float,
    critic: str = "critic",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The critic's flow-matching loss on ``x0_hat`` (detached), as :func:`distribution_matching_loss`.

    Returns:
        ``(loss, {"critic_t_mean"})``.
    """
    x0 = x0_hat.detach()
    t = score_time(time_key, len(x0), shift=shift, min_ratio=min_ratio,
                   max_ratio=max_ratio, device=x0.device)  # fmt: skip
    eps = _noise.randn_like(noise_key, x0)
    x_t = add_noise(x0, eps, t)
    v = predict(state.module(critic), x_t, t * 1000, text)
    loss = F.mse_loss(v.float(), (eps - x0).float())
    return loss, {"critic_t_mean": t.mean().detach()}


def target_step(key: torch.Tensor, step: int, num_steps: int) -> int:
    """The rollout's target step at ``step``, drawn from ``state.key`` (``docs/methods/dmd2.md``).

    Raises:
        ValueError: If ``num_steps < 1``.
    """
    check_count(num_steps, "target_step: num_steps")
    if num_steps == 1:
        return 0
    shared = fsrandom.fold_in(fsrandom.fold_in_name(key, "dmd2_target"), step)
    return int(torch.randint(num_steps, (1,), generator=fsrandom.generator(shared)))


def rollout(
    student: nn.Module,
    like: torch.Tensor,
    text: torch.Tensor,
    key: torch.Tensor,
    denoising_steps: Sequence[float] = (1.0,),
    *,
    target: int | None = None,
) -> torch.Tensor:
    """The student's few-step generation ``x0_hat`` from pure noise, at a target step.

    The steps before the target run without gradient; the last in the caller's grad mode.

    Args:
        like: A tensor giving the shape, dtype and device of the samples.
        target: The target step's index (:func:`target_step`); default drawn from ``key``,
            which on several ranks hangs a sharded student.

    Raises:
        ValueError: If ``target`` does not index ``denoising_steps``.
    """
    k_noise, k_target, k_renoise = fsrandom.split(key, 3)
    x = _noise.randn_like(k_noise, like)
    steps = tuple(float(s) for s in denoising_steps)
    if target is None:
        target = 0
        if len(steps) > 1:
            target = int(torch.randint(len(steps), (1,), generator=fsrandom.generator(k_target)))
    else:
        check_step_index(target, len(steps), "target")
    batch_size = like.shape[0]

    def time(s: float) -> torch.Tensor:
        return torch.full((batch_size,), s, device=like.device)

    with torch.no_grad():
        for i in range(target):
            t_i = time(steps[i])
            x0 = x0_from_velocity(x, t_i, predict(student, x, t_i * 1000, text))
            x = add_noise(
                x0, _noise.randn_like(fsrandom.fold_in(k_renoise, i), like), time(steps[i + 1])
            )
    t_j = time(steps[target])
    return x0_from_velocity(x, t_j, predict(student, x, t_j * 1000, text))


def dmd2_losses(
    *,
    guidance_scale: float = 3.5,
    shift: float = 3.0,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
    denoising_steps: Sequence[float] = (1.0,),
    student: str = "student",
    teacher: str = "teacher",
    critic: str = "critic",
) -> DMD2Losses:
    """The DMD2 loss functions (formulas, batch and keys: ``docs/methods/dmd2.md``).

    Args:
        guidance_scale: The teacher's classifier-free guidance scale (``1``: none).
        shift: The score timestep shift (``1``: none); ``min_ratio`` and ``max_ratio``
            clamp the score time.
        denoising_steps: The student's few-step schedule, decreasing in ``(0, 1]``.

    Raises:
        ValueError: For out-of-range settings.

    Examples:
        >>> losses = dmd2_losses(guidance_scale=3.5)
        >>> method = fvstep.sequence(fvstep.update("critic", losses.critic_loss),
        ...                          fvstep.every(5, fvstep.update("student", losses.generator_loss)))
    """
    steps = check_rollout_options(
        denoising_steps, guidance_scale=guidance_scale, shift=shift, min_ratio=min_ratio,
        max_ratio=max_ratio,
    )  # fmt: skip
    score: dict[str, Any] = {"shift": shift, "min_ratio": min_ratio, "max_ratio": max_ratio}
    g_options = {**score, "guidance_scale": guidance_scale, "teacher": teacher, "critic": critic}

    def generator_terms(state: TrainState, x0_hat: torch.Tensor, text: torch.Tensor, keys: Any):
        k_t, k_noise = keys[_GEN_T], keys[_GEN_NOISE]
        return distribution_matching_loss(state, x0_hat, text, k_t, k_noise, **g_options)

    def critic_terms(state: TrainState, x0: torch.Tensor, text: torch.Tensor, keys: Any):
        k_t, k_noise = keys[_CRITIC_T], keys[_CRITIC_NOISE]
        return critic_denoising_loss(state, x0, text, k_t, k_noise, critic=critic, **score)

    def rolled_out(state: TrainState, batch: Any, key: torch.Tensor) -> tuple[Any, Any, Any]:
        batch = check_batch(state, batch, student)
        keys = fsrandom.split(key, _NUM_KEYS)
        text = batch["text"]
        # one step: no draw, so a view with modules only (no key, no step) will do
        target = 0 if len(steps) == 1 else target_step(state.key, int(state.step), len(steps))
        module = state.module(student)
        x0_hat = rollout(module, batch["latents"], text, keys[_ROLLOUT], steps, target=target)
        return x0_hat, text, keys

    def generator_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return generator_terms(state, *rolled_out(state, batch, key))

    def critic_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        with torch.no_grad():
            x0_hat, text, keys = rolled_out(state, batch, key)
        return critic_terms(state, x0_hat, text, keys)

    def fused_loss(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        x0_hat, text, keys = rolled_out(state, batch, key)
        g_loss, g_metrics = generator_terms(state, x0_hat, text, keys)
        c_loss, c_metrics = critic_terms(state, x0_hat.detach(), text, keys)
        return {student: g_loss, critic: c_loss}, {**g_metrics, **c_metrics}

    return DMD2Losses(generator_loss, critic_loss, fused_loss)


@attrs.frozen
class IsMultiple:
    """The predicate ``step % n == 0``, comparable (for :func:`fvstep.cond`)."""

    n: int

    def __call__(self, step: int) -> bool:
        return step % self.n == 0


def dmd2(
    *,
    generator_update_interval: int = 5,
    ordering: Ordering = "fused",
    guidance_scale: float = 3.5,
    shift: float = 3.0,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
    denoising_steps: Sequence[float] = (1.0,),
) -> Cond | Chain:
    """DMD2 as a composed method: the critic every step, the student every ``n`` steps.

    The orderings: ``docs/concepts/composition.md`` (DMD2); the options are
    :func:`dmd2_losses`'s.

    Args:
        generator_update_interval: ``n``: the student steps at ``i % n == 0``.
        ordering: ``"fused"`` (both roles from one student forward) or ``"sequential"``.

    Raises:
        ValueError: For an unknown ordering, ``n < 1`` or out-of-range loss settings.

    Examples:
        >>> step = fvstep.compile(dmd2(ordering="sequential"))
        >>> [e.roles for e in fvstep.plan(step, 5)]
        [('student',), ('critic',)]
    """
    n = generator_update_interval
    check_count(n, "generator_update_interval")
    losses = dmd2_losses(
        guidance_scale=guidance_scale,
        shift=shift,
        min_ratio=min_ratio,
        max_ratio=max_ratio,
        denoising_steps=denoising_steps,
    )
    critic_unit = update("critic", losses.critic_loss, name="dmd2_critic")
    if ordering == "fused":
        fused_unit = update(("student", "critic"), losses.fused_loss, name="dmd2_fused")
        return cond(IsMultiple(n), fused_unit, critic_unit)
    if ordering == "sequential":
        generator_unit = update("student", losses.generator_loss, name="dmd2_generator")
        return sequence(every(n, generator_unit), critic_unit)
    raise ValueError(f"unknown ordering {ordering!r}; choose 'fused' or 'sequential'")
