"""Every exception fvstep raises on purpose, in one module (the lowest layer: any may import it).

Each is re-exported where its users find it (``fvstep.StepFailedError``,
``fvstep.checkpoint.CheckpointError``, ...): the same class objects.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from fvstep.core.state import TrainState

__all__ = [
    "CLIError",
    "CheckpointError",
    "CheckpointLockedError",
    "CompiledGradientError",
    "ConfigChangeError",
    "ConsumedStateError",
    "DamagedCheckpointError",
    "Interrupted",
    "MissingExtraError",
    "NewerFormatError",
    "NonFiniteGradientError",
    "ShardError",
    "SimulatedCrash",
    "StepFailedError",
    "UsageError",
]


class ConsumedStateError(RuntimeError):
    """A consumed (donated) state was used after a step took it."""


class NonFiniteGradientError(FloatingPointError):
    """A unit's loss or gradient was NaN or infinite under ``sanitize="error"``.

    Raised before the unit changes any leaf; on several ranks every rank raises (the
    verdict is the global gradient norm and every rank's losses).

    Attributes:
        step: The step counter of the state the unit ran on.
        unit: The unit's name.
        role: The role whose loss or gradient is not finite (``None``: another rank's).
        parameter: The first parameter of ``role`` with a non-finite gradient entry on
            this rank, or ``None`` (a loss, or another rank's shard).
        microbatch: The micro-batch of a non-finite loss, else ``None``.
        kind: ``"NaN"``, ``"Inf"``, or ``None`` when not known on this rank.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        unit: str | None = None,
        role: str | None = None,
        parameter: str | None = None,
        microbatch: int | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.unit = unit
        self.role = role
        self.parameter = parameter
        self.microbatch = microbatch
        self.kind = kind

    def __reduce__(self) -> tuple:
        # the attributes survive pickling (an error crossing a process boundary)
        details = {
            k: getattr(self, k) for k in ("step", "unit", "role", "parameter", "microbatch", "kind")
        }
        return (functools.partial(type(self), **details), self.args)


class StepFailedError(RuntimeError):
    """A step raised after it had changed leaves of its input in place (``__cause__``: why).

    The input is consumed and partly updated: reload the last checkpoint
    (``docs/concepts/purity.md``).
    """


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message names the extra to install."""


class CompiledGradientError(ValueError):
    """A compiled block's gradients differ from its eager ones beyond the threshold.

    Attributes:
        report: The failing block's ``fvstep.parallel.CompiledGradientReport`` (``None`` on
            a rank whose own comparison passed while another rank's failed).
    """

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the state."""


class NewerFormatError(CheckpointError):
    """A complete checkpoint written by a newer fvstep format than this one reads."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's manifest, shards or checksums are damaged (missing, truncated, malformed).

    An older checkpoint may still be good: see ``Checkpoints.on_damaged``.
    """


class CheckpointLockedError(CheckpointError):
    """The directory of checkpoints is locked by another run (``fvstep.checkpoint.lock_dir``)."""


class Interrupted(Exception):
    """:func:`run` was stopped by a signal before ``num_steps``, after saving its state.

    The run's folder is unlocked, so the same command run again resumes from
    :attr:`checkpoint` (``None`` without checkpoints).

    Attributes:
        signal: ``"SIGTERM"`` or ``"SIGINT"`` (a first Ctrl-C).
        step: The step the state reached (and was saved at).
        num_steps: The step the run was asked to reach.
    """

    def __init__(
        self,
        signal: str,
        step: int,
        num_steps: int,
        checkpoint: Path | None,
        state: TrainState | None = None,
    ) -> None:
        where = f"saved {str(checkpoint)!r}" if checkpoint is not None else "nothing saved"
        super().__init__(
            f"stopped by {signal} at step {step} of {num_steps}; {where}: run the same "
            "command again to resume"
        )
        self.signal = signal
        self.step = step
        self.num_steps = num_steps
        self.checkpoint = checkpoint
        self.state = state

    def __reduce__(self) -> Any:  # picklable (a launched rank hands it to its launcher)
        return (type(self), (self.signal, self.step, self.num_steps, self.checkpoint))


class ShardError(Exception):
    """A shard is missing, damaged, or does not match the index (the message names the file)."""


class UsageError(ValueError):
    """A user error of ``fvstep data``: printed as one line, exit code 2."""


class SimulatedCrash(RuntimeError):
    """Raised by ``fvstep.testing``'s data at the step where a test run 'crashes'."""


class ConfigChangeError(ValueError):
    """``fvstep train`` resumed with options that alter the math of the run it continues."""


class CLIError(Exception):
    """A user error of the ``fvstep`` command: printed as one line, exit code 2."""
