"""What a run reports, beside its state: validation, trackers and the progress bar.

:class:`Validation` and :func:`observe` (a validation that leaves no trace);
:func:`open_trackers` and :class:`Sinks` (rank 0's trackers and progress bar).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from fvstep.core import random as fsrandom
from fvstep.core.state import TrainState
from fvstep.executor.media import Video
from fvstep.executor.trackers import JsonlTracker, MetricsQueue, Tracker
from fvstep.parallel.grad_sync import release_modules

__all__ = [
    "Sinks",
    "Validation",
    "ValidationFn",
    "console_line",
    "observe",
    "open_trackers",
    "progress_bar",
    "validations",
]


ValidationFn = Callable[[TrainState, torch.Tensor], Mapping[str, Any]]
"""``(state, key) -> {name: value}``: scalars (numbers or one-element tensors) are logged
as metrics, :class:`fvstep.executor.media.Video` values as media; anything else is ignored."""


def _default_validation_key() -> torch.Tensor:
    return fsrandom.key(0x5A11DA7E)


@attrs.frozen(eq=False)
class Validation:
    """A validation function and when :func:`run` calls it.

    ``fn(state, key)`` runs on every rank when due (:meth:`due`), through :func:`observe`,
    with ``key = fold_in(self.key, s)``; it never changes the state, the training key
    stream or a checkpoint. Rank 0's results are logged as ``<prefix>/<name>``. See
    docs/concepts/validation.md.

    Attributes:
        fn: The validation function (:data:`ValidationFn`), e.g.
            :func:`fvstep.executor.validation.validation_loss`.
        every: Validate at every multiple of ``every`` steps (``None``: never between).
        at_start: Validate at the step a run starts or resumes at.
        at_end: Validate at ``num_steps``.
    """

    fn: ValidationFn
    every: int | None = None
    at_start: bool = False
    at_end: bool = True
    key: torch.Tensor = attrs.field(factory=_default_validation_key)
    prefix: str = "val"

    def __attrs_post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"Validation.every must be >= 1 or None, got {self.every}")
        if not fsrandom.is_key(self.key):
            raise TypeError("Validation.key must be an fvstep key (fvstep.random.key(seed))")

    def due(self, step: int, *, start: int, num_steps: int) -> bool:
        """Whether the validation runs on the state at ``step`` (the number of steps taken);
        ``start`` is where the run started or resumed."""
        return (
            (self.every is not None and step % self.every == 0)
            or (self.at_end and step == num_steps)
            or (self.at_start and step == start)
        )


def validations(validation: Validation | Sequence[Validation] | None) -> tuple[Validation, ...]:
    if validation is None:
        return ()
    found = (validation,) if isinstance(validation, Validation) else tuple(validation)
    for v in found:
        if not isinstance(v, Validation):
            raise TypeError(
                f"validation must be a fvstep.Validation or a sequence of them, got "
                f"{type(v).__name__}: wrap a function as Validation(fn, every=...)"
            )
    return found


def open_trackers(
    metrics_file: Path | None, trackers: Sequence[Tracker] | None, start: int, rank: int
) -> list[Tracker]:
    """Rank 0's trackers, started at ``start``: the JSONL file (if any), then ``trackers``."""
    if rank != 0:
        return []
    opened: list[Tracker] = []
    if metrics_file is not None:
        opened.append(JsonlTracker(metrics_file))
    opened.extend(trackers or ())
    try:
        for tracker in opened:
            begin = getattr(tracker, "start", None)
            if begin is not None:
                begin(start)
    except BaseException:
        for tracker in opened:
            with contextlib.suppress(Exception):
                tracker.close()
        raise
    return opened


class Sinks:
    """Rank 0's trackers and progress bar, fed through one :class:`MetricsQueue`."""

    def __init__(self, trackers: list[Tracker], bar: Any) -> None:
        self.trackers = trackers
        self.bar = bar
        self.queue = MetricsQueue()
        self.shown_losses: dict[str, str] = {}
        self.active = bool(trackers) or bar is not None

    def put(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.active:
            self.queue.put(step, metrics)

    def put_validation(self, step: int, prefix: str, results: Mapping[str, Any]) -> None:
        if not self.trackers:
            return
        media = {f"{prefix}/{k}": v for k, v in results.items() if isinstance(v, Video)}
        self.queue.put(step, {f"{prefix}/{k}": v for k, v in results.items()})
        if media:
            self.flush()
            for tracker in self.trackers:
                tracker.log_media(media, step)

    def flush(self) -> None:
        for step, row in self.queue.flush():
            for tracker in self.trackers:
                tracker.log(row, step)
            if self.bar is not None:
                _show_losses(self.bar, row, self.shown_losses)

    def close(self) -> None:
        try:
            if len(self.queue):
                self.flush()  # the steps that ran before an error are logged too
        finally:
            for tracker in self.trackers:
                with contextlib.suppress(Exception):
                    tracker.close()


def observe(validation: Validation, state: TrainState, step: int) -> Mapping[str, Any]:
    """Run ``validation.fn`` on ``state`` leaving no trace: no autograd, eval mode, the
    global RNG seeded from the validation key; modes, RNG and FSDP2 groups restored after."""
    key = fsrandom.fold_in(validation.key, step)
    modules = [m for rs in state.roles.values() for m in rs.role.module.modules()]
    modes = [m.training for m in modules]
    try:
        with torch.no_grad(), fsrandom.rng_scope(key):
            for m in modules:
                m.training = False
            out = validation.fn(state, key)
        if not isinstance(out, Mapping):
            raise TypeError(
                f"a validation function must return a mapping of names to values, got "
                f"{type(out).__name__} (from {getattr(validation.fn, '__name__', validation.fn)!r})"
            )
        return out
    finally:
        for m, mode in zip(modules, modes):
            m.training = mode
        release_modules(state)


def _show_losses(bar: Any, row: dict[str, Any], shown: dict[str, str]) -> None:
    """Show the latest value of each ``*loss`` metric on the progress bar: ``shown`` keeps
    a role's last loss through the steps that do not train it."""
    losses = {k: v for k, v in row.items() if k.endswith("loss") and isinstance(v, float)}
    if losses:
        shown.update({k.removesuffix("/loss"): f"{v:.4g}" for k, v in losses.items()})
        bar.set_postfix(shown, refresh=False)


# A thread lock, not tqdm's named semaphore: a rank ended by a signal would leak that.
_BAR_LOCK = threading.RLock()


def progress_bar(enabled: bool, start: int, total: int) -> Any:
    """The run's progress bar on stderr (tqdm), or ``None`` when disabled or not installed."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    tqdm.set_lock(_BAR_LOCK)
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def console_line(message: str) -> None:
    """Print ``message`` on a line of its own on stderr, above a progress bar if one is drawn."""
    tqdm = sys.modules.get("tqdm.auto")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if tqdm is not None and bars:
        tqdm.tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)
