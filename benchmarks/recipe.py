"""Time a recipe as ``fvstep train`` builds it: the path users get, step by step.

The run is what :func:`fvstep.recipes.running.train` runs (the same ``prepare_run``: the
config checked and written, the roles prepared, the data, the run options); the only
addition is a callback that waits for the device after each step and notes the time, so a
step's time is its own. Prints a table (median of the steps after ``--warmup``, overall
and for each kind of step, named by the losses it logs: DMD2's critic-only and
student+critic steps apart; the peak memory the allocator saw; the last loss) and, with
``--json``, writes it with every step's time.

Usage (from the repository root; every word after the recipe is ``fvstep train``'s):
    python -m benchmarks.recipe --json out.json -- finetune \\
        --config examples/wan2.1_1.3b_finetune.yaml --run.num_steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from fvstep.recipes import get_recipe
from fvstep.recipes.config import parse_options
from fvstep.recipes.running import prepare_run, run_prepared


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_recipe(name: str, argv: list[str], *, warmup: int) -> dict[str, Any]:
    """Run recipe ``name`` with ``argv`` and time each step (after a device sync).

    Returns:
        ``{"recipe", "argv", "seconds": {"median", "min", "max", "steps"}, "by_kind":
        {kind: the same}, "times", "kinds", "peak_gib", "first_step_s", "losses"}``.
    """
    from fvstep.recipes.parts import device_for

    recipe = get_recipe(name)
    options = parse_options(recipe, argv)
    device = device_for(options.run)
    spec = prepare_run(recipe, options, log=lambda line: None)
    if device.type == "cuda":  # after the build: CUDA is initialised, the weights are in
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    kinds: list[str] = []
    losses: list[float] = []
    last = [time.perf_counter()]

    def on_metrics(step: int, metrics: dict[str, Any]) -> None:
        _sync(device)
        now = time.perf_counter()
        times.append(now - last[0])
        kinds.append("+".join(sorted(k for k in metrics if k.endswith("loss"))) or "step")
        last[0] = now
        loss = next((v for k, v in metrics.items() if k.endswith("loss")), None)
        if loss is not None:
            losses.append(float(loss))

    try:
        _sync(device)
        last[0] = time.perf_counter()
        run_prepared(spec, options, on_metrics=on_metrics)  # what fvstep train runs
    finally:
        spec.close()
    timed = times[warmup:] or times

    def summary(seconds: list[float]) -> dict[str, Any]:
        return {
            "median": statistics.median(seconds),
            "min": min(seconds),
            "max": max(seconds),
            "steps": len(seconds),
        }

    by_kind: dict[str, list[float]] = {}
    for kind, seconds in list(zip(kinds, times))[warmup:] or zip(kinds, times):
        by_kind.setdefault(kind, []).append(seconds)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "recipe": name,
        "argv": argv,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "seconds": summary(timed),
        "by_kind": {kind: summary(seconds) for kind, seconds in by_kind.items()},
        "times": times,
        "kinds": kinds,
        "first_step_s": times[0] if times else None,
        "peak_gib": peak,
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> int:
    """Time one recipe and print a table; ``--json`` writes the result."""
    words = sys.argv[1:] if argv is None else argv
    cut = words.index("--") if "--" in words else len(words)
    ours, theirs = words[:cut], words[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recipe")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    args = parser.parse_args(ours)
    if not theirs:
        parser.error("give the recipe and its options after --")
    result = time_recipe(theirs[0], theirs[1:], warmup=args.warmup)
    peak = f"{result['peak_gib']:.1f} GiB" if result["peak_gib"] is not None else "-"
    print(
        "| recipe | device | steps | median s/step (min-max, n) | first step s | peak | last loss |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = {"all": result["seconds"]}
    if len(result["by_kind"]) > 1:
        rows.update(result["by_kind"])
    for kind, s in rows.items():
        print(
            f"| {result['recipe']} | {result['gpu'] or result['device']} | {kind} | "
            f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, {s['steps']}) | "
            f"{result['first_step_s']:.1f} | {peak} | "
            f"{result['losses'][-1] if result['losses'] else '-'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
