"""``fvstep verify-resume`` and ``fvstep verify-compile``: the laws of
:func:`fvstep.testing.assert_resume_exact` and :func:`fvstep.testing.check_compiled_gradients`
on what a user's ``MODULE:FACTORY`` (importable from the working directory) returns.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from typing import Any

from fvstep.cli.common import check_positive, from_rank0, run_on_ranks
from fvstep.core.errors import CLIError

__all__ = ["run_verify_compile", "run_verify_resume"]

_WHERE_TO_LOOK = """\
  Look for state the step reads that is not in the TrainState: a global RNG draw outside
  the step, a counter kept on an object, data that is not a function of the step."""


def _load_factory(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CLIError(f"fvstep: factory must be MODULE:FACTORY, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise CLIError(f"fvstep: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"fvstep: {module_name!r} has no callable {attr!r}")
    return factory


def _checked_factory(spec: str) -> Any:
    from fvstep.core.state import TrainState

    factory = _load_factory(spec)

    def checked() -> Any:
        made = factory()
        if not (isinstance(made, tuple) and len(made) == 3):
            raise CLIError(
                f"fvstep: {spec} must return (state, step_fn, data), got {type(made).__name__}"
                + (f" of length {len(made)}" if isinstance(made, tuple) else "")
            )
        state, step_fn, _data = made
        if not isinstance(state, TrainState):
            raise CLIError(
                f"fvstep: {spec} returned {type(state).__name__} where a TrainState must be"
            )
        if not callable(step_fn):
            raise CLIError(f"fvstep: {spec} returned a step_fn that is not callable")
        return made

    return checked


def _verify_rank(job: dict[str, Any]) -> str | None:
    from fvstep.testing import assert_resume_exact

    try:
        assert_resume_exact(
            _checked_factory(job["factory"]),
            num_steps=job["steps"],
            interruptions=job["interrupt"],
            workdir=job["workdir"],
            checkpoint_every=job["every"],
        )
    except AssertionError as e:
        return str(e)
    return None


def run_verify_resume(
    factory: str,
    *,
    steps: int = 6,
    interrupt: list[int] | None = None,
    every: int = 2,
    nproc: int = 1,
    workdir: str | None = None,
) -> int:
    """Prove the resume law for MODULE:FACTORY, on every rank.

    Args:
        factory: MODULE:FACTORY; FACTORY() returns (state, step_fn, data)
        steps: steps of each run
        interrupt: steps to crash before (default: steps // 2)
        every: checkpoint interval
        nproc: ranks to launch, gloo on CPU (under torchrun: its ranks)
        workdir: checkpoint directory (default: a temp dir)

    Returns:
        0 when every interrupted run resumes to the uninterrupted one bitwise, else 1
        (rank 0 prints the first difference and where to look).

    Raises:
        CLIError: An option is out of range, or the factory cannot be imported or returns
            something other than ``(state, step_fn, data)``.

    Example:
        $ fvstep verify-resume my_method:factory --steps 6 --interrupt 2 4 --nproc 2
    """
    check_positive(steps=steps, nproc=nproc, every=every)
    _checked_factory(factory)  # fail fast on an import error, before launching ranks
    interrupt = interrupt or [steps // 2]
    if any(not 0 <= s < steps for s in interrupt):
        raise CLIError(f"fvstep: --interrupt steps must lie in [0, {steps}), got {interrupt}")
    with tempfile.TemporaryDirectory(prefix="fvstep-verify-") as tmp:
        job = {
            "factory": factory,
            "steps": steps,
            "interrupt": interrupt,
            "every": every,
            "workdir": from_rank0(workdir or tmp),  # one directory for all ranks
        }
        failures = run_on_ranks(_verify_rank, job, nproc)
    failure = next((f for f in failures if f is not None), None)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if failure is None else 1
    num_ranks = int(os.environ.get("WORLD_SIZE", "0")) or nproc
    where = (
        f"{steps} steps, crashes before {interrupt}, checkpoints every {every}, {num_ranks} rank(s)"
    )
    if failure is None:
        print(f"resume is exact: {factory} ({where})")
        return 0
    print(f"resume is NOT exact: {factory} ({where})\n  {failure}\n{_WHERE_TO_LOOK}")
    return 1


def run_verify_compile(
    factory: str, *, threshold: float | None = None, backend: str | None = None, seed: int = 0
) -> int:
    """Check compiled gradients against eager ones for MODULE:FACTORY.

    Args:
        factory: MODULE:FACTORY; FACTORY() returns (module, args) or (module, args, kwargs)
        threshold: largest ratio of a compiled gradient's error to eager's rounding noise
            (default 20)
        backend: torch.compile backend for a module not compiled in place (default:
            inductor, with prepare's options)
        seed: the cotangent's seed

    Returns:
        0 when every block's compiled gradients match the eager ones within the
        threshold, else 1 (the mismatches are printed).

    Raises:
        CLIError: ``--threshold`` is not positive, or the factory cannot be imported or
            returns something other than ``(module, args)`` or ``(module, args, kwargs)``.

    Example:
        $ fvstep verify-compile my_model:factory --threshold 30
    """
    if threshold is not None and not threshold > 0:
        raise CLIError(f"fvstep: --threshold must be positive, got {threshold}")
    made = _load_factory(factory)()
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise CLIError(
            f"fvstep: {factory} must return (module, args) or (module, args, kwargs), "
            f"got {type(made).__name__}"
        )
    import torch

    from fvstep.core.errors import CompiledGradientError
    from fvstep.testing import check_compiled_gradients

    module, inputs, kwargs = (*made, {}) if len(made) == 2 else made
    if not isinstance(module, torch.nn.Module):
        raise CLIError(f"fvstep: {factory} returned {type(module).__name__}, not a module")
    if not isinstance(inputs, (tuple, list)) or not isinstance(kwargs, dict):
        raise CLIError(f"fvstep: {factory}'s args must be a tuple and kwargs a dict")
    compiled = None if backend is None else {"backend": backend}
    options: dict[str, Any] = {"seed": seed}
    if threshold is not None:
        options["threshold"] = threshold
    try:
        reports = check_compiled_gradients(module, *inputs, compiled=compiled, **options, **kwargs)
    except CompiledGradientError as e:
        print(f"compiled gradients are WRONG: {factory}")
        for line in str(e).splitlines():
            print(f"  {line}")
        return 1
    for r in reports:
        worst = r.worst
        what = (
            f"{worst.name} {worst.ratio:.2g} x noise (error {worst.relative_error:.2g}, "
            f"noise {worst.relative_noise:.2g})"
            if worst
            else "nothing requires grad"
        )
        print(
            f"  {r.block}: worst {what} (threshold {r.threshold:g}, {r.precision}, "
            f"{r.seconds:.2f} s)"
        )
    print(f"compiled gradients match eager ones: {factory} ({len(reports)} block(s))")
    return 0
