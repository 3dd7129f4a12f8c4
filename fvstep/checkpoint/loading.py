"""Load a whole state saved by :func:`fvstep.checkpoint.save`, verified, into a new state.

DCP reads the leaves into fresh tensors shaped like a given state (DTensors resharded,
per-rank values back to their rank); their checksums are then compared with the manifest's,
and every rank agrees on the outcome.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import optree
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fvstep.checkpoint.directories import list_complete
from fvstep.checkpoint.saving import (
    Manifest,
    exception_text,
    failure_text,
    fingerprint,
    frozen_entries,
    rank_key,
    read_manifest,
)
from fvstep.core.errors import CheckpointError, DamagedCheckpointError
from fvstep.core.state import TrainState
from fvstep.core.tree import flatten_with_paths
from fvstep.parallel.ranks import min_over_ranks, rank_and_world

__all__ = ["load"]

T = TypeVar("T")


def _roles(paths: set[str]) -> set[str]:
    return {p.split(".")[1] for p in paths if p.startswith("roles.")}


def _check_optimizer_states(like: Any, path: Path) -> None:
    """Refuse a ``like`` whose optimizer states do not fit their parameters."""
    if not isinstance(like, TrainState):
        return
    for name, rs in like.roles.items():
        optimizer = rs.role.optimizer
        if optimizer is None:
            continue
        try:
            optimizer.check_state(rs.trainable_params(), rs.opt_state)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"cannot load {str(path)!r}: the optimizer state of role {name!r} of `like` "
                f"does not fit its parameters ({e}); build `like` with TrainState.create"
            ) from None


def _few(items: list[str]) -> str:
    """The first four of ``items`` (a list's repr), then ``...`` if there are more."""
    return f"{items[:4]}{'...' if len(items) > 4 else ''}"


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == q or path.startswith(q + ".") for q in prefixes)


def _check_fits(
    manifest: Manifest,
    path: Path,
    paths: list[str],
    leaves: list[Any],
    world: int,
    reset: tuple[str, ...],
) -> None:
    saved = {p for p in manifest.leaves if not _under(p, reset)}
    mine = set(paths)
    if saved != mine:
        missing, extra = sorted(mine - saved), sorted(saved - mine)
        roles_saved, roles_mine = _roles(saved), _roles(mine)
        hint = ""
        if roles_mine - roles_saved:
            hint += f" roles added since the save: {sorted(roles_mine - roles_saved)};"
        if roles_saved - roles_mine:
            hint += f" roles removed since the save: {sorted(roles_saved - roles_mine)};"
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the state:{hint} leaves only in the state: "
            f"{_few(missing)}; only in the checkpoint: {_few(extra)} (see docs/troubleshooting.md)"
        )
    for p, x in zip(paths, leaves):
        entry = manifest.leaves[p]
        dtype = str(x.dtype).removeprefix("torch.")
        if entry["dtype"] != dtype or list(entry["shape"]) != list(x.shape):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: leaf '{p}' was saved as {entry['dtype']}"
                f"{tuple(entry['shape'])}, the state has {dtype}{tuple(x.shape)}"
            )
    per_rank = sorted(p for p in manifest.per_rank if not _under(p, reset))
    if per_rank and manifest.world_size != world:
        saved_by = manifest.world_size
        reset_hint = tuple(dict.fromkeys(".".join(p.split(".")[:2]) for p in per_rank))  # subtrees
        raise CheckpointError(
            f"checkpoint {str(path)!r}: per-rank values {_few(per_rank)} saved by {saved_by} ranks cannot be "
            f"loaded on {world}; pass reset={reset_hint!r} to start them afresh (fvstep.run: Checkpoints(reset=...))"
        )


def _check_frozen(
    manifest: Manifest, path: Path, paths: list[str], leaves: list[Any], group: Any
) -> None:
    """Collective: ``like``'s frozen parameters are those the checkpoint was saved with."""
    if not manifest.frozen:
        return
    index = {p: i for i, p in enumerate(paths)}
    missing = sorted(set(manifest.frozen) - set(index))
    if missing:
        roles = sorted({p.split(".")[1] for p in missing})
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the state: it was saved with the frozen "
            f"parameters {_few(missing)} (of roles {roles}, saved by checksum), which the state lacks"
        )
    pinned = sorted(manifest.frozen, key=index.__getitem__)
    mine, _ = frozen_entries(pinned, [leaves[index[p]] for p in pinned], group)
    for p in pinned:
        if mine.get(p) != manifest.frozen[p]:
            role = p.split(".")[1]
            name = p.split(".", 3)[3]
            here = mine.get(p, {"checksum": "differs between ranks"})
            digest = manifest.frozen_digests[role]
            saved = f"{_entry_text(manifest.frozen[p])}, the state has {_entry_text(here)}"
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved on other frozen weights of role {role!r} ({digest[:16]}...): "
                f"{name!r} was {saved}; load it into a state on the same base model (docs/troubleshooting.md)"
            )


def _entry_text(entry: dict[str, Any]) -> str:
    if "dtype" not in entry:
        return str(entry["checksum"])
    return f"{entry['dtype']}{tuple(entry['shape'])} with checksum {entry['checksum']}"


def _as_kind_of(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` as a ``Parameter`` (with ``x``'s ``requires_grad``) when ``x`` is one."""
    if isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(new, requires_grad=x.requires_grad)
    return new


def load(
    path: str | os.PathLike[str], *, like: T, group: Any = None, reset: str | Sequence[str] = ()
) -> T:
    """Load the checkpoint at ``path`` into a *new* state shaped like ``like``.

    ``like`` gives the structure, static metadata and sharding, and is not changed; loading
    on another world size reshards (``docs/concepts/checkpoints.md``). Frozen parameters
    saved by checksum (``Role(save_frozen=False)``) are not read: ``like``'s are verified.

    Args:
        path: A checkpoint directory (see :func:`fvstep.checkpoint.latest`).
        like: A state of the same structure (e.g. the freshly created initial state).
        group: The process group (default: the world).
        reset: Leaf paths (``"extra.stream"``: that leaf or every leaf under it) not read
            nor checked: the returned state has copies of ``like``'s values there.

    Returns:
        The loaded state.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        DamagedCheckpointError: If ``path`` has no valid manifest, a shard is missing or
            damaged, or the content does not match the manifest's checksums (on any rank:
            every rank raises).
        CheckpointError: If ``path`` was written by a newer format (``NewerFormatError``),
            does not fit ``like`` (roles, shapes, dtypes, per-rank values on another world
            size), or ``like``'s frozen weights saved by checksum differ from the saved ones.
        ValueError: If an entry of ``reset`` names no leaf of ``like``.

    Examples:
        >>> state = load(latest(root), like=initial_state)
    """
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        if list_complete(path):
            raise CheckpointError(
                f"{str(path)!r} is a directory of checkpoints, not a checkpoint: "
                "use fvstep.checkpoint.latest(root)"
            ) from None
        raise
    rank, world = rank_and_world(group)
    _check_optimizer_states(like, path)
    all_paths, all_leaves, spec = flatten_with_paths(like)
    reset = (reset,) if isinstance(reset, str) else tuple(reset)
    for q in reset:
        if not any(_under(p, (q,)) for p in all_paths):
            raise ValueError(f"reset={q!r} names no leaf of `like` (e.g. {all_paths[:3]})")
    if reset:
        pinned = {p: e for p, e in manifest.frozen.items() if not _under(p, reset)}
        manifest = attrs.evolve(manifest, frozen=pinned)
    _check_frozen(manifest, path, all_paths, all_leaves, group)
    keep = [i for i, p in enumerate(all_paths) if p not in manifest.frozen and not _under(p, reset)]
    paths, leaves = [all_paths[i] for i in keep], [all_leaves[i] for i in keep]
    _check_fits(manifest, path, paths, leaves, world, reset)
    fresh = [_as_kind_of(x, torch.empty_like(x.detach())) for x in leaves]
    flat = {(rank_key(p, rank) if p in manifest.per_rank else p): x for p, x in zip(paths, fresh)}
    try:
        with warnings.catch_warnings():  # no_dist on one process is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, checkpoint_id=path, process_group=group, no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        detail = (
            failure_text(e) if getattr(e, "failures", None) else f"rank {rank}: {exception_text(e)}"
        )
        raise DamagedCheckpointError(
            f"could not read checkpoint {str(path)!r} (a shard missing or damaged?): {detail}"
        ) from None
    checksums, per_rank = fingerprint(paths, fresh, group=group)
    mine = {**checksums, **{p: sums[rank] for p, sums in per_rank.items()}}
    saved = {**manifest.checksums, **{p: sums[rank] for p, sums in manifest.per_rank.items()}}
    bad = next((i for i, p in enumerate(paths) if mine.get(p) != saved[p]), len(paths))
    # A per-rank value may be damaged on one rank only: all ranks must refuse it together.
    bad = min_over_ranks([bad], group=group)[0]
    if bad < len(paths):
        raise DamagedCheckpointError(
            f"checkpoint {str(path)!r}: the content of '{paths[bad]}' does not match the "
            "manifest's checksum (the files were changed or damaged after the save)"
        )
    out = list(all_leaves)  # frozen leaves saved by checksum: the state's own, verified
    for i, x in zip(keep, fresh):
        out[i] = x
    for i, p in enumerate(all_paths):
        x = all_leaves[i]
        if _under(p, reset) and isinstance(x, torch.Tensor):
            out[i] = _as_kind_of(x, x.detach().clone())  # steps update like's tensors in place
    return optree.tree_unflatten(spec, out)  # type: ignore[return-value]
