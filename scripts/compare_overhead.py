"""fvstep's host time per step, this checkout against another (side by side, one run).

Both sides run the same fine-tune step (a tiny Wan: 2 micro-batches, clipping, EMA,
AdamW) through the public API only, so any commit of fvstep can be measured. fvstep's
own part of a step is the step's time less the calls into the loss function, backward,
torch's AdamW kernel, the gradient norm and the clip (each wrapped with a timer before
fvstep is imported, so both sides bind the same wrappers). Each round starts one fresh
interpreter per side, in alternating order (drift cancels), that times ``--steps`` steps
after ``--warmup`` untimed ones; the table gives medians, and the ratios are the median
of the per-round ratios. ``--clock cpu`` times with the process's CPU time instead of the
wall clock: on a machine shared with other work, the time a process waits for a core
then does not count.

Usage (from the repository root):
    git worktree add /tmp/before <commit>
    python scripts/compare_overhead.py --before /tmp/before --rounds 7
    python scripts/compare_overhead.py --before /tmp/before --rounds 9 --clock cpu
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
clock = time.process_time if sys.argv[3] == "cpu" else time.perf_counter

# Time what is not fvstep's own work: patched before fvstep binds them at import.
spent = [0.0]
def timed(fn):
    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += clock() - start
    return wrapper
torch.Tensor.backward = timed(torch.Tensor.backward)
import importlib
adamw_module = importlib.import_module("torch.optim.adamw")
adamw_module.adamw = timed(adamw_module.adamw)
torch.nn.utils.get_total_norm = timed(torch.nn.utils.get_total_norm)
torch.nn.utils.clip_grads_with_norm_ = timed(torch.nn.utils.clip_grads_with_norm_)

import fvstep as fs
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import synthetic_batch, tiny_wan

steps, warmup = int(sys.argv[1]), int(sys.argv[2])
state = fs.TrainState.create(
    {"student": fs.Role(tiny_wan(num_layers=2), optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.9))},
    key=fs.random.key(0),
)
step = fs.compile(
    fs.update("student", timed(flow_matching_loss()), name="finetune"),
    accumulation=fs.Accumulation(2),
    clip=fs.clip_grad_norm(1.0),
)
batch = synthetic_batch(fs.random.key(1), batch_size=2)
times, own = [], []
for i in range(warmup + steps):
    spent[0] = 0.0
    start = clock()
    state, metrics = step(state, batch)
    total = clock() - start
    if i >= warmup:
        times.append(total)
        own.append(total - spent[0])
print(json.dumps({
    "median_s": statistics.median(times), "own_s": statistics.median(own), "fvstep": fs.__file__
}))
"""


def measure(path: Path, steps: int, warmup: int, clock: str = "wall") -> tuple[float, float]:
    """One fresh interpreter importing fvstep from ``path``: its median step time, and
    the median of fvstep's own part of it (the step less the loss function, backward,
    the AdamW kernel, the norm and the clip)."""
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(steps), str(warmup), clock],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["fvstep"]).resolve().is_relative_to(path.resolve()), result
    return float(result["median_s"]), float(result["own_s"])


def main(argv: list[str] | None = None) -> None:
    """Print the A/B table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="wall clock or process CPU time"
    )
    args = parser.parse_args(argv)
    sides = {"before": args.before, "after": ROOT}
    step_s: dict[str, list[float]] = {name: [] for name in sides}
    own_s: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            total, own = measure(sides[name], args.steps, args.warmup, args.clock)
            step_s[name].append(total)
            own_s[name].append(own)
    print("| side | median step (ms) | fvstep's own part (ms) | own: min - max |")
    print("|---|---|---|---|")
    for name in sides:
        v, o = step_s[name], own_s[name]
        print(
            f"| {name} | {statistics.median(v) * 1e3:.2f} | {statistics.median(o) * 1e3:.3f} "
            f"| {min(o) * 1e3:.3f} - {max(o) * 1e3:.3f} |"
        )
    for label, results in (("step", step_s), ("fvstep's own part", own_s)):
        ratios = [a / b for a, b in zip(results["after"], results["before"])]
        print(
            f"after / before, {label}: {statistics.median(ratios):.3f} (median of per-round "
            f"ratios; min {min(ratios):.3f}, max {max(ratios):.3f})"
        )
    print(
        f"({args.rounds} rounds of {args.steps} steps after {args.warmup}, alternating; "
        f"{args.clock} clock)"
    )


if __name__ == "__main__":
    main()
