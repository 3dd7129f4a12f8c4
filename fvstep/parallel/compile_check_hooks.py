"""The compile check installed on compiled blocks: the hooks that ``prepare`` arms.

:func:`install_compile_check` arms a block compiled in place (``block.compile()``, as
:func:`fvstep.parallel.prepare` compiles): the first grad-enabled call of each graph the
block compiles runs the comparison of :mod:`fvstep.parallel.gradient_comparison` on its
real inputs, inside the block's call, where FSDP2 has gathered the parameters, and raises
:class:`~fvstep.parallel.compile_check.CompiledGradientError` (naming the block, the
parameter, the ratio of its error to eager's rounding noise and the threshold) before the
block's real forward runs. A graph is known by what dynamo specialises it on (blocks
compile with ``dynamic=False``): the shapes, strides, dtypes, devices and
``requires_grad`` of the tensor inputs, the other inputs' values, the parameters'
``requires_grad``, dtypes and shapes, and autocast; so a new input shape (a validation
shape, a bucketed resolution, a stream with and without eviction) is checked on its first
call, and a graph already checked is never checked again.
``prepare(..., verify_compile=True)`` installs it on every compiled block;
:func:`compile_check_reports` lists what the checks found. On a mesh the verdict is agreed
over the ranks (one all-reduce of one number per block), so that every rank raises, or
none: a rank that raised alone would leave the others waiting.

Examples:
    >>> block.compile(fullgraph=True)
    >>> check = install_compile_check(block, name="blocks.0")
    >>> loss = block(x, temb).square().mean()   # raises here if the gradients differ
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fvstep.core.errors import CompiledGradientError
from fvstep.parallel.compile_check import (
    DEFAULT_THRESHOLD,
    CompiledGradientReport,
    compiled_gradient_error,
)
from fvstep.parallel.gradient_comparison import (
    Comparison,
    input_names,
    positional_names,
    run_compiled,
)
from fvstep.parallel.ranks import max_over_ranks

__all__ = [
    "CompileCheck",
    "block_parameters",
    "compile_check_reports",
    "graph_key",
    "install_compile_check",
    "is_compiled_in_place",
]


def block_parameters(block: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a block computes with: its own, and those of modules its submodules
    hold outside the module tree (plain attributes, e.g. the adapters of
    :func:`fvstep.lora.add_adapters`, which live in their LoRA role but compute inside the
    base's layers), by name, so that a LoRA base's check compares the adapters' gradients.

    Examples:
        >>> [n for n in block_parameters(base.blocks[0]) if ".lora_A." in n][:1]
        ['attn1.to_q.lora_A.student.weight']
    """
    params: dict[str, torch.Tensor] = dict(block.named_parameters())
    seen = {id(p) for p in params.values()}
    for prefix, sub in block.named_modules():
        for attr, held in vars(sub).items():
            if not isinstance(held, nn.Module):
                continue
            for name, p in held.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params[".".join(x for x in (prefix, attr, name) if x)] = p
    return params


def graph_key(
    params: Mapping[str, torch.Tensor], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Hashable:
    """What dynamo specialises a block's graph on (``dynamic=False``), as one hashable
    value: two calls with the same key run the same compiled graph.

    The tensor inputs' shapes, strides, dtypes, devices and ``requires_grad``, the other
    inputs' values (dynamo specialises on Python scalars), the parameters'
    ``requires_grad``, dtypes and shapes, and the autocast state of the devices in use.

    Examples:
        >>> graph_key(dict(block.named_parameters()), (x,), {}) == graph_key(
        ...     dict(block.named_parameters()), (x.clone(),), {})
        True
    """
    tensors = list(params.values())
    inputs = (_signature(args, tensors), _signature(dict(kwargs), tensors))
    devices = sorted({"cpu", *(t.device.type for t in tensors)})
    autocast = tuple(
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices
    )
    own = tuple((p.requires_grad, p.dtype, tuple(p.shape)) for p in params.values())
    return own, inputs, autocast


def _signature(value: Any, tensors: list[torch.Tensor]) -> Hashable:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        stride = value.stride() if value.layout == torch.strided else ()
        return (value.dtype, value.device, tuple(value.shape), stride, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_signature(v, tensors) for v in value)
    if isinstance(value, Mapping):
        return "map", tuple((k, _signature(v, tensors)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value).__name__, repr(value)  # repr: 1, True and 1.0 differ, nan = nan
    return type(value).__qualname__


class CompileCheck:
    """The check installed on one compiled block (:func:`install_compile_check`).

    Attributes:
        name: The block's qualified name.
        threshold: The largest ratio of compiled error to eager rounding noise that passes.
        reports: The reports of the comparisons it ran, in order: one per graph.
    """

    def __init__(
        self, block: nn.Module, name: str, threshold: float, mesh: DeviceMesh | None, seed: int
    ) -> None:
        self.name = name
        self.threshold = threshold
        self.reports: list[CompiledGradientReport] = []
        self._mesh = mesh
        self._seed = seed
        self._checked: set[Hashable] = set()  # the graph keys that passed
        self._arg_names = positional_names(type(block).forward)
        self._block = weakref.ref(block)
        # Skipped by dynamo, not disabled: the block's forward that it calls is compiled
        # by the compiled call the hook runs inside (see _pre_forward).
        hook = torch.compiler.disable(self._pre_forward, recursive=False)
        self._handle = block.register_forward_pre_hook(hook, with_kwargs=True)
        block.__dict__.setdefault(_CHECKS_ATTR, []).append(self)  # on the block, not global

    def remove(self) -> None:
        """Disarm the check (its reports stay readable here)."""
        self._handle.remove()
        block = self._block()
        if block is not None and self in block.__dict__.get(_CHECKS_ATTR, []):
            block.__dict__[_CHECKS_ATTR].remove(self)

    def _begin(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Comparison, Hashable] | None:
        params = block_parameters(module)  # under FSDP2: gathered, by their names
        key = graph_key(params, args, kwargs)
        if key in self._checked:
            return None
        inputs = [t for _, t in input_names(args, kwargs, None)]
        if not any(t.requires_grad for t in (*params.values(), *inputs)):
            return None
        comparison = Comparison(
            module.forward,
            args,
            kwargs,
            params,
            self.name,
            self.threshold,
            self._seed,
            self._arg_names,
            list(module.buffers()),
        )
        return comparison, key

    def _conclude(self, report: CompiledGradientReport, key: Hashable) -> None:
        self.reports.append(report)
        worst = report.worst_ratio / report.threshold
        if self._mesh is not None:
            # Every rank of the mesh gets here in the same call when every rank calls the
            # block with the same shapes (FSDP2 runs the blocks in lock-step; fvstep's
            # BucketedOrder gives every rank of a step the same bucket): agree, so that all
            # raise or none does. A rank raising alone would leave the others in a collective.
            for dim in range(self._mesh.ndim):
                worst = max_over_ranks([worst], group=self._mesh.get_group(dim))[0]
        if worst <= 1.0:
            self._checked.add(key)
            return
        if not report.passed:
            raise compiled_gradient_error(report)
        mine = report.worst.describe() if report.worst else "none"
        raise CompiledGradientError(
            f"the compiled gradients of {self.name} differ from the eager ones on another rank (up to "
            f"{worst:.3g} x the threshold; here {mine}): its error names the parameter. See docs/concepts/prepare.md"
        )

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # dynamo compiles every frame called from here (this one is skipped, as is
        # run_compiled): the steps of the comparison are disabled, and only the block's
        # forward, between them, is compiled, with the guards of the real call: the graph
        # training then runs (and, in bf16/fp16, its fp32 twin: the probe).
        if not torch.is_grad_enabled():
            return None
        try:
            started = _begin(self, module, args, kwargs)
            if started is None:
                return None
            comparison, key = started
            report = run_compiled(comparison, module.forward)
        except CompiledGradientError:
            raise
        except Exception as error:  # say where it broke: inside the check, not training
            raise _check_failed(self.name, error) from error
        _conclude(self, report, key)
        return None


def _check_failed(name: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"fvstep's compile check of {name} failed inside the check "
        f"({type(error).__name__}: {error}; torch {torch.__version__}). Without "
        "verify_compile the block's own call shows whether the block or the check is at "
        "fault; docs/concepts/prepare.md says which torch versions the check was run on."
    )


_begin = torch.compiler.disable(CompileCheck._begin)
_conclude = torch.compiler.disable(CompileCheck._conclude)

_CHECKS_ATTR = "_fvstep_compile_checks"
"""Where a block keeps its installed checks (its ``__dict__``: no registry outside it)."""


def install_compile_check(
    block: nn.Module,
    *,
    name: str,
    threshold: float = DEFAULT_THRESHOLD,
    mesh: DeviceMesh | None = None,
    seed: int = 0,
) -> CompileCheck:
    """Check a block compiled in place on the first grad-enabled call of each of its graphs.

    A forward pre-hook: when grad mode is on and some parameter or input requires grad,
    and the call's graph (:func:`graph_key`: what dynamo specialises on) was not checked
    yet, it runs :func:`compare_compiled_gradients` on the call's real inputs (inside the
    call, where FSDP2 has gathered the parameters) and raises
    :class:`CompiledGradientError` before the real forward runs if a compiled gradient's
    error is more than ``threshold`` times eager's rounding noise. Otherwise the real call
    runs as it would have: same RNG state, same compiled graph (the check compiled it,
    with the real call's guards). A graph that failed is checked again on its next call,
    so training cannot go on past it.

    Args:
        block: A module compiled in place (``block.compile(...)``).
        name: Its qualified name, for the error.
        threshold: The largest ratio that passes (:data:`DEFAULT_THRESHOLD`).
        mesh: The FSDP2 mesh the block is sharded over: the verdict is agreed over it
            (one all-reduce of one number per check), so that every rank raises or none.
            Every rank must then call the block with the same shapes in the same calls.
        seed: The cotangent's seed.

    Returns:
        The :class:`CompileCheck` (``.reports``; ``.remove()`` disarms it).

    Raises:
        ValueError: If ``block`` is not compiled in place.

    Examples:
        >>> block.compile(fullgraph=True)
        >>> check = install_compile_check(block, name="blocks.0")
        >>> loss = block(x, temb).square().mean()   # raises here if the gradients differ
        >>> check.reports[0].passed
        True
    """
    if not is_compiled_in_place(block):
        raise ValueError(
            f"{name} is not compiled in place (block.compile()): nothing to check; for a "
            "separately compiled callable use compare_compiled_gradients"
        )
    return CompileCheck(block, name, threshold, mesh, seed)


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called (``nn.Module.compile`` compiles in place)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_check_reports(module: nn.Module) -> list[CompiledGradientReport]:
    """The reports of the checks installed on ``module`` and its submodules so far.

    Examples:
        >>> student = prepare(student, compile=True, verify_compile=True)
        >>> state, metrics = step(state, batch)
        >>> [r.describe()["worst_ratio"] for r in compile_check_reports(student)]
    """
    return [
        r for m in module.modules() for c in m.__dict__.get(_CHECKS_ATTR, []) for r in c.reports
    ]
