"""fvstep's own host time inside a step: a profile hook that sets work aside.

:class:`BookkeepingClock` times a call and the *work* that fvstep's library frames call
into (the loss function, hence the model's forward; ``Tensor.backward``; ``torch.optim``
kernels; gradient norm and clipping); the difference is fvstep's bookkeeping.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import fvstep as fs

__all__ = ["BookkeepingClock"]

_FVSTEP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
_NOT_LIBRARY = ("bench", "methods")  # methods/ holds the models too
_WORK = (
    os.path.join("torch", "autograd"),
    os.path.join("torch", "optim"),
    os.path.join("torch", "nn", "utils", "clip_grad.py"),
    os.path.join("fvstep", "methods"),
    os.path.join("fvstep", "bench"),
)


@functools.cache
def _is_library(filename: str) -> bool:
    """A file of fvstep's library (not its methods, models or benchmarks)."""
    path = os.path.abspath(filename)
    package = os.path.join(_FVSTEP_DIR, "fvstep") + os.sep
    return path.startswith(package) and not path[len(package) :].startswith(_NOT_LIBRARY)


@functools.cache
def _is_work(filename: str, name: str) -> bool:
    """Model, loss, backward, optimizer kernel or clipping code."""
    if filename.endswith(os.path.join("torch", "_tensor.py")):
        return name == "backward"
    return any(part in filename for part in _WORK)


class BookkeepingClock:
    """Time of a call minus the work that fvstep's own frames call into.

    A ``sys.setprofile`` hook: when a frame of fvstep's library calls a *work* function
    — a loss function (the model's forward), ``Tensor.backward``, ``torch.optim``'s
    kernels, gradient norm and clipping — the time until that call returns is work;
    the rest of the measured call is fvstep's bookkeeping (keys, RNG scopes, FSDP2
    flags, checks, metrics, state plumbing). The hook slows every Python call, so the
    result is an upper bound.

    Example:
        >>> clock = BookkeepingClock()
        >>> clock.measure(lambda: step(state, batch))
        >>> clock.total, clock.work
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.work = 0.0
        self._frames: list[float | None] = []
        self._inside_work = 0

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            start = None
            if not self._inside_work and frame.f_back is not None:
                code = frame.f_code
                if _is_work(code.co_filename, code.co_name) and _is_library(
                    frame.f_back.f_code.co_filename
                ):
                    start = time.perf_counter()
                    self._inside_work += 1
            self._frames.append(start)
        elif event == "return" and self._frames:
            start = self._frames.pop()
            if start is not None:
                self._inside_work -= 1
                self.work += time.perf_counter() - start

    def measure(self, fn: Any) -> None:
        """Run ``fn()`` under the hook, adding to :attr:`total` and :attr:`work`."""
        self._frames, self._inside_work = [], 0
        start = time.perf_counter()
        sys.setprofile(self._hook)
        try:
            fn()
        finally:
            sys.setprofile(None)
            self.total += time.perf_counter() - start

    @property
    def bookkeeping(self) -> float:
        """Seconds outside work."""
        return self.total - self.work
