"""The comparison of one block: its compiled gradients against its eager ones, on one input.

:func:`compare_compiled_gradients` runs an eager and a compiled forward of one block on
detached clones of the same inputs from the same RNG state, pulls both back with the same
fixed cotangent (drawn from a seeded generator, never the global RNG) by
``torch.autograd.grad`` (so no ``.grad`` is written and no backward hook of FSDP2 fires),
and gives one :class:`~fvstep.parallel.compile_check.CompiledGradientReport`: a
:class:`~fvstep.parallel.compile_check.GradientDifference` per parameter and per input
that requires grad. A block that computes below fp32 (autocast, bf16 parameters or
inputs, TF32) is also run eagerly in fp32 (autocast off, its low-precision parameters,
buffers and inputs cast to fp32 for the run, TF32 off): the eager gradients' distance from
that reference is the rounding noise the compiled error is judged against; in bf16/fp16
the compiled forward runs in fp32 too (the probe) and is compared with that reference.
The check installed on compiled blocks (:mod:`fvstep.parallel.compile_check_hooks`) runs
the same comparison in steps around the block's own compiled call
(:func:`run_compiled`). The verdict: :mod:`fvstep.parallel.compile_check`.

Examples:
    >>> report = compare_compiled_gradients(
    ...     block.forward, torch.compile(block.forward), (x, temb), params=dict(block.named_parameters())
    ... )
    >>> report.passed, report.worst
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.errors import CompiledGradientError
from fvstep.parallel.compile_check import (
    DEFAULT_THRESHOLD,
    GRADIENT_FLOOR,
    CompiledGradientReport,
    GradientDifference,
)

__all__ = [
    "Comparison",
    "compare_compiled_gradients",
    "input_names",
    "positional_names",
]

_TINY = torch.finfo(torch.float32).tiny
_LOW = (torch.bfloat16, torch.float16)


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


def positional_names(forward: Callable[..., Any]) -> list[str]:
    """The names of ``forward``'s positional parameters after ``self`` (``[]`` when it has no signature)."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]  # self
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


def input_names(
    args: Sequence[Any], kwargs: Mapping[str, Any], arg_names: Sequence[str] | None
) -> list[tuple[str, torch.Tensor]]:
    """The tensor leaves of a call's inputs, each with its name (from ``arg_names``, else ``args[i]``, and the keywords)."""
    names = list(arg_names or ())
    found = []
    for i, a in enumerate(args):
        found += _leaf_paths(a, names[i] if i < len(names) else f"args[{i}]")
    for k, v in kwargs.items():
        found += _leaf_paths(v, k)
    return found


def _clone_inputs(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, float32: bool = False
) -> tuple[Any, Any]:
    # Detached clones with the caller's requires_grad: the same guards as the real call, so
    # the compiled run uses the graph training uses (and compiles nothing more), and the
    # gradients asked for are exactly those training computes. One clone per distinct
    # tensor keeps aliasing (dynamo guards on it too). ``float32``: bf16/fp16 ones in fp32.
    memo: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            dtype = torch.float32 if float32 and t.dtype in _LOW else t.dtype
            c = t.detach().to(dtype, copy=True)
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


@contextlib.contextmanager
def _in_float32(tensors: Sequence[torch.Tensor], device_types: Sequence[str]) -> Iterator[None]:
    """Autocast off, TF32 off, and the bf16/fp16 ``tensors`` (a block's parameters and
    buffers) holding fp32 copies of their values (``.data``, put back after: the same
    objects, so the caller's names and FSDP2's registrations stay): the fp32 reference."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    precision = torch.get_float32_matmul_precision()
    try:
        with torch.no_grad():
            for t in tensors:
                if id(t) not in seen and t.dtype in _LOW:
                    seen.add(id(t))
                    swapped.append((t, t.data))
                    t.data = t.data.float()
        torch.set_float32_matmul_precision("highest")
        with contextlib.ExitStack() as stack:
            for device_type in device_types:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        with torch.no_grad():
            for t, data in swapped:
                t.data = data


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


class Comparison:
    """One comparison in steps, so that the compiled forward can be called from a frame
    that dynamo compiles (the hook's) while everything else runs eagerly: ``__init__``
    (eager, and below fp32 the fp32 reference), the compiled call, :meth:`take_compiled`,
    below bf16/fp16 :meth:`enter_probe`, the compiled call in fp32, :meth:`take_probe`,
    then :meth:`report` and :meth:`close`."""

    def __init__(
        self,
        eager: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        params: Mapping[str, torch.Tensor],
        block: str,
        threshold: float,
        seed: int,
        arg_names: Sequence[str] | None,
        buffers: Sequence[torch.Tensor] = (),
        more_state: Sequence[torch.Tensor] = (),
    ) -> None:
        self.block = block
        self.buffers = _BufferState(buffers)
        self.start = time.perf_counter()
        self.params = [(n, p) for n, p in params.items() if p.requires_grad]
        named_inputs = input_names(args, kwargs, arg_names)
        self.names = [n for n, _ in self.params]
        self.names += [f"input {n}" for n, t in named_inputs if t.requires_grad]
        tensors = [p for _, p in self.params] + [t for _, t in named_inputs]
        self.precision = _precision([p for _, p in params.items()], [t for _, t in named_inputs])
        self.threshold = threshold
        self.rng = _RngState(_cuda_devices(tensors))
        self.state = [*params.values(), *buffers, *more_state]  # what the fp32 runs cast
        self.device_types = sorted({"cpu", *(t.device.type for t in (*tensors, *self.state))})
        self.raw_args: Sequence[Any] | None = args
        self.raw_kwargs: Mapping[str, Any] | None = kwargs
        self.fp32: contextlib.ExitStack | None = None
        # Per tensor, on device: ‖c − e‖, ‖e‖, ‖c‖, ‖e − r‖, ‖p − r‖ (module docstring).
        self.norms: dict[str, list[torch.Tensor]] = {}
        self.reference_seconds = 0.0
        self.reference: list[torch.Tensor | None] | None = None
        try:
            eager_args, eager_kwargs = _clone_inputs(args, kwargs)
            outputs = self._run(eager, eager_args, eager_kwargs)
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
            targets = self._targets(eager_args, eager_kwargs)
            self.eager = _gradients(outputs, targets, self.cotangents)
            del outputs  # the eager graph goes before the next one is built
            self.like = [_zeros_like(t) for t in targets]
            self.norms["eager"] = [_norm(g, z) for g, z in zip(self.eager, self.like, strict=True)]
            if self.precision != "fp32":
                self.reference = self._reference(eager)
                self.norms["noise"] = self._distances(self.eager, self.reference)
        finally:
            self.rng.restore()
            self.buffers.restore()
        self.args, self.kwargs = _clone_inputs(args, kwargs)
        # A probe only where fp32 is another graph (not TF32: its flags are no guard).
        self.probe = self.precision in ("bf16", "fp16")

    def _run(self, forward: Callable[..., Any], args: Any, kwargs: Any) -> list[torch.Tensor]:
        # Every run starts from the caller's RNG state and buffers (dropout, BatchNorm).
        self.rng.restore()
        self.buffers.restore()
        with torch.compiler.set_stance("force_eager"):  # also inside a compiled caller
            return _grad_outputs(forward(*args, **kwargs))

    def _reference(self, eager: Callable[..., Any]) -> list[torch.Tensor | None]:
        """``g_r``: the gradients of an eager run in fp32."""
        start = time.perf_counter()
        args, kwargs = _clone_inputs(self.raw_args or (), self.raw_kwargs or {}, float32=True)
        with _in_float32(self.state, self.device_types):
            outputs = self._run(eager, args, kwargs)
            reference = self._pull_back(outputs, args, kwargs, "fp32 reference")
        for device in self.rng.cuda:  # the reference's own time, for the report
            torch.cuda.synchronize(device)
        self.reference_seconds = time.perf_counter() - start
        return reference

    def _pull_back(
        self, outputs: list[torch.Tensor], args: Any, kwargs: Any, what: str
    ) -> list[torch.Tensor | None]:
        if len(outputs) != len(self.cotangents) or any(
            o.shape != c.shape for o, c in zip(outputs, self.cotangents, strict=False)
        ):
            raise CompiledGradientError(
                f"the {what} forward of {self.block} returned other outputs than the eager one: "
                f"{[tuple(o.shape) for o in outputs]} against {[tuple(c.shape) for c in self.cotangents]}"
            )
        return _gradients(outputs, self._targets(args, kwargs), self.cotangents)

    def _targets(self, args: Any, kwargs: Any) -> list[torch.Tensor]:
        inputs = [t for _, t in input_names(args, kwargs, None) if t.requires_grad]
        return [p for _, p in self.params] + inputs

    def _distances(
        self, a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        return [_distance(x, y, z) for x, y, z in zip(a, b, self.like, strict=True)]

    def take_compiled(self, output: Any) -> None:
        """The real graph's gradients: their distances from eager's."""
        compiled = self._pull_back(_grad_outputs(output), self.args, self.kwargs, "compiled")
        del output
        self.norms["error"] = self._distances(compiled, self.eager)
        self.norms["compiled"] = [_norm(g, z) for g, z in zip(compiled, self.like, strict=True)]

    def enter_probe(self) -> tuple[Any, Any]:
        """Into fp32 for the probe (until :meth:`take_probe` or :meth:`close`): its inputs."""
        self.rng.restore()
        self.buffers.restore()
        self.fp32 = contextlib.ExitStack()
        self.fp32.enter_context(_in_float32(self.state, self.device_types))
        self.args, self.kwargs = _clone_inputs(
            self.raw_args or (), self.raw_kwargs or {}, float32=True
        )
        return self.args, self.kwargs

    def take_probe(self, output: Any) -> None:
        """The fp32 graph's gradients: their distances from the fp32 reference's."""
        try:
            probe = self._pull_back(_grad_outputs(output), self.args, self.kwargs, "fp32 probe")
            del output
            assert self.reference is not None
            self.norms["probe"] = self._distances(probe, self.reference)
        finally:
            self._leave_fp32()

    def _leave_fp32(self) -> None:
        if self.fp32 is not None:
            self.fp32.close()
            self.fp32 = None

    def report(self) -> CompiledGradientReport:
        if not self.names:
            return self._report(())
        n = len(self.names)
        zero, nan = torch.zeros(()), torch.full((), math.nan)
        noise = self.norms.get("noise") or [zero] * n  # fp32: eager is the reference
        probe = self.norms.get("probe") or [nan] * n  # no probe
        columns = [self.norms["error"], self.norms["eager"], self.norms["compiled"], noise, probe]
        rows = [torch.stack([x.to(row[0].device) for x in row]) for row in zip(*columns)]
        values = torch.stack(rows).cpu().tolist()  # one host sync for the whole block
        return self._report(self._differences(values))

    def _report(self, differences: tuple[GradientDifference, ...]) -> CompiledGradientReport:
        return CompiledGradientReport(
            block=self.block,
            threshold=self.threshold,
            precision=self.precision,
            differences=differences,
            seconds=time.perf_counter() - self.start,
            reference_seconds=self.reference_seconds,
        )

    def _differences(self, values: list[list[float]]) -> tuple[GradientDifference, ...]:
        num_params = len(self.params)
        scale = max(
            (
                values[i][1] / math.sqrt(max(p.numel(), 1))
                for i, (_, p) in enumerate(self.params)
                if math.isfinite(values[i][1])
            ),
            default=0.0,
        )
        out = []
        for i, (name, (diff, e_norm, c_norm, noise, probe)) in enumerate(
            zip(self.names, values, strict=True)
        ):
            floor = _TINY
            if i < num_params:
                floor = max(floor, GRADIENT_FLOOR * scale * math.sqrt(self.params[i][1].numel()))
            s = max(e_norm, floor) if math.isfinite(e_norm) else math.nan
            relative = diff / s if math.isfinite(c_norm) else math.inf
            fp32 = None if not self.probe else probe / s
            out.append(GradientDifference(name, relative, noise / s, fp32, e_norm, c_norm))
        return tuple(out)

    def close(self) -> None:
        self._leave_fp32()
        self.rng.restore()
        self.buffers.restore()
        self.args = self.kwargs = self.raw_args = self.raw_kwargs = None
        self.eager, self.reference = [], None


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=t.device).expand(t.shape)


def _norm(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=like.device) if g is None else g.float().norm()


def _distance(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """‖a − b‖ in fp32 (a missing gradient is zeros)."""
    if a is None:
        return _norm(b, like)
    if b is None:
        return _norm(a, like)
    return (a.float() - b.float()).norm()


# When a hook runs a comparison inside a compiled block's call, dynamo compiles every frame
# the hook calls: the comparison's own steps must not be traced (only the block's forward,
# called between them, is compiled), so they are disabled.
_start = torch.compiler.disable(Comparison)
_take_compiled = torch.compiler.disable(Comparison.take_compiled)
_enter_probe = torch.compiler.disable(Comparison.enter_probe)
_take_probe = torch.compiler.disable(Comparison.take_probe)
_report = torch.compiler.disable(Comparison.report)
_close = torch.compiler.disable(Comparison.close)


def _run_compiled(comparison: Comparison, compiled: Callable[..., Any]) -> CompiledGradientReport:
    """The compiled steps of ``comparison``: ``compiled`` on the real inputs, and in
    bf16/fp16 on their fp32 copies (the probe), then the report. Skipped by dynamo, not
    disabled: inside a compiled block's call (the hook's) the block's forward called from
    here is compiled, with the real call's guards."""
    try:
        _take_compiled(comparison, compiled(*comparison.args, **comparison.kwargs))
        if comparison.probe:
            args, kwargs = _enter_probe(comparison)
            _take_probe(comparison, compiled(*args, **kwargs))
        return _report(comparison)
    finally:
        _close(comparison)


run_compiled = torch.compiler.disable(_run_compiled, recursive=False)


def compare_compiled_gradients(
    eager: Callable[..., Any],
    compiled: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    params: Mapping[str, torch.Tensor],
    block: str = "block",
    threshold: float = DEFAULT_THRESHOLD,
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
    are put back after each run. Below fp32 (autocast, bf16/fp16 parameters or inputs,
    TF32) ``eager`` runs once more in fp32 (autocast and TF32 off, ``params``, the
    module's buffers and the inputs in fp32 for that run): its gradients are the
    reference that measures eager's rounding noise, against which the compiled error is
    judged (:mod:`fvstep.parallel.compile_check`). A pure function of its arguments:
    nothing is left behind, except what forward hooks of the block's submodules record
    (they fire once per run).

    Args:
        eager: The block's eager forward (run with every ``torch.compile`` ignored:
            ``torch.compiler.set_stance("force_eager")``).
        compiled: Its compiled forward (e.g. ``torch.compile(block)``).
        args: Positional inputs.
        kwargs: Keyword inputs.
        params: The block's parameters by name (all that it computes with: below fp32
            the reference needs the low-precision ones in fp32).
        block: The block's name, for the report.
        threshold: The largest ratio of compiled error to eager rounding noise that
            passes (default :data:`~fvstep.parallel.compile_check.DEFAULT_THRESHOLD`).
        seed: The cotangent's seed.
        arg_names: Names of the positional inputs, for the report (default: those of
            ``eager``'s forward if it is a module, else ``args[i]``).

    Returns:
        The :class:`CompiledGradientReport` (check ``passed``: it does not raise on a
        difference).

    Raises:
        CompiledGradientError: If the forwards return different outputs.

    Examples:
        >>> report = compare_compiled_gradients(
        ...     block, torch.compile(block), (x,), params=dict(block.named_parameters())
        ... )
        >>> report.passed
        True
    """
    if arg_names is None and isinstance(eager, nn.Module):
        arg_names = positional_names(type(eager).forward)
    buffers = list(eager.buffers()) if isinstance(eager, nn.Module) else []
    # the fp32 reference casts every parameter the module computes with, compared or not
    more = list(eager.parameters()) if isinstance(eager, nn.Module) else []
    comparison = _start(
        eager, args, kwargs or {}, params, block, threshold, seed, arg_names, buffers, more
    )
    return run_compiled(comparison, compiled)
