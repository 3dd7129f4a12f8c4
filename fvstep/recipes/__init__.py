"""Recipes: a run as a Python function of typed options (``fvstep train RECIPE``).

A :class:`Recipe` is a name, an options dataclass (:mod:`fvstep.recipes.options`) and a
``build`` function that turns options into a :class:`RunSpec`. :data:`RECIPES` lists the
shipped ones; any module-level :class:`Recipe` runs by ``fvstep train package.module:RECIPE``.

Examples:
    >>> recipe = get_recipe("finetune")
    >>> spec = recipe.build(recipe.options(), fresh=True)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["RECIPES", "Recipe", "RunSpec", "get_recipe"]

RECIPES = {
    name: f"fvstep.recipes.{name}:RECIPE"
    for name in ("finetune", "dmd2", "lora_dmd2", "self_forcing", "streaming", "diffusion_nft")
}
"""The shipped recipes, by name: where each one lives."""


@attrs.frozen
class RunSpec:
    """What a run needs: the arguments of :func:`fvstep.run`, and how to end it.

    Attributes:
        state: The initial state (the run resumes from its folder's checkpoint if any).
        data: The data (``data.batch(step, rank=, world_size=)``).
        run_options: The keyword arguments of :func:`fvstep.run` (``num_steps``,
            ``checkpoints``, ``validation``, ``trackers``, ...).
        trained: The roles whose weights the run trains (what ``init_from`` fills).
        close: Releases what the run holds (the loader's workers).
    """

    state: Any
    step: Any
    data: Any
    run_options: dict[str, Any]
    trained: tuple[str, ...] = ()
    close: Callable[[], None] = attrs.field(default=lambda: None)


@attrs.frozen
class Recipe:
    """A named run: its options type and the function that builds the run from them.

    Attributes:
        name: The name ``fvstep train`` knows it by (also written in ``config.yaml``).
        options: A dataclass of options (nested dataclasses are groups of dotted keys).
        build: ``build(options, *, fresh) -> RunSpec``; ``fresh`` is whether the run's
            folder holds no checkpoint yet (then ``options.init_from`` applies).
        summary: One line for ``--help``.
    """

    name: str
    options: type
    build: Callable[..., RunSpec]
    summary: str = ""


def get_recipe(name: str) -> Recipe:
    """A shipped recipe by name, or a :class:`Recipe` at ``"package.module:ATTRIBUTE"``
    (importable from the working directory, as ``fvstep verify-resume``'s factories).

    Raises:
        ValueError: For an unknown name, or an attribute that is not a :class:`Recipe`.
    """
    where = RECIPES.get(name, name)
    if ":" not in where:
        raise ValueError(
            f"unknown recipe {name!r}: choose one of {', '.join(RECIPES)}, or give "
            "'package.module:ATTRIBUTE' naming a fvstep.recipes.Recipe"
        )
    module, _, attribute = where.partition(":")
    if name not in RECIPES and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `fvstep train my_recipe:RECIPE` from its folder
    try:
        recipe = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import the recipe {name!r}: {e}") from None
    if not isinstance(recipe, Recipe):
        raise ValueError(f"{name!r} is a {type(recipe).__name__}, not a fvstep.recipes.Recipe")
    return recipe
