"""How the realshape benchmark builds a role: prepared by fvstep, by hand, or as LoRA adapters."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from benchmarks import common as c
from benchmarks.presets import Preset, build_model
from fvstep import parallel as fsp
from fvstep.core._compat import checkpoint_wrapper
from fvstep.methods.lora import add_adapters
from fvstep.parallel.activation_checkpoint import resolve_checkpointing

__all__ = ["by_hand", "lora_roles", "prepared"]


def by_hand(module: nn.Module, rt: c.Runtime, *, compile_blocks: bool, trainable: bool) -> Any:
    """What users wrote before ``prepare``: full AC, ``block.compile()``, ``fully_shard``."""
    blocks = module.get_submodule("blocks")
    assert isinstance(blocks, nn.ModuleList)
    for i, block in enumerate(list(blocks)):
        wrapped = checkpoint_wrapper(block)
        if compile_blocks:
            wrapped.compile()  # as users wrote it: torch's defaults (pytorch/pytorch#193061)
        blocks[i] = wrapped
    if not trainable:
        module.requires_grad_(False)
    if rt.sharded:
        fsp.shard_module(
            module,
            mesh=rt.mesh,
            mp_policy=fsp.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
        )
    return module


def prepared(module: nn.Module, rt: c.Runtime, args: Any, *, trainable: bool) -> Any:
    """``fvstep.parallel.prepare`` with the run's ``--checkpointing`` and ``--compile`` (and
    ``--inductor-option``, merged over prepare's safe Inductor options; the saved
    activations of every ``--offload-every``-th block offloaded to the host)."""
    options: dict[str, Any] = {
        "checkpointing": attrs.evolve(
            resolve_checkpointing(args.checkpointing), every=args.checkpoint_every
        )
        if args.checkpointing != "none"
        else "none",
        "compile": {"options": dict(args.inductor_option)}
        if args.compile and getattr(args, "inductor_option", None)
        else args.compile,
        "attention_backend": args.attention_backend,
        "trainable": trainable,
    }
    if getattr(args, "offload_every", None):
        options["offload_activations"] = fsp.ActivationOffloading(every=args.offload_every)
    if rt.sharded:
        options.update(mesh=rt.mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsp.prepare(module, **options)


def lora_roles(preset: Preset, rt: c.Runtime, args: Any) -> dict[str, Any]:
    """One frozen base prepared as the teacher; LoRA student and critic over it."""
    import peft

    base = build_model(preset, device=rt.device, seed=args.seed + 1)
    config = peft.LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=list(args.lora_targets)
    )
    lora = add_adapters(base, {"student": config, "critic": config}, seed=args.seed)
    prepared(base, rt, args, trainable=False)
    if rt.sharded:
        mp = fsp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in lora.values():
            fsp.shard_module(module, mesh=rt.mesh, mp_policy=mp)
    return {"student": lora["student"], "teacher": base, "critic": lora["critic"]}
