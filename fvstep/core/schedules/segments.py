"""Schedules made of segments between step boundaries: :func:`join`, :func:`piecewise_constant`."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import SupportsIndex

from fvstep.core._checks import check_int, check_learning_rate
from fvstep.core.schedules.base import Schedule, check_boundaries

__all__ = ["join", "piecewise_constant"]


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run schedules one after another, like ``optax.join_schedules``.

    ``schedules[0]`` is used for steps ``< boundaries[0]``, ``schedules[i]`` for steps in
    ``[boundaries[i-1], boundaries[i])`` and the last one for steps ``>= boundaries[-1]``.
    Each schedule is called with the step counted from the start of its own segment,
    ``step - boundaries[i-1]``, and its value is returned unchanged.

    Args:
        schedules: One or more schedules.
        boundaries: ``len(schedules) - 1`` strictly increasing step counts ``>= 0``.

    Raises:
        ValueError: If ``schedules`` is empty or the boundaries are not as above.
        TypeError: If a schedule is not callable or a boundary is not an integer.

    Examples:
        >>> sched = join([constant_with_warmup(1.0, warmup_steps=2), linear_decay(1.0, total_steps=2)], [3])
        >>> [sched(i) for i in range(6)]
        [0.0, 0.5, 1.0, 1.0, 0.5, 0.0]
    """
    pieces = tuple(schedules)
    if not pieces:
        raise ValueError("join needs at least one schedule")
    for i, s in enumerate(pieces):
        if not callable(s):
            raise TypeError(f"schedules[{i}] must be callable, got {type(s).__name__}")
    bounds = check_boundaries(boundaries, len(pieces), "schedules")
    offsets = (0, *bounds)

    def joined(step: SupportsIndex) -> float:
        s = check_int(step, "step")
        i = bisect.bisect_right(bounds, s)
        return pieces[i](s - offsets[i])

    joined.__name__ = joined.__qualname__ = "join"
    return joined


def piecewise_constant(values: Sequence[float], boundaries: Sequence[int]) -> Schedule:
    """A step function: ``values[i]`` for steps in ``[boundaries[i-1], boundaries[i])``.

    ``values[0]`` is used for steps ``< boundaries[0]`` and ``values[-1]`` for steps
    ``>= boundaries[-1]``. The values are learning rates, not diffusers' multipliers.

    Args:
        values: ``len(boundaries) + 1`` learning rates, finite and ``>= 0``.
        boundaries: Strictly increasing step counts ``>= 0``.

    Raises:
        ValueError: If an argument is not as above.

    Examples:
        >>> sched = piecewise_constant([1e-3, 1e-4, 1e-5], [10, 20])
        >>> sched(9), sched(10), sched(25)
        (0.001, 0.0001, 1e-05)
    """
    vals = tuple(check_learning_rate(v, f"values[{i}]") for i, v in enumerate(values))
    if not vals:
        raise ValueError("piecewise_constant needs at least one value")
    bounds = check_boundaries(boundaries, len(vals), "values")

    def step_function(step: SupportsIndex) -> float:
        return vals[bisect.bisect_right(bounds, check_int(step, "step"))]

    step_function.__name__ = step_function.__qualname__ = "piecewise_constant"
    return step_function
