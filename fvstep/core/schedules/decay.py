"""Decaying schedules after a linear warmup: cosine (with restarts), linear, polynomial.

Each computes its multiplier with the floating-point operations of the corresponding
``diffusers.optimization`` ``lr_lambda``, in the same order (see :mod:`fvstep.core.schedules`).
"""

from __future__ import annotations

import math

from fvstep.core._checks import check_int, check_learning_rate, check_real
from fvstep.core.schedules.base import (
    Schedule,
    check_ratio,
    check_warmup_total,
    lambda_lr,
)

__all__ = [
    "cosine",
    "linear_decay",
    "polynomial",
    "warmup_cosine",
    "warmup_cosine_restarts",
    "warmup_linear",
]


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

    Raises:
        ValueError: If an argument lies outside the range given above.

    Examples:
        >>> sched = warmup_cosine(1.0, warmup_steps=2, total_steps=6)
        >>> [round(sched(i), 6) for i in range(7)]
        [0.0, 0.5, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    """
    return _warmup_cosine(lr, warmup_steps, total_steps, min_ratio, num_cycles, "warmup_cosine")


def _warmup_cosine(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_ratio: float,
    num_cycles: float,
    name: str,
) -> Schedule:
    lr = check_learning_rate(lr)
    warmup, total = check_warmup_total(warmup_steps, total_steps)
    floor = check_ratio(min_ratio, "min_ratio")
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

    return lambda_lr(lr, factor, name, total)


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
    return _warmup_cosine(lr, 0, total_steps, min_ratio, num_cycles, "cosine")


def warmup_cosine_restarts(
    lr: float, *, warmup_steps: int, total_steps: int, num_cycles: int = 1
) -> Schedule:
    """A linear warmup, then ``num_cycles`` half-cosine decays from ``lr`` to 0 with hard restarts.

    The LR is 0 from ``total_steps`` on.

    Args:
        lr: The peak learning rate, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps <= total_steps``.
        total_steps: Step at which the last cycle ends, ``>= 1``.
        num_cycles: Number of decay cycles (hard restarts), ``>= 1``.

    Raises:
        ValueError: If an argument lies outside the range given above.

    Examples:
        >>> sched = warmup_cosine_restarts(1.0, warmup_steps=0, total_steps=4, num_cycles=2)
        >>> [round(sched(i), 6) for i in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    lr = check_learning_rate(lr)
    warmup, total = check_warmup_total(warmup_steps, total_steps)
    cycles = check_int(num_cycles, "num_cycles", minimum=1)

    def factor(step: int) -> float:
        # diffusers.optimization.get_cosine_with_hard_restarts_schedule_with_warmup.lr_lambda
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(cycles) * progress) % 1.0))))

    return lambda_lr(lr, factor, "warmup_cosine_restarts", total)


def warmup_linear(
    lr: float, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> Schedule:
    """A linear warmup from 0 to ``lr``, then a linear decay to ``min_ratio * lr`` at ``total_steps``.

    The LR stays at ``min_ratio * lr`` after ``total_steps``.

    Args:
        lr: The peak learning rate, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps <= total_steps``.
        total_steps: Step at which the decay reaches its floor, ``>= 1``.
        min_ratio: The floor as a fraction of ``lr``, in ``[0, 1]``.

    Raises:
        ValueError: If an argument lies outside the range given above.

    Examples:
        >>> sched = warmup_linear(1.0, warmup_steps=2, total_steps=6)
        >>> [sched(i) for i in range(8)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    return _warmup_linear(lr, warmup_steps, total_steps, min_ratio, "warmup_linear")


def _warmup_linear(
    lr: float, warmup_steps: int, total_steps: int, min_ratio: float, name: str
) -> Schedule:
    lr = check_learning_rate(lr)
    warmup, total = check_warmup_total(warmup_steps, total_steps)
    f_min = check_ratio(min_ratio, "min_ratio")
    f_max = 1.0

    def factor(step: int) -> float:
        # diffusers.optimization.get_linear_schedule_with_warmup.lr_lambda
        if step < warmup:
            return f_max * float(step) / float(max(1, warmup))
        progress = float(total - step) / float(max(1, total - warmup))
        return f_min + (f_max - f_min) * max(0.0, progress)

    return lambda_lr(lr, factor, name, total)


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
    return _warmup_linear(lr, warmup_steps, total_steps, min_ratio, "linear_decay")


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
        total_steps: Step at which the decay reaches ``end_lr``.
        end_lr: The final learning rate, finite and ``>= 0``.
        power: The exponent of the decay, finite and ``> 0`` (1 is linear).

    Raises:
        ValueError: If an argument lies outside the range given above.

    Examples:
        >>> sched = polynomial(1.0, warmup_steps=0, total_steps=4, end_lr=0.0, power=2.0)
        >>> [sched(i) for i in range(6)]
        [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """
    lr_init = check_learning_rate(lr)
    lr_end = check_learning_rate(end_lr, "end_lr")
    if not lr_init > lr_end:
        raise ValueError(f"end_lr ({lr_end}) must be smaller than lr ({lr_init})")
    warmup, total = check_warmup_total(warmup_steps, total_steps)
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

    return lambda_lr(lr_init, factor, "polynomial", total)
