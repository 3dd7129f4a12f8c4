"""TrainState: creation, static metadata, consumption, and the errors for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fvstep as fs
from fvstep.core import tree
from fvstep.core.state import is_consumed, mark_consumed


def net(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(dtype)


def make_state(**extra) -> fs.TrainState:
    return fs.TrainState.create(
        {
            "student": fs.Role(net(0), optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.9)),
            "teacher": fs.Role(net(1)),
        },
        key=fs.random.key(0),
        **extra,
    )


def test_create_holds_live_params_eager_optimizer_state_ema_step_and_key():
    state = make_state()
    student = state.roles["student"]
    module = student.role.module
    assert all(student.params[n] is p for n, p in module.named_parameters())
    assert set(student.opt_state.exp_avg) == set(student.params)
    assert set(student.ema.params) == set(student.params)
    assert all(v.dtype == torch.float32 for v in student.ema.params.values())
    assert int(state.step) == 0 and fs.random.is_key(state.key)
    assert state.roles["teacher"].opt_state is None
    assert not any(p.requires_grad for p in state.roles["teacher"].params.values())


def test_paths_are_the_checkpoint_keys():
    paths, _, _ = tree.flatten_with_paths(make_state())
    assert "roles.student.params.0.weight" in paths
    assert "roles.student.opt_state.exp_avg.0.weight" in paths
    assert "roles.student.ema.params.2.bias" in paths
    assert "step" in paths and "key" in paths
    assert not any(p.startswith("roles.teacher.opt_state") for p in paths)


def test_modules_and_hyper_parameters_are_static_metadata():
    state = make_state()
    leaves = tree.leaves(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    c = tree.clone(state)
    assert c.roles["student"].role is state.roles["student"].role
    tree.assert_trees_equal(state, c)


def test_a_consumed_state_raises_naming_what_was_touched():
    state = make_state()
    mark_consumed(state, "the step at step 0")
    assert is_consumed(state)
    with pytest.raises(fs.ConsumedStateError, match=r"TrainState\.roles .*step at step 0"):
        _ = state.roles
    with pytest.raises(fs.ConsumedStateError, match="TrainState.step"):
        _ = state.step
    with pytest.raises(fs.ConsumedStateError):
        tree.clone(state)
    with pytest.raises(fs.ConsumedStateError, match="already consumed"):
        mark_consumed(state, "again")
    assert "consumed" in repr(state)


def test_replace_gives_a_fresh_unconsumed_state():
    state = make_state()
    new = state.replace(step=torch.tensor(5))
    mark_consumed(state, "x")
    assert int(new.step) == 5 and not is_consumed(new)


def test_same_module_in_two_roles_is_a_value_error():
    m = net()
    with pytest.raises(ValueError, match="roles 'student' and 'teacher' share a module"):
        fs.TrainState.create(
            {"student": fs.Role(m, optimizer=fs.optim.sgd(lr=0.1)), "teacher": fs.Role(m)},
            key=fs.random.key(0),
        )


def test_shared_parameter_across_roles_is_a_value_error():
    a, b = net(0), net(1)
    b[0].weight = a[0].weight
    with pytest.raises(ValueError, match="share"):
        fs.TrainState.create({"student": fs.Role(a), "teacher": fs.Role(b)}, key=fs.random.key(0))


def test_shared_storage_across_roles_is_a_value_error():
    a, b = net(0), net(1)
    with torch.no_grad():
        b[2].bias = nn.Parameter(a[2].bias.view(2))
    with pytest.raises(ValueError, match="share the tensor storage"):
        fs.TrainState.create({"student": fs.Role(a), "teacher": fs.Role(b)}, key=fs.random.key(0))


def test_two_copies_of_one_checkpoint_are_fine():
    a = net(0)
    state = fs.TrainState.create(
        {
            "student": fs.Role(a, optimizer=fs.optim.sgd(lr=0.1)),
            "teacher": fs.Role(copy.deepcopy(a)),
        },
        key=fs.random.key(0),
    )
    tree.assert_trees_equal(state.roles["student"].params, state.roles["teacher"].params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_masters_need_an_explicit_opt_in(dtype):
    with pytest.raises(ValueError, match="fp32 master weights"):
        fs.TrainState.create(
            {"student": fs.Role(net(0, dtype), optimizer=fs.optim.adamw(lr=1e-3))},
            key=fs.random.key(0),
        )
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                net(0, dtype), optimizer=fs.optim.adamw(lr=1e-3), allow_low_precision=True
            )
        },
        key=fs.random.key(0),
    )
    assert state.roles["student"].params["0.weight"].dtype == dtype


def test_low_precision_frozen_role_needs_no_opt_in():
    fs.TrainState.create({"teacher": fs.Role(net(0, torch.bfloat16))}, key=fs.random.key(0))


def test_an_optimizer_for_a_frozen_role_is_a_value_error():
    with pytest.raises(ValueError, match="optimizer was given for a frozen role"):
        fs.Role(net(), optimizer=fs.optim.adamw(), trainable=False)
    with pytest.raises(ValueError, match="needs an optimizer"):
        fs.Role(net(), trainable=True)
    with pytest.raises(ValueError, match="EMA needs a trainable role"):
        fs.Role(net(), ema=fs.EMA(0.9))


def test_a_non_tensor_leaf_where_a_tensor_must_be_is_a_type_error():
    with pytest.raises(TypeError, match=r"extra\.counter must be a tensor, got int"):
        make_state(extra={"counter": 3})
    state = make_state(extra={"counter": torch.tensor(3), "cache": [torch.zeros(2)]})
    assert "extra.cache.0" in tree.flatten_with_paths(state)[0]


def test_bad_roles_and_keys_are_rejected():
    with pytest.raises(ValueError, match="at least one role"):
        fs.TrainState.create({}, key=fs.random.key(0))
    with pytest.raises(TypeError, match="must be a fvstep.Role"):
        fs.TrainState.create({"s": net()}, key=fs.random.key(0))
    with pytest.raises(TypeError, match="fvstep key"):
        fs.TrainState.create({"s": fs.Role(net())}, key=torch.zeros(2))
    with pytest.raises(ValueError, match="identifiers"):
        fs.TrainState.create({"a b": fs.Role(net())}, key=fs.random.key(0))
    with pytest.raises(ValueError, match="decay"):
        fs.EMA(1.5)
    with pytest.raises(KeyError, match="has roles"):
        make_state().role("critic")


def test_module_binds_a_clones_tensors_without_touching_the_original():
    state = make_state()
    c = tree.clone(state)
    x = torch.randn(2, 3)
    with torch.no_grad():
        c.roles["student"].params["0.weight"].mul_(2.0)
        y_clone = c.module("student")(x)
        y_orig = state.module("student")(x)
    assert not torch.equal(y_clone, y_orig)
    assert state.module("student")[0].weight is state.roles["student"].params["0.weight"]
