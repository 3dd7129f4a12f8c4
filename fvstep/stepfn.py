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

A step fails loudly and never half-silently (DESIGN point 10):

- before it touches anything it checks that every role that any unit of the method can
  ever run exists in the state (a typo is a ``ValueError`` naming the close match) and
  that trained roles are trainable;
- it consumes its input only when the first leaf is about to change (the first optimizer
  update, or the start of a managed step). A step that raises before that — a bad batch,
  an error in a loss function's forward or backward, a
  :class:`~fvstep.grads.NonFiniteGradientError` of its first unit — re-raises the error
  as is and leaves its input state usable and bit-unchanged;
- a step that raises after some leaves changed raises :class:`StepFailedError` (the
  original error is its ``__cause__``), which says what had already run and how to
  recover: the input state is consumed and partly updated.

Metrics are reduced over micro-batches by the mean (losses and the loss function's own
metrics); ``<role>/grad_norm``, ``<role>/lr`` and ``<role>/skipped`` are per update.
Metric values are detached tensors or Python scalars: converting them to floats is the
caller's choice (it synchronises a GPU).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from fvstep import distributed
from fvstep import random as fsrandom
from fvstep.accumulation import Accumulation, split_microbatches
from fvstep.compose import Cond, Every, Managed, ManagedContext, PlanEntry, _check_method
from fvstep.compose import Sequence as SequenceNode
from fvstep.grads import SANITIZE_POLICIES, ClipGradNorm, Sanitize
from fvstep.state import TrainState, adopt, is_consumed, mark_consumed
from fvstep.tree import flatten_with_paths
from fvstep.update import DEFAULT, GradSync, NoSync, Update, run_update

__all__ = ["Step", "StepFailedError", "compile", "plan"]


class StepFailedError(RuntimeError):
    """A step raised after it had changed some leaves of its input state in place.

    The input state is consumed and partly updated (the units named in the message had
    already changed it), so training cannot continue from it: reload the last checkpoint
    (``fvstep.checkpoint.load(fvstep.checkpoint.latest(dir), like=...)``). The error
    that stopped the step is ``__cause__``. A step that fails *before* changing a leaf
    raises that error itself and leaves its input usable.
    """


def _method_leaves(method: Any, step: int) -> list[Any]:
    """Every leaf (unit or managed step) that ``method`` can ever run: all children of a
    sequence, the wrapped method of ``every``, both branches of ``cond``. A node of
    another kind only tells its leaves at ``step`` (``active``)."""
    if isinstance(method, (Update, Managed)):
        return [method]
    if isinstance(method, SequenceNode):
        return [leaf for child in method.children for leaf in _method_leaves(child, step)]
    if isinstance(method, Every):
        return _method_leaves(method.method, step)
    if isinstance(method, Cond):
        branches = [method.if_true] + ([method.if_false] if method.if_false is not None else [])
        return [leaf for branch in branches for leaf in _method_leaves(branch, step)]
    return [leaf for _, leaf in method.active(step)]


def _unknown_role(role: str, state_roles: list[str]) -> str:
    close = difflib.get_close_matches(role, state_roles, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"the state has no role {role!r} (it has roles {state_roles}){hint}"


def _check_roles(method: Any, state: TrainState, step: int) -> None:
    """Check that every role any leaf of ``method`` can run exists in ``state``, and that
    the roles it trains are trainable; on several ranks, that trained roles are sharded.

    Raises:
        ValueError: Naming the leaf and the role (and the close match of a typo).
    """
    names = sorted(state.roles)
    for leaf in _method_leaves(method, step):
        if isinstance(leaf, Managed):
            what, trained, other = f"managed step {leaf.name!r}", leaf.trains, leaf.mutates
        else:
            what, trained, other = f"unit {leaf.name!r}", tuple(leaf.roles), ()
        for role in (*trained, *other):
            if role not in state.roles:
                verb = "trains" if role in trained else "mutates"
                raise ValueError(f"{what} {verb} role {role!r}, but {_unknown_role(role, names)}")
        for role in trained:
            if not state.roles[role].role.trainable:
                raise ValueError(
                    f"{what} trains role {role!r}, which is frozen (give it an optimizer: "
                    "Role(module, optimizer=...))"
                )
    distributed.check_roles_are_data_parallel(state)


class _Progress:
    """What a running step has changed: it consumes the input at the first change.

    The units report their first change (:meth:`before_change`); a managed step counts as
    changing from its start. Loss functions may change buffers or ``extra`` tensors in
    place too (a BatchNorm forward in training mode), so the version counters of those
    leaves are watched as well, that a failed step never leaves as "unchanged" an input
    that is not. Best effort: a kernel that writes behind autograd's back moves no
    counter (BatchNorm's running statistics; its ``num_batches_tracked`` does move).
    Parameters are not watched (only optimizers and managed steps change them).
    """

    def __init__(self, state: TrainState, step: int) -> None:
        self.state = state
        self.step = step
        self.by = f"the step function at step {step}"
        self.changed: list[str] = []
        self.current = "the step"
        watched = {
            f"roles.{r}.buffers.{n}": b
            for r, rs in state.roles.items()
            for n, b in rs.buffers.items()
        }
        paths, leaves, _ = flatten_with_paths(state.extra)
        watched.update({f"extra.{p}": x for p, x in zip(paths, leaves)})
        self.versions = {p: (x, x._version) for p, x in watched.items()}

    def change(self, what: str) -> None:
        """Record that ``what`` is about to change the state; consume it first."""
        self.consume()
        if what not in self.changed:
            self.changed.append(what)

    def before_change(self, what: str) -> Callable[[], None]:
        """:meth:`change` of ``what``, as the callback of :func:`~fvstep.update.run_update`."""
        return functools.partial(self.change, what)

    def consume(self) -> None:
        if not is_consumed(self.state):
            mark_consumed(self.state, self.by)

    def changed_in_place(self) -> list[str]:
        """Watched tensors whose version counter moved (changed in place)."""
        return [p for p, (x, version) in self.versions.items() if x._version != version]

    def failure(self, error: Exception) -> StepFailedError | None:
        """The error to raise for ``error``, or ``None`` when nothing changed (the input
        state is then left as it was, not consumed)."""
        in_place = self.changed_in_place()
        if not self.changed and not in_place:
            return None
        self.consume()
        parts = []
        if self.changed:
            parts.append("already changed by " + ", ".join(self.changed))
        if in_place:
            shown = ", ".join(in_place[:3]) + (", ..." if len(in_place) > 3 else "")
            parts.append(f"changed in place by a loss or managed function ({shown})")
        return StepFailedError(
            f"step {self.step} failed in {self.current} after the step had changed its input "
            f"state: the state was {'; '.join(parts)}. The input state is consumed and partly "
            "updated: do not continue from it. To recover, reload the last checkpoint into a "
            "state of the same structure: state = fvstep.checkpoint.load("
            "fvstep.checkpoint.latest(ckpt_dir), like=fresh_state), with fresh_state built as "
            "for the first step (fvstep.run does this when restarted with its Checkpoints). "
            f"The error that stopped the step: {type(error).__name__}: {error}"
        )


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

    def _managed_runner(self, leaf: Managed, progress: _Progress | None = None) -> Any:
        """Inner updates of a managed step: its clip/sanitize fill in for the unit's."""

        def run(state: TrainState, unit: Update, batch: Any, key: torch.Tensor, acc: Accumulation):
            if unit.clip is DEFAULT and leaf.clip is not DEFAULT:
                unit = attrs.evolve(unit, clip=leaf.clip)
            if unit.sanitize is DEFAULT and leaf.sanitize is not DEFAULT:
                unit = attrs.evolve(unit, sanitize=leaf.sanitize)
            return self._run_unit(state, unit, batch, key, acc, progress=progress)

        return run

    def _run_unit(
        self,
        state: TrainState,
        unit: Update,
        batch: Any,
        key: torch.Tensor,
        accumulation: Accumulation,
        microbatches: list[Any] | None = None,
        *,
        progress: _Progress | None = None,
        what: str | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        num = accumulation.microbatches
        if microbatches is None:
            microbatches = split_microbatches(batch, num)
        keys = [fsrandom.fold_in(key, m) for m in range(num)]
        what = what or f"unit {unit.name!r} (roles {list(unit.roles)})"
        return run_update(
            state,
            unit,
            microbatches,
            keys,
            clip=self._clip(unit),
            sanitize=self._sanitize(unit),
            sync=self._grad_sync(state, accumulation),
            before_change=progress.before_change(what) if progress is not None else None,
        )

    def __call__(
        self, state: TrainState, batch: Any, key: torch.Tensor | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run one step. See the module docstring for keys, consumption and metrics.

        Args:
            state: The current state; consumed by the call (from its first change on).
            batch: A pytree of tensors split along dim 0 into the micro-batches, or a
                list of exactly ``microbatches`` micro-batches.
            key: A key to derive this step's randomness from; default ``state.key``.

        Returns:
            ``(new_state, metrics)``.

        Raises:
            ConsumedStateError: If ``state`` was already consumed.
            ValueError: Before anything runs, if a unit of the method (at any step)
                trains or mutates a role the state does not have, or trains a frozen
                role; on several ranks, if a trained role is not sharded.
            StepFailedError: If the step raised after it had changed a leaf of ``state``
                (the original error is ``__cause__``); ``state`` is then consumed.
                Any other error leaves ``state`` usable and bit-unchanged.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"a step takes a TrainState, got {type(state).__name__}")
        if is_consumed(state):  # checked here: the state is consumed only when it changes
            mark_consumed(state, "")  # raises ConsumedStateError, naming who consumed it
        step = int(state.step)
        _check_roles(self.method, state, step)
        dp = distributed.data_parallel_index(self.sequence_parallel_size)
        step_key = fsrandom.fold_in(fsrandom.fold_in(state.key if key is None else key, step), dp)
        work = state.replace(roles={name: adopt(rs) for name, rs in state.roles.items()})
        progress = _Progress(state, step)
        counter = distributed.CollectiveCounter() if self.count_collectives else None
        try:
            with counter or contextlib.nullcontext():
                work, metrics = self._run_leaves(work, batch, step, step_key, progress)
        except Exception as error:
            failure = progress.failure(error)
            if failure is None:
                raise
            raise failure from error
        progress.consume()
        if counter is not None:
            metrics.update(counter.metrics())
        return work.replace(step=torch.tensor(step + 1, dtype=torch.int64)), metrics

    def _run_leaves(
        self, work: TrainState, batch: Any, step: int, step_key: torch.Tensor, progress: _Progress
    ) -> tuple[TrainState, dict[str, Any]]:
        microbatches: list[Any] | None = None
        metrics: dict[str, Any] = {}
        for pos, leaf in self.method.active(step):
            leaf_key = fsrandom.fold_in(step_key, pos)
            if isinstance(leaf, Managed):
                what = f"managed step {leaf.name!r} (position {pos}, trains {list(leaf.trains)})"
                progress.current = what
                # A managed step may change anything from its start.
                progress.change(what)
                runner = self._managed_runner(leaf, progress)
                ctx = ManagedContext(step, pos, self.accumulation, runner)
                try:
                    with fsrandom.rng_scope(leaf_key):
                        work, leaf_metrics = leaf.fn(work, batch, leaf_key, ctx)
                except Exception:
                    # Its own module reads (outside ctx.update) may leave FSDP2 groups busy.
                    self._grad_sync(work, self.accumulation).release(work, after_error=True)
                    raise
                if not isinstance(work, TrainState):
                    raise TypeError(f"managed step {leaf.name!r} must return (TrainState, metrics)")
            else:
                what = f"unit {leaf.name!r} (position {pos}, roles {list(leaf.roles)})"
                progress.current = what
                if microbatches is None:
                    microbatches = split_microbatches(batch, self.accumulation.microbatches)
                work, leaf_metrics = self._run_unit(
                    work,
                    leaf,
                    batch,
                    leaf_key,
                    self.accumulation,
                    microbatches,
                    progress=progress,
                    what=what,
                )
            metrics.update(leaf_metrics)
        return work, metrics


def compile(
    method: Any,
    *,
    accumulation: Accumulation | None = None,
    clip: ClipGradNorm | None = None,
    sanitize: Sanitize = "error",
    sequence_parallel_size: int = 1,
    count_collectives: bool = False,
) -> Step:
    """Compile a composed method and an execution policy into a step function.

    Args:
        method: A unit (``fvstep.update``) or a composition of units.
        accumulation: ``Accumulation(microbatches=K, sync=...)``; default one micro-batch.
        clip: Default clipping for units that do not set their own (``None``: off).
        sanitize: Default non-finite policy of units that do not set their own:
            ``"error"`` (default: raise :class:`~fvstep.grads.NonFiniteGradientError`
            before any leaf changes when a loss or gradient is NaN or infinite; one
            device sync per unit), ``"skip"`` (leave the role bit-unchanged for that
            update), ``"nan_to_num"`` (zero non-finite gradient entries), or ``None``
            (no check; unsafe: one NaN gradient silently turns every parameter and
            moment of the role into NaN). See :func:`fvstep.update`.
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
