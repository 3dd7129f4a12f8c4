"""fvstep's compiled fine-tune step against a hand-written imperative (FSDP2) loop.

Both sides train their own copy of the same model (same seed, same sharding, same
precision policy) on the same batch with the same method — flow matching, K
micro-batches under one sync policy, ``clip_grad_norm_``, AdamW (``fvstep.core.optim.adamw``
against ``torch.optim.AdamW`` with the same ``--impl``: foreach/fused/single-tensor).
The hand-written side is :func:`benchmarks.reference.finetune_step`, the loop the
equality tests hold fvstep to bitwise: FSDP2 flags set by hand per micro-batch,
``backward``, ``clip_grad_norm_``, ``opt.step()``, ``zero_grad``. Both sides derive their
noise keys the same way, so they draw the same numbers and do the same arithmetic.

They run alternately in one process group, ``--rounds`` rounds of ``--steps`` steps a
side (the side that goes first alternates), so drift cancels. Reported:

- step time: the ratio of the medians (and the median, min, max of per-round ratios);
- peak memory: each side's own resident bytes (parameters and optimizer state, local
  shards) plus the most its steps allocated above what was allocated when they began
  (``max_memory_allocated`` on CUDA, RSS on CPU); the ratio of the two on CUDA (on CPU
  the RSS high-water mark cannot be attributed to one side);
- fvstep's own CPU time per step, measured two ways:
  1. *skeleton A/B*: the same A/B on a host-bound twin of the model (same blocks and
     parameter tensors, tiny dims; :meth:`benchmarks.presets.Preset.skeleton`), where
     a step's time is the Python and dispatch work; the difference of the medians is
     the host time fvstep adds, shown as a share of the real model's step time;
  2. *profile hook*: ``--profile-steps`` fvstep steps of the real model under
     :class:`benchmarks.profiling.BookkeepingClock`: the step's time minus the calls fvstep's frames make
     into the loss function (model forward), backward, the optimizer kernel and
     gradient clipping, i.e. fvstep's bookkeeping — an upper bound, loose where the
     bookkeeping makes many Python calls (DTensor dispatch), since the hook slows each;
- MFU of each side (analytic FLOPs, see :func:`benchmarks.analytic.train_flops_per_sample`).

Targets (reported, never asserted): step time <= 1.01x and peak memory <= 1.01x of the
hand-written loop on GPU; fvstep's CPU time <= 0.5% of the step time.

Usage:
    python -m benchmarks.overhead --preset tiny-wan --k 2 --steps 3 --rounds 3
    torchrun --standalone --nproc_per_node 8 -m benchmarks.overhead --preset wan-1.3b \\
        --device cuda --k 2 --policy every --json overhead.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any

import torch
from torch import nn

import fvstep as fs
from benchmarks import analytic, presets, reference
from benchmarks import common as c
from benchmarks.profiling import BookkeepingClock
from fvstep import parallel as fsp
from fvstep.methods.finetune import flow_matching_loss

__all__ = ["main"]


class _Side:
    """One side of the A/B: its step, its resident bytes and its measurements."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.times: list[float] = []
        self.round_medians: list[float] = []
        self.peak_deltas: list[float] = []

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def resident_bytes(self, device: torch.device) -> int:
        raise NotImplementedError


class _Fvstep(_Side):
    def __init__(self, module: nn.Module, args: Any, rt: c.Runtime, dtype: str) -> None:
        super().__init__("fvstep")
        foreach, fused = c.optimizer_options(args.impl)
        opt = fs.optim.adamw(lr=args.lr, foreach=foreach, fused=fused)
        self.state = fs.TrainState.create(
            {"student": fs.Role(module, optimizer=opt, allow_no_sync=True)},
            key=fs.random.key(args.seed),
        )
        sync, keep = args.policy.split("+")[0], args.policy.endswith("+keep")
        self.step_fn = fs.compile(
            fs.update("student", c.with_autocast(flow_matching_loss(), rt, dtype)),
            accumulation=fs.Accumulation(args.k, sync=sync, keep_params_gathered=keep),
            clip=fs.clip_grad_norm(args.clip) if args.clip > 0 else None,
        )

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        self.state, _ = self.step_fn(self.state, batch, parallelism=fsp.Layout())

    def resident_bytes(self, device: torch.device) -> int:
        return analytic.local_tensor_bytes(fs.tree.leaves(self.state), device)


class _HandWritten(_Side):
    def __init__(self, module: nn.Module, args: Any, rt: c.Runtime, dtype: str) -> None:
        super().__init__("hand-written")
        self.module = module
        foreach, fused = c.optimizer_options(args.impl)
        self.opt = torch.optim.AdamW(module.parameters(), lr=args.lr, foreach=foreach, fused=fused)
        self.args, self.rt, self.dtype = args, rt, dtype
        self.base_key = fs.random.key(args.seed)  # the fvstep side's state key
        self.count = 0  # the step counter, as the fvstep side's state holds it

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        reference.finetune_step(
            self.module,
            self.opt,
            batch,
            step=self.count,
            rank=self.rt.rank,
            base_key=self.base_key,
            num_microbatches=self.args.k,
            sync=self.args.policy.split("+")[0],
            keep_params_gathered=self.args.policy.endswith("+keep"),
            max_norm=self.args.clip if self.args.clip > 0 else None,
            autocast=c.autocast_context(self.rt, self.dtype),
        )
        self.count += 1

    def resident_bytes(self, device: torch.device) -> int:
        moments = [
            t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ]
        return analytic.local_tensor_bytes([*self.module.parameters(), *moments], device)


def _build_sides(
    preset: presets.Preset, args: Any, rt: c.Runtime, dtype: str, compile_blocks: bool
) -> tuple[_Fvstep, _HandWritten]:
    """Both sides, each with its own copy of the model (same seed, same preparation)."""

    def module() -> nn.Module:
        m = presets.build_model(preset, device=rt.device, seed=args.seed)
        return c.prepare_module(m, rt, dtype=dtype, compile_blocks=compile_blocks)

    return _Fvstep(module(), args, rt, dtype), _HandWritten(module(), args, rt, dtype)


def run_ab(
    a: _Side, b: _Side, batch: dict[str, torch.Tensor], args: Any, rt: c.Runtime
) -> dict[str, Any]:
    """Warm both sides up, then alternate rounds; returns both sides' statistics."""
    meter = c.MemoryMeter(rt.device)
    for side in (a, b):
        for _ in range(args.warmup):
            side.step(batch)
    for r in range(args.rounds):
        for side in (a, b) if r % 2 == 0 else (b, a):
            meter.reset()
            times = [c.time_call(lambda: side.step(batch), rt.device)[0] for _ in range(args.steps)]  # noqa: B023
            times = rt.max_over_ranks(times)
            side.times += times
            side.round_medians.append(statistics.median(times))
            delta = meter.peak_delta()
            side.peak_deltas.append(math.nan if delta is None else float(delta))
    out: dict[str, Any] = {}
    for side in (a, b):
        resident = rt.max_over_ranks([float(side.resident_bytes(rt.device))])[0]
        known = not any(math.isnan(d) for d in side.peak_deltas)
        worst = rt.max_over_ranks([max(side.peak_deltas) if known else math.nan])[0]
        out[side.name] = {
            "step_s": c.summarize(side.times),
            "resident_bytes": resident,
            "peak_delta_bytes": worst if known else None,
            "peak_bytes": resident + worst if known else None,
        }
    ratios = [x / y for x, y in zip(a.round_medians, b.round_medians)]
    out["time_ratio"] = out[a.name]["step_s"]["median"] / out[b.name]["step_s"]["median"]
    out["round_ratios"] = c.summarize(ratios)
    pa, pb = out[a.name]["peak_bytes"], out[b.name]["peak_bytes"]
    # On CPU the RSS high-water mark mixes both sides' allocator reuse: no ratio.
    comparable = rt.device.type == "cuda" and pa is not None and pb
    out["memory_ratio"] = pa / pb if comparable else None
    return out


def _profile(side: _Fvstep, batch: dict[str, torch.Tensor], steps: int, rt: c.Runtime) -> float:
    clock = BookkeepingClock()
    for _ in range(steps):
        c.synchronize(rt.device)
        clock.measure(lambda: side.step(batch))
    c.synchronize(rt.device)
    return rt.max_over_ranks([clock.bookkeeping / steps])[0]


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_runtime_args(parser)
    parser.add_argument("--k", type=int, default=2, help="micro-batches")
    parser.add_argument(
        "--policy",
        default="every",
        choices=("every", "no_sync", "deferred", "every+keep", "no_sync+keep", "deferred+keep"),
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--impl", choices=("default", "foreach", "fused", "single"), default="default"
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: off)")
    parser.add_argument(
        "--profile-steps", type=int, default=3, help="steps under the profile hook (0: skip)"
    )
    parser.add_argument("--no-skeleton", action="store_true", help="skip the skeleton A/B")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.k < 1 or args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        print("--k, --steps and --rounds must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    c.apply_threads(args)
    rt = c.setup_runtime(args.device)
    try:
        result = run(args, rt)
        if rt.is_main:
            report(result)
            c.write_json(args.json, result)
    finally:
        c.teardown_runtime(rt)
    return 0


def run(args: Any, rt: c.Runtime) -> dict[str, Any]:
    """The real-model A/B, the skeleton A/B and the profile; the JSON-able result."""
    preset = presets.PRESETS[args.preset]
    dtype = c.resolve_dtype(args, rt)
    fv, hand = _build_sides(preset, args, rt, dtype, args.compile)
    samples = args.k * args.batch_per_microbatch
    batch = presets.make_batch(preset, samples, device=rt.device, seed=args.seed + rt.rank)
    real = run_ab(fv, hand, batch, args, rt)
    flops = analytic.train_flops_per_sample(fv.state.module("student"), preset) * samples
    peak = c.peak_flops(args, rt)
    for name in ("fvstep", "hand-written"):
        real[name]["mfu"] = analytic.mfu(flops, real[name]["step_s"]["median"], peak)
    fv_median = real["fvstep"]["step_s"]["median"]
    result: dict[str, Any] = {"benchmark": "overhead", "real": real}
    if args.profile_steps > 0:
        seconds = _profile(fv, batch, args.profile_steps, rt)
        result["profile"] = {"bookkeeping_s": seconds, "share": seconds / fv_median}
    del fv, hand
    if not args.no_skeleton:
        skeleton = preset.skeleton()
        sk_fv, sk_hand = _build_sides(skeleton, args, rt, dtype, False)
        sk_batch = presets.make_batch(skeleton, samples, device=rt.device, seed=args.seed + rt.rank)
        sk = run_ab(sk_fv, sk_hand, sk_batch, args, rt)
        extra = sk["fvstep"]["step_s"]["median"] - sk["hand-written"]["step_s"]["median"]
        result["skeleton"] = {**sk, "extra_s": extra, "share": extra / fv_median}
    result["info"] = c.describe(
        rt,
        preset=preset.name,
        dtype=dtype,
        compile=args.compile,
        k=args.k,
        policy=args.policy,
        impl=args.impl,
        clip=args.clip,
        steps=args.steps,
        rounds=args.rounds,
        train_tflops_per_step=flops / 1e12,
    )
    return result


def report(result: dict[str, Any]) -> None:
    """Print the A/B tables and the overhead lines."""
    info, real = result["info"], result["real"]
    cuda = info["device"] == "cuda"
    print(
        f"overhead: {info['preset']}, K={info['k']}, policy={info['policy']}, {info['dtype']}, "
        f"AdamW impl={info['impl']}, clip={info['clip']}, compile={info['compile']}, "
        f"{info['rounds']} rounds x {info['steps']} steps a side (alternating)"
    )
    print(c.header_line(info))
    sections = [("real", real)] + (
        [("skeleton", result["skeleton"])] if "skeleton" in result else []
    )
    headers = [
        "model",
        "side",
        "step ms med (min-max)",
        "MFU",
        "resident MiB",
        "+peak MiB",
        "peak MiB",
    ]
    rows = []
    for label, sec in sections:
        for name in ("fvstep", "hand-written"):
            s = sec[name]
            mfu = s.get("mfu")
            rows.append(
                [
                    label,
                    name,
                    c.format_stat(s["step_s"], digits=2),
                    "n/a" if mfu is None else f"{mfu:.1%}",
                    c.mib(s["resident_bytes"]),
                    c.mib(s["peak_delta_bytes"]),
                    c.mib(s["peak_bytes"]),
                ]
            )
    c.print_table(headers, rows)
    rr = real["round_ratios"]
    mem = "n/a" if real["memory_ratio"] is None else f"{real['memory_ratio']:.4f}x"
    mem_kind = "allocated" if cuda else "CPU RSS is not attributable to one side"
    print(
        f"step time fvstep/hand = {real['time_ratio']:.4f}x "
        f"(per round {rr['median']:.4f}, {rr['min']:.4f}-{rr['max']:.4f}; target <= 1.01x)"
    )
    print(f"peak memory fvstep/hand = {mem} ({mem_kind}; target <= 1.01x on GPU)")
    if "skeleton" in result:
        sk = result["skeleton"]
        print(
            f"fvstep host time (skeleton A/B): {sk['extra_s'] * 1e3:+.3f} ms/step = "
            f"{sk['share']:+.3%} of the real step (target <= 0.5%)"
        )
    if "profile" in result:
        p = result["profile"]
        print(
            f"fvstep bookkeeping (profile hook, upper bound): {p['bookkeeping_s'] * 1e3:.3f} "
            f"ms/step = {p['share']:.3%} of the real step (the hook's cost per Python call "
            "inflates call-heavy code such as DTensor dispatch; the skeleton A/B is the number)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
