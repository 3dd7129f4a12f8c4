"""``fvstep.parallel.prepare``: activation checkpointing, compile, FSDP2, frozen roles.

Laws: the options change neither parameter names nor checkpoint keys (a checkpoint saved
with them loads without them and vice versa, leaf-exact); activation checkpointing
changes no number (a step of prepared roles is bitwise the step of plain ones, on one
process and against the hand-written FSDP2 loop on 2 ranks: recomputation runs the same
kernels on the same inputs); compile changes numbers only by summation order (AOTAutograd
traces its own backward, whose reductions, e.g. a bias gradient summed over a 3-D
tensor's two leading dims at once, may associate differently from eager autograd's), so
it is compared within 1e-6; compiled blocks share a bounded number of graphs however
many steps run.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import fvstep as fs
from benchmarks.reference import dmd2_loop, shard_by_hand
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.core._compat import TorchDispatchMode
from fvstep.core.random import fold_in
from fvstep.methods import dmd2, finetune
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.parallel.activation_checkpoint import (
    ATTENTION_SAVE_OPS,
    ActivationCheckpointing,
    is_checkpointed,
    resolve_checkpointing,
)
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.mesh import block_names
from fvstep.parallel.prepare import preparation, prepare

CPU_COMPILE = {"backend": "aot_eager"}  # dynamo + AOTAutograd, no C++ toolchain needed


def _finetune_state(module: torch.nn.Module) -> fs.TrainState:
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.1))},
        key=fs.random.key(0),
    )


def _train(state: fs.TrainState, num_steps: int) -> fs.TrainState:
    step = fs.compile(finetune(), clip=fs.clip_grad_norm(1.0))
    for i in range(num_steps):
        state, _ = step(state, synthetic_batch(fs.random.key(i), batch_size=2))
    return state


@pytest.mark.parametrize("checkpointing", ["none", "full", "narrow"])
def test_one_process_param_dtype_trains_as_a_step_under_autocast(checkpointing):
    # The benchmarks' one-process path wraps the whole step in torch.autocast(bf16); a role
    # prepared with param_dtype on one process must compute exactly that, fp32 masters kept.
    by_hand = _finetune_state(prepare(tiny_wan(seed=0), checkpointing=checkpointing))
    ours = _finetune_state(
        prepare(tiny_wan(seed=0), checkpointing=checkpointing, param_dtype=torch.bfloat16)
    )
    step = fs.compile(finetune(), clip=fs.clip_grad_norm(1.0))
    for i in range(3):
        batch = synthetic_batch(fs.random.key(i), batch_size=2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            by_hand, expected = step(by_hand, batch)
        ours, got = step(ours, batch)
        assert got["student/loss"] == expected["student/loss"]
    tree.assert_trees_equal(ours, by_hand, check_static=False)
    assert all(p.dtype == torch.float32 for p in ours.roles["student"].params.values())
    assert not torch.is_autocast_enabled("cpu")  # the role's autocast ended with its forward
    plain = _train(_finetune_state(tiny_wan(seed=0)), 3)
    with pytest.raises(AssertionError):  # bf16 compute did change the numbers
        tree.assert_trees_equal(plain, ours)


CHECKPOINTINGS = [
    "none",
    "full",
    "selective",
    "attention",
    "narrow",
    ActivationCheckpointing("full", every=2),
    ActivationCheckpointing("selective", every=3),
]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("checkpointing", CHECKPOINTINGS, ids=str)
def test_parameter_names_and_state_dict_keys_do_not_change(checkpointing, compile):
    plain = tiny_wan(seed=0, num_layers=3)
    prepared = prepare(
        tiny_wan(seed=0, num_layers=3),
        checkpointing=checkpointing,
        compile=CPU_COMPILE if compile else False,
    )
    assert [n for n, _ in prepared.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(prepared.state_dict()) == list(plain.state_dict())
    ac = checkpointing if isinstance(checkpointing, ActivationCheckpointing) else None
    every = ac.every if ac else 1
    mode = ac.mode if ac else checkpointing
    expected = [] if mode == "none" else [f"blocks.{i}" for i in range(0, 3, every)]
    assert list(preparation(prepared).checkpointed_blocks) == expected
    assert [n for n in block_names(prepared) if is_checkpointed(prepared.get_submodule(n))] == (
        expected
    )


@pytest.mark.parametrize(
    ("checkpointing", "compile"),
    [
        ("full", False),
        ("selective", False),
        ("attention", False),
        (ActivationCheckpointing("full", every=2), False),
        ("selective", True),
    ],
    ids=["full", "selective", "attention", "full-every-2", "selective+compile"],
)
def test_a_prepared_role_trains_bitwise_as_the_plain_one(checkpointing, compile):
    plain = _train(_finetune_state(tiny_wan(seed=0, num_layers=3)), 3)
    prepared = prepare(
        tiny_wan(seed=0, num_layers=3),
        checkpointing=checkpointing,
        compile=CPU_COMPILE if compile else False,
    )
    trained = _train(_finetune_state(prepared), 3)
    if compile:  # summation order only (module docstring)
        tree.assert_trees_close(
            trained.roles["student"].params, plain.roles["student"].params, rtol=0, atol=1e-6
        )
    else:
        tree.assert_trees_equal(trained.roles["student"].params, plain.roles["student"].params)
        tree.assert_trees_equal(
            trained.roles["student"].opt_state, plain.roles["student"].opt_state
        )


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0
        self.attention = 0
        self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_SAVE_OPS or func.overloadpacket in ATTENTION_SAVE_OPS:
            self.attention += 1
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        else:
            self.others += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> tuple[int, int]:
    module = prepare(tiny_wan(seed=0), checkpointing=mode)
    batch = synthetic_batch(fs.random.key(0), batch_size=2)
    out = predict(module, batch["latents"], torch.full((2,), 500.0), batch["text"]).sum()
    with _OpCounter() as counter:
        out.backward()
    return counter.matmuls, counter.others


def test_selective_checkpointing_recomputes_everything_but_matmuls_and_attention():
    """In backward: full AC re-runs the blocks' matmuls, selective AC does not (it saved
    their outputs) but re-runs the rest (norms, activations, element-wise ops)."""
    none, selective, full = (_backward_ops(m) for m in ("none", "selective", "full"))
    assert full[0] > selective[0] == none[0], (none, selective, full)
    assert selective[1] > none[1], (none, selective, full)


def test_attention_checkpointing_recomputes_the_matmuls_but_not_the_attention():
    """``"attention"`` keeps only the attention kernels' outputs: backward re-runs the
    matmuls (as full AC does) but not the attention kernel (as selective AC does not)."""

    def attention_calls(mode: str) -> int:
        module = prepare(tiny_wan(seed=0), checkpointing=mode)
        batch = synthetic_batch(fs.random.key(0), batch_size=2)
        out = predict(module, batch["latents"], torch.full((2,), 500.0), batch["text"]).sum()
        with _OpCounter() as counter:
            out.backward()
        return counter.attention

    none, attention, full = (_backward_ops(m) for m in ("none", "attention", "full"))
    assert attention[0] > none[0], (none, attention, full)  # the matmuls re-run
    assert attention_calls("attention") == attention_calls("none") < attention_calls("full")
    assert resolve_checkpointing("attention").save_ops == ATTENTION_SAVE_OPS


def test_narrow_checkpointing_recomputes_only_the_matmuls_that_widen_their_input():
    """``"narrow"`` keeps attention and the matmuls that do not widen their input: backward
    re-runs fewer matmuls than full AC but more than selective (the feed-forward
    up-projections), and it trains bitwise as the plain role."""
    none, narrow, selective, full = (
        _backward_ops(m) for m in ("none", "narrow", "selective", "full")
    )
    assert selective[0] == none[0] < narrow[0] < full[0], (none, narrow, selective, full)
    assert not resolve_checkpointing("narrow").save_widening
    plain = _train(_finetune_state(tiny_wan(seed=0, num_layers=3)), 2)
    trained = _train(
        _finetune_state(prepare(tiny_wan(seed=0, num_layers=3), checkpointing="narrow")), 2
    )
    tree.assert_trees_equal(trained.roles["student"].params, plain.roles["student"].params)


def test_a_checkpoint_saved_with_the_options_loads_without_them_and_back(tmp_path):
    def build(options: bool) -> fs.TrainState:
        module = tiny_wan(seed=0)
        if options:
            module = prepare(module, checkpointing="selective", compile=CPU_COMPILE)
        return _finetune_state(module)

    with_options = _train(build(True), 2)
    fs.checkpoint.save(with_options, tmp_path / "a")
    loaded = fs.checkpoint.load(tmp_path / "a", like=build(False))
    tree.assert_trees_equal(loaded, with_options, check_static=False)

    without = _train(build(False), 1)
    fs.checkpoint.save(without, tmp_path / "b")
    back = fs.checkpoint.load(tmp_path / "b", like=build(True))
    tree.assert_trees_equal(back, without, check_static=False)
    _train(back, 1)  # and it trains on


def test_a_frozen_role_is_held_in_bf16_without_gradients_and_serves_fp32_callers():
    teacher = prepare(tiny_wan(seed=1), trainable=False)
    keep = tiny_wan()._keep_in_fp32_modules  # diffusers' list: rope, time_embedder, norms...
    dtypes = {n: p.dtype for n, p in teacher.named_parameters()}
    kept = {n for n in dtypes if any(k in n.split(".") for k in keep)}
    assert kept and all(dtypes[n] == torch.float32 for n in kept)
    assert {dtypes[n] for n in set(dtypes) - kept} == {torch.bfloat16}
    # described by the dtype of most of its elements, not of its first parameter (fp32)
    assert dtypes[next(iter(dtypes))] == torch.float32
    assert preparation(teacher).describe()["storage_dtype"] == "bfloat16"
    assert not any(p.requires_grad for p in teacher.parameters())
    batch = synthetic_batch(fs.random.key(0), batch_size=2)
    t = torch.full((2,), 500.0)
    out = predict(teacher, batch["latents"], t, batch["text"])
    assert out.dtype == torch.float32
    full = predict(tiny_wan(seed=1), batch["latents"], t, batch["text"])
    torch.testing.assert_close(out, full, rtol=0.05, atol=0.05)  # bf16 weights
    # The timestep is not rounded to bf16 (999 and 1000 are one bf16 value apart of 4):
    late = [
        predict(teacher, batch["latents"], torch.full((2,), v), batch["text"])
        for v in (999.0, 1000.0)
    ]
    assert not torch.equal(*late)

    state = fs.TrainState.create(
        {
            "student": fs.Role(tiny_wan(seed=0), optimizer=fs.optim.adamw(lr=1e-3)),
            "teacher": fs.Role(teacher),
            "critic": fs.Role(tiny_wan(seed=2), optimizer=fs.optim.adamw(lr=1e-3)),
        },
        key=fs.random.key(0),
    )
    before = tree.clone(state.roles["teacher"].params)
    step = fs.compile(dmd2(generator_update_interval=1))
    state, metrics = step(state, batch)
    assert torch.isfinite(metrics["student/loss"]) and torch.isfinite(metrics["critic/loss"])
    tree.assert_trees_equal(state.roles["teacher"].params, before)
    assert state.roles["teacher"].opt_state is None


@pytest.mark.filterwarnings("ignore:Attention backends are an experimental feature")
def test_the_attention_backend_is_set_and_recorded():
    module = prepare(tiny_wan(seed=0), attention_backend="_native_math")
    assert preparation(module).describe()["attention_backend"] == "_native_math"
    backends = {
        getattr(m.processor._attention_backend, "value", None)
        for m in module.modules()
        if hasattr(m, "processor")
    }
    assert backends == {"_native_math"}, backends
    assert {
        getattr(m.processor, "_attention_backend", None)
        for m in tiny_wan(seed=0).modules()
        if hasattr(m, "processor")
    } == {None}


@pytest.mark.filterwarnings("ignore:Attention backends are an experimental feature")
def test_a_roles_attention_backend_leaves_every_other_models_as_it_was():
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q = torch.randn(1, 6, 2, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    before = dispatch_attention_fn(q, q, q, attn_mask=mask)  # the process default
    # diffusers' setter would make "_native_flash" the default, which refuses masks (a
    # causal role's processors, which have no backend of their own, failed on it)
    prepare(tiny_wan(seed=0), attention_backend="_native_flash")
    torch.testing.assert_close(dispatch_attention_fn(q, q, q, attn_mask=mask), before)


def test_bad_options_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="mode must be"):
        ActivationCheckpointing("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every must be"):
        ActivationCheckpointing("full", every=0)
    with pytest.raises(TypeError, match="checkpointing must be"):
        prepare(tiny_wan(), checkpointing=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compile must be"):
        prepare(tiny_wan(), compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a mesh"):
        prepare(tiny_wan(), offload=True)
    with pytest.raises(ValueError, match="no blocks"):
        prepare(torch.nn.Linear(2, 2), checkpointing="full")
    with pytest.raises(ValueError, match="set_attention_backend"):
        prepare(torch.nn.Linear(2, 2), attention_backend="native")
    once = prepare(tiny_wan())
    with pytest.raises(ValueError, match="prepared already"):
        prepare(once)


# ----------------------------------------------------------------------- two ranks


def check_prepared_dmd2_is_bitwise_the_hand_written_loop(rank: int, world_size: int):
    mesh = fsp.make_mesh(device_type="cpu")
    plain = {"student": tiny_wan(seed=0), "teacher": tiny_wan(seed=1), "critic": tiny_wan(seed=2)}
    ref = {r: shard_by_hand(copy.deepcopy(m), mesh) for r, m in plain.items()}
    ref["teacher"].requires_grad_(False)
    options = {"mesh": mesh, "checkpointing": "selective", "compile": CPU_COMPILE}
    adamw = fs.optim.adamw(lr=1e-3, weight_decay=0.1)
    state = fs.TrainState.create(
        {
            "student": fs.Role(prepare(plain["student"], **options), optimizer=adamw),
            "teacher": fs.Role(
                prepare(plain["teacher"], trainable=False, frozen_dtype=None, **options)
            ),
            "critic": fs.Role(prepare(plain["critic"], **options), optimizer=adamw),
        },
        key=fs.random.key(5),
    )
    step = fs.compile(
        dmd2(generator_update_interval=2, ordering="sequential"),
        accumulation=fs.Accumulation(2),
        clip=fs.clip_grad_norm(1.0),
    )

    def batch_at(i: int) -> dict:
        return synthetic_batch(fold_in(fold_in(fs.random.key(99), i), rank), batch_size=4)

    graphs, before = [], compile_counts()["graphs"]  # dynamo's counters are per process
    for i in range(4):
        state, _ = step(state, batch_at(i), parallelism=fsp.Layout())
        graphs.append(compile_counts()["graphs"] - before)
        assert fsp.unrested_modules(state) == []
    dmd2_loop(
        ref,
        batch_at,
        num_steps=4,
        microbatches_per_step=2,
        ordering="sequential",
        generator_update_interval=2,
        rank=rank,
        base_key=fs.random.key(5),
        lr=1e-3,
        weight_decay=0.1,
        max_norm=1.0,
    )
    for role, module in ref.items():  # compiled: summation order only (module docstring)
        tree.assert_trees_close(
            state.roles[role].params, dict(module.named_parameters()), rtol=0, atol=1e-6
        )
    assert preparation(state.module("student")).describe()["mesh"] == {"shard": world_size}
    return graphs


@pytest.mark.multirank
def test_prepared_roles_on_two_ranks_match_the_hand_written_fsdp2_loop(ranks):
    """Selective AC + compile per block + FSDP2 on all three DMD2 roles, 4 steps of
    2 micro-batches: every parameter of every role equals the plain hand-written loop's
    (within 1e-6: compile's summation order; bitwise on torch 2.13 when measured);
    the compiled blocks of all roles share at most 3 graphs (grad mode x requires_grad),
    all compiled by the first step that reads each pattern, none afterwards."""
    for graphs in ranks.run(check_prepared_dmd2_is_bitwise_the_hand_written_loop, timeout=600):
        assert 1 <= graphs[-1] <= 3, graphs
        # Steps 0 (student + critic) and 1 (critic only) read every pattern: none after.
        assert graphs[2:] == [graphs[1]] * 2, graphs


def test_inductor_compiles_without_the_pass_that_breaks_wan_gradients():
    """pytorch/pytorch#193061: Inductor's mix-order reduction gave Wan's scale_shift_table
    gradients ~9000x off on an H200 at 32,760 tokens (docs/gpu.md); prepare turns it off
    for Inductor unless the caller's options say otherwise."""
    from fvstep.parallel.block_compile import SAFE_INDUCTOR_OPTIONS, resolve_compile_options

    assert SAFE_INDUCTOR_OPTIONS == {"triton.mix_order_reduction": False}
    assert resolve_compile_options(True)["options"] == SAFE_INDUCTOR_OPTIONS
    mine = resolve_compile_options({"options": {"max_autotune": True}})["options"]
    assert mine == {**SAFE_INDUCTOR_OPTIONS, "max_autotune": True}
    safe_off = {"options": {"triton.mix_order_reduction": True}}
    assert resolve_compile_options(safe_off)["options"] == {"triton.mix_order_reduction": True}
    assert "options" not in resolve_compile_options(CPU_COMPILE)
    # A mode becomes its options (torch.compile refuses both), still without the pass.
    tuned = resolve_compile_options({"mode": "max-autotune"})
    assert "mode" not in tuned
    assert tuned["options"]["max_autotune"] is True
    assert tuned["options"]["triton.mix_order_reduction"] is False


def check_bf16_compute_keeps_timesteps(rank: int, world_size: int):
    mesh = fsp.make_mesh(device_type="cpu")
    batch = synthetic_batch(fs.random.key(0), batch_size=2)

    def outputs(module: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            return [
                predict(module, batch["latents"], torch.full((2,), t), batch["text"])
                for t in (999.0, 1000.0)
            ]

    prepared = outputs(prepare(tiny_wan(seed=0), mesh=mesh, param_dtype=torch.bfloat16))
    by_hand = outputs(
        shard_by_hand(
            tiny_wan(seed=0),
            mesh,
            mp_policy=fsp.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
        )
    )
    return (
        prepared[0].dtype == torch.float32,
        not torch.equal(*prepared),  # 999 and 1000 are different timesteps
        torch.equal(*by_hand),  # FSDP2's cast_forward_inputs rounds both to 1000 in bf16
    )


@pytest.mark.multirank
def test_bf16_compute_on_two_ranks_keeps_timesteps_in_full_precision(ranks):
    assert ranks.run(check_bf16_compute_keeps_timesteps) == [(True, True, True)] * 2


def check_bf16_roles_first_used_while_not_trained(rank: int, world_size: int, resume: bool):
    """A trained role whose first use is a read under another unit (sequential DMD2: the
    student's rollout in the critic's unit; or a resumed run starting at a critic-only
    step) must still get bf16 gradients reduced into its fp32 parameters."""
    import tempfile

    mesh = fsp.make_mesh(device_type="cpu")

    def build() -> fs.TrainState:
        options = {"mesh": mesh, "param_dtype": torch.bfloat16}
        adamw = fs.optim.adamw(lr=1e-3)
        return fs.TrainState.create(
            {
                "student": fs.Role(prepare(tiny_wan(seed=0), **options), optimizer=adamw),
                "teacher": fs.Role(prepare(tiny_wan(seed=1), trainable=False, **options)),
                "critic": fs.Role(prepare(tiny_wan(seed=2), **options), optimizer=adamw),
            },
            key=fs.random.key(1),
        )

    def batch_at(i: int) -> dict:
        return synthetic_batch(fold_in(fold_in(fs.random.key(7), i), rank), batch_size=2)

    if not resume:
        step = fs.compile(dmd2(generator_update_interval=1, ordering="sequential"))
        state = build()
        for i in range(2):
            state, metrics = step(state, batch_at(i), parallelism=fsp.Layout())
        return bool(torch.isfinite(metrics["student/loss"]))
    step = fs.compile(dmd2(generator_update_interval=2))
    state = build()
    state, _ = step(state, batch_at(0), parallelism=fsp.Layout())
    with tempfile.TemporaryDirectory() as tmp:
        path = fsp.broadcast_object(tmp if rank == 0 else None)
        fs.checkpoint.save(state, f"{path}/ckpt")
        resumed = fs.checkpoint.load(f"{path}/ckpt", like=build())
        fsp.barrier()
    for i in (1, 2):  # a critic-only step first, then the student's
        resumed, metrics = step(resumed, batch_at(i), parallelism=fsp.Layout())
    return bool(torch.isfinite(metrics["student/loss"]))


@pytest.mark.multirank
@pytest.mark.parametrize("resume", [False, True], ids=["sequential", "resumed-at-odd-step"])
def test_bf16_roles_first_read_by_another_unit_train_on_two_ranks(ranks, resume):
    assert ranks.run(check_bf16_roles_first_used_while_not_trained, resume) == [True, True]


def check_hsdp_matches_fsdp(rank: int, world_size: int):
    def run(mesh) -> dict:
        module = prepare(tiny_wan(seed=0), mesh=mesh, checkpointing="full")
        state = _finetune_state(module)
        step = fs.compile(finetune(), clip=fs.clip_grad_norm(1.0))
        for i in range(2):
            batch = synthetic_batch(fold_in(fold_in(fs.random.key(4), i), rank), batch_size=2)
            state, _ = step(state, batch, parallelism=fsp.Layout())
        described = preparation(module).describe()["mesh"]
        return described, {n: p.full_tensor() for n, p in state.roles["student"].params.items()}

    hsdp_mesh, hsdp = run(fsp.make_mesh(replicate=world_size, device_type="cpu"))
    fsdp_mesh, fsdp = run(fsp.make_mesh(device_type="cpu"))
    # Both average the same two ranks' gradients: all-reduce against reduce-scatter.
    tree.assert_trees_close(hsdp, fsdp, rtol=0, atol=1e-6)
    return hsdp_mesh, fsdp_mesh


@pytest.mark.multirank
def test_hsdp_preparation_trains_as_fsdp_on_two_ranks(ranks):
    assert ranks.run(check_hsdp_matches_fsdp) == [({"replicate": 2, "shard": 1}, {"shard": 2})] * 2


@pytest.mark.parametrize(
    ("checkpointing", "name"),
    [
        ("none", "none"),
        ("full", "full"),
        ("selective", "selective"),
        ("attention", "attention"),
        ("narrow", "narrow"),
        (
            ActivationCheckpointing("selective", save_ops=[torch.ops.aten.mm]),
            "selective (custom ops)",
        ),
    ],
)
def test_the_preparation_names_the_checkpointing_it_applied(checkpointing, name):
    prepared = prepare(tiny_wan(seed=0), checkpointing=checkpointing)
    assert preparation(prepared).describe()["checkpointing"] == name


def test_a_checkpointing_choice_reads_the_same_in_every_process():
    # test ids and logs carry it; a set's order follows its ops' addresses
    code = (
        "from fvstep.parallel import ActivationCheckpointing as A;"
        "print(repr(A('selective')), repr(A('selective', save_ops=[])))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(3)
    }
    assert len(seen) == 1 and "save_ops=frozenset({})" in seen.pop()
