"""The manifest of a checkpoint: what was saved, by which versions, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from fvstep.core.errors import DamagedCheckpointError, NewerFormatError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointSkippedWarning",
    "Manifest",
    "frozen_digest",
    "read_manifest",
]

FORMAT = "fvstep-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class CheckpointSkippedWarning(UserWarning):
    """:func:`fvstep.run` skipped a damaged checkpoint and resumed from an older one."""


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
        frozen: ``path -> {"dtype", "shape", "checksum"}``: frozen parameters saved by
            checksum only, not by value (roles with ``Role(save_frozen=False)``); not
            in ``leaves``. ``load`` verifies them against the state it loads into.
    """

    step: int
    world_size: int
    leaves: dict[str, dict[str, Any]]
    checksums: dict[str, int]
    per_rank: dict[str, list[int]]
    fvstep_version: str
    torch_version: str = torch.__version__
    format_version: int = FORMAT_VERSION
    frozen: dict[str, dict[str, Any]] = attrs.Factory(dict)

    @property
    def digest(self) -> str:
        """SHA-256 of the checksums: one string that names the checkpoint's content."""
        parts: list[Any] = [self.checksums, self.per_rank]
        if self.frozen:  # absent from older manifests, whose digests must still verify
            parts.append(self.frozen)
        blob = json.dumps(parts, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def frozen_digests(self) -> dict[str, str]:
        """Role name to the digest of its frozen parameters saved by checksum only.

        The same string as :func:`frozen_digest` of those parameters' entries, keyed by
        their names within the role (``fvstep.lora.base_digest`` computes it from a
        module), so a digest names a set of weights whatever role holds them.
        """
        by_role: dict[str, dict[str, dict[str, Any]]] = {}
        for path, entry in self.frozen.items():
            _, role, _, name = path.split(".", 3)
            by_role.setdefault(role, {})[name] = entry
        return {role: frozen_digest(entries) for role, entries in by_role.items()}

    def to_json(self) -> str:
        """The manifest as JSON (with ``format`` and ``digest``).

        Returns:
            The JSON text.
        """
        body = {"format": FORMAT, **attrs.asdict(self), "digest": self.digest}
        return json.dumps(body, indent=1, sort_keys=True)

    def write(self, directory: Path) -> None:
        """Write ``manifest.json`` into ``directory`` and fsync it.

        Args:
            directory: The checkpoint's (temporary) directory.

        Raises:
            OSError: If the file cannot be written (e.g. a full disk).
        """
        path = directory / MANIFEST_NAME
        with open(path, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())


def frozen_digest(entries: dict[str, dict[str, Any]]) -> str:
    """SHA-256 of frozen weights' ``name -> {"dtype", "shape", "checksum"}`` entries.

    The checksums are those of :func:`fvstep.checkpoint.fingerprint.fingerprint` (of the
    global tensor, whatever its sharding), so the digest does not depend on the world size.

    Args:
        entries: Parameter name to its dtype (as ``"float32"``), shape and checksum.

    Returns:
        A hexadecimal SHA-256.

    Examples:
        >>> len(frozen_digest({"w": {"dtype": "float32", "shape": [2], "checksum": 7}}))
        64
    """
    rows = sorted(
        (name, e["dtype"], list(e["shape"]), int(e["checksum"])) for name, e in entries.items()
    )
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _malformed(path: Path, what: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"the manifest {str(path)!r} is malformed: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_leaf_entry(path: Path, name: str, entry: Any) -> None:
    where = f"leaves[{name!r}]"
    if not isinstance(entry, dict):
        raise _malformed(path, f"{where} is {type(entry).__name__}, not an object")
    for key, ok, kind in (
        ("dtype", lambda v: isinstance(v, str), "a string"),
        (
            "shape",
            lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v),
            "a list of sizes",
        ),
        ("sharded", lambda v: isinstance(v, bool), "true or false"),
        ("per_rank", lambda v: isinstance(v, bool), "true or false"),
    ):
        if key not in entry:
            raise _malformed(path, f"{where} has no {key!r}")
        if not ok(entry[key]):
            raise _malformed(path, f"{where}[{key!r}] is {_short(entry[key])}, not {kind}")


def _check_body(path: Path, body: dict[str, Any]) -> None:
    """Every field of a manifest body, by type and consistency; raises DamagedCheckpointError."""
    kinds: dict[str, tuple[Any, str]] = {
        "step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        "world_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        "leaves": (lambda v: isinstance(v, dict), "an object"),
        "checksums": (
            lambda v: isinstance(v, dict) and all(_is_int(c) for c in v.values()),
            "an object of integers",
        ),
        "per_rank": (
            lambda v: (
                isinstance(v, dict)
                and all(isinstance(c, list) and all(_is_int(x) for x in c) for c in v.values())
            ),
            "an object of integer lists",
        ),
        "fvstep_version": (lambda v: isinstance(v, str), "a string"),
        "torch_version": (lambda v: isinstance(v, str), "a string"),
        "digest": (lambda v: isinstance(v, str), "a string"),
    }
    for key, (ok, kind) in kinds.items():
        if key not in body:
            raise _malformed(path, f"it has no {key!r}")
        if not ok(body[key]):
            raise _malformed(path, f"{key!r} is {_short(body[key])}, not {kind}")
    for name, entry in body["leaves"].items():
        _check_leaf_entry(path, name, entry)
    leaves, checksums, per_rank = body["leaves"], body["checksums"], body["per_rank"]
    for name, entry in leaves.items():
        if (name in checksums) == (name in per_rank):
            where = "both 'checksums' and 'per_rank'" if name in checksums else "neither"
            raise _malformed(
                path, f"leaf {name!r} has a checksum in {where} (exactly one is needed)"
            )
        if entry["per_rank"] != (name in per_rank):
            raise _malformed(
                path,
                f"leaves[{name!r}]['per_rank'] is {entry['per_rank']}, but its checksum is "
                f"{'per rank' if name in per_rank else 'shared'}",
            )
    _check_frozen_entries(path, body.get("frozen", {}), leaves)
    if extra := sorted((set(checksums) | set(per_rank)) - set(leaves)):
        raise _malformed(path, f"checksums of leaves it does not list: {extra[:4]}")
    for name, sums in per_rank.items():
        if len(sums) != body["world_size"]:
            raise _malformed(
                path,
                f"per_rank[{name!r}] has {len(sums)} checksums for {body['world_size']} ranks",
            )


def _check_frozen_entries(path: Path, frozen: Any, leaves: dict[str, Any]) -> None:
    """The optional ``frozen`` field: ``roles.<role>.params.<name>`` paths to entries."""
    if not isinstance(frozen, dict):
        raise _malformed(path, f"'frozen' is {_short(frozen)}, not an object")
    for name, entry in frozen.items():
        where = f"frozen[{name!r}]"
        if not isinstance(name, str) or len(name.split(".", 3)) != 4:
            raise _malformed(path, f"{where} is not a path roles.<role>.params.<name>")
        if name in leaves:
            raise _malformed(path, f"{where} is also a saved leaf")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and all(_is_int(d) and d >= 0 for d in entry["shape"])
            and _is_int(entry.get("checksum"))
        ):
            raise _malformed(path, f"{where} is {_short(entry)}, not a dtype, shape and checksum")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate the manifest of the checkpoint in ``directory``.

    Every field is checked (type and consistency), so a malformed manifest is refused
    here with a message naming the file and what is wrong, never later with a bare
    ``KeyError`` or ``TypeError``.

    Args:
        directory: A checkpoint directory (``step_<n>``).

    Returns:
        The manifest.

    Raises:
        FileNotFoundError: If ``directory`` does not exist.
        DamagedCheckpointError: (a ``CheckpointError``) If ``directory`` has no manifest
            or the manifest is unreadable, not UTF-8, not JSON, not an fvstep manifest,
            malformed (a field missing or of the wrong type, ``format_version``
            included) or does not match its own digest.
        NewerFormatError: (a ``CheckpointError``) If its format version is newer than
            this fvstep reads.

    Examples:
        >>> read_manifest("ckpt/step_000000100").step
        100
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise DamagedCheckpointError(
            f"{str(directory)!r} is not an fvstep checkpoint (no {MANIFEST_NAME}); "
            "an interrupted save leaves no manifest, so it is never loaded"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise DamagedCheckpointError(f"the manifest {str(path)!r} is damaged: {e}") from None
    except UnicodeDecodeError as e:
        raise DamagedCheckpointError(
            f"the manifest {str(path)!r} is damaged: it is not valid UTF-8 ({e})"
        ) from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DamagedCheckpointError(
            f"the manifest {str(path)!r} is damaged: it is not valid JSON ({e})"
        ) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DamagedCheckpointError(f"{str(path)!r} is not an fvstep checkpoint manifest")
    version = body.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        what = (
            "it has no 'format_version'"
            if "format_version" not in body
            else f"'format_version' is {_short(version)}, not an integer >= 1"
        )
        raise _malformed(path, what)
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"the checkpoint {str(directory)!r} has format version {version}, newer than the "
            f"{FORMAT_VERSION} this fvstep reads: upgrade fvstep"
        )
    _check_body(path, body)
    fields = {a.name for a in attrs.fields(Manifest)}
    manifest = Manifest(**{k: v for k, v in body.items() if k in fields})
    if body["digest"] != manifest.digest:
        raise DamagedCheckpointError(f"the manifest {str(path)!r} does not match its own digest")
    return manifest
