"""Learning-rate schedules as pure functions of the step count, in the style of optax.

A schedule is a plain function ``step -> lr`` (:data:`Schedule`). Factories such as
:func:`warmup_cosine` validate their hyper-parameters once and return such a function;
the returned function holds no state, so the LR at step ``n`` is the same however many
times, and in whatever order, it is asked for. This makes the LR a function of the step
counter stored in a checkpoint rather than of a scheduler object's history.

Bit-identity with diffusers and torch:
    Every schedule that has a counterpart in ``diffusers.optimization`` computes its
    multiplier with the same floating-point operations, in the same order, as the
    corresponding diffusers ``lr_lambda``, and returns ``lr * factor`` exactly as
    :class:`torch.optim.lr_scheduler.LambdaLR` does (``base_lr * lmbda(epoch)``). The
    value at step ``n`` is therefore bit-identical to ``optimizer.param_groups[0]["lr"]``
    after ``n`` calls of ``scheduler.step()`` on the scheduler built by diffusers'
    ``get_scheduler`` (or the ``get_*_schedule_with_warmup`` function) with the same
    hyper-parameters:

    ===============================  ==============================================
    fvstep                           diffusers / torch
    ===============================  ==============================================
    :func:`constant`                 ``"constant"``
    :func:`constant_with_warmup`     ``"constant_with_warmup"``
    :func:`warmup_cosine`            ``"cosine"`` (``min_ratio=0``)
    :func:`cosine`                   ``"cosine"`` with no warmup (``min_ratio=0``)
    :func:`warmup_cosine_restarts`   ``"cosine_with_restarts"``
    :func:`warmup_linear`            ``"linear"`` (``min_ratio`` is ``f_min``)
    :func:`polynomial`               ``"polynomial"`` (``end_lr`` is ``lr_end``)
    :func:`piecewise_constant`       ``"piecewise_constant"`` (absolute values)
    :func:`constant_with_warmup`     torch ``LinearLR`` closed form (``init_ratio``)
    ===============================  ==============================================

    Note that diffusers' ``get_scheduler`` does not forward ``num_cycles`` to the
    ``"cosine"`` schedule nor ``lr_end`` to the ``"polynomial"`` one; the equalities for
    other values of those arguments hold against ``get_cosine_schedule_with_warmup`` and
    ``get_polynomial_decay_schedule_with_warmup`` called directly.

Errors:
    Factories raise ``ValueError`` for out-of-range hyper-parameters (negative step
    counts or LRs, ``warmup_steps > total_steps``, ratios outside ``[0, 1]``, ...) and
    ``TypeError`` for values of the wrong kind (a float where a step count is expected).
    Schedules raise ``ValueError`` for a negative step and ``TypeError`` for a step that is
    not an integer (a Python int, NumPy integer or integer tensor of one element).

Deprecated names (they warn, and go in the next release): ``linear_warmup`` is
:func:`constant_with_warmup`, ``piecewise`` is :func:`join`.

Examples:
    >>> sched = join([constant_with_warmup(1e-3, warmup_steps=100), constant(1e-4)], [1000])
    >>> sched(50), sched(999), sched(1000)
    (0.0005, 0.001, 0.0001)
"""

from __future__ import annotations

import bisect
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import SupportsIndex

from fvstep._checks import check_int, check_learning_rate, check_real

__all__ = [
    "Schedule",
    "constant",
    "constant_with_warmup",
    "cosine",
    "join",
    "linear_decay",
    "linear_warmup",
    "piecewise",
    "piecewise_constant",
    "polynomial",
    "warmup_cosine",
    "warmup_cosine_restarts",
    "warmup_linear",
]

Schedule = Callable[[int], float]
"""A learning-rate schedule: a pure function from a step count ``>= 0`` to a learning rate."""


# --------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------


def _as_step(step: SupportsIndex) -> int:
    """Convert a step (a Python int, NumPy integer or 0-d integer tensor) to a non-negative int."""
    try:
        s = operator.index(step)
    except TypeError:
        raise TypeError(
            f"step must be an integer (int, NumPy integer or 0-d integer tensor), "
            f"got {type(step).__name__}: {step!r}"
        ) from None
    if s < 0:
        raise ValueError(f"step must be >= 0, got {s}")
    return s


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


def _warn_deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"fvstep.schedules.{old} is deprecated and goes in the next release; use "
        f"fvstep.schedules.{new}, the same schedule with the same arguments",
        DeprecationWarning,
        stacklevel=3,
    )


def _lambda_lr(lr: float, factor: Callable[[int], float], name: str) -> Schedule:
    """Wrap a multiplier ``factor(step)`` as ``torch.optim.lr_scheduler.LambdaLR`` applies it."""

    def schedule(step: SupportsIndex) -> float:
        # LambdaLR.get_lr computes `base_lr * lmbda(last_epoch)`; same operands, same order.
        return lr * factor(_as_step(step))

    schedule.__name__ = name
    schedule.__qualname__ = name
    return schedule


# --------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------


def constant(lr: float) -> Schedule:
    """A constant learning rate.

    Equal to diffusers ``get_scheduler("constant")``.

    Args:
        lr: The learning rate, finite and ``>= 0``.

    Returns:
        A schedule returning ``lr`` at every step.

    Raises:
        ValueError: If ``lr`` is negative or not finite.

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

    The multiplier is the closed form of torch's ``LinearLR(start_factor=init_ratio,
    end_factor=1.0, total_iters=warmup_steps)``:
    ``init_ratio + (1 - init_ratio) * min(warmup_steps, step) / warmup_steps``. With the
    default ``init_ratio=0`` this is, bit for bit, diffusers'
    ``get_scheduler("constant_with_warmup", num_warmup_steps=...)``: ``lr * step /
    warmup_steps`` for ``step < warmup_steps`` and ``lr`` afterwards. With
    ``init_ratio > 0`` the held value can differ from ``lr`` by one rounding, exactly as
    torch's does.

    Args:
        lr: The learning rate after warmup, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``>= 0`` (0 means the schedule is constant).
        init_ratio: The LR at step 0 as a fraction of ``lr``, in ``[0, 1]``.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``lr`` is negative or not finite, ``warmup_steps`` is negative, or
            ``init_ratio`` lies outside ``[0, 1]``.

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
    init = _check_ratio(init_ratio, "init_ratio")

    def factor(step: int) -> float:
        if warmup == 0:
            return 1.0
        # torch.optim.lr_scheduler.LinearLR._get_closed_form_lr with end_factor=1.0. For
        # init == 0 it is `0.0 + 1.0 * step / warmup`, i.e. float(step) / float(warmup)
        # until warmup and 1.0 after: diffusers' get_constant_schedule_with_warmup.
        return init + (1.0 - init) * min(warmup, step) / warmup

    return _lambda_lr(lr, factor, "constant_with_warmup")


def linear_warmup(lr: float, *, warmup_steps: int, init_ratio: float = 0.0) -> Schedule:
    """Deprecated: use :func:`constant_with_warmup` (the same schedule, same arguments).

    Warns a ``DeprecationWarning``; goes in the next release.
    """
    _warn_deprecated("linear_warmup", "constant_with_warmup")
    return constant_with_warmup(lr, warmup_steps=warmup_steps, init_ratio=init_ratio)


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
    with ``progress = (step - warmup_steps) / (total_steps - warmup_steps)``. With
    ``min_ratio=0`` the schedule equals diffusers' ``get_cosine_schedule_with_warmup``
    (``get_scheduler("cosine")``) bit for bit.

    As in diffusers, ``progress`` is not clamped at 1: past ``total_steps`` the cosine
    keeps its period, so with the default ``num_cycles=0.5`` the LR climbs back up after
    ``total_steps``. Use :func:`join` with :func:`constant` to hold the final value.

    Args:
        lr: The peak learning rate, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps <= total_steps``.
        total_steps: Step at which the decay has run ``num_cycles`` periods, ``>= 1``.
        min_ratio: The floor of the decay as a fraction of ``lr``, in ``[0, 1]``.
        num_cycles: Number of cosine periods between ``warmup_steps`` and
            ``total_steps``; the default 0.5 is a half cosine from ``lr`` down to the floor.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``lr`` is negative or not finite, a step count is negative,
            ``total_steps`` is 0, ``warmup_steps > total_steps``, ``min_ratio`` lies outside
            ``[0, 1]``, or ``num_cycles`` is not positive and finite.

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

    return _lambda_lr(lr, factor, name)


def cosine(
    lr: float, *, total_steps: int, min_ratio: float = 0.0, num_cycles: float = 0.5
) -> Schedule:
    """A cosine decay from ``lr`` towards ``min_ratio * lr`` over ``total_steps`` steps.

    This is :func:`warmup_cosine` with ``warmup_steps=0``; with ``min_ratio=0`` it equals
    diffusers' ``get_scheduler("cosine", num_warmup_steps=0, ...)`` bit for bit. As there,
    the cosine is not clamped past ``total_steps`` (see :func:`warmup_cosine`).

    Args:
        lr: The initial learning rate, finite and ``>= 0``.
        total_steps: Step at which the decay has run ``num_cycles`` periods, ``>= 1``.
        min_ratio: The floor of the decay as a fraction of ``lr``, in ``[0, 1]``.
        num_cycles: Number of cosine periods over ``total_steps``; the default 0.5 is a
            half cosine from ``lr`` down to the floor.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``lr`` is negative or not finite, ``total_steps < 1``,
            ``min_ratio`` lies outside ``[0, 1]``, or ``num_cycles`` is not positive.

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

    Equal to diffusers ``get_scheduler("cosine_with_restarts", num_cycles=...)``
    (``get_cosine_with_hard_restarts_schedule_with_warmup``) bit for bit. The LR is 0 from
    ``total_steps`` on.

    Args:
        lr: The peak learning rate, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps <= total_steps``.
        total_steps: Step at which the last cycle ends, ``>= 1``.
        num_cycles: Number of decay cycles (hard restarts), ``>= 1``.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``lr`` is negative or not finite, a step count is negative,
            ``total_steps`` is 0, ``warmup_steps > total_steps``, or ``num_cycles < 1``.

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

    return _lambda_lr(lr, factor, "warmup_cosine_restarts")


def warmup_linear(
    lr: float, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> Schedule:
    """A linear warmup from 0 to ``lr``, then a linear decay to ``min_ratio * lr`` at ``total_steps``.

    Equal to diffusers ``get_scheduler("linear")`` bit for bit; ``min_ratio`` is
    ``get_linear_schedule_with_warmup``'s ``f_min`` (with ``f_max=1``). The LR stays at
    ``min_ratio * lr`` after ``total_steps``.

    Args:
        lr: The peak learning rate, finite and ``>= 0``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps <= total_steps``.
        total_steps: Step at which the decay reaches its floor, ``>= 1``.
        min_ratio: The floor as a fraction of ``lr``, in ``[0, 1]``.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``lr`` is negative or not finite, a step count is negative,
            ``total_steps`` is 0, ``warmup_steps > total_steps``, or ``min_ratio`` lies
            outside ``[0, 1]``.

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
    warmup, total = _check_warmup_total(warmup_steps, total_steps)
    f_min = _check_ratio(min_ratio, "min_ratio")
    f_max = 1.0

    def factor(step: int) -> float:
        # diffusers.optimization.get_linear_schedule_with_warmup.lr_lambda
        if step < warmup:
            return f_max * float(step) / float(max(1, warmup))
        progress = float(total - step) / float(max(1, total - warmup))
        return f_min + (f_max - f_min) * max(0.0, progress)

    return _lambda_lr(lr, factor, name)


def linear_decay(
    lr: float, *, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0
) -> Schedule:
    """A linear decay from ``lr`` to ``min_ratio * lr`` at ``total_steps``, after an optional warmup.

    This is :func:`warmup_linear` with ``warmup_steps`` defaulting to 0.

    Args:
        lr: The initial (peak) learning rate, finite and ``>= 0``.
        total_steps: Step at which the decay reaches its floor, ``>= 1``.
        warmup_steps: Length of an optional linear warmup from 0, ``<= total_steps``.
        min_ratio: The floor as a fraction of ``lr``, in ``[0, 1]``.

    Returns:
        The schedule.

    Raises:
        ValueError: As :func:`warmup_linear`.

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
    ``end_lr`` after ``total_steps``. Equal to diffusers'
    ``get_polynomial_decay_schedule_with_warmup(lr_end=end_lr, power=power)`` bit for bit
    (including its ``lr * (decay / lr)`` round trip through a multiplier), and so to
    ``get_scheduler("polynomial", power=...)`` for the default ``end_lr=1e-7``.

    Args:
        lr: The peak learning rate, finite and ``> end_lr``.
        warmup_steps: Length of the warmup, ``0 <= warmup_steps < total_steps``.
        total_steps: Step at which the decay reaches ``end_lr``.
        end_lr: The final learning rate, finite and ``>= 0``.
        power: The exponent of the decay, finite and ``> 0`` (1 is linear).

    Returns:
        The schedule.

    Raises:
        ValueError: If ``lr <= end_lr``, ``end_lr`` is negative, a value is not finite, a
            step count is negative, ``warmup_steps >= total_steps`` (the decay needs at
            least one step), or ``power <= 0``.

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

    return _lambda_lr(lr_init, factor, "polynomial")


# --------------------------------------------------------------------------------------
# Combinators
# --------------------------------------------------------------------------------------


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run schedules one after another, like ``optax.join_schedules``.

    ``schedules[0]`` is used for steps ``< boundaries[0]``, ``schedules[i]`` for steps in
    ``[boundaries[i-1], boundaries[i])`` and the last one for steps ``>= boundaries[-1]``.
    Each schedule is called with the step counted from the start of its own segment,
    ``step - boundaries[i-1]``, and its value is returned unchanged.

    Args:
        schedules: One or more schedules.
        boundaries: ``len(schedules) - 1`` strictly increasing step counts ``>= 0``.

    Returns:
        The joined schedule.

    Raises:
        ValueError: If ``schedules`` is empty, the number of boundaries is not
            ``len(schedules) - 1``, or the boundaries are negative or not strictly
            increasing.
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
        s = _as_step(step)
        i = bisect.bisect_right(bounds, s)
        return pieces[i](s - offsets[i])

    joined.__name__ = joined.__qualname__ = "join"
    return joined


def piecewise(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Deprecated: use :func:`join` (the same combinator, same arguments).

    Warns a ``DeprecationWarning``; goes in the next release.
    """
    _warn_deprecated("piecewise", "join")
    return join(schedules, boundaries)


def piecewise_constant(values: Sequence[float], boundaries: Sequence[int]) -> Schedule:
    """A step function: ``values[i]`` for steps in ``[boundaries[i-1], boundaries[i])``.

    ``values[0]`` is used for steps ``< boundaries[0]`` and ``values[-1]`` for steps
    ``>= boundaries[-1]``. The values are learning rates, not multipliers: diffusers'
    ``"piecewise_constant"`` with ``step_rules="m0:b0,m1:b1,...,mk"`` and base ``lr`` equals
    ``piecewise_constant([lr * m0, lr * m1, ..., lr * mk], [b0, b1, ...])`` bit for bit.

    Args:
        values: ``len(boundaries) + 1`` learning rates, finite and ``>= 0``.
        boundaries: Strictly increasing step counts ``>= 0``.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``values`` is empty or has the wrong length, a value is negative or
            not finite, or the boundaries are negative or not strictly increasing.

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
        return vals[bisect.bisect_right(bounds, _as_step(step))]

    step_function.__name__ = step_function.__qualname__ = "piecewise_constant"
    return step_function
