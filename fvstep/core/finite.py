"""The errors of ``sanitize="error"``, reached only when a unit's non-finite verdict failed:
the first non-finite loss (role, micro-batch) or gradient (role, parameter), and where."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn

import torch

from fvstep.core.errors import NonFiniteGradientError
from fvstep.core.tree import any_dtensor, local_tensor

if TYPE_CHECKING:
    from fvstep.core.engine import Group

__all__ = ["raise_non_finite"]

_AFTER = (
    "No leaf was changed and no .grad is left; to train through such updates, pass "
    "sanitize='skip' or 'nan_to_num' (see docs/troubleshooting.md)."
)


def raise_non_finite(
    step: int,
    unit: str,
    roles: tuple[str, ...],
    loss_log: Mapping[str, list[torch.Tensor]],
    groups: list[Group],
    verdict: list[float],
) -> NoReturn:
    """Raise the ``NonFiniteGradientError`` of ``verdict`` (``[non-finite losses over ranks,
    each measured group's norm]``)."""
    where = f"step {step}, unit {unit!r}"
    if verdict[0] != 0:
        _raise_for_loss(step, unit, roles, loss_log, where)
    sharded = any_dtensor(p for g in groups for p in g.params)
    measured = [g for g in groups if g.full_norm is not None]
    for group, norm in zip(measured, verdict[1:]):
        if math.isfinite(norm):
            continue
        label = "+".join(group.names)
        for role, params in zip(group.names, group.params_by_role):
            found = _first_non_finite({n: p.grad for n, p in params.items() if p.grad is not None})
            if found is None:
                continue
            name, kind = found
            shard = " (in this rank's shard)" if sharded else ""
            raise NonFiniteGradientError(
                f"{where}, role {role!r}: the gradient of parameter {name!r} has {kind} entries"
                f"{shard} (gradient norm {norm}), with a finite loss. {_AFTER}",
                step=step,
                unit=unit,
                role=role,
                parameter=name,
                kind=kind,
            )
        if sharded:
            raise NonFiniteGradientError(
                f"{where}, role {label!r}: the global gradient norm is {norm}, but this rank's "
                f"shards are finite: the entries are on another rank (or it overflowed). {_AFTER}",
                step=step,
                unit=unit,
                role=label,
            )
        raise NonFiniteGradientError(
            f"{where}, role {label!r}: every gradient entry is finite but their norm overflowed "
            f"to {norm} (scale the loss down). {_AFTER}",
            step=step,
            unit=unit,
            role=label,
            kind="Inf",
        )
    raise AssertionError(f"{where}: a failed verdict {verdict} with nothing non-finite")


def _first_non_finite(named: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """The first ``(name, "NaN" | "Inf")`` of ``named`` (local shards; a host sync per tensor)."""
    for name, x in named.items():
        local = local_tensor(x).detach()
        if not bool(torch.isfinite(local).all()):
            return name, "NaN" if bool(torch.isnan(local).any()) else "Inf"
    return None


def _raise_for_loss(
    step: int,
    unit: str,
    roles: tuple[str, ...],
    loss_log: Mapping[str, list[torch.Tensor]],
    where: str,
) -> NoReturn:
    num = len(next(iter(loss_log.values())))
    for m in range(num):
        for role in roles:
            value = float(local_tensor(loss_log[role][m]))
            if not math.isfinite(value):
                kind = "NaN" if math.isnan(value) else "Inf"
                raise NonFiniteGradientError(
                    f"{where}: the loss of role {role!r} is {value} ({kind}) at micro-batch "
                    f"{m} of {num}: check that micro-batch's data and the loss. {_AFTER}",
                    step=step,
                    unit=unit,
                    role=role,
                    microbatch=m,
                    kind=kind,
                )
    raise NonFiniteGradientError(
        f"{where}: a loss was not finite on another rank (that rank's error names the role "
        f"and micro-batch); this rank's losses are finite. {_AFTER}",
        step=step,
        unit=unit,
    )
