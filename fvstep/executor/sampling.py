"""Sampling from a role: flow-matching samplers, VAE decoding, sample videos for validation.

:func:`sample` runs an :class:`EulerSampler` (``WanPipeline``'s) or a
:class:`FewStepSampler` (a DMD2 student's); :func:`sample_videos` is a validation function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core._optional import needs_extra
from fvstep.core.state import TrainState
from fvstep.executor.media import Video, frames_from_pixels
from fvstep.executor.validation import Weights, module_device, role_module
from fvstep.methods import _noise
from fvstep.methods._checks import check_count, check_denoising_steps
from fvstep.methods.causal_wan import (
    causal_forward,
    chunk_frames_of,
    init_cache,
    is_causal,
    recorded_chunk_frames,
)
from fvstep.methods.finetune import add_noise, x0_from_velocity
from fvstep.methods.models import predict
from fvstep.parallel.ranks import rank_and_world

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler

__all__ = [
    "EulerSampler",
    "FewStepSampler",
    "Sampler",
    "decode_latents",
    "sample",
    "sample_videos",
]


def _positive_int(_: object, attribute: attrs.Attribute, value: int) -> None:
    check_count(value, attribute.name)


@attrs.frozen
class EulerSampler:
    """``num_steps`` flow-matching Euler steps from ``t = 1`` to ``0``, as ``WanPipeline``.

    The times and steps of ``FlowMatchEulerDiscreteScheduler(shift=shift)``. With
    ``guidance_scale > 1`` the velocity is classifier-free guided, ``v = v_neg + s (v -
    v_neg)``, on the negative text (zeros unless given).

    Attributes:
        shift: The scheduler's time shift (``1``: none; Wan uses 3 to 5).
        guidance_scale: ``s``; ``<= 1`` is unguided.
    """

    num_steps: int = attrs.field(default=50, validator=_positive_int)
    shift: float = 1.0
    guidance_scale: float = 1.0

    def scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """A fresh diffusers ``FlowMatchEulerDiscreteScheduler(shift=self.shift)``."""
        with needs_extra("models", "EulerSampler"):
            from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(shift=self.shift)


@attrs.frozen
class FewStepSampler:
    """A few-step student's sampler: :func:`fvstep.methods.dmd2.rollout` to its last step.

    From noise at ``t_0``: ``x0 = x - t_i v(x, t_i)``; then ``x = (1 - t_{i+1}) x0 +
    t_{i+1} eps_i`` with fresh keyed noise ``eps_i``; the last ``x0`` is the sample.

    Attributes:
        denoising_steps: Decreasing times in ``(0, 1]``.
    """

    denoising_steps: tuple[float, ...] = attrs.field(
        default=(1.0,), converter=lambda s: tuple(float(x) for x in s)
    )

    def __attrs_post_init__(self) -> None:
        check_denoising_steps(self.denoising_steps)


Sampler = EulerSampler | FewStepSampler


def sample(
    module: nn.Module,
    noise: torch.Tensor,
    text: torch.Tensor,
    *,
    sampler: Sampler,
    key: torch.Tensor | None = None,
    negative_text: torch.Tensor | None = None,
) -> torch.Tensor:
    """Generate clean latents from ``noise`` with ``module`` (the forward contract).

    Runs under ``torch.no_grad()``; a causal Wan generates chunk by chunk
    (docs/methods/causal_wan.md).

    Args:
        noise: The starting noise ``(B, C, F, H, W)``, on the module's device.
        key: The re-noising key of a multi-step :class:`FewStepSampler`.
        negative_text: The negative text of a guided :class:`EulerSampler` (default zeros).

    Returns:
        The latents, shaped like ``noise``.

    Raises:
        ValueError: If a multi-step :class:`FewStepSampler` has no ``key``.
        ValueError: If a causal model's frames are not a multiple of its chunk.
        ValueError: If the module's config records a causal Wan that it is not.
    """
    causal = is_causal(module)
    if causal:
        chunk = chunk_frames_of(module)
        if noise.shape[2] % chunk:
            raise ValueError(
                f"the noise's {noise.shape[2]} frames are not a multiple of the chunk ({chunk})"
            )
    elif recorded_chunk_frames(module) is not None:
        chunk_frames_of(module)  # raises: the record of a causal model that is not causal
    if isinstance(sampler, FewStepSampler) and len(sampler.denoising_steps) > 1 and key is None:
        raise ValueError("a FewStepSampler with more than one step needs a key")
    texts = [text]
    if isinstance(sampler, EulerSampler) and sampler.guidance_scale > 1.0:
        texts.append(torch.zeros_like(text) if negative_text is None else negative_text)
    if causal:
        return _sample_causal(module, noise, texts, sampler, key)

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _guided(sampler, [predict(module, x, t, c) for c in texts])

    with torch.no_grad():
        return _run(velocity, noise, sampler, key)


def _guided(sampler: Sampler, vs: list[torch.Tensor]) -> torch.Tensor:
    """The velocity, classifier-free guided when ``vs`` holds the negative text's too."""
    if len(vs) == 1:
        return vs[0]
    assert isinstance(sampler, EulerSampler)
    return vs[1] + sampler.guidance_scale * (vs[0] - vs[1])


def _run(
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    sampler: Sampler,
    key: torch.Tensor | None,
) -> torch.Tensor:
    """The sampler's loop; a few-step one re-noises before step ``i + 1`` from ``fold_in(key, i)``."""
    batch = x.shape[0]
    if isinstance(sampler, EulerSampler):
        scheduler: Any = sampler.scheduler()
        scheduler.set_timesteps(sampler.num_steps, device=x.device)
        for t in scheduler.timesteps:
            x = scheduler.step(velocity(x, t.expand(batch)), t, x, return_dict=False)[0]
        return x
    steps = sampler.denoising_steps
    x0 = x
    for i, s in enumerate(steps):
        t = torch.full((batch,), s, device=x.device)
        x0 = x0_from_velocity(x, t, velocity(x, t * 1000))
        if i + 1 < len(steps):
            assert key is not None
            eps = _noise.randn_like(fsrandom.fold_in(key, i), x0)
            x = add_noise(x0, eps, torch.full((batch,), steps[i + 1], device=x.device))
    return x0


def _sample_causal(
    module: nn.Module,
    noise: torch.Tensor,
    texts: list[torch.Tensor],
    sampler: Sampler,
    key: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`sample` of a causal Wan: chunk by chunk with its KV cache (one per text)."""
    chunk = chunk_frames_of(module)
    batch, _, frames, _, _ = noise.shape
    caches = [init_cache(module, noise, capacity_frames=frames) for _ in texts]

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        vs = [causal_forward(module, x, t, c, cache=k)[0] for c, k in zip(texts, caches)]
        return _guided(sampler, vs)

    out = []
    with torch.no_grad():
        for c in range(frames // chunk):
            x = noise[:, :, c * chunk : (c + 1) * chunk].contiguous()
            # the rollout's re-noising keys of chunk c (causal_rollout.rollout)
            k_renoise = None if key is None else fsrandom.split(fsrandom.fold_in(key, c), 3)[1]
            x = _run(velocity, x, sampler, k_renoise)
            out.append(x)
            t_clean = torch.zeros((batch,), device=noise.device)
            caches = [
                causal_forward(module, x, t_clean, c, cache=k, update_cache=True)[1]  # type: ignore[misc]
                for c, k in zip(texts, caches)
            ]
    return torch.cat(out, 2)


def decode_latents(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Pixels ``(B, F, H, W, 3)`` in ``[0, 1]`` from latents ``(B, C, F, H, W)``, as Wan does.

    Args:
        vae: A diffusers ``AutoencoderKLWan`` (or any VAE with that config and ``decode``).
    """
    with needs_extra("models", "decode_latents"):
        from diffusers.video_processor import VideoProcessor

    config: Any = getattr(vae, "config")  # noqa: B009 - a diffusers FrozenDict
    param = next(vae.parameters())
    with torch.no_grad():
        latents = latents.to(param.device, param.dtype)

        def stat(values: Any) -> torch.Tensor:
            view = torch.tensor(values).view(1, config.z_dim, 1, 1, 1)
            return view.to(latents.device, latents.dtype)

        mean, inv_std = stat(config.latents_mean), 1.0 / stat(config.latents_std)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]  # type: ignore[operator]
        processor = VideoProcessor(vae_scale_factor=config.scale_factor_spatial)
        pixels = processor.postprocess_video(video, output_type="pt")
    return pixels.permute(0, 1, 3, 4, 2)  # (B, F, C, H, W) -> channels last


def sample_videos(
    text: torch.Tensor,
    *,
    latent_shape: Sequence[int],
    vae: nn.Module,
    role: str = "student",
    sampler: Sampler | None = None,
    weights: Weights = "params",
    key: torch.Tensor | None = None,
    negative_text: torch.Tensor | None = None,
    captions: Sequence[str] | None = None,
    fps: int = 16,
) -> Callable[[TrainState, torch.Tensor], Mapping[str, Any]]:
    """A validation function that samples ``role`` once per prompt embedding.

    Prompt ``i`` starts from fixed noise drawn from ``fold_in(key, i)``, so successive
    validations differ only by the weights. Every rank samples; global rank 0 decodes and
    returns ``{"sample_<i>": Video}`` (the others ``{}``). See docs/concepts/validation.md.

    Args:
        text: Prompt embeddings ``(P, L, D)``, one per video.
        latent_shape: ``(C, F, H, W)`` of one video's latents.
        vae: The VAE that decodes them, on the device to decode on.
        sampler: Default ``EulerSampler(50)``.
        weights: ``"params"`` or ``"ema"`` (:func:`fvstep.executor.validation.role_module`).
        key: The noise key (default ``fvstep.random.key(0)``).
        negative_text: Negative prompt embeddings ``(P, L, D)`` for a guided sampler.

    Raises:
        ValueError: If ``text`` is not ``(P, L, D)`` or ``latent_shape`` not 4 sizes.
        ValueError: If the captions do not match the prompts.
    """
    if text.dim() != 3:
        raise ValueError(f"text must be (P, L, D), got {tuple(text.shape)}")
    shape = tuple(int(s) for s in latent_shape)
    if len(shape) != 4:
        raise ValueError(f"latent_shape must be (C, F, H, W), got {shape}")
    num = text.shape[0]
    if captions is not None and len(captions) != num:
        raise ValueError(f"{len(captions)} captions for {num} prompts")
    chosen: Sampler = EulerSampler() if sampler is None else sampler
    base_key = fsrandom.key(0) if key is None else key
    prompts = text.detach().clone()
    negatives = None if negative_text is None else negative_text.detach().clone()

    def fn(state: TrainState, key: torch.Tensor) -> Mapping[str, Any]:
        out: dict[str, Any] = {}
        decodes = rank_and_world()[0] == 0
        with torch.no_grad(), role_module(state, role, weights=weights) as module:
            device = module_device(module)
            for i in range(num):
                k_noise, k_renoise = fsrandom.split(fsrandom.fold_in(base_key, i), 2)
                noise = _noise.randn(k_noise, (1, *shape)).to(device)
                latents = sample(
                    module,
                    noise,
                    prompts[i : i + 1].to(device),
                    sampler=chosen,
                    key=k_renoise,
                    negative_text=None if negatives is None else negatives[i : i + 1].to(device),
                )
                if decodes:
                    pixels = decode_latents(vae, latents)[0]
                    caption = "" if captions is None else captions[i]
                    out[f"sample_{i}"] = Video(frames_from_pixels(pixels), fps=fps, caption=caption)
        return out

    return fn
