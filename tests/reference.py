"""Hand-written imperative training loops: what fvstep's steps are compared against.

Each loop is written the way a user would write it without fvstep: modules sharded with
``fully_shard`` by hand, ``torch.optim.AdamW``, ``torch.nn.utils.clip_grad_norm_``,
``loss / K`` backward per micro-batch, FSDP2 flags set by hand. No fvstep machinery runs
here but the loss *math* (the method's loss functions, which read modules through a
plain namespace) and the key derivation (:func:`unit_key`), so a difference is a
difference of execution: gradients, syncs, clipping, optimizer, hidden module state.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fvstep.random import fold_in


def unit_key(base: torch.Tensor, step: int, rank: int, position: int, microbatch: int):
    """The key fvstep gives micro-batch ``microbatch`` of the unit at ``position``.

    ``fold_in(fold_in(fold_in(fold_in(base, step), data_parallel_index), position), m)``.
    """
    return fold_in(fold_in(fold_in(fold_in(base, step), rank), position), microbatch)


def modules_view(modules: dict[str, nn.Module]) -> Any:
    """A stand-in for a ``TrainState`` that loss functions read modules from."""
    return types.SimpleNamespace(module=modules.__getitem__)


def shard_by_hand(module: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    """``fully_shard`` every block of a Wan transformer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return module


def reshard_all(modules: dict[str, nn.Module]) -> None:
    """Reshard every FSDP2 group of ``modules`` (to read their sharded parameters)."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules.values():
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def microbatches(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` split along dim 0 into ``k`` micro-batches."""
    parts = {name: t.chunk(k) for name, t in batch.items()}
    return [{name: parts[name][m] for name in batch} for m in range(k)]


def dmd2_loop(
    modules: dict[str, nn.Module],
    batches: Callable[[int], dict[str, torch.Tensor]],
    *,
    num_steps: int,
    microbatches_per_step: int,
    ordering: str,
    generator_update_interval: int,
    rank: int,
    base_key: torch.Tensor,
    lr: float,
    weight_decay: float,
    max_norm: float,
) -> dict[str, torch.optim.Optimizer]:
    """DMD2 by hand: ``student`` and ``critic`` trained with AdamW, ``teacher`` frozen.

    ``ordering="sequential"``: at generator steps the student's unit (position 0), then
    at every step the critic's unit (position 1). ``ordering="fused"``: at generator
    steps one unit (position 0) backpropagates the sum of both losses, else the critic's
    unit (position 1). Each role is clipped by its own norm. Returns the optimizers.
    """
    from fvstep.methods.dmd2 import dmd2_losses

    losses = dmd2_losses()
    view = modules_view(modules)
    k = microbatches_per_step
    opts = {
        r: torch.optim.AdamW(modules[r].parameters(), lr=lr, weight_decay=weight_decay)
        for r in ("student", "critic")
    }

    def unit(roles: tuple[str, ...], loss_fn: Callable, step: int, position: int, batch) -> None:
        for m, mb in enumerate(microbatches(batch, k)):
            out, _ = loss_fn(view, mb, unit_key(base_key, step, rank, position, m))
            loss = out if isinstance(out, torch.Tensor) else functools.reduce(operator.add, out.values())
            (loss / k).backward()
        for r in roles:
            torch.nn.utils.clip_grad_norm_(modules[r].parameters(), max_norm)
            opts[r].step()
            opts[r].zero_grad(set_to_none=True)

    for step in range(num_steps):
        batch = batches(step)
        generator_step = step % generator_update_interval == 0
        if ordering == "sequential":
            if generator_step:
                unit(("student",), losses.generator_loss, step, 0, batch)
            unit(("critic",), losses.critic_loss, step, 1, batch)
        elif generator_step:
            unit(("student", "critic"), losses.fused_loss, step, 0, batch)
        else:
            unit(("critic",), losses.critic_loss, step, 1, batch)
    reshard_all(modules)
    return opts
