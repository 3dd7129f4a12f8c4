"""Checks a model must pass before it runs context parallel (private to ``context``).

The attention backends its processors use must support context parallelism, and the
forward signatures of the modules in its ``_cp_plan`` must take the arguments the plan
shards, so that a mismatch is refused when the model is prepared, not in the first step.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from fvstep.core._optional import needs_extra


def _attention_backends(module: nn.Module) -> set[str]:
    """The attention backend names of ``module``'s attention processors (diffusers)."""
    with needs_extra("models", "context parallelism"):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    names = set()
    for sub in module.modules():
        processor = getattr(sub, "processor", None)
        if processor is None or not hasattr(processor, "_parallel_config"):
            continue
        backend = getattr(processor, "_attention_backend", None)
        if backend is None:
            backend, _ = _AttentionBackendRegistry.get_active_backend()
        names.add(str(getattr(backend, "value", backend)))
    return names


def check_backends(module: nn.Module, mode: str) -> None:
    """Refuse attention backends of ``module`` that diffusers cannot run context parallel (``mode``)."""
    with needs_extra("models", "context parallelism"):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backends = _attention_backends(module)
    unsupported = sorted(
        b for b in backends if b not in _AttentionBackendRegistry._supports_context_parallel
    )
    if unsupported:
        raise ValueError(
            f"the attention backend(s) {unsupported} of {type(module).__name__} do not support context "
            f"parallelism: call module.set_attention_backend(...) with one of {sorted(_AttentionBackendRegistry._supports_context_parallel)}"
        )
    if mode == "ring" and "native" in backends:
        # diffusers' ring attention merges per-chunk outputs with their log-sum-exp, which
        # its native (SDPA) backend does not return: it would fail at the first forward.
        raise ValueError(
            "mode='ring' needs an attention backend that returns the log-sum-exp (CUDA only, not 'native'): "
            "use mode='ulysses', or module.set_attention_backend(...) first. See docs/concepts/context-parallel.md"
        )


def forward_params(sub: nn.Module) -> list[str]:
    """The parameter names of ``sub``'s class ``forward``, ``self`` left out."""
    return list(inspect.signature(type(sub).forward).parameters)[1:]


def check_plan_signatures(module: nn.Module, plan: dict[str, Any]) -> None:
    """Refuse a module whose planned submodules no longer take their inputs by name (a
    wrapper module such as torch's ``checkpoint_wrapper``, or ``torch.compile(module)``)."""
    with needs_extra("models", "context parallelism"):
        from diffusers.models._modeling_parallel import ContextParallelInput

    for name, entry in plan.items():
        if not isinstance(entry, dict):
            continue
        sub = module.get_submodule(name) if name else module
        params = forward_params(sub)
        for key, spec in entry.items():
            splits_input = not (isinstance(spec, ContextParallelInput) and spec.split_output)
            if isinstance(key, str) and splits_input and key not in params:
                raise ValueError(
                    f"submodule {name or '<root>'!r} ({type(sub).__name__}) takes no argument {key!r} that the plan "
                    "splits: apply context parallel before wrapping blocks in modules (docs/concepts/context-parallel.md)"
                )
