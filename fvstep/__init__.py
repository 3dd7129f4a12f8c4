"""fvstep: training methods for video diffusion models as pure step functions over state pytrees.

The public API (DESIGN.md): ``TrainState``, ``Role``, ``EMA``, ``update``, ``sequence``,
``every``, ``cond``, ``managed``, ``compile``, ``plan``, ``Accumulation``,
``clip_grad_norm``, the errors a step raises (``ConsumedStateError``,
``NonFiniteGradientError``, ``StepFailedError``), and the modules ``tree``, ``random``,
``optim``, ``schedules``.
"""

from fvstep import checkpoint, data, optim, random, schedules, tree
from fvstep.accumulation import Accumulation
from fvstep.compose import cond, every, managed, sequence
from fvstep.executor import Checkpoints, run
from fvstep.grads import NonFiniteGradientError, clip_grad_norm
from fvstep.state import EMA, ConsumedStateError, Role, TrainState
from fvstep.stepfn import Step, StepFailedError, compile, plan
from fvstep.update import update

__version__ = "0.1.0.dev0"

__all__ = [
    "EMA",
    "Accumulation",
    "Checkpoints",
    "ConsumedStateError",
    "NonFiniteGradientError",
    "Role",
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
    "schedules",
    "sequence",
    "tree",
    "update",
]
