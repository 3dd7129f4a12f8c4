"""Roles of a LoRA run × every export format of ``fvstep export``.

A tiny ``fvstep train lora_dmd2`` run (its student and critic are LoRA adapters over one
frozen base, the teacher) is exported through the command, role by role, in each format
it offers (``model``, ``pipeline``, ``safetensors``, ``lora``, ``merged``). Where a format
applies to a role, the artefact loads with the loader of its format (diffusers'
``from_pretrained``; for ``safetensors`` a strict ``load_state_dict`` into the module the
role computes with, rebuilt from the plain base and the run's ``LoraConfig``; for ``lora``
diffusers' ``load_lora_adapter``) with no tensor left on the meta device and no missing or
unexpected key, and computes on a fixed probe what the role's module computes: bitwise
where the same arithmetic runs, within ``MERGE_RTOL``/``MERGE_ATOL`` for a merge. Where
it does not apply, the command refuses in one line naming the role and a format that does.

The teacher is the shared base: its module carries peft's layers (``to_q.base_layer``)
whose adapters belong to the other roles. Before the fix its ``model``/``pipeline``/
``safetensors`` exports kept peft's names, and ``from_pretrained`` left those layers on
the meta device (issue 34, item 7).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import fvstep as fs
from fvstep.cli import main
from fvstep.cli.export import _load_run
from tests.interactions.cells import velocity

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from fvstep.methods.lora import LoRAModule, add_adapters  # noqa: E402

ROLES = ("student", "teacher", "critic")
FORMATS = ("model", "pipeline", "safetensors", "lora", "merged")
APPLIES = {
    "student": {"safetensors", "lora", "merged"},
    "critic": {"safetensors", "lora", "merged"},
    "teacher": {"model", "pipeline", "safetensors"},
}
"""Which formats apply to which role: a LoRA role is an adapter (written as it is, or
merged into the base); the teacher is the plain base, with no adapter of its own."""
REFUSAL = {
    "student": ("--format merged", "--format lora"),
    "critic": ("--format merged", "--format lora"),
    "teacher": ("--format model",),
}
"""What a refusal names as the fix, besides the role."""

MERGE_RTOL, MERGE_ATOL = 1e-4, 1e-5
"""A merge computes ``(W + s·B@A) x`` where the role computes ``W x + s·B (A x)``: the
same values up to fp32 rounding (measured 2.4e-7 at most, on velocities up to 1.44),
not bit for bit."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step ``lora_dmd2`` run, a tiny base pipeline folder, the loaded state and each
    role's velocity on the probe."""
    from fvstep.recipes.tiny_pipeline import save_tiny_pipeline

    root = tmp_path_factory.mktemp("lora_run")
    argv = ["train", "lora_dmd2", "--run.out", str(root / "run"), "--run.num_steps", "2"]
    assert main([*argv, "--run.progress", "false", "--model.tiny.num_layers", "1"]) == 0
    base = save_tiny_pipeline(root / "tiny-wan")
    state, _ = _load_run(str(root / "run"))
    expected = {role: velocity(state.module(role)) for role in ROLES}
    return root, base, state, expected


def export(run, role: str, fmt: str) -> tuple[int, str]:
    root, base, _, _ = run
    out = root / f"{role}_{fmt}" / ("w.safetensors" if fmt == "safetensors" else "")
    argv = ["export", str(root / "run"), "--out", str(out), "--role", role, "--format", fmt]
    argv.append("--overwrite")  # a cell may write an artefact another cell wrote
    return main([*argv, "--base", str(base)] if fmt == "pipeline" else argv), str(out)


def plain_base(state: fs.TrainState) -> torch.nn.Module:
    """A plain Wan (no peft layers) holding the teacher's weights, renamed by hand."""
    teacher = state.module("teacher")
    net = diffusers.WanTransformer3DModel.from_config(teacher.config)
    weights = {n.replace(".base_layer.", "."): p for n, p in teacher.state_dict().items()}
    net.load_state_dict(weights, strict=True)
    return net


def assert_loaded(net: torch.nn.Module) -> None:
    meta = [n for n, p in [*net.named_parameters(), *net.named_buffers()] if p.is_meta]
    assert meta == [], f"left on the meta device: {meta[:3]}"


def load_model(path: str) -> torch.nn.Module:
    net, info = diffusers.WanTransformer3DModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_loaded(net)
    return net


def load_pipeline(path: str) -> torch.nn.Module:
    net = diffusers.DiffusionPipeline.from_pretrained(path).transformer
    assert_loaded(net)
    written = load_file(f"{path}/transformer/diffusion_pytorch_model.safetensors")
    assert set(written) == set(net.state_dict())  # no missing or unexpected key
    return net


def load_safetensors(path: str, role: str, state: fs.TrainState) -> torch.nn.Module:
    """The teacher's file into a plain Wan; a LoRA role's into a fresh ``LoRAModule`` of
    the run's ``LoraConfig`` over the plain base (both strict)."""
    tensors = load_file(path)
    module = state.module(role)
    if not isinstance(module, LoRAModule):
        net = diffusers.WanTransformer3DModel.from_config(module.config)
        net.load_state_dict(tensors, strict=True)
        assert_loaded(net)
        return net
    lora = add_adapters(plain_base(state), {role: module.config})[role]
    lora.load_state_dict(tensors, strict=True)
    return lora


def load_lora(path: str, role: str, state: fs.TrainState) -> torch.nn.Module:
    net = plain_base(state)
    net.load_lora_adapter(
        path, weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
    )
    written = load_file(f"{path}/pytorch_lora_weights.safetensors")
    loaded = [n for n, _ in net.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    assert len(loaded) == len(written) == len(state.roles[role].params)
    return net


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("role", ROLES)
def test_an_exported_role_loads_whole_and_computes_what_the_role_computes(run, role, fmt, capsys):
    _, _, state, expected = run
    code, out = export(run, role, fmt)
    err = capsys.readouterr().err
    if fmt not in APPLIES[role]:
        assert code == 2 and err.count("\n") == 1, err
        assert f"{role!r}" in err and any(fix in err for fix in REFUSAL[role]), err
        return
    assert code == 0, err
    if fmt == "model":
        net = load_model(out)
    elif fmt == "pipeline":
        net = load_pipeline(out)
    elif fmt == "safetensors":
        net = load_safetensors(out, role, state)
    elif fmt == "lora":
        net = load_lora(out, role, state)
    else:
        net = load_model(out)
        got = velocity(net)
        torch.testing.assert_close(got, expected[role], rtol=MERGE_RTOL, atol=MERGE_ATOL)
        return
    got = velocity(net)
    assert torch.equal(got, expected[role]), f"max diff {(got - expected[role]).abs().max()}"


@pytest.mark.parametrize("fmt", ["model", "pipeline", "safetensors"])
def test_the_teachers_export_is_the_base_under_its_plain_names_bitwise(run, fmt):
    root, _, state, _ = run
    code, out = export(run, "teacher", fmt)
    assert code == 0
    file = {
        "model": f"{out}/diffusion_pytorch_model.safetensors",
        "pipeline": f"{out}/transformer/diffusion_pytorch_model.safetensors",
        "safetensors": out,
    }[fmt]
    written = load_file(file)
    base = {n.replace(".base_layer.", "."): p for n, p in state.roles["teacher"].params.items()}
    fs.tree.assert_trees_equal(written, base)
    if fmt == "model":  # the config is the base's, with no trace of peft
        config = json.loads((root / "teacher_model" / "config.json").read_text())
        assert config["_class_name"] == "WanTransformer3DModel"


def test_the_probe_tells_the_roles_apart(run):
    """The cells cannot pass vacuously: each adapter has moved the base's output."""
    _, _, _, expected = run
    for role in ("student", "critic"):
        assert not torch.allclose(expected[role], expected["teacher"], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(expected["student"], expected["critic"], rtol=1e-3, atol=1e-3)
