"""What the commands of :mod:`fvstep.cli` share: the parser, the user error, option checks,
and ranks.

A command's options are the signature of its function: jsonargparse builds the parser and
its ``--help`` from the annotations and the docstring's ``Args`` (:func:`command_parser`),
as it builds a recipe's from its options dataclass. A command runs its work on every rank:
in place under ``torchrun`` (which sets ``WORLD_SIZE``), else on ranks launched through
torch.distributed's elastic launcher. Nothing heavy is imported up front (``fvstep --help``
stays fast).
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
    "did_you_mean",
    "from_rank0",
    "parse",
    "run_on_ranks",
    "under_launcher",
]


class Parser(ArgumentParser):
    """jsonargparse's parser, with argparse's spellings for the options of a command's
    signature (:meth:`add_signature`): ``--dashed-names``, a ``bool`` that defaults to
    False as a bare flag (``--overwrite``), a list as several values (``--interrupt 3 6``).
    Other options, a recipe's keys among them, keep jsonargparse's (``--run.num_steps 8``).
    """

    def __init__(self, prog: str, description: str | None = None) -> None:
        super().__init__(
            prog=prog, description=description, exit_on_error=False, default_meta=False
        )

    def add_signature(self, fn: Callable[..., Any], skip: Sequence[str] = ()) -> None:
        """Add the parameters of ``fn`` as options (its required positional ones as
        positional arguments), each with its ``Args`` description as help."""
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
    """The parser of a command whose options are the parameters of ``fn`` (``skip`` aside):
    its description is the docstring up to ``Args:``; ``--debug`` (read by
    :func:`fvstep.cli.main`) is accepted too.

    Example:
        >>> from fvstep.cli.demo import run_demo
        >>> command_parser(run_demo, "fvstep demo").parse_args(["--nproc", "1"]).nproc
        1
    """
    parser = Parser(prog, (inspect.getdoc(fn) or "").split("\n\nArgs:")[0])
    parser.add_signature(fn, skip)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def parse(parser: ArgumentParser, argv: Sequence[str]) -> Any:
    """``argv`` parsed by ``parser``: a namespace without ``debug``, its dataclass groups
    (a recipe's) instantiated.

    Raises:
        CLIError: For a bad option, in one line: the parser's message, the closest option
            to each unknown one, and where the options are listed.
    """
    try:
        namespace = parser.instantiate(parser.parse_args(list(argv)))
    except (ArgumentError, TypeError, ValueError) as e:
        message = " ".join(str(e).split()) + did_you_mean(parser, argv)
        raise CLIError(f"{parser.prog}: {message} (see {parser.prog} --help)") from None
    namespace.pop("debug", None)
    return namespace


def did_you_mean(parser: ArgumentParser, argv: Sequence[str]) -> str:
    """``": did you mean --optim.lr?"`` for each flag of ``argv`` that is no option of
    ``parser`` but close to one (difflib over the options, then over their last dotted
    parts: ``--lr`` is ``--optim.lr``); ``""`` when none is.

    Example:
        >>> from fvstep.cli.demo import run_demo
        >>> did_you_mean(command_parser(run_demo, "fvstep demo"), ["--evry", "2"])
        ': did you mean --every?'
    """
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
    """Refuse (``CLIError``, naming the option) a value below 1; ``values`` by the option's
    name (``num_steps`` for ``--num-steps``)."""
    for name, value in values.items():
        if value < 1:
            raise CLIError(f"fvstep: --{name.replace('_', '-')} must be >= 1, got {value}")


def under_launcher() -> bool:
    """Whether this process is one of several ranks started by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_rank0(value: Any) -> Any:
    """Rank 0's (picklable) ``value`` on every rank under ``torchrun``, the process group
    initialised from the environment (also a barrier); else ``value``."""
    if not under_launcher():
        return value
    from fvstep.parallel import gather_objects, init_from_env

    init_from_env()
    return gather_objects(value)[0]


def run_on_ranks(fn: Any, arg: Any, nproc: int) -> list[Any]:
    """Every rank's ``fn(arg)``: in place (under ``torchrun``, gathered), or on launched ranks.

    Args:
        fn: a module-level function (the launched ranks import it by name).
        arg: its one argument (picklable).
        nproc: how many ranks to launch when not under ``torchrun`` (1: run in place).

    Returns:
        ``fn(arg)`` of each rank, by rank.
    """
    if under_launcher():
        from fvstep.parallel import gather_objects, init_from_env

        init_from_env()
        return gather_objects(fn(arg))
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
