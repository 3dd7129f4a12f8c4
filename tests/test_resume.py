"""The resume law: a run interrupted (once or twice, at drawn steps) and resumed from its
checkpoints ends in bitwise the same state as a run that never stopped.

Drawn: seed, num_steps <= 6, interruption steps, checkpoint interval, K in {1, 2, 3},
sync policy, method in {fine-tune, DMD2, RL-managed}; world size 1 (in process) and 2
(two gloo ranks, FSDP2-sharded roles). ``-m heavy`` runs many more examples.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fvstep as fs
import fvstep.methods
from fvstep import parallel as fsp
from fvstep.core.random import fold_in
from fvstep.methods import dmd2, finetune, rl
from fvstep.methods.models import synthetic_batch, tiny_wan
from fvstep.testing import assert_resume_exact, resume_scenarios

METHODS = ["finetune", "dmd2", "rl"]


class SyntheticData:
    """Per-rank synthetic batches: a pure function of (step, rank)."""

    def __init__(self, seed: int, batch_size: int) -> None:
        self.key = fs.random.key(seed)
        self.batch_size = batch_size

    def batch(self, step: int, *, rank: int = 0, world_size: int = 1) -> dict:
        return synthetic_batch(
            fold_in(fold_in(self.key, step), rank), batch_size=self.batch_size, frames=1
        )


def make_factory(method: str, seed: int, microbatches: int, sync: str, sharded: bool):
    def module(s: int) -> torch.nn.Module:
        m = tiny_wan(seed=s, num_layers=1)
        return fsp.shard_module(m, mesh=fsp.make_mesh(device_type="cpu")) if sharded else m

    def trained(m: torch.nn.Module, **kw) -> fs.Role:
        return fs.Role(
            m, optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.01), allow_no_sync=True, **kw
        )

    def factory():
        if method == "finetune":
            roles = {"student": trained(module(seed), ema=fs.EMA(0.9, start_step=1))}
            program = finetune()
        elif method == "dmd2":
            base = tiny_wan(seed=seed, num_layers=1)
            wrap = (
                (lambda m: fsp.shard_module(m, mesh=fsp.make_mesh(device_type="cpu")))
                if sharded
                else (lambda m: m)
            )
            roles = {
                "student": trained(wrap(copy.deepcopy(base))),
                "teacher": fs.Role(wrap(base)),
                "critic": trained(module(seed + 1)),
            }
            program = dmd2(generator_update_interval=2, ordering="sequential")
        else:
            roles = {
                "student": trained(module(seed)),
                "old": fs.Role(module(seed)),
                "reference": fs.Role(module(seed)),
            }
            program = rl(num_inner=2, group_size=2)
        state = fs.TrainState.create(roles, key=fs.random.key(seed))
        step = fs.compile(
            program,
            accumulation=fs.Accumulation(microbatches=microbatches, sync=sync),
            clip=fs.clip_grad_norm(1.0),
        )
        return state, step, SyntheticData(seed, batch_size=microbatches)

    return factory


scenario_args = {
    "scenario": resume_scenarios(max_steps=6, max_interruptions=2),
    "method": st.sampled_from(METHODS),
    "every": st.sampled_from([1, 2]),
}


def check_resume(method: str, scenario, every: int, workdir: str, sharded: bool) -> None:
    factory = make_factory(method, scenario.seed, scenario.microbatches, scenario.sync, sharded)
    assert_resume_exact(
        factory,
        num_steps=scenario.num_steps,
        interruptions=scenario.interruptions,
        workdir=workdir,
        checkpoint_every=every,
    )


@settings(max_examples=9, deadline=None)
@given(**scenario_args)
def test_resumed_run_equals_uninterrupted_run_bitwise_on_one_process(scenario, method, every):
    with tempfile.TemporaryDirectory() as workdir:
        check_resume(method, scenario, every, workdir, sharded=False)


def resume_on_ranks(
    rank: int, world_size: int, method: str, scenario, every: int, workdir: str
) -> bool:
    check_resume(method, scenario, every, workdir, sharded=True)
    return True


@pytest.mark.multirank
@settings(max_examples=6, deadline=None)
@given(**scenario_args)
def test_resumed_run_equals_uninterrupted_run_bitwise_on_two_ranks(ranks, scenario, method, every):
    with tempfile.TemporaryDirectory() as workdir:
        assert ranks.run(resume_on_ranks, method, scenario, every, workdir) == [True, True]


@pytest.mark.heavy
@settings(max_examples=60, deadline=None)
@given(**scenario_args, world=st.sampled_from([1, 2]))
def test_resume_law_heavy(ranks, scenario, method, every, world):
    with tempfile.TemporaryDirectory() as workdir:
        if world == 1:
            check_resume(method, scenario, every, workdir, sharded=False)
        else:
            assert ranks.run(resume_on_ranks, method, scenario, every, workdir) == [True, True]


def test_async_saves_resume_exactly(tmp_path):
    factory = make_factory("finetune", 3, 2, "every", sharded=False)
    assert_resume_exact(
        factory, num_steps=5, interruptions=[2, 3], workdir=tmp_path, async_save=True
    )


def test_method_owned_state_outside_the_train_state_is_caught(tmp_path):
    # The reference's failure mode: a counter the method keeps on itself is not in the
    # checkpoint, so a resumed run silently restarts it. The law catches it.
    def leaky_factory():
        state, _, data = make_factory("finetune", 0, 1, "every", sharded=False)()
        calls = {"n": 0}
        inner = fs.methods.flow_matching_loss()

        def loss(state, batch, key):
            calls["n"] += 1
            return inner(state, batch, key)[0] * (1.0 + 0.1 * calls["n"])

        return state, fs.compile(fs.update("student", loss)), data

    with pytest.raises(AssertionError, match="resumed differs"):
        assert_resume_exact(leaky_factory, num_steps=4, interruptions=[2], workdir=tmp_path)


def test_resume_stays_exact_with_torch_compile_per_block(tmp_path):
    # The bench's --compile applies torch.compile to each transformer block (as torchtitan
    # does); compiled kernels are deterministic, so the law must still hold.
    def factory():
        module = tiny_wan(seed=0)
        for block in module.blocks:
            block.compile()
        state = fs.TrainState.create(
            {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
        )
        step = fs.compile(finetune(), accumulation=fs.Accumulation(2), clip=fs.clip_grad_norm(1.0))
        return state, step, SyntheticData(1, batch_size=2)

    assert_resume_exact(
        factory, num_steps=5, interruptions=[2, 3], workdir=tmp_path, checkpoint_every=2
    )
