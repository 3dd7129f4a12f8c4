"""The front door of ``fvstep train`` (issue 34): the world size recorded in ``config.yaml``
and checked on resume; one lock of the run folder from the config check to the end of the
run; the validation items of a dataset held out of training. Tiny Wans on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.cli import main
from fvstep.recipes import get_recipe
from fvstep.recipes.config import (
    CONFIG_NAME,
    ConfigChangeError,
    check_config_change,
    parse_options,
    read_config,
)
from fvstep.recipes.running import prepare_run, train

FINETUNE = get_recipe("finetune")
FLAGS = ["--run.progress", "false", "--model.tiny.num_layers", "1", "--data.synthetic_size", "8"]


def options(out: Path, *argv: str):
    return parse_options(FINETUNE, [*FLAGS, "--run.out", str(out), *argv])


def set_world_size(out: Path, world_size: int) -> bytes:
    """Make ``out/config.yaml`` say the run was trained on ``world_size`` ranks."""
    saved = read_config(out)
    saved["world_size"] = world_size
    (out / CONFIG_NAME).write_text(yaml.safe_dump(saved, sort_keys=False))
    return (out / CONFIG_NAME).read_bytes()


# -- 5: the world size ----------------------------------------------------------------


def test_config_yaml_records_the_world_size_next_to_the_recipe(tmp_path):
    train(FINETUNE, options(tmp_path / "run", "--run.num_steps", "1"), log=lambda line: None)
    saved = read_config(tmp_path / "run")
    assert list(saved)[:2] == ["recipe", "world_size"] and saved["world_size"] == 1


def test_a_resume_on_another_world_size_exits_2_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--run.out", str(out), "--run.every", "1"]
    assert main([*argv, "--run.num_steps", "1"]) == 0
    before = set_world_size(out, 2)  # as if `fvstep train --nproc 2` had made it
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([*argv, "--run.num_steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for words in ("world size", "--nproc 2", "--nproc 1", "2 ranks", "1 rank"):
        assert words in err, err
    assert (out / CONFIG_NAME).read_bytes() == before
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert ckpt.latest(out).name == "step_000000001"  # nothing trained


def test_a_resume_on_another_world_size_is_refused_launching_no_rank(tmp_path, capsys):
    """``--nproc 2`` over a 1-rank run: refused by the command before it launches ranks
    (the ranks' own refusal would come back as a failed rank, exit code 1)."""
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--run.out", str(out), "--run.every", "1"]
    assert main([*argv, "--run.num_steps", "1"]) == 0
    before = (out / CONFIG_NAME).read_bytes()
    capsys.readouterr()
    assert main([*argv, "--run.num_steps", "2", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "world size" in err and "--nproc 1" in err and err.count("\n") == 1, err
    assert (out / CONFIG_NAME).read_bytes() == before
    assert ckpt.latest(out).name == "step_000000001"


def test_a_config_without_a_world_size_is_refused_naming_the_way_to_continue():
    """A config.yaml of an fvstep that did not record the world size (nor held out the
    validation items of data.path) is refused: nothing can check that a resume continues
    it exactly. The same world size passes, and dicts without the key compare as before."""
    old = {"recipe": "finetune", "options": {"optim": {"lr": 1.0}}}
    new = {**old, "world_size": 1}
    with pytest.raises(ConfigChangeError, match="does not record the world size") as e:
        check_config_change(old, new)
    assert "--init_from.kind state" in str(e.value)
    assert check_config_change(new, dict(new)) == []
    assert check_config_change(old, dict(old)) == []
    with pytest.raises(ConfigChangeError, match="world size: the run being resumed"):
        check_config_change({**new, "world_size": 2}, new)


@pytest.mark.heavy
@pytest.mark.multirank
def test_a_two_rank_run_resumed_with_nproc_1_is_refused_and_resumes_on_2(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--run.out", str(out), "--run.every", "2"]
    assert main([*argv, "--nproc", "2", "--run.num_steps", "2"]) == 0
    assert read_config(out)["world_size"] == 2
    before = (out / CONFIG_NAME).read_bytes()
    capsys.readouterr()
    assert main([*argv, "--nproc", "1", "--run.num_steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "world size" in err and "--nproc 2" in err and err.count("\n") == 1, err
    assert (out / CONFIG_NAME).read_bytes() == before
    assert ckpt.latest(out).name == "step_000000002"
    assert main([*argv, "--nproc", "2", "--run.num_steps", "3"]) == 0
    assert ckpt.latest(out).name == "step_000000003"


# -- 6: one lock from the config check to the end of the run ----------------------------


def test_a_second_train_into_a_locked_folder_is_refused_without_touching_its_config(
    tmp_path, capsys
):
    out = tmp_path / "run"
    first = options(out, "--run.num_steps", "2")
    spec = prepare_run(FINETUNE, first, log=lambda line: None)  # checked, written, locked
    try:
        config = (out / CONFIG_NAME).read_bytes()
        # The window between the config check and fvstep.run, held open by the first run.
        with pytest.raises(ckpt.CheckpointLockedError, match="in use by another run"):
            train(FINETUNE, options(out, "--optim.lr", "0.5"), log=lambda line: None)
        assert (out / CONFIG_NAME).read_bytes() == config
        capsys.readouterr()
        argv = ["train", *FLAGS, "--run.out", str(out), "--data.batch_size", "4"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "in use by another run" in err and err.count("\n") == 1, err
        assert (out / CONFIG_NAME).read_bytes() == config
        # The first run goes on under the lock it holds: fvstep.run does not take it again.
        state = fs.run(spec.step, spec.state, spec.data, **spec.run_options)
        assert int(state.step) == 2
        with pytest.raises(ckpt.CheckpointLockedError):
            ckpt.lock_dir(out)  # still held, until the run's spec is closed
    finally:
        spec.close()
    ckpt.lock_dir(out).release()  # released by close
    assert (out / CONFIG_NAME).read_bytes() == config


@pytest.mark.parametrize("key", ["data.path", "model.path"])
def test_a_train_refused_for_a_wrong_path_exits_2_and_leaves_no_folder(tmp_path, capsys, key):
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--run.out", str(out), f"--{key}", str(tmp_path / "nowhere")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert key in err and err.count("\n") == 1, err
    assert not out.exists()


# -- 8: the validation items of a dataset are held out of training ----------------------


def write_latents(root: Path, num: int) -> None:
    from fvstep.executor.latents import write_dataset

    g = torch.Generator().manual_seed(0)
    rows = [
        {"latents": torch.randn(4, 2, 4, 4, generator=g), "text": torch.randn(3, 16, generator=g)}
        for _ in range(num)
    ]
    write_dataset(root, [rows[: num // 2], rows[num // 2 :]])


def drawn(spec, num_steps: int, world_size: int = 1) -> list[int]:
    return [
        i
        for s in range(num_steps)
        for r in range(world_size)
        for i in spec.data.indices(s, rank=r, world_size=world_size)
    ]


def test_the_validation_items_of_a_dataset_are_never_drawn_for_training(tmp_path):
    from fvstep.executor.latents import LatentDataset
    from fvstep.executor.validation import validation_loss

    write_latents(tmp_path / "latents", 10)
    data = ["--data.path", str(tmp_path / "latents"), "--validation.num_samples", "2"]
    opts = options(tmp_path / "run", *data, "--validation.every", "1")
    spec = FINETUNE.build(opts, fresh=True)
    try:
        # Two epochs of the 8 training items, 2 a step: each drawn, the held-out 0 and 1 never.
        one, two = drawn(spec, 8), drawn(spec, 2, world_size=2)
        assert sorted(one) == sorted([*range(2, 10)] * 2), one
        assert sorted(two) == [*range(2, 10)], two
        # Validation computes on exactly the held-out items.
        ds = LatentDataset(tmp_path / "latents", fields=("latents", "text"))
        held = {k: torch.stack([ds[i][k] for i in (0, 1)]) for k in ("latents", "text")}
        expected = validation_loss(held["latents"], held["text"])(spec.state, fs.random.key(0))
        got = spec.run_options["validation"].fn(spec.state, fs.random.key(0))
        fs.tree.assert_trees_equal(dict(got), dict(expected))
    finally:
        spec.close()
    # The split does not depend on whether validation runs (a resume may turn it off).
    quiet = FINETUNE.build(options(tmp_path / "run", *data, "--validation.every", "0"), fresh=True)
    try:
        assert drawn(quiet, 8) == one
    finally:
        quiet.close()


def test_a_resume_keeps_the_split_of_a_dataset():
    """With data.path, validation.num_samples decides which items are trained on: a resume
    may change when validation runs, not how many items it holds out."""
    saved = {
        "recipe": "finetune",
        "world_size": 1,
        "options": {"data": {"path": "latents"}, "validation": {"every": 2, "num_samples": 2}},
    }
    every = {**saved, "options": {**saved["options"], "validation": {"every": 0, "num_samples": 2}}}
    assert check_config_change(saved, every) == ["validation.every: 2 -> 0"]
    more = {**saved, "options": {**saved["options"], "validation": {"every": 2, "num_samples": 3}}}
    with pytest.raises(ConfigChangeError, match="validation.num_samples was 2 .* is 3 now"):
        check_config_change(saved, more)
    synthetic = {
        **saved,
        "options": {"data": {"path": None}, "validation": saved["options"]["validation"]},
    }
    also = {
        **synthetic,
        "options": {**synthetic["options"], "validation": {"every": 2, "num_samples": 3}},
    }
    assert check_config_change(synthetic, also) == ["validation.num_samples: 2 -> 3"]


def test_a_dataset_too_small_to_hold_out_the_validation_items_is_refused(tmp_path):
    write_latents(tmp_path / "latents", 3)
    opts = options(tmp_path / "run", "--data.path", str(tmp_path / "latents"))
    with pytest.raises(ValueError, match="validation.num_samples") as e:
        FINETUNE.build(opts, fresh=True)
    assert "data.batch_size" in str(e.value) and "3 items" in str(e.value)


# -- issue 35: precision, the whole preparation, batches on the rank's device -----------


def test_config_yaml_records_the_resolved_precision_and_a_resume_in_another_is_refused(
    tmp_path, capsys
):
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--run.out", str(out), "--run.every", "1"]
    assert main([*argv, "--run.num_steps", "1"]) == 0
    saved = read_config(out)
    assert saved["precision"] == "fp32"  # "auto" on the CPU
    assert saved["options"]["prepare"]["precision"] == "auto"
    before = (out / CONFIG_NAME).read_bytes()
    capsys.readouterr()
    assert main([*argv, "--run.num_steps", "2", "--prepare.precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "precision" in err and "fp32" in err and "bf16" in err, err
    assert (out / CONFIG_NAME).read_bytes() == before


def test_bf16_precision_prepares_every_role_for_bf16_compute_over_fp32_masters(tmp_path):
    from fvstep.parallel import preparation

    dmd2 = get_recipe("dmd2")
    flags = [*FLAGS, "--run.out", str(tmp_path / "d"), "--prepare.precision", "bf16"]
    spec = dmd2.build(parse_options(dmd2, flags), fresh=True)
    for name, role in spec.state.roles.items():
        assert preparation(role.role.module).param_dtype == torch.bfloat16, name
    for name in ("student", "critic"):  # fp32 masters, fp32 moments
        assert {p.dtype for p in spec.state.roles[name].params.values()} == {torch.float32}
    teacher = spec.state.roles["teacher"].params.values()
    assert torch.bfloat16 in {p.dtype for p in teacher}  # frozen: stored in bf16
    spec.close()


def test_the_recipes_prepare_every_checkpointing_mode_and_offload_they_are_given(tmp_path):
    from fvstep.parallel import preparation

    flags = [
        *FLAGS,
        *("--model.tiny.num_layers", "4", "--run.out", str(tmp_path / "r")),
        *("--prepare.checkpointing", "narrow", "--prepare.checkpoint_every", "2"),
        *("--prepare.offload_activations_every", "2"),
    ]
    spec = FINETUNE.build(parse_options(FINETUNE, flags), fresh=True)
    described = preparation(spec.state.roles["student"].role.module).describe()
    assert described["checkpointing"] == "narrow" and described["checkpoint_every"] == 2
    assert described["checkpointed_blocks"] == 2 and described["offloaded_blocks"] == 2
    spec.close()


def test_the_recipes_batches_arrive_on_the_runs_device(tmp_path):
    from fvstep.recipes import parts

    meta = torch.device("meta")  # stands in for cuda:LOCAL_RANK (the CPU tests have none)
    o = options(tmp_path / "r")
    batch = parts.make_data(o.data, device=meta).batch(0, rank=0, world_size=1)
    assert {v.device for v in batch.values()} == {meta}
    plain = parts.make_data(o.data).batch(0, rank=0, world_size=1)
    assert {v.device.type for v in plain.values()} == {"cpu"}


# -- found by the review of issue 34 ----------------------------------------------------


def test_a_resumes_config_keeps_the_init_from_the_run_started_from(tmp_path):
    source = tmp_path / "source"
    train(FINETUNE, options(source, "--run.num_steps", "2"), log=lambda line: None)
    run = tmp_path / "run"
    start = ("--init_from.path", str(source), "--init_from.weights", "ema")
    train(FINETUNE, options(run, "--run.num_steps", "2", *start), log=lambda line: None)
    assert read_config(run)["options"]["init_from"]["weights"] == "ema"
    other = ("--init_from.path", str(source), "--init_from.weights", "params")
    train(FINETUNE, options(run, "--run.num_steps", "4", *other), log=lambda line: None)
    kept = read_config(run)["options"]["init_from"]  # the resume ignored init_from
    assert kept["weights"] == "ema" and kept["path"] == str(source)


def test_the_compile_check_may_be_switched_on_at_a_resume(tmp_path):
    saved = {"recipe": "finetune", "options": {"prepare": {"verify_compile": False}}}
    new = {"recipe": "finetune", "options": {"prepare": {"verify_compile": True}}}
    assert check_config_change(saved, new) == ["prepare.verify_compile: False -> True"]
