"""Functional optimizers over explicit state pytrees, bit-identical to ``torch.optim``.

As in optax, each optimizer is one factory (:func:`adamw`, :func:`sgd`) that documents and
takes the hyper-parameters and returns a small frozen, hashable :mod:`attrs` object
(:class:`AdamW`, :class:`SGD`: static metadata, not a pytree) with a pure pair of methods.
Its state is a separate pytree (an ``fvstep.tree.frozen`` class whose leaves are tensors)
created by :meth:`~Optimizer.init` and advanced by :meth:`~Optimizer.update`::

    opt = adamw(1e-4, weight_decay=0.01)
    opt_state = opt.init(params)  # every moment allocated eagerly
    opt_state = opt.update(params, grads, opt_state)  # params updated in place

The arithmetic is done by PyTorch's own functional kernels (``torch.optim.adamw.adamw``,
``torch.optim.sgd.sgd``) with the same single-tensor / foreach / fused implementation that
``torch.optim.AdamW`` / ``torch.optim.SGD`` would pick, so a run is bitwise identical to the
corresponding ``torch.optim`` run (with a ``torch.optim.lr_scheduler.LambdaLR`` stepped
once per optimizer step when the learning rate is a schedule).

Unlike ``torch.optim``, every moment exists from :meth:`~Optimizer.init` on, so a
checkpoint always has a target to load into. Lazy-initialisation details of torch are
reproduced exactly: AdamW's per-parameter ``step`` stays ``0`` until the parameter first
gets a gradient, and SGD's momentum buffer is set to (a copy of) torch's
``clone(grad)`` on a parameter's first step, tracked by a per-parameter ``initialized``
flag.

Parameters may be plain tensors, ``nn.Parameter`` s or DTensors (FSDP2 sharded parameters):
moments are allocated with ``torch.zeros_like`` (which keeps DTensor placements).

The structure of params and state is checked once, not on every update:
:meth:`~Optimizer.init` checks the params, and :meth:`~Optimizer.check_state` a state that
``init`` did not just make (``TrainState.create`` runs it; so must a load). ``update``
checks only what it is handed anew: the state's class, the params' names against the
state's, and each grad against its param (shape, dtype, device, dense), before any kernel
runs.

Where things live: :mod:`fvstep.optim.base` (:class:`Optimizer`, :data:`LearningRate`),
:mod:`fvstep.optim.adamw_optimizer` (:func:`adamw`, :class:`AdamW`, :class:`AdamWState`),
:mod:`fvstep.optim.sgd_optimizer` (:func:`sgd`, :class:`SGD`, :class:`SGDState`); every
public name is importable as ``fvstep.optim.<name>``.
"""

from fvstep.optim.adamw_optimizer import AdamW, AdamWState, adamw
from fvstep.optim.base import LearningRate, Optimizer
from fvstep.optim.sgd_optimizer import SGD, SGDState, sgd

__all__ = [
    "SGD",
    "AdamW",
    "AdamWState",
    "LearningRate",
    "Optimizer",
    "SGDState",
    "adamw",
    "sgd",
]
