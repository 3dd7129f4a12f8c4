"""``compile``: turn a composed method and an execution policy into a step function.

``step = compile(method, accumulation=..., clip=..., sanitize=...)`` is a callable
``step(state, batch, key=None) -> (state, metrics)``. It reads nothing but its arguments:

- the step's key is ``fold_in(fold_in(key if given else state.key, step), dp)`` with
  ``dp`` the data-parallel index (``rank // sequence_parallel_size``; 0 on one process),
  so data-parallel ranks draw different noise and a sequence-parallel group the same; a
  leaf at tree position ``p`` gets ``fold_in(step_key, p)``, and its micro-batch ``m``
  gets ``fold_in(leaf_key, m)`` — so randomness is restored from the step counter alone;
- modules run inside ``rng_scope`` of their micro-batch key (dropout is deterministic);
- the input state is consumed (it is updated in place, like a donated buffer); the
  returned state has ``step + 1``.

Metrics are reduced over micro-batches by the mean (losses and the loss function's own
metrics); ``<role>/grad_norm``, ``<role>/lr`` and ``<role>/skipped`` are per update.
Metric values are detached tensors or Python scalars: converting them to floats is the
caller's choice (it synchronises a GPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import torch

from fvstep import distributed
from fvstep import random as fsrandom
from fvstep.accumulation import Accumulation, split_microbatches
from fvstep.compose import Managed, ManagedContext, PlanEntry, _check_method
from fvstep.grads import SANITIZE_POLICIES, ClipGradNorm, Sanitize
from fvstep.state import TrainState, adopt, mark_consumed
from fvstep.update import DEFAULT, GradSync, NoSync, Update, run_update

__all__ = ["Step", "compile", "plan"]


@attrs.frozen(eq=False)
class Step:
    """A compiled step function: ``step(state, batch, key=None) -> (state, metrics)``.

    Attributes:
        method: The composed method.
        accumulation: Micro-batching and the gradient-sync policy.
        clip: The default clipping of units that do not set their own.
        sanitize: The default non-finite policy of units that do not set their own.
        sequence_parallel_size: Ranks that share a key (one sequence-parallel group).
        count_collectives: Add ``collectives/<kind>`` counts and bytes to the metrics
            (:class:`fvstep.distributed.CollectiveCounter`; slows every op down).
    """

    method: Any
    accumulation: Accumulation
    clip: ClipGradNorm | None
    sanitize: Sanitize
    sequence_parallel_size: int = 1
    count_collectives: bool = False

    def plan(self, step: int) -> list[PlanEntry]:
        """What runs at ``step``: one :class:`PlanEntry` per active leaf, in order."""
        return [
            PlanEntry(
                position=pos,
                name=leaf.name,
                roles=leaf.trains if isinstance(leaf, Managed) else leaf.roles,
                managed=isinstance(leaf, Managed),
                clip=self._clip(leaf),
                sanitize=self._sanitize(leaf),
                mutates=leaf.mutates if isinstance(leaf, Managed) else (),
            )
            for pos, leaf in self.method.active(step)
        ]

    def _clip(self, leaf: Any) -> ClipGradNorm | None:
        return self.clip if leaf.clip is DEFAULT else leaf.clip

    def _sanitize(self, leaf: Any) -> Sanitize:
        return self.sanitize if leaf.sanitize is DEFAULT else leaf.sanitize

    def _grad_sync(self, state: TrainState, accumulation: Accumulation) -> GradSync:
        return distributed.grad_sync_for(state, accumulation) or NoSync()

    def _managed_runner(self, leaf: Managed) -> Any:
        """Inner updates of a managed step: its clip/sanitize fill in for the unit's."""

        def run(state: TrainState, unit: Update, batch: Any, key: torch.Tensor, acc: Accumulation):
            if unit.clip is DEFAULT and leaf.clip is not DEFAULT:
                unit = attrs.evolve(unit, clip=leaf.clip)
            if unit.sanitize is DEFAULT and leaf.sanitize is not DEFAULT:
                unit = attrs.evolve(unit, sanitize=leaf.sanitize)
            return self._run_unit(state, unit, batch, key, acc)

        return run

    def _run_unit(
        self,
        state: TrainState,
        unit: Update,
        batch: Any,
        key: torch.Tensor,
        accumulation: Accumulation,
        microbatches: list[Any] | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        num = accumulation.microbatches
        if microbatches is None:
            microbatches = split_microbatches(batch, num)
        keys = [fsrandom.fold_in(key, m) for m in range(num)]
        return run_update(
            state,
            unit,
            microbatches,
            keys,
            clip=self._clip(unit),
            sanitize=self._sanitize(unit),
            sync=self._grad_sync(state, accumulation),
        )

    def __call__(
        self, state: TrainState, batch: Any, key: torch.Tensor | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run one step. See the module docstring for keys, consumption and metrics.

        Args:
            state: The current state; consumed by the call.
            batch: A pytree of tensors split along dim 0 into the micro-batches, or a
                list of exactly ``microbatches`` micro-batches.
            key: A key to derive this step's randomness from; default ``state.key``.

        Returns:
            ``(new_state, metrics)``.

        Raises:
            ConsumedStateError: If ``state`` was already consumed.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"a step takes a TrainState, got {type(state).__name__}")
        step = int(state.step)
        dp = distributed.data_parallel_index(self.sequence_parallel_size)
        step_key = fsrandom.fold_in(fsrandom.fold_in(state.key if key is None else key, step), dp)
        work = state.replace(roles={name: adopt(rs) for name, rs in state.roles.items()})
        mark_consumed(state, f"the step function at step {step}")
        counter = distributed.CollectiveCounter() if self.count_collectives else None
        with counter or contextlib.nullcontext():
            work, metrics = self._run_leaves(work, batch, step, step_key)
        if counter is not None:
            metrics.update(counter.metrics())
        return work.replace(step=torch.tensor(step + 1, dtype=torch.int64)), metrics

    def _run_leaves(
        self, work: TrainState, batch: Any, step: int, step_key: torch.Tensor
    ) -> tuple[TrainState, dict[str, Any]]:
        microbatches: list[Any] | None = None
        metrics: dict[str, Any] = {}
        for pos, leaf in self.method.active(step):
            leaf_key = fsrandom.fold_in(step_key, pos)
            if isinstance(leaf, Managed):
                ctx = ManagedContext(step, pos, self.accumulation, self._managed_runner(leaf))
                with fsrandom.rng_scope(leaf_key):
                    work, leaf_metrics = leaf.fn(work, batch, leaf_key, ctx)
                if not isinstance(work, TrainState):
                    raise TypeError(f"managed step {leaf.name!r} must return (TrainState, metrics)")
            else:
                if microbatches is None:
                    microbatches = split_microbatches(batch, self.accumulation.microbatches)
                work, leaf_metrics = self._run_unit(
                    work, leaf, batch, leaf_key, self.accumulation, microbatches
                )
            metrics.update(leaf_metrics)
        return work, metrics


def compile(
    method: Any,
    *,
    accumulation: Accumulation | None = None,
    clip: ClipGradNorm | None = None,
    sanitize: Sanitize = None,
    sequence_parallel_size: int = 1,
    count_collectives: bool = False,
) -> Step:
    """Compile a composed method and an execution policy into a step function.

    Args:
        method: A unit (``fvstep.update``) or a composition of units.
        accumulation: ``Accumulation(microbatches=K, sync=...)``; default one micro-batch.
        clip: Default clipping for units that do not set their own (``None``: off).
        sanitize: Default non-finite policy: ``None``, ``"nan_to_num"`` or ``"skip"``.
        sequence_parallel_size: Ranks per sequence-parallel group; they share noise.
        count_collectives: Report collective counts and bytes in the metrics.

    Returns:
        A :class:`Step`.

    Examples:
        >>> step = compile(update("student", loss), accumulation=Accumulation(4),
        ...                clip=clip_grad_norm(1.0))
        >>> state, metrics = step(state, batch)
    """
    _check_method(method, "compile's method")
    if sanitize not in SANITIZE_POLICIES:
        raise ValueError(f"unknown sanitize policy {sanitize!r}; choose one of {SANITIZE_POLICIES}")
    if clip is not None and not isinstance(clip, ClipGradNorm):
        raise TypeError("clip must be fvstep.clip_grad_norm(...) or None")
    if isinstance(sequence_parallel_size, bool) or sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sequence_parallel_size}")
    return Step(
        method,
        accumulation or Accumulation(),
        clip,
        sanitize,
        sequence_parallel_size,
        count_collectives,
    )


def plan(step_fn: Step, step: int) -> list[PlanEntry]:
    """What ``step_fn`` runs at ``step`` (a pure function of ``step``).

    Examples:
        >>> [e.roles for e in plan(step_fn, 5)]
        [('critic',), ('student',)]
    """
    return step_fn.plan(step)
