"""Laws of fvstep.executor.data: the batch is a pure function of (step, rank, world_size)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fvstep.core import random as fr
from fvstep.executor import data as fd


@st.composite
def layouts(draw, *, min_items=1, max_world=4):
    """(num_items, batch_size, world_size, drop_last) with a global batch that fits."""
    world = draw(st.integers(1, max_world))
    batch = draw(st.integers(1, 4))
    num = draw(st.integers(max(min_items, batch * world), 40))
    return num, batch, world, draw(st.booleans())


def source(num, batch, *, seed=0, drop_last=True, **kw):
    return fd.ShuffledSource(
        list(range(num)), key=fr.key(seed), batch_size=batch, drop_last=drop_last, **kw
    )


def latents_source(num, batch, *, seed=0, drop_last=True):
    ds = fd.SyntheticLatents(num, key=fr.key(99), shape=(2, 3), text_shape=(4,))
    return fd.ShuffledSource(ds, key=fr.key(seed), batch_size=batch, drop_last=drop_last)


def global_batch(src, step, world):
    return [i for r in range(world) for i in src.indices(step, rank=r, world_size=world)]


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@settings(max_examples=25, deadline=None)
@given(layouts(), st.integers(0, 2**31), st.lists(st.integers(0, 200), min_size=1, max_size=6))
def test_batch_is_a_pure_function_of_step_rank_and_world(layout, seed, steps):
    num, batch, world, drop_last = layout
    a = source(num, batch, seed=seed, drop_last=drop_last)
    b = source(num, batch, seed=seed, drop_last=drop_last)
    queries = [(s, r) for s in steps for r in range(world)]
    first = [a.indices(s, rank=r, world_size=world) for s, r in queries]
    # Asked again, in reverse order, on the same and on an independent object.
    again = [a.indices(s, rank=r, world_size=world) for s, r in reversed(queries)][::-1]
    other = [b.indices(s, rank=r, world_size=world) for s, r in reversed(queries)][::-1]
    assert first == again == other
    assert all(len(ix) == batch and all(0 <= i < num for i in ix) for ix in first)


@settings(max_examples=25, deadline=None)
@given(layouts(), st.integers(0, 2**31), st.integers(0, 100))
def test_ranks_partition_each_global_batch(layout, seed, step):
    num, batch, world, drop_last = layout
    per_rank = source(num, batch, seed=seed, drop_last=drop_last)
    one_rank = source(num, batch * world, seed=seed, drop_last=drop_last)
    parts = [per_rank.indices(step, rank=r, world_size=world) for r in range(world)]
    flat = [i for p in parts for i in p]
    if drop_last:  # with drop_last=False a step across an epoch boundary may repeat an item
        assert len(set(flat)) == len(flat)  # disjoint
    assert flat == one_rank.indices(step)  # and, in rank order, the global batch


@settings(max_examples=25, deadline=None)
@given(layouts(), st.integers(0, 2**31), st.integers(0, 3))
def test_each_epoch_is_a_permutation(layout, seed, epoch):
    num, batch, world, drop_last = layout
    src = source(num, batch, seed=seed, drop_last=drop_last)
    g = batch * world
    perm = torch.randperm(num, generator=fr.generator(fr.fold_in(fr.key(seed), epoch))).tolist()
    if drop_last:
        spe = src.steps_per_epoch(world)
        assert spe == num // g
        seen = [
            i for s in range(epoch * spe, (epoch + 1) * spe) for i in global_batch(src, s, world)
        ]
        assert all(
            src.epoch_of(s, world_size=world) == epoch
            for s in range(epoch * spe, (epoch + 1) * spe)
        )
        assert seen == perm[: spe * g]  # each index at most once; only the tail is dropped
    else:
        # The stream of global batches, cut at multiples of num, is the epochs' permutations.
        first, last = epoch * num // g, -(-(epoch + 1) * num // g)
        stream = [i for s in range(first, last) for i in global_batch(src, s, world)]
        offset = epoch * num - first * g
        assert stream[offset : offset + num] == perm
        # epoch_of names the epoch of a step's first item.
        assert src.epoch_of(-(-epoch * num // g), world_size=world) == epoch


def test_drop_last_false_fills_the_tail_from_the_next_epoch():
    src = source(10, 4, seed=3, drop_last=False)
    perm0, perm1 = (
        torch.randperm(10, generator=fr.generator(fr.fold_in(fr.key(3), e))).tolist()
        for e in (0, 1)
    )
    assert src.steps_per_epoch() == 3
    assert src.indices(2) == perm0[8:] + perm1[:2]
    assert src.indices(3) == perm1[2:6]
    assert [src.epoch_of(s) for s in range(6)] == [0, 0, 0, 1, 1, 2]


@settings(max_examples=20, deadline=None)
@given(st.integers(12, 40), st.integers(0, 2**31), st.integers(0, 2**31))
def test_different_keys_give_different_orders(num, seed_a, seed_b):
    # Equal orders of >= 12 items happen by chance with probability <= 1 / 12!.
    a, b = source(num, 1, seed=seed_a), source(num, 1, seed=seed_b)
    order_a = [a.indices(s)[0] for s in range(num)]
    order_b = [b.indices(s)[0] for s in range(num)]
    assert (order_a == order_b) == (seed_a == seed_b)
    assert sorted(order_a) == list(range(num))


@settings(max_examples=20, deadline=None)
@given(st.integers(12, 40), st.integers(0, 2**31), st.integers(0, 5), st.integers(1, 3))
def test_epochs_differ(num, seed, epoch, later):
    src = source(num, 1, seed=seed)
    orders = [[src.indices(e * num + s)[0] for s in range(num)] for e in (epoch, epoch + later)]
    assert orders[0] != orders[1]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(num))


@settings(max_examples=10, deadline=None)
@given(layouts(max_world=2), st.integers(0, 2**31), st.integers(0, 30))
def test_resuming_at_step_s_needs_only_s(layout, seed, s):
    num, batch, world, drop_last = layout
    long_lived = latents_source(num, batch, seed=seed, drop_last=drop_last)
    for t in range(s):
        for r in range(world):
            long_lived.batch(t, rank=r, world_size=world)
    fresh = latents_source(num, batch, seed=seed, drop_last=drop_last)
    for r in range(world):
        assert_batches_equal(
            fresh.batch(s, rank=r, world_size=world),
            long_lived.batch(s, rank=r, world_size=world),
        )


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 30), st.integers(1, 3), st.booleans(), st.integers(0, 2**31))
def test_resharding_world_2_to_1(num, batch, drop_last, seed):
    if 2 * batch > num:
        batch = 1
    two = latents_source(num, batch, seed=seed, drop_last=drop_last)
    one = latents_source(num, 2 * batch, seed=seed, drop_last=drop_last)
    assert two.steps_per_epoch(2) == one.steps_per_epoch(1)
    for step in range(3 * two.steps_per_epoch(2) + 1):
        r0, r1 = (two.batch(step, rank=r, world_size=2) for r in (0, 1))
        joined = {name: torch.cat([r0[name], r1[name]]) for name in r0}
        assert_batches_equal(joined, one.batch(step))
        assert two.epoch_of(step, world_size=2) == one.epoch_of(step)


def test_call_is_the_single_process_batch():
    src = latents_source(12, 3, seed=5)
    for step in range(6):
        assert_batches_equal(src(step), src.batch(step, rank=0, world_size=1))


def test_default_collate_stacks_dict_items():
    src = latents_source(12, 3)
    b = src(4)
    assert b["latents"].shape == (3, 2, 3) and b["text"].shape == (3, 4)
    items = [src.dataset[i] for i in src.indices(4)]
    assert torch.equal(b["latents"], torch.stack([it["latents"] for it in items]))


def test_custom_collate_receives_the_items_in_order():
    src = source(10, 4, collate=list)
    assert src(2) == src.indices(2)


def test_tensor_dataset_collates_to_a_tuple_of_stacked_tensors():
    x = torch.arange(20.0).reshape(10, 2)
    ds = torch.utils.data.TensorDataset(x, x.sum(1))
    src = fd.ShuffledSource(ds, key=fr.key(0), batch_size=3)
    bx, by = src(1)
    assert torch.equal(bx, x[src.indices(1)]) and torch.equal(by, bx.sum(1))


def test_the_order_does_not_follow_later_mutation_of_the_key():
    k = fr.key(0)
    src = fd.ShuffledSource(list(range(20)), key=k, batch_size=5)
    before = [src.indices(s) for s in range(8)]
    k.add_(1)
    assert [source(20, 5, seed=0).indices(s) for s in range(8)] == before
    assert [src.indices(s) for s in range(8)] == before


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 50), st.integers(0, 2**31))
def test_synthetic_latents_item_is_a_pure_function_of_index(num, seed):
    a = fd.SyntheticLatents(num, key=fr.key(seed))
    b = fd.SyntheticLatents(num, key=fr.key(seed))
    i = num // 2
    assert_batches_equal(a[i], b[i])
    assert_batches_equal(a[i], a[i - num])  # negative indices as for sequences
    g = fr.generator(fr.fold_in(fr.key(seed), i))
    assert torch.equal(a[i]["latents"], torch.randn(4, 2, 4, 4, generator=g))
    assert torch.equal(a[i]["text"], torch.randn(3, 16, generator=g))
    if num > 1:
        assert not torch.equal(a[0]["latents"], a[num - 1]["latents"])


def test_synthetic_latents_rejects_out_of_range_indices():
    ds = fd.SyntheticLatents(3, key=fr.key(0))
    with pytest.raises(IndexError, match="out of range"):
        ds[3]
    with pytest.raises(IndexError, match="out of range"):
        ds[-4]
    with pytest.raises(ValueError, match="num must be >= 0"):
        fd.SyntheticLatents(-1, key=fr.key(0))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: source(0, 1), ValueError, "dataset is empty"),
        (lambda: source(5, 0), ValueError, "batch_size must be >= 1"),
        (lambda: source(5, 2).indices(-1), ValueError, "step must be >= 0"),
        (lambda: source(5, 2).indices(0, world_size=0), ValueError, "world_size must be >= 1"),
        (
            lambda: source(8, 2).indices(0, rank=2, world_size=2),
            ValueError,
            r"rank must lie in \[0, world_size\) = \[0, 2\), got 2",
        ),
        (lambda: source(8, 2).indices(0, rank=-1, world_size=2), ValueError, "rank must be >= 0"),
        (
            lambda: source(5, 2).batch(0, world_size=3),
            ValueError,
            r"batch_size 2 x world_size 3 = 6\) is larger than the dataset \(5 items",
        ),
        (
            lambda: source(5, 6),
            ValueError,
            r"batch_size \(6\) is larger than the dataset \(5 items",
        ),
        (lambda: source(5, 2).steps_per_epoch(3), ValueError, "larger than the dataset"),
        (lambda: source(5, 2).epoch_of(-3), ValueError, "step must be >= 0"),
        (lambda: source(5, 2).indices(1.5), TypeError, "step must be an integer"),
        (
            lambda: fd.ShuffledSource(iter([1, 2]), key=fr.key(0), batch_size=1),
            TypeError,
            "map-style",
        ),
        (
            lambda: fd.ShuffledSource([1, 2], key=torch.zeros(2), batch_size=1),
            TypeError,
            "fvstep key",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_data_module_does_not_use_torch_distributed():
    tree = ast.parse(inspect.getsource(fd))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not any(name.startswith("torch.distributed") for name in names)
    assert "torch.distributed" not in inspect.getsource(fd).replace("``torch.distributed``", "")
