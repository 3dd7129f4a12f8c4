"""Self-forcing (fvstep.methods.self_forcing, fvstep.methods.causal_rollout): the step equals
a hand-written loop bitwise, resumes bitwise at an odd step with K = 2, keeps gradient only
through the exit steps, and draws its exit steps from the shared key of the step."""

from __future__ import annotations

import copy

import pytest
import torch

import fvstep as fs
from benchmarks.reference import reshard_all, run_unit, shard_by_hand, unit_key
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.core.random import fold_in, split
from fvstep.methods.causal_rollout import exit_steps, regenerate, rollout, shifted_steps
from fvstep.methods.causal_wan import init_cache, make_causal
from fvstep.methods.dmd2 import critic_denoising_loss, distribution_matching_loss, score_time
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.methods.self_forcing import (
    critic_loss_on,
    dmd_loss_on,
    self_forcing,
    self_forcing_losses,
)
from fvstep.testing import assert_resume_exact
from tests.refusals import assert_refused_before_any_change

STEPS = (1.0, 0.5)


class VideoData:
    """Per-rank batches of two latent frames (two chunks of one): a function of (step, rank)."""

    def batch(self, step: int, *, rank: int = 0, world_size: int = 1) -> dict:
        return synthetic_batch(
            fold_in(fold_in(fs.random.key(5), step), rank), batch_size=2, frames=2
        )


def _modules() -> dict[str, torch.nn.Module]:
    return {
        "student": make_causal(tiny_wan(seed=0), chunk_frames=1),
        "teacher": tiny_wan(seed=0),
        "critic": tiny_wan(seed=1),
    }


def _state(modules) -> fs.TrainState:
    def adamw():
        return fs.optim.adamw(lr=1e-3, weight_decay=0.01)

    return fs.TrainState.create(
        {
            "student": fs.Role(modules["student"], optimizer=adamw()),
            "teacher": fs.Role(modules["teacher"]),
            "critic": fs.Role(modules["critic"], optimizer=adamw()),
        },
        key=fs.random.key(3),
    )


def _step() -> fs.Step:
    method = self_forcing(generator_update_interval=2, denoising_steps=STEPS, guidance_scale=1.5)
    return fs.compile(method, accumulation=fs.Accumulation(2))


def factory():
    return _state(_modules()), _step(), VideoData()


class _View:
    def __init__(self, modules):
        self.modules, self.key, self.step = modules, fs.random.key(3), 0

    def module(self, name):
        return self.modules[name]


def _hand_written_loop(modules, *, num_steps: int, rank: int) -> dict:
    """Self-forcing by hand: the rollout chunk by chunk, the DMD and critic losses,
    torch.optim.AdamW, K = 2 micro-batches (``run_unit``: FSDP2 flags when sharded), the
    engine's keys. Returns the optimizers."""
    optimizers = {
        r: torch.optim.AdamW(modules[r].parameters(), lr=1e-3, weight_decay=0.01)
        for r in ("student", "critic")
    }
    view = _View(modules)
    for i in range(num_steps):
        fused = i % 2 == 0
        name = "self_forcing_fused" if fused else "self_forcing_critic"
        exits = exit_steps(fs.random.key(3), i, 2, len(STEPS))

        def loss_of(m: int, mb: dict, fused=fused, name=name, exits=exits, i=i):
            key = unit_key(fs.random.key(3), i, rank, name, m)
            k_rollout, k_generator, k_critic = split(key, 3)
            with torch.set_grad_enabled(fused):
                video = rollout(modules["student"], mb["latents"], mb["text"], k_rollout,
                                exits=exits, denoising_steps=STEPS).video  # fmt: skip
            loss, _ = critic_loss_on(view, video, mb["text"], k_critic)
            if fused:
                g_loss, _ = dmd_loss_on(view, video, mb["text"], k_generator, guidance_scale=1.5)
                loss = g_loss + loss
            return loss

        roles = ("student", "critic") if fused else ("critic",)
        run_unit(modules, optimizers, roles, loss_of, VideoData().batch(i, rank=rank),
                 num_microbatches=2)  # fmt: skip
    return optimizers


def _assert_equal_to_loop(state, modules, optimizers) -> None:
    for role in ("student", "critic"):
        params = dict(modules[role].named_parameters())
        tree.assert_trees_equal(state.roles[role].params, params)
        moments = {n: optimizers[role].state[p] for n, p in params.items()}
        for moment in ("exp_avg", "exp_avg_sq"):
            tree.assert_trees_equal(
                getattr(state.roles[role].opt_state, moment),
                {n: s[moment] for n, s in moments.items()},
            )


def test_the_step_is_bitwise_a_hand_written_self_forcing_loop():
    """Three steps (fused, critic only, fused), K = 2: parameters and AdamW moments."""
    modules = _modules()
    state = _state({r: copy.deepcopy(m) for r, m in modules.items()})
    step = _step()
    for i in range(3):
        state, _ = step(state, VideoData().batch(i))
    _assert_equal_to_loop(state, modules, _hand_written_loop(modules, num_steps=3, rank=0))


def check_two_fsdp2_ranks_against_the_loop(rank: int, world_size: int) -> bool:
    mesh = fsp.make_mesh(device_type="cpu")
    plain = _modules()
    ref = {r: shard_by_hand(copy.deepcopy(m), mesh) for r, m in plain.items()}
    ref["teacher"].requires_grad_(False)
    state = _state({r: shard_by_hand(m, mesh) for r, m in plain.items()})
    step = _step()
    for i in range(2):
        state, _ = step(state, VideoData().batch(i, rank=rank), parallelism=fsp.Layout())
    optimizers = _hand_written_loop(ref, num_steps=2, rank=rank)
    reshard_all(ref)
    _assert_equal_to_loop(state, ref, optimizers)
    return True


@pytest.mark.multirank
def test_the_step_on_two_fsdp2_ranks_is_bitwise_the_hand_written_loop(ranks):
    """Every parameter and AdamW moment of student and critic, 2 steps (fused, critic)."""
    assert all(ranks.run(check_two_fsdp2_ranks_against_the_loop))


def test_a_resumed_run_is_bitwise_the_uninterrupted_one_at_an_odd_step(tmp_path):
    assert_resume_exact(factory, num_steps=2, interruptions=[1], workdir=tmp_path)


def test_gradient_flows_only_through_each_chunks_exit_step():
    """The rollout's gradient equals the one of its exit steps recomputed alone from their
    inputs and (detached) caches: nothing before an exit step, nor the cache, carries any."""
    student = make_causal(tiny_wan(seed=0), chunk_frames=1)
    batch = VideoData().batch(0)
    ro = rollout(student, batch["latents"], batch["text"], fs.random.key(1), exits=(1, 0),
                 denoising_steps=STEPS)  # fmt: skip
    assert all(not x.requires_grad for x in ro.exit_inputs)
    assert all(not leaf.requires_grad for c in ro.contexts for leaf in tree.leaves(c))
    ro.video.square().sum().backward()
    first = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad(set_to_none=True)
    again = regenerate(student, ro.exit_inputs, ro.exit_times, ro.contexts, batch["text"])
    assert torch.equal(again, ro.video.detach())
    again.square().sum().backward()
    tree.assert_trees_equal({n: p.grad for n, p in student.named_parameters()}, first)
    assert ro.exit_times == (0.5, 1.0)


def test_exit_steps_are_a_function_of_the_shared_key_and_the_step():
    key = fs.random.key(0)
    draws = {exit_steps(key, s, num_chunks=3, num_steps=4) for s in range(8)}
    assert len(draws) > 1  # they change with the step
    assert exit_steps(key, 5, 3, 4) == exit_steps(key, 5, 3, 4)  # no rank, no global RNG
    assert len(set(exit_steps(key, 5, 3, 4, same_step_across_chunks=True))) == 1
    assert exit_steps(key, 5, 3, 4, last_step_only=True) == (3, 3, 3)
    assert shifted_steps((1.0, 0.5), 3.0) == (1.0, 0.75)


def test_bad_settings_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="strictly decreasing"):
        self_forcing_losses(denoising_steps=(0.5, 1.0))
    with pytest.raises(ValueError, match="context_time"):
        self_forcing_losses(context_time=1.0)
    with pytest.raises(ValueError, match="generator_update_interval"):
        self_forcing(generator_update_interval=0)
    student = make_causal(tiny_wan(seed=0), chunk_frames=2)
    batch = synthetic_batch(fs.random.key(0), batch_size=1, frames=3)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        rollout(student, batch["latents"], batch["text"], fs.random.key(0), exits=(0,),
                denoising_steps=STEPS)  # fmt: skip


def _compiled_rollout(frames: int, compile: dict | None):
    """A rollout of ``frames`` one-frame chunks (both exit steps taken) and its backward,
    with the student's blocks compiled (``compile``) or eager: the graphs dynamo compiled
    for it, the video and the gradients."""
    student = make_causal(tiny_wan(seed=0), chunk_frames=1)
    if compile is not None:
        student = fsp.prepare(student, compile=compile)
    batch = synthetic_batch(fs.random.key(0), batch_size=1, frames=frames)
    torch._dynamo.reset()  # a fresh count, whatever this process compiled before
    before = fsp.compile_counts()["graphs"]
    ro = rollout(student, batch["latents"], batch["text"], fs.random.key(1),
                 exits=tuple(c % 2 for c in range(frames)), denoising_steps=STEPS)  # fmt: skip
    ro.video.square().mean().backward()
    graphs = fsp.compile_counts()["graphs"] - before
    return graphs, ro.video.detach(), {n: p.grad for n, p in student.named_parameters()}


def test_a_compiled_rollout_compiles_as_many_graphs_for_2n_chunks_as_for_n():
    """The student's compiled blocks get inputs of the same shapes and constants at every
    chunk and every layer (a fixed-capacity cache read with a mask, its layer picked by a
    tensor): 2 chunks and 4 chunks compile the same number of graphs, 2 (the no-grad and
    the grad forward; before, a graph per layer and cache fill level: 5 and 11), and the
    compiled rollout gives the eager video and gradients (dynamo's eager backend on the
    CPU; asserted within 1e-6)."""
    counts = {}
    for frames in (2, 4):
        counts[frames], video, grads = _compiled_rollout(frames, {"backend": "eager"})
    _, eager_video, eager_grads = _compiled_rollout(4, None)
    assert counts[2] == counts[4] <= 2, counts
    torch.testing.assert_close(video, eager_video, rtol=0, atol=1e-6)
    tree.assert_trees_close(grads, eager_grads, rtol=0, atol=1e-6)


def test_dmd2s_public_terms_are_the_dmd_formulas_written_out():
    """``distribution_matching_loss``'s gradient on ``x0_hat`` is ``g / numel`` and its
    value ``0.5 mean(g^2)``; ``critic_denoising_loss`` is the critic's flow-matching MSE
    and sends no gradient to ``x0_hat``: each written out here from the same keys (fp32,
    within 1e-6; the guided teacher is guided in x0 here, in v there)."""
    view = _View({"teacher": tiny_wan(seed=0), "critic": tiny_wan(seed=1)})
    x0_hat = torch.randn(2, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    x0_hat.requires_grad_(True)
    text = VideoData().batch(0)["text"]
    k_t, k_noise = split(fs.random.key(7), 2)
    score = {"shift": 3.0, "min_ratio": 0.02, "max_ratio": 0.98}
    loss, metrics = distribution_matching_loss(
        view, x0_hat, text, k_t, k_noise, guidance_scale=1.5, **score
    )
    loss.backward()
    t = score_time(k_t, 2, **score)
    eps = torch.randn(x0_hat.shape, generator=fs.random.generator(k_noise))
    tb = t.view(-1, 1, 1, 1, 1)
    x0 = x0_hat.detach()
    x_t = (1 - tb) * x0 + tb * eps
    with torch.no_grad():

        def x0_of(role, prompt):
            return x_t - tb * predict(view.module(role), x_t, t * 1000, prompt)

        cond, uncond = x0_of("teacher", text), x0_of("teacher", torch.zeros_like(text))
        x0_cfg = uncond + 1.5 * (cond - uncond)
        g = (x0_of("critic", text) - x0_cfg) / (x0 - x0_cfg).abs().mean((1, 2, 3, 4), True)
        v_critic = predict(view.module("critic"), x_t, t * 1000, text)
    torch.testing.assert_close(x0_hat.grad, g / g.numel(), rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, 0.5 * g.square().mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["score_t_mean"], t.mean())
    c_loss, c_metrics = critic_denoising_loss(view, x0_hat, text, k_t, k_noise, **score)
    torch.testing.assert_close(c_loss, (v_critic - (eps - x0)).square().mean(), rtol=0, atol=1e-6)
    assert torch.autograd.grad(c_loss, x0_hat, allow_unused=True) == (None,)
    assert c_loss.requires_grad and set(c_metrics) == {"critic_t_mean"}


@pytest.mark.parametrize("role", ["teacher", "critic"])
@pytest.mark.parametrize("at_step", [0, 1], ids=["fused", "critic-only"])
def test_a_causal_teacher_or_critic_is_refused_naming_the_role(role, at_step):
    modules = _modules()
    modules[role] = copy.deepcopy(modules["student"])  # a copy of the causal student
    state = _state(modules).replace(step=torch.tensor(at_step))
    assert_refused_before_any_change(
        state, _step(), VideoData().batch(0), f"needs a bidirectional '{role}'"
    )


def test_bf16_latents_on_an_fp32_student_train_as_their_fp32_upcast_bitwise():
    low = {k: v.bfloat16() for k, v in VideoData().batch(0).items()}
    high = {k: v.float() for k, v in low.items()}
    step = fs.compile(self_forcing(generator_update_interval=1, denoising_steps=STEPS))
    low_state, low_metrics = step(_state(_modules()), low)
    high_state, high_metrics = step(_state(_modules()), high)
    tree.assert_trees_equal(low_state, high_state, check_static=False)
    assert torch.equal(low_metrics["student/loss"], high_metrics["student/loss"])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"guidance_scale": -1.0}, "guidance_scale must be >= 0"),
        ({"shift": 0.0}, "shift must be > 0"),
        ({"min_ratio": 0.9, "max_ratio": 0.1}, "min_ratio <= max_ratio"),
    ],
)
def test_score_options_out_of_range_are_refused_as_dmd2_refuses_them(options, match):
    with pytest.raises(ValueError, match=match):
        self_forcing(**options)
    with pytest.raises(ValueError, match=match):
        fs.methods.dmd2(**options)


def test_rollout_and_exit_steps_refuse_bad_exits_and_a_cache_of_another_model():
    student = make_causal(tiny_wan(seed=0), chunk_frames=1)
    batch = synthetic_batch(fs.random.key(0), batch_size=1, frames=2)
    like, text = batch["latents"], batch["text"]
    for exits in [(-1, 0), (0, 2)]:
        with pytest.raises(ValueError, match=r"exits\[\d\]=.* an int in 0 \.\. 1"):
            rollout(student, like, text, fs.random.key(0), exits=exits, denoising_steps=STEPS)
    other = make_causal(tiny_wan(seed=0, num_layers=1), chunk_frames=1)
    with pytest.raises(ValueError, match="the cache has 1 layers and the student 2"):
        rollout(student, like, text, fs.random.key(0), exits=(0, 0), denoising_steps=STEPS,
                cache=init_cache(other, like, capacity_frames=2))  # fmt: skip
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        exit_steps(fs.random.key(0), 0, num_chunks=2, num_steps=0)
    # the docstring's example
    assert exit_steps(fs.random.key(0), 3, num_chunks=2, num_steps=4) == (1, 2)
