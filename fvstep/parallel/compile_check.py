"""Compiled gradients checked against eager ones, block by block.

Inductor once computed Wan's gradients ~10^4 times wrong without a word
(pytorch/pytorch#193061: ``triton.mix_order_reduction``): the loss looked healthy and
the run learned the wrong thing. The next such bug will look the same, so fvstep can
compare, once, what a compiled block computes with what its eager forward computes, on
the inputs it is really called with, before any gradient of it reaches a parameter:

- :mod:`fvstep.parallel.gradient_comparison` is the pure comparison
  (:func:`~fvstep.parallel.gradient_comparison.compare_compiled_gradients`): an eager
  and a compiled forward of one block on the same inputs, pulled back with the same fixed
  cotangent, give one :class:`CompiledGradientReport`: a :class:`GradientDifference` per
  parameter and per input that requires grad;
- :mod:`fvstep.parallel.compile_check_hooks` arms a block compiled in place
  (:func:`~fvstep.parallel.compile_check_hooks.install_compile_check`): the first
  grad-enabled call of each ``requires_grad`` pattern runs the comparison on its real
  inputs and raises :class:`CompiledGradientError` (naming the block, the parameter, the
  error and the tolerance) before the block's real forward runs.
  ``prepare(..., verify_compile=True)`` installs it on every compiled block;
  :func:`fvstep.testing.check_compiled_gradients` and ``fvstep verify-compile`` run it
  on a probe;
- this module holds what a check concludes: the tolerances (:data:`DEFAULT_RTOLS`,
  :func:`default_rtol`), :class:`GradientDifference`, :class:`CompiledGradientReport` and
  :class:`CompiledGradientError`.

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
    >>> report.passed, report.rtol == default_rtol(report.precision)
    (True, True)
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = [
    "DEFAULT_RTOLS",
    "GRADIENT_FLOOR",
    "CompiledGradientError",
    "CompiledGradientReport",
    "GradientDifference",
    "default_rtol",
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
