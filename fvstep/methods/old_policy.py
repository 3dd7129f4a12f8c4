"""What the RL methods share: the old policy's rollouts and soft update, the reference anchor.

:mod:`fvstep.methods.rl` and :mod:`fvstep.methods.diffusion_nft` keep a frozen ``old``
role that samples an outer step's rollouts and is then moved toward the policy in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fvstep.methods.models import predict

__all__ = ["blend_", "euler_sample", "reference_kl", "run_inner_updates"]


def euler_sample(
    module: nn.Module, noise: torch.Tensor, text: torch.Tensor, num_steps: int
) -> torch.Tensor:
    """Generate ``x0`` from ``noise`` at ``t = 1`` by ``num_steps`` Euler steps of the velocity.

    ``x <- x + (t_next - t) v(x, t)`` on the uniform grid ``1, 1 - 1/n, ..., 0``, in the
    caller's grad mode.

    Raises:
        ValueError: If ``num_steps < 1``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    x = noise
    grid = [1.0 - i / num_steps for i in range(num_steps + 1)]
    for t_now, t_next in itertools.pairwise(grid):
        t = torch.full((x.shape[0],), t_now, device=x.device)
        x = x + (t_next - t_now) * predict(module, x, t * 1000, text)
    return x


@torch.no_grad()
def blend_(
    target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor], beta: float
) -> None:
    """``target = beta * target + (1 - beta) * source``, in place, for every floating tensor.

    Args:
        target: The old policy's parameters (``state.roles["old"].params``).
        source: The trained policy's, by the same names (cast to ``target``'s dtypes).

    Raises:
        ValueError: If the two do not have the same names.
    """
    if set(target) != set(source):
        missing = sorted(set(target) ^ set(source))
        raise ValueError(f"cannot blend modules with different parameters (e.g. {missing[:3]})")
    names = [n for n, t in target.items() if t.is_floating_point()]
    targets = [target[n] for n in names]
    sources = [source[n].detach().to(target[n].dtype) for n in names]
    torch._foreach_mul_(targets, beta)
    torch._foreach_add_(targets, sources, alpha=1.0 - beta)


def reference_kl(
    state: Any,
    reference: str,
    v: torch.Tensor,
    x_t: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    kl_weight: float,
) -> torch.Tensor:
    """``mean((v - v_ref)^2)`` in fp32, ``v_ref`` read under ``torch.no_grad()``; ``0`` when
    ``kl_weight == 0`` (the reference is then not read).
    """
    if not kl_weight > 0:
        return torch.zeros((), device=v.device)
    with torch.no_grad():
        v_ref = predict(state.module(reference), x_t, timestep, text).float()
    return ((v - v_ref) ** 2).mean()


def run_inner_updates(
    ctx: Any,
    state: Any,
    unit: Any,
    parts: Iterable[tuple[Any, torch.Tensor]],
    *,
    role: str,
    accumulation: Any,
) -> tuple[Any, dict[str, Any], torch.Tensor]:
    """``unit`` through ``ctx.update`` on each ``(batch, key)`` of ``parts``: the state, the
    metrics (the later win) and the mean of ``role``'s losses, fp32."""
    metrics: dict[str, Any] = {}
    losses = []
    for part, key in parts:
        state, inner = ctx.update(state, unit, part, key, accumulation=accumulation)
        losses.append(torch.as_tensor(inner[f"{role}/loss"], dtype=torch.float32))
        metrics.update(inner)
    return state, metrics, torch.stack(losses).mean()
