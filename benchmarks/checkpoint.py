"""Checkpoint throughput: sync save, async save blocking time, load, against the disk.

The state is a model preset's (``--preset``) or a ``--mib``-sized linear layer's, each
with its AdamW moments (fp32: params + 2 moments); under ``torchrun`` it is sharded
with FSDP2 and every rank writes its own shards. Each round measures, all ranks
together (barrier first; the time is the slowest rank's):

- ``disk write``: the same number of bytes each rank's shards hold, written with
  ``os.write`` in 16 MiB chunks and ``os.fsync``, into the same directory: the disk's
  sequential write bandwidth for these bytes, measured in the same run;
- ``sync save``: :func:`fvstep.checkpoint.save` (checksums, DCP write with fsync,
  manifest, atomic rename), and separately the checksums alone
  (:func:`fvstep.checkpoint.saving.fingerprint`, which save and load both run);
- ``async save``: :meth:`fvstep.checkpoint.AsyncSaver.save`'s blocking time (target
  dir, staging copy) and the time until the checkpoint is committed;
- ``load``: :func:`fvstep.checkpoint.load` into a new state (checksums verified).

The disk write and the sync save alternate which goes first, so drift cancels.
Throughput is the state's bytes (all ranks) over the median time.

Usage:
    python -m benchmarks.checkpoint --mib 64 --rounds 3
    torchrun --standalone --nproc_per_node 2 -m benchmarks.checkpoint --mib 64
    python -m benchmarks.checkpoint --preset wan-1.3b --device cuda --dir /scratch
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fvstep as fs
from benchmarks import common as c
from benchmarks import presets
from fvstep import checkpoint as ckpt
from fvstep import parallel as fsd
from fvstep.checkpoint.saving import WRITER_THREADS, fingerprint
from fvstep.core.tree import flatten_with_paths

__all__ = ["main", "write_with_fsync"]

_CHUNK = 16 * 2**20


def write_with_fsync(path: Path, nbytes: int, chunk: bytes) -> float:
    """Write ``nbytes`` to ``path`` with ``os.write`` then ``os.fsync``; the seconds taken."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(chunk)
        left = nbytes
        while left > 0:
            left -= os.write(fd, view[: min(left, len(view))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def build_state(args: Any, rt: c.Runtime) -> tuple[fs.TrainState, str]:
    """The benchmarked state (sharded on several ranks) and a description of it."""
    if args.preset:
        module: nn.Module = presets.build_model(
            presets.PRESETS[args.preset], device=rt.device, seed=0
        )
        what = args.preset
    else:
        side = max(1, int((args.mib * 2**20 // 4 // 3) ** 0.5))  # params + 2 moments, fp32
        with torch.device(rt.device):
            module = nn.Linear(side, side, bias=False)
        what = f"Linear({side}, {side})"
    if rt.sharded:
        fsd.shard_module(module, mesh=rt.mesh)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )
    return state, what


def _bytes_written_here(state: fs.TrainState, rank: int) -> int:
    """This rank's share of a save: its shards, plus the replicated plain leaves on rank 0."""
    total = 0
    for leaf in fs.tree.leaves(state):
        if hasattr(leaf, "to_local"):
            local = leaf.to_local()
            total += local.numel() * local.element_size()
        elif rank == 0:
            total += leaf.numel() * leaf.element_size()
    return total


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed(rt: c.Runtime, fn: Any, *args: Any, **kwargs: Any) -> float:
    """Seconds of ``fn(*args, **kwargs)`` on this rank, barrier first, device synchronised."""
    rt.barrier()
    return c.time_call(lambda: fn(*args, **kwargs), rt.device)[0]


def run(args: Any, rt: c.Runtime) -> dict[str, Any]:
    """Measure every round; the JSON-able result."""
    state, what = build_state(args, rt)
    mine = _bytes_written_here(state, rt.rank)
    total = _sum(rt, mine)
    root_name = args.dir or (tempfile.mkdtemp(prefix="fvstep-bench-ckpt-") if rt.is_main else "")
    root = Path(fsd.broadcast_object(root_name))  # rank 0's directory
    root.mkdir(parents=True, exist_ok=True)
    chunk = torch.randint(0, 256, (min(_CHUNK, max(mine, 1)),), dtype=torch.uint8).numpy().tobytes()
    paths, leaves, _ = flatten_with_paths(state)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "disk write",
            "sync save",
            "dcp.save alone",
            "checksums",
            "async: blocking",
            "async: committed",
            "load",
        )
    }
    on_disk = 0
    async_error: str | None = None
    with ckpt.AsyncSaver() as saver:
        for r in range(args.rounds):
            sync_dir, async_dir = root / f"sync_{r}", root / f"async_{r}"
            disk = root / f"disk_{r}_rank{rt.rank}.bin"
            dcp_dir = root / f"dcp_{r}"
            order = ["disk", "sync", "dcp"]
            order = order[r % 3 :] + order[: r % 3]  # rotate, so drift cancels
            for item in order:
                if item == "disk":
                    seconds = _timed(rt, write_with_fsync, disk, mine, chunk)
                    times["disk write"].append(seconds)
                elif item == "sync":
                    times["sync save"].append(
                        _timed(rt, ckpt.save, state, sync_dir, writer_threads=args.writer_threads)
                    )
                else:  # the baseline: DCP's own save of the same tensors, nothing of fvstep's
                    flat = {p: x.detach() for p, x in zip(paths, leaves)}
                    times["dcp.save alone"].append(_timed(rt, _dcp_save, flat, dcp_dir, rt.world))
            times["checksums"].append(_timed(rt, fingerprint, paths, leaves))
            times["load"].append(_timed(rt, ckpt.load, sync_dir, like=state))
            if async_error is None:
                async_error = _time_async(rt, saver, state, async_dir, times, args.writer_threads)
            rt.barrier()
            if rt.is_main:
                on_disk = _du(sync_dir)
                shutil.rmtree(dcp_dir, ignore_errors=True)
                if not args.keep:
                    shutil.rmtree(sync_dir)
                    shutil.rmtree(async_dir, ignore_errors=True)
                    shutil.rmtree(async_dir.parent / f".tmp-{async_dir.name}", ignore_errors=True)
            if not args.keep:
                disk.unlink()
    rt.barrier()
    if rt.is_main and args.dir is None and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    rows = {}
    for name, values in times.items():
        if values:
            stat = c.summarize(rt.max_over_ranks(values))
            rows[name] = {**stat, "mib_per_s": total / 2**20 / stat["median"]}
    info = c.describe(
        rt,
        state=what,
        state_bytes=total,
        leaves=len(leaves),
        on_disk_bytes=on_disk,
        dir=str(root),
        rounds=args.rounds,
        writer_threads=args.writer_threads,
        async_error=async_error,
    )
    return {"benchmark": "checkpoint", "info": info, "rows": rows}


def _time_async(
    rt: c.Runtime,
    saver: ckpt.AsyncSaver,
    state: fs.TrainState,
    path: Path,
    times: dict[str, list[float]],
    writer_threads: int,
) -> str | None:
    """Time one async save (blocking part, then until committed); the error, if it fails.

    A failure is reported rather than raised, so the other measurements still print.
    """
    rt.barrier()
    start = time.perf_counter()
    try:
        saver.save(state, path, writer_threads=writer_threads)
        blocking = time.perf_counter() - start
        saver.wait()
    except Exception as e:  # reported in the table's notes
        return f"{type(e).__name__}: {e}"
    times["async: blocking"].append(blocking)
    times["async: committed"].append(time.perf_counter() - start)
    return None


def _dcp_save(flat: dict[str, torch.Tensor], path: Path, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(flat, checkpoint_id=path, no_dist=world == 1)


def _sum(rt: c.Runtime, value: int) -> int:
    """The sum of ``value`` over ranks."""
    if not rt.sharded:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    t = t.to(rt.device) if rt.device.type == "cuda" else t
    torch.distributed.all_reduce(t)
    return int(t.item())


def report(result: dict[str, Any]) -> None:
    """Print the table."""
    info, rows = result["info"], result["rows"]
    print(
        f"checkpoint: {info['state']} + AdamW, {info['state_bytes'] / 2**20:.1f} MiB in "
        f"{info['leaves']} leaves ({info['on_disk_bytes'] / 2**20:.1f} MiB on disk), "
        f"{info['rounds']} rounds, {info['writer_threads']} writer threads, dir {info['dir']}"
    )
    print(c.header_line(info))
    disk = rows["disk write"]["median"]
    table = [
        [
            name,
            f"{r['median']:.3f}",
            f"{r['min']:.3f}",
            f"{r['max']:.3f}",
            f"{r['mib_per_s']:.0f}" if r["mib_per_s"] >= 10 else f"{r['mib_per_s']:.2g}",
            f"{r['median'] / disk:.2f}x",
        ]
        for name, r in rows.items()
    ]
    c.print_table(["measure", "median s", "min s", "max s", "MiB/s", "time / disk"], table)
    sync = rows["sync save"]["median"]
    print(
        f"sync save reaches {rows['disk write']['median'] / sync:.0%} of the disk's write "
        f"bandwidth; checksums are {rows['checksums']['median'] / sync:.0%} of it; "
        f"fvstep's save takes {sync / rows['dcp.save alone']['median']:.2f}x DCP's own save "
        "of the same tensors"
    )
    if "async: blocking" in rows:
        share = rows["async: blocking"]["median"] / sync
        print(f"async blocking = {share:.1%} of a sync save (target <= 5%)")
    if info.get("async_error"):
        print(f"async save FAILED (not timed): {info['async_error']}")


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--preset", choices=sorted(presets.PRESETS), default=None)
    what.add_argument("--mib", type=int, default=None, help="state size (default 64 MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    parser.add_argument(
        "--writer-threads",
        type=int,
        default=WRITER_THREADS,
        help=f"files each rank's save writes at once (default {WRITER_THREADS}; DCP's "
        "own save, the baseline, writes one)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.preset is None and args.mib is None:
        args.mib = 64
    if args.rounds < 1 or args.writer_threads < 1 or (args.mib is not None and args.mib < 1):
        print("--rounds, --writer-threads and --mib must be >= 1", file=sys.stderr)
        return 2
    rt = c.setup_runtime(args.device)
    try:
        result = run(args, rt)
        if rt.is_main:
            report(result)
            c.write_json(args.json, result)
    finally:
        c.teardown_runtime(rt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
