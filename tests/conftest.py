"""Test-wide settings: one intra-op thread (the models are tiny; thread start-up dominates
and two spawned ranks on 2 cores would oversubscribe), and hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)

settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("heavy", deadline=None, print_blob=True, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def ranks():
    """Two CPU ranks on gloo, shared by the multi-rank tests of the session."""
    from tests.multirank import RankPool

    pool = RankPool(world_size=2)
    yield pool
    pool.close()
