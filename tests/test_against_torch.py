"""A compiled fine-tune step against a hand-written PyTorch loop: bitwise equal.

The hand-written loop (:func:`benchmarks.reference.finetune_loop`) uses only torch:
``torch.optim.AdamW`` under ``LambdaLR``, ``torch.nn.utils.clip_grad_norm_``, K
micro-batches with ``loss / K`` and the flow-matching loss written out. It draws its noise
with the key derivation fvstep documents
(``fold_in(fold_in_name(fold_in(fold_in(key, step), rank 0), "student"), m)``, the unit
named after its role, then ``split`` into time and noise keys), so both sides see the same
numbers.
"""

from __future__ import annotations

import copy

import pytest

import fvstep as fs
from benchmarks.reference import finetune_loop
from fvstep.core import tree
from fvstep.core.random import fold_in
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import synthetic_batch, tiny_wan

NUM_STEPS = 10
LR = fs.schedules.warmup_cosine(1e-3, warmup_steps=3, total_steps=NUM_STEPS)


def batch_at(step: int) -> dict:
    return synthetic_batch(fold_in(fs.random.key(99), step), batch_size=4)


def hand_written_loop(module, seed: int, k: int, max_norm: float, foreach: bool | None):
    return finetune_loop(
        module,
        batch_at,
        num_steps=NUM_STEPS,
        rank=0,
        base_key=fs.random.key(seed),
        num_microbatches=k,
        lr=LR,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        max_norm=max_norm,
        foreach=foreach,
    )


@pytest.mark.parametrize(("k", "foreach"), [(1, None), (2, None), (4, False)])
def test_compiled_finetune_is_bitwise_a_hand_written_loop_after_10_steps(k, foreach):
    module = tiny_wan(seed=0)
    reference = copy.deepcopy(module)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                module,
                optimizer=fs.optim.adamw(
                    lr=LR, betas=(0.9, 0.95), weight_decay=0.1, foreach=foreach
                ),
            )
        },
        key=fs.random.key(7),
    )
    step = fs.compile(
        fs.update("student", flow_matching_loss()),
        accumulation=fs.Accumulation(microbatches=k),
        clip=fs.clip_grad_norm(0.5, foreach=foreach),
    )
    for i in range(NUM_STEPS):
        state, _ = step(state, batch_at(i))

    opt = hand_written_loop(reference, seed=7, k=k, max_norm=0.5, foreach=foreach)

    tree.assert_trees_equal(state.roles["student"].params, dict(reference.named_parameters()))
    ours = state.roles["student"].opt_state
    theirs = {n: opt.state[p] for n, p in reference.named_parameters()}
    tree.assert_trees_equal(ours.exp_avg, {n: s["exp_avg"] for n, s in theirs.items()})
    tree.assert_trees_equal(ours.exp_avg_sq, {n: s["exp_avg_sq"] for n, s in theirs.items()})
    tree.assert_trees_equal(ours.step, {n: s["step"] for n, s in theirs.items()})


def test_the_overhead_benchmarks_two_sides_train_bitwise_the_same_model():
    # The benchmark times fvstep against the same reference loop as above: with the same
    # keys both sides do the same arithmetic, so they end bitwise equal (one process, fp32).
    from benchmarks import common, overhead, presets

    args = overhead.build_parser().parse_args(["--preset", "tiny-wan", "--k", "2"])
    rt = common.setup_runtime("cpu")
    try:
        preset = presets.PRESETS[args.preset]
        fv, hand = overhead._build_sides(preset, args, rt, "fp32", False)
        batch = presets.make_batch(preset, 2 * args.batch_per_microbatch, device=rt.device, seed=0)
        for _ in range(3):
            fv.step(batch)
            hand.step(batch)
    finally:
        common.teardown_runtime(rt)
    tree.assert_trees_equal(fv.state.roles["student"].params, dict(hand.module.named_parameters()))
