"""``fvstep data encode``: :func:`run_encode`'s signature is the command's options.

Only the standard library is imported here. Usage: docs/concepts/data.md.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from fvstep.core._optional import needs_extra
from fvstep.core.errors import UsageError

__all__ = ["run_encode"]

Dtype = Literal["bfloat16", "float16", "float32"]


def _user_error(message: str) -> Exception:
    return UsageError(f"fvstep data encode: {message}")


def _check_size(height: int | None, width: int | None, multiple: int) -> None:
    """Refuse a height or width that is not a multiple of ``multiple``."""
    for name, size in (("height", height), ("width", width)):
        if size is None or (size >= multiple and size % multiple == 0):
            continue
        low = max(multiple, size // multiple * multiple)
        near = sorted({low, low + multiple} if size > multiple else {multiple})
        raise _user_error(
            f"--{name} {size} is not a multiple of {multiple} (--multiple, the Wan VAE's 8 x "
            f"the 2 x 2 patch): use a multiple of {multiple}, e.g. {' or '.join(map(str, near))}"
        )


def _load_models(
    model: str | None, vae: str | None, text_encoder: str | None, tokenizer: str | None, dtype: str
) -> tuple[Any, Any, Any]:
    import torch

    with needs_extra("data", "fvstep data encode"):
        import transformers
        from diffusers import AutoencoderKLWan

    torch_dtype = getattr(torch, dtype)

    def where(explicit: str | None, sub: str) -> tuple[str, dict[str, str]]:
        if explicit:
            return explicit, {}
        if not model:
            raise _user_error(f"give --model, or --{sub.replace('_', '-')}")
        return model, {"subfolder": sub}

    path, kw = where(vae, "vae")
    vae_model = AutoencoderKLWan.from_pretrained(path, torch_dtype=torch_dtype, **kw)
    path, kw = where(text_encoder, "text_encoder")
    config = transformers.AutoConfig.from_pretrained(path, **kw)
    arch = (getattr(config, "architectures", None) or ["UMT5EncoderModel"])[0]
    encoder = getattr(transformers, arch).from_pretrained(path, torch_dtype=torch_dtype, **kw)
    path, kw = where(tokenizer, "tokenizer")
    return vae_model.eval(), encoder.eval(), transformers.AutoTokenizer.from_pretrained(path, **kw)


def _read_captions(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    captions = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                entry = json.loads(line)
                captions[str(entry["file"])] = str(entry["caption"])
            except (ValueError, KeyError, TypeError) as e:
                raise _user_error(
                    f'{path}:{n}: expected {{"file": ..., "caption": ...}}: {e}'
                ) from None
    return captions


def run_encode(
    source: str,
    out: str,
    *,
    model: str | None = None,
    vae: str | None = None,
    text_encoder: str | None = None,
    tokenizer: str | None = None,
    captions: str | None = None,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    multiple: int = 16,
    max_tokens: int = 512,
    shard_size: int = 64,
    batch_size: int = 1,
    dtype: Dtype = "bfloat16",
    model_dtype: Dtype = "float32",
    device: str = "cpu",
    rank: int | None = None,
    world_size: int | None = None,
) -> int:
    """Encode videos or frame folders + captions into Parquet shards of VAE latents and
    text embeddings (resumable; rank r of N encodes shards k with k % N == r).

    Args:
        source: folder of clips (videos or frame folders) with NAME.txt captions
        out: dataset folder to write (a rerun continues it; one with other settings,
            models, model dtype or device is refused: see its encode.json)
        model: diffusers pipeline folder or id with vae/, text_encoder/, tokenizer/
            (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)
        vae: VAE folder (AutoencoderKLWan; default MODEL/vae)
        text_encoder: text encoder folder (default MODEL/text_encoder)
        tokenizer: tokenizer folder (default MODEL/tokenizer)
        captions: JSONL of {"file": KEY, "caption": TEXT} (over NAME.txt)
        num_frames: at most this many frames a clip, cut to the largest 4k+1 (default all)
        height: output height, a multiple of --multiple
        width: output width, a multiple of --multiple
        multiple: height and width are multiples of it; without a size, crop to it
        max_tokens: text tokens
        shard_size: clips a shard
        batch_size: clips a model call
        dtype: stored dtype
        model_dtype: dtype the models run in
        device: cpu or cuda (under torchrun: cuda:LOCAL_RANK)
        rank: this rank (default $RANK or 0)
        world_size: ranks sharing the work (default $WORLD_SIZE or 1)
    """
    import torch

    from fvstep.executor.latents.encode import encode_clips

    rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1 or not 0 <= rank < world:
        raise _user_error(f"need 0 <= --rank < --world-size, got rank {rank} of {world}")
    counts = {"shard-size": shard_size, "batch-size": batch_size, "max-tokens": max_tokens}
    for name, value in {**counts, "multiple": multiple}.items():
        if value < 1:
            raise _user_error(f"--{name} must be >= 1, got {value}")
    if (height is None) != (width is None):
        raise _user_error("give both --height and --width, or neither")
    _check_size(height, width, multiple)
    if not Path(source).is_dir():
        raise _user_error(f"the clips folder {source!r} does not exist")
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    by_file = _read_captions(captions)
    vae_model, encoder, tokenizer_model = _load_models(
        model, vae, text_encoder, tokenizer, model_dtype
    )
    result = encode_clips(
        source,
        out,
        vae=vae_model.to(where),
        text_encoder=encoder.to(where),
        tokenizer=tokenizer_model,
        num_frames=num_frames,
        height=height,
        width=width,
        multiple=multiple,
        max_tokens=max_tokens,
        shard_size=shard_size,
        batch_size=batch_size,
        dtype=getattr(torch, dtype),
        rank=rank,
        world_size=world,
        captions=by_file,
        log=functools.partial(print, file=sys.stderr, flush=True),
    )
    mine = len(result.written) + len(result.skipped)
    done = (
        f"index {str(result.index)!r}"
        if result.index is not None
        else "no index yet: other ranks' shards are unfinished (rerun to complete)"
    )
    print(
        f"rank {rank} of {world}: {result.num_clips} clips in {result.num_shards} shards; this rank "
        f"wrote {len(result.written)} and found {len(result.skipped)} of its {mine} finished; {done}"
    )
    return 0
