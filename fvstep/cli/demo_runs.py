"""The work of ``fvstep demo``: a tiny DMD2 distillation (FSDP2 on several ranks) run twice,
once interrupted and resumed (docs/cli.md: ``fvstep demo``), and the plot of both runs' losses.
"""

from __future__ import annotations

import copy
import json
import signal
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch

import fvstep as fs
from fvstep import parallel
from fvstep.checkpoint import list_complete
from fvstep.core._optional import needs_extra
from fvstep.core.errors import SimulatedCrash
from fvstep.executor.data import ShuffledSource, SyntheticLatents
from fvstep.executor.reporting import Validation
from fvstep.executor.sampling import FewStepSampler, sample_videos
from fvstep.executor.validation import validation_loss
from fvstep.methods import dmd2
from fvstep.methods.models import synthetic_batch, tiny_wan
from fvstep.testing import CrashAt

__all__ = ["VAL_LOSS_NOTE", "DemoConfig", "min_steps", "plot_losses", "read_metrics", "run_demo"]

VAL_LOSS_NOTE = (
    "DMD2 trains the student as a one-step generator matched to the teacher, not this "
    "loss: it may rise as the student leaves the teacher's velocity field"
)
"""Why the demo's ``val/loss`` need not fall (the summary prints it)."""


@attrs.frozen
class DemoConfig:
    """Settings of the demo (the CLI's options, checked there)."""

    out: str
    num_steps: int = 24
    microbatches: int = 2
    sync: str = "deferred"
    every: int = 4
    generator_update_interval: int = 2
    seed: int = 0

    @property
    def crash_at(self) -> int:
        """The step before which the interrupted run crashes: mid-run, between checkpoints."""
        return _crash_at(self.num_steps, self.every)


def _crash_at(num_steps: int, every: int) -> int:
    # Half an interval after a checkpoint near the middle (never before the first one), so
    # that the restart recomputes the steps between that checkpoint and the crash.
    return max(every, num_steps // 2 // every * every) + max(1, (every + 1) // 2)


def min_steps(every: int) -> int:
    """The fewest steps a demo with checkpoints every ``every`` steps can run: its crash
    must fall after the first checkpoint and before the last step."""
    num_steps = 1
    while not _crash_at(num_steps, every) < num_steps:
        num_steps += 1
    return num_steps


def _setup(config: DemoConfig, sharded: bool) -> tuple[fs.TrainState, fs.Step, ShuffledSource]:
    mesh = parallel.make_mesh(device_type="cpu") if sharded else None

    def shard(module: torch.nn.Module) -> torch.nn.Module:
        return parallel.shard_module(module, mesh=mesh) if mesh is not None else module

    teacher: Any = tiny_wan(seed=config.seed)
    optimizer = fs.optim.adamw(lr=fs.schedules.constant_with_warmup(2e-4, warmup_steps=4))
    roles = {
        "student": fs.Role(shard(copy.deepcopy(teacher)), optimizer=optimizer, allow_no_sync=True),
        "teacher": fs.Role(shard(teacher)),
        "critic": fs.Role(
            shard(tiny_wan(seed=config.seed + 1)),  # type: ignore[arg-type]
            optimizer=fs.optim.adamw(lr=4e-4),
            allow_no_sync=True,
        ),
    }
    state = fs.TrainState.create(roles, key=fs.random.key(config.seed))
    step = fs.compile(
        dmd2(generator_update_interval=config.generator_update_interval, ordering="sequential"),
        accumulation=fs.Accumulation(microbatches=config.microbatches, sync=config.sync),  # type: ignore[arg-type]
        clip=fs.clip_grad_norm(1.0),
    )
    data = ShuffledSource(
        SyntheticLatents(
            256, key=fs.random.key(config.seed + 100), shape=(4, 2, 4, 4), text_shape=(3, 16)
        ),
        key=fs.random.key(config.seed + 200),
        batch_size=config.microbatches,
    )
    return state, step, data


def _tiny_vae(seed: int) -> torch.nn.Module:
    """A tiny ``AutoencoderKLWan`` for the demo's 4-channel latents, on the CPU."""
    with needs_extra("demo", "fvstep demo"):
        from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae: Any = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
    return vae.eval()


def _validations(config: DemoConfig) -> list[Validation]:
    """The student's validation loss every ``every`` steps, and a sample strip at the end."""
    held_out = synthetic_batch(fs.random.key(config.seed + 300), batch_size=2)
    return [
        Validation(
            validation_loss(held_out["latents"], held_out["text"], timesteps=(0.25, 0.5, 0.75)),
            every=config.every,
        ),
        Validation(
            sample_videos(
                held_out["text"][:1],
                latent_shape=(4, 2, 4, 4),
                vae=_tiny_vae(config.seed),
                sampler=FewStepSampler((1.0,)),  # DMD2's denoising_steps
                fps=4,
            ),
            at_end=True,
        ),
    ]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _interruptible(world: int) -> None:
    """Ctrl-C ends the demo at once, with no traceback on any rank (one rank raises
    ``KeyboardInterrupt``; several die by the signals' default actions)."""
    if world > 1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _steps(path: Path) -> list[int]:
    return [s for s, _ in list_complete(path)]


def _collectives(path: Path) -> dict[str, int]:
    """The largest count of each kind of collective in one step of a run's metrics."""
    most: dict[str, int] = {}
    for row in read_metrics(path):
        for k, v in row.items():
            if k.startswith("collectives/") and not k.endswith("_bytes"):
                kind = k.removeprefix("collectives/")
                most[kind] = max(most.get(kind, 0), int(v))
    return most


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run both runs on this rank (called on every rank) and return what was observed:
    ``{"equal": bool, "crashed_before": int, "resumed_from": int, ...}``."""
    rank, world = parallel.rank_and_world()
    _interruptible(world)
    # FSDP2 warns that the Wan model returns a view; nothing here modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    out = Path(config.out)
    sharded = world > 1
    checkpoints_a = fs.Checkpoints(out / "uninterrupted", every=config.every, keep=None)
    checkpoints_b = fs.Checkpoints(out / "interrupted", every=config.every, keep=None)
    run_options: dict[str, Any] = {
        "num_steps": config.num_steps,
        "handle_signals": False,
        "validation": _validations(config),
        # collectives/* metrics: what the sync policy changes
        "parallelism": parallel.Layout(count_collectives=True) if sharded else None,
    }

    if rank == 0:
        print(f"[1/3] uninterrupted run: {config.num_steps} steps on {world} rank(s)", flush=True)
    state, step, data = _setup(config, sharded)
    final_a = fs.run_until(step, state, data, checkpoints=checkpoints_a, **run_options).state

    if rank == 0:
        print(f"[2/3] interrupted run: simulated crash before step {config.crash_at}", flush=True)
    state, step, data = _setup(config, sharded)
    crashing = CrashAt(data, config.crash_at)
    try:
        fs.run_until(step, state, crashing, checkpoints=checkpoints_b, **run_options)
    except SimulatedCrash:
        crashed_before = config.crash_at
    else:
        raise RuntimeError(f"the interrupted run did not crash before step {config.crash_at}")
    checkpoints_at_crash = _steps(checkpoints_b.dir)
    if rank == 0:
        print(
            f"[3/3] restart: resuming from the newest checkpoint {checkpoints_at_crash}", flush=True
        )
    state, step, data = _setup(config, sharded)
    result_b = fs.run_until(step, state, data, checkpoints=checkpoints_b, **run_options)
    if result_b.resumed_from is None:
        raise RuntimeError("the restart found no checkpoint to resume from")

    first_difference = None
    try:
        fs.tree.assert_trees_equal(result_b.state, final_a, check_static=False)
    except AssertionError as e:
        first_difference = str(e)
    verdicts = parallel.gather_objects(first_difference)
    return {
        "equal": all(v is None for v in verdicts),
        "first_difference": next((v for v in verdicts if v is not None), None),
        "crashed_before": crashed_before,
        "resumed_from": int(result_b.resumed_from.name.removeprefix("step_")),
        "resumed_from_path": str(result_b.resumed_from),
        "checkpoints_at_crash": checkpoints_at_crash,
        "checkpoints_final": _steps(checkpoints_b.dir),
        "checkpoints_uninterrupted": _steps(checkpoints_a.dir),
        "collectives": _collectives(checkpoints_a.dir) if rank == 0 else {},
        "world_size": world,
        "checkpoint_bytes": _dir_bytes(result_b.resumed_from),
        "num_leaves": len(fs.tree.leaves(final_a)),
    }


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_losses(out: str | Path, *, resumed_from: int, crashed_before: int) -> Path | None:
    """Plot both runs' losses, marking the crash and the resume; the PNG, or ``None``
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out = Path(out)
    runs = {
        "uninterrupted": read_metrics(out / "uninterrupted"),
        "interrupted + resumed": read_metrics(out / "interrupted"),
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharex=True)
    for ax, metric in zip(axes, ["critic/loss", "student/loss", "val/loss"]):
        styles: list[dict[str, Any]] = [{"lw": 3, "alpha": 0.4}, {"lw": 1.2, "ls": "--"}]
        for (label, rows), style in zip(runs.items(), styles):
            points = [(r["step"], r[metric]) for r in rows if metric in r]
            if points:
                ax.plot(*zip(*points), label=label, marker="o", ms=3, **style)
        ax.axvline(resumed_from, color="tab:red", lw=1)
        ax.axvspan(resumed_from, crashed_before, color="tab:red", alpha=0.08)
        ax.text(
            resumed_from,
            ax.get_ylim()[1],
            f" resumed at {resumed_from}\n (crash before {crashed_before})",
            va="top",
            fontsize=8,
            color="tab:red",
        )
        if metric == "val/loss":
            ax.set_title(
                "val/loss (student's flow matching, held-out latents)\n"
                "may rise: DMD2 trains a one-step generator, not this loss",
                fontsize=9,
            )
        else:
            ax.set_title(metric)
        ax.set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    fig.suptitle("fvstep demo: DMD2 on a tiny Wan — resumed run vs uninterrupted run")
    fig.tight_layout()
    png = out / "losses.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
