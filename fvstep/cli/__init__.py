"""The ``fvstep`` command line: the table of commands and the dispatch.

A command is a function whose signature is its options
(:func:`fvstep.cli.common.command_parser`); ``train`` and ``plan`` add the recipe's. Each
command imports what it needs (``--help`` imports no torch); :func:`main` lists the exit codes.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from fvstep.cli.common import Parser, command_parser, parse
from fvstep.cli.demo import run_demo
from fvstep.cli.export import run_export
from fvstep.cli.plan import run_plan, run_plan_command
from fvstep.cli.train import run_train, run_train_command
from fvstep.cli.verify import run_verify_compile, run_verify_resume
from fvstep.core.errors import CLIError, UsageError
from fvstep.executor.latents.cli import run_encode

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, Any] = {
    "train": run_train,
    "plan": run_plan,
    "export": run_export,
    "demo": run_demo,
    "verify-resume": run_verify_resume,
    "verify-compile": run_verify_compile,
    "data": {"encode": run_encode},
}
"""The commands by name: a function of its options, or a table of commands."""

_ABOUT = {
    "fvstep": "Training methods as pure steps, with exact resume.",
    "fvstep data": "Datasets of precomputed latents.",
}

_OF_WORDS = {run_train: run_train_command, run_plan: run_plan_command}
"""The commands that parse their words themselves: their parser depends on the recipe."""


def _run(prog: str, commands: dict[str, Any], argv: list[str]) -> int:
    """Run the command ``argv``'s first word that is no option names, on the words after it."""
    parser = Parser(prog, _ABOUT[prog])
    if prog == "fvstep":
        parser.add_argument("--debug", action="store_true", help="show tracebacks")
        parser.add_argument("--version", action="version", version=f"fvstep {_version()}")
    subcommands = parser.add_subcommands(dest="command")
    for name, command in commands.items():
        about = (inspect.getdoc(command) or "") if callable(command) else _ABOUT[f"{prog} {name}"]
        subcommands.add_subcommand(name, Parser(f"{prog} {name}"), help=about.split("\n\n")[0])
    at = next((i for i, word in enumerate(argv) if not word.startswith("-")), len(argv))
    parse(parser, argv[: at + 1])
    name, words = argv[at], argv[at + 1 :]
    command = commands[name]
    if isinstance(command, dict):
        return _run(f"{prog} {name}", command, words)
    if command in _OF_WORDS:
        return _OF_WORDS[command](words)
    return command(**parse(command_parser(command, f"{prog} {name}"), words).as_dict())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fvstep")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def _close_process_group() -> None:
    """Destroy the process group before exit: a gloo group left to interpreter shutdown
    can abort a rank ("terminate called without an active exception")."""
    if "torch.distributed" in sys.modules:
        from fvstep.parallel import destroy

        destroy()  # does nothing without a group


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fvstep`` console script: parse ``argv`` and run its command.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The command's exit code (0 on success; ``fvstep train``: 75 when a signal stopped
        the run after it saved), 2 for a user error (one line on stderr), 1 for another
        error (``--debug``: the traceback), 130 on Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        code = _run("fvstep", COMMANDS, argv)
        _close_process_group()
        return code
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
    except (CLIError, UsageError) as e:
        if debug:
            raise
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _say_interrupted()
        return 130
    except Exception as e:
        if _is_sigint(e):  # the elastic launcher's SignalException, on Ctrl-C
            _say_interrupted()
            return 130
        if debug:
            raise
        cause = _root_cause(e)
        print(
            f"fvstep: error: {type(cause).__name__}: {cause} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def _say_interrupted() -> None:
    """One line; on a terminal on a line of its own, not glued to a rank's progress bar."""
    start = "\n" if sys.stderr.isatty() else ""
    print(f"{start}fvstep: interrupted", file=sys.stderr)


def _is_sigint(e: BaseException) -> bool:
    import signal

    return type(e).__name__ == "SignalException" and getattr(e, "sigval", None) == signal.SIGINT


def _root_cause(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None)  # the elastic launcher's ChildFailedError
    if failures:
        first = next(iter(failures.values()))
        message = getattr(first, "message", None)
        if isinstance(message, dict):
            text = message.get("message", str(first))
        else:
            text = str(message or first)
        return RuntimeError(text.strip().splitlines()[-1] if text.strip() else "a rank failed")
    return e


if __name__ == "__main__":
    sys.exit(main())
