"""LoRA roles: peft adapters trained over one frozen base, and their exports.

:func:`add_adapters` injects peft adapters into a base and returns one
:class:`LoRAModule` role per adapter; the base, every adapter off, is a frozen role.
Importing this package registers the export formats ``"lora"`` and ``"merged"``
(:mod:`fvstep.lora.export`). See ``docs/concepts/lora.md``; needs ``fvstep[lora]``.
"""

from fvstep.lora.adapters import (
    LoRAModule,
    add_adapters,
    base_digest,
    lora_layers,
    recompute_context,
)
from fvstep.lora.export import MERGED_DTYPE, merge_weights

__all__ = [
    "MERGED_DTYPE",
    "LoRAModule",
    "add_adapters",
    "base_digest",
    "lora_layers",
    "merge_weights",
    "recompute_context",
]
