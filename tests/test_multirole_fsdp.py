"""Several FSDP2 roles on 2 CPU ranks: fvstep's step equals a hand-written FSDP2 loop on
every parameter of every role (root-level ones included), and no module state survives
a unit.

A role read under ``torch.no_grad()`` by one unit and trained by a later one used to keep
its FSDP2 root group unsharded, with ``requires_grad`` off on the unsharded parameters:
its root-level parameters got no gradient. These tests fail on that bug.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fvstep as fs
from benchmarks.reference import (
    dmd2_loop,
    microbatches,
    modules_view,
    reshard_all,
    shard_by_hand,
    unit_key,
)
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.core.random import fold_in
from fvstep.methods.models import predict, synthetic_batch, tiny_wan

pytestmark = pytest.mark.multirank

LR = 1e-3
WD = 0.1
MAX_NORM = 1.0
ROOT_LEVEL = ("patch_embedding.weight", "condition_embedder.time_proj.weight", "proj_out.weight")


def batch_at(step: int, rank: int) -> dict:
    return synthetic_batch(fold_in(fold_in(fs.random.key(99), step), rank), batch_size=6)


def _mse_of(reader: str, target: str):
    """A loss training ``reader`` that reads ``target`` under no_grad (as DMD2's losses do)."""
    t = torch.full((1,), 500.0)

    def loss(state, batch, key):
        x, text = batch["latents"], batch["text"]
        tb = t.expand(x.shape[0])
        with torch.no_grad():
            goal = predict(state.module(target), x, tb, text)
        return torch.nn.functional.mse_loss(predict(state.module(reader), x, tb, text), goal)

    return loss


def check_two_roles_reading_each_other(rank: int, world_size: int, k: int, how: str = "compiled"):
    """``how``: ``"compiled"`` (one ``fs.compile`` of K micro-batches), ``"per_unit"`` (a
    sequence of two compiled units: a's over K micro-batches, b's over one), or
    ``"direct"`` (the ``fs.sequence`` itself called, no compile: one micro-batch each).
    Called with ``parallelism=Layout()`` in every case, so FSDP2's handling applies."""
    k_a, k_b = {"compiled": (k, k), "per_unit": (k, 1), "direct": (1, 1)}[how]
    mesh = fsp.make_mesh(device_type="cpu")
    a0, b0 = tiny_wan(seed=0), tiny_wan(seed=1)
    ref = {"a": shard_by_hand(copy.deepcopy(a0), mesh), "b": shard_by_hand(copy.deepcopy(b0), mesh)}
    state = fs.TrainState.create(
        {
            name: fs.Role(shard_by_hand(m, mesh), optimizer=fs.optim.adamw(lr=LR, weight_decay=WD))
            for name, m in (("a", a0), ("b", b0))
        },
        key=fs.random.key(3),
    )
    unit_a, unit_b = fs.update("a", _mse_of("a", "b")), fs.update("b", _mse_of("b", "a"))
    if how == "compiled":
        step = fs.compile(fs.sequence(unit_a, unit_b), accumulation=fs.Accumulation(k))
    elif how == "per_unit":
        step = fs.sequence(fs.compile(unit_a, accumulation=fs.Accumulation(k)), fs.compile(unit_b))
    else:
        step = fs.sequence(unit_a, unit_b)
    before = {n: p.full_tensor().clone() for n, p in state.roles["b"].params.items()}
    state, _ = step(state, batch_at(0, rank), parallelism=fsp.Layout())
    assert fsp.unrested_modules(state) == [], fsp.unrested_modules(state)[:3]
    # By hand: a's unit, then b's unit, each over K micro-batches.
    opts = {r: torch.optim.AdamW(ref[r].parameters(), lr=LR, weight_decay=WD) for r in ref}
    view = modules_view(ref)
    for r, other, k_r in (("a", "b", k_a), ("b", "a", k_b)):  # keyed by name (the role)
        for m, mb in enumerate(microbatches(batch_at(0, rank), k_r)):
            loss = _mse_of(r, other)(view, mb, unit_key(fs.random.key(3), 0, rank, r, m))
            (loss / k_r).backward()
        opts[r].step()
        opts[r].zero_grad(set_to_none=True)
    reshard_all(ref)
    moved = {
        n: not torch.equal(before[n], state.roles["b"].params[n].full_tensor()) for n in ROOT_LEVEL
    }
    for r in ref:
        tree.assert_trees_equal(state.roles[r].params, dict(ref[r].named_parameters()))
    return moved


@pytest.mark.parametrize("k", [1, 3])
def test_a_role_read_under_no_grad_then_trained_gets_its_root_gradients(ranks, k):
    for moved in ranks.run(check_two_roles_reading_each_other, k):
        assert all(moved.values()), moved


def test_compiled_units_sequenced_keep_their_own_accumulation_on_two_ranks(ranks):
    # sequence(compile(a, K=3), compile(b)): a over 3 micro-batches, b over one, bitwise
    # a hand-written FSDP2 loop doing the same; modules at rest after the step.
    for moved in ranks.run(check_two_roles_reading_each_other, 3, "per_unit"):
        assert all(moved.values()), moved


def test_a_step_built_through_the_face_and_called_uncompiled_reshards_between_units(ranks):
    # fs.sequence(fs.update(...), fs.update(...)) called directly (not compiled) with
    # parallelism=Layout() runs with FSDP2's handling: b's root group, left unsharded by a's
    # no-grad read, is resharded before b trains, so b's root-level parameters move.
    for moved in ranks.run(check_two_roles_reading_each_other, 1, "direct"):
        assert all(moved.values()), moved


def shard(module, mesh):
    """Shard as users do: ``fully_shard`` with torch's defaults, so the root group is not
    resharded after forward (what exposed the hidden state)."""
    return shard_by_hand(module, mesh)


def _dmd2_roles():
    teacher = tiny_wan(seed=1)
    student = copy.deepcopy(teacher)
    critic = tiny_wan(seed=2)
    return {"student": student, "teacher": teacher, "critic": critic}


def check_dmd2_against_hand_written_loop(rank: int, world_size: int, ordering: str, k: int):
    from fvstep.methods import dmd2

    num_steps, interval = 6, 2
    mesh = fsp.make_mesh(device_type="cpu")
    plain = _dmd2_roles()
    ref = {r: shard_by_hand(copy.deepcopy(m), mesh) for r, m in plain.items()}
    ref["teacher"].requires_grad_(False)
    adamw = fs.optim.adamw(lr=LR, weight_decay=WD)
    state = fs.TrainState.create(
        {
            "student": fs.Role(shard(plain["student"], mesh), optimizer=adamw),
            "teacher": fs.Role(shard(plain["teacher"], mesh)),
            "critic": fs.Role(shard(plain["critic"], mesh), optimizer=adamw),
        },
        key=fs.random.key(5),
    )
    step = fs.compile(
        dmd2(generator_update_interval=interval, ordering=ordering),
        accumulation=fs.Accumulation(microbatches=k, sync="deferred"),
        clip=fs.clip_grad_norm(MAX_NORM),
    )
    for i in range(num_steps):
        state, _ = step(state, batch_at(i, rank), parallelism=fsp.Layout())
        assert fsp.unrested_modules(state) == [], (i, fsp.unrested_modules(state)[:3])
    opts = dmd2_loop(
        ref,
        lambda i: batch_at(i, rank),
        num_steps=num_steps,
        microbatches_per_step=k,
        ordering=ordering,
        generator_update_interval=interval,
        rank=rank,
        base_key=fs.random.key(5),
        lr=LR,
        weight_decay=WD,
        max_norm=MAX_NORM,
    )
    compared = 0
    for role in ("student", "teacher", "critic"):
        theirs = dict(ref[role].named_parameters())
        assert set(theirs) == set(state.roles[role].params)
        tree.assert_trees_equal(state.roles[role].params, theirs)
        compared += len(theirs)
        if role in opts:
            moments = {n: opts[role].state[p] for n, p in theirs.items()}
            tree.assert_trees_equal(
                state.roles[role].opt_state.exp_avg, {n: s["exp_avg"] for n, s in moments.items()}
            )
            tree.assert_trees_equal(
                state.roles[role].opt_state.exp_avg_sq,
                {n: s["exp_avg_sq"] for n, s in moments.items()},
            )
    return compared


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("ordering", ["sequential", "fused"])
def test_dmd2_on_two_ranks_is_bitwise_a_hand_written_fsdp2_loop_on_every_parameter(
    ranks, ordering, k
):
    compared = ranks.run(check_dmd2_against_hand_written_loop, ordering, k, timeout=600)
    assert compared[0] == compared[1] > 3 * len(ROOT_LEVEL)


def check_rest_after_every_unit(rank: int, world_size: int):
    """Each DMD2 unit as its own step, so the invariant is checked after every unit."""
    from fvstep.methods.dmd2 import dmd2_losses

    mesh = fsp.make_mesh(device_type="cpu")
    plain = _dmd2_roles()
    adamw = fs.optim.adamw(lr=LR)
    state = fs.TrainState.create(
        {
            "student": fs.Role(shard(plain["student"], mesh), optimizer=adamw),
            "teacher": fs.Role(shard(plain["teacher"], mesh)),
            "critic": fs.Role(shard(plain["critic"], mesh), optimizer=adamw),
        },
        key=fs.random.key(5),
    )
    losses = dmd2_losses()
    units = [
        fs.compile(fs.update("student", losses.generator_loss), accumulation=fs.Accumulation(2)),
        fs.compile(fs.update("critic", losses.critic_loss), accumulation=fs.Accumulation(2)),
        fs.compile(fs.update(("student", "critic"), losses.fused_loss)),
    ]
    report = []
    for i, unit in enumerate(units * 2):
        state, _ = unit(state, batch_at(i, rank), parallelism=fsp.Layout())
        report.append(fsp.unrested_modules(state))
    # The invariant's check can fail: a no-grad read by hand leaves the root unsharded.
    with torch.no_grad():
        predict(
            state.module("critic"),
            batch_at(0, rank)["latents"],
            torch.full((6,), 1.0),
            batch_at(0, rank)["text"],
        )
    broken = fsp.unrested_modules(state)
    fsp.release_modules(state)
    return report, broken, fsp.unrested_modules(state)


def test_no_fsdp2_group_stays_unsharded_after_any_unit(ranks):
    for report, broken, repaired in ranks.run(check_rest_after_every_unit):
        assert all(r == [] for r in report), report
        assert any("unsharded FSDP2 parameter" in p and "proj_out" in p for p in broken), broken
        assert repaired == []


def check_unsharded_trained_role(rank: int, world_size: int, replicate: bool):
    module = tiny_wan(seed=0)
    if replicate:
        module = fsp.shard_module(
            module, mesh=fsp.make_mesh(replicate=world_size, device_type="cpu")
        )
    state = fs.TrainState.create(
        {"m": fs.Role(module, optimizer=fs.optim.adamw(lr=LR))}, key=fs.random.key(0)
    )
    from fvstep.methods.finetune import flow_matching_loss

    step = fs.compile(fs.update("m", flow_matching_loss(role="m")))
    try:
        for i in range(2):
            state, _ = step(state, batch_at(i, rank), parallelism=fsp.Layout())
    except ValueError as e:
        return str(e)
    return tree.tree_digest(state.roles["m"].params)


def test_a_trained_role_that_is_not_sharded_is_refused_on_two_ranks(ranks):
    for message in ranks.run(check_unsharded_trained_role, False):
        assert "not sharded" in message and "shard_module" in message, message


def test_a_replicated_role_trains_one_model_on_two_ranks(ranks):
    a, b = ranks.run(check_unsharded_trained_role, True)
    assert a == b  # the replicas agree: gradients were reduced
