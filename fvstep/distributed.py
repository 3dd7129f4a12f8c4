"""Deprecated alias of :mod:`fvstep.parallel`, kept for one release (issue 11).

Everything this module exported (``make_mesh``, ``shard_module``, ``FSDPGradSync``,
``FSDP2Parallelism``, ``CollectiveCounter``, ``launch``, ``rank_and_world``, ...) now
lives in the package :mod:`fvstep.parallel`, split by concern (``mesh``, ``sync``,
``collectives``, ``launcher``, ``ranks``). ``from fvstep import distributed`` and
``from fvstep.distributed import NAME`` keep working and give the same objects; reading
a name warns with a ``DeprecationWarning`` naming its new home. The module goes in the
next release: import from :mod:`fvstep.parallel` instead.

Examples:
    >>> from fvstep import parallel          # was: from fvstep import distributed
    >>> mesh = parallel.make_mesh()
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from fvstep import parallel as _parallel

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ serves and warns
    from fvstep.parallel import (
        CollectiveCounter,
        FSDP2Parallelism,
        FSDPGradSync,
        barrier,
        blocks_policy,
        check_roles_are_data_parallel,
        data_parallel_index,
        destroy,
        gather_objects,
        grad_sync_for,
        init_from_env,
        is_sharded,
        launch,
        make_mesh,
        max_over_ranks,
        rank_and_world,
        release_modules,
        shard_module,
        unrested_modules,
    )

__all__ = [
    "CollectiveCounter",
    "FSDP2Parallelism",
    "FSDPGradSync",
    "barrier",
    "blocks_policy",
    "check_roles_are_data_parallel",
    "data_parallel_index",
    "destroy",
    "gather_objects",
    "grad_sync_for",
    "init_from_env",
    "is_sharded",
    "launch",
    "make_mesh",
    "max_over_ranks",
    "rank_and_world",
    "release_modules",
    "shard_module",
    "unrested_modules",
]

# Names the old module held besides its __all__ that callers used.
_ALSO = ("MixedPrecisionPolicy", "ShardPolicy")


def __getattr__(name: str) -> Any:
    if name in __all__ or name in _ALSO:
        warnings.warn(
            f"fvstep.distributed is deprecated and goes in the next release; "
            f"use fvstep.parallel.{name} (the same object)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_ALSO])
