"""fvstep: training methods for video diffusion models as pure step functions over state pytrees.

The public API is ``__all__``: the state (``TrainState``, ``Role``, ``EMA``), the steps
(``update``, ``sequence``, ``every``, ``cond``, ``managed``, ``compile``, ``plan``), the
loop (``run``, ``Checkpoints``), the errors a step raises, and the modules ``tree``,
``random``, ``optim``, ``schedules``, ``checkpoint``, ``data``. The face is lazy (PEP 562):
``import fvstep`` imports no torch, so the ``fvstep`` command answers ``--help`` quickly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from fvstep import checkpoint
    from fvstep.core import optim, random, schedules, tree
    from fvstep.core.accumulation import Accumulation
    from fvstep.core.engine import Step
    from fvstep.core.errors import (
        ConsumedStateError,
        Interrupted,
        NonFiniteGradientError,
        StepFailedError,
    )
    from fvstep.core.grads import clip_grad_norm
    from fvstep.core.managed import managed
    from fvstep.core.state import EMA, Role, TrainState
    from fvstep.core.steps import compile, cond, every, plan, sequence, update
    from fvstep.executor import data
    from fvstep.executor.checkpoints import Checkpoints
    from fvstep.executor.loop import RunResult, run, run_until
    from fvstep.executor.reporting import Validation

__version__ = "0.1.0.dev0"

_NAMES = {
    "Accumulation": "fvstep.core.accumulation",
    "Checkpoints": "fvstep.executor.checkpoints",
    "ConsumedStateError": "fvstep.core.errors",
    "EMA": "fvstep.core.state",
    "Interrupted": "fvstep.core.errors",
    "NonFiniteGradientError": "fvstep.core.errors",
    "Role": "fvstep.core.state",
    "RunResult": "fvstep.executor.loop",
    "Step": "fvstep.core.engine",
    "StepFailedError": "fvstep.core.errors",
    "TrainState": "fvstep.core.state",
    "Validation": "fvstep.executor.reporting",
    "clip_grad_norm": "fvstep.core.grads",
    "compile": "fvstep.core.steps",
    "cond": "fvstep.core.steps",
    "every": "fvstep.core.steps",
    "managed": "fvstep.core.managed",
    "plan": "fvstep.core.steps",
    "run": "fvstep.executor.loop",
    "run_until": "fvstep.executor.loop",
    "sequence": "fvstep.core.steps",
    "update": "fvstep.core.steps",
}
"""Each public name and the module that defines it, imported on first read."""

_MODULES = {
    "data": "fvstep.executor.data",
    "optim": "fvstep.core.optim",
    "random": "fvstep.core.random",
    "schedules": "fvstep.core.schedules",
    "tree": "fvstep.core.tree",
}
"""The public modules that live in a layer's folder (``fvstep.tree`` is ``fvstep.core.tree``)."""

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
    """Import a public name or submodule the first time it is read (PEP 562)."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        module = importlib.import_module(_MODULES[name])
        globals()[name] = module
        return module
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
