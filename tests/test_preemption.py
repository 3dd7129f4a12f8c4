"""Preemption with the worker loader on: SIGTERM to the whole process group (what torchrun,
``kill -- -PGID``, SLURM and most schedulers deliver) saves at the step boundary, and the
checkpoint resumes bitwise; the loader's workers outlive the signal and end with their
trainer, leaving no orphan.

The trainer is ``tests/preempted_trainer.py``: it waits after a known step until it has
itself received SIGTERM, so nothing here sleeps to synchronise; the test polls for its
marker file (generous timeouts: a loaded 2-core CI machine may take long to start torch).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fvstep import checkpoint as ckpt
from fvstep.core import random as fr
from fvstep.executor.latents import latent_source
from tests.preempted_trainer import HOLD_AT, NUM_STEPS
from tests.test_latents import make_dataset

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "preempted_trainer.py")
TIMEOUT_S = 300


def _command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, SCRIPT]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", str(nproc), "--max-restarts", "0", SCRIPT),
    ]


def _start(nproc: int, *args: object, log: Path) -> subprocess.Popen:
    """The trainer (or torchrun and its ranks), in a process group of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:  # a file, not a pipe: nobody reads while the test polls
        return subprocess.Popen(
            [*_command(nproc), *map(str, args)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return log.read_text()


def _wait_for_markers(proc: subprocess.Popen, marker: Path, nproc: int, log: Path) -> list[dict]:
    """Poll for every rank's marker; fail at once (with the log) if the trainer ends first."""
    paths = [Path(f"{marker}.rank{r}") for r in range(nproc)]
    deadline = time.monotonic() + TIMEOUT_S
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"the trainer ended before step {HOLD_AT}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"no marker within {TIMEOUT_S} s:\n{log.read_text()}")
        time.sleep(0.05)
    return [json.loads(p.read_text()) for p in paths]


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return True


def _assert_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not all(_is_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"{what} still running: {pids}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("latents")
    make_dataset(root, 24, num_shapes=2, shard_size=5)
    return root


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.multirank)])
def test_sigterm_to_the_process_group_saves_at_the_step_boundary_and_resumes_bitwise(
    dataset, tmp_path, nproc
):
    marker, log = tmp_path / "marker", tmp_path / "train.log"
    trainer = _start(nproc, "train", dataset, tmp_path / "ckpt", marker, log=log)
    held = _wait_for_markers(trainer, marker, nproc, log)
    assert all(len(h["workers"]) == 2 for h in held), held  # the loader's default: 2 workers
    os.killpg(trainer.pid, signal.SIGTERM)
    out = _finish(trainer, log)

    saved = tmp_path / "ckpt" / f"step_{HOLD_AT + 1:09d}"
    assert out.count(f"returned {HOLD_AT + 1} SIGTERM {saved}\n") == nproc, out
    assert f"fvstep: stopped by SIGTERM at step {HOLD_AT + 1} of {NUM_STEPS}" in out, out
    if nproc == 1:
        assert trainer.returncode == 0 and "Traceback" not in out, out
    else:  # torchrun's agent ends with its own SignalException; no rank may have failed
        assert "ChildFailedError" not in out and "[rank" not in out, out
    assert ckpt.list_complete(tmp_path / "ckpt") == [(HOLD_AT + 1, saved)]
    # The workers outlived the signal (the save above needed them not to) and ended with
    # their trainer, though nobody closed the loader: no orphan is left.
    _assert_gone(
        [pid for h in held for pid in (h["pid"], *h["workers"])], "the trainer or a worker"
    )

    log = tmp_path / "resume.log"
    resumed = _start(nproc, "resume", dataset, tmp_path / "ckpt", tmp_path / "reference", log=log)
    out = _finish(resumed, log)
    assert resumed.returncode == 0, out
    assert out.count(f"resumed from {saved}\n") == nproc, out
    assert out.count("resume is bitwise\n") == nproc, out


def test_the_workers_end_with_a_trainer_that_is_killed(dataset, tmp_path):
    marker, log = tmp_path / "marker", tmp_path / "train.log"
    trainer = _start(1, "train", dataset, tmp_path / "ckpt", marker, log=log)
    (held,) = _wait_for_markers(trainer, marker, 1, log)
    os.kill(trainer.pid, signal.SIGKILL)  # no handler runs, no atexit: only the workers' watch
    _finish(trainer, log)
    _assert_gone(held["workers"], "a worker of the killed trainer")


EXIT_SCRIPT = """
import json, multiprocessing, sys
from fvstep.core import random as fr
from fvstep.executor.latents import latent_source

class FailsAtStep6:  # raises inside the DataLoader, which asks for steps ahead
    def __init__(self, order):
        self.order = order
    def indices(self, step, *, rank=0, world_size=1):
        if step >= 6:
            raise ValueError(f"no step {step}")
        return self.order.indices(step, rank=rank, world_size=world_size)

data = latent_source(sys.argv[1], key=fr.key(1), batch_size=2)
data = type(data)(data.dataset, FailsAtStep6(data.order))
data.batch(0)
print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
try:
    for s in range(1, 6):
        data.batch(s)
except RuntimeError as e:
    kept = e  # its traceback keeps the DataLoader alive: it never shuts its workers down
    print("raised:", e, flush=True)
"""


def test_a_loader_left_open_never_holds_up_the_exit_even_when_a_traceback_keeps_it(dataset):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(dataset)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,  # multiprocessing would join the workers, ignoring SIGTERM, forever
    )
    assert done.returncode == 0, done.stderr
    assert "raised: rank 0 of 1, step 2: the data loader failed: no step 6" in done.stdout
    workers = json.loads(done.stdout.splitlines()[0])
    assert len(workers) == 2
    _assert_gone(workers, "a worker of the ended trainer")


SEND_SIGTERM_AND_SIGINT = """
import os, signal, sys
for pid in sys.argv[1:]:
    os.kill(int(pid), signal.SIGTERM)
    os.kill(int(pid), signal.SIGINT)
"""


def _workers_started_by(fn) -> list[multiprocessing.Process]:
    before = {p.pid for p in multiprocessing.active_children()}
    fn()
    return [p for p in multiprocessing.active_children() if p.pid not in before]


def test_workers_ignore_sigterm_and_sigint_and_stop_on_close(dataset):
    with latent_source(dataset, key=fr.key(1), batch_size=2) as data:
        workers = _workers_started_by(lambda: data.batch(0))
        assert len(workers) == 2
        # From another process, as a scheduler or a shell would send them.
        pids = [str(w.pid) for w in workers]
        subprocess.run([sys.executable, "-c", SEND_SIGTERM_AND_SIGINT, *pids], check=True)
        for s in range(1, 12):  # both workers must serve fresh requests: they are alive
            assert torch.equal(data.batch(s)["index"], torch.tensor(data.indices(s)))
        assert all(w.is_alive() for w in workers)
        data.close()
        assert not any(w.is_alive() for w in workers)


def test_a_users_worker_init_fn_runs_in_each_worker_after_fvsteps(dataset, tmp_path):
    with latent_source(
        dataset, key=fr.key(1), batch_size=2, worker_init_fn=_TouchFile(tmp_path)
    ) as data:
        data.batch(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init-0", "init-1"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {json.dumps([True, True, True])}


class _TouchFile:
    """A user's worker_init_fn: writes ``init-<id>``: whether SIGINT and SIGTERM are ignored."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        # fvstep's handler (it does nothing), not the defaults nor SIG_IGN
        defaults = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)
        ignored = [signal.getsignal(s) not in defaults for s in (signal.SIGINT, signal.SIGTERM)]
        # a process the dataset starts gets the default disposition back (exec resets a
        # handler; SIG_IGN would be inherited, and its terminate() would do nothing)
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        ignored.append(child == "True")
        (self.folder / f"init-{worker_id}").write_text(json.dumps(ignored))
