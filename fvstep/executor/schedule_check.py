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

# Longer runs are not planned step by step (planning takes time linear in the steps).
_MAX_PLANNED = 1_000_000


class ScheduleLengthWarning(UserWarning):
    """A role's learning-rate schedule is laid out over another number of updates than the run makes."""


def schedule_length(schedule: Any) -> int | None:
    """The number of updates ``schedule`` is laid out over, or ``None`` (a constant, a join)."""
    length = getattr(schedule, "total_steps", None)
    return length if isinstance(length, int) else None


def check_schedule_lengths(step: Any, state: TrainState, *, num_steps: int) -> None:
    """Warn (:class:`ScheduleLengthWarning`) for each role whose schedule's length is not its
    updates from ``state`` (after resume) to ``num_steps``, counted with ``plan`` on rank 0; skips
    a non-:class:`~fvstep.Step`, managed roles and runs of over a million steps."""
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
