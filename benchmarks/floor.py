"""The step-time floor, from the kernels measured on the machine the benchmark runs on.

A Wan transformer's forward of one sample is, at the real shape, almost all attention and
matmuls. The **floor** of a step is what those kernels alone cost, measured here, one
after the other, with no recomputation (activation checkpointing), no overlap loss and
free element-wise ops (norms, modulation, rotary, GELU are not counted):

- **attention**: ``scaled_dot_product_attention`` at the model's shape (batch 1, its
  heads and head dimension, ``T`` video tokens; self-attention ``T x T`` and
  cross-attention ``T x L`` text tokens), bf16 on CUDA, timed forward and forward +
  backward under every SDPA backend that runs (cuDNN, Flash, memory-efficient); the
  fastest is used. Times the number of layers.
- **matmuls**: for every distinct ``(tokens, in, out)`` linear layer of the model (the
  patch embedding as a linear map per token), the forward ``x @ W^T`` and the backward's
  two GEMMs (``dX = dY @ W``, ``dW = dY^T @ X``), each timed, times how many layers have
  that shape.

A step's floor counts its model calls as the benchmark's call counter sees them
(:class:`Calls`): a call without grad costs one forward; a call under grad whose weights
train costs the attention forward and backward plus the three GEMMs of each linear; a
call under grad whose weights are frozen (the gradient flows to its input only, as the
teacher's in DMD2's student loss would, or a LoRA base) costs the attention forward and
backward plus two GEMMs (forward and ``dX``). A call on ``f`` of the ``F`` frames (a causal
chunk) counts as ``f / F`` of a call (its attention to a KV cache is not counted).

Examples:
    $ python -m benchmarks.floor --preset wan-1.3b-480p --device cuda
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from benchmarks import common as c
from benchmarks.analytic import _tokens_of
from benchmarks.presets import PRESETS, Preset, build_model

__all__ = [
    "CallCounter",
    "Calls",
    "KernelTimes",
    "build_parser",
    "floor_seconds",
    "main",
    "measure_kernels",
]


@attrs.frozen
class Calls:
    """A step's model calls, in samples (a call on ``B`` samples counts ``B``)."""

    no_grad: float = 0.0
    frozen: float = 0.0
    trained: float = 0.0

    @property
    def forwards(self) -> float:
        """Forward-equivalents as MFU counts them: 1, 2 and 3 a call."""
        return self.no_grad + 2 * self.frozen + 3 * self.trained


@attrs.frozen
class KernelTimes:
    """Seconds per sample of one model forward's kernels, measured (see the module docstring)."""

    attention_forward: float
    attention_forward_backward: float
    linear_forward: float
    linear_input_grad: float
    linear_weight_grad: float
    attention_backend: str
    attention_tflops: float
    """Self-attention forward + backward, TFLOP/s (backward = 2.5 x forward, FlashAttention's count)."""
    linear_tflops: float
    """All the matmuls of a forward, TFLOP/s."""


def floor_seconds(calls: Calls, kernels: KernelTimes) -> float:
    """The floor of a step with these calls (see the module docstring)."""
    k = kernels
    forward = k.attention_forward + k.linear_forward
    frozen = k.attention_forward_backward + k.linear_forward + k.linear_input_grad
    trained = frozen + k.linear_weight_grad
    return calls.no_grad * forward + calls.frozen * frozen + calls.trained * trained


def _samples_of(output: Any) -> int:
    first = output[0] if isinstance(output, (tuple, list)) else output
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1


class CallCounter:
    """A step's model calls (:class:`Calls`), counted by forward hooks on the roles' modules.

    A call on ``B`` samples counts ``B``; one whose output has fewer frames than ``frames``
    (a causal chunk) counts that share. A LoRA role's call runs its base's forward inside
    it: that inner call is not counted again, and the LoRA call counts as a frozen one (the
    base's weights get no gradient; the adapters' own FLOPs are not counted).
    """

    def __init__(self, modules: dict[str, nn.Module], frames: int) -> None:
        from fvstep.methods.lora import LoRAModule

        self._lora = LoRAModule
        self.frames = frames
        self.counts = [0.0, 0.0, 0.0]  # no grad, frozen, trained
        self.inside_lora = 0
        self.handles = []
        for m in modules.values():
            if isinstance(m, LoRAModule):
                self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._hook))

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.inside_lora += 1

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        lora = isinstance(module, self._lora)
        if lora:
            self.inside_lora -= 1
        elif self.inside_lora:
            return  # the base, called by a LoRA role: counted there
        samples: float = _samples_of(output)
        first = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(first, torch.Tensor) and first.dim() == 5:
            samples *= first.shape[2] / self.frames
        if not torch.is_grad_enabled():
            self.counts[0] += samples
        elif not lora and any(p.requires_grad for p in module.parameters()):
            self.counts[2] += samples
        else:
            self.counts[1] += samples

    def take(self) -> Calls:
        """The calls since the last ``take``; resets the count."""
        calls, self.counts = Calls(*self.counts), [0.0, 0.0, 0.0]
        return calls

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (kernel selection, allocator)
    fn()
    return statistics.median(c.time_call(fn, device)[0] for _ in range(repeats))


def _backends(device: torch.device) -> list[tuple[str, Any]]:
    if device.type != "cuda":
        return [("default", None)]
    from torch.nn.attention import SDPBackend

    return [
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]


def _attention(
    heads: int, dim: int, queries: int, keys: int, device: torch.device, dtype: torch.dtype,
    backend: Any, repeats: int,
) -> tuple[float, float]:  # fmt: skip
    from torch.nn.attention import sdpa_kernel

    def tensor(n: int) -> torch.Tensor:
        return torch.randn(1, heads, n, dim, device=device, dtype=dtype, requires_grad=True)

    q, k, v = tensor(queries), tensor(keys), tensor(keys)
    grad = torch.randn_like(q)
    scope = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with scope:

        def forward() -> None:
            with torch.no_grad():
                sdpa(q, k, v)

        def both() -> None:
            out = sdpa(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad)

        return _median_seconds(forward, device, repeats), _median_seconds(both, device, repeats)


def _linear_shapes(module: nn.Module, preset: Preset) -> collections.Counter:
    shapes: collections.Counter = collections.Counter()
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Linear, nn.Conv3d)):
            weight = mod.weight
            tokens = _tokens_of(name, preset.num_tokens, preset.text_len)
            shapes[(tokens, weight[0].numel(), weight.shape[0])] += 1
    return shapes


def _gemms(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype, repeats: int):
    tokens, fan_in, fan_out = shape
    x = torch.randn(tokens, fan_in, device=device, dtype=dtype)
    w = torch.randn(fan_out, fan_in, device=device, dtype=dtype)
    dy = torch.randn(tokens, fan_out, device=device, dtype=dtype)
    return (
        _median_seconds(lambda: x @ w.t(), device, repeats),
        _median_seconds(lambda: dy @ w, device, repeats),
        _median_seconds(lambda: dy.t() @ x, device, repeats),
    )


def measure_kernels(preset: Preset, device: torch.device, *, repeats: int = 5) -> KernelTimes:
    """Time the attention and matmul kernels of one forward of ``preset``'s model, here.

    bf16 on CUDA, fp32 elsewhere. Returns seconds per sample (module docstring).
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = preset.config
    heads, dim, layers = cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["num_layers"]
    tokens, text = preset.num_tokens, preset.text_len
    best: tuple[float, float, float, float, str] | None = None
    for name, backend in _backends(device):
        try:
            self_f, self_fb = _attention(
                heads, dim, tokens, tokens, device, dtype, backend, repeats
            )
            cross_f, cross_fb = _attention(
                heads, dim, tokens, text, device, dtype, backend, repeats
            )
        except RuntimeError:  # this backend does not run this shape here
            continue
        if best is None or self_fb + cross_fb < best[1] + best[3]:
            best = (self_f, self_fb, cross_f, cross_fb, name)
    if best is None:
        raise RuntimeError("no scaled_dot_product_attention backend ran at this shape")
    self_f, self_fb, cross_f, cross_fb, backend_name = best
    module = build_model(preset, device=torch.device("meta"))
    totals = [0.0, 0.0, 0.0]
    flops = 0.0
    for shape, count in _linear_shapes(module, preset).items():
        flops += 2.0 * shape[0] * shape[1] * shape[2] * count
        for i, seconds in enumerate(_gemms(shape, device, dtype, repeats)):
            totals[i] += count * seconds
    attention_flops = 4.0 * tokens * tokens * heads * dim * 3.5
    return KernelTimes(
        attention_forward=layers * (self_f + cross_f),
        attention_forward_backward=layers * (self_fb + cross_fb),
        linear_forward=totals[0],
        linear_input_grad=totals[1],
        linear_weight_grad=totals[2],
        attention_backend=backend_name,
        attention_tflops=attention_flops / self_fb / 1e12,
        linear_tflops=flops / totals[0] / 1e12,
    )


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.floor",
        description="Measure attention and matmul kernels; print the floor of each kind of step.",
    )
    parser.add_argument("--preset", choices=tuple(PRESETS), default="wan-1.3b-480p")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per kernel")
    return parser


STEPS = {
    "fine-tune": Calls(trained=1),
    "DMD2 critic-only": Calls(no_grad=1, trained=1),
    "DMD2 student+critic": Calls(no_grad=3, trained=2),
}
"""Issue-level reference steps: DMD2's student rollout without grad, teacher cond + uncond
and the critic's forward for the student's loss without grad, critic and student trained."""


def main(argv: list[str] | None = None) -> int:
    """Print the measured kernels and the floors of :data:`STEPS`."""
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    kernels = measure_kernels(PRESETS[args.preset], torch.device(args.device), repeats=args.repeats)
    print(f"# {args.preset} on {args.device}: {kernels}")
    rows = [[name, f"{floor_seconds(calls, kernels):.3f}"] for name, calls in STEPS.items()]
    c.print_table(["step", "floor s"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
