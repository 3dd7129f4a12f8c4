"""The optimizer protocol: what :class:`fvstep.core.state.Role` takes.

:class:`Optimizer` is static metadata with a pure ``init`` / ``update`` pair over a separate
state pytree, and ``check_state``, the structure check that ``update`` relies on (run once,
not on every update). :data:`LearningRate` is a constant or a schedule of the optimizer's
update count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar, runtime_checkable

import torch

__all__ = ["LearningRate", "Optimizer"]

LearningRate = float | Callable[[int], float]
"""A constant learning rate, or a schedule: the learning rate as a function of the
optimizer's own update count (``0`` for the first update)."""

StateT = TypeVar("StateT")


@runtime_checkable
class Optimizer(Protocol[StateT]):
    """The interface of an fvstep optimizer with state type ``StateT``.

    An optimizer is immutable static metadata (its hyper-parameters); all mutable data
    lives in the state pytree returned by :meth:`init`, advanced in place by :meth:`update`.
    """

    @property
    def needs_fp32_master(self) -> bool:
        """Whether updates are rounded away in bf16/fp16 params (an fp32 master copy is needed)."""
        ...

    def init(self, params: Mapping[str, torch.Tensor]) -> StateT:
        """Allocate the full state for ``params``: every moment, eagerly, as torch would lazily.

        Args:
            params: The trainable params by name (moments are made with ``torch.zeros_like``,
                which keeps DTensor placements).

        Returns:
            The state: ``count = 0``, and one dict keyed by param name per moment (empty
            where this configuration keeps none).

        Raises:
            TypeError: If params is not a mapping of names to tensors.
            ValueError: If ``fused=True`` and a param is not a floating-point tensor on a
                device with fused kernels.
        """
        ...

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: StateT,
    ) -> StateT:
        """Apply one update in place to ``params`` and the state's tensors.

        Everything handed in anew is checked before any kernel runs.

        Args:
            params: The params by name, the same names as at :meth:`init`.
            grads: Gradients by name; a name that is missing or maps to ``None`` is skipped
                (as ``torch.optim`` skips a param whose ``.grad`` is ``None``).
            state: The state from :meth:`init`, the previous :meth:`update`, or one that
                passed :meth:`check_state`. Updated in place: do not reuse it.

        Returns:
            A new state holding the (in-place updated) tensors, ``count`` incremented.

        Raises:
            TypeError: If ``state`` is of another optimizer, or a grad is not a tensor.
            ValueError: If a grad or moment does not fit its param (shape, dtype, device,
                sparse), or the names of grads, params and state disagree.
        """
        ...

    def check_state(self, params: Mapping[str, torch.Tensor], state: StateT) -> None:
        """Raise unless ``state`` has the structure :meth:`init` gives ``params``.

        :meth:`update` relies on that structure without checking it again: run this once on
        a state that :meth:`init` did not just make (``TrainState.create`` and a checkpoint
        load do).

        Raises:
            TypeError: If ``state`` is of another optimizer, or params is not a mapping of
                names to tensors.
            ValueError: If a dict's names differ from the params', two names share one
                tensor, a moment does not fit its param, or a dict is filled that this
                configuration keeps empty (or the reverse).
        """
        ...

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        ...
