"""Learning-rate schedules as pure functions of the step count, in the style of optax.

A schedule is a plain function ``step -> lr`` (:data:`Schedule`). Factories such as
:func:`warmup_cosine` validate their hyper-parameters once and return such a function;
the returned function holds no state, so the LR at step ``n`` is the same however many
times, and in whatever order, it is asked for. This makes the LR a function of the step
counter stored in a checkpoint rather than of a scheduler object's history.

Bit-identity with diffusers and torch:
    Every schedule that has a counterpart in ``diffusers.optimization`` computes its
    multiplier with the same floating-point operations, in the same order, as the
    corresponding diffusers ``lr_lambda``, and returns ``lr * factor`` exactly as
    :class:`torch.optim.lr_scheduler.LambdaLR` does (``base_lr * lmbda(epoch)``). The
    value at step ``n`` is therefore bit-identical to ``optimizer.param_groups[0]["lr"]``
    after ``n`` calls of ``scheduler.step()`` on the scheduler built by diffusers'
    ``get_scheduler`` (or the ``get_*_schedule_with_warmup`` function) with the same
    hyper-parameters:

    ===============================  ==============================================
    fvstep                           diffusers / torch
    ===============================  ==============================================
    :func:`constant`                 ``"constant"``
    :func:`constant_with_warmup`     ``"constant_with_warmup"``
    :func:`warmup_cosine`            ``"cosine"`` (``min_ratio=0``)
    :func:`cosine`                   ``"cosine"`` with no warmup (``min_ratio=0``)
    :func:`warmup_cosine_restarts`   ``"cosine_with_restarts"``
    :func:`warmup_linear`            ``"linear"`` (``min_ratio`` is ``f_min``)
    :func:`polynomial`               ``"polynomial"`` (``end_lr`` is ``lr_end``)
    :func:`piecewise_constant`       ``"piecewise_constant"`` (absolute values)
    :func:`constant_with_warmup`     torch ``LinearLR`` closed form (``init_ratio``)
    ===============================  ==============================================

    Note that diffusers' ``get_scheduler`` does not forward ``num_cycles`` to the
    ``"cosine"`` schedule nor ``lr_end`` to the ``"polynomial"`` one; the equalities for
    other values of those arguments hold against ``get_cosine_schedule_with_warmup`` and
    ``get_polynomial_decay_schedule_with_warmup`` called directly.

Length:
    A schedule counts the optimizer's *updates*, not the run's steps (a role updated every
    second step makes half as many updates). The decaying schedules carry the length they
    are laid out over as ``schedule.total_steps``; :func:`fvstep.run` warns
    (``fvstep.executor.schedule_check.ScheduleLengthWarning``) when it differs from the updates the
    role will have made at ``num_steps``.

Errors:
    Factories raise ``ValueError`` for out-of-range hyper-parameters (negative step
    counts or LRs, ``warmup_steps > total_steps``, ratios outside ``[0, 1]``, ...) and
    ``TypeError`` for values of the wrong kind (a float where a step count is expected).
    Schedules raise ``ValueError`` for a negative step and ``TypeError`` for a step that is
    not an integer (a Python int, NumPy integer or integer tensor of one element).

Where things live: :mod:`fvstep.core.schedules.base` (:data:`Schedule` and the argument
checks), :mod:`fvstep.core.schedules.flat` (:func:`constant`, :func:`constant_with_warmup`),
:mod:`fvstep.core.schedules.decay` (the cosine, linear and polynomial decays after a warmup),
:mod:`fvstep.core.schedules.segments` (:func:`join`, :func:`piecewise_constant`); every name is
importable as ``fvstep.core.schedules.<name>``.

Examples:
    >>> sched = join([constant_with_warmup(1e-3, warmup_steps=100), constant(1e-4)], [1000])
    >>> sched(50), sched(999), sched(1000)
    (0.0005, 0.001, 0.0001)
"""

from fvstep.core.schedules.base import Schedule
from fvstep.core.schedules.decay import (
    cosine,
    linear_decay,
    polynomial,
    warmup_cosine,
    warmup_cosine_restarts,
    warmup_linear,
)
from fvstep.core.schedules.flat import constant, constant_with_warmup
from fvstep.core.schedules.segments import join, piecewise_constant

__all__ = [
    "Schedule",
    "constant",
    "constant_with_warmup",
    "cosine",
    "join",
    "linear_decay",
    "piecewise_constant",
    "polynomial",
    "warmup_cosine",
    "warmup_cosine_restarts",
    "warmup_linear",
]
