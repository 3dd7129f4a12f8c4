"""Which weights of a role to compute with or export, and the marks of swapped weights.

:func:`select_weights` is the one rule for "the EMA weights"; :func:`holding_other_weights`
marks a module whose parameters hold something else than its live weights, so that a
reader of the live weights (a save, an export) can refuse meanwhile.
"""

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
    """Mark ``module`` as holding other values than its role's live weights (nestable).

    :func:`fvstep.executor.validation.role_module` marks a role's module while its parameters hold
    the EMA; readers of the live weights that would take the EMA for them (a checkpoint
    save, an export) refuse while it is marked (:func:`roles_holding_other_weights`).

    Examples:
        >>> with holding_other_weights(module):
        ...     ...  # module's parameters hold something else
    """
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

    Every reader of "the EMA weights" (validation, sampling, exports, LoRA's merges)
    takes them from here. ``"params"``: the live parameters. ``"ema"``: each trainable
    parameter's moving average once the EMA has started (before its first active update
    the stored copy is stale, so the live parameter); other parameters are live.

    Args:
        role: The role's name (for the error messages).

    Returns:
        Parameter name to tensor (the state's own tensors: do not write into them), for
        every parameter of the role.

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
