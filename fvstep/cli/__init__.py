"""The ``fvstep`` command line: ``train``, ``plan``, ``export``, ``demo``, ``verify-resume``,
``verify-compile``, ``data``.

This module is the parser and the dispatch; each command lives in its own module
(:mod:`fvstep.cli.train`, :mod:`fvstep.cli.plan`, :mod:`fvstep.cli.export`, :mod:`fvstep.cli.demo`,
:mod:`fvstep.cli.verify`, :mod:`fvstep.executor.latents.cli`), and what
they share in :mod:`fvstep.cli.common`. ``fvstep demo`` and ``fvstep verify-resume``
launch their ranks themselves through torch.distributed's elastic launcher when
``--nproc`` > 1, and run in place when started under ``torchrun`` (which sets
``WORLD_SIZE``); so does ``fvstep train`` (which parses its own arguments: a recipe's
``--dotted.key value`` options). Errors are one line on stderr and a non-zero exit; ``--debug`` shows the
traceback. Ctrl-C exits 130 with one line.

Only the standard library is imported up front; each command imports what it needs.
The benchmarks are not part of the package: ``python -m benchmarks.<name>`` from a
checkout.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from fvstep.cli.common import CLIError
from fvstep.cli.demo import add_demo_parser, run_demo_command
from fvstep.cli.export import add_export_parser, run_export_command
from fvstep.cli.plan import add_plan_parser, run_plan_command
from fvstep.cli.train import add_train_parser, run_train_command
from fvstep.cli.verify import add_verify_parsers, run_verify_compile, run_verify_resume

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{self.prog}: {message} (see {self.prog} --help)")


def _build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of the ``fvstep`` command; the ``data`` subcommand is built in full only
    when it is the ``command`` being run (its module imports torch)."""
    parser = _Parser(
        prog="fvstep", description="Training methods as pure steps, with exact resume."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    add_train_parser(sub)
    add_plan_parser(sub)
    add_export_parser(sub)
    add_demo_parser(sub)
    add_verify_parsers(sub)
    if command == "data":
        from fvstep.executor.latents.cli import add_parser as add_data_parser

        add_data_parser(sub)
    else:  # importing fvstep.executor.latents imports torch: only listed, unless it is the command
        sub.add_parser("data", help="datasets of precomputed latents: encode")
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top-level
    options take no values), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


class _Version(argparse.Action):
    """``--version``: looks the version up only when asked (importlib.metadata is slow)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"fvstep {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fvstep")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def _data(args: argparse.Namespace) -> int:
    from fvstep.executor.latents.cli import UsageError, run_data

    try:
        return run_data(args)
    except UsageError as e:
        raise CLIError(str(e)) from None


def _close_process_group() -> None:
    """Under torchrun, wait for every rank and destroy the process group before exit.

    A gloo group left to interpreter shutdown can abort a rank at exit ("terminate called
    without an active exception", seen once in CI after a successful verify-resume).
    Nothing is imported when no group was created (``--help`` stays fast).
    """
    if "torch.distributed" in sys.modules:
        from fvstep.parallel import destroy

        destroy()  # does nothing without a group


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fvstep`` console script: parse ``argv`` and run its command.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: the command's (0 on success; ``fvstep train``: 75 when a signal
        stopped the run after it saved), 2 for a user error (one line on stderr), 1 for
        any other error, 130 on Ctrl-C.

    Example:
        >>> main(["verify-resume", "my_method:factory", "--steps", "6"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        command_name = _command(argv)
        if command_name == "train":  # a recipe's options are the recipe's to parse
            code = run_train_command(argv[argv.index("train") + 1 :])
            _close_process_group()
            return code
        if command_name == "plan":  # so are plan's (the same options, then its own flags)
            return run_plan_command(argv[argv.index("plan") + 1 :])
        args = _build_parser(command_name).parse_args(argv)
        handlers = {
            "export": run_export_command,
            "demo": run_demo_command,
            "verify-resume": run_verify_resume,
            "verify-compile": run_verify_compile,
            "data": _data,
        }
        command = handlers[args.command]
        code = command(args)
        _close_process_group()
        return code
    except CLIError as e:
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
    """One line; on a terminal on a line of its own, not glued to a rank's progress bar
    (drawn with carriage returns, no newline, by another process)."""
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
