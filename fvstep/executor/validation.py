"""Validation functions, ``(state, key) -> metrics``, and :func:`role_module`.

Samples: :mod:`fvstep.executor.sampling`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState, adopt
from fvstep.core.weights import (
    Weights,
    holding_other_weights,
    roles_holding_other_weights,
    select_weights,
)
from fvstep.methods import _noise
from fvstep.methods.finetune import add_noise
from fvstep.methods.models import predict
from fvstep.parallel.grad_sync import release_modules

__all__ = ["Weights", "module_device", "role_module", "validation_loss"]

_DEFAULT_TIMESTEPS = (0.1, 0.3, 0.5, 0.7, 0.9)


@contextlib.contextmanager
def role_module(
    state: TrainState, role: str, *, weights: Weights = "params"
) -> Iterator[nn.Module]:
    """The module of ``role``, computing with its live weights or its EMA weights.

    With ``weights="ema"`` the role's trainable parameters hold the EMA values inside the
    ``with`` block and their own values again after it, bit for bit, also when it raises.
    Every rank of a sharded role enters it (docs/concepts/validation.md).

    Raises:
        ValueError: For an unknown ``weights``, or ``"ema"`` for a role without an EMA.
        ValueError: For ``"params"`` inside a block that holds the role's EMA.
        KeyError: For an unknown role.

    Examples:
        >>> with torch.no_grad(), role_module(state, "student", weights="ema") as net:
        ...     v = predict(net, x_t, t * 1000, text)
    """
    live = adopt(state.role(role))
    sources = select_weights(live, weights, role=role)  # the one rule, as every export
    module = live.role.module
    if weights == "params" and role in roles_holding_other_weights(state):
        raise ValueError(
            f"role_module(state, {role!r}, weights='params') inside a role_module block that "
            f"holds {role!r}'s EMA: read the live weights outside that block"
        )
    swapped = {n: t for n, t in sources.items() if t is not live.params[n]}
    kept: dict[str, torch.Tensor] = {}
    if swapped:
        # FSDP2 keeps some groups unsharded after a no_grad forward, computing with the
        # gathered copy: at rest before the swap and after it, the next forward gathers
        # what is written.
        release_modules(state)
        with torch.no_grad():
            kept = {n: live.params[n].detach().clone() for n in swapped}
    try:
        with torch.no_grad():
            for n, average in swapped.items():
                live.params[n].copy_(average)
        with holding_other_weights(module) if swapped else contextlib.nullcontext():
            yield module
    finally:
        release_modules(state)
        with torch.no_grad():
            for n, value in kept.items():
                live.params[n].copy_(value)


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (CPU for an empty module)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def validation_loss(
    latents: torch.Tensor,
    text: torch.Tensor,
    *,
    role: str = "student",
    timesteps: Sequence[float] = _DEFAULT_TIMESTEPS,
    key: torch.Tensor | None = None,
    weights: Weights = "params",
    batch_size: int | None = None,
) -> Callable[[TrainState, torch.Tensor], Mapping[str, Any]]:
    """The flow-matching loss of ``role`` on fixed held-out latents at fixed timesteps.

    For every ``t`` in ``timesteps``: ``MSE(v(x_t, 1000 t, text), eps - x0)`` in fp32 with
    ``x_t = (1 - t) x0 + t eps`` and ``eps`` drawn once, here, from ``key``: the number
    depends on the weights alone. Reports ``{"loss": mean over timesteps, "loss_t0.50":
    loss at t = 0.5, ...}`` as 0-d tensors.

    Args:
        latents: Held-out clean latents ``x0`` ``(N, C, F, H, W)``.
        text: Their text embeddings ``(N, L, D)``.
        key: The noise key (default ``fvstep.random.key(0)``).
        weights: ``"params"`` or ``"ema"`` (:func:`role_module`).
        batch_size: Evaluate this many samples at a time (``None``: all at once).

    Raises:
        ValueError: If ``latents`` and ``text`` do not match.
        ValueError: If ``timesteps`` is empty or out of ``[0, 1]``.
        ValueError: If ``batch_size < 1`` or ``weights`` is unknown.
    """
    if latents.dim() != 5 or text.dim() != 3 or latents.shape[0] != text.shape[0]:
        raise ValueError(
            f"need latents (N, C, F, H, W) and text (N, L, D) with the same N, got "
            f"{tuple(latents.shape)} and {tuple(text.shape)}"
        )
    times = tuple(float(t) for t in timesteps)
    if not times or any(not 0.0 <= t <= 1.0 for t in times):
        raise ValueError(f"timesteps must be non-empty times in [0, 1], got {times}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if weights not in ("params", "ema"):
        raise ValueError(f"weights must be 'params' or 'ema', got {weights!r}")
    x0_all = latents.detach().clone()
    text_all = text.detach().clone()
    noise_key = fsrandom.key(0) if key is None else key
    eps_all = torch.stack(
        [
            _noise.randn(fsrandom.fold_in(noise_key, i), x0_all.shape, dtype=x0_all.dtype)
            for i in range(len(times))
        ]
    )
    n = x0_all.shape[0]
    chunk = n if batch_size is None else batch_size

    def fn(state: TrainState, key: torch.Tensor) -> Mapping[str, Any]:
        with torch.no_grad(), role_module(state, role, weights=weights) as module:
            device = module_device(module)
            per_t = []
            for i, t in enumerate(times):
                total = torch.zeros((), device=device)
                for lo in range(0, n, chunk):
                    x0 = x0_all[lo : lo + chunk].to(device)
                    eps = eps_all[i, lo : lo + chunk].to(device)
                    tt = torch.full((x0.shape[0],), t, device=device)
                    v = predict(
                        module,
                        add_noise(x0, eps, tt),
                        tt * 1000,
                        text_all[lo : lo + chunk].to(device),
                    )
                    total = total + F.mse_loss(v.float(), (eps - x0).float(), reduction="sum")
                per_t.append(total / x0_all[0].numel() / n)
        losses = torch.stack(per_t)
        out: dict[str, Any] = {"loss": losses.mean()}
        out.update({f"loss_t{t:.2f}": losses[i] for i, t in enumerate(times)})
        return out

    return fn
