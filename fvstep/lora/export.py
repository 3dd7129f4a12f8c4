"""A LoRA role's exports: the formats ``"lora"`` and ``"merged"`` of :func:`fvstep.checkpoint.export`.

``"lora"`` writes ``pytorch_lora_weights.safetensors`` as diffusers' ``save_lora_weights``
does (the adapter's ``LoraConfig`` in its metadata), for ``load_lora_weights``;
``"merged"`` writes a diffusers model folder of the base with the adapter merged into its
weights (:func:`merge_weights`), for ``from_pretrained``. Registered on import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fvstep.checkpoint.exporting import FORMATS, ExportJob, Writer, gather_weights
from fvstep.core._optional import needs_extra
from fvstep.core.state import TrainState
from fvstep.core.weights import Weights
from fvstep.lora.adapters import LoRAModule, lora_layers

__all__ = ["MERGED_DTYPE", "merge_weights"]

MERGED_DTYPE = torch.float32
"""The dtype :func:`merge_weights` and ``format="merged"`` write by default: fp32, whatever
the base's dtype, since a bf16 merge rounds most of an adapter's change (below an ulp of
``W``) back to the base weight. ``dtype=torch.bfloat16`` halves the file and rounds."""


def _lora_module(state: TrainState, role: str) -> LoRAModule:
    if role not in state.roles:
        raise ValueError(f"no role {role!r}; the state has roles {sorted(state.roles)}")
    module = state.roles[role].role.module
    if not isinstance(module, LoRAModule):
        raise ValueError(
            f"role {role!r} holds a {type(module).__name__}, not a fvstep.lora.LoRAModule: it has no "
            "adapter to write; export its weights with format='diffusers' (fvstep export --format model)"
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
    rank0_only: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The base's weights with a LoRA role's adapter merged in, keyed as the plain model.

    Each adapted weight becomes ``W + scaling * (B @ A)``, computed in fp32 and cast once
    to ``dtype`` (default :data:`MERGED_DTYPE`). Names are the base model's own (peft's
    ``.base_layer`` removed), for ``load_state_dict`` of the plain model. Call it on every
    rank; ``state`` holds the base as a role too. ``weights`` (the adapter's) and
    ``rank0_only`` as :func:`fvstep.checkpoint.gather_weights`.

    Raises:
        ValueError: For a role that is not a LoRA role, a base that is not a role of the
            state, or an adapter that cannot be merged (DoRA, a non-Linear layer).

    Examples:
        >>> net.load_state_dict(merge_weights(state, "student"))
    """
    module = _lora_module(state, role)
    merges = _merge_names(module)
    base_role = _base_role(state, module, role)
    base = gather_weights(state, base_role, rank0_only=rank0_only)
    adapter = gather_weights(state, role, weights=weights, rank0_only=rank0_only)
    if base is None or adapter is None:
        return None
    target = MERGED_DTYPE if dtype is None else dtype
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        if name in merges:
            a, b, scaling = merges[name]
            delta = adapter[b].float() @ adapter[a].float()
            # fp32, then one cast: the base's bf16 first would round the change away
            tensor = tensor.float() + scaling * delta
        if tensor.is_floating_point():
            tensor = tensor.to(target)
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def _lora(job: ExportJob) -> Writer:
    with needs_extra("lora", "LoRA export"):
        from diffusers import WanPipeline

    module = _lora_module(job.state, job.role)
    config = module.config.to_dict()  # the adapter's LoraConfig as diffusers stores it
    keys = {"r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "lora_bias"}
    keys |= {"rank_pattern", "alpha_pattern", "init_lora_weights", "lora_dropout"}
    metadata: dict[str, Any] = {
        k: sorted(v) if isinstance(v, set) else v for k, v in config.items() if k in keys
    }
    return Writer(
        gather=job.gather,
        write=lambda tensors, folder: WanPipeline.save_lora_weights(
            folder, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=metadata
        ),
    )


def _merged(job: ExportJob) -> Writer:
    module = _lora_module(job.state, job.role)
    base_role = _base_role(job.state, module, job.role)
    # the base's diffusers model folder (its config, its plain names), of merged tensors
    base_folder = FORMATS["diffusers"](dataclasses.replace(job, role=base_role, options={}))
    return Writer(
        gather=lambda: merge_weights(
            job.state, job.role, weights=job.weights, dtype=job.dtype, rank0_only=job.rank0_only
        ),
        write=base_folder.write,
    )


FORMATS.update(lora=_lora, merged=_merged)
