"""Save and load a whole state through torch.distributed.checkpoint (DCP).

The DCP keys are the state's optree paths (``roles.student.params.blocks.0.ffn.net.0.proj.weight``),
so the checkpoint layout *is* the state layout. DTensor leaves (FSDP2 shards) are saved
as DTensors and reshard on load; plain tensors equal on every rank are saved once;
plain tensors that differ between ranks are saved under per-rank keys
(``<path>@rank<r>``) and come back to their own rank — never collapsed to rank 0's.

Every outcome is agreed between ranks: a failure on one rank (a non-finite leaf of its
shard, a full disk, a damaged shard of its own) makes every rank raise the same
``CheckpointError``, and no rank waits for a collective that another has left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fvstep.checkpoint.fingerprint import fingerprint, local_checks
from fvstep.checkpoint.layout import commit, discard, list_complete
from fvstep.checkpoint.manifest import (
    CheckpointError,
    DamagedCheckpointError,
    Manifest,
    read_manifest,
)
from fvstep.parallel.ranks import broadcast_object, min_over_ranks, rank_and_world
from fvstep.state import roles_holding_other_weights
from fvstep.tree import flatten_with_paths

__all__ = ["AsyncSaver", "load", "save"]

T = TypeVar("T")


def _installed_version() -> str:
    """fvstep's version from the installed distribution's metadata (as equinox reads its
    own): no module inside fvstep imports the package face for it."""
    try:
        return importlib.metadata.version("fvstep")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


_FVSTEP_VERSION = _installed_version()


@contextlib.contextmanager
def _quiet_single_process(world: int) -> Iterator[None]:
    """DCP warns that it runs without a process group; on one process that is the intent."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _exc_text(exc: Any) -> str:
    if isinstance(exc, tuple):  # DCP's failures are (exception, traceback summary)
        exc = exc[0]
    return f"{type(exc).__name__}: {exc}"


def _failure_text(e: BaseException) -> str:
    """One line per failing rank: the cause, without DCP's tracebacks."""
    failures = getattr(e, "failures", None)
    if not failures:
        return _exc_text(e)
    return "; ".join(f"rank {r}: {_exc_text(f)}" for r, f in sorted(failures.items()))


def _refuse_nonfinite(
    paths: list[str], finite: list[bool], step: int, final: Path, group: Any
) -> None:
    """Collective: raise on every rank if any rank holds a non-finite leaf (the first by path
    order, then by rank, is named)."""
    rank, world = rank_and_world(group)
    bad = next((i for i, ok in enumerate(finite) if not ok), len(paths))
    first = min_over_ranks([bad * world + rank], group=group)[0]
    if first < len(paths) * world:
        where = f" on rank {first % world}" if world > 1 else ""
        raise CheckpointError(
            f"refusing to save checkpoint {str(final)!r}: leaf '{paths[first // world]}' holds "
            f"NaN or Inf{where} at step {step}. A non-finite state cannot continue training; "
            "resume from an older checkpoint, or pass allow_nonfinite=True to keep it for "
            "inspection"
        )


def _temp_for(final: Path) -> Path:
    return final.parent / f".tmp-{final.name}"


def _rank_key(path: str, rank: int) -> str:
    return f"{path}@rank{rank}"


def _describe_leaf(x: torch.Tensor, per_rank: bool) -> dict[str, Any]:
    return {
        "dtype": str(x.dtype).removeprefix("torch."),
        "shape": list(x.shape),
        "sharded": hasattr(x, "to_local"),
        "per_rank": per_rank,
    }


def _make_temp_dir(final: Path, overwrite: bool, group: Any) -> Path:
    """Collective: rank 0 checks ``final`` and makes a fresh temporary directory."""
    rank, _ = rank_and_world(group)
    tmp = _temp_for(final)
    error: str | None = None
    if rank == 0:
        try:
            if final.exists() and not overwrite:
                error = f"checkpoint {str(final)!r} already exists (pass overwrite=True)"
            else:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        except OSError as e:
            error = f"could not save checkpoint {str(final)!r}: {_exc_text(e)}"
    error = broadcast_object(error, group=group)
    if error is not None:
        raise CheckpointError(error)
    return tmp


def _dcp_save(flat: dict[str, torch.Tensor], final: Path, tmp: Path, group: Any) -> None:
    world = rank_and_world(group)[1]
    try:
        with _quiet_single_process(world):
            dcp.save(flat, checkpoint_id=tmp, process_group=group, no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        # DCP gathers every rank's failure and raises it on all of them.
        raise CheckpointError(
            f"could not save checkpoint {str(final)!r}: {_failure_text(e)}"
        ) from None


def _write_shards(
    paths: list[str],
    leaves: list[torch.Tensor],
    step: int,
    final: Path,
    tmp: Path,
    group: Any,
    prints: tuple[dict[str, int], dict[str, list[int]]] | None,
    allow_nonfinite: bool,
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Collective: write the shards into ``tmp``; return the fingerprint.

    Unless ``prints`` are given (then the leaves were checked already), the checksums and
    finiteness of sharded leaves (and, on one process, of every leaf) are computed on a
    second thread while DCP writes: the file writes wait on the disk, the checksums on
    the processor. Plain leaves of several ranks are checksummed first, because whether
    a value is saved per rank depends on them. A non-finite leaf on any rank is refused
    after the write, before the commit.
    """
    rank, world = rank_and_world(group)
    if prints is not None:
        checksums, per_rank = prints
        flat = {
            (_rank_key(p, rank) if p in per_rank else p): x.detach() for p, x in zip(paths, leaves)
        }
        _dcp_save(flat, final, tmp, group)
        return checksums, per_rank
    check = not allow_nonfinite
    early = [i for i, x in enumerate(leaves) if world > 1 and not hasattr(x, "to_local")]
    early_set = set(early)
    late = [i for i in range(len(leaves)) if i not in early_set]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(local_checks, [leaves[i] for i in late], check_finite=check)
        early_sums, early_finite = local_checks([leaves[i] for i in early], check_finite=check)
        _, per_rank = fingerprint(
            [paths[i] for i in early], [leaves[i] for i in early], group=group, sums=early_sums
        )
        flat = {
            (_rank_key(p, rank) if p in per_rank else p): x.detach() for p, x in zip(paths, leaves)
        }
        _dcp_save(flat, final, tmp, group)
        late_sums, late_finite = pending.result()
    sums: list[torch.Tensor] = [torch.zeros((), dtype=torch.int64)] * len(leaves)
    finite = [True] * len(leaves)
    for indices, part_sums, part_finite in (
        (early, early_sums, early_finite),
        (late, late_sums, late_finite),
    ):
        for i, v, ok in zip(indices, part_sums, part_finite):
            sums[i], finite[i] = v, ok
    if check:
        _refuse_nonfinite(paths, finite, step, final, group)
    return fingerprint(paths, leaves, group=group, sums=sums)


def _write(
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
) -> None:
    """Collective: write the shards, (rank 0) commit, and agree on the outcome.

    On any failure every rank raises a ``CheckpointError`` naming ``final`` and the cause,
    and rank 0 removes ``tmp``. When it returns, on any rank, the checkpoint is committed.
    """
    rank, world = rank_and_world(group)
    try:
        checksums, per_rank = _write_shards(
            paths, leaves, step, final, tmp, group, prints, allow_nonfinite
        )
        manifest = Manifest(
            step=step,
            world_size=world,
            leaves={p: _describe_leaf(x, p in per_rank) for p, x in zip(paths, leaves)},
            checksums=checksums,
            per_rank=per_rank,
            fvstep_version=_FVSTEP_VERSION,
            frozen=frozen or {},
        )
        error: CheckpointError | None = None
        if rank == 0:
            try:
                _publish(final, tmp, manifest, overwrite)
            except CheckpointError as e:
                error = e
            except Exception as e:  # a full disk, a read-only or vanished directory
                error = CheckpointError(f"could not save checkpoint {str(final)!r}: {_exc_text(e)}")
        error = broadcast_object(error, group=group)  # also: no rank returns before the commit
        if error is not None:
            raise error
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(final: Path, tmp: Path, manifest: Manifest, overwrite: bool) -> None:
    manifest.write(tmp)
    if overwrite and final.exists():
        # Between these two renames no step_<n> exists; a crash there leaves the older
        # checkpoints as "latest", never a half-deleted one.
        discard(final)
    commit(tmp, final)


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    group: Any = None,
    allow_nonfinite: bool = False,
) -> Path:
    """Save ``state`` (a ``TrainState`` or any fvstep pytree of tensors) to ``path``, atomically.

    Every rank calls it. Shards are written into ``.tmp-<name>`` beside ``path``; rank 0
    then writes the manifest (versions, world size, structure, checksums) and renames the
    directory to ``path``. A crash before the rename leaves no checkpoint at ``path``; a
    failure (a full disk, a read-only directory, a non-finite leaf) raises on every rank
    and removes the ``.tmp-<name>`` directory.

    A state with a NaN or infinite value in a floating-point leaf (parameters, optimizer
    moments, EMA, ``extra``), on any rank, is refused: resuming from it could only
    continue a diverged run. The check rides on the checksum pass (one ``aminmax`` per
    chunk while it is in cache: a few percent of the checksums' time).

    Args:
        state: The state to save; it is not consumed or changed.
        path: The checkpoint directory to create (e.g. ``layout.checkpoint_dir(root, step)``).
        overwrite: Replace an existing checkpoint at ``path``.
        group: The process group (default: the world).
        allow_nonfinite: Save a state with NaN or Inf values anyway (for inspection).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: If ``path`` exists and ``overwrite`` is false; if a leaf is
            not finite (naming the first such leaf, the rank and the step) and
            ``allow_nonfinite`` is false; or if writing fails (naming ``path`` and the
            cause, e.g. ``No space left on device``).

    Examples:
        >>> save(state, "ckpt/step_000000100")
    """
    swapped = roles_holding_other_weights(state)
    if swapped:
        raise CheckpointError(
            f"roles {swapped} hold their EMA in their parameters here (inside "
            "fvstep.validation.role_module(weights='ema')): a checkpoint would save it as "
            "the live parameters; save after the with block"
        )
    final = Path(path)
    tmp = _make_temp_dir(final, overwrite, group)
    paths, leaves, _ = flatten_with_paths(state)
    step = int(getattr(state, "step", 0))
    try:
        paths, leaves, frozen = _split_frozen(state, paths, leaves, final, group)
    except Exception:
        if rank_and_world(group)[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write(
        paths,
        leaves,
        step,
        final,
        tmp,
        overwrite,
        group,
        allow_nonfinite=allow_nonfinite,
        frozen=frozen,
    )
    return final


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


def _split_frozen(
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


def _roles(paths: set[str]) -> set[str]:
    return {p.split(".")[1] for p in paths if p.startswith("roles.")}


def _check_fits(
    manifest: Manifest, path: Path, paths: list[str], leaves: list[Any], world: int
) -> None:
    saved = set(manifest.leaves)
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
            f"{missing[:4]}{'...' if len(missing) > 4 else ''}; only in the checkpoint: "
            f"{extra[:4]}{'...' if len(extra) > 4 else ''}"
        )
    for p, x in zip(paths, leaves):
        entry = manifest.leaves[p]
        dtype = str(x.dtype).removeprefix("torch.")
        if entry["dtype"] != dtype or list(entry["shape"]) != list(x.shape):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: leaf '{p}' was saved as {entry['dtype']}"
                f"{tuple(entry['shape'])}, the state has {dtype}{tuple(x.shape)}"
            )
    if manifest.per_rank and manifest.world_size != world:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds per-rank values ({sorted(manifest.per_rank)[:3]}) "
            f"saved by {manifest.world_size} ranks; they cannot be loaded on {world}"
        )


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    new = torch.empty_like(x.detach())
    if isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(new, requires_grad=x.requires_grad)
    return new


def load(path: str | os.PathLike[str], *, like: T, group: Any = None) -> T:
    """Load the checkpoint at ``path`` into a *new* state shaped like ``like``.

    ``like`` gives the structure, static metadata (modules, optimizers) and sharding; it
    is not changed. The loaded leaves are fresh tensors: if anything fails — a missing
    or truncated shard, a checksum mismatch — no state is returned and ``like`` and the
    files are untouched. The returned state computes with the loaded values from its
    first step on (``fvstep.state.adopt``). Loading on another world size reshards.

    Frozen parameters that the checkpoint holds by checksum only (roles with
    ``Role(save_frozen=False)``, :attr:`Manifest.frozen`) are not read: ``like``'s own
    tensors are verified against those checksums and kept in the returned state.

    Args:
        path: A checkpoint directory (see :func:`fvstep.checkpoint.latest`).
        like: A state of the same structure (e.g. the freshly created initial state).
        group: The process group (default: the world).

    Returns:
        The loaded state.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        DamagedCheckpointError: (a ``CheckpointError``) If ``path`` has no valid manifest,
            a shard is missing or truncated, or the loaded content does not match the
            manifest's checksums (on any rank: every rank raises).
        CheckpointError: If ``path`` was written by a newer format
            (``NewerFormatError``), or does not fit ``like`` (a role added or removed, a
            shape or dtype changed, per-rank values on another world size), or if
            ``like``'s frozen parameters saved by checksum differ from the checkpoint's
            (another base model: naming the role and the first differing parameter).

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
    all_paths, all_leaves, spec = flatten_with_paths(like)
    _check_frozen(manifest, path, all_paths, all_leaves, group)
    keep = [i for i, p in enumerate(all_paths) if p not in manifest.frozen]
    paths, leaves = [all_paths[i] for i in keep], [all_leaves[i] for i in keep]
    _check_fits(manifest, path, paths, leaves, world)
    fresh = [_empty_like(x) for x in leaves]
    flat = {(_rank_key(p, rank) if p in manifest.per_rank else p): x for p, x in zip(paths, fresh)}
    try:
        with _quiet_single_process(world):
            dcp.load(flat, checkpoint_id=path, process_group=group, no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        detail = (
            _failure_text(e) if getattr(e, "failures", None) else f"rank {rank}: {_exc_text(e)}"
        )
        raise DamagedCheckpointError(
            f"could not read checkpoint {str(path)!r} (a shard missing or damaged?): {detail}"
        ) from None
    checksums, per_rank = fingerprint(paths, fresh, group=group)
    bad = len(paths)
    for i, p in enumerate(paths):
        expected = manifest.per_rank[p][rank] if p in manifest.per_rank else manifest.checksums[p]
        got = per_rank[p][rank] if p in per_rank else checksums.get(p)
        if got != expected:
            bad = i
            break
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
    return optree.tree_unflatten(spec, out)  # type: ignore[return-value]


def _check_frozen(
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


class _Stager:
    """Copies a state's tensors to host memory, reusing its buffers from save to save.

    DTensors are staged as DTensors with the same mesh and placements around a host copy
    of their local shard (what DCP writes). From a GPU the copy goes to pinned memory,
    asynchronously, and is synchronised once at the end.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def _host(self, path: str, local: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            pin = local.device.type == "cuda"
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            self._buffers[path] = buf
        buf.copy_(local, non_blocking=local.device.type == "cuda")
        return buf

    def stage(self, paths: list[str], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        staged: list[torch.Tensor] = []
        for path, x in zip(paths, leaves):
            if isinstance(x, DTensor):
                host = self._host(path, x.to_local().detach())
                staged.append(
                    DTensor.from_local(
                        host,
                        x.device_mesh,
                        x.placements,
                        run_check=False,
                        shape=x.shape,
                        stride=x.stride(),
                    )
                )
            else:
                staged.append(self._host(path, x.detach()))
        if any(x.device.type == "cuda" for x in leaves):
            torch.cuda.synchronize()
        return staged


class AsyncSaver:
    """Saves in the background; one save in flight at a time.

    :meth:`save` blocks only to check the target and to *stage* the state — a host copy
    of every tensor (pinned and asynchronous from a GPU; the buffers are reused from save
    to save) — so the caller may update the state in place as soon as it returns. On a
    GPU the content checksums are computed on the device before staging (milliseconds);
    on a CPU they are computed in the background. DCP's write and the commit run on a
    background thread, with a gloo process group of their own so that their collectives
    never interleave with a training step's. A failure there (a full disk, a non-finite
    leaf found by the background checksums) is raised, as a ``CheckpointError`` naming
    the path, by the next :meth:`save`, :meth:`wait` or :meth:`close`.

    Examples:
        >>> with AsyncSaver() as saver:
        ...     for step in ...:
        ...         state, _ = step_fn(state, batch)
        ...         saver.save(state, checkpoint_dir(root, int(state.step)))
    """

    def __init__(self, *, group: Any = None) -> None:
        self._group = group
        self._upload_group: Any = None
        self._pending: concurrent.futures.Future[None] | None = None
        self._stager = _Stager()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fvstep-ckpt"
        )

    def _uploads(self) -> Any:
        if self._upload_group is None and rank_and_world(self._group)[1] > 1:
            self._upload_group = dist.new_group(backend="gloo")
        return self._upload_group

    def save(
        self,
        state: Any,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        allow_nonfinite: bool = False,
    ) -> None:
        """Start saving ``state`` to ``path``; returns once the state has been staged.

        Every rank calls it. A non-finite leaf is refused as by :func:`save`: on a GPU
        the check runs with the checksums before staging, so this call raises; on a CPU
        it runs with the checksums in the background, so the next :meth:`save`,
        :meth:`wait` or :meth:`close` raises. Either way nothing non-finite is committed,
        and a failed save leaves no ``.tmp-*`` directory.

        Args:
            state: The state to save; it may be updated in place once this returns.
            path: The checkpoint directory to create.
            overwrite: Replace an existing checkpoint at ``path``.
            allow_nonfinite: Save a state with NaN or Inf values anyway.

        Raises:
            CheckpointError: If ``path`` exists and ``overwrite`` is false, or (on a GPU)
                a leaf is not finite; or the failure of the previous background save.
        """
        self.wait()
        upload_group = self._uploads()
        final = Path(path)
        paths, leaves, _ = flatten_with_paths(state)
        step = int(getattr(state, "step", 0))
        paths, leaves, frozen = _split_frozen(state, paths, leaves, final, self._group)
        prints = None
        if any(x.device.type == "cuda" for x in leaves):
            sums, finite = local_checks(leaves, check_finite=not allow_nonfinite)
            if not allow_nonfinite:
                _refuse_nonfinite(paths, finite, step, final, self._group)
            prints = fingerprint(paths, leaves, group=self._group, sums=sums)
        tmp = _make_temp_dir(final, overwrite, self._group)
        try:
            staged = self._stager.stage(paths, leaves)
        except Exception:
            if rank_and_world(self._group)[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending = self._executor.submit(
            _write,
            paths,
            staged,
            step,
            final,
            tmp,
            overwrite,
            upload_group,
            prints,
            allow_nonfinite,
            frozen,
        )

    def wait(self) -> None:
        """Wait for the save in flight; raise its error, if any.

        Raises:
            CheckpointError: The failure of the save in flight (naming its path).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and stop the background thread.

        Raises:
            CheckpointError: The failure of the save in flight (naming its path).
        """
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
