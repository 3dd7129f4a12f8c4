"""The compile guard at the real shape on one GPU: its margin, what it catches, what it costs.

    python tests/gpu/compile_check.py --out compile_guard.json        # one H200, ~5 min

Two Wan2.1-1.3B blocks (the real config: dim 1536, 12 heads, ffn 8960, text dim 4096;
random init, seed 0) at 480x832x81 (32,760 video tokens, 512 text tokens), prepared with
Inductor per block and ``verify_compile=True``, run one flow-matching forward and
backward (the checked step: each block compares its compiled gradients with its eager
ones, and below fp32 with an eager fp32 reference, on its real inputs, then runs) and a
second one (the plain compiled step: the graph was checked). Each variant starts from the
same weights and inputs after ``torch._dynamo.reset()``, under bf16 autocast and in fp32
(TF32 off):

- ``mix``: ``triton.mix_order_reduction`` forced on (torch's default,
  pytorch/pytorch#193061), full activation checkpointing: the guard must refuse it;
- ``healthy``: fvstep's Inductor options (the pass off), in every ``prepare``
  checkpointing mode (``none``, ``full``, ``selective``, ``attention``, ``narrow``): the
  guard must pass.

Each row: the verdict, the worst ratio (compiled error / eager rounding noise) against the
threshold, the worst tensor's error and noise, every tensor's numbers, and the cost: the
check of ``blocks.1`` (``blocks.0``'s also compiles the graph both share), its fp32
reference, against the plain compiled step of both blocks. It prints a table and writes
one JSON (``--out``). A CPU dry run of the code path:

    python tests/gpu/compile_check.py --out /tmp/g.json --device cpu --tokens 64 \\
        --compile-backend aot_eager --modes none
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import attrs
import torch

if not __package__:  # run as a file: fvstep and benchmarks from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.presets import PRESETS, build_model, make_batch
from fvstep.methods.models import predict
from fvstep.parallel.compile_check import (
    DEFAULT_THRESHOLD,
    CompiledGradientError,
    compile_check_reports,
)
from fvstep.parallel.prepare import prepare

MODES = ("none", "full", "selective", "attention", "narrow")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_once(model: torch.nn.Module, batch: dict, device: torch.device, bf16: bool) -> float:
    """One flow-matching forward and backward; its wall time."""
    x0, text = batch["latents"], batch["text"]
    gen = torch.Generator(device).manual_seed(1)
    eps = torch.randn(x0.shape, generator=gen, device=device)
    t = torch.full((1,), 0.6, device=device)
    xt = (1 - t) * x0 + t * eps
    _sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        v = predict(model, xt, t * 1000, text)
    torch.nn.functional.mse_loss(v.float(), eps - x0).backward()
    _sync(device)
    return time.perf_counter() - start


def run_variant(
    preset: Any, mode: str, bf16: bool, mix: bool, device: torch.device, backend: str
) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    model = build_model(preset, device=device)
    compile_args: dict[str, Any] = {"backend": backend}
    if mix and backend == "inductor":  # the Inductor pass prepare turns off, forced back on
        compile_args["options"] = {"triton.mix_order_reduction": True}
    prepare(model, checkpointing=None if mode == "none" else mode, compile=compile_args,
            verify_compile=True)  # fmt: skip
    batch = make_batch(preset, 1, device=device, seed=0)
    row: dict[str, Any] = {
        "variant": "mix" if mix else "healthy",
        "precision": "bf16" if bf16 else "fp32",
        "checkpointing": mode,
    }
    start = time.perf_counter()
    try:
        row["checked_step_s"] = step_once(model, batch, device, bf16)
        row["verdict"] = "passed"
    except CompiledGradientError as error:
        row["checked_step_s"] = time.perf_counter() - start
        row["verdict"] = "refused"
        row["error"] = str(error).splitlines()[0]
    reports = compile_check_reports(model)
    row["reports"] = [r.describe() for r in reports]
    row["tensors"] = {
        r.block: [
            {**attrs.asdict(d), "graph_ratio": d.graph_ratio, "fp32_ratio": d.fp32_ratio}
            for d in r.differences
        ]
        for r in reports
    }
    worst = max(reports, key=lambda r: r.worst_ratio, default=None)
    if worst is not None:
        summary = worst.describe()
        row.update({k: v for k, v in summary.items() if k.startswith("worst_")})
        row.update(
            threshold=worst.threshold,
            margin=summary["margin"],
            worst_tensor=f"{worst.block} {summary['worst']}",
        )
    if row["verdict"] == "passed":
        # blocks.0's check also compiled the graph both blocks share: blocks.1's is the
        # check's own cost, against the plain compiled step that follows (both blocks).
        row["check_s_block1"] = reports[-1].seconds if len(reports) > 1 else None
        row["reference_s_block1"] = reports[-1].reference_seconds if len(reports) > 1 else None
        model.zero_grad(set_to_none=True)
        row["plain_step_s"] = step_once(model, batch, device, bf16)
        row["checks_after_plain_step"] = len(compile_check_reports(model))
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "variant  prec  checkpointing  verdict   ratio      threshold  margin    worst tensor"
        "                        graph     fp32      error     noise     check s  ref s  step s"
    )
    lines = [head, "-" * len(head)]

    def f(value: Any, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) else str(value)

    for r in rows:
        if "unexpected_error" in r:
            lines.append(f"{r['variant']:8} {r['precision']:5} {r['checkpointing']:14} ERROR "
                         f"{r['unexpected_error'][:80]}")  # fmt: skip
            continue
        lines.append(
            f"{r['variant']:8} {r['precision']:5} {r['checkpointing']:14} {r['verdict']:9} "
            f"{f(r.get('worst_ratio'), '9.3g')}  {f(r.get('threshold'), '9g')}  "
            f"{f(r.get('margin'), '8.3g')}  {r.get('worst_tensor', ''):34}  "
            f"{f(r.get('worst_graph_ratio'), '8.3g')}  {f(r.get('worst_fp32_ratio'), '8.3g')}  "
            f"{f(r.get('worst_relative_error'), '8.2g')}  {f(r.get('worst_relative_noise'), '8.2g')}  "
            f"{f(r.get('check_s_block1'), '7.3f')}  {f(r.get('reference_s_block1'), '5.2f')}  "
            f"{f(r.get('plain_step_s'), '6.3f')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None,
                        help="video tokens a sample (default the preset's 32,760)")  # fmt: skip
    parser.add_argument("--modes", default=",".join(MODES), help="healthy checkpointing modes")
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--skip-mix", action="store_true", help="no mix_order_reduction row")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-backend", default="inductor", help="aot_eager: a CPU dry run")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    base = PRESETS["wan-1.3b-480p"]
    preset = dataclasses.replace(base, config=dict(base.config, num_layers=args.layers))
    if args.tokens is not None:  # one frame of 2 x 2*tokens latents: `tokens` patches
        preset = dataclasses.replace(preset, latent_shape=(16, 1, 2, 2 * args.tokens))
    plan = [
        (mode, precision == "bf16", mix)
        for precision in args.precisions.split(",")
        for mix, modes in ((True, ["full"]), (False, args.modes.split(",")))
        if not (mix and args.skip_mix)
        for mode in modes
    ]
    info = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "layers": args.layers,
        "tokens": preset.num_tokens,
        "text_tokens": preset.text_len,
        "backend": args.compile_backend,
        "default_threshold": DEFAULT_THRESHOLD,
        "date": time.strftime("%Y-%m-%d"),
    }
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for mode, bf16, mix in plan:
        try:
            row = run_variant(preset, mode, bf16, mix, device, args.compile_backend)
        except Exception as error:  # report and go on: this is a measurement
            row = {
                "variant": "mix" if mix else "healthy",
                "precision": "bf16" if bf16 else "fp32",
                "checkpointing": mode,
                "unexpected_error": repr(error)[:2000],
                "traceback": traceback.format_exc().splitlines()[-60:],
            }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tensors"}), flush=True)
        info["wall_s"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(_table(rows), flush=True)


if __name__ == "__main__":
    main()
