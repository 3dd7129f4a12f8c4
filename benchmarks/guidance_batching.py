"""Classifier-free guidance: the teacher's conditional and unconditional calls, apart or batched.

DMD2's and self-forcing's frozen teacher runs twice a student step without gradient: on
the text and on the null text. Batching them (one call on ``2B`` samples) does the same
FLOPs; the question is whether the kernels run faster on the larger batch. This times both
on a teacher prepared as the methods' benchmark prepares it (:func:`fvstep.parallel.prepare`,
frozen, bf16 storage, ``--compile``), under bf16 autocast on CUDA, and checks that the
outputs agree (batched matmuls may round differently).

Examples:
    $ python -m benchmarks.guidance_batching --preset wan-1.3b-480p --device cuda --compile
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch

from benchmarks import common as c
from benchmarks.presets import PRESETS, build_model, make_batch
from fvstep import parallel as fsp
from fvstep.methods.models import predict

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.guidance_batching",
        description="The teacher's two guidance calls apart vs batched into one.",
    )
    parser.add_argument("--preset", choices=tuple(PRESETS), default="wan-1.3b-480p")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="compile the teacher's blocks")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the median seconds of both ways and their ratio."""
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    preset = PRESETS[args.preset]
    teacher = fsp.prepare(
        build_model(preset, device=device, seed=0),
        trainable=False,
        compile=args.compile,
        checkpointing="none",
    )
    batch = make_batch(preset, 1, device=device, seed=0)
    x, text = batch["latents"], batch["text"]
    t = torch.full((1,), 500.0, device=device)
    null = torch.zeros_like(text)
    cuda = device.type == "cuda"
    scope = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def apart() -> tuple[torch.Tensor, torch.Tensor]:
        return predict(teacher, x, t, text), predict(teacher, x, t, null)

    def batched() -> tuple[torch.Tensor, torch.Tensor]:
        v = predict(teacher, torch.cat([x, x]), torch.cat([t, t]), torch.cat([text, null]))
        return v[:1], v[1:]

    times: dict[str, list[float]] = {"apart": [], "batched": []}
    with torch.no_grad(), scope:
        outputs = {"apart": apart(), "batched": batched()}
        for _ in range(2):  # warm-up (compiles the batch-2 graph too)
            apart(), batched()
        for _ in range(args.repeats):  # interleaved, so drift cancels
            times["apart"].append(c.time_call(apart, device)[0])
            times["batched"].append(c.time_call(batched, device)[0])
    diff = max(
        float((a.float() - b.float()).abs().max())
        for a, b in zip(outputs["apart"], outputs["batched"], strict=True)
    )
    median = {k: statistics.median(v) for k, v in times.items()}
    c.print_table(
        ["teacher calls", "median s", "vs apart"],
        [[k, f"{m:.4f}", f"{m / median['apart']:.3f}x"] for k, m in median.items()],
    )
    print(f"max |apart - batched| over both outputs: {diff:.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
