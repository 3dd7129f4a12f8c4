"""Trace what one fvstep step enters: distinct named fvstep functions, files, calls.

One fine-tune step (a tiny Wan, 2 micro-batches, clipping, EMA, called directly) runs
under ``sys.setprofile``; every call into a function defined under ``fvstep/`` is
counted, except the loss function's own code (``fvstep/methods/``, the models included:
the model math a user writes) and what they call. Also: the nested fvstep frames between
``fvstep.run`` and the optimizer's kernel call, and the files they cross; the Python
opcodes run in fvstep's frames during one step (``sys.settrace``; a count of its host
work that does not depend on the machine's load); and one checkpoint save (``fvstep.checkpoint.save`` of the same state through DCP, one process),
where every fvstep frame counts, on every thread (the checksums run on a second one).

Usage (from the repository root):
    python scripts/step_path.py            # a table
    python scripts/step_path.py --list     # every function, with its call count
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

import fvstep as fs
from fvstep.methods.finetune import finetune
from fvstep.methods.models import synthetic_batch, tiny_wan

PACKAGE = Path(fs.__file__).resolve().parent
LEFT_OUT = (PACKAGE / "methods",)  # the loss function's own code (the models are in methods/)


def _build() -> tuple[fs.TrainState, Any, Any]:
    state = fs.TrainState.create(
        {"student": fs.Role(tiny_wan(), optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.9))},
        key=fs.random.key(0),
    )
    step = fs.compile(finetune(), accumulation=fs.Accumulation(2), clip=fs.clip_grad_norm(1.0))
    return state, step, synthetic_batch(fs.random.key(1), batch_size=2)


def _ours(path: str) -> bool:
    p = Path(path)
    return p.is_relative_to(PACKAGE) and not any(p.is_relative_to(x) for x in LEFT_OUT)


class Tracer:
    """Counts calls into fvstep's functions; skips everything under a left-out frame."""

    def __init__(self, frame: Any = None) -> None:
        """Start inside ``frame`` (its fvstep callers count as the path's outer frames)."""
        outer = []
        while frame is not None:
            code = frame.f_code
            if _ours(code.co_filename) and not code.co_name.startswith("<"):
                outer.append(
                    (str(Path(code.co_filename).relative_to(PACKAGE.parent)), code.co_qualname)
                )
            frame = frame.f_back
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.depth_left_out = 0
        self.stack: list[tuple[str, str]] = outer[::-1]
        self.deepest_to_kernel: list[tuple[str, str]] | None = None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            path = code.co_filename
            left_out = self.depth_left_out > 0 or any(
                Path(path).is_relative_to(x) for x in LEFT_OUT
            )
            if left_out:
                self.depth_left_out += 1
                return
            if _ours(path) and not code.co_name.startswith("<"):  # named: no genexpr, lambda
                where = (str(Path(path).relative_to(PACKAGE.parent)), code.co_qualname)
                self.calls[where] += 1
                self.stack.append(where)
            else:
                self.stack.append(("", ""))
        elif event == "return":
            if self.depth_left_out > 0:
                self.depth_left_out -= 1
                return
            if self.stack:
                self.stack.pop()
        # torch.optim.adamw.adamw: the kernel's entry
        at_kernel = event == "call" and code.co_name == "adamw" and "torch" in code.co_filename
        if at_kernel and not _ours(code.co_filename):
            frames = [f for f in self.stack if f[0]]
            if self.deepest_to_kernel is None or len(frames) > len(self.deepest_to_kernel):
                self.deepest_to_kernel = frames


def trace_step() -> Tracer:
    """One step, called directly (after one untraced warm-up step)."""
    state, step, batch = _build()
    state, _ = step(state, batch)  # warm-up: imports, caches
    tracer = Tracer()
    sys.setprofile(tracer)
    try:
        state, _ = step(state, batch)
    finally:
        sys.setprofile(None)
    return tracer


def count_opcodes() -> int:
    """The opcodes run in fvstep's frames (the loss function's code left out) during one
    step, called directly (after one untraced warm-up step)."""
    state, step, batch = _build()
    state, _ = step(state, batch)
    count = [0]

    def on_opcode(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            count[0] += 1
        return on_opcode

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if not _ours(frame.f_code.co_filename):
            return None  # torch's frames, and the loss function's
        frame.f_trace_opcodes = True
        return on_opcode

    sys.settrace(on_call)
    try:
        state, _ = step(state, batch)
    finally:
        sys.settrace(None)
    return count[0]


def trace_run() -> Tracer:
    """``fvstep.run`` for 2 steps, traced from the second batch on (the path from run to
    the kernel)."""
    state, step, batch = _build()
    with tempfile.TemporaryDirectory() as tmp:
        tracers: list[Tracer] = []

        def data(i: int) -> Any:
            if i == 1:
                tracers.append(Tracer(sys._getframe(1)))
                sys.setprofile(tracers[0])
            return batch

        try:
            fs.run(
                step,
                state,
                data,
                num_steps=2,
                checkpoints=fs.Checkpoints(tmp, every=100),
                progress=False,
            )
        finally:
            sys.setprofile(None)
    return tracers[0]


def trace_save() -> collections.Counter[tuple[str, str]]:
    """``fvstep.checkpoint.save`` of the state after one step (after one untraced save),
    every thread traced: the calls of every fvstep function, whoever calls it."""
    state, step, batch = _build()
    state, _ = step(state, batch)
    tracers: list[Tracer] = []

    def tracer_of_thread(frame: Any, event: str, arg: Any) -> None:
        tracer = Tracer()  # one per thread: its own stack
        tracers.append(tracer)
        sys.setprofile(tracer)
        tracer(frame, event, arg)

    with tempfile.TemporaryDirectory() as tmp:
        fs.checkpoint.save(state, Path(tmp) / "warm-up")  # imports, caches
        threading.setprofile(tracer_of_thread)
        sys.setprofile(tracer_of_thread)
        try:
            fs.checkpoint.save(state, Path(tmp) / "step_000000001")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    for tracer in tracers:
        calls.update(tracer.calls)
    return calls


def main(argv: list[str] | None = None) -> None:
    """Print the figures of one step (and, with ``--list``, each function)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list every function")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    one = trace_step()
    files = sorted({f for f, _ in one.calls})
    print("| one fine-tune step (tiny Wan, 2 micro-batches, clip, EMA) | |")
    print("|---|---|")
    print(f"| distinct named fvstep functions | {len(one.calls)} |")
    print(f"| files | {len(files)} |")
    print(f"| calls | {sum(one.calls.values())} |")
    print(f"| Python opcodes run in fvstep's frames | {count_opcodes()} |")
    run = trace_run()
    path = run.deepest_to_kernel or []
    print(f"| nested fvstep frames from fvstep.run to the optimizer kernel | {len(path)} |")
    print(f"| files on that path | {len({f for f, _ in path})} |")
    save = trace_save()
    save_files = sorted({f for f, _ in save})
    print(f"| checkpoint save: distinct named fvstep functions | {len(save)} |")
    print(f"| checkpoint save: files | {len(save_files)} |")
    print(f"| checkpoint save: calls | {sum(save.values())} |")
    print()
    print("files:", ", ".join(files))
    print("path from run to the kernel:", " > ".join(q for _, q in path))
    print("checkpoint save's files:", ", ".join(save_files))
    if args.list:
        for (f, q), n in sorted(one.calls.items()):
            print(f"{n:5d}  {f}:{q}")
        print("checkpoint save:")
        for (f, q), n in sorted(save.items()):
            print(f"{n:5d}  {f}:{q}")


if __name__ == "__main__":
    main()
