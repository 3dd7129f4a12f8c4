"""Combinators: build one method out of update units, decided by the step counter alone.

A method is a tree whose leaves are :class:`~fvstep.update.Update` units and
:class:`Managed` steps. Every node answers ``active(step)``: the leaves that run at that
step, in order, each with its fixed position in the tree (the position keys its
randomness). Because that is a pure function of the step, :func:`plan` can list what runs
at any step without running it — the pure form of the reference's ``get_optimizers(i)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch

from fvstep.accumulation import Accumulation
from fvstep.grads import ClipGradNorm, Sanitize
from fvstep.state import TrainState
from fvstep.update import DEFAULT, Update

__all__ = [
    "Cond",
    "Every",
    "Managed",
    "ManagedContext",
    "Method",
    "PlanEntry",
    "Sequence",
    "cond",
    "every",
    "managed",
    "sequence",
]


class Method(Protocol):
    """Anything that can say which leaves run at a step."""

    def num_leaves(self) -> int:
        """The number of leaves (units and managed steps) in the tree."""
        ...

    def active(self, step: int, base: int = 0) -> list[tuple[int, Any]]:
        """The ``(position, leaf)`` pairs that run at ``step``, in order."""
        ...


def _check_method(node: Any, where: str) -> None:
    if not (hasattr(node, "active") and hasattr(node, "num_leaves")):
        raise TypeError(
            f"{where} must be a method (fvstep.update(...), sequence, every, cond, managed), "
            f"got {type(node).__name__}"
        )


@attrs.frozen(eq=False)
class Sequence:
    """Run several methods one after the other (see :func:`sequence`)."""

    children: tuple[Any, ...]

    def num_leaves(self) -> int:
        """The leaves of all children."""
        return sum(c.num_leaves() for c in self.children)

    def active(self, step: int, base: int = 0) -> list[tuple[int, Any]]:
        """Each child's active leaves, in order."""
        out: list[tuple[int, Any]] = []
        for child in self.children:
            out += child.active(step, base)
            base += child.num_leaves()
        return out


def sequence(*methods: Any) -> Sequence:
    """Run ``methods`` in order within one step; each sees the state the previous returned.

    Examples:
        >>> sequence(update("student", gen_loss), update("critic", critic_loss))
    """
    if not methods:
        raise ValueError("sequence needs at least one method")
    for i, m in enumerate(methods):
        _check_method(m, f"sequence argument {i}")
    return Sequence(tuple(methods))


@attrs.frozen(eq=False)
class Every:
    """Run a method every ``n`` steps (see :func:`every`)."""

    n: int
    method: Any
    offset: int = 0

    def num_leaves(self) -> int:
        """The wrapped method's leaves."""
        return self.method.num_leaves()

    def runs_at(self, step: int) -> bool:
        """Whether the method runs at ``step``."""
        return step >= self.offset and (step - self.offset) % self.n == 0

    def active(self, step: int, base: int = 0) -> list[tuple[int, Any]]:
        """The method's leaves on its steps, nothing otherwise."""
        return self.method.active(step, base) if self.runs_at(step) else []


def every(n: int, method: Any, *, offset: int = 0) -> Every:
    """Run ``method`` at steps ``offset, offset + n, offset + 2n, ...``.

    On other steps its roles' parameters, optimizer state and schedule position are not
    touched (the schedule advances with the role's own update count).

    Args:
        n: The interval (>= 1); DMD2's ``generator_update_interval``.
        method: A unit or composed method.
        offset: The first step it runs at (>= 0).

    Examples:
        >>> every(5, update("student", gen_loss))   # steps 0, 5, 10, ...
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every needs an integer n >= 1, got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"every needs an integer offset >= 0, got {offset!r}")
    _check_method(method, "every's method")
    return Every(n, method, offset)


@attrs.frozen(eq=False)
class Cond:
    """Choose between two methods by a predicate of the step (see :func:`cond`)."""

    pred: Callable[[int], bool]
    if_true: Any
    if_false: Any | None

    def num_leaves(self) -> int:
        """Both branches' leaves."""
        return self.if_true.num_leaves() + (self.if_false.num_leaves() if self.if_false else 0)

    def active(self, step: int, base: int = 0) -> list[tuple[int, Any]]:
        """The leaves of the branch the predicate picks."""
        if bool(self.pred(step)):
            return self.if_true.active(step, base)
        if self.if_false is None:
            return []
        return self.if_false.active(step, base + self.if_true.num_leaves())


def cond(pred: Callable[[int], bool], if_true: Any, if_false: Any | None = None) -> Cond:
    """Run ``if_true`` at steps where ``pred(step)`` holds, else ``if_false`` (or nothing).

    ``pred`` must be a pure function of the step (an int).

    Examples:
        >>> cond(lambda i: i % 5 == 0, update(("student", "critic"), fused_loss),
        ...      update("critic", critic_loss))
    """
    if not callable(pred):
        raise TypeError("cond's predicate must be a function of the step")
    _check_method(if_true, "cond's if_true")
    if if_false is not None:
        _check_method(if_false, "cond's if_false")
    return Cond(pred, if_true, if_false)


@attrs.define
class ManagedContext:
    """What a managed step gets to run its own inner updates with the executor's machinery.

    Attributes:
        step: The global step being run.
        position: The managed step's position in the method tree.
        accumulation: The default accumulation of inner updates (the compiled step's).
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

        ``accumulation`` defaults to the compiled step's; the unit's own
        ``clip``/``sanitize`` apply, else the managed step's, else the compile-wide ones;
        the micro-batch keys are ``fold_in(key, m)``. Returns the new state and metrics.
        """
        return self._run_unit(state, unit, batch, key, accumulation or self.accumulation)


@attrs.frozen(eq=False)
class Managed:
    """A step that runs its own inner loop (see :func:`managed`)."""

    fn: Callable[[TrainState, Any, torch.Tensor, ManagedContext], tuple[TrainState, dict]]
    trains: tuple[str, ...]
    name: str
    clip: ClipGradNorm | None = DEFAULT
    sanitize: Sanitize = DEFAULT
    mutates: tuple[str, ...] = ()

    def num_leaves(self) -> int:
        """A managed step is one leaf."""
        return 1

    def active(self, step: int, base: int = 0) -> list[tuple[int, Any]]:
        """It runs at every step it is reached."""
        return [(base, self)]


def managed(
    fn: Callable[[TrainState, Any, torch.Tensor, ManagedContext], tuple[TrainState, dict]],
    *,
    trains: str | tuple[str, ...],
    mutates: str | tuple[str, ...] = (),
    clip: ClipGradNorm | None = DEFAULT,
    sanitize: Sanitize = DEFAULT,
    name: str = "managed",
) -> Managed:
    """Wrap a method that runs its own inner loop (RL: sample, reward, several updates).

    ``fn(state, batch, key, ctx) -> (state, metrics)`` gets the whole batch (no
    accumulation is applied for it) and runs inner updates with ``ctx.update(state, unit,
    batch, key)``. It may change frozen-but-mutated roles (an RL ``old`` policy) through
    their tensors in place. ``trains`` declares the roles its optimizers step and
    ``mutates`` the frozen roles it changes otherwise, for :func:`plan`. ``fn`` runs inside
    ``rng_scope`` of its key, so modules it calls directly are deterministic too.

    Args:
        fn: The outer step.
        trains: Roles whose optimizers it steps.
        mutates: Frozen roles it changes in place (e.g. ``"old"``).
        clip: Default clipping of its inner updates (else the compile-wide one).
        sanitize: Default non-finite policy of its inner updates.
        name: A label for metrics and plans.

    Examples:
        >>> managed(rl_outer_step, trains="student")
    """
    trains_t = (trains,) if isinstance(trains, str) else tuple(trains)
    mutates_t = (mutates,) if isinstance(mutates, str) else tuple(mutates)
    if not callable(fn):
        raise TypeError("managed needs a function (state, batch, key, ctx) -> (state, metrics)")
    return Managed(fn, trains_t, name, clip, sanitize, mutates_t)


@attrs.frozen
class PlanEntry:
    """One leaf that runs at a step: what it trains and how.

    Attributes:
        position: The leaf's position in the method tree (keys its randomness).
        name: The unit's or managed step's name.
        roles: The roles whose optimizers step.
        managed: Whether it runs its own inner loop.
        mutates: Frozen roles it changes in place (managed steps only).
        clip: The resolved clipping (``None``: none).
        sanitize: The resolved non-finite policy.
    """

    position: int
    name: str
    roles: tuple[str, ...]
    managed: bool
    clip: ClipGradNorm | None
    sanitize: Sanitize
    mutates: tuple[str, ...] = ()
