"""Prepare a role's module for real scale: activation checkpointing, compile, FSDP2, precision.

One call per role, composing PyTorch's own machinery in torchtitan's order:

1. **activation checkpointing** per block (:class:`ActivationCheckpointing`: none, full,
   every n-th block, or *selective*, op-level, saving the outputs of matmuls and
   attention as torchtitan's selective AC does), through
   ``torch.utils.checkpoint.checkpoint(use_reentrant=False, context_fn=...)``;
2. ``torch.compile`` per block (``block.compile()``, in place);
3. ``fully_shard`` per block and at the root (:func:`fvstep.parallel.shard_module`), with
   a ``MixedPrecisionPolicy`` and an optional ``CPUOffloadPolicy``; a 2-D mesh gives HSDP.

Frozen roles (a DMD2 teacher) are cast to ``frozen_dtype`` (bf16 by default): no
gradient, no optimizer state, half the memory. The diffusers attention backend is set
when asked (``module.set_attention_backend``).

**Names do not change.** Checkpointing is applied by giving each chosen block an
instance ``forward`` that runs the class's forward under ``checkpoint`` (no
``checkpoint_wrapper`` module in the path), and ``block.compile()`` compiles in place
(no ``_orig_mod``): parameter names, and so fvstep's checkpoint keys, are those of the
plain module whatever the options. A checkpoint saved with them loads without them and
vice versa (tested).

**Compiles are bounded.** fvstep turns other roles' ``requires_grad`` off while a unit
runs, and a role is read with and without grad mode, so a block's graph is specialised
on (grad mode, parameters' ``requires_grad``): at most three graphs for all blocks of all
roles with the same code and shapes (``inline_inbuilt_nn_modules`` shares them across
block instances), compiled with ``dynamic=False`` so that a second shape is a second
graph rather than a slower, dynamic one. :func:`compile_counts` reports what dynamo
compiled, so a benchmark can show it.

Examples:
    >>> mesh = fvstep.parallel.make_mesh()
    >>> student = prepare(student, mesh=mesh, checkpointing="selective", compile=True,
    ...                   param_dtype=torch.bfloat16)
    >>> teacher = prepare(teacher, mesh=mesh, trainable=False, compile=True)
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fvstep import _compat as torch_compat
from fvstep.parallel.compile_check import install_compile_check, resolve_rtol
from fvstep.parallel.mesh import ShardPolicy, blocks_policy, is_sharded, shard_module

__all__ = [
    "FULL_PRECISION_INPUTS",
    "RECOMPILE_LIMIT",
    "SAFE_INDUCTOR_OPTIONS",
    "ActivationCheckpointing",
    "Preparation",
    "block_names",
    "compile_counts",
    "is_checkpointed",
    "preparation",
    "prepare",
]

CheckpointMode = Literal["none", "full", "selective"]

_aten = torch.ops.aten
#: Ops whose outputs selective checkpointing keeps (torchtitan's list, less collectives):
#: matmuls and the attention kernels, whose recomputation costs the most FLOPs.
DEFAULT_SAVE_OPS: frozenset[Any] = frozenset(
    op
    for op in (
        getattr(_aten, "mm", None),
        getattr(_aten, "addmm", None),
        getattr(_aten, "bmm", None),
        getattr(_aten, "baddbmm", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(_aten, "_flash_attention_forward", None),
        getattr(_aten, "_efficient_attention_forward", None),
    )
    if op is not None
)


@attrs.frozen
class ActivationCheckpointing:
    """Which blocks recompute their activations in backward, and how much of them.

    Attributes:
        mode: ``"none"``; ``"full"`` (a block keeps only its inputs and recomputes its
            whole forward in backward); ``"selective"`` (op-level: the outputs of
            ``save_ops`` — matmuls and attention by default — are kept, everything else,
            norms, activations, element-wise ops, is recomputed).
        every: Checkpoint every ``every``-th block (blocks ``0, every, 2 * every, ...``);
            ``1`` checkpoints all of them.
        save_ops: For ``"selective"``: the ATen ops (``OpOverloadPacket`` or
            ``OpOverload``) whose outputs are saved.

    Raises:
        ValueError: On an unknown mode or ``every < 1``.

    Examples:
        >>> ActivationCheckpointing("full", every=2)      # half the blocks, fully
        >>> ActivationCheckpointing("selective")          # all blocks, matmuls kept
    """

    mode: CheckpointMode = "full"
    every: int = 1
    save_ops: frozenset[Any] = attrs.field(default=DEFAULT_SAVE_OPS, converter=frozenset)

    def __attrs_post_init__(self) -> None:
        if self.mode not in ("none", "full", "selective"):
            raise ValueError(
                f"activation checkpointing mode must be 'none', 'full' or 'selective', "
                f"not {self.mode!r}"
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an int >= 1, not {self.every!r}")

    def chooses(self, index: int) -> bool:
        """Whether the ``index``-th block is checkpointed."""
        return self.mode != "none" and index % self.every == 0

    def context_fn(self) -> Callable[[], Any] | None:
        """``checkpoint``'s ``context_fn`` for this mode (``None`` for full)."""
        if self.mode != "selective":
            return None
        save = self.save_ops

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            packet = getattr(op, "overloadpacket", op)
            if op in save or packet in save:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return functools.partial(create_selective_checkpoint_contexts, policy)


@attrs.frozen
class Preparation:
    """What :func:`prepare` did to a module (kept on it; :func:`describe` prints it).

    Attributes:
        trainable: Whether the role is trained.
        checkpointing: The activation-checkpointing choice.
        checkpointed_blocks: Qualified names of the checkpointed blocks.
        compiled_blocks: Qualified names of the compiled blocks.
        sharded: Whether ``fully_shard`` was applied (per block and at the root).
        mesh_shape: The mesh's shape and dim names, or ``None``.
        param_dtype: Compute dtype of the parameters under FSDP2 (``None``: as stored).
        reduce_dtype: Gradient reduction dtype (``None``: the parameter dtype).
        storage_dtype: The dtype most parameter elements are stored in (a frozen role's
            ``_keep_in_fp32_modules`` stay fp32 beside it).
        offload: Whether parameters are offloaded to the CPU between uses.
        attention_backend: The diffusers attention backend set, or ``None``.
    """

    trainable: bool
    checkpointing: ActivationCheckpointing
    checkpointed_blocks: tuple[str, ...]
    compiled_blocks: tuple[str, ...]
    sharded: bool
    mesh_shape: tuple[tuple[str, int], ...] | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    storage_dtype: torch.dtype
    offload: bool
    attention_backend: str | None

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary (for benchmark output and logs)."""
        return {
            "trainable": self.trainable,
            "checkpointing": self.checkpointing.mode,
            "checkpoint_every": self.checkpointing.every,
            "checkpointed_blocks": len(self.checkpointed_blocks),
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
        }


_PREPARATION_ATTR = "_fvstep_preparation"


def block_names(module: nn.Module, policy: ShardPolicy = blocks_policy) -> list[str]:
    """The qualified names of the blocks ``policy`` picks, in module order.

    Examples:
        >>> block_names(tiny_wan(num_layers=2))
        ['blocks.0', 'blocks.1']
    """
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    return [n for n, m in module.named_modules() if n and policy(n, m, parents.get(id(m)))]


def _checkpointed_forward(
    forward: Callable[..., Any],
    context_fn: Callable[[], Any] | None,
    compiled_context_fn: Callable[[], Any] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    # Under torch.compile the recomputation is part of the compiled backward graph: no
    # Python runs again, so a context that sets Python state back for it (``checkpoint_
    # context``: a LoRA base's adapter flags) has nothing to do, and torch.compile accepts
    # only selective checkpointing's dispatch modes as a context_fn.
    if torch.compiler.is_compiling():
        context_fn = compiled_context_fn
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`prepare` gave ``block`` a checkpointed forward."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def _apply_checkpointing(
    block: nn.Module,
    ac: ActivationCheckpointing,
    checkpoint_context: Callable[[Callable[[], Any] | None], Callable[[], Any]] | None = None,
) -> None:
    # The class's forward, bound to this block, run under checkpoint: an instance
    # attribute, so nn.Module.__call__ (and compile, and FSDP2's hooks around it) sees it
    # while the module tree, and so every parameter name, stays as it was.
    original = type(block).forward.__get__(block)
    compiled_context_fn = ac.context_fn()
    context_fn = compiled_context_fn
    if checkpoint_context is not None:
        context_fn = checkpoint_context(compiled_context_fn)
    block.forward = functools.partial(
        _checkpointed_forward, original, context_fn, compiled_context_fn
    )


FULL_PRECISION_INPUTS: tuple[str, ...] = ("timestep", "timesteps", "t", "sigma", "sigmas")
"""The forward arguments a boundary cast of :func:`prepare` leaves in full precision.

Diffusion timesteps (and noise levels) by name, whatever their shape: a per-token
timestep ``(B, S)`` (Wan2.2 TI2V) looks like an activation but rounds to a multiple of 4
near 1000 in bf16. Pass ``prepare(..., full_precision_inputs=...)`` to extend it."""


def _cast_tree(value: Any, dtype: torch.dtype, *, min_ndim: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.ndim >= min_ndim and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (tuple, list)):
        items = [_cast_tree(v, dtype, min_ndim=min_ndim) for v in value]
        if hasattr(value, "_fields"):  # a namedtuple takes its fields as arguments
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        # keep the mapping's type: a diffusers ModelOutput (return_dict=True) stays one
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _cast_tree(v, dtype, min_ndim=min_ndim)
        return out
    return value


def _positional_names(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module.forward``'s positional parameters, in order (``()`` if unknown).

    A module whose ``forward(*args, **kwargs)`` delegates to another (a
    :class:`fvstep.lora.LoRAModule` calls its base) names them by its
    ``forward_signature`` attribute, an ``inspect.Signature``.
    """
    signature = getattr(module, "forward_signature", None)
    try:
        if not isinstance(signature, inspect.Signature):
            signature = inspect.signature(module.forward)
        parameters = signature.parameters.values()
    except (TypeError, ValueError):  # a builtin or an odd callable: fall back on ranks
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def _cast_at_the_boundary(module: nn.Module, dtype: torch.dtype, keep: frozenset[str]) -> None:
    # A role computing in bf16 stays a drop-in for callers in fp32 (with or without
    # autocast, sharded or not): floating activations are cast to its dtype on the way
    # in, its floating outputs back to the callers' dtype on the way out. Arguments named
    # in ``keep`` (the model's ``timestep``) keep their precision whatever their shape:
    # in bf16 a timestep near 1000 is rounded to a multiple of 4, and Wan2.2's per-token
    # timesteps are (B, S), shaped like an activation. An argument with no known name
    # (beyond the signature's positional ones) is judged by rank: 0-D and 1-D
    # (per-sample scalars) are kept. FSDP2's own cast_forward_inputs casts everything,
    # which is why prepare turns it off.
    positional = _positional_names(module)
    callers: list[torch.dtype | None] = []

    def cast(name: str | None, value: Any) -> Any:
        if name is not None and name in keep:
            return value
        return _cast_tree(value, dtype, min_ndim=2)

    def caller_dtype(named: list[tuple[str | None, Any]]) -> torch.dtype | None:
        for name, v in named:
            kept = name is not None and name in keep
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim >= 2 and not kept:
                return v.dtype
        return None

    def cast_in(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = [positional[i] if i < len(positional) else None for i in range(len(args))]
        callers.append(caller_dtype([*zip(names, args), *kwargs.items()]))
        return (
            tuple(cast(n, v) for n, v in zip(names, args)),
            {k: cast(k, v) for k, v in kwargs.items()},
        )

    def cast_out(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        caller = callers.pop()  # also after an error (always_call): the stack stays balanced
        return output if caller is None or output is None else _cast_tree(output, caller)

    module.register_forward_pre_hook(cast_in, with_kwargs=True, prepend=True)
    module.register_forward_hook(cast_out, with_kwargs=True, always_call=True)


def _kept_in_fp32(module: nn.Module) -> set[str]:
    """The qualified names of the tensors that diffusers keeps in fp32, for every model of
    ``module``: the root's, or one inside a wrapper (``_keep_in_fp32_modules`` of each
    submodule, matched against the names below it)."""
    kept: set[str] = set()
    for prefix, sub in module.named_modules():
        keep = tuple(getattr(sub, "_keep_in_fp32_modules", None) or ())
        if not keep:
            continue
        for name, tensor in [*sub.named_parameters(), *sub.named_buffers()]:
            if tensor.is_floating_point() and any(k in name.split(".") for k in keep):
                kept.add(f"{prefix}.{name}" if prefix else name)
    return kept


def _store_in(module: nn.Module, dtype: torch.dtype) -> None:
    # diffusers models name the submodules that must stay fp32 (Wan: rope, time_embedder,
    # scale_shift_table, norms); what from_pretrained(torch_dtype=...) keeps, keep here.
    kept = _kept_in_fp32(module)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and name not in kept:
            tensor.data = tensor.data.to(dtype)


def _as_checkpointing(
    value: ActivationCheckpointing | CheckpointMode | None,
) -> ActivationCheckpointing:
    if value is None:
        return ActivationCheckpointing("none")
    if isinstance(value, ActivationCheckpointing):
        return value
    if isinstance(value, str):
        return ActivationCheckpointing(value)
    raise TypeError(
        f"checkpointing must be 'none', 'full', 'selective' or an ActivationCheckpointing, "
        f"not {type(value).__name__}"
    )


#: Inductor options every prepared block is compiled with (unless the caller overrides them).
#: ``triton.mix_order_reduction`` (on by default since torch 2.10) computes silently wrong
#: gradients for chained modulated norms whose shift/scale are chunks of one shared
#: parameter — Wan's ``scale_shift_table`` — once batch x sequence exceeds ~16k tokens
#: (pytorch/pytorch#193061). Measured on an H200 with torch 2.11 at 32,760 tokens
#: (tests/gpu/compile_nan.py, docs/gpu.md): the compiled gradient of ``scale_shift_table``
#: and ``time_proj`` was ~9000x the eager one, in fp32 too; DMD2 on 2 GPUs got NaN.
SAFE_INDUCTOR_OPTIONS: dict[str, Any] = {"triton.mix_order_reduction": False}


#: The least recompile limit (``torch._dynamo.config.recompile_limit``, default 8) that
#: :func:`prepare` sets when it compiles. The blocks of every role it compiles share one
#: code object (the block class's forward, or the checkpointed forward around it), and
#: each (role, grad mode, input requires-grad) combination that reaches a block is a graph
#: of it: full-weight DMD2 compiles 4, DMD2 over a LoRA base 7, and both in one process
#: (a benchmark's two sides) 11, past the default.
RECOMPILE_LIMIT = 64


def _compile_kwargs(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    if compile is False:
        return None
    if compile is not True and not isinstance(compile, Mapping):
        raise TypeError(f"compile must be a bool or torch.compile options, not {compile!r}")
    kwargs: dict[str, Any] = {"fullgraph": True, "dynamic": False}
    if isinstance(compile, Mapping):
        kwargs.update(compile)
    if kwargs.get("backend", "inductor") == "inductor":
        known = {
            k: v for k, v in SAFE_INDUCTOR_OPTIONS.items() if torch_compat.inductor_has_option(k)
        }
        # torch.compile takes a mode or options, not both: a mode becomes its options, so
        # that no mode can bring back the pass SAFE_INDUCTOR_OPTIONS turns off.
        mode = kwargs.pop("mode", None)
        by_mode = torch_compat.inductor_mode_options(mode) if mode is not None else {}
        kwargs["options"] = {**by_mode, **known, **dict(kwargs.get("options") or {})}
    return kwargs


def prepare(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    trainable: bool = True,
    checkpointing: ActivationCheckpointing | CheckpointMode | None = None,
    compile: bool | Mapping[str, Any] = False,
    verify_compile: bool | float = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    offload: bool = False,
    frozen_dtype: torch.dtype | None = torch.bfloat16,
    attention_backend: str | None = None,
    policy: ShardPolicy = blocks_policy,
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
        checkpointing: ``"none"`` (default), ``"full"``, ``"selective"`` or an
            :class:`ActivationCheckpointing` (e.g. every n-th block). Under ``no_grad`` a
            checkpointed block just runs its forward, so a role read without gradient
            (a DMD2 teacher) pays nothing for it.
        compile: ``True`` for ``block.compile(fullgraph=True, dynamic=False)`` on each
            block, or a mapping of ``torch.compile`` arguments (e.g. ``{"backend":
            "aot_eager"}``) merged over those. With Inductor, the Inductor ``options``
            (a ``mode`` is turned into its options) default to :data:`SAFE_INDUCTOR_OPTIONS`, which turn
            off a pass that computes wrong gradients for Wan's blocks
            (pytorch/pytorch#193061); an ``options`` mapping given here is merged over
            them. Dynamo's recompile limit is raised to :data:`RECOMPILE_LIMIT` at
            least (a process-wide setting): every block of every compiled role shares one
            code object, so the default (8) is too few for DMD2 over a LoRA base.
        verify_compile: Check every compiled block's gradients against its eager ones
            before training on them (:mod:`fvstep.parallel.compile_check`): the first
            grad-enabled call of each ``requires_grad`` pattern compares them on its real
            inputs and raises :class:`~fvstep.parallel.compile_check.CompiledGradientError`
            (block, parameter, error, tolerance) when they differ. ``True`` for the
            default tolerance by precision (1e-3 fp32, 1e-2 TF32, 0.1 bf16/fp16), or a
            relative tolerance. It costs one eager and one compiled forward and backward
            of each block, once, and no compile; off by default.
        param_dtype: FSDP2's compute dtype (``MixedPrecisionPolicy.param_dtype``), e.g.
            ``torch.bfloat16`` with fp32 master parameters. Needs ``mesh``. Activations
            are cast to it at the root and outputs cast back; the
            ``full_precision_inputs`` are not (FSDP2's ``cast_forward_inputs`` would
            round them).
        reduce_dtype: FSDP2's gradient-reduction dtype (default fp32).
        reshard_after_forward: FSDP2's option, for every group.
        offload: FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state
            on the CPU between uses). Needs ``mesh``.
        frozen_dtype: The dtype a frozen role is stored in (default bf16; ``None`` keeps
            it).
        attention_backend: A diffusers attention backend name (``"native"``,
            ``"_native_cudnn"``, ``"_native_flash"``, ``"flash"``, ...), set with
            ``module.set_attention_backend``.
        policy: Which submodules are blocks (default: the items of the root's
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
            then run with :class:`fvstep.parallel.ContextParallelism`. Not with
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
            given without a mesh, if it has no blocks to checkpoint or compile, or if
            ``verify_compile`` is asked without ``compile``.
        TypeError: On a bad ``checkpointing``, ``compile`` or ``verify_compile`` value.

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
    if mesh is None and (param_dtype is not None or offload):
        raise ValueError("param_dtype and offload are FSDP2 options: they need a mesh")
    if isinstance(full_precision_inputs, str):
        raise TypeError(
            "full_precision_inputs must be a collection of argument names, got the string "
            f"{full_precision_inputs!r}; write ({full_precision_inputs!r},)"
        )
    keep = frozenset(full_precision_inputs)
    ac = _as_checkpointing(checkpointing)
    compile_kwargs = _compile_kwargs(compile)
    verify_rtol = resolve_rtol(verify_compile)
    if verify_compile is not False and compile_kwargs is None:
        raise ValueError("verify_compile checks compiled blocks: it needs compile")
    names = block_names(module, policy)
    if (ac.mode != "none" or compile_kwargs is not None) and not names:
        raise ValueError(
            "the module has no blocks to checkpoint or compile (the policy picked none)"
        )
    if context_mesh is not None and compile_kwargs is not None:
        raise ValueError(
            "compile with context parallel is not supported: diffusers' attention "
            "backward under context parallel cannot be traced (docs/concepts/context-parallel.md)"
        )
    blocks = dict(module.named_modules())
    if attention_backend is not None:
        setter = getattr(module, "set_attention_backend", None)
        if setter is None:
            raise ValueError(
                f"{type(module).__name__} has no set_attention_backend: the attention "
                "backend is chosen by diffusers models only"
            )
        setter(attention_backend)
    if not trainable:
        if frozen_dtype is not None:
            _store_in(module, frozen_dtype)
            _cast_at_the_boundary(module, frozen_dtype, keep)
        module.requires_grad_(False)
    if context_mesh is not None:
        from fvstep.parallel.context import apply_context_parallel

        apply_context_parallel(module, mesh=context_mesh, mode=context_mode)
    if checkpoint_context is None:
        checkpoint_context = module.__dict__.get("_fvstep_checkpoint_context")
    checkpointed = [n for i, n in enumerate(names) if ac.chooses(i)]
    for name in checkpointed:
        _apply_checkpointing(blocks[name], ac, checkpoint_context)
    if compile_kwargs is not None:
        torch_compat.raise_recompile_limit(RECOMPILE_LIMIT)
        for name in names:
            blocks[name].compile(**compile_kwargs)
            if verify_compile is not False:  # a pre-hook: runs after FSDP2's (it prepends)
                install_compile_check(blocks[name], name=name, rtol=verify_rtol, mesh=mesh)
    if mesh is not None and param_dtype is not None and trainable:
        _cast_at_the_boundary(module, param_dtype, keep)
    if mesh is not None:
        offload_policy: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
        shard_module(
            module,
            mesh=mesh,
            policy=policy,
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
        checkpointed_blocks=tuple(checkpointed),
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


def compile_counts() -> dict[str, int]:
    """What dynamo compiled in this process so far: graphs and graph breaks.

    Read from ``torch._dynamo.utils.counters`` (process-wide, as dynamo keeps them): take
    the difference of two calls around the code of interest. Every graph past the first
    of a block's code is a recompile; a prepared role's blocks share their graphs (at
    most one per grad mode and ``requires_grad`` pattern and input shape).

    Returns:
        ``{"graphs": ..., "graph_breaks": ...}``.

    Examples:
        >>> before = compile_counts()
        >>> state, metrics = step(state, batch)
        >>> compile_counts()["graphs"] - before["graphs"]
        3
    """
    counters = torch_compat.dynamo_counters()
    return {
        "graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters.get("graph_break", {}).values())),
    }
