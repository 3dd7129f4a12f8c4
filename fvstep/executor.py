"""The executor: loop a step over data, log metrics, save and resume checkpoints.

``run(step, state, data, num_steps=..., checkpoints=Checkpoints(dir, every, keep))``
resumes from the newest complete checkpoint under ``dir`` if there is one, runs steps
``state.step .. num_steps - 1``, saves every ``every`` steps and at the end, and on
SIGTERM saves and returns early. Data is a function of the step, so resuming at step
``s`` needs nothing but ``s``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from fvstep import checkpoint as ckpt
from fvstep.state import TrainState

__all__ = ["Checkpoints", "run"]


@attrs.frozen
class Checkpoints:
    """Where and how often :func:`run` saves.

    Attributes:
        dir: The directory of checkpoints (one ``step_<n>`` directory each).
        every: Save after every ``every`` steps (and always at the end).
        keep: Keep the newest ``keep`` complete checkpoints (``None``: all).
        async_save: Write in the background (:class:`fvstep.checkpoint.AsyncSaver`).

    Examples:
        >>> Checkpoints("runs/a/ckpt", every=100, keep=3, async_save=True)
    """

    dir: Path = attrs.field(converter=Path)
    every: int = 100
    keep: int | None = 3
    async_save: bool = False

    def __attrs_post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"Checkpoints.every must be >= 1, got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"Checkpoints.keep must be >= 1 or None, got {self.keep}")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _batch(data: Any, step: int, rank: int, world: int) -> Any:
    if hasattr(data, "batch"):
        return data.batch(step, rank=rank, world_size=world)
    if callable(data):
        return data(step)
    raise TypeError("data must be a function of the step, or have .batch(step, rank=, world_size=)")


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().float().item() if v.numel() == 1 else None
    if isinstance(v, (bool, int, float)):
        return v
    return None


class _MetricsLog:
    """Rank 0's JSONL (and TensorBoard, when installed) metrics writer."""

    def __init__(self, path: Path | None, resume_step: int, enabled: bool) -> None:
        self.file = None
        self.tb: Any = None
        if not enabled or path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # drop lines of steps that will be recomputed after a resume
            kept = [
                line for line in path.read_text().splitlines() if _line_step(line) < resume_step
            ]
            path.write_text("".join(f"{line}\n" for line in kept))
        self.file = open(path, "a")  # noqa: SIM115 - closed in close()
        with contextlib.suppress(ImportError):
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(path.parent / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if self.file is None:
            return
        row = {"step": step}
        row.update({k: s for k, v in metrics.items() if (s := _scalar(v)) is not None})
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


@contextlib.contextmanager
def _sigterm_flag() -> Iterator[dict[str, bool]]:
    flag = {"stop": False}
    previous = None
    installed = False
    with contextlib.suppress(ValueError):  # not the main thread: no handler
        previous = signal.signal(signal.SIGTERM, lambda *_: flag.update(stop=True))
        installed = True
    try:
        yield flag
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)


def _agree_to_stop(local: bool, world: int) -> bool:
    """A SIGTERM may reach only some ranks: stop when any rank was told to."""
    if world == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run(
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    data: Any,
    *,
    num_steps: int,
    checkpoints: Checkpoints | None = None,
    metrics_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    on_metrics: Callable[[int, dict[str, Any]], None] | None = None,
) -> TrainState:
    """Run ``step`` until the state's step counter reaches ``num_steps``.

    Resumes from the newest complete checkpoint under ``checkpoints.dir`` (if any): the
    loaded state replaces ``state`` (which only supplies the structure). Saves after
    every ``checkpoints.every`` steps and at the end; on SIGTERM it finishes the step in
    progress, saves, and returns early (the returned state's ``step`` says where).

    Args:
        step: A compiled step (``fvstep.compile``) or any ``(state, batch) -> (state, metrics)``.
        state: The initial state (consumed).
        data: ``data(step) -> batch``, or an object with ``.batch(step, rank=, world_size=)``
            such as :class:`fvstep.data.ShuffledSource`.
        num_steps: The step count to reach.
        checkpoints: Where and how often to save; ``None`` for no checkpoints.
        metrics_path: A JSONL file for metrics (rank 0); default
            ``<checkpoints.dir>/metrics.jsonl`` when checkpointing. Lines of steps that a
            resume recomputes are dropped.
        progress: Show a progress bar on rank 0 (tqdm, when installed).
        on_metrics: Called with ``(step, metrics)`` after every step, on every rank.

    Returns:
        The final state.

    Raises:
        CheckpointError: If the newest checkpoint does not fit ``state``.

    Examples:
        >>> state = run(step_fn, state, source, num_steps=1000,
        ...             checkpoints=Checkpoints("ckpt", every=100, keep=3))
    """
    rank, world = _rank_world()
    if checkpoints is not None:
        found = ckpt.latest(checkpoints.dir)
        if found is not None:
            state = ckpt.load(found, like=state)
    start = int(state.step)
    if metrics_path is None and checkpoints is not None:
        metrics_path = checkpoints.dir / "metrics.jsonl"
    log = _MetricsLog(Path(metrics_path) if metrics_path else None, start, rank == 0)
    saver = ckpt.AsyncSaver() if checkpoints is not None and checkpoints.async_save else None
    bar = _progress(progress and rank == 0, start, num_steps)
    last_saved = start
    try:
        with _sigterm_flag() as flag:
            for s in range(start, num_steps):
                state, metrics = step(state, _batch(data, s, rank, world))
                log.write(s, metrics)
                if on_metrics is not None:
                    on_metrics(s, metrics)
                if bar is not None:
                    bar.update(1)
                stop = _agree_to_stop(flag["stop"], world)
                done = s + 1 == num_steps
                if checkpoints is not None and ((s + 1) % checkpoints.every == 0 or done or stop):
                    _save(state, checkpoints, saver)
                    last_saved = s + 1
                if stop:
                    break
        if checkpoints is not None and last_saved != int(state.step):
            _save(state, checkpoints, saver)
    finally:
        try:
            if saver is not None:
                saver.close()
        finally:
            log.close()
            if bar is not None:
                bar.close()
    return state


def _save(state: TrainState, checkpoints: Checkpoints, saver: ckpt.AsyncSaver | None) -> None:
    path = ckpt.checkpoint_dir(checkpoints.dir, int(state.step))
    if saver is not None:
        saver.save(state, path, overwrite=True)
    else:
        ckpt.save(state, path, overwrite=True)
    if _rank_world()[0] == 0:
        ckpt.prune(checkpoints.dir, checkpoints.keep, keep_temp=path.parent / f".tmp-{path.name}")


def _progress(enabled: bool, start: int, total: int) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
