"""DiffusionNFT's negative-aware loss on the forward process (the inner update's loss).

:func:`nft_loss` is the loss of one inner update of :func:`fvstep.methods.diffusion_nft`;
it reads the policy and the old policy (and a reference, for the optional KL term)
through the state, and the rollouts, their optimality probabilities and text from the
batch.

Examples:
    >>> unit = fvstep.update("policy", nft_loss(beta=1.0))
    >>> state, metrics = unit(state, {"samples": x0, "text": text, "probabilities": r})
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState
from fvstep.methods import _noise
from fvstep.methods.finetune import (
    RoleLossFn,
    TSampling,
    add_noise,
    broadcast_time,
    check_t_sampling,
    sample_time,
)
from fvstep.methods.models import predict

__all__ = ["Weighting", "nft_loss"]

Weighting = Literal["adaptive", "velocity"]
"""How a sample's error is weighted: the authors' self-normalised ``x0`` error, or the
paper's plain velocity error."""


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
    x0_hat = x_t - broadcast_time(t, x_t) * v
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
    ``"probabilities"`` ``r`` ``(N,)``. ``split(key, 2)`` draws ``t`` (``t_sampling``)
    and ``eps``; ``x_t = (1 - t) x0 + t eps``; ``v_old`` (and ``v_ref``) are read under
    ``torch.no_grad()``; everything is fp32. With ``v+ = (1 - beta) v_old + beta
    v_theta`` and ``v- = (1 + beta) v_old - beta v_theta``, the loss is
    ``(clip_max / beta) mean_i[r_i l(v+)_i + (1 - r_i) l(v-)_i] + kl_weight
    mean((v_theta - v_ref)^2)``, where per sample:

    - ``weighting="velocity"``: ``l(v) = mean((v - (eps - x0))^2)``;
    - ``weighting="adaptive"``: with ``x0(v) = x_t - t v``, ``l(v) =
      mean((x0(v) - x0)^2) / sg(max(mean|x0(v) - x0|, 1e-5))`` (the authors' code; the
      weight stops the gradient).

    The factor ``clip_max / beta`` is the authors' scale: at ``v_theta = v_old`` the
    gradient in ``v_theta`` no longer shrinks with ``beta``. At ``r = 1/2`` (velocity
    weighting) the loss is ``(clip_max / beta) mean_i[mean((v_old - v)^2) + beta^2
    mean((v_theta - v_old)^2)]``.

    Args:
        beta: The guidance strength (> 0).
        clip_max: The probability clip of :func:`optimality_probabilities` (the scale).
        weighting: ``"adaptive"`` or ``"velocity"``.
        kl_weight: Weight of the reference term (>= 0; ``0`` skips the reference).
        t_sampling: ``"uniform"`` or ``"logit_normal"`` (:func:`~fvstep.methods.finetune.sample_time`).
        policy: The trained role.
        old: The old policy's role.
        reference: The reference role (read only when ``kl_weight > 0``).

    Returns:
        ``loss_fn(state, batch, key) -> (loss, {"policy_loss", "kl", "old_deviation",
        "probability_mean"})``.

    Raises:
        ValueError: For out-of-range settings.

    Examples:
        >>> unit = fvstep.update("policy", nft_loss(beta=0.1, kl_weight=1e-4))
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
        k_t, k_eps = fsrandom.split(key, 2)
        t = sample_time(k_t, x0.shape[0], device=x0.device, t_sampling=t_sampling)
        eps = _noise.randn_like(k_eps, x0)
        x_t = add_noise(x0, eps, t)
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
        kl = torch.zeros((), device=v.device)
        if kl_weight > 0:
            with torch.no_grad():
                v_ref = predict(state.module(reference), x_t, t * 1000, text).float()
            kl = ((v - v_ref) ** 2).mean()
        loss = policy_loss + kl_weight * kl
        return loss, {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "old_deviation": ((v.detach() - v_old) ** 2).mean(),
            "probability_mean": r.mean(),
        }

    return loss_fn
