"""Laws for fvstep.core.schedules: bit-identity with diffusers / torch schedulers, join, purity, validation.

Reference values are read the way a training loop sees them: ``optimizer.param_groups[0]["lr"]``
before each ``scheduler.step()``, for 1,000 steps.
"""

from __future__ import annotations

import doctest
import inspect
import math
import random
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from diffusers.optimization import (
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_polynomial_decay_schedule_with_warmup,
    get_scheduler,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler

from fvstep.core import schedules

N_STEPS = 1000
LAW = settings(max_examples=10, deadline=None)

lrs = st.floats(min_value=1e-8, max_value=10.0, allow_nan=False, allow_infinity=False)
ratios = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
# Totals straddle N_STEPS so that behaviour past total_steps is compared too.
totals = st.integers(min_value=1, max_value=1200)


@st.composite
def warmup_and_total(draw: st.DrawFn, *, strict: bool = False) -> tuple[int, int]:
    total = draw(st.integers(min_value=2 if strict else 1, max_value=1200))
    warmup = draw(st.integers(min_value=0, max_value=total - 1 if strict else total))
    return warmup, total


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _stepped_lrs(
    make: Callable[[torch.optim.Optimizer], LRScheduler], lr: float, n: int = N_STEPS
) -> list[float]:
    """The LR in the param group before each of ``n`` ``scheduler.step()`` calls."""
    opt = _optimizer(lr)
    scheduler = make(opt)
    seen = []
    for _ in range(n):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()  # no grads: a no-op, but keeps torch's "step order" check quiet
        scheduler.step()
    return seen


def _closed_form_lrs(
    make: Callable[[torch.optim.Optimizer], LRScheduler], lr: float, n: int = N_STEPS
) -> list[float]:
    """The LR torch's ``_get_closed_form_lr`` gives at steps ``0..n-1`` (``step(epoch)``)."""
    opt = _optimizer(lr)
    scheduler = make(opt)
    seen = []
    with warnings.catch_warnings():
        # step(epoch) is the public entry to the closed form; torch marks it deprecated.
        warnings.filterwarnings("ignore", message=".*epoch parameter.*", category=UserWarning)
        for i in range(n):
            opt.step()
            scheduler.step(i)
            seen.append(opt.param_groups[0]["lr"])
    return seen


def _assert_bit_identical(schedule: schedules.Schedule, expected: list[float]) -> None:
    for i, want in enumerate(expected):
        got = schedule(i)
        assert type(got) is float
        assert got == want, f"step {i}: fvstep {got!r} != reference {want!r}"


# --------------------------------------------------------------------------------------
# Bit-identity with diffusers (exact `==`)
# --------------------------------------------------------------------------------------


@LAW
@given(lr=lrs)
def test_constant_matches_diffusers_constant_step_for_step(lr: float) -> None:
    expected = _stepped_lrs(lambda o: get_scheduler("constant", o), lr)
    _assert_bit_identical(schedules.constant(lr), expected)


@LAW
@given(lr=lrs, warmup=st.integers(min_value=0, max_value=1200))
def test_constant_with_warmup_matches_diffusers_constant_with_warmup_step_for_step(
    lr: float, warmup: int
) -> None:
    expected = _stepped_lrs(
        lambda o: get_scheduler("constant_with_warmup", o, num_warmup_steps=warmup), lr
    )
    _assert_bit_identical(schedules.constant_with_warmup(lr, warmup_steps=warmup), expected)
    # init_ratio=0 given explicitly is the same schedule, bit for bit.
    _assert_bit_identical(
        schedules.constant_with_warmup(lr, warmup_steps=warmup, init_ratio=0.0), expected
    )


@LAW
@given(lr=lrs, wt=warmup_and_total())
def test_warmup_cosine_matches_diffusers_cosine_step_for_step(
    lr: float, wt: tuple[int, int]
) -> None:
    warmup, total = wt
    expected = _stepped_lrs(
        lambda o: get_scheduler("cosine", o, num_warmup_steps=warmup, num_training_steps=total),
        lr,
    )
    _assert_bit_identical(
        schedules.warmup_cosine(lr, warmup_steps=warmup, total_steps=total), expected
    )


@LAW
@given(
    lr=lrs,
    wt=warmup_and_total(),
    cycles=st.floats(min_value=0.05, max_value=4.0, allow_nan=False),
)
def test_warmup_cosine_matches_diffusers_cosine_for_any_num_cycles_step_for_step(
    lr: float, wt: tuple[int, int], cycles: float
) -> None:
    # get_scheduler("cosine") does not forward num_cycles, so call the function directly.
    warmup, total = wt
    expected = _stepped_lrs(
        lambda o: get_cosine_schedule_with_warmup(o, warmup, total, num_cycles=cycles), lr
    )
    _assert_bit_identical(
        schedules.warmup_cosine(lr, warmup_steps=warmup, total_steps=total, num_cycles=cycles),
        expected,
    )


@LAW
@given(lr=lrs, total=totals, cycles=st.floats(min_value=0.05, max_value=4.0, allow_nan=False))
def test_cosine_matches_diffusers_cosine_without_warmup_step_for_step(
    lr: float, total: int, cycles: float
) -> None:
    expected = _stepped_lrs(
        lambda o: get_cosine_schedule_with_warmup(o, 0, total, num_cycles=cycles), lr
    )
    _assert_bit_identical(schedules.cosine(lr, total_steps=total, num_cycles=cycles), expected)


@LAW
@given(lr=lrs, wt=warmup_and_total(), cycles=st.integers(min_value=1, max_value=8))
def test_warmup_cosine_restarts_matches_diffusers_cosine_with_restarts_step_for_step(
    lr: float, wt: tuple[int, int], cycles: int
) -> None:
    warmup, total = wt
    expected = _stepped_lrs(
        lambda o: get_scheduler(
            "cosine_with_restarts",
            o,
            num_warmup_steps=warmup,
            num_training_steps=total,
            num_cycles=cycles,
        ),
        lr,
    )
    _assert_bit_identical(
        schedules.warmup_cosine_restarts(
            lr, warmup_steps=warmup, total_steps=total, num_cycles=cycles
        ),
        expected,
    )


@LAW
@given(lr=lrs, wt=warmup_and_total())
def test_warmup_linear_matches_diffusers_linear_step_for_step(
    lr: float, wt: tuple[int, int]
) -> None:
    warmup, total = wt
    expected = _stepped_lrs(
        lambda o: get_scheduler("linear", o, num_warmup_steps=warmup, num_training_steps=total),
        lr,
    )
    _assert_bit_identical(
        schedules.warmup_linear(lr, warmup_steps=warmup, total_steps=total), expected
    )
    _assert_bit_identical(
        schedules.linear_decay(lr, warmup_steps=warmup, total_steps=total), expected
    )


@pytest.mark.skipif(
    "f_min" not in inspect.signature(get_linear_schedule_with_warmup).parameters,
    reason="this diffusers has no f_min",
)
@LAW
@given(lr=lrs, wt=warmup_and_total(), floor=ratios)
def test_warmup_linear_min_ratio_matches_diffusers_linear_f_min_step_for_step(
    lr: float, wt: tuple[int, int], floor: float
) -> None:
    warmup, total = wt
    expected = _stepped_lrs(
        lambda o: get_linear_schedule_with_warmup(o, warmup, total, f_min=floor), lr
    )
    _assert_bit_identical(
        schedules.warmup_linear(lr, warmup_steps=warmup, total_steps=total, min_ratio=floor),
        expected,
    )


@LAW
@given(
    lr=lrs,
    wt=warmup_and_total(strict=True),
    end_fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    power=st.floats(min_value=0.1, max_value=5.0, allow_nan=False),
)
def test_polynomial_matches_diffusers_polynomial_step_for_step(
    lr: float, wt: tuple[int, int], end_fraction: float, power: float
) -> None:
    # get_scheduler("polynomial") does not forward lr_end, so call the function directly.
    warmup, total = wt
    end_lr = lr * end_fraction
    expected = _stepped_lrs(
        lambda o: get_polynomial_decay_schedule_with_warmup(
            o, warmup, total, lr_end=end_lr, power=power
        ),
        lr,
    )
    _assert_bit_identical(
        schedules.polynomial(
            lr, warmup_steps=warmup, total_steps=total, end_lr=end_lr, power=power
        ),
        expected,
    )


@LAW
@given(
    lr=st.floats(min_value=1e-6, max_value=10.0),
    wt=warmup_and_total(strict=True),
    power=st.floats(min_value=0.1, max_value=5.0, allow_nan=False),
)
def test_polynomial_default_end_lr_matches_diffusers_get_scheduler_polynomial_step_for_step(
    lr: float, wt: tuple[int, int], power: float
) -> None:
    warmup, total = wt
    expected = _stepped_lrs(
        lambda o: get_scheduler(
            "polynomial", o, num_warmup_steps=warmup, num_training_steps=total, power=power
        ),
        lr,
    )
    _assert_bit_identical(
        schedules.polynomial(lr, warmup_steps=warmup, total_steps=total, power=power), expected
    )


@LAW
@given(
    lr=lrs,
    data=st.data(),
)
def test_piecewise_constant_matches_diffusers_piecewise_constant_step_for_step(
    lr: float, data: st.DataObject
) -> None:
    bounds = sorted(
        data.draw(st.sets(st.integers(min_value=1, max_value=1200), min_size=0, max_size=5))
    )
    mults = data.draw(st.lists(ratios, min_size=len(bounds) + 1, max_size=len(bounds) + 1))
    # repr(float) round-trips, so diffusers parses exactly these multipliers.
    rules = ",".join(
        [*(f"{m!r}:{b}" for m, b in zip(mults, bounds, strict=False)), repr(mults[-1])]
    )
    expected = _stepped_lrs(lambda o: get_scheduler("piecewise_constant", o, step_rules=rules), lr)
    _assert_bit_identical(schedules.piecewise_constant([lr * m for m in mults], bounds), expected)


# --------------------------------------------------------------------------------------
# Agreement with torch's own schedulers
# --------------------------------------------------------------------------------------


@LAW
@given(
    lr=lrs,
    warmup=st.integers(min_value=1, max_value=1200),
    init=st.floats(min_value=1e-3, max_value=1.0, allow_nan=False),
)
def test_constant_with_warmup_matches_torch_linear_lr_closed_form_exactly(
    lr: float, warmup: int, init: float
) -> None:
    expected = _closed_form_lrs(
        lambda o: LinearLR(o, start_factor=init, end_factor=1.0, total_iters=warmup), lr
    )
    _assert_bit_identical(
        schedules.constant_with_warmup(lr, warmup_steps=warmup, init_ratio=init), expected
    )


@LAW
@given(
    lr=lrs,
    warmup=st.integers(min_value=1, max_value=1200),
    init=st.floats(min_value=1e-3, max_value=1.0, allow_nan=False),
)
def test_constant_with_warmup_tracks_torch_stepped_linear_lr_within_rounding(
    lr: float, warmup: int, init: float
) -> None:
    # Exact equality (or 1 ulp) is impossible here: stepped LinearLR multiplies the previous
    # LR by a ratio each step, so rounding accumulates over the warmup (measured up to
    # ~90 ulp(lr) over 1,000 steps), while its closed form, which we match exactly (see
    # above), does not. 1e-12 * lr is ~4,500 ulp(lr): loose for drift, tight for any bug.
    expected = _stepped_lrs(
        lambda o: LinearLR(o, start_factor=init, end_factor=1.0, total_iters=warmup), lr
    )
    sched = schedules.constant_with_warmup(lr, warmup_steps=warmup, init_ratio=init)
    for i, want in enumerate(expected):
        assert math.isclose(sched(i), want, rel_tol=0.0, abs_tol=1e-12 * lr), i


@LAW
@given(lr=lrs, total=st.integers(min_value=1, max_value=N_STEPS), floor=ratios)
def test_cosine_matches_torch_cosine_annealing_closed_form_within_16_ulp_of_lr(
    lr: float, total: int, floor: float
) -> None:
    # Exact equality is impossible: torch computes eta_min + (lr - eta_min) * (1 + cos(pi * t / T)) / 2
    # while we follow diffusers' operation order, lr * (m + (1 - m) * 0.5 * (1 + cos(pi * (t / T)))),
    # which we must keep to be bit-identical to diffusers. The two round differently (the
    # cosine's argument alone can differ by an ulp of pi); measured differences are <= 3 ulp(lr)
    # on [0, total], the error analysis bounds them by ~10 ulp(lr).
    # Past total the arguments grow and their rounding is amplified, so compare on [0, total].
    eta_min = lr * floor
    expected = _closed_form_lrs(
        lambda o: CosineAnnealingLR(o, T_max=total, eta_min=eta_min), lr, total + 1
    )
    sched = schedules.cosine(lr, total_steps=total, min_ratio=floor)
    for i in range(total + 1):
        assert abs(sched(i) - expected[i]) <= 16 * math.ulp(lr), i


@LAW
@given(lr=lrs, total=st.integers(min_value=1, max_value=N_STEPS - 1), floor=ratios)
def test_cosine_tracks_torch_stepped_cosine_annealing_within_rounding(
    lr: float, total: int, floor: float
) -> None:
    # Exact equality (or 1 ulp) is impossible: stepped CosineAnnealingLR is recursive
    # (lr_t = eta_min + ratio_t * (lr_{t-1} - eta_min)) and accumulates rounding, measured up
    # to ~100 ulp(lr) on [0, total] (and far more after total, where the ratio is
    # ill-conditioned). 1e-12 * lr is ~4,500 ulp(lr): loose for drift, tight for any bug.
    eta_min = lr * floor
    expected = _stepped_lrs(
        lambda o: CosineAnnealingLR(o, T_max=total, eta_min=eta_min), lr, total + 1
    )
    sched = schedules.cosine(lr, total_steps=total, min_ratio=floor)
    for i, want in enumerate(expected):
        assert math.isclose(sched(i), want, rel_tol=0.0, abs_tol=1e-12 * lr), i


@LAW
@given(
    lr=lrs,
    factor=st.floats(min_value=1e-3, max_value=1.0, allow_nan=False),
    until=st.integers(min_value=1, max_value=1200),
)
def test_piecewise_constant_matches_torch_constant_lr(lr: float, factor: float, until: int) -> None:
    expected = _stepped_lrs(lambda o: ConstantLR(o, factor=factor, total_iters=until), lr)
    sched = schedules.piecewise_constant([lr * factor, lr], [until])
    for i, want in enumerate(expected):
        if i < until:
            assert sched(i) == want, i
        else:
            # torch restores the LR as (lr * factor) * (1.0 / factor), which need not round
            # back to lr exactly; it lands within 1 ulp(lr) of it.
            assert abs(sched(i) - want) <= math.ulp(lr), i


# --------------------------------------------------------------------------------------
# join
# --------------------------------------------------------------------------------------


def _tagged(tag: int) -> schedules.Schedule:
    """A schedule whose value encodes which piece answered and the step it was given."""
    return lambda step: float(tag * 1_000_000 + step)


@LAW
@given(bounds=st.sets(st.integers(min_value=0, max_value=300), max_size=6).map(sorted))
def test_join_uses_ith_schedule_on_its_segment_with_the_step_shifted_to_the_segment_start(
    bounds: list[int],
) -> None:
    joined = schedules.join([_tagged(i) for i in range(len(bounds) + 1)], bounds)
    starts = [0, *bounds]
    for step in range((bounds[-1] if bounds else 0) + 5):
        piece = sum(b <= step for b in bounds)
        assert joined(step) == float(piece * 1_000_000 + step - starts[piece]), step
    for i, b in enumerate(bounds):
        assert joined(b) == float((i + 1) * 1_000_000)  # first step of piece i+1 is its step 0
        if b > starts[i]:
            assert joined(b - 1) == float(i * 1_000_000 + b - 1 - starts[i])


def test_join_of_warmup_and_cosine_hands_over_at_the_boundary() -> None:
    warm = schedules.constant_with_warmup(1e-3, warmup_steps=10)
    decay = schedules.cosine(1e-3, total_steps=90, min_ratio=0.1)
    sched = schedules.join([warm, decay], [10])
    assert [sched(i) for i in range(10)] == [warm(i) for i in range(10)]
    assert [sched(10 + i) for i in range(200)] == [decay(i) for i in range(200)]


def test_join_of_one_schedule_is_that_schedule() -> None:
    inner = schedules.warmup_linear(0.1, warmup_steps=3, total_steps=20)
    sched = schedules.join([inner], [])
    assert [sched(i) for i in range(30)] == [inner(i) for i in range(30)]


# --------------------------------------------------------------------------------------
# Purity and step types
# --------------------------------------------------------------------------------------


def _all_schedules() -> list[schedules.Schedule]:
    lr = 3e-4
    return [
        schedules.constant(lr),
        schedules.constant_with_warmup(lr, warmup_steps=7),
        schedules.constant_with_warmup(lr, warmup_steps=7, init_ratio=0.3),
        schedules.cosine(lr, total_steps=50, min_ratio=0.1, num_cycles=0.75),
        schedules.warmup_cosine(lr, warmup_steps=5, total_steps=50, min_ratio=0.2),
        schedules.warmup_cosine_restarts(lr, warmup_steps=5, total_steps=50, num_cycles=3),
        schedules.warmup_linear(lr, warmup_steps=5, total_steps=50, min_ratio=0.1),
        schedules.linear_decay(lr, total_steps=50),
        schedules.polynomial(lr, warmup_steps=5, total_steps=50, end_lr=1e-6, power=2.0),
        schedules.piecewise_constant([lr, lr / 10, lr / 100], [10, 30]),
        schedules.join(
            [
                schedules.constant_with_warmup(lr, warmup_steps=5),
                schedules.linear_decay(lr, total_steps=40),
            ],
            [10],
        ),
    ]


@pytest.mark.parametrize("sched", _all_schedules(), ids=lambda s: s.__name__)
def test_schedules_are_pure_any_call_order_gives_the_same_values(
    sched: schedules.Schedule,
) -> None:
    steps = list(range(80))
    in_order = [sched(i) for i in steps]
    shuffled = steps[:]
    random.Random(0).shuffle(shuffled)
    out_of_order = {i: sched(i) for i in shuffled}
    assert [out_of_order[i] for i in steps] == in_order
    assert [sched(i) for i in steps] == in_order  # and again
    assert all(type(v) is float and math.isfinite(v) and v >= 0.0 for v in in_order)


@pytest.mark.parametrize("sched", _all_schedules(), ids=lambda s: s.__name__)
def test_integer_tensor_and_numpy_steps_give_the_int_step_value(
    sched: schedules.Schedule,
) -> None:
    for i in (0, 3, 17, 64):
        assert sched(torch.tensor(i)) == sched(i)  # type: ignore[arg-type]
        assert sched(torch.tensor(i, dtype=torch.int32)) == sched(i)  # type: ignore[arg-type]
        assert sched(np.int64(i)) == sched(i)


@pytest.mark.parametrize("sched", _all_schedules(), ids=lambda s: s.__name__)
def test_negative_or_non_integer_steps_are_rejected(sched: schedules.Schedule) -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        sched(-1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        sched(torch.tensor(-3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an integer"):
        sched(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an integer"):
        sched(torch.tensor(1.0))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

S = schedules
BAD_HYPERPARAMETERS: list[tuple[str, Callable[[], object], str]] = [
    ("negative lr", lambda: S.constant(-1e-3), "lr must be >= 0"),
    ("nan lr", lambda: S.constant(math.nan), "lr must be finite"),
    ("inf lr", lambda: S.warmup_cosine(math.inf, warmup_steps=0, total_steps=5), "finite"),
    ("negative warmup", lambda: S.constant_with_warmup(1.0, warmup_steps=-1), "warmup_steps"),
    (
        "init_ratio > 1",
        lambda: S.constant_with_warmup(1.0, warmup_steps=2, init_ratio=1.5),
        "init_ratio",
    ),
    (
        "init_ratio < 0",
        lambda: S.constant_with_warmup(1.0, warmup_steps=2, init_ratio=-0.1),
        "init_ratio",
    ),
    ("zero total", lambda: S.cosine(1.0, total_steps=0), "total_steps must be >= 1"),
    ("negative total", lambda: S.linear_decay(1.0, total_steps=-5), "total_steps"),
    (
        "warmup > total",
        lambda: S.warmup_cosine(1.0, warmup_steps=11, total_steps=10),
        r"warmup_steps \(11\) must not exceed total_steps \(10\)",
    ),
    (
        "warmup > total",
        lambda: S.warmup_linear(1.0, warmup_steps=11, total_steps=10),
        "must not exceed",
    ),
    (
        "warmup > total",
        lambda: S.warmup_cosine_restarts(1.0, warmup_steps=11, total_steps=10),
        "must not exceed",
    ),
    (
        "min_ratio > 1",
        lambda: S.cosine(1.0, total_steps=10, min_ratio=1.01),
        r"min_ratio must lie in \[0, 1\]",
    ),
    (
        "min_ratio < 0",
        lambda: S.warmup_cosine(1.0, warmup_steps=1, total_steps=10, min_ratio=-0.5),
        "min_ratio",
    ),
    (
        "min_ratio > 1",
        lambda: S.warmup_linear(1.0, warmup_steps=1, total_steps=10, min_ratio=2.0),
        "min_ratio",
    ),
    (
        "zero cycles",
        lambda: S.cosine(1.0, total_steps=10, num_cycles=0.0),
        "num_cycles must be > 0",
    ),
    (
        "zero restarts",
        lambda: S.warmup_cosine_restarts(1.0, warmup_steps=0, total_steps=10, num_cycles=0),
        "num_cycles",
    ),
    (
        "end_lr >= lr",
        lambda: S.polynomial(1e-3, warmup_steps=0, total_steps=10, end_lr=1e-3),
        "end_lr",
    ),
    (
        "negative end_lr",
        lambda: S.polynomial(1e-3, warmup_steps=0, total_steps=10, end_lr=-1.0),
        "end_lr must be >= 0",
    ),
    (
        "no decay steps",
        lambda: S.polynomial(1.0, warmup_steps=10, total_steps=10),
        "at least one step",
    ),
    (
        "zero power",
        lambda: S.polynomial(1.0, warmup_steps=0, total_steps=10, power=0.0),
        "power must be > 0",
    ),
    ("no schedules", lambda: S.join([], []), "at least one schedule"),
    ("boundary count", lambda: S.join([S.constant(1.0)] * 2, [1, 2]), "one boundary fewer"),
    ("unsorted boundaries", lambda: S.join([S.constant(1.0)] * 3, [5, 5]), "strictly increasing"),
    (
        "negative boundary",
        lambda: S.join([S.constant(1.0)] * 2, [-1]),
        r"boundaries\[0\] must be >= 0",
    ),
    ("no values", lambda: S.piecewise_constant([], []), "at least one value"),
    ("value count", lambda: S.piecewise_constant([1.0, 0.1], []), "one boundary fewer"),
    (
        "unsorted boundaries",
        lambda: S.piecewise_constant([1.0, 0.5, 0.1], [20, 10]),
        "strictly increasing",
    ),
    (
        "negative value",
        lambda: S.piecewise_constant([1.0, -0.1], [10]),
        r"values\[1\] must be >= 0",
    ),
]


@pytest.mark.parametrize(
    ("build", "message"),
    [(b, m) for _, b, m in BAD_HYPERPARAMETERS],
    ids=[name for name, _, _ in BAD_HYPERPARAMETERS],
)
def test_bad_hyperparameters_raise_value_error(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_non_integer_step_counts_and_non_callable_pieces_raise_type_error() -> None:
    with pytest.raises(TypeError, match="warmup_steps must be an integer"):
        S.constant_with_warmup(1.0, warmup_steps=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="total_steps must be an integer"):
        S.cosine(1.0, total_steps=10.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lr must be a real number"):
        S.constant("1e-3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"schedules\[1\] must be callable"):
        S.join([S.constant(1.0), 0.5], [3])  # type: ignore[list-item]


def test_docstring_examples_hold() -> None:
    result = doctest.testmod(schedules, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
