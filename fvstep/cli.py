"""The ``fvstep`` command line: ``demo``, ``verify-resume``, ``verify-compile``, ``bench``.

``fvstep demo`` and ``fvstep verify-resume`` launch their ranks themselves through
torch.distributed's elastic launcher when ``--nproc`` > 1, and run in place when started
under ``torchrun`` (which sets ``WORLD_SIZE``). Errors are one line on stderr and a
non-zero exit; ``--debug`` shows the traceback. Ctrl-C exits 130 with one line.

Only the standard library is imported up front; each command imports what it needs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


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

    demo = sub.add_parser(
        "demo", help="tiny DMD2 distillation that interrupts itself, resumes and proves it"
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=24,
        help="steps per run (default 24; the minimum depends on --every: the crash falls "
        "after the first checkpoint and before the last step)",
    )
    demo.add_argument("--nproc", type=int, default=2, help="ranks (gloo on CPU; default 2)")
    demo.add_argument(
        "--policy",
        choices=["every", "no_sync", "deferred"],
        default="deferred",
        help="FSDP2 gradient sync under accumulation: when gradients are reduced between "
        "micro-batches; changes communication, not results (default deferred; no effect "
        "with --nproc 1)",
    )
    demo.add_argument(
        "--microbatches", type=int, default=2, help="K, micro-batches per step (default 2)"
    )
    demo.add_argument("--every", type=int, default=4, help="checkpoint interval (default 4)")
    demo.add_argument(
        "--out", default="fvstep-demo", help="output directory (default ./fvstep-demo)"
    )
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the output of an earlier demo in --out (else the demo refuses)",
    )
    demo.add_argument("--debug", action="store_true", help="show tracebacks")

    verify = sub.add_parser("verify-resume", help="prove the resume law for MODULE:FACTORY")
    verify.add_argument("factory", help="MODULE:FACTORY; FACTORY() returns (state, step_fn, data)")
    verify.add_argument("--steps", type=int, default=6, help="steps of each run (default 6)")
    verify.add_argument(
        "--interrupt", type=int, nargs="+", default=None, help="steps to crash before"
    )
    verify.add_argument("--every", type=int, default=2, help="checkpoint interval (default 2)")
    verify.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks to launch, gloo on CPU (default 1; under torchrun: its ranks)",
    )
    verify.add_argument(
        "--workdir", default=None, help="checkpoint directory (default: a temp dir)"
    )
    verify.add_argument("--debug", action="store_true", help="show tracebacks")

    compiled = sub.add_parser(
        "verify-compile", help="check compiled gradients against eager ones for MODULE:FACTORY"
    )
    compiled.add_argument(
        "factory", help="MODULE:FACTORY; FACTORY() returns (module, args) or (module, args, kwargs)"
    )
    compiled.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="relative tolerance (default by precision: 1e-3 fp32, 1e-2 TF32, 0.1 bf16/fp16)",
    )
    compiled.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend for a module not compiled in place (default: inductor, "
        "with prepare's options)",
    )
    compiled.add_argument("--seed", type=int, default=0, help="the cotangent's seed (default 0)")
    compiled.add_argument("--debug", action="store_true", help="show tracebacks")

    bench = sub.add_parser(
        "bench", help="benchmarks: accumulation | overhead | checkpoint | realshape | data"
    )
    bench.add_argument(
        "name", choices=["accumulation", "overhead", "checkpoint", "realshape", "data"]
    )
    bench.add_argument("args", nargs=argparse.REMAINDER, help="options of the benchmark (--help)")

    if command == "data":
        from fvstep.latents.cli import add_parser as add_data_parser

        add_data_parser(sub)
    else:  # importing fvstep.latents imports torch: only listed, unless it is the command
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


def _under_launcher() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _check_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fvstep-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CLIError(
            f"fvstep: cannot write to the output directory {path!r}: {e.strerror or e}"
        ) from None
    return out.resolve()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise CLIError(f"fvstep: --{name.replace('_', '-')} must be >= 1, got {value}")


# ---------------------------------------------------------------------------- demo


def _demo_rank(config: Any) -> dict[str, Any]:
    from fvstep.demo import run_demo

    return run_demo(config)


def _from_rank0(value: Any) -> Any:
    """Under torchrun: rank 0's ``value`` on every rank (also a barrier). Else ``value``."""
    if not _under_launcher():
        return value
    from fvstep.parallel import gather_objects, init_from_env

    init_from_env()
    return gather_objects(value)[0]


def _run_on_ranks(fn: Any, arg: Any, nproc: int) -> list[Any]:
    """Every rank's ``fn(arg)``: in place (under torchrun, gathered), or on launched ranks."""
    if _under_launcher():
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


_DEMO_OUTPUTS = ("uninterrupted", "interrupted", "losses.png")


def _check_demo_options(args: argparse.Namespace) -> None:
    from fvstep.demo import min_steps

    _check_positive(nproc=args.nproc, microbatches=args.microbatches, every=args.every)
    if args.steps < min_steps(args.every):
        raise CLIError(
            f"fvstep: --steps must be >= {min_steps(args.every)} with --every {args.every} "
            f"(the demo crashes after its first checkpoint and before its last step), got "
            f"{args.steps}: use more steps or a smaller --every"
        )


def _demo_out_dir(args: argparse.Namespace) -> Path:
    """``--out``, checked writable; an earlier demo's output in it is refused, or removed
    with ``--overwrite`` (by rank 0, the other ranks waiting)."""
    out = _check_out_dir(args.out)
    earlier = [name for name in _DEMO_OUTPUTS if (out / name).exists()]
    if earlier and not args.overwrite:
        raise CLIError(
            f"fvstep: {args.out!r} holds an earlier demo's output ({', '.join(earlier)}): "
            "pass --overwrite to replace it, or another --out"
        )
    if earlier and int(os.environ.get("RANK", "0")) == 0:
        import shutil

        for name in earlier:
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            else:
                (out / name).unlink()
    _from_rank0(None)  # under torchrun: the other ranks wait for the clean-up
    return out


def _demo(args: argparse.Namespace) -> int:
    _check_demo_options(args)
    from fvstep.demo import DemoConfig, plot_losses

    out = _demo_out_dir(args)
    config = DemoConfig(
        out=str(out),
        num_steps=args.steps,
        microbatches=args.microbatches,
        sync=args.policy,
        every=args.every,
    )
    start = time.perf_counter()
    summary = _run_on_ranks(_demo_rank, config, args.nproc)[0]
    elapsed = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if summary["equal"] else 1
    png = plot_losses(
        out, resumed_from=summary["resumed_from"], crashed_before=summary["crashed_before"]
    )
    for line in _demo_summary(args, out, summary, png, elapsed):
        print(line)
    return 0 if summary["equal"] else 1


def _demo_summary(
    args: argparse.Namespace, out: Path, summary: dict[str, Any], png: Path | None, elapsed: float
) -> list[str]:
    """The summary's lines: every number in it was observed on the runs, not planned."""
    world = summary["world_size"]
    rows = [
        ("ranks", f"{world} (gloo, FSDP2)" if world > 1 else "1 (no sharding)"),
        ("steps", f"{args.steps} per run, K={args.microbatches} micro-batches"),
        ("sync policy", _policy_line(args.policy, world)),
        ("collectives", _collectives_line(summary["collectives"])),
        (
            "interruption",
            f"crashed before step {summary['crashed_before']} (checkpoints then: "
            f"{_steps_text(summary['checkpoints_at_crash'])}); restarted from the newest, "
            f"step {summary['resumed_from']}, {_recomputed(summary)}",
        ),
        ("resumed from", summary["resumed_from_path"]),
        (
            "checkpoints",
            f"every {args.every} steps, all kept: uninterrupted/ "
            f"{_steps_text(summary['checkpoints_uninterrupted'])}; interrupted/ "
            f"{_steps_text(summary['checkpoints_final'])}",
        ),
        ("final losses", _last_losses(out)),
        (
            "checkpoint size",
            f"{summary['checkpoint_bytes'] / 2**20:.2f} MiB ({summary['num_leaves']} leaves "
            f"per rank)",
        ),
        (
            "metrics",
            f"{out / 'uninterrupted' / 'metrics.jsonl'}, {out / 'interrupted' / 'metrics.jsonl'}",
        ),
        ("plot", str(png) if png else "matplotlib not installed: no plot"),
        ("time", f"{elapsed:.1f} s"),
    ]
    if summary["equal"]:
        rows.append(
            ("verdict", "RESUMED RUN == UNINTERRUPTED RUN, bitwise (every leaf, every rank)")
        )
    else:
        rows.append(("verdict", f"DIFFERENT: {summary['first_difference']}"))
    title = "fvstep demo — DMD2 (student, frozen teacher, critic) on a tiny Wan transformer"
    return ["", title, *(f"  {name:<19}  {text}" for name, text in rows)]


def _policy_line(policy: str, world: int) -> str:
    if world == 1:
        return f"none: one rank communicates no gradients (--policy {policy} has no effect)"
    return (
        f"{policy}. A policy changes when gradients are communicated, not what is computed: "
        "every and deferred give bitwise the same losses, no_sync the same up to summation "
        "order (docs: Sync policies)"
    )


def _collectives_line(collectives: dict[str, int]) -> str:
    if not collectives:
        return "none (one rank)"
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(collectives.items()))
    return f"at most {counts} per step (counted on rank 0)"


def _recomputed(summary: dict[str, Any]) -> str:
    first, last = summary["resumed_from"], summary["crashed_before"] - 1
    if last < first:
        return "with no step to recompute"
    return (
        f"and recomputed step {first}" if first == last else f"and recomputed steps {first}-{last}"
    )


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(str(s) for s in steps)


def _last_losses(out: Path) -> str:
    import json

    lines = (out / "interrupted" / "metrics.jsonl").read_text().splitlines()
    last: dict[str, float] = {}
    for line in lines:
        row = json.loads(line)
        last.update({k: v for k, v in row.items() if k.endswith("/loss")})
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(last.items()))


# ------------------------------------------------------------------- verify-resume


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
    from fvstep.state import TrainState

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


def _verify(args: argparse.Namespace) -> int:
    _check_positive(steps=args.steps, nproc=args.nproc, every=args.every)
    _checked_factory(args.factory)  # fail fast on an import error, before launching ranks
    interrupt = args.interrupt or [args.steps // 2]
    if any(not 0 <= s < args.steps for s in interrupt):
        raise CLIError(f"fvstep: --interrupt steps must lie in [0, {args.steps}), got {interrupt}")
    with tempfile.TemporaryDirectory(prefix="fvstep-verify-") as tmp:
        job = {
            "factory": args.factory,
            "steps": args.steps,
            "interrupt": interrupt,
            "every": args.every,
            "workdir": _from_rank0(args.workdir or tmp),  # one directory for all ranks
        }
        failures = _run_on_ranks(_verify_rank, job, args.nproc)
    failure = next((f for f in failures if f is not None), None)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if failure is None else 1
    num_ranks = int(os.environ.get("WORLD_SIZE", "0")) or args.nproc
    where = f"{args.steps} steps, crashes before {interrupt}, checkpoints every {args.every}, {num_ranks} rank(s)"
    if failure is None:
        print(f"resume is exact: {args.factory} ({where})")
        return 0
    print(f"resume is NOT exact: {args.factory} ({where})")
    print(f"  {failure}")
    print(
        "  Look for state the step reads that is not in the TrainState: a global RNG draw outside"
    )
    print("  the step, a counter kept on an object, data that is not a function of the step.")
    return 1


# ------------------------------------------------------------------ verify-compile


def _verify_compile(args: argparse.Namespace) -> int:
    if args.rtol is not None and not args.rtol > 0:
        raise CLIError(f"fvstep: --rtol must be positive, got {args.rtol}")
    made = _load_factory(args.factory)()
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise CLIError(
            f"fvstep: {args.factory} must return (module, args) or (module, args, kwargs), "
            f"got {type(made).__name__}"
        )
    import torch

    from fvstep.parallel.compile_check import CompiledGradientError
    from fvstep.testing import check_compiled_gradients

    module, inputs, kwargs = (*made, {}) if len(made) == 2 else made
    if not isinstance(module, torch.nn.Module):
        raise CLIError(f"fvstep: {args.factory} returned {type(module).__name__}, not a module")
    if not isinstance(inputs, (tuple, list)) or not isinstance(kwargs, dict):
        raise CLIError(f"fvstep: {args.factory}'s args must be a tuple and kwargs a dict")
    compiled = None if args.backend is None else {"backend": args.backend}
    try:
        reports = check_compiled_gradients(
            module, *inputs, compiled=compiled, rtol=args.rtol, seed=args.seed, **kwargs
        )
    except CompiledGradientError as e:
        print(f"compiled gradients are WRONG: {args.factory}")
        for line in str(e).splitlines():
            print(f"  {line}")
        return 1
    for r in reports:
        worst = r.worst
        what = f"{worst.name} {worst.relative_error:.2g}" if worst else "nothing requires grad"
        print(f"  {r.block}: worst {what} (tolerance {r.rtol:g}, {r.precision}, {r.seconds:.2f} s)")
    print(f"compiled gradients match eager ones: {args.factory} ({len(reports)} block(s))")
    return 0


# --------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"fvstep.bench.{args.name}")
    return int(module.main(list(args.args)))


def _data(args: argparse.Namespace) -> int:
    from fvstep.latents.cli import UsageError, run_data

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
    """Entry point of the ``fvstep`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = _build_parser(_command(argv)).parse_args(argv)
        handlers = {
            "demo": _demo,
            "verify-resume": _verify,
            "verify-compile": _verify_compile,
            "bench": _bench,
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
        print("fvstep: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _is_sigint(e):  # the elastic launcher's SignalException, on Ctrl-C
            print("fvstep: interrupted", file=sys.stderr)
            return 130
        if debug:
            raise
        cause = _root_cause(e)
        print(
            f"fvstep: error: {type(cause).__name__}: {cause} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


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
