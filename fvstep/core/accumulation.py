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

    Each micro-batch's loss is divided by ``microbatches`` (``K >= 1``) so the accumulated
    gradient is the gradient of the mean loss. ``sync`` (``"no_sync"``: each trained role
    opts in with ``Role(..., allow_no_sync=True)``), ``keep_params_gathered`` and
    ``defer_all_reduce``: ``docs/concepts/sync-policies.md``.

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
