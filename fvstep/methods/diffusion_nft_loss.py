"""DiffusionNFT's negative-aware loss on the forward process (the inner update's loss).

:func:`nft_loss` reads the policy, the old policy (and a reference, for the optional KL
term) through the state, and the rollouts, their optimality probabilities and text from
the batch. The equations: ``docs/methods/diffusion_nft.md``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fvstep.core.state import TrainState
from fvstep.methods.finetune import (
    RoleLossFn,
    TSampling,
    check_t_sampling,
    sample_x_t,
    x0_from_velocity,
)
from fvstep.methods.models import predict
from fvstep.methods.old_policy import reference_kl

__all__ = ["Weighting", "nft_loss"]

Weighting = Literal["adaptive", "velocity"]


def _per_sample_error(
    v: torch.Tensor,
    target: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    weighting: Weighting,
) -> torch.Tensor:
    if weighting == "velocity":
        return ((v - target) ** 2).flatten(1).mean(1)
    x0_hat = x0_from_velocity(x_t, t, v)
    err = (x0_hat - x0).flatten(1)
    weight = err.detach().abs().mean(1).clamp(min=1e-5)
    return (err**2).mean(1) / weight


def nft_loss(
    *,
    beta: float = 1.0,
    clip_max: float = 5.0,
    weighting: Weighting = "adaptive",
    kl_weight: float = 0.0,
    t_sampling: TSampling = "uniform",
    policy: str = "policy",
    old: str = "old",
    reference: str = "reference",
) -> RoleLossFn:
    """The negative-aware loss of DiffusionNFT on the forward process (one inner update).

    The batch holds ``"samples"`` (``x0``, no gradient), ``"text"`` and
    ``"probabilities"`` ``(N,)``. The loss is step 3 of ``docs/methods/diffusion_nft.md``.

    Args:
        beta: The guidance strength (> 0).
        clip_max: The probability clip of
            :func:`~fvstep.methods.rewards.optimality_probabilities` (the scale).
        weighting: ``"adaptive"`` (the authors' self-normalised ``x0`` error) or
            ``"velocity"`` (the paper's).
        kl_weight: Weight of the reference term (``0`` skips the reference).
        t_sampling: As :func:`~fvstep.methods.finetune.sample_time`'s.

    Returns:
        ``loss_fn(state, batch, key) -> (loss, {"policy_loss", "kl", "old_deviation",
        "probability_mean"})``.

    Raises:
        ValueError: For out-of-range settings.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not clip_max > 0:
        raise ValueError(f"clip_max must be > 0, got {clip_max}")
    if weighting not in ("adaptive", "velocity"):
        raise ValueError(f"weighting must be 'adaptive' or 'velocity', got {weighting!r}")
    if not kl_weight >= 0:
        raise ValueError(f"kl_weight must be >= 0, got {kl_weight}")
    check_t_sampling(t_sampling, 1.0)
    scale = clip_max / beta

    def loss_fn(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        x0, text, r = batch["samples"], batch["text"], batch["probabilities"]
        t, eps, x_t = sample_x_t(key, x0, t_sampling=t_sampling)
        with torch.no_grad():
            v_old = predict(state.module(old), x_t, t * 1000, text).float()
        v = predict(state.module(policy), x_t, t * 1000, text).float()
        v_pos = (1 - beta) * v_old + beta * v
        v_neg = (1 + beta) * v_old - beta * v
        target = (eps - x0).float()
        x_t32, x0_32 = x_t.float(), x0.float()
        pos = _per_sample_error(v_pos, target, x_t32, x0_32, t, weighting)
        neg = _per_sample_error(v_neg, target, x_t32, x0_32, t, weighting)
        r = r.float()
        policy_loss = scale * (r * pos + (1 - r) * neg).mean()
        kl = reference_kl(state, reference, v, x_t, t * 1000, text, kl_weight)
        loss = policy_loss + kl_weight * kl
        return loss, {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "old_deviation": ((v.detach() - v_old) ** 2).mean(),
            "probability_mean": r.mean(),
        }

    return loss_fn
