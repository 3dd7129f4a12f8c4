"""Samplers, VAE decoding and sample videos: the math of each sampler, fixed noise, EMA
weights chosen explicitly, and a state left bitwise unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fvstep as fs
from fvstep.core import tree
from fvstep.executor.reporting import Validation
from fvstep.executor.sampling import (
    EulerSampler,
    FewStepSampler,
    decode_latents,
    sample,
    sample_videos,
)
from fvstep.methods.finetune import finetune
from fvstep.methods.models import synthetic_batch, tiny_wan

diffusers = pytest.importorskip("diffusers")

LATENT_SHAPE = (4, 2, 4, 4)


def tiny_vae() -> nn.Module:
    """A tiny ``AutoencoderKLWan`` (4 latent channels; 5 frames of 32x32 from 2x4x4)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return diffusers.AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.5, 1.0, 2.0],
        ).eval()


class ConstantVelocity(nn.Module):
    """A module with the forward contract whose velocity is ``c`` everywhere."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c
        self.calls: list[torch.Tensor] = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        self.calls.append(timestep)
        return (torch.full_like(hidden_states, self.c),)


def test_euler_sampler_integrates_a_constant_velocity_from_t1_to_0():
    noise = torch.randn(2, *LATENT_SHAPE, generator=torch.Generator().manual_seed(0))
    module = ConstantVelocity(0.5)
    out = sample(module, noise, torch.zeros(2, 3, 16), sampler=EulerSampler(4, shift=3.0))
    torch.testing.assert_close(out, noise - 0.5)  # the steps' dt sum to -1
    times = [float(t[0]) for t in module.calls]
    assert len(times) == 4 and times[0] == 1000.0 and times == sorted(times, reverse=True)


def test_guided_euler_sampler_extrapolates_from_the_negative_text():
    class TextVelocity(nn.Module):
        def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
            return (torch.full_like(hidden_states, float(encoder_hidden_states.mean())),)

    noise = torch.zeros(1, *LATENT_SHAPE)
    text = torch.ones(1, 3, 16)
    out = sample(TextVelocity(), noise, text, sampler=EulerSampler(2, guidance_scale=3.0))
    torch.testing.assert_close(out, noise - 3.0)  # v = 0 + 3 (1 - 0)


def test_few_step_sampler_predicts_x0_and_renoises_with_keyed_noise():
    noise = torch.randn(1, *LATENT_SHAPE, generator=torch.Generator().manual_seed(0))
    text = torch.zeros(1, 3, 16)
    one = sample(ConstantVelocity(0.25), noise, text, sampler=FewStepSampler((1.0,)))
    torch.testing.assert_close(one, noise - 0.25)  # x0 = x - 1 * v
    key = fs.random.key(5)
    two = sample(ConstantVelocity(0.25), noise, text, sampler=FewStepSampler((1.0, 0.5)), key=key)
    eps = torch.randn(noise.shape, generator=fs.random.generator(fs.random.fold_in(key, 0)))
    x = 0.5 * (noise - 0.25) + 0.5 * eps
    torch.testing.assert_close(two, x - 0.5 * 0.25)
    with pytest.raises(ValueError, match="key"):
        sample(ConstantVelocity(0.0), noise, text, sampler=FewStepSampler((1.0, 0.5)))
    with pytest.raises(ValueError, match="decreasing"):
        FewStepSampler((0.5, 1.0))
    with pytest.raises(ValueError, match="num_steps"):
        EulerSampler(0)


def test_decode_latents_matches_the_vae_decode_of_denormalised_latents():
    vae = tiny_vae()
    latents = torch.randn(1, *LATENT_SHAPE, generator=torch.Generator().manual_seed(1))
    pixels = decode_latents(vae, latents)
    assert pixels.shape == (1, 5, 32, 32, 3)
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.5, 1.0, 2.0]).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents * std + mean).sample  # (B, 3, F, H, W) in [-1, 1]
    expected = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1)
    torch.testing.assert_close(pixels, expected)


def make_state() -> fs.TrainState:
    return fs.TrainState.create(
        {"student": fs.Role(tiny_wan(seed=0), optimizer=fs.optim.adamw(lr=1e-2), ema=fs.EMA(0.5))},
        key=fs.random.key(0),
    )


def test_sample_videos_are_fixed_per_prompt_and_leave_the_state_unchanged():
    state = make_state()
    step = fs.compile(finetune())
    for s in range(2):
        state, _ = step(state, synthetic_batch(fs.random.fold_in(fs.random.key(1), s)))
    before = tree.clone(state)
    prompts = synthetic_batch(fs.random.key(9), batch_size=2)["text"]
    vae = tiny_vae()

    def videos(weights, sampler=None):
        fn = sample_videos(
            prompts,
            latent_shape=LATENT_SHAPE,
            vae=vae,
            sampler=sampler or EulerSampler(2),
            weights=weights,
            captions=["a", "b"],
        )
        return fn(state, fs.random.key(0))

    params = videos("params")
    assert sorted(params) == ["sample_0", "sample_1"]
    v = params["sample_0"]
    assert v.frames.shape == (5, 32, 32, 3) and v.frames.dtype == torch.uint8
    assert v.caption == "a"
    again = videos("params")
    assert all(torch.equal(params[k].frames, again[k].frames) for k in params)
    assert not torch.equal(params["sample_0"].frames, params["sample_1"].frames)
    ema = videos("ema")
    assert not torch.equal(ema["sample_0"].frames, params["sample_0"].frames)
    few = videos("params", FewStepSampler((1.0, 0.5)))
    assert not torch.equal(few["sample_0"].frames, params["sample_0"].frames)
    tree.assert_trees_equal(state, before)


def test_a_run_writes_a_sample_strip_per_prompt(tmp_path):
    state = make_state()
    prompts = synthetic_batch(fs.random.key(9), batch_size=1)["text"]
    fn = sample_videos(prompts, latent_shape=LATENT_SHAPE, vae=tiny_vae(), sampler=EulerSampler(1))
    fs.run(
        fs.compile(finetune()),
        state,
        lambda s: synthetic_batch(fs.random.fold_in(fs.random.key(1), s)),
        num_steps=1,
        metrics_path=tmp_path / "m.jsonl",
        validation=Validation(fn),
        progress=False,
        trackers=[],
    )
    folder = tmp_path / "media" / "step_000000001"
    assert sorted(p.name for p in folder.iterdir()) == ["val_sample_0.mp4", "val_sample_0.png"]


def test_few_step_sampler_is_the_dmd2_rollout_run_to_its_last_step():
    from fvstep.methods.dmd2 import rollout

    steps = (1.0, 0.75, 0.5)
    net = tiny_wan(seed=3)
    like = torch.zeros(1, *LATENT_SHAPE)
    text = synthetic_batch(fs.random.key(2), batch_size=1)["text"]
    # a rollout key whose drawn target step is the last one
    key = next(
        k
        for k in (fs.random.key(i) for i in range(100))
        if int(
            torch.randint(len(steps), (1,), generator=fs.random.generator(fs.random.split(k, 3)[1]))
        )
        == len(steps) - 1
    )
    k_noise, _, k_renoise = fs.random.split(key, 3)
    noise = torch.randn(like.shape, generator=fs.random.generator(k_noise))
    with torch.no_grad():
        expected = rollout(net, like, text, key, steps)
    ours = sample(net, noise, text, sampler=FewStepSampler(steps), key=k_renoise)
    tree.assert_trees_equal(ours, expected)
