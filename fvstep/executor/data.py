"""Data as a function of the step: a deterministic, key-seeded, rank-sharded shuffle.

:class:`ShuffledSource`'s batch is a pure function of ``(step, rank, world_size)``: no
cursor, so resuming needs only the step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol, SupportsIndex

import torch
from torch.utils.data import default_collate

from fvstep.core._checks import check_int
from fvstep.core.random import fold_in, generator, is_key

__all__ = ["MapDataset", "ShuffledSource", "SyntheticLatents"]


class MapDataset(Protocol):
    """A map-style dataset: a length and an item for each index in ``range(len(...))``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


def _check_key(k: torch.Tensor) -> torch.Tensor:
    if not is_key(k):
        raise TypeError(
            "key must be an fvstep key (a CPU int64 tensor of shape (2,), from "
            f"fvstep.core.random.key), got {type(k).__name__}"
        )
    # A private copy: the order must not change if the caller later mutates its key.
    return k.clone()


class ShuffledSource:
    """A deterministic, key-seeded shuffle over a map-style dataset, sharded by rank.

    One rank with ``batch_size=B * W`` sees what ``W`` ranks with ``B`` see (resharding); the
    order's construction: docs/concepts/checkpoints.md.

    Args:
        key: An fvstep key; it alone decides the order.
        batch_size: The per-rank batch size.
        collate: Turns a list of items into a batch (default ``default_collate``).
        drop_last: Skip the tail of each epoch that does not fill a global batch (default),
            or complete it from the next epoch's start (an item may then appear twice).

    Raises:
        TypeError: If ``dataset`` is not map-style or ``key`` is not an fvstep key.
        ValueError: If ``dataset`` is empty or ``batch_size`` is not in ``[1, len(dataset)]``.

    Examples:
        >>> from fvstep import random as fr
        >>> data = ShuffledSource(list(range(10)), key=fr.key(0), batch_size=2)
        >>> data.indices(3, rank=0, world_size=2), data.epoch_of(3, world_size=2)
        ([6, 1], 1)
    """

    def __init__(
        self,
        dataset: MapDataset,
        *,
        key: torch.Tensor,
        batch_size: int,
        collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = True,
    ) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                "dataset must be map-style (define __len__ and __getitem__), "
                f"got {type(dataset).__name__}"
            )
        if len(dataset) == 0:
            raise ValueError("dataset is empty: a ShuffledSource needs at least one item")
        self._dataset = dataset
        self._num_items = len(dataset)
        self._key = _check_key(key)
        self._batch_size = check_int(batch_size, "batch_size", minimum=1)
        if self._batch_size > self._num_items:
            raise ValueError(
                f"batch_size ({self._batch_size}) is larger than the dataset "
                f"({self._num_items} items)"
            )
        self._collate = default_collate if collate is None else collate
        self._drop_last = bool(drop_last)
        # Permutations of recently used epochs; a cache only, never part of the result.
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def dataset(self) -> MapDataset:
        """The wrapped dataset."""
        return self._dataset

    @property
    def batch_size(self) -> int:
        """The per-rank batch size."""
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        """Whether the tail of each epoch is dropped."""
        return self._drop_last

    def __repr__(self) -> str:
        return (
            f"ShuffledSource({type(self._dataset).__name__} of {self._num_items}, "
            f"batch_size={self._batch_size}, drop_last={self._drop_last})"
        )

    def _global_batch(self, world_size: SupportsIndex) -> int:
        w = check_int(world_size, "world_size", minimum=1)
        g = self._batch_size * w
        if g > self._num_items:
            raise ValueError(
                f"the global batch (batch_size {self._batch_size} x world_size {w} = {g}) "
                f"is larger than the dataset ({self._num_items} items)"
            )
        return g

    def steps_per_epoch(self, world_size: int = 1) -> int:
        """Steps per epoch: ``len(dataset) // global_batch``, or its ceiling if ``drop_last=False``.

        Raises:
            ValueError: If ``world_size < 1`` or the global batch exceeds the dataset.
        """
        g = self._global_batch(world_size)
        return self._num_items // g if self._drop_last else -(-self._num_items // g)

    def epoch_of(self, step: SupportsIndex, *, world_size: int = 1) -> int:
        """The epoch that ``step`` belongs to (with ``drop_last=False``: of its first item).

        Raises:
            ValueError: As :meth:`indices`.
        """
        s = check_int(step, "step", minimum=0)
        g = self._global_batch(world_size)
        if self._drop_last:
            return s // (self._num_items // g)
        return s * g // self._num_items

    def indices(
        self, step: SupportsIndex, *, rank: SupportsIndex = 0, world_size: SupportsIndex = 1
    ) -> list[int]:
        """The ``batch_size`` dataset indices of ``rank``'s batch at ``step``.

        Raises:
            ValueError: If ``step < 0``, ``world_size < 1`` or ``rank`` is out of range.
            ValueError: If the global batch exceeds the dataset.
        """
        s = check_int(step, "step", minimum=0)
        g = self._global_batch(world_size)
        w = g // self._batch_size
        r = check_int(rank, "rank", minimum=0)
        if r >= w:
            raise ValueError(f"rank must lie in [0, world_size) = [0, {w}), got {r}")
        if self._drop_last:
            spe = self._num_items // g
            epoch, offset = divmod(s, spe)
            start = epoch * self._num_items + offset * g + r * self._batch_size
        else:
            start = s * g + r * self._batch_size
        return self._take(start, self._batch_size)

    def _take(self, start: int, count: int) -> list[int]:
        """``count`` entries of the concatenated permutations from stream position ``start``."""
        out: list[int] = []
        epoch, offset = divmod(start, self._num_items)
        while len(out) < count:
            perm = self._permutation(epoch)
            out += perm[offset : offset + count - len(out)].tolist()
            epoch, offset = epoch + 1, 0
        return out

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            g = generator(fold_in(self._key, epoch))
            perm = torch.randperm(self._num_items, generator=g)
            if len(self._perms) >= 2:  # a step touches at most two epochs
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def batch(
        self, step: SupportsIndex, *, rank: SupportsIndex = 0, world_size: SupportsIndex = 1
    ) -> Any:
        """``rank``'s batch at ``step``: ``collate([dataset[i] for i in indices(...)])``.

        Raises:
            ValueError: As :meth:`indices`.
        """
        idx = self.indices(step, rank=rank, world_size=world_size)
        return self._collate([self._dataset[i] for i in idx])

    def __call__(self, step: SupportsIndex) -> Any:
        """The single-process batch at ``step``: ``batch(step)`` with one rank."""
        return self.batch(step)


class SyntheticLatents:
    """A map-style dataset of random video latents and text embeddings, for demos and tests.

    Item ``i`` is ``{"latents": randn(shape), "text": randn(text_shape)}`` (float32), drawn
    from ``generator(fold_in(key, i))``.

    Args:
        shape: The latent shape of one item (channels, frames, height, width).
        text_shape: The text-embedding shape of one item (tokens, features).

    Raises:
        TypeError: If ``key`` is not an fvstep key.
        ValueError: If ``num`` is negative or a shape has a negative size.

    Examples:
        >>> from fvstep import random as fr
        >>> ds = SyntheticLatents(8, key=fr.key(0))
        >>> len(ds), ds[3]["latents"].shape, ds[3]["text"].shape
        (8, torch.Size([4, 2, 4, 4]), torch.Size([3, 16]))
    """

    def __init__(
        self,
        num: int,
        *,
        key: torch.Tensor,
        shape: Sequence[int] = (4, 2, 4, 4),
        text_shape: Sequence[int] = (3, 16),
    ) -> None:
        self._num = check_int(num, "num", minimum=0)
        self._key = _check_key(key)
        self._shape = tuple(check_int(d, "shape entry", minimum=0) for d in shape)
        self._text_shape = tuple(check_int(d, "text_shape entry", minimum=0) for d in text_shape)

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = operator.index(index)
        if not -self._num <= i < self._num:
            raise IndexError(f"index {i} out of range for SyntheticLatents of {self._num}")
        g = generator(fold_in(self._key, i % self._num))
        latents = torch.randn(self._shape, generator=g)
        text = torch.randn(self._text_shape, generator=g)
        return {"latents": latents, "text": text}

    def __repr__(self) -> str:
        return f"SyntheticLatents({self._num}, shape={self._shape}, text_shape={self._text_shape})"
