"""The FSDP2 gradient-sync policy of accumulation, and FSDP2 modules returned to rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from torch import nn
from torch.distributed.fsdp import FSDPModule

from fvstep.core._compat import fsdp_lazy_init, is_fsdp_root
from fvstep.core.accumulation import Accumulation
from fvstep.core.state import RoleState, TrainState
from fvstep.parallel.mesh import is_sharded

__all__ = [
    "FSDPGradSync",
    "release_modules",
    "unrested_modules",
]


class FSDPGradSync:
    """Applies an accumulation policy to the FSDP2 roots of the roles one unit trains.

    Which switch each policy flips, and :meth:`end`'s restore: ``docs/concepts/sync-policies.md``."""

    def __init__(self, accumulation: Accumulation) -> None:
        self.accumulation = accumulation
        self.roots: list[FSDPModule] = []
        self.num_microbatches = 1

    def release(self, state: TrainState, *, after_error: bool = False) -> None:
        """Reshard every FSDP2 group of every role of ``state`` (see :func:`release_modules`)."""
        release_modules(state, after_error=after_error)

    def begin(self, roles: Sequence[RoleState], num_microbatches: int) -> None:
        """Collect the sharded roots and check the per-role opt-ins."""
        self.num_microbatches = num_microbatches
        self.roots = []
        for rs in roles:
            module = rs.role.module
            if not is_sharded(module):
                continue
            if (
                self.accumulation.sync == "no_sync"
                and num_microbatches > 1
                and not rs.role.allow_no_sync
            ):
                grads = (
                    p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
                )
                mib = sum(grads) / 2**20
                raise ValueError(
                    f"sync='no_sync' keeps an unsharded gradient of up to {mib:.1f} MiB per rank for {type(module).__name__}: "
                    "opt in with Role(..., allow_no_sync=True), or use sync='deferred' (same result, sharded)"
                )
            self.roots.append(module)  # type: ignore[arg-type]

    def before_backward(self, index: int) -> None:
        """Set the FSDP2 flags for micro-batch ``index``."""
        last = index == self.num_microbatches - 1
        acc = self.accumulation
        for root in self.roots:
            if acc.sync == "no_sync":
                root.set_requires_gradient_sync(last)
            elif acc.sync == "deferred":
                root.set_is_last_backward(last)
            if acc.keep_params_gathered:
                root.set_reshard_after_backward(last)
            if acc.defer_all_reduce:
                root.set_requires_all_reduce(last)

    def end(self) -> dict[str, Any]:
        """Restore FSDP2's defaults on every root touched."""
        for root in self.roots:
            root.set_requires_gradient_sync(True)
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_all_reduce(True)
        self.roots = []
        return {}


def release_modules(state: TrainState, *, after_error: bool = False) -> None:
    """Return every FSDP2 module of every role of ``state`` to rest: all groups sharded.

    FSDP2 does not reshard the root group after forward, so a role read under
    ``torch.no_grad()`` keeps it unsharded, with the ``requires_grad`` it was gathered with.
    fvstep calls this before and after every unit; :func:`unrested_modules` checks it.

    Args:
        after_error: A forward or backward raised midway: discard in-flight collectives and
            partial reductions too (FSDP2's ``reset_iter_state`` where torch has it).
    """
    for rs in state.roles.values():
        modules = [m for m in rs.role.module.modules() if isinstance(m, FSDPModule)]
        if not modules:
            continue
        root = modules[0]
        if root is rs.role.module and not after_error:
            # FSDP2 fixes a group's gradient dtypes at lazy init from the parameters that
            # require grad then; a role first used while a unit had turned that off (a DMD2
            # student read by a critic-only step) would get none. At rest all do: init here.
            fsdp_lazy_init(rs.role.module)
        reset = getattr(root, "reset_iter_state", None)
        if after_error and reset is not None and is_fsdp_root(cast(nn.Module, root)):
            reset()
        for m in modules:
            m.reshard()


def unrested_modules(state: TrainState) -> list[str]:
    """What a module of ``state`` holds that the state does not; ``[]`` when at rest.

    At rest (after every unit and every step): each role's module holds exactly the
    state's parameter tensors (no FSDP2 group unsharded), every trainable parameter has
    ``requires_grad`` on and every frozen one off, and no parameter has a ``.grad``.
    """
    problems: list[str] = []
    for name, rs in state.roles.items():
        module = rs.role.module
        live = dict(module.named_parameters(remove_duplicate=False))
        trainable = set(rs.trainable_names)
        for pname, tensor in rs.params.items():
            held = live.get(pname)
            if held is not tensor:
                kind = "an unsharded FSDP2 parameter" if is_sharded(module) else "another tensor"
                problems.append(f"{name}.{pname}: the module holds {kind}, not the state's leaf")
            if tensor.requires_grad != (pname in trainable):
                problems.append(f"{name}.{pname}: requires_grad is {tensor.requires_grad}")
            if tensor.grad is not None:
                problems.append(f"{name}.{pname}: has a .grad")
    return problems
