"""What a running step has changed, so that a failure says it and never hides it.

The engine consumes its input state at the first change (a unit about to apply its
update, a managed step from its start); a failure before that leaves the input usable,
one after raises :class:`~fvstep.core.policy.StepFailedError` naming what had run.
"""

from __future__ import annotations

from fvstep._compat import tensor_version
from fvstep.core.policy import StepFailedError
from fvstep.state import TrainState, is_consumed, mark_consumed
from fvstep.tree import flatten_with_paths

__all__ = ["Progress"]


class Progress:
    """What a running step has changed: it consumes the input at the first change.

    Loss functions may change buffers or ``extra`` tensors in place too (a BatchNorm
    forward in training mode), so the version counters of those leaves are watched, that
    a failed step never leaves as "unchanged" an input that is not (best effort: a kernel
    that writes behind autograd's back moves no counter). Parameters are not watched
    (only optimizers and managed steps change them).
    """

    def __init__(self, state: TrainState, step: int) -> None:
        self.state = state
        self.step = step
        self.changed: list[str] = []
        self.current = "the step"
        watched = {
            f"roles.{r}.buffers.{n}": b
            for r, rs in state.roles.items()
            for n, b in rs.buffers.items()
        }
        if state.extra:
            paths, leaves, _ = flatten_with_paths(state.extra)
            watched.update({f"extra.{p}": x for p, x in zip(paths, leaves)})
        self.versions = {p: (x, tensor_version(x)) for p, x in watched.items()}

    def consume(self) -> None:
        """Mark the input consumed (once)."""
        if not is_consumed(self.state):
            mark_consumed(self.state, f"the step function at step {self.step}")

    def change(self, what: str) -> None:
        """``what`` is about to change the state: consume it first."""
        self.consume()
        if what not in self.changed:
            self.changed.append(what)

    def failure(self, error: Exception) -> StepFailedError | None:
        """The error to raise for ``error``; ``None`` when nothing changed (the input is
        then left as it was, not consumed)."""
        in_place = [p for p, (x, v) in self.versions.items() if tensor_version(x) != v]
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
