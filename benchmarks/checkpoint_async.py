"""Async save blocking time vs synchronous save time, on CPU (one process).

Each round saves the same state synchronously and asynchronously (alternating, so drift
cancels); reported: median (min/max) of the sync save time, the async call's blocking
time (preparation + DCP staging), and the async save's total time until committed.

Usage: python -m benchmarks.checkpoint_async [--mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import fvstep as fs
from fvstep import checkpoint as ckpt


def build_state(mib: int) -> fs.TrainState:
    numel = mib * 2**20 // 4 // 3  # params + 2 AdamW moments, fp32
    side = int(numel**0.5)
    module = torch.nn.Linear(side, side, bias=False)
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    state = build_state(args.mib)
    nbytes = sum(x.numel() * x.element_size() for x in fs.tree.leaves(state))
    root = Path(args.dir or tempfile.mkdtemp(prefix="fvstep-bench-"))
    sync, blocking, total = [], [], []
    with ckpt.AsyncSaver() as saver:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            ckpt.save(state, root / f"sync_{r}")
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            saver.save(state, root / f"async_{r}")
            blocking.append(time.perf_counter() - t0)
            saver.wait()
            total.append(time.perf_counter() - t0)
            shutil.rmtree(root / f"sync_{r}")
            shutil.rmtree(root / f"async_{r}")
    if args.dir is None:
        shutil.rmtree(root)
    print(f"state: {nbytes / 2**20:.0f} MiB, {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'measure':<26} {'median s':>9} {'min s':>8} {'max s':>8}")
    for name, values in [
        ("sync save", sync),
        ("async save: blocking", blocking),
        ("async save: until committed", total),
    ]:
        print(
            f"{name:<26} {statistics.median(values):>9.3f} {min(values):>8.3f} {max(values):>8.3f}"
        )
    ratio = statistics.median(blocking) / statistics.median(sync)
    print(f"async blocking / sync save = {ratio:.1%} (target <= 5%)")
    print(f"sync throughput = {nbytes / 2**20 / statistics.median(sync):.0f} MiB/s")


if __name__ == "__main__":
    main()
