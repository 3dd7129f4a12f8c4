"""Flat schedules: a constant learning rate, after an optional linear warmup."""

from __future__ import annotations

from fvstep.core._checks import check_int, check_learning_rate
from fvstep.core.schedules.base import Schedule, check_ratio, lambda_lr

__all__ = ["constant", "constant_with_warmup"]


def constant(lr: float) -> Schedule:
    """A constant learning rate, finite and ``>= 0``: diffusers' ``get_scheduler("constant")``.

    Raises:
        ValueError: If ``lr`` is negative or not finite.

    Examples:
        >>> constant(1e-4)(12345)
        0.0001
    """
    lr = check_learning_rate(lr)

    def factor(step: int) -> float:
        return 1.0

    return lambda_lr(lr, factor, "constant")


def constant_with_warmup(lr: float, *, warmup_steps: int, init_ratio: float = 0.0) -> Schedule:
    """A linear warmup from ``init_ratio * lr`` to ``lr`` over ``warmup_steps`` steps, then ``lr``.

    The multiplier is the closed form of torch's ``LinearLR(start_factor=init_ratio,
    end_factor=1.0, total_iters=warmup_steps)``; with the default ``init_ratio=0`` the
    schedule is diffusers' ``get_scheduler("constant_with_warmup")`` bit for bit. With
    ``init_ratio > 0`` the held value can differ from ``lr`` by one rounding, as torch's does.

    Args:
        lr: The learning rate after warmup, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``>= 0`` (0 means the schedule is constant).
        init_ratio: The LR at step 0 as a fraction of ``lr``, in ``[0, 1]``.

    Raises:
        ValueError: If an argument lies outside the range given above.

    Examples:
        >>> sched = constant_with_warmup(1.0, warmup_steps=4)
        >>> [sched(i) for i in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
        >>> sched = constant_with_warmup(1.0, warmup_steps=4, init_ratio=0.5)
        >>> [sched(i) for i in range(6)]
        [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    """
    lr = check_learning_rate(lr)
    warmup = check_int(warmup_steps, "warmup_steps")
    init = check_ratio(init_ratio, "init_ratio")

    def factor(step: int) -> float:
        if warmup == 0:
            return 1.0
        # LinearLR._get_closed_form_lr with end_factor=1.0; for init == 0 it is diffusers'
        # get_constant_schedule_with_warmup (`0.0 + 1.0 * step / warmup` is `step / warmup`).
        return init + (1.0 - init) * min(warmup, step) / warmup

    return lambda_lr(lr, factor, "constant_with_warmup")
