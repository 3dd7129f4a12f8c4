"""The distributed equality checks on GPUs (NCCL), run by torchrun — not collected by pytest.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.gpu.equality \
        --json equality.json

What it checks on each rank (the CPU versions are tests/test_distributed.py):
- fvstep's compiled fine-tune step vs the hand-written imperative FSDP2 loop of
  benchmarks.reference, the one the CPU tests and the benchmark use (tiny Wan,
  fully_shard per block and at the root, MixedPrecisionPolicy(bf16 params, fp32 reduce),
  fp32 master weights, torch.optim.AdamW, clip_grad_norm_, K micro-batches, loss / K),
  after 5 steps, for every, deferred and no_sync: bitwise?
- every == deferred bitwise; no_sync vs every: max abs difference;
- reduce-scatter counts per step (K x groups for every/deferred, groups for no_sync);
- DMD2 with three roles (issue 10's multi-role case) against the hand-written loop, every
  parameter and AdamW moment of every role, both orderings.
Deterministic algorithms are on (CUBLAS_WORKSPACE_CONFIG=:4096:8), so that a difference
means a different computation, not a non-deterministic kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fvstep as fs
from benchmarks.reference import finetune_loop, shard_by_hand
from fvstep import parallel as fsd
from fvstep.core import tree
from fvstep.core.random import fold_in
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import synthetic_batch, tiny_wan

NUM_STEPS = 5
K = 2
MAX_NORM = 0.5
NUM_GROUPS = 3
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def batch_at(step: int, rank: int, device: torch.device) -> dict:
    return synthetic_batch(
        fold_in(fold_in(fs.random.key(99), step), rank), batch_size=4, device=device
    )


def fvstep_run(rank: int, device: torch.device, sync: str):
    mesh = fsd.make_mesh(device_type="cuda")
    module = fsd.shard_module(tiny_wan(seed=0).to(device), mesh=mesh, mp_policy=MP)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                module, optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.1), allow_no_sync=True
            )
        },
        key=fs.random.key(7),
    )
    step = fs.compile(
        fs.update("student", flow_matching_loss()),
        accumulation=fs.Accumulation(microbatches=K, sync=sync),
        clip=fs.clip_grad_norm(MAX_NORM),
    )
    counts = []
    for i in range(NUM_STEPS):
        layout = fsd.Layout(count_collectives=True)
        state, metrics = step(state, batch_at(i, rank, device), parallelism=layout)
        counts.append(metrics.get("collectives/reduce_scatter"))
    return state.roles["student"], counts


def hand_written(rank: int, device: torch.device, sync: str):
    """The imperative FSDP2 loop fvstep replaces (benchmarks.reference), on the GPU."""
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    module = shard_by_hand(tiny_wan(seed=0).to(device), mesh, mp_policy=MP)
    opt = finetune_loop(
        module,
        lambda step: batch_at(step, rank, device),
        num_steps=NUM_STEPS,
        rank=rank,
        base_key=fs.random.key(7),
        num_microbatches=K,
        sync=sync,
        lr=1e-3,
        weight_decay=0.1,
        max_norm=MAX_NORM,
    )
    return module, opt


def max_abs_diff(a: dict, b: dict) -> float:
    diffs = [(a[n].to_local().float() - b[n].to_local().float()).abs() for n in a]
    return max((d.max().item() for d in diffs if d.numel()), default=0.0)


def dmd2_equality(rank: int, device: torch.device, ordering: str) -> dict:
    """DMD2 with three roles (student read under no_grad by the critic's unit, teacher
    frozen), 4 steps of K=2, sharded with torch's default fully_shard (root not resharded
    after forward) and bf16 compute: fvstep against the hand-written loop, every parameter
    and both AdamW moments of every role, root-level parameters included."""
    import copy

    from benchmarks.reference import dmd2_loop
    from fvstep.methods import dmd2

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    with torch.device(device):
        teacher = tiny_wan(seed=1)
        plain = {"student": copy.deepcopy(teacher), "teacher": teacher, "critic": tiny_wan(seed=2)}
    ref = {r: shard_by_hand(copy.deepcopy(m), mesh, mp_policy=MP) for r, m in plain.items()}
    ref["teacher"].requires_grad_(False)
    from fvstep.core._compat import fsdp_lazy_init

    for module in ref.values():  # as fvstep does at rest: bf16 grad dtypes need it (docs/gpu.md)
        fsdp_lazy_init(module)
    adamw = fs.optim.adamw(lr=1e-3, weight_decay=0.1)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                shard_by_hand(plain["student"], mesh, mp_policy=MP), optimizer=adamw
            ),
            "teacher": fs.Role(shard_by_hand(plain["teacher"], mesh, mp_policy=MP)),
            "critic": fs.Role(shard_by_hand(plain["critic"], mesh, mp_policy=MP), optimizer=adamw),
        },
        key=fs.random.key(5),
    )
    step = fs.compile(
        dmd2(generator_update_interval=2, ordering=ordering),
        accumulation=fs.Accumulation(K),
        clip=fs.clip_grad_norm(MAX_NORM),
    )
    for i in range(4):
        state, _ = step(state, batch_at(i, rank, device), parallelism=fsd.Layout())
    opts = dmd2_loop(
        ref,
        lambda i: batch_at(i, rank, device),
        num_steps=4,
        microbatches_per_step=K,
        ordering=ordering,
        generator_update_interval=2,
        rank=rank,
        base_key=fs.random.key(5),
        lr=1e-3,
        weight_decay=0.1,
        max_norm=MAX_NORM,
    )
    out: dict = {"compared_tensors": 0, "bitwise": True, "first_difference": None}
    for role, module in ref.items():
        theirs = dict(module.named_parameters())
        pairs = [(state.roles[role].params, theirs)]
        if role in opts:
            for moment in ("exp_avg", "exp_avg_sq"):
                pairs.append(
                    (
                        getattr(state.roles[role].opt_state, moment),
                        {n: opts[role].state[p][moment] for n, p in theirs.items()},
                    )
                )
        for ours, expected in pairs:
            out["compared_tensors"] += len(expected)
            try:
                tree.assert_trees_equal(ours, expected)
            except AssertionError as e:
                out["bitwise"] = False
                out["first_difference"] = out["first_difference"] or f"{role}: {str(e)[:300]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    import warnings

    warnings.filterwarnings("ignore")
    results: dict = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "world": dist.get_world_size(),
        "python": platform.python_version(),
        "policies": {},
    }
    finals = {}
    for sync in ["every", "deferred", "no_sync"]:
        ours, counts = fvstep_run(rank, device, sync)
        module, opt = hand_written(rank, device, sync)
        theirs = dict(module.named_parameters())
        exact = True
        try:
            tree.assert_trees_equal(ours.params, theirs)
            tree.assert_trees_equal(
                ours.opt_state.exp_avg, {n: opt.state[p]["exp_avg"] for n, p in theirs.items()}
            )
            tree.assert_trees_equal(
                ours.opt_state.exp_avg_sq,
                {n: opt.state[p]["exp_avg_sq"] for n, p in theirs.items()},
            )
        except AssertionError as e:
            exact = False
            results["policies"].setdefault(sync, {})["first_difference"] = str(e)[:300]
        results["policies"].setdefault(sync, {}).update(
            bitwise_vs_hand_written=exact,
            max_abs_diff_vs_hand_written=max_abs_diff(ours.params, theirs),
            reduce_scatters_per_step=counts,
            expected_reduce_scatters=K * NUM_GROUPS if sync != "no_sync" else NUM_GROUPS,
        )
        finals[sync] = {n: p.detach().clone() for n, p in ours.params.items()}
    try:
        tree.assert_trees_equal(finals["every"], finals["deferred"])
        results["every_equals_deferred_bitwise"] = True
    except AssertionError:
        results["every_equals_deferred_bitwise"] = False
    results["no_sync_vs_every_max_abs_diff"] = max_abs_diff(finals["every"], finals["no_sync"])
    results["dmd2_three_roles_vs_hand_written"] = {
        ordering: dmd2_equality(rank, device, ordering) for ordering in ("sequential", "fused")
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        text = json.dumps(gathered, indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
