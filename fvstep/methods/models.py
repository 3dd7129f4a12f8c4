"""Tiny models and data for examples and tests, and the forward contract of the methods.

The reference methods call a role's module as a flow-matching velocity predictor through
:func:`predict`, whose docstring states the contract. Batches are dicts with
``"latents"`` (clean latents ``x0``, ``(B, C, F, H, W)``) and ``"text"`` (``(B, L, D)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core._optional import needs_extra
from fvstep.methods import _noise

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

__all__ = ["predict", "synthetic_batch", "tiny_wan"]


def tiny_wan(
    *,
    seed: int = 0,
    num_layers: int = 2,
    in_channels: int = 4,
    dim_per_head: int = 8,
    num_heads: int = 2,
    text_dim: int = 16,
    ffn_dim: int = 32,
    freq_dim: int = 16,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    rope_max_seq_len: int = 32,
) -> WanTransformer3DModel:
    """A tiny ``diffusers.WanTransformer3DModel``, built from a config on the CPU (no download).

    The weights are a pure function of ``seed`` (the global RNG is left untouched).

    Args:
        in_channels: Latent channels (also the output channels).
        text_dim: Dimension of the text embeddings (``D`` of ``batch["text"]``).
        patch_size: ``(frames, height, width)``; latents' ``F, H, W`` must be divisible by it.

    Returns:
        The model (in training mode, fp32, on the CPU).

    Raises:
        ImportError: If diffusers is not installed (``pip install fvstep[models]``).
    """
    with needs_extra("models", "tiny_wan"):
        from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=patch_size,
            num_attention_heads=num_heads,
            attention_head_dim=dim_per_head,
            in_channels=in_channels,
            out_channels=in_channels,
            text_dim=text_dim,
            freq_dim=freq_dim,
            ffn_dim=ffn_dim,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=rope_max_seq_len,
        )


def synthetic_batch(
    key: torch.Tensor,
    *,
    batch_size: int = 4,
    channels: int = 4,
    frames: int = 2,
    height: int = 4,
    width: int = 4,
    text_len: int = 3,
    text_dim: int = 16,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A random batch ``{"latents": (B, C, F, H, W), "text": (B, L, D)}``, a pure function of ``key``."""
    k_latents, k_text = fsrandom.split(key, 2)
    shape = (batch_size, channels, frames, height, width)
    latents = _noise.randn(k_latents, shape, device=device, dtype=dtype)
    text = _noise.randn(k_text, (batch_size, text_len, text_dim), device=device, dtype=dtype)
    return {"latents": latents, "text": text}


def predict(
    module: nn.Module, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor
) -> torch.Tensor:
    """The velocity that ``module`` predicts at ``x``, through the forward contract::

        velocity = module(
            hidden_states=x,                # (B, C, F, H, W) noisy latents x_t
            timestep=t,                     # (B,) float, flow-matching time in [0, 1] times 1000
            encoder_hidden_states=text,     # (B, L, D) text embeddings
            return_dict=False,
        )[0]                                # (B, C, F, H, W), the velocity eps - x0

    on the path ``x_t = (1 - t) * x0 + t * eps``, so ``x0 = x_t - t * velocity``.
    ``diffusers.WanTransformer3DModel`` has this signature; any ``nn.Module`` whose
    ``forward`` takes these keywords and returns a tuple works with every method.

    Raises:
        ValueError: If ``t`` is not of shape ``(B,)`` or the output's shape is not ``x``'s.
    """
    if t.dim() != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(
            f"timestep must have shape (batch,) = ({x.shape[0]},), got {tuple(t.shape)}"
        )
    out: Any = module(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
    velocity = out[0]
    if not isinstance(velocity, torch.Tensor) or velocity.shape != x.shape:
        got = (
            tuple(velocity.shape) if isinstance(velocity, torch.Tensor) else type(velocity).__name__
        )
        raise ValueError(
            f"the module's output[0] must be a velocity of the input's shape {tuple(x.shape)}, "
            f"got {got}; see the forward contract in fvstep.methods.models"
        )
    return velocity
