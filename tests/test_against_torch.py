"""A compiled fine-tune step against a hand-written PyTorch loop: bitwise equal.

The hand-written loop uses only torch and diffusers: ``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``, K micro-batches with ``loss / K``. It draws its noise
with the key derivation fvstep documents (``fold_in(fold_in(fold_in(fold_in(key, step), rank 0), position 0), m)``,
then ``split`` into time and noise keys), so both sides see the same numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fvstep as fs
from fvstep import tree
from fvstep.methods.finetune import flow_matching_loss
from fvstep.models import synthetic_batch, tiny_wan
from fvstep.random import fold_in, generator, split

NUM_STEPS = 10
LR = fs.schedules.warmup_cosine(1e-3, warmup_steps=3, total_steps=NUM_STEPS)


def batch_at(step: int) -> dict:
    return synthetic_batch(fold_in(fs.random.key(99), step), batch_size=4)


def hand_written_loop(module, seed: int, k: int, max_norm: float, foreach: bool | None):
    opt = torch.optim.AdamW(
        module.parameters(), lr=1.0, betas=(0.9, 0.95), weight_decay=0.1, foreach=foreach
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: LR(c))
    base = fs.random.key(seed)
    for step in range(NUM_STEPS):
        batch = batch_at(step)
        micro = zip(batch["latents"].chunk(k), batch["text"].chunk(k), strict=False)
        for m, (x0, text) in enumerate(micro):
            k_t, k_eps = split(fold_in(fold_in(fold_in(fold_in(base, step), 0), 0), m), 2)
            t = torch.rand((x0.shape[0],), generator=generator(k_t))
            eps = torch.randn(x0.shape, generator=generator(k_eps))
            tb = t.view(-1, 1, 1, 1, 1)
            x_t = (1 - tb) * x0 + tb * eps
            v = module(
                hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text, return_dict=False
            )[0]
            (F.mse_loss(v.float(), (eps - x0).float()) / k).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=foreach)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return opt


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
