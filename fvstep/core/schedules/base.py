"""What a schedule is, and the argument checks and wrapper every schedule factory shares.

:data:`Schedule` is a pure function from a step count to a learning rate. The private
helpers check steps, ratios and boundaries with the messages the package documents, and
wrap a multiplier exactly as ``torch.optim.lr_scheduler.LambdaLR`` applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import SupportsIndex

from fvstep.core._checks import check_int, check_real

__all__ = [
    "Schedule",
    "check_boundaries",
    "check_ratio",
    "check_warmup_total",
    "lambda_lr",
]

Schedule = Callable[[int], float]
"""A learning-rate schedule: a pure function from a step count ``>= 0`` to a learning rate."""


def check_ratio(value: float, name: str) -> float:
    """``value`` as a float in ``[0, 1]``, or a ``ValueError`` naming ``name``."""
    v = check_real(value, name)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {v}")
    return v


def check_warmup_total(warmup_steps: SupportsIndex, total_steps: SupportsIndex) -> tuple[int, int]:
    """The checked ``(warmup_steps, total_steps)``: integers, ``total >= 1``, warm-up no longer than the total."""
    warmup = check_int(warmup_steps, "warmup_steps")
    total = check_int(total_steps, "total_steps", minimum=1)
    if warmup > total:
        raise ValueError(f"warmup_steps ({warmup}) must not exceed total_steps ({total})")
    return warmup, total


def check_boundaries(
    boundaries: Sequence[SupportsIndex], n_pieces: int, what: str
) -> tuple[int, ...]:
    """The checked boundaries of ``n_pieces`` pieces (``what``): integers, one fewer than the pieces."""
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


def lambda_lr(
    lr: float, factor: Callable[[int], float], name: str, total_steps: int | None = None
) -> Schedule:
    """Wrap a multiplier ``factor(step)`` as ``torch.optim.lr_scheduler.LambdaLR`` applies it.

    A schedule laid out over ``total_steps`` updates carries them as ``schedule.total_steps``
    (what :func:`fvstep.run` compares with the updates a run makes)."""

    def schedule(step: SupportsIndex) -> float:
        # LambdaLR.get_lr computes `base_lr * lmbda(last_epoch)`; same operands, same order.
        return lr * factor(check_int(step, "step"))

    schedule.__name__ = name
    schedule.__qualname__ = name
    if total_steps is not None:
        schedule.__dict__["total_steps"] = total_steps
    return schedule
