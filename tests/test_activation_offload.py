"""Activation offloading (``prepare(offload_activations=...)``): what it hooks, what it
refuses, and that it changes no number.

On a CPU nothing moves (the hooks keep every tensor where it is), so the CPU tests check
the wiring: which blocks are hooked, that names and checkpoint keys do not change, that a
step through the hooks (eager, compiled, checkpointed) is bitwise the plain one, and that
compiling around them breaks no graph. The bookkeeping around the copies (versions, one
copy per saved tensor, the copies back one block ahead) is checked on a CPU through a
stand-in for the CUDA copies (``_HostCopies``). The CUDA tests (run on the GPU machine,
results in ``docs/gpu.md``) check that tensors do move, under Inductor too, and that the
step stays bitwise the same while the device holds less.
"""

from __future__ import annotations

import pytest
import torch

import fvstep as fs
from fvstep.core import tree
from fvstep.methods import finetune
from fvstep.methods.models import synthetic_batch, tiny_wan
from fvstep.parallel import ActivationOffloading
from fvstep.parallel.activation_offload import (
    apply_activation_offloading,
    is_offloaded,
    offloaded_bytes,
    resolve_offloading,
)
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.mesh import block_names
from fvstep.parallel.prepare import preparation, prepare

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
    with pytest.raises(ValueError, match="every must be >= 1"):
        ActivationOffloading(every=0)
    with pytest.raises(TypeError, match="min_bytes must be an integer"):
        ActivationOffloading(min_bytes=1.5)
    with pytest.raises(TypeError, match="offload_activations must be a bool"):
        resolve_offloading(2)  # type: ignore[arg-type]
    module = tiny_wan()
    blocks = dict(module.blocks.named_children())
    assert apply_activation_offloading(blocks, ActivationOffloading(every=2)) == ("0",)
    with pytest.raises(ValueError, match="applied to .* already"):
        apply_activation_offloading(blocks, ActivationOffloading())


def test_only_plain_contiguous_cuda_tensors_of_min_bytes_are_movable():
    from fvstep.parallel.activation_offload import CudaCopies

    copies = CudaCopies()
    assert not copies.movable(torch.zeros(1024), 1)  # a CPU tensor stays
    if CUDA:
        x = torch.zeros(64, 64, device="cuda")
        assert copies.movable(x, 1) and not copies.movable(x, x.numel() * 4 + 1)
        assert not copies.movable(x.t(), 1) and not copies.movable(torch.nn.Parameter(x), 1)


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


class _HostCopies:
    """The CUDA copies' stand-in on a CPU: every tensor of ``min_bytes`` or more moves (a
    clone), and each copy is logged, so the bookkeeping around the copies (versions, one
    copy per tensor, the prefetch one block ahead) is checked without a GPU."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.owner: dict[int, str] = {}  # id of a host copy -> the block that moved it

    def movable(self, t: torch.Tensor, min_bytes: int) -> bool:
        return (
            type(t) is torch.Tensor
            and t.is_contiguous()  # as the CUDA copies: a clone would change the strides
            and t.numel() * t.element_size() >= min_bytes
        )

    def out(self, t):
        host = t.detach().clone()
        self.log.append(("out", id(host)))
        return host, None

    def back(self, host, device, done):
        self.log.append(("back", self.owner.get(id(host))))
        return host.clone(), None

    def ready(self, back, arrived):
        return back


def _hooked(blocks: torch.nn.ModuleList, offload: ActivationOffloading, copies: _HostCopies):
    from fvstep.parallel.activation_offload import _install, _Offloader

    offloader = _Offloader(offload.min_bytes, copies)
    for i, block in enumerate(blocks):
        _install(block, offloader, offload.chooses(i))
    return offloader


def _mlp_blocks(n: int) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        for _ in range(n)
    )


def test_moved_tensors_come_back_one_block_ahead_and_the_gradients_stay_bitwise():
    plain, moved = _mlp_blocks(4), _mlp_blocks(4)
    log: list = []
    copies = _HostCopies(log)
    offloader = _hooked(moved, ActivationOffloading(every=2, min_bytes=1), copies)
    for i, block in enumerate(moved):
        block.register_forward_hook(
            lambda m, a, o, i=i: copies.owner.update(
                {
                    hid: f"block {i}"
                    for kind, hid in log
                    if kind == "out" and hid not in copies.owner
                }
            )
        )
        block.register_full_backward_pre_hook(lambda m, g, i=i: log.append(("backward", i)))
    x = torch.randn(5, 8, requires_grad=True)
    for blocks in (plain, moved):
        h = x
        for b in blocks:
            h = b(h)
        h.square().sum().backward()
    for p, q in zip(plain.parameters(), moved.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert offloader.moved_bytes > 0
    assert any(kind == "out" for kind, _ in log)
    events = [e for e in log if e[0] != "out"]
    runs = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    # block 2 comes back when block 3's backward starts, block 0 when block 1's does
    assert runs == [
        ("backward", 3),
        ("back", "block 2"),
        ("backward", 2),
        ("backward", 1),
        ("back", "block 0"),
        ("backward", 0),
    ], events


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_blocks_move_what_they_save_and_train_bitwise_as_unhooked_ones(backend):
    """Around compiled blocks, the bookkeeping runs as Python: a trace of it read tensor
    versions as constants and raised a false in-place error under Inductor."""
    module = prepare(tiny_wan(seed=0, num_layers=2), compile={"backend": backend})
    offloader = _hooked(module.blocks, ActivationOffloading(every=1, min_bytes=1), _HostCopies([]))
    trained = _train(_state(module), 2)
    assert offloader.moved_bytes > 0
    reference = _train(
        _state(prepare(tiny_wan(seed=0, num_layers=2), compile={"backend": backend})), 2
    )
    tree.assert_trees_equal(trained.roles["student"].params, reference.roles["student"].params)


class _SavesTwice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # mul saves x twice


@pytest.mark.parametrize(
    "where",
    [
        "inside-the-forward",
        "after-it-by-the-caller",
        "after-it-through-a-detached-output",
        "after-it-by-the-caller-compiled",
        "nowhere-compiled",
    ],
)
def test_a_moved_tensor_changed_in_place_raises_autograds_error(where):
    """A saved tensor's memory may outlive the object that was saved: an eager block may
    return ``z.detach()``, and a compiled function (``aot_eager``) saves a separate
    object sharing the memory and version counter of the ``z`` it returns. The block's
    outputs are watched as the saved tensor (found by the review)."""

    class ChangesItsSaved(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            z = torch.sigmoid(x * 1.0)  # sigmoid saves its output
            if where == "inside-the-forward":
                z.mul_(2.0)
            return z * 1.0, (z.detach() if "detached" in where else z)

    blocks = torch.nn.ModuleList([ChangesItsSaved()])
    if where.endswith("compiled"):
        blocks[0].compile(backend="aot_eager", fullgraph=True, dynamic=False)
    log: list = []
    _hooked(blocks, ActivationOffloading(min_bytes=1), _HostCopies(log))
    out, z = blocks[0](torch.randn(3, requires_grad=True))
    assert log  # z moved
    if where.startswith("after-it"):
        z.add_(1.0)
    if where == "nowhere-compiled":
        out.sum().backward()  # and no false error
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_every_output_over_a_moved_tensors_memory_is_watched():
    """Two outputs of one layout over a saved tensor's memory: a change through either is
    seen (the review found only the last one watched)."""

    class TwoAliases(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            z = torch.sigmoid(x * 1.0)  # sigmoid saves its output
            return z * 1.0, z.detach(), z.data  # .data: a version counter of its own

    blocks = torch.nn.ModuleList([TwoAliases()])
    _hooked(blocks, ActivationOffloading(min_bytes=1), _HostCopies([]))
    out, first, _ = blocks[0](torch.randn(3, requires_grad=True))
    first.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_tensor_saved_again_after_an_in_place_change_is_a_second_copy():
    """As plain autograd: the first save is stale (an error only if its backward runs)."""

    class SavesBeforeAndAfter(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = x * 1.0
            unused = h.sin()  # saves h at version 0
            h.mul_(2.0)
            return h.cos(), unused  # saves h at version 1

    log: list = []
    blocks = torch.nn.ModuleList([SavesBeforeAndAfter()])
    _hooked(blocks, ActivationOffloading(min_bytes=1), _HostCopies(log))
    x = torch.randn(4, requires_grad=True)
    used, _ = blocks[0](x)
    used.sum().backward()
    assert [e[0] for e in log].count("out") == 2
    assert torch.equal(x.grad, -torch.sin(2 * x.detach()) * 2)


def test_a_graph_kept_from_an_earlier_backward_is_not_brought_back():
    log: list = []
    blocks = _mlp_blocks(4)
    _hooked(blocks, ActivationOffloading(min_bytes=1), _HostCopies(log))

    def loss(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b(x)
        return x.square().sum()

    kept = loss(torch.randn(3, 8))
    kept.backward(retain_graph=True)  # its graph stays alive, its backward ran
    log.clear()
    loss(torch.randn(3, 8)).backward()
    kinds = [e[0] for e in log]
    assert kinds.count("back") == kinds.count("out") > 0, log


def test_a_tensor_saved_twice_moves_once():
    log: list = []
    blocks = torch.nn.ModuleList([_SavesTwice()])
    _hooked(blocks, ActivationOffloading(min_bytes=1), _HostCopies(log))
    x = torch.randn(4, requires_grad=True)
    blocks[0](x).sum().backward()
    assert [e[0] for e in log] == ["out", "back"]
    assert torch.equal(x.grad, 2 * x.detach())


def test_no_grad_calls_move_nothing_and_compute_as_the_plain_blocks():
    log: list = []
    blocks, plain = _mlp_blocks(2), _mlp_blocks(2)
    _hooked(blocks, ActivationOffloading(min_bytes=1), _HostCopies(log))
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        out, ref = blocks[1](blocks[0](x)), plain[1](plain[0](x))
    assert log == [] and torch.equal(out, ref)
    blocks[1](blocks[0](x))  # with grad, the same call moves what it saves
    assert log


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
