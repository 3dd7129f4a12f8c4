"""Activation offloading (``prepare(offload_activations=...)``): what it hooks, what it
refuses, and that it changes no number.

On a CPU nothing moves (the hooks keep every tensor where it is), so the CPU tests check
the wiring: which blocks are hooked, that names and checkpoint keys do not change, that a
step through the hooks (eager, compiled, checkpointed) is bitwise the plain one, and that
compiling around them breaks no graph. The CUDA tests (run on the GPU machine, results in
``docs/benchmarks.md``) check that tensors do move, under Inductor too, and that the
step stays bitwise the same while the device holds less.
"""

from __future__ import annotations

import pytest
import torch

import fvstep as fs
from fvstep import tree
from fvstep.methods import finetune
from fvstep.models import synthetic_batch, tiny_wan
from fvstep.parallel import ActivationOffloading
from fvstep.parallel.activation_offload import (
    apply_activation_offloading,
    is_offloaded,
    offloaded_bytes,
    resolve_offloading,
)
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.prepare import block_names, preparation, prepare

CPU_COMPILE = {"backend": "aot_eager"}
CUDA = torch.cuda.is_available()


def _state(module: torch.nn.Module) -> fs.TrainState:
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.1))},
        key=fs.random.key(0),
    )


def _train(state: fs.TrainState, num_steps: int, device: str = "cpu") -> fs.TrainState:
    step = fs.compile(finetune(), clip=fs.clip_grad_norm(1.0))
    for i in range(num_steps):
        batch = synthetic_batch(fs.random.key(i), batch_size=2)
        state, _ = step(state, {k: v.to(device) for k, v in batch.items()})
    return state


@pytest.mark.parametrize(
    ("options", "every"),
    [
        ({}, 1),
        ({}, 2),
        ({"checkpointing": "narrow"}, 2),
        ({"compile": CPU_COMPILE}, 2),
    ],
    ids=["every-block", "every-2nd", "narrow", "compiled"],
)
def test_offloading_hooks_the_chosen_blocks_and_trains_bitwise_as_the_plain_role(options, every):
    plain = _train(_state(tiny_wan(seed=0, num_layers=3)), 2)
    before = compile_counts()
    module = prepare(
        tiny_wan(seed=0, num_layers=3),
        offload_activations=ActivationOffloading(every=every),
        **options,
    )
    assert [n for n, _ in module.named_parameters()] == [
        n for n, _ in tiny_wan(seed=0, num_layers=3).named_parameters()
    ]
    chosen = [f"blocks.{i}" for i in range(0, 3, every)]
    assert list(preparation(module).offloaded_blocks) == chosen
    assert [n for n in block_names(module) if is_offloaded(module.get_submodule(n))] == chosen
    assert preparation(module).describe()["offloaded_blocks"] == len(chosen)
    trained = _train(_state(module), 2)
    if "compile" in options:  # compile's summation order (as tests/test_prepare.py)
        tree.assert_trees_close(
            trained.roles["student"].params, plain.roles["student"].params, rtol=0, atol=1e-6
        )
        assert compile_counts()["graph_breaks"] == before["graph_breaks"]
    else:
        tree.assert_trees_equal(trained.roles["student"].params, plain.roles["student"].params)
        tree.assert_trees_equal(
            trained.roles["student"].opt_state, plain.roles["student"].opt_state
        )
    assert offloaded_bytes(module) == 0  # on a CPU nothing moves


def test_a_checkpoint_of_an_offloaded_role_loads_into_a_plain_one(tmp_path):
    state = _train(_state(prepare(tiny_wan(seed=0), offload_activations=True)), 1)
    fs.checkpoint.save(state, tmp_path / "c")
    loaded = fs.checkpoint.load(tmp_path / "c", like=_state(tiny_wan(seed=3)))
    tree.assert_trees_equal(loaded.roles["student"].params, state.roles["student"].params)


def test_bad_offloading_options_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ActivationOffloading(every=0)
    with pytest.raises(ValueError, match="min_bytes must be an int >= 1"):
        ActivationOffloading(min_bytes=True)
    with pytest.raises(TypeError, match="offload_activations must be a bool"):
        resolve_offloading(2)  # type: ignore[arg-type]
    module = tiny_wan()
    blocks = dict(module.blocks.named_children())
    assert apply_activation_offloading(blocks, ActivationOffloading(every=2)) == ("0",)
    with pytest.raises(ValueError, match="applied to .* already"):
        apply_activation_offloading(blocks, ActivationOffloading())


class _SinBlock(torch.nn.Module):
    """Returns the tensor its ``sin`` saves, so a caller can change it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h.sin(), h


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "offload-hooked"])
def test_a_saved_tensor_changed_in_place_raises_autograds_error_through_the_hooks(hooked):
    """Autograd checks no version counter under saved-tensor hooks: the hooks do."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_SinBlock()])
    if hooked:
        apply_activation_offloading(dict(blocks.named_children()), ActivationOffloading())
    out, h = blocks[0](torch.randn(2, 4))
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_grad_calls_are_not_hooked():
    module = prepare(tiny_wan(seed=0), offload_activations=True)
    batch = synthetic_batch(fs.random.key(0), batch_size=1)
    with torch.no_grad():
        out = module(batch["latents"], torch.full((1,), 500.0), batch["text"], return_dict=False)[0]
        ref = tiny_wan(seed=0)(
            batch["latents"], torch.full((1,), 500.0), batch["text"], return_dict=False
        )[0]
    assert torch.equal(out, ref)


@pytest.mark.skipif(not CUDA, reason="moves tensors between a CUDA device and the host")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "inductor"])
def test_on_cuda_tensors_move_and_the_step_stays_bitwise(compile):
    def role(offload):
        module = tiny_wan(seed=0, num_layers=4).cuda()
        options = {"offload_activations": offload} if offload else {}
        return prepare(module, compile=compile, **options)

    plain = _train(_state(role(None)), 3, "cuda")
    module = role(ActivationOffloading(every=2, min_bytes=1))
    offloaded = _train(_state(module), 3, "cuda")
    assert offloaded_bytes(module) > 0
    tree.assert_trees_equal(offloaded.roles["student"].params, plain.roles["student"].params)
    tree.assert_trees_equal(offloaded.roles["student"].opt_state, plain.roles["student"].opt_state)


@pytest.mark.skipif(not CUDA, reason="measures CUDA memory")
def test_on_cuda_offloaded_activations_leave_the_device_and_the_gradients_stay():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
        )
        for _ in range(8)
    ).cuda()
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)

    def held_and_grads() -> tuple[int, list[torch.Tensor]]:
        # Nothing of an earlier call stays on the device: both calls start equal.
        x.grad = None
        for p in blocks.parameters():
            p.grad = None
        h = x
        for b in blocks:
            h = b(h)
        torch.cuda.synchronize()  # every copy to the host done
        held = torch.cuda.memory_allocated()
        h.square().mean().backward()
        return held, [p.grad.cpu() for p in (x, *blocks.parameters())]

    held_plain, grads_plain = held_and_grads()
    apply_activation_offloading(dict(blocks.named_children()), ActivationOffloading(every=2))
    held_offloaded, grads_offloaded = held_and_grads()
    for a, b in zip(grads_offloaded, grads_plain):
        assert torch.equal(a, b)
    # A block saves 8192 x (1024 + 4096 + 4096) fp32 values (288 MiB); 4 of the 8 move,
    # less block 0's input (the test's own x, 32 MiB, which stays referenced).
    moved = 4 * 288 * 2**20 - 32 * 2**20
    assert held_offloaded <= held_plain - moved, (held_offloaded, held_plain)
