"""A trainer over the worker loader that a test preempts: the subject of ``test_preemption.py``.

``python tests/preempted_trainer.py train <dataset> <ckpt> <marker>`` trains a tiny model on
the latent dataset at ``<dataset>`` (read by :func:`fvstep.executor.latents.latent_source` with its
default two worker processes) towards step ``NUM_STEPS``, saving into ``<ckpt>`` only every
1000 steps (so the only checkpoint it can leave is the one a signal makes it save). After
step ``HOLD_AT`` it writes ``<marker>.rank<r>`` (JSON: its pid and its loader workers'
pids) and waits until it has itself received SIGTERM, which the test sends to the whole
process group once every rank's marker is there; ``fvstep.run`` then stops at that step
boundary and saves ``step_{HOLD_AT + 1}``. It prints ``returned <step> <why> <checkpoint>``.

``python tests/preempted_trainer.py resume <dataset> <ckpt> <reference>`` resumes from
``<ckpt>`` to ``NUM_STEPS``, runs the same training uninterrupted into ``<reference>``, and
prints ``resumed from <checkpoint>`` and ``resume is bitwise`` when the final states are
equal (``fvstep.core.tree.assert_trees_equal``; it raises otherwise).

Both run on one process, or on several under ``torchrun`` (gloo, the model FSDP2-sharded).
Run it from the repository root with ``PYTHONPATH=.`` (the test sets it).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.executor.latents import latent_source
from tests.crash_saver import report  # one atomic write a line: two ranks share stdout

HOLD_AT = 2
"""The step after which the trainer waits for SIGTERM (it saves ``step_{HOLD_AT + 1}``)."""

NUM_STEPS = 6
"""The step both the resumed and the uninterrupted run reach."""

WAIT_S = 300.0
"""How long the trainer waits for SIGTERM: generous, for a loaded 2-core machine."""


def make_run(root: str) -> tuple[fs.TrainState, object, object]:
    """The state, the step and the worker-loaded data of the run, built afresh."""
    net = nn.Linear(8, 4)
    with torch.no_grad():
        net.weight.copy_(torch.linspace(-1, 1, 32).reshape(4, 8))
        net.bias.zero_()
    if fsp.rank_and_world()[1] > 1:  # the ranks train one model
        net = fsp.shard_module(net, mesh=fsp.make_mesh(device_type="cpu"))

    def loss(state, batch, key):
        x = batch["latents"].flatten(2).mean(-1)  # (B, 2)
        t = batch["text"].float().flatten(1)[:, :6]  # (B, 6)
        return state.module("net")(torch.cat([x, t], 1)).pow(2).mean()

    state = fs.TrainState.create(
        {"net": fs.Role(net, optimizer=fs.optim.adamw(lr=1e-2))}, key=fs.random.key(0)
    )
    data = latent_source(root, key=fs.random.key(7), batch_size=2)  # num_workers: the default
    return state, fs.compile(fs.update("net", loss)), data


def wait_for_sigterm(wakeup: int) -> None:
    """Block until this process has received SIGTERM (its handler has then run too)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([wakeup], [], [], 1.0)
        if ready and signal.SIGTERM in os.read(wakeup, 512):
            return
    raise TimeoutError(f"no SIGTERM within {WAIT_S:.0f} s")


def train(root: str, ckpt: str, marker: str) -> None:
    rank = fsp.rank_and_world()[0]
    # Every signal with a Python handler writes its number here: the executor's SIGTERM
    # handler (installed later by fs.run) included, so the trainer can tell when it got it.
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    state, step, data = make_run(root)

    def hold(s: int, metrics: dict) -> None:
        if s != HOLD_AT:
            return
        workers = [p.pid for p in multiprocessing.active_children()]
        mark, tmp = Path(f"{marker}.rank{rank}"), Path(f"{marker}.rank{rank}.tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "workers": workers}))
        tmp.replace(mark)  # whole, or not there
        wait_for_sigterm(wakeup_r)

    result = fs.run_until(
        step,
        state,
        data,
        num_steps=NUM_STEPS,
        checkpoints=fs.Checkpoints(ckpt, every=1000),
        on_metrics=hold,
        progress=False,
    )
    report(f"returned {int(result.state.step)} {result.stopped_by} {result.checkpoint}")


def resume(root: str, ckpt: str, reference: str) -> None:
    state, step, data = make_run(root)
    with data:
        resumed = fs.run_until(
            step, state, data, num_steps=NUM_STEPS, checkpoints=fs.Checkpoints(ckpt, every=1000)
        )
    report(f"resumed from {resumed.resumed_from}")
    state, step, data = make_run(root)
    with data:
        uninterrupted = fs.run_until(
            step, state, data, num_steps=NUM_STEPS, checkpoints=fs.Checkpoints(reference)
        )
    assert uninterrupted.resumed_from is None
    # Built anew, the two states hold different module objects: compare the leaves.
    fs.tree.assert_trees_equal(resumed.state, uninterrupted.state, check_static=False)
    report("resume is bitwise")


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    started = fsp.init_from_env(backend="gloo") if "WORLD_SIZE" in os.environ else False
    try:
        {"train": train, "resume": resume}[argv[0]](*argv[1:])
    finally:
        if started:
            fsp.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
