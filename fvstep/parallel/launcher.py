"""Starting and stopping ranks: local launch (:func:`launch`), ``torchrun``'s environment
(:func:`init_from_env`), tear-down (:func:`destroy`)."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fvstep.parallel.ranks import barrier

__all__ = ["destroy", "init_from_env", "launch"]


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _launched(entry: tuple[str, str], args: tuple[Any, ...]) -> Any:
    """Each launched rank: a process group from the env, then ``entry``."""
    backend = _default_backend()
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    # FSDP2 warns, on every rank and for every root module, that a module returned a view
    # (Wan's output is one): fvstep's commands use the outputs out of place only.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    try:
        module, name = entry
        fn = getattr(importlib.import_module(module), name)
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks with torch.distributed's elastic launcher.

    Each rank runs ``fn`` (a module-level function) inside a default process group (NCCL
    with GPUs, else gloo) and returns a picklable result.

    Returns:
        The results, by rank.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: If a rank failed.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    with _child_tracebacks_not_logged():
        results = elastic_launch(config, _launched)((fn.__module__, fn.__qualname__), args)
    return [results[r] for r in sorted(results)]


@contextlib.contextmanager
def _child_tracebacks_not_logged() -> Iterator[None]:
    """Silence the launcher's log of a failed rank's traceback: ``ChildFailedError`` carries it."""
    from torch.distributed.elastic.multiprocessing import api as processes_api

    # and torch.multiprocessing's "Terminating process ... via signal SIGTERM" of the others
    loggers = (processes_api.logger, logging.getLogger("torch.multiprocessing.spawn"))
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def init_from_env(*, backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Initialise the default process group from torchrun's environment, if not yet done.

    Args:
        backend: Default NCCL when CUDA is available, else gloo.
        timeout_s: The collectives' timeout (default: torch's).

    Returns:
        Whether this call created the group (the caller then owns :func:`destroy`).
    """
    if dist.is_initialized():
        return False
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend or _default_backend(), **kwargs)
    return True


def destroy() -> None:
    """Wait for every rank, then destroy the default process group (if there is one)."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
