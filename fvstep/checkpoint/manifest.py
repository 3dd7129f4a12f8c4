"""The manifest of a checkpoint: what was saved, by which versions, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointError",
    "Manifest",
    "read_manifest",
]

FORMAT = "fvstep-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the state."""


class NewerFormatError(CheckpointError):
    """A complete checkpoint written by a newer fvstep format than this one reads."""


@attrs.frozen
class Manifest:
    """What a checkpoint holds.

    Attributes:
        step: The state's step counter.
        world_size: Ranks that saved it.
        leaves: ``path -> {"dtype", "shape", "sharded", "per_rank"}`` (global shapes).
        checksums: ``path -> int``: global content checksums of shared leaves.
        per_rank: ``path -> [int by rank]``: checksums of values saved per rank.
        fvstep_version: The fvstep that saved it.
        torch_version: The torch that saved it.
        format_version: The layout version (a newer one is refused).
    """

    step: int
    world_size: int
    leaves: dict[str, dict[str, Any]]
    checksums: dict[str, int]
    per_rank: dict[str, list[int]]
    fvstep_version: str
    torch_version: str = torch.__version__
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> str:
        """SHA-256 of the checksums: one string that names the checkpoint's content."""
        blob = json.dumps([self.checksums, self.per_rank], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def to_json(self) -> str:
        """The manifest as JSON (with ``format`` and ``digest``)."""
        body = {"format": FORMAT, **attrs.asdict(self), "digest": self.digest}
        return json.dumps(body, indent=1, sort_keys=True)

    def write(self, directory: Path) -> None:
        """Write ``manifest.json`` into ``directory`` and fsync it."""
        path = directory / MANIFEST_NAME
        with open(path, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate the manifest of the checkpoint in ``directory``.

    Raises:
        FileNotFoundError: If ``directory`` does not exist.
        CheckpointError: If it is not an fvstep checkpoint, the manifest is damaged, or
            its format version is newer than this fvstep reads.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{str(directory)!r} is not an fvstep checkpoint (no {MANIFEST_NAME}); "
            "an interrupted save leaves no manifest, so it is never loaded"
        )
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"the manifest {str(path)!r} is damaged: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not an fvstep checkpoint manifest")
    version = body.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise NewerFormatError(
            f"the checkpoint {str(directory)!r} has format version {version}, newer than the "
            f"{FORMAT_VERSION} this fvstep reads: upgrade fvstep"
        )
    fields = {a.name for a in attrs.fields(Manifest)}
    try:
        manifest = Manifest(**{k: v for k, v in body.items() if k in fields})
    except TypeError as e:
        raise CheckpointError(f"the manifest {str(path)!r} is incomplete: {e}") from None
    if body.get("digest") != manifest.digest:
        raise CheckpointError(f"the manifest {str(path)!r} does not match its own digest")
    return manifest
