"""Functional optimizers over explicit state pytrees, bit-identical to ``torch.optim``.

As in optax, each optimizer is one factory (:func:`adamw`, :func:`sgd`) returning static
metadata with the methods of :class:`Optimizer` over a separate state pytree; both are one
mechanism (``_KernelOptimizer``) over PyTorch's functional kernels::

    opt = adamw(1e-4, weight_decay=0.01)
    opt_state = opt.init(params)
    opt_state = opt.update(params, grads, opt_state)  # params updated in place
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import attrs
import torch
from torch.optim.adamw import adamw as torch_adamw
from torch.optim.sgd import sgd as torch_sgd

from fvstep.core import _compat as torch_compat  # not `_compat`: attrs-generated methods read it
from fvstep.core._checks import check_learning_rate
from fvstep.core.tree import frozen

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
    """An fvstep optimizer: immutable hyper-parameters over a state pytree of type ``StateT``."""

    @property
    def needs_fp32_master(self) -> bool:
        """Whether updates are rounded away in bf16/fp16 params (an fp32 master copy is needed)."""
        ...

    def init(self, params: Mapping[str, torch.Tensor]) -> StateT:
        """Allocate the state for ``params`` (by name): every moment, eagerly, at ``count = 0``.

        Raises:
            TypeError: If params is not a mapping of names to tensors.
            ValueError: If ``fused=True`` and a param is not floating point on a fused device.
        """
        ...

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: StateT,
    ) -> StateT:
        """Apply one update in place to ``params`` and the state's tensors; checks run first.

        Args:
            grads: Gradients by name; a name that is missing or maps to ``None`` is skipped.
            state: From :meth:`init`, the previous :meth:`update`, or one that passed
                :meth:`check_state`. Updated in place: do not reuse it.

        Returns:
            A new state holding the updated tensors, ``count`` incremented.

        Raises:
            TypeError: If ``state`` is of another optimizer, or a grad is not a tensor.
            ValueError: If a grad or moment does not fit its param (shape, dtype, device,
                sparse), or the names of grads, params and state disagree.
        """
        ...

    def check_state(self, params: Mapping[str, torch.Tensor], state: StateT) -> None:
        """Raise (``TypeError``/``ValueError``, naming the field) unless ``state`` has the structure
        :meth:`init` gives ``params``; :meth:`update` relies on it unchecked, so run it once on a
        state :meth:`init` did not just make (``TrainState.create`` and a checkpoint load do)."""
        ...

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        ...


_Tensors = list[torch.Tensor]


@frozen
class AdamWState:
    """State of :class:`AdamW`; every leaf is a tensor, dicts are keyed by param name.

    Attributes:
        count: 0-d int64 CPU tensor, the number of updates applied (drives the schedule).
        step: Per-param bias-correction step ``t``, as ``torch.optim.AdamW`` creates it.
        max_exp_avg_sq: ``{}`` when amsgrad is off.
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
        count: As :class:`AdamWState`'s.
        momentum_buffer: ``{}`` when momentum is 0.
        initialized: Per-param 0-d bool: the param has had a gradient (``{}`` without momentum).
    """

    count: torch.Tensor
    momentum_buffer: dict[str, torch.Tensor]
    initialized: dict[str, torch.Tensor]


KernelStateT = TypeVar("KernelStateT", AdamWState, SGDState)


class _Slot(NamedTuple):  # a per-param dict of a state: how init makes an entry
    new: Callable[[torch.Tensor], torch.Tensor]
    moment: bool


_MOMENT = _Slot(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), True)
_FLAG = _Slot(lambda p: torch.zeros((), dtype=torch.bool), False)


class _KernelOptimizer(Generic[KernelStateT]):
    """The :class:`Optimizer` methods over ``_state_class``, ``_slots``
    (per-param dicts by field; ``None``: kept empty) and ``_apply`` (the kernel)."""

    __slots__ = ()
    _state_class: ClassVar[type]
    lr: LearningRate
    foreach: bool | None
    fused: bool | None

    _slots: Callable[[], dict[str, _Slot | None]]
    _apply: Callable[..., None]  # (params, grads, state: the filled dicts as lists, lr, **impl)

    @property
    def needs_fp32_master(self) -> bool:
        """True: AdamW's and SGD's small updates round away in bf16/fp16 params."""
        return True

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        lr = self.lr
        if not callable(lr):  # checked when the optimizer was made
            return lr
        return check_learning_rate(
            lr(count), f"the learning-rate schedule's value at count {count}"
        )

    def init(self, params: Mapping[str, torch.Tensor]) -> KernelStateT:
        """Allocate every moment for ``params`` eagerly, exactly as torch would lazily."""
        _check_params(params, fused=bool(self.fused))
        with torch.no_grad():
            dicts = {
                field: {n: slot.new(p) for n, p in params.items()} if slot else {}
                for field, slot in self._slots().items()
            }
        return self._state_class(count=torch.zeros((), dtype=torch.int64), **dicts)

    def check_state(self, params: Mapping[str, torch.Tensor], state: KernelStateT) -> None:
        """Raise unless ``state`` is the state :meth:`init` would give ``params``."""
        self._check_state_class(state)
        _check_params(params)
        for field, slot in self._slots().items():
            _check_state_dict(field, getattr(state, field), params, slot)

    def update(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor | None],
        state: KernelStateT,
    ) -> KernelStateT:
        """Apply one update in place to ``params`` and ``state``'s tensors; return the new state."""
        self._check_state_class(state)
        slots = self._slots()
        dicts = {f: getattr(state, f) for f, slot in slots.items() if slot is not None}
        moments = [(f, dicts[f]) for f, slot in slots.items() if slot is not None and slot.moment]
        names = _grad_names(params, grads, next(iter(dicts.items()), None), moments)
        lr = self.learning_rate(int(state.count))
        p_list = [params[n] for n in names]
        with torch.no_grad():
            # No .detach(), as torch.optim: detaching a DTensor costs host time per parameter.
            g_list: _Tensors = [grads[n] for n in names]  # type: ignore[misc]
            lists = {f: [d[n] for n in names] for f, d in dicts.items()}
            # foreach=fused=None: torch's kernel picks its default for these params' device
            self._apply(p_list, g_list, lists, lr, foreach=self.foreach, fused=self.fused)
            state.count.add_(1)
        return self._state_class(count=state.count, **{f: dict(getattr(state, f)) for f in slots})

    def _check_state_class(self, state: object) -> None:
        if not isinstance(state, self._state_class):
            name = self._state_class.__name__
            raise TypeError(f"state must be an {name}, got {type(state).__name__}")


# Checks of hyper-parameters, run when an optimizer is made.


def _as_learning_rate(lr: LearningRate) -> LearningRate:
    """A schedule as it is; a constant checked and made a ``float``."""
    return lr if callable(lr) else check_learning_rate(lr, "lr")


def _as_betas(betas: tuple[float, float]) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"betas[{i}] must be a float, got {type(beta).__name__}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} (must be in [0, 1))")
    return (betas[0], betas[1])


def _check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")


def _check_nonnegative(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}: {value!r}")
        if not value >= 0.0:  # also rejects NaN
            raise ValueError(f"Invalid {name} value: {value} (must be >= 0)")


def _check_impl_flags(foreach: bool | None, fused: bool | None) -> None:
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            kind = type(value).__name__
            raise TypeError(f"{name} must be a bool or None, got {kind}: {value!r}")
    if foreach and fused:
        raise ValueError("`fused` and `foreach` cannot be `True` together.")


@attrs.frozen(kw_only=True)
class AdamW(_KernelOptimizer[AdamWState]):
    """What :func:`adamw` returns (and documents): its checked, read-only hyper-parameters."""

    _state_class: ClassVar[type] = AdamWState
    lr: LearningRate = attrs.field(converter=_as_learning_rate)
    betas: tuple[float, float] = attrs.field(converter=_as_betas)
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    foreach: bool | None
    fused: bool | None

    def __attrs_post_init__(self) -> None:
        _check_nonnegative(epsilon=self.eps, weight_decay=self.weight_decay)
        _check_flags(amsgrad=self.amsgrad, maximize=self.maximize)
        _check_impl_flags(self.foreach, self.fused)

    def _new_step(self, p: torch.Tensor) -> torch.Tensor:
        # torch/optim/adam.py `_init_group`, note [special device hosting for step].
        if self.fused:
            dtype = torch_compat.optimizer_step_dtype(fused=True)
            return torch.zeros((), dtype=dtype, device=p.device)
        return torch.tensor(0.0, dtype=torch_compat.optimizer_step_dtype(), device="cpu")

    def _slots(self) -> dict[str, _Slot | None]:
        return {
            "step": _Slot(self._new_step, moment=False),
            "exp_avg": _MOMENT,
            "exp_avg_sq": _MOMENT,
            "max_exp_avg_sq": _MOMENT if self.amsgrad else None,
        }

    def _apply(
        self,
        params: _Tensors,
        grads: _Tensors,
        state: dict[str, _Tensors],
        lr: float,
        **impl: bool | None,
    ) -> None:
        torch_adamw(
            params,
            grads,
            state["exp_avg"],
            state["exp_avg_sq"],
            state.get("max_exp_avg_sq", []),
            state["step"],
            capturable=False,
            differentiable=False,
            grad_scale=None,
            found_inf=None,
            has_complex=any(p.is_complex() for p in params),
            amsgrad=self.amsgrad,
            beta1=self.betas[0],
            beta2=self.betas[1],
            lr=lr,
            weight_decay=self.weight_decay,
            eps=self.eps,
            maximize=self.maximize,
            **impl,
        )


@attrs.frozen(kw_only=True)
class SGD(_KernelOptimizer[SGDState]):
    """What :func:`sgd` returns (and documents): its checked, read-only hyper-parameters."""

    _state_class: ClassVar[type] = SGDState
    lr: LearningRate = attrs.field(converter=_as_learning_rate)
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    foreach: bool | None
    fused: bool | None

    def __attrs_post_init__(self) -> None:
        _check_nonnegative(momentum=self.momentum)
        if isinstance(self.dampening, bool) or not isinstance(self.dampening, (int, float)):
            raise TypeError(f"dampening must be a float, got {type(self.dampening).__name__}")
        _check_nonnegative(weight_decay=self.weight_decay)
        _check_flags(nesterov=self.nesterov, maximize=self.maximize)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _check_impl_flags(self.foreach, self.fused)

    def _slots(self) -> dict[str, _Slot | None]:
        on = self.momentum != 0
        return {"momentum_buffer": _MOMENT if on else None, "initialized": _FLAG if on else None}

    def _apply(
        self,
        params: _Tensors,
        grads: _Tensors,
        state: dict[str, _Tensors],
        lr: float,
        **impl: bool | None,
    ) -> None:
        # torch makes a buffer lazily as clone(grad) on a param's first step: pass None there
        # (and [] without momentum, as torch.optim.SGD does), then copy in what torch made.
        eager, done = state.get("momentum_buffer", []), state.get("initialized", [])
        buffers: list[torch.Tensor | None] = [b if bool(d) else None for b, d in zip(eager, done)]
        # torch's fused kernel makes buffers only when *all* are missing (it fails on a mix):
        # the new ones get a call of their own. The kernels are elementwise: no bit changes.
        groups = [list(range(len(params)))]
        new = [i for i, b in enumerate(buffers) if b is None]
        if impl["fused"] and 0 < len(new) < len(buffers):
            groups = [new, [i for i, b in enumerate(buffers) if b is not None]]
        for group in groups:
            group_buffers = [buffers[i] for i in group] if eager else []
            torch_sgd(
                [params[i] for i in group],
                [grads[i] for i in group],
                group_buffers,
                has_sparse_grad=False,
                grad_scale=None,
                found_inf=None,
                weight_decay=self.weight_decay,
                momentum=self.momentum,
                lr=lr,
                dampening=self.dampening,
                nesterov=self.nesterov,
                maximize=self.maximize,
                **impl,
            )
            for i, buf in zip(group, group_buffers):  # torch writes back `list[i] = clone`
                buffers[i] = buf
        for buf, target, flag in zip(buffers, eager, done):
            assert buf is not None, "torch's sgd kernel made no momentum buffer"
            if buf is not target:
                target.copy_(buf)
                flag.fill_(True)


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
    The defaults are ``torch.optim.AdamW``'s; the state is an :class:`AdamWState`.

    Args:
        lr: Learning rate (finite, ``>= 0``), or a schedule ``count -> lr`` of the
            optimizer's own update count (``docs/api/schedules.md``).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: Denominator term :math:`\epsilon`, ``>= 0``.
        weight_decay: Decoupled weight decay :math:`\lambda`, ``>= 0``.
        foreach: ``None`` picks torch's default for the params' device.
        fused: Use torch's fused kernel (CPU and CUDA); only when asked for.

    Raises:
        ValueError: On out-of-range hyper-parameters or ``foreach=fused=True``.
        TypeError: On a hyper-parameter of the wrong kind.

    Examples:
        >>> opt = adamw(3e-4, betas=(0.9, 0.95), weight_decay=0.1)
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

    A param whose grad is ``None`` is skipped (its buffer stays uninitialized). The
    defaults are ``torch.optim.SGD``'s; the state is an :class:`SGDState`. As in torch, the
    foreach kernel with ``nesterov`` (no ``maximize`` or weight decay) adds the momentum
    into the grads in place. With ``fused=True``, a param's first gradient after others'
    does not raise, unlike torch.

    Args:
        lr: As :func:`adamw`'s.
        momentum: Momentum factor :math:`\mu`, ``>= 0`` (``0`` keeps no state but ``count``).
        dampening: Dampening :math:`\tau` (not applied on a param's first step).
        weight_decay: L2 penalty :math:`\lambda`, ``>= 0``.
        nesterov: Requires ``momentum > 0`` and ``dampening == 0``.
        foreach: As :func:`adamw`'s.
        fused: As :func:`adamw`'s. Not deterministic for bf16/fp16 params with momentum on
            CPU (torch's ``FusedSGDKernel.cpp`` reads such a buffer as float32, past its end).

    Raises:
        ValueError: On out-of-range hyper-parameters, nesterov without momentum or with
            dampening, or ``foreach=fused=True``.
        TypeError: On a hyper-parameter of the wrong kind.

    Examples:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
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


# Checks of params, state and grads.

_INIT_HINT = " (init makes every moment like its param)"
_REPLACED_HINT = (
    ": was the optimizer state replaced after TrainState.create? (check it with "
    "optimizer.check_state(params, state))"
)


def _check_params(params: Mapping[str, torch.Tensor], *, fused: bool = False) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping of names to tensors, got {type(params).__name__}"
        )
    supported = torch_compat.fused_kernel_devices() if fused else []
    for name, p in params.items():
        if not isinstance(name, str):
            raise TypeError(f"param names must be strings, got {name!r}")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"param '{name}' must be a tensor, got {type(p).__name__}")
        if fused and (p.device.type not in supported or not torch.is_floating_point(p)):
            raise ValueError(
                f"`fused=True` needs floating point params on {supported}, but param "
                f"'{name}' is {p.dtype} on {p.device.type}: pass fused=None"
            )


def _check_state_dict(
    field: str, tensors: Mapping[str, Any], params: Mapping[str, torch.Tensor], slot: _Slot | None
) -> None:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"state.{field} must be a dict, got {type(tensors).__name__}")
    if slot is None:
        if tensors:
            raise ValueError(
                f"state.{field} must be empty for this optimizer's configuration, but has "
                f"{len(tensors)} entries (was the state made by another optimizer?)"
            )
        return
    if tensors.keys() != params.keys():
        missing = sorted(set(params) - set(tensors))
        extra = sorted(set(tensors) - set(params))
        raise ValueError(
            f"state.{field} keys do not match the params: missing {missing[:10]}, "
            f"unexpected {extra[:10]} (was the state made by init() for these params?)"
        )
    owners: dict[int, str] = {}
    for name, t in tensors.items():  # one tensor per name: a shared one is updated twice
        other = owners.setdefault(id(t), name)
        if other != name:
            raise ValueError(
                f"state.{field}['{other}'] and state.{field}['{name}'] are one tensor: each "
                "param needs its own (an update would advance it twice)"
            )
    for name, p in params.items() if slot.moment else ():
        _check_moment(f"state.{field}['{name}']", tensors[name], p, _INIT_HINT)


def _check_moment(where: str, t: object, p: torch.Tensor, hint: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    if t.shape != p.shape:
        raise ValueError(
            f"{where} has shape {tuple(t.shape)} but the param has shape {tuple(p.shape)}{hint}"
        )
    if t.dtype != p.dtype:
        raise ValueError(f"{where} is {t.dtype} but the param is {p.dtype}{hint}")


def _grad_names(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor | None],
    keyed: tuple[str, Mapping[str, torch.Tensor]] | None,
    moments: Sequence[tuple[str, Mapping[str, torch.Tensor]]],
) -> list[str]:
    """The names with a grad, each grad and moment checked: torch would broadcast silently."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping of names to tensors, got {type(params).__name__}"
        )
    if keyed is not None and keyed[1].keys() != params.keys():  # raises, naming the names
        _check_state_dict(keyed[0], keyed[1], params, _FLAG)
    if not isinstance(grads, Mapping):
        raise TypeError(f"grads must be a mapping of names to tensors, got {type(grads).__name__}")
    if not grads.keys() <= params.keys():
        unknown = [n for n in grads if n not in params]
        raise ValueError(
            f"grads has names that are not in params: {sorted(map(str, unknown))[:10]}"
            f" (params has {len(params)} names, e.g. {list(params)[:5]})"
        )
    names = []
    for name, p in params.items():
        g = grads.get(name)
        if g is None:
            continue
        if (
            not isinstance(g, torch.Tensor)
            or g.shape != p.shape
            or g.dtype != p.dtype
            or g.device != p.device
            or g.is_sparse
        ):
            _raise_bad_grad(name, g, p)
        for field, tensors in moments:
            t = tensors.get(name)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                _check_moment(f"state.{field}['{name}']", t, p, _REPLACED_HINT)
        names.append(name)
    return names


def _raise_bad_grad(name: str, g: object, p: torch.Tensor) -> None:
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"grad of '{name}' must be a tensor or None, got {type(g).__name__}")
    if g.shape != p.shape:
        raise ValueError(
            f"grad of '{name}' has shape {tuple(g.shape)} but the param has shape {tuple(p.shape)}"
        )
    if g.dtype != p.dtype:
        raise ValueError(f"grad of '{name}' has dtype {g.dtype} but the param has dtype {p.dtype}")
    if g.device != p.device:
        raise ValueError(f"grad of '{name}' is on {g.device} but the param is on {p.device}")
    raise ValueError(f"grad of '{name}' is sparse; sparse gradients are not supported")
