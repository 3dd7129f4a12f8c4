"""Learning-rate schedules as pure functions of the update count, in the style of optax.

A schedule is a stateless function ``count -> lr`` (:data:`Schedule`) of the optimizer's
*updates*; decaying ones carry ``schedule.total_steps``. Each equals its diffusers counterpart
bit for bit; factories raise ``ValueError`` out of range (``docs/api/schedules.md``).

Examples:
    >>> warmup_cosine(1e-3, warmup_steps=100, total_steps=1000)(50)
    0.0005
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import SupportsIndex

from fvstep.core._checks import check_int, check_learning_rate, check_real

__all__ = [
    "Schedule",
    "constant",
    "constant_with_warmup",
    "cosine",
    "join",
    "linear_decay",
    "piecewise_constant",
    "polynomial",
    "warmup_cosine",
    "warmup_cosine_restarts",
    "warmup_linear",
]

Schedule = Callable[[int], float]
"""A learning-rate schedule: a pure function from a step count ``>= 0`` to a learning rate."""


def _check_ratio(value: float, name: str) -> float:
    v = check_real(value, name)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {v}")
    return v


def _check_warmup_total(warmup_steps: SupportsIndex, total_steps: SupportsIndex) -> tuple[int, int]:
    warmup = check_int(warmup_steps, "warmup_steps")
    total = check_int(total_steps, "total_steps", minimum=1)
    if warmup > total:
        raise ValueError(f"warmup_steps ({warmup}) must not exceed total_steps ({total})")
    return warmup, total


def _check_boundaries(
    boundaries: Sequence[SupportsIndex], n_pieces: int, what: str
) -> tuple[int, ...]:
    bounds = tuple(check_int(b, f"boundaries[{i}]") for i, b in enumerate(boundaries))
    if len(bounds) != n_pieces - 1:
        raise ValueError(
            f"need exactly one boundary fewer than {what}: got {n_pieces} {what} "
            f"and {len(bounds)} boundaries"
        )
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            raise ValueError(f"boundaries must be strictly increasing, got {list(bounds)}")
    return bounds


def _named(schedule: Schedule, name: str) -> Schedule:
    schedule.__name__ = schedule.__qualname__ = name
    return schedule


def _lambda_lr(
    lr: float, factor: Callable[[int], float], name: str, total_steps: int | None = None
) -> Schedule:
    """``factor(step)`` applied as ``LambdaLR`` does; ``total_steps`` (what
    :func:`fvstep.run` compares with a role's updates) is kept as ``schedule.total_steps``."""

    def schedule(step: SupportsIndex) -> float:
        # LambdaLR.get_lr computes `base_lr * lmbda(last_epoch)`; same operands, same order.
        return lr * factor(check_int(step, "step"))

    if total_steps is not None:
        schedule.__dict__["total_steps"] = total_steps
    return _named(schedule, name)


def constant(lr: float) -> Schedule:
    """A constant learning rate, finite and ``>= 0``: diffusers' ``get_scheduler("constant")``.

    Examples:
        >>> constant(1e-4)(12345)
        0.0001
    """
    lr = check_learning_rate(lr)

    def factor(step: int) -> float:
        return 1.0

    return _lambda_lr(lr, factor, "constant")


def constant_with_warmup(lr: float, *, warmup_steps: int, init_ratio: float = 0.0) -> Schedule:
    """A linear warmup from ``init_ratio * lr`` to ``lr`` over ``warmup_steps`` steps, then ``lr``.

    With ``init_ratio > 0`` the held value can differ from ``lr`` by one rounding, as torch's
    ``LinearLR`` does.

    Args:
        lr: The learning rate after warmup, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``>= 0`` (0 means the schedule is constant).
        init_ratio: The LR at step 0 as a fraction of ``lr``, in ``[0, 1]``.

    Examples:
        >>> sched = constant_with_warmup(1.0, warmup_steps=4, init_ratio=0.5)
        >>> [sched(i) for i in range(6)]
        [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    """
    lr = check_learning_rate(lr)
    warmup = check_int(warmup_steps, "warmup_steps")
    init = _check_ratio(init_ratio, "init_ratio")

    def factor(step: int) -> float:
        if warmup == 0:
            return 1.0
        # LinearLR._get_closed_form_lr with end_factor=1.0; for init == 0 it is diffusers'
        # get_constant_schedule_with_warmup (`0.0 + 1.0 * step / warmup` is `step / warmup`).
        return init + (1.0 - init) * min(warmup, step) / warmup

    return _lambda_lr(lr, factor, "constant_with_warmup")


def warmup_cosine(
    lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> Schedule:
    """A linear warmup from 0 to ``lr``, then a cosine decay towards ``min_ratio * lr``.

    After warmup the multiplier is
    ``min_ratio + (1 - min_ratio) * max(0, (1 + cos(2π · num_cycles · progress)) / 2)``
    with ``progress = (step - warmup_steps) / (total_steps - warmup_steps)``.

    As in diffusers, ``progress`` is not clamped at 1: past ``total_steps`` the LR climbs
    back up; :func:`join` it with :func:`constant` to hold the final value.

    Args:
        lr: The peak learning rate, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps <= total_steps``.
        total_steps: Step at which the decay has run ``num_cycles`` periods, ``>= 1``.
        min_ratio: The floor of the decay as a fraction of ``lr``, in ``[0, 1]``.
        num_cycles: Number of cosine periods between ``warmup_steps`` and
            ``total_steps``; the default 0.5 is a half cosine from ``lr`` down to the floor.

    Examples:
        >>> sched = warmup_cosine(1.0, warmup_steps=2, total_steps=6)
        >>> [round(sched(i), 6) for i in range(7)]
        [0.0, 0.5, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    """
    lr = check_learning_rate(lr)
    warmup, total = _check_warmup_total(warmup_steps, total_steps)
    floor = _check_ratio(min_ratio, "min_ratio")
    cycles = check_real(num_cycles, "num_cycles")
    if cycles <= 0.0:
        raise ValueError(f"num_cycles must be > 0, got {cycles}")

    def factor(step: int) -> float:
        # diffusers.optimization.get_cosine_schedule_with_warmup.lr_lambda ...
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        c = max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress)))
        # ... rescaled to [min_ratio, 1]; for min_ratio == 0 this is `0.0 + 1.0 * c == c`.
        return floor + (1.0 - floor) * c

    return _lambda_lr(lr, factor, "warmup_cosine", total)


def cosine(
    lr: float, *, total_steps: int, min_ratio: float = 0.0, num_cycles: float = 0.5
) -> Schedule:
    """A cosine decay from ``lr`` towards ``min_ratio * lr`` over ``total_steps`` steps.

    :func:`warmup_cosine` with ``warmup_steps=0`` (its arguments and raises).

    Examples:
        >>> sched = cosine(1.0, total_steps=4, min_ratio=0.1)
        >>> [round(sched(i), 6) for i in range(5)]
        [1.0, 0.868198, 0.55, 0.231802, 0.1]
    """
    schedule = warmup_cosine(
        lr, warmup_steps=0, total_steps=total_steps, min_ratio=min_ratio, num_cycles=num_cycles
    )
    return _named(schedule, "cosine")


def warmup_cosine_restarts(
    lr: float, *, warmup_steps: int, total_steps: int, num_cycles: int = 1
) -> Schedule:
    """A linear warmup, then ``num_cycles`` half-cosine decays from ``lr`` to 0 with hard restarts.

    The LR is 0 from ``total_steps`` on. ``lr``, ``warmup_steps`` and ``total_steps`` are as
    :func:`warmup_cosine`'s; ``num_cycles`` (the decays) is an integer ``>= 1``.

    Examples:
        >>> sched = warmup_cosine_restarts(1.0, warmup_steps=0, total_steps=4, num_cycles=2)
        >>> [round(sched(i), 6) for i in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    lr = check_learning_rate(lr)
    warmup, total = _check_warmup_total(warmup_steps, total_steps)
    cycles = check_int(num_cycles, "num_cycles", minimum=1)

    def factor(step: int) -> float:
        # diffusers.optimization.get_cosine_with_hard_restarts_schedule_with_warmup.lr_lambda
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(cycles) * progress) % 1.0))))

    return _lambda_lr(lr, factor, "warmup_cosine_restarts", total)


def warmup_linear(
    lr: float, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> Schedule:
    """A linear warmup from 0 to ``lr``, then a linear decay to ``min_ratio * lr`` at ``total_steps``.

    The LR stays at ``min_ratio * lr`` after ``total_steps``. The arguments are as
    :func:`warmup_cosine`'s.

    Examples:
        >>> sched = warmup_linear(1.0, warmup_steps=2, total_steps=6)
        >>> [sched(i) for i in range(8)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    lr = check_learning_rate(lr)
    warmup, total = _check_warmup_total(warmup_steps, total_steps)
    f_min = _check_ratio(min_ratio, "min_ratio")
    f_max = 1.0

    def factor(step: int) -> float:
        # diffusers.optimization.get_linear_schedule_with_warmup.lr_lambda
        if step < warmup:
            return f_max * float(step) / float(max(1, warmup))
        progress = float(total - step) / float(max(1, total - warmup))
        return f_min + (f_max - f_min) * max(0.0, progress)

    return _lambda_lr(lr, factor, "warmup_linear", total)


def linear_decay(
    lr: float, *, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0
) -> Schedule:
    """A linear decay from ``lr`` to ``min_ratio * lr`` at ``total_steps``, after an optional warmup.

    :func:`warmup_linear` with ``warmup_steps`` defaulting to 0 (its arguments).

    Examples:
        >>> sched = linear_decay(1.0, total_steps=4)
        >>> [sched(i) for i in range(6)]
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    schedule = warmup_linear(
        lr, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio
    )
    return _named(schedule, "linear_decay")


def polynomial(
    lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    end_lr: float = 1e-7,
    power: float = 1.0,
) -> Schedule:
    """A linear warmup from 0 to ``lr``, then a polynomial decay to ``end_lr`` at ``total_steps``.

    After warmup the LR is ``(lr - end_lr) * (1 - progress) ** power + end_lr`` and
    ``end_lr`` after ``total_steps`` (through diffusers' ``lr * (decay / lr)`` round trip).

    Args:
        lr: The peak learning rate, finite and ``> end_lr``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps < total_steps``.
        end_lr: The final learning rate, finite and ``>= 0``.
        power: The exponent of the decay, finite and ``> 0`` (1 is linear).

    Examples:
        >>> sched = polynomial(1.0, warmup_steps=0, total_steps=4, end_lr=0.0, power=2.0)
        >>> [sched(i) for i in range(6)]
        [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """
    lr_init = check_learning_rate(lr)
    lr_end = check_learning_rate(end_lr, "end_lr")
    if not lr_init > lr_end:
        raise ValueError(f"end_lr ({lr_end}) must be smaller than lr ({lr_init})")
    warmup, total = _check_warmup_total(warmup_steps, total_steps)
    if warmup == total:
        raise ValueError(
            f"warmup_steps ({warmup}) must be smaller than total_steps ({total}) "
            "so that the decay has at least one step"
        )
    exponent = check_real(power, "power")
    if exponent <= 0.0:
        raise ValueError(f"power must be > 0, got {exponent}")

    def factor(step: int) -> float:
        # diffusers.optimization.get_polynomial_decay_schedule_with_warmup.lr_lambda
        if step < warmup:
            return float(step) / float(max(1, warmup))
        elif step > total:
            return lr_end / lr_init
        else:
            lr_range = lr_init - lr_end
            decay_steps = total - warmup
            pct_remaining = 1 - (step - warmup) / decay_steps
            decay = lr_range * pct_remaining**exponent + lr_end
            return decay / lr_init

    return _lambda_lr(lr_init, factor, "polynomial", total)


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run schedules one after another, like ``optax.join_schedules``.

    ``schedules[0]`` is used for steps ``< boundaries[0]``, ``schedules[i]`` for steps in
    ``[boundaries[i-1], boundaries[i])`` and the last one for steps ``>= boundaries[-1]``.
    Each schedule is called with the step counted from the start of its own segment,
    ``step - boundaries[i-1]``, and its value is returned unchanged.

    Args:
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
    bounds = _check_boundaries(boundaries, len(pieces), "schedules")
    offsets = (0, *bounds)

    def joined(step: SupportsIndex) -> float:
        s = check_int(step, "step")
        i = bisect.bisect_right(bounds, s)
        return pieces[i](s - offsets[i])

    return _named(joined, "join")


def piecewise_constant(values: Sequence[float], boundaries: Sequence[int]) -> Schedule:
    """A step function: ``values[i]`` for steps in ``[boundaries[i-1], boundaries[i])``.

    ``values[0]`` is used for steps ``< boundaries[0]`` and ``values[-1]`` for steps
    ``>= boundaries[-1]``. The values are learning rates, not diffusers' multipliers.

    Args:
        values: ``len(boundaries) + 1`` learning rates, finite and ``>= 0``.
        boundaries: Strictly increasing step counts ``>= 0``.

    Examples:
        >>> sched = piecewise_constant([1e-3, 1e-4, 1e-5], [10, 20])
        >>> sched(9), sched(10), sched(25)
        (0.001, 0.0001, 1e-05)
    """
    vals = tuple(check_learning_rate(v, f"values[{i}]") for i, v in enumerate(values))
    if not vals:
        raise ValueError("piecewise_constant needs at least one value")
    bounds = _check_boundaries(boundaries, len(vals), "values")

    def step_function(step: SupportsIndex) -> float:
        return vals[bisect.bisect_right(bounds, check_int(step, "step"))]

    return _named(step_function, "piecewise_constant")
