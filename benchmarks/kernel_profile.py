"""Where a step's time goes: its kernels, grouped by what they do, and the device's idle time.

The floor (:mod:`benchmarks.floor`) counts attention and matmuls only. This module profiles
one real step (``torch.profiler``) and groups its kernels so that the rest of the step can
be read off: element-wise work (Inductor's fused pointwise and reduction kernels, eager
ATen element-wise kernels), the optimizer, copies, collectives, and the time the device
sits idle between kernels (host overhead, syncs).

A kernel's **category** comes from its name (:func:`category`): the names are those of
cuDNN, cuBLAS, CUTLASS, FlashAttention, Triton (Inductor) and ATen kernels on CUDA, or the
ATen op names on CPU, where the profile has no kernels.

Examples:
    >>> category("triton_poi_fused_add_mul_0")
    'pointwise (Inductor)'
    >>> busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
    4.0
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["CATEGORIES", "busy_seconds", "category", "profile_call"]

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    (
        "attention",
        ("fmha", "flash", "attention", "sdpa", "cudnn", "fprop", "dgrad_knob", "bprop"),
    ),
    (
        "matmul",
        (
            "gemm",
            "nvjet",
            "xmma",
            "cutlass",
            "cublas",
            "wgmma",
            "linear",
            "addmm",
            "matmul",
            "::mm",
        ),
    ),
    ("collective", ("nccl", "all_gather", "reduce_scatter", "allreduce", "c10d")),
    ("pointwise (Inductor)", ("triton_poi",)),
    ("reduction (Inductor)", ("triton_red", "triton_per")),
    ("other Triton", ("triton",)),
    ("copy / memset", ("memcpy", "memset", "copy", "cat", "fill")),
    ("element-wise (eager)", ("elementwise", "vectorized", "unrolled", "aten::")),
    ("reduction (eager)", ("reduce_kernel", "norm")),
)
"""``(category, substrings)`` in order: a kernel is the first category one of whose
substrings its lower-cased name contains; ``"other"`` otherwise."""


def category(name: str) -> str:
    """The category of a kernel (or, on CPU, an ATen op) by its name: see :data:`CATEGORIES`."""
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time at least one ran."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _kernel_events(prof: Any, device: torch.device) -> list[tuple[str, float, float]]:
    """``(name, start_s, end_s)`` of each device kernel (CUDA) or top-level ATen op (CPU)."""
    from torch.autograd import DeviceType

    events = []
    for event in prof.events():
        on_device = getattr(event, "device_type", None) == DeviceType.CUDA
        if device.type == "cuda" and not on_device:
            continue
        if device.type != "cuda" and (event.cpu_parent is not None or on_device):
            continue
        span = event.time_range
        events.append((event.name, span.start / 1e6, span.end / 1e6))
    return events


def profile_call(fn: Callable[[], Any], device: torch.device, *, top: int = 25) -> dict[str, Any]:
    """Profile one call of ``fn`` and group its kernels.

    Args:
        fn: The call (one step); its result is returned under ``"result"``.
        device: Where it runs: on CUDA the device's kernels are grouped, on CPU the
            top-level ATen ops.
        top: How many of the longest kernels (summed by name) to list.

    Returns:
        ``{"wall_s", "busy_s", "idle_s", "categories": {label: seconds},
        "top": [{"name", "category", "seconds", "count"}], "result"}``: ``busy_s`` is the
        time at least one kernel ran, ``idle_s = wall_s - busy_s``; a category's seconds
        are its kernels' summed durations (kernels on several streams may overlap).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = _kernel_events(prof, device)
    if not events:
        return {
            "wall_s": 0.0,
            "busy_s": 0.0,
            "idle_s": 0.0,
            "categories": {},
            "top": [],
            "result": result,
        }
    wall = max(end for _, _, end in events) - min(start for _, start, _ in events)
    busy = busy_seconds((start, end) for _, start, end in events)
    categories: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, start, end in events:
        categories[category(name)] += end - start
        by_name[name][0] += end - start
        by_name[name][1] += 1
    longest = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {
        "wall_s": wall,
        "busy_s": busy,
        "idle_s": wall - busy,
        "categories": dict(sorted(categories.items(), key=lambda item: -item[1])),
        "top": [
            {"name": name[:160], "category": category(name), "seconds": s, "count": int(n)}
            for name, (s, n) in longest
        ],
        "result": result,
    }
