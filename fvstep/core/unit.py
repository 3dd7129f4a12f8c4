"""How one unit runs: forward and backward over micro-batches, then the update.

A unit runs in two phases, so that the engine consumes its input state between them,
exactly when the first leaf is about to change:

1. :func:`backward`: for each micro-batch ``m``, ``loss_fn(state, batch_m, key_m)``
   inside ``rng_scope(key_m)`` and backward of ``loss / K`` (of the summed losses of a
   multi-role unit); then, per group of roles updated together, sanitize
   (``"nan_to_num"``) and the global gradient norm; with ``sanitize="error"`` the
   non-finite verdict. It changes no leaf (gradients are not leaves) and leaves no
   ``.grad`` when it raises.
2. :func:`apply`: per group, clip by that norm, step each role's optimizer at its
   schedule position, update its EMA, and clear the gradients.

Gradients reach only the trained roles' parameters: the other roles' parameters have
``requires_grad`` off while the unit runs.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import optree
import torch

from fvstep.core import random as fsrandom
from fvstep.core.finite import raise_non_finite
from fvstep.core.grads import ClipGradNorm, Sanitize, nan_to_num_
from fvstep.core.layout import GradSync, Parallelism
from fvstep.core.state import RoleState, TrainState
from fvstep.core.tree import full_tensor, local_tensors

__all__ = ["Gradients", "LossFn", "apply", "backward", "split_microbatches"]

LossFn = Callable[[TrainState, Any, torch.Tensor], Any]
"""``(state, batch, key) -> loss | (loss, metrics) | ({role: loss}, metrics)``."""


@attrs.define
class Group:
    """Roles updated together (one role, or all of a unit's under a joint clip), with the
    global norm of their gradients, measured before anything changes."""

    names: list[str]
    role_states: list[RoleState]
    params_by_role: list[dict[str, torch.Tensor]]
    params: list[torch.Tensor]  # every parameter, role by role
    norm: torch.Tensor | None = None  # as computed: a DTensor for sharded gradients
    full_norm: torch.Tensor | None = None  # a plain tensor, the same on every rank


@attrs.define
class Gradients:
    """What :func:`backward` leaves for :func:`apply`: the unit's measured gradients.

    Attributes:
        groups: The groups of roles to update, their norms measured.
        metrics: The losses and the loss function's metrics, means over micro-batches.
    """

    groups: list[Group]
    metrics: dict[str, Any]

    def clear(self) -> None:
        """Drop every ``.grad`` of the unit (no gradient outlives a unit)."""
        for group in self.groups:
            for p in group.params:
                p.grad = None


def _unpack(out: Any, roles: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    metrics: dict[str, Any] = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise TypeError("loss_fn must return loss or (loss, metrics dict)")
        out, metrics = out[0], dict(out[1])
    if isinstance(out, torch.Tensor):
        if len(roles) != 1:
            raise TypeError(
                f"loss_fn of a unit training {roles} returned one loss; return a dict "
                "{role: loss} (the unit backpropagates their sum)"
            )
        losses = {roles[0]: out}
    elif isinstance(out, Mapping):
        losses = dict(out)
        if set(losses) != set(roles):
            raise ValueError(
                f"loss_fn returned losses for {sorted(losses)}, expected {sorted(roles)}"
            )
    else:
        raise TypeError(f"loss_fn must return a tensor loss, got {type(out).__name__}")
    for role, loss in losses.items():
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"the loss of role {role!r} must be a scalar tensor")
    return losses, metrics


def _mean(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        return torch.stack([v.detach().float().reshape(()) for v in values]).mean()
    return sum(values) / len(values)


def backward(
    state: TrainState,
    roles: tuple[str, ...],
    loss_fn: LossFn,
    name: str,
    microbatches: Sequence[Any],
    key: torch.Tensor,
    *,
    clip: ClipGradNorm | None,
    sanitize: Sanitize,
    sync: GradSync | None,
    parallelism: Parallelism | None,
) -> Gradients:
    """Phase 1 of a unit: gradients of ``roles`` over ``microbatches``, measured.

    Micro-batch ``m`` is keyed by ``fold_in(key, m)``. Changes no leaf of ``state``.

    Raises:
        NonFiniteGradientError: With ``sanitize="error"``, if a loss or a gradient is not
            finite (on any rank); no ``.grad`` is left.
    """
    num = len(microbatches)
    trained = {r: state.roles[r].trainable_params() for r in roles}
    silenced = [
        p
        for r, rs in state.roles.items()
        if r not in trained
        for p in rs.trainable_params().values()
        if p.requires_grad
    ]
    # Modules must be at rest before requires_grad changes: FSDP2 copies a sharded
    # parameter's requires_grad to its unsharded twin only when it unshards.
    if sync is not None:
        sync.release(state)
    for p in silenced:
        p.requires_grad_(False)
    groups = []
    for names in [list(roles)] if clip is not None and clip.joint else [[r] for r in roles]:
        by_role = [trained[r] for r in names]
        params = [p for role_params in by_role for p in role_params.values()]
        groups.append(Group(names, [state.roles[r] for r in names], by_role, params))
    gradients = Gradients(groups, {})
    gradients.clear()
    loss_log: dict[str, list[torch.Tensor]] = {r: [] for r in roles}
    metric_log: dict[str, list[Any]] = {}
    failed = True
    try:
        if sync is not None:
            sync.begin([state.roles[r] for r in roles], num)
        for index, batch in enumerate(microbatches):
            mkey = fsrandom.fold_in(key, index)
            with fsrandom.rng_scope(mkey):
                losses, metrics = _unpack(loss_fn(state, batch, mkey), roles)
                if sync is not None:
                    sync.before_backward(index)
                # One backward of the summed loss: FSDP2's hooks see one pass.
                (functools.reduce(operator.add, losses.values()) / num).backward()
            for role, loss in losses.items():
                loss_log[role].append(loss.detach())
            for k, v in metrics.items():
                metric_log.setdefault(k, []).append(v)
        failed = False
    finally:
        try:
            sync_metrics = sync.end() if sync is not None else {}
        finally:
            for p in silenced:
                p.requires_grad_(True)
            if failed:
                gradients.clear()
            # A no-grad read of a role leaves FSDP2's root group unsharded.
            if sync is not None:
                sync.release(state, after_error=failed)
    out = gradients.metrics
    out.update({f"{r}/loss": _mean(v) for r, v in loss_log.items()})
    clash = [k for k in metric_log if f"{name}/{k}" in out]
    if clash:
        gradients.clear()
        raise ValueError(
            f"the loss function of unit {name!r} returned the metric {clash[0]!r}, reported "
            f"as {name + '/' + clash[0]!r}, the key of the unit's own loss: rename the metric "
            "(or the unit: update(..., name=...))"
        )
    out.update({f"{name}/{k}": _mean(v) for k, v in metric_log.items()})
    out.update(sync_metrics)
    try:
        for group in groups:
            grads = [p.grad for p in group.params if p.grad is not None]
            if sanitize == "nan_to_num":
                nan_to_num_(grads)
            if clip is not None or sanitize in ("skip", "error"):
                norm_type = clip.norm_type if clip is not None else 2.0
                foreach = clip.foreach if clip is not None else None
                group.norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
                group.full_norm = full_tensor(group.norm).detach()  # of a partial DTensor
        if sanitize == "error":
            _check_finite(int(state.step), name, roles, loss_log, groups, parallelism)
    except BaseException:
        gradients.clear()
        raise
    return gradients


def _check_finite(
    step: int,
    name: str,
    roles: tuple[str, ...],
    loss_log: Mapping[str, list[torch.Tensor]],
    groups: list[Group],
    parallelism: Parallelism | None,
) -> None:
    """``sanitize="error"``: one device sync for the verdict of every rank (the norms are
    global; the non-finite losses are counted over ranks)."""
    losses = local_tensors([loss for r in roles for loss in loss_log[r]])
    device = losses[0].device
    bad = (~torch.isfinite(torch.stack([x.float().reshape(()) for x in losses]))).sum().float()
    if parallelism is not None:
        bad = parallelism.sum_over_ranks(bad, [p for g in groups for p in g.params]).to(device)
    norms = [g.full_norm.float().reshape(()).to(device) for g in groups if g.full_norm is not None]
    verdict = torch.stack([bad, *norms]).tolist()  # the one device sync
    if verdict[0] == 0 and all(math.isfinite(v) for v in verdict[1:]):
        return
    raise_non_finite(step, name, roles, loss_log, groups, verdict)


def apply(
    state: TrainState,
    gradients: Gradients,
    *,
    clip: ClipGradNorm | None,
    sanitize: Sanitize,
) -> tuple[TrainState, dict[str, Any]]:
    """Phase 2 of a unit: clip, optimize and EMA each group; clear the gradients.

    Metrics: ``<group>/grad_norm`` (before clipping; when clipping, skipping or checking),
    ``<role>/lr``, ``<role>/skipped``, after :func:`backward`'s losses and metrics.
    """
    step = int(state.step)
    out = gradients.metrics
    roles = dict(state.roles)
    try:
        for group in gradients.groups:
            full = group.full_norm
            skipped = full is not None and sanitize == "skip" and not bool(torch.isfinite(full))
            if full is not None:
                out["+".join(group.names) + "/grad_norm"] = full
            if not skipped and clip is not None and group.norm is not None:
                torch.nn.utils.clip_grads_with_norm_(
                    group.params, clip.max_norm, group.norm, foreach=clip.foreach
                )
            for role, rs, params in zip(group.names, group.role_states, group.params_by_role):
                optimizer = rs.role.optimizer
                assert optimizer is not None
                out[f"{role}/lr"] = optimizer.learning_rate(int(rs.opt_state.count))
                out[f"{role}/skipped"] = skipped
                if skipped:
                    continue
                grads = {n: p.grad for n, p in params.items()}
                opt_state = optimizer.update(params, grads, rs.opt_state)
                roles[role] = attrs.evolve(rs, opt_state=opt_state)  # type: ignore[misc]
                ema = rs.role.ema
                if ema is not None and rs.ema is not None and step >= ema.start_step:
                    _update_ema(rs.ema.params, params, rs.ema.initialized, ema.decay)
    finally:
        gradients.clear()
    return state.replace(roles=roles), out


@torch.no_grad()
def _update_ema(
    ema: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    initialized: torch.Tensor,
    decay: float,
) -> None:
    """``ema = decay * ema + (1 - decay) * param`` in fp32; the first call copies.

    The EMA is sharded like the parameters: DTensors are updated on their local shards
    (no communication; foreach kernels apply).
    """
    targets = local_tensors([ema[n] for n in params])
    sources = [x.to(torch.float32) for x in local_tensors([p.detach() for p in params.values()])]
    if not bool(initialized):
        torch._foreach_copy_(targets, sources)
        initialized.fill_(True)
        return
    torch._foreach_mul_(targets, decay)
    torch._foreach_add_(targets, sources, alpha=1.0 - decay)


def split_microbatches(batch: Any, num: int) -> list[Any]:
    """Split ``batch`` into ``num`` micro-batches along dim 0 of every tensor leaf.

    A ``list`` (or tuple) of exactly ``num`` items is taken as already split. Non-tensor
    leaves (ints, strings) are shared by every micro-batch.

    Args:
        batch: A pytree (dicts, tuples, lists) of tensors, or a list of ``num`` micro-batches.
        num: The number of micro-batches.

    Returns:
        A list of ``num`` pytrees of the same structure.

    Raises:
        ValueError: If a tensor's dim 0 is not divisible by ``num``, tensors disagree on
            dim 0, or a given list has the wrong length.
    """
    if isinstance(batch, (list, tuple)) and not _is_tensor_tree(batch):
        if len(batch) != num:
            raise ValueError(f"got a list of {len(batch)} micro-batches, expected {num}")
        return list(batch)
    if num == 1:
        return [batch]
    _paths, flat, spec = optree.tree_flatten_with_path(batch)
    sizes = {int(x.shape[0]) for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"batch tensors disagree on dim 0: sizes {sorted(sizes)}")
    if sizes and next(iter(sizes)) % num:
        raise ValueError(
            f"batch size {next(iter(sizes))} is not divisible by microbatches={num}; "
            "pass a list of micro-batches for uneven splits"
        )
    columns = [
        x.chunk(num, dim=0) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * num
        for x in flat
    ]
    return [optree.tree_unflatten(spec, [col[m] for col in columns]) for m in range(num)]


def _is_tensor_tree(batch: Sequence[Any]) -> bool:
    """A tuple/list whose items are tensors is one batch (e.g. ``(x, y)``), not micro-batches."""
    return len(batch) > 0 and all(isinstance(x, torch.Tensor) for x in batch)
