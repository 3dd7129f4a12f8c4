"""What a step should cost, analytically: model FLOPs (for MFU) and FSDP2 collectives.

The benchmarks print these beside what they measure.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from benchmarks.presets import Preset
from fvstep import parallel as fsd

__all__ = [
    "expected_collectives",
    "fsdp_groups",
    "local_tensor_bytes",
    "mfu",
    "padded_numel",
    "train_flops_per_sample",
    "trainable_numel",
]


def _tokens_of(name: str, video: int, text: int) -> int:
    """How many tokens per sample a linear layer of a Wan transformer is applied to."""
    if name.startswith("condition_embedder.text_embedder"):
        return text
    if name.startswith(("condition_embedder.time", "condition_embedder.time_proj")):
        return 1
    if ".attn2." in name and name.rsplit(".", 1)[-1] in (
        "to_k",
        "to_v",
        "add_k_proj",
        "add_v_proj",
    ):
        return text  # cross-attention keys/values are projections of the text tokens
    return video


def train_flops_per_sample(module: nn.Module, preset: Preset) -> float:
    """Training FLOPs (forward + backward) of one sample through a Wan transformer.

    ``6 * weights * tokens`` for every linear layer (and the patch-embedding conv, a
    linear map per token), with the tokens the layer acts on (video tokens ``T``, text
    tokens ``L`` for the text embedder and cross-attention keys/values, one for the time
    embedding), plus attention: ``12 * layers * T^2 * dim`` for self-attention and
    ``12 * layers * T * L * dim`` for cross-attention (``QK^T`` and ``AV``, 2 FLOPs a
    multiply-add, times 3 for forward + backward). Norms and elementwise ops are left out.
    """
    video, text = preset.num_tokens, preset.text_len
    linear = 0.0
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Linear, nn.Conv3d)):
            linear += 6.0 * mod.weight.numel() * _tokens_of(name, video, text)
    cfg = preset.config
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    attention = 12.0 * cfg["num_layers"] * dim * (video * video + video * text)
    return linear + attention


def mfu(flops_per_step: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of one device, or ``None`` without a peak."""
    return None if peak is None or seconds <= 0 else flops_per_step / seconds / peak


# ------------------------------------------------------------------ FSDP2 groups


def fsdp_groups(module: nn.Module) -> list[tuple[str, list[torch.Tensor]]]:
    """The FSDP2 parameter groups of a sharded module: ``(module name, its own params)``.

    A group's parameters are those of an ``fully_shard``-ed module that no nested
    ``fully_shard``-ed module owns. Empty for an unsharded module.
    """
    sharded = [(n, m) for n, m in module.named_modules() if fsd.is_sharded(m)]
    owned: set[int] = set()
    groups = []
    for name, mod in reversed(sharded):  # innermost first
        params = [p for p in mod.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        groups.append((name or "<root>", params))
    return list(reversed(groups))


def padded_numel(params: Sequence[torch.Tensor], world: int) -> int:
    """Elements FSDP2 all-gathers for ``params``: dim 0 padded to a multiple of ``world``."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        rest = p.numel() // max(rows, 1) if p.dim() else 1
        total += -(-rows // world) * world * rest
    return total


def expected_collectives(
    module: nn.Module,
    *,
    world: int,
    microbatches: int,
    sync: str,
    keep_params_gathered: bool,
    param_bytes: int,
    reduce_bytes: int,
    clip: bool = False,
) -> dict[str, float]:
    """The analytic FSDP2 collectives of one step of a unit training ``module``.

    With ``G`` groups of padded sizes ``N_g`` and ``K`` micro-batches, per step:

    - all-gathers: each group is gathered for the forward and again for the backward of
      each micro-batch, ``2K`` times (``K + 1`` with ``keep_params_gathered``: only the
      first forward gathers, later forwards find the parameters still unsharded); bytes
      = the gathered output, ``sum N_g * param_bytes`` each time;
    - reduce-scatters: ``K`` per group (``every``, ``deferred``), ``1`` (``no_sync``);
      bytes as :class:`fvstep.parallel.CollectiveCounter` counts them, the output
      shard: ``sum N_g * reduce_bytes / world`` each time (the data reduced is ``world``
      times that);
    - all-reduces: one a step for the global gradient norm when clipping.

    All zero on one process (unsharded).
    """
    groups = fsdp_groups(module)
    if world == 1 or not groups:
        kinds = ("all_gather", "all_gather_bytes", "reduce_scatter", "reduce_scatter_bytes")
        return dict.fromkeys((*kinds, "all_reduce"), 0)
    numel = sum(padded_numel(ps, world) for _, ps in groups)
    k = microbatches
    ag = k + 1 if keep_params_gathered else 2 * k
    rs = 1 if sync == "no_sync" else k
    return {
        "all_gather": len(groups) * ag,
        "all_gather_bytes": numel * param_bytes * ag,
        "reduce_scatter": len(groups) * rs,
        "reduce_scatter_bytes": numel * reduce_bytes * rs / world,
        "all_reduce": 1 if clip else 0,
    }


def trainable_numel(module: nn.Module) -> int:
    """Global element count of the trainable parameters (DTensors count globally)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def local_tensor_bytes(
    tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor], device: torch.device
) -> int:
    """Bytes of the local shards of ``tensors`` that live on ``device``'s type."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == device.type:
            total += local.numel() * local.element_size()
    return total
