"""AdamW: the state class, the optimizer and its factory, on torch's own kernels.

:func:`adamw` builds an :class:`AdamW`; its state is an :class:`AdamWState` (every
moment allocated at ``init``). ``update`` calls ``torch.optim.adamw.adamw`` with the
single-tensor / foreach / fused implementation ``torch.optim.AdamW`` would pick.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch.optim.adamw import adamw as _torch_adamw

from fvstep import (
    _compat as torch_compat,  # not `_compat`: attrs-generated methods read that global
)
from fvstep.optim.base import (
    LearningRate,
    _as_betas,
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

__all__ = ["AdamW", "AdamWState", "adamw"]


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
        lr = self.lr
        return _scheduled_learning_rate(lr, count) if callable(lr) else lr

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

    def check_state(self, params: Mapping[str, torch.Tensor], state: AdamWState) -> None:
        """Raise unless ``state`` is an AdamW state that :meth:`init` would give ``params``.

        Checks the structure that :meth:`update` relies on without checking it again:
        every dict has exactly the params' names (``max_exp_avg_sq`` none unless
        amsgrad) and its own tensor for each, every moment the param's shape and dtype. ``TrainState.create`` runs it once,
        and a state loaded from elsewhere needs it once before its first update.

        Args:
            params: The params by name, the same names as at :meth:`init`.
            state: The state to check.

        Raises:
            TypeError: If ``state`` is not an :class:`AdamWState`, or params is not a
                mapping of names to tensors.
            ValueError: If a dict's names differ from the params', a moment's shape from
                its param's, or ``max_exp_avg_sq`` disagrees with ``amsgrad``.

        Examples:
            >>> opt = adamw(1e-3)
            >>> opt.check_state(params, opt.init(params))  # passes
        """
        if not isinstance(state, AdamWState):
            raise TypeError(f"state must be an AdamWState, got {type(state).__name__}")
        _check_params(params)
        _check_state_dict("step", state.step, params, expected=True, like_param=False)
        _check_state_dict("exp_avg", state.exp_avg, params, expected=True, like_param=True)
        _check_state_dict("exp_avg_sq", state.exp_avg_sq, params, expected=True, like_param=True)
        _check_state_dict(
            "max_exp_avg_sq", state.max_exp_avg_sq, params, expected=self.amsgrad, like_param=True
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
            state: The state from :meth:`init`, the previous :meth:`update`, or one that
                passed :meth:`check_state` (a loaded one). Its tensors are updated in
                place, so it must not be reused afterwards.

        Returns:
            A new :class:`AdamWState` holding the (in-place updated) tensors, ``count``
            incremented by one.

        Raises:
            ValueError: If grads has names not in params, a grad's shape, dtype or device
                differs from its param's, a grad is sparse, or params has other names than
                the state.
            TypeError: If ``state`` is not an :class:`AdamWState`.
        """
        if not isinstance(state, AdamWState):
            raise TypeError(f"state must be an AdamWState, got {type(state).__name__}")
        # The state's structure was checked once (init, check_state); see base.py.
        moments = [("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)]
        if self.amsgrad:
            moments.append(("max_exp_avg_sq", state.max_exp_avg_sq))
        names = _grad_names(params, grads, ("step", state.step), moments)
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
                has_complex=any(p.is_complex() for p in p_list),
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
