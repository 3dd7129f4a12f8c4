"""The update unit: forward/backward over micro-batches, sanitize, clip, optimize, EMA.

``update(roles, loss_fn)`` is the building block of every method. ``loss_fn(state, batch,
key)`` returns a loss (or one loss per role, as a dict) and optionally a metrics dict; it
may call any role's module through ``state.module(name)``. Gradients reach only the
parameters of the roles the unit trains: the other roles' parameters have
``requires_grad`` off while the unit runs, and no ``.grad`` outlives the unit.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from fvstep import random as fsrandom
from fvstep.grads import SANITIZE_POLICIES, ClipGradNorm, Sanitize, as_full, nan_to_num_, total_norm
from fvstep.state import RoleState, TrainState
from fvstep.tree import replace

__all__ = [
    "DEFAULT",
    "GradSync",
    "LossFn",
    "NoSync",
    "Update",
    "run_update",
    "update",
]

LossFn = Callable[[TrainState, Any, torch.Tensor], Any]


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
"""Marks an option that falls back to the setting given to ``fvstep.compile``."""


@attrs.frozen(eq=False)
class Update:
    """One update unit (see :func:`update`)."""

    roles: tuple[str, ...]
    loss_fn: LossFn
    clip: Any = DEFAULT
    sanitize: Any = DEFAULT
    name: str = ""

    def num_leaves(self) -> int:
        """A unit is one leaf of a method tree."""
        return 1

    def active(self, step: int, base: int = 0) -> list[tuple[int, Any]]:
        """A unit runs at every step it is reached."""
        return [(base, self)]


def update(
    roles: str | Sequence[str],
    loss_fn: LossFn,
    *,
    clip: ClipGradNorm | None = DEFAULT,
    sanitize: Sanitize = DEFAULT,
    name: str | None = None,
) -> Update:
    """Train ``roles`` on ``loss_fn``: the unit that methods are built from.

    At each step it runs, for each micro-batch ``m`` of ``K``: ``loss_fn(state, batch_m,
    key_m)`` inside ``fvstep.random.rng_scope(key_m)``, then backward of ``loss / K``
    (with a dict of losses, of their sum: each role's gradient is the gradient of the
    sum, so a loss that reads another trained role's output must detach it or compute
    it under ``torch.no_grad()``, as DMD2's losses do).
    After the last micro-batch, per role: sanitize non-finite gradients, clip by global
    norm, apply the role's optimizer at its schedule position, update its EMA.

    Args:
        roles: The role (or roles) trained; each must have an optimizer.
        loss_fn: ``(state, batch, key) -> loss | (loss, metrics) | ({role: loss}, metrics)``.
        clip: A :func:`fvstep.clip_grad_norm`, ``None`` for no clipping, or left out for
            the compile-wide setting.
        sanitize: ``"nan_to_num"`` (zero non-finite entries), ``"skip"`` (leave
            parameters and optimizer state bit-unchanged if the gradient norm is not
            finite; metric ``<role>/skipped``), ``None``, or left out for the
            compile-wide setting.
        name: A label for metrics (default: the roles joined by ``+``).

    Returns:
        An :class:`Update`, composable with ``sequence``, ``every``, ``cond``.

    Examples:
        >>> unit = update("student", flow_matching_loss, clip=clip_grad_norm(1.0))
    """
    roles_t = (roles,) if isinstance(roles, str) else tuple(roles)
    if not roles_t or not all(isinstance(r, str) for r in roles_t):
        raise ValueError(f"update needs one or more role names, got {roles!r}")
    if len(set(roles_t)) != len(roles_t):
        raise ValueError(f"update got a role twice: {roles_t}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if sanitize is not DEFAULT and sanitize not in SANITIZE_POLICIES:
        raise ValueError(f"unknown sanitize policy {sanitize!r}; choose one of {SANITIZE_POLICIES}")
    if clip is not DEFAULT and clip is not None and not isinstance(clip, ClipGradNorm):
        raise TypeError("clip must be fvstep.clip_grad_norm(...) or None")
    return Update(roles_t, loss_fn, clip, sanitize, name or "+".join(roles_t))


class GradSync(Protocol):
    """What the executor does around micro-batches to control gradient reduction.

    The single-process implementation is :class:`NoSync`; ``fvstep.distributed``
    provides the FSDP2 one.
    """

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Called once before the first micro-batch of a unit."""

    def before_backward(self, index: int) -> None:
        """Called before the backward of micro-batch ``index``."""

    def end(self) -> dict[str, Any]:
        """Called after the last backward (also on error); returns debug metrics."""
        ...


class NoSync:
    """The gradient-sync policy of unsharded modules: nothing to do."""

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Nothing to prepare."""

    def before_backward(self, index: int) -> None:
        """Nothing to switch."""

    def end(self) -> dict[str, Any]:
        """No collectives were issued."""
        return {}


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


def run_update(
    state: TrainState,
    unit: Update,
    microbatches: Sequence[Any],
    keys: Sequence[torch.Tensor],
    *,
    clip: ClipGradNorm | None,
    sanitize: Sanitize,
    sync: GradSync,
) -> tuple[TrainState, dict[str, Any]]:
    """Run one unit on ``state`` (whose tensors it updates in place); the engine of steps.

    ``clip`` and ``sanitize`` are the unit's settings with defaults already resolved.
    Metrics: ``<role>/loss`` (mean over micro-batches of the unscaled loss), the loss
    function's own metrics as ``<name>/<metric>`` (mean over micro-batches),
    ``<role>/grad_norm`` (before clipping; when clipping or skipping), ``<role>/lr``,
    ``<role>/skipped``.
    """
    num = len(microbatches)
    role_states = [state.role(r) for r in unit.roles]
    for rs, name in zip(role_states, unit.roles, strict=False):
        if not rs.role.trainable:
            raise ValueError(f"unit {unit.name!r} trains role {name!r}, which is frozen")
    trained = {r: rs.trainable_params() for r, rs in zip(unit.roles, role_states, strict=False)}
    silenced = [
        p
        for r, rs in state.roles.items()
        if r not in trained
        for p in rs.trainable_params().values()
        if p.requires_grad
    ]
    for params in trained.values():
        for p in params.values():
            p.grad = None
    for p in silenced:
        p.requires_grad_(False)
    loss_log: dict[str, list[torch.Tensor]] = {r: [] for r in unit.roles}
    metric_log: dict[str, list[Any]] = {}
    try:
        sync.begin(role_states, num)
        for index, (batch, key) in enumerate(zip(microbatches, keys, strict=False)):
            with fsrandom.rng_scope(key):
                losses, metrics = _unpack(unit.loss_fn(state, batch, key), unit.roles)
                sync.before_backward(index)
                # One backward of the (summed) loss: FSDP2's hooks see one pass, and
                # autograd.backward(inputs=...) cannot name FSDP2's unsharded parameters.
                (functools.reduce(operator.add, losses.values()) / num).backward()
            for role, loss in losses.items():
                loss_log[role].append(loss.detach())
            for k, v in metrics.items():
                metric_log.setdefault(k, []).append(v)
    finally:
        sync_metrics = sync.end()
        for p in silenced:
            p.requires_grad_(True)
    out: dict[str, Any] = {f"{r}/loss": _mean(v) for r, v in loss_log.items()}
    out.update({f"{unit.name}/{k}": _mean(v) for k, v in metric_log.items()})
    out.update(sync_metrics)
    step = int(state.step)
    new_roles = dict(state.roles)
    joint = clip is not None and clip.joint
    groups = [list(unit.roles)] if joint else [[r] for r in unit.roles]
    by_name = dict(zip(unit.roles, role_states))
    for group in groups:
        updated, group_metrics = _apply_group(
            group, [by_name[r] for r in group], [trained[r] for r in group], step, clip, sanitize
        )
        for role, rs in zip(group, updated):
            new_roles[role] = rs
        prefix = "+".join(group)
        out.update({f"{prefix}/{k}": v for k, v in group_metrics.items() if k in _NORM_METRICS})
        for role in group:
            out[f"{role}/skipped"] = group_metrics["skipped"]
            out[f"{role}/lr"] = group_metrics["lr"][role]
    return state.replace(roles=new_roles), out


_NORM_METRICS = ("grad_norm",)


def _apply_group(
    names: list[str],
    role_states: list[RoleState],
    params_by_role: list[dict[str, torch.Tensor]],
    step: int,
    clip: ClipGradNorm | None,
    sanitize: Sanitize,
) -> tuple[list[RoleState], dict[str, Any]]:
    """Sanitize, clip (one norm over the group), optimize and EMA roles after backward.

    A group is one role, or every role of the unit with ``clip_grad_norm(joint=True)``.
    """
    param_list = [p for params in params_by_role for p in params.values()]
    grads = [p.grad for p in param_list if p.grad is not None]
    metrics: dict[str, Any] = {}
    if sanitize == "nan_to_num":
        nan_to_num_(grads)
    norm = None
    if clip is not None or sanitize == "skip":
        norm_type = clip.norm_type if clip is not None else 2.0
        norm = total_norm(grads, norm_type=norm_type, foreach=clip.foreach if clip else None)
        metrics["grad_norm"] = as_full(norm).detach()
    skipped = norm is not None and sanitize == "skip" and not bool(torch.isfinite(as_full(norm)))
    metrics["skipped"] = skipped
    metrics["lr"] = {}
    if not skipped and clip is not None and norm is not None:
        clip.apply(param_list, norm)
    updated = []
    for name, rs, params in zip(names, role_states, params_by_role):
        optimizer = rs.role.optimizer
        assert optimizer is not None
        metrics["lr"][name] = optimizer.learning_rate(int(rs.opt_state.count))
        opt_state = rs.opt_state
        if not skipped:
            opt_state = optimizer.update(params, {n: p.grad for n, p in params.items()}, opt_state)
            ema = rs.ema
            if ema is not None and rs.role.ema is not None and step >= rs.role.ema.start_step:
                _update_ema(ema.params, params, ema.initialized, rs.role.ema.decay)
        updated.append(replace(rs, opt_state=opt_state))
    for p in param_list:
        p.grad = None
    return updated, metrics


def _local(x: torch.Tensor) -> torch.Tensor:
    to_local = getattr(x, "to_local", None)
    return to_local() if to_local is not None else x


@torch.no_grad()
def _update_ema(
    ema: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    initialized: torch.Tensor,
    decay: float,
) -> None:
    """``ema = decay * ema + (1 - decay) * param`` in fp32; the first call copies.

    The EMA is sharded exactly like the parameters, so DTensors are updated shard by
    shard (on their local tensors: no communication, and foreach kernels apply).
    """
    targets = [_local(ema[n]) for n in params]
    sources = [_local(p.detach()).to(torch.float32) for p in params.values()]
    if not bool(initialized):
        torch._foreach_copy_(targets, sources)
        initialized.fill_(True)
        return
    torch._foreach_mul_(targets, decay)
    torch._foreach_add_(targets, sources, alpha=1.0 - decay)
