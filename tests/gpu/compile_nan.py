"""Where does the compiled backward of a Wan block at 32,760 tokens go non-finite? (one GPU)

    python -m tests.gpu.compile_nan --json compile_nan.json [--layers 2]

Issue 10 item 7: DMD2 at 480x832x81 with AC + ``block.compile()`` + FSDP2 bf16 gave a NaN
gradient of ``condition_embedder.time_embedder.linear_1.weight`` at step 0; eager was
finite, and compiled at 1,950 tokens was finite. Here one Wan2.1-1.3B-shaped transformer
(``--layers`` blocks, random init, seed 0) runs one flow-matching forward/backward at the
real shape under several preparations, each from the same weights and inputs:

- ``bf16``: parameters stored in bf16 (as FSDP2's ``param_dtype`` computes), inputs bf16,
  the timestep either rounded to bf16 (what FSDP2's ``cast_forward_inputs`` did) or
  kept fp32 (what ``fvstep.parallel.prepare`` does now);
- ``autocast``: fp32 parameters under ``torch.autocast(bf16)``;

each eager, compiled, checkpointed + compiled, with Inductor's defaults and with
``emulate_precision_casts``. It prints, per variant: the loss, the number of non-finite
gradients and the first one, and the largest relative gradient difference from the
eager run of the same precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from typing import Any

import torch

from benchmarks.presets import PRESETS, build_model, make_batch
from fvstep.methods.models import predict
from fvstep.parallel.prepare import prepare

BACKEND = "inductor"


def run_variant(
    preset: Any,
    layers: int,
    precision: str,
    how: str,
    t_dtype: torch.dtype,
    emulate: bool,
    device: torch.device,
    split_reductions: bool = True,
) -> dict[str, Any]:
    import torch._dynamo
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    inductor.emulate_precision_casts = emulate
    inductor.split_reductions = split_reductions
    model = build_model(
        dataclasses.replace(preset, config=dict(preset.config, num_layers=layers)), device=device
    )
    checkpointing = "full" if "ac" in how else None
    compile_args: dict[str, Any] = {"backend": BACKEND}
    if "mix" in how:  # the Inductor pass prepare turns off, turned back on
        compile_args["options"] = {"triton.mix_order_reduction": True}
    prepare(
        model,
        checkpointing=checkpointing,
        compile=compile_args if "compile" in how else False,
    )
    batch = make_batch(preset, 1, device=device, seed=0)
    x0, text = batch["latents"], batch["text"]
    gen = torch.Generator(device).manual_seed(1)
    eps = torch.randn(x0.shape, generator=gen, device=device)
    t = torch.full((1,), 0.6, device=device)
    xt = (1 - t) * x0 + t * eps
    timestep = (t * 1000).to(t_dtype)
    start = time.perf_counter()
    ctx = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "autocast"
        else torch.autocast(device.type, enabled=False)
    )
    with ctx:
        v = predict(model, xt, timestep, text)
    loss = torch.nn.functional.mse_loss(v.float(), eps - x0)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    return {
        "loss": float(loss),
        "seconds": time.perf_counter() - start,
        "nonfinite_grads": len(bad),
        "first_nonfinite": bad[:3],
        "grads": grads,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--preset", default="wan-1.3b-480p")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--latents", type=int, nargs=4, default=None)
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    global BACKEND
    BACKEND = args.compile_backend
    preset = PRESETS[args.preset]
    if args.latents:
        preset = dataclasses.replace(preset, latent_shape=tuple(args.latents))
    variants = [
        ("fp32", "eager", torch.float32, False, True),
        ("fp32", "compile", torch.float32, False, True),
        ("fp32", "compile+mix", torch.float32, False, True),
        ("autocast", "eager", torch.float32, False, True),
        ("autocast", "compile", torch.float32, False, True),
        ("autocast", "ac+compile", torch.float32, False, True),
        ("autocast", "ac+compile+mix", torch.float32, False, True),
    ]
    eager: dict[tuple[str, torch.dtype], dict[str, torch.Tensor]] = {}
    rows = []
    for precision, how, t_dtype, emulate, split in variants:
        try:
            r = run_variant(
                preset,
                args.layers,
                precision,
                how,
                t_dtype,
                emulate,
                torch.device(args.device),
                split,
            )
        except Exception as error:  # report and go on: this is a diagnosis
            rows.append({"variant": [precision, how, split], "error": repr(error)})
            print(rows[-1], flush=True)
            continue
        grads = r.pop("grads")
        if how == "eager":
            eager[(precision, t_dtype)] = grads
        ref = eager.get((precision, t_dtype))
        truth = eager.get(("fp32", torch.float32))
        worst = None
        if ref is not None and not r["nonfinite_grads"]:
            diffs = sorted(
                (float((grads[n] - ref[n]).norm() / (ref[n].norm() + 1e-30)), n) for n in ref
            )
            worst = [
                (
                    d,
                    n,
                    float(ref[n].norm()),
                    float(grads[n].norm()),
                    None
                    if truth is None
                    else float((grads[n] - truth[n]).norm() / (truth[n].norm() + 1e-30)),
                )
                for d, n in diffs[-4:]
            ]
        row = {
            "variant": [precision, how, "split" if split else "nosplit"],
            **r,
            "worst_rel_grad_diff_vs_eager": worst,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del grads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    info = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "python": platform.python_version(),
        "preset": preset.name,
        "layers": args.layers,
        "latents": list(preset.latent_shape),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
