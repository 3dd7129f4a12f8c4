"""Exits × weights × data × observers: a run that crashes (after a synchronous or an
async save) and resumes ends bitwise where the uninterrupted run ends, logs the same
validation numbers at the same steps (a cadence straddling the resume, an EMA that
starts between the crash and the end, or before it), and exports the same files.

Weights: live, an EMA that starts after the resume point (step 4 of 6; the crash is
before step 3), one that starts before it (step 1), LoRA over a frozen base, tied
weights. Data: a step-indexed function and a :class:`fvstep.executor.data.ShuffledSource`.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fvstep as fs
from fvstep.core import tree
from fvstep.executor.data import ShuffledSource, SyntheticLatents
from fvstep.executor.reporting import Validation
from fvstep.executor.validation import validation_loss
from fvstep.methods.finetune import flow_matching_loss
from fvstep.testing import CrashAt, SimulatedCrash
from tests.interactions.cells import PROBE, WeightsCase, build_state, data

pytest.importorskip("peft")

NUM_STEPS = 6
CRASH_AT = 3  # the run saved at 2 and crashes before step 3; the resume starts at 2

CASES = (
    WeightsCase("live"),
    WeightsCase("ema_starting_after_the_resume", ema_start=4),
    WeightsCase("ema_started_before_the_crash", ema_start=1),
    WeightsCase("lora_ema_starting_after_the_resume", ema_start=4, lora=True),
    WeightsCase("tied_ema_started_before_the_crash", ema_start=1, tied=True),
)
SOURCES = {
    "function": lambda: data,
    "shuffled": lambda: ShuffledSource(
        SyntheticLatents(7, key=fs.random.key(5)), key=fs.random.key(6), batch_size=2
    ),
}
EXITS = ("crash", "crash_after_async_save")


def validations(case: WeightsCase) -> list[Validation]:
    weights = "params" if case.ema_start is None else "ema"
    fn = validation_loss(PROBE["latents"], PROBE["text"], weights=weights)
    return [Validation(fn, every=1, prefix="val")]


def run(case, source, tmp: Path, *, crash: bool, async_save: bool) -> fs.TrainState:
    step = fs.compile(fs.update("student", flow_matching_loss()))
    checkpoints = fs.Checkpoints(tmp, every=2, keep=None, async_save=async_save)
    feed = SOURCES[source]()
    return fs.run(
        step,
        build_state(case),
        CrashAt(feed, CRASH_AT) if crash else feed,
        num_steps=NUM_STEPS,
        checkpoints=checkpoints,
        validation=validations(case),
        progress=False,
        trackers=[],
    )


def val_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if any(k.startswith("val/") for k in r)]


@functools.cache
def uninterrupted(case_name: str, source: str) -> tuple[fs.TrainState, Path]:
    """The uninterrupted run of a (case, source), shared by its exits, and its folder."""
    case = next(c for c in CASES if c.name == case_name)
    folder = Path(tempfile.mkdtemp(prefix="fvstep-plain-"))
    return tree.clone(run(case, source, folder, crash=False, async_save=False)), folder


def export(state: fs.TrainState, case: WeightsCase, tmp: Path) -> dict[str, torch.Tensor]:
    weights = "params" if case.ema_start is None else "ema"
    return load_file(fs.checkpoint.export(state, "student", tmp / "export", weights=weights))


@pytest.mark.parametrize("exit", EXITS)
@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_resumed_run_is_the_uninterrupted_one_in_state_validation_and_export(
    case, source, exit, tmp_path
):
    plain, base = uninterrupted(case.name, source)
    resumed_dir = tmp_path
    with pytest.raises(SimulatedCrash):
        run(case, source, resumed_dir, crash=True, async_save=exit == "crash_after_async_save")
    resumed = run(case, source, resumed_dir, crash=False, async_save=False)
    tree.assert_trees_equal(resumed, plain, check_static=False)
    assert val_rows(resumed_dir / "metrics.jsonl") == val_rows(base / "metrics.jsonl")
    steps = [r["step"] for r in val_rows(resumed_dir / "metrics.jsonl")]
    assert steps == list(range(NUM_STEPS + 1))
    a, b = export(plain, case, tmp_path / "a"), export(resumed, case, tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
