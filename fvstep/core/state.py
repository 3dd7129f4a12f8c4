"""The training state: roles, their parameters, optimizer state and EMA, the step and the key.

``TrainState`` is a frozen attrs pytree whose leaves are tensors (the modules' live
parameters and persistent buffers, optimizer state, EMA, step, key, method-owned
``extra``); modules and hyper-parameters are static, so the leaves' optree paths are the
checkpoint keys. Tied tensors: ``docs/concepts/state.md``; consumption:
``docs/concepts/purity.md``. The checks of the tensors a state is made of are here too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from fvstep.core import random as fsrandom
from fvstep.core.errors import ConsumedStateError
from fvstep.core.optim import Optimizer
from fvstep.core.tree import any_dtensor, field, flatten_with_paths, frozen, local_tensor, replace

__all__ = [
    "EMA",
    "EMAState",
    "Role",
    "RoleState",
    "TrainState",
    "adopt",
    "is_consumed",
    "mark_consumed",
]


@attrs.frozen
class EMA:
    """Exponential moving average of a role's trainable parameters (static configuration).

    After each optimizer update of the role at global step ``>= start_step``:
    ``ema = decay * ema + (1 - decay) * param``, held in fp32 (``decay`` in ``[0, 1)``). The
    first active update re-initialises the average from the live weights.
    """

    decay: float = attrs.field(default=0.999)
    start_step: int = 0

    @decay.validator
    def _check_decay(self, _: attrs.Attribute, value: float) -> None:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {value}")


@attrs.frozen(eq=False)
class Role:
    """A role of a training method: a module, and how (or whether) it is trained.

    Attributes:
        optimizer: A functional optimizer (``fvstep.optim.adamw(...)``); ``None``: frozen.
        trainable: Defaults to ``optimizer is not None`` (and must agree with it).
        allow_low_precision: Opt in to bf16/fp16 trainable parameters with an optimizer
            that needs fp32 master weights (updates smaller than an ulp are lost).
        allow_no_sync: Opt in to the ``no_sync`` accumulation policy for this role
            (it holds a full unsharded gradient between micro-batches).
        save_frozen: Whether a checkpoint holds this role's frozen parameters; ``False``
            (a large teacher, LoRA's base): only their digest, checked on load.

    Raises:
        ValueError: For an inconsistent combination of ``optimizer``, ``trainable``, ``ema``.

    Examples:
        >>> Role(student, optimizer=fvstep.optim.adamw(lr=1e-4), ema=EMA(0.999))
    """

    module: nn.Module
    optimizer: Optimizer | None = None
    trainable: bool | None = None
    ema: EMA | None = None
    allow_low_precision: bool = False
    allow_no_sync: bool = False
    save_frozen: bool = True

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"Role.module must be an nn.Module, got {type(self.module).__name__}")
        if self.trainable is None:
            object.__setattr__(self, "trainable", self.optimizer is not None)
        if self.trainable and self.optimizer is None:
            raise ValueError("a trainable role needs an optimizer (Role(module, optimizer=...))")
        if not self.trainable and self.optimizer is not None:
            raise ValueError(
                "an optimizer was given for a frozen role (trainable=False); "
                "drop the optimizer or make the role trainable"
            )
        if self.ema is not None and not self.trainable:
            raise ValueError("an EMA needs a trainable role")


@frozen
class EMAState:
    """The fp32 moving average of a role's trainable parameters (``initialized``: 0-d bool,
    false until the first active update)."""

    params: dict[str, torch.Tensor]
    initialized: torch.Tensor


@frozen
class RoleState:
    """One role's leaves and its static description.

    Attributes:
        params: Every parameter of the module, by qualified name (the live tensors).
        buffers: The module's persistent buffers, by qualified name.
        opt_state: The optimizer's state (``None`` for a frozen role).
        tied: ``(alias, canonical)`` pairs of tied tensors: only the canonical name is a
            leaf (``docs/concepts/state.md``).
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    ema: EMAState | None
    role: Role = field(pytree_node=False)
    trainable_names: tuple[str, ...] = field(pytree_node=False, default=())
    tied: tuple[tuple[str, str], ...] = field(pytree_node=False, default=())

    @property
    def module(self) -> nn.Module:
        """The role's module, bound to this state's tensors."""
        return adopt(self).role.module

    def trainable_params(self) -> dict[str, torch.Tensor]:
        """The parameters the optimizer updates, by name."""
        return {n: self.params[n] for n in self.trainable_names}


@attrs.define
class _Lease:
    """Who consumed the state: mutable, not part of the pytree."""

    consumed_by: str | None = None


_USE_RETURNED = "use the returned state, or fvstep.tree.clone(state) before the step."
_GUARDED = frozenset({"step", "key", "roles", "extra", "module", "role", "replace"})


@frozen
class TrainState:
    """Every bit a step reads: step counter, RNG key, roles and method-owned state.

    Build one with :meth:`create`.

    Attributes:
        step: 0-d int64 CPU tensor, the number of steps taken.
        key: The base RNG key; steps fold the step counter in.
        extra: Method-owned state (any pytree of tensors; e.g. a stream's cache).
    """

    step: torch.Tensor
    key: torch.Tensor
    roles: dict[str, RoleState]
    extra: dict[str, Any] = attrs.field(factory=dict)
    _lease: _Lease = field(init=False, pytree_node=False, factory=_Lease, eq=False, repr=False)

    def __getattribute__(self, name: str) -> Any:
        if name in _GUARDED:
            lease = object.__getattribute__(self, "_lease")
            if lease.consumed_by is not None:
                raise ConsumedStateError(
                    f"TrainState.{name} was read after the state was consumed by "
                    f"{lease.consumed_by}: {_USE_RETURNED}"
                )
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        lease = object.__getattribute__(self, "_lease")
        if lease.consumed_by is not None:
            return f"TrainState(<consumed by {lease.consumed_by}>)"
        roles = ", ".join(self.roles)
        return f"TrainState(step={int(self.step)}, roles=[{roles}], extra={list(self.extra)})"

    @classmethod
    def create(
        cls,
        roles: Mapping[str, Role],
        *,
        key: torch.Tensor,
        extra: Mapping[str, Any] | None = None,
    ) -> TrainState:
        """Build the initial state from roles and a key.

        Trainable roles get their optimizer state allocated eagerly (and an fp32 EMA if
        configured); frozen roles have ``requires_grad`` turned off.

        Args:
            key: The base key (``fvstep.random.key(seed)``).
            extra: Method-owned initial state: a pytree whose leaves are tensors.

        Raises:
            ValueError: If ``roles`` is empty, two roles share a module or a parameter,
                two tensors of one role share storage without being one tensor, or a
                trainable role has bf16/fp16 parameters and an optimizer that needs fp32
                master weights without ``allow_low_precision=True``.
            TypeError: If a role is not a :class:`Role`, the key is not a key, or a
                leaf of ``extra`` is not a tensor.

        Examples:
            >>> state = TrainState.create(
            ...     {"student": Role(net, optimizer=fvstep.optim.adamw(lr=1e-4))},
            ...     key=fvstep.random.key(0),
            ... )
        """
        if not roles:
            raise ValueError("TrainState.create needs at least one role")
        for name, role in roles.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"role names must be identifiers, got {name!r}")
            if not isinstance(role, Role):
                raise TypeError(f"role {name!r} must be a fvstep.Role, got {type(role).__name__}")
        if not fsrandom.is_key(key):
            raise TypeError("key must be an fvstep key: use fvstep.random.key(seed)")
        _check_no_aliasing(roles)
        extra = dict(extra or {})
        paths, leaves, _ = flatten_with_paths(extra)
        for path, leaf in zip(paths, leaves, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"extra.{path} must be a tensor, got {type(leaf).__name__} ({leaf!r}); "
                    "state leaves are tensors only (wrap counters as torch.tensor(...))"
                )
        role_states = {name: _create_role_state(name, role) for name, role in roles.items()}
        return cls(
            step=torch.zeros((), dtype=torch.int64),
            key=key.clone(),
            roles=role_states,
            extra=extra,
        )

    def module(self, name: str) -> nn.Module:
        """The module of role ``name`` (a ``KeyError`` if none), bound to this state's tensors."""
        return adopt(self.role(name)).role.module

    def role(self, name: str) -> RoleState:
        """The :class:`RoleState` of role ``name`` (a ``KeyError`` naming the roles if none)."""
        try:
            return self.roles[name]
        except KeyError:
            raise KeyError(f"no role {name!r}; the state has roles {sorted(self.roles)}") from None

    def replace(self, **changes: Any) -> TrainState:
        """A new state with ``changes`` applied (``attrs.evolve``), not consumed."""
        return attrs.evolve(self, **changes)  # type: ignore[misc]


def mark_consumed(state: TrainState, by: str) -> None:
    """Mark ``state`` consumed by ``by``: a later read of its fields raises
    :class:`ConsumedStateError` naming ``by``, as does this, if it was already consumed."""
    lease = object.__getattribute__(state, "_lease")
    if lease.consumed_by is not None:
        raise ConsumedStateError(
            f"this TrainState was already consumed by {lease.consumed_by}; "
            "a state can be used by one step only (clone it to run it twice)"
        )
    lease.consumed_by = by


def is_consumed(state: TrainState) -> bool:
    """Whether ``state`` has been consumed by a step."""
    return object.__getattribute__(state, "_lease").consumed_by is not None


def _create_role_state(name: str, role: Role) -> RoleState:
    module = role.module
    params, buffers, tied = _distinct_tensors(module)
    _check_no_partial_aliasing(name, module, {**params, **buffers})
    if role.trainable:
        assert role.optimizer is not None
        trainable = _resolve_trainable_names(name, role, params)
        trainable_params = {n: params[n] for n in trainable}
        opt_state = role.optimizer.init(trainable_params)
        # update relies on this one structure check
        role.optimizer.check_state(trainable_params, opt_state)
        ema = None
        if role.ema is not None:
            ema = EMAState(
                params={
                    n: p.detach().to(torch.float32, copy=True) for n, p in trainable_params.items()
                },
                initialized=torch.zeros((), dtype=torch.bool),
            )
    else:
        for p in params.values():
            p.requires_grad_(False)
        trainable, opt_state, ema = (), None, None
    state = RoleState(
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        ema=ema,
        role=role,
        trainable_names=trainable,
        tied=tied,
    )
    module.__dict__["_fvstep_bound"] = (params, buffers)
    return state


def adopt(role_state: RoleState) -> RoleState:
    """Make the role's module compute with ``role_state``'s values; return the role state
    whose tensors are the ones the module now holds.

    Plain tensors are put into the module's slots (aliases included). DTensor parameters
    cannot be swapped: their values are copied into the live shards, so another state
    holding those shards sees the copy (run steps on one lineage at a time).

    Raises:
        ValueError: If the module's parameter or buffer names no longer match the state's,
            or a sharded module no longer holds one tensor under tied names.

    Examples:
        >>> snapshot = fvstep.tree.clone(state)
        >>> module = adopt(snapshot.role("student")).role.module  # computes with the copy
    """
    module = role_state.role.module
    bound = module.__dict__.get("_fvstep_bound")
    if bound is not None and bound[0] is role_state.params and bound[1] is role_state.buffers:
        return role_state
    live_params, live_buffers = _live_tensors(
        module, role_state.params, role_state.buffers, role_state.tied
    )
    mine = {**role_state.params, **role_state.buffers}
    live = {**live_params, **live_buffers}
    if any_dtensor(live_params.values()):
        for alias, canonical in role_state.tied:
            if live[alias] is not live[canonical]:
                raise ValueError(
                    f"the sharded module holds different tensors under the tied {canonical!r} "
                    f"and {alias!r}: was the module re-wrapped or the tie broken after create?"
                )
        with torch.no_grad():
            for name, tensor in mine.items():
                if tensor is not live[name]:
                    live[name].copy_(tensor)
        role_state = replace(
            role_state,
            params={n: live_params[n] for n in role_state.params},
            buffers={n: live_buffers[n] for n in role_state.buffers},
        )
    else:
        _bind_tensors(module, live_params, live, mine, dict(role_state.tied))
    module.__dict__["_fvstep_bound"] = (role_state.params, role_state.buffers)
    return role_state


# The tensors a role's module holds. A tied tensor is kept once, under its first name; storage
# shared otherwise (a view, between roles, with a non-persistent buffer) would come back from
# a checkpoint as independent tensors: TrainState.create refuses it.

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _named_buffers(
    module: nn.Module, *, persistent: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's (non-)persistent buffers under every name, in ``state_dict`` order."""
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for buf_name, buf in mod._buffers.items():
            if buf is not None and (buf_name not in mod._non_persistent_buffers_set) == persistent:
                yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf


def _distinct_tensors(
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


def _check_no_partial_aliasing(
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


def _check_no_aliasing(roles: Mapping[str, Role]) -> None:
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


def _resolve_trainable_names(
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


def _live_tensors(
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


def _bind_tensors(
    module: nn.Module,
    live_params: Mapping[str, torch.Tensor],
    live: Mapping[str, torch.Tensor],
    mine: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
) -> None:
    """Put the state's tensors (``mine``) into every slot of ``module``, aliases included."""
    for name in live:
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        slot: dict[str, Any] = owner._parameters if name in live_params else owner._buffers
        slot[leaf] = mine[aliases.get(name, name)]
