"""The executor: resume from the newest checkpoint, save cadence, SIGTERM, metrics JSONL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.core import tree
from fvstep.executor.data import ShuffledSource, SyntheticLatents


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
    with pytest.raises(ValueError, match="on_damaged must be 'skip' or 'error'"):
        fs.Checkpoints("x", on_damaged="ignore")


# The script holds step 3 until the test has signalled it and seen the signal handled,
# then releases it by creating the file GO: the signal falls inside a step, whatever the
# machine's speed (no sleeps as synchronisation).
SIGNAL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    # Python's own Ctrl-C handler, as in a terminal: a child started from a background
    # job inherits an ignored SIGINT, and fvstep keeps a handling it did not install.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    import fvstep as fs
    from tests.test_executor import tiny_setup
    torch.set_num_threads(1)
    state, step, data = tiny_setup()
    def held(s):
        print("step", s, flush=True)
        while s == 3 and not os.path.exists({go!r}):
            time.sleep(0.01)
        return data(s)
    result = fs.run_until(step, state, held, num_steps=100000,
                          checkpoints=fs.Checkpoints({dir!r}, every=1000), progress=False)
    print("returned", int(result.state.step), result.stopped_by, result.checkpoint, flush=True)
    """
)


def start_signal_script(tmp_path, *, raises=False):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    go = tmp_path / "go"
    script = SIGNAL_SCRIPT.format(root=root, dir=str(tmp_path / "ckpt"), go=str(go), raises=raises)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    return proc, go


def read_until(proc, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"the script ended before printing {prefix!r}:\n{''.join(lines)}")


def finish(proc) -> str:
    out = proc.stdout.read()
    proc.stdout.close()
    proc.wait(timeout=TIMEOUT_S)
    return out


# A loaded 2-core CI machine may take long to start torch: waits are generous.
TIMEOUT_S = 300


def test_sigterm_saves_at_the_step_boundary_returns_and_says_so(tmp_path):
    proc, go = start_signal_script(tmp_path)
    read_until(proc, "step 3")
    proc.send_signal(signal.SIGTERM)
    go.touch()
    out = finish(proc)
    assert proc.returncode == 0, out
    saved = tmp_path / "ckpt" / "step_000000004"
    assert f"fvstep: stopped by SIGTERM at step 4 of 100000; saved {str(saved)!r}\n" in out
    assert f"returned 4 SIGTERM {saved}\n" in out
    assert ckpt.latest(tmp_path / "ckpt") == saved


def test_run_stopped_by_sigterm_raises_interrupted_after_saving_a_loadable_checkpoint(tmp_path):
    state, step, data = tiny_setup()

    def preempt(s: int, metrics: dict) -> None:
        if s == 2:  # inside step 2's boundary: the run saves step 3, then raises
            os.kill(os.getpid(), signal.SIGTERM)

    checkpoints = fs.Checkpoints(tmp_path / "ckpt", every=1000)
    with pytest.raises(fs.Interrupted) as info:
        fs.run(
            step,
            state,
            data,
            num_steps=10,
            checkpoints=checkpoints,
            on_metrics=preempt,
            progress=False,
        )
    e = info.value
    saved = tmp_path / "ckpt" / "step_000000003"
    assert (e.signal, e.step, e.num_steps, e.checkpoint) == ("SIGTERM", 3, 10, saved)
    assert int(e.state.step) == 3 and ckpt.latest(tmp_path / "ckpt") == saved
    ckpt.lock_dir(tmp_path / "ckpt").release()  # released before raising
    loaded = ckpt.load(saved, like=tiny_setup()[0])
    fs.tree.assert_trees_equal(loaded, e.state, check_static=False)
    resumed = fs.run(
        step, tiny_setup()[0], data, num_steps=10, checkpoints=checkpoints, progress=False
    )
    assert int(resumed.step) == 10


def test_interrupted_names_the_signal_step_and_checkpoint_and_pickles():
    import pickle

    e = fs.Interrupted("SIGTERM", 4, 10, Path("ckpt/step_000000004"))
    assert "stopped by SIGTERM at step 4 of 10; saved 'ckpt/step_000000004'" in str(e)
    again = pickle.loads(pickle.dumps(e))
    assert (again.signal, again.step, again.num_steps) == ("SIGTERM", 4, 10)
    assert again.checkpoint == Path("ckpt/step_000000004") and again.state is None


def test_a_first_ctrl_c_saves_at_the_next_step_boundary_and_says_where(tmp_path):
    proc, go = start_signal_script(tmp_path)
    read_until(proc, "step 3")
    proc.send_signal(signal.SIGINT)
    read_until(proc, "fvstep: Ctrl-C: saving at the end of this step")
    go.touch()
    out = finish(proc)
    assert proc.returncode == 0, out
    saved = tmp_path / "ckpt" / "step_000000004"
    assert f"fvstep: stopped by SIGINT at step 4 of 100000; saved {str(saved)!r}\n" in out
    assert f"returned 4 SIGINT {saved}\n" in out
    assert "Traceback" not in out


def test_a_second_ctrl_c_aborts_at_once_without_saving(tmp_path):
    proc, _ = start_signal_script(tmp_path)
    read_until(proc, "step 3")
    proc.send_signal(signal.SIGINT)
    read_until(proc, "fvstep: Ctrl-C: saving at the end of this step")
    proc.send_signal(signal.SIGINT)  # step 3 is still held: only an abort ends it
    out = finish(proc)
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out
    assert "returned" not in out
    assert ckpt.list_complete(tmp_path / "ckpt") == []


def test_a_completed_run_says_so_and_names_its_checkpoint(tmp_path):
    state, step, data = tiny_setup()
    checkpoints = fs.Checkpoints(tmp_path / "ckpt", every=2)
    result = fs.run_until(step, state, data, num_steps=3, checkpoints=checkpoints, progress=False)
    assert result.completed and result.stopped_by == "completed"
    assert int(result.state.step) == 3
    assert (
        result.checkpoint == ckpt.latest(tmp_path / "ckpt") == tmp_path / "ckpt" / "step_000000003"
    )
    again = fs.run_until(
        step, tiny_setup()[0], data, num_steps=3, checkpoints=checkpoints, progress=False
    )
    assert result.resumed_from is None
    assert again.completed and again.checkpoint == again.resumed_from == result.checkpoint
    assert fs.run_until(step, tiny_setup()[0], data, num_steps=1, progress=False).checkpoint is None


def test_steps_that_train_nothing_write_no_metrics_line(tmp_path):
    state, _, data = tiny_setup()

    def loss(state, batch, key):
        return ((state.module("net")(batch["x"]) - batch["y"]) ** 2).mean()

    every_other = fs.compile(fs.every(2, fs.update("net", loss)))
    fs.run(every_other, state, data, num_steps=5, metrics_path=tmp_path / "m.jsonl", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert all(len(r) > 1 for r in rows)


# ------------------------------------------------- never a wrong value, never silently


def strict_json(line: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def with_metrics(step, extra_metrics):
    def stepped(state, batch):
        state, metrics = step(state, batch)
        return state, {**metrics, **extra_metrics(int(state.step))}

    return stepped


def test_metrics_jsonl_is_strict_json_with_null_for_nonfinite_values(tmp_path):
    state, step, data = tiny_setup()
    step = with_metrics(
        step,
        lambda s: {
            "nan": float("nan"),
            "inf": torch.tensor(float("inf")),
            "neg_inf": torch.tensor([-float("inf")]),
            "fine": 0.5,
            "vector": torch.ones(3),  # not a scalar: not logged
        },
    )
    fs.run(step, state, data, num_steps=3, metrics_path=tmp_path / "m.jsonl", progress=False)
    rows = [strict_json(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["nan"] is None and r["inf"] is None and r["neg_inf"] is None
        assert r["fine"] == 0.5 and "vector" not in r


def poison_at(step, bad_step: int):
    """A hand-written step that writes a NaN into a parameter at ``bad_step`` without raising
    (a compiled step would refuse first)."""

    def stepped(state, batch):
        state, metrics = step(state, batch)
        if int(state.step) == bad_step:
            with torch.no_grad():
                state.roles["net"].params["weight"][0, 0] = float("nan")
        return state, metrics

    return stepped


@pytest.mark.parametrize("async_save", [False, True])
def test_run_never_checkpoints_a_nonfinite_state(tmp_path, async_save):
    state, step, data = tiny_setup()
    checkpoints = fs.Checkpoints(tmp_path, every=1, keep=None, async_save=async_save)
    with pytest.raises(ckpt.CheckpointError) as info:
        fs.run(
            poison_at(step, 3), state, data, num_steps=6, checkpoints=checkpoints, progress=False
        )
    message = str(info.value)
    assert "'roles.net.params.weight'" in message and "step 3" in message, message
    assert [s for s, _ in ckpt.list_complete(tmp_path)] == [1, 2]
    assert not list(tmp_path.glob(".tmp-*"))


def run_to(tmp_path, num_steps: int, **options):
    state, step, data = tiny_setup()
    seen: list[int] = []
    final = fs.run(
        step,
        state,
        data,
        num_steps=num_steps,
        checkpoints=fs.Checkpoints(tmp_path, **options),
        progress=False,
        on_metrics=lambda s, m: seen.append(s),
    )
    return final, seen


def test_run_refuses_a_checkpoint_past_num_steps(tmp_path):
    run_to(tmp_path, 8, every=4)
    with pytest.raises(ValueError) as info:
        run_to(tmp_path, 3, every=4)
    message = str(info.value)
    assert "step 8" in message and "num_steps=3" in message and str(tmp_path) in message
    final, seen = run_to(tmp_path, 8, every=4)  # reaching it exactly is "already done"
    assert int(final.step) == 8 and seen == []


def test_run_refuses_a_state_past_num_steps():
    state, step, data = tiny_setup()
    state = fs.run(step, state, data, num_steps=4, progress=False)
    with pytest.raises(ValueError, match="state is at step 4, past num_steps=2"):
        fs.run(step, state, data, num_steps=2, progress=False)


@pytest.mark.parametrize("keep", [1, 2])
def test_async_save_leaves_exactly_keep_checkpoints(tmp_path, keep):
    final, _ = run_to(tmp_path, 7, every=2, keep=keep, async_save=True)
    assert [s for s, _ in ckpt.list_complete(tmp_path)] == [2, 4, 6, 7][-keep:]
    assert not list(tmp_path.glob(".tmp-*"))
    assert int(final.step) == 7


# ------------------------------------------------------------------ the lock


def test_a_locked_directory_fails_the_run_at_once_naming_the_holder(tmp_path):
    import socket

    seen = []
    with ckpt.lock_dir(tmp_path):
        state, step, data = tiny_setup()
        with pytest.raises(ckpt.CheckpointLockedError) as info:
            fs.run(
                step,
                state,
                data,
                num_steps=2,
                checkpoints=fs.Checkpoints(tmp_path),
                progress=False,
                on_metrics=lambda s, m: seen.append(s),
            )
    message = str(info.value)
    assert f"process {os.getpid()} on host {socket.gethostname()!r}" in message, message
    assert str(tmp_path) in message
    assert seen == [] and ckpt.list_complete(tmp_path) == []  # nothing ran, nothing written


def test_run_releases_the_lock_when_it_returns_or_raises(tmp_path):
    run_to(tmp_path, 2, every=1)
    ckpt.lock_dir(tmp_path).release()  # free again
    state, step, _ = tiny_setup()

    def crash(s):
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        fs.run(
            step, state, crash, num_steps=4, checkpoints=fs.Checkpoints(tmp_path), progress=False
        )
    with ckpt.lock_dir(tmp_path) as lock:
        assert lock.held


LOCKED_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    import fvstep as fs
    from tests.test_executor import tiny_setup
    torch.set_num_threads(1)
    state, step, data = tiny_setup()
    try:
        fs.run(step, state, data, num_steps=2, checkpoints=fs.Checkpoints({dir!r}),
               progress=False)
    except fs.checkpoint.CheckpointLockedError as e:
        print("locked:", e, flush=True)
        sys.exit(3)
    """
)


def test_a_run_in_another_process_fails_while_the_lock_is_held(tmp_path):
    import socket

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = LOCKED_SCRIPT.format(root=root, dir=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ckpt.lock_dir(tmp_path):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
        )
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"process {os.getpid()} on host {socket.gethostname()!r}" in done.stdout
    assert ckpt.list_complete(tmp_path) == []


def run_on_locked_dir(rank: int, world_size: int, root: str):
    state, step, data = tiny_setup()
    try:
        fs.run(step, state, data, num_steps=2, checkpoints=fs.Checkpoints(root), progress=False)
    except ckpt.CheckpointLockedError as e:
        return str(e)
    return "ran"


@pytest.mark.multirank
def test_a_locked_directory_fails_every_rank(ranks, tmp_path):
    with ckpt.lock_dir(tmp_path):
        messages = ranks.run(run_on_locked_dir, str(tmp_path))
    assert all(f"process {os.getpid()} " in m for m in messages), messages
    assert ckpt.list_complete(tmp_path) == []


# ------------------------------------------------------- damaged checkpoints


def damage(path, how: str) -> None:
    from tests.test_checkpoint import corrupt_leaf_bytes, shard_files

    if how == "deleted_shard":
        shard_files(path)[0].unlink()
    elif how == "checksum":
        leaf = "roles.net.params.weight"
        like, _, _ = tiny_setup()
        value = ckpt.load(path, like=like).roles["net"].params["weight"]
        corrupt_leaf_bytes(path, leaf, value)
    elif how == "manifest_field":
        body = json.loads((path / "manifest.json").read_text())
        del body["leaves"]["roles.net.params.weight"]["dtype"]
        (path / "manifest.json").write_text(json.dumps(body))
    else:  # a manifest that is not UTF-8
        (path / "manifest.json").write_bytes(b"\xff" + (path / "manifest.json").read_bytes())


@pytest.mark.parametrize("how", ["deleted_shard", "checksum", "manifest_field", "manifest_bytes"])
def test_run_resumes_from_the_newest_checkpoint_that_verifies(tmp_path, how):
    reference, _ = run_to(tmp_path / "reference", 6, every=100)
    run_to(tmp_path, 4, every=1, keep=2)  # step_3, step_4
    damaged = ckpt.checkpoint_dir(tmp_path, 4)
    damage(damaged, how)
    with pytest.warns(ckpt.CheckpointSkippedWarning, match="step_000000004") as record:
        final, seen = run_to(tmp_path, 6, every=1, keep=2)
    assert len(record) == 1 and "step_000000003" in str(record[0].message)
    assert seen == [3, 4, 5]  # resumed from step 3, not from scratch
    tree.assert_trees_equal(final, reference, check_static=False)
    # the damaged one is kept for inspection, but it is no checkpoint any more: it neither
    # pushed the good ones out of keep=2 nor was it overwritten by the new step_4
    assert (tmp_path / "step_000000004.damaged").is_dir()
    assert [s for s, _ in ckpt.list_complete(tmp_path)] == [5, 6]


def test_on_damaged_error_refuses_to_resume_past_a_damaged_checkpoint(tmp_path):
    run_to(tmp_path, 4, every=1, keep=2)
    damage(ckpt.checkpoint_dir(tmp_path, 4), "checksum")
    with pytest.raises(ckpt.DamagedCheckpointError, match="step_000000004.*checksum"):
        run_to(tmp_path, 6, every=1, on_damaged="error")
    assert ckpt.checkpoint_dir(tmp_path, 4).is_dir()  # left where it was


def test_run_does_not_start_over_when_every_checkpoint_is_damaged(tmp_path):
    run_to(tmp_path, 2, every=1, keep=2)
    for s in (1, 2):
        damage(ckpt.checkpoint_dir(tmp_path, s), "deleted_shard")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint .* can be loaded"):
        run_to(tmp_path, 4, every=1)
    assert [s for s, _ in ckpt.directories.list_step_dirs(tmp_path)] == [1, 2]  # nothing renamed


def run_sharded_resume(rank: int, world_size: int, root: str, num_steps: int, damage_at):
    """A hand-written step on two ranks (a per-rank value in extra); rank 1 damages its own
    per-rank value in the checkpoint ``damage_at``."""
    from tests.test_checkpoint import corrupt_leaf_bytes

    state = fs.TrainState.create(
        {"net": fs.Role(torch.nn.Linear(4, 4))},  # frozen: the step below trains nothing
        key=fs.random.key(0),
        extra={"per_rank": torch.arange(4.0) + 10.0 * rank},
    )

    def step(state, batch):
        with torch.no_grad():
            state.extra["per_rank"].add_(1.0)
            state.step.add_(1)
        return state, {}

    if damage_at is not None and rank == 1:
        path = ckpt.checkpoint_dir(root, damage_at)
        value = torch.arange(4.0) + 10.0 + damage_at
        corrupt_leaf_bytes(path, "extra.per_rank", value)
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = fs.run(
            step,
            state,
            lambda s: None,
            num_steps=num_steps,
            checkpoints=fs.Checkpoints(root, every=1, keep=3),
            progress=False,
        )
    skipped = [str(w.message) for w in caught if w.category is ckpt.CheckpointSkippedWarning]
    return int(final.step), final.extra["per_rank"].tolist(), skipped


@pytest.mark.multirank
def test_a_checkpoint_damaged_on_one_rank_is_skipped_by_every_rank(ranks, tmp_path):
    ranks.run(run_sharded_resume, str(tmp_path), 3, None)
    results = ranks.run(run_sharded_resume, str(tmp_path), 5, 3)
    for rank, (step, values, skipped) in enumerate(results):
        assert step == 5 and values == [5.0 + 10 * rank + i for i in range(4)]
        assert len(skipped) == 1 and "step_000000003" in skipped[0], skipped
    assert (tmp_path / "step_000000003.damaged").is_dir()
