"""What the commands of :mod:`fvstep.cli` share: the user error, option checks, and ranks.

A command runs its work on every rank: in place under ``torchrun`` (which sets
``WORLD_SIZE``), else on ranks launched through torch.distributed's elastic launcher.
Only the standard library is imported up front (``fvstep --help`` stays fast).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CLIError", "check_positive", "from_rank0", "run_on_ranks", "under_launcher"]


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


def check_positive(**values: int) -> None:
    """Refuse an option below 1.

    Args:
        **values: the options to check, by their name (``num_steps`` for ``--num-steps``).

    Raises:
        CLIError: one of ``values`` is below 1; the message names its option.

    Example:
        >>> check_positive(steps=6, every=2)
    """
    for name, value in values.items():
        if value < 1:
            raise CLIError(f"fvstep: --{name.replace('_', '-')} must be >= 1, got {value}")


def under_launcher() -> bool:
    """Whether this process is one of several ranks started by ``torchrun``.

    Returns:
        True when ``WORLD_SIZE`` is above 1.

    Example:
        >>> under_launcher()  # a plain python process
        False
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank under ``torchrun`` (also a barrier); else ``value``.

    Args:
        value: this rank's value (picklable).

    Returns:
        Rank 0's ``value``; the process group is initialised from the environment first.

    Example:
        >>> from_rank0("/tmp/one-directory-for-all-ranks")
        '/tmp/one-directory-for-all-ranks'
    """
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

    Example:
        >>> run_on_ranks(abs, -2, nproc=1)
        [2]
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
