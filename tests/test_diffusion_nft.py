"""DiffusionNFT: a hand-written loop of the same method, resume, the reward law, the loss's
closed forms, the rewards, and clear errors."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fvstep as fs
from fvstep.core import tree
from fvstep.core.random import fold_in, fold_in_name, generator, split
from fvstep.core.state import is_consumed
from fvstep.methods import SoftUpdate, diffusion_nft
from fvstep.methods.diffusion_nft import euler_rollout
from fvstep.methods.diffusion_nft_loss import nft_loss
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.methods.rewards import (
    check_rewards,
    colorfulness,
    decoded,
    latent_mse_reward,
    optimality_probabilities,
)

pytest.importorskip("diffusers")

LR, WD, MAX_NORM = 1e-3, 0.01, 1.0
BATCH: dict[str, Any] = {"batch_size": 2, "frames": 1}
DATA_KEY = fs.random.key(77)


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


def batch_at(step: int, rank: int = 0) -> dict[str, torch.Tensor]:
    key = fold_in(DATA_KEY, step) if rank == 0 else fold_in(fold_in(DATA_KEY, step), rank)
    return synthetic_batch(key, **BATCH)


def nft_state(seed: int = 0, *, reference: bool = True) -> fs.TrainState:
    net = tiny_wan(seed=seed, num_layers=1)
    roles = {
        "policy": fs.Role(net, optimizer=fs.optim.adamw(lr=LR, weight_decay=WD)),
        "old": fs.Role(copy.deepcopy(net)),
    }
    if reference:
        roles["reference"] = fs.Role(copy.deepcopy(net))
    return fs.TrainState.create(roles, key=fs.random.key(seed + 5))


# --------------------------------------------------------------------------------------
# The same method written by hand: torch.optim.AdamW, clip_grad_norm_, loss / K
# --------------------------------------------------------------------------------------


def _euler_by_hand(module, noise, text, num_steps):
    x = noise
    for i in range(num_steps):
        t_now, t_next = 1.0 - i / num_steps, 1.0 - (i + 1) / num_steps
        t = torch.full((x.shape[0],), t_now)
        x = x + (t_next - t_now) * predict(module, x, t * 1000, text)
    return x


def _probabilities_by_hand(rewards, group_size, clip_max):
    grouped = rewards.float().reshape(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    spread = grouped.std(dim=1, keepdim=True, unbiased=False)
    advantages = (grouped - mean) / (spread + 1e-4)
    return (0.5 + 0.5 * (advantages / clip_max).clamp(-1.0, 1.0)).reshape(-1)


def _adaptive_by_hand(v, x_t, x0, t):
    err = (x_t - t.reshape(-1, 1, 1, 1, 1) * v - x0).flatten(1)
    return (err**2).mean(1) / err.detach().abs().mean(1).clamp(min=1e-5)


def _nft_loss_by_hand(modules, mb, key, *, beta, clip_max, kl_weight):
    x0, text, r = mb["samples"], mb["text"], mb["probabilities"]
    k_t, k_eps = split(key, 2)
    t = torch.rand((x0.shape[0],), generator=generator(k_t))
    eps = torch.randn(x0.shape, generator=generator(k_eps), dtype=x0.dtype)
    tb = t.reshape(-1, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * eps
    with torch.no_grad():
        v_old = predict(modules["old"], x_t, t * 1000, text).float()
        v_ref = predict(modules["reference"], x_t, t * 1000, text).float()
    v = predict(modules["policy"], x_t, t * 1000, text).float()
    pos = _adaptive_by_hand((1 - beta) * v_old + beta * v, x_t, x0, t)
    neg = _adaptive_by_hand((1 + beta) * v_old - beta * v, x_t, x0, t)
    policy_loss = (clip_max / beta) * (r * pos + (1 - r) * neg).mean()
    return policy_loss + kl_weight * ((v - v_ref) ** 2).mean()


def nft_loop(modules, num_steps, *, base_key, group_size, num_inner, minibatches, k, beta,
             clip_max, kl_weight, sample_steps, soft_update, rank=0, rest=lambda: None):  # fmt: skip
    """DiffusionNFT by hand, with fvstep's documented key scheme (``rest()``: reshard FSDP2
    groups, so that the soft update and the next forward see the sharded parameters)."""
    opt = torch.optim.AdamW(modules["policy"].parameters(), lr=LR, weight_decay=WD)
    for step in range(num_steps):
        batch = batch_at(step, rank)
        key = fold_in_name(fold_in(fold_in(base_key, step), rank), "diffusion_nft")
        k_noise, _, k_inner = split(key, 3)
        text = batch["text"].repeat_interleave(group_size, dim=0)
        latents = batch["latents"].repeat_interleave(group_size, dim=0)
        noise = torch.randn(latents.shape, generator=generator(k_noise), dtype=latents.dtype)
        with torch.no_grad():
            samples = _euler_by_hand(modules["old"], noise, text, sample_steps)
            rewards = -((samples - latents) ** 2).flatten(1).mean(1)
        rollouts = {
            "samples": samples,
            "text": text,
            "probabilities": _probabilities_by_hand(rewards, group_size, clip_max),
        }
        n = samples.shape[0]
        size = n // minibatches
        for e in range(num_inner):
            k_perm, k_updates = split(fold_in(k_inner, e), 2)
            order = torch.randperm(n, generator=generator(k_perm))
            shuffled = {name: v[order] for name, v in rollouts.items()}
            for j in range(minibatches):
                part = {name: v[j * size : (j + 1) * size] for name, v in shuffled.items()}
                for m in range(k):
                    mb = {name: v.chunk(k)[m] for name, v in part.items()}
                    loss = _nft_loss_by_hand(
                        modules, mb, fold_in(fold_in(k_updates, j), m),
                        beta=beta, clip_max=clip_max, kl_weight=kl_weight,
                    )  # fmt: skip
                    (loss / k).backward()
                torch.nn.utils.clip_grad_norm_(modules["policy"].parameters(), MAX_NORM)
                opt.step()
                opt.zero_grad(set_to_none=True)
        eta = soft_update(step)
        rest()
        with torch.no_grad():
            for p_old, p in zip(
                modules["old"].parameters(), modules["policy"].parameters(), strict=True
            ):
                p_old.mul_(eta).add_(p, alpha=1 - eta)
        rest()
    return opt


def test_diffusion_nft_is_bitwise_a_hand_written_loop_on_every_parameter_and_moment() -> None:
    settings_ = {"beta": 0.5, "clip_max": 2.0, "kl_weight": 0.1}
    soft = SoftUpdate(0.3, 0.5)
    state = nft_state()
    plain = {name: copy.deepcopy(state.module(name)) for name in state.roles}
    plain["old"].requires_grad_(False)
    plain["reference"].requires_grad_(False)
    base_key = state.key.clone()
    step = fs.compile(
        diffusion_nft(
            reward_fn=latent_mse_reward,
            group_size=2,
            num_inner=2,
            minibatches=2,
            rollout=euler_rollout(2),
            soft_update=soft,
            **settings_,
        ),
        accumulation=fs.Accumulation(2),
        clip=fs.clip_grad_norm(MAX_NORM),
    )
    assert [(e.roles, e.mutates, e.managed) for e in fs.plan(step, 0)] == [
        (("policy",), ("old",), True)
    ]
    reference_before = tree.clone(state.roles["reference"].params)
    for i in range(2):
        state, metrics = step(state, batch_at(i))
        assert metrics["diffusion_nft/old_decay"] == soft(i)
    opt = nft_loop(
        plain, 2, base_key=base_key, group_size=2, num_inner=2, minibatches=2, k=2,
        sample_steps=2, soft_update=soft, **settings_,
    )  # fmt: skip
    for role in ("policy", "old", "reference"):
        tree.assert_trees_equal(state.roles[role].params, dict(plain[role].named_parameters()))
    tree.assert_trees_equal(state.roles["reference"].params, reference_before)
    moments = {n: opt.state[p] for n, p in plain["policy"].named_parameters()}
    opt_state = state.roles["policy"].opt_state
    tree.assert_trees_equal(opt_state.exp_avg, {n: s["exp_avg"] for n, s in moments.items()})
    tree.assert_trees_equal(opt_state.exp_avg_sq, {n: s["exp_avg_sq"] for n, s in moments.items()})
    assert int(opt_state.count) == 2 * 2 * 2  # steps x passes x minibatches
    assert _differs(state.roles["old"].params, reference_before)


def check_two_ranks_against_hand_written_loop(rank: int, world_size: int) -> int:
    from benchmarks.reference import reshard_all, shard_by_hand
    from fvstep import parallel as fsp

    mesh = fsp.make_mesh(device_type="cpu")
    net = tiny_wan(seed=0, num_layers=1)
    plain = {name: copy.deepcopy(net) for name in ("policy", "old", "reference")}
    ref = {name: shard_by_hand(copy.deepcopy(m), mesh) for name, m in plain.items()}
    ref["old"].requires_grad_(False)
    ref["reference"].requires_grad_(False)
    state = fs.TrainState.create(
        {
            "policy": fs.Role(
                shard_by_hand(plain["policy"], mesh),
                optimizer=fs.optim.adamw(lr=LR, weight_decay=WD),
            ),
            "old": fs.Role(shard_by_hand(plain["old"], mesh)),
            "reference": fs.Role(shard_by_hand(plain["reference"], mesh)),
        },
        key=fs.random.key(9),
    )
    soft = SoftUpdate(0.3, 0.5)
    step = fs.compile(
        diffusion_nft(
            reward_fn=latent_mse_reward,
            group_size=2,
            num_inner=1,
            minibatches=1,
            beta=0.5,
            kl_weight=0.1,
            rollout=euler_rollout(1),
            soft_update=soft,
        ),
        accumulation=fs.Accumulation(2, sync="deferred"),
        clip=fs.clip_grad_norm(MAX_NORM),
    )
    for i in range(2):
        state, _ = step(state, batch_at(i, rank), parallelism=fsp.Layout())
        assert fsp.unrested_modules(state) == [], fsp.unrested_modules(state)[:3]
    opt = nft_loop(
        ref, 2, base_key=fs.random.key(9), group_size=2, num_inner=1, minibatches=1, k=2,
        beta=0.5, clip_max=5.0, kl_weight=0.1, sample_steps=1, soft_update=soft, rank=rank,
        rest=lambda: reshard_all(ref),
    )  # fmt: skip
    compared = 0
    for role in ("policy", "old", "reference"):
        theirs = dict(ref[role].named_parameters())
        tree.assert_trees_equal(state.roles[role].params, theirs)
        compared += len(theirs)
    moments = {n: opt.state[p] for n, p in ref["policy"].named_parameters()}
    opt_state = state.roles["policy"].opt_state
    tree.assert_trees_equal(opt_state.exp_avg, {n: s["exp_avg"] for n, s in moments.items()})
    tree.assert_trees_equal(opt_state.exp_avg_sq, {n: s["exp_avg_sq"] for n, s in moments.items()})
    return compared


@pytest.mark.multirank
def test_diffusion_nft_on_two_fsdp2_ranks_is_bitwise_a_hand_written_loop(ranks) -> None:
    compared = ranks.run(check_two_ranks_against_hand_written_loop, timeout=600)
    assert compared[0] == compared[1] > 3 * 10  # every parameter of the three roles


def test_resume_at_an_odd_step_with_two_microbatches_is_bitwise(tmp_path) -> None:
    def factory():
        state = nft_state(3)
        method = diffusion_nft(
            reward_fn=latent_mse_reward, group_size=2, kl_weight=0.1,
            rollout=euler_rollout(1), soft_update=SoftUpdate(0.25, 0.5),
        )  # fmt: skip
        return state, fs.compile(method, accumulation=fs.Accumulation(2)), batch_at

    fs.testing.assert_resume_exact(factory, num_steps=3, interruptions=[1], workdir=tmp_path)


# --------------------------------------------------------------------------------------
# Rewards to optimality probabilities
# --------------------------------------------------------------------------------------


def _rewards(seed: int, groups: int, size: int) -> torch.Tensor:
    return torch.randn(groups * size, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    groups=st.integers(1, 3),
    size=st.integers(2, 5),
    data=st.data(),
)
def test_probabilities_are_invariant_to_a_positive_affine_map_within_each_group(
    seed, groups, size, data
) -> None:
    rewards = _rewards(seed, groups, size)
    scale = torch.tensor(
        data.draw(st.lists(st.floats(0.1, 10.0), min_size=groups, max_size=groups))
    )
    shift = torch.tensor(data.draw(st.lists(st.floats(-10, 10), min_size=groups, max_size=groups)))
    mapped = rewards * scale.repeat_interleave(size) + shift.repeat_interleave(size)
    p = optimality_probabilities(rewards, size, clip_max=1.5, eps=0.0)
    # The law up to fp32 rounding (the function computes in fp32), which the map amplifies
    # by |R| / spread: a shift of 4 over a group spread of 0.1 x 0.01 cancels digits (seed
    # 295, scale 0.109, shift 4 differed by 1.1e-5 with no fault in the law).
    grouped = mapped.reshape(groups, size)
    condition = float(grouped.abs().max() / grouped.std(dim=1, unbiased=False).min())
    tol = 1e-5 + torch.finfo(torch.float32).eps * condition
    torch.testing.assert_close(
        optimality_probabilities(mapped, size, clip_max=1.5, eps=0.0), p, atol=tol, rtol=0
    )
    # "batch": one positive affine map for all the rewards.
    one = rewards * scale[0] + shift[0]
    batch_condition = float(one.abs().max() / one.std(unbiased=False))
    torch.testing.assert_close(
        optimality_probabilities(one, size, std="batch", eps=0.0),
        optimality_probabilities(rewards, size, std="batch", eps=0.0),
        atol=1e-5 + torch.finfo(torch.float32).eps * batch_condition,
        rtol=0,
    )
    assert bool(((p >= 0) & (p <= 1)).all())
    order = rewards.reshape(groups, size).argsort(dim=1)
    assert bool((p.reshape(groups, size).gather(1, order).diff(dim=1) >= 0).all())  # monotone


def test_probabilities_follow_the_closed_form_and_equal_rewards_give_one_half() -> None:
    rewards = torch.tensor([0.0, 2.0, 1.0, 1.0, 1.0, 4.0])
    p = optimality_probabilities(rewards, 3, clip_max=2.0, eps=0.0)
    # group 1: rewards (0, 2, 1), mean 1, std sqrt(2/3): (-1, 1, 0) / sqrt(2/3) / 2
    group0 = 0.5 + 0.5 * ((torch.tensor([0.0, 2.0, 1.0]) - 1.0) / (2.0 / 3.0) ** 0.5 / 2.0)
    torch.testing.assert_close(p[:3], group0)
    # group 2: rewards (1, 1, 4), mean 2, std sqrt(2): (-1/sqrt2, -1/sqrt2, 2/sqrt2) / 2
    a = torch.tensor([-1.0, -1.0, 2.0]) / 2.0**0.5 / 2.0
    torch.testing.assert_close(p[3:], 0.5 + 0.5 * a.clamp(-1, 1))
    flat = optimality_probabilities(torch.full((4,), 3.0), 2)
    torch.testing.assert_close(flat, torch.full((4,), 0.5))
    for bad, match in (
        ((torch.zeros(3), 2), "divisible"),
        ((torch.zeros(4), 1), "group_size"),
        ((torch.zeros(4, 1), 2), r"\(N,\)"),
    ):
        with pytest.raises(ValueError, match=match):
            optimality_probabilities(*bad)
    with pytest.raises(ValueError, match="std"):
        optimality_probabilities(torch.zeros(4), 2, std="global")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# The loss against closed forms
# --------------------------------------------------------------------------------------


def _loss_inputs(policy_seed: int) -> tuple[fs.TrainState, dict[str, torch.Tensor]]:
    old = tiny_wan(seed=0, num_layers=1)
    policy = tiny_wan(seed=policy_seed, num_layers=1)
    state = fs.TrainState.create(
        {"policy": fs.Role(policy, optimizer=fs.optim.sgd(lr=0.0)), "old": fs.Role(old)},
        key=fs.random.key(0),
    )
    batch = batch_at(0)
    batch = {"samples": batch["latents"], "text": batch["text"], "probabilities": torch.ones(2)}
    return state, batch


def _velocities(state, batch, key):
    x0, text = batch["samples"], batch["text"]
    k_t, k_eps = split(key, 2)
    t = torch.rand((x0.shape[0],), generator=generator(k_t))
    eps = torch.randn(x0.shape, generator=generator(k_eps))
    tb = t.reshape(-1, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * eps
    with torch.no_grad():
        v_old = predict(state.module("old"), x_t, t * 1000, text)
    return predict(state.module("policy"), x_t, t * 1000, text), v_old, eps - x0


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_loss_at_probability_one_half_is_the_closed_form(beta) -> None:
    # r = 1/2: (c / beta) mean_i[mean((v_old - v)^2) + beta^2 mean((v_theta - v_old)^2)]
    state, batch = _loss_inputs(policy_seed=1)
    batch["probabilities"] = torch.full((2,), 0.5)
    key = fs.random.key(11)
    loss, _ = nft_loss(beta=beta, clip_max=3.0, weighting="velocity")(state, batch, key)
    with torch.no_grad():
        v, v_old, target = _velocities(state, batch, key)
    d = ((v_old - target) ** 2).flatten(1).mean(1) + beta**2 * ((v - v_old) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(loss.detach(), (3.0 / beta) * d.mean(), rtol=1e-5, atol=1e-6)


def _policy_grads(state, loss) -> dict[str, torch.Tensor]:
    params = state.roles["policy"].trainable_params()
    grads = torch.autograd.grad(loss, list(params.values()))
    return dict(zip(params, grads, strict=True))


@pytest.mark.parametrize("beta", [1e-3, 1.0])
def test_gradient_at_the_old_policy_is_the_closed_form_for_every_beta(beta) -> None:
    # At v_theta = v_old the gradient is that of (2c / N) sum_i (2 r_i - 1) mean((v_old - v) v_theta),
    # whatever beta: the c / beta scale cancels the beta of v+ and v-, so beta -> 0 keeps it.
    state, batch = _loss_inputs(policy_seed=0)  # the policy is a copy of the old policy
    batch["probabilities"] = torch.tensor([0.9, 0.2])
    key = fs.random.key(12)
    loss, _ = nft_loss(beta=beta, clip_max=2.0, weighting="velocity")(state, batch, key)
    got = _policy_grads(state, loss)
    v, v_old, target = _velocities(state, batch, key)
    signs = (2 * batch["probabilities"] - 1).reshape(-1, 1, 1, 1, 1)
    surrogate = 2.0 * 2.0 * (signs * (v_old - target) * v).flatten(1).mean(1).mean()
    want = _policy_grads(state, surrogate)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=2e-3, atol=1e-7, msg=name)


# --------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------


def test_colorfulness_is_the_hasler_susstrunk_measure() -> None:
    grey = torch.full((2, 1, 4, 4, 3), 0.5)
    torch.testing.assert_close(colorfulness(grey), torch.zeros(2))
    red = torch.zeros(1, 1, 2, 2, 3)
    red[..., 0] = 1.0
    # rg = 255, yb = 127.5 everywhere: no spread, 0.3 * |(255, 127.5)|
    torch.testing.assert_close(colorfulness(red), torch.tensor([0.3 * (255**2 + 127.5**2) ** 0.5]))
    half = torch.zeros(1, 2, 1, 1, 3)
    half[0, 0, ..., 0] = 1.0  # one red pixel, one black: std(rg) = mean(rg) = 127.5
    expected = (127.5**2 + 63.75**2) ** 0.5 * 1.3
    torch.testing.assert_close(colorfulness(half), torch.tensor([expected]))
    with pytest.raises(ValueError, match="RGB"):
        colorfulness(torch.zeros(2, 4, 4))


def tiny_vae():
    import diffusers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 1.0, 2.0],
        ).eval()  # fmt: skip


def test_a_step_trains_on_the_colourfulness_of_decoded_videos() -> None:
    from fvstep.executor.sampling import decode_latents

    vae = tiny_vae()
    reward = decoded(colorfulness, functools.partial(decode_latents, vae))
    latents = synthetic_batch(fs.random.key(1), batch_size=2, frames=2)["latents"]
    pixels = decode_latents(vae, latents)
    fs.tree.assert_trees_equal(reward(latents, {}), colorfulness(pixels))
    state = nft_state(reference=False)
    before = tree.clone(state.roles["policy"].params)
    step = fs.compile(diffusion_nft(reward_fn=reward, group_size=2, rollout=euler_rollout(1)))
    state, metrics = step(state, synthetic_batch(fs.random.key(2), batch_size=1, frames=2))
    assert float(metrics["diffusion_nft/reward_std"]) > 0
    assert _differs(before, state.roles["policy"].params)
    with pytest.raises(TypeError, match="callables"):
        decoded(colorfulness, None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_size": 1}, ValueError, "group_size"),
        ({"num_inner": 0}, ValueError, "num_inner"),
        ({"minibatches": 0}, ValueError, "minibatches"),
        ({"beta": 0.0}, ValueError, "beta"),
        ({"weighting": "x0"}, ValueError, "weighting"),
        ({"std": "global"}, ValueError, "std"),
        ({"kl_weight": -1.0}, ValueError, "kl_weight"),
        ({"latent_shape": (4, 1, 4)}, ValueError, "latent_shape"),
        ({"reward_fn": "clip"}, TypeError, "reward_fn"),
        ({"soft_update": 0.5}, TypeError, "soft_update"),
    ],
)
def test_bad_settings_are_refused_when_the_method_is_built(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        diffusion_nft(**{"reward_fn": latent_mse_reward, **kwargs})


def test_soft_update_follows_its_schedule_and_refuses_bad_settings() -> None:
    assert [SoftUpdate()(i) for i in (0, 1, 100, 10_000)] == [0.0, 0.001, 0.1, 0.5]
    assert [SoftUpdate(0.5, 0.9, flat=2)(i) for i in range(5)] == [0.0, 0.0, 0.0, 0.5, 0.9]
    for bad in ({"rate": -1.0}, {"max_decay": 1.5}, {"flat": -1}):
        with pytest.raises(ValueError, match="SoftUpdate"):
            SoftUpdate(**bad)


def _cause_text(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    e: BaseException | None = excinfo.value
    text = []
    while e is not None:
        text.append(str(e))
        e = e.__cause__
    return " | ".join(text)


@pytest.mark.parametrize(
    ("method", "state_kwargs", "batch_edit", "match"),
    [
        ({"kl_weight": 0.1}, {"reference": False}, None, "reference role"),
        ({"minibatches": 3}, {}, None, "must divide"),
        ({}, {}, lambda b: {"text": b["text"]}, "latent_shape"),
        ({"reward_fn": lambda x, b: x.mean(dim=(2, 3, 4))}, {}, None, "one reward per sample"),
        ({"reward_fn": lambda x, b: torch.zeros(4, dtype=torch.long)}, {}, None, "floating"),
        ({"soft_update": lambda i: 1.5}, {}, None, "not in [0, 1]"),
    ],
)
def test_bad_inputs_at_the_step_name_the_problem(method, state_kwargs, batch_edit, match) -> None:
    state = nft_state(**state_kwargs)
    step = fs.compile(
        diffusion_nft(
            **{"reward_fn": latent_mse_reward, "group_size": 2, "rollout": euler_rollout(1),
               **method}
        )
    )  # fmt: skip
    batch = batch_at(0) if batch_edit is None else batch_edit(batch_at(0))
    with pytest.raises((ValueError, TypeError, fs.StepFailedError)) as excinfo:
        step(state, batch)
    assert match in _cause_text(excinfo), _cause_text(excinfo)
    if not isinstance(excinfo.value, fs.StepFailedError):  # refused before anything ran
        assert not is_consumed(state)


def test_an_old_policy_of_another_model_is_refused() -> None:
    state = fs.TrainState.create(
        {
            "policy": fs.Role(tiny_wan(num_layers=1), optimizer=fs.optim.adamw(lr=LR)),
            "old": fs.Role(tiny_wan(num_layers=2)),
        },
        key=fs.random.key(0),
    )
    step = fs.compile(diffusion_nft(reward_fn=latent_mse_reward, group_size=2))
    with pytest.raises(ValueError) as excinfo:  # refused before the state is consumed
        step(state, batch_at(0))
    assert "must have the parameters of 'policy'" in _cause_text(excinfo)
    assert not is_consumed(state)


def test_check_rewards_refuses_what_is_not_one_float_a_sample() -> None:
    fs.tree.assert_trees_equal(check_rewards(torch.ones(3), 3), torch.ones(3))
    with pytest.raises(TypeError, match="floating"):
        check_rewards([1.0, 2.0], 2)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        check_rewards(torch.ones(2, 1), 2)
    with pytest.raises(ValueError, match="require grad: a reward is a constant of the loss"):
        check_rewards(torch.ones(2, requires_grad=True), 2)


def _nft_step(**options: Any) -> fs.Step:
    method = diffusion_nft(
        **{"reward_fn": latent_mse_reward, "group_size": 2, "rollout": euler_rollout(1), **options}
    )
    return fs.compile(method)


@pytest.mark.parametrize("where", ["method", "compiled"])
def test_an_accumulation_that_does_not_divide_a_minibatch_is_refused_before_any_change(
    where,
) -> None:
    state = nft_state()  # 2 prompts x group_size 2 = 4 rollouts, minibatches=2: 2 each
    before = tree.clone(state)
    if where == "method":
        step = _nft_step(minibatches=2, accumulation=fs.Accumulation(4))
    else:  # the compiled step's accumulation, which the input check is given
        method = diffusion_nft(
            reward_fn=latent_mse_reward, group_size=2, rollout=euler_rollout(1), minibatches=2
        )
        step = fs.compile(method, accumulation=fs.Accumulation(4))
    with pytest.raises(ValueError, match="accumulation=4 micro-batches must divide each inner"):
        step(state, batch_at(0))
    assert not is_consumed(state)
    tree.assert_trees_equal(state, before)


@pytest.mark.parametrize(
    ("options", "compiled", "match"),
    [
        ({"reward_fn": lambda x, b: x.flatten(1).mean(1).requires_grad_()}, {}, "require grad"),
    ],
    ids=["reward-requires-grad"],
)
def test_what_only_the_step_can_find_raises_step_failed_as_documented(
    options, compiled, match
) -> None:
    state = nft_state()
    method = diffusion_nft(
        **{"reward_fn": latent_mse_reward, "group_size": 2, "rollout": euler_rollout(1), **options}
    )
    with pytest.raises(fs.StepFailedError) as excinfo:
        fs.compile(method, **compiled)(state, batch_at(0))
    assert isinstance(excinfo.value.__cause__, ValueError)
    assert match in str(excinfo.value.__cause__)
    assert is_consumed(state)


@pytest.mark.parametrize("latents", [True, False], ids=["latents", "latent_shape"])
def test_bf16_batches_on_an_fp32_policy_train_as_their_fp32_upcast_bitwise(latents) -> None:
    low = {k: v.bfloat16() for k, v in batch_at(0).items()}
    high = {k: v.float() for k, v in low.items()}
    options: dict[str, Any] = {"reward_fn": lambda x, b: x.float().flatten(1).mean(1)}
    if not latents:
        options["latent_shape"] = tuple(low["latents"].shape[1:])
        low, high = {"text": low["text"]}, {"text": high["text"]}
    results = [_nft_step(**options)(nft_state(), batch) for batch in (low, high)]
    tree.assert_trees_equal(results[0][0], results[1][0], check_static=False)


def test_latent_mse_reward_is_minus_the_mean_squared_error_to_the_target() -> None:
    target = torch.arange(8.0).reshape(2, 1, 2, 2)
    samples = target + torch.tensor([0.0, 2.0]).view(2, 1, 1, 1)
    torch.testing.assert_close(
        latent_mse_reward(samples, {"latents": target}), torch.tensor([0.0, -4.0]), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match=r"batch\['latents'\] shaped like the samples"):
        latent_mse_reward(samples, {"latents": target[:1]})
    with pytest.raises(ValueError, match="latent_mse_reward needs"):
        latent_mse_reward(samples, {})
