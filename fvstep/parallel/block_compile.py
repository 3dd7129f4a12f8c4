"""``torch.compile`` per block: the options, the recompile limit, and what dynamo compiled.

Each block is compiled in place (``block.compile()``, no ``_orig_mod``: parameter names
do not change) with ``fullgraph=True, dynamic=False`` and, under Inductor,
:data:`SAFE_INDUCTOR_OPTIONS`. Why compiles stay bounded: ``docs/concepts/prepare.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from fvstep.core import _compat as torch_compat

__all__ = [
    "RECOMPILE_LIMIT",
    "SAFE_INDUCTOR_OPTIONS",
    "apply_compile",
    "compile_counts",
    "resolve_compile_options",
]

#: Inductor options every prepared block is compiled with (unless the caller overrides them).
#: ``triton.mix_order_reduction`` computes wrong gradients for Wan's ``scale_shift_table``
#: at long sequences (pytorch/pytorch#193061, ``docs/concepts/prepare.md``).
SAFE_INDUCTOR_OPTIONS: dict[str, Any] = {"triton.mix_order_reduction": False}


#: The least recompile limit (``torch._dynamo.config.recompile_limit``, default 8) that
#: :func:`fvstep.parallel.prepare` sets when it compiles: the blocks of every role share
#: one code object, and each (role, grad mode, input ``requires_grad``) that reaches a
#: block is a graph of it (DMD2 over a LoRA base: 7).
RECOMPILE_LIMIT = 64


def resolve_compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``block.compile`` arguments of ``prepare(..., compile=compile)``; ``None`` for ``False``.

    Inductor's ``options`` start from :data:`SAFE_INDUCTOR_OPTIONS`. ``TypeError`` on a non-mapping."""
    if compile is False:
        return None
    if compile is not True and not isinstance(compile, Mapping):
        raise TypeError(f"compile must be a bool or torch.compile options, not {compile!r}")
    kwargs: dict[str, Any] = {"fullgraph": True, "dynamic": False}
    if isinstance(compile, Mapping):
        kwargs.update(compile)
    if kwargs.get("backend", "inductor") == "inductor":
        known = {
            k: v for k, v in SAFE_INDUCTOR_OPTIONS.items() if torch_compat.inductor_has_option(k)
        }
        # torch.compile takes a mode or options, not both: a mode becomes its options, so
        # that no mode can bring back the pass SAFE_INDUCTOR_OPTIONS turns off.
        mode = kwargs.pop("mode", None)
        by_mode = torch_compat.inductor_mode_options(mode) if mode is not None else {}
        kwargs["options"] = {**by_mode, **known, **dict(kwargs.get("options") or {})}
    return kwargs


def apply_compile(blocks: Iterable[nn.Module], options: Mapping[str, Any]) -> None:
    """Compile each block in place, dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT`."""
    torch_compat.raise_recompile_limit(RECOMPILE_LIMIT)
    for block in blocks:
        block.compile(**options)


def compile_counts() -> dict[str, int]:
    """What dynamo compiled in this process so far (graphs, graph breaks): compare two calls.

    Examples:
        >>> before = compile_counts()
        >>> state, metrics = step(state, batch)
        >>> compile_counts()["graphs"] - before["graphs"]
        3
    """
    counters = torch_compat.dynamo_counters()
    return {
        "graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters.get("graph_break", {}).values())),
    }
