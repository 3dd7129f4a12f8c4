"""Hand-written imperative training loops: what fvstep is tested and measured against.

Each loop is written the way a user would write it without fvstep: modules sharded with
``fully_shard`` by hand (:func:`shard_by_hand`), ``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``, ``loss / K`` backward per micro-batch, FSDP2 flags set
by hand per micro-batch. No fvstep machinery runs here but the key derivation
(:func:`unit_key`, fvstep's documented scheme) and, for DMD2, the method's loss math (its
loss functions read modules through :func:`modules_view`); the flow-matching loss of
fine-tuning is written out by hand (:func:`flow_matching_by_hand`). So a difference between
fvstep and these loops is a difference of execution (gradients, syncs, clipping,
optimizer, state left in a module) or of the noise a method draws.

This is the one copy. Its users: ``tests/test_against_torch.py`` (one process),
``tests/test_distributed.py`` and ``tests/test_multirole_fsdp.py`` (2 CPU ranks, gloo),
``tests/gpu/equality.py`` (NCCL), all for bitwise equality, and
:mod:`benchmarks.overhead` for time and memory. It lives with the benchmarks, outside the
wheel, because a benchmark never imports the test tree; tests import it from here (run
from the repository root).

Examples:
    >>> module = shard_by_hand(tiny_wan(seed=0), mesh)
    >>> opt = finetune_loop(module, batch_at, num_steps=5, rank=rank, base_key=key(7),
    ...                     microbatches=2, sync="no_sync", lr=1e-3, weight_decay=0.1,
    ...                     max_norm=0.5)
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fvstep.core.random import fold_in, fold_in_name, generator, split

__all__ = [
    "dmd2_loop",
    "finetune_loop",
    "finetune_step",
    "flow_matching_by_hand",
    "microbatches",
    "modules_view",
    "reshard_all",
    "run_unit",
    "shard_by_hand",
    "unit_key",
]

Batch = dict[str, torch.Tensor]
Loss = torch.Tensor | Mapping[str, torch.Tensor]


def unit_key(base: torch.Tensor, step: int, rank: int, name: str, microbatch: int) -> torch.Tensor:
    """The key fvstep gives micro-batch ``microbatch`` of the unit named ``name``.

    ``fold_in(fold_in_name(fold_in(fold_in(base, step), rank), name), microbatch)``, with
    ``rank`` the data-parallel index (ranks of one sequence-parallel group share it). A
    unit's name is its ``name=`` or, by default, its roles joined by ``+``
    (``fvstep.update("student", ...)`` is ``"student"``); DMD2's units are
    ``"dmd2_generator"``, ``"dmd2_critic"`` and ``"dmd2_fused"``.
    """
    return fold_in(fold_in_name(fold_in(fold_in(base, step), rank), name), microbatch)


def modules_view(modules: Mapping[str, nn.Module]) -> Any:
    """A stand-in for a ``TrainState`` that loss functions read modules from."""
    return types.SimpleNamespace(module=modules.__getitem__)


def shard_by_hand(module: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    """``fully_shard`` every block of a Wan transformer, then the root (``kwargs``: FSDP2's)."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return module


def reshard_all(modules: Mapping[str, nn.Module]) -> None:
    """Reshard every FSDP2 group of ``modules`` (to read their sharded parameters)."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules.values():
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def microbatches(batch: Mapping[str, torch.Tensor], k: int) -> list[Batch]:
    """``batch`` split along dim 0 into ``k`` micro-batches."""
    parts = {name: t.chunk(k) for name, t in batch.items()}
    return [{name: parts[name][m] for name in batch} for m in range(k)]


def flow_matching_by_hand(
    module: nn.Module, x0: torch.Tensor, text: torch.Tensor, key: torch.Tensor
) -> torch.Tensor:
    """The flow-matching loss of one micro-batch, written out.

    ``split(key, 2)`` gives ``t ~ U[0, 1)`` and ``eps ~ N(0, I)`` (generators on ``x0``'s
    device); ``x_t = (1 - t) x0 + t eps``; the loss is ``MSE(v(x_t, 1000 t), eps - x0)`` in
    fp32, ``v`` read through the forward contract of :mod:`fvstep.methods.models`.
    """
    k_t, k_eps = split(key, 2)
    device = x0.device
    t = torch.rand((x0.shape[0],), generator=generator(k_t, device), device=device)
    eps = torch.randn(x0.shape, generator=generator(k_eps, device), device=device, dtype=x0.dtype)
    tb = t.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    x_t = (1 - tb) * x0 + tb * eps
    v = module(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text, return_dict=False)
    return F.mse_loss(v[0].float(), (eps - x0).float())


def _fsdp_roots(modules: Sequence[nn.Module]) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in modules if isinstance(m, FSDPModule)]


def run_unit(
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    roles: Sequence[str],
    loss_of: Callable[[int, Batch], Loss],
    batch: Mapping[str, torch.Tensor],
    *,
    num_microbatches: int,
    sync: str = "every",
    keep_params_gathered: bool = False,
    max_norm: float | None = None,
    clip_foreach: bool | None = None,
    schedulers: Mapping[str, torch.optim.lr_scheduler.LRScheduler] | None = None,
) -> torch.Tensor:
    """One update of ``roles`` by hand: K micro-batches, FSDP2 flags, clip, step, zero_grad.

    Per micro-batch ``m``: on the roles' FSDP2 roots, ``no_sync`` sets
    ``set_requires_gradient_sync(last)``, ``deferred`` sets ``set_is_last_backward(last)``
    and ``keep_params_gathered`` sets ``set_reshard_after_backward(last)``; then
    ``loss_of(m, microbatch)`` (one loss, or one per role, summed) is backpropagated
    divided by K. Then each role is clipped by its own norm (``max_norm``), stepped (and its
    scheduler), its gradients set to ``None``, and its flags restored to FSDP2's defaults.

    Returns:
        The last micro-batch's loss, detached.
    """
    k = num_microbatches
    roots = _fsdp_roots([modules[r] for r in roles])
    loss = torch.zeros(())
    for m, mb in enumerate(microbatches(batch, k)):
        last = m == k - 1
        for root in roots:
            if sync == "no_sync":
                root.set_requires_gradient_sync(last)
            elif sync == "deferred":
                root.set_is_last_backward(last)
            if keep_params_gathered:
                root.set_reshard_after_backward(last)
        out = loss_of(m, mb)
        loss = (
            out if isinstance(out, torch.Tensor) else functools.reduce(operator.add, out.values())
        )
        (loss / k).backward()
    for r in roles:
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(modules[r].parameters(), max_norm, foreach=clip_foreach)
        optimizers[r].step()
        if schedulers is not None and r in schedulers:
            schedulers[r].step()
        optimizers[r].zero_grad(set_to_none=True)
    for root in roots:
        root.set_requires_gradient_sync(True)
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
    return loss.detach()


def finetune_step(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    *,
    step: int,
    rank: int,
    base_key: torch.Tensor,
    num_microbatches: int,
    sync: str = "every",
    keep_params_gathered: bool = False,
    max_norm: float | None = None,
    clip_foreach: bool | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    name: str = "student",
    autocast: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """Step ``step`` of flow-matching fine-tuning by hand (the unit ``name``, one role).

    What ``fvstep.compile(fvstep.update(name, flow_matching_loss()), ...)`` does, with the
    loss of :func:`flow_matching_by_hand` keyed by :func:`unit_key`. ``autocast``: a
    context (``torch.autocast``) entered around each micro-batch's loss.

    Returns:
        The last micro-batch's loss, detached.
    """

    def loss_of(m: int, mb: Batch) -> torch.Tensor:
        with autocast if autocast is not None else contextlib.nullcontext():
            key = unit_key(base_key, step, rank, name, m)
            return flow_matching_by_hand(module, mb["latents"], mb["text"], key)

    return run_unit(
        {name: module},
        {name: opt},
        (name,),
        loss_of,
        {"latents": batch["latents"], "text": batch["text"]},
        num_microbatches=num_microbatches,
        sync=sync,
        keep_params_gathered=keep_params_gathered,
        max_norm=max_norm,
        clip_foreach=clip_foreach,
        schedulers=None if scheduler is None else {name: scheduler},
    )


def finetune_loop(
    module: nn.Module,
    batches: Callable[[int], Mapping[str, torch.Tensor]],
    *,
    num_steps: int,
    rank: int,
    base_key: torch.Tensor,
    num_microbatches: int,
    sync: str = "every",
    lr: float | Callable[[int], float],
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float,
    max_norm: float | None,
    foreach: bool | None = None,
    name: str = "student",
) -> torch.optim.AdamW:
    """``num_steps`` steps of :func:`finetune_step` with ``torch.optim.AdamW``; returns it.

    A schedule ``lr`` runs as ``LambdaLR(AdamW(lr=1.0), lr)`` stepped once per step;
    ``foreach`` goes to both AdamW and ``clip_grad_norm_``.
    """
    base_lr = 1.0 if callable(lr) else lr
    opt = torch.optim.AdamW(
        module.parameters(), lr=base_lr, betas=betas, weight_decay=weight_decay, foreach=foreach
    )
    scheduler = None
    if callable(lr):
        schedule = lr
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: schedule(c))
    for step in range(num_steps):
        finetune_step(
            module,
            opt,
            batches(step),
            step=step,
            rank=rank,
            base_key=base_key,
            num_microbatches=num_microbatches,
            sync=sync,
            max_norm=max_norm,
            clip_foreach=foreach,
            scheduler=scheduler,
            name=name,
        )
    return opt


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

    ``ordering="sequential"``: at generator steps the unit ``"dmd2_generator"`` (student),
    then at every step ``"dmd2_critic"``. ``ordering="fused"``: at generator steps one unit
    ``"dmd2_fused"`` backpropagates the sum of both losses, else ``"dmd2_critic"``. Each
    role is clipped by its own norm. Returns the optimizers.
    """
    from fvstep.methods.dmd2 import dmd2_losses

    losses = dmd2_losses()
    view = modules_view(modules)
    opts: dict[str, torch.optim.Optimizer] = {
        r: torch.optim.AdamW(modules[r].parameters(), lr=lr, weight_decay=weight_decay)
        for r in ("student", "critic")
    }

    def unit(roles: tuple[str, ...], name: str, loss_fn: Callable[..., Any]) -> None:
        def loss_of(m: int, mb: Batch) -> Loss:
            out, _ = loss_fn(view, mb, unit_key(base_key, step, rank, name, m))
            return out

        run_unit(
            modules,
            opts,
            roles,
            loss_of,
            batch,
            num_microbatches=microbatches_per_step,
            max_norm=max_norm,
        )

    for step in range(num_steps):
        batch = batches(step)
        generator_step = step % generator_update_interval == 0
        if ordering == "sequential":
            if generator_step:
                unit(("student",), "dmd2_generator", losses.generator_loss)
            unit(("critic",), "dmd2_critic", losses.critic_loss)
        elif generator_step:
            unit(("student", "critic"), "dmd2_fused", losses.fused_loss)
        else:
            unit(("critic",), "dmd2_critic", losses.critic_loss)
    reshard_all(modules)
    return opts
