"""The executor: resume from the newest checkpoint, save cadence, SIGTERM, metrics JSONL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep import tree
from fvstep.data import ShuffledSource, SyntheticLatents


def tiny_setup(seed: int = 0):
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 4)
    state = fs.TrainState.create(
        {"net": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-2))}, key=fs.random.key(seed)
    )

    def loss(state, batch, key):
        return ((state.module("net")(batch["x"]) - batch["y"]) ** 2).mean()

    def data(step):
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(2, 4, generator=g), "y": torch.randn(2, 4, generator=g)}

    return state, fs.compile(fs.update("net", loss)), data


def test_run_saves_every_n_steps_and_at_the_end_keeping_the_newest(tmp_path):
    state, step, data = tiny_setup()
    final = fs.run(
        step,
        state,
        data,
        num_steps=7,
        checkpoints=fs.Checkpoints(tmp_path, every=3, keep=2),
        progress=False,
    )
    assert int(final.step) == 7
    assert [s for s, _ in ckpt.list_complete(tmp_path)] == [6, 7]


def test_run_resumes_from_the_latest_checkpoint_and_continues_exactly(tmp_path):
    state, step, data = tiny_setup()
    reference = fs.run(step, state, data, num_steps=6, progress=False)
    reference = tree.clone(reference)
    state, step, data = tiny_setup()
    fs.run(
        step,
        state,
        data,
        num_steps=4,
        checkpoints=fs.Checkpoints(tmp_path, every=2),
        progress=False,
    )
    seen = []
    state, step, data = tiny_setup()
    resumed = fs.run(
        step,
        state,
        data,
        num_steps=6,
        checkpoints=fs.Checkpoints(tmp_path, every=2),
        progress=False,
        on_metrics=lambda s, m: seen.append(s),
    )
    assert seen == [4, 5]  # nothing before the checkpoint was recomputed
    tree.assert_trees_equal(resumed, reference, check_static=False)


def test_metrics_jsonl_drops_lines_of_steps_a_resume_recomputes(tmp_path):
    state, step, data = tiny_setup()

    def crash_at_5(s):
        if s == 5:
            raise RuntimeError("crash")
        return data(s)

    with pytest.raises(RuntimeError, match="crash"):
        fs.run(
            step,
            state,
            crash_at_5,
            num_steps=8,
            checkpoints=fs.Checkpoints(tmp_path, every=2),
            progress=False,
        )
    state, step, data = tiny_setup()
    fs.run(
        step,
        state,
        data,
        num_steps=8,
        checkpoints=fs.Checkpoints(tmp_path, every=2),
        progress=False,
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))
    assert all("net/loss" in r and "net/lr" in r for r in rows)


def test_run_takes_a_shuffled_source_as_data(tmp_path):
    source = ShuffledSource(
        SyntheticLatents(12, key=fs.random.key(1), shape=(4,), text_shape=(4,)),
        key=fs.random.key(2),
        batch_size=2,
    )
    state, step, _ = tiny_setup()
    step = fs.compile(
        fs.update("net", lambda s, b, k: ((s.module("net")(b["latents"]) - b["text"]) ** 2).mean())
    )
    final = fs.run(step, state, source, num_steps=8, progress=False)
    assert int(final.step) == 8


def test_bad_checkpoint_settings_are_rejected():
    with pytest.raises(ValueError, match="every must be >= 1"):
        fs.Checkpoints("x", every=0)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        fs.Checkpoints("x", keep=0)


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {root!r})
    import fvstep as fs
    from tests.test_executor import tiny_setup
    torch.set_num_threads(1)
    state, step, data = tiny_setup()
    def slow(s):
        print("step", s, flush=True)
        time.sleep(0.05)
        return data(s)
    final = fs.run(step, state, slow, num_steps=100000,
                   checkpoints=fs.Checkpoints({dir!r}, every=1000), progress=False)
    print("returned at", int(final.step), flush=True)
    """
)


def test_sigterm_saves_and_returns_cleanly(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = SIGTERM_SCRIPT.format(root=root, dir=str(tmp_path / "ckpt"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 3"):
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.stdout.read()
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    returned = int(out.split("returned at")[-1])
    assert returned >= 4
    assert ckpt.latest(tmp_path / "ckpt").name == f"step_{returned:09d}"
