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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar, runtime_checkable

import attrs
import torch
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.sgd import sgd as _torch_sgd

from fvstep import (
    _compat as torch_compat,  # not `_compat`: attrs-generated methods read that global
)
from fvstep._checks import check_learning_rate
from fvstep.tree import frozen

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

LearningRate = float | Callable[[int], float]
"""A constant learning rate, or a schedule: the learning rate as a function of the
optimizer's own update count (``0`` for the first update)."""

StateT = TypeVar("StateT")


@runtime_checkable
class Optimizer(Protocol[StateT]):
    """The interface of an fvstep optimizer with state type ``StateT``.

    An optimizer is immutable static metadata (its hyper-parameters); all mutable data
    lives in the state pytree returned by :meth:`init`.
    """

    @property
    def needs_fp32_master(self) -> bool:
        """Whether updates are rounded away in bf16/fp16 params (an fp32 master copy is needed)."""
        ...

    def init(self, params: Mapping[str, torch.Tensor]) -> StateT:
        """Allocate the full optimizer state for ``params`` (every moment, eagerly)."""
        ...

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: StateT,
    ) -> StateT:
        """Apply one update in place to ``params`` and the state's tensors; return the new state."""
        ...

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        ...


# --------------------------------------------------------------------------------------
# State classes
# --------------------------------------------------------------------------------------


@frozen
class AdamWState:
    """State of :class:`AdamW`; every leaf is a tensor, dicts are keyed by param name.

    Attributes:
        count: 0-d int64 CPU tensor, the number of updates applied (drives the schedule).
        step: Per-param step tensor exactly as ``torch.optim.AdamW`` creates it: a 0-d
            float32 CPU tensor (float64 if that is the default dtype at :meth:`AdamW.init`),
            or a 0-d float32 tensor on the param's device when ``fused=True``. It counts the
            updates in which the param had a gradient (the bias-correction step ``t``).
        exp_avg: First moments ``m``, ``zeros_like(param)`` at init.
        exp_avg_sq: Second moments ``v``, ``zeros_like(param)`` at init.
        max_exp_avg_sq: ``max`` of second moments (amsgrad), ``{}`` when amsgrad is off.
    """

    count: torch.Tensor
    step: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    max_exp_avg_sq: dict[str, torch.Tensor]


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


# --------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------


def _new_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _as_learning_rate(lr: LearningRate) -> LearningRate:
    """A schedule as it is; a constant checked and made a ``float``."""
    return lr if callable(lr) else check_learning_rate(lr, "lr")


def _learning_rate(lr: LearningRate, count: int) -> float:
    if callable(lr):
        return check_learning_rate(
            lr(count), f"the learning-rate schedule's value at count {count}"
        )
    return lr


def _as_betas(betas: tuple[float, float]) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"betas[{i}] must be a float, got {type(beta).__name__}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} (must be in [0, 1))")
    return (betas[0], betas[1])


def _check_flag(name: str, value: object, *, optional: bool = False) -> None:
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "a bool or None" if optional else "a bool"
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}: {value!r}")


def _check_nonnegative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}: {value!r}")
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name} value: {value} (must be >= 0)")


def _check_impl_flags(foreach: bool | None, fused: bool | None) -> None:
    _check_flag("foreach", foreach, optional=True)
    _check_flag("fused", fused, optional=True)
    if foreach and fused:
        raise ValueError("`fused` and `foreach` cannot be `True` together.")


def _check_params(params: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping of names to tensors, got {type(params).__name__}"
        )
    for name, p in params.items():
        if not isinstance(name, str):
            raise TypeError(f"param names must be strings, got {name!r}")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"param '{name}' must be a tensor, got {type(p).__name__}")


def _check_fused_params(params: Mapping[str, torch.Tensor]) -> None:
    supported = torch_compat.fused_kernel_devices()
    for name, p in params.items():
        if p.device.type not in supported or not torch.is_floating_point(p):
            raise ValueError(
                "`fused=True` requires all the params to be floating point tensors on a "
                f"supported device ({supported}), but param '{name}' is {p.dtype} on "
                f"{p.device.type}"
            )


def _check_grads(
    params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor | None]
) -> list[str]:
    """Validate ``grads`` against ``params``; the names (in params order) that have a grad."""
    if not isinstance(grads, Mapping):
        raise TypeError(f"grads must be a mapping of names to tensors, got {type(grads).__name__}")
    unknown = [n for n in grads if n not in params]
    if unknown:
        raise ValueError(
            f"grads has names that are not in params: {sorted(map(str, unknown))[:10]}"
            f" (params has {len(params)} names, e.g. {list(params)[:5]})"
        )
    names = []
    for name, p in params.items():
        g = grads.get(name)
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grad of '{name}' must be a tensor or None, got {type(g).__name__}")
        if g.shape != p.shape:
            raise ValueError(
                f"grad of '{name}' has shape {tuple(g.shape)} but the param has shape "
                f"{tuple(p.shape)}"
            )
        if g.dtype != p.dtype:
            raise ValueError(
                f"grad of '{name}' has dtype {g.dtype} but the param has dtype {p.dtype}"
            )
        if g.device != p.device:
            raise ValueError(f"grad of '{name}' is on {g.device} but the param is on {p.device}")
        if g.is_sparse:
            raise ValueError(f"grad of '{name}' is sparse; sparse gradients are not supported")
        names.append(name)
    return names


def _check_state_dict(
    field_name: str,
    tensors: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *,
    expected: bool,
    like_param: bool,
) -> None:
    """Check that ``state.<field_name>`` has exactly the keys of params (or none)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"state.{field_name} must be a dict, got {type(tensors).__name__}")
    if not expected:
        if tensors:
            raise ValueError(
                f"state.{field_name} must be empty for this optimizer's configuration, "
                f"but has {len(tensors)} entries (was the state made by another optimizer?)"
            )
        return
    if tensors.keys() != params.keys():
        missing = sorted(set(params) - set(tensors))
        extra = sorted(set(tensors) - set(params))
        raise ValueError(
            f"state.{field_name} keys do not match the params: missing {missing[:10]}, "
            f"unexpected {extra[:10]} (was the state made by init() for these params?)"
        )
    if like_param:
        for name, p in params.items():
            t = tensors[name]
            if t.shape != p.shape:
                raise ValueError(
                    f"state.{field_name}['{name}'] has shape {tuple(t.shape)} but the param "
                    f"has shape {tuple(p.shape)}"
                )


def _resolve_impl(
    params: Iterable[torch.Tensor], foreach: bool | None, fused: bool | None
) -> tuple[bool, bool]:
    """(foreach, fused) as ``torch.optim`` resolves them for ``params`` (those with grads).

    ``None`` for both means torch's default for the params' device and type
    (:func:`fvstep._compat.default_foreach`: foreach on foreach-capable devices such as
    CUDA, the single-tensor loop on CPU); fused is only used when asked for.
    """
    if foreach is None and fused is None:
        foreach = torch_compat.default_foreach(list(params))
    return bool(foreach), bool(fused)


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


# --------------------------------------------------------------------------------------
# AdamW
# --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AdamW:
    """The optimizer that :func:`adamw` returns: AdamW's hyper-parameters, ``init``, ``update``.

    Build it with :func:`adamw`, which documents each field, its default and the update
    equations. The fields are read-only and checked on construction (``ValueError`` out of
    range, ``TypeError`` of the wrong kind).
    """

    lr: LearningRate = attrs.field(converter=_as_learning_rate)
    betas: tuple[float, float] = attrs.field(converter=_as_betas)
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    foreach: bool | None
    fused: bool | None

    def __attrs_post_init__(self) -> None:
        _check_nonnegative("epsilon", self.eps)
        _check_nonnegative("weight_decay", self.weight_decay)
        _check_flag("amsgrad", self.amsgrad)
        _check_flag("maximize", self.maximize)
        _check_impl_flags(self.foreach, self.fused)

    @property
    def needs_fp32_master(self) -> bool:
        """True: AdamW's small updates are rounded away in bf16/fp16 params."""
        return True

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        return _learning_rate(self.lr, count)

    def init(self, params: Mapping[str, torch.Tensor]) -> AdamWState:
        """Allocate every moment for ``params`` eagerly, exactly as torch would lazily.

        Args:
            params: The trainable params by name (tensors, ``nn.Parameter`` s or DTensors).

        Returns:
            An :class:`AdamWState` with ``count = 0``, per-param ``step = 0`` and zero
            moments (``max_exp_avg_sq`` is ``{}`` unless amsgrad).

        Raises:
            ValueError: If ``fused=True`` and a param is not a floating-point tensor on a
                device with fused kernels.
        """
        _check_params(params)
        if self.fused:
            _check_fused_params(params)
        step: dict[str, torch.Tensor] = {}
        exp_avg: dict[str, torch.Tensor] = {}
        exp_avg_sq: dict[str, torch.Tensor] = {}
        max_exp_avg_sq: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in params.items():
                # torch/optim/adam.py `_init_group`, note [special device hosting for step].
                if self.fused:
                    step[name] = torch.zeros(
                        (), dtype=torch_compat.optimizer_step_dtype(fused=True), device=p.device
                    )
                else:
                    step[name] = torch.tensor(
                        0.0, dtype=torch_compat.optimizer_step_dtype(), device="cpu"
                    )
                exp_avg[name] = _zeros_like(p)
                exp_avg_sq[name] = _zeros_like(p)
                if self.amsgrad:
                    max_exp_avg_sq[name] = _zeros_like(p)
        return AdamWState(
            count=_new_count(),
            step=step,
            exp_avg=exp_avg,
            exp_avg_sq=exp_avg_sq,
            max_exp_avg_sq=max_exp_avg_sq,
        )

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: AdamWState,
    ) -> AdamWState:
        """Apply one AdamW update in place to ``params`` and ``state``'s tensors.

        Args:
            params: The params by name, the same names as at :meth:`init`.
            grads: Gradients by name; a name that is missing or maps to ``None`` is
                skipped (as ``torch.optim`` skips a param whose ``.grad`` is ``None``).
            state: The state from :meth:`init` or the previous :meth:`update`. Its tensors
                are updated in place, so it must not be reused afterwards.

        Returns:
            A new :class:`AdamWState` holding the (in-place updated) tensors, ``count``
            incremented by one.

        Raises:
            ValueError: If grads has names not in params, a grad's shape, dtype or device
                differs from its param's, a grad is sparse, or the state's keys or shapes
                do not match params.
            TypeError: If ``state`` is not an :class:`AdamWState`.
        """
        if not isinstance(state, AdamWState):
            raise TypeError(f"state must be an AdamWState, got {type(state).__name__}")
        _check_params(params)
        names = _check_grads(params, grads)
        _check_state_dict("step", state.step, params, expected=True, like_param=False)
        _check_state_dict("exp_avg", state.exp_avg, params, expected=True, like_param=True)
        _check_state_dict("exp_avg_sq", state.exp_avg_sq, params, expected=True, like_param=True)
        _check_state_dict(
            "max_exp_avg_sq", state.max_exp_avg_sq, params, expected=self.amsgrad, like_param=True
        )
        lr = self.learning_rate(int(state.count))
        foreach, fused = _resolve_impl((params[n] for n in names), self.foreach, self.fused)
        with torch.no_grad():
            # No .detach(): under no_grad torch.optim hands the parameters to the same
            # kernels as they are, and detaching a DTensor costs ~17 µs of host time each.
            p_list = [params[n] for n in names]
            g_list = [grads[n] for n in names]
            _torch_adamw(
                p_list,
                g_list,  # type: ignore[arg-type]
                [state.exp_avg[n] for n in names],
                [state.exp_avg_sq[n] for n in names],
                [state.max_exp_avg_sq[n] for n in names] if self.amsgrad else [],
                [state.step[n] for n in names],
                foreach=foreach,
                capturable=False,
                differentiable=False,
                fused=fused,
                grad_scale=None,
                found_inf=None,
                has_complex=any(torch.is_complex(p) for p in p_list),
                amsgrad=self.amsgrad,
                beta1=self.betas[0],
                beta2=self.betas[1],
                lr=lr,
                weight_decay=self.weight_decay,
                eps=self.eps,
                maximize=self.maximize,
            )
            state.count.add_(1)
        return AdamWState(
            count=state.count,
            step=dict(state.step),
            exp_avg=dict(state.exp_avg),
            exp_avg_sq=dict(state.exp_avg_sq),
            max_exp_avg_sq=dict(state.max_exp_avg_sq),
        )


def adamw(
    lr: LearningRate = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> AdamW:
    r"""AdamW (decoupled weight decay), bitwise identical to ``torch.optim.AdamW``.

    For each param :math:`\theta` with gradient :math:`g` (negated if ``maximize``), at its
    own step :math:`t` (the number of updates in which it had a gradient) and learning rate
    :math:`\gamma` = ``learning_rate(count)``:

    .. math::
        \theta &\leftarrow \theta - \gamma \lambda \theta \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) g \\
        v &\leftarrow \beta_2 v + (1 - \beta_2) g^2 \\
        \hat v &\leftarrow \max(\hat v, v) \text{ if amsgrad else } v \\
        \theta &\leftarrow \theta - \gamma \frac{m / (1 - \beta_1^t)}
            {\sqrt{\hat v / (1 - \beta_2^t)} + \epsilon}

    A param whose grad is ``None`` is skipped (its moments and ``step`` stay untouched).
    The defaults are ``torch.optim.AdamW``'s.

    Args:
        lr: Learning rate (finite, ``>= 0``), or a schedule ``count -> lr`` of the
            optimizer's own update count (bitwise like ``LambdaLR(opt, lambda c:
            schedule(c) / base_lr)`` stepped once per update, when
            ``schedule(c) == base_lr * f(c)``).
        betas: ``(beta1, beta2)``, each in ``[0, 1)`` (``beta1 = 0`` is allowed).
        eps: Denominator term :math:`\epsilon`, ``>= 0``.
        weight_decay: Decoupled weight decay :math:`\lambda`, ``>= 0``.
        amsgrad: Use the AMSGrad variant.
        maximize: Maximize the objective.
        foreach: ``None`` picks torch's default for the params' device (foreach on
            CUDA-like devices, the single-tensor loop on CPU).
        fused: Use torch's fused kernel (CPU and CUDA support it); only when asked for.

    Returns:
        The :class:`AdamW` optimizer.

    Raises:
        ValueError: On out-of-range hyper-parameters or ``foreach=fused=True``.
        TypeError: On a hyper-parameter of the wrong kind.

    Examples:
        >>> opt = adamw(3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        >>> state = opt.init(dict(model.named_parameters()))
        >>> grads = {n: p.grad for n, p in model.named_parameters()}
        >>> state = opt.update(dict(model.named_parameters()), grads, state)
        >>> warmup = adamw(lambda c: 3e-4 * min(1.0, (c + 1) / 1000))
    """
    return AdamW(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        fused=fused,
    )


# --------------------------------------------------------------------------------------
# SGD
# --------------------------------------------------------------------------------------


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
        return _learning_rate(self.lr, count)

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
            state: The state from :meth:`init` or the previous :meth:`update`. Its tensors
                are updated in place, so it must not be reused afterwards.

        Returns:
            A new :class:`SGDState` holding the (in-place updated) tensors, ``count``
            incremented by one.

        Raises:
            ValueError: If grads has names not in params, a grad's shape, dtype or device
                differs from its param's, a grad is sparse, or the state's keys or shapes
                do not match params.
            TypeError: If ``state`` is not an :class:`SGDState`.
        """
        if not isinstance(state, SGDState):
            raise TypeError(f"state must be an SGDState, got {type(state).__name__}")
        _check_params(params)
        names = _check_grads(params, grads)
        has_momentum = self.momentum != 0
        _check_state_dict(
            "momentum_buffer", state.momentum_buffer, params, expected=has_momentum, like_param=True
        )
        _check_state_dict(
            "initialized", state.initialized, params, expected=has_momentum, like_param=False
        )
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
