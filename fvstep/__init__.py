"""fvstep: training methods for video diffusion models as pure step functions over state pytrees.

The public API: ``TrainState``, ``Role``, ``EMA``, ``update``, ``sequence``, ``every``,
``cond``, ``managed``, ``compile``, ``plan``, ``Step``, ``Accumulation``,
``clip_grad_norm``, ``run``, ``run_until``, ``Checkpoints``, ``Validation``, the errors a
step raises (``ConsumedStateError``, ``NonFiniteGradientError``, ``StepFailedError``),
``Interrupted`` (what ``run`` raises when a signal stopped it, after saving),
and the modules ``tree``, ``random``, ``optim``, ``schedules``, ``checkpoint``, ``data``.

A step is called with its process layout: ``step(state, batch)`` on one process,
``step(state, batch, parallelism=fvstep.parallel.Layout())`` on several ranks;
``fvstep.run`` picks the layout of its processes by itself.

The face is lazy (PEP 562): ``import fvstep`` imports no torch; each name is imported the
first time it is read, so the ``fvstep`` command answers ``--help`` without loading
torch, FSDP2 or diffusers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from fvstep import checkpoint, data, optim, random, schedules, tree
    from fvstep.accumulation import Accumulation
    from fvstep.core.engine import Step
    from fvstep.core.managed import managed
    from fvstep.core.policy import StepFailedError
    from fvstep.core.steps import compile, cond, every, plan, sequence, update
    from fvstep.executor import Interrupted, RunResult, run, run_until
    from fvstep.grads import NonFiniteGradientError, clip_grad_norm
    from fvstep.reporting import Validation
    from fvstep.run_checkpoints import Checkpoints
    from fvstep.state import EMA, ConsumedStateError, Role, TrainState

__version__ = "0.1.0.dev0"

_NAMES = {
    "Accumulation": "fvstep.accumulation",
    "Checkpoints": "fvstep.run_checkpoints",
    "ConsumedStateError": "fvstep.state",
    "EMA": "fvstep.state",
    "Interrupted": "fvstep.executor",
    "NonFiniteGradientError": "fvstep.grads",
    "Role": "fvstep.state",
    "RunResult": "fvstep.executor",
    "Step": "fvstep.core.engine",
    "StepFailedError": "fvstep.core.policy",
    "TrainState": "fvstep.state",
    "Validation": "fvstep.reporting",
    "clip_grad_norm": "fvstep.grads",
    "compile": "fvstep.core.steps",
    "cond": "fvstep.core.steps",
    "every": "fvstep.core.steps",
    "managed": "fvstep.core.managed",
    "plan": "fvstep.core.steps",
    "run": "fvstep.executor",
    "run_until": "fvstep.executor",
    "sequence": "fvstep.core.steps",
    "update": "fvstep.core.steps",
}
"""Each public name and the module that defines it, imported on first read."""

__all__ = [
    "EMA",
    "Accumulation",
    "Checkpoints",
    "ConsumedStateError",
    "Interrupted",
    "NonFiniteGradientError",
    "Role",
    "RunResult",
    "Step",
    "StepFailedError",
    "TrainState",
    "Validation",
    "__version__",
    "checkpoint",
    "clip_grad_norm",
    "compile",
    "cond",
    "data",
    "every",
    "managed",
    "optim",
    "plan",
    "random",
    "run",
    "run_until",
    "schedules",
    "sequence",
    "tree",
    "update",
]


def __getattr__(name: str) -> Any:
    """Import a public name or submodule the first time it is read (PEP 562).

    Raises:
        AttributeError: ``name`` is neither.

    Examples:
        >>> import fvstep
        >>> fvstep.TrainState.__name__
        'TrainState'
    """
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:  # a submodule (fvstep.checkpoint, fvstep.parallel, ...): importing binds it
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every public name of the face, imported or not."""
    return sorted({*globals(), *__all__})
