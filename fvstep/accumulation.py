"""Gradient accumulation: how a batch becomes micro-batches, and the FSDP2 sync policy.

The policies:

- ``"every"``: reduce-scatter gradients after every micro-batch (lowest memory).
- ``"no_sync"``: reduce only after the last micro-batch; holds unsharded gradients in
  between, so each trained role must opt in (``Role(..., allow_no_sync=True)``).
- ``"deferred"``: reduce each micro-batch but wait only on the last
  (``set_is_last_backward``); bit-identical to ``"every"``.

On unsharded (single-process) modules every policy computes the same thing; the policy
only changes which collectives FSDP2 issues.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import optree
import torch

__all__ = ["SYNC_POLICIES", "Accumulation", "SyncPolicy", "split_microbatches"]

SyncPolicy = Literal["every", "no_sync", "deferred"]
SYNC_POLICIES: tuple[str, ...] = ("every", "no_sync", "deferred")


@attrs.frozen
class Accumulation:
    """How many micro-batches a step runs and how FSDP2 syncs gradients between them.

    Each micro-batch's loss is divided by ``microbatches`` so the accumulated gradient is
    the gradient of the mean loss.

    Attributes:
        microbatches: ``K >= 1``.
        sync: One of ``"every"``, ``"no_sync"``, ``"deferred"``.
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


def split_microbatches(batch: Any, num: int) -> list[Any]:
    """Split ``batch`` into ``num`` micro-batches along dim 0 of every tensor leaf.

    A ``list`` (or tuple) of exactly ``num`` items is taken as already split. Non-tensor
    leaves (ints, strings) are shared by every micro-batch.

    Args:
        batch: A pytree (dicts, tuples, lists) of tensors, or a list of ``num`` micro-batches.
        num: The number of micro-batches.

    Returns:
        A list of ``num`` pytrees of the same structure.

    Raises:
        ValueError: If a tensor's dim 0 is not divisible by ``num``, tensors disagree on
            dim 0, or a given list has the wrong length.
    """
    if isinstance(batch, (list, tuple)) and not _is_tensor_tree(batch):
        if len(batch) != num:
            raise ValueError(f"got a list of {len(batch)} micro-batches, expected {num}")
        return list(batch)
    if num == 1:
        return [batch]
    _paths, flat, spec = optree.tree_flatten_with_path(batch)
    sizes = {int(x.shape[0]) for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"batch tensors disagree on dim 0: sizes {sorted(sizes)}")
    if sizes and next(iter(sizes)) % num:
        raise ValueError(
            f"batch size {next(iter(sizes))} is not divisible by microbatches={num}; "
            "pass a list of micro-batches for uneven splits"
        )
    columns = [
        x.chunk(num, dim=0) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * num
        for x in flat
    ]
    return [optree.tree_unflatten(spec, [col[m] for col in columns]) for m in range(num)]


def _is_tensor_tree(batch: Sequence[Any]) -> bool:
    """A tuple/list whose items are tensors is one batch (e.g. ``(x, y)``), not micro-batches."""
    return len(batch) > 0 and all(isinstance(x, torch.Tensor) for x in batch)
