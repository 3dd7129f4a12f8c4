"""Encoding clips into the on-disk format: :func:`encode_clips` (``fvstep data encode``)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fvstep.core._checks import check_int
from fvstep.core.errors import ShardError
from fvstep.executor.latents.clips import Clip, find_clips, fit_frames, read_frames
from fvstep.executor.latents.encode_identity import agree_on_settings, describe_encode
from fvstep.executor.latents.format import (
    INDEX_FILE,
    ShardInfo,
    describe_shard,
    dtype_name,
    open_shard,
    shard_name,
    write_index,
    write_shard,
)

__all__ = ["EncodeResult", "encode_clips"]


@dataclass
class EncodeResult:
    """What one call of :func:`encode_clips` did on this rank: clips and shards of the whole
    folder, this rank's shards written and skipped (already finished), and the index path once
    every shard is finished (else ``None``)."""

    num_clips: int
    num_shards: int
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    index: Path | None = None


def _encode_video(vae: Any, clips: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Normalised posterior means of same-shape ``uint8`` clips ``(T, H, W, 3)``."""
    x = torch.stack(clips).to(device).permute(0, 4, 1, 2, 3)  # (B, 3, T, H, W)
    x = x.to(vae.dtype) / 127.5 - 1.0
    z = vae.encode(x).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    if mean.shape[1] != z.shape[1] or std.shape[1] != z.shape[1]:
        raise ValueError(
            f"the VAE's latents_mean/latents_std have {mean.shape[1]}/{std.shape[1]} entries, "
            f"its latents {z.shape[1]} channels"
        )
    return list(((z - mean) / std).cpu().unbind(0))


def _encode_text(
    text_encoder: Any, tokenizer: Any, captions: list[str], max_tokens: int, device: torch.device
) -> tuple[list[torch.Tensor], list[int]]:
    tokens = tokenizer(
        captions,
        padding="max_length",
        max_length=max_tokens,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    hidden = text_encoder(ids, attention_mask=mask).last_hidden_state.float()
    hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)  # zero past each caption's length
    return list(hidden.cpu().unbind(0)), mask.sum(dim=1).tolist()


@contextmanager
def _evaluating(*modules: Any) -> Iterator[None]:
    """Run ``modules`` in eval mode (dropout off: nothing random), then give each submodule
    its mode back (a model built from a config, not loaded, starts in training mode)."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for m, training in modes:  # parents first: a child's own mode is set after
            m.train(training)


def _finished(path: Path, clips: Sequence[Clip]) -> bool:
    """Whether ``path`` is a whole shard of exactly ``clips`` (a damaged one is redone)."""
    if not path.exists():
        return False
    try:
        pf, _ = open_shard(path)
        keys = pf.read(columns=["key"]).column("key").to_pylist()
    except (ShardError, OSError, ValueError, KeyError) as e:
        print(f"fvstep: re-encoding {str(path)!r}: {e}", file=sys.stderr, flush=True)
        return False
    return bool(keys == [c.key for c in clips])


def encode_clips(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    vae: Any,
    text_encoder: Any,
    tokenizer: Any,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    multiple: int = 16,
    max_tokens: int = 512,
    shard_size: int = 64,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
    world_size: int = 1,
    captions: Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> EncodeResult:
    """Encode the clips under ``source`` into a dataset in ``out``; rank ``r`` encodes the shards
    ``k`` with ``k % world_size == r``. What is stored, and reruns: docs/concepts/data.md.

    Args:
        vae: A diffusers ``AutoencoderKLWan`` (or a VAE with its ``encode`` and config).
        text_encoder: A transformers encoder:
            ``text_encoder(ids, attention_mask=mask).last_hidden_state``.
        num_frames: At most this many frames a clip (default all), of the form ``k * t + 1``
            (``t`` the VAE's temporal factor).
        height: Output height (with ``width``); default: each clip's own, cropped.
        multiple: Without a size, crop to a multiple of this.
        max_tokens: Text tokens a caption is padded or truncated to (Wan: 512).
        shard_size: Clips a shard.
        batch_size: Clips a model call (clips of one shape share a VAE call).
        dtype: The stored dtype of latents and text embeddings.
        captions: Captions by clip key, over caption files.
        log: Called with one line per shard (e.g. ``print``).

    Raises:
        ValueError: If a clip has no caption or cannot be read (naming it).
        ValueError: If ``out`` holds an encode with other settings or models (naming each
            key that differs).
        ValueError: If an argument is out of range.
    """
    shard_size = check_int(shard_size, "shard_size", minimum=1)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    world_size = check_int(world_size, "world_size", minimum=1)
    rank = check_int(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}), got {rank}")
    if (height is None) != (width is None):  # before anything is written to `out`
        raise ValueError("give both height and width, or neither")
    factor = int(2 ** sum(bool(d) for d in vae.config.temperal_downsample))  # diffusers' spelling
    if num_frames is not None and (num_frames < 1 or (num_frames - 1) % factor):
        raise ValueError(f"num_frames must be k * {factor} + 1 (e.g. 81), got {num_frames}")
    clips = find_clips(source, captions=captions)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fit: dict[str, Any] = {
        "num_frames": num_frames,
        "height": height,
        "width": width,
        "multiple": multiple,
    }
    options = {
        **fit,
        "max_tokens": max_tokens,
        "shard_size": shard_size,
        "dtype": dtype_name(dtype),
    }
    settings = describe_encode(
        clips, options, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer
    )
    agree_on_settings(out, settings)
    fit["temporal_factor"] = factor
    num_shards = -(-len(clips) // shard_size)
    result = EncodeResult(len(clips), num_shards)
    device = next(vae.parameters()).device
    text_device = next(text_encoder.parameters()).device

    def encode_batch(batch: list[Clip]) -> list[dict[str, Any]]:
        pixels = []
        for clip in batch:
            frames = read_frames(clip, max_frames=num_frames)
            try:
                pixels.append(fit_frames(frames, **fit))
            except ValueError as e:
                raise ValueError(f"clip {str(clip.path)!r}: {e}") from e
        latents: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        for shape in dict.fromkeys(p.shape for p in pixels):  # one VAE call a shape, in order
            where = [i for i, p in enumerate(pixels) if p.shape == shape]
            for i, z in zip(where, _encode_video(vae, [pixels[i] for i in where], device)):
                latents[i] = z
        texts = [c.caption for c in batch]
        text, lengths = _encode_text(text_encoder, tokenizer, texts, max_tokens, text_device)
        return [
            {
                "key": clip.key,
                "caption": clip.caption,
                "latents": z.to(dtype),
                "text": t.to(dtype),
                "text_length": n,
            }
            for clip, z, t, n in zip(batch, latents, text, lengths, strict=True)
        ]

    with _evaluating(vae, text_encoder), torch.no_grad():
        for k in range(rank, num_shards, world_size):
            name = shard_name(k)
            for stale in out.glob(f"{name}.tmp-*"):  # left by a killed run (temporary_path)
                stale.unlink(missing_ok=True)
            part = clips[k * shard_size : (k + 1) * shard_size]
            if _finished(out / name, part):
                result.skipped.append(name)
                continue
            rows: list[dict[str, Any]] = []
            for i in range(0, len(part), batch_size):
                rows += encode_batch(part[i : i + batch_size])
            write_shard(out / name, rows)
            result.written.append(name)
            if log is not None:
                log(f"rank {rank}: wrote {name} ({len(rows)} clips)")
    result.index = _write_index_if_complete(out, num_shards, settings)
    return result


def _write_index_if_complete(out: Path, num_shards: int, settings: dict[str, Any]) -> Path | None:
    paths = [out / shard_name(k) for k in range(num_shards)]
    if not all(p.exists() for p in paths):
        return None
    infos: list[ShardInfo] = [describe_shard(p) for p in paths]
    if (out / INDEX_FILE).exists():
        try:
            current = json.loads((out / INDEX_FILE).read_text())
            if current.get("shards") == [i.to_json() for i in infos]:
                return out / INDEX_FILE
        except ValueError:
            pass
    return write_index(out, infos, extra={"encode": settings})
