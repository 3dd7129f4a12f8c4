"""Laws of fvstep.core.random: determinism, independence, generators, the global-RNG scope."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fvstep.core import random as fr

seeds = st.integers(-(2**70), 2**70)


@settings(max_examples=100, deadline=None)
@given(seeds, st.integers(0, 2**64 - 1))
def test_key_derivation_is_deterministic(seed, data):
    assert torch.equal(fr.key(seed), fr.key(seed))
    assert torch.equal(fr.fold_in(fr.key(seed), data), fr.fold_in(fr.key(seed), data))
    a = fr.split(fr.key(seed), 3)
    b = fr.split(fr.key(seed), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))


@settings(max_examples=100, deadline=None)
@given(seeds, st.integers(0, 2**40), st.integers(0, 2**40))
def test_different_fold_in_data_give_different_keys(seed, d1, d2):
    k = fr.key(seed)
    same = torch.equal(fr.fold_in(k, d1), fr.fold_in(k, d2))
    assert same == (d1 == d2)


@settings(max_examples=50, deadline=None)
@given(seeds, st.integers(2, 16))
def test_split_keys_are_distinct_from_each_other_and_the_parent(seed, n):
    k = fr.key(seed)
    keys = [tuple(x.tolist()) for x in fr.split(k, n)]
    keys.append(tuple(k.tolist()))
    keys += [tuple(fr.fold_in(k, i).tolist()) for i in range(n)]
    assert len(set(keys)) == len(keys)


def test_fold_in_does_not_modify_its_input():
    k = fr.key(3)
    before = k.clone()
    fr.fold_in(k, 1)
    fr.split(k, 4)
    assert torch.equal(k, before)


def test_streams_from_independent_keys_are_uncorrelated():
    # 64 keys folded from one parent: pairwise correlations of their normal streams
    # are consistent with independence (|r| < 5 / sqrt(n)).
    n = 4096
    base = fr.key(0)
    streams = torch.stack(
        [torch.randn(n, generator=fr.generator(fr.fold_in(base, i))) for i in range(64)]
    )
    corr = torch.corrcoef(streams)
    off_diag = corr[~torch.eye(64, dtype=torch.bool)]
    assert off_diag.abs().max() < 5 / n**0.5


def test_generator_is_a_pure_function_of_the_key():
    k = fr.key(11)
    a = torch.randn(8, generator=fr.generator(k))
    b = torch.randn(8, generator=fr.generator(k))
    assert torch.equal(a, b)
    c = torch.randn(8, generator=fr.generator(fr.fold_in(k, 1)))
    assert not torch.equal(a, c)


def test_generator_does_not_touch_the_global_rng():
    before = torch.get_rng_state()
    torch.randn(4, generator=fr.generator(fr.key(1)))
    assert torch.equal(before, torch.get_rng_state())


@settings(max_examples=20, deadline=None)
@given(seeds)
def test_rng_scope_is_deterministic_and_restores_the_global_state(seed):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with fr.rng_scope(fr.key(seed)):
        a = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(before, torch.get_rng_state())
    with fr.rng_scope(fr.key(seed)):
        b = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(a, b)


def test_rng_scope_restores_on_error():
    before = torch.get_rng_state()
    with pytest.raises(ValueError), fr.rng_scope(fr.key(0)):
        torch.rand(3)
        raise ValueError("boom")
    assert torch.equal(before, torch.get_rng_state())


def test_keys_are_int64_tensors_of_two_words():
    k = fr.key(5)
    assert fr.is_key(k) and k.dtype == torch.int64 and k.shape == (2,)


@pytest.mark.parametrize("bad", [1.5, "3", None, True])
def test_bad_seed_raises_type_error(bad):
    with pytest.raises(TypeError, match="seed must be an int"):
        fr.key(bad)


def test_a_non_key_is_rejected_with_a_clear_error():
    with pytest.raises(TypeError, match="expected an fvstep key"):
        fr.fold_in(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="num >= 1"):
        fr.split(fr.key(0), 0)


@given(st.text(max_size=20), st.text(max_size=20))
def test_fold_in_name_depends_on_the_name_alone(a, b):
    import hashlib

    k = fr.key(3)
    assert torch.equal(fr.fold_in_name(k, a), fr.fold_in_name(k, a))
    expected = fr.fold_in(k, int.from_bytes(hashlib.sha256(a.encode()).digest()[:8], "little"))
    assert torch.equal(fr.fold_in_name(k, a), expected)
    if a != b:
        assert not torch.equal(fr.fold_in_name(k, a), fr.fold_in_name(k, b))
