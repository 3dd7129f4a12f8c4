"""Testing helpers for users: prove that *your* method resumes exactly and compiles right.

:func:`assert_resume_exact`, :func:`check_compiled_gradients` (``fvstep verify-compile``),
:func:`assert_trees_equal` and the hypothesis strategies :func:`resume_scenarios` and
:func:`train_states`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from fvstep.core.errors import SimulatedCrash
from fvstep.core.layout import Parallelism
from fvstep.core.state import TrainState
from fvstep.core.tree import assert_trees_equal, leaves
from fvstep.executor.checkpoints import Checkpoints
from fvstep.executor.loop import run
from fvstep.parallel.compile_check import (
    DEFAULT_THRESHOLD,
    CompiledGradientReport,
    block_parameters,
    compare_compiled_gradients,
    compiled_gradient_error,
    install_compile_check,
    is_compiled_in_place,
)
from fvstep.parallel.mesh import is_sharded

__all__ = [
    "CrashAt",
    "ResumeScenario",
    "SimulatedCrash",
    "assert_resume_exact",
    "assert_trees_equal",
    "check_compiled_gradients",
    "resume_scenarios",
    "train_states",
]

Factory = Callable[[], tuple[TrainState, Callable[..., Any], Any]]


@attrs.frozen
class CrashAt:
    """Data (a source with ``batch``, or a function of the step) that crashes at ``step``."""

    data: Any
    step: int

    def batch(self, step: int, *, rank: int = 0, world_size: int = 1) -> Any:
        if step == self.step:
            raise SimulatedCrash(f"simulated crash before step {step}")
        if hasattr(self.data, "batch"):
            return self.data.batch(step, rank=rank, world_size=world_size)
        return self.data(step)


def assert_resume_exact(
    factory: Factory,
    *,
    num_steps: int,
    interruptions: Sequence[int],
    workdir: str | os.PathLike[str],
    checkpoint_every: int = 1,
    async_save: bool = False,
    parallelism: Parallelism | None = None,
) -> TrainState:
    """Assert that interrupting and resuming a run does not change its final state, bit for bit.

    ``factory()`` builds everything anew each call (modules, state, step, data), as a
    restarted process would. The interrupted run crashes before each step in
    ``interruptions`` and restarts from the newest checkpoint until ``num_steps``. On
    several ranks, every rank calls this with the same ``workdir``.

    Args:
        factory: ``() -> (initial_state, step_fn, data)``.
        workdir: An empty directory for the checkpoints (shared by all ranks).
        checkpoint_every: The interrupted run's checkpointing (with ``async_save``).
        parallelism: The layout every run is called with (``fvstep.run``'s).

    Returns:
        The final state of the uninterrupted run.

    Raises:
        AssertionError: Naming the first leaf where the resumed run differs.
        ValueError: For interruptions outside ``[0, num_steps)``.

    An example: docs/tutorial.md.
    """
    if any(not 0 <= s < num_steps for s in interruptions):
        raise ValueError(f"interruptions {list(interruptions)} must lie in [0, {num_steps})")
    # A check, not a training run: a signal ends it (Ctrl-C raises KeyboardInterrupt) rather
    # than stopping one of its runs early, which would compare a partial state.
    state, step_fn, data = factory()
    options: dict[str, Any] = {
        "progress": False,
        "handle_signals": False,
        "parallelism": parallelism,
    }
    expected = run(step_fn, state, data, num_steps=num_steps, **options)
    checkpoints = Checkpoints(
        Path(workdir) / "checkpoints", every=checkpoint_every, keep=2, async_save=async_save
    )
    for stop in sorted(interruptions):
        state, step_fn, data = factory()
        with contextlib.suppress(SimulatedCrash):
            run(
                step_fn,
                state,
                CrashAt(data, stop),
                num_steps=num_steps,
                checkpoints=checkpoints,
                **options,
            )
    state, step_fn, data = factory()
    resumed = run(step_fn, state, data, num_steps=num_steps, checkpoints=checkpoints, **options)
    try:
        assert_trees_equal(resumed, expected, check_static=False)
    except AssertionError as e:
        raise AssertionError(
            f"the run interrupted before steps {sorted(interruptions)} and resumed differs from "
            f"the uninterrupted run: {e}"
        ) from None
    return expected


@attrs.frozen
class ResumeScenario:
    """One drawn resume scenario (see :func:`resume_scenarios`)."""

    seed: int
    num_steps: int
    interruptions: tuple[int, ...]
    microbatches: int
    sync: str


def resume_scenarios(
    *, max_steps: int = 6, max_interruptions: int = 2, microbatches: Sequence[int] = (1, 2, 3)
) -> Any:
    """A hypothesis strategy of :class:`ResumeScenario` (seed, steps, crash points, K, policy)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d: Any) -> ResumeScenario:
        num_steps = d(st.integers(2, max_steps))
        stops = d(
            st.lists(
                st.integers(1, num_steps - 1), min_size=1, max_size=max_interruptions, unique=True
            )
        )
        return ResumeScenario(
            seed=d(st.integers(0, 2**31 - 1)),
            num_steps=num_steps,
            interruptions=tuple(sorted(stops)),
            microbatches=d(st.sampled_from(list(microbatches))),
            sync=d(st.sampled_from(["every", "no_sync", "deferred"])),
        )

    return draw()


def train_states(*, max_roles: int = 3) -> Any:
    """A hypothesis strategy of small :class:`TrainState` s: drawn roles, dtypes, optimizers,
    EMAs, extra state and leaf values."""
    from hypothesis import strategies as st

    from fvstep.core import optim
    from fvstep.core import random as fsrandom
    from fvstep.core.state import EMA, Role

    @st.composite
    def draw(d: Any) -> TrainState:
        num_roles = d(st.integers(1, max_roles))
        seed = d(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        roles = {}
        for i in range(num_roles):
            dtype = d(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
            width = d(st.integers(1, 5))
            depth = d(st.integers(1, 3))
            layers = [torch.nn.Linear(width, width, bias=d(st.booleans())) for _ in range(depth)]
            module = torch.nn.Sequential(*layers).to(dtype)
            kind = d(st.sampled_from(["adamw", "sgd", "frozen"]))
            opt: Any = {
                "adamw": optim.adamw(lr=1e-3, amsgrad=d(st.booleans())),
                "sgd": optim.sgd(lr=0.1, momentum=0.9),
                "frozen": None,
            }[kind]
            ema = EMA(0.9) if opt is not None and d(st.booleans()) else None
            roles[f"role{i}"] = Role(module, optimizer=opt, ema=ema, allow_low_precision=True)
        extra = {
            "counter": torch.tensor(d(st.integers(0, 100))),
            "cache": [torch.randn(d(st.integers(0, 3)), 2, generator=gen)],
        }
        state = TrainState.create(roles, key=fsrandom.key(seed), extra=extra)
        with torch.no_grad():
            for leaf in (x for x in leaves(state) if x.is_floating_point()):
                leaf.copy_(
                    torch.randn(leaf.shape, generator=gen, dtype=torch.float64).to(leaf.dtype)
                )
        return state

    return draw()


def check_compiled_gradients(
    module: torch.nn.Module,
    *args: Any,
    compiled: Callable[..., Any] | Mapping[str, Any] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    seed: int = 0,
    **kwargs: Any,
) -> list[CompiledGradientReport]:
    """Check that ``module``'s compiled gradients match its eager ones on one input.

    What :func:`fvstep.parallel.prepare`'s ``verify_compile`` does, on a probe of yours:
    each compiled block's gradients, eager and compiled, on the inputs it receives when
    ``module(*args, **kwargs)`` runs, judged against eager's rounding noise
    (:mod:`fvstep.parallel.compile_check`). Nothing is left behind (no ``.grad``; the RNG,
    dtypes, ``requires_grad`` and compilation as they were).

    Args:
        module: Its blocks compiled in place are checked one by one; if none is, the
            module itself is compiled for the check and checked whole.
        compiled: ``None`` (the above); a mapping of ``torch.compile`` arguments to
            compile ``module`` with; or a compiled version of ``module`` to compare with
            ``module`` called eagerly.
        threshold: The largest ratio of a compiled gradient's error to eager's rounding
            noise that passes.
        seed: The cotangent's seed.

    Returns:
        One :class:`~fvstep.parallel.compile_check.CompiledGradientReport` per block
        checked, in the order the blocks ran.

    Raises:
        CompiledGradientError: For the first block whose gradients differ, naming it.
        ValueError: If ``module`` is sharded (use ``prepare(..., verify_compile=True)``).
        ValueError: If ``compiled`` asks to compile a module whose blocks are compiled.

    An example: docs/concepts/prepare.md.
    """
    if is_sharded(module):
        raise ValueError(
            "check_compiled_gradients runs on one process: for a sharded module use "
            "fvstep.parallel.prepare(..., verify_compile=True), which checks on every rank"
        )
    if compiled is not None and not isinstance(compiled, Mapping):
        report = compare_compiled_gradients(
            module,
            compiled,
            args,
            kwargs,
            params=block_parameters(module),
            block=type(module).__name__,
            threshold=threshold,
            seed=seed,
        )
        if not report.passed:
            raise compiled_gradient_error(report)
        return [report]
    blocks = _outermost_compiled(module)
    compiled_here = not blocks
    if blocks and compiled is not None:
        raise ValueError(
            f"{', '.join(blocks)} of the module are compiled already: leave compiled=None "
            "to check them as they are"
        )
    if compiled_here:
        from fvstep.parallel.block_compile import resolve_compile_options  # prepare's defaults

        module.compile(**(resolve_compile_options(True if compiled is None else compiled) or {}))
        blocks = {type(module).__name__: module}
    checks = [
        install_compile_check(m, name=n, threshold=threshold, seed=seed) for n, m in blocks.items()
    ]
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            module(*args, **kwargs)  # each block checks itself; the output is discarded
    finally:
        for check in checks:
            check.remove()
        if compiled_here:  # back to the class's None: not compiled in place, as it came
            module.__dict__.pop("_compiled_call_impl", None)
    return [r for check in checks for r in check.reports]


def _outermost_compiled(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The submodules compiled in place that no other compiled one contains, by name."""
    found: dict[str, torch.nn.Module] = {}
    for name, m in module.named_modules():
        inside = any(name == n or name.startswith(f"{n}.") or n == "" for n in found)
        if is_compiled_in_place(m) and not inside:
            found[name] = m
    return {n or type(module).__name__: m for n, m in found.items()}
