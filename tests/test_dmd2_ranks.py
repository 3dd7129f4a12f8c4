"""Multi-step DMD2 on ranks (fvstep.methods.dmd2): the rollout's target step comes from the
shared key of the step, so every rank and micro-batch runs the same number of student
forwards, and a step on 2 FSDP2 gloo ranks equals a one-process loop over both ranks'
batches, bitwise (issue 34: a per-rank draw hung the ranks' all-gathers)."""

from __future__ import annotations

import copy

import pytest
import torch

import fvstep as fs
from benchmarks.reference import microbatches, reshard_all, run_unit, unit_key
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.core.random import fold_in
from fvstep.methods import dmd2, dmd2_losses
from fvstep.methods.dmd2 import rollout, target_step
from fvstep.methods.models import synthetic_batch, tiny_wan

STEPS = (1.0, 0.5)
SEED = fs.random.key(3)
NUM_MICROBATCHES = 2
NUM_STEPS = 3
WORLD_SIZE = 2
TIMEOUT_S = 240.0  # a correct run takes well under a minute; a mismatched collective hangs


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(fold_in(fold_in(fs.random.key(9), step), rank), batch_size=2, frames=1)


def _modules() -> dict[str, torch.nn.Module]:
    teacher = tiny_wan(seed=0)
    return {"student": copy.deepcopy(teacher), "teacher": teacher, "critic": tiny_wan(seed=1)}


def _method(ordering: str) -> fs.Step:
    return dmd2(
        generator_update_interval=2, ordering=ordering, guidance_scale=1.5,  # type: ignore[arg-type]
        denoising_steps=STEPS,
    )  # fmt: skip


class _View:
    """What the DMD2 losses read of a state: modules, the base key and the step."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.modules, self.key, self.step = modules, SEED, 0

    def module(self, name: str) -> torch.nn.Module:
        return self.modules[name]


class _CountingStudent(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("loss", ["generator_loss", "critic_loss", "fused_loss"])
def test_every_rank_and_micro_batch_of_a_step_runs_the_shared_target_steps_forwards(loss):
    """The student's forwards of a micro-batch are ``target_step(state.key, step) + 1`` for
    every rank's and micro-batch's key (a per-rank draw made them differ: FSDP2 hangs)."""
    modules = _modules()
    student = _CountingStudent(modules["student"])
    view = _View({**modules, "student": student})
    fn = getattr(dmd2_losses(guidance_scale=1.5, denoising_steps=(1.0, 0.75, 0.5)), loss)
    seen = set()
    for step in range(6):
        view.step = step
        target = target_step(SEED, step, 3)
        seen.add(target)
        for rank in range(2):
            for m in range(2):
                student.calls = 0
                with torch.no_grad():
                    fn(view, _batch(step, rank), unit_key(SEED, step, rank, "dmd2_fused", m))
                assert student.calls == target + 1, (step, rank, m, student.calls, target)
    assert len(seen) > 1  # the target is drawn, not fixed


def test_target_step_is_a_function_of_the_shared_key_and_the_step():
    draws = [target_step(SEED, step, 4) for step in range(32)]
    assert draws == [target_step(SEED, step, 4) for step in range(32)]
    assert set(draws) == {0, 1, 2, 3}
    assert draws != [target_step(fs.random.key(4), step, 4) for step in range(32)]
    assert target_step(SEED, 5, 1) == 0
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        target_step(SEED, 0, 0)
    batch = _batch(0, 0)
    with pytest.raises(ValueError, match=r"target=2 must index the 2 denoising steps"):
        rollout(tiny_wan(), batch["latents"], batch["text"], SEED, STEPS, target=2)


def _units(step: int, ordering: str) -> list[tuple[tuple[str, ...], str, str]]:
    """The units DMD2 runs at ``step``: (roles, unit name, loss function's name)."""
    critic = (("critic",), "dmd2_critic", "critic_loss")
    if step % 2:
        return [critic]
    if ordering == "fused":
        return [(("student", "critic"), "dmd2_fused", "fused_loss")]
    return [(("student",), "dmd2_generator", "generator_loss"), critic]


def _adamw(modules: dict[str, torch.nn.Module]) -> dict[str, torch.optim.Optimizer]:
    modules["teacher"].requires_grad_(False)
    return {
        r: torch.optim.AdamW(modules[r].parameters(), lr=1e-3, weight_decay=0.01)
        for r in ("student", "critic")
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if fs.tree.is_dtensor(t) else t).detach().clone()


def _snapshot(params: dict, moments: dict) -> dict[str, dict[str, torch.Tensor]]:
    """``{role: params, role.exp_avg: ..., role.exp_avg_sq: ...}``, full tensors by name."""
    out = {}
    for role in ("student", "critic"):
        out[role] = {n: _full(p) for n, p in params[role].items()}
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{role}.{moment}"] = {n: _full(t) for n, t in moments[role][moment].items()}
    return out


def _torch_snapshot(modules, optimizers) -> dict[str, dict[str, torch.Tensor]]:
    params = {r: dict(modules[r].named_parameters()) for r in ("student", "critic")}
    moments = {
        r: {m: {n: optimizers[r].state[p][m] for n, p in params[r].items()}
            for m in ("exp_avg", "exp_avg_sq")}
        for r in ("student", "critic")
    }  # fmt: skip
    return _snapshot(params, moments)


def _one_process_loop(ordering: str) -> dict[str, dict[str, torch.Tensor]]:
    """DMD2 by hand on one process for both ranks: torch.optim.AdamW; per micro-batch ``m``
    each rank's loss on its own batch and key (the engine's ``unit_key``), backpropagated
    divided by K; the two ranks' gradients averaged (FSDP2's reduce-scatter: ``(g_0 +
    g_1) / 2``, added up over the micro-batches)."""
    modules = _modules()
    optimizers = _adamw(modules)
    losses = dmd2_losses(guidance_scale=1.5, denoising_steps=STEPS)
    view = _View(modules)
    for i in range(NUM_STEPS):
        view.step = i
        parts = [microbatches(_batch(i, r), NUM_MICROBATCHES) for r in range(WORLD_SIZE)]
        for roles, name, loss in _units(i, ordering):
            params = [p for r in roles for p in modules[r].parameters()]
            for m in range(NUM_MICROBATCHES):
                per_rank = []
                for r in range(WORLD_SIZE):
                    out, _ = getattr(losses, loss)(view, parts[r][m], unit_key(SEED, i, r, name, m))
                    total = out if isinstance(out, torch.Tensor) else sum(out.values())
                    per_rank.append(torch.autograd.grad(total / NUM_MICROBATCHES, params))
                for p, g0, g1 in zip(params, *per_rank, strict=True):
                    mean = (g0 + g1) / WORLD_SIZE
                    p.grad = mean if p.grad is None else p.grad + mean
            for r in roles:
                optimizers[r].step()
                optimizers[r].zero_grad(set_to_none=True)
    return _torch_snapshot(modules, optimizers)


def _rank_loop(rank: int, ordering: str) -> dict[str, dict[str, torch.Tensor]]:
    """DMD2 by hand on this FSDP2 rank: ``run_unit`` (K micro-batches, FSDP2's default
    flags, torch.optim.AdamW on the shards), the engine's keys, this rank's batches."""
    mesh = fsp.make_mesh(device_type="cpu")
    modules = {r: fsp.shard_module(m, mesh=mesh) for r, m in _modules().items()}
    optimizers = _adamw(modules)
    losses = dmd2_losses(guidance_scale=1.5, denoising_steps=STEPS)
    view = _View(modules)
    for i in range(NUM_STEPS):
        view.step = i
        for roles, name, loss in _units(i, ordering):

            def loss_of(m, mb, i=i, name=name, loss=loss):
                return getattr(losses, loss)(view, mb, unit_key(SEED, i, rank, name, m))[0]

            run_unit(modules, optimizers, roles, loss_of, _batch(i, rank),
                     num_microbatches=NUM_MICROBATCHES)  # fmt: skip
    reshard_all(modules)
    return _torch_snapshot(modules, optimizers)


def check_dmd2_on_two_fsdp2_ranks(rank: int, world_size: int, ordering: str) -> dict:
    """NUM_STEPS steps of DMD2 on FSDP2 ranks (every role sharded by ``shard_module``),
    K = 2, asserted bitwise equal to the hand-written loop on this rank; returns the full
    parameters and AdamW moments of student and critic."""
    mesh = fsp.make_mesh(device_type="cpu")
    modules = {r: fsp.shard_module(m, mesh=mesh) for r, m in _modules().items()}
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                modules["student"], optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.01)
            ),
            "teacher": fs.Role(modules["teacher"]),
            "critic": fs.Role(
                modules["critic"], optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.01)
            ),
        },
        key=SEED,
    )
    step = fs.compile(_method(ordering), accumulation=fs.Accumulation(NUM_MICROBATCHES))
    for i in range(NUM_STEPS):
        state, _ = step(state, _batch(i, rank), parallelism=fsp.Layout())
    ours = _snapshot(
        {r: state.roles[r].params for r in ("student", "critic")},
        {r: {m: getattr(state.roles[r].opt_state, m) for m in ("exp_avg", "exp_avg_sq")}
         for r in ("student", "critic")},
    )  # fmt: skip
    tree.assert_trees_equal(ours, _rank_loop(rank, ordering))
    return ours


# FSDP2 wraps each block's inputs in autograd functions of its own, which changes the order in
# which autograd sums the gradients of an activation read in several places (the text
# embedding feeds every block's cross-attention): even on 1 rank, FSDP2's gradients of the
# text embedder differ from a plain module's by an ulp. After 3 AdamW steps (each moving a
# parameter by up to lr = 1e-3) the one-process loop is 2e-6 of each tensor's largest value
# away, measured; a rank that ran other forwards (another target step) is ~1 away.
RELATIVE_TOLERANCE = 2e-5


@pytest.mark.multirank
@pytest.mark.parametrize("ordering", ["fused", "sequential"])
def test_multi_step_dmd2_on_two_fsdp2_ranks_is_the_one_process_loop(ranks, ordering):
    """``denoising_steps=(1.0, 0.5)``, 3 steps (generator, critic only, generator), K = 2:
    on each rank, every parameter and AdamW moment of student and critic equals the
    hand-written loop on that rank bitwise, and the one-process loop over both ranks'
    batches up to ``RELATIVE_TOLERANCE`` of each tensor's largest value (see above). Before
    the fix the ranks drew their own target steps and hung in FSDP2's all-gathers (the
    pool's timeout turns that into a failure)."""
    results = ranks.run(check_dmd2_on_two_fsdp2_ranks, ordering, timeout=TIMEOUT_S)
    expected = _one_process_loop(ordering)
    assert len(expected["student"]) > 10 and len(expected["critic"]) > 10
    for name, tensors in expected.items():
        for param, want in tensors.items():
            torch.testing.assert_close(
                results[0][name][param], want, rtol=0,
                atol=RELATIVE_TOLERANCE * float(want.abs().max()),
                msg=lambda text, where=f"{name} {param}": f"{where}: {text}",
            )  # fmt: skip
