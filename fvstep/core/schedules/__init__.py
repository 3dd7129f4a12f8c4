"""Learning-rate schedules as pure functions of the update count, in the style of optax.

A schedule is a stateless function ``count -> lr`` (:data:`Schedule`) of the optimizer's
*updates*; the decaying ones carry their length (``schedule.total_steps``). Each equals its
``diffusers`` counterpart bit for bit (``docs/api/schedules.md``).

Examples:
    >>> warmup_cosine(1e-3, warmup_steps=100, total_steps=1000)(50)
    0.0005
"""

from fvstep.core.schedules.base import Schedule
from fvstep.core.schedules.decay import (
    cosine,
    linear_decay,
    polynomial,
    warmup_cosine,
    warmup_cosine_restarts,
    warmup_linear,
)
from fvstep.core.schedules.flat import constant, constant_with_warmup
from fvstep.core.schedules.segments import join, piecewise_constant

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
