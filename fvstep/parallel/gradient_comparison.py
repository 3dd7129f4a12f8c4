"""The comparison of one block: its compiled gradients against its eager ones, on one input.

:func:`compare_compiled_gradients` runs an eager and a compiled forward of one block on
detached clones of the same inputs from the same RNG state, pulls both back with the same
fixed cotangent (drawn from a seeded generator, never the global RNG) by
``torch.autograd.grad`` (so no ``.grad`` is written and no backward hook of FSDP2 fires),
and gives one :class:`~fvstep.parallel.compile_check.CompiledGradientReport`: a
:class:`~fvstep.parallel.compile_check.GradientDifference` per parameter and per input
that requires grad. The check installed on compiled blocks
(:mod:`fvstep.parallel.compile_check_hooks`) runs the same comparison in three parts
around the block's own compiled call. Tolerances and the relative error:
:mod:`fvstep.parallel.compile_check`.

Examples:
    >>> report = compare_compiled_gradients(
    ...     block.forward, torch.compile(block.forward), (x, temb), params=dict(block.named_parameters())
    ... )
    >>> report.passed, report.worst
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fvstep import random as fsrandom
from fvstep.parallel.compile_check import (
    GRADIENT_FLOOR,
    CompiledGradientError,
    CompiledGradientReport,
    GradientDifference,
    default_rtol,
)

__all__ = ["compare_compiled_gradients"]

_TINY = torch.finfo(torch.float32).tiny


def _leaf_paths(value: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [p for i, v in enumerate(value) for p in _leaf_paths(v, f"{path}[{i}]")]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _leaf_paths(v, f"{path}.{k}")]
    return []


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    return value


def _positional_names(forward: Callable[..., Any]) -> list[str]:
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]  # self
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


def _input_names(
    args: Sequence[Any], kwargs: Mapping[str, Any], arg_names: Sequence[str] | None
) -> list[tuple[str, torch.Tensor]]:
    names = list(arg_names or ())
    found = []
    for i, a in enumerate(args):
        found += _leaf_paths(a, names[i] if i < len(names) else f"args[{i}]")
    for k, v in kwargs.items():
        found += _leaf_paths(v, k)
    return found


def _clone_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    # Detached clones with the caller's requires_grad: the same guards as the real call, so
    # the compiled run uses the graph training uses (and compiles nothing more), and the
    # gradients asked for are exactly those training computes. One clone per distinct
    # tensor keeps aliasing (dynamo guards on it too).
    memo: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            c = t.detach().clone()
            memo[id(t)] = c.requires_grad_(t.requires_grad) if t.is_floating_point() else c
        return memo[id(t)]

    return _map_tensors(clone, tuple(args)), _map_tensors(clone, dict(kwargs))


def _precision(params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> str:
    device_types = {t.device.type for t in (*params, *inputs)} or {"cpu"}
    for device_type in sorted(device_types):
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            if dtype in (torch.bfloat16, torch.float16):
                return "bf16" if dtype == torch.bfloat16 else "fp16"
    dtypes = {t.dtype for t in (*params, *inputs) if t.is_floating_point()}
    if torch.bfloat16 in dtypes:
        return "bf16"
    if torch.float16 in dtypes:
        return "fp16"
    if "cuda" in device_types and (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    ):
        return "tf32"
    return "fp32"


def _cuda_devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    return sorted(
        {
            t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in tensors
            if t.is_cuda
        }
    )


class _BufferState:
    """Copies of a block's buffers (BatchNorm's running statistics, counters), put back
    after each run: both runs start from the state the real call starts from, and the
    real call finds it as it would have without the check."""

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            self.saved = [(b, b.detach().clone()) for b in buffers]

    def restore(self) -> None:
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)


class _RngState:
    """The global CPU and CUDA RNG state, to give both runs the same draws (dropout) and
    to hand the real call the state it would have had without the check."""

    def __init__(self, cuda_devices: Sequence[int]) -> None:
        self.cpu = torch.random.get_rng_state()
        self.cuda = {d: torch.cuda.get_rng_state(d) for d in cuda_devices}

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        for d, s in self.cuda.items():
            torch.cuda.set_rng_state(s, d)


def _grad_outputs(output: Any) -> list[torch.Tensor]:
    return [t for _, t in _leaf_paths(output, "") if t.is_floating_point() and t.requires_grad]


def _gradients(
    outputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    if not outputs or not targets:
        return [None] * len(targets)
    return list(
        torch.autograd.grad(
            outputs,
            targets,
            [c.to(o.dtype) for o, c in zip(outputs, cotangents, strict=True)],
            allow_unused=True,
        )
    )


class _Comparison:
    """One comparison in three parts, so that the compiled forward can be called from a
    frame that dynamo compiles (the hook's) while everything else runs eagerly."""

    def __init__(
        self,
        eager: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        params: Mapping[str, torch.Tensor],
        block: str,
        rtol: float | None,
        seed: int,
        arg_names: Sequence[str] | None,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self.block = block
        self.buffers = _BufferState(buffers)
        self.start = time.perf_counter()
        self.params = [(n, p) for n, p in params.items() if p.requires_grad]
        named_inputs = _input_names(args, kwargs, arg_names)
        self.input_names = [f"input {n}" for n, t in named_inputs if t.requires_grad]
        tensors = [p for _, p in self.params] + [t for _, t in named_inputs]
        self.precision = _precision([p for _, p in params.items()], [t for _, t in named_inputs])
        self.rtol = default_rtol(self.precision) if rtol is None else rtol
        self.rng = _RngState(_cuda_devices(tensors))
        eager_args, eager_kwargs = _clone_inputs(args, kwargs)
        try:
            with torch.compiler.set_stance("force_eager"):  # also inside a compiled caller
                outputs = _grad_outputs(eager(*eager_args, **eager_kwargs))
        except BaseException:
            self.rng.restore()
            self.buffers.restore()
            raise
        key = fsrandom.key(seed)
        self.cotangents = [
            torch.randn(
                o.shape,
                generator=fsrandom.generator(fsrandom.fold_in(key, i), o.device),
                device=o.device,
                dtype=o.dtype,
            )
            for i, o in enumerate(outputs)
        ]
        self.eager_grads = _gradients(
            outputs, self._targets(eager_args, eager_kwargs), self.cotangents
        )
        del outputs  # the eager graph goes before the compiled one is built
        self.rng.restore()
        self.buffers.restore()
        self.args, self.kwargs = _clone_inputs(args, kwargs)

    def _targets(self, args: Any, kwargs: Any) -> list[torch.Tensor]:
        inputs = [t for _, t in _input_names(args, kwargs, None) if t.requires_grad]
        return [p for _, p in self.params] + inputs

    def finish(self, output: Any) -> CompiledGradientReport:
        outputs = _grad_outputs(output)
        if len(outputs) != len(self.cotangents) or any(
            o.shape != c.shape for o, c in zip(outputs, self.cotangents, strict=False)
        ):
            raise CompiledGradientError(
                f"the compiled forward of {self.block} returned other outputs than the eager "
                f"one: {[tuple(o.shape) for o in outputs]} against "
                f"{[tuple(c.shape) for c in self.cotangents]}"
            )
        compiled = _gradients(outputs, self._targets(self.args, self.kwargs), self.cotangents)
        del outputs, output
        names = [n for n, _ in self.params] + self.input_names
        return CompiledGradientReport(
            block=self.block,
            rtol=self.rtol,
            precision=self.precision,
            differences=self._differences(names, compiled),
            seconds=time.perf_counter() - self.start,
        )

    def _differences(
        self, names: list[str], compiled: list[torch.Tensor | None]
    ) -> tuple[GradientDifference, ...]:
        rows = []
        targets = self._targets(self.args, self.kwargs)
        for ge, gc, target in zip(self.eager_grads, compiled, targets, strict=True):
            e = torch.zeros_like(target, dtype=torch.float32) if ge is None else ge.float()
            c = torch.zeros_like(target, dtype=torch.float32) if gc is None else gc.float()
            rows.append(torch.stack([(c - e).norm(), e.norm(), c.norm()]))
        if not rows:
            return ()
        table = torch.stack(rows).cpu().tolist()  # one host sync for the whole block
        num_params = len(self.params)
        scale = max(
            (
                table[i][1] / math.sqrt(max(p.numel(), 1))
                for i, (_, p) in enumerate(self.params)
                if math.isfinite(table[i][1])
            ),
            default=0.0,
        )
        out = []
        for i, (name, (diff, e_norm, c_norm)) in enumerate(zip(names, table, strict=True)):
            floor = _TINY
            if i < num_params:
                floor = max(floor, GRADIENT_FLOOR * scale * math.sqrt(self.params[i][1].numel()))
            if math.isfinite(e_norm) and math.isfinite(c_norm):
                relative = diff / max(e_norm, floor)
            else:
                relative = math.inf if math.isfinite(e_norm) else math.nan
            out.append(GradientDifference(name, relative, e_norm, c_norm))
        return tuple(out)

    def close(self) -> None:
        self.rng.restore()
        self.buffers.restore()
        self.args = self.kwargs = None
        self.eager_grads = []


def _start_comparison(*args: Any) -> _Comparison:
    return _Comparison(*args)


def _finish_comparison(comparison: _Comparison, output: Any) -> CompiledGradientReport:
    return comparison.finish(output)


def _close_comparison(comparison: _Comparison) -> None:
    comparison.close()


# When a hook runs a comparison inside a compiled block's call, dynamo compiles every frame
# the hook calls: its own steps must not be traced (only the block's forward, called
# between them, is compiled), so they are disabled.
_start = torch.compiler.disable(_start_comparison)
_finish = torch.compiler.disable(_finish_comparison)
_close = torch.compiler.disable(_close_comparison)


def compare_compiled_gradients(
    eager: Callable[..., Any],
    compiled: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    params: Mapping[str, torch.Tensor],
    block: str = "block",
    rtol: float | None = None,
    seed: int = 0,
    arg_names: Sequence[str] | None = None,
) -> CompiledGradientReport:
    """Compare a block's compiled gradients with its eager ones on one input.

    Both forwards run on detached clones of ``args``/``kwargs`` (floating tensors keep the
    caller's ``requires_grad``) from the same global RNG state (restored afterwards: the
    caller's draws are untouched), and are pulled back with the same cotangent, drawn
    from a generator seeded with ``seed``; ``torch.autograd.grad`` computes the gradients
    of ``params`` (those that require grad) and of the inputs that require grad, so no
    ``.grad`` is written; an ``eager`` module's buffers (BatchNorm's running statistics)
    are put back after each run. A pure function of its arguments: nothing is left
    behind, except what forward hooks of the block's submodules record (they fire once
    per run).

    Args:
        eager: The block's eager forward (run with every ``torch.compile`` ignored:
            ``torch.compiler.set_stance("force_eager")``).
        compiled: Its compiled forward (e.g. ``torch.compile(block)``).
        args: Positional inputs.
        kwargs: Keyword inputs.
        params: The block's parameters by name.
        block: The block's name, for the report.
        rtol: The tolerance (default: :func:`default_rtol` of the precision).
        seed: The cotangent's seed.
        arg_names: Names of the positional inputs, for the report (default: those of
            ``eager``'s forward if it is a module, else ``args[i]``).

    Returns:
        The :class:`CompiledGradientReport` (check ``passed``: it does not raise on a
        difference).

    Raises:
        CompiledGradientError: If the two forwards return different outputs.

    Examples:
        >>> report = compare_compiled_gradients(
        ...     block, torch.compile(block), (x,), params=dict(block.named_parameters())
        ... )
        >>> report.passed
        True
    """
    if arg_names is None and isinstance(eager, nn.Module):
        arg_names = _positional_names(type(eager).forward)
    buffers = list(eager.buffers()) if isinstance(eager, nn.Module) else []
    comparison = _start(eager, args, kwargs or {}, params, block, rtol, seed, arg_names, buffers)
    try:
        return _finish(comparison, compiled(*comparison.args, **comparison.kwargs))
    finally:
        _close(comparison)
