"""Running a recipe: the resolved config checked and kept, ``init_from``, then :func:`fvstep.run`
(:func:`train`, what ``fvstep train`` runs on every rank).

Examples:
    >>> recipe = get_recipe("finetune")
    >>> state = train(recipe, parse_options(recipe, ["--run.num_steps", "4"]))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.checkpoint.directories import DirectoryLock
from fvstep.parallel import broadcast_object, rank_and_world
from fvstep.recipes import Recipe, RunSpec
from fvstep.recipes import init as init_
from fvstep.recipes.config import (
    CONFIG_NAME,
    check_config_change,
    dataset_digest,
    read_config,
    write_config,
)
from fvstep.recipes.parts import check_paths, compute_dtype, device_for
from fvstep.recipes.samples import check_samples

__all__ = [
    "check_resume",
    "compile_memory_budget",
    "describe_plan",
    "prepare_run",
    "run_prepared",
    "train",
]


def _say(rank: int, log: Callable[[str], None]) -> Callable[[str], None]:
    return log if rank == 0 else (lambda line: None)


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result (or its error, raised) on every rank."""
    result: Any = None
    error: Exception | None = None
    if rank_and_world()[0] == 0:
        try:
            result = fn()
        except Exception as e:
            error = e
    error, result = broadcast_object((error, result))
    if error is not None:
        raise error
    return result


def _describe(recipe: Recipe, options: Any, world_size: int, *, digest: bool = True) -> Any:
    """What ``config.yaml`` holds, ``prepare.precision`` resolved on this rank's device."""
    compute = compute_dtype(options.prepare, device_for(options.run))
    config: dict[str, Any] = {
        "recipe": recipe.name,
        "world_size": world_size,
        "precision": "fp32" if compute is None else "bf16",
        "options": json.loads(json.dumps(dataclasses.asdict(options))),  # tuples as lists
    }
    data_digest = dataset_digest(options.data.path) if digest else None
    if data_digest is not None:
        config["data_digest"] = data_digest
    return config


def compile_memory_budget(options: Any) -> contextlib.AbstractContextManager[Any]:
    """A context applying ``prepare.compile_memory_budget`` to the blocks compiled inside it.

    Raises ``ValueError`` for a budget outside ``[0, 1]``.
    """
    budget = getattr(options.prepare, "compile_memory_budget", None)
    if budget is None:
        return contextlib.nullcontext()
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"prepare.compile_memory_budget must be in [0, 1], got {budget}")
    from fvstep.core._compat import activation_memory_budget

    return activation_memory_budget(budget)


def run_prepared(spec: RunSpec, options: Any, **extra: Any) -> Any:
    """:func:`fvstep.run` of a :func:`prepare_run` spec (and ``extra`` keywords) under
    :func:`compile_memory_budget`; the final state. It does not close ``spec``.
    """
    with compile_memory_budget(options):
        return fs.run(spec.step, spec.state, spec.data, **spec.run_options, **extra)


def check_resume(recipe: Recipe, options: Any, *, world_size: int) -> tuple[Path | None, list[str]]:
    """The checkpoint ``run.out`` resumes from (``None``: a fresh run) and the config changes.

    Reads only; raises as :func:`~fvstep.recipes.config.check_config_change`."""
    out = Path(options.run.out)
    resumed_from = ckpt.latest(out) if out.is_dir() else None
    saved = read_config(out)
    if resumed_from is None or saved is None:
        return resumed_from, []
    return resumed_from, check_config_change(saved, _describe(recipe, options, world_size))


def prepare_run(
    recipe: Recipe, options: Any, *, log: Callable[[str], None] = print, write: bool = True
) -> RunSpec:
    """What :func:`train` does before it runs: lock ``run.out``, check the config, build the
    run, apply ``init_from`` and (with ``write``) keep the config. Collective.

    With ``write``, the spec's ``checkpoints`` hold rank 0's lock and ``spec.close()`` releases
    it; without, nothing is locked or written.

    Raises:
        fvstep.checkpoint.CheckpointLockedError: If another run holds the folder's lock.
        fvstep.recipes.config.ConfigChangeError: For a resume whose config changed the math.
        ValueError: For options a run would refuse, before anything is written.
    """
    rank, world = rank_and_world()
    say = _say(rank, log)
    out = Path(options.run.out)
    lock: DirectoryLock | None = None

    def check() -> tuple[Path | None, list[str]]:
        nonlocal lock
        check_paths(options)  # before the lock: a wrong path leaves no folder
        init_.check_init_state(options)
        check_samples(options)
        lock = ckpt.lock_dir(out) if write else None
        return check_resume(recipe, options, world_size=world)

    def keep_config() -> None:
        config = _describe(recipe, options, world)
        # a resume ignores init_from: the config keeps where the run started
        saved = read_config(out) if resumed_from is not None else None
        if saved is not None and saved["options"].get("init_from") is not None:
            config["options"]["init_from"] = saved["options"]["init_from"]
        write_config(out, config)

    try:
        resumed_from, applied = _on_rank0(check)
        for change in applied:
            say(f"fvstep train: config change applied on resume: {change}")
        spec = _build(recipe, options, fresh=resumed_from is None, say=say)
        if write:
            try:
                _on_rank0(keep_config)
            except BaseException:
                spec.close()
                raise
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if resumed_from is not None:
        say(f"fvstep train: resuming from {resumed_from}")
    if not write:
        return spec
    run_options = dict(spec.run_options)
    checkpoints = run_options.get("checkpoints")
    if checkpoints is not None and Path(checkpoints.dir).resolve() == out.resolve():
        # fvstep.run goes on under this lock (rank 0's; None elsewhere) instead of its own.
        run_options["checkpoints"] = attrs.evolve(checkpoints, lock=lock)

    def close() -> None:
        try:
            spec.close()
        finally:
            if lock is not None:
                lock.release()

    return attrs.evolve(spec, run_options=run_options, close=close)


def _build(recipe: Recipe, options: Any, *, fresh: bool, say: Callable[[str], None]) -> RunSpec:
    """The recipe's run, its state from ``init_from`` when fresh and of kind ``state``."""
    if fresh and options.init_from.path is not None:
        say(f"fvstep train: a new run, from {options.init_from.kind} of {options.init_from.path}")
    spec = recipe.build(options, fresh=fresh)
    if fresh and options.init_from.path is not None and options.init_from.kind == "state":
        try:
            state = init_.init_from(options.init_from, state=spec.state)
        except BaseException:
            spec.close()
            raise
        spec = attrs.evolve(spec, state=state)
    return spec


def describe_plan(spec: RunSpec, num: int = 4) -> list[str]:
    """What the first ``num`` steps of a run train, one line a step (``fvstep.plan``),
    e.g. ``"step 0: finetune updates student (1 micro-batch, clip 1.0)"``."""
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
        dry_run: Print the resolved config and the plan of the first steps, and stop
            (nothing is written).
        log: Where rank 0's lines go.

    Returns:
        The final state (``None`` for a dry run).

    Raises:
        fvstep.Interrupted: If SIGTERM or Ctrl-C stopped the run (after it saved).
        fvstep.recipes.config.ConfigChangeError: For a refused change on resume.
    """
    import yaml

    rank, world = rank_and_world()
    say = _say(rank, log)
    with warnings.catch_warnings():
        # FSDP2 warns that a Wan transformer returns a view; no method changes it in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        spec = prepare_run(recipe, options, log=log, write=not dry_run)
        try:
            if dry_run:
                say(f"# {CONFIG_NAME} of recipe {recipe.name!r} (dry run: nothing is written)")
                config = _describe(recipe, options, world, digest=False)
                say(yaml.safe_dump(config, sort_keys=False).rstrip())
                say(f"# the first steps, from step {int(spec.state.step)}, on {world} rank(s):")
                for line in describe_plan(spec):
                    say(line)
                return None
            say(
                f"fvstep train: recipe {recipe.name}, {world} rank(s), to step "
                f"{options.run.num_steps}; run folder {options.run.out}"
            )
            state = run_prepared(spec, options)
            say(
                f"fvstep train: done at step {int(state.step)}; run folder {options.run.out} "
                f"(checkpoints, metrics.jsonl, {CONFIG_NAME})"
            )
            return state
        finally:
            spec.close()
