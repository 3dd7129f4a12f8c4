"""Linear layers whose bias gradient is a matrix-vector product, not a fused reduction.

A step of :func:`fvstep.parallel.prepare` (``prepare(gemm_bias_grads=True)``). The bias
gradient of ``y = x @ W.T + b`` is the column sum of ``dL/dy`` over every token. Under
Inductor that sum is fused into the kernel that makes ``dL/dy`` (for Wan's feed-forward,
GELU's backward) as a column reduction over 32,760 rows, which ran at about a third of
the H200's memory bandwidth: the largest of the step's element-wise kernels
(``docs/benchmarks.md``, "Where the rest of the step goes"). Here the bias gradient is
``dL/dy.T @ ones``, one cuBLAS matrix-vector product, and the kernel before it is plain
element-wise work.

**What changes.** The forward is the plain layer's, bit for bit (the same ``F.linear``
call, with autocast's casts made explicitly). The input and weight gradients are the
matmuls autograd's own linear backward runs, in the same orientation: bitwise in eager.
The bias gradient is the same sum in another order (a matrix-vector product accumulates
in fp32 as the reduction does), so it differs in the last bits. Parameter names, and so
checkpoint keys, do not change: each chosen ``nn.Linear`` gets an instance ``forward``.

Examples:
    >>> apply_gemm_bias_grads({"blocks.0": block})
    ('blocks.0.attn1.to_q', ...)
    >>> has_gemm_bias_grads(block.attn1.to_q)
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["apply_gemm_bias_grads", "gemm_bias_linear", "has_gemm_bias_grads"]


class _GemmBiasLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes the bias gradient as a matrix-vector product."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        dtype: torch.dtype | None,
    ) -> torch.Tensor:
        # autocast's casts, made here: what is saved is what plain autocast saves (the
        # cast copies), and the gradients go back to the inputs' dtypes through the
        # engine's cast, as through autocast's. (No autocast context in the backward:
        # dynamo, tracing one there, left autocast off for the rest of the block.)
        if dtype is not None:
            x, weight, bias = (_cast(t, dtype) for t in (x, weight, bias))
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = gb = None
        # The orientations of autograd's addmm backward (mm_mat1_backward and
        # mm_mat2_backward): a column-major input's gradient is made column-major.
        if ctx.needs_input_grad[0]:
            if x2.stride(0) == 1 and x2.stride(1) == x2.shape[0]:
                gx = weight.t().mm(g.t()).t().reshape(x.shape)
            else:
                gx = g.mm(weight).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = g.t().mm(x2)  # the weight's transpose is column-major
        if ctx.needs_input_grad[2]:
            gb = g.t().mm(g.new_ones((g.shape[0], 1))).view(-1)
        return gx, gw, gb, None


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # autocast casts floating inputs other than float64 to its dtype; so do we.
    if t.is_floating_point() and t.dtype not in (dtype, torch.float64):
        return t.to(dtype)
    return t


def gemm_bias_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, its bias gradient computed as ``grad.T @ ones``.

    Under autocast the inputs are cast as autocast casts them for ``F.linear``, so the
    output is bitwise the plain call's. The input and weight gradients are autograd's
    own matmuls; the bias gradient is the same column sum in another order.

    Examples:
        >>> y = gemm_bias_linear(x, layer.weight, layer.bias)
    """
    out: torch.Tensor = _GemmBiasLinear.apply(x, weight, bias, _autocast_dtype(x))
    return out


def _forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return gemm_bias_linear(x, layer.weight, layer.bias)


def has_gemm_bias_grads(layer: nn.Module) -> bool:
    """Whether :func:`apply_gemm_bias_grads` gave ``layer`` its forward."""
    return getattr(layer.__dict__.get("forward"), "__func__", None) is _forward


def apply_gemm_bias_grads(blocks: Mapping[str, nn.Module]) -> tuple[str, ...]:
    """Give every ``nn.Linear`` with a bias inside ``blocks`` a matrix-vector bias gradient.

    Each such layer (peft's LoRA base layers too; adapters have no bias) gets an instance
    ``forward`` calling :func:`gemm_bias_linear`; nothing is renamed. A subclass of
    ``nn.Linear`` with its own ``forward`` is left alone, and so is a layer given one
    already.

    Args:
        blocks: Qualified block name -> block (``prepare``'s blocks).

    Returns:
        The qualified names of the layers changed, in module order.

    Examples:
        >>> apply_gemm_bias_grads({"blocks.0": block})[:1]
        ('blocks.0.attn1.to_q',)
    """
    changed: list[str] = []
    for block_name, block in blocks.items():
        for name, layer in block.named_modules():
            if (
                type(layer).forward is not nn.Linear.forward
                or not isinstance(layer, nn.Linear)
                or layer.bias is None
                or "forward" in layer.__dict__
            ):
                continue
            layer.forward = _forward.__get__(layer)  # type: ignore[method-assign]
            changed.append(f"{block_name}.{name}" if name else block_name)
    return tuple(changed)
