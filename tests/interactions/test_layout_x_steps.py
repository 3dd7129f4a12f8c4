"""The layout of a call × the step's policies and shape × the optimizer implementation.

A step holds no layout: the same step object called with no layout (one process), with
a hand-written one-process ``Parallelism`` and with ``fvstep.parallel.Layout()`` (one process, plain modules)
computes bitwise the same state and metrics, whatever its policy (sanitize, accumulation,
clipping) and composition (one unit; two units of one role, whose metrics must both
survive; a managed step). And an optimizer state whose moment was replaced after
``TrainState.create`` by one that does not fit its parameter is refused before any
kernel runs, for every AdamW implementation (the fused one read it out of bounds).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

import fvstep as fs
from fvstep import parallel as fsp
from tests.multirank import OneRankReference

LAYOUTS = {"default": None, "one_process_protocol": OneRankReference(), "layout": fsp.Layout()}


def mlp(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))


def state_of(impl: dict | None = None) -> fs.TrainState:
    opt = fs.optim.adamw(lr=1e-2, **(impl or {}))
    return fs.TrainState.create(
        {"a": fs.Role(mlp(0), optimizer=opt, ema=fs.EMA(0.5))}, key=fs.random.key(0)
    )


def loss(state, batch, key):
    out = state.module("a")(batch["x"])
    return ((out - batch["y"]) ** 2).mean() + 1e-3 * torch.randn(())  # noise from the key


def batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"x": torch.randn(4, 3, generator=gen), "y": torch.randn(4, 2, generator=gen)}


def managed_step() -> fs.Step:
    unit = fs.update("a", loss, name="inner")

    def outer(state, b, key, ctx):
        state, m1 = ctx.update(state, unit, b, fs.random.fold_in(key, 0))
        return state, m1

    return fs.managed(outer, trains="a", name="m")


STEPS = {
    "unit": lambda: fs.update("a", loss),
    "two_units_one_role": lambda: fs.sequence(
        fs.update("a", loss, name="u1"), fs.update("a", loss, name="u2")
    ),
    "managed": managed_step,
}
POLICIES = {
    "error": {},
    "skip_clip": {"sanitize": "skip", "clip": fs.clip_grad_norm(0.1)},
    "acc2_nan_to_num": {"accumulation": fs.Accumulation(2), "sanitize": "nan_to_num"},
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", STEPS)
def test_one_step_object_computes_the_same_under_every_layout_of_one_process(shape, policy):
    step = fs.compile(STEPS[shape](), **POLICIES[policy])
    results = {}
    for name, layout in LAYOUTS.items():
        state, log = state_of(), []
        for i in range(3):
            state, metrics = step(state, batch(i), parallelism=layout)
            log.append(metrics)
        results[name] = (state, log)
    (ref_state, ref_log), *others = results.values()
    for state, log in others:
        fs.tree.assert_trees_equal(state.roles, ref_state.roles, check_static=False)
        assert [sorted(m) for m in log] == [sorted(m) for m in ref_log]
        for got, want in zip(log, ref_log):
            for k in want:
                assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])), k
    if shape == "two_units_one_role":  # both units' losses are reported
        assert {"a/loss", "u2/a/loss"} <= set(ref_log[0])


IMPLS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.mark.parametrize("bad", ["smaller", "flat", "dtype"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_moment_replaced_after_create_is_refused_before_any_kernel(impl, bad):
    state = state_of(IMPLS[impl])
    rs = state.roles["a"]
    p = rs.params["0.weight"]
    wrong = {
        "smaller": torch.zeros(p.numel() // 2),
        "flat": torch.zeros(p.numel()),
        "dtype": torch.zeros(p.shape, dtype=torch.float64),
    }[bad]
    opt_state = attrs.evolve(rs.opt_state, exp_avg={**rs.opt_state.exp_avg, "0.weight": wrong})
    state = state.replace(roles={"a": attrs.evolve(rs, opt_state=opt_state)})
    before = {n: x.clone() for n, x in rs.params.items()}
    with pytest.raises(fs.StepFailedError) as info:  # consumed: the unit had begun its update
        fs.update("a", loss)(state, batch(0))
    assert "state.exp_avg['0.weight']" in str(info.value.__cause__)
    for n, x in before.items():  # no kernel ran: the parameters are as they were
        assert torch.equal(rs.params[n], x), n
