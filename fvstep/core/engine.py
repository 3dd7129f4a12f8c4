"""The step type, and the engine that runs a call of a step, down to each unit's update.

A step is resolved when it is built (:class:`Route`: one per leaf, settings merged, the
``every``/``cond`` :class:`Gate` s on the way); a call (:meth:`Step.__call__`) checks once,
derives the keys, runs each scheduled leaf by its own ``run`` and returns ``step + 1``. A
unit runs in two phases (:func:`backward`, which changes no leaf, then :func:`apply`), and
the input state is consumed between them. The order of a call, its keys and its failure
rule: ``docs/architecture.md`` ("One call, top to bottom") and ``docs/concepts/purity.md``.
"""

from __future__ import annotations

import abc
import contextlib
import difflib
import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import optree
import torch

from fvstep.core import random as fsrandom
from fvstep.core._compat import tensor_version, world_size_of_default_group
from fvstep.core.accumulation import Accumulation
from fvstep.core.errors import StepFailedError
from fvstep.core.finite import raise_non_finite
from fvstep.core.grads import ClipGradNorm, Sanitize
from fvstep.core.layout import GradSync, Parallelism
from fvstep.core.settings import UNSET, PlanEntry, UnitSettings
from fvstep.core.state import RoleState, TrainState, adopt, is_consumed, mark_consumed
from fvstep.core.tree import any_dtensor, flatten_with_paths, full_tensor, local_tensors

__all__ = [
    "Call",
    "Gate",
    "Gradients",
    "Leaf",
    "LossFn",
    "Route",
    "Step",
    "apply",
    "backward",
    "name_routes",
    "run_unit",
    "scheduled",
]


@attrs.frozen(eq=False)
class Gate:
    """A condition on the way from a step to one of its leaves: ``every(n, offset=...)``
    (``pred`` is ``None``: open at ``offset, offset + n, ...``) or one branch of ``cond``
    (open where ``bool(pred(step)) == branch``)."""

    n: int = 1
    offset: int = 0
    pred: Callable[[int], bool] | None = None
    branch: bool = True


@attrs.frozen(eq=False)
class Route:
    """One leaf of a step, resolved when the step is built: its ``settings`` over the enclosing
    ``compile``s', those over the defaults (``resolved``), the ``gates`` to it (outermost first,
    all must open) and whether its metrics are ``<name>/<key>`` (:func:`name_routes`)."""

    leaf: Leaf
    settings: UnitSettings
    resolved: UnitSettings
    gates: tuple[Gate, ...] = ()
    named: bool = False

    def under(self, outer: UnitSettings) -> Route:
        """This route inside a ``compile`` of settings ``outer``."""
        settings = self.settings.over(outer)
        return Route(self.leaf, settings, settings.resolve(), self.gates, self.named)

    def behind(self, gate: Gate) -> Route:
        """This route behind ``gate`` (an enclosing ``every`` or ``cond`` branch)."""
        return Route(self.leaf, self.settings, self.resolved, (gate, *self.gates), self.named)


def name_routes(routes: Sequence[Route]) -> tuple[Route, ...]:
    """``routes`` with :attr:`Route.named` set where a leaf trains a role an earlier leaf that can
    run at the same step trains too: its metrics are ``<name>/<key>`` at every step."""
    out = []
    for position, route in enumerate(routes):
        named = any(
            set(earlier.leaf.trains) & set(route.leaf.trains)
            and not any(
                a.pred is not None and a.pred is b.pred and a.branch != b.branch
                for a in earlier.gates
                for b in route.gates
            )
            for earlier in routes[:position]
        )
        out.append(route if route.named == named else attrs.evolve(route, named=named))
    return tuple(out)


def scheduled(routes: Sequence[Route], step: int) -> list[tuple[int, Route]]:
    """The ``(position, route)`` that run at ``step``, in order; a ``cond``'s predicate is
    called at most once per step, and only where the gates before it opened."""
    decided: dict[int, bool] = {}
    out = []
    for position, route in enumerate(routes):
        for gate in route.gates:
            if gate.pred is None:
                opens = step >= gate.offset and (step - gate.offset) % gate.n == 0
            else:
                if id(gate.pred) not in decided:  # the two branches share the predicate
                    decided[id(gate.pred)] = bool(gate.pred(step))
                opens = decided[id(gate.pred)] == gate.branch
            if not opens:
                break
        else:
            out.append((position, route))
    return out


class Step(abc.ABC):
    """A step function: ``step(state, batch, key=None, *, parallelism=None)``; its
    :attr:`routes`, one per leaf it can ever run, are computed when it is built."""

    routes: tuple[Route, ...]

    def leaves(self) -> tuple[Leaf, ...]:
        """Every leaf this step can ever run, depth first (both branches of ``cond``)."""
        return tuple(route.leaf for route in self.routes)

    def plan(self, step: int) -> list[PlanEntry]:
        """What runs at ``step``: one :class:`PlanEntry` per leaf, in order, resolved."""
        entries = []
        for position, route in scheduled(self.routes, step):
            leaf, p = route.leaf, route.resolved
            assert p.accumulation is not None and p.clip is not UNSET and p.sanitize is not UNSET
            entries.append(
                PlanEntry(
                    position=position,
                    name=leaf.name,
                    roles=leaf.trains,
                    managed=leaf.managed,
                    clip=p.clip,
                    sanitize=p.sanitize,
                    mutates=leaf.mutates,
                    accumulation=p.accumulation,
                )
            )
        return entries

    def __call__(
        self,
        state: TrainState,
        batch: Any,
        key: torch.Tensor | None = None,
        *,
        parallelism: Parallelism | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run one step: check, derive the keys, run the scheduled leaves, count the step.

        Keys and the failure rule: ``docs/concepts/keys.md``, ``docs/concepts/purity.md``.

        Args:
            state: The current state; consumed by the call.
            batch: A pytree of tensors split along dim 0 into micro-batches, or a list of them
                (``docs/concepts/composition.md``).
            key: The key of this step's randomness; default ``state.key``.
            parallelism: ``fvstep.parallel.Layout(...)`` on several ranks; ``None``: one process.

        Returns:
            ``(new_state, metrics)``.

        Raises:
            ConsumedStateError: If ``state`` was already consumed.
            ValueError: Before anything runs, if a leaf's roles or the layout do not fit ``state``.
            StepFailedError: If the step raised after it had changed a leaf of ``state``
                (the error is ``__cause__``); any other error leaves ``state`` unchanged.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"a step takes a TrainState, got {type(state).__name__}")
        if is_consumed(state):
            mark_consumed(state, "")  # raises ConsumedStateError, naming who consumed it
        step = int(state.step)
        routes = self.routes
        _check_call(routes, state, parallelism)
        if parallelism is None:
            replica, counter = 0, None
        else:
            replica, _ = parallelism.data_parallel_rank_and_size()
            counter = parallelism.collective_counter()
        step_key = fsrandom.fold_in(
            fsrandom.fold_in(state.key if key is None else key, step), replica
        )
        work = state.replace(roles={name: adopt(rs) for name, rs in state.roles.items()})
        call = Call(state, step, batch, parallelism)
        metrics: dict[str, Any] = {}
        try:
            with counter if counter is not None else contextlib.nullcontext():
                runs = scheduled(routes, step)
                for _, route in runs:  # the leaves' input checks, before anything changes
                    if route.leaf.check is not None:
                        accumulation = route.resolved.accumulation
                        assert accumulation is not None  # resolved
                        route.leaf.check(work, batch, accumulation)
                for position, route in runs:
                    leaf = call.leaf = route.leaf
                    call.position = position
                    leaf_key = fsrandom.fold_in_name(step_key, leaf.name)
                    work, leaf_metrics = leaf.run(work, batch, leaf_key, route.resolved, call)
                    # a key an earlier leaf reported goes under <name>/ too: none is lost
                    prefix = f"{leaf.name}/"
                    for name, value in leaf_metrics.items():
                        if (route.named or name in metrics) and not name.startswith(prefix):
                            name = prefix + name
                        metrics[name] = value
        except Exception as error:
            failure = call.failure(error)
            if failure is None:
                raise
            raise failure from error
        if not call.changed:  # a step that ran nothing still consumes its input
            mark_consumed(state, f"the step function at step {step}")
        if counter is not None:
            metrics.update(counter.metrics())
        return work.replace(step=torch.tensor(step + 1, dtype=torch.int64)), metrics


class Leaf(Step):
    """A unit (``fvstep.update``) or a managed step (``fvstep.managed``), run by the engine
    as ``leaf.run(state, batch, key, settings, call)``; its ``name`` is unique within a step."""

    kind: ClassVar[str] = "leaf"
    managed: ClassVar[bool] = False
    trains_label: ClassVar[str] = "roles"  # what messages call ``trains``
    name: str
    settings: UnitSettings  # its own clip and sanitize; unset fields are the enclosing ones
    trains: tuple[str, ...]  # the roles whose optimizers it steps
    mutates: tuple[str, ...] = ()  # frozen roles it changes in place (managed steps only)
    # run on the step's input before any leaf runs (a managed step's ``check``)
    check: Callable[[TrainState, Any, Accumulation], None] | None = None

    @abc.abstractmethod
    def run(
        self, state: TrainState, batch: Any, key: torch.Tensor, settings: UnitSettings, call: Call
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run this leaf once; call ``call.change()`` right before first changing ``state``."""

    def describe(self, position: int | None = None) -> str:
        """``unit 'name'`` or ``managed step 'name'``; with ``position``, also the roles."""
        if position is None:
            return f"{self.kind} {self.name!r}"
        return (
            f"{self.kind} {self.name!r} (position {position}, "
            f"{self.trains_label} {list(self.trains)})"
        )


# a leaf's routes: itself, with its own settings
ROUTES = attrs.Factory(
    lambda leaf: (Route(leaf, leaf.settings, leaf.settings.resolve()),), takes_self=True
)


class Call:
    """One call of a step as it runs: what its leaves read, and which changed the state
    (``changed``; buffers and ``extra`` are watched by version counter, best effort)."""

    def __init__(
        self, state: TrainState, step: int, batch: Any, parallelism: Parallelism | None
    ) -> None:
        self.state = state
        self.step = step
        self.batch = batch
        self.parallelism = parallelism
        self.splits: dict[int, list[Any]] = {}
        self.position = 0
        self.leaf: Leaf | None = None
        self.changed: list[tuple[int, Leaf | None]] = []
        watched = {
            f"roles.{r}.buffers.{n}": b
            for r, rs in state.roles.items()
            for n, b in rs.buffers.items()
        }
        if state.extra:
            paths, leaves, _ = flatten_with_paths(state.extra)
            watched.update({f"extra.{p}": x for p, x in zip(paths, leaves)})
        self.versions = {p: (x, tensor_version(x)) for p, x in watched.items()}

    def change(self) -> None:
        """The running leaf is about to change the state: consume it first (once)."""
        if not self.changed:
            mark_consumed(self.state, f"the step function at step {self.step}")
        running = (self.position, self.leaf)
        if running not in self.changed:
            self.changed.append(running)

    def _describe(self, position: int, leaf: Leaf | None) -> str:
        return "the step" if leaf is None else leaf.describe(position)

    def failure(self, error: Exception) -> StepFailedError | None:
        """The error to raise for ``error``; ``None`` when nothing changed (nor consumed)."""
        in_place = [p for p, (x, v) in self.versions.items() if tensor_version(x) != v]
        if not self.changed and not in_place:
            return None
        if not is_consumed(self.state):
            mark_consumed(self.state, f"the step function at step {self.step}")
        parts = []
        if self.changed:
            parts.append(
                "already changed by " + ", ".join(self._describe(*c) for c in self.changed)
            )
        if in_place:
            shown = ", ".join(in_place[:3]) + (", ..." if len(in_place) > 3 else "")
            parts.append(f"changed in place by a loss or managed function ({shown})")
        where, what = self._describe(self.position, self.leaf), "; ".join(parts)
        return StepFailedError(
            f"step {self.step} failed in {where}; the state was {what}: it is consumed and "
            f"partly updated. {_RECOVER} The error: {type(error).__name__}: {error}"
        )


_RECOVER = (
    "Reload the last checkpoint: fvstep.checkpoint.load(fvstep.checkpoint.latest(ckpt_dir), "
    "like=fresh_state) (see docs/troubleshooting.md)."
)


def _check_call(
    routes: Sequence[Route], state: TrainState, parallelism: Parallelism | None
) -> None:
    """Refuse a leaf's missing or frozen role and a state the layout cannot train, up front."""
    roles = state.roles
    for route in routes:
        leaf = route.leaf
        for role in (*leaf.trains, *leaf.mutates):
            if role not in roles:
                verb = "trains" if role in leaf.trains else "mutates"
                close = difflib.get_close_matches(role, sorted(roles), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{leaf.describe()} {verb} role {role!r}, but the state has no role "
                    f"{role!r} (it has roles {sorted(roles)}){hint}"
                )
        for role in leaf.trains:
            if not roles[role].role.trainable:
                raise ValueError(
                    f"{leaf.describe()} trains role {role!r}, which is frozen (give it an "
                    "optimizer: Role(module, optimizer=...))"
                )
    if parallelism is not None:
        parallelism.check(state)
        return
    world = world_size_of_default_group()
    if world > 1:
        raise ValueError(
            f"this process is one of {world} ranks, but the step runs with the one-process "
            "layout (no gradient reduced): pass parallelism=fvstep.parallel.Layout()"
        )
    for name, rs in roles.items():
        if any_dtensor(rs.params.values()):
            raise ValueError(
                f"role {name!r} has sharded (DTensor) parameters, but the step runs with the "
                "layout of one process: pass parallelism=fvstep.parallel.Layout()"
            )


def run_unit(
    leaf: Any, state: TrainState, batch: Any, key: torch.Tensor, settings: UnitSettings, call: Call
) -> tuple[TrainState, dict[str, Any]]:
    """``Unit.run``: split ``batch``, :func:`backward`, ``call.change()``, :func:`apply`."""
    accumulation, clip, sanitize = settings.accumulation, settings.clip, settings.sanitize
    assert accumulation is not None and clip is not UNSET and sanitize is not UNSET
    num = accumulation.microbatches
    if batch is call.batch:  # the step's own batch: split once per number of micro-batches
        microbatches = call.splits.get(num)
        if microbatches is None:
            microbatches = call.splits[num] = _split_microbatches(batch, num)
    else:
        microbatches = _split_microbatches(batch, num)
    parallelism = call.parallelism
    sync = None if parallelism is None else parallelism.grad_sync(state, accumulation)
    gradients = backward(
        state,
        leaf.roles,
        leaf.loss_fn,
        leaf.name,
        microbatches,
        key,
        clip=clip,
        sanitize=sanitize,
        sync=sync,
        parallelism=parallelism,
    )
    call.change()
    return apply(state, gradients, clip=clip, sanitize=sanitize)


LossFn = Callable[[TrainState, Any, torch.Tensor], Any]
"""``(state, batch, key) -> loss | (loss, metrics) | ({role: loss}, metrics)``."""


@attrs.define
class Group:
    """Roles updated together (one, or a unit's all under a joint clip) and their grad norm."""

    names: list[str]
    role_states: list[RoleState]
    params_by_role: list[dict[str, torch.Tensor]]
    params: list[torch.Tensor]  # every parameter, role by role
    norm: torch.Tensor | None = None  # as computed: a DTensor for sharded gradients
    full_norm: torch.Tensor | None = None  # a plain tensor, the same on every rank


@attrs.define
class Gradients:
    """What :func:`backward` leaves for :func:`apply`: the groups, norms measured, and the
    losses and loss function's metrics (means over micro-batches)."""

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
    """Phase 1 of a unit: gradients of ``roles`` over ``microbatches`` (keyed ``fold_in(key, m)``).

    Changes no leaf of ``state``; the other roles' parameters have ``requires_grad`` off.

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
            f"unit {name!r}'s loss function returned a metric {clash[0]!r}: that is the key of "
            "the unit's own loss under its name; rename the metric (or the unit: update(name=))"
        )
    out.update({f"{name}/{k}": _mean(v) for k, v in metric_log.items()})
    out.update(sync_metrics)
    try:
        for group in groups:
            grads = [p.grad for p in group.params if p.grad is not None]
            if sanitize == "nan_to_num":
                for g in grads:
                    torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
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
    """``sanitize="error"``'s verdict over every rank, in one device sync."""
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
    """``ema = decay * ema + (1 - decay) * param`` in fp32 on local shards; the first copies."""
    targets = local_tensors([ema[n] for n in params])
    sources = [x.to(torch.float32) for x in local_tensors([p.detach() for p in params.values()])]
    if not bool(initialized):
        torch._foreach_copy_(targets, sources)
        initialized.fill_(True)
        return
    torch._foreach_mul_(targets, decay)
    torch._foreach_add_(targets, sources, alpha=1.0 - decay)


def _split_microbatches(batch: Any, num: int) -> list[Any]:
    """``batch`` split along dim 0 of every tensor leaf (other leaves shared), or a list
    (not a tuple of tensors) of ``num`` micro-batches as given."""
    if isinstance(batch, (list, tuple)) and not _is_tensor_tree(batch):
        if len(batch) != num:
            raise ValueError(f"got a list of {len(batch)} micro-batches, expected {num}")
        return list(batch)
    if num == 1:
        return [batch]
    flat, spec = optree.tree_flatten(batch)
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


def _is_tensor_tree(batch: Sequence[Any]) -> bool:  # ``(x, y)`` is one batch
    return len(batch) > 0 and all(isinstance(x, torch.Tensor) for x in batch)
