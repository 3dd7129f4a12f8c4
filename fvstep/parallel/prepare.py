"""Prepare a role's module for real scale: activation checkpointing, compile, FSDP2, precision.

One call per role, composing PyTorch's own machinery in torchtitan's order, one concern a
module:

1. **activation checkpointing** per block (:mod:`fvstep.parallel.activation_checkpoint`:
   none, full, every n-th block, or *selective*, op-level, saving the outputs of matmuls
   and attention as torchtitan's selective AC does);
2. ``torch.compile`` per block (:mod:`fvstep.parallel.block_compile`: ``block.compile()``,
   in place, with bounded recompiles; :func:`~fvstep.parallel.block_compile.compile_counts`
   reports what dynamo compiled);
3. ``fully_shard`` per block and at the root (:func:`fvstep.parallel.shard_module`), with
   a ``MixedPrecisionPolicy`` and an optional ``CPUOffloadPolicy``; a 2-D mesh gives HSDP.

Frozen roles (a DMD2 teacher) are cast to ``frozen_dtype`` (bf16 by default): no
gradient, no optimizer state, half the memory; activations are cast at the boundary
(:mod:`fvstep.parallel.precision`). The diffusers attention backend is set when asked
(``module.set_attention_backend``).

**Names do not change.** Checkpointing is applied by giving each chosen block an
instance ``forward`` that runs the class's forward under ``checkpoint`` (no
``checkpoint_wrapper`` module in the path), and ``block.compile()`` compiles in place
(no ``_orig_mod``): parameter names, and so fvstep's checkpoint keys, are those of the
plain module whatever the options. A checkpoint saved with them loads without them and
vice versa (tested).

Examples:
    >>> mesh = fvstep.parallel.make_mesh()
    >>> student = prepare(student, mesh=mesh, checkpointing="selective", compile=True,
    ...                   param_dtype=torch.bfloat16)
    >>> teacher = prepare(teacher, mesh=mesh, trainable=False, compile=True)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

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
from fvstep.parallel.compile_check import resolve_threshold
from fvstep.parallel.compile_check_hooks import install_compile_check
from fvstep.parallel.flash_attention import flash_attention_4_enabled
from fvstep.parallel.mesh import BlockFilter, is_block, is_sharded, shard_module
from fvstep.parallel.precision import (
    FULL_PRECISION_INPUTS,
    autocast_forward,
    cast_at_boundary,
    store_in_dtype,
)

__all__ = ["Preparation", "block_names", "preparation", "prepare"]


@attrs.frozen
class Preparation:
    """What :func:`prepare` did to a module (kept on it; :func:`describe` prints it).

    Attributes:
        trainable: Whether the role is trained.
        checkpointing: The activation-checkpointing choice.
        checkpointed_blocks: Qualified names of the checkpointed blocks.
        offloaded_blocks: Qualified names of the blocks whose saved activations wait in
            host memory (``offload_activations``).
        compiled_blocks: Qualified names of the compiled blocks.
        sharded: Whether ``fully_shard`` was applied (per block and at the root).
        mesh_shape: The mesh's shape and dim names, or ``None``.
        param_dtype: Compute dtype over the stored parameters: FSDP2's with a mesh,
            autocast's on one process (``None``: as stored).
        reduce_dtype: Gradient reduction dtype (``None``: the parameter dtype).
        storage_dtype: The dtype most parameter elements are stored in (a frozen role's
            ``_keep_in_fp32_modules`` stay fp32 beside it).
        offload: Whether parameters are offloaded to the CPU between uses.
        attention_backend: The diffusers attention backend set, or ``None``.
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
        """A JSON-friendly summary (for benchmark output and logs).

        ``flash_attention_4`` is the process's state when this is called (whether SDPA's
        flash backend runs FlashAttention-4, :func:`~fvstep.parallel.enable_flash_attention_4`),
        not a property of the module: the kernel a ``"_native_flash"`` role runs now.
        """
        return {
            "trainable": self.trainable,
            "checkpointing": self.checkpointing.describe(),
            "checkpoint_every": self.checkpointing.every,
            "checkpointed_blocks": len(self.checkpointed_blocks),
            "offloaded_blocks": len(self.offloaded_blocks),
            "compiled_blocks": len(self.compiled_blocks),
            "sharded": self.sharded,
            "mesh": dict(self.mesh_shape) if self.mesh_shape else None,
            "param_dtype": str(self.param_dtype).removeprefix("torch.")
            if self.param_dtype
            else None,
            "reduce_dtype": str(self.reduce_dtype).removeprefix("torch.")
            if self.reduce_dtype
            else None,
            "storage_dtype": str(self.storage_dtype).removeprefix("torch."),
            "offload": self.offload,
            "attention_backend": self.attention_backend,
            "flash_attention_4": flash_attention_4_enabled(),
        }


_PREPARATION_ATTR = "_fvstep_preparation"


def block_names(module: nn.Module, blocks: BlockFilter = is_block) -> list[str]:
    """The qualified names of the blocks ``blocks`` picks, in module order.

    Examples:
        >>> block_names(tiny_wan(num_layers=2))
        ['blocks.0', 'blocks.1']
    """
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    return [n for n, m in module.named_modules() if n and blocks(n, m, parents.get(id(m)))]


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

    The module is changed in place and returned; build the role with it
    (``fvstep.Role(prepare(...), optimizer=...)``). Parameter names do not change.

    Args:
        module: The role's module, its parameters on the device they will run on.
        mesh: Shard with FSDP2 over this mesh (a 2-D ``("replicate", "shard")`` mesh gives
            HSDP; :func:`fvstep.parallel.make_mesh`); ``None`` leaves it unsharded (one
            process).
        trainable: ``False`` for a frozen role: its parameters are cast to
            ``frozen_dtype`` and lose ``requires_grad``; it gets no optimizer. Floating
            activations are cast to that dtype on the way in and outputs back to the
            caller's dtype on the way out, so fp32 callers need no change; the inputs
            named in ``full_precision_inputs`` (timesteps, whatever their shape) and
            unnamed 0-D/1-D inputs keep their precision. The model's
            ``_keep_in_fp32_modules`` (diffusers) stay fp32.
        checkpointing: ``"none"`` (default), ``"full"``, ``"selective"`` (the outputs of
            matmuls and attention kept), ``"attention"`` (the attention kernels' outputs
            kept, the rest recomputed: most of selective's speed at a fraction of its
            memory for long videos), ``"narrow"`` (attention and the matmuls that do not
            widen their input kept: the feed-forward up-projections are recomputed) or an
            :class:`ActivationCheckpointing` (e.g. every n-th block). Under ``no_grad`` a
            checkpointed block just runs its forward, so a role read without gradient
            (a DMD2 teacher) pays nothing for it.
        offload_activations: Keep the saved activations of some blocks in pinned host
            memory between forward and backward (:mod:`fvstep.parallel.activation_offload`):
            ``True`` for every block, or an :class:`ActivationOffloading` (every n-th
            block). They come back one block ahead of their backward. Memory without
            recomputation, paid in PCIe bandwidth; bitwise the same step. CUDA tensors
            only (on a CPU nothing moves). A frozen role saves activations only when a
            gradient flows through it to its inputs.
        compile: ``True`` for ``block.compile(fullgraph=True, dynamic=False)`` on each
            block, or a mapping of ``torch.compile`` arguments (e.g. ``{"backend":
            "aot_eager"}``) merged over those. With Inductor, the Inductor ``options``
            (a ``mode`` is turned into its options) default to
            :data:`~fvstep.parallel.block_compile.SAFE_INDUCTOR_OPTIONS`, which turn off
            a pass that computes wrong gradients for Wan's blocks; an ``options``
            mapping given here is merged over them (``{"options":
            {"coordinate_descent_tuning": True}}``). Dynamo's recompile
            limit is raised to :data:`~fvstep.parallel.block_compile.RECOMPILE_LIMIT` at
            least (a process-wide setting): every block of every compiled role shares one
            code object, so the default (8) is too few for DMD2 over a LoRA base.
        verify_compile: Check every compiled block's gradients against its eager ones
            before training on them (:mod:`fvstep.parallel.compile_check`): the first
            grad-enabled call of each graph a block compiles (each new input shape,
            ``requires_grad`` pattern or autocast state) compares them on its real inputs
            and raises :class:`~fvstep.parallel.compile_check.CompiledGradientError`
            (block, parameter, error, eager's rounding noise, their ratio, the threshold)
            when a compiled gradient's error is more than the threshold times eager's own
            rounding noise (below fp32 measured against an eager fp32 run). ``True`` for
            the default threshold (100), or a threshold. It costs one eager and one
            compiled forward and backward of each block, and below fp32 one eager fp32
            forward and backward more, once per graph, and no compile; off by default.
        param_dtype: The compute dtype over the stored (master) parameters, e.g.
            ``torch.bfloat16`` over fp32. With ``mesh``, FSDP2's
            ``MixedPrecisionPolicy.param_dtype``: activations are cast to it at the root
            and outputs cast back; the ``full_precision_inputs`` are not (FSDP2's
            ``cast_forward_inputs`` would round them). On one process (no ``mesh``), the
            role's forward runs under ``torch.autocast(param_dtype)``
            (:func:`~fvstep.parallel.precision.autocast_forward`), what a step wrapped in
            autocast computes; for a frozen role too.
        reduce_dtype: FSDP2's gradient-reduction dtype (default fp32).
        reshard_after_forward: FSDP2's option, for every group.
        offload: FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state
            on the CPU between uses). Needs ``mesh``.
        frozen_dtype: The dtype a frozen role is stored in (default bf16; ``None`` keeps
            it).
        attention_backend: A diffusers attention backend name (``"native"``,
            ``"_native_cudnn"``, ``"_native_flash"``, ``"flash"``, ...), set with
            ``module.set_attention_backend``. ``"_native_flash"`` runs FlashAttention-4
            once :func:`~fvstep.parallel.enable_flash_attention_4` has been called (the
            fastest measured on Hopper; PyTorch's FlashAttention-2 otherwise).
        blocks: Which submodules are blocks (default: the items of the root's
            ``nn.ModuleList`` attributes, e.g. a Wan transformer's ``blocks.*``).
        checkpoint_context: ``context_fn -> context_fn``: wraps the checkpointing
            context of every checkpointed block (``None`` for full checkpointing,
            selective's otherwise), for modules whose recomputation needs state set
            back, e.g. ``functools.partial(fvstep.lora.recompute_context, base)`` for a
            LoRA base, whose adapters are switched per call. ``None`` takes the one the
            module carries, if any (:func:`fvstep.lora.add_adapters` gives a base that
            one). Under ``torch.compile`` the recomputation is part of the compiled
            backward graph and runs no Python, so only the inner context (selective
            checkpointing's) is used there.
        context_mesh: Shard each sample's token sequence over this mesh's ``"context"``
            axis first (:func:`fvstep.parallel.apply_context_parallel`, before
            checkpointing and FSDP2; :func:`fvstep.parallel.make_context_mesh`); steps
            then called with ``parallelism=fvstep.parallel.Layout(mesh)``. Not with
            ``compile`` (diffusers' native attention backward cannot be traced).
        context_mode: ``"ulysses"`` (all-to-all) or ``"ring"`` (CUDA backends only).
        full_precision_inputs: The names of ``module.forward``'s arguments that a cast
            at the boundary (``trainable=False`` with ``frozen_dtype``, or
            ``param_dtype``) never touches, whatever their shape, positional or keyword
            (default :data:`FULL_PRECISION_INPUTS`: ``timestep`` and its usual
            spellings). Extend it for a model whose timestep or noise level has another
            name: ``(*FULL_PRECISION_INPUTS, "noise_level")``.

    Returns:
        The same module, prepared; :func:`preparation` tells what was done.

    Raises:
        ValueError: If the module was prepared or sharded already, if FSDP2 options are
            given without a mesh, if it has no blocks to checkpoint, offload or compile,
            or if ``verify_compile`` is asked without ``compile``.
        TypeError: On a bad ``checkpointing``, ``offload_activations``, ``compile`` or
            ``verify_compile`` value.

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
    if isinstance(full_precision_inputs, str):
        raise TypeError(
            "full_precision_inputs must be a collection of argument names, got the string "
            f"{full_precision_inputs!r}; write ({full_precision_inputs!r},)"
        )
    keep = frozenset(full_precision_inputs)
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
    submodules = dict(module.named_modules())
    if attention_backend is not None:
        setter = getattr(module, "set_attention_backend", None)
        if setter is None:
            raise ValueError(
                f"{type(module).__name__} has no set_attention_backend: the attention "
                "backend is chosen by diffusers models only"
            )
        with needs_extra("models", "prepare(attention_backend=...)"):
            from diffusers.models.attention_dispatch import attention_backend as active_backend

        # diffusers' setter also makes its backend the process's default, which every other
        # model's processors without a backend of their own would then run on; the
        # context puts the default back, so only this module changes
        with active_backend():
            setter(attention_backend)
    if not trainable:
        if frozen_dtype is not None:
            store_in_dtype(module, frozen_dtype)
            cast_at_boundary(module, frozen_dtype, full_precision_inputs=keep)
        module.requires_grad_(False)
    if context_mesh is not None:
        from fvstep.parallel.context import apply_context_parallel

        apply_context_parallel(module, mesh=context_mesh, mode=context_mode)
    if checkpoint_context is None:
        checkpoint_context = module.__dict__.get("_fvstep_checkpoint_context")
    checkpointed = apply_activation_checkpointing(
        {name: submodules[name] for name in names}, ac, checkpoint_context=checkpoint_context
    )
    offloaded: tuple[str, ...] = ()
    if offloading is not None:
        offloaded = apply_activation_offloading(
            {name: submodules[name] for name in names}, offloading
        )
    if compile_kwargs is not None:
        apply_compile([submodules[name] for name in names], compile_kwargs)
        if verify_compile is not False:  # a pre-hook: runs after FSDP2's (it prepends)
            for name in names:
                install_compile_check(
                    submodules[name], name=name, threshold=verify_threshold, mesh=mesh
                )
    if mesh is not None and param_dtype is not None and trainable:
        cast_at_boundary(module, param_dtype, full_precision_inputs=keep)
    if mesh is None and param_dtype is not None:  # one process: autocast, as FSDP2 casts
        autocast_forward(module, param_dtype)
    if mesh is not None:
        offload_policy: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
        shard_module(
            module,
            mesh=mesh,
            blocks=blocks,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
            ),
            reshard_after_forward=reshard_after_forward,
            offload_policy=offload_policy,
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
