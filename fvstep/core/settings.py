"""How a unit runs, as data: its execution settings and what a step's plan lists.

A unit's own ``clip``/``sanitize`` win; an enclosing ``compile`` (the innermost first)
fills what a unit leaves unset, accumulation included; then :data:`DEFAULT_SETTINGS`.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from fvstep.core.accumulation import Accumulation
from fvstep.core.grads import SANITIZE_MODES, ClipGradNorm, Sanitize

__all__ = [
    "UNSET",
    "PlanEntry",
    "UnitSettings",
    "Unset",
    "check_clip",
    "check_sanitize",
]


class Unset(enum.Enum):
    """The type of :data:`UNSET`: an option left to the enclosing step or the default."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET
"""An option not given (``None`` is a value: ``clip=None`` turns clipping off)."""


def check_clip(clip: object) -> None:
    """Refuse (``TypeError``) a ``clip`` not ``clip_grad_norm(...)``, ``None`` or :data:`UNSET`."""
    if clip is not UNSET and clip is not None and not isinstance(clip, ClipGradNorm):
        raise TypeError("clip must be fvstep.clip_grad_norm(...) or None")


def check_sanitize(sanitize: object) -> None:
    """Refuse (``ValueError``) an unknown non-finite mode."""
    if sanitize is not UNSET and sanitize not in SANITIZE_MODES:
        raise ValueError(f"unknown sanitize mode {sanitize!r}; choose one of {SANITIZE_MODES}")


@attrs.frozen
class UnitSettings:
    """How a unit runs: micro-batching and sync, clipping, the non-finite mode.

    Unset fields are ``None`` for ``accumulation``, :data:`UNSET` for the others.

    Examples:
        >>> UnitSettings(clip=None).over(UnitSettings(Accumulation(4), sanitize="skip")).resolve()
        UnitSettings(accumulation=Accumulation(microbatches=4, ...), clip=None, sanitize='skip')
    """

    accumulation: Accumulation | None = None
    clip: ClipGradNorm | Unset | None = UNSET
    sanitize: Sanitize | Unset = UNSET

    def over(self, outer: UnitSettings) -> UnitSettings:
        """These settings, with their unset fields taken from ``outer``."""
        return UnitSettings(
            accumulation=outer.accumulation if self.accumulation is None else self.accumulation,
            clip=outer.clip if self.clip is UNSET else self.clip,
            sanitize=outer.sanitize if self.sanitize is UNSET else self.sanitize,
        )

    def resolve(self) -> UnitSettings:
        """These settings over the defaults: every field set."""
        return self.over(DEFAULT_SETTINGS)


DEFAULT_SETTINGS: Final = UnitSettings(Accumulation(), None, "error")
"""One micro-batch (``sync="every"``), no clipping, ``sanitize="error"``."""


@attrs.frozen
class PlanEntry:
    """One leaf that runs at a step: what it trains and how.

    Attributes:
        position: The leaf's index among all the leaves of the step (depth first, every
            branch); for messages only: keys come from the name.
        mutates: Frozen roles it changes in place (managed steps only).
        accumulation: For a managed step, that of its inner updates unless they pass theirs.
    """

    position: int
    name: str
    roles: tuple[str, ...]
    managed: bool
    clip: ClipGradNorm | None
    sanitize: Sanitize
    mutates: tuple[str, ...] = ()
    accumulation: Accumulation = attrs.Factory(Accumulation)
