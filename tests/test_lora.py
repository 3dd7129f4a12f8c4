"""LoRA roles (fvstep.methods.lora): adapters over one frozen base, its digest in checkpoints,
the resume law over LoRA roles, exports in diffusers' formats, DMD2 over one base."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    base_digest,
    export,
    merge_weights,
    read_manifest,
)
from fvstep.core.random import fold_in
from fvstep.core.state import adopt
from fvstep.methods import dmd2
from fvstep.methods.lora import LoRAModule, add_adapters
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.testing import assert_resume_exact

peft = pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"]


def lora_config(**kw) -> peft.LoraConfig:
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **kw})


class Data:
    """Per-rank synthetic batches: a pure function of (step, rank)."""

    def __init__(self, seed: int = 0, batch_size: int = 2) -> None:
        self.key = fs.random.key(seed)
        self.batch_size = batch_size

    def batch(self, step: int, *, rank: int = 0, world_size: int = 1) -> dict:
        key = fold_in(fold_in(self.key, step), rank)
        return synthetic_batch(key, batch_size=self.batch_size, frames=1)


def dmd2_state(
    base_seed: int = 0,
    *,
    sharded: bool = False,
    init: object = True,
    prepared: dict | None = None,
    num_layers: int = 1,
) -> tuple[fs.TrainState, dict[str, LoRAModule]]:
    """DMD2 over one base: teacher = the base, student and critic = LoRA adapters.
    ``prepared``: options of fvstep.parallel.prepare for the base (then it is sharded by
    prepare when ``sharded``)."""
    base = tiny_wan(seed=base_seed, num_layers=num_layers)
    config = lora_config(init_lora_weights=init)
    lora = add_adapters(base, {"student": config, "critic": config}, seed=7)
    mesh = fsp.make_mesh(device_type="cpu") if sharded else None
    if prepared is not None:
        fsp.prepare(base, mesh=mesh, trainable=False, frozen_dtype=None, **prepared)
    elif mesh is not None:
        fsp.shard_module(base, mesh=mesh)
    if mesh is not None:
        for module in lora.values():
            fsp.shard_module(module, mesh=mesh)
    adamw = fs.optim.adamw(lr=1e-2, weight_decay=0.01)
    state = fs.TrainState.create(
        {
            "student": fs.Role(lora["student"], optimizer=adamw, ema=fs.EMA(0.9)),
            "teacher": fs.Role(base, save_frozen=False),
            "critic": fs.Role(lora["critic"], optimizer=adamw),
        },
        key=fs.random.key(0),
    )
    return state, lora


def dmd2_step() -> fs.Step:
    return fs.compile(
        dmd2(generator_update_interval=2, guidance_scale=2.0), clip=fs.clip_grad_norm(1.0)
    )


def run_steps(state: fs.TrainState, num: int) -> fs.TrainState:
    return fs.run(dmd2_step(), state, Data(), num_steps=num, progress=False)


def velocity(module: torch.nn.Module, seed: int = 5) -> torch.Tensor:
    batch = synthetic_batch(fs.random.key(seed), batch_size=2, frames=1)
    t = torch.full((2,), 700.0)
    with torch.no_grad():
        return predict(module, batch["latents"], t, batch["text"])


def test_only_adapter_parameters_train_and_hold_optimizer_state():
    plain = tiny_wan(seed=0, num_layers=1)
    state, _ = dmd2_state()
    base = state.roles["teacher"]
    assert len(base.params) == len(dict(plain.named_parameters()))  # no adapter in the base
    assert all("lora_" not in n for n in base.params)
    assert base.trainable_names == () and base.opt_state is None
    assert not any(p.requires_grad for p in base.params.values())
    for role in ("student", "critic"):
        rs = state.roles[role]
        names = set(rs.params)
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert set(rs.trainable_names) == names
        assert set(rs.opt_state.exp_avg) == names
        assert all(p.requires_grad for p in rs.params.values())
    assert set(state.roles["student"].ema.params) == set(state.roles["student"].params)
    state = run_steps(state, 2)
    assert fsp.unrested_modules(state) == []  # requires_grad restored, no .grad left
    assert not any(p.requires_grad for p in state.roles["teacher"].params.values())


def test_dmd2_over_one_base_keeps_one_base_and_never_changes_the_teacher():
    state, lora = dmd2_state()
    base = state.roles["teacher"].role.module
    assert lora["student"].base is base and lora["critic"].base is base
    before = fs.tree.clone(state.roles["teacher"].params)
    teacher_out = velocity(base)
    student_out = velocity(lora["student"])
    state = run_steps(state, 4)
    # One base in memory: the distinct storages of every tensor the roles compute with
    # are the base's once plus the adapters'.
    storages = {
        p.untyped_storage().data_ptr()
        for rs in state.roles.values()
        for m in [
            rs.role.module,
            *([rs.role.module.base] if isinstance(rs.role.module, LoRAModule) else []),
        ]
        for p in m.parameters()
    }
    num_adapters = sum(len(state.roles[r].params) for r in ("student", "critic"))
    assert len(storages) == len(before) + num_adapters
    # The teacher never changes: its weights and its output are bitwise the same.
    fs.tree.assert_trees_equal(state.roles["teacher"].params, before)
    assert torch.equal(velocity(state.module("teacher")), teacher_out)
    # ... while the adapters trained, and the student computes with its own adapter.
    assert not torch.equal(velocity(state.module("student")), student_out)
    assert not torch.equal(velocity(state.module("student")), velocity(state.module("critic")))


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_law_over_lora_roles_is_bitwise(tmp_path, async_save):
    def factory():
        state, _ = dmd2_state()
        return state, dmd2_step(), Data()

    assert_resume_exact(
        factory, num_steps=4, interruptions=[1, 3], workdir=tmp_path, async_save=async_save
    )


def test_a_trainable_role_can_keep_its_frozen_weights_out_of_checkpoints(tmp_path):
    # One peft model as one role (LoRA without a shared base): the adapters are its
    # trainable parameters, the base weights its frozen ones, saved by digest only.
    def factory():
        net = tiny_wan(seed=0, num_layers=1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            peft.inject_adapter_in_model(lora_config(), net)
        role = fs.Role(net, optimizer=fs.optim.adamw(lr=1e-2), save_frozen=False)
        state = fs.TrainState.create({"student": role}, key=fs.random.key(0))
        return state, fs.compile(fs.methods.finetune()), Data()

    final = assert_resume_exact(factory, num_steps=3, interruptions=[2], workdir=tmp_path)
    fs.checkpoint.save(final, tmp_path / "ckpt")
    manifest = read_manifest(tmp_path / "ckpt")
    trainable = set(final.roles["student"].trainable_names)
    saved = {p.split(".", 3)[3] for p in manifest.leaves if p.startswith("roles.student.params.")}
    assert saved == trainable and all("lora_" in n for n in saved)
    assert {p.split(".", 3)[3] for p in manifest.frozen} == set(
        final.roles["student"].params
    ) - trainable


def test_checkpoint_holds_adapters_and_a_base_digest_not_the_base(tmp_path):
    state, _ = dmd2_state()
    state = run_steps(state, 1)
    fs.checkpoint.save(state, tmp_path / "ckpt")
    manifest = read_manifest(tmp_path / "ckpt")
    assert not any(p.startswith("roles.teacher.params.") for p in manifest.leaves)
    assert set(manifest.frozen) == {
        f"roles.teacher.params.{n}" for n in state.roles["teacher"].params
    }
    assert any(p.startswith("roles.student.ema.params.") for p in manifest.leaves)
    assert any(p.startswith("roles.critic.opt_state.exp_avg.") for p in manifest.leaves)
    assert manifest.frozen_digests == {"teacher": base_digest(state.module("teacher"))}
    loaded = fs.checkpoint.load(tmp_path / "ckpt", like=dmd2_state()[0])
    fs.tree.assert_trees_equal(loaded, state, check_static=False)


def test_load_on_another_base_is_an_error_naming_the_role(tmp_path):
    state, _ = dmd2_state(base_seed=0)
    fs.checkpoint.save(state, tmp_path / "ckpt")
    other, _ = dmd2_state(base_seed=1)
    with pytest.raises(CheckpointError, match="role 'teacher'.*same base model"):
        fs.checkpoint.load(tmp_path / "ckpt", like=other)


def test_a_malformed_frozen_entry_is_a_damaged_manifest(tmp_path):
    state, _ = dmd2_state()
    fs.checkpoint.save(state, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "manifest.json"
    body = json.loads(path.read_text())
    next(iter(body["frozen"].values()))["checksum"] = "x"
    path.write_text(json.dumps(body))
    with pytest.raises(DamagedCheckpointError, match="frozen"):
        read_manifest(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA DMD2 state after 3 steps (adapters away from their initialisation)."""
    state, _ = dmd2_state(init=False)
    return run_steps(state, 3), tmp_path_factory.mktemp("exports")


@pytest.mark.parametrize("weights", ["params", "ema"])
def test_diffusers_lora_export_loads_and_matches_the_role(trained, weights):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    state, root = trained
    path = export(state, "student", root / f"lora_{weights}", format="lora")
    expected_module = state.module("student")
    if weights == "ema":  # the role computing with its EMA weights
        ema = fs.tree.clone(state.roles["student"].ema.params)
        expected_module = adopt(
            fs.tree.replace(fs.tree.clone(state.roles["student"]), params=ema)
        ).role.module
    expected = velocity(expected_module)
    state.module("student")  # bind the live weights again
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        transformer=tiny_wan(seed=0, num_layers=1),
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    if weights == "params":
        pipe.load_lora_weights(path)
        # The same operations in the same order as the role: equal, not merely close.
        assert torch.equal(velocity(pipe.transformer), expected)
    net = tiny_wan(seed=0, num_layers=1)
    export(state, "student", root / f"lora2_{weights}", weights=weights, format="lora")
    net.load_lora_adapter(
        root / f"lora2_{weights}",
        weight_name="pytorch_lora_weights.safetensors",
        prefix="transformer",
        adapter_name="student",
    )
    torch.testing.assert_close(velocity(net), expected, rtol=0, atol=0)


def test_merged_export_matches_the_role_up_to_rounding(trained):
    from diffusers import WanTransformer3DModel

    state, root = trained
    path = export(state, "student", root / "merged", format="merged")
    net = WanTransformer3DModel.from_pretrained(path)
    assert not any("lora" in n or "base_layer" in n for n, _ in net.named_parameters())
    # Merging W + s * B @ A rounds differently from W x + s * B (A x): close, not equal.
    torch.testing.assert_close(
        velocity(net), velocity(state.module("student")), rtol=1e-4, atol=1e-5
    )
    assert set(merge_weights(state, "critic")) == set(net.state_dict())


def test_merge_weights_refuses_a_dtype_that_is_not_floating_point(trained):
    # An integer dtype would cast the merged weights silently (found by review, issue 36).
    state, _ = trained
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        merge_weights(state, "student", dtype=torch.int8)


def peft_model(*, disabled: bool) -> torch.nn.Module:
    """One peft model (adapters in its own module tree, as peft leaves them), its adapter
    away from zero (``init_lora_weights=False``) and on, or disabled."""
    net = tiny_wan(seed=0, num_layers=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft.inject_adapter_in_model(lora_config(init_lora_weights=False), net)
    if disabled:
        for module in net.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.enable_adapters(False)
    return net


def one_role(net: torch.nn.Module) -> fs.TrainState:
    return fs.TrainState.create({"student": fs.Role(net)}, key=fs.random.key(0))


def test_a_peft_model_with_its_adapters_off_exports_the_plain_model_it_computes(tmp_path):
    from diffusers import WanTransformer3DModel

    from fvstep.checkpoint import export

    net = peft_model(disabled=True)
    path = export(one_role(net), "student", tmp_path / "plain", format="diffusers")
    loaded, info = WanTransformer3DModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    plain = tiny_wan(seed=0, num_layers=1)  # the base the adapters were injected into
    fs.tree.assert_trees_equal(dict(loaded.state_dict()), dict(plain.state_dict()))
    assert torch.equal(velocity(loaded), velocity(net))  # the adapters' tensors left out


def test_a_peft_model_computing_with_its_adapters_keeps_them_or_is_refused(tmp_path):
    from safetensors.torch import load_file

    from fvstep.checkpoint import export

    net = peft_model(disabled=False)
    state = one_role(net)
    with pytest.raises(ValueError, match=r"role 'student' computes with the peft adapter "):
        export(state, "student", tmp_path / "plain", format="diffusers")  # would drop the adapter
    # A safetensors file is the peft model as it is: it loads back into one, bitwise.
    again = peft_model(disabled=False)
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    again.load_state_dict(load_file(export(state, "student", tmp_path / "role")))
    assert torch.equal(velocity(again), velocity(net))


def test_an_export_refuses_peft_adapters_it_would_silently_lose(tmp_path):
    from fvstep.checkpoint import export

    state, lora = dmd2_state(init=False)
    with lora["student"].active(), pytest.raises(ValueError, match="not the role.s"):
        export(state, "teacher", tmp_path / "active")  # the student's weights, not its
    net = peft_model(disabled=False)
    for module in net.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
    with pytest.raises(ValueError, match=r"role 'student' has peft adapters \['default'\]"):
        export(one_role(net), "student", tmp_path / "merged")
    with pytest.raises(ValueError, match="--format merged"):
        export(state, "critic", tmp_path / "critic", format="diffusers")


def test_a_lora_role_without_its_base_in_the_state_is_refused():
    base = tiny_wan(seed=0, num_layers=1)
    lora = add_adapters(base, {"student": lora_config()})
    adamw = fs.optim.adamw(lr=1e-3)
    state = fs.TrainState.create(
        {"student": fs.Role(lora["student"], optimizer=adamw)}, key=fs.random.key(0)
    )
    with pytest.raises(ValueError, match="its base is not"):
        velocity(state.module("student"))


def test_add_adapters_refuses_bad_names_and_repeats():
    base = tiny_wan(seed=0, num_layers=1)
    add_adapters(base, {"student": lora_config()})
    with pytest.raises(ValueError, match="already has an adapter 'student'"):
        add_adapters(base, {"student": lora_config()})
    with pytest.raises(ValueError, match="identifiers"):
        add_adapters(base, {"a-b": lora_config()})


def resume_on_ranks(rank: int, world_size: int, workdir: str) -> tuple[list[str], bool]:
    def factory():
        state, _ = dmd2_state(sharded=True)
        return state, dmd2_step(), Data()

    digest = base_digest(factory()[0].module("teacher"))
    final = assert_resume_exact(factory, num_steps=2, interruptions=[1], workdir=workdir)
    assert fsp.unrested_modules(final) == []
    unchanged = base_digest(final.module("teacher")) == digest
    return sorted(final.roles["student"].params), unchanged


@pytest.mark.multirank
@pytest.mark.heavy  # about 45 s on a loaded 2-core box
def test_resume_law_over_fsdp2_sharded_lora_roles_on_two_ranks(ranks):
    with tempfile.TemporaryDirectory() as workdir:
        results = ranks.run(resume_on_ranks, workdir)
    state, _ = dmd2_state()
    # fully_shard keeps the adapters' names (the checkpoint keys) as they are unsharded,
    # and the sharded teacher (the shared base) is bitwise unchanged by training.
    assert results == [(sorted(state.roles["student"].params), True)] * 2


def adapter_grads(
    checkpointing: str | None, *, context: str = "auto", compile: bool = False
) -> list[torch.Tensor]:
    """Gradients of the student and critic adapters from one backward through both
    (after a teacher forward without gradient), the base's blocks prepared by
    fvstep.parallel.prepare: checkpointed (``"full"``/``"selective"``) and/or compiled.
    ``context="auto"`` keeps the recompute context add_adapters gives the base;
    ``"none"`` replaces it by one that sets nothing back."""
    from fvstep.parallel import prepare

    base = tiny_wan(seed=0, num_layers=2)
    config = lora_config(init_lora_weights=False)
    lora = add_adapters(base, {"student": config, "critic": config}, seed=0)
    if checkpointing is not None or compile:
        prepare(
            base,
            trainable=False,
            frozen_dtype=None,
            checkpointing=checkpointing or "none",
            checkpoint_context=(lambda inner: inner) if context == "none" else None,
            compile={"backend": "aot_eager"} if compile else False,
        )
    batch = synthetic_batch(fs.random.key(0), batch_size=2, frames=1)
    t = torch.full((2,), 500.0)
    with torch.no_grad():
        predict(base, batch["latents"], t, batch["text"])
    student = predict(lora["student"], batch["latents"], t, batch["text"])
    critic = predict(lora["critic"], batch["latents"], t, batch["text"])
    (student.square().mean() + critic.abs().mean()).backward()
    return [p.grad for m in lora.values() for p in m.parameters()]


def test_recomputed_blocks_use_the_adapter_of_their_forward():
    from torch.utils.checkpoint import CheckpointError as RecomputeError

    with pytest.raises(RecomputeError, match="different number of tensors"):
        adapter_grads("full", context="none")  # recomputed with every adapter off: refused
    reference = adapter_grads(None)
    for a, b in zip(adapter_grads("full"), reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.heavy  # the compiled, checkpointed LoRA DMD2 on two ranks covers it in the default run
def test_compiled_lora_blocks_give_the_eager_gradients():
    # torch.compile takes no Python context_fn: the recomputation is in the compiled
    # backward graph, traced with the adapter of the forward. aot_eager: the same ATen ops
    # as eager, so the gradients are bitwise those of eager without checkpointing.
    import torch._dynamo.config as dynamo_config

    from fvstep.parallel.block_compile import RECOMPILE_LIMIT

    torch._dynamo.reset()
    # From dynamo's default: the three cases in one process compile more graphs of one
    # code object than it allows (fullgraph=True then fails); prepare raises it.
    # (config.patch, not monkeypatch, which would delete the option for the process.)
    with dynamo_config.patch(recompile_limit=8):
        reference = adapter_grads(None)
        for checkpointing in (None, "full", "selective"):
            before = fsp.compile_counts()["graphs"]
            grads = adapter_grads(checkpointing, compile=True)
            graphs = fsp.compile_counts()["graphs"] - before
            for a, b in zip(grads, reference, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            # one graph per (adapter, grad mode) and a few more, shared by both blocks:
            # not one per block, which would grow with the model's depth
            assert 3 <= graphs <= 6, (checkpointing, graphs)
        assert dynamo_config.recompile_limit == RECOMPILE_LIMIT


COMPILED = {"checkpointing": "full", "compile": {"backend": "aot_eager"}}


def trained_params(sharded: bool, prepared: dict | None, steps: int) -> dict:
    state, _ = dmd2_state(sharded=sharded, init=False, prepared=prepared, num_layers=2)
    state = run_steps(state, steps)
    return {
        r: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in rs.params.items()}
        for r, rs in state.roles.items()
    }


@pytest.mark.heavy  # its 2-rank twin runs by default
def test_compiled_checkpointed_lora_dmd2_trains_bitwise_as_eager():
    # Several steps, both kinds (student+critic, critic only): a compiled graph that kept
    # an adapter's old values, or the wrong adapter, would part from eager after the first
    # update. aot_eager runs eager's ATen ops, so the law is bitwise.
    torch._dynamo.reset()
    eager = trained_params(False, None, 3)
    compiled = trained_params(False, COMPILED, 3)
    fs.tree.assert_trees_equal(compiled, eager)


def compiled_against_eager_on_ranks(rank: int, world_size: int) -> bool:
    torch._dynamo.reset()
    eager = trained_params(True, None, 2)
    compiled = trained_params(True, COMPILED, 2)
    fs.tree.assert_trees_equal(compiled, eager)
    return True


@pytest.mark.multirank  # about 55 s on a loaded 2-core box
def test_compiled_checkpointed_fsdp2_lora_dmd2_trains_bitwise_as_eager_on_two_ranks(ranks):
    # The base sharded by prepare (AC + compile per block), each LoRA role its own FSDP2
    # group, the teacher read under no_grad by both units: every parameter of every role,
    # gathered, equal to the eager sharded run on both ranks.
    assert ranks.run(compiled_against_eager_on_ranks) == [True, True]
