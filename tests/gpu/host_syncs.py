"""Host synchronisations per step on the default path, and what the one left costs (GPU).

A fine-tune step of a Wan-shaped model (Wan2.1-1.3B's widths, ``--layers`` blocks,
bf16 autocast, fused AdamW, clipping, EMA, 2 micro-batches) runs under
``torch.cuda.set_sync_debug_mode("warn")``; each warning is one operation that made the
host wait for the GPU. Counted for ``sanitize="error"`` (the default), ``"skip"`` and
``None``, then timed side by side (alternating rounds, medians).

Usage (from the repository root, on a GPU machine):
    python -m tests.gpu.host_syncs --layers 8 --frames 5 --height 30 --width 52 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import fvstep as fs
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import synthetic_batch, tiny_wan

POLICIES = {"error": "error", "skip": "skip", "none": None}


def build(args: argparse.Namespace, sanitize: object) -> tuple[fs.TrainState, fs.Step, dict]:
    """A Wan-shaped state, the step for ``sanitize``, one batch."""
    net = tiny_wan(
        seed=0,
        num_layers=args.layers,
        in_channels=16,
        dim_per_head=128,
        num_heads=12,
        text_dim=4096,
        ffn_dim=8960,
        freq_dim=256,
        rope_max_seq_len=1024,
    ).cuda()
    state = fs.TrainState.create(
        {"student": fs.Role(net, optimizer=fs.optim.adamw(lr=1e-5, fused=True), ema=fs.EMA(0.99))},
        key=fs.random.key(0),
    )
    loss = flow_matching_loss()

    def autocast_loss(state, batch, key):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss(state, batch, key)

    step = fs.compile(
        fs.update("student", autocast_loss, name="finetune"),
        accumulation=fs.Accumulation(2),
        clip=fs.clip_grad_norm(1.0),
        sanitize=sanitize,  # type: ignore[arg-type]
    )
    batch = synthetic_batch(
        fs.random.key(1),
        batch_size=2,
        channels=16,
        frames=args.frames,
        height=args.height,
        width=args.width,
        text_len=512,
        text_dim=4096,
        device="cuda",
    )
    return state, step, batch


def count_syncs(
    state: fs.TrainState, step: fs.Step, batch: dict
) -> tuple[fs.TrainState, list[str]]:
    """One step under the sync debug mode: the messages of the synchronising operations."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = step(state, batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return state, [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def main() -> None:
    """Count and time; print a table; write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--height", type=int, default=30)
    parser.add_argument("--width", type=int, default=52)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out: dict = {"args": vars(args), "syncs": {}, "step_s": {p: [] for p in POLICIES}}
    runs = {}
    for name, sanitize in POLICIES.items():
        state, step, batch = build(args, sanitize)
        for _ in range(2):  # warm up: cuBLAS handles, allocator
            state, _ = step(state, batch)
        state, syncs = count_syncs(state, step, batch)
        out["syncs"][name] = syncs
        runs[name] = [state, step, batch]
    for r in range(args.rounds):
        order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
        for name in order:
            state, step, batch = runs[name]
            torch.cuda.synchronize()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                state, _ = step(state, batch)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            runs[name][0] = state
            out["step_s"][name].append(statistics.median(times))
    tokens = args.frames * (args.height // 2) * (args.width // 2)
    print(f"{args.layers} Wan-1.3B blocks, {tokens} video tokens, 2 micro-batches of 1")
    print("| sanitize | host syncs in one step | median step (ms) |")
    print("|---|---|---|")
    base = statistics.median(out["step_s"]["none"])
    for name in POLICIES:
        med = statistics.median(out["step_s"][name])
        print(
            f"| {name} | {len(out['syncs'][name])} | {med * 1e3:.2f} ({med / base:.4f}x of none) |"
        )
    for name, syncs in out["syncs"].items():
        for s in syncs:
            print(f"  {name}: {s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
