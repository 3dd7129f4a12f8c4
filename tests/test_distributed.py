"""FSDP2-sharded roles on 2 CPU ranks (gloo): fvstep against a hand-written FSDP2 loop,
collective counts per policy, flags restored, keys across ranks, HSDP.

Each ``check_*`` function runs on every rank of the ``ranks`` pool (tests/multirank.py).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fvstep as fs
from benchmarks.reference import finetune_loop, shard_by_hand
from fvstep import parallel as fsd
from fvstep.core import tree
from fvstep.core.random import fold_in, generator
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import synthetic_batch, tiny_wan

pytestmark = pytest.mark.multirank

NUM_STEPS = 5
K = 2
MAX_NORM = 0.5
NUM_GROUPS = 3  # tiny_wan: 2 blocks + the root's own parameters
LAYOUT = fsd.Layout()  # the process layout of a step on several ranks
COUNTING = fsd.Layout(count_collectives=True)  # the same, reporting collectives/* counts


def batch_at(step: int, rank: int) -> dict:
    return synthetic_batch(fold_in(fold_in(fs.random.key(99), step), rank), batch_size=4)


def max_abs_diff(a: dict, b: dict) -> float:
    """Max abs difference of the local shards (some shards are empty on some ranks)."""
    diffs = [(a[n].to_local() - b[n].to_local()).abs() for n in a]
    return max((d.max().item() for d in diffs if d.numel()), default=0.0)


def fvstep_finetune(rank: int, sync: str, steps: int = NUM_STEPS, *, allow_no_sync: bool = True):
    mesh = fsd.make_mesh(device_type="cpu")
    module = fsd.shard_module(tiny_wan(seed=0), mesh=mesh)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                module,
                optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.1),
                allow_no_sync=allow_no_sync,
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
    for i in range(steps):
        state, metrics = step(state, batch_at(i, rank), parallelism=COUNTING)
        counts.append({k: v for k, v in metrics.items() if k.startswith("collectives/")})
    return state, counts


def hand_written_fsdp_loop(rank: int, sync: str):
    """The imperative FSDP2 loop fvstep replaces (benchmarks.reference), on tiny_wan."""
    from torch.distributed.device_mesh import init_device_mesh

    module = shard_by_hand(tiny_wan(seed=0), init_device_mesh("cpu", (2,)))
    opt = finetune_loop(
        module,
        lambda step: batch_at(step, rank),
        num_steps=NUM_STEPS,
        rank=rank,
        base_key=fs.random.key(7),
        num_microbatches=K,
        sync=sync,
        lr=1e-3,
        weight_decay=0.1,
        max_norm=MAX_NORM,
    )
    return dict(module.named_parameters()), opt, module


def check_policy_against_hand_written_loop(rank: int, world_size: int, sync: str):
    state, _ = fvstep_finetune(rank, sync)
    params, opt, module = hand_written_fsdp_loop(rank, sync)
    ours = state.roles["student"]
    exact = True
    try:
        tree.assert_trees_equal(ours.params, params)
        theirs = {n: opt.state[p] for n, p in module.named_parameters()}
        tree.assert_trees_equal(
            ours.opt_state.exp_avg, {n: s["exp_avg"] for n, s in theirs.items()}
        )
        tree.assert_trees_equal(
            ours.opt_state.exp_avg_sq, {n: s["exp_avg_sq"] for n, s in theirs.items()}
        )
    except AssertionError:
        exact = False
    worst = max_abs_diff(ours.params, params)
    return {"exact": exact, "max_abs_diff": worst, "digest": tree.tree_digest(ours.params)}


@pytest.mark.parametrize("sync", ["every", "deferred"])
def test_fsdp2_finetune_is_bitwise_a_hand_written_fsdp2_loop(ranks, sync):
    results = ranks.run(check_policy_against_hand_written_loop, sync)
    assert all(r["exact"] for r in results), results


def test_no_sync_is_bitwise_the_hand_written_no_sync_loop(ranks):
    # Against the same policy by hand, no_sync is exact; against 'every' it differs by
    # summation order only (see test_every_and_deferred_are_bitwise_equal_and_no_sync_is_close).
    results = ranks.run(check_policy_against_hand_written_loop, "no_sync")
    assert all(r["exact"] for r in results), results


def check_every_equals_deferred(rank: int, world_size: int):
    every, _ = fvstep_finetune(rank, "every")
    deferred, _ = fvstep_finetune(rank, "deferred")
    tree.assert_trees_equal(
        every.roles["student"].params, deferred.roles["student"].params, check_static=False
    )
    tree.assert_trees_equal(
        every.roles["student"].opt_state, deferred.roles["student"].opt_state, check_static=False
    )
    no_sync, _ = fvstep_finetune(rank, "no_sync")
    return max_abs_diff(every.roles["student"].params, no_sync.roles["student"].params)


def test_every_and_deferred_are_bitwise_equal_and_no_sync_is_close(ranks):
    # no_sync sums the K micro-batch gradients unsharded and reduce-scatters once; every
    # reduce-scatters each and adds the shards: the same terms in another order, so fp32
    # results differ by rounding only (bound: 1e-6 abs after 5 AdamW steps at lr 1e-3).
    diffs = ranks.run(check_every_equals_deferred)
    assert all(d < 1e-6 for d in diffs), diffs


def check_collective_counts(rank: int, world_size: int, sync: str):
    _, counts = fvstep_finetune(rank, sync, steps=2)
    return counts


@pytest.mark.parametrize(
    ("sync", "reduce_scatters"),
    [("every", K * NUM_GROUPS), ("deferred", K * NUM_GROUPS), ("no_sync", NUM_GROUPS)],
)
def test_collective_counts_prove_the_policy_ran(ranks, sync, reduce_scatters):
    for counts in ranks.run(check_collective_counts, sync):
        for step_counts in counts:
            assert step_counts["collectives/reduce_scatter"] == reduce_scatters, step_counts
            # forward + backward all-gathers of every group, for each micro-batch
            assert step_counts["collectives/all_gather"] == 2 * K * NUM_GROUPS, step_counts
            # the clip's global norm: an all-reduce issued inside a DTensor op
            assert step_counts["collectives/all_reduce"] >= 1, step_counts


def check_no_sync_needs_opt_in(rank: int, world_size: int):
    try:
        fvstep_finetune(rank, "no_sync", steps=1, allow_no_sync=False)
    except ValueError as e:
        return str(e)
    return None


def test_no_sync_without_opt_in_is_refused_with_the_memory_it_would_add(ranks):
    for message in ranks.run(check_no_sync_needs_opt_in):
        assert message is not None and "allow_no_sync=True" in message and "MiB" in message


def check_flags_are_restored_after_an_error(rank: int, world_size: int):
    mesh = fsd.make_mesh(device_type="cpu")
    module = fsd.shard_module(tiny_wan(seed=0), mesh=mesh)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3), allow_no_sync=True)},
        key=fs.random.key(0),
    )
    inner = flow_matching_loss()
    calls = {"n": 0}

    def failing(state, batch, key):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom in micro-batch 1")
        return inner(state, batch, key)

    broken = fs.compile(
        fs.update("student", failing), accumulation=fs.Accumulation(microbatches=K, sync="no_sync")
    )
    snapshot = tree.clone(state)
    with contextlib.suppress(RuntimeError):
        broken(state, batch_at(0, rank), parallelism=LAYOUT)
    module.zero_grad(set_to_none=True)
    # If no_sync's flag had stuck, this 'every' step would issue fewer reduce-scatters.
    step = fs.compile(
        fs.update("student", inner),
        accumulation=fs.Accumulation(microbatches=K, sync="every"),
    )
    _, metrics = step(snapshot, batch_at(0, rank), parallelism=COUNTING)
    return metrics["collectives/reduce_scatter"]


def test_fsdp_flags_are_restored_after_a_failing_step(ranks):
    assert ranks.run(check_flags_are_restored_after_an_error) == [K * NUM_GROUPS] * 2


def check_keys_across_ranks(rank: int, world_size: int, context: int):
    seen = {}

    def record(state, batch, key):
        seen["noise"] = torch.randn(4, generator=generator(key))
        return (state.module("m").weight.sum()) * 0.0

    module = fsd.shard_module(torch.nn.Linear(2, 2), mesh=fsd.make_mesh(device_type="cpu"))
    state = fs.TrainState.create(
        {"m": fs.Role(module, optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(0)
    )
    # context 2: both ranks form one context group (one data-parallel replica).
    layout = (
        fsd.Layout(fsd.make_context_mesh(context=context, device_type="cpu"))
        if context > 1
        else LAYOUT
    )
    step = fs.compile(fs.update("m", record))
    step(state, {"x": torch.zeros(1)}, parallelism=layout)
    return seen["noise"]


def test_data_parallel_ranks_draw_different_noise(ranks):
    a, b = ranks.run(check_keys_across_ranks, 1)
    assert not torch.equal(a, b)


def test_ranks_of_one_context_parallel_group_draw_the_same_noise(ranks):
    a, b = ranks.run(check_keys_across_ranks, 2)
    assert torch.equal(a, b)


def check_hsdp_defers_the_all_reduce(rank: int, world_size: int, defer: bool):
    mesh = fsd.make_mesh(replicate=2, device_type="cpu")
    module = fsd.shard_module(tiny_wan(seed=0), mesh=mesh)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )
    step = fs.compile(
        fs.update("student", flow_matching_loss()),
        accumulation=fs.Accumulation(microbatches=K, sync="every", defer_all_reduce=defer),
        sanitize=None,  # count the gradients' all-reduces only, not those of the finite check
    )
    state, metrics = step(state, batch_at(0, rank), parallelism=COUNTING)
    return metrics.get("collectives/all_reduce", 0), tree.tree_digest(state.roles["student"].params)


def test_hsdp_defers_the_cross_replica_all_reduce_to_the_last_microbatch(ranks):
    eager = ranks.run(check_hsdp_defers_the_all_reduce, False)
    deferred = ranks.run(check_hsdp_defers_the_all_reduce, True)
    assert eager[0][0] == K * NUM_GROUPS and deferred[0][0] == NUM_GROUPS, (eager, deferred)
    # replicas agree with each other
    assert eager[0][1] == eager[1][1] and deferred[0][1] == deferred[1][1]


def check_clone_of_a_sharded_state_replays_exactly(rank: int, world_size: int):
    mesh = fsd.make_mesh(device_type="cpu")
    module = fsd.shard_module(tiny_wan(seed=0), mesh=mesh)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )
    step = fs.compile(fs.update("student", flow_matching_loss()), accumulation=fs.Accumulation(K))
    snapshot = tree.clone(state)
    placements = [p.placements for p in snapshot.roles["student"].params.values()]
    first, _ = step(state, batch_at(0, rank), parallelism=LAYOUT)
    first = tree.clone(first)
    again, _ = step(snapshot, batch_at(0, rank), parallelism=LAYOUT)
    tree.assert_trees_equal(first, again)
    return placements == [p.placements for p in again.roles["student"].params.values()]


def test_a_clone_of_a_sharded_state_keeps_placements_and_replays_bitwise(ranks):
    assert ranks.run(check_clone_of_a_sharded_state_replays_exactly) == [True, True]


def check_dmd2_on_sharded_roles(
    rank: int, world_size: int, sync: str, opt_in: bool, ordering: str = "sequential"
):
    from fvstep.methods import dmd2

    mesh = fsd.make_mesh(device_type="cpu")
    teacher = tiny_wan(seed=1)
    roles = {
        "student": fs.Role(
            fsd.shard_module(copy.deepcopy(teacher), mesh=mesh),
            optimizer=fs.optim.adamw(lr=1e-3),
            allow_no_sync=opt_in,
        ),
        "teacher": fs.Role(fsd.shard_module(teacher, mesh=mesh)),
        "critic": fs.Role(
            fsd.shard_module(tiny_wan(seed=2), mesh=mesh),
            optimizer=fs.optim.adamw(lr=1e-3),
            allow_no_sync=True,
        ),
    }
    state = fs.TrainState.create(roles, key=fs.random.key(0))
    teacher_before = tree.clone(state.roles["teacher"])
    step = fs.compile(
        dmd2(generator_update_interval=2, ordering=ordering),
        accumulation=fs.Accumulation(microbatches=K, sync=sync),
        clip=fs.clip_grad_norm(1.0),
    )
    losses = []
    try:
        for i in range(4):
            before = tree.clone(state.roles)
            state, metrics = step(state, batch_at(i, rank), parallelism=LAYOUT)
            changed = {
                r
                for r in before
                if tree.tree_digest(before[r].params) != tree.tree_digest(state.roles[r].params)
            }
            planned = {r for e in fs.plan(step, i) for r in e.roles}
            assert changed == planned, (i, changed, planned)
            losses.append(float(metrics["critic/loss"]))
    except ValueError as e:
        return {"error": str(e)}
    tree.assert_trees_equal(state.roles["teacher"], teacher_before)
    return {
        "losses": losses,
        "placements": str(state.roles["critic"].opt_state.exp_avg["proj_out.weight"].placements),
    }


@pytest.mark.parametrize("ordering", ["sequential", "fused"])
def test_dmd2_on_two_ranks_trains_the_planned_roles_and_never_the_teacher(ranks, ordering):
    for result in ranks.run(check_dmd2_on_sharded_roles, "deferred", False, ordering):
        assert "error" not in result, result
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert "Shard(dim=0)" in result["placements"]  # moments are sharded like the params


def test_dmd2_no_sync_is_refused_for_a_role_without_opt_in(ranks):
    for result in ranks.run(check_dmd2_on_sharded_roles, "no_sync", False):
        assert "allow_no_sync=True" in result.get("error", ""), result


def check_joint_clip_on_shards(rank: int, world_size: int):
    from fvstep.methods.models import predict

    mesh = fsd.make_mesh(device_type="cpu")
    a, b = tiny_wan(seed=0), tiny_wan(seed=1)
    a_ref, b_ref = copy.deepcopy(a), copy.deepcopy(b)
    state = fs.TrainState.create(
        {
            "a": fs.Role(fsd.shard_module(a, mesh=mesh), optimizer=fs.optim.sgd(lr=0.1)),
            "b": fs.Role(fsd.shard_module(b, mesh=mesh), optimizer=fs.optim.sgd(lr=0.1)),
        },
        key=fs.random.key(0),
    )
    batch = batch_at(0, rank)
    t = torch.full((4,), 500.0)

    def fused(state, batch, key):
        va = predict(state.module("a"), batch["latents"], t, batch["text"])
        vb = predict(state.module("b"), batch["latents"], t, batch["text"])
        return {"a": (va**2).mean(), "b": (vb**2).mean() * 10}, {}

    step = fs.compile(fs.update(("a", "b"), fused), clip=fs.clip_grad_norm(0.05, joint=True))
    new, metrics = step(state, batch, parallelism=LAYOUT)
    for m in (a_ref, b_ref):
        shard_by_hand(m, mesh)
    (predict(a_ref, batch["latents"], t, batch["text"]) ** 2).mean().backward()
    ((predict(b_ref, batch["latents"], t, batch["text"]) ** 2).mean() * 10).backward()
    params = [*a_ref.parameters(), *b_ref.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
    torch.optim.SGD(params, lr=0.1).step()
    tree.assert_trees_equal(new.roles["a"].params, dict(a_ref.named_parameters()))
    tree.assert_trees_equal(new.roles["b"].params, dict(b_ref.named_parameters()))
    return float(metrics["a+b/grad_norm"]), float(norm.full_tensor())


def test_joint_clip_on_shards_is_one_clip_grad_norm_over_every_shard_of_both_roles(ranks):
    for ours, theirs in ranks.run(check_joint_clip_on_shards):
        assert ours == theirs and ours > 0.05  # the clip was active
