"""Videos as values, and the files they are written to: MP4, GIF and a PNG strip.

A :class:`Video` is what a validation function returns for a tracker to log. The writers
use ``imageio`` (MP4 through ``imageio-ffmpeg``; ``pip install fvstep[media]``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from fvstep.core._optional import needs_extra

__all__ = ["Video", "frames_from_pixels", "strip", "write_gif", "write_mp4", "write_png_strip"]


def _check_frames(_: object, __: attrs.Attribute, frames: torch.Tensor) -> None:
    if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8:
        raise TypeError(f"Video.frames must be a uint8 tensor, got {frames!r:.60}")
    if frames.dim() != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(
            f"Video.frames must be (F, H, W, 3) with F >= 1, got {tuple(frames.shape)}"
        )
    if frames.device.type != "cpu":
        raise ValueError(f"Video.frames must be on the CPU, got {frames.device}")


@attrs.frozen(eq=False)
class Video:
    """A short video to log: RGB ``uint8`` frames ``(F, H, W, 3)`` on the CPU.

    Attributes:
        caption: A line that trackers show with it (e.g. the prompt).
    """

    frames: torch.Tensor = attrs.field(validator=_check_frames)
    fps: int = 16
    caption: str = ""


def frames_from_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """``uint8`` frames from float pixels ``(F, H, W, 3)`` in ``[0, 1]``, as diffusers rounds.

    ValueError if ``pixels`` is not floating point of shape ``(F, H, W, 3)``."""
    if not pixels.is_floating_point() or pixels.dim() != 4 or pixels.shape[-1] != 3:
        raise ValueError(
            f"pixels must be floating point (F, H, W, 3) in [0, 1], got {pixels.dtype} "
            f"{tuple(pixels.shape)}"
        )
    return (pixels.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def strip(video: Video, *, max_frames: int = 8) -> torch.Tensor:
    """The frames side by side, ``(H, n W, 3)``: ``n <= max_frames`` frames evenly spaced.

    The first and the last frame are among them.

    Raises:
        ValueError: If ``max_frames < 1``.

    Examples:
        >>> strip(video, max_frames=4).shape  # a 32x32 video
        torch.Size([32, 128, 3])
    """
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    num = video.frames.shape[0]
    picks = torch.linspace(0, num - 1, min(num, max_frames)).round().long().unique()
    return torch.cat(list(video.frames[picks]), dim=1)


def _even(frames: torch.Tensor) -> torch.Tensor:
    """Pad ``(F, H, W, 3)`` to even ``H`` and ``W`` by repeating the last row/column: H.264
    in yuv420p needs even sizes, and imageio would otherwise resize (and warn)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h:
        frames = torch.cat([frames, frames[:, -1:]], dim=1)
    if pad_w:
        frames = torch.cat([frames, frames[:, :, -1:]], dim=2)
    return frames


def write_mp4(video: Video, path: str | os.PathLike[str]) -> Path:
    """Write ``video`` as an H.264 MP4 at ``path`` (its folder made; odd sizes padded by one).

    MissingExtraError without ``imageio``/``imageio-ffmpeg`` (``pip install fvstep[media]``)."""
    imageio, path = _prepare_write(path)
    frames = _even(video.frames).numpy()
    imageio.v2.mimwrite(path, list(frames), fps=video.fps, macro_block_size=1, format="FFMPEG")
    return path


def write_gif(video: Video, path: str | os.PathLike[str]) -> Path:
    """Write ``video`` as a looping GIF (``imageio`` with Pillow); otherwise as :func:`write_mp4`."""
    imageio, path = _prepare_write(path)
    imageio.v3.imwrite(path, video.frames.numpy(), duration=1000 / video.fps, loop=0)
    return path


def write_png_strip(video: Video, path: str | os.PathLike[str], *, max_frames: int = 8) -> Path:
    """Write :func:`strip`'s image of ``video`` as one PNG; otherwise as :func:`write_mp4`."""
    imageio, path = _prepare_write(path)
    imageio.v3.imwrite(path, strip(video, max_frames=max_frames).numpy())
    return path


def _prepare_write(path: str | os.PathLike[str]) -> tuple[Any, Path]:
    """``imageio`` (first: a missing extra is the error, whatever the arguments) and
    ``path``, its folder made."""
    with needs_extra("media", "validation media"):
        import imageio.v2
        import imageio.v3

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return imageio, path
