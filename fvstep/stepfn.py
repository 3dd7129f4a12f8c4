"""The step type: what every unit, combinator and compiled step is, and how a step runs.

Every step is a :class:`Step`: ``step(state, batch, key=None) -> (state, metrics)`` and
``step.plan(i) -> [PlanEntry]``. Units (``fvstep.update``) and managed steps are its
leaves (:class:`Leaf`); ``sequence``, ``every``, ``cond`` and ``compile`` take steps and
return steps. What runs at step ``i`` is :meth:`Step.schedule`: the leaves, in order, each
with the execution :class:`Policy` that applies to it, a pure function of ``i``.

Calling a step reads nothing but its arguments:

- the step's key is ``fold_in(fold_in(key if given else state.key, step), dp)`` with
  ``dp`` the data-parallel index (``rank // sequence_parallel_size``; 0 on one process),
  so data-parallel ranks draw different noise and a sequence-parallel group the same;
- a leaf gets ``fold_in_name(step_key, leaf.name)`` (its stable name, not its position:
  adding a unit leaves the noise of the others unchanged), and a unit's micro-batch ``m``
  gets ``fold_in(unit_key, m)`` — so randomness is restored from the step counter alone;
- modules run inside ``rng_scope`` of their micro-batch key (dropout is deterministic);
- the input state is consumed (it is updated in place, like a donated buffer); the
  returned state has ``step + 1``.

The execution policy is explicit where it applies (:class:`Policy`): a unit's own
``clip``/``sanitize`` win; an enclosing ``compile`` (the innermost first) fills what a
unit leaves unset, accumulation included; then the defaults (one micro-batch, no clip,
``sanitize="error"``). The settings of a whole call (:class:`CallSettings`: the
parallelism, ``sequence_parallel_size``, ``count_collectives``) are those of the
outermost step that sets them, since one call has one process layout.

A step fails loudly and never half-silently (DESIGN point 10):

- before it touches anything it checks that every role that any leaf of the step can
  ever run exists in the state (a typo is a ``ValueError`` naming the close match), that
  trained roles are trainable, and that the parallelism accepts the state's layout;
- it consumes its input only when the first leaf is about to change (the first optimizer
  update, or the start of a managed step). A step that raises before that — a bad batch,
  an error in a loss function's forward or backward, a
  :class:`~fvstep.grads.NonFiniteGradientError` of its first unit — re-raises the error
  as is and leaves its input state usable and bit-unchanged;
- a step that raises after some leaves changed raises :class:`StepFailedError` (the
  original error is its ``__cause__``), which says what had already run and how to
  recover: the input state is consumed and partly updated.

Consumption and these checks happen once, in the outermost call; nested steps run
through it.

Metrics are reduced over micro-batches by the mean (losses and the loss function's own
metrics); ``<role>/grad_norm``, ``<role>/lr`` and ``<role>/skipped`` are per update.
Metric values are detached tensors or Python scalars: converting them to floats is the
caller's choice (it synchronises a GPU).
"""

from __future__ import annotations

import abc
import contextlib
import difflib
import enum
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Final

import attrs
import torch

from fvstep import random as fsrandom
from fvstep._compat import tensor_version
from fvstep.accumulation import Accumulation, split_microbatches
from fvstep.grads import SANITIZE_POLICIES, ClipGradNorm, Sanitize
from fvstep.state import TrainState, adopt, is_consumed, mark_consumed
from fvstep.sync import Parallelism, SingleProcess
from fvstep.tree import flatten_with_paths

__all__ = [
    "UNSET",
    "CallSettings",
    "Leaf",
    "PlanEntry",
    "Policy",
    "RunContext",
    "Step",
    "StepFailedError",
    "Unset",
    "check_unique_names",
    "plan",
]


class Unset(enum.Enum):
    """The type of :data:`UNSET`: an option left to the enclosing step or the default."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET
"""An option that was not given: the enclosing ``compile``'s setting applies, else the default."""


def _check_clip(clip: object) -> None:
    if clip is not UNSET and clip is not None and not isinstance(clip, ClipGradNorm):
        raise TypeError("clip must be fvstep.clip_grad_norm(...) or None")


def _check_sanitize(sanitize: object) -> None:
    if sanitize is not UNSET and sanitize not in SANITIZE_POLICIES:
        raise ValueError(f"unknown sanitize policy {sanitize!r}; choose one of {SANITIZE_POLICIES}")


@attrs.frozen
class Policy:
    """How a unit runs: micro-batching and sync, clipping, the non-finite policy.

    A field left unset (``None`` for ``accumulation``, :data:`UNSET` for the others)
    takes the enclosing setting: :meth:`over` merges a policy over an outer one, and
    :meth:`resolve` fills what is still unset with the defaults (one micro-batch with
    ``sync="every"``, no clipping, ``sanitize="error"``).

    Examples:
        >>> Policy(clip=None).over(Policy(Accumulation(4), sanitize="skip")).resolve()
        Policy(accumulation=Accumulation(microbatches=4, ...), clip=None, sanitize='skip')
    """

    accumulation: Accumulation | None = None
    clip: ClipGradNorm | Unset | None = UNSET
    sanitize: Sanitize | Unset = UNSET

    def __attrs_post_init__(self) -> None:
        if self.accumulation is not None and not isinstance(self.accumulation, Accumulation):
            raise TypeError(
                f"accumulation must be fvstep.Accumulation(...), got {type(self.accumulation).__name__}"
            )
        _check_clip(self.clip)
        _check_sanitize(self.sanitize)

    def over(self, outer: Policy) -> Policy:
        """This policy, with its unset fields taken from ``outer``."""
        return Policy(
            accumulation=outer.accumulation if self.accumulation is None else self.accumulation,
            clip=outer.clip if self.clip is UNSET else self.clip,
            sanitize=outer.sanitize if self.sanitize is UNSET else self.sanitize,
        )

    def resolve(self) -> Policy:
        """This policy over the defaults: every field set."""
        return self.over(_DEFAULT_POLICY)


_DEFAULT_POLICY: Final = Policy(Accumulation(), None, "error")


@attrs.frozen
class CallSettings:
    """The settings of a whole call of a step (one process layout per call).

    ``None`` is unset. When a step is called, each setting is that of the outermost step
    of the composition that sets it (breadth first), else the default: ``SingleProcess()``,
    ``1``, ``False``.

    Attributes:
        parallelism: The process layout (:class:`~fvstep.sync.Parallelism`).
        sequence_parallel_size: Ranks per sequence-parallel group; they share noise.
        count_collectives: Report collective counts and bytes in the metrics.
    """

    parallelism: Parallelism | None = None
    sequence_parallel_size: int | None = None
    count_collectives: bool | None = None

    def __attrs_post_init__(self) -> None:
        size = self.sequence_parallel_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"sequence_parallel_size must be >= 1, got {size!r}")

    def fill(self, inner: CallSettings) -> CallSettings:
        """These settings, with the unset ones taken from ``inner`` (an inner step's)."""
        mine, theirs = _fields(self), _fields(inner)
        return CallSettings(*(a if a is not None else b for a, b in zip(mine, theirs)))


def _fields(settings: CallSettings) -> tuple[Any, ...]:
    return (settings.parallelism, settings.sequence_parallel_size, settings.count_collectives)


@attrs.frozen
class PlanEntry:
    """One leaf that runs at a step: what it trains and how.

    Attributes:
        position: The leaf's index among all the leaves of the step (depth first, every
            branch); for messages only: keys come from the name.
        name: The unit's or managed step's name (keys its randomness).
        roles: The roles whose optimizers step.
        managed: Whether it runs its own inner loop.
        clip: The resolved clipping (``None``: none).
        sanitize: The resolved non-finite policy.
        mutates: Frozen roles it changes in place (managed steps only).
        accumulation: The resolved micro-batching (for a managed step, that of its inner
            updates unless they pass their own).
    """

    position: int
    name: str
    roles: tuple[str, ...]
    managed: bool
    clip: ClipGradNorm | None
    sanitize: Sanitize
    mutates: tuple[str, ...] = ()
    accumulation: Accumulation = attrs.Factory(Accumulation)


class StepFailedError(RuntimeError):
    """A step raised after it had changed some leaves of its input state in place.

    The input state is consumed and partly updated (the units named in the message had
    already changed it), so training cannot continue from it: reload the last checkpoint
    (``fvstep.checkpoint.load(fvstep.checkpoint.latest(dir), like=...)``). The error
    that stopped the step is ``__cause__``. A step that fails *before* changing a leaf
    raises that error itself and leaves its input usable.
    """


class Step(abc.ABC):
    """A step function: ``step(state, batch, key=None) -> (state, metrics)``.

    Units, managed steps, ``sequence``, ``every``, ``cond`` and ``compile`` all return
    steps, and take steps: any step can be called, planned and composed.

    Subclasses say which sub-steps they hold (:meth:`children`) and which leaves run at a
    step with which policy (:meth:`schedule`); leaves (:class:`Leaf`) run themselves.
    """

    settings: CallSettings = CallSettings()  # a step's own call settings (here: none set)

    @abc.abstractmethod
    def children(self) -> tuple[Step, ...]:
        """The sub-steps, in order (all of them, whether or not they run at a step)."""

    @abc.abstractmethod
    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """The leaves that run at ``step``, in order, each with its policy merged over
        ``policy`` (the enclosing steps'). A pure function of ``step``."""

    def leaves(self) -> tuple[Leaf, ...]:
        """Every leaf this step can ever run, depth first (both branches of ``cond``)."""
        return tuple(leaf for child in self.children() for leaf in child.leaves())

    def plan(self, step: int) -> list[PlanEntry]:
        """What runs at ``step``: one :class:`PlanEntry` per leaf, in order, resolved."""
        positions = {id(leaf): i for i, leaf in enumerate(self.leaves())}
        entries = []
        for leaf, policy in self.schedule(step, Policy()):
            p = policy.resolve()
            assert p.accumulation is not None and p.clip is not UNSET and p.sanitize is not UNSET
            entries.append(
                PlanEntry(
                    position=positions[id(leaf)],
                    name=leaf.name,
                    roles=leaf.trains,
                    managed=leaf.managed,
                    clip=p.clip,
                    sanitize=p.sanitize,
                    mutates=leaf.mutates,
                    accumulation=p.accumulation,
                )
            )
        return entries

    def resolved_settings(self) -> CallSettings:
        """The settings of a call of this step: the outermost set value of each, else the
        default (``SingleProcess()``, ``1``, ``False``)."""
        settings, level = CallSettings(), [self]
        while level:
            for s in level:
                settings = settings.fill(s.settings)
            level = [c for s in level for c in s.children()]
        return settings.fill(CallSettings(SingleProcess(), 1, False))

    def __call__(
        self, state: TrainState, batch: Any, key: torch.Tensor | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run one step. See :mod:`fvstep.stepfn` for keys, consumption and metrics.

        Args:
            state: The current state; consumed by the call (from its first change on).
            batch: A pytree of tensors split along dim 0 into the micro-batches, or a
                list of exactly ``microbatches`` micro-batches.
            key: A key to derive this step's randomness from; default ``state.key``.

        Returns:
            ``(new_state, metrics)``.

        Raises:
            ConsumedStateError: If ``state`` was already consumed.
            ValueError: Before anything runs, if a leaf of the step (at any step) trains
                or mutates a role the state does not have, or trains a frozen role; or if
                the parallelism refuses the layout (on several ranks, a trained role that
                is not sharded).
            StepFailedError: If the step raised after it had changed a leaf of ``state``
                (the original error is ``__cause__``); ``state`` is then consumed.
                Any other error leaves ``state`` usable and bit-unchanged.
        """
        return _call(self, state, batch, key)


class Leaf(Step):
    """A step that is one leaf of a composition: a unit or a managed step.

    Its ``name`` keys its randomness (``fold_in_name(step_key, name)``) and labels its
    metrics, so the names of the leaves of a composed step are unique.
    """

    kind: ClassVar[str] = "leaf"
    managed: ClassVar[bool] = False
    name: str

    @property
    @abc.abstractmethod
    def trains(self) -> tuple[str, ...]:
        """The roles whose optimizers it steps."""

    @property
    def mutates(self) -> tuple[str, ...]:
        """Frozen roles it changes in place (none, unless a managed step declares some)."""
        return ()

    @property
    @abc.abstractmethod
    def policy(self) -> Policy:
        """Its own execution policy (what it sets; unset fields are the enclosing ones)."""

    @abc.abstractmethod
    def run(
        self, state: TrainState, batch: Any, key: torch.Tensor, policy: Policy, ctx: RunContext
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run on ``state`` with its key (``fold_in_name(step_key, name)``) and resolved
        ``policy``; report changes to ``ctx`` before making them."""

    def children(self) -> tuple[Step, ...]:
        """None: a leaf."""
        return ()

    def leaves(self) -> tuple[Leaf, ...]:
        """Itself."""
        return (self,)

    def schedule(self, step: int, policy: Policy) -> list[tuple[Leaf, Policy]]:
        """It runs at every step it is reached, with its own policy over ``policy``."""
        return [(self, self.policy.over(policy))]

    def describe(self) -> str:
        """``unit 'name'`` or ``managed step 'name'``, for messages."""
        return f"{self.kind} {self.name!r}"


def check_unique_names(leaves: tuple[Leaf, ...], where: str) -> None:
    """Refuse two leaves of one name: their keys would be the same.

    Raises:
        ValueError: Naming the name and how to rename.
    """
    seen: dict[str, Leaf] = {}
    for leaf in leaves:
        other = seen.setdefault(leaf.name, leaf)
        if other is leaf and leaves.count(leaf) == 1:
            continue
        what = (
            f"the same {leaf.describe()} appears twice"
            if other is leaf
            else f"{other.describe()} and {leaf.describe()} share the name"
        )
        raise ValueError(
            f"{where}: {what}. Sub-steps are keyed by name (their noise is drawn from "
            f"fold_in_name(step_key, name)), so every unit and managed step of a composed step "
            f"needs its own name: pass update(..., name={leaf.name + '_2'!r}) (or managed(..., "
            "name=...)) to one of them"
        )


def _unknown_role(role: str, state_roles: list[str]) -> str:
    close = difflib.get_close_matches(role, state_roles, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"the state has no role {role!r} (it has roles {state_roles}){hint}"


def _check_roles(leaves: tuple[Leaf, ...], state: TrainState) -> None:
    """Check that every role any of ``leaves`` can run exists in ``state``, and that the
    roles they train are trainable.

    Raises:
        ValueError: Naming the leaf and the role (and the close match of a typo).
    """
    names = sorted(state.roles)
    for leaf in leaves:
        trained, other = leaf.trains, leaf.mutates
        for role in (*trained, *other):
            if role not in state.roles:
                verb = "trains" if role in trained else "mutates"
                raise ValueError(
                    f"{leaf.describe()} {verb} role {role!r}, but {_unknown_role(role, names)}"
                )
        for role in trained:
            if not state.roles[role].role.trainable:
                raise ValueError(
                    f"{leaf.describe()} trains role {role!r}, which is frozen (give it an "
                    "optimizer: Role(module, optimizer=...))"
                )


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
        self.versions = {p: (x, tensor_version(x)) for p, x in watched.items()}

    def change(self, what: str) -> None:
        """Record that ``what`` is about to change the state; consume it first."""
        self.consume()
        if what not in self.changed:
            self.changed.append(what)

    def consume(self) -> None:
        if not is_consumed(self.state):
            mark_consumed(self.state, self.by)

    def changed_in_place(self) -> list[str]:
        """Watched tensors whose version counter moved (changed in place)."""
        return [p for p, (x, v) in self.versions.items() if tensor_version(x) != v]

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


class RunContext:
    """What a leaf gets from the call that runs it (one per call of a step).

    Attributes:
        step: The step counter being run.
        parallelism: The call's process layout.
    """

    def __init__(
        self,
        step: int,
        parallelism: Parallelism,
        batch: Any,
        positions: dict[int, int],
        progress: _Progress,
    ) -> None:
        self.step = step
        self.parallelism = parallelism
        self._batch = batch
        self._positions = positions
        self._progress = progress
        self._splits: dict[int, list[Any]] = {}

    def position(self, leaf: Leaf) -> int | None:
        """``leaf``'s index among the called step's leaves (``None``: not one of them)."""
        return self._positions.get(id(leaf))

    def microbatches(self, batch: Any, num: int) -> list[Any]:
        """``batch`` split into ``num`` micro-batches (the step's batch is split once per
        ``num``, and the split shared by the leaves)."""
        if batch is not self._batch:
            return split_microbatches(batch, num)
        if num not in self._splits:
            self._splits[num] = split_microbatches(batch, num)
        return self._splits[num]

    def begin(self, what: str) -> None:
        """``what`` (``"unit 'x' (position 0, ...)"``) is running: named if it fails."""
        self._progress.current = what

    def change(self, what: str) -> None:
        """``what`` is about to change the state: the input is consumed first."""
        self._progress.change(what)

    def before_change(self, what: str) -> Callable[[], None]:
        """:meth:`change` of ``what``, as the callback of :func:`~fvstep.update.run_update`."""
        return functools.partial(self._progress.change, what)


def _call(
    root: Step, state: TrainState, batch: Any, key: torch.Tensor | None
) -> tuple[TrainState, dict[str, Any]]:
    """The outermost call of a step: checks, keys, consumption, the leaves, the counter."""
    if not isinstance(state, TrainState):
        raise TypeError(f"a step takes a TrainState, got {type(state).__name__}")
    if is_consumed(state):  # checked here: the state is consumed only when it changes
        mark_consumed(state, "")  # raises ConsumedStateError, naming who consumed it
    step = int(state.step)
    leaves = root.leaves()
    _check_roles(leaves, state)
    settings = root.resolved_settings()
    parallelism = settings.parallelism
    assert parallelism is not None and settings.sequence_parallel_size is not None
    parallelism.check(state)
    dp = parallelism.data_parallel_index(settings.sequence_parallel_size)
    step_key = fsrandom.fold_in(fsrandom.fold_in(state.key if key is None else key, step), dp)
    work = state.replace(roles={name: adopt(rs) for name, rs in state.roles.items()})
    progress = _Progress(state, step)
    ctx = RunContext(step, parallelism, batch, {id(x): i for i, x in enumerate(leaves)}, progress)
    counter = parallelism.collective_counter() if settings.count_collectives else None
    metrics: dict[str, Any] = {}
    try:
        with counter or contextlib.nullcontext():
            for leaf, policy in root.schedule(step, Policy()):
                leaf_key = fsrandom.fold_in_name(step_key, leaf.name)
                work, leaf_metrics = leaf.run(work, batch, leaf_key, policy.resolve(), ctx)
                metrics.update(leaf_metrics)
    except Exception as error:
        failure = progress.failure(error)
        if failure is None:
            raise
        raise failure from error
    progress.consume()
    if counter is not None:
        metrics.update(counter.metrics())
    return work.replace(step=torch.tensor(step + 1, dtype=torch.int64)), metrics


def check_step(step: object, where: str) -> None:
    """Refuse what is not a step.

    Raises:
        TypeError: Naming ``where``.
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"{where} must be a step (a method: fvstep.update(...), sequence, every, cond, "
            f"managed, compile), got {type(step).__name__}"
        )


def plan(step_fn: Step, step: int) -> list[PlanEntry]:
    """What ``step_fn`` runs at ``step`` (a pure function of ``step``).

    Examples:
        >>> [e.roles for e in plan(step_fn, 5)]
        [('critic',), ('student',)]
    """
    check_step(step_fn, "plan's step function")
    return step_fn.plan(step)


def __getattr__(name: str) -> Any:
    # compile and Compiled moved to fvstep.compose (a compiled step is a combinator's
    # result); their old address stays valid.
    if name in ("compile", "Compiled"):
        from fvstep import compose

        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
