"""Whether a run's learning-rate schedules end where the run does: schedules count updates.

:func:`fvstep.run` calls :func:`check_schedule_lengths` once before its first step.
"""

from __future__ import annotations

import warnings
from typing import Any

from fvstep.core.engine import Step
from fvstep.core.state import TrainState
from fvstep.core.steps import plan
from fvstep.parallel.ranks import rank_and_world

__all__ = ["ScheduleLengthWarning", "check_schedule_lengths", "schedule_length"]

_MAX_PLANNED = 1_000_000
"""Longer runs are not planned step by step (planning takes time linear in the steps)."""


class ScheduleLengthWarning(UserWarning):
    """A role's learning-rate schedule is laid out over another number of updates than the run makes."""


def schedule_length(schedule: Any) -> int | None:
    """The number of updates ``schedule`` is laid out over, or ``None`` (a constant, a join).

    Examples:
        >>> schedule_length(fs.schedules.cosine(1.0, total_steps=40))
        40
        >>> schedule_length(1e-4) is None
        True
    """
    length = getattr(schedule, "total_steps", None)
    return length if isinstance(length, int) else None


def check_schedule_lengths(step: Any, state: TrainState, *, num_steps: int) -> None:
    """Warn for each role whose schedule's length differs from its updates at ``num_steps``.

    A schedule counts the role's *updates*, not the run's steps: a student that updates
    every second step of a 100-step run makes 50. The updates are counted with
    ``plan(step, i)`` on rank 0. Nothing is checked for a step that is not a
    :class:`~fvstep.Step`, a role trained by a managed step, or a run of over a million steps.

    Args:
        state: The state the run starts from (after its resume).

    Warns:
        ScheduleLengthWarning: Naming the role, its ``total_steps`` and the value to use.

    Examples:
        >>> lr = fs.schedules.warmup_cosine(1e-4, warmup_steps=5, total_steps=50)
        >>> check_schedule_lengths(step, state, num_steps=100)  # the student updates every 2nd step
    """
    if not isinstance(step, Step) or rank_and_world()[0] != 0:
        return
    lengths = {
        name: length
        for name, role in state.roles.items()
        if role.role.optimizer is not None
        and (length := schedule_length(getattr(role.role.optimizer, "lr", None))) is not None
    }
    start = int(state.step)
    if not lengths or not 0 <= num_steps - start <= _MAX_PLANNED:
        return
    updates = {name: _count(state.roles[name].opt_state) for name in lengths}
    managed: set[str] = set()
    for i in range(start, num_steps):
        for entry in plan(step, i):
            if entry.managed:
                managed.update(entry.roles)
            for name in entry.roles:
                if name in updates:
                    updates[name] += 1
    for name, length in lengths.items():
        total = updates[name]
        if name in managed or total == length:
            continue
        warnings.warn(
            ScheduleLengthWarning(
                f"role {name!r}: its learning-rate schedule is laid out over total_steps="
                f"{length} updates, but at num_steps={num_steps} it will have made {total} "
                f"(schedules count the role's updates, not the run's steps; see "
                f"fvstep.plan). Pass total_steps={total} to the schedule"
            ),
            stacklevel=3,
        )


def _count(opt_state: Any) -> int:
    count = getattr(opt_state, "count", None)
    return int(count) if count is not None else 0
