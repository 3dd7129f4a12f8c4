"""Hypothesis strategies shared by the tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
names = st.text("abcdefgh", min_size=1, max_size=4)


@st.composite
def tensors(draw, dtype=None, shape=None):
    """A tensor of a drawn dtype and shape with drawn bits (NaNs, -0.0, infs included)."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = shape if shape is not None else draw(shapes)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if x.numel() and draw(st.booleans()):
        special = draw(st.sampled_from([float("nan"), -0.0, float("inf"), -float("inf")]))
        x.view(-1)[0] = special
    return x


def trees(leaves=None):
    """Nested dicts/lists/tuples of tensors."""
    leaves = leaves or tensors()
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(names, children, max_size=3),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
        ),
        max_leaves=8,
    )
