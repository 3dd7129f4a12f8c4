"""Gradient hygiene: non-finite handling and clipping by global norm.

Both are configuration objects that the update unit applies, in this order, after the
last micro-batch's backward: sanitize, then clip, then the optimizer. The norm and the
clipping are torch's own (``torch.nn.utils.get_total_norm`` and
``clip_grads_with_norm_``), so a step is bitwise equal to a loop that calls
``clip_grad_norm_``; on DTensor gradients they compute the global norm over all shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch

__all__ = [
    "SANITIZE_POLICIES",
    "ClipGradNorm",
    "Sanitize",
    "as_full",
    "clip_grad_norm",
    "nan_to_num_",
    "total_norm",
]

Sanitize = Literal["nan_to_num", "skip"] | None
SANITIZE_POLICIES: tuple[str | None, ...] = (None, "nan_to_num", "skip")


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

    def apply(self, params: Sequence[torch.Tensor], norm: torch.Tensor) -> None:
        """Scale the ``.grad`` of ``params`` in place given their global ``norm``."""
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm, foreach=self.foreach)


def clip_grad_norm(
    max_norm: float, *, norm_type: float = 2.0, foreach: bool | None = None, joint: bool = False
) -> ClipGradNorm:
    """Clip each trained role's gradients by their global norm, as ``clip_grad_norm_`` does.

    The norm is over every shard of every parameter (DTensor gradients of FSDP2 roles
    included). By default each role of a unit is clipped by its own norm; with
    ``joint=True`` the roles a unit trains together are clipped by one norm over all of
    them (metric ``<role>+<role>/grad_norm``), like one ``clip_grad_norm_`` call over the
    parameters of several modules.

    Args:
        max_norm: The maximum norm (> 0).
        norm_type: The p of the p-norm (``float("inf")`` allowed).
        foreach: torch's foreach switch (``None``: torch's default).
        joint: Clip the roles of a multi-role unit together.

    Returns:
        A :class:`ClipGradNorm` to pass as ``clip=`` to ``fvstep.compile`` or ``fvstep.update``.

    Examples:
        >>> step = fvstep.compile(method, clip=clip_grad_norm(1.0))
    """
    return ClipGradNorm(max_norm=max_norm, norm_type=norm_type, foreach=foreach, joint=joint)


def total_norm(
    grads: Sequence[torch.Tensor], *, norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The global p-norm of ``grads`` (torch's ``get_total_norm``).

    For DTensor gradients the result is a DTensor, exactly what ``clip_grad_norm_`` hands
    to ``clip_grads_with_norm_``; :func:`as_full` turns it into a plain tensor.
    """
    return torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)


def as_full(norm: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a norm that may be a (partial or replicated) DTensor."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def nan_to_num_(grads: Sequence[torch.Tensor]) -> None:
    """Replace NaN and ±inf entries of ``grads`` by 0, in place."""
    for g in grads:
        torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
