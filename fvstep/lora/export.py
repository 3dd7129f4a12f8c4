"""Export a LoRA role: adapters in diffusers' LoRA format, or a merged transformer.

- :func:`lora_weights`: the adapter's full weights, keyed as peft's state dict.
- :func:`export_lora`: a folder with ``pytorch_lora_weights.safetensors`` as diffusers'
  ``save_lora_weights`` writes it (keys ``transformer.<peft key>``, the adapter's
  ``LoraConfig`` in the metadata), loadable by ``WanPipeline.load_lora_weights`` or
  ``WanTransformer3DModel.load_lora_adapter(path, prefix="transformer")``.
- :func:`export_merged`: a diffusers model folder of the base with the adapter merged
  into its weights (``W + scaling * B @ A``), loadable by ``from_pretrained``.

Sharded (FSDP2) weights are gathered collectively: call these on every rank; global
rank 0 writes.

Examples:
    >>> export_lora(state, "student", "out/student_lora", weights="ema")
    >>> pipe.load_lora_weights("out/student_lora")
    >>> export_merged(state, "student", "out/student_merged", dtype=torch.bfloat16)
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from fvstep._optional import needs_extra
from fvstep.checkpoint.diffusers_export import _config_json, _diffusers_class
from fvstep.checkpoint.export import (
    _agree,
    _check_target,
    _replace_dir,
    _save_safetensors,
    gather_weights,
)
from fvstep.checkpoint.layout import fsync
from fvstep.lora.adapters import LoRAModule, lora_layers
from fvstep.parallel.ranks import rank_and_world
from fvstep.state import TrainState
from fvstep.weights import Weights

__all__ = ["MERGED_DTYPE", "export_lora", "export_merged", "lora_weights", "merge_weights"]

PREFIX = "transformer"
"""The component prefix of diffusers' LoRA files for a pipeline's transformer."""

MERGED_DTYPE = torch.float32
"""The dtype :func:`merge_weights` and :func:`export_merged` write by default.

fp32, whatever the base's storage dtype: ``W + scaling * (B @ A)`` over a frozen bf16
base (``prepare``'s default) holds changes far below an ulp of ``W`` in bf16 (85 % of
the elements that three small AdamW steps of an adapter change, measured in
``tests/interactions/test_lora_x_precision.py``), which a bf16 merge would round back
to the base weight: the merged model would lose most of what was trained. fp32 keeps
them, and the bf16 base weights are exact in fp32. Pass ``dtype=torch.bfloat16`` for a
file half the size, knowing that it rounds."""


def _lora_module(state: TrainState, role: str) -> LoRAModule:
    if role not in state.roles:
        raise ValueError(f"no role {role!r}; the state has roles {sorted(state.roles)}")
    module = state.roles[role].role.module
    if not isinstance(module, LoRAModule):
        raise ValueError(
            f"role {role!r} holds a {type(module).__name__}, not a fvstep.lora.LoRAModule "
            "(made by fvstep.lora.add_adapters): it has no adapter to write; write its "
            "weights as a diffusers model (fvstep.checkpoint.export_diffusers; fvstep "
            "export --format model)"
        )
    return module


def _base_role(state: TrainState, module: LoRAModule, role: str) -> str:
    for name, rs in state.roles.items():
        if rs.role.module is module.base:
            return name
    raise ValueError(
        f"the base of LoRA role {role!r} is not a role of the state: add it as a frozen "
        "role (fvstep.Role(base, save_frozen=False)) so that its weights are in the state"
    )


def lora_weights(
    state: TrainState,
    role: str,
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor] | None:
    """The full weights of a LoRA role's adapter, keyed as peft's state dict.

    Keys like ``blocks.0.attn1.to_q.lora_A.weight`` (no adapter name), on the CPU.
    Call it on every rank (sharded adapters are gathered).

    Args:
        state: The training state.
        role: A role whose module is a :class:`~fvstep.lora.LoRAModule`.
        weights: ``"params"`` or ``"ema"`` (the adapter's moving average).
        dtype: Cast to this floating-point dtype; ``None`` keeps each tensor's.

    Returns:
        Name to tensor on global rank 0; ``None`` on the other ranks.

    Raises:
        ValueError: For a role that is not a LoRA role, or ``weights="ema"`` without EMA.

    Examples:
        >>> sd = lora_weights(state, "student", weights="ema")
    """
    _lora_module(state, role)
    return gather_weights(state, role, weights=weights, dtype=dtype)


def _merge_names(module: LoRAModule) -> dict[str, tuple[str, str, float]]:
    """Base weight name -> (lora_A name, lora_B name, scaling) for vanilla Linear LoRA."""
    out: dict[str, tuple[str, str, float]] = {}
    for path, layer in lora_layers(module.base):
        if module.adapter not in layer.__dict__.get("lora_A", {}):
            continue
        if not isinstance(layer.get_base_layer(), torch.nn.Linear) or layer.fan_in_fan_out:
            raise ValueError(
                f"cannot merge adapter {module.adapter!r} into {path!r}: only LoRA on "
                f"nn.Linear layers is merged, not on {type(layer.get_base_layer()).__name__}"
            )
        if layer.use_dora.get(module.adapter) or layer.lora_bias.get(module.adapter):
            raise ValueError(
                f"cannot merge adapter {module.adapter!r} into {path!r}: DoRA and LoRA "
                "biases are not supported"
            )
        out[f"{path}.base_layer.weight"] = (
            f"{path}.lora_A.weight",
            f"{path}.lora_B.weight",
            float(layer.scaling[module.adapter]),
        )
    return out


def merge_weights(
    state: TrainState,
    role: str,
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor] | None:
    """The base's weights with a LoRA role's adapter merged in, keyed as the plain model.

    Each adapted weight becomes ``W + scaling * (B @ A)``, computed in fp32 and cast once
    to ``dtype`` (default :data:`MERGED_DTYPE`, fp32, whatever the base's dtype: a bf16
    merge rounds away the changes smaller than an ulp of ``W``, most of a LoRA's): the
    merged model's outputs differ from the LoRA role's by rounding only. Names are the
    base model's own (peft's ``.base_layer`` removed), so ``type(base).from_config(base.config).load_state_dict(...)`` takes them.
    Call it on every rank.

    Args:
        state: The training state (with the LoRA role and its base's role).
        role: The LoRA role.
        weights: ``"params"`` or ``"ema"`` (of the adapter; the base is frozen), as
            :func:`fvstep.weights.select_weights` decides (live before the EMA starts).
        dtype: The dtype of every floating-point tensor written (default
            :data:`MERGED_DTYPE`, fp32); the merge itself is always computed in fp32.

    Returns:
        Name to tensor on global rank 0; ``None`` on the other ranks.

    Raises:
        ValueError: For a role that is not a LoRA role, a base that is not a role of the
            state, or an adapter that cannot be merged (DoRA, a non-Linear layer).

    Examples:
        >>> net.load_state_dict(merge_weights(state, "student"))
    """
    module = _lora_module(state, role)
    merges = _merge_names(module)
    base = gather_weights(state, _base_role(state, module, role))
    adapter = gather_weights(state, role, weights=weights)
    if base is None or adapter is None:
        return None
    target = MERGED_DTYPE if dtype is None else dtype
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        if name in merges:
            a, b, scaling = merges[name]
            delta = adapter[b].float() @ adapter[a].float()
            # In fp32, then one cast to the target: a cast to the base's bf16 first
            # would round away every change smaller than half an ulp of W.
            tensor = tensor.float() + scaling * delta
        if tensor.is_floating_point():
            tensor = tensor.to(target)
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def _write_dir(path: Path, fill: Any) -> None:
    """Fill a fresh temporary folder beside ``path``, fsync it, rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    try:
        tmp.mkdir()
        fill(tmp)
        for f in tmp.iterdir():
            fsync(f)
        fsync(tmp)
        _replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _metadata(module: LoRAModule) -> dict[str, Any]:
    """The adapter's LoraConfig as diffusers stores it (JSON-friendly)."""
    config = module.config.to_dict()
    return {
        k: sorted(v) if isinstance(v, set) else v
        for k, v in config.items()
        if k in ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "lora_bias")
        or k in ("rank_pattern", "alpha_pattern", "init_lora_weights", "lora_dropout")
    }


def export_lora(
    state: TrainState,
    role: str,
    path: str | os.PathLike[str],
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path | None:
    """Write a LoRA role's adapter in diffusers' LoRA format (a folder).

    The folder holds ``pytorch_lora_weights.safetensors``, written by diffusers'
    ``WanPipeline.save_lora_weights``: keys ``transformer.blocks.0.attn1.to_q.lora_A.weight``,
    and the adapter's ``LoraConfig`` (rank, alpha, target modules) in the file's
    metadata, so that ``load_lora_weights`` scales it as in training. Call it on every
    rank; global rank 0 writes (atomically: a temporary folder renamed into place).

    Args:
        state: The training state.
        role: A LoRA role (its module is a :class:`~fvstep.lora.LoRAModule`).
        path: The folder to write.
        weights: ``"params"`` or ``"ema"``.
        dtype: Cast to this floating-point dtype (e.g. ``torch.bfloat16``).
        overwrite: Replace a non-empty folder at ``path``.

    Returns:
        ``path`` on global rank 0, ``None`` on the others.

    Raises:
        ImportError: If diffusers is not installed.
        ValueError: For a role that is not a LoRA role, ``weights="ema"`` without an EMA,
            or an existing non-empty ``path`` without ``overwrite``. Raised on every rank.

    Examples:
        >>> export_lora(state, "student", "out/lora")
        >>> pipe.load_lora_weights("out/lora")   # a diffusers WanPipeline
    """
    with needs_extra("lora", "LoRA export"):
        from diffusers import WanPipeline

    module = _lora_module(state, role)
    path = Path(path)
    writes = rank_and_world()[0] == 0
    _agree("check the export target", (lambda: _check_target(path, overwrite)) if writes else None)
    tensors = lora_weights(state, role, weights=weights, dtype=dtype)

    def write() -> None:
        assert tensors is not None
        _write_dir(
            path,
            lambda tmp: WanPipeline.save_lora_weights(
                tmp,
                transformer_lora_layers=tensors,
                transformer_lora_adapter_metadata=_metadata(module),
            ),
        )

    _agree("write the LoRA export", write if writes else None)
    return path if writes else None


def export_merged(
    state: TrainState,
    role: str,
    path: str | os.PathLike[str],
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path | None:
    """Write the base with a LoRA role's adapter merged in, as a diffusers model folder.

    ``config.json`` (the base's config) and ``diffusion_pytorch_model.safetensors``
    (:func:`merge_weights`), so that ``type(base).from_pretrained(path)`` loads a plain
    model (no peft layers) computing what the LoRA role computes, up to rounding. Call
    it on every rank; global rank 0 writes.

    Args:
        state: The training state (with the LoRA role and its base's role).
        role: The LoRA role.
        path: The folder to write.
        weights: ``"params"`` or ``"ema"`` (of the adapter).
        dtype: The dtype written (default :data:`MERGED_DTYPE`, fp32; see :func:`merge_weights`).
        overwrite: Replace a non-empty folder at ``path``.

    Returns:
        ``path`` on global rank 0, ``None`` on the others.

    Raises:
        ImportError: If diffusers is not installed.
        ValueError: As :func:`merge_weights`, for a base that is not a diffusers model,
            or an existing non-empty ``path`` without ``overwrite``. Raised on every rank.

    Examples:
        >>> export_merged(state, "student", "out/merged")
        >>> WanTransformer3DModel.from_pretrained("out/merged")
    """
    with needs_extra("lora", "the merged export"):
        from diffusers.utils import SAFETENSORS_WEIGHTS_NAME

    module = _lora_module(state, role)
    cls = _diffusers_class(module.base, _base_role(state, module, role))
    path = Path(path)
    writes = rank_and_world()[0] == 0
    _agree("check the export target", (lambda: _check_target(path, overwrite)) if writes else None)
    tensors = merge_weights(state, role, weights=weights, dtype=dtype)

    def fill(tmp: Path) -> None:
        assert tensors is not None
        _save_safetensors(tensors, tmp / SAFETENSORS_WEIGHTS_NAME)
        (tmp / cls.config_name).write_text(_config_json(module.base, cls))

    _agree("write the merged export", (lambda: _write_dir(path, fill)) if writes else None)
    return path if writes else None
