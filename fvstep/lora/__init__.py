"""LoRA roles: peft adapters trained over one frozen base, and their exports.

- :func:`add_adapters` / :class:`LoRAModule`: peft LoRA adapters injected into a base;
  one module per adapter, holding only its adapter's parameters, computing the base
  with that adapter active. The base itself (every adapter off) is a frozen role.
- :func:`recompute_context`: activation checkpointing's ``context_fn`` that recomputes
  a block with the adapter it ran with.
- :func:`base_digest`: the digest of a base's weights that a checkpoint records for a
  frozen role saved with ``Role(save_frozen=False)`` (verified on load).
- the formats ``"lora"`` (diffusers' LoRA format) and ``"merged"`` (a merged diffusers
  model) of :func:`fvstep.checkpoint.export`, registered on import; :func:`merge_weights`.

See ``docs/concepts/lora.md``. Needs ``peft`` (``pip install fvstep[lora]``).

Examples:
    >>> lora = add_adapters(base, {"student": config}, seed=0)
    >>> state = fvstep.TrainState.create({
    ...     "base": fvstep.Role(base, save_frozen=False),
    ...     "student": fvstep.Role(lora["student"], optimizer=fvstep.optim.adamw(lr=1e-4)),
    ... }, key=fvstep.random.key(0))
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
