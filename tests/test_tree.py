"""Laws of fvstep.core.tree: clone, assert_trees_equal, tree_digest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fvstep.core import tree
from tests.strategies import tensors, trees


@tree.frozen
class PairState:
    a: torch.Tensor
    b: dict
    label: str = tree.field(pytree_node=False, default="x")


@settings(max_examples=60, deadline=None)
@given(trees())
def test_clone_is_bitwise_equal_and_shares_no_storage(t):
    c = tree.clone(t)
    tree.assert_trees_equal(t, c)
    for x, y in zip(tree.leaves(t), tree.leaves(c), strict=False):
        assert x is not y
        if x.numel():
            assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


@settings(max_examples=40, deadline=None)
@given(tensors(dtype=torch.float32, shape=(3,)))
def test_mutating_a_clone_leaves_the_original_untouched(x):
    state = PairState(a=x, b={"m": x * 2})
    snapshot_bits = tree.tree_digest(state)
    c = tree.clone(state)
    c.a.add_(1.0)
    c.b["m"].zero_()
    assert tree.tree_digest(state) == snapshot_bits


def test_clone_keeps_parameters_and_requires_grad():
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    c = tree.clone({"p": p, "q": q})
    assert isinstance(c["p"], torch.nn.Parameter) and c["p"].requires_grad
    assert isinstance(c["q"], torch.nn.Parameter) and not c["q"].requires_grad


def test_attrs_state_is_a_pytree_in_the_namespace_with_static_fields():
    s = PairState(a=torch.ones(1), b={"z": torch.zeros(2)}, label="y")
    paths, _flat, _ = tree.flatten_with_paths(s)
    assert paths == ["a", "b.z"]
    doubled = tree.tree_map(lambda x: x * 2, s)
    assert isinstance(doubled, PairState) and doubled.label == "y"
    with pytest.raises(AssertionError, match="structures differ"):
        tree.assert_trees_equal(s, PairState(a=torch.ones(1), b={"z": torch.zeros(2)}, label="n"))


def test_equal_nans_pass_and_signed_zeros_differ():
    nan = torch.tensor([float("nan"), 1.0])
    tree.assert_trees_equal({"x": nan}, {"x": nan.clone()})
    with pytest.raises(AssertionError, match="differ bitwise"):
        tree.assert_trees_equal({"x": torch.tensor([0.0])}, {"x": torch.tensor([-0.0])})


def test_error_names_first_differing_path_with_shape_dtype_and_max_diff():
    a = {"roles": {"student": {"w": torch.zeros(2, 3)}, "critic": {"w": torch.zeros(4)}}}
    b = tree.clone(a)
    b["roles"]["student"]["w"][1, 2] = 0.5
    with pytest.raises(AssertionError) as info:
        tree.assert_trees_equal(a, b)
    msg = str(info.value)
    assert "roles.student.w" in msg and "(2, 3)" in msg and "float32" in msg and "0.5" in msg


@pytest.mark.parametrize(
    "other",
    [
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(3),
        torch.zeros(1, 2),
    ],
    ids=["dtype", "shape", "rank"],
)
def test_dtype_and_shape_mismatches_are_reported(other):
    with pytest.raises(AssertionError, match="differs|differ"):
        tree.assert_trees_equal({"x": torch.zeros(2)}, {"x": other})


def test_structure_mismatch_names_missing_paths():
    with pytest.raises(AssertionError, match="only in the first: \\['b'\\]"):
        tree.assert_trees_equal({"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": torch.zeros(1)})


@settings(max_examples=60, deadline=None)
@given(trees())
def test_digest_is_stable_under_clone(t):
    assert tree.tree_digest(t) == tree.tree_digest(tree.clone(t))


@settings(max_examples=60, deadline=None)
@given(trees(), st.data())
def test_digest_changes_when_any_bit_changes(t, data):
    flat = [x for x in tree.leaves(t) if x.numel()]
    if not flat:
        return
    c = tree.clone(t)
    leaf = [x for x in tree.leaves(c) if x.numel()][data.draw(st.integers(0, len(flat) - 1))]
    bits = tree._bits(leaf).reshape(-1)
    i = data.draw(st.integers(0, bits.numel() - 1))
    bits[i] = bits[i] ^ 1 if leaf.dtype != torch.bool else 1 - bits[i]
    if leaf.dtype == torch.bool:
        leaf.view(-1)[i] = ~leaf.view(-1)[i]
    assert tree.tree_digest(t) != tree.tree_digest(c)


def test_digest_covers_structure_dtype_and_shape():
    base = tree.tree_digest({"a": torch.zeros(4)})
    assert base != tree.tree_digest({"b": torch.zeros(4)})
    assert base != tree.tree_digest({"a": torch.zeros(4, dtype=torch.int32)})
    assert base != tree.tree_digest({"a": torch.zeros(2, 2)})
    assert base == tree.tree_digest({"a": torch.zeros(4)})


def test_digest_is_the_same_in_another_process():
    # The digest must not depend on ids, hash seeds or the process.
    code = (
        "import torch; from fvstep import tree; "
        "print(tree.tree_digest({'w': torch.arange(4, dtype=torch.float32), 'k': [torch.ones(2)]}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    here = tree.tree_digest({"w": torch.arange(4, dtype=torch.float32), "k": [torch.ones(2)]})
    assert out.stdout.strip() == here
