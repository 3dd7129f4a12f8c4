"""Save and load a whole state through torch.distributed.checkpoint (DCP).

The DCP keys are the state's optree paths (``roles.student.params.blocks.0.ffn.net.0.proj.weight``),
so the checkpoint layout *is* the state layout. DTensor leaves (FSDP2 shards) are saved
as DTensors and reshard on load; plain tensors equal on every rank are saved once;
plain tensors that differ between ranks are saved under per-rank keys
(``<path>@rank<r>``) and come back to their own rank — never collapsed to rank 0's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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

import fvstep
from fvstep.checkpoint.fingerprint import fingerprint
from fvstep.checkpoint.layout import commit, list_complete
from fvstep.checkpoint.manifest import CheckpointError, Manifest, read_manifest
from fvstep.tree import flatten_with_paths

__all__ = ["AsyncSaver", "load", "save"]

T = TypeVar("T")


def _rank_world(group: Any = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


@contextlib.contextmanager
def _quiet_single_process(world: int) -> Iterator[None]:
    """DCP warns that it runs without a process group; on one process that is the intent."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(group: Any = None) -> None:
    if _rank_world(group)[1] > 1:
        dist.barrier(group)


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


def _prepare(state: Any, path: str | os.PathLike[str], overwrite: bool, group: Any):
    """Collective: flatten, fingerprint, make the temporary directory. Returns the plan."""
    rank, world = _rank_world(group)
    final = Path(path)
    tmp = _temp_for(final)
    paths, leaves, _ = flatten_with_paths(state)
    if rank == 0:
        if final.exists() and not overwrite:
            error: str | None = f"checkpoint {str(final)!r} already exists (pass overwrite=True)"
        else:
            error = None
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    else:
        error = None
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)
    checksums, per_rank = fingerprint(paths, leaves, group=group)
    flat = {(_rank_key(p, rank) if p in per_rank else p): x.detach() for p, x in zip(paths, leaves)}
    manifest = Manifest(
        step=int(getattr(state, "step", 0)),
        world_size=world,
        leaves={p: _describe_leaf(x, p in per_rank) for p, x in zip(paths, leaves)},
        checksums=checksums,
        per_rank=per_rank,
        fvstep_version=fvstep.__version__,
    )
    _barrier(group)
    return final, tmp, flat, manifest


def _publish(final: Path, tmp: Path, manifest: Manifest, overwrite: bool) -> None:
    manifest.write(tmp)
    if overwrite and final.exists():
        shutil.rmtree(final)
    commit(tmp, final)


def save(
    state: Any, path: str | os.PathLike[str], *, overwrite: bool = False, group: Any = None
) -> Path:
    """Save ``state`` (a ``TrainState`` or any fvstep pytree of tensors) to ``path``, atomically.

    Every rank calls it. Shards are written into ``.tmp-<name>`` beside ``path``; rank 0
    then writes the manifest (versions, world size, structure, checksums) and renames the
    directory to ``path``. A crash before the rename leaves no checkpoint at ``path``.

    Args:
        state: The state to save; it is not consumed or changed.
        path: The checkpoint directory to create (e.g. ``layout.checkpoint_dir(root, step)``).
        overwrite: Replace an existing checkpoint at ``path``.
        group: The process group (default: the world).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: If ``path`` exists and ``overwrite`` is false.

    Example:
        >>> save(state, "ckpt/step_000000100")
    """
    final, tmp, flat, manifest = _prepare(state, path, overwrite, group)
    rank, world = _rank_world(group)
    with _quiet_single_process(world):
        dcp.save(flat, checkpoint_id=tmp, process_group=group, no_dist=world == 1)
    if rank == 0:
        _publish(final, tmp, manifest, overwrite)
    _barrier(group)
    return final


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

    Args:
        path: A checkpoint directory (see :func:`fvstep.checkpoint.latest`).
        like: A state of the same structure (e.g. the freshly created initial state).
        group: The process group (default: the world).

    Returns:
        The loaded state.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        CheckpointError: If ``path`` is not a complete fvstep checkpoint, was written by a
            newer format, does not fit ``like`` (a role added or removed, a shape or
            dtype changed, per-rank values on another world size), a shard is missing or
            truncated, or the loaded content does not match the manifest's checksums.

    Example:
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
    rank, world = _rank_world(group)
    paths, leaves, spec = flatten_with_paths(like)
    _check_fits(manifest, path, paths, leaves, world)
    fresh = [_empty_like(x) for x in leaves]
    flat = {(_rank_key(p, rank) if p in manifest.per_rank else p): x for p, x in zip(paths, fresh)}
    try:
        with _quiet_single_process(world):
            dcp.load(flat, checkpoint_id=path, process_group=group, no_dist=world == 1)
    except Exception as e:  # DCP wraps reader errors in CheckpointException
        raise CheckpointError(
            f"could not read checkpoint {str(path)!r}: {type(e).__name__}: {e}"
        ) from e
    checksums, per_rank = fingerprint(paths, fresh, group=group)
    for p in paths:
        expected = manifest.per_rank[p][rank] if p in manifest.per_rank else manifest.checksums[p]
        got = per_rank[p][rank] if p in per_rank else checksums.get(p)
        if got != expected:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: the content of '{p}' does not match the manifest's "
                "checksum (the files were changed or damaged after the save)"
            )
    return optree.tree_unflatten(spec, fresh)  # type: ignore[return-value]


class AsyncSaver:
    """Saves in the background with DCP's ``async_save``; one save in flight at a time.

    :meth:`save` blocks for the collective preparation and for DCP's staging (a copy of
    every tensor), so the caller may update the state in place as soon as it returns;
    the files are written and the checkpoint committed on a background thread. A
    failure there is raised by the next :meth:`save`, :meth:`wait` or :meth:`close`.

    Example:
        >>> with AsyncSaver() as saver:
        ...     for step in ...:
        ...         state, _ = step_fn(state, batch)
        ...         saver.save(state, checkpoint_dir(root, int(state.step)))
    """

    def __init__(self, *, group: Any = None) -> None:
        self._group = group
        self._upload_group: Any = None
        self._pending: concurrent.futures.Future[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fvstep-ckpt"
        )

    def _uploads(self) -> Any:
        # DCP's background thread runs collectives: give it a gloo group of its own so they
        # never interleave with the training step's collectives.
        if self._upload_group is None and _rank_world(self._group)[1] > 1:
            self._upload_group = dist.new_group(backend="gloo")
        return self._upload_group

    def save(self, state: Any, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Start saving ``state`` to ``path``; returns once the state has been staged.

        Raises:
            Exception: A failure of the previous background save.
        """
        self.wait()
        upload_group = self._uploads()
        final, tmp, flat, manifest = _prepare(state, path, overwrite, self._group)
        rank, world = _rank_world(self._group)
        with _quiet_single_process(world):
            response = dcp.async_save(
                flat, checkpoint_id=tmp, process_group=upload_group, no_dist=world == 1
            )
        upload: Any = getattr(response, "upload_completion", response)

        def finish() -> None:
            upload.result()
            if rank == 0:
                _publish(final, tmp, manifest, overwrite)

        self._pending = self._executor.submit(finish)

    def wait(self) -> None:
        """Wait for the save in flight; raise its error, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
