"""The steps: units, managed steps, and the combinators that make steps of steps.

A unit (:func:`update`) and a managed step (:func:`managed`) are leaves; :func:`sequence`,
:func:`every`, :func:`cond` and :func:`compile` take steps and return a
:class:`~fvstep.core.engine.Step`, so combinations nest. Leaves are keyed by their names,
which are unique within a step; what runs at a step is a pure function of it (:func:`plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import ClassVar

import attrs

from fvstep.core.accumulation import Accumulation
from fvstep.core.engine import (
    ROUTES,
    Gate,
    Leaf,
    LossFn,
    Route,
    Step,
    name_routes,
    run_unit,
)
from fvstep.core.grads import ClipGradNorm, Sanitize
from fvstep.core.settings import UNSET, PlanEntry, UnitSettings, Unset, check_clip, check_sanitize

__all__ = [
    "Chain",
    "Compiled",
    "Cond",
    "Every",
    "Unit",
    "compile",
    "cond",
    "every",
    "plan",
    "sequence",
    "update",
]


def _check_step(step: object, where: str) -> None:
    if not isinstance(step, Step):
        raise TypeError(
            f"{where} must be a step (a method: fvstep.update(...), sequence, every, cond, "
            f"managed, compile), got {type(step).__name__}"
        )


def _check_unique_names(leaves: tuple[Leaf, ...], where: str) -> None:
    """Refuse two leaves of one name: their keys would be the same."""
    seen: dict[str, Leaf] = {}
    for leaf in leaves:
        other = seen.setdefault(leaf.name, leaf)
        if other is leaf and leaves.count(leaf) == 1:
            continue
        what = (
            f"the same {leaf.describe()} appears twice"
            if other is leaf
            else f"{other.describe()} and {leaf.describe()} share the name"
        )
        raise ValueError(
            f"{where}: {what}; leaves are keyed by fold_in_name(step_key, name): rename one, "
            f"e.g. update(..., name={leaf.name + '_2'!r}) (or managed(..., name=...))"
        )


@attrs.frozen(eq=False)
class Unit(Leaf):
    """One update unit (see :func:`update`): a step, and a leaf of composed steps."""

    kind: ClassVar[str] = "unit"

    roles: tuple[str, ...]
    loss_fn: LossFn
    settings: UnitSettings = attrs.Factory(UnitSettings)
    name: str = ""
    trains: tuple[str, ...] = attrs.field(
        init=False, repr=False, default=attrs.Factory(lambda unit: unit.roles, takes_self=True)
    )
    routes: tuple[Route, ...] = attrs.field(init=False, repr=False, eq=False, default=ROUTES)
    run = run_unit


def update(
    roles: str | SequenceOf[str],
    loss_fn: LossFn,
    *,
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
    name: str | None = None,
) -> Unit:
    """Train ``roles`` on ``loss_fn``: the unit that methods are built from.

    Per micro-batch: ``loss_fn`` inside ``rng_scope`` of its key, backward of ``loss / K``;
    then per role: sanitize, clip, step the optimizer, update the EMA
    (``docs/concepts/composition.md``).

    Args:
        roles: The role (or roles) trained; each must have an optimizer.
        loss_fn: ``(state, batch, key) -> loss | (loss, metrics) | ({role: loss}, metrics)``;
            several losses are summed into one backward (detach what crosses roles).
        clip: A :func:`fvstep.clip_grad_norm`, ``None`` for no clipping, or left out for
            the enclosing setting (a managed step's, then ``compile``'s; default off).
        sanitize: ``"error"`` (the default: raise
            :class:`~fvstep.core.errors.NonFiniteGradientError` before the unit changes
            anything), ``"skip"``, ``"nan_to_num"``, or ``None`` (unsafe: no check); left
            out, the enclosing setting.
        name: Keys the unit's randomness and labels its metrics (default: the roles
            joined by ``+``); unique among the leaves of a step.

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
    check_clip(clip)
    check_sanitize(sanitize)
    return Unit(
        roles_t, loss_fn, UnitSettings(clip=clip, sanitize=sanitize), name or "+".join(roles_t)
    )


@attrs.frozen(eq=False)
class Chain(Step):
    """Several steps run one after the other (see :func:`sequence`)."""

    steps: tuple[Step, ...]
    routes: tuple[Route, ...] = attrs.field(init=False, repr=False, eq=False)

    @routes.default
    def _build(self) -> tuple[Route, ...]:
        return name_routes([route for s in self.steps for route in s.routes])


def sequence(*steps: Step) -> Chain:
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
        _check_step(s, f"sequence argument {i}")
    composed = Chain(tuple(steps))
    _check_unique_names(composed.leaves(), "sequence")
    return composed


@attrs.frozen(eq=False)
class Every(Step):
    """A step run every ``n`` steps (see :func:`every`)."""

    n: int
    inner: Step
    offset: int = 0
    routes: tuple[Route, ...] = attrs.field(init=False, repr=False, eq=False)

    @routes.default
    def _build(self) -> tuple[Route, ...]:
        gate = Gate(self.n, self.offset)
        return tuple(route.behind(gate) for route in self.inner.routes)


def every(n: int, inner: Step, *, offset: int = 0) -> Every:
    """Run ``inner`` at steps ``offset, offset + n, offset + 2n, ...``.

    On other steps its roles' parameters, optimizer state and schedule position are not
    touched (the schedule advances with the role's own update count).

    Args:
        n: The interval (>= 1); DMD2's ``generator_update_interval``.
        offset: The first step it runs at (>= 0).

    Examples:
        >>> every(5, update("student", gen_loss))   # steps 0, 5, 10, ...
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every needs an integer n >= 1, got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"every needs an integer offset >= 0, got {offset!r}")
    _check_step(inner, "every's step")
    return Every(n, inner, offset)


@attrs.frozen(eq=False)
class Cond(Step):
    """A choice between two steps by a predicate of the step (see :func:`cond`)."""

    pred: Callable[[int], bool]
    if_true: Step
    if_false: Step | None
    routes: tuple[Route, ...] = attrs.field(init=False, repr=False, eq=False)

    @routes.default
    def _build(self) -> tuple[Route, ...]:
        yes = Gate(pred=self.pred, branch=True)
        no = attrs.evolve(yes, branch=False)
        routes = [route.behind(yes) for route in self.if_true.routes]
        if self.if_false is not None:
            routes += [route.behind(no) for route in self.if_false.routes]
        return name_routes(routes)


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
    _check_step(if_true, "cond's if_true")
    if if_false is not None:
        _check_step(if_false, "cond's if_false")
    composed = Cond(pred, if_true, if_false)
    _check_unique_names(composed.leaves(), "cond")
    return composed


@attrs.frozen(eq=False)
class Compiled(Step):
    """A step with execution settings for its units (see :func:`compile`)."""

    inner: Step
    settings: UnitSettings = attrs.Factory(UnitSettings)
    routes: tuple[Route, ...] = attrs.field(init=False, repr=False, eq=False)

    @routes.default
    def _build(self) -> tuple[Route, ...]:
        return tuple(route.under(self.settings) for route in self.inner.routes)


def compile(
    inner: Step,
    *,
    accumulation: Accumulation | None = None,
    clip: ClipGradNorm | Unset | None = UNSET,
    sanitize: Sanitize | Unset = UNSET,
) -> Compiled:
    """Give a step execution settings; returns a step.

    Compiled steps compose (the innermost setting wins). The process layout is not a
    setting: it is passed to each call (``parallelism=``).

    Args:
        accumulation: ``Accumulation(microbatches=K, sync=...)`` for the units inside;
            default one micro-batch.
        clip: Clipping of units that do not set their own (``None``: off); default off.
        sanitize: Non-finite mode of units that do not set their own (:func:`update`'s).

    Raises:
        ValueError: For a bad setting, or two leaves of one name.

    Examples:
        >>> step = compile(update("student", loss), accumulation=Accumulation(4))
    """
    _check_step(inner, "compile's step")
    _check_unique_names(inner.leaves(), "compile")
    if accumulation is not None and not isinstance(accumulation, Accumulation):
        raise TypeError(
            f"accumulation must be fvstep.Accumulation(...), got {type(accumulation).__name__}"
        )
    check_clip(clip)
    check_sanitize(sanitize)
    return Compiled(inner, UnitSettings(accumulation, clip, sanitize))


def plan(step_fn: Step, step: int) -> list[PlanEntry]:
    """What ``step_fn`` runs at ``step``: one :class:`~fvstep.core.settings.PlanEntry` per
    leaf that runs, in order (a pure function of ``step``).

    Examples:
        >>> [e.roles for e in plan(step_fn, 5)]
        [('critic',), ('student',)]
    """
    _check_step(step_fn, "plan's step function")
    return step_fn.plan(step)
