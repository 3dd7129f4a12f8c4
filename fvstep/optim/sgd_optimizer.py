"""SGD with optional (Nesterov) momentum: the state class, the optimizer and its factory.

:func:`sgd` builds an :class:`SGD`; its state is an :class:`SGDState` (every momentum
buffer allocated at ``init``, with a flag for torch's lazy first-step buffer). ``update``
calls ``torch.optim.sgd.sgd`` with the implementation ``torch.optim.SGD`` would pick.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch.optim.sgd import sgd as _torch_sgd

from fvstep.optim.base import (
    LearningRate,
    _as_learning_rate,
    _check_flag,
    _check_fused_params,
    _check_impl_flags,
    _check_nonnegative,
    _check_params,
    _check_state_dict,
    _grad_names,
    _new_count,
    _resolve_impl,
    _scheduled_learning_rate,
    _zeros_like,
)
from fvstep.tree import frozen

__all__ = ["SGD", "SGDState", "sgd"]


@frozen
class SGDState:
    """State of :class:`SGD`; every leaf is a tensor, dicts are keyed by param name.

    Attributes:
        count: 0-d int64 CPU tensor, the number of updates applied (drives the schedule).
        momentum_buffer: Momentum buffers ``b``, ``zeros_like(param)`` at init and set to
            torch's ``clone(grad)`` on a param's first step; ``{}`` when momentum is 0.
        initialized: Per-param 0-d bool CPU tensor, whether the param's momentum buffer
            holds torch's buffer (i.e. the param has had a gradient); ``{}`` when momentum
            is 0.
    """

    count: torch.Tensor
    momentum_buffer: dict[str, torch.Tensor]
    initialized: dict[str, torch.Tensor]


@attrs.frozen(kw_only=True)
class SGD:
    """The optimizer that :func:`sgd` returns: SGD's hyper-parameters, ``init``, ``update``.

    Build it with :func:`sgd`, which documents each field, its default and the update
    equations. The fields are read-only and checked on construction (``ValueError`` out of
    range, ``TypeError`` of the wrong kind).
    """

    lr: LearningRate = attrs.field(converter=_as_learning_rate)
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    foreach: bool | None
    fused: bool | None

    def __attrs_post_init__(self) -> None:
        _check_nonnegative("momentum", self.momentum)
        if isinstance(self.dampening, bool) or not isinstance(self.dampening, (int, float)):
            raise TypeError(f"dampening must be a float, got {type(self.dampening).__name__}")
        _check_nonnegative("weight_decay", self.weight_decay)
        _check_flag("nesterov", self.nesterov)
        _check_flag("maximize", self.maximize)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _check_impl_flags(self.foreach, self.fused)

    @property
    def needs_fp32_master(self) -> bool:
        """True: SGD's small updates are rounded away in bf16/fp16 params."""
        return True

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        lr = self.lr
        return _scheduled_learning_rate(lr, count) if callable(lr) else lr

    def init(self, params: Mapping[str, torch.Tensor]) -> SGDState:
        """Allocate every momentum buffer for ``params`` eagerly (zeros, not initialized).

        Args:
            params: The trainable params by name (tensors, ``nn.Parameter`` s or DTensors).

        Returns:
            An :class:`SGDState` with ``count = 0``; without momentum its dicts are empty.

        Raises:
            ValueError: If ``fused=True`` and a param is not a floating-point tensor on a
                device with fused kernels.
        """
        _check_params(params)
        if self.fused:
            _check_fused_params(params)
        momentum_buffer: dict[str, torch.Tensor] = {}
        initialized: dict[str, torch.Tensor] = {}
        if self.momentum != 0:
            with torch.no_grad():
                for name, p in params.items():
                    momentum_buffer[name] = _zeros_like(p)
                    initialized[name] = torch.zeros((), dtype=torch.bool)
        return SGDState(
            count=_new_count(), momentum_buffer=momentum_buffer, initialized=initialized
        )

    def check_state(self, params: Mapping[str, torch.Tensor], state: SGDState) -> None:
        """Raise unless ``state`` is an SGD state that :meth:`init` would give ``params``.

        Checks the structure that :meth:`update` relies on without checking it again:
        with momentum, ``momentum_buffer`` and ``initialized`` have exactly the params'
        names, each its own tensor, and every buffer the param's shape and dtype; without,
        both are empty.
        ``TrainState.create`` runs it once, and a state loaded from elsewhere needs it
        once before its first update.

        Args:
            params: The params by name, the same names as at :meth:`init`.
            state: The state to check.

        Raises:
            TypeError: If ``state`` is not an :class:`SGDState`, or params is not a
                mapping of names to tensors.
            ValueError: If a dict's names differ from the params', a buffer's shape from
                its param's, or the dicts disagree with ``momentum``.

        Examples:
            >>> opt = sgd(0.1, momentum=0.9)
            >>> opt.check_state(params, opt.init(params))  # passes
        """
        if not isinstance(state, SGDState):
            raise TypeError(f"state must be an SGDState, got {type(state).__name__}")
        _check_params(params)
        has_momentum = self.momentum != 0
        _check_state_dict(
            "momentum_buffer", state.momentum_buffer, params, expected=has_momentum, like_param=True
        )
        _check_state_dict(
            "initialized", state.initialized, params, expected=has_momentum, like_param=False
        )

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: SGDState,
    ) -> SGDState:
        """Apply one SGD update in place to ``params`` and ``state``'s tensors.

        torch creates a momentum buffer lazily as ``clone(grad)`` on a param's first step;
        for a param whose ``initialized`` flag is off this passes ``None`` to torch's kernel,
        copies the buffer torch creates into the eager buffer and sets the flag.

        With ``fused=True``, torch's fused kernel only creates buffers when none exist yet
        (``torch.optim.SGD(fused=True)`` raises a ``TypeError`` when a param gets its first
        gradient after others did); here such params are updated in a separate first-step
        call of the same kernel, which is elementwise, so every case torch supports is
        unchanged.

        As in ``torch.optim.SGD``, torch's foreach kernel adds the momentum term into the
        gradient tensors in place when ``nesterov`` (without ``maximize`` or weight decay):
        pass copies of ``grads`` if they are needed afterwards.

        Args:
            params: The params by name, the same names as at :meth:`init`.
            grads: Gradients by name; a name that is missing or maps to ``None`` is
                skipped (as ``torch.optim`` skips a param whose ``.grad`` is ``None``).
            state: The state from :meth:`init`, the previous :meth:`update`, or one that
                passed :meth:`check_state` (a loaded one). Its tensors are updated in
                place, so it must not be reused afterwards.

        Returns:
            A new :class:`SGDState` holding the (in-place updated) tensors, ``count``
            incremented by one.

        Raises:
            ValueError: If grads has names not in params, a grad's shape, dtype or device
                differs from its param's, a grad is sparse, or (with momentum) params has
                other names than the state.
            TypeError: If ``state`` is not an :class:`SGDState`.
        """
        if not isinstance(state, SGDState):
            raise TypeError(f"state must be an SGDState, got {type(state).__name__}")
        # The state's structure was checked once (init, check_state); see base.py.
        has_momentum = self.momentum != 0
        buffers_of = ("momentum_buffer", state.momentum_buffer) if has_momentum else None
        names = _grad_names(params, grads, buffers_of, [buffers_of] if buffers_of else [])
        lr = self.learning_rate(int(state.count))
        foreach, fused = _resolve_impl((params[n] for n in names), self.foreach, self.fused)
        # torch.optim.SGD passes [] without momentum, else state.get("momentum_buffer").
        buffers: list[torch.Tensor | None] = []
        if has_momentum:
            buffers = [
                state.momentum_buffer[n] if bool(state.initialized[n]) else None for n in names
            ]
        # torch's fused SGD kernel only creates buffers when *all* of them are missing (it
        # fails on a mix); run the not-yet-initialized params as a separate first-step call.
        # The kernels are elementwise, so this equals one call wherever torch's works.
        groups = [list(range(len(names)))]
        if fused and has_momentum and None in buffers and any(b is not None for b in buffers):
            groups = [
                [i for i, b in enumerate(buffers) if b is None],
                [i for i, b in enumerate(buffers) if b is not None],
            ]
        with torch.no_grad():
            for group in groups:
                group_buffers = [buffers[i] for i in group] if has_momentum else []
                _torch_sgd(
                    [params[names[i]] for i in group],
                    [grads[names[i]] for i in group],  # type: ignore[misc]
                    group_buffers,
                    has_sparse_grad=False,
                    foreach=foreach,
                    fused=fused,
                    grad_scale=None,
                    found_inf=None,
                    weight_decay=self.weight_decay,
                    momentum=self.momentum,
                    lr=lr,
                    dampening=self.dampening,
                    nesterov=self.nesterov,
                    maximize=self.maximize,
                )
                # torch writes the buffers it creates back into the list (`list[i] = clone`).
                if has_momentum:
                    for i, buf in zip(group, group_buffers, strict=True):
                        buffers[i] = buf
            for name, buf in zip(names if has_momentum else [], buffers, strict=True):
                eager = state.momentum_buffer[name]
                if buf is None:
                    raise RuntimeError(
                        f"torch's sgd kernel created no momentum buffer for '{name}'"
                    )
                if buf is not eager:
                    eager.copy_(buf)
                    state.initialized[name].fill_(True)
            state.count.add_(1)
        return SGDState(
            count=state.count,
            momentum_buffer=dict(state.momentum_buffer),
            initialized=dict(state.initialized),
        )


def sgd(
    lr: LearningRate = 1e-3,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> SGD:
    r"""SGD with optional (Nesterov) momentum, bitwise identical to ``torch.optim.SGD``.

    For each param :math:`\theta` with gradient :math:`g` (negated if ``maximize``) and
    learning rate :math:`\gamma` = ``learning_rate(count)``:

    .. math::
        g &\leftarrow g + \lambda \theta \\
        b &\leftarrow g \text{ on the param's first step, else } \mu b + (1 - \tau) g \\
        g &\leftarrow g + \mu b \text{ if nesterov else } b \quad (\text{if } \mu \ne 0) \\
        \theta &\leftarrow \theta - \gamma g

    A param whose grad is ``None`` is skipped (its momentum buffer stays untouched and
    uninitialized). The defaults are ``torch.optim.SGD``'s.

    Args:
        lr: Learning rate (finite, ``>= 0``), or a schedule ``count -> lr`` of the
            optimizer's own update count.
        momentum: Momentum factor :math:`\mu`, ``>= 0`` (``0`` keeps no state besides
            ``count``).
        dampening: Dampening :math:`\tau` of the momentum (not applied on a param's first
            step).
        weight_decay: L2 penalty :math:`\lambda`, ``>= 0``.
        nesterov: Nesterov momentum; requires ``momentum > 0`` and ``dampening == 0``.
        maximize: Maximize the objective.
        foreach: ``None`` picks torch's default for the params' device (foreach on
            CUDA-like devices, the single-tensor loop on CPU).
        fused: Use torch's fused kernel (CPU and CUDA support it); only when asked for.
            Avoid it for bf16/fp16 params with momentum on CPU: torch's CPU kernel
            (``FusedSGDKernel.cpp``) loads such a momentum buffer as float32, reading past
            its end, so neither torch nor this is deterministic there.

    Returns:
        The :class:`SGD` optimizer.

    Raises:
        ValueError: On out-of-range hyper-parameters, nesterov without momentum or with
            dampening, or ``foreach=fused=True``.
        TypeError: On a hyper-parameter of the wrong kind.

    Examples:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
        >>> state = opt.init(params)
        >>> state = opt.update(params, grads, state)
    """
    return SGD(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        foreach=foreach,
        fused=fused,
    )
