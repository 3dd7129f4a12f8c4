"""fvstep: training methods for video diffusion models as pure step functions over state pytrees.

The public API (DESIGN.md): ``TrainState``, ``Role``, ``EMA``, ``update``, ``sequence``,
``every``, ``cond``, ``managed``, ``compile``, ``plan``, ``Step``, ``Accumulation``,
``clip_grad_norm``, the errors a step raises (``ConsumedStateError``,
``NonFiniteGradientError``, ``StepFailedError``), and the modules ``tree``, ``random``,
``optim``, ``schedules``.

Every step built here runs with FSDP2's handling (``fvstep.parallel.FSDP2Parallelism``)
unless given another ``parallelism``: the step constructors of this face are those of
the core (:mod:`fvstep.update`, :mod:`fvstep.compose`, :mod:`fvstep.stepfn`), which know
only the :class:`fvstep.sync.Parallelism` protocol, with the FSDP2 layout injected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from fvstep import checkpoint, data, optim, random, schedules, tree
from fvstep import compose as _compose
from fvstep.accumulation import Accumulation
from fvstep.executor import Checkpoints, RunResult, run, run_until
from fvstep.grads import NonFiniteGradientError, clip_grad_norm
from fvstep.parallel import FSDP2Parallelism
from fvstep.state import EMA, ConsumedStateError, Role, TrainState
from fvstep.stepfn import Step, StepFailedError, plan
from fvstep.update import update as _update

__version__ = "0.1.0.dev0"

__all__ = [
    "EMA",
    "Accumulation",
    "Checkpoints",
    "ConsumedStateError",
    "NonFiniteGradientError",
    "Role",
    "RunResult",
    "Step",
    "StepFailedError",
    "TrainState",
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

_S = TypeVar("_S", bound=Step)


def _on_fsdp2(step: _S) -> _S:
    """``step`` with the FSDP2 parallelism, unless its call settings name one already."""
    if step.settings.parallelism is not None:
        return step
    settings = attrs.evolve(step.settings, parallelism=FSDP2Parallelism())
    return attrs.evolve(step, settings=settings)  # type: ignore[misc]


def _face(core: Callable[..., _S]) -> Callable[..., _S]:
    """The core constructor ``core``, its steps run with FSDP2 (same signature and docs)."""

    @functools.wraps(core)
    def build(*args: Any, **kwargs: Any) -> _S:
        return _on_fsdp2(core(*args, **kwargs))

    build.__module__ = __name__
    return build


update = _face(_update)
sequence = _face(_compose.sequence)
every = _face(_compose.every)
cond = _face(_compose.cond)
managed = _face(_compose.managed)
compile = _face(_compose.compile)
