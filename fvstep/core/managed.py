"""Managed steps: methods that run their own inner loop (RL: sample, reward, several updates).

The engine runs one as every leaf, by its ``run``, which gives ``fn`` a
:class:`ManagedContext` to run inner units the same way, by theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch

from fvstep.core import random as fsrandom
from fvstep.core.accumulation import Accumulation
from fvstep.core.engine import ROUTES, Call, Leaf, Route
from fvstep.core.grads import ClipGradNorm, Sanitize
from fvstep.core.settings import UNSET, UnitSettings, Unset, check_clip, check_sanitize
from fvstep.core.state import TrainState

__all__ = ["Managed", "ManagedContext", "ManagedFn", "managed"]


@attrs.frozen(eq=False)
class Managed(Leaf):
    """A step that runs its own inner loop (see :func:`managed`)."""

    kind: ClassVar[str] = "managed step"
    managed: ClassVar[bool] = True
    trains_label: ClassVar[str] = "trains"

    fn: ManagedFn
    trains: tuple[str, ...]
    name: str = "managed"
    settings: UnitSettings = attrs.Factory(UnitSettings)
    mutates: tuple[str, ...] = ()
    check: Callable[[TrainState, Any, Accumulation], None] | None = None
    routes: tuple[Route, ...] = attrs.field(init=False, repr=False, eq=False, default=ROUTES)

    def run(
        self, state: TrainState, batch: Any, key: torch.Tensor, settings: UnitSettings, call: Call
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run ``fn`` inside ``rng_scope(key)``; it counts as changing the state from its start."""
        call.change()
        accumulation = settings.accumulation
        assert accumulation is not None
        ctx = ManagedContext(call.step, call.position, accumulation, settings, call, self.trains)
        try:
            with fsrandom.rng_scope(key):
                new_state, metrics = self.fn(state, batch, key, ctx)
        except Exception:
            # Its own module reads (outside ctx.update) may leave FSDP2 groups busy.
            parallelism = call.parallelism
            sync = None if parallelism is None else parallelism.grad_sync(state, accumulation)
            if sync is not None:
                sync.release(state, after_error=True)
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
    check: Callable[[TrainState, Any, Accumulation], None] | None = None,
) -> Managed:
    """Wrap a method that runs its own inner loop (RL: sample, reward, several updates).

    ``fn(state, batch, key, ctx) -> (state, metrics)`` gets the whole batch and runs inner
    updates with ``ctx.update(state, unit, batch, key)``, inside ``rng_scope`` of its key.
    It may change the frozen roles it declares in ``mutates`` in place (an RL ``old``
    policy).

    Args:
        trains: Roles whose optimizers it steps.
        clip: Default clipping of its inner updates (else the enclosing ``compile``'s).
        sanitize: Default non-finite mode of its inner updates.
        name: Keys its randomness; labels its metrics.
        check: ``check(state, batch, accumulation)``, run before any leaf runs: it raises
            on what ``fn`` cannot take, leaving the input usable.

    Examples:
        >>> managed(rl_outer_step, trains="student")
    """
    trains_t = (trains,) if isinstance(trains, str) else tuple(trains)
    mutates_t = (mutates,) if isinstance(mutates, str) else tuple(mutates)
    if not callable(fn):
        raise TypeError("managed needs a function (state, batch, key, ctx) -> (state, metrics)")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a managed step's name must be a non-empty str, got {name!r}")
    if check is not None and not callable(check):
        raise TypeError(
            f"check must be a function (state, batch, accumulation) -> None, got {check!r}"
        )
    check_clip(clip)
    check_sanitize(sanitize)
    return Managed(fn, trains_t, name, UnitSettings(clip=clip, sanitize=sanitize), mutates_t, check)


@attrs.define
class ManagedContext:
    """What a managed step runs its inner updates with: the ``step``, its ``position`` among
    the leaves, and the inner updates' default ``accumulation`` (the enclosing ``compile``'s)."""

    step: int
    position: int
    accumulation: Accumulation
    _settings: UnitSettings
    _call: Call
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
        ``clip``/``sanitize`` apply, else the managed step's, else the enclosing ones.

        Raises:
            TypeError: If ``unit_`` is not a unit (``fvstep.update(...)``).
            ValueError: If it trains a role the managed step does not declare in ``trains``.
        """
        if not isinstance(unit_, Leaf) or unit_.managed:
            raise TypeError(
                f"ctx.update runs a unit (fvstep.update(...)), got {type(unit_).__name__}"
            )
        undeclared = [r for r in unit_.trains if r not in self._trains]
        if undeclared:
            declare = tuple(sorted({*self._trains, *undeclared}))
            raise ValueError(
                f"ctx.update: {unit_.describe()} trains {undeclared}, which this managed step "
                f"does not declare: pass managed(..., trains={declare!r})"
            )
        settings = attrs.evolve(
            unit_.settings.over(self._settings), accumulation=accumulation or self.accumulation
        ).resolve()
        return unit_.run(state, batch, key, settings, self._call)


ManagedFn = Callable[[TrainState, Any, torch.Tensor, ManagedContext], tuple[TrainState, dict]]
"""``fn(state, batch, key, ctx) -> (state, metrics)`` of a managed step."""
