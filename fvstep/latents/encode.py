"""Encoding clips into the on-disk format: :func:`encode_clips` (``fvstep data encode``).

**Inputs.** A folder whose clips are video files (``.mp4``, ``.webm``, ``.mov``,
``.mkv``, ``.avi``, ``.gif``) or *frame folders* (a
directory holding images, in name order), found recursively. A clip's caption is the
text file beside it with the same stem (``a/b.mp4`` -> ``a/b.txt``; frame folder ``a/c/``
-> ``a/c.txt`` or ``a/c/caption.txt``), or an entry of a ``captions`` mapping (a JSONL
file of ``{"file": ..., "caption": ...}`` lines in the CLI). A clip's *key* is its path
relative to the folder; clips are sorted by key.

**Per clip.** Frames: the first ``num_frames`` (default all), cut to the largest count
of the form ``k * t + 1`` (``t`` the VAE's temporal factor, 4 for Wan). Pixels: resized
to cover ``height x width`` and centre-cropped, or (without a size) centre-cropped to a
multiple of ``multiple`` (16: the VAE's 8 times Wan's 2 x 2 patch). Latents: the VAE
posterior's mean (``latent_dist.mode()``; nothing random: the models run in eval mode,
whatever mode they come in, and get theirs back), normalised as Wan's
pipelines expect, ``(z - latents_mean) / latents_std``. Text: the caption tokenised to
``max_tokens`` (padded, truncated), encoded, positions past its length set to zero (as
``WanPipeline`` does), stored with ``text_length``. Clips of different sizes give
different latent shapes: the loader's shape buckets keep them apart.

**Shards, ranks, resume.** Clip ``i`` goes to shard ``i // shard_size``, and rank ``r``
of ``world_size`` encodes the shards ``k`` with ``k % world_size == r``: the output does
not depend on the number of ranks (nor need the ranks talk to each other). A finished
shard is renamed into place, so a killed run loses only the shards in progress; a rerun
(with any number of ranks) skips the finished ones. ``encode.json`` records the
encode's identity: the settings, a digest of the clip list, and for each model its
class, a digest of its config (the VAE's includes ``latents_mean``/``latents_std``;
the tokenizer's, its vocabulary and rules), the dtype and device type it runs in (with
the TF32 switches on CUDA) and a digest of its weights. Every rank checks it before it
writes anything: a rerun that differs in any of these is refused, naming each key that
differs with both values, instead of mixing two encodings in one dataset. Not in it:
the batch size and the GPU model (they change latents by rounding alone, e.g. 2e-7 in
fp32 for the batch size), library versions, and the clips' pixels (a clip file replaced
under the same key and caption goes unnoticed). The rank that finds every shard
finished writes ``index.json``; until then the dataset is not readable.

Examples:
    >>> from fvstep.latents.encode import fit_frames
    >>> fit_frames(torch.zeros(11, 30, 40, 3, dtype=torch.uint8), multiple=16).shape
    torch.Size([9, 16, 32, 3])
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fvstep._checks import check_int
from fvstep.latents.format import (
    INDEX_FILE,
    ShardError,
    ShardInfo,
    _open,
    describe_shard,
    shard_name,
    write_index,
    write_shard,
)

__all__ = ["Clip", "EncodeResult", "encode_clips", "find_clips", "fit_frames", "read_frames"]

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SETTINGS_FILE = "encode.json"


@dataclass(frozen=True)
class Clip:
    """One input clip: its key (path relative to the folder), path, kind and caption."""

    key: str
    path: Path
    kind: str  # "video" or "frames"
    caption: str


@dataclass
class EncodeResult:
    """What one call of :func:`encode_clips` did on this rank.

    Attributes:
        num_clips: Clips in the whole folder.
        num_shards: Shards of the whole dataset.
        written: The shards this call encoded.
        skipped: This rank's shards that were already finished.
        index: The index path if this call wrote it (every shard finished), else ``None``.
    """

    num_clips: int
    num_shards: int
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    index: Path | None = None


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def find_clips(
    root: str | os.PathLike[str], *, captions: Mapping[str, str] | None = None
) -> list[Clip]:
    """The clips under ``root`` with their captions, sorted by key.

    Args:
        root: The input folder.
        captions: Captions by clip key (relative path, ``/``-separated); these win over
            caption files.

    Returns:
        The clips.

    Raises:
        FileNotFoundError: If ``root`` is not a directory.
        ValueError: If there are no clips, or some have no caption (the first few named).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "a.mp4").write_bytes(b""); (root / "a.txt").write_text("a cat")
        0
        5
        >>> [(c.key, c.caption) for c in find_clips(root)]
        [('a.mp4', 'a cat')]
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"the clips folder {str(root)!r} does not exist")
    found: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames.sort()
        if here != root and any(Path(f).suffix.lower() in IMAGE_SUFFIXES for f in filenames):
            found.append((here, "frames"))
            dirnames.clear()  # a frame folder is one clip
            continue
        found += [
            (here / f, "video") for f in filenames if Path(f).suffix.lower() in VIDEO_SUFFIXES
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
            f"no clips under {str(root)!r}: expected video files ({', '.join(VIDEO_SUFFIXES)}) "
            "or folders of images"
        )
    return sorted(clips, key=lambda c: c.key)


def read_frames(clip: Clip, *, max_frames: int | None = None) -> torch.Tensor:
    """A clip's frames as a ``uint8`` tensor of shape ``(frames, height, width, 3)``.

    Args:
        clip: The clip (a video file or a frame folder).
        max_frames: Read at most this many frames from the start (default all).

    Returns:
        The frames.

    Raises:
        ValueError: If the clip cannot be read or has no frames (naming the file).

    Examples:
        >>> import tempfile, numpy as np, imageio.v3 as iio
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp()) / "clip"; folder.mkdir()
        >>> for i in range(2): iio.imwrite(folder / f"{i}.png", np.zeros((8, 8, 3), np.uint8))
        >>> read_frames(Clip("clip", folder, "frames", "x")).shape
        torch.Size([2, 8, 8, 3])
    """
    import imageio.v3 as iio
    import numpy as np

    frames: list[Any] = []
    try:
        if clip.kind == "frames":
            for p in _images(clip.path)[:max_frames]:
                frames.append(iio.imread(p))
        else:
            # PyAV itself: imageio's PyAV plugin runs a full gc.collect() on every close.
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
    """Cut frames to ``k * temporal_factor + 1`` and fit them to the size (see the module).

    Args:
        frames: ``uint8`` frames ``(T, H, W, 3)``.
        num_frames: At most this many frames (default all).
        height: The output height (with ``width``): resize to cover, then centre-crop.
        width: The output width.
        temporal_factor: The VAE's temporal compression.
        multiple: Without a size: centre-crop height and width to a multiple of this.

    Returns:
        ``uint8`` frames ``(T', H', W', 3)``.

    Raises:
        ValueError: If only one of ``height``/``width`` is given, or the frames are smaller
            than ``multiple``.

    Examples:
        >>> fit_frames(torch.zeros(6, 20, 30, 3, dtype=torch.uint8), height=8, width=8).shape
        torch.Size([5, 8, 8, 3])
    """
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


def _temporal_factor(vae: Any) -> int:
    return int(2 ** sum(bool(d) for d in vae.config.temperal_downsample))


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


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Set when a model is saved or loaded, or said elsewhere in the identity (class, dtype):
# none of them changes what the model computes.
_NOT_CONFIG = ("transformers_version", "diffusers_version", "torch_dtype", "dtype", "architectures")


def _config(module: Any) -> dict[str, Any]:
    config: Any = getattr(module, "config", None)
    as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return {k: v for k, v in as_dict.items() if not k.startswith("_") and k not in _NOT_CONFIG}


def _tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """What decides a tokenizer's ids: its vocabulary and rules, special tokens and sides."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a tokenizers-backed one: vocabulary, normaliser, pre-tokeniser...
        rules: Any = json.loads(backend.to_str())
        # Each call sets padding and truncation on the backend (to max_tokens, recorded
        # on its own): what an earlier call left there is no part of the tokenizer.
        rules.pop("padding", None)
        rules.pop("truncation", None)
    else:
        rules = sorted(tokenizer.get_vocab().items())
    return {
        "rules": rules,
        "special_tokens": getattr(tokenizer, "special_tokens_map", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
    }


_CHUNK_BYTES = 64 << 20  # one hash job: a 2 GB embedding spreads over the cores too


def _hash_piece(flat: torch.Tensor, start: int, staging: threading.local) -> bytes:
    part = flat[start : start + _CHUNK_BYTES]
    if part.is_cuda:
        # Through a pinned buffer of this worker's: a pageable copy from an H200 ran at
        # 1.2 GB/s, a pinned one at 24 GB/s (8 threads).
        buffer = getattr(staging, "buffer", None)
        if buffer is None:
            buffer = staging.buffer = torch.empty(_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        part = buffer[: part.numel()].copy_(part)
    else:
        part = part.cpu()
    return hashlib.sha256(part.numpy().data).digest()


def _weights_digest(module: torch.nn.Module) -> str:
    """A digest of ``module``'s weights: every state-dict tensor's name, dtype, shape and bytes.

    Tensors are taken in name order, so the digest depends on the weights alone (not on
    the device, nor on the order of registration); a tensor tied to an earlier one (an
    embedding shared with the input layer) is recorded as such, not hashed twice. The bytes
    are SHA-256-hashed on the CPU in 64 MiB pieces by up to 8 threads (``hashlib``
    releases the GIL), a GPU's through pinned buffers. Measured on a UMT5-XXL-shaped bf16
    encoder (5.7 B parameters, 11.4 GB): 1.3 s on an H200 host (16 cores; the same on its
    CPU), 7.6 s on 2 cores; a Wan-VAE-sized fp32 one (0.5 GB) 0.1 s. It is a digest of the
    weights *as loaded*: the same checkpoint loaded in another dtype gives another one.
    """
    state = module.state_dict()
    lines: list[str] = []
    jobs: list[tuple[torch.Tensor, int]] = []
    owners: list[int] = []  # the line each job's digest belongs to
    first: dict[tuple[Any, ...], str] = {}
    for name in sorted(state):
        t = state[name]
        lines.append(f"{name} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.stride())
        tie = (*where, t.dtype, tuple(t.shape))
        if tie in first:
            lines[-1] += f" = {first[tie]}"
            continue
        first[tie] = name
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), _CHUNK_BYTES):
            jobs.append((flat, start))
            owners.append(len(lines) - 1)
    staging = threading.local()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(lambda job: _hash_piece(job[0], job[1], staging), jobs)
        for line, digest in zip(owners, digests):
            lines[line] += f" {digest.hex()}"
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _model_identity(module: Any) -> dict[str, Any]:
    """What decides a model's outputs: class, config, the dtypes and device it runs in, and
    its weights."""
    state = module.state_dict()
    dtypes = sorted(
        {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    )
    device = next(module.parameters()).device.type  # cuda:0 and cuda:1 compute the same
    identity = {
        "class": type(module).__name__,
        "config_sha256": _digest(_config(module)),
        "dtype": "+".join(dtypes) or "none",  # "bfloat16+float32": some layers kept in fp32
        "device": device,
        "weights_sha256": _weights_digest(module),
    }
    if device == "cuda":
        # TF32 (cuDNN's is on by default) changes float32 convolutions and matmuls.
        identity["tf32"] = {
            "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn": bool(torch.backends.cudnn.allow_tf32),
        }
    return identity


def _settings(
    clips: Sequence[Clip],
    options: Mapping[str, Any],
    *,
    vae: Any,
    text_encoder: Any,
    tokenizer: Any,
) -> dict[str, Any]:
    return {
        "num_clips": len(clips),
        "clips_sha256": _digest([(c.key, c.caption) for c in clips]),
        **options,
        "models": {
            "vae": _model_identity(vae),
            "text_encoder": _model_identity(text_encoder),
            "tokenizer": {
                "class": type(tokenizer).__name__,
                "config_sha256": _digest(_tokenizer_config(tokenizer)),
            },
        },
    }


def _flat(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"models": {"vae": {"dtype": ...}}}`` as ``{"models.vae.dtype": ...}``."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _differences(previous: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """The settings that differ, each with both values, e.g. ``models.vae.dtype: ...``."""
    before, now = _flat(previous), _flat(settings)

    def show(values: dict[str, Any], key: str) -> str:
        return repr(values[key]) if key in values else "absent"  # an older encode's file

    keys = [k for k in sorted({*before, *now}) if show(before, k) != show(now, k)]
    lines = [f"{k}: {show(before, k)} in {SETTINGS_FILE}, {show(now, k)} now" for k in keys]
    if any(k.endswith(".dtype") for k in keys):
        lines.append("(a weights digest is of the weights as loaded: it changes with the dtype)")
    return "; ".join(lines)


def _agree_on_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record ``settings`` in ``out``, or refuse if it holds an encode with other ones.

    Every rank calls it before it writes anything. The first to come publishes its
    settings with a hard link, which fails if the file exists: of ranks starting at once,
    exactly one publishes and the others compare with it (a rename would let each replace
    the other's and pass).
    """
    path = out / SETTINGS_FILE
    if not path.exists():
        tmp = out / f"{SETTINGS_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            pass  # another rank was first: compare with its settings below
        except OSError:  # a file system without hard links
            if not path.exists():
                os.replace(tmp, path)
                return
        finally:
            tmp.unlink(missing_ok=True)
    previous = json.loads(path.read_text())
    if previous != settings:
        raise ValueError(
            f"{str(out)!r} holds an encode with other settings: "
            f"{_differences(previous, settings)}. A dataset must be one encoding: use "
            f"another output folder, delete this one, or rerun with the settings of "
            f"{SETTINGS_FILE}"
        )


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
        pf, _ = _open(path)
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
    """Encode the clips under ``source`` into a dataset in ``out`` (see the module).

    Args:
        source: The clips folder.
        out: The dataset folder (created if needed).
        vae: A diffusers ``AutoencoderKLWan`` (or a VAE with its ``encode`` and config).
        text_encoder: A transformers encoder (``UMT5EncoderModel``, ``T5EncoderModel``...):
            ``text_encoder(ids, attention_mask=mask).last_hidden_state``.
        tokenizer: Its tokenizer.
        num_frames: At most this many frames a clip (default all); ``k * t + 1`` frames
            are kept (``t`` the VAE's temporal factor).
        height: Output height (with ``width``); default: each clip's own, cropped.
        width: Output width.
        multiple: Without a size, crop to a multiple of this (default 16).
        max_tokens: Text tokens a caption is padded or truncated to (Wan: 512).
        shard_size: Clips a shard, ``>= 1``.
        batch_size: Clips a model call, ``>= 1`` (clips of one shape share a VAE call).
        dtype: The stored dtype of latents and text embeddings (default ``bfloat16``).
        rank: This rank, ``0 <= rank < world_size``: it encodes shards ``k`` with
            ``k % world_size == rank``.
        world_size: The number of ranks sharing the work, ``>= 1``.
        captions: Captions by clip key, over caption files.
        log: Called with one line per shard (e.g. ``print``).

    Returns:
        What this call did: an :class:`EncodeResult`.

    Raises:
        ValueError: If a clip has no caption or cannot be read (naming it), ``out`` holds
            an encode with other settings or models (naming each key that differs, e.g.
            ``models.vae.weights_sha256``), or an argument is out of range.

    Examples:
        >>> # vae, text_encoder, tokenizer: see docs/concepts/data.md for tiny ones
        >>> # encode_clips("clips/", "latents/", vae=vae, text_encoder=te, tokenizer=tok)
    """
    shard_size = check_int(shard_size, "shard_size", minimum=1)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    world_size = check_int(world_size, "world_size", minimum=1)
    rank = check_int(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}), got {rank}")
    factor = _temporal_factor(vae)
    if num_frames is not None and (num_frames < 1 or (num_frames - 1) % factor):
        raise ValueError(f"num_frames must be k * {factor} + 1 (e.g. 81), got {num_frames}")
    clips = find_clips(source, captions=captions)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    options = {
        "num_frames": num_frames,
        "height": height,
        "width": width,
        "multiple": multiple,
        "max_tokens": max_tokens,
        "shard_size": shard_size,
        "dtype": str(dtype).removeprefix("torch."),
    }
    settings = _settings(clips, options, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
    _agree_on_settings(out, settings)
    num_shards = -(-len(clips) // shard_size)
    result = EncodeResult(len(clips), num_shards)
    device = next(vae.parameters()).device
    text_device = next(text_encoder.parameters()).device
    with _evaluating(vae, text_encoder), torch.no_grad():
        for k in range(rank, num_shards, world_size):
            name = shard_name(k)
            for stale in out.glob(f"{name}.tmp-*"):  # left by a killed run
                stale.unlink(missing_ok=True)
            part = clips[k * shard_size : (k + 1) * shard_size]
            if _finished(out / name, part):
                result.skipped.append(name)
                continue
            rows: list[dict[str, Any]] = []
            for i in range(0, len(part), batch_size):
                rows += _encode_batch(
                    part[i : i + batch_size],
                    vae=vae,
                    text_encoder=text_encoder,
                    tokenizer=tokenizer,
                    fit={
                        "num_frames": num_frames,
                        "height": height,
                        "width": width,
                        "temporal_factor": factor,
                        "multiple": multiple,
                    },
                    max_tokens=max_tokens,
                    dtype=dtype,
                    devices=(device, text_device),
                )
            write_shard(out / name, rows)
            result.written.append(name)
            if log is not None:
                log(f"rank {rank}: wrote {name} ({len(rows)} clips)")
    result.index = _write_index_if_complete(out, num_shards, settings)
    return result


def _encode_batch(
    clips: list[Clip],
    *,
    vae: Any,
    text_encoder: Any,
    tokenizer: Any,
    fit: dict[str, Any],
    max_tokens: int,
    dtype: torch.dtype,
    devices: tuple[torch.device, torch.device],
) -> list[dict[str, Any]]:
    pixels = []
    for clip in clips:
        frames = read_frames(clip, max_frames=fit["num_frames"])
        try:
            pixels.append(fit_frames(frames, **fit))
        except ValueError as e:
            raise ValueError(f"clip {str(clip.path)!r}: {e}") from e
    latents: list[torch.Tensor | None] = [None] * len(clips)
    for shape in dict.fromkeys(p.shape for p in pixels):  # one VAE call a shape, in order
        where = [i for i, p in enumerate(pixels) if p.shape == shape]
        for i, z in zip(where, _encode_video(vae, [pixels[i] for i in where], devices[0])):
            latents[i] = z
    text, lengths = _encode_text(
        text_encoder, tokenizer, [c.caption for c in clips], max_tokens, devices[1]
    )
    return [
        {
            "key": clip.key,
            "caption": clip.caption,
            "latents": z.to(dtype),
            "text": t.to(dtype),
            "text_length": n,
        }
        for clip, z, t, n in zip(clips, latents, text, lengths, strict=True)
        if z is not None
    ]


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
