"""Accumulation policies against K: step time, MFU, peak memory and collective bytes.

For each K (``--k``) and policy (``--policies``; ``every``, ``no_sync``, ``deferred``,
each optionally ``+keep`` for ``keep_params_gathered=True``) one fine-tune step
(flow matching, AdamW, clip 1.0) runs ``--warmup`` times, then ``--steps`` timed times
(device synchronised around each; median, min and max; under torchrun the slowest
rank's time per step), then ONE extra step with ``Layout(count_collectives=True)`` — apart from
the timed ones, since the counter slows every op. Reported beside the analytic
expectation (:func:`benchmarks.analytic.expected_collectives`):

- all-gathers: ``2K`` per FSDP group and step (``K + 1`` with ``+keep``), bytes of the
  gathered parameters in the param dtype (bf16 with ``--dtype bf16``);
- reduce-scatters: ``K`` per group (``every``/``deferred``), ``1`` (``no_sync``), bytes
  of the fp32 output shard (the counter's convention; the data reduced is
  ``world`` times that);
- memory: ``no_sync`` holds the role's unsharded fp32 gradient between micro-batches,
  ``numel * 4 * (1 - 1/world)`` bytes above ``every`` (which holds the shards);
- MFU: analytic model FLOPs (:func:`benchmarks.analytic.train_flops_per_sample`) per
  step and device over the median step time and ``--peak-tflops``.

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and the RSS high-water mark
above its start on CPU (``ΔRSS``; the allocator's reuse makes it coarse).

Usage:
    python -m benchmarks.accumulation --preset tiny-wan --k 1 2 --steps 3 --warmup 1
    torchrun --standalone --nproc_per_node 8 -m benchmarks.accumulation \\
        --preset wan-1.3b --device cuda --k 1 2 4 --json acc.json --plot acc.png
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import fvstep as fs
from benchmarks import analytic, presets
from benchmarks import common as c
from fvstep import parallel as fsp
from fvstep.methods.finetune import flow_matching_loss

__all__ = ["main", "parse_policy"]

POLICIES = ("every", "no_sync", "deferred")


def parse_policy(token: str) -> tuple[str, bool]:
    """``"no_sync+keep"`` -> ``("no_sync", True)``.

    Raises:
        ValueError: For an unknown policy or suffix.
    """
    sync, _, suffix = token.partition("+")
    if sync not in POLICIES or suffix not in ("", "keep"):
        raise ValueError(f"unknown policy {token!r}; use one of {POLICIES}, optionally +keep")
    return sync, suffix == "keep"


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accumulation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_runtime_args(parser)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4], help="micro-batches")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--impl", choices=("default", "foreach", "fused", "single"), default="default"
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: off)")
    parser.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        policies = [parse_policy(t) for t in args.policies]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if min(args.k) < 1 or args.steps < 1 or args.warmup < 0:
        print("--k must be >= 1, --steps >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    c.apply_threads(args)
    rt = c.setup_runtime(args.device)
    try:
        result = run(args, rt, policies)
        if rt.is_main:
            report(result)
            c.write_json(args.json, result)
            if args.plot:
                plot(result, args.plot)
    finally:
        c.teardown_runtime(rt)
    return 0


def run(args: Any, rt: c.Runtime, policies: list[tuple[str, bool]]) -> dict[str, Any]:
    """Measure every (K, policy); returns the JSON-able result (on every rank)."""
    preset = presets.PRESETS[args.preset]
    dtype = c.resolve_dtype(args, rt)
    module = presets.build_model(preset, device=rt.device, seed=args.seed)
    flops_per_sample = analytic.train_flops_per_sample(module, preset)
    numel = analytic.trainable_numel(module)
    c.prepare_module(module, rt, dtype=dtype, compile_blocks=args.compile)
    foreach, fused = c.optimizer_options(args.impl)
    optimizer = fs.optim.adamw(lr=args.lr, foreach=foreach, fused=fused)
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=optimizer, allow_no_sync=True)},
        key=fs.random.key(args.seed),
    )
    method = fs.update("student", c.with_autocast(flow_matching_loss(), rt, dtype), name="finetune")
    clip = fs.clip_grad_norm(args.clip) if args.clip > 0 else None
    param_bytes = 2 if dtype == "bf16" and rt.sharded else 4
    peak = c.peak_flops(args, rt)
    meter = c.MemoryMeter(rt.device)
    rows = []
    for k in args.k:
        samples = k * args.batch_per_microbatch
        batch = presets.make_batch(preset, samples, device=rt.device, seed=args.seed + rt.rank)
        for sync, keep in policies:
            acc = fs.Accumulation(microbatches=k, sync=sync, keep_params_gathered=keep)  # type: ignore[arg-type]
            step = fs.compile(method, accumulation=acc, clip=clip)
            for _ in range(args.warmup):
                state, _ = step(state, batch, parallelism=fsp.Layout())
            meter.reset()
            times = []
            for _ in range(args.steps):
                seconds, (state, _) = c.time_call(
                    lambda: step(state, batch, parallelism=fsp.Layout()),  # noqa: B023
                    rt.device,
                )
                times.append(seconds)
            peak_bytes, delta_bytes = meter.peak(), meter.peak_delta()
            state, metrics = step(state, batch, parallelism=fsp.Layout(count_collectives=True))
            times = rt.max_over_ranks(times)
            mem = rt.max_over_ranks([float(x) for x in (peak_bytes, delta_bytes) if x is not None])
            stat = c.summarize(times)
            flops = flops_per_sample * samples
            rows.append(
                {
                    "k": k,
                    "policy": sync + ("+keep" if keep else ""),
                    "step_s": stat,
                    "tflops_per_step": flops / 1e12,
                    "mfu": analytic.mfu(flops, stat["median"], peak),
                    "peak_bytes": mem[0] if len(mem) == 2 else None,
                    "peak_delta_bytes": mem[1] if len(mem) == 2 else None,
                    "collectives": {
                        key.removeprefix("collectives/"): v
                        for key, v in metrics.items()
                        if key.startswith("collectives/")
                    },
                    "expected": analytic.expected_collectives(
                        module,
                        world=rt.world,
                        microbatches=k,
                        sync=sync,
                        keep_params_gathered=keep,
                        param_bytes=param_bytes,
                        reduce_bytes=4,
                        clip=clip is not None,
                    ),
                    "expected_extra_bytes": (
                        numel * 4 * (1 - 1 / rt.world) if sync == "no_sync" and k > 1 else 0.0
                    ),
                }
            )
    _add_memory_deltas(rows, rt)
    info = c.describe(
        rt,
        preset=preset.name,
        dtype=dtype,
        compile=args.compile,
        params=numel,
        tokens_per_sample=preset.num_tokens,
        text_tokens=preset.text_len,
        batch_per_microbatch=args.batch_per_microbatch,
        train_tflops_per_sample=flops_per_sample / 1e12,
        peak_tflops=None if peak is None else peak / 1e12,
        steps=args.steps,
        warmup=args.warmup,
        fsdp_groups=len(analytic.fsdp_groups(module)),
    )
    return {"benchmark": "accumulation", "info": info, "rows": rows}


def _add_memory_deltas(rows: list[dict[str, Any]], rt: c.Runtime) -> None:
    """Each row's peak minus the peak of ``every`` at the same K (CUDA: absolute peaks)."""
    key = "peak_bytes" if rt.device.type == "cuda" else "peak_delta_bytes"
    base = {r["k"]: r[key] for r in rows if r["policy"] == "every"}
    for r in rows:
        ref = base.get(r["k"])
        r["extra_vs_every_bytes"] = None if ref is None or r[key] is None else r[key] - ref


def _pair(measured: Any, expected: Any, scale: float = 1.0) -> str:
    if measured is None:
        return f"-/{expected * scale:.3g}"
    return f"{measured * scale:.3g}/{expected * scale:.3g}"


def report(result: dict[str, Any]) -> None:
    """Print the table and the notes."""
    info, rows = result["info"], result["rows"]
    cuda = info["device"] == "cuda"
    print(
        f"accumulation: {info['preset']} ({info['params']:,} params, "
        f"{info['tokens_per_sample']} tokens + {info['text_tokens']} text tokens a sample, "
        f"{info['batch_per_microbatch']} a micro-batch), {info['dtype']}, "
        f"compile={info['compile']}, {info['fsdp_groups']} FSDP groups"
    )
    print(c.header_line(info))
    mem = "peak MiB" if cuda else "ΔRSS MiB"
    headers = [
        "K", "policy", "step ms med (min-max)", "MFU", mem, "+vs every", "exp +",
        "AG n m/e", "AG MiB m/e", "RS n m/e", "RS MiB m/e", "AR n m/e",
    ]  # fmt: skip
    table = []
    for r in rows:
        got, exp = r["collectives"], r["expected"]
        table.append(
            [
                r["k"],
                r["policy"],
                c.format_stat(r["step_s"]),
                "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}",
                c.mib(r["peak_bytes"] if cuda else r["peak_delta_bytes"]),
                c.mib(r["extra_vs_every_bytes"]),
                c.mib(r["expected_extra_bytes"]),
                _pair(got.get("all_gather", 0), exp["all_gather"]),
                _pair(got.get("all_gather_bytes", 0), exp["all_gather_bytes"], 2**-20),
                _pair(got.get("reduce_scatter", 0), exp["reduce_scatter"]),
                _pair(got.get("reduce_scatter_bytes", 0), exp["reduce_scatter_bytes"], 2**-20),
                _pair(got.get("all_reduce", 0), exp["all_reduce"]),
            ]
        )
    c.print_table(headers, table)
    print(
        "m/e = measured (one extra step, CollectiveCounter) / analytic expectation per step "
        "and rank; AG = all-gather (gathered bytes, param dtype), RS = reduce-scatter "
        "(output-shard bytes, fp32), AR = all-reduce (the clip norm's, issued inside DTensor "
        "ops; the GPU runs of 2026-11-29 predate the counter seeing them and show 0); "
        "'+vs every' = peak minus the peak of "
        "'every' at the same K, 'exp +' = no_sync's unsharded fp32 gradient minus its shard."
    )


def plot(result: dict[str, Any], path: str) -> None:
    """Step time, peak memory and reduce-scatter bytes against K, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    cuda = result["info"]["device"] == "cuda"
    panels = [
        ("step time (ms)", lambda r: r["step_s"]["median"] * 1e3),
        (
            "peak memory (MiB)" if cuda else "ΔRSS (MiB)",
            lambda r: (r["peak_bytes"] if cuda else r["peak_delta_bytes"] or 0) / 2**20,
        ),
        (
            "reduce-scatter MiB / step",
            lambda r: r["collectives"].get("reduce_scatter_bytes", 0) / 2**20,
        ),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (label, value) in zip(axes, panels):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            ax.plot([r["k"] for r in mine], [value(r) for r in mine], marker="o", label=policy)
        ax.set_xticks(sorted({r["k"] for r in rows}))
        ax.set_xlabel("micro-batches K")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    info = result["info"]
    fig.suptitle(
        f"{info['preset']}, {info['dtype']}, world {info['world_size']}, {info['device_name']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
