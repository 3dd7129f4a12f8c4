"""Recipes (fvstep.recipes): options from files and dotted flags, the resolved config kept
in the run's folder and checked on resume, ``init_from`` (a diffusers folder, another
run's weights, another run's state), and the LoRA base rule. Tiny Wans on synthetic
latents, on the CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.recipes import get_recipe
from fvstep.recipes.config import (
    ConfigChangeError,
    check_config_change,
    dataset_digest,
    parse_options,
    read_config,
)
from fvstep.recipes.init import source_weights
from fvstep.recipes.options import InitFrom
from fvstep.recipes.running import describe_plan, prepare_run, train

FINETUNE = get_recipe("finetune")
QUIET = ["--run.progress", "false", "--model.tiny.num_layers", "1", "--data.synthetic_size", "8"]


def options(tmp_path, *argv: str, out: str = "run", recipe=FINETUNE):
    return parse_options(recipe, [*QUIET, "--run.out", str(tmp_path / out), *argv])


def test_options_come_from_yaml_or_toml_files_and_dotted_flags_later_ones_winning(tmp_path):
    (tmp_path / "a.yaml").write_text("optim:\n  lr: 0.5\nrun:\n  num_steps: 3\n")
    (tmp_path / "b.toml").write_text(
        "[optim]\nlr = 0.25\nema = 0.5\n[data]\nlatent_shape = [4, 1, 2, 2]\n"
    )
    argv = ["--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.toml")]
    got = parse_options(FINETUNE, [*argv, "--run.num_steps", "7"])
    assert (got.optim.lr, got.optim.ema, got.run.num_steps) == (0.25, 0.5, 7)
    assert got.data.latent_shape == (4, 1, 2, 2)  # a tuple, as typed
    assert parse_options(FINETUNE, []) == FINETUNE.options()
    with pytest.raises(ValueError, match="optim.lrr"):
        parse_options(FINETUNE, ["--optim.lrr", "1"])
    with pytest.raises(ValueError, match="run.num_steps"):
        parse_options(FINETUNE, ["--run.num_steps", "many"])
    with pytest.raises(ValueError, match="t_sampling"):
        parse_options(FINETUNE, ["--t_sampling", "gaussian"])


def test_config_change_rules_name_the_key_that_alters_the_math():
    saved = {"recipe": "finetune", "options": {"optim": {"lr": 1e-4}, "data": {"batch_size": 2}}}
    lr = {"recipe": "finetune", "options": {"optim": {"lr": 3e-4}, "data": {"batch_size": 2}}}
    assert check_config_change(saved, lr) == ["optim.lr: 0.0001 -> 0.0003"]
    batch = {"recipe": "finetune", "options": {"optim": {"lr": 1e-4}, "data": {"batch_size": 3}}}
    with pytest.raises(ConfigChangeError, match="data.batch_size was 2 .* is 3 now"):
        check_config_change(saved, batch)
    with pytest.raises(ConfigChangeError, match="recipe 'finetune', not 'dmd2'"):
        check_config_change(saved, {**lr, "recipe": "dmd2"})
    critic = {"recipe": "dmd2", "options": {"critic_lr": 4e-4}}
    assert check_config_change(critic, {"recipe": "dmd2", "options": {"critic_lr": 1e-4}}) == [
        "critic_lr: 0.0004 -> 0.0001"
    ]  # any learning rate may change, a key named *_lr too


def test_a_resume_refuses_another_dataset_at_the_same_path(tmp_path):
    (tmp_path / "index.json").write_text('{"shards": ["a"]}')
    first = dataset_digest(tmp_path)
    saved = {
        "recipe": "finetune",
        "options": {"data": {"path": str(tmp_path)}},
        "data_digest": first,
    }
    assert check_config_change(saved, dict(saved)) == []
    (tmp_path / "index.json").write_text('{"shards": ["b"]}')
    again = {**saved, "data_digest": dataset_digest(tmp_path)}
    with pytest.raises(ConfigChangeError, match="holds another dataset"):
        check_config_change(saved, again)
    assert dataset_digest(None) is None and dataset_digest(tmp_path / "none") is None


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """A finetune run of 2 steps (EMA on), its folder and final state."""
    root = tmp_path_factory.mktemp("source")
    opts = options(
        root,
        "--run.num_steps",
        "2",
        "--run.every",
        "2",
        "--optim.ema",
        "0.5",
        "--validation.every",
        "2",
    )
    state = train(FINETUNE, opts, log=lambda line: None)
    return root / "run", state


def test_a_resumed_run_applies_an_lr_change_and_refuses_one_that_alters_the_math(
    source_run, tmp_path
):
    run, _ = source_run
    saved = read_config(run)
    assert saved["recipe"] == "finetune" and saved["options"]["run"]["num_steps"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/loss" in r] == [0, 2]  # validation.every 2
    lines: list[str] = []
    more = options(run.parent, "--run.num_steps", "3", "--run.every", "2", "--optim.lr", "3e-4")
    more = dataclasses.replace(more, optim=dataclasses.replace(more.optim, ema=0.5))
    spec = prepare_run(FINETUNE, more, log=lines.append, write=False)
    spec.close()
    assert int(spec.state.step) == 0  # fvstep.run resumes; prepare_run only checks
    assert "fvstep train: config change applied on resume: optim.lr: 0.0001 -> 0.0003" in lines
    other = options(run.parent, "--run.num_steps", "3", "--data.batch_size", "3")
    with pytest.raises(ConfigChangeError, match="data.batch_size"):
        prepare_run(FINETUNE, other, log=lines.append)
    assert read_config(run) == saved  # refused: the saved config is kept


def test_init_from_another_runs_ema_starts_a_new_run_with_fresh_optimizer_state(
    source_run, tmp_path
):
    run, source = source_run
    opts = options(tmp_path, "--init_from.path", str(run), "--init_from.weights", "ema")
    spec = prepare_run(FINETUNE, opts, log=lambda line: None)
    spec.close()
    student = spec.state.roles["student"]
    assert int(spec.state.step) == 0 and int(student.opt_state.count) == 0
    ema = source.roles["student"].ema.params
    for name, p in student.params.items():
        assert torch.equal(p, ema[name]), name
    assert not torch.equal(source.roles["student"].params[name], ema[name])  # EMA, not live
    with pytest.raises(ValueError, match="has no saved weights of role .critic."):
        source_weights(run, role="critic")


def test_init_from_another_runs_state_continues_it_in_a_new_folder(source_run, tmp_path):
    run, source = source_run
    opts = options(
        tmp_path, "--init_from.path", str(run), "--init_from.kind", "state", "--optim.ema", "0.5"
    )
    spec = prepare_run(FINETUNE, opts, log=lambda line: None)
    spec.close()
    fs.tree.assert_trees_equal(spec.state, source, check_static=False)
    opts = dataclasses.replace(opts, run=dataclasses.replace(opts.run, num_steps=3))
    state = train(FINETUNE, opts, log=lambda line: None)
    assert int(state.step) == 3 and ckpt.latest(tmp_path / "run").name == "step_000000003"
    assert ckpt.latest(run).name == "step_000000002"  # the source run is left as it was


def test_init_from_a_diffusers_folder_loads_its_weights_into_the_student(source_run, tmp_path):
    _, source = source_run
    ckpt.export(source, "student", tmp_path / "model", format="diffusers")
    opts = options(tmp_path, "--init_from.path", str(tmp_path / "model"))
    spec = prepare_run(FINETUNE, opts, log=lambda line: None)
    spec.close()
    fs.tree.assert_trees_equal(spec.state.roles["student"].params, source.roles["student"].params)
    wrong = options(tmp_path, "--init_from.path", str(tmp_path / "model"), out="other")
    wrong = dataclasses.replace(wrong, init_from=InitFrom(path=str(tmp_path), roles={"x": "y"}))
    with pytest.raises(ValueError, match="names \\['x'\\], which this run does not train"):
        prepare_run(FINETUNE, wrong, log=lambda line: None)


def test_the_plan_of_dmd2_says_which_roles_each_step_updates(tmp_path):
    recipe = get_recipe("dmd2")
    spec = recipe.build(options(tmp_path, recipe=recipe), fresh=True)
    assert describe_plan(spec, 2) == [
        "step 0: dmd2_fused updates student, critic (1 micro-batch, clip 1.0)",
        "step 1: dmd2_critic updates critic (1 micro-batch, clip 1.0)",
    ]
    assert spec.state.roles["teacher"].role.save_frozen is False


def test_lora_adapters_start_only_from_a_run_on_the_same_base(tmp_path):
    recipe = get_recipe("lora_dmd2")
    first = options(tmp_path, "--run.num_steps", "1", "--run.every", "1", recipe=recipe)
    train(recipe, first, log=lambda line: None)
    start = ["--init_from.path", str(tmp_path / "run")]
    same = options(tmp_path, *start, out="same", recipe=recipe)
    spec = prepare_run(recipe, same, log=lambda line: None)
    spec.close()
    trained = source_weights(tmp_path / "run", role="student")
    for name, p in spec.state.roles["student"].params.items():
        assert torch.equal(p, trained[name]), name
    other = options(tmp_path, *start, "--model.seed", "1", out="other", recipe=recipe)
    with pytest.raises(ckpt.CheckpointError, match="trained on another base model"):
        prepare_run(recipe, other, log=lambda line: None)


def test_the_model_comes_from_a_diffusers_folder_or_a_bare_config(source_run, tmp_path):
    from fvstep.recipes.options import ModelOptions
    from fvstep.recipes.parts import load_transformer

    _, source = source_run
    ckpt.export(source, "student", tmp_path / "model", format="diffusers")
    loaded = load_transformer(ModelOptions(path=str(tmp_path / "model")))
    fs.tree.assert_trees_equal(dict(loaded.named_parameters()), source.roles["student"].params)
    config = tmp_path / "model" / "config.json"
    fresh = load_transformer(ModelOptions(config=str(config), seed=3))
    again = load_transformer(ModelOptions(config=str(config), seed=3))
    fs.tree.assert_trees_equal(dict(fresh.named_parameters()), dict(again.named_parameters()))
    assert {n: p.shape for n, p in fresh.named_parameters()} == {
        n: p.shape for n, p in loaded.named_parameters()
    }
    with pytest.raises(ValueError, match="neither a diffusers model folder"):
        load_transformer(ModelOptions(path=str(tmp_path)))


@pytest.mark.parametrize("fused", [True, False])
def test_a_recipes_adamw_is_torchs_fused_kernel_unless_told_otherwise(fused):
    from fvstep.recipes.options import OptimOptions
    from fvstep.recipes.parts import make_optimizer

    assert OptimOptions().fused is True
    optim = OptimOptions(lr=1e-2, weight_decay=0.1, fused=fused)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    reference = torch.nn.Linear(8, 8)
    reference.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(
        reference.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None
    )
    opt = make_optimizer(optim)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.init(params)
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in reference.named_parameters():
            p.grad = grads[n].clone()
        torch_opt.step()
        state = opt.update(params, grads, state)
    for n, p in reference.named_parameters():
        assert torch.equal(params[n], p.detach()), n


def test_the_recipes_flash_attention_4_option_enables_it_or_refuses(monkeypatch):
    import sys

    from fvstep.methods.models import tiny_wan
    from fvstep.parallel import preparation
    from fvstep.recipes.options import PrepareOptions
    from fvstep.recipes.parts import prepare_role

    plain = prepare_role(tiny_wan(seed=0), PrepareOptions(), None, trainable=True)
    assert preparation(plain).attention_backend is None
    # on a machine FA4 cannot run on, the option raises before anything is prepared
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    fa4 = PrepareOptions(flash_attention_4=True, precision="bf16")
    with pytest.raises(ModuleNotFoundError, match=r"fvstep\[flash4\]"):
        prepare_role(tiny_wan(seed=0), fa4, None, trainable=True)
    with pytest.raises(ValueError, match="needs bf16 compute"):  # no fp32 kernel: refused
        prepare_role(tiny_wan(seed=0), PrepareOptions(flash_attention_4=True), None, trainable=True)
    enabled = []
    monkeypatch.setattr(fs.parallel, "enable_flash_attention_4", lambda: enabled.append(1))
    module = prepare_role(tiny_wan(seed=0), fa4, None, trainable=True)
    assert enabled == [1] and preparation(module).attention_backend == "_native_flash"
    assert (
        preparation(module).describe()["flash_attention_4"] is False
    )  # the stand-in enabled nothing
