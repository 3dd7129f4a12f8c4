"""What the save's finiteness check costs: folded into the checksum pass, or a pass of its own.

    python -m benchmarks.checksum_finite --mib 256 --rounds 7 [--device cuda]

A save checksums every leaf; ``checkpoint.save`` also refuses non-finite leaves, and
takes the finiteness of each chunk while the checksum reads it
(``fvstep.checkpoint.saving.local_checks``). Printed: the median time of the
checksum alone, of the checksum with the folded check, and of the checksum followed by
a separate ``torch.isfinite(x).all()`` pass, for fp32 and bf16 leaves (every variant
timed side by side in each round).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from fvstep.checkpoint.saving import local_checks, local_sums


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _checksum_then_isfinite(leaves: list[torch.Tensor]) -> None:
    local_sums(leaves)
    [bool(torch.isfinite(x).all()) for x in leaves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the leaves, in MiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"{'dtype':<9}{'checksum':>12}{'+ folded':>12}{'+ separate':>12}  (median of {args.rounds})"
    )
    for dtype in (torch.float32, torch.bfloat16):
        numel = args.mib * 2**20 // torch.finfo(dtype).bits * 8
        leaves = [t.to(dtype) for t in torch.randn(numel, device=device).chunk(16)]
        variants = {
            "checksum": functools.partial(local_sums, leaves),
            "folded": functools.partial(local_checks, leaves),
            "separate": functools.partial(_checksum_then_isfinite, leaves),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(_timed(fn, device))
        base = statistics.median(times["checksum"])
        folded = statistics.median(times["folded"]) / base - 1
        separate = statistics.median(times["separate"]) / base - 1
        name = str(dtype).removeprefix("torch.")
        print(f"{name:<9}{base * 1e3:>10.1f}ms{folded:>+11.1%}{separate:>+12.1%}")


if __name__ == "__main__":
    main()
