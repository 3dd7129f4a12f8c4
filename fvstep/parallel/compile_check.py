"""Compiled gradients checked against eager ones, block by block, once per compiled graph.

The ratios, the fp32 probe and the cost: ``docs/concepts/prepare.md`` (Checking compiled gradients).
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fvstep.core import random as fsrandom
from fvstep.core.errors import CompiledGradientError
from fvstep.parallel.precision import map_tensors, positional_names
from fvstep.parallel.ranks import max_over_ranks

__all__ = [
    "DEFAULT_THRESHOLD",
    "GRADIENT_FLOOR",
    "ROUNDING_FLOOR",
    "Comparison",
    "CompiledGradientReport",
    "GradientDifference",
    "block_parameters",
    "compare_compiled_gradients",
    "compile_check_reports",
    "compiled_gradient_error",
    "graph_key",
    "install_compile_check",
    "is_compiled_in_place",
    "resolve_threshold",
]

#: The largest ratio that passes: a correct compile is about 1 in bf16 and below it in
#: fp32, a compiler bug far above (measured: ``docs/concepts/prepare.md``).
DEFAULT_THRESHOLD = 20.0

#: The least relative rounding noise a gradient is credited with. In fp32, where eager is
#: its own reference, it is the noise: ``DEFAULT_THRESHOLD × ROUNDING_FLOOR`` is then the
#: relative error allowed.
ROUNDING_FLOOR = 1e-5

#: A parameter's gradient is measured against at least this fraction of the block's
#: largest root-mean-square gradient (times the square root of its size): an exact-zero
#: gradient is not measured against its own noise.
GRADIENT_FLOOR = 0.1


@attrs.frozen
class GradientDifference:
    """How one tensor's compiled gradient differs from its eager one, against eager's noise.

    The numbers are those of ``docs/concepts/prepare.md`` (How the verdict is formed)."""

    name: str
    relative_error: float
    relative_noise: float
    fp32_relative_error: float | None
    eager_norm: float
    compiled_norm: float

    @property
    def noise_is_floor(self) -> bool:
        """Whether the measured noise is below :data:`ROUNDING_FLOOR` (or not finite)."""
        return not (self.relative_noise >= ROUNDING_FLOOR and math.isfinite(self.relative_noise))

    @property
    def graph_ratio(self) -> float:
        """``relative_error / max(relative_noise, ROUNDING_FLOOR)`` (``inf`` if not finite)."""
        return _finite_or_inf(self.relative_error / self._noise)

    @property
    def fp32_ratio(self) -> float:
        """``fp32_relative_error / ROUNDING_FLOOR`` (0 without a probe, ``inf`` if not finite)."""
        if self.fp32_relative_error is None:
            return 0.0
        return _finite_or_inf(self.fp32_relative_error / ROUNDING_FLOOR)

    @property
    def ratio(self) -> float:
        """What the threshold judges: the larger of :attr:`graph_ratio` and :attr:`fp32_ratio`."""
        return max(self.graph_ratio, self.fp32_ratio)

    def describe(self) -> str:
        """One line: name, ratio, error, noise, norms."""
        floor = " (the floor)" if self.noise_is_floor else ""
        probe = ""
        if self.fp32_relative_error is not None:
            probe = f"; in fp32 {self.fp32_ratio:.3g} x (error {self.fp32_relative_error:.3g})"
        return (
            f"{self.name}: {self.graph_ratio:.3g} x eager's rounding noise (relative error "
            f"{self.relative_error:.3g}, noise {self._noise:.3g}{floor}){probe}; eager norm "
            f"{self.eager_norm:.3g}, compiled {self.compiled_norm:.3g}"
        )

    @property
    def _noise(self) -> float:
        return ROUNDING_FLOOR if self.noise_is_floor else self.relative_noise


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


@attrs.frozen
class CompiledGradientReport:
    """One block's compiled gradients against its eager ones, on one input (one graph).

    ``differences``: one per parameter and input that requires grad; ``precision``: fp32, tf32, bf16 or fp16."""

    block: str
    threshold: float
    precision: str
    differences: tuple[GradientDifference, ...]
    seconds: float
    reference_seconds: float = 0.0

    @property
    def failures(self) -> tuple[GradientDifference, ...]:
        """The differences above the threshold (a non-finite one is above it), worst first."""
        bad = [d for d in self.differences if not d.ratio <= self.threshold]
        return tuple(sorted(bad, key=operator.attrgetter("ratio"), reverse=True))

    @property
    def passed(self) -> bool:
        """Whether every ratio is within the threshold."""
        return not self.failures

    @property
    def worst(self) -> GradientDifference | None:
        """The largest ratio (``None`` when nothing required grad)."""
        return max(self.differences, key=operator.attrgetter("ratio"), default=None)

    @property
    def worst_ratio(self) -> float:
        """The largest ratio (``inf`` when not finite, 0 when nothing required grad)."""
        worst = self.worst
        return 0.0 if worst is None else worst.ratio

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary: the verdict, the threshold, the worst tensor's numbers."""
        worst = self.worst
        return {
            "block": self.block,
            "passed": self.passed,
            "threshold": self.threshold,
            "precision": self.precision,
            "worst": worst.name if worst else None,
            "worst_ratio": self.worst_ratio,
            "worst_graph_ratio": worst.graph_ratio if worst else None,
            "worst_fp32_ratio": worst.fp32_ratio if worst else None,
            "worst_relative_error": worst.relative_error if worst else None,
            "worst_relative_noise": worst.relative_noise if worst else None,
            "worst_fp32_relative_error": worst.fp32_relative_error if worst else None,
            "margin": self.threshold / self.worst_ratio if self.worst_ratio else math.inf,
            "tensors": len(self.differences),
            "seconds": self.seconds,
            "reference_seconds": self.reference_seconds,
        }


def compiled_gradient_error(report: CompiledGradientReport) -> CompiledGradientError:
    """The error for a failed report: block, tensors, ratios, threshold, what to do."""
    failures = report.failures
    first = failures[0]
    if first.graph_ratio >= first.fp32_ratio:
        floor = ", the floor" if first.noise_is_floor else ""
        what = (
            f"{first.name} has relative error {first.relative_error:.3g}, "
            f"{first.graph_ratio:.3g} x eager's rounding noise ({first._noise:.3g}{floor})"
        )
    else:
        what = (
            f"{first.name} has relative error {first.fp32_relative_error:.3g} compiled in "
            f"fp32, {first.fp32_ratio:.3g} x the fp32 floor ({ROUNDING_FLOOR:g}; in "
            f"{report.precision}: {first.relative_error:.3g}, {first.graph_ratio:.3g} x "
            f"eager's rounding noise {first._noise:.3g})"
        )
    lines = [
        f"the compiled gradients of {report.block} differ from its eager ones: {what} > "
        f"threshold {report.threshold:g} ({report.precision}; eager norm "
        f"{first.eager_norm:.3g}, compiled {first.compiled_norm:.3g})"
    ]
    if len(failures) > 1:
        shown = "; ".join(d.describe() for d in failures[1:4])
        more = f" and {len(failures) - 4} more" if len(failures) > 4 else ""
        lines.append(f"also above it: {shown}{more}")
    lines.append(
        "Train without compile or with other compile options; if this is rounding, raise "
        "the threshold (prepare(..., verify_compile=<threshold>)). See docs/troubleshooting.md"
    )
    return CompiledGradientError("\n".join(lines), report)


def resolve_threshold(verify: bool | float) -> float:
    """The threshold a ``verify_compile`` value asks for: a bool means :data:`DEFAULT_THRESHOLD`.

    Raises ``TypeError`` on a non-number, ``ValueError`` on a number not positive and finite."""
    if isinstance(verify, bool):
        return DEFAULT_THRESHOLD
    if not isinstance(verify, (int, float)):
        raise TypeError(f"verify_compile must be a bool or a threshold, not {verify!r}")
    if not (math.isfinite(verify) and verify > 0):
        raise ValueError(f"the compile check's threshold must be positive, not {verify!r}")
    return float(verify)


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


def _named_inputs(
    args: Sequence[Any], kwargs: Mapping[str, Any], arg_names: Sequence[str] | None
) -> list[tuple[str, torch.Tensor]]:
    """The tensor leaves of a call's inputs, named by ``arg_names`` (else ``args[i]``) and keywords."""
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
    # Detached clones with the caller's requires_grad and aliasing: the same dynamo guards as
    # the real call, so the compiled run uses training's graph and compiles nothing more.
    memo: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            dtype = torch.float32 if float32 and t.dtype in _LOW else t.dtype
            c = t.detach().to(dtype, copy=True)
            memo[id(t)] = c.requires_grad_(t.requires_grad) if t.is_floating_point() else c
        return memo[id(t)]

    return map_tensors(clone, tuple(args)), map_tensors(clone, dict(kwargs))


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


class _CallerState:
    """The global RNG state and a block's buffers: every run, and the real call, start from them."""

    def __init__(self, buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            self.buffers = [(b, b.detach().clone()) for b in buffers]
        self.cpu = torch.random.get_rng_state()
        devices = {t.device.index for t in tensors if t.is_cuda}
        devices = {torch.cuda.current_device() if d is None else d for d in devices}
        self.cuda = {d: torch.cuda.get_rng_state(d) for d in sorted(devices)}

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        for d, s in self.cuda.items():
            torch.cuda.set_rng_state(s, d)
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)


@contextlib.contextmanager
def _in_float32(tensors: Sequence[torch.Tensor], device_types: Sequence[str]) -> Iterator[None]:
    """Autocast and TF32 off, the bf16/fp16 ``tensors`` holding fp32 copies in ``.data`` (same objects)."""
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
    """One comparison in steps (as :func:`_run_compiled` calls them), each disabled for dynamo.

    Only the compiled forward between the steps runs in a compiled frame."""

    @torch.compiler.disable
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
        self.start = time.perf_counter()
        self.params = [(n, p) for n, p in params.items() if p.requires_grad]
        named_inputs = _named_inputs(args, kwargs, arg_names)
        self.names = [n for n, _ in self.params]
        self.names += [f"input {n}" for n, t in named_inputs if t.requires_grad]
        tensors = [p for _, p in self.params] + [t for _, t in named_inputs]
        self.precision = _precision(list(params.values()), [t for _, t in named_inputs])
        self.threshold = threshold
        self.saved = _CallerState(buffers, tensors)
        self.state = [*params.values(), *buffers, *more_state]  # what the fp32 runs cast
        self.device_types = sorted({"cpu", *(t.device.type for t in (*tensors, *self.state))})
        self.raw_args: Sequence[Any] | None = args
        self.raw_kwargs: Mapping[str, Any] | None = kwargs
        self.fp32 = contextlib.ExitStack()
        # Per tensor, on device: ‖c − e‖, ‖e‖, ‖c‖, ‖e − r‖, ‖p − r‖ (GradientDifference).
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
            self.devices = [t.device for t in targets]
            self.norms["eager"] = self._norms(self.eager)
            if self.precision != "fp32":
                self.reference = self._reference(eager)
                self.norms["noise"] = self._distances(self.eager, self.reference)
        finally:
            self.saved.restore()
        self.args, self.kwargs = _clone_inputs(args, kwargs)
        # A probe only where fp32 is another graph (not TF32: its flags are no guard).
        self.probe = self.precision in ("bf16", "fp16")

    def _run(self, forward: Callable[..., Any], args: Any, kwargs: Any) -> list[torch.Tensor]:
        self.saved.restore()  # every run starts as the real call does (dropout, BatchNorm)
        with torch.compiler.set_stance("force_eager"):  # also inside a compiled caller
            return _grad_outputs(forward(*args, **kwargs))

    def _fp32_inputs(self) -> tuple[Any, Any]:
        return _clone_inputs(self.raw_args or (), self.raw_kwargs or {}, float32=True)

    def _reference(self, eager: Callable[..., Any]) -> list[torch.Tensor | None]:
        """``g_r``: the gradients of an eager run in fp32."""
        start = time.perf_counter()
        args, kwargs = self._fp32_inputs()
        with _in_float32(self.state, self.device_types):
            outputs = self._run(eager, args, kwargs)
            reference = self._pull_back(outputs, args, kwargs, "fp32 reference")
        for device in self.saved.cuda:  # the reference's own time, for the report
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
        inputs = [t for _, t in _named_inputs(args, kwargs, None) if t.requires_grad]
        return [p for _, p in self.params] + inputs

    def _norms(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        return [_norm(g, d) for g, d in zip(grads, self.devices, strict=True)]

    def _distances(
        self, a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        return [_distance(x, y, d) for x, y, d in zip(a, b, self.devices, strict=True)]

    @torch.compiler.disable
    def take_compiled(self, output: Any) -> None:
        """The real graph's gradients: their distances from eager's."""
        compiled = self._pull_back(_grad_outputs(output), self.args, self.kwargs, "compiled")
        del output
        self.norms["error"] = self._distances(compiled, self.eager)
        self.norms["compiled"] = self._norms(compiled)

    @torch.compiler.disable
    def enter_probe(self) -> tuple[Any, Any]:
        """Into fp32 for the probe (until :meth:`take_probe` or :meth:`close`): its inputs."""
        self.saved.restore()
        self.fp32.enter_context(_in_float32(self.state, self.device_types))
        self.args, self.kwargs = self._fp32_inputs()
        return self.args, self.kwargs

    @torch.compiler.disable
    def take_probe(self, output: Any) -> None:
        """The fp32 graph's gradients: their distances from the fp32 reference's."""
        try:
            probe = self._pull_back(_grad_outputs(output), self.args, self.kwargs, "fp32 probe")
            del output
            assert self.reference is not None
            self.norms["probe"] = self._distances(probe, self.reference)
        finally:
            self.fp32.close()

    @torch.compiler.disable
    def report(self) -> CompiledGradientReport:
        differences: tuple[GradientDifference, ...] = ()
        if self.names:
            n = len(self.names)
            zero, nan = torch.zeros(()), torch.full((), math.nan)
            noise = self.norms.get("noise") or [zero] * n  # fp32: eager is the reference
            probe = self.norms.get("probe") or [nan] * n  # no probe
            columns = [self.norms[k] for k in ("error", "eager", "compiled")] + [noise, probe]
            rows = [torch.stack([x.to(row[0].device) for x in row]) for row in zip(*columns)]
            values = torch.stack(rows).cpu().tolist()  # one host sync for the whole block
            differences = self._differences(values)
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

    @torch.compiler.disable
    def close(self) -> None:
        self.fp32.close()
        self.saved.restore()
        self.args = self.kwargs = self.raw_args = self.raw_kwargs = None
        self.eager, self.reference = [], None


def _norm(g: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return torch.zeros((), device=device) if g is None else g.float().norm()


def _distance(a: torch.Tensor | None, b: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """‖a − b‖ in fp32 (a missing gradient is zeros)."""
    if a is None or b is None:
        return _norm(b if a is None else a, device)
    return (a.float() - b.float()).norm()


@torch.compiler.disable(recursive=False)
def _run_compiled(comparison: Comparison, compiled: Callable[..., Any]) -> CompiledGradientReport:
    """``compiled`` on the real inputs, in bf16/fp16 on their fp32 copies too, then the report.

    Skipped by dynamo, not disabled: inside a compiled block's call the forward called
    from here is compiled, with the real call's guards.
    """
    try:
        comparison.take_compiled(compiled(*comparison.args, **comparison.kwargs))
        if comparison.probe:
            args, kwargs = comparison.enter_probe()
            comparison.take_probe(compiled(*args, **kwargs))
        return comparison.report()
    finally:
        comparison.close()


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
    """Compare a block's compiled gradients with its eager ones on one input: the report.

    ``params``: all the block computes with; raises only if the forwards' outputs differ."""
    if arg_names is None and isinstance(eager, nn.Module):
        arg_names = positional_names(type(eager).forward)[1:]  # self
    buffers = list(eager.buffers()) if isinstance(eager, nn.Module) else []
    # the fp32 reference casts every parameter the module computes with, compared or not
    more = list(eager.parameters()) if isinstance(eager, nn.Module) else []
    comparison = Comparison(
        eager, args, kwargs or {}, params, block, threshold, seed, arg_names, buffers, more
    )
    return _run_compiled(comparison, compiled)


def block_parameters(block: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a block computes with, by name: its own, and those of modules held
    as plain attributes (the adapters of :func:`fvstep.methods.lora.add_adapters`)."""
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
    """What dynamo specialises a block's graph on (``dynamic=False``), as one hashable value.

    The tensor inputs' shapes, strides, dtypes, devices and ``requires_grad``, the other
    inputs' values, the parameters' ``requires_grad``, dtypes and shapes, and autocast:
    two calls with the same key run the same compiled graph.
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


class _CompileCheck:
    """The check installed on one compiled block: ``reports``, one per graph, in order."""

    def __init__(
        self, block: nn.Module, name: str, threshold: float, mesh: DeviceMesh | None, seed: int
    ) -> None:
        self.name = name
        self.threshold = threshold
        self.reports: list[CompiledGradientReport] = []
        self._mesh = mesh
        self._seed = seed
        self._checked: set[Hashable] = set()  # the graph keys that passed
        self._arg_names = positional_names(type(block).forward)[1:]
        self._block = weakref.ref(block)
        self._handle = block.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        block.__dict__.setdefault(_CHECKS_ATTR, []).append(self)  # on the block, not global

    def remove(self) -> None:
        """Disarm the check (its reports stay readable here)."""
        self._handle.remove()
        block = self._block()
        if block is not None and self in block.__dict__.get(_CHECKS_ATTR, []):
            block.__dict__[_CHECKS_ATTR].remove(self)

    @torch.compiler.disable
    def _begin(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Comparison, Hashable] | None:
        params = block_parameters(module)  # under FSDP2: gathered, by their names
        key = graph_key(params, args, kwargs)
        if key in self._checked:
            return None
        inputs = [t for _, t in _named_inputs(args, kwargs, None)]
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

    @torch.compiler.disable
    def _conclude(self, report: CompiledGradientReport, key: Hashable) -> None:
        self.reports.append(report)
        worst = report.worst_ratio / report.threshold
        if self._mesh is not None:
            # Agree, so that all ranks raise or none does: a rank raising alone would
            # leave the others waiting in a collective.
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

    # Skipped by dynamo, not disabled: the block's forward it calls is compiled.
    @torch.compiler.disable(recursive=False)
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if not torch.is_grad_enabled():
            return None
        try:
            started = self._begin(module, args, kwargs)
            if started is None:
                return None
            comparison, key = started
            report = _run_compiled(comparison, module.forward)
        except CompiledGradientError:
            raise
        except Exception as error:  # say where it broke: inside the check, not training
            raise RuntimeError(
                f"fvstep's compile check of {self.name} failed inside the check ({type(error).__name__}: "
                f"{error}; torch {torch.__version__}): try without verify_compile; see docs/concepts/prepare.md"
            ) from error
        self._conclude(report, key)
        return None


_CHECKS_ATTR = "_fvstep_compile_checks"  # in the block's __dict__: no registry outside it


def install_compile_check(
    block: nn.Module,
    *,
    name: str,
    threshold: float = DEFAULT_THRESHOLD,
    mesh: DeviceMesh | None = None,
    seed: int = 0,
) -> _CompileCheck:
    """Check a block compiled in place on the first grad-enabled call of each of its graphs.

    A failing call raises ``CompiledGradientError`` on every rank of ``mesh``; no compile: ``ValueError``."""
    if not is_compiled_in_place(block):
        raise ValueError(
            f"{name} is not compiled in place (block.compile()): nothing to check; for a "
            "separately compiled callable use compare_compiled_gradients"
        )
    return _CompileCheck(block, name, threshold, mesh, seed)


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
