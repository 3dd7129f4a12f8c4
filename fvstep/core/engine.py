"""The step type, and the engine that runs a call of a step.

Every step is a :class:`Step`: ``step(state, batch, key=None, *, parallelism=None) ->
(state, metrics)`` and ``step.plan(i) -> [PlanEntry]``. Units and managed steps are its
leaves (:class:`Leaf`, plain data); ``sequence``, ``every``, ``cond`` and ``compile``
(:mod:`fvstep.core.steps`) take steps and return steps. What runs at step ``i`` is
:meth:`Step.schedule`: the leaves, in order, each with its :class:`~fvstep.core.policy.Policy`,
a pure function of ``i``.

A call (:func:`run_step`) reads nothing but its arguments, and:

1. checks once, before anything is consumed: every role that any leaf can ever run
   exists in the state (a typo names the close match), trained roles are trainable,
   and the layout (``parallelism``, default :class:`~fvstep.core.layout.SingleProcess`)
   accepts the state;
2. derives the step's key, ``fold_in(fold_in(key if given else state.key, step), dp)``
   with ``dp`` this rank's data-parallel replica (the ranks of one context-parallel group
   share it); a leaf gets ``fold_in_name(step_key, leaf.name)`` (its stable name: adding
   a unit leaves the noise of the others unchanged), micro-batch ``m`` of a unit
   ``fold_in(unit_key, m)``; modules run inside ``rng_scope`` of their key;
3. runs ``plan(step)`` entry by entry: a unit's :func:`~fvstep.core.unit.backward`, then,
   right before its first leaf changes, the input is consumed (like a donated buffer),
   then :func:`~fvstep.core.unit.apply`; a managed step counts as changing from its start;
4. returns the state with ``step + 1``.

A step fails loudly and never half-silently: a step that raises before its first change
(a bad batch, an error in a loss's forward or backward, a
:class:`~fvstep.grads.NonFiniteGradientError` of its first unit) re-raises the error as
is and leaves its input usable and bit-unchanged; one that raises later raises
:class:`~fvstep.core.policy.StepFailedError` (the original error is its ``__cause__``),
saying what had run and how to recover.

Metrics are means over micro-batches (losses and the loss function's own metrics) and
per update (``<role>/grad_norm``, ``<role>/lr``, ``<role>/skipped``), as detached tensors
or Python scalars: converting them to floats is the caller's choice (it syncs a GPU).
When two units of one step train the same role, the later one's ``<role>/...`` metrics
are reported as ``<unit name>/<role>/...``: no unit's loss or skip is lost.
"""

from __future__ import annotations

import abc
import contextlib
import difflib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fvstep import random as fsrandom
from fvstep.accumulation import Accumulation, split_microbatches
from fvstep.core import unit
from fvstep.core.layout import Parallelism, SingleProcess
from fvstep.core.policy import UNSET, PlanEntry, Policy
from fvstep.core.progress import Progress
from fvstep.state import TrainState, adopt, is_consumed, mark_consumed

__all__ = ["Leaf", "ManagedContext", "ManagedFn", "Step", "run_step"]


class Step(abc.ABC):
    """A step function: ``step(state, batch, key=None, *, parallelism=None)``.

    Subclasses say which sub-steps they hold (:meth:`children`) and which leaves run at a
    step with which policy (:meth:`schedule`).
    """

    @abc.abstractmethod
    def children(self) -> tuple[Step, ...]:
        """The sub-steps, in order (all of them, whether or not they run at a step)."""

    @abc.abstractmethod
    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """The leaves that run at ``step``, in order, each with its policy merged over
        ``policy`` (the enclosing steps'). A pure function of ``step``."""

    def leaves(self) -> tuple[Leaf, ...]:
        """Every leaf this step can ever run, depth first (both branches of ``cond``)."""
        return self._leaves

    @property
    def _leaves(self) -> tuple[Leaf, ...]:
        # a composite keeps its leaves in a field (``steps.leaves_of``): steps are frozen
        return tuple(leaf for child in self.children() for leaf in child.leaves())

    def plan(self, step: int) -> list[PlanEntry]:
        """What runs at ``step``: one :class:`PlanEntry` per leaf, in order, resolved."""
        positions = {id(leaf): i for i, leaf in enumerate(self.leaves())}
        entries = []
        for leaf, policy in self.schedule(step, Policy()):
            p = policy.resolve()
            assert p.accumulation is not None and p.clip is not UNSET and p.sanitize is not UNSET
            entries.append(
                PlanEntry(
                    position=positions[id(leaf)],
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
        """Run one step (see :mod:`fvstep.core.engine`).

        Args:
            state: The current state; consumed by the call (from its first change on).
            batch: A pytree of tensors split along dim 0 into the micro-batches, or a
                list of exactly ``microbatches`` micro-batches.
            key: A key to derive this step's randomness from; default ``state.key``.
            parallelism: The process layout of the call (``fvstep.parallel.Layout(...)``
                on several ranks); default one process.

        Returns:
            ``(new_state, metrics)``.

        Raises:
            ConsumedStateError: If ``state`` was already consumed.
            ValueError: Before anything runs: a leaf (at any step) trains or mutates a
                role the state does not have, or trains a frozen role; or the layout
                refuses the state.
            StepFailedError: If the step raised after it had changed a leaf of ``state``
                (the original error is ``__cause__``); ``state`` is then consumed.
                Any other error leaves ``state`` usable and bit-unchanged.
        """
        return run_step(self, state, batch, key, parallelism or SingleProcess())


class Leaf(Step):
    """One leaf of a composition: a unit (``managed = False``: ``roles``, ``loss_fn``) or a
    managed step (``managed = True``: ``fn``). Plain data: the engine runs it.

    Its ``name`` keys its randomness and labels its metrics, so the names of the leaves
    of a composed step are unique.
    """

    kind: ClassVar[str] = "leaf"
    managed: ClassVar[bool] = False
    name: str
    policy: Policy  # its own clip and sanitize; unset fields are the enclosing ones
    trains: tuple[str, ...]  # the roles whose optimizers it steps
    mutates: tuple[str, ...] = ()  # frozen roles it changes in place (managed steps only)

    def children(self) -> tuple[Step, ...]:
        """None: a leaf."""
        return ()

    def leaves(self) -> tuple[Leaf, ...]:
        """Itself."""
        return (self,)

    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """It runs at every step it is reached, with its own policy over ``policy``."""
        return [(self, self.policy.over(policy))]

    def describe(self) -> str:
        """``unit 'name'`` or ``managed step 'name'``, for messages."""
        return f"{self.kind} {self.name!r}"


@attrs.define
class ManagedContext:
    """What a managed step gets to run its inner updates with the step's machinery.

    Attributes:
        step: The global step being run.
        position: The managed step's index among the leaves of the called step.
        accumulation: The default accumulation of inner updates (the enclosing
            ``compile``'s).
    """

    step: int
    position: int
    accumulation: Accumulation
    _policy: Policy
    _parallelism: Parallelism
    _trains: tuple[str, ...]

    def update(
        self,
        state: TrainState,
        unit_: Leaf,
        batch: Any,
        key: torch.Tensor,
        *,
        accumulation: Accumulation | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run the unit ``unit_`` once on ``batch`` (split into micro-batches), keyed by ``key``.

        ``accumulation`` defaults to the enclosing ``compile``'s; the unit's own
        ``clip``/``sanitize`` apply, else the managed step's, else the enclosing
        ``compile``'s; the micro-batch keys are ``fold_in(key, m)``.

        Returns:
            The new state and the unit's metrics.

        Raises:
            TypeError: If ``unit_`` is not a unit (``fvstep.update(...)``).
            ValueError: If it trains a role the managed step does not declare in
                ``trains`` (``plan`` would not show it).
        """
        if not isinstance(unit_, Leaf) or unit_.managed:
            raise TypeError(
                f"ctx.update runs a unit (fvstep.update(...)), got {type(unit_).__name__}"
            )
        undeclared = [r for r in unit_.trains if r not in self._trains]
        if undeclared:
            raise ValueError(
                f"ctx.update: {unit_.describe()} trains {undeclared}, which this managed step "
                f"does not declare (trains={list(self._trains)}): pass managed(..., "
                f"trains={tuple(sorted({*self._trains, *undeclared}))!r}) so that plan() "
                "and the checks before the step see them"
            )
        policy = attrs.evolve(
            unit_.policy.over(self._policy), accumulation=accumulation or self.accumulation
        ).resolve()
        assert policy.accumulation is not None
        microbatches = split_microbatches(batch, policy.accumulation.microbatches)
        return _run_unit(state, unit_, microbatches, key, policy, self._parallelism, None)


def _unknown_role(role: str, state_roles: list[str]) -> str:
    close = difflib.get_close_matches(role, state_roles, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"the state has no role {role!r} (it has roles {state_roles}){hint}"


def _check_roles(leaves: Sequence[Leaf], state: TrainState) -> None:
    """Every role any leaf can run exists in ``state``; the trained ones are trainable."""
    for leaf in leaves:
        for role in (*leaf.trains, *leaf.mutates):
            if role not in state.roles:
                verb = "trains" if role in leaf.trains else "mutates"
                raise ValueError(
                    f"{leaf.describe()} {verb} role {role!r}, but "
                    f"{_unknown_role(role, sorted(state.roles))}"
                )
        for role in leaf.trains:
            if not state.roles[role].role.trainable:
                raise ValueError(
                    f"{leaf.describe()} trains role {role!r}, which is frozen (give it an "
                    "optimizer: Role(module, optimizer=...))"
                )


def _run_unit(
    state: TrainState,
    leaf: Any,
    microbatches: Any,
    key: torch.Tensor,
    policy: Policy,
    parallelism: Parallelism,
    progress: Progress | None,
) -> tuple[TrainState, dict[str, Any]]:
    """One unit: backward, consume the input (``progress``: ``None`` inside a managed step,
    which consumed it at its start), apply."""
    accumulation, clip, sanitize = policy.accumulation, policy.clip, policy.sanitize
    assert accumulation is not None and clip is not UNSET and sanitize is not UNSET
    sync = parallelism.grad_sync(state, accumulation)
    gradients = unit.backward(
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
    if progress is not None:
        progress.change(progress.current)
    return unit.apply(state, gradients, clip=clip, sanitize=sanitize)


def _run_managed(
    state: TrainState,
    leaf: Any,
    batch: Any,
    key: torch.Tensor,
    policy: Policy,
    parallelism: Parallelism,
    step: int,
    position: int,
) -> tuple[TrainState, dict[str, Any]]:
    """A managed step: ``fn(state, batch, key, ctx)`` inside ``rng_scope(key)``."""
    assert policy.accumulation is not None
    ctx = ManagedContext(step, position, policy.accumulation, policy, parallelism, leaf.trains)
    try:
        with fsrandom.rng_scope(key):
            new_state, metrics = leaf.fn(state, batch, key, ctx)
    except Exception:
        # Its own module reads (outside ctx.update) may leave FSDP2 groups busy.
        sync = parallelism.grad_sync(state, policy.accumulation)
        if sync is not None:
            sync.release(state, after_error=True)
        raise
    if not isinstance(new_state, TrainState):
        raise TypeError(f"managed step {leaf.name!r} must return (TrainState, metrics)")
    return new_state, metrics


def _merge_metrics(metrics: dict[str, Any], new: dict[str, Any], name: str) -> None:
    """Add a leaf's metrics; a key an earlier leaf of the step reported (two units that
    train one role: ``<role>/loss``, ``<role>/skipped``, ...) goes under ``<name>/<key>``,
    so that neither is lost."""
    for key, value in new.items():
        metrics[f"{name}/{key}" if key in metrics else key] = value


def run_step(
    root: Step,
    state: TrainState,
    batch: Any,
    key: torch.Tensor | None,
    parallelism: Parallelism,
) -> tuple[TrainState, dict[str, Any]]:
    """The outermost call of ``root``: checks, keys, consumption, the plan, the counter.

    See :meth:`Step.__call__` for the arguments and errors.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"a step takes a TrainState, got {type(state).__name__}")
    if is_consumed(state):
        mark_consumed(state, "")  # raises ConsumedStateError, naming who consumed it
    step = int(state.step)
    leaves = root.leaves()
    _check_roles(leaves, state)
    parallelism.check(state)
    replica, _ = parallelism.data_parallel_rank_and_size()
    step_key = fsrandom.fold_in(fsrandom.fold_in(state.key if key is None else key, step), replica)
    work = state.replace(roles={name: adopt(rs) for name, rs in state.roles.items()})
    progress = Progress(state, step)
    counter = parallelism.collective_counter()
    splits: dict[int, list[Any]] = {}
    metrics: dict[str, Any] = {}
    try:
        with counter if counter is not None else contextlib.nullcontext():
            for leaf, policy in root.schedule(step, Policy()):
                policy = policy.resolve()
                leaf_key = fsrandom.fold_in_name(step_key, leaf.name)
                position = next(i for i, x in enumerate(leaves) if x is leaf)
                if leaf.managed:
                    progress.current = (
                        f"managed step {leaf.name!r} (position {position}, "
                        f"trains {list(leaf.trains)})"
                    )
                    progress.change(progress.current)  # it may change anything from its start
                    work, leaf_metrics = _run_managed(
                        work, leaf, batch, leaf_key, policy, parallelism, step, position
                    )
                else:
                    progress.current = (
                        f"unit {leaf.name!r} (position {position}, roles {list(leaf.trains)})"
                    )
                    assert policy.accumulation is not None
                    num = policy.accumulation.microbatches
                    if num not in splits:
                        splits[num] = split_microbatches(batch, num)
                    work, leaf_metrics = _run_unit(
                        work, leaf, splits[num], leaf_key, policy, parallelism, progress
                    )
                _merge_metrics(metrics, leaf_metrics, leaf.name)
    except Exception as error:
        failure = progress.failure(error)
        if failure is None:
            raise
        raise failure from error
    progress.consume()
    if counter is not None:
        metrics.update(counter.metrics())
    return work.replace(step=torch.tensor(step + 1, dtype=torch.int64)), metrics


ManagedFn = Callable[[TrainState, Any, torch.Tensor, ManagedContext], tuple[TrainState, dict]]
"""``fn(state, batch, key, ctx) -> (state, metrics)`` of a managed step."""
