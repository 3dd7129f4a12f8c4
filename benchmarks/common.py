"""Shared pieces of the benchmarks: distributed setup, options, timing, memory, tables.

A benchmark process is either a single process (modules unsharded) or one rank of a
``torchrun`` launch (``WORLD_SIZE > 1``): :func:`setup_runtime` then initialises the
process group (NCCL on CUDA, gloo on CPU) and :func:`prepare_module` shards every role
with :func:`fvstep.parallel.shard_module`. Model presets live in
:mod:`benchmarks.presets`, analytic FLOPs and collectives in :mod:`benchmarks.analytic`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fvstep as fs
from benchmarks.presets import PRESETS
from fvstep import parallel as fsd

__all__ = [
    "MemoryMeter",
    "Runtime",
    "add_runtime_args",
    "apply_threads",
    "autocast_context",
    "describe",
    "format_stat",
    "mib",
    "optimizer_options",
    "peak_flops",
    "prepare_module",
    "print_table",
    "resolve_dtype",
    "setup_runtime",
    "summarize",
    "teardown_runtime",
    "time_call",
    "with_autocast",
    "write_json",
]

# ------------------------------------------------------------------ distributed runtime


@dataclass
class Runtime:
    """Where this process runs: rank, world size, device and (when sharded) the mesh."""

    rank: int
    world: int
    device: torch.device
    mesh: Any = None
    started_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and writes."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether roles are sharded with FSDP2 (``torchrun`` with more than one rank)."""
        return self.world > 1

    def barrier(self) -> None:
        """A barrier over all ranks (a no-op on one process)."""
        fsd.barrier()

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks (the slowest rank's time, the largest peak)."""
        return fsd.max_over_ranks(
            values, device=self.device if self.device.type == "cuda" else None
        )

    def print(self, *args: Any) -> None:
        """Print on rank 0 only."""
        if self.is_main:
            print(*args, flush=True)


def setup_runtime(device: str | None) -> Runtime:
    """Initialise the process group under ``torchrun`` and pick this rank's device.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).

    Returns:
        The :class:`Runtime`; with ``WORLD_SIZE > 1`` it holds a 1-D FSDP mesh.
    """
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    # diffusers' Wan returns a view of its output; FSDP2 warns about in-place ops on it,
    # which the benchmarks never do.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return Runtime(rank=0, world=1, device=dev)
    started = fsd.init_from_env(backend="nccl" if kind == "cuda" else "gloo", timeout_s=600)
    mesh = fsd.make_mesh(device_type=kind)
    rank, world = fsd.rank_and_world()
    return Runtime(rank, world, dev, mesh, started)


def teardown_runtime(rt: Runtime) -> None:
    """Destroy the process group if :func:`setup_runtime` created it."""
    if rt.started_group:
        fsd.destroy()


def add_runtime_args(parser: Any, *, dtype: bool = True) -> None:
    """The options every benchmark shares: preset, device, dtype, compile, JSON."""
    parser.add_argument("--preset", default="tiny-wan", choices=sorted(PRESETS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    if dtype:
        parser.add_argument(
            "--dtype",
            choices=("bf16", "fp32"),
            default=None,
            help="bf16: fp32 master params, bf16 compute (FSDP2 MixedPrecisionPolicy with "
            "fp32 reduce when sharded, autocast on one process); default bf16 on cuda",
        )
        parser.add_argument(
            "--compile", action="store_true", help="torch.compile each transformer block"
        )
        parser.add_argument(
            "--peak-tflops",
            type=float,
            default=None,
            help="per-device peak for MFU (default 989 = H200 bf16 dense on cuda; n/a on cpu)",
        )
        parser.add_argument("--batch-per-microbatch", type=int, default=1)
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write the results as JSON here")


def apply_threads(args: Any) -> None:
    """``torch.set_num_threads(--threads)`` when given."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def resolve_dtype(args: Any, rt: Runtime) -> str:
    """``--dtype``, defaulting to bf16 on CUDA and fp32 on CPU."""
    return args.dtype or ("bf16" if rt.device.type == "cuda" else "fp32")


def peak_flops(args: Any, rt: Runtime) -> float | None:
    """Per-device peak FLOP/s for MFU, or ``None`` (n/a)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    return 989e12 if rt.device.type == "cuda" else None


def prepare_module(
    module: nn.Module, rt: Runtime, *, dtype: str, compile_blocks: bool = False
) -> nn.Module:
    """Compile each block (optional), then shard with FSDP2 when running on several ranks.

    ``block.compile()`` compiles in place (parameter names unchanged), before
    ``fully_shard`` as torchtitan orders it; dynamo skips FSDP2's hooks
    (``torch._dynamo.config.skip_fsdp_hooks``), so they run eagerly around the compiled
    block.
    """
    if compile_blocks:
        from fvstep.parallel.block_compile import SAFE_INDUCTOR_OPTIONS

        for block in module.blocks:  # type: ignore[union-attr]
            block.compile(options=SAFE_INDUCTOR_OPTIONS)  # pytorch/pytorch#193061
    if rt.sharded:
        mp = None
        if dtype == "bf16":
            mp = fsd.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fsd.shard_module(module, mesh=rt.mesh, mp_policy=mp)
    return module


def with_autocast(fn: Callable[..., Any], rt: Runtime, dtype: str) -> Callable[..., Any]:
    """On one process with bf16, run ``fn`` under autocast (FSDP2 casts when sharded)."""
    if dtype != "bf16" or rt.sharded:
        return fn

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(rt.device.type, dtype=torch.bfloat16):
            return fn(*args, **kwargs)

    return wrapped


def autocast_context(rt: Runtime, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """The autocast context :func:`with_autocast` uses (or a null context)."""
    if dtype != "bf16" or rt.sharded:
        return contextlib.nullcontext()
    return torch.autocast(rt.device.type, dtype=torch.bfloat16)


def optimizer_options(impl: str) -> tuple[bool | None, bool | None]:
    """``(foreach, fused)`` for ``--impl default|foreach|fused|single``."""
    options: dict[str, tuple[bool | None, bool | None]] = {
        "default": (None, None),
        "foreach": (True, None),
        "fused": (None, True),
        "single": (False, None),
    }
    return options[impl]


# ------------------------------------------------------------------ timing and memory


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall-clock seconds of ``fn()`` with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class MemoryMeter:
    """Peak memory of a section: ``max_memory_allocated`` on CUDA, peak RSS on CPU.

    On CPU the RSS high-water mark is reset by writing ``5`` to ``/proc/self/clear_refs``
    (Linux); where that is impossible the peak is ``None`` ("n/a").
    """

    device: torch.device
    start: int | None = None
    _ok: bool = field(default=True)

    def reset(self) -> None:
        """Start a section: reset the peak and remember what is allocated now."""
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss = _proc_status_kib("VmRSS")
            self.start = None if rss is None else rss * 1024
        except OSError:
            self.start = None

    def peak(self) -> int | None:
        """The peak (bytes) since :meth:`reset`: allocated on CUDA, RSS on CPU."""
        synchronize(self.device)
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.start is None:
            return None
        hwm = _proc_status_kib("VmHWM")
        return None if hwm is None else hwm * 1024

    def peak_delta(self) -> int | None:
        """The peak above what was in use at :meth:`reset` (bytes)."""
        peak = self.peak()
        return None if peak is None or self.start is None else peak - self.start


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def format_stat(stat: dict[str, float], scale: float = 1e3, digits: int = 1) -> str:
    """``"median (min-max)"`` with values multiplied by ``scale`` (default s -> ms)."""
    f = f"{{:.{digits}f}}"
    med, lo, hi = (f.format(stat[k] * scale) for k in ("median", "min", "max"))
    return f"{med} ({lo}-{hi})"


def mib(nbytes: float | None, digits: int = 1) -> str:
    """Bytes as MiB, ``"n/a"`` for ``None``."""
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.{digits}f}"


# ------------------------------------------------------------------ reporting


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a fixed-width table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))


def describe(rt: Runtime, **extra: Any) -> dict[str, Any]:
    """How the benchmark was run: versions, device, world size, command line."""
    device_name = (
        torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else platform.processor()
    )
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "torch": torch.__version__,
        "fvstep": fs.__version__,
        "device": str(rt.device.type),
        "device_name": device_name or platform.machine(),
        "world_size": rt.world,
        "sharded": rt.sharded,
        "threads": torch.get_num_threads(),
        **extra,
    }


def header_line(info: dict[str, Any]) -> str:
    """One line naming what ran where."""
    keys = ("device_name", "world_size", "torch", "threads")
    return ", ".join(f"{k}={info[k]}" for k in keys if k in info)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON to ``path`` (nothing if ``None``)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
