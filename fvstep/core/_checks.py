"""Argument checks shared by the modules that take hyper-parameters (private).

One definition of "a step count" and "a learning rate": ``TypeError`` for a value of the
wrong kind, ``ValueError`` for one out of range; every message names the argument.
"""

from __future__ import annotations

import math
import operator
from typing import SupportsFloat, SupportsIndex

__all__ = ["check_int", "check_learning_rate", "check_real"]


def check_int(value: SupportsIndex, name: str, *, minimum: int = 0) -> int:
    """``value`` as an ``int >= minimum`` (a Python int, NumPy integer or 0-d integer tensor;
    not a float, even an integral one)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__}: {value!r}"
        ) from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def check_real(value: SupportsFloat, name: str) -> float:
    """``value`` as a finite ``float`` (bools and strings are not numbers here)."""
    v = _as_float(value, name)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_learning_rate(value: SupportsFloat, name: str = "lr") -> float:
    """``value`` as a learning rate: a finite ``float >= 0``."""
    v = _as_float(value, name)
    if not math.isfinite(v):
        raise ValueError(f"Invalid learning rate: {name} must be finite, got {v}")
    if v < 0.0:
        raise ValueError(f"Invalid learning rate: {name} must be >= 0, got {v}")
    return v


def _as_float(value: SupportsFloat, name: str) -> float:
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of 2+ elements
            pass
    raise TypeError(f"{name} must be a real number, got {type(value).__name__}: {value!r}")
