"""Context (sequence) parallelism on 2 CPU ranks (gloo) with a tiny Wan transformer.

The laws: a 2-way context-parallel forward equals the 1-rank forward, and a 2-way
context-parallel fvstep step equals the 1-rank step on every parameter and moment, within
a stated tolerance (not bitwise: each rank's parameter gradient is the part its own
tokens contribute, and the sum of the two parts is rounded differently from the one-pass
sum over all tokens); resume under context parallel is bitwise; parameter names and
state-dict keys do not change; ranks of one context group share keys and data; bad
layouts are refused with a ValueError.

Shapes: latents ``(B, 4, 2, 4, 4)`` with patch ``(1, 2, 2)`` give 8 tokens a sample and
``tiny_wan`` has 2 heads: both divide by the degree 2.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.core._compat import checkpoint_wrapper
from fvstep.core.random import generator
from fvstep.executor.data import ShuffledSource, SyntheticLatents
from fvstep.methods.finetune import finetune
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.parallel import (
    Layout,
    apply_context_parallel,
    context_parallel_degree,
    data_parallel_rank_and_size,
    make_context_mesh,
)
from fvstep.testing import assert_resume_exact
from tests.multirank import OneRankReference

pytestmark = pytest.mark.multirank

# Tolerances of the 2-way step against the 1-rank step (fp32, tiny Wan, 2 steps of
# AdamW at lr 1e-4): gradients agree to ~1e-6 relative, parameters to ~1e-8 absolute.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-7}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}
MOMENT_TOL = {"rtol": 1e-4, "atol": 1e-9}
FORWARD_TOL = {"rtol": 1e-5, "atol": 1e-6}
LR = 1e-4


def _batch(seed: int = 1) -> dict:
    return synthetic_batch(fs.random.key(seed), batch_size=2)


def check_forward(rank: int, world_size: int, wrap_blocks: str):
    mesh = make_context_mesh(context=2, device_type="cpu")
    plain = tiny_wan(seed=0)
    names = [n for n, _ in plain.named_parameters()], sorted(plain.state_dict())
    cp = apply_context_parallel(tiny_wan(seed=0), mesh=mesh)
    assert context_parallel_degree(cp) == 2 and context_parallel_degree(plain) == 1
    assert ([n for n, _ in cp.named_parameters()], sorted(cp.state_dict())) == names
    # Activation checkpointing applied after context parallel, as a wrapper module or by
    # re-binding each block's forward (which would drop diffusers' own plan hooks).
    for i, block in enumerate(cp.blocks):
        if wrap_blocks == "wrapper":
            cp.blocks[i] = checkpoint_wrapper(block)
        elif wrap_blocks == "rebound":
            forward = type(block).forward.__get__(block)
            block.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    batch, t = _batch(), torch.tensor([300.0, 700.0])
    outs = []
    for net in (plain, cp):
        out = predict(net, batch["latents"], t, batch["text"])
        out.square().mean().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], **FORWARD_TOL)
    # Each rank holds the gradient its own tokens contribute; their sum is the full one.
    for (name, p), q in zip(plain.named_parameters(), cp.parameters()):
        grad = q.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    return torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("wrap_blocks", ["none", "wrapper", "rebound"])
def test_forward_equals_the_one_rank_forward_and_keys_do_not_change(ranks, wrap_blocks):
    # Ulysses runs each head's attention over the whole sequence, so on the CPU the
    # output is, in practice, bitwise the 1-rank output; the law is stated with a tolerance.
    ranks.run(check_forward, wrap_blocks)


def check_chained(rank: int, world_size: int):
    """A loss through a frozen context-parallel model into a trained one (as a reward
    model's): the trained one's gradient, summed over the group, is the 1-rank gradient."""
    mesh = make_context_mesh(context=2, device_type="cpu")
    nets = {}
    for cp in (False, True):
        first, second = tiny_wan(seed=0), tiny_wan(seed=1).requires_grad_(False)
        if cp:
            first = apply_context_parallel(first, mesh=mesh)
            second = apply_context_parallel(second, mesh=mesh)
        batch, t = _batch(), torch.tensor([300.0, 700.0])
        x = predict(first, batch["latents"], t, batch["text"])
        predict(second, x, t, batch["text"]).square().mean().backward()
        nets[cp] = first
    for (name, p), q in zip(nets[False].named_parameters(), nets[True].parameters()):
        grad = q.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    return True


def test_gradients_through_a_frozen_context_parallel_model_sum_to_the_one_rank_ones(ranks):
    assert ranks.run(check_chained) == [True, True]


def check_step(rank: int, world_size: int, microbatches: int, prepared: bool = False):
    mesh = make_context_mesh(context=2, device_type="cpu")

    def make(cp: bool):
        net = tiny_wan(seed=0)
        if cp and prepared:  # the same through fvstep.parallel.prepare, with full AC
            net = fsp.prepare(
                net,
                mesh=fsp.make_mesh(device_type="cpu"),
                context_mesh=mesh,
                checkpointing="full",
            )
        elif cp:
            net = apply_context_parallel(net, mesh=mesh)
            net = fsp.shard_module(net, mesh=fsp.make_mesh(device_type="cpu"))
        state = fs.TrainState.create(
            {"student": fs.Role(net, optimizer=fs.optim.adamw(lr=LR, weight_decay=0.1))},
            key=fs.random.key(3),
        )
        step = fs.compile(
            finetune(),
            accumulation=fs.Accumulation(microbatches=microbatches),
            clip=fs.clip_grad_norm(1.0),
        )
        return state, step

    (ref, step), (cp, _) = make(False), make(True)
    for i in range(2):
        batch = synthetic_batch(fs.random.key(10 + i), batch_size=2)
        ref, ref_metrics = step(ref, batch, parallelism=OneRankReference())
        cp, cp_metrics = step(cp, batch, parallelism=Layout(mesh))
        for key in ("student/loss", "student/grad_norm"):
            torch.testing.assert_close(cp_metrics[key], ref_metrics[key], **LOSS_TOL)
    assert fsp.unrested_modules(cp) == []
    ours, theirs = cp.roles["student"], ref.roles["student"]
    assert list(ours.params) == list(theirs.params)
    for name in theirs.params:
        torch.testing.assert_close(
            ours.params[name].full_tensor(), theirs.params[name], **PARAM_TOL
        )
        for moment in ("exp_avg", "exp_avg_sq"):  # the gradients, not 2x or 1/2 of them
            torch.testing.assert_close(
                getattr(ours.opt_state, moment)[name].full_tensor(),
                getattr(theirs.opt_state, moment)[name],
                **MOMENT_TOL,
            )
    return float(cp_metrics["student/loss"])


@pytest.mark.parametrize(
    ("microbatches", "prepared"),
    [(1, False), (2, False), (2, True)],
    ids=["k1", "k2", "k2-prepared"],
)
def test_a_two_way_context_parallel_step_equals_the_one_rank_step(ranks, microbatches, prepared):
    losses = ranks.run(check_step, microbatches, prepared)
    assert losses[0] == losses[1]  # every rank of the group computes the whole loss


def check_resume(rank: int, world_size: int, workdir: str):
    mesh = make_context_mesh(context=2, device_type="cpu")
    fsdp_mesh = fsp.make_mesh(device_type="cpu")

    def factory():
        net = apply_context_parallel(tiny_wan(seed=0), mesh=mesh)
        net = fsp.shard_module(net, mesh=fsdp_mesh)
        state = fs.TrainState.create(
            {"student": fs.Role(net, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(5)
        )
        source = ShuffledSource(
            SyntheticLatents(8, key=fs.random.key(6)), key=fs.random.key(7), batch_size=2
        )
        return state, fs.compile(finetune()), source

    final = assert_resume_exact(
        factory, num_steps=3, interruptions=[2], workdir=workdir, parallelism=Layout(mesh)
    )
    # A checkpoint saved with context parallel loads, leaf-exact, into a role without it.
    fs.checkpoint.save(final, f"{workdir}/export")
    plain = fsp.shard_module(tiny_wan(seed=1), mesh=fsdp_mesh)
    like = fs.TrainState.create(
        {"student": fs.Role(plain, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(5)
    )
    loaded = fs.checkpoint.load(f"{workdir}/export", like=like)
    fs.tree.assert_trees_equal(loaded, final, check_static=False)
    return True


def test_resume_under_context_parallel_is_bitwise(ranks):
    with tempfile.TemporaryDirectory() as workdir:
        assert ranks.run(check_resume, workdir) == [True, True]


def check_dmd2(rank: int, world_size: int):
    from fvstep.methods import dmd2

    mesh = make_context_mesh(context=2, device_type="cpu")

    def make(cp: bool):
        roles = {
            "student": tiny_wan(seed=1),
            "teacher": tiny_wan(seed=1),
            "critic": tiny_wan(seed=2),
        }
        if cp:
            for name, net in roles.items():
                net = apply_context_parallel(net, mesh=mesh)
                roles[name] = fsp.shard_module(net, mesh=fsp.make_mesh(device_type="cpu"))
        adamw = fs.optim.adamw(lr=LR)
        state = fs.TrainState.create(
            {
                "student": fs.Role(roles["student"], optimizer=adamw),
                "teacher": fs.Role(roles["teacher"]),
                "critic": fs.Role(roles["critic"], optimizer=adamw),
            },
            key=fs.random.key(4),
        )
        return state

    step = fs.compile(dmd2(generator_update_interval=2))
    ref, cp = make(False), make(True)
    for i in range(2):  # a critic-only step, then student and critic
        batch = synthetic_batch(fs.random.key(20 + i), batch_size=2)
        ref, _ = step(ref, batch, parallelism=OneRankReference())
        cp, _ = step(cp, batch, parallelism=Layout(mesh))
    for role in ("student", "critic"):
        ours, theirs = cp.roles[role], ref.roles[role]
        for name in theirs.params:
            torch.testing.assert_close(
                ours.params[name].full_tensor(), theirs.params[name], **PARAM_TOL
            )
            torch.testing.assert_close(
                ours.opt_state.exp_avg[name].full_tensor(),
                theirs.opt_state.exp_avg[name],
                **MOMENT_TOL,
            )
    return True


def test_dmd2_with_three_context_parallel_roles_equals_the_one_rank_steps(ranks):
    assert ranks.run(check_dmd2, timeout=600) == [True, True]


def check_keys_and_data(rank: int, world_size: int, context: int):
    """Through ``fvstep.run(..., parallelism=Layout(mesh))``: the keys a unit gets and the
    batches it reads, per step."""
    from torch.distributed.device_mesh import init_device_mesh

    # context 2: one group of 2; context 1: 2 data-parallel replicas (a size-1 axis).
    mesh = init_device_mesh("cpu", (2 // context, context), mesh_dim_names=("data", "context"))
    layout = Layout(mesh)
    seen = []

    def record(state, batch, key):
        seen.append((torch.randn(4, generator=generator(key)), batch["latents"].clone()))
        return state.module("m").weight.sum() * 0.0

    module = fsp.shard_module(torch.nn.Linear(2, 2), mesh=fsp.make_mesh(device_type="cpu"))
    state = fs.TrainState.create(
        {"m": fs.Role(module, optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(0)
    )
    source = ShuffledSource(
        SyntheticLatents(8, key=fs.random.key(1)), key=fs.random.key(2), batch_size=1
    )
    fs.run(
        fs.compile(fs.update("m", record)),
        state,
        source,
        num_steps=2,
        parallelism=layout,
        progress=False,
        handle_signals=False,
    )
    assert layout.data_parallel_rank_and_size() == data_parallel_rank_and_size(mesh)
    noise = torch.stack([n for n, _ in seen])
    batches = torch.stack([b for _, b in seen])
    return (*layout.data_parallel_rank_and_size(), noise, batches)


def test_a_context_group_shares_keys_and_data_and_replicas_differ(ranks):
    (i0, s0, n0, b0), (i1, s1, n1, b1) = ranks.run(check_keys_and_data, 2)
    assert (i0, s0, i1, s1) == (0, 1, 0, 1)
    assert torch.equal(n0, n1) and torch.equal(b0, b1)
    assert not torch.equal(n0[0], n0[1]) and not torch.equal(b0[0], b0[1])  # steps differ
    (i0, s0, n0, b0), (i1, s1, n1, b1) = ranks.run(check_keys_and_data, 1)
    assert (i0, s0, i1, s1) == (0, 2, 1, 2)
    for step in range(2):
        assert not torch.equal(n0[step], n1[step]) and not torch.equal(b0[step], b1[step])


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{fn} raised no ValueError")


def check_refusals(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = make_context_mesh(context=2, device_type="cpu")
    t = torch.full((2,), 500.0)
    errors = {}
    errors["heads"] = _error(lambda: apply_context_parallel(tiny_wan(num_heads=3), mesh=mesh))
    errors["ring_on_native"] = _error(
        lambda: apply_context_parallel(tiny_wan(), mesh=mesh, mode="ring")
    )
    errors["mode"] = _error(lambda: apply_context_parallel(tiny_wan(), mesh=mesh, mode="x"))
    errors["axis"] = _error(lambda: apply_context_parallel(tiny_wan(), mesh=mesh, axis="seq"))
    one = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data", "context"))
    errors["degree_one"] = _error(lambda: apply_context_parallel(tiny_wan(), mesh=one))
    errors["context_one"] = _error(lambda: make_context_mesh(context=1, device_type="cpu"))
    errors["context_three"] = _error(lambda: make_context_mesh(context=3, device_type="cpu"))
    wrapped = tiny_wan()
    wrapped.blocks[0] = checkpoint_wrapper(wrapped.blocks[0])
    errors["wrapped"] = _error(lambda: apply_context_parallel(wrapped, mesh=mesh))
    net = apply_context_parallel(tiny_wan(), mesh=mesh)
    errors["twice"] = _error(lambda: apply_context_parallel(net, mesh=mesh))
    odd = synthetic_batch(fs.random.key(0), batch_size=2, frames=3, height=2, width=2)
    with torch.no_grad():
        errors["tokens"] = _error(lambda: predict(net, odd["latents"], t, odd["text"]))
        mine = synthetic_batch(fs.random.key(rank), batch_size=2)  # a different sample per rank
        errors["inputs"] = _error(lambda: predict(net, mine["latents"], t, mine["text"]))
    state = fs.TrainState.create(
        {"student": fs.Role(net, optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(0)
    )
    step = fs.compile(finetune())
    errors["unsharded"] = _error(lambda: step(state, _batch(), parallelism=Layout(mesh)))
    errors["layout_axis"] = _error(lambda: Layout(mesh, context_axis="seq"))
    # A role prepared on one mesh's context groups, called with another layout.
    sharded = fsp.shard_module(
        apply_context_parallel(tiny_wan(), mesh=mesh), mesh=fsp.make_mesh(device_type="cpu")
    )
    state = fs.TrainState.create(
        {"student": fs.Role(sharded, optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(0)
    )
    before = fs.tree.clone(state)
    errors["other_mesh"] = _error(lambda: step(state, _batch(), parallelism=Layout(one)))
    errors["no_mesh"] = _error(lambda: step(state, _batch(), parallelism=Layout()))
    fs.tree.assert_trees_equal(state, before)  # refused before anything is consumed
    step(state, _batch(), parallelism=Layout(mesh))  # the mesh it was prepared on
    return errors


def test_bad_layouts_and_inputs_are_refused_with_a_value_error(ranks):
    expected = {
        "heads": "heads must divide",
        "ring_on_native": "log-sum-exp",
        "mode": "mode must be one of",
        "axis": "no axis 'seq'",
        "degree_one": "needs >= 2",
        "context_one": "context must be an int >= 2",
        "context_three": "must divide the world size",
        "wrapped": "before wrapping blocks in modules",
        "twice": "already prepared",
        "tokens": "does not divide by the context-parallel degree 2",
        "inputs": "were given different inputs",
        "unsharded": "not sharded",
        "layout_axis": "no axis 'seq'",
        "other_mesh": "role 'student' runs context parallel over ranks [0, 1], but this call's "
        "groups are [",
        "no_mesh": "role 'student' runs context parallel over ranks [0, 1], but this call has none",
    }
    for errors in ranks.run(check_refusals):
        for case, words in expected.items():
            assert words in errors[case], (case, errors[case])


def check_replicas_of_context_groups(rank: int, world_size: int):
    """4 ranks, 2 replicas x 2-way context: equals plain FSDP2 over the 4 ranks where each
    pair computes its sample whole (same keys and data per pair), within tolerance."""
    mesh = make_context_mesh(context=2, device_type="cpu")
    fsdp_mesh = fsp.make_mesh(device_type="cpu")
    source = ShuffledSource(
        SyntheticLatents(8, key=fs.random.key(1)), key=fs.random.key(2), batch_size=2
    )
    layout = Layout(mesh)
    replica, replicas = layout.data_parallel_rank_and_size()

    def make(cp: bool):
        net = tiny_wan(seed=0)
        if cp:
            net = apply_context_parallel(net, mesh=mesh)
        net = fsp.shard_module(net, mesh=fsdp_mesh)
        state = fs.TrainState.create(
            {"student": fs.Role(net, optimizer=fs.optim.adamw(lr=LR))}, key=fs.random.key(3)
        )
        return state

    # The same layout keys both by replica (rank // 2); only cp's role shards the tokens.
    step = fs.compile(finetune())
    ref, cp = make(False), make(True)
    for i in range(2):
        batch = source.batch(i, rank=replica, world_size=replicas)
        ref, ref_metrics = step(ref, batch, parallelism=layout)
        cp, cp_metrics = step(cp, batch, parallelism=layout)
        torch.testing.assert_close(
            cp_metrics["student/loss"], ref_metrics["student/loss"], **LOSS_TOL
        )
    for name, p in ref.roles["student"].params.items():
        torch.testing.assert_close(
            cp.roles["student"].params[name].full_tensor(), p.full_tensor(), **PARAM_TOL
        )
        torch.testing.assert_close(
            cp.roles["student"].opt_state.exp_avg[name].full_tensor(),
            ref.roles["student"].opt_state.exp_avg[name].full_tensor(),
            **MOMENT_TOL,
        )
    return data_parallel_rank_and_size(mesh), float(cp_metrics["student/loss"])


@pytest.mark.heavy
def test_two_replicas_of_two_way_context_groups_on_four_ranks():
    from tests.multirank import RankPool

    pool = RankPool(world_size=4)
    try:
        results = pool.run(check_replicas_of_context_groups, timeout=600)
    finally:
        pool.close()
    assert [r[0] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert results[0][1] == results[1][1] and results[2][1] == results[3][1]
    assert results[0][1] != results[2][1]  # the replicas trained on different samples
