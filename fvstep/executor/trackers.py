"""Trackers: where a run's metrics and media go, behind one small protocol (:class:`Tracker`).

Metrics reach them without a GPU sync per step, through :class:`MetricsQueue`. See
docs/concepts/validation.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from fvstep.core._optional import needs_extra
from fvstep.executor import media as fsmedia
from fvstep.executor.media import Video

__all__ = [
    "JsonlTracker",
    "MetricsQueue",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
]

Scalar = bool | int | float | None
"""A logged metric value: a number, or ``None`` for NaN and infinities."""


@runtime_checkable
class Tracker(Protocol):
    """Where metrics and media go, on rank 0 (docs/concepts/validation.md).

    An optional ``start(step)`` is called once, first, with the step the run starts at."""

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        """Log scalar metrics (``None`` for a non-finite value) at ``step``."""

    def log_media(self, media: Mapping[str, Video], step: int) -> None:
        """Log videos at ``step``."""

    def close(self) -> None:
        """Flush and release files and connections."""


def _number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsQueue:
    """Per-step metrics held as they are (tensors included) until :meth:`flush`.

    :meth:`flush` reads each device's pending tensors with one ``.tolist()``: one host sync
    per device per flush. Only numbers and one-element tensors are kept; NaN and
    infinities become ``None``.

    Examples:
        >>> q = MetricsQueue()
        >>> q.put(0, {"loss": torch.tensor(0.5), "lr": 1e-4})
        >>> q.flush()
        [(0, {'loss': 0.5, 'lr': 0.0001})]
    """

    def __init__(self) -> None:
        self._rows: list[tuple[int, dict[str, Any]]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Queue ``metrics`` of ``step`` (no host sync)."""
        row: dict[str, Any] = {}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                if v.numel() == 1:  # a copy on the device: no sync
                    row[k] = v.detach().reshape(()).clone()
            elif isinstance(v, (bool, int, float)):
                row[k] = v
        self._rows.append((step, row))

    def flush(self) -> list[tuple[int, dict[str, Scalar]]]:
        """Every queued ``(step, row)`` in order, its tensors read as Python numbers."""
        rows, self._rows = self._rows, []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, row in rows:
            for v in row.values():
                if isinstance(v, torch.Tensor):
                    by_device.setdefault(v.device, []).append(v)
        values: dict[int, float] = {}
        for tensors in by_device.values():
            numbers = torch.stack([t.float() for t in tensors]).tolist()
            values.update({id(t): n for t, n in zip(tensors, numbers)})

        def read(v: Any) -> Scalar:
            return _number(values[id(v)] if isinstance(v, torch.Tensor) else v)

        return [(step, {k: read(v) for k, v in row.items()}) for step, row in rows]


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


class JsonlTracker:
    """Strict JSON lines (``{"step": n, ...}``), and media files beside them.

    ``log_media`` writes ``<media_dir>/step_<n>/<name>`` as ``.mp4`` and ``.png`` (the
    frames side by side), and ``.gif`` with ``gif=True``. What a resume drops:
    docs/concepts/validation.md.

    Args:
        media_dir: Where media go; default ``<path's folder>/media``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        media_dir: str | os.PathLike[str] | None = None,
        gif: bool = False,
    ) -> None:
        self.path = Path(path)
        self.media_dir = Path(media_dir) if media_dir is not None else self.path.parent / "media"
        self.gif = gif
        self._file: Any = None

    def start(self, step: int) -> None:
        """Open the file, dropping lines (and media folders) of steps ``>= step``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _line_step(line) < step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
        if self.media_dir.is_dir():
            import shutil

            for d in self.media_dir.glob("step_*"):
                suffix = d.name.removeprefix("step_")
                if suffix.isdigit() and int(suffix) >= step:
                    shutil.rmtree(d, ignore_errors=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        """Append ``{"step": step, **metrics}`` as one strict-JSON line (none if empty)."""
        if not metrics:
            return
        if self._file is None:
            self.start(0)
        row = {"step": step, **{k: _number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def log_media(self, media: Mapping[str, Video], step: int) -> None:
        """Write each video as MP4 and PNG strip (and GIF) under ``step_<step>/``."""
        folder = self.media_dir / f"step_{step:09d}"
        for name, video in media.items():
            base = folder / name.replace("/", "_")
            fsmedia.write_mp4(video, base.with_suffix(".mp4"))
            fsmedia.write_png_strip(video, base.with_suffix(".png"))
            if self.gif:
                fsmedia.write_gif(video, base.with_suffix(".gif"))

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker:
    """TensorBoard event files (``pip install tensorboard``): finite scalars, and each video
    as the image of its frames side by side. See docs/concepts/validation.md."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def start(self, step: int) -> None:
        """Open the writer (purging events of steps ``>= step`` when resuming)."""
        with needs_extra("tracking", "TensorBoardTracker"):
            from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir), purge_step=step if step > 0 else None)

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        """``add_scalar`` for each finite number."""
        if self._writer is None:
            self.start(0)
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._writer.add_scalar(k, v, step)

    def log_media(self, media: Mapping[str, Video], step: int) -> None:
        """``add_image`` of each video's frames side by side (HWC)."""
        if self._writer is None:
            self.start(0)
        for name, video in media.items():
            self._writer.add_image(name, fsmedia.strip(video).numpy(), step, dataformats="HWC")

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbTracker:
    """Weights & Biases (``pip install wandb``), offline unless told otherwise.

    Offline, it writes ``<dir>/wandb/offline-run-*/`` for ``wandb sync``. A resumed run
    logs its recomputed steps in a new W&B run (pass ``id`` and ``resume="allow"`` to
    append to one).

    Args:
        dir: The folder W&B writes under.
        **init_kwargs: More ``wandb.init`` arguments (``name``, ``config``, ``id``, ...).

    Examples:
        >>> tracker = WandbTracker(project="distill", dir="runs/a", config={"lr": 1e-5})
    """

    def __init__(
        self,
        *,
        project: str = "fvstep",
        dir: str | os.PathLike[str] = ".",
        mode: Literal["online", "offline", "disabled"] = "offline",
        **init_kwargs: Any,
    ) -> None:
        self.project = project
        self.dir = Path(dir)
        self.mode = mode
        self.init_kwargs = init_kwargs
        self.run: Any = None

    def start(self, step: int) -> None:
        """Start the W&B run."""
        with needs_extra("tracking", "WandbTracker"):
            import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project, dir=str(self.dir), mode=self.mode, **self.init_kwargs
        )

    def log(self, metrics: Mapping[str, Scalar], step: int) -> None:
        """``run.log(metrics, step=step)`` (``None`` values are left out)."""
        if self.run is None:
            self.start(0)
        row = {k: v for k, v in metrics.items() if v is not None}
        if row:
            self.run.log(row, step=step)

    def log_media(self, media: Mapping[str, Video], step: int) -> None:
        """Each video as an MP4 ``wandb.Video``."""
        import tempfile

        with needs_extra("tracking", "WandbTracker"):
            import wandb

        if self.run is None:
            self.start(0)

        with tempfile.TemporaryDirectory(dir=self.dir) as tmp:
            row = {}
            for name, video in media.items():
                mp4 = fsmedia.write_mp4(video, Path(tmp) / f"{name.replace('/', '_')}.mp4")
                row[name] = wandb.Video(str(mp4), caption=video.caption or None, format="mp4")
            self.run.log(row, step=step)

    def close(self) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
            self.run = None
