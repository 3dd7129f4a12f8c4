"""Laws of compiled steps: determinism, purity, every(n), skip, accumulation, and the
equality with a hand-written PyTorch loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fvstep as fs
from fvstep.core import tree
from fvstep.core.random import generator


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))


def regression_loss(role: str):
    def loss_fn(state, batch, key):
        noise = torch.randn(batch["x"].shape, generator=generator(key)) * 0.01
        pred = state.module(role)(batch["x"] + noise)
        return ((pred - batch["y"]) ** 2).mean(), {"pred_mean": pred.mean()}

    return loss_fn


def deterministic_loss(role: str):
    def loss_fn(state, batch, key):
        module = state.module(role)
        return ((module[3](module[2](module[0](batch["x"]))) - batch["y"]) ** 2).mean()

    return loss_fn


def make_batch(seed: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, generator=g), "y": torch.randn(n, 2, generator=g)}


def two_role_state(seed: int = 0, lr=1e-2, ema=None) -> fs.TrainState:
    return fs.TrainState.create(
        {
            "a": fs.Role(mlp(seed), optimizer=fs.optim.adamw(lr=lr), ema=ema),
            "b": fs.Role(mlp(seed + 1), optimizer=fs.optim.sgd(lr=0.1, momentum=0.9)),
            "frozen": fs.Role(mlp(seed + 2)),
        },
        key=fs.random.key(seed),
    )


def two_role_method(n: int = 2):
    def b_loss(state, batch, key):
        with torch.no_grad():
            target = state.module("frozen")(batch["x"])
        return ((state.module("b")(batch["x"]) - target) ** 2).mean()

    return fs.sequence(fs.update("a", regression_loss("a")), fs.every(n, fs.update("b", b_loss)))


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    k=st.sampled_from([1, 2, 4]),
    sync=st.sampled_from(["every", "no_sync", "deferred"]),
    sanitize=st.sampled_from([None, "error", "nan_to_num", "skip"]),
)
def test_a_step_is_deterministic_given_a_cloned_state_batch_and_key(seed, k, sync, sanitize):
    step = fs.compile(
        two_role_method(),
        accumulation=fs.Accumulation(microbatches=k, sync=sync),
        clip=fs.clip_grad_norm(0.5),
        sanitize=sanitize,
    )
    state = two_role_state(seed, ema=fs.EMA(0.5))
    batch = make_batch(seed)
    twin = tree.clone(state)
    new, metrics = step(state, batch)
    new_twin, metrics_twin = step(twin, batch)
    tree.assert_trees_equal(new, new_twin)
    tree.assert_trees_equal(metrics, metrics_twin)


def test_a_consumed_input_raises_and_a_clone_stays_untouched():
    step = fs.compile(two_role_method())
    state = two_role_state()
    keep = tree.clone(state)
    digest = tree.tree_digest(keep)
    new, _ = step(state, make_batch(0))
    with pytest.raises(fs.ConsumedStateError, match="step function at step 0"):
        step(state, make_batch(0))
    with pytest.raises(fs.ConsumedStateError, match="TrainState.roles"):
        _ = state.roles
    assert tree.tree_digest(keep) == digest
    assert int(new.step) == 1
    changed = tree.tree_digest(new.roles["a"].params) != tree.tree_digest(keep.roles["a"].params)
    assert changed


def _role_digest(state, role):
    rs = state.roles[role]
    return tree.tree_digest((rs.params, rs.opt_state, rs.ema))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 4), offset=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_every_changes_a_role_only_on_its_steps(n, offset, seed):
    method = fs.sequence(
        fs.update("a", regression_loss("a")),
        fs.every(n, fs.update("b", deterministic_loss("b")), offset=offset),
    )
    step = fs.compile(method)
    state = two_role_state(seed)
    for i in range(8):
        before = _role_digest(state, "b"), int(state.roles["b"].opt_state.count)
        frozen_before = tree.tree_digest(state.roles["frozen"].params)
        state, metrics = step(state, make_batch(seed + i))
        runs = i >= offset and (i - offset) % n == 0
        after = _role_digest(state, "b"), int(state.roles["b"].opt_state.count)
        assert (before[0] != after[0]) == runs, f"step {i}"
        assert after[1] == before[1] + int(runs)
        assert ("b/loss" in metrics) == runs
        assert [e.roles for e in fs.plan(step, i)] == [("a",)] + [("b",)] * runs
        assert tree.tree_digest(state.roles["frozen"].params) == frozen_before


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), bad=st.sampled_from([float("nan"), float("inf")]))
def test_skip_on_non_finite_leaves_the_state_bit_identical(seed, bad):
    def poisoned(state, batch, key):
        return state.module("a")(batch["x"]).sum() * bad

    step = fs.compile(fs.update("a", poisoned), sanitize="skip", clip=fs.clip_grad_norm(1.0))
    state = two_role_state(seed, ema=fs.EMA(0.5))
    before = tree.clone(state)
    new, metrics = step(state, make_batch(seed))
    assert metrics["a/skipped"] is True
    tree.assert_trees_equal(new.roles, before.roles)
    assert all(p.grad is None for p in new.roles["a"].params.values())


def test_nan_to_num_zeroes_non_finite_gradients_and_steps():
    def half_poisoned(state, batch, key):
        out = state.module("a")(batch["x"])
        return out[:, 0].mean() + out[:, 1].mean() * float("nan")

    step = fs.compile(fs.update("a", half_poisoned), sanitize="nan_to_num")
    state = two_role_state()
    new, metrics = step(state, make_batch(0))
    assert metrics["a/skipped"] is False
    assert all(torch.isfinite(p).all() for p in new.roles["a"].params.values())


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.sampled_from([2, 4]))
def test_k_microbatches_approximate_one_batch_of_k_times_the_size(seed, k):
    # Float32 summation order differs (K partial means vs one mean), so equality holds
    # to rounding: after one SGD step parameters agree to 1e-6 absolute.
    def run(microbatches):
        state = fs.TrainState.create(
            {"a": fs.Role(mlp(seed), optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(seed)
        )
        step = fs.compile(
            fs.update("a", deterministic_loss("a")),
            accumulation=fs.Accumulation(microbatches=microbatches),
        )
        new, _ = step(state, make_batch(seed, n=4 * k))
        return new.roles["a"].params

    split, whole = run(k), run(1)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5)


def test_gradients_reach_only_the_trained_role_and_no_grad_outlives_the_unit():
    seen = {}

    def critic_reads_student(state, batch, key):
        x = state.module("b")(batch["x"])  # the other role's forward, with grad mode on
        seen["b_requires_grad"] = x.requires_grad
        return ((state.module("a")(batch["x"]) - x) ** 2).mean()

    step = fs.compile(fs.update("a", critic_reads_student))
    state = two_role_state()
    b_before = tree.clone(state.roles["b"])
    new, _ = step(state, make_batch(0))
    assert seen["b_requires_grad"] is False
    assert all(p.grad is None for rs in new.roles.values() for p in rs.params.values())
    assert all(p.requires_grad for p in new.roles["b"].params.values())
    tree.assert_trees_equal(new.roles["b"], b_before)


def test_a_dict_of_losses_backpropagates_their_sum_once():
    def fused(state, batch, key):
        b = state.module("b")(batch["x"])
        a = state.module("a")(batch["x"])
        # a's loss reads b's output detached (the contract); b's loss is its own.
        return {"a": ((a - b.detach()) ** 2).mean(), "b": (b**2).mean()}, {}

    def b_only(state, batch, key):
        return (state.module("b")(batch["x"]) ** 2).mean()

    fused_state = two_role_state()
    reference = tree.clone(fused_state)
    # One name, so both units draw the same keys (the modules have dropout).
    new, metrics = fs.compile(fs.update(("a", "b"), fused, name="u"))(fused_state, make_batch(0))
    ref, _ = fs.compile(fs.update("b", b_only, name="u"))(reference, make_batch(0))
    tree.assert_trees_equal(new.roles["b"], ref.roles["b"])
    assert "a/loss" in metrics and "b/loss" in metrics


def test_ema_is_reinitialised_from_live_weights_at_its_first_active_step():
    state = two_role_state(ema=fs.EMA(0.5, start_step=2))
    step = fs.compile(fs.update("a", regression_loss("a")))
    ema0 = tree.clone(state.roles["a"].ema.params)
    for _ in range(2):
        state, _ = step(state, make_batch(0))
    tree.assert_trees_equal(state.roles["a"].ema.params, ema0)  # not active yet
    state, _ = step(state, make_batch(0))
    live = {n: p.detach().float().clone() for n, p in state.roles["a"].params.items()}
    tree.assert_trees_equal(state.roles["a"].ema.params, live)
    state, _ = step(state, make_batch(1))
    assert bool(state.roles["a"].ema.initialized)
    expected = {
        n: 0.5 * live[n] + 0.5 * p.detach().float() for n, p in state.roles["a"].params.items()
    }
    for n in expected:
        torch.testing.assert_close(state.roles["a"].ema.params[n], expected[n])


def test_learning_rate_follows_the_roles_own_update_count():
    method = fs.every(3, fs.update("a", regression_loss("a")))
    state = fs.TrainState.create(
        {"a": fs.Role(mlp(0), optimizer=fs.optim.sgd(lr=lambda c: 0.1 * (c + 1)))},
        key=fs.random.key(0),
    )
    step = fs.compile(method)
    lrs = []
    for i in range(7):
        state, metrics = step(state, make_batch(i))
        if "a/lr" in metrics:
            lrs.append(metrics["a/lr"])
    assert lrs == [0.1, 0.2, 0.30000000000000004]


def test_metrics_are_means_over_microbatches():
    def loss_fn(state, batch, key):
        return state.module("a")(batch["x"]).sum() * 0 + batch["y"].sum(), {"m": batch["y"].sum()}

    step = fs.compile(fs.update("a", loss_fn), accumulation=fs.Accumulation(microbatches=2))
    batch = {"x": torch.zeros(2, 3), "y": torch.tensor([[1.0, 0.0], [3.0, 0.0]])}
    _, metrics = step(two_role_state(), batch)
    assert float(metrics["a/loss"]) == 2.0 and float(metrics["a/m"]) == 2.0


def test_bad_configuration_is_rejected_clearly():
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        fs.Accumulation(microbatches=0)
    with pytest.raises(ValueError, match="unknown sync policy"):
        fs.Accumulation(sync="sometimes")
    with pytest.raises(ValueError, match="unknown sanitize"):
        fs.compile(fs.update("a", regression_loss("a")), sanitize="ignore")
    with pytest.raises(TypeError, match="must be a step"):
        fs.sequence(lambda s, b, k: 0)
    with pytest.raises(ValueError, match="n >= 1"):
        fs.every(0, fs.update("a", regression_loss("a")))
    step = fs.compile(fs.update("frozen", regression_loss("frozen")))
    with pytest.raises(ValueError, match="trains role 'frozen', which is frozen"):
        step(two_role_state(), make_batch(0))
    step = fs.compile(fs.update("a", regression_loss("a")), accumulation=fs.Accumulation(3))
    with pytest.raises(ValueError, match="not divisible by microbatches=3"):
        step(two_role_state(), make_batch(0))
    with pytest.raises(ValueError, match="one or more role names"):
        fs.update((), regression_loss("a"))


def test_a_list_of_microbatches_is_taken_as_given():
    step = fs.compile(fs.update("a", deterministic_loss("a")), accumulation=fs.Accumulation(2))
    s1, s2 = two_role_state(), two_role_state()
    b = make_batch(0)
    n1, _ = step(s1, b)
    n2, _ = step(s2, [{"x": b["x"][:2], "y": b["y"][:2]}, {"x": b["x"][2:], "y": b["y"][2:]}])
    with pytest.raises(AssertionError, match="static metadata"):
        tree.assert_trees_equal(n1, n2)  # two states of different module objects
    tree.assert_trees_equal(n1, n2, check_static=False)


def test_joint_clip_is_one_clip_grad_norm_over_all_roles_of_the_unit():
    def fused(state, batch, key):
        a = state.module("a")[0](batch["x"])
        b = state.module("b")[0](batch["x"])
        return {"a": (a**2).mean() * 10, "b": (b**2).mean()}, {}

    state = fs.TrainState.create(
        {
            "a": fs.Role(mlp(0), optimizer=fs.optim.sgd(lr=0.1)),
            "b": fs.Role(mlp(1), optimizer=fs.optim.sgd(lr=0.1)),
        },
        key=fs.random.key(0),
    )
    a_ref, b_ref = mlp(0), mlp(1)
    batch = make_batch(0)
    step = fs.compile(fs.update(("a", "b"), fused), clip=fs.clip_grad_norm(0.1, joint=True))
    new, metrics = step(state, batch)
    # by hand: both losses, one clip over both modules' parameters, SGD
    ((a_ref[0](batch["x"]) ** 2).mean() * 10).backward()
    ((b_ref[0](batch["x"]) ** 2).mean()).backward()
    params = [p for m in (a_ref, b_ref) for p in m.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    assert torch.equal(metrics["a+b/grad_norm"], norm)
    tree.assert_trees_equal(new.roles["a"].params, dict(a_ref.named_parameters()))
    tree.assert_trees_equal(new.roles["b"].params, dict(b_ref.named_parameters()))
