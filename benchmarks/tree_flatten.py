"""Time flatten + unflatten of a TrainState with 1,000 parameters (median over runs).

Usage: python -m benchmarks.tree_flatten [--params 1000] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import optree
import torch

import fvstep as fs
from fvstep.core.tree import NAMESPACE


def build_state(num_params: int) -> fs.TrainState:
    # num_params / 2 Linear layers (weight + bias), AdamW: 4 leaves per param + 1 step each.
    layers = [torch.nn.Linear(4, 4) for _ in range(num_params // 2)]
    module = torch.nn.Sequential(*layers)
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    state: Any = build_state(args.params)  # optree's PyTree type does not know attrs classes
    num_leaves = len(optree.tree_leaves(state, namespace=NAMESPACE))
    timings: dict[str, list[float]] = {"flatten": [], "unflatten": [], "flatten_with_path": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        leaves, spec = optree.tree_flatten(state, namespace=NAMESPACE)
        t1 = time.perf_counter()
        optree.tree_unflatten(spec, leaves)
        t2 = time.perf_counter()
        optree.tree_flatten_with_path(state, namespace=NAMESPACE)
        t3 = time.perf_counter()
        timings["flatten"].append(t1 - t0)
        timings["unflatten"].append(t2 - t1)
        timings["flatten_with_path"].append(t3 - t2)
    print(f"TrainState: {args.params} parameters, {num_leaves} leaves, {args.repeats} runs")
    print(f"{'operation':<20} {'median µs':>10} {'min µs':>10} {'max µs':>10}")
    for name, values in timings.items():
        us = [v * 1e6 for v in values]
        print(f"{name:<20} {statistics.median(us):>10.1f} {min(us):>10.1f} {max(us):>10.1f}")
    total = [(a + b) * 1e6 for a, b in zip(timings["flatten"], timings["unflatten"])]
    print(
        f"{'flatten+unflatten':<20} {statistics.median(total):>10.1f} {min(total):>10.1f} {max(total):>10.1f}"
    )


if __name__ == "__main__":
    main()
