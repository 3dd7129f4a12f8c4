"""The executor: loop a step over data, log metrics, save and resume checkpoints.

:func:`run` and :func:`run_until` (which returns a :class:`RunResult` instead of raising
:class:`Interrupted` when a signal stops the run). Data is a function of the step, so
resuming at step ``s`` needs nothing but ``s``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from fvstep import checkpoint as ckpt
from fvstep.core.engine import Step
from fvstep.core.errors import Interrupted
from fvstep.core.layout import Parallelism
from fvstep.core.state import TrainState
from fvstep.executor.checkpoints import Checkpoints, lock_run_dir, resume, save_run_state
from fvstep.executor.reporting import (
    Sinks,
    Validation,
    console_line,
    observe,
    open_trackers,
    progress_bar,
    validations,
)
from fvstep.executor.schedule_check import check_schedule_lengths
from fvstep.executor.trackers import Tracker
from fvstep.parallel.layout import default_layout
from fvstep.parallel.ranks import host_group, max_over_ranks, rank_and_world

__all__ = ["Checkpoints", "RunResult", "run", "run_until"]


StopReason = Literal["completed", "SIGTERM", "SIGINT"]


@attrs.frozen
class RunResult:
    """How :func:`run_until` ended.

    Attributes:
        stopped_by: ``"completed"``, or the signal (``"SIGTERM"``, ``"SIGINT"``) that
            stopped the run early, after saving.
        checkpoint: The checkpoint that holds ``state`` (``None`` without checkpoints).
        resumed_from: The checkpoint the run resumed from (``None``: it did not resume).
    """

    state: TrainState
    stopped_by: StopReason
    checkpoint: Path | None
    resumed_from: Path | None = None

    @property
    def completed(self) -> bool:
        """Whether the run reached ``num_steps``."""
        return self.stopped_by == "completed"


def _batch(data: Any, step: int, rank: int, world: int) -> Any:
    if hasattr(data, "batch"):
        return data.batch(step, rank=rank, world_size=world)
    if callable(data):
        return data(step)
    raise TypeError("data must be a function of the step, or have .batch(step, rank=, world_size=)")


_REASONS: tuple[StopReason, ...] = ("completed", "SIGTERM", "SIGINT")


@contextlib.contextmanager
def _stop_signals(rank: int, *, enabled: bool) -> Iterator[dict[str, int]]:
    """SIGTERM and a first SIGINT set ``flag["stop"]`` (an index into ``_REASONS``); a second
    SIGINT raises ``KeyboardInterrupt``. A caller's own SIGINT handler is kept."""
    flag = {"stop": 0, "sigints": 0}

    def on_sigterm(signum: int, frame: Any) -> None:
        flag["stop"] = flag["stop"] or _REASONS.index("SIGTERM")

    def on_sigint(signum: int, frame: Any) -> None:
        flag["sigints"] += 1
        if flag["sigints"] > 1:
            raise KeyboardInterrupt
        flag["stop"] = flag["stop"] or _REASONS.index("SIGINT")
        if rank == 0:
            console_line(
                "fvstep: Ctrl-C: saving at the end of this step (Ctrl-C again to abort now)"
            )

    previous: dict[int, Any] = {}
    if enabled and threading.current_thread() is threading.main_thread():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _agree_to_stop(local: int, group: Any) -> int:
    """A signal may reach only some ranks: stop when any rank was told to (the reason of
    the highest index in ``_REASONS``, so that all ranks agree on it too)."""
    return int(max_over_ranks([local], device=torch.device("cpu"), group=group)[0])


def run(
    step: Callable[..., tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    data: Any,
    *,
    num_steps: int,
    checkpoints: Checkpoints | None = None,
    metrics_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    on_metrics: Callable[[int, dict[str, Any]], None] | None = None,
    handle_signals: bool = True,
    validation: Validation | Sequence[Validation] | None = None,
    trackers: Sequence[Tracker] | None = None,
    log_every: int = 10,
    parallelism: Parallelism | None = None,
) -> TrainState:
    """Run ``step`` until the state's step counter reaches ``num_steps``; return the state.

    As :func:`run_until` (the same options and errors), but a run that a signal stops early
    raises :class:`Interrupted` after saving and releasing the lock.

    Raises:
        Interrupted: If SIGTERM or a first Ctrl-C stopped the run before ``num_steps``.
    """
    result = run_until(
        step,
        state,
        data,
        num_steps=num_steps,
        checkpoints=checkpoints,
        metrics_path=metrics_path,
        progress=progress,
        on_metrics=on_metrics,
        handle_signals=handle_signals,
        validation=validation,
        trackers=trackers,
        log_every=log_every,
        parallelism=parallelism,
    )
    if not result.completed:
        raise Interrupted(
            result.stopped_by,
            int(result.state.step),
            num_steps,
            result.checkpoint,
            result.state,
        )
    return result.state


def run_until(
    step: Callable[..., tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    data: Any,
    *,
    num_steps: int,
    checkpoints: Checkpoints | None = None,
    metrics_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    on_metrics: Callable[[int, dict[str, Any]], None] | None = None,
    handle_signals: bool = True,
    validation: Validation | Sequence[Validation] | None = None,
    trackers: Sequence[Tracker] | None = None,
    log_every: int = 10,
    parallelism: Parallelism | None = None,
) -> RunResult:
    """Run ``step`` until the state's step counter reaches ``num_steps``, or a signal.

    With ``checkpoints`` it holds the run directory's lock, resumes from the newest
    checkpoint that loads, and saves every ``checkpoints.every`` steps and at the end. On
    SIGTERM or a first Ctrl-C every rank finishes the step in progress, saves and returns.
    Validations run between steps and never change the state. The rules in full:
    docs/concepts/checkpoints.md and docs/concepts/validation.md.

    Args:
        step: A compiled step (``fvstep.compile``) or any ``(state, batch) -> (state, metrics)``.
        state: The initial state (consumed).
        data: ``data(step) -> batch``, or an object with ``.batch(step, rank=, world_size=)``
            such as :class:`fvstep.executor.data.ShuffledSource`.
        num_steps: The step count to reach.
        checkpoints: Where and how often to save; ``None`` for no checkpoints.
        metrics_path: A strict-JSONL file for metrics (rank 0); default
            ``<checkpoints.dir>/metrics.jsonl`` when checkpointing.
        on_metrics: Called with ``(step, metrics)`` after every step, on every rank.
        handle_signals: ``False`` leaves SIGTERM and SIGINT to the caller.
        trackers: Where metrics and media go besides the JSONL file (rank 0).
        log_every: Hand metrics to the file and the trackers every ``log_every`` steps
            (and before each checkpoint, and at the end): one host sync per flush.
        parallelism: The process layout every step is called with; it also maps this
            rank to the data it reads. Default :func:`fvstep.parallel.default_layout`.

    Raises:
        CheckpointLockedError: If another run holds the lock of ``checkpoints.dir``.
        CheckpointError: If a checkpoint does not fit ``state``, is damaged (as
            ``checkpoints.on_damaged`` says), or a save fails or holds NaN or Inf.
        ValueError: If the resumed state is past ``num_steps``, or ``log_every < 1``.

    Examples:
        >>> result = run_until(step_fn, state, source, num_steps=1000,
        ...                    checkpoints=Checkpoints("ckpt", every=100, keep=3))
        >>> result.stopped_by, result.checkpoint
        ('completed', PosixPath('ckpt/step_000001000'))
    """
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
    rank, _ = rank_and_world()
    with contextlib.ExitStack() as locked:
        lock = lock_run_dir(checkpoints.dir, rank, checkpoints.lock) if checkpoints else None
        if lock is not None:  # rank 0's, unless the caller holds it
            locked.callback(lock.release)
        resumed_from = None
        if checkpoints is not None:
            state, resumed_from = resume(state, checkpoints, num_steps, rank)
        if int(state.step) > num_steps:
            raise ValueError(
                f"the state is at step {int(state.step)}, past num_steps={num_steps}: "
                "num_steps is the step to reach (counted from 0), not a number of steps to add"
            )
        check_schedule_lengths(step, state, num_steps=num_steps)
        if parallelism is None:
            parallelism = default_layout(state)
        checks = validations(validation)
        replica, replicas = parallelism.data_parallel_rank_and_size() if parallelism else (0, 1)
        layout = {"parallelism": parallelism} if isinstance(step, Step) and parallelism else {}
        start = int(state.step)
        if metrics_path is None and checkpoints is not None:
            metrics_path = checkpoints.dir / "metrics.jsonl"
        last_saved = start
        stop = 0
        with contextlib.ExitStack() as opened:  # closed in reverse: saver, sinks, bar
            saver = (
                ckpt.AsyncSaver() if checkpoints is not None and checkpoints.async_save else None
            )
            bar = progress_bar(progress and rank == 0, start, num_steps)
            if bar is not None:
                opened.callback(bar.close)
            sinks = Sinks(
                open_trackers(Path(metrics_path) if metrics_path else None, trackers, start, rank),
                bar,
            )
            opened.callback(sinks.close)
            if saver is not None:
                opened.callback(saver.close)

            def validate(at: int) -> None:
                for v in checks:
                    if v.due(at, start=start, num_steps=num_steps):
                        sinks.put_validation(at, v.prefix, observe(v, state, at))

            validate(start)
            with _stop_signals(rank, enabled=handle_signals) as flag, host_group() as control:
                for s in range(start, num_steps):
                    state, metrics = step(state, _batch(data, s, replica, replicas), **layout)
                    sinks.put(s, metrics)
                    if on_metrics is not None:
                        on_metrics(s, metrics)
                    if bar is not None:
                        bar.update(1)
                    if (s + 1) % log_every == 0:
                        sinks.flush()
                    stop = _agree_to_stop(flag["stop"], control)  # on the CPU: no GPU sync
                    if not stop:
                        validate(s + 1)
                    done = s + 1 == num_steps
                    if checkpoints is not None and (
                        (s + 1) % checkpoints.every == 0 or done or stop
                    ):
                        sinks.flush()  # the lines of the steps a checkpoint holds are written first
                        save_run_state(state, checkpoints, saver)
                        last_saved = s + 1
                    if stop:
                        break
            sinks.flush()
            if checkpoints is not None and last_saved != int(state.step):
                save_run_state(state, checkpoints, saver)
            if saver is not None and checkpoints is not None:
                saver.wait()
                # The last save was in flight when _save pruned: prune again now that it is
                # committed, so that exactly `keep` remain.
                if rank == 0:
                    ckpt.prune(checkpoints.dir, checkpoints.keep)
        stopped_by: StopReason = "completed" if int(state.step) >= num_steps else _REASONS[stop]
        saved = ckpt.checkpoint_dir(checkpoints.dir, int(state.step)) if checkpoints else None
        if stopped_by != "completed" and rank == 0:
            where = f"saved {str(saved)!r}" if saved else "no checkpoints: nothing saved"
            console_line(
                f"fvstep: stopped by {stopped_by} at step {int(state.step)} of {num_steps}; {where}"
            )
        saved = saved if saved is not None and saved.exists() else None
        return RunResult(state, stopped_by, saved, resumed_from)
