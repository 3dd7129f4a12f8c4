"""The optimizer protocol, and what every fvstep optimizer shares.

:class:`Optimizer` is what :class:`fvstep.state.Role` takes: static metadata with a pure
``init`` / ``update`` pair over a separate state pytree, and ``check_state``, the
structure check that ``update`` relies on (run once, not on every update).
:data:`LearningRate` is a constant or a schedule of the optimizer's update count.

Shared by the optimizers (private): the hyper-parameter checks, the kernel choice, and
the structure checks, at two costs in two places. The structure of the params and of the
state (names, the shapes of every moment, which dicts this configuration fills) is
checked once, by ``init`` and ``check_state``: ``TrainState.create`` and a checkpoint
load run them, and ``update`` keeps that structure (it returns the same dicts' tensors).
What ``update`` is handed anew on every call is checked there, cheaply
(:func:`_grad_names`), with a message naming the param on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch

from fvstep import _compat as torch_compat
from fvstep._checks import check_learning_rate

__all__ = ["LearningRate", "Optimizer"]

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

    def check_state(self, params: Mapping[str, torch.Tensor], state: StateT) -> None:
        """Raise unless ``state`` has the structure :meth:`init` gives ``params``.

        :meth:`update` relies on that structure without checking it again: run this
        once on a state that :meth:`init` did not just make (``TrainState.create`` and a
        checkpoint load do).
        """
        ...

    def learning_rate(self, count: int) -> float:
        """The learning rate of the update made when ``count`` updates have been applied."""
        ...


# Shared by the optimizers (private): hyper-parameters, the kernel choice, allocation.


def _new_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _as_learning_rate(lr: LearningRate) -> LearningRate:
    """A schedule as it is; a constant checked and made a ``float``."""
    return lr if callable(lr) else check_learning_rate(lr, "lr")


def _scheduled_learning_rate(schedule: Callable[[int], float], count: int) -> float:
    """A schedule's value at ``count``, checked (a constant needs no call: it was checked
    when the optimizer was made)."""
    return check_learning_rate(
        schedule(count), f"the learning-rate schedule's value at count {count}"
    )


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
    owners: dict[int, str] = {}
    for name, t in tensors.items():  # one tensor per name: a shared one is updated twice
        other = owners.setdefault(id(t), name)
        if other != name:
            raise ValueError(
                f"state.{field_name}['{other}'] and state.{field_name}['{name}'] are one "
                "tensor: each param needs its own (an update would advance it twice)"
            )
    if like_param:
        for name, p in params.items():
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"state.{field_name}['{name}'] must be a tensor, got {type(t).__name__}"
                )
            if t.shape != p.shape:
                raise ValueError(
                    f"state.{field_name}['{name}'] has shape {tuple(t.shape)} but the param "
                    f"has shape {tuple(p.shape)}"
                )
            if t.dtype != p.dtype:
                raise ValueError(
                    f"state.{field_name}['{name}'] is {t.dtype} but the param is {p.dtype} "
                    "(init makes every moment in its param's dtype)"
                )


def _grad_names(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor | None],
    keyed: tuple[str, Mapping[str, torch.Tensor]] | None,
    moments: Sequence[tuple[str, Mapping[str, torch.Tensor]]] = (),
) -> list[str]:
    """The per-update guard: the names (in params order) that have a grad, each grad and
    each of the state's ``moments`` (``(field name, dict)``) checked against its param.

    First, ``params`` must have the names of the state's dict ``keyed`` (``(field name,
    dict)``, or ``None`` where the state keeps none): one comparison of two key views. Without it, params of another role would
    fail with a bare ``KeyError`` or leave some of their names silently without an update.

    Checked on every update, before any kernel runs, because each case fails badly
    without it: a grad of another shape broadcasts silently in the single-tensor and
    foreach kernels (``(1,)`` into ``(4, 4)``), and the fused kernel reads it by the
    param's element count (out of bounds when it is smaller); another dtype, device, a
    sparse grad or a non-tensor fail inside torch's single-tensor loop after the params
    before it, and the failing param's weight decay and step, were already updated, with
    a message that names no param. A name not in params would be skipped silently.
    The moments are checked for the same reasons (the fused kernel reads and writes a
    moment by its param's element count: a smaller one corrupts memory): the state is
    public data, and ``TrainState.replace`` or ``attrs.evolve`` can put any tensor there
    after :meth:`check_state` passed.
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping of names to tensors, got {type(params).__name__}"
        )
    if keyed is not None and keyed[1].keys() != params.keys():
        _check_state_dict(keyed[0], keyed[1], params, expected=True, like_param=False)
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
        # one short-circuit test on the common path; the message is built on failure only
        if (
            not isinstance(g, torch.Tensor)
            or g.shape != p.shape
            or g.dtype != p.dtype
            or g.device != p.device
            or g.is_sparse
        ):
            _raise_bad_grad(name, g, p)
        for field_name, tensors in moments:
            t = tensors.get(name)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                _raise_bad_moment(field_name, name, t, p)
        names.append(name)
    return names


def _raise_bad_moment(field_name: str, name: str, t: object, p: torch.Tensor) -> None:
    where = f"state.{field_name}['{name}']"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(t).__name__}")
    raise ValueError(
        f"{where} is {t.dtype}{tuple(t.shape)} but the param is {p.dtype}{tuple(p.shape)}: "
        "was the optimizer state replaced after TrainState.create? (check it with "
        "optimizer.check_state(params, state))"
    )


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
