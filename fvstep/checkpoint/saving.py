"""Save a whole state through DCP: checksums, manifest and atomic commit, in one place.

The DCP keys are the state's optree paths, so the checkpoint layout is the state layout.
:func:`save` reads top to bottom: check the target, split off the frozen weights saved by
checksum, write the shards while the checksums are computed, refuse a non-finite state,
write the manifest, rename ``.tmp-<name>`` to its name. Every outcome is agreed between
ranks. What is written and why it can be trusted: ``docs/concepts/checkpoints.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import json
import operator
import os
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fvstep.core._compat import local_shape_and_global_offset
from fvstep.core.errors import CheckpointError, DamagedCheckpointError, NewerFormatError
from fvstep.core.tree import flatten_with_paths, is_dtensor, local_tensor
from fvstep.core.weights import roles_holding_other_weights
from fvstep.parallel.ranks import collective_device, gather_objects, rank_and_world

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "WRITER_THREADS",
    "Manifest",
    "base_digest",
    "discard",
    "exception_text",
    "failure_text",
    "fingerprint",
    "frozen_digest",
    "frozen_entries",
    "fsync",
    "leaf_checksum",
    "local_checks",
    "local_sums",
    "make_temp_dir",
    "prepare_save",
    "rank_key",
    "read_manifest",
    "refuse_nonfinite",
    "save",
    "split_frozen",
    "write_checkpoint",
]


def _installed_version() -> str:
    """fvstep's version from the installed distribution (no module imports the package face)."""
    try:
        return importlib.metadata.version("fvstep")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


_FVSTEP_VERSION = _installed_version()

#: Files each rank writes at once by default (DCP's ``thread_count``). Not more, because a
#: write that fails on one of DCP's helper threads prints its own traceback (fvstep still
#: refuses the save); ``docs/benchmarks.md`` measures several.
WRITER_THREADS = 1

# ---------------------------------------------------------------------------------------
# The manifest: what a checkpoint holds
# ---------------------------------------------------------------------------------------

_FORMAT = "fvstep-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@attrs.frozen
class Manifest:
    """What a checkpoint holds.

    Attributes:
        leaves: ``path -> {"dtype", "shape", "sharded", "per_rank"}`` (global shapes).
        checksums: ``path -> int``: global content checksums of shared leaves.
        per_rank: ``path -> [int by rank]``: checksums of values saved per rank.
        frozen: ``path -> {"dtype", "shape", "checksum"}``: frozen parameters saved by
            checksum only (``Role(save_frozen=False)``), not in ``leaves``.
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
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    @property
    def frozen_digests(self) -> dict[str, str]:
        """Role name to the :func:`frozen_digest` of its frozen parameters saved by checksum
        (keyed by their names within the role, so a digest names weights, not a role)."""
        by_role: dict[str, dict[str, dict[str, Any]]] = {}
        for path, entry in self.frozen.items():
            _, role, _, name = path.split(".", 3)
            by_role.setdefault(role, {})[name] = entry
        return {role: frozen_digest(entries) for role, entries in by_role.items()}

    def write(self, directory: Path) -> None:
        """Write ``manifest.json`` (with ``format`` and ``digest``) into ``directory``, fsynced;
        an ``OSError`` if it cannot be written."""
        body = {"format": _FORMAT, **attrs.asdict(self), "digest": self.digest}
        with open(directory / MANIFEST_NAME, "w") as f:
            f.write(json.dumps(body, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())


def frozen_digest(entries: dict[str, dict[str, Any]]) -> str:
    """SHA-256 of frozen weights' ``name -> {"dtype", "shape", "checksum"}`` entries; the
    checksums are :func:`fingerprint`'s, of the global tensors, whatever the world size."""
    rows = sorted(
        (name, e["dtype"], list(e["shape"]), int(e["checksum"])) for name, e in entries.items()
    )
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _malformed(path: Path, what: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"the manifest {str(path)!r} is malformed: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_shape(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fields(path: Path, where: str, body: dict[str, Any], kinds: dict[str, Any]) -> None:
    """Each ``key: (ok, kind)`` of ``kinds`` is present in ``body`` and ``ok``."""
    for key, (ok, kind) in kinds.items():
        if key not in body:
            raise _malformed(path, f"{where or 'it'} has no {key!r}")
        if not ok(body[key]):
            field = f"{where}[{key!r}]" if where else repr(key)
            raise _malformed(path, f"{field} is {_short(body[key])}, not {kind}")


_AT_LEAST_ONE = (lambda v: _is_int(v) and v >= 1, "an integer >= 1")
_STRING = (lambda v: isinstance(v, str), "a string")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_BODY_KINDS: dict[str, Any] = {
    "step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "world_size": _AT_LEAST_ONE,
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
    "fvstep_version": _STRING,
    "torch_version": _STRING,
    "digest": _STRING,
}
_LEAF_KINDS: dict[str, Any] = {
    "dtype": _STRING,
    "shape": (_is_shape, "a list of sizes"),
    "sharded": _BOOL,
    "per_rank": _BOOL,
}


def _check_body(path: Path, body: dict[str, Any]) -> None:
    """Every field of a manifest body, by type and consistency."""
    _check_fields(path, "", body, _BODY_KINDS)
    leaves, checksums, per_rank = body["leaves"], body["checksums"], body["per_rank"]
    for name, entry in leaves.items():
        where = f"leaves[{name!r}]"
        if not isinstance(entry, dict):
            raise _malformed(path, f"{where} is {type(entry).__name__}, not an object")
        _check_fields(path, where, entry, _LEAF_KINDS)
        if (name in checksums) == (name in per_rank):
            which = "both 'checksums' and 'per_rank'" if name in checksums else "neither"
            raise _malformed(
                path, f"leaf {name!r} has a checksum in {which} (exactly one is needed)"
            )
        if entry["per_rank"] != (name in per_rank):
            shared = "per rank" if name in per_rank else "shared"
            raise _malformed(
                path,
                f"{where}['per_rank'] is {entry['per_rank']}, but its checksum is {shared}",
            )
    frozen = body.get("frozen", {})
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
            and _is_shape(entry.get("shape"))
            and _is_int(entry.get("checksum"))
        ):
            raise _malformed(path, f"{where} is {_short(entry)}, not a dtype, shape and checksum")
    if extra := sorted((set(checksums) | set(per_rank)) - set(leaves)):
        raise _malformed(path, f"checksums of leaves it does not list: {extra[:4]}")
    for name, sums in per_rank.items():
        if len(sums) != body["world_size"]:
            raise _malformed(
                path,
                f"per_rank[{name!r}] has {len(sums)} checksums for {body['world_size']} ranks",
            )


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate (every field, by type and consistency) a checkpoint's manifest.

    Raises:
        FileNotFoundError: If ``directory`` does not exist.
        DamagedCheckpointError: If it has no manifest, or the manifest is unreadable,
            malformed or does not match its own digest.
        NewerFormatError: If its format version is newer than this fvstep reads.

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
        body = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        what = "UTF-8" if isinstance(e, UnicodeDecodeError) else "JSON"
        cause = str(e) if isinstance(e, OSError) else f"it is not valid {what} ({e})"
        raise DamagedCheckpointError(f"the manifest {str(path)!r} is damaged: {cause}") from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        raise DamagedCheckpointError(f"{str(path)!r} is not an fvstep checkpoint manifest")
    _check_fields(path, "", body, {"format_version": _AT_LEAST_ONE})
    if (version := body["format_version"]) > FORMAT_VERSION:
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


# ---------------------------------------------------------------------------------------
# Checksums of the global tensors, whatever their sharding
# ---------------------------------------------------------------------------------------
# checksum = sum over elements e of mix(bits(e) ^ K2 * global_index(e))  (mod 2**64), mix a
# multiply-xorshift (a bijection, so any changed element changes the sum; the index term makes
# swapped elements count); why it reshards: docs/concepts/checkpoints.md. A replica counts
# once; a complex leaf counts as its real view. On a CPU the mixing runs in numpy: its ufuncs
# release the GIL and run no intra-op threads, so the checksum threads scale and a forked
# child never waits on torch's intra-op threads (it checks NaN and Inf on the bits it reads).

_K1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_K2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CPU_CHUNK = 1 << 18  # elements per numpy operation: int64 buffers of 2 MiB, reused
_DEVICE_CHUNK = 1 << 26
_SEGMENT_CHUNKS = 4  # at least this many chunks per checksum thread
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_POOL_PID = 0

#: ``(mask, value)`` of the raw bits of each CPU float dtype the numpy pass checks for
#: finiteness itself: an element is NaN or infinite exactly when ``bits & mask == value``
#: (an all-ones exponent; e4m3fn has only NaN, S.1111.111; the fnuz formats only one NaN,
#: 0x80). Other float dtypes are checked by :func:`_finite`.
_NONFINITE_BITS: dict[torch.dtype, tuple[int, int]] = {
    torch.float16: (0x7C00, 0x7C00),
    torch.bfloat16: (0x7F80, 0x7F80),
    torch.float32: (0x7F800000, 0x7F800000),
    torch.float64: (0x7FF0000000000000, 0x7FF0000000000000),
    **{
        dtype: bits
        for name, bits in (
            ("float8_e5m2", (0x7C, 0x7C)),
            ("float8_e4m3fn", (0x7F, 0x7F)),
            ("float8_e5m2fnuz", (0xFF, 0x80)),
            ("float8_e4m3fnuz", (0xFF, 0x80)),
        )
        if (dtype := getattr(torch, name, None)) is not None
    },
}


def _threads() -> int:
    """How many checksum threads a large leaf may use: torch's intra-op thread count."""
    return torch.get_num_threads()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The checksum threads of this process, started on first use (again in a forked
    child, which inherits the pool object but none of its threads)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or os.getpid() != _POOL_PID:
            workers = max(1, min(8, os.cpu_count() or 1))
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, "fvstep-checksum")
            _POOL_PID = os.getpid()
        return _POOL


def _finite(part: torch.Tensor) -> torch.Tensor:
    """Whether ``part`` is finite, a 0-d bool tensor: one ``aminmax`` (which propagates NaN)."""
    if part.is_complex():
        part = torch.view_as_real(part)
    if not part.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=part.device)
    if part.element_size() == 1:
        part = part.float()
    lo, hi = torch.aminmax(part)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _segment_sum(ints: torch.Tensor, start: int, chunk: int) -> torch.Tensor:
    """The checksum of the 1-d raw bits ``ints`` on a device, the first at global ``start``."""
    device = ints.device
    chunk = min(chunk, ints.numel())
    index_k2 = torch.arange(start, start + chunk, dtype=torch.int64, device=device)
    index_k2 *= _K2  # int64 arithmetic wraps, as the formula's
    advance = int(torch.tensor(chunk) * _K2)
    bits = torch.empty(chunk, dtype=torch.int64, device=device)
    high = torch.empty(chunk, dtype=torch.int64, device=device)
    count = -(-ints.numel() // chunk)
    partial = torch.empty(count, dtype=torch.int64, device=device)
    for k in range(count):
        part = ints[k * chunk : (k + 1) * chunk]
        b, h = bits[: part.numel()], high[: part.numel()]
        torch.bitwise_xor(part, index_k2[: part.numel()], out=b)
        b *= _K1
        torch.bitwise_right_shift(b, 32, out=h)
        b ^= h
        torch.sum(b, dim=0, out=partial[k])
        index_k2 += advance
    return partial.sum()


def _segment_sum_cpu(
    ints: torch.Tensor, start: int, chunk: int, nonfinite: tuple[int, int] | None = None
) -> tuple[torch.Tensor, bool]:
    """:func:`_segment_sum` in numpy, and whether no bits match ``nonfinite`` (``None``: none)."""
    values = ints.numpy()
    chunk = min(chunk, values.size)
    index_k2 = np.arange(start, start + chunk, dtype=np.int64)
    index_k2 *= np.int64(_K2)
    advance = np.multiply(chunk, _K2, dtype=np.int64)
    bits = np.empty(chunk, dtype=np.int64)
    high = np.empty(chunk, dtype=np.int64)
    partial = np.empty(-(-values.size // chunk), dtype=np.int64)
    masked = np.empty(chunk, dtype=values.dtype) if nonfinite is not None else None
    mask, value = (values.dtype.type(v) for v in nonfinite) if nonfinite else (0, 0)
    finite = True
    for k, lo in enumerate(range(0, values.size, chunk)):
        part = values[lo : lo + chunk]
        b, h = bits[: part.size], high[: part.size]
        np.bitwise_xor(part, index_k2[: part.size], out=b)
        np.multiply(b, np.int64(_K1), out=b)
        np.right_shift(b, 32, out=h)
        np.bitwise_xor(b, h, out=b)
        partial[k] = b.sum(dtype=np.int64)
        index_k2 += advance
        if masked is not None and finite:
            m = masked[: part.size]
            np.bitwise_and(part, mask, out=m)
            # an all-ones exponent is the largest value ``bits & mask`` can take: one max
            finite = bool(m.max() < mask) if value == mask else not bool((m == value).any())
    return torch.tensor(int(partial.sum()), dtype=torch.int64), finite


def _rows_checks(
    flat: torch.Tensor, start: int, check_finite: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checksum of the contiguous 1-d ``flat`` (first global index ``start``), and whether
    it is finite; on a CPU, a large leaf is summed by the checksum threads, a segment each."""
    device = flat.device
    finite = torch.ones((), dtype=torch.bool, device=device)
    values = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
    if values.dtype == torch.bool:
        values = values.view(torch.uint8)
    ints = values.view(_INT[values.element_size()])
    start *= 2 if flat.is_complex() else 1  # complex: two parts per element, indexed as such
    nonfinite = _NONFINITE_BITS.get(values.dtype) if check_finite else None
    if check_finite and (device.type != "cpu" or nonfinite is None):
        finite = _finite(values)
    if device.type != "cpu":
        return _segment_sum(ints, start, _DEVICE_CHUNK), finite
    per_thread = _CPU_CHUNK * _SEGMENT_CHUNKS
    threads = min(_threads(), -(-ints.numel() // per_thread)) if ints.numel() > per_thread else 1
    if threads <= 1:
        pieces = [_segment_sum_cpu(ints, start, _CPU_CHUNK, nonfinite)]
    else:
        step = -(-ints.numel() // (threads * _CPU_CHUNK)) * _CPU_CHUNK
        futures = [
            _pool().submit(
                _segment_sum_cpu, ints[lo : lo + step], start + lo, _CPU_CHUNK, nonfinite
            )
            for lo in range(0, ints.numel(), step)
        ]
        pieces = [f.result() for f in futures]
    if nonfinite is not None:
        finite = torch.tensor(all(ok for _, ok in pieces))
    return torch.stack([total for total, _ in pieces]).sum(), finite


def local_checks(
    leaves: list[torch.Tensor], *, check_finite: bool = True
) -> tuple[list[torch.Tensor], list[bool]]:
    """Each leaf's local checksum contribution and whether its local values are finite.

    One pass over each leaf's memory computes both; no communication. Integer and bool
    leaves are always finite; a DTensor's replica is not counted and reported finite (the
    rank that counts it checks it). With ``check_finite=False`` every leaf is reported
    finite.

    Returns:
        ``(sums, finite)``: CPU 0-d int64 tensors, and one bool per leaf.
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    x: Any  # a tensor or a DTensor
    for x in leaves:
        sharded = is_dtensor(x)
        local = (local_tensor(x) if sharded else x).detach()
        zero = torch.zeros((), dtype=torch.int64, device=local.device)
        finite = torch.ones((), dtype=torch.bool, device=local.device)
        if sharded:
            coordinate = x.device_mesh.get_coordinate()
            if coordinate is None or any(  # a replica: the rank that counts it checks it
                c != 0 for c, p in zip(coordinate, x.placements) if not p.is_shard()
            ):
                pairs.append((zero, finite))
                continue
            shape, offset = local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
            global_shape = tuple(x.shape)
        else:
            shape, offset, global_shape = tuple(local.shape), (0,) * local.dim(), tuple(local.shape)
        if local.numel() == 0:
            pairs.append((zero, finite))
            continue
        leaf_finite = check_finite and (local.is_floating_point() or local.is_complex())
        flat = local.contiguous().reshape(-1)
        if all(o == 0 for o in offset[1:]) and tuple(shape[1:]) == tuple(global_shape[1:]):
            # A block of whole rows (FSDP2's Shard(0)): global flat index = start + local index.
            start = offset[0] * (flat.numel() // max(shape[0], 1)) if shape else 0
            pairs.append(_rows_checks(flat, start, leaf_finite))
            continue
        if leaf_finite:
            finite &= _finite(flat)
        index = zero
        stride = 1
        for dim in reversed(range(len(global_shape))):  # each element's global flat index
            axis = torch.arange(shape[dim], dtype=torch.int64, device=local.device) + offset[dim]
            view = [1] * len(global_shape)
            view[dim] = shape[dim]
            index = index + axis.view(view) * stride
            stride *= global_shape[dim]
        bits = flat.to(torch.uint8) if flat.dtype == torch.bool else flat
        bits = torch.view_as_real(bits) if bits.is_complex() else bits
        bits = bits.contiguous().view(_INT[bits.element_size()]).to(torch.int64, copy=True)
        bits ^= index.reshape(-1) * _K2
        bits *= _K1
        bits ^= bits >> 32
        pairs.append((bits.sum(), finite))
    by_device: dict[torch.device, list[int]] = {}
    for i, (v, _) in enumerate(pairs):
        by_device.setdefault(v.device, []).append(i)
    sums: list[torch.Tensor] = [torch.zeros((), dtype=torch.int64)] * len(pairs)
    finite_list = [True] * len(pairs)
    for indices in by_device.values():  # one device-to-host copy per device
        both = torch.stack(
            [torch.stack([pairs[i][0], pairs[i][1].to(torch.int64)]) for i in indices]
        ).cpu()
        for i, (v, ok) in zip(indices, both):
            sums[i] = v
            finite_list[i] = bool(ok)
    return sums, finite_list


def leaf_checksum(x: Any) -> torch.Tensor:
    """This rank's contribution to the global checksum of ``x`` (the sum over ranks), a 0-d
    int64 tensor on ``x``'s device."""
    return local_checks([x], check_finite=False)[0][0].to(x.device)


def local_sums(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's local checksum contribution, as CPU 0-d tensors (:func:`local_checks`)."""
    return local_checks(leaves, check_finite=False)[0]


def fingerprint(
    paths: list[str],
    leaves: list[torch.Tensor],
    *,
    group: Any = None,
    sums: list[torch.Tensor] | None = None,
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Collective: global checksums of every leaf, and the per-rank checksums of those that differ.

    DTensor leaves are summed across ranks (one all-reduce for all); a plain tensor's
    checksum is its own, and with several ranks a plain leaf whose checksums differ between
    ranks is a per-rank value.

    Args:
        sums: :func:`local_sums` of the leaves, if already computed.

    Returns:
        ``(checksums, per_rank)``: ``checksums[path]`` for shared leaves,
        ``per_rank[path][rank]`` for leaves that differ between ranks.
    """
    sums = list(sums) if sums is not None else local_sums(leaves)
    world = rank_and_world(group)[1]
    per_rank: dict[str, list[int]] = {}
    if world > 1:
        sharded: list[int] = []
        plain: list[int] = []
        for i, x in enumerate(leaves):
            (sharded if is_dtensor(x) else plain).append(i)
        device = collective_device(group)
        if sharded:
            total = torch.stack([sums[i] for i in sharded]).to(device)
            dist.all_reduce(total, group=group)
            for i, v in zip(sharded, total.cpu()):
                sums[i] = v
        if plain:
            mine = torch.stack([sums[i] for i in plain]).to(device)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine, group=group)
            table = torch.stack([g.cpu() for g in gathered])  # (world, num_plain)
            for column, i in enumerate(plain):
                if not bool((table[:, column] == table[0, column]).all()):
                    per_rank[paths[i]] = [int(v) for v in table[:, column]]
    checksums = {p: int(s) for p, s in zip(paths, sums) if p not in per_rank}
    return checksums, per_rank


# ---------------------------------------------------------------------------------------
# Frozen weights saved by checksum only (Role(save_frozen=False))
# ---------------------------------------------------------------------------------------


def _meta(x: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}


def frozen_entries(
    paths: list[str], leaves: list[torch.Tensor], group: Any
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Collective: ``path -> {dtype, shape, checksum}`` of frozen leaves, and the paths of
    those whose (plain) values differ between ranks."""
    checksums, per_rank = fingerprint(paths, leaves, group=group)
    entries = {
        p: {**_meta(x), "checksum": checksums[p]} for p, x in zip(paths, leaves) if p in checksums
    }
    return entries, sorted(per_rank)


def split_frozen(
    state: Any, paths: list[str], leaves: list[torch.Tensor], final: Path, group: Any
) -> tuple[list[str], list[torch.Tensor], dict[str, dict[str, Any]]]:
    """Collective: the leaves saved by value, and the entries of the frozen parameters of
    roles with ``Role(save_frozen=False)``, saved by checksum."""
    frozen: set[str] = set()
    roles = getattr(state, "roles", None)
    for name, rs in roles.items() if isinstance(roles, dict) else ():
        role = getattr(rs, "role", None)
        if role is not None and not getattr(role, "save_frozen", True):
            trainable = set(rs.trainable_names)
            frozen.update(f"roles.{name}.params.{n}" for n in rs.params if n not in trainable)
    if not frozen:
        return paths, leaves, {}
    pinned = [i for i, p in enumerate(paths) if p in frozen]
    entries, differ = frozen_entries([paths[i] for i in pinned], [leaves[i] for i in pinned], group)
    if differ:
        raise CheckpointError(
            f"refusing to save checkpoint {str(final)!r}: the frozen parameter '{differ[0]}' "
            "differs between ranks; a frozen role's weights must be equal on every rank, or sharded"
        )
    keep = [i for i, p in enumerate(paths) if p not in frozen]
    return [paths[i] for i in keep], [leaves[i] for i in keep], entries


# ---------------------------------------------------------------------------------------
# The save
# ---------------------------------------------------------------------------------------


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file, or a directory's entries (off POSIX: skipped), to disk; ``OSError`` if it
    cannot be opened or flushed."""
    path = Path(path)
    is_dir = path.is_dir()
    if is_dir and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(path: Path) -> None:
    """Delete a checkpoint directory, renamed ``.tmp-deleting-<name>`` first so that a crash
    midway never leaves a listed, broken one; an ``OSError`` if it cannot be renamed."""
    aside = path.with_name(f".tmp-deleting-{path.name}")
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(path, aside)
    fsync(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def exception_text(exc: Any) -> str:
    """One line for an exception, or a DCP failure ``(exception, traceback)``."""
    if isinstance(exc, tuple):  # DCP's failures are (exception, traceback summary)
        exc = exc[0]
    return f"{type(exc).__name__}: {exc}"


def failure_text(e: BaseException) -> str:
    """One line per failing rank: the cause, without DCP's tracebacks."""
    failures = getattr(e, "failures", None)
    if not failures:
        return exception_text(e)
    return "; ".join(f"rank {r}: {exception_text(f)}" for r, f in sorted(failures.items()))


def rank_key(path: str, rank: int) -> str:
    """The key of ``path``'s own copy on ``rank`` in a checkpoint (a per-rank leaf)."""
    return f"{path}@rank{rank}"


def make_temp_dir(final: Path, overwrite: bool, group: Any) -> Path:
    """Collective: rank 0 checks ``final`` and makes a fresh ``.tmp-<name>`` beside it."""
    tmp = final.parent / f".tmp-{final.name}"
    error: str | None = None
    if rank_and_world(group)[0] == 0:
        try:
            if final.exists() and not overwrite:
                error = f"checkpoint {str(final)!r} already exists (pass overwrite=True)"
            else:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        except OSError as e:
            error = f"could not save checkpoint {str(final)!r}: {exception_text(e)}"
    error = gather_objects(error, group=group)[0]  # rank 0's verdict, on every rank
    if error is not None:
        raise CheckpointError(error)
    return tmp


def refuse_nonfinite(
    paths: list[str], finite: list[bool], step: int, final: Path, group: Any
) -> None:
    """Collective: raise on every rank if any rank holds a non-finite leaf (the first by
    path order, then by rank, is named)."""
    bad = next((i for i, ok in enumerate(finite) if not ok), len(paths))
    leaf, rank = min((b, r) for r, b in enumerate(gather_objects(bad, group=group)))
    if leaf < len(paths):
        where = f" on rank {rank}" if rank_and_world(group)[1] > 1 else ""
        raise CheckpointError(
            f"refusing to save checkpoint {str(final)!r}: leaf '{paths[leaf]}' holds NaN or Inf"
            f"{where} at step {step}; resume from an older checkpoint, or pass allow_nonfinite=True"
        )


class _CheckedWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, raising when fewer items were written than planned (DCP
    loses a failure on a helper thread: the thread dies, its items' results are missing)."""

    def __init__(self, path: Path, thread_count: int) -> None:
        super().__init__(path, thread_count=thread_count)
        self._failures: list[BaseException] = []
        original, failures = self.fs.create_stream, self._failures

        @contextlib.contextmanager
        def create_stream(path: Any, mode: str) -> Iterator[Any]:
            try:
                with original(path, mode) as stream:
                    yield stream
            except BaseException as e:
                failures.append(e)
                raise

        # this writer's FileSystem only
        self.fs.create_stream = create_stream  # type: ignore[method-assign]

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        missing = len(plan.items) - len(written.wait())
        if missing:
            cause = self._failures[0] if self._failures else None
            text = exception_text(cause) if cause is not None else "no error was raised"
            raise OSError(f"{missing} of {len(plan.items)} items were not written ({text})")
        return written


def write_checkpoint(
    paths: list[str],
    leaves: list[torch.Tensor],
    step: int,
    final: Path,
    tmp: Path,
    overwrite: bool,
    group: Any,
    prints: tuple[dict[str, int], dict[str, list[int]]] | None = None,
    allow_nonfinite: bool = False,
    frozen: dict[str, dict[str, Any]] | None = None,
    writer_threads: int = WRITER_THREADS,
) -> None:
    """Collective: write the shards into ``tmp``, then (rank 0) the manifest, and commit; any
    failure raises a ``CheckpointError`` on every rank. ``prints``: the :func:`fingerprint` of
    leaves checked already (``None``: computed during the write)."""
    rank, world = rank_and_world(group)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            if prints is None:
                # Plain leaves of several ranks first: their checksums decide which are per rank.
                plain = [world > 1 and not is_dtensor(x) for x in leaves]
                early = [i for i, is_plain in enumerate(plain) if is_plain]
                late = [i for i, is_plain in enumerate(plain) if not is_plain]
                check = not allow_nonfinite
                pending = pool.submit(local_checks, [leaves[i] for i in late], check_finite=check)
                early_sums, early_finite = local_checks(
                    [leaves[i] for i in early], check_finite=check
                )
                per_rank: dict[str, list[int]] = {}
                if early:
                    _, per_rank = fingerprint(
                        [paths[i] for i in early],
                        [leaves[i] for i in early],
                        group=group,
                        sums=early_sums,
                    )
            else:
                per_rank = prints[1]
            flat = {
                (rank_key(p, rank) if p in per_rank else p): x.detach()
                for p, x in zip(paths, leaves)
            }
            # DCP's own writer raises a failed write; on helper threads it would lose it.
            writer = (
                FileSystemWriter(tmp)
                if writer_threads == 1
                else _CheckedWriter(tmp, writer_threads)
            )
            try:
                with warnings.catch_warnings():  # no_dist on one process is the intent
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.save(
                        flat,
                        checkpoint_id=tmp,
                        storage_writer=writer,
                        process_group=group,
                        no_dist=world == 1,
                    )
            except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
                # DCP gathers every rank's failure and raises it on all of them.
                raise CheckpointError(
                    f"could not save checkpoint {str(final)!r}: {failure_text(e)}"
                ) from None
            if prints is None:
                late_sums, late_finite = pending.result()
        if prints is None:
            parts = zip(early + late, early_sums + late_sums, early_finite + late_finite)
            by_leaf = sorted(parts, key=lambda part: part[0])  # back in leaf order
            sums = [v for _, v, _ in by_leaf]
            finite = [ok for _, _, ok in by_leaf]
            if not allow_nonfinite:
                refuse_nonfinite(paths, finite, step, final, group)
            prints = fingerprint(paths, leaves, group=group, sums=sums)
        checksums, per_rank = prints
        manifest = Manifest(
            step=step,
            world_size=world,
            leaves={
                p: {
                    "dtype": str(x.dtype).removeprefix("torch."),
                    "shape": list(x.shape),
                    "sharded": is_dtensor(x),
                    "per_rank": p in per_rank,
                }
                for p, x in zip(paths, leaves)
            },
            checksums=checksums,
            per_rank=per_rank,
            fvstep_version=_FVSTEP_VERSION,
            frozen=frozen or {},
        )
        error: CheckpointError | None = None
        if rank == 0:
            try:
                manifest.write(tmp)
                if overwrite and final.exists():
                    # Between the two renames no step_<n> exists: a crash there leaves the
                    # older checkpoints "latest", never a half-deleted one.
                    discard(final)
                if final.exists():
                    raise CheckpointError(f"checkpoint {str(final)!r} already exists")
                fsync(tmp)
                os.replace(tmp, final)  # the commit: atomic on POSIX
                fsync(final.parent)
            except CheckpointError as e:
                error = e
            except Exception as e:  # a full disk, a read-only or vanished directory
                error = CheckpointError(
                    f"could not save checkpoint {str(final)!r}: {exception_text(e)}"
                )
        error = gather_objects(error, group=group)[0]  # also: no rank returns before the commit
        if error is not None:
            raise error
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_save(
    state: Any, final: Path, writer_threads: Any, group: Any
) -> tuple[int, list[str], list[torch.Tensor], dict[str, dict[str, Any]]]:
    """Collective: check a save's arguments; ``(writer_threads, paths, leaves, frozen)``, the
    leaves saved by value and the frozen entries (:func:`split_frozen`)."""
    try:
        writer_threads = operator.index(writer_threads)
    except TypeError:
        kind = type(writer_threads).__name__
        raise TypeError(
            f"writer_threads must be an integer, got {kind}: {writer_threads!r}"
        ) from None
    if writer_threads < 1:
        raise ValueError(f"writer_threads must be >= 1, got {writer_threads}")
    swapped = roles_holding_other_weights(state)
    if swapped:  # a save would store the EMA as the live weights
        raise CheckpointError(
            f"roles {swapped} hold their EMA in their parameters here (inside "
            "fvstep.executor.validation.role_module(weights='ema')): save after the with block"
        )
    paths, leaves, _ = flatten_with_paths(state)
    return (writer_threads, *split_frozen(state, paths, leaves, final, group))


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    group: Any = None,
    allow_nonfinite: bool = False,
    writer_threads: int = WRITER_THREADS,
) -> Path:
    """Save ``state`` (a ``TrainState`` or any fvstep pytree of tensors) to ``path``, atomically.

    Every rank calls it. The commit is atomic, and a NaN or infinity in a floating-point
    leaf, on any rank, is refused (``docs/concepts/checkpoints.md``).

    Args:
        state: The state to save; it is not consumed or changed.
        path: The checkpoint directory to create (e.g. ``checkpoint_dir(root, step)``).
        overwrite: Replace an existing checkpoint at ``path``.
        group: The process group (default: the world).
        allow_nonfinite: Save a state with NaN or Inf values anyway (for inspection).
        writer_threads: Files each rank writes at once (DCP's ``thread_count``); loading
            reads any number.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: If ``path`` exists and ``overwrite`` is false; if a leaf is not
            finite and ``allow_nonfinite`` is false (naming the leaf, the rank and the
            step); if a role holds its EMA in its parameters; or if writing fails (naming
            ``path`` and the cause).
        TypeError: If ``writer_threads`` is not an integer.
        ValueError: If ``writer_threads`` is smaller than 1.

    Examples:
        >>> save(state, "ckpt/step_000000100")
    """
    final = Path(path)
    writer_threads, paths, leaves, frozen = prepare_save(state, final, writer_threads, group)
    tmp = make_temp_dir(final, overwrite, group)
    step = int(getattr(state, "step", 0))
    write_checkpoint(
        paths,
        leaves,
        step,
        final,
        tmp,
        overwrite,
        group,
        allow_nonfinite=allow_nonfinite,
        frozen=frozen,
        writer_threads=writer_threads,
    )
    return final


def base_digest(base: torch.nn.Module) -> str:
    """The digest of ``base``'s weights that checkpoints record for a frozen role.

    Equal to ``read_manifest(path).frozen_digests[role]`` for a role
    ``Role(base, save_frozen=False)`` saved at ``path``, whatever the world size. Every
    rank calls it (sharded parameters are checksummed collectively).
    """
    named = dict(base.named_parameters())
    checksums, _ = fingerprint(list(named), [p.detach() for p in named.values()])
    return frozen_digest(
        {n: {**_meta(p), "checksum": checksums.get(n, 0)} for n, p in named.items()}
    )
