"""Gradient accumulation: the number of micro-batches and the FSDP2 sync policy.

The policies change only which collectives FSDP2 issues (``docs/concepts/sync-policies.md``).
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["SYNC_POLICIES", "Accumulation", "SyncPolicy"]

SyncPolicy = Literal["every", "no_sync", "deferred"]
SYNC_POLICIES: tuple[str, ...] = ("every", "no_sync", "deferred")


@attrs.frozen
class Accumulation:
    """How many micro-batches a step runs and how FSDP2 syncs gradients between them.

    Each micro-batch's loss is divided by ``microbatches`` so the accumulated gradient is
    the gradient of the mean loss.

    Attributes:
        microbatches: ``K >= 1``.
        sync: ``"every"``, ``"deferred"`` or ``"no_sync"`` (each trained role opts in with
            ``Role(..., allow_no_sync=True)``): ``docs/concepts/sync-policies.md``.
        keep_params_gathered: Keep FSDP2 parameters unsharded between micro-batches
            (``set_reshard_after_backward(last)``): fewer all-gathers, more memory.
        defer_all_reduce: With HSDP, all-reduce across replicas only after the last
            micro-batch (``set_requires_all_reduce(last)``).

    Raises:
        ValueError: For ``K < 1`` or an unknown policy.

    Examples:
        >>> Accumulation(microbatches=4, sync="deferred")
    """

    microbatches: int = 1
    sync: SyncPolicy = "every"
    keep_params_gathered: bool = False
    defer_all_reduce: bool = False

    def __attrs_post_init__(self) -> None:
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int):
            raise TypeError(f"microbatches must be an int, got {self.microbatches!r}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.sync not in SYNC_POLICIES:
            raise ValueError(f"unknown sync policy {self.sync!r}; choose one of {SYNC_POLICIES}")
