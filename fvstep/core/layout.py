"""What a step needs from the process layout: the protocols it is passed, never imports.

A call of a step is given its layout: ``step(state, batch, parallelism=...)`` (default
:class:`SingleProcess`). The core knows these protocols and :class:`SingleProcess`, and
nothing of ``torch.distributed`` or FSDP2; ``fvstep.parallel.Layout`` is the FSDP2 (and
context-parallel) implementation.

- :class:`GradSync`: what happens around one unit's micro-batches (gradient reduction
  flags) and before and after it (modules returned to rest); ``None`` where there is
  nothing to do (plain modules).
- :class:`Parallelism`: the layout of a call: it refuses bad states before anything is
  consumed, makes a unit's :class:`GradSync`, maps this rank to its data-parallel replica
  (which keys the noise and picks the data), counts collectives when asked, and sums a
  count over ranks (so that every rank takes the same non-finite decision).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

import attrs
import torch

from fvstep._compat import world_size_of_default_group
from fvstep.accumulation import Accumulation
from fvstep.state import RoleState, TrainState
from fvstep.tree import any_dtensor

__all__ = ["CollectiveCounting", "GradSync", "Parallelism", "SingleProcess"]


class GradSync(Protocol):
    """What a unit does around its micro-batches to control gradient reduction.

    :meth:`release` keeps "no state outside the state": it is called before a unit
    touches any module and again after it (also on error), and returns every role's
    module to rest, so that nothing a unit leaves in a module (an FSDP2 group still
    unsharded after a no-grad forward, say) reaches the next unit.
    """

    def release(self, state: TrainState, *, after_error: bool = False) -> None:
        """Return every role's module of ``state`` to rest (``after_error``: a forward or
        backward raised midway; discard partial reductions too)."""

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Called once before the first micro-batch of a unit."""

    def before_backward(self, index: int) -> None:
        """Called before the backward of micro-batch ``index``."""

    def end(self) -> dict[str, Any]:
        """Called after the last backward (also on error); returns debug metrics."""
        ...


class CollectiveCounting(Protocol):
    """A context manager that counts the collectives issued inside it."""

    def __enter__(self) -> Any: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any: ...

    def metrics(self) -> dict[str, int]:
        """``collectives/<kind>`` counts and ``collectives/<kind>_bytes``."""
        ...


class Parallelism(Protocol):
    """The process layout of a call, as the core sees it.

    It holds configuration, never training state. Implementations: :class:`SingleProcess`
    and ``fvstep.parallel.Layout``.
    """

    def check(self, state: TrainState) -> None:
        """Refuse a state this layout cannot train correctly, before anything is consumed.

        Raises:
            ValueError: Naming the role and what to do.
        """

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


@attrs.frozen
class SingleProcess:
    """One process, plain (unsharded) modules: no sync, replica 0 of 1.

    :meth:`check` refuses a role whose parameters are sharded (DTensors) and a process
    that is one of several ranks: without the parallel layer's handling each rank would
    train its own copy. Pass ``parallelism=fvstep.parallel.Layout()`` there.

    Examples:
        >>> state, metrics = step(state, batch, parallelism=SingleProcess())  # the default
    """

    def check(self, state: TrainState) -> None:
        """Refuse sharded roles and a world of several ranks.

        Raises:
            ValueError: Naming the role (or the world size) and the layout to pass.
        """
        world = world_size_of_default_group()
        if world > 1:
            raise ValueError(
                f"this process is one of {world} ranks, but the step runs with the layout of "
                "one process (the default), which reduces no gradient: each rank would train "
                "its own copy. Pass the layout: step(state, batch, "
                "parallelism=fvstep.parallel.Layout()) (fvstep.run passes it by itself)"
            )
        for name, rs in state.roles.items():
            if any_dtensor(rs.params.values()):
                raise ValueError(
                    f"role {name!r} has sharded (DTensor) parameters, but the step runs with the "
                    "layout of one process, which does not return FSDP2 modules to rest between "
                    "units: pass parallelism=fvstep.parallel.Layout()"
                )

    def grad_sync(self, state: TrainState, accumulation: Accumulation) -> None:
        """``None``: plain modules hold nothing between units."""
        return None

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """``(0, 1)``: the only replica."""
        return 0, 1

    def collective_counter(self) -> None:
        """``None``: one process issues no collectives."""
        return None

    def sum_over_ranks(self, value: torch.Tensor, like: Sequence[torch.Tensor]) -> torch.Tensor:
        """``value`` itself."""
        return value
