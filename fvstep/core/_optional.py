"""Optional packages: a missing one names the extra that installs it (private).

Every import of a package that is not a core dependency sits in a ``with needs_extra(...)``
block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fvstep.core.errors import MissingExtraError

__all__ = ["needs_extra"]


@contextlib.contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Turn an ``ImportError`` inside the block into a ``MissingExtraError`` naming the module,
    ``feature`` (what needs it) and ``pip install 'fvstep[extra]'``."""
    try:
        yield
    except ImportError as e:
        if isinstance(e, MissingExtraError):
            raise
        what = repr(e.name) if e.name else "a package"
        raise MissingExtraError(
            f"{feature} needs {what}, which cannot be imported ({e}): "
            f"pip install 'fvstep[{extra}]'",
            name=e.name,
        ) from e
