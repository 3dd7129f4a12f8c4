"""Gradient hygiene: non-finite handling and clipping by global norm.

The norm and the clipping are torch's own (``get_total_norm``, ``clip_grads_with_norm_``),
so a step is bitwise a loop calling ``clip_grad_norm_``. The sanitize modes
(:data:`SANITIZE_MODES`) are documented on :func:`fvstep.core.steps.update`.
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = [
    "SANITIZE_MODES",
    "ClipGradNorm",
    "Sanitize",
    "clip_grad_norm",
]

Sanitize = Literal["error", "nan_to_num", "skip"] | None
SANITIZE_MODES: tuple[str | None, ...] = ("error", "skip", "nan_to_num", None)


@attrs.frozen
class ClipGradNorm:
    """Clip gradients to a maximum global norm (see :func:`clip_grad_norm`)."""

    max_norm: float
    norm_type: float = 2.0
    foreach: bool | None = None
    joint: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {self.max_norm}")


def clip_grad_norm(
    max_norm: float, *, norm_type: float = 2.0, foreach: bool | None = None, joint: bool = False
) -> ClipGradNorm:
    """Clip each trained role's gradients by their global norm, as ``clip_grad_norm_`` does.

    The norm is over every shard; ``joint=True`` clips a unit's roles by one norm over all of
    them (``docs/concepts/composition.md``).

    Args:
        max_norm: The maximum norm (> 0).
        norm_type: The p of the p-norm (``float("inf")`` allowed).
        foreach: torch's foreach switch (``None``: torch's default).

    Returns:
        The ``clip=`` of ``fvstep.compile`` or ``fvstep.update``.

    Examples:
        >>> step = fvstep.compile(method, clip=clip_grad_norm(1.0))
    """
    return ClipGradNorm(max_norm=max_norm, norm_type=norm_type, foreach=foreach, joint=joint)
