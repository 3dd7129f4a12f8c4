"""Rewards for the RL methods: the protocol (:class:`RewardFn`), its checks, and rewards
that run anywhere. A pixel reward becomes a latent one through a decoder (:func:`decoded`);
rewards become DiffusionNFT's optimality probabilities or the RL step's advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import torch

from fvstep.methods._checks import check_count

__all__ = [
    "GroupStd",
    "PixelRewardFn",
    "RewardFn",
    "check_rewards",
    "colorfulness",
    "decoded",
    "group_advantages",
    "group_batch",
    "latent_mse_reward",
    "optimality_probabilities",
]

GroupStd = Literal["group", "batch"]


class RewardFn(Protocol):
    """``reward_fn(samples, batch) -> (N,)``: one reward per sample (higher is better).

    ``samples`` are the generated latents ``(N, C, F, H, W)``, ``batch`` the method's batch
    repeated per sample (:func:`group_batch`). It runs under ``torch.no_grad()`` in the
    step's RNG scope: a reward that draws noise draws it from the global RNG (seeded from
    the step's key) or is deterministic.
    """

    def __call__(self, samples: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor: ...


PixelRewardFn = Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor]
"""``pixel_reward(pixels, batch) -> (N,)`` with pixels ``(N, F, H, W, 3)`` in ``[0, 1]``."""


def check_rewards(rewards: object, num_samples: int) -> torch.Tensor:
    """Refuse what is not one floating reward a sample (metadata only: no device sync).

    Returns:
        ``rewards``, detached.

    Raises:
        TypeError: If it is not a floating tensor.
        ValueError: If its shape is not ``(N,)``, or it requires grad.
    """
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        got = rewards.dtype if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise TypeError(f"reward_fn must return a floating tensor of rewards, got {got}")
    if tuple(rewards.shape) != (num_samples,):
        raise ValueError(
            f"reward_fn must return one reward per sample, shape ({num_samples},), got "
            f"{tuple(rewards.shape)} (reduce any per-frame or per-pixel scores to one a sample)"
        )
    if rewards.requires_grad:
        raise ValueError(
            "reward_fn returned rewards that require grad: a reward is a constant of "
            "the loss; compute it under torch.no_grad(), or .detach() what it returns"
        )
    return rewards.detach()


def decoded(
    pixel_reward: PixelRewardFn, decode: Callable[[torch.Tensor], torch.Tensor]
) -> RewardFn:
    """A latent reward ``reward_fn(samples, batch) = pixel_reward(decode(samples), batch)``.

    Args:
        decode: ``latents -> pixels``, e.g. ``functools.partial(decode_latents, vae)``.

    Raises:
        TypeError: If either is not callable.
    """
    if not callable(pixel_reward) or not callable(decode):
        raise TypeError("decoded needs a pixel reward and a decode function (both callables)")

    def reward_fn(samples: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            return pixel_reward(decode(samples), batch)

    return reward_fn


def colorfulness(pixels: torch.Tensor, batch: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The colourfulness of each video (Hasler and Süsstrunk 2003), on the 0..255 scale.

    With ``rg = R - G`` and ``yb = (R + G) / 2 - B`` over all pixels of all frames of a
    video: ``C = sqrt(std(rg)^2 + std(yb)^2) + 0.3 sqrt(mean(rg)^2 + mean(yb)^2)``
    (population standard deviations, fp32). A grey video scores 0.

    Args:
        pixels: ``(N, F, H, W, 3)`` (or ``(N, H, W, 3)``) RGB in ``[0, 1]``.

    Returns:
        ``(N,)`` fp32.

    Raises:
        ValueError: If the last dimension is not 3 channels.
    """
    if pixels.dim() < 3 or pixels.shape[-1] != 3:
        raise ValueError(
            f"colorfulness needs RGB pixels (N, ..., 3) channels last, got {tuple(pixels.shape)}"
        )
    rgb = pixels.float().reshape(pixels.shape[0], -1, 3) * 255.0
    r, g, b = rgb.unbind(-1)
    rg = r - g
    yb = 0.5 * (r + g) - b
    spread = (rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False)).sqrt()
    level = (rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2).sqrt()
    return spread + 0.3 * level


def latent_mse_reward(samples: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """A cheap deterministic reward: ``-mean((x0 - batch["latents"])^2)`` per sample, fp32.

    Raises:
        ValueError: If the batch has no ``"latents"`` of the samples' shape.
    """
    target = batch.get("latents")
    if not isinstance(target, torch.Tensor) or target.shape != samples.shape:
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(
            f"latent_mse_reward needs batch['latents'] shaped like the samples "
            f"{tuple(samples.shape)}, got {got}"
        )
    diff = samples.float() - target.float()
    return -(diff**2).flatten(1).mean(1)


def _check_grouped(rewards: torch.Tensor, group_size: int) -> None:
    check_count(group_size, "group_size", 2)
    if rewards.dim() != 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be (N,) with N divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )


def group_batch(batch: Mapping[str, Any], group_size: int) -> dict[str, Any]:
    """``batch`` with every tensor repeated ``group_size`` times along dim 0 (one row a sample)."""
    return {
        k: v.repeat_interleave(group_size, dim=0) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def optimality_probabilities(
    rewards: torch.Tensor,
    group_size: int,
    *,
    std: GroupStd = "group",
    clip_max: float = 5.0,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Rewards to optimality probabilities in ``[0, 1]`` (``docs/methods/diffusion_nft.md``, step 2).

    Groups are consecutive rows; ``std="batch"`` (the authors' default) normalises by the
    spread of all the rewards given (per rank).

    Args:
        rewards: ``(N,)``, ``N`` divisible by ``group_size`` (>= 2); computed in fp32.
        clip_max: Advantages beyond ``+-clip_max`` standard deviations saturate (> 0).
        eps: Added to the standard deviation (>= 0).

    Returns:
        ``(N,)`` fp32 probabilities (``1/2`` for a group of equal rewards).

    Raises:
        ValueError: For a bad shape or setting.

    Examples:
        >>> optimality_probabilities(torch.tensor([0.0, 2.0, 5.0, 5.0]), 2, clip_max=1.0, eps=0.0)
        tensor([0.0000, 1.0000, 0.5000, 0.5000])
    """
    _check_grouped(rewards, group_size)
    if std not in ("group", "batch"):
        raise ValueError(f"std must be 'group' or 'batch', got {std!r}")
    if not clip_max > 0:
        raise ValueError(f"clip_max must be > 0, got {clip_max}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    advantages = _normalised(rewards.float(), group_size, std, eps)
    return 0.5 + 0.5 * (advantages / clip_max).clamp(-1.0, 1.0)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Normalise rewards within consecutive groups of ``group_size``: ``(r - mean_g) / (std_g + eps)``.

    Raises:
        ValueError: For a bad shape or group size.
    """
    _check_grouped(rewards, group_size)
    return _normalised(rewards, group_size, "group", eps)


def _normalised(rewards: torch.Tensor, group_size: int, std: GroupStd, eps: float) -> torch.Tensor:
    """``(r - mean_g) / (s + eps)``, ``s`` the population std of the group or the batch."""
    grouped = rewards.reshape(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    if std == "group":
        spread = grouped.std(dim=1, keepdim=True, unbiased=False)
    else:
        spread = grouped.std(unbiased=False)
    return ((grouped - mean) / (spread + eps)).reshape(-1)
