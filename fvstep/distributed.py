"""FSDP2-sharded roles and the gradient-sync policies of accumulation.

Only this module, ``fvstep.checkpoint`` and the executor call ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

from fvstep.accumulation import Accumulation
from fvstep.state import TrainState

__all__ = ["grad_sync_for", "is_sharded"]


def is_sharded(module: Any) -> bool:
    """Whether ``module`` is an FSDP2 root (``fully_shard`` was applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def grad_sync_for(state: TrainState, accumulation: Accumulation) -> Any:
    """The gradient-sync controller for ``state``'s roles, or ``None`` if none is sharded."""
    if not any(is_sharded(rs.role.module) for rs in state.roles.values()):
        return None
    raise NotImplementedError("FSDP2-sharded roles arrive with the distributed issue")
