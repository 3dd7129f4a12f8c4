"""Frozen parameters saved by checksum only (``Role(save_frozen=False)``).

A role whose frozen base is large and never changes (a LoRA base, a DMD2 teacher) may
leave it out of its checkpoints. :func:`fvstep.checkpoint.save` then records each such
parameter's dtype, shape and checksum in the manifest (:attr:`Manifest.frozen`, with
one :func:`fvstep.checkpoint.frozen_digest` per role) instead of its values, and
:func:`fvstep.checkpoint.load` verifies the state's own tensors against them and keeps
them. These are the collective helpers of both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fvstep.checkpoint.fingerprint import fingerprint
from fvstep.checkpoint.manifest import Manifest
from fvstep.core.errors import CheckpointError

__all__ = [
    "check_frozen",
    "split_frozen",
]


def _frozen_paths(state: Any) -> set[str]:
    """The paths of the frozen parameters of roles with ``Role(save_frozen=False)``."""
    roles = getattr(state, "roles", None)
    if not isinstance(roles, dict):
        return set()
    out: set[str] = set()
    for name, rs in roles.items():
        role = getattr(rs, "role", None)
        if role is None or getattr(role, "save_frozen", True):
            continue
        trainable = set(rs.trainable_names)
        out.update(f"roles.{name}.params.{n}" for n in rs.params if n not in trainable)
    return out


def _frozen_entries(
    paths: list[str], leaves: list[torch.Tensor], group: Any
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Collective: ``path -> {dtype, shape, checksum}`` of frozen leaves, and the paths of
    those whose (plain) values differ between ranks."""
    checksums, per_rank = fingerprint(paths, leaves, group=group)
    entries = {
        p: {
            "dtype": str(x.dtype).removeprefix("torch."),
            "shape": list(x.shape),
            "checksum": checksums[p],
        }
        for p, x in zip(paths, leaves)
        if p in checksums
    }
    return entries, sorted(per_rank)


def split_frozen(
    state: Any, paths: list[str], leaves: list[torch.Tensor], final: Path, group: Any
) -> tuple[list[str], list[torch.Tensor], dict[str, dict[str, Any]]]:
    """Collective: the leaves to save by value, and the entries of those saved by checksum."""
    frozen = _frozen_paths(state)
    if not frozen:
        return paths, leaves, {}
    pinned = [i for i, p in enumerate(paths) if p in frozen]
    entries, differ = _frozen_entries(
        [paths[i] for i in pinned], [leaves[i] for i in pinned], group
    )
    if differ:
        raise CheckpointError(
            f"refusing to save checkpoint {str(final)!r}: the frozen parameter '{differ[0]}' "
            "differs between ranks, so no single digest describes it (a frozen role's "
            "weights must be the same on every rank, or sharded)"
        )
    keep = [i for i, p in enumerate(paths) if p not in frozen]
    return [paths[i] for i in keep], [leaves[i] for i in keep], entries


def check_frozen(
    manifest: Manifest, path: Path, paths: list[str], leaves: list[Any], group: Any
) -> None:
    """Collective when the checkpoint has frozen entries: ``like``'s frozen parameters
    must be those the checkpoint was saved with (dtype, shape and checksum)."""
    if not manifest.frozen:
        return
    index = {p: i for i, p in enumerate(paths)}
    missing = sorted(set(manifest.frozen) - set(index))
    if missing:
        roles = sorted({p.split(".")[1] for p in missing})
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the state: it was saved with the frozen "
            f"parameters {missing[:4]}{'...' if len(missing) > 4 else ''} (of roles {roles}, "
            "saved by checksum), which the state does not have"
        )
    pinned = sorted(manifest.frozen, key=index.__getitem__)
    mine, _ = _frozen_entries(pinned, [leaves[index[p]] for p in pinned], group)
    for p in pinned:
        if mine.get(p) != manifest.frozen[p]:
            role = p.split(".")[1]
            name = p.split(".", 3)[3]
            here = mine.get(p, {"checksum": "differs between ranks"})
            digest = manifest.frozen_digests[role]
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved on other frozen weights of role "
                f"{role!r} (base digest {digest[:16]}...): its parameter {name!r} was "
                f"{_entry_text(manifest.frozen[p])}, the state has {_entry_text(here)}. "
                "The checkpoint holds only the digest of these weights, not their values: "
                "load it into a state built on the same base model (same weights, dtype and "
                "revision) it was trained on"
            )


def _entry_text(entry: dict[str, Any]) -> str:
    if "dtype" not in entry:
        return str(entry["checksum"])
    return f"{entry['dtype']}{tuple(entry['shape'])} with checksum {entry['checksum']}"
