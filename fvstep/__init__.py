"""fvstep: training methods for video diffusion models as pure step functions over state pytrees.

The public API (DESIGN.md): ``TrainState``, ``Role``, ``EMA``, ``update``, ``sequence``,
``every``, ``cond``, ``managed``, ``compile``, ``plan``, ``Step``, ``Accumulation``,
``Validation`` (what ``run`` evaluates, and when),
``clip_grad_norm``, the errors a step raises (``ConsumedStateError``,
``NonFiniteGradientError``, ``StepFailedError``), and the modules ``tree``, ``random``,
``optim``, ``schedules``.

Every step built here runs with FSDP2's handling (``fvstep.parallel.FSDP2Parallelism``)
unless given another ``parallelism``: the step constructors of this face are those of
the core (:mod:`fvstep.update`, :mod:`fvstep.compose`, :mod:`fvstep.stepfn`), which know
only the :class:`fvstep.sync.Parallelism` protocol, with the FSDP2 layout injected.

The face is lazy (PEP 562): ``import fvstep`` imports no torch; each name and submodule
is imported the first time it is read (``fvstep.TrainState``, ``from fvstep import
update``), so the ``fvstep`` command answers ``--help`` without loading torch,
FSDP2 or diffusers. ``dir(fvstep)`` and ``__all__`` list every name.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from fvstep import checkpoint, data, optim, random, schedules, tree
    from fvstep.accumulation import Accumulation
    from fvstep.compose import compile, cond, every, managed, sequence
    from fvstep.executor import Checkpoints, RunResult, Validation, run, run_until
    from fvstep.grads import NonFiniteGradientError, clip_grad_norm
    from fvstep.parallel import FSDP2Parallelism as FSDP2Parallelism
    from fvstep.state import EMA, ConsumedStateError, Role, TrainState
    from fvstep.stepfn import Step, StepFailedError, plan
    from fvstep.update import update

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

_NAMES = {
    "Accumulation": "fvstep.accumulation",
    "Checkpoints": "fvstep.executor",
    "ConsumedStateError": "fvstep.state",
    "EMA": "fvstep.state",
    "FSDP2Parallelism": "fvstep.parallel",
    "NonFiniteGradientError": "fvstep.grads",
    "Role": "fvstep.state",
    "RunResult": "fvstep.executor",
    "Step": "fvstep.stepfn",
    "StepFailedError": "fvstep.stepfn",
    "TrainState": "fvstep.state",
    "Validation": "fvstep.executor",
    "clip_grad_norm": "fvstep.grads",
    "plan": "fvstep.stepfn",
    "run": "fvstep.executor",
    "run_until": "fvstep.executor",
}
"""Names re-exported from the module that defines them, imported on first read."""

_ON_FSDP2 = {
    "update": "fvstep.update",
    "sequence": "fvstep.compose",
    "every": "fvstep.compose",
    "cond": "fvstep.compose",
    "managed": "fvstep.compose",
    "compile": "fvstep.compose",
}
"""The core's step constructors, served with the FSDP2 parallelism injected (``_face``)."""

_S = TypeVar("_S", bound="Step")


def _on_fsdp2(step: _S) -> _S:
    """``step`` with the FSDP2 parallelism, unless its call settings name one already."""
    import attrs

    from fvstep.parallel import FSDP2Parallelism

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


@functools.cache
def _constructor(name: str) -> Callable[..., Any]:
    """The face's ``name`` (one of ``_ON_FSDP2``), built once."""
    return _face(getattr(importlib.import_module(_ON_FSDP2[name]), name))


def __getattr__(name: str) -> Any:
    """Import a public name or submodule the first time it is read (PEP 562).

    Args:
        name: An attribute of the package that is not bound yet.

    Returns:
        The object: a re-exported name, a face step constructor, or a submodule.

    Raises:
        AttributeError: ``name`` is none of these.

    Examples:
        >>> import fvstep
        >>> fvstep.TrainState.__name__
        'TrainState'
    """
    if name in _ON_FSDP2:
        return _constructor(name)
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:  # a submodule (fvstep.checkpoint, fvstep.state, ...): importing binds it
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every name of the face, imported or not.

    Returns:
        The bound names plus the public ones served on first read, sorted.

    Examples:
        >>> import fvstep
        >>> "TrainState" in dir(fvstep)
        True
    """
    return sorted({*globals(), *__all__, *_NAMES})


class _Face(types.ModuleType):
    """The package module: ``fvstep.update`` is the step constructor, not the submodule.

    Importing the submodule ``fvstep.update`` (which the executor does) binds it as an
    attribute of the package; a data descriptor on the module's class takes precedence
    over that binding, so ``fvstep.update`` stays the face's constructor, as the
    eager face had it.
    """

    @property
    def update(self) -> Callable[..., Any]:
        return self.__dict__.get("_update_override") or _constructor("update")

    @update.setter
    def update(self, value: Any) -> None:
        if isinstance(value, types.ModuleType):  # the import system binding the submodule
            return
        self.__dict__["_update_override"] = value

    @update.deleter
    def update(self) -> None:
        self.__dict__.pop("_update_override", None)


sys.modules[__name__].__class__ = _Face
