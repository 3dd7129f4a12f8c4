"""What a first-time user tripped over, each pinned by a test that fails if it comes back.

Batches made for another model, bf16 latents for an fp32 model, a schedule counted in
steps where it counts updates, an unfinished checkpoint folder, an unsharded factory on
two ranks, latents no Wan patch fits, a missing optional package.
"""

from __future__ import annotations

import pytest
import torch

import fvstep as fs
from fvstep.executor import latents, media, trackers
from fvstep.methods import dmd2_losses, finetune, flow_matching_loss, lora
from fvstep.methods._checks import check_batch
from fvstep.methods.models import synthetic_batch, tiny_wan


def _student_state(module: torch.nn.Module | None = None) -> fs.TrainState:
    return fs.TrainState.create(
        {"student": fs.Role(module or tiny_wan(seed=0), optimizer=fs.optim.adamw(lr=1e-3))},
        key=fs.random.key(0),
    )


def _batch(**kwargs: object) -> dict[str, torch.Tensor]:
    return synthetic_batch(fs.random.key(1), batch_size=2, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# The method's boundary: bf16 latents, wrong sizes, missing keys
# --------------------------------------------------------------------------------------


def test_bf16_latents_train_an_fp32_model_as_their_fp32_upcast_would() -> None:
    batch = _batch()
    low = {k: v.bfloat16() for k, v in batch.items()}
    upcast = {k: v.float() for k, v in low.items()}
    step = fs.compile(finetune())
    got, got_metrics = step(_student_state(), low)
    want, want_metrics = step(_student_state(), upcast)
    fs.tree.assert_trees_equal(got.roles["student"].params, want.roles["student"].params)
    assert got_metrics["student/loss"] == want_metrics["student/loss"]


def test_the_boundary_leaves_a_batch_in_the_role_dtype_as_it_is() -> None:
    state, batch = _student_state(), _batch()
    assert check_batch(state, batch, "student") is batch


def test_the_boundary_never_casts_under_autocast_nor_downcasts() -> None:
    state, batch = _student_state(), _batch()
    low = {k: v.bfloat16() for k, v in batch.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert check_batch(state, low, "student") is low
    bf16 = fs.TrainState.create(
        {"teacher": fs.Role(tiny_wan(seed=0).bfloat16())}, key=fs.random.key(0)
    )
    assert check_batch(bf16, batch, "teacher") is batch  # fp32 stays fp32


def test_the_boundary_leaves_the_dtype_to_a_boundary_cast_of_prepare() -> None:
    module = fs.parallel.prepare(tiny_wan(seed=0), trainable=False, frozen_dtype=torch.bfloat16)
    state = fs.TrainState.create({"teacher": fs.Role(module)}, key=fs.random.key(0))
    low = {k: v.bfloat16() for k, v in _batch().items()}
    assert check_batch(state, low, "teacher") is low


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (lambda: _batch(channels=3), r"batch\['latents'\] has 3 channels.*in_channels=4"),
        (lambda: _batch(text_dim=8), r"batch\['text'\] has width 8.*text_dim=16"),
        (lambda: _batch(height=5), r"\(frames, height, width\) = \(2, 5, 4\).*patch_size"),
        (lambda: {"latents": torch.zeros(2, 4, 4, 4), "text": torch.zeros(2, 3, 16)}, "video"),
        (lambda: {"latents": torch.zeros(2, 4, 2, 4, 4), "text": torch.zeros(3, 3, 16)}, "agree"),
    ],
)
def test_a_batch_for_another_model_is_refused_naming_key_and_shape(batch, message) -> None:
    step = fs.compile(finetune())
    with pytest.raises(ValueError, match=message):
        step(_student_state(), batch())


def test_a_missing_batch_key_is_named_with_the_keys_there_are() -> None:
    loss = flow_matching_loss()
    with pytest.raises(KeyError, match=r"no 'text' \(it has \['latents'\]\)"):
        loss(_student_state(), {"latents": _batch()["latents"]}, fs.random.key(0))


def test_dmd2_checks_its_batch_at_each_loss() -> None:
    losses = dmd2_losses()
    state = fs.TrainState.create(
        {
            "student": fs.Role(tiny_wan(seed=0), optimizer=fs.optim.adamw(lr=1e-3)),
            "teacher": fs.Role(tiny_wan(seed=1)),
            "critic": fs.Role(tiny_wan(seed=2), optimizer=fs.optim.adamw(lr=1e-3)),
        },
        key=fs.random.key(0),
    )
    for loss in losses:
        with pytest.raises(ValueError, match="in_channels=4"):
            loss(state, _batch(channels=3), fs.random.key(0))


# --------------------------------------------------------------------------------------
# Schedules count updates: a run that disagrees with its schedule's length is told so
# --------------------------------------------------------------------------------------


def _linear_loss(state: fs.TrainState, batch: torch.Tensor, key: torch.Tensor) -> tuple:
    return state.module("student")(batch).pow(2).mean(), {}


def _every_second_step(total_steps: int) -> tuple[fs.TrainState, fs.Step]:
    lr = fs.schedules.warmup_cosine(1e-2, warmup_steps=1, total_steps=total_steps)
    module = torch.nn.Linear(3, 2)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=lr))}, key=fs.random.key(0)
    )
    return state, fs.compile(fs.every(2, fs.update("student", _linear_loss)))


def test_run_warns_when_a_schedule_counts_steps_where_the_role_makes_fewer_updates() -> None:
    from fvstep.executor.schedule_check import ScheduleLengthWarning

    state, step = _every_second_step(total_steps=8)
    with pytest.warns(ScheduleLengthWarning, match=r"total_steps=8 .* made 4 .*total_steps=4"):
        fs.run(step, state, lambda i: torch.ones(2, 3), num_steps=8, progress=False)


def test_run_is_silent_when_the_schedule_counts_the_role_updates() -> None:
    state, step = _every_second_step(total_steps=4)
    done = fs.run(step, state, lambda i: torch.ones(2, 3), num_steps=8, progress=False)
    assert int(done.roles["student"].opt_state.count) == 4


def test_the_decaying_schedules_carry_their_length() -> None:
    from fvstep.executor.schedule_check import schedule_length

    s = fs.schedules
    for schedule in (
        s.warmup_cosine(1.0, warmup_steps=1, total_steps=7),
        s.cosine(1.0, total_steps=7),
        s.warmup_cosine_restarts(1.0, warmup_steps=1, total_steps=7),
        s.warmup_linear(1.0, warmup_steps=1, total_steps=7),
        s.linear_decay(1.0, total_steps=7),
        s.polynomial(1.0, warmup_steps=1, total_steps=7),
    ):
        assert schedule_length(schedule) == 7, schedule.__name__
    assert schedule_length(s.constant(1.0)) is None and schedule_length(1e-3) is None


# --------------------------------------------------------------------------------------
# A step folder without a manifest: an unfinished save, to latest() and to fs.run alike
# --------------------------------------------------------------------------------------


def test_a_step_folder_without_manifest_past_num_steps_is_set_aside_not_blocking(
    tmp_path,
) -> None:
    from fvstep.checkpoint import CheckpointSkippedWarning

    state, step = _every_second_step(total_steps=2)
    ckpt = fs.Checkpoints(tmp_path, every=2, keep=None)
    data = lambda i: torch.ones(2, 3)  # noqa: E731
    fs.run(step, state, data, num_steps=4, checkpoints=ckpt, progress=False)
    (tmp_path / "step_000000010").mkdir()  # a save that died before its manifest
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "step_000000004"
    again, _ = _every_second_step(total_steps=3)
    with pytest.warns(CheckpointSkippedWarning, match="step_000000010.*no manifest"):
        done = fs.run(step, again, data, num_steps=6, checkpoints=ckpt, progress=False)
    assert int(done.step) == 6
    assert (tmp_path / "step_000000010.damaged").is_dir()  # kept, never deleted


# --------------------------------------------------------------------------------------
# fvstep data encode: a size whose latents no Wan patch fits is refused at the CLI
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (["--height", "30", "--width", "32"], "--height 30 is not a multiple of 16.*16 or 32"),
        (["--height", "32", "--width", "8"], "--width 8 is not a multiple of 16.*e.g. 16$"),
        (["--height", "40", "--width", "32", "--multiple", "8"], None),
    ],
)
def test_encode_refuses_a_size_no_patch_fits_in_one_line(tmp_path, capsys, size, message):
    import re

    from fvstep.cli import main

    missing = tmp_path / "no-clips"  # a valid size gets past the check, to this error
    code = main(["data", "encode", str(missing), str(tmp_path / "out"), "--model", "m", *size])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    if message is None:
        assert "does not exist" in err
    else:
        assert re.search(message, err), err


# --------------------------------------------------------------------------------------
# verify-resume --nproc 2 with a factory that does not shard: one line on stderr
# --------------------------------------------------------------------------------------


def unsharded_factory() -> tuple:
    """A factory that forgets to shard its role on several ranks."""
    module = torch.nn.Linear(3, 2)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-2))}, key=fs.random.key(0)
    )
    return state, fs.compile(fs.update("student", _linear_loss)), lambda i: torch.ones(2, 3)


@pytest.mark.multirank
def test_verify_resume_on_two_ranks_refuses_an_unsharded_factory_in_one_line() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = ["verify-resume", "tests.test_paper_cuts:unsharded_factory", "--nproc", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "fvstep", *command, "--steps", "2", "--interrupt", "1"],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)},
        timeout=300,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "is trained on 2 ranks but its module is not sharded" in lines[0]
    assert "shard_module" in lines[0]


# --------------------------------------------------------------------------------------
# A missing optional package names the extra that installs it
# --------------------------------------------------------------------------------------

_OPTIONAL = {
    "diffusers",
    "peft",
    "pyarrow",
    "av",
    "imageio",
    "safetensors",
    "transformers",
    "wandb",
    "tensorboard",
}


def _missing(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    import sys

    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            monkeypatch.delitem(sys.modules, name)
    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now fails


@pytest.mark.parametrize(
    ("packages", "call", "extra"),
    [
        (("pyarrow",), lambda tmp: latents.write_shard(tmp / "s", [{"x": 1}]), "data"),
        (("diffusers",), lambda tmp: tiny_wan(seed=0), "models"),
        (("wandb",), lambda tmp: trackers.WandbTracker(project="p").start(0), "tracking"),
        (("imageio",), lambda tmp: media.write_gif(torch.zeros(1, 3, 8, 8), tmp / "a"), "media"),
        (("peft",), lambda tmp: lora.add_adapters(torch.nn.Linear(2, 2), {}), "lora"),
    ],
)
def test_a_missing_optional_package_names_its_extra(
    monkeypatch, tmp_path, packages, call, extra
) -> None:
    _missing(monkeypatch, *packages)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'fvstep\[{extra}\]'"):
        call(tmp_path)


def test_every_optional_import_of_the_library_names_its_extra() -> None:
    import ast

    from tests.test_architecture import APPLICATIONS, MODULES

    def guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return True
            if isinstance(node, ast.With) and "needs_extra" in ast.unparse(node.items[0]):
                return True
            if isinstance(node, ast.Try) and any(  # a soft dependency: tqdm, matplotlib
                "ImportError" in ast.unparse(h.type) for h in node.handlers if h.type
            ):
                return True
        return False

    bare = []
    for module, path in MODULES.items():
        if any(module == a or module.startswith(a + ".") for a in APPLICATIONS):
            continue
        tree = ast.parse(path.read_text())
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.removeprefix("torch.utils.")]
            else:
                continue
            if {n.split(".")[0] for n in names} & _OPTIONAL and not guarded(node, parents):
                bare.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bare, "imports of optional packages outside `with needs_extra(...)`: " + "; ".join(
        bare
    )


# --------------------------------------------------------------------------------------
# Console: a message is a line of its own beside the progress bar; the bar's lock is no
# semaphore that a rank killed by a signal would leak
# --------------------------------------------------------------------------------------


def test_a_console_line_is_not_glued_to_the_progress_bar(capsys) -> None:
    from fvstep.executor.reporting import console_line, progress_bar

    bar = progress_bar(True, 0, 4)
    assert bar is not None
    bar.update(1)
    console_line("fvstep: Ctrl-C: saving")
    bar.close()
    err = capsys.readouterr().err
    before = err[: err.index("fvstep: Ctrl-C: saving")]
    assert before == "" or before[-1] in "\r\n", repr(before[-40:])


def test_the_progress_bar_takes_a_thread_lock_not_a_semaphore() -> None:
    import multiprocessing.synchronize

    from tqdm.auto import tqdm

    from fvstep.executor.reporting import progress_bar

    bar = progress_bar(True, 0, 1)
    try:
        locks = [tqdm.get_lock(), *getattr(tqdm.get_lock(), "locks", [])]
        assert not any(isinstance(x, multiprocessing.synchronize.SemLock) for x in locks)
    finally:
        bar.close()


# --------------------------------------------------------------------------------------
# The demo says why its val/loss may rise, in the summary and on the plot
# --------------------------------------------------------------------------------------


def test_the_demo_summary_explains_a_rising_validation_loss(tmp_path) -> None:
    import json

    from fvstep.cli.demo import _validation_line
    from fvstep.cli.demo_runs import VAL_LOSS_NOTE, plot_losses

    for run in ("uninterrupted", "interrupted"):
        (tmp_path / run).mkdir()
        rows = [
            {"step": s, "val/loss": 1 + s / 10, "critic/loss": 1, "student/loss": 1} for s in (0, 4)
        ]
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _validation_line(tmp_path)
    assert line.startswith("val/loss 1.0000 -> 1.4000") and VAL_LOSS_NOTE in line
    assert "one-step generator" in VAL_LOSS_NOTE
    assert plot_losses(tmp_path, resumed_from=4, crashed_before=6) == tmp_path / "losses.png"


def check_bf16_latents_on_sharded_roles(rank: int, world_size: int) -> dict[str, bool]:
    """On each rank: a sharded fp32 student trains on bf16 latents as on their fp32 upcast;
    under FSDP2 mixed precision (which casts inputs itself) the batch is left alone."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fvstep import parallel

    def sharded(**options: object) -> fs.TrainState:
        module = parallel.shard_module(tiny_wan(seed=0), mesh=parallel.make_mesh(), **options)
        return _student_state(module)

    low = {k: v.bfloat16() for k, v in _batch().items()}
    upcast = {k: v.float() for k, v in low.items()}
    step, layout = fs.compile(finetune()), parallel.Layout()
    got, _ = step(sharded(), low, parallelism=layout)
    want, _ = step(sharded(), upcast, parallelism=layout)
    mixed = sharded(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return {
        "upcast_equal": fs.tree.tree_digest(got.roles["student"].params)
        == fs.tree.tree_digest(want.roles["student"].params),
        "mixed_left_alone": check_batch(mixed, low, "student") is low,
        "plain_upcast": check_batch(sharded(), low, "student")["latents"].dtype == torch.float32,
    }


@pytest.mark.multirank
def test_bf16_latents_train_a_sharded_fp32_model_on_two_ranks(ranks) -> None:
    for result in ranks.run(check_bf16_latents_on_sharded_roles):
        assert all(result.values()), result


# --------------------------------------------------------------------------------------
# fvstep train's front door: --help with descriptions, a recipe of the working directory,
# an init_from state with nothing left to train, a misspelt key
# --------------------------------------------------------------------------------------


def test_train_help_shows_each_options_description(capsys) -> None:
    from fvstep.cli import main
    from tests.test_docs_facts import _pyproject

    dependencies = _pyproject()["project"]["dependencies"]
    assert any(r.startswith("docstring-parser") for r in dependencies)  # jsonargparse reads them
    assert main(["train", "finetune", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--optim.lr LR The learning rate (a resumed run may change it" in text, text


def test_a_recipe_in_the_working_directory_is_found_by_module_and_attribute(
    tmp_path, monkeypatch
) -> None:
    import sys

    from fvstep.recipes import get_recipe

    (tmp_path / "my_cwd_recipe.py").write_text(
        "from fvstep.recipes import Recipe\n"
        "from fvstep.recipes.finetune import FinetuneOptions, build\n"
        "RECIPE = Recipe('mine', FinetuneOptions, build)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_recipe", raising=False)
    assert get_recipe("my_cwd_recipe:RECIPE").name == "mine"


@pytest.mark.parametrize("num_steps", [2, 1])
def test_init_from_a_state_with_no_step_left_to_train_is_refused_naming_both_steps(
    tmp_path, monkeypatch, capsys, num_steps
) -> None:
    from fvstep.cli import main

    monkeypatch.chdir(tmp_path)
    run = ["train", "finetune", "--run.progress", "false", "--model.tiny.num_layers", "1"]
    assert main([*run, "--run.out", "a", "--run.num_steps", "2"]) == 0
    capsys.readouterr()
    init = ["--init_from.path", "a", "--init_from.kind", "state"]
    assert main([*run, "--run.out", "b", *init, "--run.num_steps", str(num_steps)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"is at step 2 and run.num_steps is {num_steps}" in err, err
    assert not (tmp_path / "b").exists()
    assert main([*run, "--run.out", "b", *init, "--run.num_steps", "3"]) == 0  # one step left


def test_a_misspelt_key_is_answered_with_the_closest_key(capsys) -> None:
    from fvstep.cli import main

    assert main(["train", "finetune", "--optim.lrr", "1"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --optim.lrr 1: did you mean --optim.lr?" in err, err
    assert main(["train", "dmd2", "--run.nm_steps", "3", "--critic_lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --run.num_steps for --run.nm_steps, --critic_lr for --critic_lrr?" in err
    assert main(["train", "finetune", "--bogus", "1"]) == 2
    assert "did you mean" not in capsys.readouterr().err
