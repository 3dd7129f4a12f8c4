"""Laws of the one step type: every combinator takes and returns steps; sub-steps are keyed
by name; the execution policy is explicit where it applies; the core sees only a protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fvstep as fs
from fvstep.core import tree
from fvstep.core.random import fold_in, fold_in_name, generator
from fvstep.core.state import is_consumed
from fvstep.core.steps import Chain

ROLES = ("a", "b", "c", "d")


def mlp(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))


def state_of(seed: int = 0) -> fs.TrainState:
    return fs.TrainState.create(
        {r: fs.Role(mlp(seed + i), optimizer=fs.optim.adamw(lr=1e-2)) for i, r in enumerate(ROLES)},
        key=fs.random.key(seed),
    )


def make_batch(seed: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, generator=g), "y": torch.randn(n, 2, generator=g)}


def recording(role: str, seen: list | None = None):
    """A loss that draws noise from its key (and dropout from the global RNG), and records
    ``(role, key, micro-batch size)``."""

    def loss_fn(state, batch, key):
        if seen is not None:
            seen.append((role, key, batch["x"].shape[0]))
        noise = torch.randn(batch["x"].shape, generator=generator(key)) * 0.01
        return ((state.module(role)(batch["x"] + noise) - batch["y"]) ** 2).mean()

    return loss_fn


def assert_same_keys(seen: list, expected: list) -> None:
    assert [(r, n) for r, _, n in seen] == [(r, n) for r, _, n in expected]
    for (_, k1, _), (_, k2, _) in zip(seen, expected, strict=True):
        assert torch.equal(k1, k2)


# ---------------------------------------------------------------------------------------
# keys by name
# ---------------------------------------------------------------------------------------


def test_a_units_keys_are_its_name_folded_into_the_step_key():
    seen: list = []
    step = fs.compile(
        fs.sequence(
            fs.every(2, fs.update("a", recording("a", seen), name="first")),
            fs.update("b", recording("b", seen)),
        ),
        accumulation=fs.Accumulation(2),
    )
    state = state_of()
    for s in range(3):
        seen.clear()
        state, _ = step(state, make_batch(s))
        step_key = fold_in(fold_in(fs.random.key(0), s), 0)
        expected = [("b", fold_in(fold_in_name(step_key, "b"), m), 2) for m in range(2)]
        if s % 2 == 0:
            first = [("a", fold_in(fold_in_name(step_key, "first"), m), 2) for m in range(2)]
            expected = first + expected
        assert_same_keys(seen, expected)


def test_a_managed_steps_key_is_its_name_folded_into_the_step_key():
    seen = []

    def outer(state, batch, key, ctx):
        seen.append(key)
        return state, {}

    step = fs.sequence(fs.update("a", recording("a")), fs.managed(outer, trains="b", name="rl"))
    step(state_of(), make_batch(0))
    step_key = fold_in(fold_in(fs.random.key(0), 0), 0)
    assert torch.equal(seen[0], fold_in_name(step_key, "rl"))


def later_unit_run(inserted: list[str], wrap: str, k: int, seed: int) -> tuple[list, dict]:
    """Run ``b`` (named "later") after units named ``inserted`` (training other roles)."""
    seen: list = []
    units = [
        fs.update(ROLES[2 + i % 2], recording(ROLES[2 + i % 2]), name=n)
        for i, n in enumerate(inserted)
    ]
    later = fs.update("b", recording("b", seen), name="later")
    wrapped = {
        "none": lambda u: u,
        "every": lambda u: fs.every(1, u),
        "cond": lambda u: fs.cond(lambda i: i % 2 == 0, u),
    }[wrap]
    step = fs.compile(fs.sequence(*map(wrapped, units), later), accumulation=fs.Accumulation(k))
    state = state_of(seed)
    for i in range(2):
        state, _ = step(state, make_batch(seed + i))
    return seen, tree.clone(state.roles["b"])


@settings(max_examples=12, deadline=None)
@given(
    inserted=st.lists(
        st.sampled_from(["critic", "x", "gen", "u1"]), min_size=1, max_size=3, unique=True
    ),
    wrap=st.sampled_from(["none", "every", "cond"]),
    k=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_inserting_a_unit_in_front_does_not_change_a_later_units_noise(inserted, wrap, k, seed):
    alone, b_alone = later_unit_run([], wrap, k, seed)
    after, b_after = later_unit_run(inserted, wrap, k, seed)
    assert_same_keys(after, alone)
    tree.assert_trees_equal(b_after, b_alone, check_static=False)  # its noise and dropout too


def test_two_leaves_of_one_name_are_refused_at_composition():
    a1, a2 = fs.update("a", recording("a")), fs.update(("a", "b"), recording("a"), name="a")
    with pytest.raises(ValueError, match=r"sequence: unit 'a' and unit 'a' share the name") as info:
        fs.sequence(a1, fs.every(2, a2))
    assert "update(..., name=" in str(info.value) and "fold_in_name" in str(info.value)
    with pytest.raises(ValueError, match="the same unit 'a' appears twice"):
        fs.sequence(a1, a1)
    with pytest.raises(ValueError, match="cond: unit 'a' and unit 'a' share the name"):
        fs.cond(lambda i: i > 0, a1, a2)
    with pytest.raises(ValueError, match="compile: the same unit 'a' appears twice"):
        fs.compile(Chain((a1, a1)))  # built around the combinator's check
    m = fs.managed(lambda s, b, k, ctx: (s, {}), trains="b", name="a")
    with pytest.raises(ValueError, match="unit 'a' and managed step 'a' share the name"):
        fs.sequence(a1, m)
    fs.sequence(a1, fs.update("a", recording("a"), name="a_again"))  # renamed: fine


# ---------------------------------------------------------------------------------------
# one step type
# ---------------------------------------------------------------------------------------


def test_a_unit_called_directly_is_the_unit_compiled_with_the_defaults():
    unit = fs.update("a", recording("a"))
    s1, s2 = state_of(), state_of()
    n1, m1 = unit(s1, make_batch(0))
    n2, m2 = fs.compile(unit)(s2, make_batch(0))
    tree.assert_trees_equal(n1, n2, check_static=False)
    tree.assert_trees_equal(m1, m2)
    assert is_consumed(s1) and int(n1.step) == 1
    assert [(e.roles, e.sanitize, e.clip, e.accumulation) for e in unit.plan(0)] == [
        (("a",), "error", None, fs.Accumulation())
    ]


@pytest.mark.parametrize("combinator", ["sequence", "every", "cond", "compile", "managed"])
def test_every_combinator_returns_a_step_that_composes(combinator):
    unit = fs.update("a", recording("a"))

    def outer(state, batch, key, ctx):
        return ctx.update(state, unit, batch, key)

    made = {
        "sequence": lambda: fs.sequence(unit),
        "every": lambda: fs.every(1, unit),
        "cond": lambda: fs.cond(lambda i: True, unit),
        "compile": lambda: fs.compile(unit),
        "managed": lambda: fs.managed(outer, trains="a", name="m"),
    }[combinator]()
    assert isinstance(made, fs.Step)
    state, metrics = fs.sequence(made, fs.update("b", recording("b")))(state_of(), make_batch(0))
    assert "a/loss" in metrics and "b/loss" in metrics and int(state.step) == 1


def test_compiled_steps_compose_each_with_its_own_accumulation():
    seen: list = []
    a, b = fs.update("a", recording("a", seen)), fs.update("b", recording("b", seen))
    step = fs.sequence(fs.compile(a, accumulation=fs.Accumulation(4)), fs.compile(b))
    step(state_of(), make_batch(0))
    assert [(r, n) for r, _, n in seen] == [("a", 1)] * 4 + [("b", 4)]
    assert [e.accumulation.microbatches for e in step.plan(0)] == [4, 1]


def test_nested_compiles_equal_one_compile_of_the_same_policy_bitwise():
    a, b = fs.update("a", recording("a")), fs.update("b", recording("b"))
    acc, clip = fs.Accumulation(2), fs.clip_grad_norm(0.1)
    nested = fs.sequence(
        fs.compile(a, accumulation=acc, clip=clip), fs.compile(b, accumulation=acc, clip=clip)
    )
    flat = fs.compile(fs.sequence(a, b), accumulation=acc, clip=clip)
    s1, s2 = state_of(3), state_of(3)
    for i in range(3):
        s1, m1 = nested(s1, make_batch(i))
        s2, m2 = flat(s2, make_batch(i))
        tree.assert_trees_equal(m1, m2)
    tree.assert_trees_equal(s1, s2, check_static=False)


def test_the_policy_is_the_units_own_then_the_innermost_compiles_then_the_default():
    c1, c2 = fs.clip_grad_norm(1.0), fs.clip_grad_norm(2.0)
    a = fs.update("a", recording("a"), clip=None)  # its own: no clipping
    b = fs.update("b", recording("b"), sanitize="skip")
    c = fs.update("c", recording("c"))
    inner = fs.compile(fs.sequence(a, b), accumulation=fs.Accumulation(4), clip=c1)
    step = fs.compile(
        fs.sequence(inner, c), accumulation=fs.Accumulation(2), clip=c2, sanitize="nan_to_num"
    )
    got = [(e.name, e.accumulation.microbatches, e.clip, e.sanitize) for e in step.plan(0)]
    assert got == [("a", 4, None, "nan_to_num"), ("b", 4, c1, "skip"), ("c", 2, c2, "nan_to_num")]
    # An inner compile that sets nothing shadows nothing.
    assert fs.compile(fs.compile(c), sanitize="skip").plan(0)[0].sanitize == "skip"
    (entry,) = fs.compile(c).plan(0)
    assert entry.sanitize == "error" and entry.clip is None


def test_a_managed_steps_inner_units_take_its_policy_over_the_compiles():
    seen = {}
    inner = fs.update("a", recording("a"), name="inner")

    def outer(state, batch, key, ctx):
        seen["accumulation"] = ctx.accumulation
        return ctx.update(state, inner, batch, key)

    step = fs.compile(
        fs.managed(outer, trains="a", name="m", clip=fs.clip_grad_norm(0.5)),
        accumulation=fs.Accumulation(2),
        sanitize="skip",
    )
    (entry,) = step.plan(0)
    assert (entry.clip, entry.sanitize, entry.accumulation) == (
        fs.clip_grad_norm(0.5),
        "skip",
        fs.Accumulation(2),
    )
    _, metrics = step(state_of(), make_batch(0))
    assert seen["accumulation"] == fs.Accumulation(2)
    assert "a/grad_norm" in metrics and metrics["a/skipped"] is False


def test_plan_positions_are_the_depth_first_index_of_every_leaf():
    units = [fs.update(r, recording(r)) for r in ROLES]
    step = fs.compile(
        fs.sequence(
            fs.cond(lambda i: i % 2 == 0, units[0], fs.compile(units[1])),
            fs.every(3, fs.sequence(units[2], units[3])),
        )
    )
    assert [(e.position, e.name) for e in step.plan(0)] == [(0, "a"), (2, "c"), (3, "d")]
    assert [(e.position, e.name) for e in step.plan(1)] == [(1, "b")]


# ---------------------------------------------------------------------------------------
# checks and consumption once, at the outermost call
# ---------------------------------------------------------------------------------------


def test_a_typo_in_a_nested_compiled_step_is_caught_before_consumption():
    state = state_of()
    inner = fs.compile(fs.update("bb", recording("b")), accumulation=fs.Accumulation(2))
    step = fs.sequence(fs.update("a", recording("a")), fs.every(7, inner, offset=3))
    with pytest.raises(ValueError, match="no role 'bb'.*did you mean 'b'"):
        step(state, make_batch(0))
    assert not is_consumed(state)


def test_a_nested_compiled_step_failing_after_a_change_is_a_step_failed_error():
    def failing(state, batch, key):
        raise RuntimeError("b's data missing")

    state = state_of()
    step = fs.sequence(
        fs.compile(fs.update("a", recording("a"))), fs.compile(fs.update("b", failing))
    )
    with pytest.raises(fs.StepFailedError, match=r"failed in unit 'b' \(position 1") as info:
        step(state, make_batch(0))
    assert "already changed by unit 'a' (position 0" in str(info.value)
    assert is_consumed(state)


def test_a_nested_first_unit_failing_leaves_the_input_usable():
    def failing(state, batch, key):
        state.module("a")(batch["x"])
        raise KeyError("no such column")

    state = state_of()
    before = tree.clone(state)
    step = fs.sequence(fs.compile(fs.update("a", failing), accumulation=fs.Accumulation(2)))
    with pytest.raises(KeyError):
        step(state, make_batch(0))
    assert not is_consumed(state)
    tree.assert_trees_equal(state, before)


# ---------------------------------------------------------------------------------------
# the layout of a call
# ---------------------------------------------------------------------------------------


def test_single_process_refuses_sharded_roles_before_consumption():
    state = state_of()
    state.roles["a"].params["0.weight"].device_mesh = object()  # looks like a DTensor
    step = fs.compile(fs.update("b", recording("b")))
    with pytest.raises(ValueError, match="role 'a' has sharded.*one process.*parallel.Layout"):
        step(state, make_batch(0))  # the default layout: one process
    assert not is_consumed(state)


class RecordingParallelism:
    """A Parallelism of one process that records what the step asks of it."""

    def __init__(self) -> None:
        self.calls: list = []

    def check(self, state):
        self.calls.append("check")

    def grad_sync(self, state, accumulation):
        self.calls.append(("grad_sync", accumulation.microbatches))
        return None

    def data_parallel_rank_and_size(self):
        self.calls.append("dp")
        return 5, 6

    def collective_counter(self):
        return None

    def sum_over_ranks(self, value, like):
        self.calls.append("sum_over_ranks")
        return value


def test_the_step_uses_the_layout_it_is_called_with():
    seen: list = []
    parallelism = RecordingParallelism()
    step = fs.compile(
        fs.sequence(
            fs.compile(fs.update("a", recording("a", seen)), accumulation=fs.Accumulation(2)),
            fs.update("b", recording("b", seen)),
        ),
    )
    step(state_of(), make_batch(0), parallelism=parallelism)
    assert parallelism.calls == [
        "check",  # once per call, before anything runs
        "dp",
        ("grad_sync", 2),
        "sum_over_ranks",  # the sanitize="error" verdict, made global
        ("grad_sync", 1),
        "sum_over_ranks",
    ]
    step_key = fold_in(fold_in(fs.random.key(0), 0), 5)  # the data-parallel index it gave
    assert torch.equal(seen[-1][1], fold_in(fold_in_name(step_key, "b"), 0))


CORE = (
    "core/state",
    "core/engine",
    "core/steps",
    "core/settings",
    "core/layout",
    "core/managed",
    "core/finite",
    "core/optim",
    "core/random",
    "core/tree",
    "core/grads",
    "core/accumulation",
)


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_nothing_of_torch_distributed_or_the_parallel_layer(module):
    root = Path(fs.__file__).parent
    path = root / f"{module}.py"
    files = [path] if path.exists() else sorted((root / module).glob("*.py"))  # a package
    assert files, module
    source = "\n".join(f.read_text() for f in files)
    banned = ("torch.distributed", "fvstep.distributed", "fvstep.parallel")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        else:
            continue
        bad = [n for n in names if n.startswith(banned)]
        assert not bad, f"fvstep/{module}.py line {node.lineno} uses {bad}"


def test_two_units_of_one_role_keep_both_metrics_the_later_under_its_name():
    nan = lambda state, batch, key: state.module("a")(batch["x"]).sum() * float("nan")  # noqa: E731
    step = fs.compile(
        fs.sequence(fs.update("a", nan, name="u1"), fs.update("a", recording("a"), name="u2")),
        sanitize="skip",
    )
    state, metrics = step(state_of(), make_batch(0))
    assert metrics["a/skipped"] is True  # u1's update was skipped: it must show
    assert metrics["u2/a/skipped"] is False
    assert not torch.isfinite(metrics["a/loss"]) and torch.isfinite(metrics["u2/a/loss"])
    assert int(state.roles["a"].opt_state.count) == 1


def test_a_managed_step_cannot_train_a_role_it_does_not_declare():
    inner = fs.update("b", recording("b"), name="inner")

    def outer(state, batch, key, ctx):
        return ctx.update(state, inner, batch, key)

    with pytest.raises(fs.StepFailedError) as info:  # a managed step changes from its start
        fs.managed(outer, trains="a", name="m")(state_of(), make_batch(0))
    assert isinstance(info.value.__cause__, ValueError)
    assert "trains ['b'], which this managed step does not declare" in str(info.value.__cause__)


def test_a_managed_steps_check_refuses_its_input_before_anything_is_consumed():
    """``managed(..., check=...)`` runs before the input is consumed: its error leaves the
    state usable and bit-unchanged; the same error raised in ``fn`` consumes it."""
    ran = []

    def outer(state, batch, key, ctx):
        ran.append(True)
        return state, {}

    seen = []

    def check(state, batch, accumulation):
        seen.append(accumulation.microbatches)  # the accumulation ctx will hold
        if batch["x"].shape[0] != 3:
            raise ValueError("want 3 samples")

    state = state_of()
    before = tree.clone(state)
    with pytest.raises(ValueError, match="want 3 samples"):
        step = fs.managed(outer, trains="a", name="m", check=check)
        fs.compile(step, accumulation=fs.Accumulation(2))(state, make_batch(0))
    assert not ran and not is_consumed(state) and seen == [2]
    tree.assert_trees_equal(state, before)

    def outer_checking(state, batch, key, ctx):
        check(state, batch, ctx.accumulation)
        return state, {}

    with pytest.raises(fs.StepFailedError):
        fs.managed(outer_checking, trains="a", name="m")(state, make_batch(0))
    assert is_consumed(state)
    with pytest.raises(TypeError, match="check must be a function"):
        fs.managed(outer, trains="a", check=3)  # type: ignore[arg-type]


def test_a_units_metric_keys_do_not_depend_on_which_other_units_ran():
    """Two units of one role, one of them every 2nd step: the later one's metrics are
    ``<its name>/...`` at every step, so a metric series never mixes two units' losses."""
    step = fs.compile(
        fs.sequence(
            fs.every(2, fs.update("a", recording("a"), name="x")),
            fs.update("a", recording("a"), name="y"),
        )
    )
    state = state_of()
    for i in range(3):
        state, metrics = step(state, make_batch(i))
        assert "y/a/loss" in metrics and "y/a/skipped" in metrics, sorted(metrics)
        assert ("a/loss" in metrics) == (i % 2 == 0), (i, sorted(metrics))


def test_the_two_branches_of_one_cond_keep_their_roles_plain_keys():
    step = fs.cond(
        lambda i: i % 2 == 0,
        fs.update("a", recording("a"), name="x"),
        fs.update("a", recording("a"), name="y"),
    )
    state = state_of()
    for i in range(2):
        state, metrics = step(state, make_batch(i))
        assert "a/loss" in metrics and not any(k.startswith(("x/a", "y/a")) for k in metrics)


def test_a_loss_metric_that_takes_the_units_loss_key_is_refused():
    def loss(state, batch, key):
        out = recording("a")(state, batch, key)
        return out, {"loss": torch.tensor(-1.0)}

    state = state_of()
    with pytest.raises(ValueError, match="the key of the unit's own loss"):
        fs.update("a", loss)(state, make_batch(0))
    assert not is_consumed(state)


def test_a_managed_steps_check_runs_before_the_units_before_it():
    def check(state, batch, accumulation):
        raise ValueError("no")

    step = fs.sequence(
        fs.update("a", recording("a"), name="u"),
        fs.managed(lambda s, b, k, c: (s, {}), trains="b", name="m", check=check),
    )
    state = state_of()
    before = tree.clone(state)
    with pytest.raises(ValueError, match="no"):
        step(state, make_batch(0))
    assert not is_consumed(state)
    tree.assert_trees_equal(state, before)


def test_a_conds_predicate_is_called_once_per_step_for_both_branches():
    calls: list[int] = []

    def pred(i: int) -> bool:
        calls.append(i)
        return i % 2 == 0

    step = fs.cond(
        pred,
        fs.sequence(
            fs.update("a", recording("a"), name="x1"), fs.update("b", recording("b"), name="x2")
        ),
        fs.update("a", recording("a"), name="y"),
    )
    state = state_of()
    for i in range(3):
        state, _ = step(state, make_batch(i))
    assert calls == [0, 1, 2]
    assert [e.name for e in fs.plan(step, 1)] == ["y"]
