"""A tiny diffusers ``WanPipeline`` folder, built from configs on the CPU, for trying the
whole path without a download (``fvstep data encode``, ``train``, ``export``).

The parts: the tiny Wan (:func:`fvstep.methods.models.tiny_wan`), an ``AutoencoderKLWan``
with ``z_dim=4``, a one-layer ``UMT5EncoderModel``, a ``ByT5Tokenizer`` and a flow-matching
scheduler; random weights, a pure function of ``seed``.

Examples:
    >>> save_tiny_pipeline("tiny-wan")  # PosixPath('tiny-wan')
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_tiny_pipeline"]


def save_tiny_pipeline(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a tiny ``WanPipeline`` folder at ``path`` (created; files of the same names
    replaced) and return it; ``seed`` seeds every part's weights, not the global RNG."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    from fvstep.methods.models import tiny_wan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae: Any = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
        config = UMT5Config(vocab_size=384, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
        text_encoder = UMT5EncoderModel(config)
    transformer: Any = tiny_wan(seed=seed)
    pipe: Any = WanPipeline(
        tokenizer=ByT5Tokenizer(),
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(str(path))
    return Path(path)
