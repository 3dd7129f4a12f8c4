"""Functional optimizers over explicit state pytrees, bit-identical to ``torch.optim``.

As in optax, each optimizer is one factory (:func:`adamw`, :func:`sgd`) returning static
metadata with the pure methods of :class:`Optimizer` over a separate state pytree; both run
PyTorch's functional kernels, so a run is bitwise the ``torch.optim`` run::

    opt = adamw(1e-4, weight_decay=0.01)
    opt_state = opt.init(params)
    opt_state = opt.update(params, grads, opt_state)  # params updated in place
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
