"""fvstep's host time per step, this checkout against another (side by side, one run).

Both sides run the same host-bound fine-tune step (a tiny Wan whose step time is
Python and dispatch work: 2 micro-batches, clipping, EMA, AdamW) through the public API
only, so any commit of fvstep can be measured. Each round starts one fresh interpreter
per side, in alternating order (drift cancels), that times ``--steps`` steps after
``--warmup`` untimed ones; the table gives each side's median over rounds of its median
step time, and the ratio of the two.

Usage (from the repository root):
    git worktree add /tmp/before <commit>
    python scripts/compare_overhead.py --before /tmp/before --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
import fvstep as fs
from fvstep.methods.finetune import finetune
from fvstep.models import synthetic_batch, tiny_wan

steps, warmup = int(sys.argv[1]), int(sys.argv[2])
state = fs.TrainState.create(
    {"student": fs.Role(tiny_wan(num_layers=4), optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.9))},
    key=fs.random.key(0),
)
step = fs.compile(finetune(), accumulation=fs.Accumulation(2), clip=fs.clip_grad_norm(1.0))
batch = synthetic_batch(fs.random.key(1), batch_size=2, height=2, width=2, frames=1)
times = []
for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    if i >= warmup:
        times.append(time.perf_counter() - start)
print(json.dumps({"median_s": statistics.median(times), "fvstep": fs.__file__}))
"""


def measure(path: Path, steps: int, warmup: int) -> float:
    """One fresh interpreter importing fvstep from ``path``: its median step time."""
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(steps), str(warmup)],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["fvstep"]).resolve().is_relative_to(path.resolve()), result
    return float(result["median_s"])


def main(argv: list[str] | None = None) -> None:
    """Print the A/B table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    sides = {"before": args.before, "after": ROOT}
    results: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            results[name].append(measure(sides[name], args.steps, args.warmup))
    before, after = (statistics.median(results[n]) for n in ("before", "after"))
    ratios = [a / b for a, b in zip(results["after"], results["before"])]
    print("| side | median step (ms) | min | max |")
    print("|---|---|---|---|")
    for name in sides:
        v = results[name]
        print(
            f"| {name} | {statistics.median(v) * 1e3:.2f} | {min(v) * 1e3:.2f} | {max(v) * 1e3:.2f} |"
        )
    print(
        f"\nafter / before: {after / before:.3f} (per-round ratios: median "
        f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
        f"{args.rounds} rounds of {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
