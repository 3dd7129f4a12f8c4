"""Running a recipe: the resolved config checked and kept, ``init_from``, then :func:`fvstep.run`.

:func:`train` is what ``fvstep train`` runs on every rank:

1. A run folder that holds a checkpoint is resumed: its ``config.yaml`` is compared with
   the new options (:func:`fvstep.recipes.config.check_config_change`: a learning-rate or
   ``run.num_steps`` change applies, a change that alters the math is refused, naming
   the key). Otherwise the run is fresh and ``init_from`` applies.
2. Rank 0 writes the resolved config as ``<run.out>/config.yaml``.
3. The recipe builds the run; ``init_from`` with ``kind="state"`` replaces its state by
   the other run's.
4. :func:`fvstep.run` trains to ``run.num_steps``, resuming from the folder's newest
   checkpoint; on SIGTERM or Ctrl-C it saves and raises :class:`fvstep.Interrupted`.

Examples:
    >>> recipe = get_recipe("finetune")
    >>> state = train(recipe, parse_options(recipe, ["--run.num_steps", "4"]))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.parallel import broadcast_object, rank_and_world
from fvstep.recipes import Recipe, RunSpec
from fvstep.recipes import init as init_
from fvstep.recipes.config import (
    CONFIG_NAME,
    check_config_change,
    dataset_digest,
    options_to_dict,
    read_config,
    write_config,
)

__all__ = ["describe_plan", "prepare_run", "train"]


def _say(rank: int, log: Callable[[str], None]) -> Callable[[str], None]:
    return log if rank == 0 else (lambda line: None)


def prepare_run(
    recipe: Recipe, options: Any, *, log: Callable[[str], None] = print, write: bool = True
) -> RunSpec:
    """Steps 1 to 3 of :func:`train`: check (and with ``write``, keep) the config, build
    the run, apply ``init_from``. Collective on several ranks.

    Raises:
        fvstep.recipes.config.ConfigChangeError: If the options change a key that alters
            the math of the run being resumed.
    """
    rank, _ = rank_and_world()
    say = _say(rank, log)
    out = Path(options.run.out)
    error: Exception | None = None
    resumed_from = None
    if rank == 0:
        try:
            resumed_from = ckpt.latest(out) if out.is_dir() else None
            saved = read_config(out)
            digest = dataset_digest(options.data.path)
            new = {
                "recipe": recipe.name,
                "options": options_to_dict(options),
                "data_digest": digest,
            }
            if resumed_from is not None and saved is not None:
                for change in check_config_change(saved, new):
                    say(f"fvstep train: config change applied on resume: {change}")
            if write:
                lock = ckpt.lock_dir(out)  # a run in progress there: refuse before writing
                try:
                    write_config(out, recipe.name, options, data_digest=digest)
                finally:
                    lock.release()
        except Exception as e:
            error = e
    error, resumed_from = broadcast_object((error, resumed_from))
    if error is not None:
        raise error
    fresh = resumed_from is None
    if fresh and options.init_from.path is not None:
        say(f"fvstep train: a new run, from {options.init_from.kind} of {options.init_from.path}")
    spec = recipe.build(options, fresh=fresh)
    if fresh and options.init_from.path is not None and options.init_from.kind == "state":
        state = init_.init_from(options.init_from, state=spec.state)
        spec = RunSpec(state, spec.step, spec.data, spec.run_options, spec.trained, spec.close)
    if not fresh:
        say(f"fvstep train: resuming from {resumed_from}")
    return spec


def describe_plan(spec: RunSpec, num: int = 4) -> list[str]:
    """What the first ``num`` steps of a run train, one line a step (``fvstep.plan``).

    Examples:
        >>> describe_plan(spec, 2)
        ['step 0: finetune updates student (1 micro-batch, clip 1.0)', ...]
    """
    start = int(spec.state.step)
    end = min(start + num, spec.run_options["num_steps"])
    lines = []
    for i in range(start, end):
        parts = []
        for entry in fs.plan(spec.step, i):
            k = entry.accumulation.microbatches
            clip = f", clip {entry.clip.max_norm}" if entry.clip is not None else ""
            parts.append(
                f"{entry.name} updates {', '.join(entry.roles)} "
                f"({k} micro-batch{'es' if k != 1 else ''}{clip})"
            )
        lines.append(f"step {i}: " + ("; ".join(parts) if parts else "nothing to update"))
    return lines


def train(
    recipe: Recipe, options: Any, *, dry_run: bool = False, log: Callable[[str], None] = print
) -> Any:
    """Run ``recipe`` with ``options`` to ``options.run.num_steps`` (every rank calls it).

    Args:
        recipe: The recipe.
        options: Its options (:func:`fvstep.recipes.config.parse_options`).
        dry_run: Print the resolved config and the plan of the first steps, and stop
            (nothing is written).
        log: Where rank 0's lines go.

    Returns:
        The final state (``None`` for a dry run).

    Raises:
        fvstep.Interrupted: If SIGTERM or Ctrl-C stopped the run (after it saved).
        fvstep.recipes.config.ConfigChangeError: For a refused change on resume.

    Examples:
        >>> state = train(get_recipe("finetune"), FinetuneOptions())
    """
    with warnings.catch_warnings():
        # FSDP2 warns that a Wan transformer returns a view; no method changes it in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        return _train(recipe, options, dry_run=dry_run, log=log)


def _train(recipe: Recipe, options: Any, *, dry_run: bool, log: Callable[[str], None]) -> Any:
    import yaml

    rank, world = rank_and_world()
    say = _say(rank, log)
    spec = prepare_run(recipe, options, log=log, write=not dry_run)
    try:
        if dry_run:
            say(f"# {CONFIG_NAME} of recipe {recipe.name!r} (dry run: nothing is written)")
            text = yaml.safe_dump(
                {"recipe": recipe.name, "options": options_to_dict(options)}, sort_keys=False
            )
            say(text.rstrip())
            say(f"# the first steps, from step {int(spec.state.step)}, on {world} rank(s):")
            for line in describe_plan(spec):
                say(line)
            return None
        say(
            f"fvstep train: recipe {recipe.name}, {world} rank(s), to step "
            f"{options.run.num_steps}; run folder {options.run.out}"
        )
        state = fs.run(spec.step, spec.state, spec.data, **spec.run_options)
        say(
            f"fvstep train: done at step {int(state.step)}; run folder {options.run.out} "
            f"(checkpoints, metrics.jsonl, {CONFIG_NAME})"
        )
        return state
    finally:
        spec.close()
