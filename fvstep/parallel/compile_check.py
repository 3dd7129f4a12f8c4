"""Compiled gradients checked against eager ones, block by block.

Inductor once computed Wan's gradients ~10^4 times wrong without a word
(pytorch/pytorch#193061), so fvstep can compare, once per compiled graph, a compiled
block's gradients with its eager ones on its real inputs, before any reaches a parameter.
The comparison is :mod:`fvstep.parallel.gradient_comparison`, the hooks that arm a block
:mod:`fvstep.parallel.compile_check_hooks`; this module holds the verdict: the threshold
(:data:`DEFAULT_THRESHOLD`), the floors, :class:`GradientDifference`,
:class:`CompiledGradientReport` and :class:`CompiledGradientError`. The ratios, the fp32
probe and the cost: ``docs/concepts/prepare.md`` (Checking compiled gradients).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from fvstep.core.errors import CompiledGradientError

__all__ = [
    "DEFAULT_THRESHOLD",
    "GRADIENT_FLOOR",
    "ROUNDING_FLOOR",
    "CompiledGradientReport",
    "GradientDifference",
    "compiled_gradient_error",
    "resolve_threshold",
]

#: The largest ratio that passes (the module docstring). Measured at 32,760 tokens on an
#: H200 (``docs/concepts/prepare.md``): a correct compile 0.1 in fp32 and ~1 in bf16 (its
#: error about eager's noise), pytorch/pytorch#193061 ~1e4 in fp32 (and in bf16's fp32
#: probe) and 30–60 against bf16's noise: tenfold margins both ways.
DEFAULT_THRESHOLD = 20.0

#: The least relative rounding noise a gradient is credited with (``‖g_e − g_r‖ / s``
#: below it counts as this): in fp32, where eager is its own reference, it is the noise,
#: and ``DEFAULT_THRESHOLD × ROUNDING_FLOOR`` (1e-3) the relative error allowed; compiled
#: and eager fp32 gradients differ by 1e-7 to 2e-5 (summation order) at 32,760 tokens.
ROUNDING_FLOOR = 1e-5

#: A parameter's gradient is measured against at least this fraction of the block's
#: largest root-mean-square gradient (times the square root of its size). Wan's
#: cross-attention ``attn2.to_k.bias`` has an exact-zero gradient (a bias on every key
#: shifts all logits of a query alike): in fp32 its gradient is rounding noise around 0,
#: which measured against itself would fail any compile.
GRADIENT_FLOOR = 0.1


@attrs.frozen
class GradientDifference:
    """How one tensor's compiled gradient differs from its eager one, against eager's noise.

    Attributes:
        name: The parameter's name in the block (``"scale_shift_table"``), or
            ``"input <name>"`` for an input of the block's forward.
        relative_error: ``‖g_c − g_e‖ / s`` (module docstring): the compiled graph's
            gradient against eager's; ``inf`` or ``nan`` when a gradient is not finite.
        relative_noise: ``‖g_e − g_r‖ / s``: eager's rounding, against its fp32
            reference (0 in fp32, where eager is the reference).
        fp32_relative_error: ``‖g_p − g_r‖ / s``: the block compiled in fp32 (the probe)
            against eager in fp32; ``None`` where no probe ran (the block computes in
            fp32 or TF32).
        eager_norm: ``‖g_e‖``.
        compiled_norm: ``‖g_c‖``.
    """

    name: str
    relative_error: float
    relative_noise: float
    fp32_relative_error: float | None
    eager_norm: float
    compiled_norm: float

    @property
    def noise_is_floor(self) -> bool:
        """Whether the graph's ratio is taken against :data:`ROUNDING_FLOOR` (the measured
        noise is below it, or not finite)."""
        return not (self.relative_noise >= ROUNDING_FLOOR and math.isfinite(self.relative_noise))

    @property
    def graph_ratio(self) -> float:
        """``relative_error / max(relative_noise, ROUNDING_FLOOR)`` (``inf`` if not finite)."""
        noise = ROUNDING_FLOOR if self.noise_is_floor else self.relative_noise
        return _finite_or_inf(self.relative_error / noise)

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

    Attributes:
        block: The block's qualified name (``"blocks.3"``).
        threshold: The largest ratio (:attr:`GradientDifference.ratio`) that passes.
        precision: What the block computed in: ``"fp32"``, ``"tf32"``, ``"bf16"`` or
            ``"fp16"`` (autocast's dtype, else the lowest floating dtype of its
            parameters and inputs); below ``"fp32"`` the noise is measured against an
            eager fp32 reference.
        differences: One per parameter and input that requires grad, in module order.
        seconds: Wall time of the comparison (every forward and backward of it).
        reference_seconds: Wall time of the fp32 reference's forward and backward (0 in
            fp32: none is run).
    """

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
        return tuple(sorted(bad, key=_badness, reverse=True))

    @property
    def passed(self) -> bool:
        """Whether every ratio is within the threshold."""
        return not self.failures

    @property
    def worst(self) -> GradientDifference | None:
        """The largest ratio (``None`` when nothing required grad)."""
        return max(self.differences, key=_badness, default=None)

    @property
    def worst_ratio(self) -> float:
        """The largest ratio (``inf`` when not finite, 0 when nothing required grad)."""
        worst = self.worst
        return 0.0 if worst is None else _badness(worst)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary (for benchmarks and logs): the verdict, the threshold,
        and the worst tensor's ratio, error and noise."""
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


def _badness(d: GradientDifference) -> float:
    return d.ratio


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
        "Training on these gradients would learn the wrong thing. The compiler computed "
        "them (pytorch/pytorch#193061 was one such bug): train without compile, or "
        "compile with other options; if this is rounding, raise the threshold "
        "(prepare(..., verify_compile=<threshold>)). See docs/concepts/prepare.md."
    )
    return CompiledGradientError("\n".join(lines), report)


def resolve_threshold(verify: bool | float) -> float:
    """The threshold that a ``verify_compile`` value asks for: :data:`DEFAULT_THRESHOLD`
    for ``True`` (or ``False``, which checks nothing), else the number itself.

    Raises:
        TypeError: If ``verify`` is neither a bool nor a number.
        ValueError: If it is a number that is not positive and finite.

    Examples:
        >>> resolve_threshold(True), resolve_threshold(30)
        (100.0, 30.0)
    """
    if isinstance(verify, bool):
        return DEFAULT_THRESHOLD
    if not isinstance(verify, (int, float)):
        raise TypeError(f"verify_compile must be a bool or a threshold, not {verify!r}")
    if not (math.isfinite(verify) and verify > 0):
        raise ValueError(f"the compile check's threshold must be positive, not {verify!r}")
    return float(verify)
