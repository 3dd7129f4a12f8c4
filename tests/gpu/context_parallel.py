"""Context parallel at the real shape: a 2-way step against the 1-GPU step of the same sample.

Run twice, the 1-GPU reference first (it writes the state after its first step to
``--reference``), then the context-parallel run (it reads it and compares):

    python -m torch.distributed.run --standalone --nproc_per_node 1 \
        -m tests.gpu.context_parallel --mode single --reference /tmp/cp_ref.pt \
        --json cp_single.json
    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m tests.gpu.context_parallel --mode cp --reference /tmp/cp_ref.pt --json cp.json

CPU smoke run (gloo): the same with ``--device cpu --preset tiny-wan``.

The step: ``fvstep.methods.finetune`` (flow matching) of a Wan2.1-1.3B-shaped transformer
(``--preset wan-1.3b-480p``: latents 16x21x60x104, 32,760 video tokens and 512 text
tokens; random init, seed 0), one sample, AdamW, ``clip_grad_norm(1.0)``; the role is
prepared by ``fvstep.parallel.prepare`` with full activation checkpointing, FSDP2 over
every rank and bf16 compute over fp32 masters (no compile: compile with context parallel
fails, docs/concepts/context-parallel.md). ``--mode cp``: ``prepare(...,
context_mesh=make_context_mesh(context=world))`` (Ulysses by default: diffusers'
``apply_context_parallel`` first), every rank the same sample,
``parallelism=Layout(mesh)``; ``--mode single``: the same on one rank with ``Layout()``.

Reported (one JSON line each, rank 0, as soon as known): the first step (its time, loss,
grad norm, peak memory); in ``cp`` mode, the comparison with the reference's first step
(relative differences of loss and grad norm; max abs and relative differences of the
parameters and of AdamW's first moment, ``0.1 x`` the clipped gradient; whether the CPU
tests' tolerances hold — stated for fp32 there, so bf16 here may miss them); then the
median step time of ``--steps`` further steps and their peak memory.
Deterministic algorithms are on by default (``CUBLAS_WORKSPACE_CONFIG=:4096:8``); a
failure is reported as a JSON line with ``"error"``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import time
import traceback
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist

import fvstep as fs
from benchmarks.presets import PRESETS, build_model, make_batch
from fvstep import parallel as fsp
from fvstep.methods.finetune import finetune
from fvstep.parallel import Layout, make_context_mesh
from fvstep.parallel.prepare import prepare

# The tolerances of tests/test_context_parallel.py (fp32, tiny Wan, 2 steps).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-7}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}
MOMENT_TOL = {"rtol": 1e-4, "atol": 1e-9}


def emit(rank: int, record: dict, out: list) -> None:
    if rank == 0:
        out.append(record)
        print(json.dumps(record), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def build(args, device: torch.device):
    """The prepared role, the initial state and the step function of ``args.mode``."""
    preset = PRESETS[args.preset]
    model = build_model(preset, device=device, seed=0)
    cp_mesh = None
    if args.mode == "cp":
        cp_mesh = make_context_mesh(context=dist.get_world_size(), device_type=device.type)
    model = prepare(
        model,
        mesh=fsp.make_mesh(device_type=device.type),
        checkpointing=args.checkpointing,
        param_dtype=None if args.fp32 else torch.bfloat16,
        attention_backend=args.attention_backend,
        context_mesh=cp_mesh,
        context_mode=args.cp_mode,
    )
    state = fs.TrainState.create(
        {"student": fs.Role(model, optimizer=fs.optim.adamw(lr=args.lr, weight_decay=0.01))},
        key=fs.random.key(0),
    )
    # The role is FSDP2-sharded in both modes: the step is called with the layout.
    step = fs.compile(finetune(), clip=fs.clip_grad_norm(1.0))
    return state, functools.partial(step, parallelism=Layout(cp_mesh))


def full(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def compare(state, reference: dict | None, metrics: dict, rank: int, device) -> dict:
    """Differences of the first step's loss, grad norm, parameters and first moments."""
    role = state.roles["student"]
    result: dict[str, Any] = {}
    if reference is not None:
        for key in ("loss", "grad_norm"):
            value = float(metrics[f"student/{key}"])
            result[f"{key}_rel_diff"] = rel(value, reference[key])
            result[f"{key}_within_test_tol"] = abs(value - reference[key]) <= LOSS_TOL[
                "atol"
            ] + LOSS_TOL["rtol"] * abs(reference[key])
    groups = {"params": role.params, "exp_avg": role.opt_state.exp_avg}
    tols = {"params": PARAM_TOL, "exp_avg": MOMENT_TOL}
    for group, tensors in groups.items():
        worst_abs, worst_rel, worst_norm, within = 0.0, 0.0, 0.0, True
        worst_name = None
        sq_diff, sq_ref = 0.0, 0.0
        for name, x in tensors.items():
            ours = full(x).detach().float()  # every rank: a collective
            if reference is None:
                continue
            theirs = reference[group][name].to(ours.device, non_blocking=True).float()
            diff = (ours - theirs).abs()
            scale = theirs.abs().max().item()
            d = diff.max().item() if diff.numel() else 0.0
            sq_diff += float(diff.double().square().sum())
            sq_ref += float(theirs.double().square().sum())
            norm_rel = float(diff.double().norm() / theirs.double().norm().clamp_min(1e-30))
            if d > worst_abs:
                worst_abs, worst_name = d, name
            worst_rel = max(worst_rel, d / max(scale, 1e-30))
            worst_norm = max(worst_norm, norm_rel)
            within = within and bool(
                torch.allclose(ours, theirs, rtol=tols[group]["rtol"], atol=tols[group]["atol"])
            )
        if reference is not None:
            result[group] = {
                "max_abs_diff": worst_abs,
                "max_abs_diff_at": worst_name,
                "max_rel_diff_to_tensor_max": worst_rel,
                "max_tensor_rel_norm_diff": worst_norm,
                "global_rel_norm_diff": (sq_diff / max(sq_ref, 1e-300)) ** 0.5,
                "within_test_tol": within,
            }
    return result


def save_reference(state, metrics: dict, path: str) -> float:
    """Write the first step's loss, grad norm, parameters and first moments (one rank)."""
    t0 = time.perf_counter()
    role = state.roles["student"]
    payload = {
        "loss": float(metrics["student/loss"]),
        "grad_norm": float(metrics["student/grad_norm"]),
        "params": {n: full(p).detach().cpu() for n, p in role.params.items()},
        "exp_avg": {n: full(m).detach().cpu() for n, m in role.opt_state.exp_avg.items()},
    }
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["single", "cp"], required=True)
    parser.add_argument("--reference", default=None, help="the 1-rank step's state (.pt)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="wan-1.3b-480p", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--cp-mode", default="ulysses", choices=["ulysses", "ring"])
    parser.add_argument(
        "--attention-backend", default=None, help="diffusers backend (default: native SDPA)"
    )
    parser.add_argument("--checkpointing", default="full", choices=["none", "full", "selective"])
    parser.add_argument("--fp32", action="store_true", help="fp32 compute (no param_dtype)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    parser.add_argument("--timeout-s", type=int, default=300)
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        # Filling every new allocation with NaN would slow the timed steps.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    preset = PRESETS[args.preset]
    out: list[dict] = []
    header = {
        "mode": args.mode,
        "machine": f"{world} x {torch.cuda.get_device_name(device) if cuda else 'CPU'}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": preset.name,
        "tokens": preset.num_tokens,
        "text_tokens": preset.text_len,
        "cp_mode": args.cp_mode if args.mode == "cp" else None,
        "attention_backend": args.attention_backend or "native",
        "checkpointing": args.checkpointing,
        "compute_dtype": "fp32" if args.fp32 else "bf16",
        "deterministic": args.deterministic,
    }
    emit(rank, header, out)
    try:
        if args.mode == "cp" and world < 2:
            raise ValueError("--mode cp needs 2 or more ranks (torchrun --nproc_per_node 2)")
        if args.mode == "single" and world != 1:
            raise ValueError("--mode single runs on one rank (torchrun --nproc_per_node 1)")
        t0 = time.perf_counter()
        state, step = build(args, device)
        sync(device)
        build_s = time.perf_counter() - t0
        batch = make_batch(preset, 1, device=device, seed=1)  # the same sample on every rank

        reset_peak(device)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        sync(device)
        first = {
            "result": "first_step",
            "build_s": build_s,
            "step_s": time.perf_counter() - t0,
            "loss": float(metrics["student/loss"]),
            "grad_norm": float(metrics["student/grad_norm"]),
            "peak_gib": peak_gib(device),
        }
        emit(rank, first, out)

        if args.mode == "single" and args.reference:
            seconds = save_reference(state, metrics, args.reference)
            emit(rank, {"result": "reference_saved", "path": args.reference, "s": seconds}, out)
        elif args.mode == "cp":
            reference = None
            if rank == 0 and args.reference and os.path.exists(args.reference):
                reference = torch.load(args.reference, map_location="cpu", mmap=True)
            t0 = time.perf_counter()
            diffs = compare(state, reference, metrics, rank, device)
            if reference is None:
                diffs["skipped"] = f"no reference at {args.reference!r}"
            emit(
                rank,
                {
                    "result": "cp_vs_single_after_one_step",
                    "test_tolerances": {
                        "loss_and_grad_norm": LOSS_TOL,
                        "params": PARAM_TOL,
                        "exp_avg": MOMENT_TOL,
                    },
                    **diffs,
                    "s": time.perf_counter() - t0,
                },
                out,
            )
            del reference
            if cuda:
                torch.cuda.empty_cache()

        reset_peak(device)
        times, losses = [], []
        for _ in range(args.steps):
            sync(device)
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["student/loss"]))
        emit(
            rank,
            {
                "result": "timing",
                "median_step_s": statistics.median(times) if times else None,
                "step_s": times,
                "losses": losses,
                "tokens_per_s": preset.num_tokens / statistics.median(times) if times else None,
                "peak_gib": peak_gib(device),
            },
            out,
        )
    except Exception as e:
        emit(
            rank,
            {
                "result": "error",
                "error": f"{type(e).__name__}: {e}"[:500],
                "traceback": traceback.format_exc()[-2000:],
            },
            out,
        )
        if rank != 0:  # rank 0 prints; the others say which rank failed
            print(json.dumps({"rank": rank, "error": f"{type(e).__name__}: {e}"[:300]}))
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
