"""Activation checkpointing per block: which blocks recompute their activations, and how much.

None, full, every n-th block, or selective (op-level, as torchtitan's). A chosen block
gets an instance ``forward`` that runs the class's under ``checkpoint``: no wrapper
module, so parameter names and checkpoint keys are those of the plain module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = [
    "ATTENTION_SAVE_OPS",
    "DEFAULT_SAVE_OPS",
    "ActivationCheckpointing",
    "CheckpointMode",
    "apply_activation_checkpointing",
    "is_checkpointed",
    "resolve_checkpointing",
]

CheckpointMode = Literal["none", "full", "selective"]
CheckpointName = Literal["none", "full", "selective", "attention", "narrow"]
"""What ``prepare(checkpointing=...)`` takes by name: a mode; ``"attention"`` (selective
checkpointing that keeps only the attention kernels' outputs, :data:`ATTENTION_SAVE_OPS`);
or ``"narrow"`` (selective, keeping attention and the matmuls that do not widen their
input: the feed-forward up-projections are recomputed)."""

_aten = torch.ops.aten


def _aten_ops(*names: str) -> frozenset[Any]:
    """The ATen ops of these names that this torch has."""
    return frozenset(op for name in names if (op := getattr(_aten, name, None)) is not None)


#: The attention kernels only: ``checkpointing="attention"`` keeps their outputs and
#: recomputes the rest of a block. Attention is most of a video block's FLOPs at long
#: sequences but a small part of its activation memory.
ATTENTION_SAVE_OPS: frozenset[Any] = _aten_ops(
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

#: Ops whose outputs selective checkpointing keeps (torchtitan's list, less collectives):
#: matmuls and the attention kernels, whose recomputation costs the most FLOPs.
DEFAULT_SAVE_OPS: frozenset[Any] = ATTENTION_SAVE_OPS | _aten_ops("mm", "addmm", "bmm", "baddbmm")


@attrs.frozen
class ActivationCheckpointing:
    """Which blocks recompute their activations in backward, and how much of them.

    Attributes:
        mode: ``"none"``; ``"full"`` (a block keeps only its inputs); ``"selective"``
            (op-level: the outputs of ``save_ops`` are kept, everything else recomputed).
        every: Checkpoint blocks ``0, every, 2 * every, ...``.
        save_ops: For ``"selective"``: the ATen ops (packets or overloads) whose outputs
            are saved.
        save_widening: For ``"selective"``: whether a matmul that widens its input (a
            feed-forward up-projection) is saved too.

    Raises:
        ValueError: On an unknown mode or ``every < 1``.

    Examples:
        >>> ActivationCheckpointing("full", every=2)      # half the blocks, fully
        >>> ActivationCheckpointing("selective")          # all blocks, matmuls kept
    """

    mode: CheckpointMode = "full"
    every: int = 1
    # A set's order follows its ops' hashes (addresses), which differ between processes:
    # the repr lists them sorted, so that it is the same in every process.
    save_ops: frozenset[Any] = attrs.field(
        default=DEFAULT_SAVE_OPS,
        converter=frozenset,
        repr=lambda ops: "frozenset({" + ", ".join(sorted(map(str, ops))) + "})",
    )
    save_widening: bool = True

    def __attrs_post_init__(self) -> None:
        if self.mode not in ("none", "full", "selective"):
            raise ValueError(
                f"activation checkpointing mode must be 'none', 'full' or 'selective' (or, "
                f"for prepare, 'attention' or 'narrow'), not {self.mode!r}"
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an int >= 1, not {self.every!r}")

    def describe(self) -> str:
        """The name of this choice: a :data:`CheckpointName` or ``"selective (custom ops)"``."""
        if self.mode != "selective":
            return self.mode
        if self.save_ops == DEFAULT_SAVE_OPS:
            return "selective" if self.save_widening else "narrow"
        if self.save_ops == ATTENTION_SAVE_OPS:
            return "attention"
        return "selective (custom ops)"

    def chooses(self, index: int) -> bool:
        """Whether the ``index``-th block is checkpointed."""
        return self.mode != "none" and index % self.every == 0

    def context_fn(self) -> Callable[[], Any] | None:
        """``checkpoint``'s ``context_fn`` for this mode (``None`` for full)."""
        if self.mode != "selective":
            return None
        save, widening = self.save_ops, self.save_widening

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            packet = getattr(op, "overloadpacket", op)
            if (op in save or packet in save) and (widening or not _widens(packet, args)):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return functools.partial(create_selective_checkpoint_contexts, policy)


_MATMUL_OPERANDS = {
    getattr(_aten, name): first
    for name, first in (("mm", 0), ("bmm", 0), ("addmm", 1), ("baddbmm", 1))
}


def _widens(packet: Any, args: tuple[Any, ...]) -> bool:
    """Whether a matmul's output is wider than its inner dimension (``a @ b`` with ``b``
    of shape ``[..., K, N]``, ``N > K``); ``False`` for any other op."""
    first = _MATMUL_OPERANDS.get(packet)
    if first is None or len(args) < first + 2:
        return False
    b = args[first + 1]
    shape = getattr(b, "shape", None)
    return shape is not None and len(shape) >= 2 and shape[-1] > shape[-2]


def resolve_checkpointing(
    value: ActivationCheckpointing | CheckpointName | None,
) -> ActivationCheckpointing:
    """The :class:`ActivationCheckpointing` that ``prepare(..., checkpointing=value)`` means.

    Raises ``TypeError`` on a value of another type, ``ValueError`` on an unknown name."""
    if value is None:
        return ActivationCheckpointing("none")
    if isinstance(value, ActivationCheckpointing):
        return value
    if value == "attention":
        return ActivationCheckpointing("selective", save_ops=ATTENTION_SAVE_OPS)
    if value == "narrow":
        return ActivationCheckpointing("selective", save_widening=False)
    if isinstance(value, str):
        return ActivationCheckpointing(value)
    raise TypeError(
        "checkpointing must be 'none', 'full', 'selective', 'attention' or an "
        f"ActivationCheckpointing, not {type(value).__name__}"
    )


def _checkpointed_forward(
    forward: Callable[..., Any],
    context_fn: Callable[[], Any] | None,
    compiled_context_fn: Callable[[], Any] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    # Compiled, the recomputation runs no Python, so ``checkpoint_context`` has nothing to
    # set back, and torch.compile accepts only selective checkpointing's context_fn.
    if torch.compiler.is_compiling():
        context_fn = compiled_context_fn
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`fvstep.parallel.prepare` gave ``block`` a checkpointed forward."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def apply_activation_checkpointing(
    blocks: Mapping[str, nn.Module],
    ac: ActivationCheckpointing,
    *,
    checkpoint_context: Callable[[Callable[[], Any] | None], Callable[[], Any]] | None = None,
) -> tuple[str, ...]:
    """Checkpoint, in place, the blocks ``ac`` chooses (counted in ``blocks``' order): their names.

    ``checkpoint_context`` wraps an eager recomputation's ``context_fn`` (LoRA's state)."""
    chosen = tuple(name for i, name in enumerate(blocks) if ac.chooses(i))
    for name in chosen:
        block = blocks[name]
        compiled_context_fn = context_fn = ac.context_fn()
        if checkpoint_context is not None:
            context_fn = checkpoint_context(compiled_context_fn)
        # An instance attribute: __call__, compile and FSDP2's hooks see it, while the module
        # tree, and so every parameter name, stays as it was.
        original = type(block).forward.__get__(block)
        block.forward = functools.partial(
            _checkpointed_forward, original, context_fn, compiled_context_fn
        )
    return chosen
