"""The identity of an encode (``encode.json``): what decides its latents, checked on reruns.

The settings, a digest of the clip list, and for each model its class, config, dtype,
device type (and TF32 switches) and weights. What is left out, and why:
docs/concepts/data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fvstep.executor.latents.clips import Clip
from fvstep.executor.latents.format import dtype_name, temporary_path

__all__ = ["agree_on_settings", "describe_encode"]

_SETTINGS_FILE = "encode.json"


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
        # Through a pinned buffer of this worker's: a pageable copy is much slower
        # (docs/concepts/data.md).
        buffer = getattr(staging, "buffer", None)
        if buffer is None:
            buffer = staging.buffer = torch.empty(_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        part = buffer[: part.numel()].copy_(part)
    else:
        part = part.cpu()
    return hashlib.sha256(part.numpy().data).digest()


def _weights_digest(module: torch.nn.Module) -> str:
    """A digest of every state-dict tensor's name, dtype, shape and bytes, in name order.

    A tensor tied to an earlier one is recorded as such, not hashed twice; pieces are
    hashed by up to 8 threads (``hashlib`` releases the GIL).
    """
    state = module.state_dict()
    lines: list[str] = []
    jobs: list[tuple[torch.Tensor, int]] = []
    owners: list[int] = []  # the line each job's digest belongs to
    first: dict[tuple[Any, ...], str] = {}
    for name in sorted(state):
        t = state[name]
        lines.append(f"{name} {dtype_name(t.dtype)} {list(t.shape)}")
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
    """What decides a model's outputs: class, config, dtypes, device type and weights."""
    state = module.state_dict()
    dtypes = sorted({dtype_name(t.dtype) for t in state.values() if t.is_floating_point()})
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


def describe_encode(
    clips: Sequence[Clip],
    options: Mapping[str, Any],
    *,
    vae: Any,
    text_encoder: Any,
    tokenizer: Any,
) -> dict[str, Any]:
    """The identity of an encode of the whole folder's ``clips``, as ``encode.json`` records it.

    ``options``: the JSON-able settings that decide the latents."""
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
    lines = [f"{k}: {show(before, k)} in {_SETTINGS_FILE}, {show(now, k)} now" for k in keys]
    if any(k.endswith(".dtype") for k in keys):
        lines.append("(a weights digest is of the weights as loaded: it changes with the dtype)")
    return "; ".join(lines)


def agree_on_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record ``settings`` in ``out``; ValueError (naming each differing key) if it holds others.

    Every rank calls it before writing; a hard link (not a rename) lets exactly one publish."""
    path = out / _SETTINGS_FILE
    if not path.exists():
        tmp = temporary_path(path)
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
            f"{str(out)!r} holds an encode with other settings: {_differences(previous, settings)}; "
            f"use another output folder, delete this one, or rerun with the settings of {_SETTINGS_FILE}"
        )
