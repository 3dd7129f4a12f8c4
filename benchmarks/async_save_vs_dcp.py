"""AsyncSaver against DCP's own ``async_save``: the time a save blocks the training step.

Both sides save the same state with the same guarantees (checksums and a finiteness
check of what is saved, the manifest written after the shards, the atomic rename):

- ``fvstep AsyncSaver``: :meth:`fvstep.checkpoint.AsyncSaver.save` (checks the target,
  stages a host copy into buffers reused from save to save; checksums, DCP write and
  commit on its thread);
- ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` with one
  ``DefaultStager`` kept for every save (so its storages are reused, as ours are). Its
  future holds only DCP's metadata, never the staged copy, so the checksums that the
  manifest records must be taken from the live state before the call returns; the
  manifest and the rename follow the write.

The two alternate which goes first each round, so drift cancels; reported: the median,
min and max of each side's blocking time, and of its time until committed.

Usage: python -m benchmarks.async_save_vs_dcp [--mib 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.checkpoint.saving import (
    _FVSTEP_VERSION,
    Manifest,
    fingerprint,
    fsync,
    local_checks,
    make_temp_dir,
    refuse_nonfinite,
    split_frozen,
)
from fvstep.core.tree import flatten_with_paths


def build_state(mib: int) -> fs.TrainState:
    numel = mib * 2**20 // 4 // 3  # params + 2 AdamW moments, fp32
    side = int(numel**0.5)
    module = torch.nn.Linear(side, side, bias=False)
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )


class DcpAsyncSaver:
    """The same save on ``dcp.async_save`` (one process): what replacing ours would be."""

    def __init__(self) -> None:
        self._stager = DefaultStager(StagingOptions(False, False, False, False))  # CPU
        self._pending: tuple[Future[Any], Path, Path, Manifest] | None = None

    def save(self, state: Any, path: Path) -> None:
        self.wait()
        paths, leaves, _ = flatten_with_paths(state)
        step = int(state.step)
        paths, leaves, frozen = split_frozen(state, paths, leaves, path, None)
        sums, finite = local_checks(leaves)  # before returning: the state may then change
        refuse_nonfinite(paths, finite, step, path, None)
        checksums, per_rank = fingerprint(paths, leaves, sums=sums)
        tmp = make_temp_dir(path, False, None)
        flat = {p: x.detach() for p, x in zip(paths, leaves)}
        future = dcp.async_save(flat, checkpoint_id=tmp, async_stager=self._stager, no_dist=True)
        manifest = Manifest(
            step=step,
            world_size=1,
            leaves={
                p: {"dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}
                | {"sharded": False, "per_rank": False}
                for p, x in zip(paths, leaves)
            },
            checksums=checksums,
            per_rank=per_rank,
            fvstep_version=_FVSTEP_VERSION,
            frozen=frozen,
        )
        self._pending = (future, path, tmp, manifest)  # type: ignore[assignment]

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            future, path, tmp, manifest = pending
            future.result()
            manifest.write(tmp)  # the commit of fvstep.checkpoint.save
            fsync(tmp)
            os.replace(tmp, path)
            fsync(path.parent)

    def close(self) -> None:
        self.wait()
        self._stager.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process
    state = build_state(args.mib)
    nbytes = sum(x.numel() * x.element_size() for x in fs.tree.leaves(state))
    root = Path(args.dir or tempfile.mkdtemp(prefix="fvstep-bench-"))
    ours, theirs = ckpt.AsyncSaver(), DcpAsyncSaver()
    sides: dict[str, Any] = {"fvstep AsyncSaver": ours, "dcp.async_save": theirs}
    blocking: dict[str, list[float]] = {k: [] for k in sides}
    total: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for r in range(args.rounds):
            for name in sorted(sides, reverse=r % 2 == 1):
                path = root / f"{name.split()[0].replace('.', '_')}_{r}"
                t0 = time.perf_counter()
                sides[name].save(state, path)
                blocking[name].append(time.perf_counter() - t0)
                with torch.no_grad():  # the next step's in-place update
                    for x in fs.tree.leaves(state):
                        if x.is_floating_point():
                            x.add_(1.0)
                sides[name].wait()
                total[name].append(time.perf_counter() - t0)
                ckpt.load(path, like=state)  # committed, and verified
                shutil.rmtree(path)
    finally:
        ours.close()
        theirs.close()
        if args.dir is None:
            shutil.rmtree(root)
    print(f"state: {nbytes / 2**20:.0f} MiB, {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'measure':<38} {'median s':>9} {'min s':>8} {'max s':>8}")
    for what, values in (("blocking", blocking), ("until committed", total)):
        for name, v in values.items():
            label = f"{name}: {what}"
            print(f"{label:<38} {statistics.median(v):>9.3f} {min(v):>8.3f} {max(v):>8.3f}")


if __name__ == "__main__":
    main()
