"""``fvstep train RECIPE [--config F] [--key value ...]``: run a recipe.

``RECIPE`` is a shipped recipe (``finetune``, the default; ``dmd2``; ``lora_dmd2``;
``self_forcing``; ``streaming``; ``diffusion_nft``) or
``package.module:ATTRIBUTE`` naming a :class:`fvstep.recipes.Recipe`. Its options come from
``--config`` files (YAML, or TOML) and ``--dotted.key value`` flags
(:mod:`fvstep.recipes.config`). Besides them: ``--nproc N`` launches N local ranks
(torch's elastic launcher; under ``torchrun`` the command runs in place on each rank),
``--dry-run`` prints the resolved config and the plan of the first steps, ``--help``
lists every key of the recipe.

Exit codes: 0 when ``run.num_steps`` was reached; :data:`EXIT_INTERRUPTED` (75) when
SIGTERM or Ctrl-C stopped the run after it saved (run the same command again to resume);
2 for a user error (one line: an unknown key or value, a ``data.path`` or ``model.path``
that holds nothing, a run folder another run holds, a refused config change such as
another ``--nproc`` than the run's); 1 for any other error.
"""

from __future__ import annotations

import sys
from typing import Any

from fvstep.cli.common import CLIError, check_positive, run_on_ranks, under_launcher

__all__ = ["EXIT_INTERRUPTED", "add_train_parser", "run_train_command", "split_train_args"]

EXIT_INTERRUPTED = 75
"""The exit code of a run stopped by a signal after saving (``EX_TEMPFAIL``: try again)."""

_OWN_FLAGS = """
options of fvstep train itself:
  RECIPE                finetune (default), dmd2, lora_dmd2, self_forcing, streaming,
                        diffusion_nft, or package.module:ATTRIBUTE
  --nproc N             launch N local ranks (default 1; under torchrun: in place)
  --dry-run             print the resolved config and the plan of the first steps
  --debug               show tracebacks
exit codes: 0 done; 75 stopped by SIGTERM or Ctrl-C after saving (rerun to resume);
  2 a user error; 1 another error
"""


def add_train_parser(sub: Any) -> None:
    """Add the ``train`` subcommand to the ``fvstep`` parser (for ``fvstep --help``; the
    command parses its own arguments: :func:`split_train_args`).

    Example:
        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="fvstep")
        >>> add_train_parser(parser.add_subparsers(dest="command"))
    """
    train = sub.add_parser(
        "train",
        help="run a recipe: fvstep train RECIPE [--config F] [--key value ...] "
        "(no arguments: a tiny Wan fine-tune on the CPU)",
        add_help=False,
    )
    train.add_argument("recipe", nargs="?", default="finetune")
    train.add_argument("--config", action="append", help="a YAML or TOML file of options")
    train.add_argument("--nproc", type=int, default=1, help="local ranks to launch")
    train.add_argument("--dry-run", action="store_true", help="print the config and the plan")
    train.add_argument("--debug", action="store_true", help="show tracebacks")


def split_train_args(argv: list[str]) -> tuple[str, list[str], dict[str, Any]]:
    """``argv`` (after ``train``) -> the recipe, its options' arguments, and the command's
    own flags (``nproc``, ``dry_run``, ``help``).

    Raises:
        CLIError: For ``--nproc`` without a number.

    Example:
        >>> split_train_args(["dmd2", "--nproc", "2", "--optim.lr", "1e-4"])
        ('dmd2', ['--optim.lr', '1e-4'], {'nproc': 2, 'dry_run': False, 'help': False})
    """
    words = list(argv)
    recipe = words.pop(0) if words and not words[0].startswith("-") else "finetune"
    own: dict[str, Any] = {"nproc": 1, "dry_run": False, "help": False}
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-h", "--help"):
            own["help"] = True
        elif word == "--dry-run":
            own["dry_run"] = True
        elif word == "--debug":
            pass
        elif word == "--nproc" or word.startswith("--nproc="):
            value = word.partition("=")[2] if "=" in word else None
            if value is None:
                i += 1
                value = words[i] if i < len(words) else ""
            try:
                own["nproc"] = int(value)
            except ValueError:
                raise CLIError(f"fvstep train: --nproc needs a number, got {value!r}") from None
        else:
            rest.append(word)
        i += 1
    return recipe, rest, own


def _recipe(name: str) -> Any:
    from fvstep.recipes import get_recipe

    try:
        return get_recipe(name)
    except ValueError as e:
        raise CLIError(f"fvstep train: {e}") from None


def _options(recipe: Any, argv: list[str]) -> Any:
    from fvstep.recipes.config import parse_options

    try:
        return parse_options(recipe, argv)
    except ValueError as e:
        raise CLIError(
            f"fvstep train {recipe.name}: {e} (see fvstep train {recipe.name} --help)"
        ) from None


def _check_options(options: Any) -> None:
    """What a run would refuse before it starts, refused before it writes anything: a path
    that holds nothing, an ``init_from`` state past ``run.num_steps``, samples without a
    VAE."""
    from fvstep.recipes.init import check_init_state
    from fvstep.recipes.parts import check_paths
    from fvstep.recipes.samples import check_samples

    check_paths(options)
    check_init_state(options)
    check_samples(options)


def _check_before_launch(recipe: Any, options: Any, nproc: int) -> None:
    """What the launched ranks would refuse, refused here (exit code 2, not a failed
    rank's 1): a wrong path, a folder another run holds, a refused config change."""
    from pathlib import Path

    from fvstep.checkpoint import CheckpointLockedError, lock_dir
    from fvstep.checkpoint.directories import LOCK_NAME
    from fvstep.recipes.config import ConfigChangeError
    from fvstep.recipes.running import check_resume

    try:
        _check_options(options)
        if (Path(options.run.out) / LOCK_NAME).is_file():  # creates nothing in a new folder
            lock_dir(options.run.out).release()
        check_resume(recipe, options, world_size=nproc)
    except (CheckpointLockedError, ConfigChangeError) as e:
        raise CLIError(f"fvstep train: {e}") from None
    except ValueError as e:  # _check_options's
        raise CLIError(f"fvstep train {recipe.name}: {e}") from None


def _train_rank(job: tuple[str, list[str], bool]) -> dict[str, Any]:
    """One rank's run; what it ended with, as plain data (a launched rank returns it)."""
    import fvstep as fs
    from fvstep.checkpoint import CheckpointLockedError
    from fvstep.recipes.config import ConfigChangeError
    from fvstep.recipes.running import train

    name, argv, dry_run = job
    recipe = _recipe(name)
    options = _options(recipe, argv)
    try:
        _check_options(options)
    except ValueError as e:
        raise CLIError(f"fvstep train {recipe.name}: {e}") from None
    try:
        state = train(recipe, options, dry_run=dry_run, log=lambda line: print(line, flush=True))
    except fs.Interrupted as e:
        return {"interrupted": str(e), "signal": e.signal, "step": e.step}
    except (ConfigChangeError, CheckpointLockedError) as e:
        raise CLIError(f"fvstep train: {e}") from None
    return {"step": None if state is None else int(state.step), "out": options.run.out}


def _newest(out: str) -> str:
    from fvstep.checkpoint import latest

    newest = latest(out)
    return str(newest) if newest is not None else "none"


def run_train_command(argv: list[str]) -> int:
    """Run ``fvstep train`` with ``argv`` (the words after ``train``).

    Returns:
        0 when the run reached ``run.num_steps`` (or a dry run), :data:`EXIT_INTERRUPTED`
        when a signal stopped it after saving.

    Raises:
        CLIError: For an unknown recipe, key or value, a wrong path, a run folder another
            run holds, or a refused config change (another world size included).

    Example:
        $ fvstep train finetune --config examples/finetune_tiny.yaml --run.num_steps 8
    """
    name, rest, own = split_train_args(argv)
    recipe = _recipe(name)
    if own["help"]:
        from fvstep.recipes.config import help_text

        print(help_text(recipe).rstrip() + "\n" + _OWN_FLAGS)
        return 0
    check_positive(nproc=own["nproc"])
    options = _options(recipe, rest)  # a bad key fails here, before any rank starts
    job = (name, rest, own["dry_run"])
    if under_launcher() or own["nproc"] == 1:
        if under_launcher():
            from fvstep.parallel import init_from_env

            init_from_env()
        results = [_train_rank(job)]
    else:
        _check_before_launch(recipe, options, own["nproc"])
        try:
            results = run_on_ranks(_train_rank, job, own["nproc"])
        except Exception as e:
            import signal

            sigval = getattr(e, "sigval", None)
            if type(e).__name__ != "SignalException" or sigval not in (
                signal.SIGTERM,
                signal.SIGINT,
            ):
                raise
            print(
                f"fvstep train: stopped by {signal.Signals(sigval).name}; each rank saves at "
                f"the step boundary before it exits (newest checkpoint now: "
                f"{_newest(options.run.out)}): run the same command again to resume",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
    if "interrupted" in results[0]:
        # rank 0's fvstep.run said it in one line (the signal, the step, the checkpoint)
        return EXIT_INTERRUPTED
    return 0
