"""What a step needs from the process layout: the protocols it is passed, never imports.

A call is given its layout (``parallelism=``; ``None`` is one process), which
``fvstep.parallel.Layout`` implements: the core knows nothing of ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from fvstep.core.accumulation import Accumulation
from fvstep.core.state import RoleState, TrainState

__all__ = ["CollectiveCounting", "GradSync", "Parallelism"]


class GradSync(Protocol):
    """What a unit does around its micro-batches to control gradient reduction; :meth:`release`
    runs before and after (also on error), so no unsharded FSDP2 group reaches the next unit."""

    def release(self, state: TrainState, *, after_error: bool = False) -> None:
        """Return every role's module to rest (``after_error``: discard partial reductions too)."""

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Called once before the first micro-batch of a unit."""

    def before_backward(self, index: int) -> None:
        """Called before the backward of micro-batch ``index``."""

    def end(self) -> dict[str, Any]:
        """Called after the last backward (also on error); returns debug metrics."""
        ...


class CollectiveCounting(AbstractContextManager[Any], Protocol):
    """A context manager that counts the collectives issued inside it."""

    def metrics(self) -> dict[str, int]:
        """``collectives/<kind>`` counts and ``collectives/<kind>_bytes``."""
        ...


class Parallelism(Protocol):
    """The process layout of a call, as the core sees it: configuration, never training state."""

    def check(self, state: TrainState) -> None:
        """Refuse (``ValueError``) a state this layout cannot train, before anything is consumed."""

    def grad_sync(self, state: TrainState, accumulation: Accumulation) -> GradSync | None:
        """The :class:`GradSync` of one unit run on ``state`` with ``accumulation``, or
        ``None`` when no module of ``state`` holds anything between units."""
        ...

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """This rank's data-parallel replica and the number of replicas (the ranks of one
        context-parallel group share a replica: the same noise and the same batch)."""
        ...

    def collective_counter(self) -> CollectiveCounting | None:
        """A fresh counter of the collectives a call issues, or ``None``: do not count."""
        ...

    def sum_over_ranks(self, value: torch.Tensor, like: Sequence[torch.Tensor]) -> torch.Tensor:
        """``value`` (a 0-d count) summed over the ranks that hold shards of ``like``."""
        ...
