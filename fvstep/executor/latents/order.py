"""Shape buckets as a pure function of the step: :class:`BucketedOrder`.

See docs/concepts/data.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, SupportsIndex

import torch

from fvstep.core._checks import check_int
from fvstep.core.random import fold_in, fold_in_name, generator, is_key
from fvstep.executor.data import ShuffledSource

__all__ = ["BucketedOrder", "bucket_key"]


def bucket_key(shapes: Any) -> Hashable:
    """The bucket of an item with these ``shapes``: a hashable, sortable form of them.

    ``{field: shape}`` -> ``((field, shape), ...)`` sorted, a shape -> a tuple; else the value."""
    if isinstance(shapes, Mapping):
        return tuple(sorted((str(k), tuple(int(d) for d in v)) for k, v in shapes.items()))
    if isinstance(shapes, Sequence) and not isinstance(shapes, str):
        return tuple(int(d) for d in shapes)
    return shapes


class BucketedOrder:
    """A step-indexed order over a dataset whose items fall into shape buckets.

    Every rank of a step draws from one bucket, and :class:`~fvstep.executor.data.ShuffledSource`'s
    laws hold; with a single shape the order is ``ShuffledSource``'s. The construction:
    docs/concepts/data.md.

    Args:
        shapes: One entry per item: its shapes, or any hashable bucket label
            (:func:`bucket_key`).
        key: An fvstep key; it alone decides the order.
        drop_last: As :class:`~fvstep.executor.data.ShuffledSource`.

    Raises:
        TypeError: If ``key`` is not an fvstep key.
        ValueError: If ``shapes`` is empty or ``batch_size < 1``.

    Examples:
        >>> from fvstep import random as fr
        >>> shapes = [{"x": (2,)}, {"x": (3,)}] * 4           # two buckets of 4 items
        >>> order = BucketedOrder(shapes, key=fr.key(0), batch_size=2)
        >>> order.steps_per_epoch(), len({shapes[i]["x"] for i in order.indices(5)})
        (4, 1)
    """

    def __init__(
        self,
        shapes: Sequence[Any],
        *,
        key: torch.Tensor,
        batch_size: int,
        drop_last: bool = True,
    ) -> None:
        if not is_key(key):
            raise TypeError(f"key must be an fvstep key, got {type(key).__name__}")
        if len(shapes) == 0:
            raise ValueError("shapes is empty: a BucketedOrder needs at least one item")
        self._batch_size = check_int(batch_size, "batch_size", minimum=1)
        self._drop_last = bool(drop_last)
        self._key = key.clone()
        labels = [bucket_key(s) for s in shapes]
        self._buckets: list[Hashable] = sorted(set(labels))  # type: ignore[type-var]
        where = {b: i for i, b in enumerate(self._buckets)}
        self._members: list[list[int]] = [[] for _ in self._buckets]
        for item, label in enumerate(labels):
            self._members[where[label]].append(item)
        self._sources: dict[int, ShuffledSource] = {}
        # Per (world-free) global batch size: {epoch: (bucket of each step, its local step)}.
        self._schedules: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    @property
    def buckets(self) -> list[Hashable]:
        """The bucket labels, sorted; bucket ``b`` is ``buckets[b]``."""
        return list(self._buckets)

    @property
    def batch_size(self) -> int:
        """The per-rank batch size."""
        return self._batch_size

    def members(self, bucket: int) -> list[int]:
        """The items of bucket ``bucket`` (an index into :attr:`buckets`), in dataset order."""
        return list(self._members[bucket])

    def __len__(self) -> int:
        return sum(len(m) for m in self._members)

    def __repr__(self) -> str:
        sizes = [len(m) for m in self._members]
        return (
            f"BucketedOrder({len(self)} items in buckets of {sizes}, batch_size={self._batch_size})"
        )

    def _draws(self, g: int) -> list[int]:
        """Steps an epoch of each bucket for a global batch of ``g``."""
        if self._drop_last:
            return [len(m) // g for m in self._members]
        return [-(-len(m) // g) if len(m) >= g else 0 for m in self._members]

    def steps_per_epoch(self, world_size: int = 1) -> int:
        """Steps of one epoch: the sum over buckets of their steps.

        Raises:
            ValueError: If no bucket holds a global batch.
        """
        g = self._batch_size * check_int(world_size, "world_size", minimum=1)
        total = sum(self._draws(g))
        if total == 0:
            raise ValueError(
                f"no shape bucket holds a global batch of {g} (batch_size {self._batch_size} "
                f"x world_size {world_size}); the largest has {max(len(m) for m in self._members)} items"
            )
        return total

    def _source(self, bucket: int) -> ShuffledSource:
        src = self._sources.get(bucket)
        if src is None:
            k = self._key if len(self._buckets) == 1 else fold_in(self._key, bucket)
            src = ShuffledSource(
                list(range(len(self._members[bucket]))),
                key=k,
                batch_size=self._batch_size,
                drop_last=self._drop_last,
            )
            self._sources[bucket] = src
        return src

    def _schedule(self, g: int, epoch: int) -> tuple[list[int], list[int]]:
        cached = self._schedules.get((g, epoch))
        if cached is None:
            draws = self._draws(g)
            multiset = torch.tensor([b for b, d in enumerate(draws) for _ in range(d)])
            if len(self._buckets) > 1:
                k = fold_in(fold_in_name(self._key, "buckets"), epoch)
                multiset = multiset[torch.randperm(len(multiset), generator=generator(k))]
            buckets = multiset.tolist()
            seen = [epoch * d for d in draws]
            local = []
            for b in buckets:
                local.append(seen[b])
                seen[b] += 1
            if len(self._schedules) >= 4:
                self._schedules.pop(next(iter(self._schedules)))
            cached = self._schedules[(g, epoch)] = (buckets, local)
        return cached

    def bucket_of(self, step: SupportsIndex, *, world_size: SupportsIndex = 1) -> int:
        """The bucket (an index into :attr:`buckets`) that every rank draws from at ``step``."""
        return self._locate(step, world_size)[0]

    def _locate(self, step: SupportsIndex, world_size: SupportsIndex) -> tuple[int, int]:
        s = check_int(step, "step", minimum=0)
        w = check_int(world_size, "world_size", minimum=1)
        epoch, offset = divmod(s, self.steps_per_epoch(w))
        buckets, local = self._schedule(self._batch_size * w, epoch)
        return buckets[offset], local[offset]

    def indices(
        self, step: SupportsIndex, *, rank: SupportsIndex = 0, world_size: SupportsIndex = 1
    ) -> list[int]:
        """The dataset indices of ``rank``'s batch at ``step``: ``batch_size`` of one bucket.

        Raises:
            ValueError: If ``step < 0``, ``rank`` is out of range, or no bucket holds a
                global batch.
        """
        bucket, local = self._locate(step, world_size)
        members = self._members[bucket]
        positions = self._source(bucket).indices(local, rank=rank, world_size=world_size)
        return [members[p] for p in positions]
