"""Sampling time: a 4-step DMD2 student (FewStepSampler) and a 50-step flow-matching sampler
(EulerSampler), model only and with VAE decode, at 480x832x81 (latents 16x21x60x104) on one GPU.

    python -m benchmarks.sampling            # Wan2.1-1.3B shape, random init, bf16, one GPU
    python -m benchmarks.sampling --tiny     # a CPU smoke run of the same code

Prints one table row per (sampler, decode) with the median of --repeats timed runs after a
warm-up run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from fvstep.executor.sampling import EulerSampler, FewStepSampler, decode_latents, sample
    from fvstep.methods.models import tiny_wan

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    net: Any  # diffusers' models: their stubs lack nn.Module's methods (`.to`)
    vae: Any
    if args.tiny:
        net = tiny_wan(seed=0)
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
        shape, text_shape = (1, 4, 2, 4, 4), (1, 3, 16)
    else:
        net = WanTransformer3DModel(  # Wan2.1-1.3B
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        )
        vae = AutoencoderKLWan()  # the Wan2.1 VAE's default config
        shape, text_shape = (1, 16, 21, 60, 104), (1, 512, 4096)
    net = net.to(device, dtype).eval()
    vae = vae.to(device, torch.float32 if args.tiny else torch.bfloat16).eval()
    g = torch.Generator(device).manual_seed(0)
    noise = torch.randn(shape, generator=g, device=device, dtype=dtype)
    text = torch.randn(text_shape, generator=g, device=device, dtype=dtype)
    key = __import__("fvstep").random.key(0)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    samplers: dict[str, EulerSampler | FewStepSampler] = {
        "DMD2 student, 4 steps": FewStepSampler((1.0, 0.75, 0.5, 0.25)),
        "flow matching, 50 steps": EulerSampler(50, shift=3.0),
    }
    print("| sampler | model only (s) | with VAE decode (s) |")
    print("|---|---|---|")
    for name, sampler in samplers.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for decode in (False, True):
            for i in range(args.repeats + 1):
                sync()
                start = time.perf_counter()
                with torch.no_grad():
                    latents = sample(net, noise, text, sampler=sampler, key=key)
                    if decode:
                        decode_latents(vae, latents)
                sync()
                if i > 0:
                    times[decode].append(time.perf_counter() - start)
        print(
            f"| {name} | {statistics.median(times[False]):.2f} | "
            f"{statistics.median(times[True]):.2f} |"
        )


if __name__ == "__main__":
    main()
