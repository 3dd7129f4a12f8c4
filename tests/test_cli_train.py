"""``fvstep train`` and ``fvstep export`` end to end: a folder of mp4 files, ``fvstep data
encode``, ``fvstep train finetune --config examples/finetune_tiny.yaml`` killed by SIGTERM
to its process group and resumed by the same command, bitwise equal to an uninterrupted
run, then ``fvstep export`` and a diffusers pipeline that loads the export and samples.
Tiny real models (the pipeline of :mod:`fvstep.recipes.tiny_pipeline`), nothing downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.cli import main
from fvstep.cli.export import _load_run
from fvstep.cli.train import EXIT_INTERRUPTED

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_tiny.yaml"
HELD = ROOT / "tests" / "held_trainer.py"
TIMEOUT_S = 300  # a loaded 2-core CI machine may take long to start torch
HOLD_AT = 3  # the held trainer waits for SIGTERM in step 3: it saves step 4
NUM_STEPS = 6  # run.num_steps of the example


def write_clips(root: Path, num: int = 4) -> None:
    import av

    root.mkdir()
    rng = np.random.RandomState(0)
    for i in range(num):
        frames = (rng.rand(5, 16, 32, 3) * 255).astype(np.uint8)
        with av.open(str(root / f"clip{i}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
        (root / f"clip{i}.txt").write_text(f"clip number {i}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """``clips/`` (mp4 + captions), ``tiny-wan/`` (a pipeline folder) and ``latents/``
    made from them by ``fvstep data encode``: what the example config names."""
    from fvstep.recipes.tiny_pipeline import save_tiny_pipeline

    root = tmp_path_factory.mktemp("train")
    write_clips(root / "clips")
    save_tiny_pipeline(root / "tiny-wan")
    here = os.getcwd()
    os.chdir(root)
    try:
        encode = ["data", "encode", "clips", "latents", "--model", "tiny-wan"]
        assert main([*encode, "--max-tokens", "16", "--dtype", "float32"]) == 0
    finally:
        os.chdir(here)
    return root


def held_train(workdir: Path, command: list[str], log: Path) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, str(HELD), str(HOLD_AT), str(workdir / "held"), *command],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a scheduler's job
        )


def wait_for(path: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the trainer never reached step {HOLD_AT}:\n{log.read_text()}")
        time.sleep(0.05)  # polling for the trainer's marker; the signal itself is not timed


def test_train_killed_by_sigterm_resumes_bitwise_then_exports_a_pipeline_that_samples(
    workdir, monkeypatch, capsys
):
    from diffusers import WanPipeline

    monkeypatch.chdir(workdir)
    command = ["train", "finetune", "--config", str(EXAMPLE)]
    log = workdir / "held.log"
    proc = held_train(workdir, command, log)
    try:
        # The reference, uninterrupted, in this process while the trainer starts up.
        assert main([*command, "--run.out", "runs/uninterrupted"]) == 0
        wait_for(workdir / "held", proc, log)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as torchrun and SLURM do
        assert proc.wait(timeout=TIMEOUT_S) == EXIT_INTERRUPTED, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    saved = f"saved '{Path('runs/finetune-tiny') / f'step_{HOLD_AT + 1:09d}'}'"
    assert f"fvstep: stopped by SIGTERM at step {HOLD_AT + 1} of {NUM_STEPS}; {saved}" in out, out
    assert out.count("stopped by SIGTERM") == 1, out  # one line, fvstep.run's
    run = Path("runs/finetune-tiny")
    assert ckpt.latest(run) == run / f"step_{HOLD_AT + 1:09d}"
    capsys.readouterr()

    assert main(command) == 0  # the same command: resumes
    assert f"resuming from {run / f'step_{HOLD_AT + 1:09d}'}" in capsys.readouterr().out

    resumed, _ = _load_run(str(run))
    uninterrupted, _ = _load_run("runs/uninterrupted")
    assert int(resumed.step) == NUM_STEPS
    fs.tree.assert_trees_equal(resumed, uninterrupted, check_static=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    again = Path("runs/uninterrupted/metrics.jsonl").read_text().splitlines()
    assert rows == [json.loads(line) for line in again] and [r["step"] for r in rows] == [
        *range(NUM_STEPS)
    ]

    export = ["export", str(run), "--out", "exports/pipe", "--format", "pipeline"]
    assert main([*export, "--base", "tiny-wan", "--weights", "ema"]) == 0
    pipe = WanPipeline.from_pretrained("exports/pipe")
    ema = resumed.roles["student"].ema.params
    for name, p in pipe.transformer.named_parameters():
        assert torch.equal(p.detach(), ema[name]), name
    frames = pipe(
        "clip number 1",
        height=16,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=16,
        output_type="np",
    ).frames
    assert frames.shape == (1, 5, 16, 32, 3) and np.isfinite(frames).all()


def test_dry_run_prints_the_resolved_config_and_the_plan_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "dmd2", "--dry-run", "--run.out", str(out), "--model.tiny.num_layers", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recipe: dmd2" in printed and "critic_lr: 0.0004" in printed
    assert "step 0: dmd2_fused updates student, critic" in printed
    assert "step 1: dmd2_critic updates critic (1 micro-batch, clip 1.0)" in printed
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--optim.lrr", "1"], "optim.lrr"),
        (["train", "finetune", "--run.num_steps", "x"], "run.num_steps"),
        (["train", "nope"], "unknown recipe 'nope': choose one of finetune, dmd2, lora_dmd2"),
        (["train", "--nproc", "0"], "--nproc must be >= 1"),
        (["export", "nowhere", "--out", "x"], "neither a checkpoint"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_train_help_lists_the_recipes_keys_and_the_exit_codes(capsys):
    assert main(["train", "lora_dmd2", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--lora.rank" in out and "--init_from.kind" in out and "75 stopped by SIGTERM" in out


def test_train_with_no_arguments_runs_the_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 0
    assert "run folder runs/finetune" in capsys.readouterr().out
    assert ckpt.latest("runs/finetune").name == "step_000000010"


@pytest.mark.heavy
def test_export_writes_lora_weights_and_a_merged_model_of_a_lora_run(tmp_path, monkeypatch):
    from diffusers import WanTransformer3DModel

    monkeypatch.chdir(tmp_path)
    run = ["train", "lora_dmd2", "--run.num_steps", "1", "--run.progress", "false"]
    assert main([*run, "--model.tiny.num_layers", "1"]) == 0
    assert main(["export", "runs/lora_dmd2", "--out", "lora", "--format", "lora"]) == 0
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    export = ["export", "runs/lora_dmd2", "--out", "merged", "--format", "merged"]
    assert main([*export, "--weights", "ema"]) == 0
    merged = WanTransformer3DModel.from_pretrained("merged")
    assert sum(p.numel() for p in merged.parameters()) > 0
    assert (
        main(["export", "runs/lora_dmd2", "--out", "y", "--format", "lora", "--role", "teacher"])
        == 2
    )


@pytest.mark.heavy
@pytest.mark.multirank
def test_train_on_two_ranks_resumes_and_exports_on_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = ["train", "dmd2", "--nproc", "2", "--run.progress", "false", "--run.every", "2"]
    assert main([*run, "--run.num_steps", "2"]) == 0
    assert main([*run, "--run.num_steps", "3"]) == 0  # resumed on 2 ranks
    assert ckpt.latest("runs/dmd2").name == "step_000000003"
    assert main(["export", "runs/dmd2", "--out", "student", "--weights", "ema"]) == 0
    assert (tmp_path / "student" / "config.json").is_file()
