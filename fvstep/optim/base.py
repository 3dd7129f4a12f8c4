"""The optimizer protocol and the hyper-parameter checks every fvstep optimizer shares.

:class:`Optimizer` is what :class:`fvstep.state.Role` takes: static metadata with a pure
``init`` / ``update`` pair over a separate state pytree, and ``check_state``, the
structure check that ``update`` relies on (run once, not on every update).
:data:`LearningRate` is a constant or a schedule of the optimizer's update count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar, runtime_checkable

import torch

from fvstep import _compat as torch_compat
from fvstep._checks import check_learning_rate

__all__ = ["LearningRate", "Optimizer"]

LearningRate = float | Callable[[int], float]
"""A constant learning rate, or a schedule: the learning rate as a function of the
optimizer's own update count (``0`` for the first update)."""

StateT = TypeVar("StateT")


@runtime_checkable
class Optimizer(Protocol[StateT]):
    """The interface of an fvstep optimizer with state type ``StateT``.

    An optimizer is immutable static metadata (its hyper-parameters); all mutable data
    lives in the state pytree returned by :meth:`init`.
    """

    @property
    def needs_fp32_master(self) -> bool:
        """Whether updates are rounded away in bf16/fp16 params (an fp32 master copy is needed)."""
        ...

    def init(self, params: Mapping[str, torch.Tensor]) -> StateT:
        """Allocate the full optimizer state for ``params`` (every moment, eagerly)."""
        ...

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: StateT,
    ) -> StateT:
        """Apply one update in place to ``params`` and the state's tensors; return the new state."""
        ...

    def check_state(self, params: Mapping[str, torch.Tensor], state: StateT) -> None:
        """Raise unless ``state`` has the structure :meth:`init` gives ``params``.

        :meth:`update` relies on that structure without checking it again: run this
        once on a state that :meth:`init` did not just make (``TrainState.create`` and a
        checkpoint load do).
        """
        ...

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        ...


# Shared by the optimizers (private): hyper-parameters, the kernel choice, allocation.


def _new_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _as_learning_rate(lr: LearningRate) -> LearningRate:
    """A schedule as it is; a constant checked and made a ``float``."""
    return lr if callable(lr) else check_learning_rate(lr, "lr")


def _learning_rate(lr: LearningRate, count: int) -> float:
    if callable(lr):
        return check_learning_rate(
            lr(count), f"the learning-rate schedule's value at count {count}"
        )
    return lr


def _as_betas(betas: tuple[float, float]) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"betas[{i}] must be a float, got {type(beta).__name__}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} (must be in [0, 1))")
    return (betas[0], betas[1])


def _check_flag(name: str, value: object, *, optional: bool = False) -> None:
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "a bool or None" if optional else "a bool"
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}: {value!r}")


def _check_nonnegative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}: {value!r}")
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name} value: {value} (must be >= 0)")


def _check_impl_flags(foreach: bool | None, fused: bool | None) -> None:
    _check_flag("foreach", foreach, optional=True)
    _check_flag("fused", fused, optional=True)
    if foreach and fused:
        raise ValueError("`fused` and `foreach` cannot be `True` together.")


def _resolve_impl(
    params: Iterable[torch.Tensor], foreach: bool | None, fused: bool | None
) -> tuple[bool, bool]:
    """(foreach, fused) as ``torch.optim`` resolves them for ``params`` (those with grads).

    ``None`` for both means torch's default for the params' device and type
    (:func:`fvstep._compat.default_foreach`: foreach on foreach-capable devices such as
    CUDA, the single-tensor loop on CPU); fused is only used when asked for.
    """
    if foreach is None and fused is None:
        foreach = torch_compat.default_foreach(list(params))
    return bool(foreach), bool(fused)


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)
