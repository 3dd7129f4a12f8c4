"""What the core needs from the process layout: the protocols a step is given, not imports.

A step runs its units through a :class:`Parallelism`, injected when the step is built
(``fvstep.compile(..., parallelism=...)``). The core (``state``, ``update``, ``compose``,
``stepfn``, ...) knows these protocols and :class:`SingleProcess`, and nothing of
``torch.distributed`` or FSDP2; ``fvstep.parallel.FSDP2Parallelism`` is the FSDP2
implementation, and the one ``fvstep.compile`` uses unless told otherwise.

- :class:`GradSync`: what happens around one unit's micro-batches (gradient reduction
  flags) and before and after it (modules returned to rest, DESIGN point 9).
- :class:`Parallelism`: the process layout a step runs on: refuses bad layouts before
  anything is consumed, makes a unit's :class:`GradSync`, gives the data-parallel index
  that keys the noise, counts collectives, and sums a count over ranks (so that every
  rank takes the same non-finite decision).

Examples:
    >>> step = fvstep.stepfn.compile(method, parallelism=SingleProcess())
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

import attrs
import torch

from fvstep.accumulation import Accumulation
from fvstep.state import RoleState, TrainState

__all__ = [
    "CollectiveCounting",
    "GradSync",
    "NoSync",
    "NullCounter",
    "Parallelism",
    "SingleProcess",
]


class GradSync(Protocol):
    """What the step does around a unit to control gradient reduction and module state.

    The single-process implementation is :class:`NoSync`; ``fvstep.parallel``
    provides the FSDP2 one. :meth:`release` is what keeps DESIGN point 9 ("no state
    outside the state"): it is called before a unit touches any module and again after it
    (also on error), and must return every role's module to its resting state, so that
    nothing a unit leaves in a module (an FSDP2 group still unsharded after a no-grad
    forward, say) can reach the next unit.
    """

    def release(self, state: TrainState, *, after_error: bool = False) -> None:
        """Return every role's module of ``state`` to its resting state.

        ``after_error``: a forward or backward raised midway; in-flight collectives and
        partial gradient reductions are to be discarded too.
        """

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Called once before the first micro-batch of a unit."""

    def before_backward(self, index: int) -> None:
        """Called before the backward of micro-batch ``index``."""

    def end(self) -> dict[str, Any]:
        """Called after the last backward (also on error); returns debug metrics."""
        ...


class NoSync:
    """The gradient-sync policy of unsharded modules: nothing to do."""

    def release(self, state: TrainState, *, after_error: bool = False) -> None:
        """Plain modules hold no state between units."""

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Nothing to prepare."""

    def before_backward(self, index: int) -> None:
        """Nothing to switch."""

    def end(self) -> dict[str, Any]:
        """No collectives were issued."""
        return {}


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
    """The process layout a step runs on, as the core sees it.

    One object serves every call of a step; it holds configuration, never training
    state. Implementations: :class:`SingleProcess` and
    ``fvstep.parallel.FSDP2Parallelism``.
    """

    def check(self, state: TrainState) -> None:
        """Refuse a layout the step cannot train correctly, before anything is consumed.

        Raises:
            ValueError: Naming the role and what to do.
        """

    def grad_sync(self, state: TrainState, accumulation: Accumulation) -> GradSync:
        """The :class:`GradSync` of one unit run on ``state`` with ``accumulation``."""
        ...

    def data_parallel_index(self, sequence_parallel_size: int) -> int:
        """This rank's data-parallel index (ranks of one sequence-parallel group share it)."""
        ...

    def collective_counter(self) -> CollectiveCounting:
        """A fresh counter of the collectives issued inside it."""
        ...

    def sum_over_ranks(self, value: torch.Tensor, like: Sequence[torch.Tensor]) -> torch.Tensor:
        """``value`` (a 0-d count) summed over the ranks that hold shards of ``like``.

        A unit uses it to make its non-finite verdict global: every rank must raise, or
        none, whichever rank's loss is not finite.
        """
        ...


class NullCounter:
    """Counts nothing: one process issues no collectives."""

    def __enter__(self) -> NullCounter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def metrics(self) -> dict[str, int]:
        """No collectives: ``{}``."""
        return {}


@attrs.frozen
class SingleProcess:
    """One process, plain (unsharded) modules: no sync, data-parallel index 0.

    It refuses a role whose parameters are sharded (DTensors): their modules need the
    parallel layer's handling between units (``fvstep.parallel.FSDP2Parallelism``,
    the default of ``fvstep.compile``).

    Examples:
        >>> step = fvstep.stepfn.compile(method, parallelism=SingleProcess())
    """

    def check(self, state: TrainState) -> None:
        """Refuse roles with sharded (DTensor) parameters."""
        for name, rs in state.roles.items():
            if any(getattr(p, "device_mesh", None) is not None for p in rs.params.values()):
                raise ValueError(
                    f"role {name!r} has sharded (DTensor) parameters, but this step runs with "
                    "SingleProcess parallelism, which does not return FSDP2 modules to rest "
                    "between units. Build the step with fvstep.compile (FSDP2 by default) or "
                    "pass parallelism=fvstep.parallel.FSDP2Parallelism()"
                )

    def grad_sync(self, state: TrainState, accumulation: Accumulation) -> GradSync:
        """:class:`NoSync`."""
        return NoSync()

    def data_parallel_index(self, sequence_parallel_size: int) -> int:
        """0: the only replica."""
        if isinstance(sequence_parallel_size, bool) or sequence_parallel_size < 1:
            raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
        return 0

    def collective_counter(self) -> NullCounter:
        """A :class:`NullCounter`."""
        return NullCounter()

    def sum_over_ranks(self, value: torch.Tensor, like: Sequence[torch.Tensor]) -> torch.Tensor:
        """``value`` itself."""
        return value
