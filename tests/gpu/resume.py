"""The resume law on GPUs: DMD2 with prepared, sharded roles, interrupted at an odd step.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.gpu.resume \
        --json resume.json

CPU smoke run (gloo; compile with the ``aot_eager`` backend, no C++ toolchain):

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.gpu.resume \
        --device cpu --preset tiny-wan --compile-backend aot_eager

Per configuration (``none``: no activation checkpointing, no compile; ``full+compile``:
full activation checkpointing and ``torch.compile`` per block, Inductor by default):

1. three fresh roles, each prepared by ``fvstep.parallel.prepare`` (FSDP2 over every
   rank, bf16 compute over fp32 masters; the teacher frozen, ``trainable=False``), the
   student a copy of the teacher; ``fvstep.methods.dmd2(generator_update_interval=2)``,
   ``Accumulation(2)``, ``clip_grad_norm(1.0)``, AdamW; run ``--steps`` steps
   uninterrupted and keep a clone of the final state;
2. fresh roles again, run to the odd step ``--stop``, ``fvstep.checkpoint.save``;
3. fresh roles again (a restarted process), ``fvstep.checkpoint.load(path, like=...)``,
   run to ``--steps``;
4. compare the two final states bitwise (``fvstep.tree.assert_trees_equal(...,
   check_static=False)``, every rank its own shards).

Batches: the preset's shapes, one sample per micro-batch, keyed by
``fold_in(fold_in(key, step), rank)`` (different per data-parallel rank). Deterministic
algorithms are on (``CUBLAS_WORKSPACE_CONFIG=:4096:8``), so a difference means a
different computation. One JSON line is printed per configuration as soon as it is known
(rank 0); ``--json`` gets them all at the end. An error in a configuration is reported
in its line (``"error"``) and the next configuration still runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist

import fvstep as fs
from benchmarks.presets import PRESETS, Preset, build_model
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.core.random import fold_in
from fvstep.methods import dmd2
from fvstep.methods.models import synthetic_batch
from fvstep.parallel.prepare import prepare

CONFIGS = {
    "none": {"checkpointing": "none", "compile": False},
    "full+compile": {"checkpointing": "full", "compile": True},
}
K = 2


def batch_at(preset: Preset, step: int, rank: int, device: torch.device) -> dict:
    """The batch of ``step`` on ``rank``: ``make_batch``'s shapes, keyed per step and rank."""
    c, f, h, w = preset.latent_shape
    return synthetic_batch(
        fold_in(fold_in(fs.random.key(99), step), rank),
        batch_size=K,
        channels=c,
        frames=f,
        height=h,
        width=w,
        text_len=preset.text_len,
        text_dim=preset.config["text_dim"],
        device=device,
    )


def fresh(args, preset: Preset, device: torch.device, mesh, config: dict):
    """Three freshly built and prepared roles, the initial state and the step function."""
    compile_arg: bool | dict = False
    if config["compile"]:
        compile_arg = {"backend": args.compile_backend} if args.compile_backend else True
    options = {"mesh": mesh, "checkpointing": config["checkpointing"], "compile": compile_arg}
    student = prepare(
        build_model(preset, device=device, seed=1), param_dtype=torch.bfloat16, **options
    )
    teacher = prepare(build_model(preset, device=device, seed=1), trainable=False, **options)
    critic = prepare(
        build_model(preset, device=device, seed=2), param_dtype=torch.bfloat16, **options
    )
    if args.lazy_init_workaround:
        # FSDP2 fixes a group's gradient dtypes at its lazy init, from the parameters
        # that require grad *then*; a role first run while fvstep has turned its
        # requires_grad off (the critic, read by the generator's unit) gets none, and its
        # bf16 gradients are later refused ("attempting to assign a gradient with dtype
        # BFloat16 to a tensor with grad_dtype Float"). Initialise while trainable.
        for module in (student, critic):
            module._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    adamw = fs.optim.adamw(lr=args.lr, weight_decay=0.01)
    state = fs.TrainState.create(
        {
            "student": fs.Role(student, optimizer=adamw),
            "teacher": fs.Role(teacher),
            "critic": fs.Role(critic, optimizer=adamw),
        },
        key=fs.random.key(0),
    )
    step = fs.compile(
        dmd2(generator_update_interval=2),
        accumulation=fs.Accumulation(K),
        clip=fs.clip_grad_norm(1.0),
    )
    return state, step


def run_to(state, step, stop: int, preset, rank, device, losses: dict):
    """Step ``state`` until ``state.step == stop``; record each step's losses."""
    while int(state.step) < stop:
        i = int(state.step)
        state, metrics = step(state, batch_at(preset, i, rank, device), parallelism=fsp.Layout())
        losses[i] = {k: float(v) for k, v in metrics.items() if k.endswith("/loss")}
    return state


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_config(args, name: str, preset, rank: int, device, mesh, workdir: str) -> dict:
    config = CONFIGS[name]
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    losses_a: dict[int, dict] = {}
    losses_b: dict[int, dict] = {}

    state, step = fresh(args, preset, device, mesh, config)
    state = run_to(state, step, args.steps, preset, rank, device, losses_a)
    sync(device)
    expected = tree.clone(state)
    del state, step
    timings["uninterrupted_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    state, step = fresh(args, preset, device, mesh, config)
    state = run_to(state, step, args.stop, preset, rank, device, losses_b)
    path = os.path.join(workdir, f"{name.replace('+', '_')}_step_{args.stop}")
    sync(device)
    t_save = time.perf_counter()
    fs.checkpoint.save(state, path)
    timings["save_s"] = time.perf_counter() - t_save
    del state, step
    timings["to_stop_and_save_s"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    like, step = fresh(args, preset, device, mesh, config)
    t_load = time.perf_counter()
    state = fs.checkpoint.load(path, like=like)
    sync(device)
    timings["load_s"] = time.perf_counter() - t_load
    del like
    state = run_to(state, step, args.steps, preset, rank, device, losses_b)
    sync(device)
    timings["resumed_s"] = time.perf_counter() - t2

    first_difference = None
    try:
        tree.assert_trees_equal(state, expected, check_static=False)
    except AssertionError as e:
        first_difference = str(e)[:400]
    del state, expected, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "bitwise": first_difference is None,
        "first_difference": first_difference,
        "losses_equal": all(losses_a[i] == losses_b[i] for i in losses_a),
        "losses": {str(i): losses_a[i] for i in sorted(losses_a)},
        "seconds": time.perf_counter() - t0,
        **timings,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="wan-1.3b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=5, help="N, the final step count")
    parser.add_argument("--stop", type=int, default=3, help="the odd step s to save at")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (CPU: aot_eager)"
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--timeout-s", type=int, default=300, help="collective timeout (a rank that failed)"
    )
    parser.add_argument(
        "--no-lazy-init-workaround",
        dest="lazy_init_workaround",
        action="store_false",
        help="do not initialise FSDP2 on the trained roles before the first step",
    )
    parser.add_argument("--workdir", default=None, help="shared checkpoint directory")
    args = parser.parse_args()
    if not 0 < args.stop < args.steps or args.stop % 2 == 0:
        parser.error("--stop must be odd and between 0 and --steps")
    import warnings

    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    mesh = fsp.make_mesh(device_type=device.type)
    preset = PRESETS[args.preset]

    made = [args.workdir or (tempfile.mkdtemp(prefix="fvstep-resume-") if rank == 0 else None)]
    dist.broadcast_object_list(made, src=0)
    workdir = str(made[0])
    os.makedirs(workdir, exist_ok=True)

    header = {
        "machine": f"{world} x {torch.cuda.get_device_name(device) if cuda else 'CPU'}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": preset.name,
        "tokens": preset.num_tokens,
        "steps": args.steps,
        "stop": args.stop,
        "microbatches": K,
        "compile_backend": args.compile_backend or "inductor",
        "lazy_init_workaround": args.lazy_init_workaround,
    }
    if rank == 0:
        print(json.dumps(header), flush=True)
    results = []
    for name in args.configs:
        t0 = time.perf_counter()
        try:
            mine = one_config(args, name, preset, rank, device, mesh, workdir)
        except Exception as e:  # report and go on to the next configuration
            mine = {
                "error": f"{type(e).__name__}: {e}"[:300],
                "traceback": traceback.format_exc()[-1500:],
                "seconds": time.perf_counter() - t0,
            }
            if cuda:
                torch.cuda.empty_cache()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            errors = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if "error" in g]
            trace = next((g["traceback"] for g in gathered if "traceback" in g), None)
            line = {
                "config": name,
                **CONFIGS[name],
                "bitwise": None if errors else all(g["bitwise"] for g in gathered),
                "first_difference": next(
                    (
                        f"rank {r}: {g['first_difference']}"
                        for r, g in enumerate(gathered)
                        if g.get("first_difference")
                    ),
                    None,
                ),
                "errors": errors or None,
                "traceback": trace,
                "seconds": max(g["seconds"] for g in gathered),
                "per_rank": [
                    {k: v for k, v in g.items() if k not in ("error", "traceback")}
                    for g in gathered
                ],
            }
            results.append(line)
            print(json.dumps(line), flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**header, "results": results}, f, indent=1)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
