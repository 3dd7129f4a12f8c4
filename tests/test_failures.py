"""Steps fail loudly and never write a wrong value.

- A NaN or infinite gradient (or loss) raises ``NonFiniteGradientError`` under the default
  ``sanitize="error"`` before any leaf changes, naming the step, unit, role and parameter;
  on two ranks both raise (the decision is global), even when only one rank's data or
  shard is bad.
- A role-name typo is caught before the step consumes its input.
- A step that raises before changing a leaf (a bad batch, an error in a loss function's
  forward or backward, a non-finite gradient of its first unit) leaves its input usable
  and bit-unchanged; one that raises after some leaves changed raises ``StepFailedError``
  saying the state is partly updated and how to recover.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.core.random import fold_in
from fvstep.core.state import is_consumed
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import predict, synthetic_batch, tiny_wan

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def linear(seed: int, n_in: int = 3, n_out: int = 2) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(n_in, n_out)


def linear_state(seed: int = 0) -> fs.TrainState:
    """A student and a critic (trained, AdamW with an EMA / SGD) and a frozen teacher."""
    return fs.TrainState.create(
        {
            "student": fs.Role(linear(seed), optimizer=fs.optim.adamw(lr=1e-2), ema=fs.EMA(0.5)),
            "critic": fs.Role(linear(seed + 1), optimizer=fs.optim.sgd(lr=0.1, momentum=0.9)),
            "teacher": fs.Role(linear(seed + 2)),
        },
        key=fs.random.key(seed),
    )


def make_batch(seed: int = 0, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    # Positive inputs: an infinite output gradient gives +inf weight gradients (no inf - inf).
    return {"x": torch.rand(n, 3, generator=g) + 0.5, "y": torch.randn(n, 2, generator=g)}


def mse(role: str):
    def loss_fn(state, batch, key):
        with torch.no_grad():
            target = state.module("teacher")(batch["x"])
        return ((state.module(role)(batch["x"]) - target - batch["y"]) ** 2).mean()

    return loss_fn


def sqrt_at_zero(role: str):
    """A finite loss (``sqrt(0) = 0`` is added) whose backward is infinite: d sqrt(u)/du at
    0 is inf, so output 0's gradient, and with it row 0 of the weight, is +inf."""

    def loss_fn(state, batch, key):
        out = state.module(role)(batch["x"])
        return ((out - batch["y"]) ** 2).mean() + torch.sqrt(out[:, 0] - out[:, 0].detach()).sum()

    return loss_fn


class NaNGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a custom op with a broken gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def assert_usable_and_unchanged(state: fs.TrainState, before: fs.TrainState) -> None:
    assert not is_consumed(state)
    tree.assert_trees_equal(state, before)
    assert fsp.unrested_modules(state) == []


def assert_a_later_step_equals_a_fresh_one(state: fs.TrainState, before: fs.TrainState, step):
    """The failed-on state steps exactly like a snapshot taken before the failure."""
    batch = make_batch(1)
    ours, _ = step(state, batch)
    ours = tree.clone(ours)
    fresh, _ = step(before, batch)
    tree.assert_trees_equal(ours, fresh)


# ---------------------------------------------------------------------------------------
# A. non-finite gradients and losses
# ---------------------------------------------------------------------------------------


def test_error_is_the_default_sanitize_policy():
    step = fs.compile(fs.update("student", mse("student")))
    assert [e.sanitize for e in fs.plan(step, 0)] == ["error"]


def test_an_infinite_gradient_of_a_finite_loss_raises_and_changes_no_leaf():
    state = linear_state()
    before = tree.clone(state)
    step = fs.compile(fs.update("student", sqrt_at_zero("student")))
    with pytest.raises(fs.NonFiniteGradientError) as info:
        step(state, make_batch(0))
    message = str(info.value)
    assert "step 0" in message and "unit 'student'" in message and "role 'student'" in message
    assert "'weight' has Inf entries" in message
    assert "sanitize='skip'" in message
    e = info.value
    assert (e.step, e.unit, e.role, e.parameter, e.kind) == (
        0,
        "student",
        "student",
        "weight",
        "Inf",
    )
    assert isinstance(e, FloatingPointError)
    assert_usable_and_unchanged(state, before)


def test_a_custom_function_with_a_nan_backward_raises_naming_the_parameter():
    def loss_fn(state, batch, key):
        module = state.module("student")
        return NaNGrad.apply(module(batch["x"])).pow(2).mean()

    state = linear_state()
    before = tree.clone(state)
    step = fs.compile(fs.update("student", loss_fn), clip=fs.clip_grad_norm(1.0))
    with pytest.raises(fs.NonFiniteGradientError, match="'weight' has NaN entries"):
        step(state, make_batch(0))
    assert_usable_and_unchanged(state, before)
    # With the input left usable, the run can continue (with a loss that works).
    good = fs.compile(fs.update("student", mse("student")), clip=fs.clip_grad_norm(1.0))
    assert_a_later_step_equals_a_fresh_one(state, before, good)


def test_a_non_finite_loss_raises_naming_the_role_and_microbatch():
    state = linear_state()
    before = tree.clone(state)
    batch = make_batch(0)
    batch["x"][3, 0] = float("nan")  # micro-batch 1 of 2
    step = fs.compile(fs.update("student", mse("student")), accumulation=fs.Accumulation(2))
    with pytest.raises(fs.NonFiniteGradientError) as info:
        step(state, batch)
    assert "the loss of role 'student' is nan (NaN) at micro-batch 1 of 2" in str(info.value)
    assert (info.value.role, info.value.microbatch) == ("student", 1)
    assert_usable_and_unchanged(state, before)


def test_a_non_finite_gradient_of_the_second_role_stops_the_first_roles_update():
    # Per-role groups are measured before any optimizer steps.
    def fused(state, batch, key):
        a = state.module("student")(batch["x"])
        return {"student": (a**2).mean(), "critic": sqrt_at_zero("critic")(state, batch, key)}, {}

    state = linear_state()
    before = tree.clone(state)
    step = fs.compile(fs.update(("student", "critic"), fused), clip=fs.clip_grad_norm(1.0))
    with pytest.raises(fs.NonFiniteGradientError, match="role 'critic'"):
        step(state, make_batch(0))
    assert_usable_and_unchanged(state, before)


def test_a_nan_in_a_tiny_wan_batch_raises_and_leaves_the_state_unchanged():
    state = fs.TrainState.create(
        {"student": fs.Role(tiny_wan(seed=0, num_layers=1), optimizer=fs.optim.adamw(lr=1e-3))},
        key=fs.random.key(0),
    )
    before = tree.clone(state)
    batch = synthetic_batch(fs.random.key(1), batch_size=2, frames=1)
    batch["latents"][0, 0, 0, 0, 0] = float("inf")
    step = fs.compile(fs.update("student", flow_matching_loss()), clip=fs.clip_grad_norm(1.0))
    with pytest.raises(fs.NonFiniteGradientError, match="role 'student'"):
        step(state, batch)
    assert_usable_and_unchanged(state, before)


def test_with_clipping_the_check_reuses_the_clip_norm(monkeypatch):
    calls = []
    real = torch.nn.utils.get_total_norm  # what fvstep.core.engine measures the norm with

    def counting(grads, *args, **kwargs):
        calls.append((args, kwargs))
        return real(grads, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", counting)
    step = fs.compile(fs.update("student", mse("student")), clip=fs.clip_grad_norm(1.0))
    reference = linear(0)
    state = linear_state()
    _, metrics = step(state, make_batch(0))
    assert len(calls) == 1  # one norm for the clip and the check
    with torch.no_grad():
        target = linear(2)(make_batch(0)["x"])
    ((reference(make_batch(0)["x"]) - target - make_batch(0)["y"]) ** 2).mean().backward()
    assert torch.equal(
        metrics["student/grad_norm"], torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    )


def test_sanitize_none_is_the_unchecked_opt_out():
    state = linear_state()
    step = fs.compile(fs.update("student", sqrt_at_zero("student")), sanitize=None)
    new, _ = step(state, make_batch(0))
    assert not torch.isfinite(new.roles["student"].params["weight"]).all()


# ---------------------------------------------------------------------------------------
# B1. role names are checked before the step consumes its input
# ---------------------------------------------------------------------------------------


def test_a_role_typo_is_caught_before_the_input_is_consumed():
    state = linear_state()
    step = fs.compile(fs.update("studnet", mse("student")))
    with pytest.raises(ValueError, match=r"no role 'studnet'.*did you mean 'student'\?") as info:
        step(state, make_batch(0))
    assert "['critic', 'student', 'teacher']" in str(info.value)
    assert not is_consumed(state)
    fs.compile(fs.update("student", mse("student")))(state, make_batch(0))


def test_a_typo_in_a_branch_that_does_not_run_at_this_step_is_caught_too():
    state = linear_state()
    method = fs.sequence(
        fs.update("student", mse("student")),
        fs.every(5, fs.cond(lambda i: i > 100, fs.update("critc", mse("critic")))),
    )
    step = fs.compile(method)
    with pytest.raises(ValueError, match="unit 'critc' trains role 'critc'.*did you mean 'critic'"):
        step(state, make_batch(0))
    frozen = fs.compile(fs.cond(lambda i: False, fs.update("teacher", mse("teacher"))))
    with pytest.raises(ValueError, match="trains role 'teacher', which is frozen"):
        frozen(state, make_batch(0))
    typo = fs.compile(
        fs.managed(lambda s, b, k, ctx: (s, {}), trains="student", mutates="teachr", name="rl")
    )
    with pytest.raises(ValueError, match="managed step 'rl' mutates role 'teachr'"):
        typo(state, make_batch(0))
    assert not is_consumed(state)


# ---------------------------------------------------------------------------------------
# B2. a step that fails before changing a leaf leaves its input usable and unchanged
# ---------------------------------------------------------------------------------------


def test_a_batch_of_the_wrong_shape_leaves_the_state_usable_and_unchanged():
    state = linear_state()
    before = tree.clone(state)
    step = fs.compile(fs.update("student", mse("student")))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        step(state, {"x": torch.zeros(4, 5), "y": torch.zeros(4, 2)})
    with pytest.raises(RuntimeError):  # wrong dtype
        step(state, {"x": torch.zeros(4, 3, dtype=torch.float64), "y": torch.zeros(4, 2)})
    assert_usable_and_unchanged(state, before)
    assert_a_later_step_equals_a_fresh_one(state, before, step)


def test_a_loss_function_raising_in_forward_leaves_the_state_usable_and_unchanged():
    def failing(state, batch, key):
        state.module("student")(batch["x"])
        raise KeyError("no such column")

    state = linear_state()
    before = tree.clone(state)
    with pytest.raises(KeyError, match="no such column"):
        fs.compile(fs.update("student", failing), accumulation=fs.Accumulation(2))(
            state, make_batch(0)
        )
    assert_usable_and_unchanged(state, before)
    assert_a_later_step_equals_a_fresh_one(
        state, before, fs.compile(fs.update("student", mse("student")))
    )


def test_a_loss_function_raising_in_backward_leaves_the_state_usable_and_unchanged():
    def failing(state, batch, key):
        out = FailingBackward.apply(state.module("critic")(batch["x"]))
        return ((out - state.module("student")(batch["x"]).detach()) ** 2).mean()

    state = linear_state()
    before = tree.clone(state)
    with pytest.raises(RuntimeError, match="boom in backward"):
        fs.compile(fs.update("critic", failing))(state, make_batch(0))
    assert_usable_and_unchanged(state, before)  # the silenced student has requires_grad back
    assert_a_later_step_equals_a_fresh_one(
        state, before, fs.compile(fs.update("critic", mse("critic")))
    )


# ---------------------------------------------------------------------------------------
# B3. a step that fails after changing leaves says so, and how to recover
# ---------------------------------------------------------------------------------------


def test_a_second_unit_failing_raises_step_failed_error_and_consumes_the_input():
    def failing(state, batch, key):
        raise RuntimeError("critic data missing")

    state = linear_state()
    step = fs.compile(
        fs.sequence(fs.update("student", mse("student")), fs.update("critic", failing))
    )
    with pytest.raises(fs.StepFailedError) as info:
        step(state, make_batch(0))
    message = str(info.value)
    assert "step 0 failed in unit 'critic' (position 1" in message
    assert "already changed by unit 'student' (position 0" in message
    assert "partly updated" in message and "consumed" in message
    assert "fvstep.checkpoint.load(fvstep.checkpoint.latest(" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "critic data missing" in str(info.value.__cause__)
    assert is_consumed(state)
    with pytest.raises(fs.ConsumedStateError):
        _ = state.roles


def test_a_non_finite_gradient_of_a_second_unit_is_a_step_failed_error():
    state = linear_state()
    step = fs.compile(
        fs.sequence(
            fs.update("student", mse("student")), fs.update("critic", sqrt_at_zero("critic"))
        )
    )
    with pytest.raises(fs.StepFailedError, match="partly updated") as info:
        step(state, make_batch(0))
    assert isinstance(info.value.__cause__, fs.NonFiniteGradientError)
    assert is_consumed(state)


class Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.lin = linear(0)

    def forward(self, x):
        return self.lin(self.norm(x))


def test_a_loss_function_that_changed_a_buffer_before_raising_is_not_called_unchanged():
    # BatchNorm's forward updates its running statistics (state leaves) in place; its
    # counter num_batches_tracked shows it (the statistics' own version counters do not
    # move: the kernel writes them behind autograd's back).
    def failing(state, batch, key):
        state.module("student")(batch["x"])
        raise RuntimeError("after the forward")

    state = fs.TrainState.create(
        {"student": fs.Role(Normalized(), optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(0)
    )
    with pytest.raises(fs.StepFailedError, match="roles.student.buffers.norm.num_batches_tracked"):
        fs.compile(fs.update("student", failing))(state, make_batch(0))
    assert is_consumed(state)


def test_a_managed_step_that_fails_counts_as_having_changed_the_state():
    def outer(state, batch, key, ctx):
        raise RuntimeError("reward model crashed")

    state = linear_state()
    with pytest.raises(fs.StepFailedError, match="managed step 'rl'"):
        fs.compile(fs.managed(outer, trains="student", name="rl"))(state, make_batch(0))
    assert is_consumed(state)


def test_a_successful_step_still_consumes_its_input_even_when_nothing_ran():
    state = linear_state()
    step = fs.compile(fs.every(2, fs.update("student", mse("student")), offset=1))
    new, metrics = step(state, make_batch(0))
    assert metrics == {} and is_consumed(state) and int(new.step) == 1


# ---------------------------------------------------------------------------------------
# two ranks, FSDP2-sharded roles
# ---------------------------------------------------------------------------------------

K = 2
LAYOUT = fsp.Layout()  # the process layout of a step on several ranks


def wan_batch(step: int, rank: int) -> dict:
    return synthetic_batch(fold_in(fold_in(fs.random.key(99), step), rank), batch_size=4)


def sharded_wan_state(mesh) -> fs.TrainState:
    return fs.TrainState.create(
        {
            "student": fs.Role(
                fsp.shard_module(tiny_wan(seed=0), mesh=mesh), optimizer=fs.optim.adamw(lr=1e-3)
            ),
            "teacher": fs.Role(fsp.shard_module(tiny_wan(seed=1), mesh=mesh)),
        },
        key=fs.random.key(7),
    )


def check_nan_in_one_ranks_data(rank: int, world_size: int, replicate: int):
    mesh = fsp.make_mesh(replicate=replicate, device_type="cpu")
    state = sharded_wan_state(mesh)
    snapshot = tree.clone(state)
    step = fs.compile(
        fs.update("student", flow_matching_loss()),
        accumulation=fs.Accumulation(microbatches=K, sync="deferred"),
        clip=fs.clip_grad_norm(1.0),
    )
    batch = wan_batch(0, rank)
    if rank == 1:
        batch["latents"][3, 0, 0, 0, 0] = float("nan")  # rank 1, micro-batch 1
    try:
        step(state, batch, parallelism=LAYOUT)
    except fs.NonFiniteGradientError as e:
        message = str(e)
    else:
        message = None
    consumed = is_consumed(state)
    tree.assert_trees_equal(state, snapshot)
    assert fsp.unrested_modules(state) == []
    good, _ = step(state, wan_batch(1, rank), parallelism=LAYOUT)
    good = tree.clone(good)
    fresh, _ = step(snapshot, wan_batch(1, rank), parallelism=LAYOUT)
    tree.assert_trees_equal(good, fresh)
    return message, consumed


@pytest.mark.multirank
@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
def test_a_nan_in_one_ranks_data_raises_on_both_ranks_and_changes_nothing(ranks, replicate):
    (m0, c0), (m1, c1) = ranks.run(check_nan_in_one_ranks_data, replicate, timeout=120)
    assert m1 is not None and "the loss of role 'student' is nan (NaN) at micro-batch 1" in m1
    assert m0 is not None and "a loss was not finite on another rank" in m0
    assert not c0 and not c1


def check_inf_in_one_ranks_shard(rank: int, world_size: int):
    """Rank 0's loss has an infinite gradient for output row 0 only: after the
    reduce-scatter only rank 0's shard of the weight (rows 0-1 of 4) is not finite."""
    mesh = fsp.make_mesh(device_type="cpu")
    state = fs.TrainState.create(
        {
            "m": fs.Role(
                fsp.shard_module(linear(0, 3, 4), mesh=mesh), optimizer=fs.optim.sgd(lr=0.1)
            )
        },
        key=fs.random.key(0),
    )
    snapshot = tree.clone(state)

    def loss_fn(state, batch, key):
        out = state.module("m")(batch["x"])
        loss = (out**2).mean()
        if rank == 0:
            loss = loss + torch.sqrt(out[:, 0] - out[:, 0].detach()).sum()
        return loss

    step = fs.compile(fs.update("m", loss_fn))
    try:
        step(state, make_batch(rank), parallelism=LAYOUT)
    except fs.NonFiniteGradientError as e:
        error = (str(e), e.parameter, e.kind)
    else:
        error = None
    tree.assert_trees_equal(state, snapshot)
    return error, is_consumed(state)


@pytest.mark.multirank
def test_an_inf_in_one_ranks_shard_raises_on_both_ranks(ranks):
    (e0, c0), (e1, c1) = ranks.run(check_inf_in_one_ranks_shard, timeout=120)
    assert e0 is not None and e0[1:] == ("weight", "Inf") and "in this rank's shard" in e0[0]
    assert e1 is not None and e1[1] is None and "on another rank" in e1[0]
    assert not c0 and not c1


def _reads_teacher_then_fails_in_backward(state, batch, key):
    t = torch.full((batch["latents"].shape[0],), 500.0)
    with torch.no_grad():
        goal = predict(state.module("teacher"), batch["latents"], t, batch["text"])
    v = predict(state.module("student"), batch["latents"], t, batch["text"])
    return ((FailingBackward.apply(v) - goal) ** 2).mean()


def _student_reads_teacher(state, batch, key):
    t = torch.full((batch["latents"].shape[0],), 500.0)
    with torch.no_grad():
        goal = predict(state.module("teacher"), batch["latents"], t, batch["text"])
    return (
        (predict(state.module("student"), batch["latents"], t, batch["text"]) - goal) ** 2
    ).mean()


def check_first_unit_failure_on_sharded_roles(rank: int, world_size: int):
    mesh = fsp.make_mesh(device_type="cpu")
    state = sharded_wan_state(mesh)
    snapshot = tree.clone(state)
    acc = fs.Accumulation(microbatches=K, sync="deferred")
    failing = fs.compile(
        fs.update("student", _reads_teacher_then_fails_in_backward), accumulation=acc
    )
    try:
        failing(state, wan_batch(0, rank), parallelism=LAYOUT)
    except RuntimeError as e:
        assert "boom in backward" in str(e) and not isinstance(e, fs.StepFailedError)
    else:
        raise AssertionError("the step did not fail")
    assert not is_consumed(state)
    tree.assert_trees_equal(state, snapshot)
    assert fsp.unrested_modules(state) == []
    step = fs.compile(
        fs.update("student", _student_reads_teacher), accumulation=acc, clip=fs.clip_grad_norm(1.0)
    )
    ours, _ = step(state, wan_batch(1, rank), parallelism=LAYOUT)
    ours = tree.clone(ours)  # the snapshot's step below writes into the live shards
    fresh, _ = step(snapshot, wan_batch(1, rank), parallelism=LAYOUT)
    tree.assert_trees_equal(ours, fresh)
    return tree.tree_digest(ours.roles["student"].params)


@pytest.mark.multirank
def test_a_failed_first_unit_on_two_ranks_leaves_sharded_roles_usable_and_unchanged(ranks):
    a, b = ranks.run(check_first_unit_failure_on_sharded_roles, timeout=300)
    assert a and b


def check_typo_on_two_ranks(rank: int, world_size: int):
    state = sharded_wan_state(fsp.make_mesh(device_type="cpu"))
    step = fs.compile(fs.update("studnet", flow_matching_loss()))
    try:
        step(state, wan_batch(0, rank), parallelism=LAYOUT)
    except ValueError as e:
        return str(e), is_consumed(state)
    return None, is_consumed(state)


@pytest.mark.multirank
def test_a_typo_on_two_ranks_raises_on_both_before_consumption(ranks):
    for message, consumed in ranks.run(check_typo_on_two_ranks, timeout=120):
        assert message is not None and "did you mean 'student'" in message and not consumed


def check_unsharded_role_is_refused_before_consumption(rank: int, world_size: int):
    state = fs.TrainState.create(
        {"m": fs.Role(linear(0), optimizer=fs.optim.sgd(lr=0.1))}, key=fs.random.key(0)
    )
    step = fs.compile(fs.update("m", lambda s, b, k: s.module("m")(b["x"]).sum()))
    try:
        step(state, make_batch(0), parallelism=LAYOUT)
    except ValueError as e:
        refused = "not sharded" in str(e)
    else:
        refused = False
    try:  # the default layout (one process) refuses a process that is one of several ranks
        step(state, make_batch(0))
    except ValueError as e:
        refused = refused and "one of 2 ranks" in str(e) and "parallelism=" in str(e)
    else:
        refused = False
    return refused, is_consumed(state)


@pytest.mark.multirank
def test_an_unsharded_trained_role_on_two_ranks_is_refused_before_consumption(ranks):
    assert ranks.run(check_unsharded_role_is_refused_before_consumption) == [(True, False)] * 2
