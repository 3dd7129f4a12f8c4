"""``fvstep demo``: the command and its summary; :mod:`fvstep.cli.demo_runs` is its work."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal

from fvstep.cli.common import check_positive, from_rank0, run_on_ranks
from fvstep.core.errors import CLIError

__all__ = ["run_demo"]


_DEMO_OUTPUTS = ("uninterrupted", "interrupted", "losses.png")


def _demo_out_dir(path: str, overwrite: bool) -> Path:
    """``--out``, checked writable; an earlier demo's output in it is refused, or removed
    with ``--overwrite`` (by rank 0, the other ranks waiting)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / ".fvstep-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CLIError(
            f"fvstep: cannot write to the output directory {path!r}: {e.strerror or e}"
        ) from None
    out = Path(path).resolve()
    earlier = [name for name in _DEMO_OUTPUTS if (out / name).exists()]
    if earlier and not overwrite:
        raise CLIError(
            f"fvstep: {path!r} holds an earlier demo's output ({', '.join(earlier)}): "
            "pass --overwrite to replace it, or another --out"
        )
    if earlier and int(os.environ.get("RANK", "0")) == 0:
        import shutil

        for name in earlier:
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            else:
                (out / name).unlink()
    from_rank0(None)  # under torchrun: the other ranks wait for the clean-up
    return out


def run_demo(
    *,
    steps: int = 24,
    nproc: int = 2,
    policy: Literal["every", "no_sync", "deferred"] = "deferred",
    microbatches: int = 2,
    every: int = 4,
    out: str = "fvstep-demo",
    overwrite: bool = False,
) -> int:
    """Run a tiny DMD2 distillation that interrupts itself, resumes and proves it.

    Both runs run on every rank; then rank 0 plots the losses and prints the summary.

    Args:
        steps: steps per run (the crash falls after the first checkpoint and before the
            last step: the minimum depends on --every)
        nproc: ranks (gloo on CPU)
        policy: FSDP2 gradient sync under accumulation: when gradients are reduced
            between micro-batches; changes communication, not results (no effect with
            --nproc 1)
        microbatches: K, micro-batches per step
        every: checkpoint interval
        out: output directory
        overwrite: replace the output of an earlier demo in --out (else the demo refuses)

    Returns:
        0 when the resumed run equals the uninterrupted one bitwise, else 1.

    Raises:
        CLIError: An option is out of range, or ``--out`` is not writable or holds an
            earlier demo's output without ``--overwrite``.

    Example:
        $ fvstep demo --nproc 2 --steps 24 --every 4 --out fvstep-demo
    """
    from fvstep.cli import demo_runs
    from fvstep.cli.demo_runs import DemoConfig, min_steps, plot_losses

    check_positive(nproc=nproc, microbatches=microbatches, every=every)
    if steps < min_steps(every):
        raise CLIError(
            f"fvstep: --steps must be >= {min_steps(every)} with --every {every} (the crash falls "
            f"between the first checkpoint and the last step), got {steps}: raise it or lower --every"
        )
    folder = _demo_out_dir(out, overwrite)
    config = DemoConfig(
        out=str(folder), num_steps=steps, microbatches=microbatches, sync=policy, every=every
    )
    start = time.perf_counter()
    summary = run_on_ranks(demo_runs.run_demo, config, nproc)[0]
    elapsed = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) == 0:
        png = plot_losses(
            folder, resumed_from=summary["resumed_from"], crashed_before=summary["crashed_before"]
        )
        print("\n".join(_demo_summary(config, summary, png, elapsed)))
    return 0 if summary["equal"] else 1


def _demo_summary(
    config: Any, summary: dict[str, Any], png: Path | None, elapsed: float
) -> list[str]:
    """The summary's lines: every number in it was observed on the runs, not planned."""
    out = Path(config.out)
    world = summary["world_size"]
    rows = [
        ("ranks", f"{world} (gloo, FSDP2)" if world > 1 else "1 (no sharding)"),
        ("steps", f"{config.num_steps} per run, K={config.microbatches} micro-batches"),
        ("sync policy", _policy_line(config.sync, world)),
        ("collectives", _collectives_line(summary["collectives"])),
        (
            "interruption",
            f"crashed before step {summary['crashed_before']} (checkpoints then: "
            f"{_steps_text(summary['checkpoints_at_crash'])}); restarted from the newest, "
            f"step {summary['resumed_from']}, {_recomputed(summary)}",
        ),
        ("resumed from", summary["resumed_from_path"]),
        (
            "checkpoints",
            f"every {config.every} steps, all kept: uninterrupted/ "
            f"{_steps_text(summary['checkpoints_uninterrupted'])}; interrupted/ "
            f"{_steps_text(summary['checkpoints_final'])}",
        ),
        ("final losses", _last_losses(out)),
        ("validation", _validation_line(out)),
        (
            "checkpoint size",
            f"{summary['checkpoint_bytes'] / 2**20:.2f} MiB ({summary['num_leaves']} leaves "
            f"per rank)",
        ),
        (
            "metrics",
            f"{out / 'uninterrupted' / 'metrics.jsonl'}, {out / 'interrupted' / 'metrics.jsonl'}",
        ),
        ("plot", str(png) if png else "matplotlib not installed: no plot"),
        ("time", f"{elapsed:.1f} s"),
    ]
    verdict = "RESUMED RUN == UNINTERRUPTED RUN, bitwise (every leaf, every rank)"
    rows.append(
        ("verdict", verdict if summary["equal"] else f"DIFFERENT: {summary['first_difference']}")
    )
    title = "fvstep demo — DMD2 (student, frozen teacher, critic) on a tiny Wan transformer"
    return ["", title, *(f"  {name:<19}  {text}" for name, text in rows)]


def _policy_line(policy: str, world: int) -> str:
    if world == 1:
        return f"none: one rank communicates no gradients (--policy {policy} has no effect)"
    return (
        f"{policy}. A policy changes when gradients are communicated, not what is computed: "
        "every and deferred give bitwise the same losses, no_sync the same up to summation "
        "order (docs: Sync policies)"
    )


def _collectives_line(collectives: dict[str, int]) -> str:
    if not collectives:
        return "none (one rank)"
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(collectives.items()))
    return f"at most {counts} per step (counted on rank 0)"


def _recomputed(summary: dict[str, Any]) -> str:
    first, last = summary["resumed_from"], summary["crashed_before"] - 1
    if last < first:
        return "with no step to recompute"
    return (
        f"and recomputed step {first}" if first == last else f"and recomputed steps {first}-{last}"
    )


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(str(s) for s in steps)


def _validation_line(out: Path) -> str:
    """``val/loss`` from its first to its last value, and why it need not fall."""
    from fvstep.cli.demo_runs import VAL_LOSS_NOTE, read_metrics

    rows = read_metrics(out / "interrupted")
    values = [row["val/loss"] for row in rows if "val/loss" in row]
    if not values:
        return "none logged"
    return f"val/loss {values[0]:.4f} -> {values[-1]:.4f} (the student's flow-matching loss on held-out latents): {VAL_LOSS_NOTE}"


def _last_losses(out: Path) -> str:
    from fvstep.cli.demo_runs import read_metrics

    last: dict[str, float] = {}
    for row in read_metrics(out / "interrupted"):
        last.update({k: v for k, v in row.items() if k.endswith("/loss")})
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(last.items()))
