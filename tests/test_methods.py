"""The reference methods (fine-tune, DMD2, RL) on tiny models: plans, role updates, keys."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import platform
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fvstep as fs
from fvstep.core.state import RoleState
from fvstep.methods import dmd2, dmd2_losses, finetune, flow_matching_loss, rl
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.methods.rewards import group_advantages

needs_diffusers = pytest.mark.skipif(
    importlib.util.find_spec("diffusers") is None, reason="needs diffusers"
)

TINY: dict[str, Any] = {"num_layers": 1}
"""The smallest Wan that still exercises every block type (fast 50-step runs)."""
BATCH: dict[str, Any] = {"batch_size": 4, "frames": 1}
DATA_KEY = fs.random.key(1234)
ACCUMULATION = fs.Accumulation(microbatches=2)


class TinyConvVelocity(nn.Module):
    """A non-diffusers module with the forward contract of :mod:`fvstep.methods.models`."""

    def __init__(self, channels: int = 4, text_dim: int = 16, hidden: int = 8) -> None:
        super().__init__()
        self.inp = nn.Conv3d(channels, hidden, 3, padding=1)
        self.text = nn.Linear(text_dim, hidden)
        self.time = nn.Linear(1, hidden)
        self.out = nn.Conv3d(hidden, channels, 3, padding=1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
    ) -> tuple[torch.Tensor]:
        cond = self.text(encoder_hidden_states.mean(dim=1)) + self.time(timestep[:, None] / 1000)
        h = F.silu(self.inp(hidden_states) + cond[:, :, None, None, None])
        return (self.out(h),)


def conv_net(seed: int) -> TinyConvVelocity:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyConvVelocity()


def batch_at(step: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(fs.random.fold_in(DATA_KEY, step), **BATCH)


def dmd2_state(seed: int = 0) -> fs.TrainState:
    teacher = tiny_wan(seed=seed, **TINY)
    student = copy.deepcopy(teacher)
    critic = tiny_wan(seed=seed + 1, **TINY)
    return fs.TrainState.create(
        roles={
            "student": fs.Role(student, optimizer=fs.optim.adamw(lr=1e-3)),
            "teacher": fs.Role(teacher),
            "critic": fs.Role(critic, optimizer=fs.optim.adamw(lr=1e-3)),
        },
        key=fs.random.key(0),
    )


def rl_state(seed: int = 0) -> fs.TrainState:
    policy = tiny_wan(seed=seed, **TINY)
    return fs.TrainState.create(
        roles={
            "student": fs.Role(policy, optimizer=fs.optim.adamw(lr=1e-3)),
            "old": fs.Role(copy.deepcopy(policy)),
            "reference": fs.Role(copy.deepcopy(policy)),
        },
        key=fs.random.key(0),
    )


def changed_roles(before: Mapping[str, RoleState], after: Mapping[str, RoleState]) -> set[str]:
    """Roles whose leaves (params, optimizer state, EMA) differ bitwise."""
    changed = set()
    for name in before:
        try:
            fs.tree.assert_trees_equal(before[name], after[name])
        except AssertionError:
            changed.add(name)
    return changed


def params_changed(before: RoleState, after: RoleState) -> bool:
    try:
        fs.tree.assert_trees_equal(before.params, after.params)
    except AssertionError:
        return True
    return False


def assert_finite_metrics(metrics: Mapping[str, Any], step: int) -> None:
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            assert torch.isfinite(value).all(), f"metric {name} is not finite at step {step}"


def assert_same_leaves(a: Any, b: Any) -> None:
    """Bitwise equality of two states' leaves by path.

    ``assert_trees_equal`` on two separately built states fails on their static metadata
    (each ``Role`` holds its own module and compares by identity), so compare leaves.
    """
    paths_a, leaves_a, _ = fs.tree.flatten_with_paths(a)
    paths_b, leaves_b, _ = fs.tree.flatten_with_paths(b)
    assert paths_a == paths_b
    fs.tree.assert_trees_equal(
        dict(zip(paths_a, leaves_a, strict=True)), dict(zip(paths_b, leaves_b, strict=True))
    )


def plan_roles(step_fn: fs.Step, step: int) -> list[tuple[str, ...]]:
    return [entry.roles for entry in fs.plan(step_fn, step)]


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------


@needs_diffusers
def test_tiny_wan_is_a_pure_function_of_the_seed() -> None:
    rng = torch.get_rng_state()
    a, b, c = tiny_wan(seed=3, **TINY), tiny_wan(seed=3, **TINY), tiny_wan(seed=4, **TINY)
    assert torch.equal(torch.get_rng_state(), rng), "tiny_wan touched the global RNG"
    fs.tree.assert_trees_equal(dict(a.state_dict()), dict(b.state_dict()))
    with pytest.raises(AssertionError):
        fs.tree.assert_trees_equal(dict(a.state_dict()), dict(c.state_dict()))
    x = torch.zeros(2, 4, 1, 4, 4)
    v = predict(a, x, torch.tensor([0.0, 1000.0]), torch.zeros(2, 3, 16))
    assert v.shape == x.shape


def test_synthetic_batch_is_a_pure_function_of_the_key() -> None:
    rng = torch.get_rng_state()
    a = synthetic_batch(fs.random.key(0), batch_size=2)
    b = synthetic_batch(fs.random.key(0), batch_size=2)
    c = synthetic_batch(fs.random.key(1), batch_size=2)
    assert torch.equal(torch.get_rng_state(), rng)
    fs.tree.assert_trees_equal(a, b)
    assert not torch.equal(a["latents"], c["latents"])
    assert a["latents"].shape == (2, 4, 2, 4, 4)
    assert a["text"].shape == (2, 3, 16)


def test_predict_checks_the_forward_contract() -> None:
    net = conv_net(0)
    x, text = torch.zeros(2, 4, 1, 4, 4), torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match="timestep must have shape"):
        predict(net, x, torch.zeros(2, 1), text)

    class Wrong(nn.Module):
        def forward(self, **kwargs: Any) -> tuple[torch.Tensor]:
            return (torch.zeros(1),)

    with pytest.raises(ValueError, match="forward contract"):
        predict(Wrong(), x, torch.zeros(2), text)


# ---------------------------------------------------------------------------------------
# fine-tune
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("t_sampling", ["uniform", "logit_normal"])
def test_flow_matching_loss_is_a_function_of_its_key(t_sampling: str) -> None:
    state = fs.TrainState.create(
        {"student": fs.Role(conv_net(0), optimizer=fs.optim.adamw(lr=1e-3))},
        key=fs.random.key(0),
    )
    loss_fn = flow_matching_loss(t_sampling=t_sampling)  # type: ignore[arg-type]
    batch = batch_at(0)
    rng = torch.get_rng_state()
    with torch.no_grad():
        a, ma = loss_fn(state, batch, fs.random.key(5))
        b, _ = loss_fn(state, batch, fs.random.key(5))
        c, _ = loss_fn(state, batch, fs.random.key(6))
    assert torch.equal(torch.get_rng_state(), rng), "the loss drew from the global RNG"
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert 0.0 <= float(ma["t_mean"]) <= 1.0


def test_flow_matching_loss_rejects_unknown_sampling() -> None:
    with pytest.raises(ValueError, match="t_sampling"):
        flow_matching_loss(t_sampling="cosine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logit_std"):
        finetune(logit_std=0.0)


def test_finetune_trains_a_non_diffusers_module_with_the_contract() -> None:
    state = fs.TrainState.create(
        {"student": fs.Role(conv_net(0), optimizer=fs.optim.adamw(lr=1e-2))},
        key=fs.random.key(0),
    )
    step_fn = fs.compile(finetune(t_sampling="logit_normal"), accumulation=ACCUMULATION)
    assert plan_roles(step_fn, 0) == [("student",)]
    batch = batch_at(0)
    eval_fn = flow_matching_loss()
    eval_keys = [fs.random.key(100 + i) for i in range(8)]

    def eval_loss(s: fs.TrainState) -> float:
        with torch.no_grad():
            return sum(float(eval_fn(s, batch, k)[0]) for k in eval_keys) / len(eval_keys)

    before = eval_loss(state)
    for i in range(40):
        state, metrics = step_fn(state, batch)
        assert_finite_metrics(metrics, i)
        assert set(metrics) >= {"student/loss", "finetune/t_mean", "student/lr"}
    after = eval_loss(state)
    assert after < 0.9 * before, (before, after)


# ---------------------------------------------------------------------------------------
# DMD2
# ---------------------------------------------------------------------------------------


def test_dmd2_plans_of_both_orderings() -> None:
    fused = fs.compile(dmd2(generator_update_interval=5, ordering="fused"))
    sequential = fs.compile(dmd2(generator_update_interval=5, ordering="sequential"))
    for i in range(16):
        if i % 5 == 0:
            assert plan_roles(fused, i) == [("student", "critic")]
            assert plan_roles(sequential, i) == [("student",), ("critic",)]
        else:
            assert plan_roles(fused, i) == [("critic",)]
            assert plan_roles(sequential, i) == [("critic",)]
    # The critic-only unit keeps its tree position, so its keys do not depend on the step kind.
    assert [e.position for e in fs.plan(sequential, 0)] == [0, 1]
    assert [e.position for e in fs.plan(sequential, 1)] == [1]
    assert [e.name for e in fs.plan(fused, 0)] == ["dmd2_fused"]
    assert [e.name for e in fs.plan(fused, 3)] == ["dmd2_critic"]


def test_dmd2_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="ordering"):
        dmd2(ordering="interleaved")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="generator_update_interval"):
        dmd2(generator_update_interval=0)
    with pytest.raises(ValueError, match="min_ratio"):
        dmd2_losses(min_ratio=0.9, max_ratio=0.1)
    with pytest.raises(ValueError, match="decreasing"):
        dmd2_losses(denoising_steps=(0.5, 1.0))
    with pytest.raises(ValueError, match="shift"):
        dmd2_losses(shift=0.0)


@needs_diffusers
@pytest.mark.parametrize("ordering", ["fused", "sequential"])
def test_dmd2_50_steps_update_exactly_the_planned_roles(ordering: str) -> None:
    state = dmd2_state()
    step_fn = fs.compile(
        dmd2(generator_update_interval=5, ordering=ordering, guidance_scale=3.0),  # type: ignore[arg-type]
        accumulation=ACCUMULATION,
    )
    for i in range(50):
        before = fs.tree.clone(state.roles)
        state, metrics = step_fn(state, batch_at(i))
        planned = {r for roles in plan_roles(step_fn, i) for r in roles}
        assert planned == ({"student", "critic"} if i % 5 == 0 else {"critic"})
        changed = changed_roles(before, state.roles)
        assert changed == planned, f"step {i}: changed {changed}, planned {planned}"
        for role in planned:
            assert params_changed(before[role], state.roles[role]), (i, role)
        assert "teacher" not in changed
        assert_finite_metrics(metrics, i)
        assert "critic/loss" in metrics
        assert ("student/loss" in metrics) == (i % 5 == 0)
    assert int(state.step) == 50


@needs_diffusers
@pytest.mark.parametrize("denoising_steps", [(1.0,), (1.0, 0.6, 0.3)])
def test_dmd2_fused_loss_equals_the_separate_losses(denoising_steps: tuple[float, ...]) -> None:
    state = dmd2_state()
    losses = dmd2_losses(guidance_scale=2.0, denoising_steps=denoising_steps)
    batch = batch_at(0)
    rng = torch.get_rng_state()
    for seed in range(3):
        key = fs.random.key(seed)
        fused, fused_metrics = losses.fused_loss(state, batch, key)
        g_loss, g_metrics = losses.generator_loss(state, batch, key)
        c_loss, c_metrics = losses.critic_loss(state, batch, key)
        torch.testing.assert_close(fused["student"], g_loss, rtol=0, atol=0)
        torch.testing.assert_close(fused["critic"], c_loss, rtol=0, atol=0)
        assert fused_metrics.keys() == {*g_metrics, *c_metrics}
        assert fused["student"].requires_grad and fused["critic"].requires_grad
        assert not g_metrics["dmd_denominator"].requires_grad
    assert torch.equal(torch.get_rng_state(), rng), "a DMD2 loss drew from the global RNG"
    # The generator's gradient reaches the student only; the critic's loss the critic only.
    fused, _ = losses.fused_loss(state, batch, fs.random.key(0))
    student_params = list(state.roles["student"].trainable_params().values())
    critic_params = list(state.roles["critic"].trainable_params().values())
    g_on_critic = torch.autograd.grad(fused["student"], critic_params, allow_unused=True)
    c_on_student = torch.autograd.grad(
        fused["critic"], student_params, allow_unused=True, retain_graph=True
    )
    assert all(g is None for g in g_on_critic)
    assert all(g is None for g in c_on_student)


@needs_diffusers
def test_dmd2_generator_loss_vanishes_when_the_critic_matches_the_teacher() -> None:
    teacher = tiny_wan(seed=0, **TINY)
    state = fs.TrainState.create(
        roles={
            "student": fs.Role(tiny_wan(seed=1, **TINY), optimizer=fs.optim.adamw(lr=1e-3)),
            "teacher": fs.Role(teacher),
            "critic": fs.Role(copy.deepcopy(teacher), optimizer=fs.optim.adamw(lr=1e-3)),
        },
        key=fs.random.key(0),
    )
    batch = batch_at(0)
    unguided = dmd2_losses(guidance_scale=1.0).generator_loss(state, batch, fs.random.key(0))[0]
    assert float(unguided.detach()) == 0.0  # g = (x0_critic - x0_teacher) / ... = 0 exactly
    guided = dmd2_losses(guidance_scale=3.0).generator_loss(state, batch, fs.random.key(0))[0]
    assert float(guided.detach()) > 0.0


@needs_diffusers
def test_dmds_gradient_of_a_sample_does_not_depend_on_the_other_samples() -> None:
    """The denominator ``mean|x0_hat - x0_cfg|`` is each sample's own (DMD2's and
    Self-Forcing's code): changing sample 1 leaves sample 0's gradient as it was; with one
    mean over the micro-batch it moved by ~90 %."""
    from fvstep.methods.dmd2 import distribution_matching_loss

    roles = {
        "teacher": fs.Role(tiny_wan(seed=0, **TINY)),
        "critic": fs.Role(tiny_wan(seed=2, **TINY)),
    }
    state = fs.TrainState.create(roles=roles, key=fs.random.key(0))
    batch = synthetic_batch(fs.random.key(5), batch_size=2, frames=1)
    options = {"guidance_scale": 3.0, "shift": 3.0, "min_ratio": 0.02, "max_ratio": 0.98}

    def grad_of_first(x0: torch.Tensor) -> torch.Tensor:
        x0 = x0.clone().requires_grad_(True)
        loss, metrics = distribution_matching_loss(
            state, x0, batch["text"], fs.random.key(1), fs.random.key(2), **options
        )
        assert metrics["dmd_denominator"].dim() == 0
        loss.backward()
        return x0.grad[0]

    x0 = batch["latents"]
    other = x0.clone()
    other[1] = 10 * x0[1] + 3
    first, moved = grad_of_first(x0), grad_of_first(other)
    assert first.abs().sum() > 0
    torch.testing.assert_close(moved, first, rtol=1e-5, atol=1e-8)


@needs_diffusers
def test_dmd2_steps_are_reproducible_from_the_state() -> None:
    method = dmd2(generator_update_interval=2, ordering="sequential", denoising_steps=(1.0, 0.5))
    finals = []
    for _ in range(2):
        state = dmd2_state()
        step_fn = fs.compile(method, accumulation=ACCUMULATION)
        for i in range(3):
            state, _ = step_fn(state, batch_at(i))
        finals.append(state)
    assert_same_leaves(finals[0], finals[1])


# ---------------------------------------------------------------------------------------
# RL
# ---------------------------------------------------------------------------------------


def test_group_advantages_normalise_within_groups() -> None:
    adv = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0, -2.0, 0.0]), 2)
    torch.testing.assert_close(
        adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(3), 2)
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        group_advantages(torch.zeros(4), 1)


def test_rl_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="group_size"):
        rl(group_size=1)
    with pytest.raises(ValueError, match="blend"):
        rl(blend=1.5)
    with pytest.raises(ValueError, match="num_inner"):
        rl(num_inner=0)


@needs_diffusers
def test_rl_50_steps_train_student_blend_old_and_keep_reference() -> None:
    blend = 0.9
    state = rl_state()
    step_fn = fs.compile(
        rl(num_inner=2, blend=blend, kl_weight=0.1, group_size=2, accumulation=ACCUMULATION),
        accumulation=ACCUMULATION,
    )
    entries = fs.plan(step_fn, 0)
    assert [(e.roles, e.managed, e.name, e.mutates) for e in entries] == [
        (("student",), True, "rl", ("old",))
    ]
    for i in range(50):
        before = fs.tree.clone(state.roles)
        state, metrics = step_fn(
            state, synthetic_batch(fs.random.fold_in(DATA_KEY, i), batch_size=2, frames=1)
        )
        planned = {r for roles in plan_roles(step_fn, i) for r in roles}
        assert planned == {"student"}
        mutated = {r for e in fs.plan(step_fn, i) for r in e.mutates}
        changed = changed_roles(before, state.roles)
        assert changed == planned | mutated, f"step {i}: changed {changed}"
        assert params_changed(before["student"], state.roles["student"])
        assert "reference" not in changed
        # old = blend * old + (1 - blend) * student, with the student after the inner updates.
        expected = {
            n: before["old"].params[n].detach().clone().mul_(blend) for n in before["old"].params
        }
        for n, t in expected.items():
            t.add_(state.roles["student"].params[n].detach(), alpha=1 - blend)
        fs.tree.assert_trees_equal(
            expected, {n: p.detach() for n, p in state.roles["old"].params.items()}
        )
        assert_finite_metrics(metrics, i)
        assert {"rl/reward_mean", "rl/reward_std", "rl/inner_loss_mean", "student/loss"} <= set(
            metrics
        )
        assert int(state.roles["student"].opt_state.count) == 2 * (i + 1)
    assert int(state.step) == 50


@needs_diffusers
def test_rl_steps_are_reproducible_from_the_state() -> None:
    method = rl(num_inner=2, group_size=2, sample_steps=1)
    finals = []
    for _ in range(2):
        state = rl_state()
        step_fn = fs.compile(method)
        for i in range(2):
            state, _ = step_fn(state, synthetic_batch(fs.random.fold_in(DATA_KEY, i), batch_size=2))
        finals.append(state)
    assert_same_leaves(finals[0], finals[1])


# --------------------------------------------------------------------------------------
# Keyed noise: one helper (fvstep.methods._noise), the same draws as before it existed
# --------------------------------------------------------------------------------------


def _randn_like_as_the_methods_wrote_it(key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # finetune, rl (twice) and dmd2 each wrote this out before the shared helper.
    return torch.randn(
        like.shape,
        generator=fs.random.generator(key, like.device),
        device=like.device,
        dtype=like.dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(3,), (2, 4, 1, 2, 2), (5, 17)])
def test_keyed_noise_helper_draws_bitwise_what_each_method_wrote_before(dtype, shape) -> None:
    from fvstep.methods import _noise

    for seed in range(3):
        key, like = fs.random.key(seed), torch.zeros(shape, dtype=dtype)
        fs.tree.assert_trees_equal(
            _noise.randn_like(key, like), _randn_like_as_the_methods_wrote_it(key, like)
        )
        g = fs.random.generator(key)
        fs.tree.assert_trees_equal(
            _noise.rand(key, (shape[0],)), torch.rand((shape[0],), generator=g)
        )


def test_keyed_noise_values_are_pinned() -> None:
    # Small draws take torch's scalar CPU samplers, the same on every CPU.
    from fvstep.methods import _noise

    def hexes(t: torch.Tensor) -> list[str]:
        return [float(x).hex() for x in t]

    key = fs.random.key(0)
    assert hexes(_noise.rand(key, (3,))) == [
        "0x1.20c0840000000p-2",
        "0x1.7419000000000p-3",
        "0x1.57e95c0000000p-1",
    ]
    assert hexes(_noise.randn(key, (3,))) == [
        "-0x1.2474300000000p-5",
        "0x1.eee64a0000000p-1",
        "0x1.5d5aec0000000p-2",
    ]
    assert hexes(_noise.randn_like(fs.random.key(1), torch.zeros(2, dtype=torch.float64))) == [
        "0x1.b216ece6f80fcp-2",
        "-0x1.3e91e1ad337b4p-1",
    ]


class _Recorder(nn.Module):
    """A velocity ``0.5 x`` that records every input it is given (the methods' draws)."""

    def __init__(self, log: list[torch.Tensor]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))
        self.log = log

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        self.log += [hidden_states.detach().clone(), timestep.detach().clone()]
        return (hidden_states * self.w,)


# The digests of every input the methods' modules saw on keys 0, 1, 2, taken before the
# keyed draw moved into fvstep.methods._noise: the methods still draw the same numbers.
# (Inputs only: elementwise functions of the draws, so no reduction order enters them. fp32
# only: torch's bf16 CPU sampler gave other bits on torch 2.11 on another CPU; bf16 draws
# are held to the old formula on the machine itself, above.)
_DRAW_DIGESTS = {
    "fm_uniform": "fd9b2b9b5aa2b2d4",
    "rl_inner": "1462e87989d7fcba",
    "dmd2_generator_loss": "1df6c125a1e49e80",
    "dmd2_critic_loss": "5df33ad5c132ae89",
    "dmd2_fused_loss": "822182751eabfe4d",
}


def _draw_digest(loss_fn: Any, dtype: torch.dtype) -> str:
    import hashlib
    import types

    log: list[torch.Tensor] = []
    modules = {r: _Recorder(log) for r in ("student", "teacher", "critic", "reference")}
    # key and step: multi-step DMD2 draws its target step from them (dmd2.target_step); at
    # these it is 1, the target that keys 0, 1, 2 drew per key before, so the pins still hold
    view = types.SimpleNamespace(
        module=modules.__getitem__, key=fs.random.key(9), step=torch.tensor(4)
    )
    x0 = (torch.arange(32, dtype=torch.float32).reshape(2, 4, 1, 2, 2) / 7 - 1).to(dtype)
    batch = {
        "latents": x0,
        "text": torch.ones(2, 3, 5, dtype=dtype),
        "samples": x0,
        "advantages": torch.tensor([0.5, -0.5]),
    }
    for seed in (0, 1, 2):
        loss_fn(view, batch, fs.random.key(seed))
    h = hashlib.sha256()
    for t in log:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="pinned on x86-64, where torch's CPU normal sampler is its AVX2 kernel",
)
@pytest.mark.parametrize("name", sorted(_DRAW_DIGESTS))
def test_methods_draw_the_same_noise_as_before_the_shared_helper(name: str) -> None:
    from fvstep.methods.rl import rl_inner_loss

    dmd2_fns = dmd2_losses(denoising_steps=(1.0, 0.6, 0.3))
    loss_fn = {
        "fm_uniform": flow_matching_loss(),
        "rl_inner": rl_inner_loss(kl_weight=0.1),
        "dmd2_generator_loss": dmd2_fns.generator_loss,
        "dmd2_critic_loss": dmd2_fns.critic_loss,
        "dmd2_fused_loss": dmd2_fns.fused_loss,
    }[name]
    assert _draw_digest(loss_fn, torch.float32) == _DRAW_DIGESTS[name]


def test_the_removed_alias_finetune_loss_fn_is_gone() -> None:
    # (fvstep.methods.finetune is the function there; the module, by its full name)
    finetune_module = importlib.import_module("fvstep.methods.finetune")
    assert not hasattr(finetune_module, "LossFn")  # the one name is RoleLossFn
    assert callable(finetune_module.flow_matching_loss())
