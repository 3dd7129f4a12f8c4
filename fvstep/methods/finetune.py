"""Flow-matching fine-tuning, and the flow-matching primitives the other methods share.

The flow-matching path is ``x_t = (1 - t) * x0 + t * eps`` for ``t`` in ``[0, 1]``; a
module predicts the velocity ``eps - x0`` (see the forward contract in
:mod:`fvstep.methods.models`), so ``x0 = x_t - t * v``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState
from fvstep.core.steps import Unit, update
from fvstep.methods import _noise
from fvstep.methods._checks import check_batch
from fvstep.methods.models import predict

__all__ = [
    "RoleLossFn",
    "TSampling",
    "add_noise",
    "check_t_sampling",
    "finetune",
    "flow_matching_loss",
    "sample_time",
    "sample_x_t",
    "x0_from_velocity",
]

TSampling = Literal["uniform", "logit_normal"]
_T_SAMPLINGS: tuple[str, ...] = ("uniform", "logit_normal")

RoleLossFn = Callable[[TrainState, Any, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]
"""A loss function for a unit that trains one role: ``(state, batch, key) -> (loss, metrics)``."""


def _broadcast_time(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample times ``(B,)`` to broadcast against ``like`` ``(B, ...)``, in its dtype."""
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def add_noise(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The point ``x_t = (1 - t) * x0 + t * eps`` of the flow-matching path (``t``: ``(B,)``)."""
    tb = _broadcast_time(t, x0)
    return (1 - tb) * x0 + tb * eps


def x0_from_velocity(x_t: torch.Tensor, t: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """The clean sample that a velocity points to: ``x0 = x_t - t * v`` (``t``: ``(B,)``)."""
    return x_t - _broadcast_time(t, x_t) * velocity


def sample_time(
    key: torch.Tensor,
    batch_size: int,
    *,
    device: torch.device | str = "cpu",
    t_sampling: TSampling = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """Draw ``(batch_size,)`` fp32 flow-matching times in ``[0, 1]`` from ``key``.

    Args:
        t_sampling: ``"uniform"`` (``U[0, 1)``) or ``"logit_normal"``
            (``sigmoid(N(logit_mean, logit_std^2))``).
    """
    if t_sampling == "uniform":
        return _noise.rand(key, (batch_size,), device=device)
    if t_sampling == "logit_normal":
        z = _noise.randn(key, (batch_size,), device=device)
        return torch.sigmoid(z * logit_std + logit_mean)
    raise ValueError(f"unknown t_sampling {t_sampling!r}; choose one of {_T_SAMPLINGS}")


def sample_x_t(
    key: torch.Tensor,
    x0: torch.Tensor,
    *,
    t_sampling: TSampling = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(t, eps, x_t)``: ``split(key, 2)`` draws ``t`` (:func:`sample_time`) and ``eps``."""
    k_t, k_eps = fsrandom.split(key, 2)
    t = sample_time(
        k_t,
        x0.shape[0],
        device=x0.device,
        t_sampling=t_sampling,
        logit_mean=logit_mean,
        logit_std=logit_std,
    )
    eps = _noise.randn_like(k_eps, x0)
    return t, eps, add_noise(x0, eps, t)


def check_t_sampling(t_sampling: str, logit_std: float) -> None:
    """Refuse an unknown ``t_sampling`` or a ``logit_std`` that is not positive."""
    if t_sampling not in _T_SAMPLINGS:
        raise ValueError(f"unknown t_sampling {t_sampling!r}; choose one of {_T_SAMPLINGS}")
    if not logit_std > 0:
        raise ValueError(f"logit_std must be > 0, got {logit_std}")


def flow_matching_loss(
    *,
    role: str = "student",
    t_sampling: TSampling = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> RoleLossFn:
    """The flow-matching loss of one role, as a loss function for :func:`fvstep.update`.

    ``loss_fn(state, batch, key)`` draws ``(t, eps, x_t)`` (:func:`sample_x_t`) for
    ``x0 = batch["latents"]`` and returns ``MSE(v(x_t, 1000 t, batch["text"]), eps - x0)``
    (in fp32) with metrics ``{"t_mean": mean t}``.

    Args:
        t_sampling: As :func:`sample_time`'s, with ``logit_mean`` and ``logit_std`` (> 0).

    Raises:
        ValueError: For an unknown ``t_sampling`` or ``logit_std <= 0``.

    Examples:
        >>> unit = fvstep.update("student", flow_matching_loss(t_sampling="logit_normal"))
    """
    check_t_sampling(t_sampling, logit_std)

    def loss_fn(
        state: TrainState, batch: Any, key: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        batch = check_batch(state, batch, role)
        x0 = batch["latents"]
        t, eps, x_t = sample_x_t(
            key, x0, t_sampling=t_sampling, logit_mean=logit_mean, logit_std=logit_std
        )
        v = predict(state.module(role), x_t, t * 1000, batch["text"])
        loss = F.mse_loss(v.float(), (eps - x0).float())
        return loss, {"t_mean": t.mean().detach()}

    return loss_fn


def finetune(
    *,
    role: str = "student",
    t_sampling: TSampling = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> Unit:
    """Flow-matching fine-tuning: ``fvstep.update(role, flow_matching_loss(...), name="finetune")``.

    Raises:
        ValueError: For an unknown ``t_sampling`` or ``logit_std <= 0``.

    Examples:
        >>> state = fvstep.TrainState.create(
        ...     {"student": fvstep.Role(net, optimizer=fvstep.optim.adamw(lr=1e-4))},
        ...     key=fvstep.random.key(0))
        >>> step = fvstep.compile(finetune())
        >>> state, metrics = step(state, batch)
    """
    loss_fn = flow_matching_loss(
        role=role, t_sampling=t_sampling, logit_mean=logit_mean, logit_std=logit_std
    )
    return update(role, loss_fn, name="finetune")
