"""Which weights of a role to compute with or export (:func:`select_weights`, the one rule
for "the EMA weights"), and the marks of swapped weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from fvstep.core.state import RoleState

__all__ = ["Weights", "holding_other_weights", "roles_holding_other_weights", "select_weights"]

Weights = Literal["params", "ema"]
"""Which weights of a role to compute with or export: the live ones or the EMA."""


_OTHER_WEIGHTS = "_fvstep_other_weights"


@contextlib.contextmanager
def holding_other_weights(module: nn.Module) -> Iterator[None]:
    """Mark ``module`` as holding other values than its role's live weights (nestable), e.g.
    while validation swaps in the EMA: a save or an export refuses it meanwhile."""
    module.__dict__[_OTHER_WEIGHTS] = module.__dict__.get(_OTHER_WEIGHTS, 0) + 1
    try:
        yield
    finally:
        module.__dict__[_OTHER_WEIGHTS] -= 1


def roles_holding_other_weights(state: Any) -> list[str]:
    """The roles of ``state`` whose modules hold other values than their live weights now."""
    roles = getattr(state, "roles", None)
    if not isinstance(roles, Mapping):
        return []
    return [
        name for name, rs in roles.items() if rs.role.module.__dict__.get(_OTHER_WEIGHTS, 0) > 0
    ]


def select_weights(
    role_state: RoleState, weights: Weights, *, role: str
) -> dict[str, torch.Tensor]:
    """The tensors that stand for a role's parameters under ``weights``: the one rule.

    ``"params"``: the live parameters. ``"ema"``: each trainable parameter's moving average
    once the EMA has started (before, the stored copy is stale: the live parameter); other
    parameters are live.

    Returns:
        Every parameter of the role by name (the state's own tensors: do not write into them).

    Raises:
        ValueError: For an unknown ``weights``, or ``"ema"`` for a role without an EMA.

    Examples:
        >>> sources = select_weights(state.role("student"), "ema", role="student")
    """
    if weights not in ("params", "ema"):
        raise ValueError(f"weights must be 'params' or 'ema', got {weights!r}")
    if weights == "params":
        return dict(role_state.params)
    ema = role_state.ema
    if ema is None:
        raise ValueError(
            f"weights='ema' but role {role!r} has no EMA; configure one with "
            "Role(..., ema=fvstep.EMA(decay)) or use weights='params'"
        )
    if not bool(ema.initialized):
        return dict(role_state.params)
    return {name: ema.params.get(name, param) for name, param in role_state.params.items()}
