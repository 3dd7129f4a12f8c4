"""The tensors a role's module holds, and the checks of the tensors a state is made of (private).

A tied tensor is kept once, under its first name (:func:`distinct_tensors`). Storage shared
otherwise (a view of another tensor, between roles, with a non-persistent buffer) would come
back from a checkpoint as independent tensors: ``TrainState.create`` refuses it here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fvstep.core.tree import flatten_with_paths, local_tensor

if TYPE_CHECKING:
    from fvstep.core.state import Role

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _named_buffers(
    module: nn.Module, *, persistent: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's (non-)persistent buffers under every name, in ``state_dict`` order."""
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for buf_name, buf in mod._buffers.items():
            if buf is not None and (buf_name not in mod._non_persistent_buffers_set) == persistent:
                yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf


def distinct_tensors(
    module: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[tuple[str, str], ...]]:
    """The module's distinct params and persistent buffers (first names), and the tied pairs."""
    first_name: dict[int, str] = {}  # id() is safe: the module keeps every tensor alive
    tied: list[tuple[str, str]] = []
    slots: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    named = (module.named_parameters(remove_duplicate=False), _named_buffers(module))
    for distinct, tensors in zip(slots, named, strict=True):
        for name, tensor in tensors:
            canonical = first_name.setdefault(id(tensor), name)
            if canonical == name:
                distinct[name] = tensor
            else:
                tied.append((name, canonical))
    return slots[0], slots[1], tuple(tied)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    local = local_tensor(tensor)
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return str(local.device), local.untyped_storage().data_ptr()


def check_no_partial_aliasing(
    role_name: str, module: nn.Module, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Refuse different tensors of one role that share storage (a checkpoint would untie them)."""
    seen: dict[tuple[str, int], str] = {}
    for name, tensor in tensors.items():
        where = _storage_key(tensor)
        if where is None:
            continue
        other = seen.setdefault(where, name)
        if other != name:
            raise ValueError(
                f"role {role_name!r}: {other!r} and {name!r} are different tensors that share "
                "storage: tie them as one tensor, or .clone() one (see docs/troubleshooting.md)"
            )
    held = {id(t) for t in tensors.values()}
    for name, buf in _named_buffers(module, persistent=False):
        where = _storage_key(buf)
        if where is not None and where in seen:
            how = "is" if id(buf) in held else "shares storage with"
            raise ValueError(
                f"role {role_name!r}: the non-persistent buffer {name!r} {how} {seen[where]!r}: "
                "make it persistent, or recompute it in forward (see docs/troubleshooting.md)"
            )


def check_no_aliasing(roles: Mapping[str, Role]) -> None:
    """Refuse roles that share a module or a parameter's storage."""
    seen_modules: dict[int, tuple[str, str]] = {}
    seen_storage: dict[tuple[str, int], tuple[str, str]] = {}
    for role_name, role in roles.items():
        for mod_name, mod in role.module.named_modules():
            other = seen_modules.get(id(mod))
            if other is not None and other[0] != role_name:
                shared = f"{other[1] or '<root>'!r} / {mod_name or '<root>'!r}"
                raise ValueError(
                    f"roles {other[0]!r} and {role_name!r} share a module ({shared}); give each "
                    "role its own copy (e.g. copy.deepcopy(module))"
                )
            seen_modules.setdefault(id(mod), (role_name, mod_name))
        tensors: list[tuple[str, torch.Tensor]] = [
            *role.module.named_parameters(remove_duplicate=False),
            *role.module.named_buffers(remove_duplicate=False),
        ]
        for t_name, t in tensors:
            where = _storage_key(t)
            if where is None:
                continue
            other = seen_storage.get(where)
            if other is not None and other[0] != role_name:
                raise ValueError(
                    f"roles {other[0]!r} and {role_name!r} share the tensor storage of "
                    f"{other[1]!r} / {t_name!r}; give each role its own copy (copy.deepcopy)"
                )
            seen_storage.setdefault(where, (role_name, t_name))


def resolve_trainable_names(
    name: str, role: Role, params: Mapping[str, torch.Tensor]
) -> tuple[str, ...]:
    """The names of the params with ``requires_grad``; low precision refused unless opted in."""
    assert role.optimizer is not None
    trainable = tuple(n for n, p in params.items() if p.requires_grad)
    if not trainable:
        raise ValueError(f"trainable role {name!r} has no parameter with requires_grad=True")
    low = [n for n in trainable if params[n].dtype in _LOW_PRECISION]
    if low and role.optimizer.needs_fp32_master and not role.allow_low_precision:
        dtype, count = params[low[0]].dtype, f"{len(low)}, e.g. {low[0]!r}"
        raise ValueError(
            f"role {name!r} is trainable with {dtype} parameters ({count}) and its optimizer needs "
            "fp32 master weights: keep them in fp32, or pass Role(..., allow_low_precision=True)"
        )
    return trainable


def check_tensor_leaves(tree: Any, what: str) -> None:
    """Refuse a leaf of ``tree`` (``what``) that is not a tensor."""
    paths, flat, _ = flatten_with_paths(tree)
    for path, leaf in zip(paths, flat, strict=False):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what}.{path} must be a tensor, got {type(leaf).__name__} ({leaf!r}); "
                "state leaves are tensors only (wrap counters as torch.tensor(...))"
            )


def _locate(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


def live_tensors(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    tied: tuple[tuple[str, str], ...],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's params and persistent buffers under every name, if those are the state's."""
    live_params: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    live_buffers = dict(_named_buffers(module))
    if (
        set(live_params) | set(live_buffers) != set(params) | set(buffers) | set(dict(tied))
        or not set(params) <= set(live_params)
        or not set(buffers) <= set(live_buffers)
    ):
        live, mine = sorted(live_params)[:3], sorted(params)[:3]
        raise ValueError(
            f"the module of this role has parameters/buffers {live}..., not the state's "
            f"{mine}...: was the module re-wrapped or changed after TrainState.create?"
        )
    return live_params, live_buffers


def bind_tensors(
    module: nn.Module,
    live_params: Mapping[str, torch.Tensor],
    live: Mapping[str, torch.Tensor],
    mine: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
) -> None:
    """Put the state's tensors (``mine``) into every slot of ``module``, aliases included."""
    for name in live:
        owner, leaf = _locate(module, name)
        slot: dict[str, Any] = owner._parameters if name in live_params else owner._buffers
        slot[leaf] = mine[aliases.get(name, name)]
