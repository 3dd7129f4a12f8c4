"""Functional optimizers over explicit state pytrees, bit-identical to ``torch.optim``.

As in optax, each optimizer is one factory (:func:`adamw`, :func:`sgd`) that documents the
hyper-parameters and returns a frozen, hashable object (:class:`AdamW`, :class:`SGD`:
static metadata) with the pure methods of :class:`Optimizer`, over a separate state pytree
(:class:`AdamWState`, :class:`SGDState`) whose every moment exists from ``init`` on::

    opt = adamw(1e-4, weight_decay=0.01)
    opt_state = opt.init(params)  # every moment allocated eagerly
    opt_state = opt.update(params, grads, opt_state)  # params updated in place

Both are one mechanism over PyTorch's functional kernels (``torch.optim.adamw.adamw``,
``torch.optim.sgd.sgd``) with the implementation ``torch.optim`` would pick, and torch's
lazy initialisation reproduced: a run is bitwise the ``torch.optim`` run. Where things
live: :mod:`fvstep.core.optim.base` (:class:`Optimizer`, :data:`LearningRate`) and
:mod:`fvstep.core.optim.kernel` (the rest); every public name is ``fvstep.core.optim.<name>``.
"""

from fvstep.core.optim.base import LearningRate, Optimizer
from fvstep.core.optim.kernel import SGD, AdamW, AdamWState, SGDState, adamw, sgd

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
