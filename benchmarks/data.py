"""Loader benchmark: samples/s of :class:`fvstep.executor.latents.WorkerSource`, and the time a
step waits on its next batch.

It writes a synthetic dataset in fvstep's format (random latents and text embeddings of
the chosen shapes; default: Wan2.1 at 480x832x81, latents 16x21x60x104 and 512x4096
text embeddings, bfloat16, 8.4 MB a sample), then, for each number of workers:

- **throughput**: ``steps`` batches asked for back to back (no work between): samples/s
  of the loader alone, after the first batch (whose time, starting the workers, is
  reported apart as ``startup``);
- **data wait**: the same with a simulated step between batches (``time.sleep`` of
  ``--step-time`` seconds: the host is idle while a GPU step runs; with ``--device cuda``
  each batch is also copied to the GPU, from pinned memory). ``wait`` is the time spent
  inside ``data.batch(step)``; ``wait %`` its share of the whole step time (after the
  first step). The issue's target: <= 1 % at the real shape.

Files are read through the page cache after the first pass (the dataset is small); a
cold read is the disk's speed, not the loader's. Only performance is measured here.

Examples:
    $ python -m benchmarks.data --workers 0 1 2 --step-time 0.5
    $ python -m benchmarks.data --shape 4 2 8 8 --text-shape 8 16 --samples 32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_parser", "main", "measure", "run_benchmark", "write_synthetic"]

WAN_480P = {"shape": (16, 21, 60, 104), "text_shape": (512, 4096)}


def write_synthetic(
    root: str | Path,
    *,
    num_samples: int,
    shape: Sequence[int],
    text_shape: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    shard_size: int = 8,
) -> Path:
    """Write a dataset of ``num_samples`` random samples in fvstep's format.

    Args:
        root: The dataset directory.
        num_samples: Samples, ``>= 1``.
        shape: The latent shape of each sample.
        text_shape: The text-embedding shape of each sample.
        dtype: The stored dtype.
        shard_size: Samples a shard.

    Returns:
        ``root``.

    Examples:
        >>> import tempfile
        >>> write_synthetic(tempfile.mkdtemp(), num_samples=2, shape=(1,), text_shape=(1,)).is_dir()
        True
    """
    from fvstep.executor.latents import shard_name, write_index, write_shard

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    infos = []
    for k, start in enumerate(range(0, num_samples, shard_size)):
        rows = [
            {
                "key": f"sample-{i}",
                "caption": f"synthetic sample {i}",
                "latents": torch.randn(tuple(shape), generator=g).to(dtype),
                "text": torch.randn(tuple(text_shape), generator=g).to(dtype),
                "text_length": int(text_shape[0]),
            }
            for i in range(start, min(start + shard_size, num_samples))
        ]
        infos.append(write_shard(root / shard_name(k), rows))
    write_index(root, infos)
    return root


def measure(
    root: str | Path,
    *,
    num_workers: int,
    batch_size: int = 1,
    steps: int = 20,
    step_time_s: float = 0.0,
    prefetch: int = 2,
    device: str = "cpu",
) -> dict[str, Any]:
    """Ask a :class:`~fvstep.executor.latents.WorkerSource` for ``steps`` batches in step order.

    Args:
        root: The dataset directory.
        num_workers: Worker processes.
        batch_size: Samples a batch.
        steps: Batches to ask for (the first is reported apart), ``>= 2``.
        step_time_s: Simulated step time between batches (``0``: back to back).
        prefetch: Batches each worker prepares ahead.
        device: ``"cuda"``: copy each batch to the GPU (non-blocking, then synchronise).

    Returns:
        A row: ``workers``, ``batch``, ``samples_per_s`` (of the loader when
        ``step_time_s`` is 0), ``startup_s``, ``step_s``, ``wait_mean_ms``,
        ``wait_max_ms``, ``wait_fraction``.

    Raises:
        ValueError: If ``steps < 2``.

    Examples:
        >>> import tempfile
        >>> root = write_synthetic(tempfile.mkdtemp(), num_samples=4, shape=(2,), text_shape=(2,))
        >>> measure(root, num_workers=0, steps=3)["workers"]
        0
    """
    from fvstep.core import random as fr
    from fvstep.executor.latents import latent_source

    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")
    waits, totals = [], []
    with latent_source(
        root, key=fr.key(0), batch_size=batch_size, num_workers=num_workers, prefetch=prefetch
    ) as data:
        for s in range(steps):
            t0 = time.perf_counter()
            batch = data.batch(s)
            if device != "cpu":
                moved = {
                    k: v.to(device, non_blocking=True)
                    for k, v in batch.items()
                    if isinstance(v, torch.Tensor)
                }
            t1 = time.perf_counter()
            if step_time_s > 0:
                time.sleep(step_time_s)
            if device != "cpu":
                torch.cuda.synchronize()
                del moved
            t2 = time.perf_counter()
            waits.append(t1 - t0)
            totals.append(t2 - t0)
    steady_wait, steady_total = waits[1:], totals[1:]
    return {
        "workers": num_workers,
        "batch": batch_size,
        "samples_per_s": batch_size * len(steady_total) / sum(steady_total),
        "startup_s": waits[0],
        "step_s": step_time_s,
        "wait_mean_ms": 1e3 * statistics.fmean(steady_wait),
        "wait_max_ms": 1e3 * max(steady_wait),
        "wait_fraction": sum(steady_wait) / sum(steady_total),
    }


def run_benchmark(
    *,
    workers: Sequence[int] = (0, 1, 2),
    shape: Sequence[int] = WAN_480P["shape"],
    text_shape: Sequence[int] = WAN_480P["text_shape"],
    dtype: torch.dtype = torch.bfloat16,
    num_samples: int = 16,
    batch_size: int = 1,
    steps: int = 20,
    step_time_s: float = 0.5,
    device: str = "cpu",
    root: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Write a synthetic dataset and :func:`measure` throughput and data wait per worker count.

    Args:
        workers: The worker counts to measure.
        shape: Latent shape of a sample.
        text_shape: Text-embedding shape of a sample.
        dtype: Stored dtype.
        num_samples: Samples in the dataset.
        batch_size: Samples a batch.
        steps: Batches a measurement.
        step_time_s: The simulated step time of the data-wait measurement.
        device: ``"cuda"`` to copy batches to the GPU.
        root: Where to write the dataset (default: a temporary directory, removed after).

    Returns:
        Two rows per worker count: ``mode`` ``"throughput"`` (no step time) and ``"wait"``.

    Examples:
        >>> rows = run_benchmark(workers=[0], shape=(2,), text_shape=(2,), num_samples=4,
        ...                      steps=3, step_time_s=0.01)
        >>> [r["mode"] for r in rows]
        ['throughput', 'wait']
    """
    with tempfile.TemporaryDirectory(prefix="fvstep-bench-data-") as tmp:
        where = Path(root) if root is not None else Path(tmp)
        write_synthetic(
            where, num_samples=num_samples, shape=shape, text_shape=text_shape, dtype=dtype
        )
        rows = []
        for n in workers:
            for mode, step_time in (("throughput", 0.0), ("wait", step_time_s)):
                row = measure(
                    where,
                    num_workers=n,
                    batch_size=batch_size,
                    steps=steps,
                    step_time_s=step_time,
                    device=device,
                )
                rows.append({"mode": mode, **row})
    return rows


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    headers = [
        "mode",
        "workers",
        "batch",
        "samples/s",
        "startup s",
        "step s",
        "wait ms (mean)",
        "wait ms (max)",
        "wait %",
    ]
    cells = [headers] + [
        [
            r["mode"],
            str(r["workers"]),
            str(r["batch"]),
            f"{r['samples_per_s']:.1f}",
            f"{r['startup_s']:.2f}",
            f"{r['step_s']:.2f}",
            f"{r['wait_mean_ms']:.2f}",
            f"{r['wait_max_ms']:.2f}",
            f"{100 * r['wait_fraction']:.2f}",
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options.

    Returns:
        The parser of ``python -m benchmarks.data``.

    Examples:
        >>> build_parser().parse_args(["--workers", "2"]).workers
        [2]
    """
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.data", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="worker counts (default 0 1 2)"
    )
    p.add_argument(
        "--shape",
        type=int,
        nargs="+",
        default=list(WAN_480P["shape"]),
        help="latent shape (default Wan 480x832x81)",
    )
    p.add_argument(
        "--text-shape",
        type=int,
        nargs="+",
        default=list(WAN_480P["text_shape"]),
        help="text shape (default 512 4096)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--samples", type=int, default=16, help="samples in the synthetic dataset (default 16)"
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="batches a measurement (default 20)")
    p.add_argument(
        "--step-time", type=float, default=0.5, help="simulated step seconds (default 0.5)"
    )
    p.add_argument("--device", default="cpu", help="cuda: copy batches to the GPU")
    p.add_argument("--dir", default=None, help="where to write the dataset (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the rows and the set-up here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (and write ``--json``).

    Args:
        argv: The options (default: the command line).

    Returns:
        The exit code: 0, or 2 for bad options.

    Examples:
        >>> main(["--workers", "0", "--shape", "2", "--text-shape", "2", "--samples", "2",
        ...       "--steps", "2", "--step-time", "0"])  # doctest: +ELLIPSIS
        # {...}
        ...
        0
    """
    args = build_parser().parse_args(argv)
    if min(args.workers) < 0 or args.samples < args.batch_size or args.steps < 2:
        print("need --workers >= 0, --samples >= --batch-size, --steps >= 2", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = run_benchmark(
        workers=args.workers,
        shape=args.shape,
        text_shape=args.text_shape,
        dtype=getattr(torch, args.dtype),
        num_samples=args.samples,
        batch_size=args.batch_size,
        steps=args.steps,
        step_time_s=args.step_time,
        device=args.device,
        root=args.dir,
    )
    nbytes = (torch.Size(args.shape).numel() + torch.Size(args.text_shape).numel()) * getattr(
        torch, args.dtype
    ).itemsize
    setup = {
        "command": " ".join(
            ["python -m benchmarks.data", *(argv if argv is not None else sys.argv[1:])]
        ),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpus": torch.multiprocessing.cpu_count(),
        "device": args.device,
        "shape": args.shape,
        "text_shape": args.text_shape,
        "dtype": args.dtype,
        "sample_mb": nbytes / 1e6,
    }
    print(f"# {json.dumps(setup)}")
    for line in _table(rows):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
