"""``fvstep.parallel.compile_check``: compiled gradients checked against eager ones.

Laws: a compiled block whose backward is wrong is refused before training on it, with an
error naming the block, the parameter, the relative error and the tolerance (whatever
the activation checkpointing, on one process and on 2 ranks, also when only one rank's
compiled code is wrong: every rank raises, none hangs); a correct compiled block passes
and the check changes no number (a step with it is bitwise the step without it, with the
same compiled graphs, the same RNG state after, no ``.grad`` of its own, ``requires_grad``
as it was) and costs one all-reduce per checked block on a mesh, nothing else; each
``requires_grad`` pattern is checked once, grad-free calls never.

The wrong backward is injected with a ``torch.compile`` backend of our own: AOTAutograd
without a compiler (as ``aot_eager``) whose backward scales the gradients of one shape —
tiny Wan's ``scale_shift_table`` (1, 6, 16), as pytorch/pytorch#193061 did on an H200 —
by 3e4, so only the compiled path is wrong.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import fvstep as fs
from fvstep import parallel as fsp
from fvstep import tree
from fvstep.cli import main
from fvstep.methods import dmd2, finetune
from fvstep.models import synthetic_batch, tiny_wan
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.compile_check import DEFAULT_RTOLS, CompiledGradientError, default_rtol
from fvstep.parallel.compile_check_hooks import (
    compile_check_reports,
    install_compile_check,
    is_compiled_in_place,
)
from fvstep.parallel.gradient_comparison import compare_compiled_gradients
from fvstep.parallel.prepare import prepare
from fvstep.random import fold_in
from fvstep.testing import check_compiled_gradients

CPU_COMPILE = {"backend": "aot_eager"}
FACTOR = 3e4
TABLE_SHAPE = (1, 6, 16)  # tiny_wan's scale_shift_table (and its blocks' temb input)


def scaled_backward(shape: tuple[int, ...] = TABLE_SHAPE, factor: float = FACTOR) -> Any:
    """aot_eager, except that the backward multiplies the gradients of ``shape`` by ``factor``."""

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return make_boxed_func(gm.forward)

    def backward_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        run = make_boxed_func(gm.forward)

        def wrong(args: list[Any]) -> list[Any]:
            outs = run(args)
            return [
                o * factor if isinstance(o, torch.Tensor) and tuple(o.shape) == shape else o
                for o in outs
            ]

        wrong._boxed_call = True  # type: ignore[attr-defined]
        return wrong

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)


def _state(module: nn.Module) -> fs.TrainState:
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )


def _batch(i: int, rank: int = 0) -> dict[str, torch.Tensor]:
    return synthetic_batch(fold_in(fold_in(fs.random.key(7), i), rank), batch_size=2)


def _wan_inputs() -> dict[str, Any]:
    batch = synthetic_batch(fs.random.key(0), batch_size=1)
    return {
        "hidden_states": batch["latents"],
        "timestep": torch.full((1,), 500.0),
        "encoder_hidden_states": batch["text"],
        "return_dict": False,
    }


class Block(nn.Module):
    """A small residual block with a modulation input and (optionally) dropout."""

    def __init__(self, dim: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.gain = nn.Parameter(torch.ones(1, dim))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc(self.norm(x) * (1 + scale))) * self.gain


class Stack(nn.Module):
    def __init__(self, p: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList([Block(p=p) for _ in range(2)])

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale)
        return x


def _stack_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 8, generator=g)
    scale = torch.randn(4, 1, 8, generator=g).requires_grad_()
    return x, scale


# ------------------------------------------------------------------- one process


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_a_wrong_compiled_gradient_is_refused_naming_block_parameter_and_error(checkpointing):
    torch._dynamo.reset()
    module = prepare(
        tiny_wan(seed=0),
        checkpointing=checkpointing,
        compile={"backend": scaled_backward()},
        verify_compile=True,
    )
    state = _state(module)
    before = tree.clone(state.roles["student"].params)
    step = fs.compile(finetune())
    with pytest.raises(CompiledGradientError) as raised:
        step(state, _batch(0))
    message = str(raised.value)
    assert "blocks.0" in message and "scale_shift_table" in message, message
    assert "tolerance 0.001" in message and "3e+04" in message, message
    report = raised.value.report
    assert report is not None and report.block == "blocks.0" and report.precision == "fp32"
    wrong = {d.name for d in report.failures}
    assert wrong == {"scale_shift_table"}, wrong  # (temb is (2, 6, 16) at batch size 2)
    assert report.failures[0].relative_error == pytest.approx(FACTOR - 1, rel=1e-3)
    # Refused before any leaf changed, and the check left no gradient behind.
    tree.assert_trees_equal(state.roles["student"].params, before)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_a_correct_compiled_block_passes_and_the_check_changes_no_number(checkpointing):
    def train(verify: bool) -> tuple[fs.TrainState, int, torch.Tensor, nn.Module]:
        module = prepare(
            tiny_wan(seed=0),
            checkpointing=checkpointing,
            compile=CPU_COMPILE,
            verify_compile=verify,
        )
        state, graphs = _state(module), compile_counts()["graphs"]
        step = fs.compile(finetune(), accumulation=fs.Accumulation(2))
        for i in range(2):
            state, _ = step(state, _batch(i))
        return state, compile_counts()["graphs"] - graphs, torch.random.get_rng_state(), module

    torch._dynamo.reset()
    torch.manual_seed(0)
    checked, checked_graphs, checked_rng, module = train(True)
    torch.manual_seed(0)
    plain, plain_graphs, plain_rng, _ = train(False)
    tree.assert_trees_equal(checked.roles["student"].params, plain.roles["student"].params)
    tree.assert_trees_equal(checked.roles["student"].opt_state, plain.roles["student"].opt_state)
    # The check compiled the one graph training uses (all blocks share it), with the real
    # call's guards: the unchecked run after it finds it and compiles nothing.
    assert (checked_graphs, plain_graphs) == (1, 0)
    assert torch.equal(checked_rng, plain_rng)
    reports = compile_check_reports(module)
    assert [r.block for r in reports] == ["blocks.0", "blocks.1"]  # once, not per micro-batch
    assert all(r.passed and r.rtol == DEFAULT_RTOLS["fp32"] for r in reports)
    assert max(r.worst.relative_error for r in reports if r.worst) <= 1e-6


def test_the_check_leaves_no_state_behind_even_with_dropout():
    """Dropout draws from the global RNG: both runs of the check start from the caller's
    state, which the real call then finds untouched, so outputs, gradients and the RNG
    after are bitwise those of an unchecked run; no .grad is written by the check and no
    requires_grad changes."""

    def run(verify: bool) -> tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor, Any]:
        torch._dynamo.reset()
        stack = prepare(Stack(p=0.5), compile=CPU_COMPILE, verify_compile=verify)
        x, scale = _stack_inputs()
        flags = [p.requires_grad for p in stack.parameters()]
        torch.manual_seed(11)
        out = stack(x, scale)
        assert all(p.grad is None for p in stack.parameters())  # the check wrote none
        assert [p.requires_grad for p in stack.parameters()] == flags
        out.square().sum().backward()
        return out, [p.grad for p in stack.parameters()], torch.random.get_rng_state(), stack

    out, grads, rng, _ = run(False)
    out_checked, grads_checked, rng_checked, stack = run(True)
    assert torch.equal(out, out_checked) and torch.equal(rng, rng_checked)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_checked, strict=True))  # type: ignore[arg-type]
    assert [r.passed for r in compile_check_reports(stack)] == [True, True]


def test_each_requires_grad_pattern_is_checked_once_and_grad_free_calls_never():
    torch._dynamo.reset()
    stack = prepare(Stack(), compile=CPU_COMPILE, verify_compile=True)
    x, scale = _stack_inputs()
    with torch.no_grad():
        stack(x, scale)
    assert compile_check_reports(stack) == []
    stack(x, scale)
    stack(x, scale)
    assert len(compile_check_reports(stack)) == 2  # one per block
    stack.requires_grad_(False)  # another pattern: another graph, checked once too
    stack(x, scale)
    stack(x, scale)
    reports = compile_check_reports(stack)
    assert len(reports) == 4 and all(r.passed for r in reports)
    # In module order, each block's in the order checked: the frozen pattern second.
    assert [r.block for r in reports] == ["blocks.0", "blocks.0", "blocks.1", "blocks.1"]
    assert {d.name for d in reports[1].differences} == {"input scale"}  # only inputs now
    assert {d.name for d in reports[3].differences} == {"input x", "input scale"}
    stack(x, scale.detach())  # nothing requires grad: nothing to check
    assert len(compile_check_reports(stack)) == 4


def test_the_tolerance_is_stated_by_precision_and_can_be_given():
    assert DEFAULT_RTOLS == {"fp32": 1e-3, "tf32": 1e-2, "bf16": 0.1, "fp16": 0.1}
    assert default_rtol("bf16") == 0.1
    torch._dynamo.reset()
    stack = prepare(Stack(), compile=CPU_COMPILE, verify_compile=True)
    x, scale = _stack_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stack(x, scale)
    report = compile_check_reports(stack)[0]
    assert (report.precision, report.rtol) == ("bf16", 0.1)
    torch._dynamo.reset()
    mine = prepare(Stack(), compile=CPU_COMPILE, verify_compile=0.5)
    mine(x, scale)
    assert compile_check_reports(mine)[0].rtol == 0.5
    # A 2x error: within a tolerance of 2, not within the default.
    torch._dynamo.reset()
    lax = prepare(Stack(), compile={"backend": scaled_backward((1, 8), 2.0)}, verify_compile=2.0)
    lax(x, scale)
    with pytest.raises(CompiledGradientError, match=r"blocks\.0.*gain has relative error 1 > "):
        torch._dynamo.reset()
        strict = prepare(Stack(), compile={"backend": scaled_backward((1, 8), 2.0)})
        install_compile_check(strict.blocks[0], name="blocks.0", rtol=0.5)
        strict(x, scale)


def test_bad_options_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="needs compile"):
        prepare(Stack(), verify_compile=True)
    with pytest.raises(TypeError, match="verify_compile must be a bool or a tolerance"):
        prepare(Stack(), compile=CPU_COMPILE, verify_compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be positive"):
        prepare(Stack(), compile=CPU_COMPILE, verify_compile=-1.0)
    with pytest.raises(ValueError, match="not compiled in place"):
        install_compile_check(Block(), name="block")


# ------------------------------------------------------------------- fvstep.testing


def test_check_compiled_gradients_checks_a_users_module_and_leaves_it_as_it_was():
    torch._dynamo.reset()
    block, (x, scale) = Block(), _stack_inputs()
    reports = check_compiled_gradients(block, x, scale=scale, compiled=CPU_COMPILE)
    assert [r.block for r in reports] == ["Block"] and reports[0].passed
    names = {d.name for d in reports[0].differences}
    assert names == {"norm.weight", "norm.bias", "fc.weight", "fc.bias", "gain", "input scale"}
    assert not is_compiled_in_place(block) and all(p.grad is None for p in block.parameters())
    torch._dynamo.reset()
    with pytest.raises(CompiledGradientError, match=r"Block.*: gain has relative error 3e\+04"):
        check_compiled_gradients(block, x, scale, compiled={"backend": scaled_backward((1, 8))})
    assert not is_compiled_in_place(block)
    # A compiled callable of the caller's, compared with the module run eagerly.
    compiled = torch.compile(copy.deepcopy(block), backend=scaled_backward((1, 8)))
    report = compare_compiled_gradients(block, compiled, (x, scale), params={})
    assert report.passed and [d.name for d in report.differences] == ["input scale"]
    with pytest.raises(CompiledGradientError, match="input scale has relative error"):
        check_compiled_gradients(
            block, x, scale, compiled=torch.compile(block, backend=scaled_backward((4, 1, 8)))
        )


def test_check_compiled_gradients_checks_a_prepared_role_block_by_block():
    torch._dynamo.reset()
    student = prepare(tiny_wan(seed=0), checkpointing="full", compile=CPU_COMPILE)
    reports = check_compiled_gradients(student, **_wan_inputs())
    assert [r.block for r in reports] == ["blocks.0", "blocks.1"]
    assert all(r.passed for r in reports)
    assert "input temb" in {d.name for d in reports[0].differences}
    assert all(p.grad is None for p in student.parameters())
    torch._dynamo.reset()
    wrong = prepare(tiny_wan(seed=0), compile={"backend": scaled_backward()})
    with pytest.raises(CompiledGradientError, match=r"blocks\.0.*scale_shift_table"):
        check_compiled_gradients(wrong, **_wan_inputs())


@pytest.mark.heavy
def test_dmd2_with_three_checked_roles_is_bitwise_the_unchecked_run():
    """Features together: DMD2 (student, frozen bf16 teacher, critic), selective AC,
    compile, verify_compile on every role: bitwise the unchecked run, the same graphs;
    the trained roles are checked once each, the teacher (read without grad) never."""

    def run(verify: bool) -> tuple[fs.TrainState, int]:
        options = {"checkpointing": "selective", "compile": CPU_COMPILE, "verify_compile": verify}
        adamw = fs.optim.adamw(lr=1e-3)
        state = fs.TrainState.create(
            {
                "student": fs.Role(prepare(tiny_wan(seed=0), **options), optimizer=adamw),
                "teacher": fs.Role(prepare(tiny_wan(seed=1), trainable=False, **options)),
                "critic": fs.Role(prepare(tiny_wan(seed=2), **options), optimizer=adamw),
            },
            key=fs.random.key(5),
        )
        step = fs.compile(
            dmd2(generator_update_interval=2, ordering="sequential"),
            accumulation=fs.Accumulation(2),
        )
        graphs = compile_counts()["graphs"]
        for i in range(3):
            state, _ = step(state, _batch(i))
        return state, compile_counts()["graphs"] - graphs

    torch._dynamo.reset()
    checked, checked_graphs = run(True)
    torch._dynamo.reset()
    plain, plain_graphs = run(False)
    for role in ("student", "critic"):
        tree.assert_trees_equal(checked.roles[role].params, plain.roles[role].params)
        reports = compile_check_reports(checked.module(role))
        assert [(r.block, r.passed) for r in reports] == [("blocks.0", True), ("blocks.1", True)]
    assert compile_check_reports(checked.module("teacher")) == []
    assert checked_graphs == plain_graphs


@pytest.mark.heavy
def test_inductor_on_cpu_gives_the_eager_gradients_of_a_tiny_wan_block():
    """Inductor itself (prepare's defaults, with SAFE_INDUCTOR_OPTIONS) on a tiny Wan
    block: fp32 relative errors of ~1e-7 measured, far within 1e-3 (about a minute of
    compile on a 2-core CPU, hence heavy)."""
    torch._dynamo.reset()
    student = prepare(tiny_wan(seed=0, num_layers=1), compile=True)
    (report,) = check_compiled_gradients(student, **_wan_inputs())
    assert report.passed and report.worst is not None and report.worst.relative_error < 1e-5


# ------------------------------------------------------------------- the command line


def probe(backend: Any = "aot_eager") -> tuple[nn.Module, tuple, dict]:
    """``fvstep verify-compile tests.test_compile_check:probe``'s factory."""
    torch._dynamo.reset()
    return prepare(tiny_wan(seed=0), compile={"backend": backend}), (), _wan_inputs()


def wrong_probe() -> tuple[nn.Module, tuple, dict]:
    return probe(scaled_backward())


def test_verify_compile_on_the_command_line(capsys):
    assert main(["verify-compile", "tests.test_compile_check:probe"]) == 0
    out = capsys.readouterr().out
    assert "compiled gradients match eager ones" in out and "blocks.1: worst" in out, out
    assert main(["verify-compile", "tests.test_compile_check:wrong_probe"]) == 1
    out = capsys.readouterr().out
    assert "compiled gradients are WRONG" in out and "scale_shift_table" in out, out
    assert main(["verify-compile", "tests.test_compile_check:_wan_inputs"]) == 2
    assert "must return (module, args)" in capsys.readouterr().err


# ----------------------------------------------------------------------- two ranks


COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
    "all_to_all_single",
    "barrier",
)


@contextlib.contextmanager
def count_collectives() -> Any:
    """Counts torch.distributed's collectives by name (FSDP2 calls them through
    ``torch.distributed``; a TorchDispatchMode would stop torch.compile from compiling)."""
    import torch.distributed as dist

    counts: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def check_verified_training_is_bitwise_on_two_ranks(rank: int, world_size: int) -> dict:
    mesh = fsp.make_mesh(device_type="cpu")

    def train(verify: bool) -> tuple[fs.TrainState, dict, list]:
        module = prepare(
            tiny_wan(seed=0),
            mesh=mesh,
            checkpointing="full",
            compile=CPU_COMPILE,
            verify_compile=verify,
        )
        state = _state(module)
        step = fs.compile(finetune(), accumulation=fs.Accumulation(2))
        with count_collectives() as counts:  # one step of 2 micro-batches: checked once
            state, _ = step(state, _batch(0, rank), parallelism=fsp.Layout())
        assert fsp.unrested_modules(state) == []
        return state, dict(counts), compile_check_reports(module)

    torch._dynamo.reset()  # the pool's ranks run other tests too
    checked, checked_counts, reports = train(True)
    plain, plain_counts, _ = train(False)  # reuses the graphs the checked run compiled
    tree.assert_trees_equal(checked.roles["student"].params, plain.roles["student"].params)
    return {
        "plain": plain_counts,
        "checked": checked_counts,
        "reports": [(r.block, r.passed) for r in reports],
    }


@pytest.mark.multirank
def test_on_two_ranks_the_check_changes_no_number_and_adds_one_all_reduce_per_block(ranks):
    """FSDP2-sharded blocks on 2 gloo ranks, full AC, compile: the check runs inside the
    block's call (parameters gathered), the step is bitwise the unchecked one, and the
    only collectives it adds are one all-reduce of one number per checked block."""
    for result in ranks.run(check_verified_training_is_bitwise_on_two_ranks):
        assert result["reports"] == [("blocks.0", True), ("blocks.1", True)]
        plain, checked = result["plain"], result["checked"]
        assert checked.get("all_reduce", 0) - plain.get("all_reduce", 0) == 2, result
        others = {k for k in {*plain, *checked} if k != "all_reduce"}
        assert {k: checked.get(k) for k in others} == {k: plain.get(k) for k in others}, result


def check_a_wrong_rank_stops_every_rank(rank: int, world_size: int, wrong_ranks: list) -> str:
    torch._dynamo.reset()
    mesh = fsp.make_mesh(device_type="cpu")
    backend = scaled_backward() if rank in wrong_ranks else "aot_eager"
    module = prepare(tiny_wan(seed=0), mesh=mesh, compile={"backend": backend}, verify_compile=True)
    step = fs.compile(finetune())
    try:
        step(_state(module), _batch(0, rank), parallelism=fsp.Layout())
    except CompiledGradientError as e:
        return str(e)
    return "trained"


@pytest.mark.multirank
def test_on_two_ranks_a_wrong_gradient_on_one_rank_stops_both(ranks):
    mine, other = ranks.run(check_a_wrong_rank_stops_every_rank, [0])
    assert "blocks.0" in mine and "scale_shift_table has relative error 3e+04" in mine, mine
    assert "blocks.0" in other and "on another rank" in other, other


class NormBlock(nn.Module):
    """A block whose forward writes its own buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class NormStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([NormBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_the_check_puts_back_the_buffers_a_forward_writes():
    """BatchNorm's running statistics and counter after a checked step are those of an
    unchecked one (the check's two runs would otherwise update them twice more)."""

    def run(verify: bool) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        stack = prepare(NormStack(), compile=CPU_COMPILE, verify_compile=verify)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
        stack(x).square().sum().backward()
        return {k: v.clone() for k, v in stack.state_dict().items()}

    unchecked, checked = run(False), run(True)
    assert checked["blocks.0.bn.num_batches_tracked"].item() == 1
    assert all(torch.equal(unchecked[k], checked[k]) for k in unchecked), [
        k for k in unchecked if not torch.equal(unchecked[k], checked[k])
    ]


def test_a_lora_bases_check_compares_the_adapters_gradients_and_refuses_a_wrong_one():
    """The adapters live in their LoRA role, outside the base's module tree, but compute
    inside its blocks: their gradients are compared (block 0 of a frozen base has no
    other gradient at all), and a wrong one is refused, naming the adapter."""
    peft = pytest.importorskip("peft")
    from fvstep.lora import add_adapters

    def lora_state(backend: Any) -> fs.TrainState:
        torch._dynamo.reset()
        base = tiny_wan(seed=0)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=False
        )
        student = add_adapters(base, {"student": config})["student"]
        prepare(
            base,
            trainable=False,
            frozen_dtype=None,
            compile={"backend": backend},
            verify_compile=True,
        )
        return fs.TrainState.create(
            {
                "student": fs.Role(student, optimizer=fs.optim.adamw(lr=1e-3)),
                "base": fs.Role(base, save_frozen=False),
            },
            key=fs.random.key(0),
        )

    step = fs.compile(finetune())
    batch = synthetic_batch(fs.random.key(1), batch_size=2)
    state = lora_state("aot_eager")
    state, _ = step(state, batch)
    reports = compile_check_reports(state.roles["base"].role.module)
    assert [r.block for r in reports] == ["blocks.0", "blocks.1"] and all(r.passed for r in reports)
    assert "attn1.to_q.lora_A.student.weight" in [d.name for d in reports[0].differences]

    state = lora_state(scaled_backward(shape=(4, 16)))  # lora_A: (r, in_features)
    with pytest.raises(CompiledGradientError, match=r"blocks\.0 .*lora_A\.student\.weight"):
        step(state, batch)
