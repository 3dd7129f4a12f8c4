"""Prepare a role's module for real scale: activation checkpointing, compile, FSDP2, precision.

One call per role composes PyTorch's own machinery in torchtitan's order, one module a
step. Parameter names, and so checkpoint keys, do not change. The options and their laws:
``docs/concepts/prepare.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from fvstep.core._optional import needs_extra
from fvstep.parallel.activation_checkpoint import (
    ActivationCheckpointing,
    CheckpointName,
    apply_activation_checkpointing,
    resolve_checkpointing,
)
from fvstep.parallel.activation_offload import (
    ActivationOffloading,
    apply_activation_offloading,
    resolve_offloading,
)
from fvstep.parallel.block_compile import apply_compile, resolve_compile_options
from fvstep.parallel.compile_check import install_compile_check, resolve_threshold
from fvstep.parallel.context import apply_context_parallel
from fvstep.parallel.flash_attention import flash_attention_4_enabled
from fvstep.parallel.mesh import BlockFilter, block_names, is_block, is_sharded, shard_module
from fvstep.parallel.precision import (
    FULL_PRECISION_INPUTS,
    autocast_forward,
    cast_at_boundary,
    resolve_full_precision_inputs,
    store_in_dtype,
)

__all__ = ["Preparation", "preparation", "prepare"]


@attrs.frozen
class Preparation:
    """What :func:`prepare` did to a module (kept on it; :func:`describe` prints it).

    Attributes:
        mesh_shape: The mesh's dim names and sizes, or ``None``.
        param_dtype: The compute dtype: FSDP2's with a mesh, autocast's on one process
            (``None``: as stored).
        reduce_dtype: FSDP2's gradient reduction dtype (``None``: the parameter dtype).
        storage_dtype: The dtype most parameter elements are stored in.
        offload: Whether FSDP2 offloads the parameters to the CPU between uses.
    """

    trainable: bool
    checkpointing: ActivationCheckpointing
    checkpointed_blocks: tuple[str, ...]
    offloaded_blocks: tuple[str, ...]
    compiled_blocks: tuple[str, ...]
    sharded: bool
    mesh_shape: tuple[tuple[str, int], ...] | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    storage_dtype: torch.dtype
    offload: bool
    attention_backend: str | None

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary; ``flash_attention_4`` is the process's state now, not the module's."""
        return {
            "trainable": self.trainable,
            "checkpointing": self.checkpointing.describe(),
            "checkpoint_every": self.checkpointing.every,
            "checkpointed_blocks": len(self.checkpointed_blocks),
            "offloaded_blocks": len(self.offloaded_blocks),
            "compiled_blocks": len(self.compiled_blocks),
            "sharded": self.sharded,
            "mesh": dict(self.mesh_shape) if self.mesh_shape else None,
            "param_dtype": _dtype_name(self.param_dtype),
            "reduce_dtype": _dtype_name(self.reduce_dtype),
            "storage_dtype": _dtype_name(self.storage_dtype),
            "offload": self.offload,
            "attention_backend": self.attention_backend,
            "flash_attention_4": flash_attention_4_enabled(),
        }


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype else None


_PREPARATION_ATTR = "_fvstep_preparation"


def prepare(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    trainable: bool = True,
    checkpointing: ActivationCheckpointing | CheckpointName | None = None,
    offload_activations: ActivationOffloading | bool | None = None,
    compile: bool | Mapping[str, Any] = False,
    verify_compile: bool | float = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    offload: bool = False,
    frozen_dtype: torch.dtype | None = torch.bfloat16,
    attention_backend: str | None = None,
    blocks: BlockFilter = is_block,
    checkpoint_context: Callable[[Callable[[], Any] | None], Callable[[], Any]] | None = None,
    context_mesh: DeviceMesh | None = None,
    context_mode: Literal["ulysses", "ring"] = "ulysses",
    full_precision_inputs: Collection[str] = FULL_PRECISION_INPUTS,
) -> nn.Module:
    """Prepare a role's module: checkpointing, then compile, then FSDP2 (torchtitan's order).

    The module is changed in place and returned. The options (a table), what each does
    and what it costs: ``docs/concepts/prepare.md``.

    Args:
        module: The role's module, its parameters on the device they will run on.
        mesh: Shard with FSDP2 over this mesh (:func:`fvstep.parallel.make_mesh`; 2-D: HSDP).
        checkpointing: A :data:`~fvstep.parallel.activation_checkpoint.CheckpointName` or an
            :class:`ActivationCheckpointing`.
        compile: ``True`` for ``block.compile(fullgraph=True, dynamic=False)`` per block, or
            ``torch.compile`` arguments merged over those.
        verify_compile: ``True`` or a threshold (:mod:`fvstep.parallel.compile_check`).
        param_dtype: The compute dtype: FSDP2's ``param_dtype`` with ``mesh``, else
            ``torch.autocast(param_dtype)``.
        checkpoint_context: ``context_fn -> context_fn`` around every checkpointed block's
            recomputation; ``None`` takes the one the module carries (:func:`fvstep.methods.lora.add_adapters`).
        context_mesh: Shard each sample's tokens over this mesh's ``"context"`` axis first
            (:func:`fvstep.parallel.apply_context_parallel`).
        full_precision_inputs: Names of ``module.forward``'s arguments a boundary cast never
            touches (default :data:`FULL_PRECISION_INPUTS`, the timesteps).

    Returns:
        The same module; :func:`preparation` tells what was done.

    Raises:
        ValueError: If the module was prepared or sharded already; if ``offload`` is given
            without a mesh; if no block is picked for checkpointing, offloading or compile;
            if ``verify_compile`` is asked without ``compile``, or ``compile`` with
            ``context_mesh``; if the module cannot take an ``attention_backend``.
        TypeError: On a bad ``checkpointing``, ``offload_activations``, ``compile``,
            ``verify_compile`` or ``full_precision_inputs`` value.

    Examples:
        >>> student = prepare(student, mesh=mesh, checkpointing="full", compile=True,
        ...                   param_dtype=torch.bfloat16)
        >>> preparation(student).describe()["compiled_blocks"]
        30
    """
    if getattr(module, _PREPARATION_ATTR, None) is not None:
        raise ValueError("the module was prepared already (fvstep.parallel.prepare)")
    if is_sharded(module):
        raise ValueError("the module is sharded already: prepare it before fully_shard")
    if mesh is None and offload:
        raise ValueError("offload is an FSDP2 option: it needs a mesh")
    keep = resolve_full_precision_inputs(full_precision_inputs)
    ac = resolve_checkpointing(checkpointing)
    offloading = resolve_offloading(offload_activations)
    compile_kwargs = resolve_compile_options(compile)
    verify_threshold = resolve_threshold(verify_compile)
    if verify_compile is not False and compile_kwargs is None:
        raise ValueError("verify_compile checks compiled blocks: it needs compile")
    names = block_names(module, blocks)
    if (ac.mode != "none" or offloading is not None or compile_kwargs is not None) and not names:
        raise ValueError(
            "the module has no blocks to checkpoint, offload or compile (the blocks filter picked none)"
        )
    if context_mesh is not None and compile_kwargs is not None:
        raise ValueError(
            "compile with context parallel is not supported: diffusers' attention "
            "backward under context parallel cannot be traced (docs/concepts/context-parallel.md)"
        )
    named_blocks = {name: module.get_submodule(name) for name in names}
    if attention_backend is not None:
        setter = getattr(module, "set_attention_backend", None)
        if setter is None:
            raise ValueError(
                f"{type(module).__name__} has no set_attention_backend: the attention "
                "backend is chosen by diffusers models only"
            )
        with needs_extra("models", "prepare(attention_backend=...)"):
            from diffusers.models.attention_dispatch import attention_backend as active_backend

        # diffusers' setter also makes its backend the process's default: put that back
        with active_backend():
            setter(attention_backend)
    if not trainable:
        if frozen_dtype is not None:
            store_in_dtype(module, frozen_dtype)
            cast_at_boundary(module, frozen_dtype, full_precision_inputs=keep)
        module.requires_grad_(False)
    if context_mesh is not None:
        apply_context_parallel(module, mesh=context_mesh, mode=context_mode)
    if checkpoint_context is None:
        checkpoint_context = module.__dict__.get("_fvstep_checkpoint_context")
    checkpointed = apply_activation_checkpointing(
        named_blocks, ac, checkpoint_context=checkpoint_context
    )
    offloaded: tuple[str, ...] = ()
    if offloading is not None:
        offloaded = apply_activation_offloading(named_blocks, offloading)
    if compile_kwargs is not None:
        apply_compile(named_blocks.values(), compile_kwargs)
        if verify_compile is not False:  # a pre-hook: runs after FSDP2's (it prepends)
            for name, block in named_blocks.items():
                install_compile_check(block, name=name, threshold=verify_threshold, mesh=mesh)
    if mesh is not None and param_dtype is not None and trainable:
        cast_at_boundary(module, param_dtype, full_precision_inputs=keep)
    if mesh is None and param_dtype is not None:  # one process: autocast, as FSDP2 casts
        autocast_forward(module, param_dtype)
    if mesh is not None:
        shard_module(
            module,
            mesh=mesh,
            blocks=blocks,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
            ),
            reshard_after_forward=reshard_after_forward,
            offload_policy=CPUOffloadPolicy() if offload else None,
        )
    elements: dict[torch.dtype, int] = {}
    for p in module.parameters():
        elements[p.dtype] = elements.get(p.dtype, 0) + p.numel()
    storage = max(elements, key=elements.__getitem__, default=torch.float32)
    record = Preparation(
        trainable=trainable,
        checkpointing=ac,
        checkpointed_blocks=checkpointed,
        offloaded_blocks=offloaded,
        compiled_blocks=tuple(names) if compile_kwargs is not None else (),
        sharded=mesh is not None,
        mesh_shape=tuple(zip(mesh.mesh_dim_names or (), mesh.shape, strict=False))
        if mesh is not None
        else None,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype if mesh is not None else None,
        storage_dtype=storage,
        offload=offload,
        attention_backend=attention_backend,
    )
    object.__setattr__(module, _PREPARATION_ATTR, record)
    return module


def preparation(module: nn.Module) -> Preparation | None:
    """What :func:`prepare` did to ``module`` (``None`` if it was not prepared)."""
    return getattr(module, _PREPARATION_ATTR, None)
