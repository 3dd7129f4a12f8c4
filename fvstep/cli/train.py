"""``fvstep train RECIPE [--config F] [--key value ...]``: run a recipe (:func:`run_train`);
:func:`recipe_parser` (``fvstep plan``'s too) reads the recipe's options and the command's own.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fvstep.cli.common import (
    Parser,
    check_positive,
    command_parser,
    parse,
    run_on_ranks,
    under_launcher,
)
from fvstep.core.errors import CLIError
from fvstep.recipes import Recipe

__all__ = [
    "EXIT_INTERRUPTED",
    "parse_recipe_args",
    "recipe_name",
    "recipe_parser",
    "run_train",
    "run_train_command",
]

EXIT_INTERRUPTED = 75
"""The exit code of a run stopped by a signal after saving (``EX_TEMPFAIL``: try again)."""


def recipe_name(argv: Sequence[str]) -> str:
    """The recipe that the words after ``fvstep train`` (or ``plan``) name: the first,
    unless it is an option; else ``finetune``."""
    return argv[0] if argv and not argv[0].startswith("-") else "finetune"


def recipe_parser(
    command: str, fn: Callable[..., Any], argv: Sequence[str]
) -> tuple[Recipe, Parser, list[str]]:
    """The recipe that ``argv`` (the words after ``fvstep COMMAND``) names, the parser of
    its options, ``--config`` and ``fn``'s keyword-only parameters, and the words to parse;
    ``CLIError`` for an unknown recipe."""
    from fvstep.recipes import get_recipe
    from fvstep.recipes.config import add_options

    name = recipe_name(argv)
    try:
        recipe = get_recipe(name)
    except ValueError as e:
        raise CLIError(f"fvstep {command}: {e}") from None
    parameters = inspect.signature(fn).parameters.values()
    skip = [p.name for p in parameters if p.kind != p.KEYWORD_ONLY]
    parser = command_parser(fn, f"fvstep {command} {recipe.name}", skip=skip)
    parser.description = f"{recipe.summary} {parser.description}"
    add_options(parser, recipe)
    return recipe, parser, list(argv[1:] if argv and argv[0] == name else argv)


def parse_recipe_args(
    command: str, fn: Callable[..., Any], argv: Sequence[str]
) -> tuple[Recipe, Any, dict[str, Any]]:
    """``argv`` parsed by :func:`recipe_parser`'s parser: the recipe, its options, and the
    command's own options by name; ``CLIError`` for an unknown recipe, key or value."""
    from fvstep.recipes.config import options_from

    recipe, parser, words = recipe_parser(command, fn, argv)
    namespace = parse(parser, words)
    parameters = inspect.signature(fn).parameters.values()
    own = {p.name: namespace[p.name] for p in parameters if p.kind == p.KEYWORD_ONLY}
    return recipe, options_from(recipe, namespace), own


def _check_options(name: str, options: Any) -> None:
    """What a run would refuse before it starts, refused (``CLIError``) before it writes."""
    from fvstep.recipes.init import check_init_state
    from fvstep.recipes.parts import check_lora, check_paths
    from fvstep.recipes.samples import check_samples

    try:
        check_paths(options)
        if hasattr(options, "lora"):
            check_lora(options, required=name != "finetune")
        check_init_state(options)
        check_samples(options)
    except ValueError as e:
        raise CLIError(f"fvstep train {name}: {e}") from None


def _check_before_launch(recipe: Any, options: Any, nproc: int) -> None:
    """What the launched ranks would refuse, refused here (exit code 2, not a failed
    rank's 1)."""
    from pathlib import Path

    from fvstep.checkpoint import lock_dir
    from fvstep.checkpoint.directories import LOCK_NAME
    from fvstep.core.errors import CheckpointLockedError, ConfigChangeError
    from fvstep.recipes.running import check_resume

    try:
        _check_options(recipe.name, options)
        if (Path(options.run.out) / LOCK_NAME).is_file():  # creates nothing in a new folder
            lock_dir(options.run.out).release()
        check_resume(recipe, options, world_size=nproc)
    except (CheckpointLockedError, ConfigChangeError) as e:
        raise CLIError(f"fvstep train: {e}") from None
    except ValueError as e:
        raise CLIError(f"fvstep train {recipe.name}: {e}") from None


def _train(recipe: Recipe, options: Any, dry_run: bool) -> dict[str, Any]:
    """One rank's run; what it ended with, as plain data (a launched rank returns it)."""
    import fvstep as fs
    from fvstep.core.errors import CheckpointLockedError, ConfigChangeError
    from fvstep.recipes.running import train

    _check_options(recipe.name, options)
    try:
        state = train(recipe, options, dry_run=dry_run, log=lambda line: print(line, flush=True))
    except fs.Interrupted as e:
        return {"interrupted": str(e), "signal": e.signal, "step": e.step}
    except (ConfigChangeError, CheckpointLockedError) as e:
        raise CLIError(f"fvstep train: {e}") from None
    return {"step": None if state is None else int(state.step), "out": options.run.out}


def _train_rank(argv: Sequence[str]) -> dict[str, Any]:
    """A launched rank's run: the words after ``train``, parsed again."""
    recipe, options, own = parse_recipe_args("train", run_train, argv)
    return _train(recipe, options, own["dry_run"])


def run_train_command(argv: Sequence[str]) -> int:
    """Run ``fvstep train`` with ``argv`` (the words after ``train``)."""
    recipe, options, own = parse_recipe_args("train", run_train, argv)
    return run_train(recipe, options, argv, **own)


def run_train(
    recipe: Recipe,
    options: Any,
    argv: Sequence[str] = (),
    *,
    nproc: int = 1,
    dry_run: bool = False,
) -> int:
    """Run a recipe (with no options, on a tiny Wan and synthetic latents); run again, it resumes.

    RECIPE (the first word) is finetune (the default), dmd2, lora_dmd2, self_forcing,
    streaming, diffusion_nft, or package.module:ATTRIBUTE naming a fvstep.recipes.Recipe.
    Exit codes: 0 done; 75 stopped by SIGTERM or Ctrl-C after saving (run it again to
    resume); 2 a user error; 1 another error.

    Args:
        argv: the words after ``train``, which each launched rank parses again
        nproc: local ranks to launch (under torchrun: in place on each)
        dry_run: print the resolved config and the plan of the first steps

    Returns:
        0 when the run reached ``run.num_steps`` (or a dry run), :data:`EXIT_INTERRUPTED`
        when a signal stopped it after saving.

    Raises:
        CLIError: For a wrong path, a run folder another run holds, or a refused config
            change (another world size included).

    Example:
        $ fvstep train finetune --config examples/finetune_tiny.yaml --run.num_steps 8
    """
    check_positive(nproc=nproc)
    if under_launcher() or nproc == 1:
        if under_launcher():
            from fvstep.parallel import init_from_env

            init_from_env()
        results = [_train(recipe, options, dry_run)]
    else:
        _check_before_launch(recipe, options, nproc)
        try:
            results = run_on_ranks(_train_rank, list(argv), nproc)
        except Exception as e:
            import signal

            from fvstep.checkpoint import latest

            sigval = getattr(e, "sigval", None)
            stops = (signal.SIGTERM, signal.SIGINT)
            if type(e).__name__ != "SignalException" or sigval not in stops:
                raise
            print(
                f"fvstep train: stopped by {signal.Signals(sigval).name}; each rank saves at "
                f"the step boundary before it exits (newest checkpoint now: "
                f"{latest(options.run.out) or 'none'}): run the same command again to resume",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
    if "interrupted" in results[0]:
        # rank 0's fvstep.run said it in one line (the signal, the step, the checkpoint)
        return EXIT_INTERRUPTED
    return 0
