"""LoRA roles over one frozen base: peft's adapters, one module per adapter.

The base, every adapter disabled, is a frozen role; each :class:`LoRAModule` registers only
its adapter's parameters and calls the base with that adapter active. The design:
``docs/concepts/lora.md``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fvstep.core._optional import needs_extra
from fvstep.core.tree import any_dtensor

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["LoRAModule", "add_adapters", "lora_layers", "recompute_context"]

# peft's per-adapter containers of a LoRA layer (LoraLayer.adapter_layer_names) and its
# dropout modules: moved out of the base's module tree, registered in the LoRA modules.
_ADAPTER_ATTRS = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "lora_dropout",
)


def lora_layers(base: nn.Module) -> list[tuple[str, Any]]:
    """The peft LoRA layers of ``base``, as ``(qualified name, layer)`` in module order."""
    with needs_extra("lora", "LoRA roles"):
        from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in base.named_modules() if isinstance(m, LoraLayer)]


def _container(root: nn.Module, path: str) -> nn.Module:
    """The submodule of ``root`` at ``path``, made of empty modules where missing."""
    node = root
    for part in path.split("."):
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node


class LoRAModule(nn.Module):
    """One LoRA adapter over a shared base: a role's module (see :func:`add_adapters`).

    Its parameters are the adapter's only, named as in peft's state dict
    (``blocks.0.attn1.to_q.lora_A.weight``); the base is held but not registered (it is
    its own role). Its ``forward`` is the base's, computed with this adapter active.
    """

    base: nn.Module
    adapter: str

    def __init__(self, base: nn.Module, adapter: str, config: LoraConfig) -> None:
        super().__init__()
        self.__dict__["base"] = base  # not a submodule: the base is its own (frozen) role
        self.adapter = adapter
        self.config = config
        layers = []
        for path, layer in lora_layers(base):
            held = [(a, layer.__dict__.get(a)) for a in _ADAPTER_ATTRS]
            held = [(a, h) for a, h in held if h is not None and adapter in h]
            if not held:
                continue
            layers.append(layer)
            node = _container(self, path)
            for attr, holder in held:
                item = holder[adapter]
                if isinstance(item, nn.Parameter):
                    node.register_parameter(attr, item)
                else:
                    node.add_module(attr, item)
        if not layers:
            raise ValueError(
                f"the base holds no adapter {adapter!r}: no module matched its target_modules "
                f"{sorted(config.target_modules or [])}"
            )
        self.__dict__["_layers"] = tuple(layers)

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """A context in which the base computes with this adapter; yields the base."""
        layers = self.__dict__["_layers"]
        with _flags_set(layers, [(self.adapter, False)] * len(layers)):
            yield self.base

    @property
    def forward_signature(self) -> inspect.Signature:
        """The base's ``forward`` signature, by which :func:`fvstep.parallel.prepare` names
        positional arguments."""
        return inspect.signature(self.base.forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base's forward with this adapter active.

        Raises:
            ValueError: If this module is a role of a ``TrainState`` but its base is not.
        """
        if "_fvstep_bound" in self.__dict__ and "_fvstep_bound" not in self.base.__dict__:
            raise ValueError(
                f"the LoRA adapter {self.adapter!r} is a role of a TrainState, but its base is not: add the "
                "base as a frozen role, e.g. fvstep.Role(base, save_frozen=False). See docs/concepts/lora.md"
            )
        with self.active() as base:
            return base(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"adapter={self.adapter!r}, base={type(self.base).__name__}"


@contextlib.contextmanager
def _flags_set(
    layers: tuple[Any, ...],
    flags: list[tuple[Any, bool]],
    inner: Any = None,
) -> Iterator[None]:
    """Each layer's active adapter and disabled flag (not peft's ``set_adapter``) inside ``inner``."""
    saved = [(layer._active_adapter, layer._disable_adapters) for layer in layers]
    for layer, (name, disabled) in zip(layers, flags):
        layer._active_adapter = name
        layer._disable_adapters = disabled
    try:
        with contextlib.nullcontext() if inner is None else inner:
            yield
    finally:
        for layer, (name, disabled) in zip(layers, saved):
            layer._active_adapter = name
            layer._disable_adapters = disabled


def recompute_context(
    base: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None = None
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that recomputes with the same adapter.

    Args:
        base: The base module that :func:`add_adapters` injected adapters into.
        context_fn: Another ``context_fn`` whose two contexts are entered too.

    Returns:
        ``() -> (forward_context, recompute_context)``, for
        ``checkpoint(fn, ..., use_reentrant=False, context_fn=...)``.

    Examples:
        >>> ctx = recompute_context(base)
        >>> out = checkpoint(block, x, use_reentrant=False, context_fn=ctx)
    """
    layers = tuple(layer for _, layer in lora_layers(base))

    def make() -> tuple[Any, Any]:
        flags = [(layer._active_adapter, layer._disable_adapters) for layer in layers]
        forward, recompute = (
            context_fn() if context_fn else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return forward, _flags_set(layers, flags, recompute)

    return make


def add_adapters(
    base: nn.Module, configs: Mapping[str, LoraConfig], *, seed: int = 0
) -> dict[str, LoRAModule]:
    """Inject peft LoRA adapters into ``base`` (in place); one :class:`LoRAModule` each.

    The adapters move out of the base's module tree into their :class:`LoRAModule`, every
    adapter is disabled, the base is frozen and the adapters trainable. Move the base and
    its LoRA modules to a device together (``base.to`` does not move adapters).

    Args:
        base: The base model, not sharded.
        configs: Adapter name (an identifier) to its ``peft.LoraConfig``.
        seed: Seeds the adapters' initialisation (the global RNG is left untouched).

    Returns:
        Adapter name to its :class:`LoRAModule`.

    Raises:
        ImportError: If peft is not installed (``pip install fvstep[lora]``).
        ValueError: For a name that is not an identifier or already an adapter of
            ``base``, a sharded ``base``, no configs, or a config that matches no module.

    Examples:
        >>> config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k"])
        >>> lora = add_adapters(transformer, {"student": config}, seed=0)
    """
    with needs_extra("lora", "LoRA roles"):
        from peft import inject_adapter_in_model

    if not configs:
        raise ValueError("add_adapters needs at least one adapter config")
    if any_dtensor(base.parameters()):
        raise ValueError("add adapters before sharding the base (fully_shard)")
    existing = {a for _, layer in lora_layers(base) for a in layer.__dict__.get("lora_A", {})}
    for name in configs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"adapter names must be identifiers, got {name!r}")
        if name in existing:
            raise ValueError(f"the base already has an adapter {name!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, config in configs.items():
            with warnings.catch_warnings():
                # several adapters in one model is the intent here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                inject_adapter_in_model(config, base, adapter_name=name)
            for _, layer in lora_layers(base):
                for attr in _ADAPTER_ATTRS:
                    holder = layer._modules.pop(attr, None)
                    if holder is not None:
                        layer.__dict__[attr] = holder
    base.requires_grad_(False)
    for _, layer in lora_layers(base):
        layer._disable_adapters = True
    # fvstep.parallel.prepare checkpoints the base's blocks with this context when it is
    # given none: a recomputed block runs with the adapter its forward ran with.
    base.__dict__["_fvstep_checkpoint_context"] = functools.partial(recompute_context, base)
    modules = {name: LoRAModule(base, name, config) for name, config in configs.items()}
    for module in modules.values():
        module.requires_grad_(True)
    return modules
