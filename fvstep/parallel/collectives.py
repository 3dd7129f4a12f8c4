"""Counting the collectives a piece of code issues: the proof that a policy did what it says."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fvstep.core._compat import TorchDispatchMode

__all__ = ["CollectiveCounter"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def _kind(op_name: str) -> str:
    """The kind of a c10d op (``allgather_into_tensor_coalesced`` is an ``all_gather``)."""
    base = op_name.split("::")[-1].strip("_").split(".")[0]
    return next((k for k in _KINDS if base.startswith((k, k.replace("_", "")))), base)


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued inside it, by kind, with their bytes.

    The bytes are those of each op's first tensor argument: the gathered output of an
    all-gather, the output shard of a reduce-scatter, the buffer of an all-reduce.

    It adds Python overhead to every op: use it for checks and debugging, not in timed runs.

    Examples:
        >>> with CollectiveCounter() as counter:
        ...     state, metrics = step(state, batch)
        >>> counter.counts
        {'all_gather': 12, 'reduce_scatter': 6}
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor decompose the op; its own collectives (a clip norm's all-reduce)
            # then come back here as plain c10d ops.
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = _kind(func.name())
            if not kind.startswith(("wait", "wrap_tensor_autograd")):
                self.counts[kind] += 1
                first = args[0] if args else None
                while isinstance(first, (list, tuple)) and first:  # a list (of lists) of tensors
                    first = first[0]
                if isinstance(first, torch.Tensor):
                    self.bytes[kind] += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))

    def metrics(self) -> dict[str, int]:
        """``collectives/<kind>`` counts and ``collectives/<kind>_bytes``."""
        out = {f"collectives/{k}": v for k, v in self.counts.items()}
        out.update({f"collectives/{k}_bytes": v for k, v in self.bytes.items()})
        return out
