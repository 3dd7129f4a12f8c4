"""Sample videos of a recipe's student at a cadence (``validation.sample_every``; see
``docs/recipes.md``, "Sample videos").

Examples:
    >>> samples = sample_validation(options, held, device=torch.device("cpu"))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fvstep.core._optional import needs_extra
from fvstep.core.state import TrainState
from fvstep.executor.reporting import Validation
from fvstep.executor.sampling import EulerSampler, Sampler, sample_videos
from fvstep.parallel import rank_and_world

__all__ = ["SAMPLES_PREFIX", "check_samples", "sample_validation"]

SAMPLES_PREFIX = "samples"
"""The prefix of the videos' names: ``media/step_<n>/samples_sample_<i>.mp4``."""


def _vae_folder(options: Any) -> Path | None:
    """``model.path`` when it is a pipeline folder with a ``vae/``, else ``None``."""
    path = getattr(getattr(options, "model", None), "path", None)
    if path is None or not (Path(path) / "vae" / "config.json").is_file():
        return None
    return Path(path)


def check_samples(options: Any) -> None:
    """Refuse (``ValueError``) ``validation`` sample options a run could not honour, before it
    starts; ``MissingExtraError`` without ``imageio-ffmpeg`` (the MP4 files)."""
    v = options.validation
    if v.sample_every < 0:
        raise ValueError(
            f"validation.sample_every is {v.sample_every}: give a number of steps, or 0 "
            "(no samples)"
        )
    if v.sample_every == 0:
        return
    if not 1 <= v.num_videos <= v.num_samples:
        raise ValueError(
            f"validation.num_videos is {v.num_videos}: give 1 to {v.num_samples} (the "
            "held-out items, validation.num_samples), or raise validation.num_samples"
        )
    if v.sample_steps < 1:
        raise ValueError(f"validation.sample_steps is {v.sample_steps}: give 1 or more")
    if _vae_folder(options) is None:
        raise ValueError(
            f"validation.sample_every {v.sample_every} needs a VAE, and model.path ({options.model.path!r}) "
            "is no pipeline folder with a vae/: give one, or --validation.sample_every 0"
        )
    if v.sample_weights == "ema" and getattr(options.optim, "ema", None) is None:
        raise ValueError(
            "validation.sample_weights is 'ema' and the run keeps no EMA (optim.ema is "
            "None): set --optim.ema, or --validation.sample_weights params (or auto)"
        )
    with needs_extra("media", "validation.sample_every (the videos' MP4 files)"):
        import imageio  # noqa: F401
        import imageio_ffmpeg  # noqa: F401


def _scheduler_shift(folder: Path) -> float:
    """The time shift of the pipeline's scheduler (``1``: none, or no scheduler)."""
    config = folder / "scheduler" / "scheduler_config.json"
    if not config.is_file():
        return 1.0
    return float(json.loads(config.read_text()).get("shift", 1.0))


def _load_vae(folder: Path, device: torch.device) -> nn.Module:
    with needs_extra("models", "validation.sample_every (the pipeline's VAE)"):
        from diffusers import AutoencoderKLWan

    vae: Any = AutoencoderKLWan.from_pretrained(
        str(folder), subfolder="vae", torch_dtype=torch.float32
    )
    return vae.to(device).eval()


def sample_validation(
    options: Any,
    held_out: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
    sampler: Sampler | None = None,
) -> Validation | None:
    """The sample videos of ``options.validation`` (checked by :func:`check_samples`) as a
    :class:`fvstep.Validation`; ``None`` when ``validation.sample_every`` is 0.

    Every rank samples (a sharded role needs all of them); rank 0 alone decodes and
    returns the videos.

    Args:
        held_out: The held-out items: the first ``validation.num_videos`` texts are the
            prompts, the latents the shape.
        sampler: The student's sampler (a distilled student's few-step schedule); ``None``:
            ``validation.sample_steps`` Euler steps at the pipeline scheduler's shift.
    """
    v = options.validation
    if v.sample_every == 0:
        return None
    folder = _vae_folder(options)
    assert folder is not None  # the caller's check_samples refused it otherwise
    text, shape = held_out["text"][: v.num_videos], tuple(held_out["latents"].shape[1:])
    # only rank 0 decodes (sample_videos); the others never touch their VAE
    vae = _load_vae(folder, device) if rank_and_world()[0] == 0 else nn.Module()
    chosen = sampler or EulerSampler(v.sample_steps, shift=_scheduler_shift(folder))
    by_weights: dict[str, Callable[[TrainState, torch.Tensor], Mapping[str, Any]]] = {}

    def videos(state: TrainState, key: torch.Tensor) -> Mapping[str, Any]:
        weights = v.sample_weights
        if weights == "auto":
            weights = "ema" if state.role("student").ema is not None else "params"
        if weights not in by_weights:
            by_weights[weights] = sample_videos(
                text, latent_shape=shape, vae=vae, role="student", sampler=chosen, weights=weights
            )
        return by_weights[weights](state, key)

    return Validation(videos, every=v.sample_every, prefix=SAMPLES_PREFIX)
