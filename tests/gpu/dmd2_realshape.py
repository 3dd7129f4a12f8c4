"""DMD2 at the real workload on GPUs, run several times: finite and bitwise repeatable?

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m tests.gpu.dmd2_realshape --runs 3 --steps 20 --json dmd2_runs.json

The setup of issue 10 item 7 (an intermittent NaN): ``fvstep.methods.dmd2`` with its
default options (fused ordering, generator every 5 steps), three roles of the Wan2.1-1.3B
shape (random init; student = a copy of the teacher), each sharded *by hand* as users do —
``checkpoint_wrapper`` on each block, then ``block.compile()``, then ``fully_shard`` per block
and at the root with torch's defaults and ``MixedPrecisionPolicy(bf16 params, fp32
reduce)`` over fp32 masters; latents 16×21×60×104 (480×832, 81 frames: 32,760 tokens),
512 text tokens, one sample per rank; AdamW lr 1e-5; clip 1.0. Deterministic algorithms
are on, so runs of the same code must agree bit for bit; a difference means a race.

Each run rebuilds every model and the state from the same seeds. Printed and written to
``--json``: per run, every step's losses (finite?), step times, the digest of every role's
parameters (per rank), and whether all runs agree; also dynamo's recompile counts.
``--no-release`` replays fvstep's old behaviour (modules not returned to rest between units)
to compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fvstep as fs
from benchmarks.presets import PRESETS, build_model
from fvstep import parallel as fsd
from fvstep.core import tree
from fvstep.methods import dmd2
from fvstep.methods.models import synthetic_batch

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def prepare_by_hand(
    model: torch.nn.Module, mesh, compile_blocks: bool, ac: bool = True
) -> torch.nn.Module:
    """AC per block, then compile per block, then FSDP2 per block and at the root."""
    for i, block in enumerate(model.blocks):
        wrapped = checkpoint_wrapper(block) if ac else block
        if compile_blocks:
            wrapped.compile()
        model.blocks[i] = wrapped
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MP)
    fully_shard(model, mesh=mesh, mp_policy=MP)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_run(args, rank: int, device: torch.device, mesh) -> dict:
    preset = PRESETS[args.preset]
    c, f, h, w = args.latents
    teacher = build_model(preset, device=device, seed=1)
    student = build_model(preset, device=device, seed=1)
    critic = build_model(preset, device=device, seed=2)
    adamw = fs.optim.adamw(lr=1e-5)
    roles = {
        "student": fs.Role(prepare_by_hand(student, mesh, args.compile, args.ac), optimizer=adamw),
        "teacher": fs.Role(prepare_by_hand(teacher, mesh, args.compile, args.ac)),
        "critic": fs.Role(prepare_by_hand(critic, mesh, args.compile, args.ac), optimizer=adamw),
    }
    state = fs.TrainState.create(roles, key=fs.random.key(0))
    step = fs.compile(dmd2(), clip=fs.clip_grad_norm(1.0))
    rows = []
    for i in range(args.steps):
        batch = synthetic_batch(
            fs.random.fold_in(fs.random.fold_in(fs.random.key(7), i), rank),
            batch_size=1,
            channels=c,
            frames=f,
            height=h,
            width=w,
            text_len=args.text_len,
            text_dim=preset.config["text_dim"],
            device=device,
        )
        sync(device)
        t0 = time.perf_counter()
        state, metrics = step(state, batch, parallelism=fsd.Layout())
        losses = {k: float(v) for k, v in metrics.items() if k.endswith(("/loss", "/grad_norm"))}
        if i == 0:
            losses["nonfinite_params"] = {
                r: [
                    n for n, p in rs.params.items() if not bool(torch.isfinite(p.to_local()).all())
                ][:4]
                for r, rs in state.roles.items()
            }
        sync(device)
        rows.append({"step": i, "seconds": time.perf_counter() - t0, **losses})
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    digests = {r: tree.tree_digest(rs.params) for r, rs in state.roles.items()}
    finite = all(math.isfinite(v) for row in rows for k, v in row.items() if k.endswith("/loss"))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del state, roles, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "digests": digests, "finite": finite, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--no-release", action="store_true")
    parser.add_argument("--preset", default="wan-1.3b", help="tiny-wan for a CPU smoke run")
    parser.add_argument("--latents", type=int, nargs=4, default=(16, 21, 60, 104))
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    parser.add_argument(
        "--no-fill",
        dest="fill",
        action="store_false",
        help="deterministic algorithms without filling uninitialised memory with NaN",
    )
    parser.add_argument("--no-ac", dest="ac", action="store_false")
    args = parser.parse_args()
    if args.deterministic:
        # warn_only=False: with warn_only=True, cuDNN attention's backward stays
        # non-deterministic (it only warns), and runs differ in the last bits.
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = args.fill
    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    if args.no_release:
        fsd.FSDPGradSync.release = lambda self, state, after_error=False: None
    runs = []
    for r in range(args.runs):
        runs.append(one_run(args, rank, device, mesh))
        if rank == 0:
            print(f"run {r}: finite={runs[-1]['finite']} digests={runs[-1]['digests']}", flush=True)
    from torch._dynamo.utils import counters

    gathered = [None] * world
    mine = {
        "runs": runs,
        "recompiles": dict(counters["recompiles"]) if "recompiles" in counters else {},
        "frames": dict(counters["frames"]),
    }
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        agree = all(
            all(run["digests"] == g["runs"][0]["digests"] for run in g["runs"]) for g in gathered
        )
        out = {
            "machine": f"{world} x {torch.cuda.get_device_name(device) if cuda else 'CPU'}",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "compile": args.compile,
            "release": not args.no_release,
            "deterministic": args.deterministic,
            "fill_uninitialized_memory": args.deterministic and args.fill,
            "activation_checkpointing": args.ac,
            "all_finite": all(run["finite"] for g in gathered for run in g["runs"]),
            "runs_bitwise_equal": agree,
            "ranks": gathered,
        }
        print(json.dumps({k: v for k, v in out.items() if k != "ranks"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
