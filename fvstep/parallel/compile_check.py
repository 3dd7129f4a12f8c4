"""Compiled gradients checked against eager ones, block by block (DESIGN point 18).

Inductor once computed Wan's gradients ~10^4 times wrong without a word
(pytorch/pytorch#193061: ``triton.mix_order_reduction``): the loss looked healthy and
the run learned the wrong thing. The next such bug will look the same, so fvstep can
compare, once, what a compiled block computes with what its eager forward computes, on
the inputs it is really called with, before any gradient of it reaches a parameter:

- :func:`compare_compiled_gradients` is the pure comparison: an eager and a compiled
  forward of one block, run on detached clones of the same inputs from the same RNG state,
  pulled back with the same fixed cotangent (drawn from a seeded generator, never the
  global RNG) by ``torch.autograd.grad`` (so no ``.grad`` is written and no backward hook
  of FSDP2 fires), give one :class:`CompiledGradientReport`: a
  :class:`GradientDifference` per parameter and per input that requires grad;
- :func:`install_compile_check` arms a block compiled in place (``block.compile()``, as
  :func:`fvstep.parallel.prepare` compiles): the first grad-enabled call of each
  ``requires_grad`` pattern (each its own compiled graph) runs the comparison on its real
  inputs, inside the block's call, where FSDP2 has gathered the parameters, and raises
  :class:`CompiledGradientError` (naming the block, the parameter, the error and the
  tolerance) before the block's real forward runs. ``prepare(..., verify_compile=True)``
  installs it on every compiled block; :func:`fvstep.testing.check_compiled_gradients`
  and ``fvstep verify-compile`` run it on a probe.

**Cost**: one eager and one compiled forward and backward of each block, once per pattern;
no compile (the compiled run uses, and fills, the graph the real call then uses), no
collective but one all-reduce of one number per block on a mesh (so that every rank
raises, or none: a rank that raised alone would leave the others waiting).

**Tolerance** (:data:`DEFAULT_RTOLS`): compiled and eager differ by rounding only,
~1e-6 to 1e-5 relative in fp32 and up to ~3e-2 under bf16 autocast at 32,760 tokens
(docs/gpu_runs/compile_mix_order_fix_32k.json), while the bug was 1e2 to 1e4. The
defaults, 1e-3 in fp32 (a hundred times the rounding), 1e-2 with TF32 matmuls and 0.1 in
bf16/fp16 (three times the largest difference measured), are all a thousand times below
the bug.

**Relative error**: ``‖g_c − g_e‖ / max(‖g_e‖, floor)`` per tensor, in fp32. For a
parameter the floor is ``GRADIENT_FLOOR · √n · R`` (``n`` its elements, ``R`` the largest
root-mean-square eager gradient of the block's parameters): a gradient far below the
block's scale (rounding noise around an exact zero) is measured against that scale
rather than against itself.

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
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fvstep import random as fsrandom
from fvstep.parallel.ranks import max_over_ranks

__all__ = [
    "DEFAULT_RTOLS",
    "GRADIENT_FLOOR",
    "CompileCheck",
    "CompiledGradientError",
    "CompiledGradientReport",
    "GradientDifference",
    "block_parameters",
    "compare_compiled_gradients",
    "compile_check_reports",
    "default_rtol",
    "install_compile_check",
    "is_compiled_in_place",
    "resolve_rtol",
]

#: Default relative tolerances by the precision a block computes in (see the module
#: docstring): ~100x the rounding difference of compiled and eager code, ~1000x below
#: the error of pytorch/pytorch#193061.
DEFAULT_RTOLS: dict[str, float] = {"fp32": 1e-3, "tf32": 1e-2, "bf16": 0.1, "fp16": 0.1}

#: A parameter's gradient is measured against at least this fraction of the block's
#: largest root-mean-square gradient (times the square root of its size). Wan's
#: cross-attention ``attn2.to_k.bias`` has an exact-zero gradient (a bias on every key
#: shifts all logits of a query alike): at 32,760 tokens in bf16 it is rounding noise of
#: norm 17 whose eager and compiled draws differ by 15 %, and measured against itself it
#: failed a correct compile; against 10 % of the block's scale it is 4e-2.
GRADIENT_FLOOR = 0.1

_TINY = torch.finfo(torch.float32).tiny


@attrs.frozen
class GradientDifference:
    """How one tensor's compiled gradient differs from its eager one.

    Attributes:
        name: The parameter's name in the block (``"scale_shift_table"``), or
            ``"input <name>"`` for an input of the block's forward.
        relative_error: ``‖g_c − g_e‖ / max(‖g_e‖, floor)`` (module docstring); ``inf``
            or ``nan`` when a gradient is not finite.
        eager_norm: ``‖g_e‖``.
        compiled_norm: ``‖g_c‖``.
    """

    name: str
    relative_error: float
    eager_norm: float
    compiled_norm: float

    def describe(self) -> str:
        """One line: name, relative error, norms."""
        return (
            f"{self.name}: relative error {self.relative_error:.3g} "
            f"(eager norm {self.eager_norm:.3g}, compiled {self.compiled_norm:.3g})"
        )


@attrs.frozen
class CompiledGradientReport:
    """One block's compiled gradients against its eager ones, on one input.

    Attributes:
        block: The block's qualified name (``"blocks.3"``).
        rtol: The tolerance the relative errors are held to.
        precision: What the block computed in: ``"fp32"``, ``"tf32"``, ``"bf16"`` or
            ``"fp16"`` (autocast's dtype, else the lowest floating dtype of its
            parameters and inputs).
        differences: One per parameter and input that requires grad, in module order.
        seconds: Wall time of the comparison (both forwards and backwards).
    """

    block: str
    rtol: float
    precision: str
    differences: tuple[GradientDifference, ...]
    seconds: float

    @property
    def failures(self) -> tuple[GradientDifference, ...]:
        """The differences above the tolerance (a non-finite one is above it), worst first."""
        bad = [d for d in self.differences if not d.relative_error <= self.rtol]
        return tuple(sorted(bad, key=_badness, reverse=True))

    @property
    def passed(self) -> bool:
        """Whether every relative error is within the tolerance."""
        return not self.failures

    @property
    def worst(self) -> GradientDifference | None:
        """The largest relative error (``None`` when nothing required grad)."""
        return max(self.differences, key=_badness, default=None)

    @property
    def worst_ratio(self) -> float:
        """The worst relative error over the tolerance (``inf`` when not finite)."""
        worst = self.worst
        if worst is None:
            return 0.0
        return _badness(worst) / self.rtol

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary (for benchmarks and logs)."""
        worst = self.worst
        return {
            "block": self.block,
            "passed": self.passed,
            "rtol": self.rtol,
            "precision": self.precision,
            "worst": worst.name if worst else None,
            "worst_relative_error": worst.relative_error if worst else None,
            "tensors": len(self.differences),
            "seconds": self.seconds,
        }


def _badness(d: GradientDifference) -> float:
    return d.relative_error if math.isfinite(d.relative_error) else math.inf


class CompiledGradientError(ValueError):
    """A compiled block's gradients differ from its eager ones beyond the tolerance.

    Attributes:
        report: The failing block's report (``None`` on a rank whose own comparison
            passed while another rank's failed).
    """

    def __init__(self, message: str, report: CompiledGradientReport | None = None) -> None:
        super().__init__(message)
        self.report = report

    @classmethod
    def from_report(cls, report: CompiledGradientReport) -> CompiledGradientError:
        """The error for a failed report: block, parameters, errors, tolerance, what to do."""
        failures = report.failures
        lines = [
            f"the compiled gradients of {report.block} differ from its eager ones: "
            f"{failures[0].name} has relative error {failures[0].relative_error:.3g} > "
            f"tolerance {report.rtol:g} ({report.precision}; eager norm "
            f"{failures[0].eager_norm:.3g}, compiled {failures[0].compiled_norm:.3g})"
        ]
        if len(failures) > 1:
            shown = "; ".join(d.describe() for d in failures[1:4])
            more = f" and {len(failures) - 4} more" if len(failures) > 4 else ""
            lines.append(f"also above it: {shown}{more}")
        lines.append(
            "Training on these gradients would learn the wrong thing. The compiler computed "
            "them (pytorch/pytorch#193061 was one such bug): train without compile, or "
            "compile with other options; if this is rounding, raise the tolerance "
            "(prepare(..., verify_compile=<rtol>)). See docs/concepts/prepare.md."
        )
        return cls("\n".join(lines), report)


def default_rtol(precision: str) -> float:
    """The default tolerance for a block computing in ``precision`` (:data:`DEFAULT_RTOLS`).

    Raises:
        ValueError: On an unknown precision.

    Examples:
        >>> default_rtol("bf16")
        0.1
    """
    if precision not in DEFAULT_RTOLS:
        raise ValueError(f"precision must be one of {sorted(DEFAULT_RTOLS)}, not {precision!r}")
    return DEFAULT_RTOLS[precision]


def resolve_rtol(verify: bool | float) -> float | None:
    """The tolerance that a ``verify_compile`` value asks for: ``None`` for the default by
    precision (``True``), the number itself (a positive float), or ``False``'s ``None``.

    Raises:
        TypeError: If ``verify`` is neither a bool nor a number.
        ValueError: If it is a number that is not positive and finite.
    """
    if isinstance(verify, bool):
        return None
    if not isinstance(verify, (int, float)):
        raise TypeError(f"verify_compile must be a bool or a tolerance, not {verify!r}")
    if not (math.isfinite(verify) and verify > 0):
        raise ValueError(f"the compile check's tolerance must be positive, not {verify!r}")
    return float(verify)


# ------------------------------------------------------------------- the comparison


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


# ------------------------------------------------------------------- installed checks


def _positional_names(forward: Callable[..., Any]) -> list[str]:
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]  # self
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


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


_Pattern = tuple[tuple[bool, ...], tuple[bool, ...]]


class CompileCheck:
    """The check installed on one compiled block (:func:`install_compile_check`).

    Attributes:
        name: The block's qualified name.
        rtol: The tolerance (``None``: by precision).
        reports: The reports of the comparisons it ran, in order.
    """

    def __init__(
        self, block: nn.Module, name: str, rtol: float | None, mesh: DeviceMesh | None, seed: int
    ) -> None:
        self.name = name
        self.rtol = rtol
        self.reports: list[CompiledGradientReport] = []
        self._mesh = mesh
        self._seed = seed
        self._checked: set[_Pattern] = set()
        self._arg_names = _positional_names(type(block).forward)
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
    ) -> tuple[_Comparison, _Pattern] | None:
        params = block_parameters(module)  # under FSDP2: gathered, by their names
        inputs = [t for _, t in _input_names(args, kwargs, None)]
        pattern = (
            tuple(p.requires_grad for p in params.values()),
            tuple(t.requires_grad for t in inputs),
        )
        if pattern in self._checked or not (any(pattern[0]) or any(pattern[1])):
            return None
        comparison = _Comparison(
            module.forward,
            args,
            kwargs,
            params,
            self.name,
            self.rtol,
            self._seed,
            self._arg_names,
            list(module.buffers()),
        )
        return comparison, pattern

    def _conclude(self, report: CompiledGradientReport, pattern: _Pattern) -> None:
        self.reports.append(report)
        worst = report.worst_ratio
        if self._mesh is not None:
            # Every rank of the mesh gets here in the same call (FSDP2 runs the blocks in
            # lock-step, each pattern first in the same unit): agree, so that all raise or
            # none does. A rank raising alone would leave the others in a collective.
            for dim in range(self._mesh.ndim):
                worst = max_over_ranks([worst], group=self._mesh.get_group(dim))[0]
        if worst <= 1.0:
            self._checked.add(pattern)
            return
        if not report.passed:
            raise CompiledGradientError.from_report(report)
        mine = report.worst.describe() if report.worst else "none"
        raise CompiledGradientError(
            f"the compiled gradients of {self.name} differ from its eager ones on another "
            f"rank (up to {worst:.3g} x the tolerance; this rank's worst: {mine}): that "
            "rank's error names the parameter. See docs/concepts/prepare.md."
        )

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # dynamo compiles every frame called from here (this one is skipped): the steps of
        # the comparison are disabled, and only the block's forward, between them, is
        # compiled, with the guards of the real call: the graph training then runs.
        if not torch.is_grad_enabled():
            return None
        try:
            started = _begin(self, module, args, kwargs)
            if started is None:
                return None
            comparison, pattern = started
            try:
                output = module.forward(*comparison.args, **comparison.kwargs)
                report = _finish(comparison, output)
            finally:
                _close(comparison)
        except CompiledGradientError:
            raise
        except Exception as error:  # say where it broke: inside the check, not training
            raise _check_failed(self.name, error) from error
        _conclude(self, report, pattern)
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
    rtol: float | None = None,
    mesh: DeviceMesh | None = None,
    seed: int = 0,
) -> CompileCheck:
    """Check a block compiled in place on its first grad-enabled call of each pattern.

    A forward pre-hook: when grad mode is on and some parameter or input requires grad,
    and this ``requires_grad`` pattern (one compiled graph) was not checked yet, it runs
    :func:`compare_compiled_gradients` on the call's real inputs (inside the call, where
    FSDP2 has gathered the parameters) and raises :class:`CompiledGradientError` before
    the real forward runs if the compiled gradients differ. Otherwise the real call runs
    as it would have: same RNG state, same compiled graph (the check compiled it, with the
    real call's guards). A pattern that failed is checked again on its next call, so
    training cannot go on past it.

    Args:
        block: A module compiled in place (``block.compile(...)``).
        name: Its qualified name, for the error.
        rtol: The tolerance (default: by precision, :data:`DEFAULT_RTOLS`).
        mesh: The FSDP2 mesh the block is sharded over: the verdict is agreed over it
            (one all-reduce of one number per check), so that every rank raises or none.
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
    return CompileCheck(block, name, rtol, mesh, seed)


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called (``nn.Module.compile`` compiles in place)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_check_reports(module: nn.Module) -> list[CompiledGradientReport]:
    """The reports of the checks installed on ``module`` and its submodules so far.

    Examples:
        >>> student = prepare(student, compile=True, verify_compile=True)
        >>> state, metrics = step(state, batch)
        >>> [r.describe()["worst_relative_error"] for r in compile_check_reports(student)]
    """
    return [
        r for m in module.modules() for c in m.__dict__.get(_CHECKS_ATTR, []) for r in c.reports
    ]
