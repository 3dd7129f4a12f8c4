"""Keyed draws: how the reference methods turn a key into noise and times (private).

Every random tensor of :mod:`fvstep.methods` is drawn from a ``torch.Generator`` made from
one key (:func:`fvstep.core.random.generator`) on the tensor's device, never from the
global RNG. One key, one draw: a caller that needs two tensors splits its key first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fvstep.core import random as fsrandom

__all__ = ["rand", "randn", "randn_like"]


def randn(
    key: torch.Tensor,
    shape: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``N(0, 1)`` samples of ``shape`` (``dtype`` ``None``: torch's default dtype) from ``key``."""
    generator = fsrandom.generator(key, device)
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype)


def randn_like(key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``N(0, 1)`` samples with the shape, dtype and device of ``like``, from ``key``."""
    return randn(key, like.shape, device=like.device, dtype=like.dtype)


def rand(
    key: torch.Tensor, shape: Sequence[int], *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``U[0, 1)`` samples of ``shape`` in torch's default dtype, from ``key``."""
    generator = fsrandom.generator(key, device)
    return torch.rand(tuple(shape), generator=generator, device=device)
