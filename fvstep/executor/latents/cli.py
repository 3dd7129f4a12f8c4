"""``fvstep data``: the command line of :mod:`fvstep.executor.latents` (``fvstep data encode``).

Registered by :mod:`fvstep.cli` through :func:`add_parser`; :func:`run_data` runs the
parsed command. Only the standard library is imported here; the handler imports the
models' libraries.

Examples:
    $ fvstep data encode clips/ latents/ --model Wan2.1-T2V-1.3B-Diffusers \\
          --num-frames 81 --height 480 --width 832 --device cuda
    $ torchrun --nproc_per_node 8 -m fvstep data encode clips/ latents/ --model ... --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from fvstep.core._optional import needs_extra

__all__ = ["UsageError", "add_parser", "run_data"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``data`` (with ``encode``) to the ``fvstep`` command's subparsers.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers`` returned.

    Returns:
        The ``data`` parser.

    Examples:
        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="fvstep")
        >>> _ = add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["data", "encode", "clips", "out", "--model", "m"]).data_command
        'encode'
    """
    data = subparsers.add_parser("data", help="datasets of precomputed latents: encode")
    sub = data.add_subparsers(dest="data_command", required=True)
    enc = sub.add_parser(
        "encode",
        help="videos or frame folders + captions -> Parquet shards of VAE latents and text "
        "embeddings (resumable; rank r of N encodes shards k with k %% N == r)",
    )
    enc.add_argument(
        "source", help="folder of clips (videos or frame folders) with NAME.txt captions"
    )
    enc.add_argument(
        "out",
        help="dataset folder to write (a rerun continues it; one with other settings, "
        "models, model dtype or device is refused: see its encode.json)",
    )
    enc.add_argument(
        "--model",
        help="diffusers pipeline folder or id with vae/, text_encoder/, tokenizer/ "
        "(e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)",
    )
    enc.add_argument("--vae", help="VAE folder (AutoencoderKLWan; default MODEL/vae)")
    enc.add_argument("--text-encoder", help="text encoder folder (default MODEL/text_encoder)")
    enc.add_argument("--tokenizer", help="tokenizer folder (default MODEL/tokenizer)")
    enc.add_argument("--captions", help='JSONL of {"file": KEY, "caption": TEXT} (over NAME.txt)')
    enc.add_argument(
        "--num-frames",
        type=int,
        default=None,
        help="at most this many frames a clip, cut to the largest 4k+1 (default all)",
    )
    enc.add_argument(
        "--height", type=int, default=None, help="output height, a multiple of --multiple"
    )
    enc.add_argument(
        "--width", type=int, default=None, help="output width, a multiple of --multiple"
    )
    enc.add_argument(
        "--multiple",
        type=int,
        default=16,
        help="height and width are multiples of it; without a size, crop to it (default 16)",
    )
    enc.add_argument("--max-tokens", type=int, default=512, help="text tokens (default 512)")
    enc.add_argument("--shard-size", type=int, default=64, help="clips a shard (default 64)")
    enc.add_argument("--batch-size", type=int, default=1, help="clips a model call (default 1)")
    enc.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="stored dtype (default bfloat16)",
    )
    enc.add_argument(
        "--model-dtype",
        default="float32",
        choices=["bfloat16", "float16", "float32"],
        help="dtype the models run in (default float32)",
    )
    enc.add_argument(
        "--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)"
    )
    enc.add_argument("--rank", type=int, default=None, help="this rank (default $RANK or 0)")
    enc.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks sharing the work (default $WORLD_SIZE or 1)",
    )
    enc.add_argument("--debug", action="store_true", help="show tracebacks")
    return data


class UsageError(ValueError):
    """A user error of ``fvstep data``: the ``fvstep`` command prints it as one line and
    exits 2."""


def _user_error(message: str) -> Exception:
    return UsageError(f"fvstep data encode: {message}")


def _check_size(height: int | None, width: int | None, multiple: int) -> None:
    """Refuse a size whose latents no patch fits: height and width must be multiples of
    ``multiple`` (16: the Wan VAE's 8 times Wan's 2 x 2 patch)."""
    for name, size in (("height", height), ("width", width)):
        if size is None or (size >= multiple and size % multiple == 0):
            continue
        low = max(multiple, size // multiple * multiple)
        near = sorted({low, low + multiple} if size > multiple else {multiple})
        raise _user_error(
            f"--{name} {size} is not a multiple of {multiple} (--multiple): its latents fit "
            f"no Wan patch (the VAE's 8 x the 2 x 2 patch). Valid sizes are multiples of "
            f"{multiple}, e.g. {' or '.join(map(str, near))}"
        )


def _load_models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    with needs_extra("data", "fvstep data encode"):
        import transformers
        from diffusers import AutoencoderKLWan

    dtype = getattr(torch, args.model_dtype)

    def where(explicit: str | None, sub: str) -> tuple[str, dict[str, str]]:
        if explicit:
            return explicit, {}
        if not args.model:
            raise _user_error(f"give --model, or --{sub.replace('_', '-')}")
        return args.model, {"subfolder": sub}

    path, kw = where(args.vae, "vae")
    vae = AutoencoderKLWan.from_pretrained(path, torch_dtype=dtype, **kw)
    path, kw = where(args.text_encoder, "text_encoder")
    config = transformers.AutoConfig.from_pretrained(path, **kw)
    arch = (getattr(config, "architectures", None) or ["UMT5EncoderModel"])[0]
    text_encoder = getattr(transformers, arch).from_pretrained(path, torch_dtype=dtype, **kw)
    path, kw = where(args.tokenizer, "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kw)
    return vae.eval(), text_encoder.eval(), tokenizer


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


def run_data(args: argparse.Namespace) -> int:
    """Run a parsed ``fvstep data`` command.

    Args:
        args: The parsed arguments (``add_parser``'s).

    Returns:
        The exit code (0).

    Raises:
        UsageError: For a user error (``fvstep`` prints it as one line and exits 2).
        ValueError: As :func:`fvstep.executor.latents.encode_clips`.

    Examples:
        >>> # run_data(parser.parse_args(["data", "encode", "clips", "out", "--model", "m"]))
    """
    import torch

    from fvstep.executor.latents.encode import encode_clips

    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    world = (
        args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    )
    if world < 1 or not 0 <= rank < world:
        raise _user_error(f"need 0 <= --rank < --world-size, got rank {rank} of {world}")
    for name in ("shard_size", "batch_size", "max_tokens", "multiple"):
        if getattr(args, name) < 1:
            raise _user_error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if (args.height is None) != (args.width is None):
        raise _user_error("give both --height and --width, or neither")
    _check_size(args.height, args.width, args.multiple)
    if not Path(args.source).is_dir():
        raise _user_error(f"the clips folder {args.source!r} does not exist")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    captions = _read_captions(args.captions)
    vae, text_encoder, tokenizer = _load_models(args)
    vae.to(device)
    text_encoder.to(device)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = encode_clips(
        args.source,
        args.out,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        num_frames=args.num_frames,
        height=args.height,
        width=args.width,
        multiple=args.multiple,
        max_tokens=args.max_tokens,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        dtype=getattr(torch, args.dtype),
        rank=rank,
        world_size=world,
        captions=captions,
        log=log,
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
