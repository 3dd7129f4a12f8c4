"""The update unit: forward/backward over micro-batches, sanitize, clip, optimize, EMA.

``update(roles, loss_fn)`` is the building block of every method. ``loss_fn(state, batch,
key)`` returns a loss (or one loss per role, as a dict) and optionally a metrics dict; it
may call any role's module through ``state.module(name)``. Gradients reach only the
parameters of the roles the unit trains: the other roles' parameters have
``requires_grad`` off while the unit runs, and no ``.grad`` outlives the unit.

A unit (:class:`Update`) is a step (:class:`~fvstep.stepfn.Step`), and a leaf of the
steps composed from it; :func:`run_update` is the engine every unit runs through. The
gradient-sync protocol it drives (:class:`~fvstep.sync.GradSync`, :class:`~fvstep.sync.NoSync`)
lives in :mod:`fvstep.sync` and is re-exported here under its old address.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fvstep import random as fsrandom
from fvstep.accumulation import split_microbatches
from fvstep.grads import (
    ClipGradNorm,
    NonFiniteGradientError,
    Sanitize,
    as_full,
    first_non_finite,
    nan_to_num_,
    total_norm,
)
from fvstep.state import RoleState, TrainState
from fvstep.stepfn import (
    UNSET,
    CallSettings,
    Leaf,
    Policy,
    RunContext,
    Unset,
    _check_clip,
    _check_sanitize,
)
from fvstep.sync import GradSync, NoSync, Parallelism, SingleProcess
from fvstep.tree import _local, replace

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

DEFAULT: Any = UNSET
"""The old name of :data:`fvstep.stepfn.UNSET` (an option left to the enclosing step); typed
``Any`` so that signatures written as ``clip: ClipGradNorm | None = DEFAULT`` still check."""


@attrs.frozen(eq=False)
class Update(Leaf):
    """One update unit (see :func:`update`): a step, and a leaf of composed steps.

    Attributes:
        roles: The roles it trains.
        loss_fn: ``(state, batch, key) -> loss | (loss, metrics) | ({role: loss}, metrics)``.
        clip: Its own clipping, or :data:`~fvstep.stepfn.UNSET` (the enclosing one).
        sanitize: Its own non-finite policy, or :data:`~fvstep.stepfn.UNSET`.
        name: Keys its randomness and labels its metrics.
        settings: Call settings, when it is called on its own (see
            :class:`~fvstep.stepfn.CallSettings`).
    """

    kind: ClassVar[str] = "unit"

    roles: tuple[str, ...]
    loss_fn: LossFn
    clip: ClipGradNorm | Unset | None = UNSET
    sanitize: Sanitize | Unset = UNSET
    name: str = ""
    settings: CallSettings = attrs.Factory(CallSettings)

    @property
    def trains(self) -> tuple[str, ...]:
        """The roles it trains."""
        return self.roles

    @property
    def policy(self) -> Policy:
        """Its own clip and sanitize settings."""
        return Policy(clip=self.clip, sanitize=self.sanitize)

    def run(
        self, state: TrainState, batch: Any, key: torch.Tensor, policy: Policy, ctx: RunContext
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run as a leaf of a step: on the step's batch, split once per call."""
        what = f"unit {self.name!r} (position {ctx.position(self)}, roles {list(self.roles)})"
        ctx.begin(what)
        assert policy.accumulation is not None
        microbatches = ctx.microbatches(batch, policy.accumulation.microbatches)
        return self._run(state, microbatches, key, policy, ctx, what)

    def run_inner(
        self, state: TrainState, batch: Any, key: torch.Tensor, policy: Policy, ctx: RunContext
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run inside a managed step (``ctx.update``): on the batch the managed step gives."""
        assert policy.accumulation is not None
        microbatches = split_microbatches(batch, policy.accumulation.microbatches)
        what = f"unit {self.name!r} (roles {list(self.roles)})"
        return self._run(state, microbatches, key, policy, ctx, what)

    def _run(
        self,
        state: TrainState,
        microbatches: list[Any],
        key: torch.Tensor,
        policy: Policy,
        ctx: RunContext,
        what: str,
    ) -> tuple[TrainState, dict[str, Any]]:
        assert policy.accumulation is not None and policy.clip is not UNSET
        assert policy.sanitize is not UNSET
        return run_update(
            state,
            self,
            microbatches,
            [fsrandom.fold_in(key, m) for m in range(len(microbatches))],
            clip=policy.clip,
            sanitize=policy.sanitize,
            sync=ctx.parallelism.grad_sync(state, policy.accumulation),
            parallelism=ctx.parallelism,
            before_change=ctx.before_change(what),
        )


def update(
    roles: str | Sequence[str],
    loss_fn: LossFn,
    *,
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
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

    The unit is a step: ``update(...)(state, batch)`` runs it with the default policy
    (one micro-batch, no clipping, ``sanitize="error"``), and ``sequence``, ``every``,
    ``cond`` and ``compile`` take it. Its key is ``fold_in_name(step_key, name)``.

    Args:
        roles: The role (or roles) trained; each must have an optimizer.
        loss_fn: ``(state, batch, key) -> loss | (loss, metrics) | ({role: loss}, metrics)``.
        clip: A :func:`fvstep.clip_grad_norm`, ``None`` for no clipping, or left out for
            the enclosing setting (a managed step's, then ``compile``'s; default off).
        sanitize: What to do with a NaN or infinite gradient, or left out for the
            enclosing setting (whose default is ``"error"``):

            - ``"error"``: raise :class:`~fvstep.grads.NonFiniteGradientError` (naming the
              step, unit, role and the first non-finite parameter, or the role and
              micro-batch of a non-finite loss) before any leaf of the unit changes;
              costs one device sync per unit, and reuses the clipping norm;
            - ``"skip"``: leave the roles' parameters, optimizer state and EMA
              bit-unchanged when their gradient norm is not finite (metric
              ``<role>/skipped``);
            - ``"nan_to_num"``: zero non-finite gradient entries, then step;
            - ``None``: no check. Unsafe: a single NaN gradient silently turns every
              parameter and optimizer moment of the role into NaN.
        name: Keys the unit's randomness and labels its metrics (default: the roles
            joined by ``+``); unique among the units of a composed step.

    Returns:
        An :class:`Update`, a step composable with ``sequence``, ``every``, ``cond``,
        ``compile``.

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
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"a unit's name must be a non-empty str, got {name!r}")
    _check_sanitize(sanitize)
    _check_clip(clip)
    return Update(roles_t, loss_fn, clip, sanitize, name or "+".join(roles_t))


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
    parallelism: Parallelism | None = None,
    before_change: Callable[[], None] | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """Run one unit on ``state`` (whose tensors it updates in place); the engine of steps.

    ``clip`` and ``sanitize`` are the unit's settings with defaults already resolved.
    ``sync`` is the unit's gradient-sync controller and ``parallelism`` the process
    layout whose :meth:`~fvstep.sync.Parallelism.sum_over_ranks` makes the
    ``sanitize="error"`` verdict global (default :class:`~fvstep.sync.SingleProcess`:
    this process's verdict).
    ``before_change`` is called once, after the last backward and every check, right
    before the unit changes its first leaf (the first optimizer update): until then the
    unit has changed nothing a state holds (gradients are not leaves), also when it
    raises. Metrics: ``<role>/loss`` (mean over micro-batches of the unscaled loss), the
    loss function's own metrics as ``<name>/<metric>`` (mean over micro-batches),
    ``<role>/grad_norm`` (before clipping; when clipping, skipping or checking with
    ``"error"``), ``<role>/lr``, ``<role>/skipped``.

    Raises:
        NonFiniteGradientError: With ``sanitize="error"``, if a loss or a gradient is not
            finite (on any rank); no leaf was changed and no ``.grad`` is left.
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
    # Modules must be at rest before requires_grad changes: FSDP2 copies a sharded
    # parameter's requires_grad to its unsharded twin only when it unshards, so a group
    # left unsharded by an earlier no-grad read would keep requires_grad off.
    sync.release(state)
    for p in silenced:
        p.requires_grad_(False)
    loss_log: dict[str, list[torch.Tensor]] = {r: [] for r in unit.roles}
    metric_log: dict[str, list[Any]] = {}
    failed = True
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
        failed = False
    finally:
        try:
            sync_metrics = sync.end()
        finally:
            for p in silenced:
                p.requires_grad_(True)
            if failed:  # no .grad outlives a unit, not even a failed one
                for params in trained.values():
                    for p in params.values():
                        p.grad = None
            # Reading a role under no_grad leaves FSDP2's root group unsharded (the root
            # does not reshard after forward); return every module to rest here too.
            sync.release(state, after_error=failed)
    out: dict[str, Any] = {f"{r}/loss": _mean(v) for r, v in loss_log.items()}
    out.update({f"{unit.name}/{k}": _mean(v) for k, v in metric_log.items()})
    out.update(sync_metrics)
    step = int(state.step)
    new_roles = dict(state.roles)
    joint = clip is not None and clip.joint
    names = [list(unit.roles)] if joint else [[r] for r in unit.roles]
    by_name = dict(zip(unit.roles, role_states))
    try:
        # Measure every group before changing any: a non-finite gradient in the second
        # role of a unit must stop the unit before the first role's optimizer steps.
        groups = [
            _measure_group(g, [by_name[r] for r in g], [trained[r] for r in g], clip, sanitize)
            for g in names
        ]
        if sanitize == "error":
            _check_finite(step, unit, loss_log, groups, parallelism or SingleProcess())
        if before_change is not None:
            before_change()
        for group in groups:
            updated, group_metrics = _apply_group(group, step, clip, sanitize)
            for role, rs in zip(group.names, updated):
                new_roles[role] = rs
            prefix = "+".join(group.names)
            out.update({f"{prefix}/{k}": v for k, v in group_metrics.items() if k in _NORM_METRICS})
            for role in group.names:
                out[f"{role}/skipped"] = group_metrics["skipped"]
                out[f"{role}/lr"] = group_metrics["lr"][role]
    finally:
        for params in trained.values():  # no .grad outlives a unit, not even a failed one
            for p in params.values():
                p.grad = None
    return state.replace(roles=new_roles), out


_NORM_METRICS = ("grad_norm",)


@attrs.define
class _Group:
    """Roles updated together (one role, or all of a unit's with a joint clip) and the
    global norm of their gradients, measured before anything changes."""

    names: list[str]
    role_states: list[RoleState]
    params_by_role: list[dict[str, torch.Tensor]]
    norm: torch.Tensor | None = None  # as computed: a DTensor for sharded gradients
    full_norm: torch.Tensor | None = None  # a plain tensor, the same on every rank

    def params(self) -> list[torch.Tensor]:
        return [p for params in self.params_by_role for p in params.values()]


def _measure_group(
    names: list[str],
    role_states: list[RoleState],
    params_by_role: list[dict[str, torch.Tensor]],
    clip: ClipGradNorm | None,
    sanitize: Sanitize,
) -> _Group:
    """Sanitize with ``"nan_to_num"`` and take the group's global gradient norm (when
    clipping, skipping or checking); changes gradients only, never a leaf."""
    group = _Group(names, role_states, params_by_role)
    grads = [p.grad for p in group.params() if p.grad is not None]
    if sanitize == "nan_to_num":
        nan_to_num_(grads)
    if clip is not None or sanitize in ("skip", "error"):
        norm_type = clip.norm_type if clip is not None else 2.0
        group.norm = total_norm(grads, norm_type=norm_type, foreach=clip.foreach if clip else None)
        group.full_norm = as_full(group.norm).detach()
    return group


def _apply_group(
    group: _Group, step: int, clip: ClipGradNorm | None, sanitize: Sanitize
) -> tuple[list[RoleState], dict[str, Any]]:
    """Clip (one norm over the group), optimize and EMA the group's roles."""
    metrics: dict[str, Any] = {}
    norm = group.norm
    if group.full_norm is not None:
        metrics["grad_norm"] = group.full_norm
    full = group.full_norm  # set together with norm
    skipped = full is not None and sanitize == "skip" and not bool(torch.isfinite(full))
    metrics["skipped"] = skipped
    metrics["lr"] = {}
    if not skipped and clip is not None and norm is not None:
        clip.apply(group.params(), norm)
    updated = []
    for name, rs, params in zip(group.names, group.role_states, group.params_by_role):
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
    for p in group.params():
        p.grad = None
    return updated, metrics


def _mesh_of(groups: list[_Group]) -> Any:
    """The device mesh of the first sharded (DTensor) parameter of ``groups``, or None."""
    for group in groups:
        for p in group.params():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
    return None


def _check_finite(
    step: int,
    unit: Update,
    loss_log: Mapping[str, list[torch.Tensor]],
    groups: list[_Group],
    parallelism: Parallelism,
) -> None:
    """``sanitize="error"``: raise if a loss (on any rank) or a group's global gradient
    norm is not finite. One device sync (the norms are global; the losses are counted
    over ranks), so that every rank takes the same decision."""
    # A loss may be a DTensor (a loss computed from sharded parameters): check its shard.
    losses = [_local(loss).float().reshape(()) for r in unit.roles for loss in loss_log[r]]
    mesh = _mesh_of(groups)
    device = losses[0].device
    bad_losses = (~torch.isfinite(torch.stack(losses))).sum().float()
    trained = [p for g in groups for p in g.params()]
    bad_losses = parallelism.sum_over_ranks(bad_losses, trained).to(device)
    norms = [g.full_norm.float().reshape(()).to(device) for g in groups if g.full_norm is not None]
    verdict = torch.stack([bad_losses, *norms]).tolist()  # the one device sync
    if verdict[0] == 0 and all(math.isfinite(v) for v in verdict[1:]):
        return
    where = f"step {step}, unit {unit.name!r}"
    after = (
        "No leaf was changed (no optimizer step, clipping or EMA update), and no .grad is "
        "left. Pass sanitize='skip' (drop such updates) or 'nan_to_num' (zero the entries) "
        "to fvstep.compile or fvstep.update to train through them instead."
    )
    if verdict[0] != 0:
        num = len(next(iter(loss_log.values())))
        for m in range(num):
            for role in unit.roles:
                value = float(_local(loss_log[role][m]))
                if not math.isfinite(value):
                    kind = "NaN" if math.isnan(value) else "Inf"
                    raise NonFiniteGradientError(
                        f"{where}: the loss of role {role!r} is {value} ({kind}) at micro-batch "
                        f"{m} of {num}, so its gradients cannot be trusted. Look for a NaN or "
                        f"Inf in that micro-batch's data, or an overflow in the loss. {after}",
                        step=step,
                        unit=unit.name,
                        role=role,
                        microbatch=m,
                        kind=kind,
                    )
        raise NonFiniteGradientError(
            f"{where}: a loss was not finite on another rank (that rank's error names the "
            f"role and micro-batch); this rank's losses are finite. {after}",
            step=step,
            unit=unit.name,
        )
    for group, norm in zip([g for g in groups if g.full_norm is not None], verdict[1:]):
        if math.isfinite(norm):
            continue
        label = "+".join(group.names)
        for role, params in zip(group.names, group.params_by_role):
            found = first_non_finite([(n, p.grad) for n, p in params.items() if p.grad is not None])
            if found is None:
                continue
            name, kind = found
            shard = " (in this rank's shard)" if mesh is not None else ""
            raise NonFiniteGradientError(
                f"{where}, role {role!r}: the gradient of parameter {name!r} has {kind} "
                f"entries{shard} (the first non-finite gradient of the role; gradient norm "
                f"{norm}), with a finite loss. Look for an operation whose backward is not "
                "finite at its input (sqrt or pow at 0, log of 0, a division by a tiny "
                f"value, a custom autograd Function), or an overflow in low precision. {after}",
                step=step,
                unit=unit.name,
                role=role,
                parameter=name,
                kind=kind,
            )
        if mesh is not None:
            raise NonFiniteGradientError(
                f"{where}, role {label!r}: the global gradient norm is {norm}, but every "
                "gradient entry of this rank's shards is finite: the non-finite entries are on "
                "another rank (its error names the parameter), or the norm overflowed. "
                f"{after}",
                step=step,
                unit=unit.name,
                role=label,
            )
        raise NonFiniteGradientError(
            f"{where}, role {label!r}: every gradient entry is finite but their norm "
            f"overflowed to {norm}: the gradients are too large for their dtype (scale the "
            f"loss down). {after}",
            step=step,
            unit=unit.name,
            role=label,
            kind="Inf",
        )


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
