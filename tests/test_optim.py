"""Laws of fvstep.core.optim: AdamW and SGD are bitwise torch.optim.AdamW / torch.optim.SGD."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import attrs
import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fvstep.core import optim
from fvstep.core.tree import NAMESPACE, assert_trees_equal, clone, flatten_with_paths

LAW = settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------
# A drawn training run: initial params, per-step grads (with None and -0.0), both sides.
# --------------------------------------------------------------------------------------


@attrs.frozen
class Run:
    seed: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    steps: int
    none_mask: int  # bit s set: param "p0" has grad None on step s
    grad_scale: float

    @property
    def names(self) -> list[str]:
        return [f"p{i}" for i in range(len(self.shapes))]

    def initial_params(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        return {
            n: torch.randn(s, generator=gen, dtype=torch.float64).to(self.dtype)
            for n, s in zip(self.names, self.shapes, strict=True)
        }

    def grads(self, step: int) -> dict[str, torch.Tensor | None]:
        gen = torch.Generator().manual_seed(self.seed * 7919 + step + 1)
        out: dict[str, torch.Tensor | None] = {}
        for i, (n, s) in enumerate(zip(self.names, self.shapes, strict=True)):
            g = torch.randn(s, generator=gen, dtype=torch.float64) * self.grad_scale
            zero_mask = torch.rand(s, generator=gen) < 0.15
            neg_zero_mask = torch.rand(s, generator=gen) < 0.25
            g = torch.where(zero_mask, torch.zeros((), dtype=g.dtype), g)
            g = torch.where(neg_zero_mask, torch.full((), -0.0, dtype=g.dtype), g)
            if torch.rand((), generator=gen).item() < 0.1:
                g = torch.full(s, -0.0, dtype=g.dtype)  # an all -0.0 grad
            is_none = (
                (self.none_mask >> step) & 1
                if i == 0
                else torch.rand((), generator=gen).item() < 0.15
            )
            out[n] = None if is_none else g.to(self.dtype)
        return out


@st.composite
def runs(draw: st.DrawFn, *, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Run:
    shapes = draw(
        st.lists(
            st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
            min_size=1,
            max_size=4,
        )
    )
    steps = draw(st.integers(20, 24))
    return Run(
        seed=draw(st.integers(0, 2**31 - 1)),
        shapes=tuple(shapes),
        dtype=draw(st.sampled_from(dtypes)),
        steps=steps,
        none_mask=draw(st.integers(0, 2**steps - 1)),
        grad_scale=draw(st.sampled_from([1e-3, 1.0, 1e3])),
    )


LRS = st.floats(1e-4, 1.0) | st.just(0.0)
BETA1 = st.just(0.0) | st.floats(0.0, 0.99)
BETA2 = st.floats(0.0, 0.9999) | st.just(0.999)
EPS = st.sampled_from([1e-8, 1e-6]) | st.floats(1e-10, 1e-2)
WEIGHT_DECAY = st.just(0.0) | st.floats(0.0, 0.5)
FOREACH = st.sampled_from([True, False, None])


def _params(init: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(p.clone()) for n, p in init.items()}


def _copy(grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {n: None if g is None else g.clone() for n, g in grads.items()}


def _detached(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in params.items()}


def _torch_adamw_state(
    topt: torch.optim.Optimizer,
    tparams: dict[str, torch.nn.Parameter],
    count: int,
    *,
    amsgrad: bool,
    fused: bool,
) -> optim.AdamWState:
    """torch's AdamW state as an AdamWState; never-stepped params get torch's lazy init."""
    step, exp_avg, exp_avg_sq, max_exp_avg_sq = {}, {}, {}, {}
    for n, p in tparams.items():
        s = topt.state.get(p) or {}
        lazy_step = (
            torch.zeros((), dtype=torch.float32, device=p.device)
            if fused
            else torch.tensor(0.0, dtype=torch.float32)
        )
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
        step[n] = s.get("step", lazy_step)
        exp_avg[n] = s.get("exp_avg", zeros)
        exp_avg_sq[n] = s.get("exp_avg_sq", zeros)
        if amsgrad:
            max_exp_avg_sq[n] = s.get("max_exp_avg_sq", zeros)
    return optim.AdamWState(
        count=torch.tensor(count, dtype=torch.int64),
        step=step,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        max_exp_avg_sq=max_exp_avg_sq,
    )


def _torch_sgd_state(
    topts: list[torch.optim.Optimizer],
    tparams: dict[str, torch.nn.Parameter],
    count: int,
    *,
    momentum: float,
) -> optim.SGDState:
    buffers, initialized = {}, {}
    if momentum != 0:
        for n, p in tparams.items():
            s = next((o.state[p] for o in topts if p in o.state), {})
            buf = s.get("momentum_buffer")
            initialized[n] = torch.tensor(buf is not None)
            buffers[n] = torch.zeros_like(p).detach() if buf is None else buf
    return optim.SGDState(
        count=torch.tensor(count, dtype=torch.int64),
        momentum_buffer=buffers,
        initialized=initialized,
    )


def _drive_adamw(
    run: Run,
    opt: optim.AdamW,
    make_torch: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> None:
    init = run.initial_params()
    tparams, fparams = _params(init), _params(init)
    topt = make_torch(list(tparams.values()))
    sched = scheduler(topt) if scheduler is not None else None
    state = opt.init(fparams)
    for step in range(run.steps):
        grads = run.grads(step)
        for n, p in tparams.items():
            p.grad = None if grads[n] is None else grads[n].clone()
        topt.step()
        if sched is not None:
            sched.step()
        state = opt.update(fparams, _copy(grads), state)
        assert_trees_equal(_detached(fparams), _detached(tparams))
        expected = _torch_adamw_state(
            topt, tparams, step + 1, amsgrad=opt.amsgrad, fused=bool(opt.fused)
        )
        assert_trees_equal(state, expected)


def _drive_sgd(
    run: Run,
    opt: optim.SGD,
    make_torch: Callable[[list[torch.nn.Parameter]], list[torch.optim.Optimizer]],
    *,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> None:
    init = run.initial_params()
    tparams, fparams = _params(init), _params(init)
    topts = make_torch(list(tparams.values()))
    scheds = [scheduler(o) for o in topts] if scheduler is not None else []
    state = opt.init(fparams)
    for step in range(run.steps):
        grads = run.grads(step)
        for n, p in tparams.items():
            p.grad = None if grads[n] is None else grads[n].clone()
        for o in topts:
            o.step()
        for s in scheds:
            s.step()
        state = opt.update(fparams, _copy(grads), state)
        assert_trees_equal(_detached(fparams), _detached(tparams))
        assert_trees_equal(state, _torch_sgd_state(topts, tparams, step + 1, momentum=opt.momentum))


# --------------------------------------------------------------------------------------
# The laws: bitwise torch.optim
# --------------------------------------------------------------------------------------


@LAW
@given(
    run=runs(dtypes=(torch.float32, torch.float32, torch.float64, torch.bfloat16)),
    lr=LRS,
    beta1=BETA1,
    beta2=BETA2,
    eps=EPS,
    weight_decay=WEIGHT_DECAY,
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    foreach=FOREACH,
)
def test_adamw_is_bitwise_torch_adamw_over_steps(
    run: Run,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    foreach: bool | None,
) -> None:
    kwargs = dict(
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
    )
    opt = optim.adamw(lr, **kwargs)
    _drive_adamw(run, opt, lambda ps: torch.optim.AdamW(ps, lr=lr, **kwargs))


@LAW
@given(
    run=runs(dtypes=(torch.float32, torch.float32, torch.float64, torch.bfloat16)),
    lr=LRS,
    momentum=st.just(0.0) | st.just(0.9) | st.floats(0.0, 0.99),
    dampening=st.just(0.0) | st.floats(0.0, 1.0),
    nesterov=st.booleans(),
    weight_decay=WEIGHT_DECAY,
    maximize=st.booleans(),
    foreach=FOREACH,
)
def test_sgd_is_bitwise_torch_sgd_over_steps(
    run: Run,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    foreach: bool | None,
) -> None:
    if nesterov and (momentum <= 0 or dampening != 0):
        dampening = 0.0
        momentum = momentum or 0.5
    kwargs = dict(
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
        foreach=foreach,
    )
    opt = optim.sgd(lr, **kwargs)
    _drive_sgd(run, opt, lambda ps: [torch.optim.SGD(ps, lr=lr, **kwargs)])


@SMALL
@given(run=runs(), base_lr=st.floats(1e-3, 1.0), amsgrad=st.booleans(), foreach=FOREACH)
def test_adamw_schedule_is_bitwise_torch_lambdalr(
    run: Run, base_lr: float, amsgrad: bool, foreach: bool | None
) -> None:
    def factor(c: int) -> float:
        return (c + 1) / 20

    opt = optim.adamw(lambda c: base_lr * factor(c), amsgrad=amsgrad, foreach=foreach)
    _drive_adamw(
        run,
        opt,
        lambda ps: torch.optim.AdamW(ps, lr=base_lr, amsgrad=amsgrad, foreach=foreach),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor),
    )


@SMALL
@given(run=runs(), base_lr=st.floats(1e-3, 1.0), nesterov=st.booleans(), foreach=FOREACH)
def test_sgd_schedule_is_bitwise_torch_lambdalr(
    run: Run, base_lr: float, nesterov: bool, foreach: bool | None
) -> None:
    def factor(c: int) -> float:
        return 0.1 * (c + 1) / 20

    kwargs = dict(momentum=0.9, nesterov=nesterov, foreach=foreach)
    opt = optim.sgd(lambda c: base_lr * factor(c), **kwargs)
    _drive_sgd(
        run,
        opt,
        lambda ps: [torch.optim.SGD(ps, lr=base_lr, **kwargs)],
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor),
    )


@SMALL
@given(
    run=runs(dtypes=(torch.float32, torch.float64, torch.bfloat16)),
    lr=LRS,
    beta1=BETA1,
    beta2=BETA2,
    eps=EPS,
    weight_decay=WEIGHT_DECAY,
    amsgrad=st.booleans(),
    maximize=st.booleans(),
)
def test_fused_adamw_is_bitwise_torch_fused_adamw_on_cpu(
    run: Run,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    kwargs = dict(
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        fused=True,
    )
    opt = optim.adamw(lr, **kwargs)
    _drive_adamw(run, opt, lambda ps: torch.optim.AdamW(ps, lr=lr, **kwargs))


@SMALL
@given(
    run=runs(dtypes=(torch.float32, torch.float64, torch.bfloat16)),
    lr=LRS,
    momentum=st.just(0.0) | st.floats(0.0, 0.99),
    dampening=st.just(0.0) | st.floats(0.0, 1.0),
    weight_decay=WEIGHT_DECAY,
    maximize=st.booleans(),
)
def test_fused_sgd_is_bitwise_per_param_torch_fused_sgd_on_cpu(
    run: Run, lr: float, momentum: float, dampening: float, weight_decay: float, maximize: bool
) -> None:
    # torch.optim.SGD(fused=True) raises when a param gets its first grad after others did,
    # so the reference is one torch fused SGD per param (the kernel is elementwise).
    if run.dtype in (torch.bfloat16, torch.float16):
        # torch's CPU fused SGD kernel loads a bf16/fp16 momentum buffer as float32
        # (`fVec::loadu(momentum_buf_ptr + d)` in FusedSGDKernel.cpp): it reads past the
        # buffer and is not even deterministic against itself, so no momentum there.
        momentum = 0.0
    kwargs = dict(
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        maximize=maximize,
        fused=True,
    )
    opt = optim.sgd(lr, **kwargs)
    _drive_sgd(run, opt, lambda ps: [torch.optim.SGD([p], lr=lr, **kwargs) for p in ps])


@SMALL
@given(run=runs(), momentum=st.floats(0.1, 0.99), dampening=st.floats(0.0, 1.0))
def test_fused_sgd_is_bitwise_torch_fused_sgd_when_every_param_has_grads(
    run: Run, momentum: float, dampening: float
) -> None:
    run = attrs.evolve(run, none_mask=0)
    init = run.initial_params()
    tparams, fparams = _params(init), _params(init)
    kwargs = dict(momentum=momentum, dampening=dampening, fused=True)
    topt = torch.optim.SGD(list(tparams.values()), lr=0.1, **kwargs)
    opt = optim.sgd(0.1, **kwargs)
    state = opt.init(fparams)
    for step in range(run.steps):
        grads = {n: torch.randn(p.shape) for n, p in init.items()}
        for n, p in tparams.items():
            p.grad = grads[n].clone()
        topt.step()
        state = opt.update(fparams, _copy(grads), state)
        assert_trees_equal(_detached(fparams), _detached(tparams))
        assert_trees_equal(state, _torch_sgd_state([topt], tparams, step + 1, momentum=momentum))


def test_sgd_first_momentum_is_torch_clone_of_negative_zero_grad() -> None:
    # clone(-0.0) is -0.0, whereas 0 * buf + grad would be +0.0.
    params = {"w": torch.nn.Parameter(torch.ones(4))}
    tparam = torch.nn.Parameter(torch.ones(4))
    opt = optim.sgd(0.1, momentum=0.9, dampening=0.5)
    topt = torch.optim.SGD([tparam], lr=0.1, momentum=0.9, dampening=0.5)
    state = opt.init(params)
    tparam.grad = torch.full((4,), -0.0)
    topt.step()
    state = opt.update(params, {"w": torch.full((4,), -0.0)}, state)
    assert torch.equal(
        state.momentum_buffer["w"].view(torch.int32), torch.full((4,), -0.0).view(torch.int32)
    )
    assert_trees_equal(state.momentum_buffer, {"w": topt.state[tparam]["momentum_buffer"]})
    assert bool(state.initialized["w"])


# --------------------------------------------------------------------------------------
# Eager init, skipping, counting, schedules
# --------------------------------------------------------------------------------------


def _some_params() -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.nn.Parameter(torch.randn(3, 4)),
        "a.bias": torch.nn.Parameter(torch.randn(4)),
        "scale": torch.nn.Parameter(torch.randn(())),
    }


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("fused", [None, True])
def test_adamw_init_allocates_every_moment_eagerly(amsgrad: bool, fused: bool | None) -> None:
    params = _some_params()
    state = optim.adamw(amsgrad=amsgrad, fused=fused).init(params)
    assert state.count.dtype == torch.int64 and state.count.shape == () and int(state.count) == 0
    moments = [state.exp_avg, state.exp_avg_sq] + ([state.max_exp_avg_sq] if amsgrad else [])
    for moment in moments:
        assert list(moment) == list(params)
        for n, p in params.items():
            assert type(moment[n]) is torch.Tensor and not moment[n].requires_grad
            assert_trees_equal(moment[n], torch.zeros_like(p).detach())
    assert state.max_exp_avg_sq == ({} if not amsgrad else state.max_exp_avg_sq)
    for n in params:
        assert_trees_equal(state.step[n], torch.tensor(0.0))
    paths, leaves, _ = flatten_with_paths(state)
    assert "exp_avg.a.weight" in paths and all(isinstance(x, torch.Tensor) for x in leaves)
    assert_trees_equal(clone(state), state)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_init_allocates_every_momentum_buffer_eagerly(momentum: float) -> None:
    params = _some_params()
    state = optim.sgd(momentum=momentum).init(params)
    assert int(state.count) == 0
    if momentum == 0:
        assert state.momentum_buffer == {} and state.initialized == {}
        return
    assert list(state.momentum_buffer) == list(params) == list(state.initialized)
    for n, p in params.items():
        assert_trees_equal(state.momentum_buffer[n], torch.zeros_like(p).detach())
        assert state.initialized[n].dtype == torch.bool and not bool(state.initialized[n])


@pytest.mark.parametrize(
    "opt", [optim.adamw(0.1, amsgrad=True), optim.sgd(0.1, momentum=0.9, weight_decay=0.1)]
)
def test_update_skips_a_param_whose_grad_is_none(opt: optim.Optimizer[Any]) -> None:
    params = _some_params()
    state = opt.init(params)
    before_params, before_state = clone(params), clone(state)
    grads = {n: torch.randn(p.shape) for n, p in params.items()}
    grads["a.bias"] = None
    del grads["scale"]  # a missing name is skipped too
    new_state = opt.update(params, grads, state)
    assert new_state is not state
    assert int(new_state.count) == 1
    for n in ("a.bias", "scale"):
        assert_trees_equal(params[n], before_params[n])
        for field in attrs.fields(type(state))[1:]:
            d = getattr(new_state, field.name)
            if d:
                assert_trees_equal(d[n], getattr(before_state, field.name)[n])
    assert not torch.equal(params["a.weight"], before_params["a.weight"])


def test_learning_rate_is_the_schedule_of_the_update_count() -> None:
    seen: list[int] = []

    def schedule(count: int) -> float:
        seen.append(count)
        return 0.1 * (count + 1)

    opt = optim.sgd(schedule)
    params = {"w": torch.zeros(2)}
    state = opt.init(params)
    for _ in range(3):
        state = opt.update(params, {"w": torch.ones(2)}, state)
    assert seen == [0, 1, 2] and int(state.count) == 3
    assert opt.learning_rate(4) == 0.1 * 5
    assert optim.adamw(0.25).learning_rate(123) == 0.25


def test_update_counts_updates_without_any_grad() -> None:
    opt = optim.adamw(0.1)
    params = _some_params()
    state = opt.update(params, {}, opt.init(params))
    assert int(state.count) == 1
    assert all(float(s) == 0.0 for s in state.step.values())


def test_schedule_value_is_validated() -> None:
    opt = optim.adamw(lambda c: -1.0)
    params = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="learning rate"):
        opt.update(params, {"w": torch.ones(2)}, opt.init(params))


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------

OPTS = [
    optim.adamw(0.1),
    optim.adamw(0.1, amsgrad=True),
    optim.sgd(0.1, momentum=0.9),
    optim.sgd(0.1),
]


@pytest.mark.parametrize("opt", OPTS)
def test_update_rejects_grads_with_names_not_in_params(opt: optim.Optimizer[Any]) -> None:
    params = _some_params()
    with pytest.raises(ValueError, match=r"not in params: \['typo'\]"):
        opt.update(params, {"typo": torch.zeros(3)}, opt.init(params))


MOMENT_FIELDS = {"AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}


@pytest.mark.parametrize("fused", [None, True])
@pytest.mark.parametrize(
    "make", [lambda f: optim.adamw(1e-3, fused=f), lambda f: optim.sgd(0.1, momentum=0.9, fused=f)]
)
@pytest.mark.parametrize("bad", ["smaller", "larger", "flat", "dtype"])
def test_update_refuses_a_moment_replaced_by_one_that_does_not_fit_before_any_change(
    make: Any, fused: bool | None, bad: str
) -> None:
    # update() no longer re-checks the whole state (check_state did, at create), but a
    # moment put into the state afterwards must not reach a kernel: the fused one reads and
    # writes it by the param's element count (a smaller one corrupted memory)
    opt = make(fused)
    params = _some_params()
    state = opt.init(params)
    field = MOMENT_FIELDS[type(opt).__name__][-1]
    p = params["a.weight"]
    replacement = {
        "smaller": torch.zeros(p.numel() // 2),
        "larger": torch.zeros(p.numel() * 2),
        "flat": torch.zeros(p.numel()),
        "dtype": torch.zeros(p.shape, dtype=torch.float64),
    }[bad]
    getattr(state, field)["a.weight"] = replacement
    before = [x.clone() for x in params.values()]
    grads = {n: torch.ones_like(x) for n, x in params.items()}
    with pytest.raises(ValueError, match=rf"state.{field}\['a.weight'\]"):
        opt.update(params, grads, state)
    assert int(state.count) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params.values()))


@pytest.mark.parametrize(
    ("make", "field", "bad"),
    [
        (lambda: optim.adamw(1e-3), "step", "shared"),
        (lambda: optim.adamw(1e-3), "exp_avg", "shared"),
        (lambda: optim.adamw(1e-3), "exp_avg_sq", "dtype"),
        (lambda: optim.sgd(0.1, momentum=0.9), "momentum_buffer", "dtype"),
        (lambda: optim.sgd(0.1, momentum=0.9), "initialized", "shared"),
    ],
)
def test_check_state_refuses_shared_tensors_and_moments_of_another_dtype(make, field, bad):
    # a step tensor shared by two params advances twice per update (bias correction off);
    # a bf16 moment of an fp32 param loses precision: both ran silently before
    opt = make()
    params = _some_params()
    state = opt.init(params)
    tensors = getattr(state, field)
    if bad == "shared":
        tensors["a.bias"] = tensors["a.weight"]
        match = "are one tensor"
    else:
        tensors["a.weight"] = tensors["a.weight"].to(torch.bfloat16)
        match = "is torch.bfloat16 but the param is torch.float32"
    with pytest.raises(ValueError, match=match):
        opt.check_state(params, state)


@pytest.mark.parametrize("opt", OPTS)
def test_update_rejects_grads_with_mismatched_shape_dtype_device(opt: optim.Optimizer[Any]) -> None:
    params = _some_params()
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"grad of 'a.bias' has shape \(3,\)"):
        opt.update(params, {"a.bias": torch.zeros(3)}, state)
    with pytest.raises(ValueError, match="dtype"):
        opt.update(params, {"a.bias": torch.zeros(4, dtype=torch.float64)}, state)
    with pytest.raises(ValueError, match="sparse"):
        opt.update(params, {"a.bias": torch.zeros(4).to_sparse()}, state)
    with pytest.raises(TypeError, match="tensor or None"):
        opt.update(params, {"a.bias": [0.0] * 4}, state)  # type: ignore[dict-item]
    assert int(state.count) == 0


@pytest.mark.parametrize("opt", OPTS)
def test_check_state_rejects_a_state_whose_keys_or_shapes_do_not_match_params(
    opt: optim.Optimizer[Any],
) -> None:
    params = _some_params()
    opt.check_state(params, opt.init(params))
    state = opt.init({n: p for n, p in params.items() if n != "scale"})
    has_dicts = any(getattr(state, f.name) for f in attrs.fields(type(state))[1:])
    if has_dicts:
        with pytest.raises(ValueError, match=r"keys do not match the params: missing \['scale'\]"):
            opt.check_state(params, state)
        bigger = opt.init({**params, "extra": torch.zeros(1)})
        with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
            opt.check_state(params, bigger)
        reshaped = opt.init({**params, "scale": torch.zeros(2)})
        with pytest.raises(ValueError, match="shape"):
            opt.check_state(params, reshaped)


@pytest.mark.parametrize("opt", OPTS)
def test_update_rejects_params_with_other_names_than_the_state(opt: optim.Optimizer[Any]) -> None:
    # the one structure check update keeps: a comparison of the names, not of the shapes
    params = _some_params()
    state = opt.init({n: p for n, p in params.items() if n != "scale"})
    has_dicts = any(getattr(state, f.name) for f in attrs.fields(type(state))[1:])
    if has_dicts:
        with pytest.raises(ValueError, match=r"keys do not match the params: missing \['scale'\]"):
            opt.update(params, {}, state)
        bigger = opt.init({**params, "extra": torch.zeros(1)})
        with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
            opt.update(params, {}, bigger)
        assert int(state.count) == 0 and int(bigger.count) == 0


def test_check_state_rejects_a_state_from_another_configuration() -> None:
    params = _some_params()
    with pytest.raises(ValueError, match="max_exp_avg_sq must be empty"):
        optim.adamw().check_state(params, optim.adamw(amsgrad=True).init(params))
    with pytest.raises(ValueError, match="max_exp_avg_sq keys do not match"):
        optim.adamw(amsgrad=True).check_state(params, optim.adamw().init(params))
    with pytest.raises(ValueError, match="momentum_buffer must be empty"):
        optim.sgd().check_state(params, optim.sgd(momentum=0.9).init(params))
    with pytest.raises(TypeError, match="AdamWState"):
        optim.adamw().check_state(params, optim.sgd().init(params))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SGDState"):
        optim.sgd().check_state(params, optim.adamw().init(params))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping of names"):
        optim.adamw().check_state([torch.zeros(1)], optim.adamw().init({}))  # type: ignore[arg-type]


def test_update_rejects_a_state_of_another_optimizer() -> None:
    params = _some_params()
    with pytest.raises(TypeError, match="AdamWState"):
        optim.adamw().update(params, {}, optim.sgd().init(params))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SGDState"):
        optim.sgd().update(params, {}, optim.adamw().init(params))  # type: ignore[arg-type]


@pytest.mark.parametrize("opt", OPTS)
def test_update_rejects_a_bad_grad_before_any_tensor_changes(opt: optim.Optimizer[Any]) -> None:
    # torch's single-tensor loop would have updated the params before the bad one
    params = _some_params()
    state = opt.init(params)
    before_params, before_state = clone(params), clone(state)
    grads: dict[str, Any] = {n: torch.ones(p.shape) for n, p in params.items()}
    grads["scale"] = torch.ones(params["scale"].shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="grad of 'scale' has dtype"):
        opt.update(params, grads, state)
    assert_trees_equal(params, before_params)
    assert_trees_equal(state, before_state)


def test_fused_init_rejects_non_floating_params() -> None:
    with pytest.raises(ValueError, match="fused=True"):
        optim.adamw(fused=True).init({"n": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="fused=True"):
        optim.sgd(momentum=0.9, fused=True).init({"n": torch.zeros(2, dtype=torch.int64)})


ADAMW_BAD = [
    dict(lr=-1e-3),
    dict(lr=float("nan")),
    dict(betas=(1.0, 0.999)),
    dict(betas=(-0.1, 0.999)),
    dict(betas=(0.9, 1.0)),
    dict(betas=(0.9, -1e-9)),
    dict(eps=-1e-8),
    dict(weight_decay=-0.1),
]
SGD_BAD = [
    dict(lr=-0.1),
    dict(momentum=-0.5),
    dict(weight_decay=-0.1),
    dict(nesterov=True),
    dict(nesterov=True, momentum=0.9, dampening=0.1),
]


@pytest.mark.parametrize("kwargs", ADAMW_BAD, ids=repr)
def test_adamw_rejects_what_torch_adamw_rejects(kwargs: dict[str, Any]) -> None:
    kwargs = dict(kwargs)
    lr = kwargs.pop("lr", 1e-3)
    with pytest.raises(ValueError):
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr, **kwargs)
    with pytest.raises(ValueError, match="Invalid"):
        optim.adamw(lr, **kwargs)


@pytest.mark.parametrize("kwargs", SGD_BAD, ids=repr)
def test_sgd_rejects_what_torch_sgd_rejects(kwargs: dict[str, Any]) -> None:
    kwargs = dict(kwargs)
    lr = kwargs.pop("lr", 1e-3)
    with pytest.raises(ValueError):
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, **kwargs)
    with pytest.raises(ValueError, match=r"Invalid|Nesterov"):
        optim.sgd(lr, **kwargs)


def test_foreach_and_fused_together_are_rejected() -> None:
    with pytest.raises(ValueError, match="cannot be `True` together"):
        optim.adamw(foreach=True, fused=True)
    with pytest.raises(ValueError, match="cannot be `True` together"):
        optim.sgd(foreach=True, fused=True)


def test_edge_hyperparameters_torch_accepts_are_accepted() -> None:
    optim.adamw(0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    optim.sgd(0.0, momentum=0.5, dampening=1.0, nesterov=False)
    optim.sgd(0.1, momentum=0.5, nesterov=True)


# --------------------------------------------------------------------------------------
# Optimizers are static metadata
# --------------------------------------------------------------------------------------


def test_optimizers_are_hashable_static_metadata_not_pytrees() -> None:
    a, b = optim.adamw(1e-4, betas=(0.0, 0.99)), optim.adamw(1e-4, betas=(0.0, 0.99))
    assert a == b and hash(a) == hash(b) and a != optim.adamw(2e-4)
    assert optim.sgd(0.1, momentum=0.9) == optim.sgd(0.1, momentum=0.9)
    assert len({a, b, optim.sgd()}) == 2
    assert optree.tree_leaves(a, namespace=NAMESPACE) == [a]
    for opt in (a, optim.sgd()):
        assert isinstance(opt, optim.Optimizer)
        assert opt.needs_fp32_master is True
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            opt.lr = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------
# DTensor (FSDP2-sharded) params: two gloo ranks on CPU
# --------------------------------------------------------------------------------------


def _dtensor_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(0)
        full = {"w": torch.randn(6, 3, generator=gen), "b": torch.randn(5, generator=gen)}

        def shard(t: torch.Tensor) -> torch.Tensor:
            return distribute_tensor(t, mesh, [Shard(0)])

        for make, make_torch in [
            (
                lambda: optim.adamw(0.1, amsgrad=True, weight_decay=0.1),
                lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True, weight_decay=0.1),
            ),
            (
                lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, foreach=True),
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, foreach=True),
            ),
        ]:
            fparams = {n: torch.nn.Parameter(shard(t.clone())) for n, t in full.items()}
            tparams = {n: torch.nn.Parameter(shard(t.clone())) for n, t in full.items()}
            opt, topt = make(), make_torch(list(tparams.values()))
            state = opt.init(fparams)
            moments = (
                state.exp_avg if isinstance(state, optim.AdamWState) else state.momentum_buffer
            )
            for leaf in moments.values():
                assert type(leaf).__name__ == "DTensor" and leaf.placements == (Shard(0),)
            for step in range(4):
                g = {n: shard(torch.randn(t.shape, generator=gen)) for n, t in full.items()}
                if step == 0:
                    g["b"] = None
                for n, p in tparams.items():
                    p.grad = None if g[n] is None else g[n].clone()
                topt.step()
                state = opt.update(fparams, g, state)
                assert_trees_equal(_detached(fparams), _detached(tparams))
                for n, p in tparams.items():
                    torch_state = topt.state.get(p) or {}
                    assert bool(torch_state) == (step > 0 or n == "w")
                    for key, value in torch_state.items():
                        assert_trees_equal(getattr(state, key)[n], value)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multirank
def test_dtensor_params_are_bitwise_torch_optim_on_dtensors() -> None:
    import torch._dynamo  # distribute_tensor imports it lazily, slowly, in each rank
    import torch.distributed.tensor  # noqa: F401
    import torch.multiprocessing as mp

    # fork: the ranks inherit the imported modules (spawn would re-import them per rank).
    mp.start_processes(
        _dtensor_worker, args=(2, _free_port()), nprocs=2, join=True, start_method="fork"
    )


# --------------------------------------------------------------------------------------
# One factory per optimizer; one definition of a learning rate
# --------------------------------------------------------------------------------------


def test_each_factory_returns_its_small_class_and_the_class_checks_its_fields() -> None:
    opt = optim.adamw(0.1, betas=[0.8, 0.9])  # type: ignore[arg-type]
    assert type(opt) is optim.AdamW and opt.betas == (0.8, 0.9) and opt.weight_decay == 1e-2
    assert type(optim.sgd(0.1)) is optim.SGD
    # Built directly, the same checks hold (the factory only documents and defaults).
    fields = {f.name: getattr(opt, f.name) for f in attrs.fields(optim.AdamW)}
    assert optim.AdamW(**fields) == opt
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.AdamW(**{**fields, "lr": -1.0})
    with pytest.raises(ValueError, match="Invalid beta"):
        optim.AdamW(**{**fields, "betas": (0.9, 1.5)})


@pytest.mark.parametrize(
    ("lr", "error", "message"),
    [
        (-1e-3, ValueError, r"Invalid learning rate: lr must be >= 0"),
        (float("nan"), ValueError, r"Invalid learning rate: lr must be finite"),
        (float("inf"), ValueError, r"Invalid learning rate: lr must be finite"),
        ("1e-3", TypeError, r"lr must be a real number"),
        (True, TypeError, r"lr must be a real number"),
    ],
)
def test_optimizers_and_schedules_reject_the_same_learning_rates_alike(lr, error, message) -> None:
    from fvstep.core import schedules

    for build in (optim.adamw, optim.sgd, schedules.constant):
        with pytest.raises(error, match=message):
            build(lr)


def test_optimizers_have_a_repr():
    # attrs-generated methods read a module global named `_compat`: a module that imports
    # fvstep.core._compat under that name breaks them (it did, in optim.py).
    assert repr(optim.adamw(lr=1e-3)).startswith("AdamW(")
    assert repr(optim.sgd(lr=1e-3)).startswith("SGD(")
