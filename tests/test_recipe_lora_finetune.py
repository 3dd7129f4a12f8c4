"""``fvstep train finetune --lora.rank R``: a LoRA fine-tune over a frozen base. Only the
adapter trains, the base stays bitwise and out of the checkpoints (its digest is kept),
a resume is bitwise, adapters start only from a run on the same base, and the plan's bytes
are the built state's. Tiny Wans on synthetic latents, on the CPU."""

from __future__ import annotations

import re

import pytest
import torch

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.recipes import get_recipe
from fvstep.recipes.config import parse_options
from fvstep.recipes.init import source_weights
from fvstep.recipes.running import prepare_run, train

FINETUNE = get_recipe("finetune")
QUIET = ["--run.progress", "false", "--model.tiny.num_layers", "1", "--data.synthetic_size", "8"]
LORA = ["--lora.rank", "4", "--optim.lr", "1e-2"]


def options(tmp_path, *argv: str, out: str = "run", recipe=FINETUNE):
    return parse_options(recipe, [*QUIET, *LORA, "--run.out", str(tmp_path / out), *argv])


def quiet(line: str) -> None:
    pass


def test_only_the_adapter_trains_and_the_base_stays_bitwise_and_out_of_the_checkpoint(tmp_path):
    spec = prepare_run(FINETUNE, options(tmp_path, "--run.num_steps", "2"), log=quiet)
    spec.close()
    before = spec.state
    assert set(before.roles) == {"base", "student"}
    names = set(before.roles["student"].params)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), sorted(names)[:3]
    assert not any("lora" in n for n in before.roles["base"].params)
    base_before = {n: p.clone() for n, p in before.roles["base"].params.items()}
    student_before = {n: p.clone() for n, p in before.roles["student"].params.items()}

    after = train(
        FINETUNE, options(tmp_path, "--run.num_steps", "2", "--run.every", "2"), log=quiet
    )
    for name, p in after.roles["base"].params.items():
        assert torch.equal(p, base_before[name]), name
    assert any(
        not torch.equal(p, student_before[n]) for n, p in after.roles["student"].params.items()
    ), "the adapter did not train"
    manifest = ckpt.read_manifest(ckpt.latest(tmp_path / "run"))
    assert set(manifest.frozen_digests) == {"base"}  # the base is kept by its digest alone
    saved = source_weights(tmp_path / "run", role="student")
    assert set(saved) == names


def test_a_lora_fine_tune_stopped_and_resumed_ends_bitwise_as_an_uninterrupted_run(tmp_path):
    argv = ["--run.microbatches", "2", "--run.every", "1", "--optim.ema", "0.9"]
    whole = train(
        FINETUNE, options(tmp_path, *argv, "--run.num_steps", "3", out="whole"), log=quiet
    )
    train(FINETUNE, options(tmp_path, *argv, "--run.num_steps", "1"), log=quiet)
    resumed = train(FINETUNE, options(tmp_path, *argv, "--run.num_steps", "3"), log=quiet)
    assert int(resumed.step) == 3
    fs.tree.assert_trees_equal(resumed, whole, check_static=False)


def test_a_lora_fine_tunes_adapters_start_only_from_a_run_on_the_same_base(tmp_path):
    train(FINETUNE, options(tmp_path, "--run.num_steps", "1", "--run.every", "1"), log=quiet)
    start = ["--init_from.path", str(tmp_path / "run")]
    spec = prepare_run(FINETUNE, options(tmp_path, *start, out="same"), log=quiet)
    spec.close()
    trained = source_weights(tmp_path / "run", role="student")
    for name, p in spec.state.roles["student"].params.items():
        assert torch.equal(p, trained[name]), name
    other = options(tmp_path, *start, "--model.seed", "1", out="other")
    with pytest.raises(ckpt.CheckpointError, match="trained on another base model"):
        prepare_run(FINETUNE, other, log=quiet)


def test_lora_dmd2_refuses_rank_0(tmp_path):
    recipe = get_recipe("lora_dmd2")
    bad = parse_options(recipe, [*QUIET, "--lora.rank", "0", "--run.out", str(tmp_path / "r")])
    with pytest.raises(ValueError, match="lora.rank must be >= 1"):
        prepare_run(recipe, bad, log=quiet)


@pytest.mark.parametrize("recipe", ["finetune", "lora_dmd2", "dmd2"])
def test_export_rebuilds_a_gpu_runs_state_with_its_resolved_precision(recipe, tmp_path, capsys):
    """A run on CUDA with ``precision: auto`` (and FlashAttention-4) computed in bf16: its
    frozen role's checkpoint digest is of bf16 weights. ``fvstep export`` rebuilds the
    state on the CPU, where ``auto`` is fp32 and FA4 cannot run: it must use the run's
    resolved precision (found on the H200: every frozen-role export failed there)."""
    import yaml

    from fvstep.cli import main

    extra = LORA if recipe == "finetune" else []
    argv = [*QUIET, *extra, "--run.num_steps", "1", "--run.every", "1"]
    out = tmp_path / "run"
    train(
        get_recipe(recipe),
        parse_options(
            get_recipe(recipe), [*argv, "--prepare.precision", "bf16", "--run.out", str(out)]
        ),
        log=quiet,
    )
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["precision"] == "bf16"
    config["options"]["prepare"]["precision"] = "auto"  # as a CUDA run writes it
    config["options"]["prepare"]["flash_attention_4"] = True
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    role, fmt = ("student", "lora") if recipe != "dmd2" else ("student", "safetensors")
    code = main(["export", str(out), "--role", role, "--format", fmt, "--out", str(tmp_path / "e")])
    assert code == 0, capsys.readouterr()
    assert any((tmp_path / "e").iterdir())


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--lora.targets", "[to_q, ffn.net.0.prj]"], r"\['ffn.net.0.prj'\] match no layer"),
        (["--lora.targets", "[patch_embedding]"], "a Conv3d"),
        (["--lora.alpha", "0"], "lora.alpha must be > 0"),
        (["--lora.alpha", "-8"], "lora.alpha must be > 0"),
        (["--lora.rank", "-3"], "lora.rank must be >= 0"),
        (["--model.dtype", "bfloat16"], "adapters train in fp32"),
    ],
    ids=["misspelt-target", "conv-target", "alpha-0", "alpha-negative", "rank-negative", "bf16"],
)
def test_lora_options_that_would_train_nothing_or_else_are_refused_by_train_and_plan(
    argv, match, tmp_path, capsys
):
    """Found by review: a misspelt target was dropped and alpha 0 trained nothing, with
    exit 0; ``fvstep plan`` said "fits" for runs ``fvstep train`` refuses."""
    from fvstep.cli import main
    from fvstep.recipes import planning

    words = [*QUIET, *LORA, *argv, "--run.num_steps", "1", "--run.out", str(tmp_path / "r")]
    # the options' checks run before anything is written (exit 2); the targets need the
    # model's layers and are checked when it is built (exit 1, before any step)
    code = main(["train", "finetune", *words])
    assert code == (1 if "target" in argv[0] else 2)
    assert re.search(match, capsys.readouterr().err)
    assert not list((tmp_path / "r").glob("step_*"))
    with pytest.raises(ValueError, match=match):
        planning.plan_run("finetune", parse_options(FINETUNE, words))
    with pytest.raises(ValueError, match=match):  # the build refuses it too
        FINETUNE.build(parse_options(FINETUNE, words), fresh=True)


def test_init_from_state_of_a_lora_run_refuses_other_lora_options(tmp_path, capsys):
    """Found by review: ``init_from.kind state`` continued an adapter at another
    ``lora.alpha`` (another scale) without a word; a resume with it is refused."""
    from fvstep.cli import main

    train(FINETUNE, options(tmp_path, "--run.num_steps", "1", "--run.every", "1"), log=quiet)
    start = ["--init_from.path", str(tmp_path / "run"), "--init_from.kind", "state"]
    words = [*QUIET, *LORA, *start, "--run.num_steps", "2"]
    other = [*words, "--lora.alpha", "16", "--run.out", str(tmp_path / "other")]
    assert main(["train", "finetune", *other]) == 2
    assert "lora.alpha 8, this run has 16" in capsys.readouterr().err
    same = [*words, "--run.out", str(tmp_path / "same")]
    assert main(["train", "finetune", *same]) == 0
