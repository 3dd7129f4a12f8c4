"""The check that a refused step left its input state usable and bit-unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from fvstep.core import tree
from fvstep.core.state import is_consumed


def assert_refused_before_any_change(
    state: Any, step: Any, batch: Any, match: str, error: type[Exception] = ValueError
) -> None:
    """``step(state, batch)`` raises ``error`` matching ``match`` and leaves ``state``
    usable (not consumed) and bit-unchanged."""
    before = tree.clone(state)
    with pytest.raises(error, match=match):
        step(state, batch)
    assert not is_consumed(state)
    tree.assert_trees_equal(state, before)
