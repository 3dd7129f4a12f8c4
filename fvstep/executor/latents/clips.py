"""The inputs of an encode: clips found in a folder, their frames read and fitted."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fvstep.core._optional import needs_extra

__all__ = ["Clip", "find_clips", "fit_frames", "read_frames"]

_VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class Clip:
    """One input clip: its key (path relative to the folder), path, kind and caption."""

    key: str
    path: Path
    kind: str  # "video" or "frames"
    caption: str


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)


def find_clips(
    root: str | os.PathLike[str], *, captions: Mapping[str, str] | None = None
) -> list[Clip]:
    """The clips (video files, frame folders) under ``root``, keyed by relative path, sorted;
    a caption is ``captions[key]``, else ``a/b.txt`` beside ``a/b.mp4`` (``a/c.txt`` or
    ``a/c/caption.txt`` for frame folder ``a/c/``); ValueError if none, or no clips at all."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"the clips folder {str(root)!r} does not exist")
    found: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames.sort()
        if here != root and any(Path(f).suffix.lower() in _IMAGE_SUFFIXES for f in filenames):
            found.append((here, "frames"))
            dirnames.clear()  # a frame folder is one clip
            continue
        found += [
            (here / f, "video") for f in filenames if Path(f).suffix.lower() in _VIDEO_SUFFIXES
        ]
    clips, missing = [], []
    for path, kind in found:
        key = path.relative_to(root).as_posix()
        caption = None if captions is None else captions.get(key)
        if caption is None:
            for candidate in (
                path.with_suffix(".txt") if kind == "video" else path.parent / f"{path.name}.txt",
                path / "caption.txt",
            ):
                if candidate.is_file():
                    caption = candidate.read_text().strip()
                    break
        if caption is None:
            missing.append(key)
        else:
            clips.append(Clip(key, path, kind, caption))
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5])
        raise ValueError(
            f"{len(missing)} clip(s) under {str(root)!r} have no caption ({shown}"
            f"{', ...' if len(missing) > 5 else ''}): add NAME.txt beside each, or a captions file"
        )
    if not clips:
        raise ValueError(
            f"no clips under {str(root)!r}: expected video files ({', '.join(_VIDEO_SUFFIXES)}) "
            "or folders of images"
        )
    return sorted(clips, key=lambda c: c.key)


def read_frames(clip: Clip, *, max_frames: int | None = None) -> torch.Tensor:
    """A clip's first ``max_frames`` frames (default all), ``uint8`` ``(F, H, W, 3)``.

    ValueError (naming the file) if the clip cannot be read or has no frames."""
    with needs_extra("data", "reading clips"):
        import imageio.v3 as iio
    import numpy as np

    frames: list[Any] = []
    try:
        if clip.kind == "frames":
            for p in _images(clip.path)[:max_frames]:
                frames.append(iio.imread(p))
        else:
            # PyAV itself: imageio's PyAV plugin runs a full gc.collect() on every close.
            with needs_extra("data", "reading video files"):
                import av

            with av.open(str(clip.path)) as container:
                for frame in container.decode(video=0):
                    frames.append(frame.to_ndarray(format="rgb24"))
                    if max_frames is not None and len(frames) >= max_frames:
                        break
    except Exception as e:
        raise ValueError(f"cannot read clip {str(clip.path)!r}: {e}") from e
    if not frames:
        raise ValueError(f"clip {str(clip.path)!r} has no frames")
    rgb = [f[..., :3] if f.ndim == 3 else np.repeat(f[..., None], 3, axis=-1) for f in frames]
    if len({f.shape for f in rgb}) != 1:
        raise ValueError(f"clip {str(clip.path)!r} has frames of different sizes")
    return torch.from_numpy(np.stack(rgb).astype(np.uint8))


def fit_frames(
    frames: torch.Tensor,
    *,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    temporal_factor: int = 4,
    multiple: int = 16,
) -> torch.Tensor:
    """Cut ``uint8`` frames ``(T, H, W, 3)`` to ``k * temporal_factor + 1``, resize to cover
    ``height x width`` and centre-crop (without a size: crop to a multiple of ``multiple``);
    ValueError for one of height/width, or frames below ``multiple``."""
    if (height is None) != (width is None):
        raise ValueError("give both height and width, or neither")
    t = frames.shape[0] if num_frames is None else min(frames.shape[0], num_frames)
    t = (t - 1) // temporal_factor * temporal_factor + 1
    x = frames[:t]
    h, w = x.shape[1], x.shape[2]
    if height is not None and width is not None:
        scale = max(height / h, width / w)
        size = (max(height, round(h * scale)), max(width, round(w * scale)))
        if size != (h, w):
            y = x.permute(0, 3, 1, 2).float()
            y = F.interpolate(y, size=size, mode="bilinear", antialias=True, align_corners=False)
            x = y.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        th, tw = height, width
    else:
        th, tw = h // multiple * multiple, w // multiple * multiple
        if th == 0 or tw == 0:
            raise ValueError(f"frames of {h}x{w} are smaller than the multiple {multiple}")
    top, left = (x.shape[1] - th) // 2, (x.shape[2] - tw) // 2
    return x[:, top : top + th, left : left + tw].contiguous()
