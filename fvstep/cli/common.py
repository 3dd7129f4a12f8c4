"""What the commands of :mod:`fvstep.cli` share: the parser built from a command's signature
(:func:`command_parser`), option checks, and running on every rank (in place under
``torchrun``, else on ranks launched by torch.distributed's elastic launcher).
"""

from __future__ import annotations

import inspect
import os
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser

from fvstep.core.errors import CLIError

__all__ = [
    "Parser",
    "check_positive",
    "command_parser",
    "from_rank0",
    "parse",
    "run_on_ranks",
    "under_launcher",
]


class Parser(ArgumentParser):
    """jsonargparse's parser, with argparse's spellings for a command's signature
    (``--dashed-names``, bare ``bool`` flags, a list as several values); a recipe's keys
    keep jsonargparse's (``--run.num_steps 8``)."""

    def __init__(self, prog: str, description: str | None = None) -> None:
        super().__init__(
            prog=prog, description=description, exit_on_error=False, default_meta=False
        )

    def add_signature(self, fn: Callable[..., Any], skip: Sequence[str] = ()) -> None:
        """Add ``fn``'s parameters as options, each with its ``Args`` description as help."""
        self._signature = typing.get_type_hints(fn)
        try:
            self.add_function_arguments(fn, as_group=False, as_positional=True, skip=set(skip))
        finally:
            del self._signature

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        # jsonargparse compiles this method into its groups too: they have no signature
        signature = getattr(self, "_signature", {})
        hint = signature.get(args[0].lstrip("-")) if args else None
        if hint is not None and args[0].startswith("--"):
            args = (args[0].replace("_", "-"),)  # and no `--name+` (a list is nargs="+")
            if hint is bool and kwargs.get("default") is False:
                kwargs = {"action": "store_true", "default": False, "help": kwargs.get("help")}
            elif typing.get_origin(hint) in (typing.Union, types.UnionType, list):
                (inner,) = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
                if typing.get_origin(inner) is list:
                    kwargs.pop("action", None)
                    kwargs.update(type=typing.get_args(inner)[0], nargs="+")
        return super().add_argument(*args, **kwargs)


def command_parser(fn: Callable[..., Any], prog: str, skip: Sequence[str] = ()) -> Parser:
    """The parser of a command whose options are ``fn``'s parameters (``skip`` aside), its
    description ``fn``'s docstring up to ``Args:``, and ``--debug``."""
    parser = Parser(prog, (inspect.getdoc(fn) or "").split("\n\nArgs:")[0])
    parser.add_signature(fn, skip)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def parse(parser: ArgumentParser, argv: Sequence[str]) -> Any:
    """``argv`` parsed by ``parser``: a namespace without ``debug``, its dataclass groups (a
    recipe's) instantiated; ``CLIError`` for a bad option, naming the closest one."""
    try:
        namespace = parser.instantiate(parser.parse_args(list(argv)))
    except (ArgumentError, TypeError, ValueError) as e:
        message = " ".join(str(e).split()) + _did_you_mean(parser, argv)
        raise CLIError(f"{parser.prog}: {message} (see {parser.prog} --help)") from None
    namespace.pop("debug", None)
    return namespace


def _did_you_mean(parser: ArgumentParser, argv: Sequence[str]) -> str:
    """``": did you mean --optim.lr?"`` for the unknown flags of ``argv`` close to an option."""
    import argparse
    import difflib

    actions = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    options = [o[2:] for a in actions for o in a.option_strings if o.startswith("--")]
    known = {*options, *(o.rsplit(".", 1)[0] for o in options)}  # and a group's name
    hints = []
    for word in argv:
        key = word[2:].partition("=")[0]
        if not word.startswith("--") or key in known:
            continue
        close = difflib.get_close_matches(key, options, n=1)
        if not close:
            last = key.rsplit(".", 1)[-1]
            close = [o for o in options if o.rsplit(".", 1)[-1] == last][:1]
        if close:
            hints.append((key, close[0]))
    if len(hints) == 1:
        return f": did you mean --{hints[0][1]}?"
    pairs = ", ".join(f"--{option} for --{typo}" for typo, option in hints)
    return f": did you mean {pairs}?" if hints else ""


def check_positive(**values: int) -> None:
    """Refuse (``CLIError``) a value below 1, naming its option (``num_steps``: ``--num-steps``)."""
    for name, value in values.items():
        if value < 1:
            raise CLIError(f"fvstep: --{name.replace('_', '-')} must be >= 1, got {value}")


def under_launcher() -> bool:
    """Whether this process is one of several ranks started by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _gather(make: Callable[[], Any]) -> list[Any]:
    """Every rank's ``make()``, called once the process group is initialised from the
    environment."""
    from fvstep.parallel import gather_objects, init_from_env

    init_from_env()
    return gather_objects(make())


def from_rank0(value: Any) -> Any:
    """Rank 0's (picklable) ``value`` on every rank under ``torchrun`` (also a barrier);
    else ``value``."""
    return _gather(lambda: value)[0] if under_launcher() else value


def run_on_ranks(fn: Any, arg: Any, nproc: int) -> list[Any]:
    """Every rank's ``fn(arg)``, by rank: in place (under ``torchrun``, gathered), or on
    ``nproc`` launched ranks (1: in place); ``fn`` is module-level (the launched ranks
    import it by name) and ``arg`` picklable."""
    if under_launcher():
        return _gather(lambda: fn(arg))
    if nproc == 1:
        return [fn(arg)]
    import logging

    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api as processes_api

    from fvstep.parallel import launch

    # On Ctrl-C the launcher's agent logs three warnings (the signal, each rank closed):
    # the CLI says it in one line instead.
    for logger in (agent_api.logger, processes_api.logger):
        logger.setLevel(logging.ERROR)
    return launch(fn, arg, nproc=nproc)
