"""Save a whole state through torch.distributed.checkpoint (DCP), atomically.

The DCP keys are the state's optree paths (``roles.student.params.blocks.0.ffn.net.0.proj.weight``),
so the checkpoint layout *is* the state layout. DTensor leaves (FSDP2 shards) are saved
as DTensors and reshard on load; plain tensors equal on every rank are saved once;
plain tensors that differ between ranks are saved under per-rank keys
(``<path>@rank<r>``) and come back to their own rank — never collapsed to rank 0's.

The shards are written into ``.tmp-<name>``; the manifest (checksums included) is
written after them, and only then is the directory renamed to its final name. Every
outcome is agreed between ranks: a failure on one rank (a non-finite leaf of its shard,
a full disk) makes every rank raise the same ``CheckpointError``, and no rank waits for a
collective that another has left. :mod:`fvstep.checkpoint.loading` reads it back;
:mod:`fvstep.checkpoint.async_saving` runs the same write in the background.
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
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fvstep.checkpoint.directories import commit, discard
from fvstep.checkpoint.fingerprint import fingerprint, local_checks
from fvstep.checkpoint.frozen import split_frozen
from fvstep.checkpoint.manifest import Manifest
from fvstep.core._checks import check_int
from fvstep.core.errors import CheckpointError
from fvstep.core.tree import flatten_with_paths, is_dtensor
from fvstep.core.weights import roles_holding_other_weights
from fvstep.parallel.ranks import broadcast_object, min_over_ranks, rank_and_world

__all__ = [
    "WRITER_THREADS",
    "exception_text",
    "failure_text",
    "make_temp_dir",
    "quiet_single_process",
    "rank_key",
    "refuse_nonfinite",
    "save",
    "write_checkpoint",
]


def _installed_version() -> str:
    """fvstep's version from the installed distribution's metadata (as equinox reads its
    own): no module inside fvstep imports the package face for it."""
    try:
        return importlib.metadata.version("fvstep")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


_FVSTEP_VERSION = _installed_version()

#: Files each rank writes at once by default (DCP ``FileSystemWriter``'s ``thread_count``):
#: one, as DCP's own save. ``save(..., writer_threads=4)`` splits a rank's shards by size
#: into 4 files, each written and fsynced on its own thread, so one file's fsync overlaps
#: the next one's writes: on the H200 host a sync save went from 1.09x to 0.94x of DCP's
#: own save from CUDA (2 GiB) and from 0.99x to 0.62x from the CPU (512 MiB)
#: (``docs/benchmarks.md``, "Checkpoint writes on several threads"). It is not the
#: default because when a write fails on one of DCP's helper threads, DCP neither raises
#: it nor stops the other threads: fvstep refuses such a save (:class:`_CheckedWriter`),
#: but the helper threads print their own tracebacks.
WRITER_THREADS = 1


@contextlib.contextmanager
def quiet_single_process(world: int) -> Iterator[None]:
    """DCP warns that it runs without a process group; on one process that is the intent."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def exception_text(exc: Any) -> str:
    """One line for an exception, or a DCP failure ``(exception, traceback)``: its type and message."""
    if isinstance(exc, tuple):  # DCP's failures are (exception, traceback summary)
        exc = exc[0]
    return f"{type(exc).__name__}: {exc}"


def failure_text(e: BaseException) -> str:
    """One line per failing rank: the cause, without DCP's tracebacks."""
    failures = getattr(e, "failures", None)
    if not failures:
        return exception_text(e)
    return "; ".join(f"rank {r}: {exception_text(f)}" for r, f in sorted(failures.items()))


def refuse_nonfinite(
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


def rank_key(path: str, rank: int) -> str:
    """The key of ``path``'s own copy on ``rank`` in a checkpoint (a per-rank leaf)."""
    return f"{path}@rank{rank}"


def _describe_leaf(x: torch.Tensor, per_rank: bool) -> dict[str, Any]:
    return {
        "dtype": str(x.dtype).removeprefix("torch."),
        "shape": list(x.shape),
        "sharded": is_dtensor(x),
        "per_rank": per_rank,
    }


def make_temp_dir(final: Path, overwrite: bool, group: Any) -> Path:
    """Collective: rank 0 checks ``final`` and makes a fresh temporary directory."""
    rank, _ = rank_and_world(group)
    tmp = final.parent / f".tmp-{final.name}"
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
            error = f"could not save checkpoint {str(final)!r}: {exception_text(e)}"
    error = broadcast_object(error, group=group)
    if error is not None:
        raise CheckpointError(error)
    return tmp


class _CheckedWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, whose writes are all accounted for.

    With ``thread_count > 1``, DCP writes files on helper threads and a failure there is
    lost: the thread dies, its items' results are missing, and DCP writes the metadata
    of a checkpoint that cannot load. This writer records any exception that passes
    through a file stream and raises when fewer items were written than planned.
    """

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

        self.fs.create_stream = create_stream  # type: ignore[method-assign]  # this writer's FileSystem only

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        missing = len(plan.items) - len(written.wait())
        if missing:
            cause = self._failures[0] if self._failures else None
            text = exception_text(cause) if cause is not None else "no error was raised"
            raise OSError(f"{missing} of {len(plan.items)} items were not written ({text})")
        return written


def _dcp_save(
    flat: dict[str, torch.Tensor], final: Path, tmp: Path, group: Any, writer_threads: int
) -> None:
    world = rank_and_world(group)[1]
    writer = _CheckedWriter(tmp, thread_count=writer_threads)
    try:
        with quiet_single_process(world):
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


def _write_shards(
    paths: list[str],
    leaves: list[torch.Tensor],
    step: int,
    final: Path,
    tmp: Path,
    group: Any,
    prints: tuple[dict[str, int], dict[str, list[int]]] | None,
    allow_nonfinite: bool,
    writer_threads: int,
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
            (rank_key(p, rank) if p in per_rank else p): x.detach() for p, x in zip(paths, leaves)
        }
        _dcp_save(flat, final, tmp, group, writer_threads)
        return checksums, per_rank
    check = not allow_nonfinite
    early = [i for i, x in enumerate(leaves) if world > 1 and not is_dtensor(x)]
    early_set = set(early)
    late = [i for i in range(len(leaves)) if i not in early_set]
    early_sums: list[torch.Tensor] = []
    early_finite: list[bool] = []
    per_rank = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(local_checks, [leaves[i] for i in late], check_finite=check)
        if early:  # (one process: none)
            early_sums, early_finite = local_checks([leaves[i] for i in early], check_finite=check)
            _, per_rank = fingerprint(
                [paths[i] for i in early], [leaves[i] for i in early], group=group, sums=early_sums
            )
        flat = {
            (rank_key(p, rank) if p in per_rank else p): x.detach() for p, x in zip(paths, leaves)
        }
        _dcp_save(flat, final, tmp, group, writer_threads)
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
        refuse_nonfinite(paths, finite, step, final, group)
    return fingerprint(paths, leaves, group=group, sums=sums)


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
    """Collective: write the shards, (rank 0) commit, and agree on the outcome.

    On any failure every rank raises a ``CheckpointError`` naming ``final`` and the cause,
    and rank 0 removes ``tmp``. When it returns, on any rank, the checkpoint is committed.
    """
    rank, world = rank_and_world(group)
    try:
        checksums, per_rank = _write_shards(
            paths, leaves, step, final, tmp, group, prints, allow_nonfinite, writer_threads
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
                error = CheckpointError(
                    f"could not save checkpoint {str(final)!r}: {exception_text(e)}"
                )
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
    writer_threads: int = WRITER_THREADS,
) -> Path:
    """Save ``state`` (a ``TrainState`` or any fvstep pytree of tensors) to ``path``, atomically.

    Every rank calls it. Shards are written into ``.tmp-<name>`` beside ``path``; rank 0
    then writes the manifest (versions, world size, structure, checksums) and renames the
    directory to ``path``. A crash before the rename leaves no checkpoint at ``path``; a
    failure (a full disk, a read-only directory, a non-finite leaf) raises on every rank
    and removes the ``.tmp-<name>`` directory.

    A state with a NaN or infinite value in a floating-point leaf (parameters, optimizer
    moments, EMA, ``extra``), on any rank, is refused: resuming from it could only
    continue a diverged run. The check rides on the checksum call (one ``aminmax`` of each
    leaf, read at memory speed: a few percent of the checksums' time).

    Args:
        state: The state to save; it is not consumed or changed.
        path: The checkpoint directory to create (e.g. ``directories.checkpoint_dir(root, step)``).
        overwrite: Replace an existing checkpoint at ``path``.
        group: The process group (default: the world).
        allow_nonfinite: Save a state with NaN or Inf values anyway (for inspection).
        writer_threads: Files each rank writes at once (default :data:`WRITER_THREADS`,
            1; DCP's ``thread_count``; ``docs/benchmarks.md`` measures 4). A failed
            write on a helper thread is refused all the same, but that thread prints
            its own traceback. Loading reads any number of files.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: If ``path`` exists and ``overwrite`` is false; if a leaf is
            not finite (naming the first such leaf, the rank and the step) and
            ``allow_nonfinite`` is false; or if writing fails (naming ``path`` and the
            cause, e.g. ``No space left on device``).
        TypeError: If ``writer_threads`` is not an integer.
        ValueError: If ``writer_threads`` is smaller than 1.

    Examples:
        >>> save(state, "ckpt/step_000000100")
    """
    writer_threads = check_int(writer_threads, "writer_threads", minimum=1)
    swapped = roles_holding_other_weights(state)
    if swapped:
        raise CheckpointError(
            f"roles {swapped} hold their EMA in their parameters here (inside "
            "fvstep.observe.validation.role_module(weights='ema')): a checkpoint would save it as "
            "the live parameters; save after the with block"
        )
    final = Path(path)
    tmp = make_temp_dir(final, overwrite, group)
    paths, leaves, _ = flatten_with_paths(state)
    step = int(getattr(state, "step", 0))
    try:
        paths, leaves, frozen = split_frozen(state, paths, leaves, final, group)
    except Exception:
        if rank_and_world(group)[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
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
