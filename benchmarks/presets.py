"""Model presets of the benchmarks: a ``WanTransformer3DModel`` config and a sample's shape.

- ``tiny-wan``: :func:`fvstep.methods.models.tiny_wan`'s config, for CPU smoke runs;
- ``small-wan``: 4 blocks of dim 128, for CPU runs with some arithmetic;
- ``wan-1.3b``: the Wan2.1-1.3B shape (random init), 3549 video tokens and 512 text
  tokens a sample, for GPUs;
- ``wan-1.3b-480p``: the same model at the resolution it is trained at, 480x832, 81
  frames (latents 16x21x60x104): 32,760 video tokens and 512 text tokens a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

import fvstep as fs
from fvstep.methods.models import synthetic_batch

__all__ = ["PRESETS", "Preset", "build_model", "make_batch"]

_WAN_COMMON: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
}


@dataclass(frozen=True)
class Preset:
    """A model (a ``WanTransformer3DModel`` config) and the shape of one sample.

    Attributes:
        name: The preset's name (``--preset``).
        config: ``WanTransformer3DModel`` keyword arguments.
        latent_shape: ``(C, F, H, W)`` of one sample's latents.
        text_len: Text tokens per sample.
        note: One line for the help text.
    """

    name: str
    config: dict[str, Any]
    latent_shape: tuple[int, int, int, int]
    text_len: int
    note: str = ""

    @property
    def num_tokens(self) -> int:
        """Video tokens per sample: ``F/pf * H/ph * W/pw``."""
        _, f, h, w = self.latent_shape
        pf, ph, pw = self.config["patch_size"]
        return (f // pf) * (h // ph) * (w // pw)

    def skeleton(self) -> Preset:
        """The same blocks and parameter tensors with tiny dims: a host-bound twin.

        Same number of layers, hence the same parameter-tensor count and FSDP2 groups,
        so a step's Python work is the same while its arithmetic is negligible.
        """
        config = {**self.config, **PRESETS["tiny-wan"].config}
        config["num_layers"] = self.config["num_layers"]
        tiny = PRESETS["tiny-wan"]
        return replace(tiny, name=f"{self.name}-skeleton", config=config)


PRESETS: dict[str, Preset] = {
    "tiny-wan": Preset(
        "tiny-wan",
        {
            **_WAN_COMMON,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 16,
            "ffn_dim": 32,
            "num_layers": 2,
            "rope_max_seq_len": 32,
        },
        latent_shape=(4, 2, 4, 4),
        text_len=3,
        note="fvstep.methods.models.tiny_wan (10k params, 8 tokens): CPU smoke runs",
    ),
    "small-wan": Preset(
        "small-wan",
        {
            **_WAN_COMMON,
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 64,
            "freq_dim": 32,
            "ffn_dim": 512,
            "num_layers": 4,
            "rope_max_seq_len": 64,
        },
        latent_shape=(16, 4, 16, 16),
        text_len=32,
        note="4 blocks of dim 128 (1.0M params, 256 tokens): CPU runs with some arithmetic",
    ),
    "wan-1.3b": Preset(
        "wan-1.3b",
        {
            **_WAN_COMMON,
            "num_attention_heads": 12,
            "attention_head_dim": 128,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
            "freq_dim": 256,
            "ffn_dim": 8960,
            "num_layers": 30,
            "rope_max_seq_len": 1024,
        },
        latent_shape=(16, 21, 26, 26),
        text_len=512,
        note="Wan2.1-1.3B shape, random init (3549 tokens + 512 text tokens a sample): GPU",
    ),
}
PRESETS["wan-1.3b-480p"] = replace(
    PRESETS["wan-1.3b"],
    name="wan-1.3b-480p",
    latent_shape=(16, 21, 60, 104),
    note="Wan2.1-1.3B at 480x832x81 (32,760 tokens + 512 text tokens a sample): GPU",
)


def build_model(preset: Preset, *, device: torch.device, seed: int = 0) -> nn.Module:
    """The preset's ``WanTransformer3DModel``, fp32, initialised directly on ``device``.

    Construction runs under ``torch.device(device)`` (parameters are allocated and
    initialised there: no CPU copy of a 1.3B model) and a forked RNG seeded with
    ``seed``, so every rank builds the same weights and the global RNG is untouched.
    """
    from diffusers import WanTransformer3DModel

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model: nn.Module = WanTransformer3DModel(**preset.config)  # type: ignore[assignment]
    return model


def make_batch(
    preset: Preset, batch_size: int, *, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A synthetic ``{"latents", "text"}`` batch of the preset's shapes (fp32)."""
    c, f, h, w = preset.latent_shape
    return synthetic_batch(
        fs.random.key(seed),
        batch_size=batch_size,
        channels=c,
        frames=f,
        height=h,
        width=w,
        text_len=preset.text_len,
        text_dim=preset.config["text_dim"],
        device=device,
    )
