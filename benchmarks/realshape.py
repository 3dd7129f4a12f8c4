"""The real workload: fine-tune, DMD2, self-forcing or DiffusionNFT at 480x832x81, prepared vs by hand.

Each *side* builds its roles, runs ``--warmup`` steps (compiles, allocator warm-up), then
``--steps`` timed steps, and frees everything before the next side, in one process group:

- ``prepared``: every role through :func:`fvstep.parallel.prepare` (``--checkpointing``,
  ``--compile``, FSDP2 per block and at the root with bf16 compute and fp32 reduce when
  sharded, the frozen teacher stored in bf16);
- ``by-hand``: what users wrote before ``prepare`` existed: ``checkpoint_wrapper`` on each
  block (full AC), ``block.compile()``, ``fully_shard``; the teacher kept in fp32.
- ``lora`` (DMD2 only; ask for it with ``--sides``): one frozen base, prepared as the
  teacher (bf16, ``--checkpointing``, ``--compile``), and a LoRA student and a LoRA critic
  over it (:mod:`fvstep.methods.lora`: peft adapters of rank ``--lora-rank`` on
  ``--lora-targets``, fp32), against the full-weight ``prepared`` side: one transformer
  in memory, not three, and optimizer state for the adapters only.

DMD2 runs with ``generator_update_interval=2``, so steps alternate between
student+critic and critic-only, which are reported apart. DiffusionNFT
(``--method diffusion-nft``) runs a policy and its old copy (frozen, bf16 on the prepared
side), one prompt a step rolled out ``--group-size`` times by ``--rollout-steps`` Euler
steps of the old policy, scored by the stated latent reward
(:func:`fvstep.methods.rewards.latent_mse_reward`), one optimizer step over ``--group-size``
micro-batches of one sample, then the soft update; its rollout forwards count as
no-grad forwards. Self-forcing (``--method self-forcing``) makes the student causal
(:func:`fvstep.methods.make_causal`, chunks of 3 latent frames, or 1 when the frames do
not divide by 3) and runs DMD2's schedule (interval 2) on its chunk-by-chunk rollouts; a
call on ``f`` of the ``F`` frames counts as ``f / F`` of a forward (its attention to the
KV cache is not counted). Both sides run fvstep's
compiled step; the difference is only the role preparation.

**MFU** counts model FLOPs only: forward hooks count each role's calls per step, a call
under grad mode with trainable parameters costs 3 forwards (forward + backward for
inputs and weights), one under grad mode whose parameters are frozen for the unit costs
2 (the gradient flows to its input only), one without grad costs 1 (a LoRA role's call
under grad mode costs 2: its base's weights get no gradient; the adapters' own FLOPs are
not counted); a forward is
:func:`benchmarks.analytic.train_flops_per_sample` / 3 (linear layers at 2 FLOPs a
multiply-add, plus self- and cross-attention ``QK^T`` and ``AV`` at ``4 T^2 d`` and
``4 T L d`` per layer). Recomputation by activation checkpointing is not counted, nor
are norms and element-wise ops.

Examples:
    $ python -m benchmarks.realshape --preset tiny-wan --device cpu --steps 2 --warmup 1
    $ torchrun --standalone --nproc_per_node 2 -m benchmarks.realshape \\
        --preset wan-1.3b-480p --method dmd2 --checkpointing full --compile --json dmd2.json
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gc
import json
import sys
from typing import Any

import attrs
import torch

import fvstep as fs
from benchmarks import common as c
from benchmarks.analytic import mfu, train_flops_per_sample
from benchmarks.floor import CallCounter, Calls, KernelTimes, floor_seconds, measure_kernels
from benchmarks.kernel_profile import profile_call
from benchmarks.presets import PRESETS, Preset, build_model, make_batch
from benchmarks.roles import by_hand, lora_roles, prepared
from fvstep import parallel as fsp
from fvstep.methods import SoftUpdate, diffusion_nft, dmd2, finetune, make_causal, self_forcing
from fvstep.methods.diffusion_nft import euler_rollout
from fvstep.methods.rewards import latent_mse_reward
from fvstep.methods.streaming import init_stream, streaming

__all__ = ["build_parser", "main", "run_side"]


ROLES = {
    "finetune": ["student"],
    "dmd2": ["student", "teacher", "critic"],
    "diffusion-nft": ["policy", "old"],
    "self-forcing": ["student", "teacher", "critic"],
    "streaming": ["student", "teacher", "critic"],
}
"""The roles each ``--method`` trains or reads."""
FROZEN = ("teacher", "old")
"""Roles without an optimizer (prepared as frozen: stored in bf16 on the prepared side)."""


def _method(args: Any) -> fs.Step:
    if args.method == "dmd2":
        return dmd2(generator_update_interval=2)
    if args.method == "self-forcing":
        return self_forcing(generator_update_interval=2)
    if args.method == "streaming":  # one stream for the whole run: the cache rolls
        return streaming(
            steps_per_stream=1_000_000,
            window_frames=args.window_frames,
            sink_frames=args.sink_frames,
            generator_update_interval=2,
        )
    if args.method == "diffusion-nft":
        # The stated latent reward (no reward model at this shape); one sample per
        # micro-batch, so a step holds a group of --group-size rollouts of one prompt.
        return diffusion_nft(
            reward_fn=latent_mse_reward,
            group_size=args.group_size,
            rollout=euler_rollout(args.rollout_steps),
            soft_update=SoftUpdate(),
            accumulation=fs.Accumulation(args.group_size),
        )
    return finetune()


def _roles(side: str, preset: Preset, rt: c.Runtime, args: Any) -> dict[str, Any]:
    if side == "lora":
        return lora_roles(preset, rt, args)
    names = ROLES[args.method]
    modules = {}
    for i, name in enumerate(names):
        # DiffusionNFT's old policy starts as a copy of the policy (the same seed)
        seed = args.seed + (0 if name == "old" else i)
        module = build_model(preset, device=rt.device, seed=seed)
        if (
            args.method in ("self-forcing", "streaming") and name == "student"
        ):  # 3-frame chunks, or 1
            module = make_causal(module, chunk_frames=3 if preset.latent_shape[1] % 3 == 0 else 1)
        trainable = name not in FROZEN
        if side == "prepared":
            modules[name] = prepared(module, rt, args, trainable=trainable)
        else:
            modules[name] = by_hand(module, rt, compile_blocks=args.compile, trainable=trainable)
    return modules


def run_side(
    side: str, preset: Preset, rt: c.Runtime, args: Any, kernels: KernelTimes | None = None
) -> dict[str, Any]:
    """Build one side's roles and state, warm up, time ``--steps`` steps; free it all.

    With ``kernels`` (:func:`benchmarks.floor.measure_kernels`), each kind of step also
    reports its floor and the fraction of it that the step reaches.
    """
    modules = _roles(side, preset, rt, args)
    impl = _adamw_impl(args, rt)
    adamw = fs.optim.adamw(
        lr=1e-5,
        foreach=True if impl == "foreach" else None,
        fused=True if impl == "fused" else None,
    )
    roles = {
        name: fs.Role(m, optimizer=None if name in FROZEN else adamw) for name, m in modules.items()
    }
    batch = make_batch(preset, 1, device=rt.device, seed=args.seed + rt.rank)
    extra = {}
    if args.method == "streaming":
        extra["stream"] = init_stream(
            modules["student"],
            batch,
            window_frames=args.window_frames,
            sink_frames=args.sink_frames,
            cache_dtype=torch.bfloat16 if c.resolve_dtype(args, rt) == "bf16" else None,
        )
    state = fs.TrainState.create(roles, key=fs.random.key(args.seed), extra=extra)
    compiled = fs.compile(_method(args), clip=fs.clip_grad_norm(1.0))
    step = c.with_autocast(compiled, rt, c.resolve_dtype(args, rt))
    counter = CallCounter(modules, frames=preset.latent_shape[1])
    meter = c.MemoryMeter(rt.device)
    compiled_before = fsp.compile_counts()["graphs"]
    times: dict[str, list[float]] = {}
    forwards: dict[str, Calls] = {}
    profiles: dict[str, dict[str, Any]] = {}
    meter.reset()
    try:
        for i in range(args.warmup + args.steps + args.profile_steps):
            if args.method == "streaming":  # one managed step; the student every 2nd
                kind = "critic+student" if int(state.step) % 2 == 0 else "critic"
            else:
                kind = "+".join(
                    sorted({r for e in fs.plan(compiled, int(state.step)) for r in e.roles})
                )
            call = functools.partial(step, state, batch, parallelism=fsp.Layout())
            if i >= args.warmup + args.steps:  # profiled after the timed steps
                profile = profile_call(call, rt.device)
                state, _ = profile.pop("result")
                profiles.setdefault(kind, profile)
                counter.take()
                continue
            seconds, (state, _) = c.time_call(call, rt.device)
            fwd = counter.take()
            if i >= args.warmup:
                times.setdefault(kind, []).append(seconds)
                forwards[kind] = fwd
    finally:
        counter.close()
    peak = meter.peak()
    graphs = fsp.compile_counts()["graphs"] - compiled_before
    trained = sum(
        p.numel()
        for r in state.roles.values()
        for p in r.params.values()
        if r.opt_state is not None
    )
    shown = "teacher" if side == "lora" else ROLES[args.method][0]
    description = fsp.preparation(modules[shown])
    del state, modules, roles, step, compiled
    gc.collect()
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    per_forward = train_flops_per_sample(build_model(preset, device=torch.device("meta")), preset)
    per_forward /= 3.0
    rows = {}
    for kind, values in times.items():
        slowest = rt.max_over_ranks(values)
        stat = c.summarize(slowest)
        calls = forwards[kind]
        rows[kind] = row = {
            "seconds": stat,
            "model_forwards": calls.forwards,
            "calls": attrs.asdict(calls),
            "mfu": mfu(calls.forwards * per_forward, stat["median"], c.peak_flops(args, rt)),
        }
        if kernels is not None:
            floor = floor_seconds(calls, kernels)
            row.update(floor_s=floor, of_floor=floor / stat["median"])
        if kind in profiles:
            row["profile"] = profiles[kind]
    return {
        "side": side,
        "steps": rows,
        "peak_bytes": max(rt.max_over_ranks([float(peak or 0)])),
        "graphs_compiled": graphs,
        "trained_params": trained,
        "preparation": description.describe() if description else "by hand",
    }


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realshape",
        description="Fine-tune, DMD2 or DiffusionNFT at the real shape: prepare vs by hand.",
    )
    c.add_runtime_args(parser)
    parser.set_defaults(preset="wan-1.3b-480p")
    parser.add_argument("--method", choices=tuple(ROLES), default="dmd2")
    parser.add_argument(
        "--group-size",
        type=int,
        default=2,
        help="diffusion-nft: rollouts per prompt (one micro-batch each; default 2)",
    )
    parser.add_argument(
        "--rollout-steps",
        type=int,
        default=10,
        help="diffusion-nft: Euler steps of the old policy's rollout (default 10)",
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=("prepared", "by-hand", "lora"),
        default=["prepared", "by-hand"],
        help="what to compare, in this order (default prepared and by-hand; lora: DMD2 "
        "with LoRA student and critic over one base)",
    )
    parser.add_argument("--lora-rank", type=int, default=64, help="LoRA rank (= alpha)")
    parser.add_argument(
        "--lora-targets",
        nargs="+",
        default=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
        help="module names the adapters target (peft's target_modules)",
    )
    parser.add_argument(
        "--checkpointing",
        choices=("none", "full", "selective", "attention", "narrow"),
        default="full",
        help="activation checkpointing of the prepared side (default full; attention: "
        "selective, keeping the attention kernels' outputs only)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="checkpoint every n-th block only (default 1: all of them)",
    )
    parser.add_argument(
        "--offload-every",
        type=int,
        default=None,
        help="trained roles keep the saved activations of every n-th block in pinned host "
        "memory (prepare's offload_activations; default: none)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="diffusers attention backend of the prepared side, e.g. _native_cudnn",
    )
    parser.add_argument(
        "--flash-attention-4",
        action="store_true",
        help="the prepared side's attention on FlashAttention-4 (fvstep.parallel."
        "enable_flash_attention_4, attention backend _native_flash); the floor stays "
        "PyTorch's own kernels, FA4's are measured beside it (info.kernels_fa4)",
    )
    parser.add_argument(
        "--window-frames",
        type=int,
        default=None,
        help="streaming: latent frames the stream's cache keeps (default: a step's frames)",
    )
    parser.add_argument(
        "--sink-frames", type=int, default=3, help="streaming: attention-sink frames (default 3)"
    )
    parser.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="torch._functorch.config.activation_memory_budget for compiled graphs "
        "(PyTorch's own budget-driven recomputation; use with --checkpointing none --compile)",
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument(
        "--adamw-impl",
        choices=("torch", "foreach", "fused"),
        default=None,
        help="AdamW's implementation: torch's default for the device (foreach on CUDA), "
        "foreach, or the fused kernel (the default on CUDA; torch's elsewhere)",
    )
    parser.add_argument(
        "--inductor-option",
        type=_inductor_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an Inductor option for the prepared side's compile (repeatable), e.g. "
        "coordinate_descent_tuning=True",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="steps profiled after the timed ones (benchmarks.kernel_profile): each kind "
        "of step's first gets its kernels grouped by category in the JSON",
    )
    return parser


def _adamw_impl(args: Any, rt: c.Runtime) -> str:
    if args.adamw_impl is not None:
        return str(args.adamw_impl)
    return "fused" if rt.device.type == "cuda" else "torch"


def _inductor_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _memory_budget(budget: float | None) -> Any:
    if budget is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def main(argv: list[str] | None = None) -> int:
    """Run the sides and print a table (rank 0); ``--json`` writes the results."""
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.profile_steps < 0:
        print("--steps must be >= 1, --warmup and --profile-steps >= 0", file=sys.stderr)
        return 2
    if args.checkpoint_every < 1 or (args.offload_every is not None and args.offload_every < 1):
        print("--checkpoint-every and --offload-every must be >= 1", file=sys.stderr)
        return 2
    if args.method == "diffusion-nft" and (args.group_size < 2 or args.rollout_steps < 1):
        print("--group-size must be >= 2 and --rollout-steps >= 1", file=sys.stderr)
        return 2
    if "lora" in args.sides and args.method != "dmd2":
        print("--sides lora is DMD2 with LoRA roles: use --method dmd2", file=sys.stderr)
        return 2
    if args.memory_budget is not None and not 0.0 <= args.memory_budget <= 1.0:
        print("--memory-budget must be in [0, 1]", file=sys.stderr)
        return 2
    if args.flash_attention_4:
        if args.attention_backend not in (None, "_native_flash"):
            print("--flash-attention-4 runs the _native_flash backend", file=sys.stderr)
            return 2
        args.attention_backend = "_native_flash"
    if args.window_frames is None:
        args.window_frames = PRESETS[args.preset].latent_shape[1]
    c.apply_threads(args)
    rt = c.setup_runtime(args.device)
    try:
        preset = PRESETS[args.preset]
        info = c.describe(
            rt,
            preset=preset.name,
            tokens=preset.num_tokens,
            method=args.method,
            compile=args.compile,
            checkpointing=args.checkpointing,
            checkpoint_every=args.checkpoint_every,
            attention_backend=args.attention_backend or "default",
            flash_attention_4=args.flash_attention_4,
            memory_budget=args.memory_budget,
            adamw_impl=_adamw_impl(args, rt),
            inductor_options=dict(args.inductor_option),
        )
        kernels = measure_kernels(preset, rt.device)
        info["kernels"] = attrs.asdict(kernels)
        rt.print(f"# floor kernels: {kernels}")
        if args.flash_attention_4:
            from fvstep.parallel import enable_flash_attention_4

            enable_flash_attention_4(rt.device)
            fa4_kernels = measure_kernels(preset, rt.device)
            info["kernels_fa4"] = attrs.asdict(fa4_kernels)
            rt.print(f"# FA4 kernels (not the floor's): {fa4_kernels}")
        rt.print(f"# {c.header_line(info)}, {preset.name} ({preset.num_tokens} tokens)")
        results = []
        for side in args.sides:
            try:
                with _memory_budget(args.memory_budget):
                    results.append(run_side(side, preset, rt, args, kernels))
            except Exception as error:  # a side that fails (a NaN, OOM) is a result too
                results.append({"side": side, "error": f"{type(error).__name__}: {error}"})
                if rt.device.type == "cuda":
                    torch.cuda.empty_cache()
            rt.print(json.dumps(results[-1], default=str))
        if rt.is_main:
            report(results)
        c.write_json(args.json if rt.is_main else None, {"info": info, "results": results})
    finally:
        c.teardown_runtime(rt)
    return 0


def report(results: list[dict[str, Any]]) -> None:
    """One row per side and kind of step."""
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["side"], r["error"][:60], "", "", "", "", "", "", ""])
            continue
        for kind, row in r["steps"].items():
            rows.append(
                [
                    r["side"],
                    kind,
                    c.format_stat(row["seconds"], scale=1.0, digits=3),
                    f"{row['model_forwards']:.0f}",
                    "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}",
                    f"{row['floor_s']:.3f} ({100 * row['of_floor']:.0f} %)"
                    if "floor_s" in row
                    else "",
                    f"{r['peak_bytes'] / 2**30:.1f}",
                    r["graphs_compiled"],
                    f"{r['trained_params'] / 1e6:.1f}",
                ]
            )
    c.print_table(
        [
            "side",
            "step trains",
            "s median (min-max)",
            "fwd-equiv",
            "MFU %",
            "floor s (reached)",
            "peak GiB",
            "graphs",
            "trained M",
        ],
        rows,
    )
    for r in results:
        for kind, row in r.get("steps", {}).items():
            if "profile" in row:
                p = row["profile"]
                parts = ", ".join(f"{label} {s:.3f}" for label, s in p["categories"].items())
                print(
                    f"# profile {r['side']} {kind}: {p['wall_s']:.3f} s, device idle "
                    f"{p['idle_s']:.3f} s; kernels (s): {parts}"
                )


if __name__ == "__main__":
    raise SystemExit(main())
