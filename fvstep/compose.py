"""Combinators: steps made of steps, what runs decided by the step counter alone.

Every combinator (:func:`sequence`, :func:`every`, :func:`cond`, :func:`compile`,
:func:`managed`) takes steps and returns a :class:`~fvstep.stepfn.Step` with the same
call signature, so combinations nest: ``sequence(compile(critic, accumulation=...),
every(5, student))`` is a step like any other. :func:`compile` gives the units inside a
step an execution policy (the innermost ``compile`` that sets a field wins). The leaves of a composition are
:class:`~fvstep.update.Update` units and :class:`Managed` steps; each is keyed by its
name, so the names of a composition's leaves must be unique (checked here). Because what
runs at a step is a pure function of the step, :func:`~fvstep.stepfn.plan` can list it
without running anything — the pure form of the reference's ``get_optimizers(i)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch

from fvstep import random as fsrandom
from fvstep.accumulation import Accumulation
from fvstep.grads import ClipGradNorm, Sanitize
from fvstep.state import TrainState
from fvstep.stepfn import (
    UNSET,
    CallSettings,
    Leaf,
    PlanEntry,
    Policy,
    RunContext,
    Step,
    Unset,
    _check_clip,
    _check_sanitize,
    check_step,
    check_unique_names,
)
from fvstep.sync import Parallelism
from fvstep.update import Update

__all__ = [
    "Compiled",
    "Cond",
    "Every",
    "Managed",
    "ManagedContext",
    "Method",
    "PlanEntry",
    "Sequence",
    "compile",
    "cond",
    "every",
    "managed",
    "sequence",
]

Method = Step
"""The old name of :class:`~fvstep.stepfn.Step` (a composed method is a step)."""


@attrs.frozen(eq=False)
class Sequence(Step):
    """Run several steps one after the other (see :func:`sequence`)."""

    steps: tuple[Step, ...]
    settings: CallSettings = attrs.Factory(CallSettings)

    def children(self) -> tuple[Step, ...]:
        """The steps, in order."""
        return self.steps

    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """Each step's leaves, in order."""
        return [entry for child in self.steps for entry in child.schedule(step, policy)]


def sequence(*steps: Step) -> Sequence:
    """Run ``steps`` in order within one step; each sees the state the previous returned.

    Raises:
        TypeError: If an argument is not a step.
        ValueError: If two leaves share a name (they would share their keys).

    Examples:
        >>> sequence(update("student", gen_loss), update("critic", critic_loss))
    """
    if not steps:
        raise ValueError("sequence needs at least one step")
    for i, s in enumerate(steps):
        check_step(s, f"sequence argument {i}")
    composed = Sequence(tuple(steps))
    check_unique_names(composed.leaves(), "sequence")
    return composed


@attrs.frozen(eq=False)
class Every(Step):
    """Run a step every ``n`` steps (see :func:`every`)."""

    n: int
    method: Step
    offset: int = 0
    settings: CallSettings = attrs.Factory(CallSettings)

    def runs_at(self, step: int) -> bool:
        """Whether the wrapped step runs at ``step``."""
        return step >= self.offset and (step - self.offset) % self.n == 0

    def children(self) -> tuple[Step, ...]:
        """The wrapped step."""
        return (self.method,)

    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """The wrapped step's leaves on its steps, nothing otherwise."""
        return self.method.schedule(step, policy) if self.runs_at(step) else []


def every(n: int, method: Step, *, offset: int = 0) -> Every:
    """Run ``method`` at steps ``offset, offset + n, offset + 2n, ...``.

    On other steps its roles' parameters, optimizer state and schedule position are not
    touched (the schedule advances with the role's own update count).

    Args:
        n: The interval (>= 1); DMD2's ``generator_update_interval``.
        method: A unit or any composed step.
        offset: The first step it runs at (>= 0).

    Examples:
        >>> every(5, update("student", gen_loss))   # steps 0, 5, 10, ...
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every needs an integer n >= 1, got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"every needs an integer offset >= 0, got {offset!r}")
    check_step(method, "every's method")
    return Every(n, method, offset)


@attrs.frozen(eq=False)
class Cond(Step):
    """Choose between two steps by a predicate of the step (see :func:`cond`)."""

    pred: Callable[[int], bool]
    if_true: Step
    if_false: Step | None
    settings: CallSettings = attrs.Factory(CallSettings)

    def children(self) -> tuple[Step, ...]:
        """Both branches (``if_true`` first)."""
        return (self.if_true,) if self.if_false is None else (self.if_true, self.if_false)

    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """The leaves of the branch the predicate picks."""
        if bool(self.pred(step)):
            return self.if_true.schedule(step, policy)
        return [] if self.if_false is None else self.if_false.schedule(step, policy)


def cond(pred: Callable[[int], bool], if_true: Step, if_false: Step | None = None) -> Cond:
    """Run ``if_true`` at steps where ``pred(step)`` holds, else ``if_false`` (or nothing).

    ``pred`` must be a pure function of the step (an int). The leaves of both branches
    need distinct names (each leaf is keyed by its name).

    Examples:
        >>> cond(lambda i: i % 5 == 0, update(("student", "critic"), fused_loss),
        ...      update("critic", critic_loss))
    """
    if not callable(pred):
        raise TypeError("cond's predicate must be a function of the step")
    check_step(if_true, "cond's if_true")
    if if_false is not None:
        check_step(if_false, "cond's if_false")
    composed = Cond(pred, if_true, if_false)
    check_unique_names(composed.leaves(), "cond")
    return composed


@attrs.frozen(eq=False)
class Compiled(Step):
    """A step with an execution policy and call settings (see :func:`compile`).

    Attributes:
        inner: The step it runs.
        policy: Defaults for the units of ``inner`` that do not set their own (the
            innermost ``compile`` wins).
        settings: The settings of a call (see :class:`CallSettings`).
    """

    inner: Step
    policy: Policy = attrs.Factory(Policy)
    settings: CallSettings = attrs.Factory(CallSettings)

    def children(self) -> tuple[Step, ...]:
        """The wrapped step."""
        return (self.inner,)

    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """The wrapped step's leaves, with this policy under theirs and over ``policy``."""
        return self.inner.schedule(step, self.policy.over(policy))

    @property
    def method(self) -> Step:
        """The wrapped step (the name of fvstep 0.1)."""
        return self.inner

    @property
    def accumulation(self) -> Accumulation:
        """The micro-batching this compile gives its units (resolved)."""
        accumulation = self.policy.resolve().accumulation
        assert accumulation is not None
        return accumulation

    @property
    def clip(self) -> ClipGradNorm | None:
        """The clipping this compile gives units that set none (resolved)."""
        clip = self.policy.resolve().clip
        assert clip is not UNSET
        return clip

    @property
    def sanitize(self) -> Sanitize:
        """The non-finite policy this compile gives units that set none (resolved)."""
        sanitize = self.policy.resolve().sanitize
        assert sanitize is not UNSET
        return sanitize

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks per sequence-parallel group of a call of this step."""
        size = self.resolved_settings().sequence_parallel_size
        assert size is not None
        return size

    @property
    def count_collectives(self) -> bool:
        """Whether a call of this step reports collective counts."""
        return bool(self.resolved_settings().count_collectives)


def compile(
    method: Step,
    *,
    accumulation: Accumulation | None = None,
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
    sequence_parallel_size: int | None = None,
    count_collectives: bool | None = None,
    parallelism: Parallelism | None = None,
) -> Compiled:
    """Give a step an execution policy (and a call its settings); returns a step.

    Compiled steps compose: ``sequence(compile(critic, accumulation=Accumulation(4)),
    compile(student))`` runs the critic's unit over 4 micro-batches and the student's
    over one. ``fvstep.compile`` is this function with ``parallelism`` defaulting to
    ``fvstep.parallel.FSDP2Parallelism()``; here it is left unset (a call runs with
    the parallelism of the outermost step that sets one, else
    :class:`~fvstep.sync.SingleProcess`).

    Args:
        method: A unit (``fvstep.update``) or any composed step.
        accumulation: ``Accumulation(microbatches=K, sync=...)`` for the units inside
            (the innermost ``compile`` that sets it wins); default one micro-batch.
        clip: Clipping of units that do not set their own (``None``: off); default the
            enclosing ``compile``'s, else off.
        sanitize: Non-finite policy of units that do not set their own: ``"error"`` (the
            final default: raise :class:`~fvstep.grads.NonFiniteGradientError` before any
            leaf changes when a loss or gradient is NaN or infinite; one device sync per
            unit), ``"skip"`` (leave the role bit-unchanged for that update),
            ``"nan_to_num"`` (zero non-finite gradient entries), or ``None`` (no check;
            unsafe: one NaN gradient silently turns every parameter and moment of the
            role into NaN). See :func:`fvstep.update`.
        sequence_parallel_size: Ranks per sequence-parallel group; they share noise
            (default 1).
        count_collectives: Report collective counts and bytes in the metrics.
        parallelism: The process layout (:class:`~fvstep.sync.Parallelism`).

    Returns:
        A :class:`Compiled` step.

    Raises:
        ValueError: For a bad setting, or two leaves of one name.

    Examples:
        >>> step = compile(update("student", loss), accumulation=Accumulation(4),
        ...                clip=clip_grad_norm(1.0))
        >>> state, metrics = step(state, batch)
    """
    check_step(method, "compile's method")
    check_unique_names(method.leaves(), "compile")
    policy = Policy(accumulation, clip, sanitize)
    settings = CallSettings(parallelism, sequence_parallel_size, count_collectives)
    return Compiled(method, policy, settings)


@attrs.define
class ManagedContext:
    """What a managed step gets to run its own inner updates with the step's machinery.

    Attributes:
        step: The global step being run.
        position: The managed step's index among the leaves of the called step.
        accumulation: The default accumulation of inner updates (the enclosing
            ``compile``'s).
    """

    step: int
    position: int
    accumulation: Accumulation
    _run_unit: Callable[..., tuple[TrainState, dict[str, Any]]]

    def update(
        self,
        state: TrainState,
        unit: Update,
        batch: Any,
        key: torch.Tensor,
        *,
        accumulation: Accumulation | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run ``unit`` once on ``batch`` (split into micro-batches), keyed by ``key``.

        ``accumulation`` defaults to the enclosing ``compile``'s; the unit's own
        ``clip``/``sanitize`` apply, else the managed step's, else the enclosing
        ``compile``'s; the micro-batch keys are ``fold_in(key, m)``. Returns the new
        state and metrics.
        """
        if not isinstance(unit, Update):
            raise TypeError(
                f"ctx.update runs a unit (fvstep.update(...)), got {type(unit).__name__}"
            )
        return self._run_unit(state, unit, batch, key, accumulation or self.accumulation)


ManagedFn = Callable[[TrainState, Any, torch.Tensor, ManagedContext], tuple[TrainState, dict]]


@attrs.frozen(eq=False)
class Managed(Leaf):
    """A step that runs its own inner loop (see :func:`managed`)."""

    kind: ClassVar[str] = "managed step"
    managed: ClassVar[bool] = True

    fn: ManagedFn
    trains: tuple[str, ...]  # a field where Leaf has a property
    name: str = "managed"
    clip: ClipGradNorm | Unset | None = UNSET
    sanitize: Sanitize | Unset = UNSET
    mutates: tuple[str, ...] = ()
    settings: CallSettings = attrs.Factory(CallSettings)

    @property
    def policy(self) -> Policy:
        """Its clip and sanitize: defaults of its inner updates."""
        return Policy(clip=self.clip, sanitize=self.sanitize)

    def run(
        self, state: TrainState, batch: Any, key: torch.Tensor, policy: Policy, ctx: RunContext
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run ``fn`` inside ``rng_scope(key)``; it changes the state from its start."""
        position = ctx.position(self)
        what = f"managed step {self.name!r} (position {position}, trains {list(self.trains)})"
        ctx.begin(what)
        ctx.change(what)  # a managed step may change anything from its start
        assert policy.accumulation is not None

        def run_unit(
            state: TrainState, unit: Update, batch: Any, key: torch.Tensor, acc: Accumulation
        ) -> tuple[TrainState, dict[str, Any]]:
            inner = attrs.evolve(unit.policy.over(policy), accumulation=acc)
            return unit.run_inner(state, batch, key, inner, ctx)

        assert position is not None  # a managed step runs as a leaf of the called step
        inner_ctx = ManagedContext(ctx.step, position, policy.accumulation, run_unit)
        try:
            with fsrandom.rng_scope(key):
                new_state, metrics = self.fn(state, batch, key, inner_ctx)
        except Exception:
            # Its own module reads (outside ctx.update) may leave FSDP2 groups busy.
            ctx.parallelism.grad_sync(state, policy.accumulation).release(state, after_error=True)
            raise
        if not isinstance(new_state, TrainState):
            raise TypeError(f"managed step {self.name!r} must return (TrainState, metrics)")
        return new_state, metrics


def managed(
    fn: ManagedFn,
    *,
    trains: str | tuple[str, ...],
    mutates: str | tuple[str, ...] = (),
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
    name: str = "managed",
) -> Managed:
    """Wrap a method that runs its own inner loop (RL: sample, reward, several updates).

    ``fn(state, batch, key, ctx) -> (state, metrics)`` gets the whole batch (no
    accumulation is applied for it) and runs inner updates with ``ctx.update(state, unit,
    batch, key)``. It may change frozen-but-mutated roles (an RL ``old`` policy) through
    their tensors in place. ``trains`` declares the roles its optimizers step and
    ``mutates`` the frozen roles it changes otherwise, for :func:`~fvstep.stepfn.plan`.
    ``fn`` runs inside ``rng_scope`` of its key, ``fold_in_name(step_key, name)``, so
    modules it calls directly are deterministic too.

    Args:
        fn: The outer step.
        trains: Roles whose optimizers it steps.
        mutates: Frozen roles it changes in place (e.g. ``"old"``).
        clip: Default clipping of its inner updates (else the enclosing ``compile``'s).
        sanitize: Default non-finite policy of its inner updates.
        name: Keys its randomness; a label for metrics and plans.

    Examples:
        >>> managed(rl_outer_step, trains="student")
    """
    trains_t = (trains,) if isinstance(trains, str) else tuple(trains)
    mutates_t = (mutates,) if isinstance(mutates, str) else tuple(mutates)
    if not callable(fn):
        raise TypeError("managed needs a function (state, batch, key, ctx) -> (state, metrics)")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a managed step's name must be a non-empty str, got {name!r}")
    _check_clip(clip)
    _check_sanitize(sanitize)
    return Managed(fn, trains_t, name, clip, sanitize, mutates_t)
