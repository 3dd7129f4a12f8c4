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
from fvstep.cli_export import _load_run
from fvstep.cli_train import EXIT_INTERRUPTED

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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
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
    assert f"stopped by SIGTERM at step {HOLD_AT + 1} of {NUM_STEPS}" in out, out
    assert "run the same command again to resume" in out
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
