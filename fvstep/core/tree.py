"""Pytrees of fvstep state: one optree namespace, cloning, bitwise comparison, digests.

Every fvstep state class is a frozen ``attrs`` class registered with optree in the
namespace :data:`NAMESPACE` through :mod:`optree.integrations.attrs`. optree's own
functions (``tree_flatten``, ``tree_map``, ``tree_flatten_with_path``) work on them
when given ``namespace=NAMESPACE``; the helpers here pass it for you.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import optree
import torch
from optree.integrations import attrs as optree_attrs
from typing_extensions import dataclass_transform

__all__ = [
    "NAMESPACE",
    "any_dtensor",
    "assert_trees_close",
    "assert_trees_equal",
    "clone",
    "field",
    "flatten_with_paths",
    "frozen",
    "full_tensor",
    "is_dtensor",
    "leaves",
    "local_tensor",
    "local_tensors",
    "replace",
    "tree_digest",
    "tree_map",
]

NAMESPACE = "fvstep"
"""The optree namespace in which every fvstep state class is registered."""

T = TypeVar("T")

field = optree_attrs.field


@dataclass_transform(frozen_default=True, field_specifiers=(optree_attrs.field, attrs.field))
def frozen(cls: type[T]) -> type[T]:
    """Decorate ``cls`` as a frozen attrs class registered as a pytree in :data:`NAMESPACE`.

    Examples:
        >>> @frozen
        ... class CounterState:
        ...     count: torch.Tensor
    """
    return optree_attrs.frozen(cls, namespace=NAMESPACE)


def replace(obj: T, **changes: Any) -> T:
    """A copy of the frozen state object ``obj`` with ``changes`` (``attrs.evolve``)."""
    return attrs.evolve(obj, **changes)  # type: ignore[misc]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any, none_is_leaf: bool = False) -> Any:
    """``optree.tree_map`` in fvstep's namespace (``None`` is an empty subtree by default)."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in optree's canonical order."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treespec)`` of ``tree``; the dotted paths
    (``roles.student.params.proj.weight``) are the checkpoint keys."""
    paths, flat, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [".".join(map(str, p)) for p in paths], flat, spec


def _clone_leaf(x: Any) -> Any:
    if isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(x.detach().clone(), requires_grad=x.requires_grad)
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def clone(tree: T) -> T:
    """Deep-copy every tensor leaf of ``tree``; the copy shares no storage with the original.

    Dtype, device, ``nn.Parameter``-ness (with ``requires_grad``) and DTensor placements are
    kept; non-tensor leaves are shared. A consumed ``TrainState`` cannot be cloned.

    Examples:
        >>> snapshot = clone(state)
    """
    return tree_map(_clone_leaf, tree)


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a DTensor (by an attribute every DTensor has: no ``torch.distributed``)."""
    return getattr(x, "device_mesh", None) is not None


def local_tensor(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (``to_local()``), the tensor itself otherwise."""
    return x.to_local() if is_dtensor(x) else x  # type: ignore[attr-defined]


def any_dtensor(xs: Iterable[object]) -> bool:
    """Whether any of ``xs`` is a DTensor (:func:`is_dtensor`)."""
    return any(getattr(x, "device_mesh", None) is not None for x in xs)


def local_tensors(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local_tensor` of each of ``xs``."""
    # is_dtensor's test, inline: this runs once per parameter on the hot path
    return [
        x.to_local() if getattr(x, "device_mesh", None) is not None else x  # type: ignore[attr-defined]
        for x in xs
    ]


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank of its mesh must call it),
    the tensor itself otherwise."""
    is_d = getattr(x, "device_mesh", None) is not None  # is_dtensor, inline: the hot path
    return x.full_tensor() if is_d else x  # type: ignore[attr-defined]


def _bits(x: torch.Tensor) -> torch.Tensor:  # x's bytes as integers of the same width
    x = local_tensor(x).detach()
    if x.dtype == torch.bool:
        return x.to(torch.uint8)
    if x.is_complex():
        x = torch.view_as_real(x)
    width = x.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return x.contiguous().view(as_int)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        kind = type(x).__name__
        return f"{kind}(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return repr(x)


def _leaf_mismatch(a: Any, b: Any) -> str | None:  # None: bitwise identical
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"one leaf is a tensor and the other is not: {_describe(a)} vs {_describe(b)}"
    if not isinstance(a, torch.Tensor):
        return None if a == b else f"values differ: {a!r} vs {b!r}"
    if type(a) is not type(b) and not (
        isinstance(a, torch.nn.Parameter) or isinstance(b, torch.nn.Parameter)
    ):
        return f"tensor types differ: {_describe(a)} vs {_describe(b)}"
    for attr in ("shape", "dtype", "device"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} differs: {_describe(a)} vs {_describe(b)}"
    placements = getattr(a, "placements", None), getattr(b, "placements", None)
    if placements[0] != placements[1]:
        return f"DTensor placements differ: {placements[0]} vs {placements[1]}"
    if local_tensor(a).shape != local_tensor(b).shape:
        return f"local shard shapes differ: {tuple(local_tensor(a).shape)} vs {tuple(local_tensor(b).shape)}"
    if not torch.equal(_bits(a), _bits(b)):
        num_diff = int((_bits(a) != _bits(b)).sum().item())
        diff = (local_tensor(a).detach().double() - local_tensor(b).detach().double()).abs()
        finite = diff[torch.isfinite(diff)]
        worst = finite.max().item() if finite.numel() else float("nan")
        return (
            f"{num_diff} of {local_tensor(a).numel()} elements differ bitwise "
            f"(max abs difference {worst:g}): {_describe(a)}"
        )
    return None


def _same_structure(a: Any, b: Any, check_static: bool) -> tuple[list[str], list[Any], list[Any]]:
    """The paths and both trees' leaves, after asserting that their structures agree."""
    paths_a, flat_a, spec_a = flatten_with_paths(a)
    paths_b, flat_b, spec_b = flatten_with_paths(b)
    if (spec_a != spec_b) if check_static else (paths_a != paths_b):
        only_a = sorted(set(paths_a) - set(paths_b))
        only_b = sorted(set(paths_b) - set(paths_a))
        detail = f"paths only in the first: {only_a[:5]}; only in the second: {only_b[:5]}"
        if not only_a and not only_b:
            detail = "same paths, different node types or static metadata"
        raise AssertionError(f"tree structures differ ({detail})\n  {spec_a}\n  {spec_b}")
    return paths_a, flat_a, flat_b


def assert_trees_equal(a: Any, b: Any, *, check_static: bool = True) -> None:
    """Assert that two pytrees are bitwise identical.

    Compares structure, then every leaf: tensor type, shape, dtype, device, DTensor
    placements and the raw bits (NaNs with equal bits are equal, ``-0.0 != 0.0``);
    DTensors shard by shard on each rank.

    Args:
        check_static: Whether static metadata (modules, hyper-parameters) must be equal;
            ``False`` compares the paths only (e.g. a resumed run against an uninterrupted one).

    Raises:
        AssertionError: Naming the first differing path and how the leaves differ.

    Examples:
        >>> assert_trees_equal(clone(state), state)
    """
    paths, flat_a, flat_b = _same_structure(a, b, check_static)
    for path, x, y in zip(paths, flat_a, flat_b, strict=False):
        why = _leaf_mismatch(x, y)
        if why is not None:
            raise AssertionError(f"trees differ at '{path or '<root>'}': {why}")


def assert_trees_close(
    a: Any, b: Any, *, rtol: float = 1.3e-6, atol: float = 1e-5, check_static: bool = False
) -> None:
    """Assert that two pytrees have the same paths and tensor leaves equal within tolerances
    (``torch.testing.assert_close``, NaN equal to NaN, DTensors shard by shard): for compiled
    against eager. An ``AssertionError`` names the first path that differs."""
    paths, flat_a, flat_b = _same_structure(a, b, check_static)
    for path, x, y in zip(paths, flat_a, flat_b, strict=False):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(
                    local_tensor(x), local_tensor(y), rtol=rtol, atol=atol, equal_nan=True
                )
            except AssertionError as error:
                raise AssertionError(f"trees differ at '{path or '<root>'}': {error}") from None
        elif x != y:
            raise AssertionError(f"trees differ at '{path or '<root>'}': {x!r} != {y!r}")


def tree_digest(tree: Any) -> str:
    """A stable SHA-256 hex digest of ``tree``'s paths, leaf metadata and every leaf's bytes.

    Stable across processes and runs; non-tensor leaves enter by ``repr``, static metadata
    not at all. For a DTensor it covers the local shard: a per-rank digest.

    Examples:
        >>> tree_digest(state) == tree_digest(clone(state))
        True
    """
    paths, flat, _ = flatten_with_paths(tree)
    h = hashlib.sha256()
    for path, x in zip(paths, flat, strict=False):
        h.update(path.encode())
        h.update(b"\0")
        if isinstance(x, torch.Tensor):
            local = local_tensor(x).detach()
            h.update(f"{x.dtype}|{tuple(x.shape)}|{tuple(local.shape)}".encode())
            data = _bits(local).cpu().contiguous().reshape(-1)
            h.update(struct.pack("<Q", data.numel()))
            h.update(data.numpy().tobytes())
        else:
            h.update(repr(x).encode())
        h.update(b"\1")
    return h.hexdigest()
