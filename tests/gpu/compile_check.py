"""The compile check at the real shape on one GPU: what it costs, and what it catches.

    python -m tests.gpu.compile_check --json compile_check.json [--layers 30] [--variants safe,mix,fp32]

One Wan2.1-1.3B-shaped transformer (``--layers`` blocks, random init, seed 0) at
480x832x81 (32,760 video tokens and 512 text tokens), prepared with full activation
checkpointing and Inductor per block and ``verify_compile=True``, runs one flow-matching
forward and backward (the checked step: each block compares its compiled gradients with
its eager ones on its real inputs, then runs) and a second one (unchecked: every pattern
was checked). Variants, each from the same weights and inputs, in one process after
``torch._dynamo.reset()``:

- ``safe``: bf16 autocast, fvstep's Inductor options (``SAFE_INDUCTOR_OPTIONS``): the
  check must pass, and its cost is measured;
- ``mix``: the same with ``triton.mix_order_reduction`` turned back on (torch's default,
  pytorch/pytorch#193061): the check must refuse it, naming the block and the parameter;
- ``fp32``: no autocast, safe options (TF32 off): the rounding difference in fp32.

It prints, per variant, a JSON row: the step times and peak memory of the checked and the
unchecked step, each block's report (worst tensor, relative error, seconds), or the
error's message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
import traceback
from typing import Any

import attrs
import torch

from benchmarks.presets import PRESETS, build_model, make_batch
from fvstep.models import predict
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.compile_check import CompiledGradientError
from fvstep.parallel.compile_check_hooks import compile_check_reports
from fvstep.parallel.prepare import prepare


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def step_once(model: torch.nn.Module, batch: dict, device: torch.device, autocast: bool) -> float:
    x0, text = batch["latents"], batch["text"]
    gen = torch.Generator(device).manual_seed(1)
    eps = torch.randn(x0.shape, generator=gen, device=device)
    t = torch.full((1,), 0.6, device=device)
    xt = (1 - t) * x0 + t * eps
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    _sync(device)
    start = time.perf_counter()
    with ctx:
        v = predict(model, xt, t * 1000, text)
    loss = torch.nn.functional.mse_loss(v.float(), eps - x0)
    loss.backward()
    _sync(device)
    return time.perf_counter() - start


def run_variant(
    preset: Any, layers: int, variant: str, device: torch.device, backend: str = "inductor"
) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    model = build_model(
        dataclasses.replace(preset, config=dict(preset.config, num_layers=layers)), device=device
    )
    compile_args: dict[str, Any] = {"backend": backend}
    if variant.startswith("mix"):  # the Inductor pass prepare turns off, turned back on
        compile_args["options"] = {"triton.mix_order_reduction": True}
    prepare(model, checkpointing="full", compile=compile_args, verify_compile=True)
    batch = make_batch(preset, 1, device=device, seed=0)
    autocast = not variant.endswith("fp32")
    row: dict[str, Any] = {"variant": variant, "layers": layers}
    graphs = compile_counts()["graphs"]
    _reset_peak(device)
    start = time.perf_counter()
    try:
        row["checked_step_s"] = step_once(model, batch, device, autocast)
    except CompiledGradientError as error:
        row["raised_after_s"] = time.perf_counter() - start
        row["error"] = str(error)
        report = error.report
        row["failing_report"] = None if report is None else report.describe()
        row["failures"] = [] if report is None else [attrs.asdict(d) for d in report.failures[:8]]
        row["reports"] = [r.describe() for r in compile_check_reports(model)]
        return row
    row["checked_step_peak_gib"] = _peak_gib(device)
    reports = compile_check_reports(model)
    row["reports"] = [r.describe() for r in reports]
    seconds = [r.seconds for r in reports]
    # Block 0's comparison also compiles the graph (forward and backward) that all blocks
    # share: its time is compile time. The others' is the check's own cost.
    row["check_s_block0_with_compile"] = seconds[0] if seconds else None
    rest = seconds[1:]
    row["check_s_per_block_median"] = sorted(rest)[len(rest) // 2] if rest else None
    row["check_s_total_excluding_block0"] = sum(rest)
    row["worst_relative_error"] = max(
        (r.worst.relative_error for r in reports if r.worst), default=None
    )
    model.zero_grad(set_to_none=True)
    _reset_peak(device)
    row["unchecked_step_s"] = step_once(model, batch, device, autocast)
    row["unchecked_step_peak_gib"] = _peak_gib(device)
    row["reports_after_second_step"] = len(compile_check_reports(model))
    row["graphs"] = compile_counts()["graphs"] - graphs
    return row


def _short_traceback() -> list[str]:
    # A RecursionError's traceback repeats one cycle: its first and last frames say which.
    lines = traceback.format_exc().splitlines()
    return lines if len(lines) <= 160 else [*lines[:80], "...", *lines[-80:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--preset", default="wan-1.3b-480p")
    parser.add_argument("--variants", default="safe,mix,fp32")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-backend", default="inductor", help="aot_eager: a CPU smoke run")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    preset = PRESETS[args.preset]
    rows = []
    for variant in args.variants.split(","):
        try:
            row = run_variant(preset, args.layers, variant, device, args.compile_backend)
        except Exception as error:  # report and go on: this is a measurement
            row = {
                "variant": variant,
                "unexpected_error": repr(error)[:2000],
                "traceback": _short_traceback(),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "preset": preset.name,
        "latents": list(preset.latent_shape),
        "checkpointing": "full",
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
