"""Shared pieces of the benchmarks: model presets, data, distributed setup, timing,
memory, FLOPs, the FSDP2 groups of a module, and tables.

A benchmark process is either a single process (modules unsharded) or one rank of a
``torchrun`` launch (``WORLD_SIZE > 1``): :func:`setup_runtime` then initialises the
process group (NCCL on CUDA, gloo on CPU) and :func:`prepare_module` shards every role
with :func:`fvstep.distributed.shard_module`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fvstep as fs
from fvstep import distributed as fsd
from fvstep.models import synthetic_batch

__all__ = [
    "PRESETS",
    "Preset",
    "Runtime",
    "add_runtime_args",
    "build_model",
    "expected_collectives",
    "format_stat",
    "fsdp_groups",
    "make_batch",
    "mfu",
    "optimizer_options",
    "prepare_module",
    "print_table",
    "setup_runtime",
    "summarize",
    "teardown_runtime",
    "train_flops_per_sample",
    "with_autocast",
]

_WAN_COMMON: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
}


@dataclass(frozen=True)
class Preset:
    """A model (a ``WanTransformer3DModel`` config) and the shape of one sample.

    Attributes:
        name: The preset's name (``--preset``).
        config: ``WanTransformer3DModel`` keyword arguments.
        latent_shape: ``(C, F, H, W)`` of one sample's latents.
        text_len: Text tokens per sample.
        note: One line for the help text.
    """

    name: str
    config: dict[str, Any]
    latent_shape: tuple[int, int, int, int]
    text_len: int
    note: str = ""

    @property
    def num_tokens(self) -> int:
        """Video tokens per sample: ``F/pf * H/ph * W/pw``."""
        _, f, h, w = self.latent_shape
        pf, ph, pw = self.config["patch_size"]
        return (f // pf) * (h // ph) * (w // pw)

    def skeleton(self) -> Preset:
        """The same blocks and parameter tensors with tiny dims: a host-bound twin.

        Same number of layers, hence the same parameter-tensor count and FSDP2 groups,
        so a step's Python work is the same while its arithmetic is negligible.
        """
        config = {**self.config, **PRESETS["tiny-wan"].config}
        config["num_layers"] = self.config["num_layers"]
        tiny = PRESETS["tiny-wan"]
        return replace(tiny, name=f"{self.name}-skeleton", config=config)


PRESETS: dict[str, Preset] = {
    "tiny-wan": Preset(
        "tiny-wan",
        {
            **_WAN_COMMON,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 16,
            "ffn_dim": 32,
            "num_layers": 2,
            "rope_max_seq_len": 32,
        },
        latent_shape=(4, 2, 4, 4),
        text_len=3,
        note="fvstep.models.tiny_wan (10k params, 8 tokens): CPU smoke runs",
    ),
    "small-wan": Preset(
        "small-wan",
        {
            **_WAN_COMMON,
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 64,
            "freq_dim": 32,
            "ffn_dim": 512,
            "num_layers": 4,
            "rope_max_seq_len": 64,
        },
        latent_shape=(16, 4, 16, 16),
        text_len=32,
        note="4 blocks of dim 128 (1.0M params, 256 tokens): CPU runs with some arithmetic",
    ),
    "wan-1.3b": Preset(
        "wan-1.3b",
        {
            **_WAN_COMMON,
            "num_attention_heads": 12,
            "attention_head_dim": 128,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
            "freq_dim": 256,
            "ffn_dim": 8960,
            "num_layers": 30,
            "rope_max_seq_len": 1024,
        },
        latent_shape=(16, 21, 26, 26),
        text_len=512,
        note="Wan2.1-1.3B shape, random init (3549 tokens + 512 text tokens a sample): GPU",
    ),
}


def build_model(preset: Preset, *, device: torch.device, seed: int = 0) -> nn.Module:
    """The preset's ``WanTransformer3DModel``, fp32, initialised directly on ``device``.

    Construction runs under ``torch.device(device)`` (parameters are allocated and
    initialised there: no CPU copy of a 1.3B model) and a forked RNG seeded with
    ``seed``, so every rank builds the same weights and the global RNG is untouched.
    """
    from diffusers import WanTransformer3DModel

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model: nn.Module = WanTransformer3DModel(**preset.config)  # type: ignore[assignment]
    return model


def make_batch(
    preset: Preset, batch_size: int, *, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A synthetic ``{"latents", "text"}`` batch of the preset's shapes (fp32)."""
    c, f, h, w = preset.latent_shape
    return synthetic_batch(
        fs.random.key(seed),
        batch_size=batch_size,
        channels=c,
        frames=f,
        height=h,
        width=w,
        text_len=preset.text_len,
        text_dim=preset.config["text_dim"],
        device=device,
    )


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
        if self.sharded:
            dist.barrier()

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks (the slowest rank's time, the largest peak)."""
        if not self.sharded or not values:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        t = t.to(self.device) if self.device.type == "cuda" else t
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]

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
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "nccl" if kind == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10)
        )
    mesh = fsd.make_mesh(device_type=kind)
    return Runtime(dist.get_rank(), dist.get_world_size(), dev, mesh, started)


def teardown_runtime(rt: Runtime) -> None:
    """Destroy the process group if :func:`setup_runtime` created it."""
    if rt.started_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
        for block in module.blocks:  # type: ignore[union-attr]
            block.compile()
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


# ------------------------------------------------------------------ FLOPs


def _tokens_of(name: str, video: int, text: int) -> int:
    """How many tokens per sample a linear layer of a Wan transformer is applied to."""
    if name.startswith("condition_embedder.text_embedder"):
        return text
    if name.startswith(("condition_embedder.time", "condition_embedder.time_proj")):
        return 1
    if ".attn2." in name and name.rsplit(".", 1)[-1] in (
        "to_k",
        "to_v",
        "add_k_proj",
        "add_v_proj",
    ):
        return text  # cross-attention keys/values are projections of the text tokens
    return video


def train_flops_per_sample(module: nn.Module, preset: Preset) -> float:
    """Training FLOPs (forward + backward) of one sample through a Wan transformer.

    ``6 * weights * tokens`` for every linear layer (and the patch-embedding conv, a
    linear map per token), with the tokens the layer acts on (video tokens ``T``, text
    tokens ``L`` for the text embedder and cross-attention keys/values, one for the time
    embedding), plus attention: ``12 * layers * T^2 * dim`` for self-attention and
    ``12 * layers * T * L * dim`` for cross-attention (``QK^T`` and ``AV``, 2 FLOPs a
    multiply-add, times 3 for forward + backward). Norms and elementwise ops are left out.
    """
    video, text = preset.num_tokens, preset.text_len
    linear = 0.0
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Linear, nn.Conv3d)):
            linear += 6.0 * mod.weight.numel() * _tokens_of(name, video, text)
    cfg = preset.config
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    attention = 12.0 * cfg["num_layers"] * dim * (video * video + video * text)
    return linear + attention


def mfu(flops_per_step: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of one device, or ``None`` without a peak."""
    return None if peak is None or seconds <= 0 else flops_per_step / seconds / peak


# ------------------------------------------------------------------ FSDP2 groups


def fsdp_groups(module: nn.Module) -> list[tuple[str, list[torch.Tensor]]]:
    """The FSDP2 parameter groups of a sharded module: ``(module name, its own params)``.

    A group's parameters are those of an ``fully_shard``-ed module that no nested
    ``fully_shard``-ed module owns. Empty for an unsharded module.
    """
    sharded = [(n, m) for n, m in module.named_modules() if fsd.is_sharded(m)]
    owned: set[int] = set()
    groups = []
    for name, mod in reversed(sharded):  # innermost first
        params = [p for p in mod.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        groups.append((name or "<root>", params))
    return list(reversed(groups))


def padded_numel(params: Sequence[torch.Tensor], world: int) -> int:
    """Elements FSDP2 all-gathers for ``params``: dim 0 padded to a multiple of ``world``."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        rest = p.numel() // max(rows, 1) if p.dim() else 1
        total += -(-rows // world) * world * rest
    return total


def expected_collectives(
    module: nn.Module,
    *,
    world: int,
    microbatches: int,
    sync: str,
    keep_params_gathered: bool,
    param_bytes: int,
    reduce_bytes: int,
    clip: bool = False,
) -> dict[str, float]:
    """The analytic FSDP2 collectives of one step of a unit training ``module``.

    With ``G`` groups of padded sizes ``N_g`` and ``K`` micro-batches, per step:

    - all-gathers: each group is gathered for the forward and again for the backward of
      each micro-batch, ``2K`` times (``K + 1`` with ``keep_params_gathered``: only the
      first forward gathers, later forwards find the parameters still unsharded); bytes
      = the gathered output, ``sum N_g * param_bytes`` each time;
    - reduce-scatters: ``K`` per group (``every``, ``deferred``), ``1`` (``no_sync``);
      bytes as :class:`fvstep.distributed.CollectiveCounter` counts them, the output
      shard: ``sum N_g * reduce_bytes / world`` each time (the data reduced is ``world``
      times that);
    - all-reduces: one a step for the global gradient norm when clipping.

    All zero on one process (unsharded).
    """
    groups = fsdp_groups(module)
    if world == 1 or not groups:
        kinds = ("all_gather", "all_gather_bytes", "reduce_scatter", "reduce_scatter_bytes")
        return dict.fromkeys((*kinds, "all_reduce"), 0)
    numel = sum(padded_numel(ps, world) for _, ps in groups)
    k = microbatches
    ag = k + 1 if keep_params_gathered else 2 * k
    rs = 1 if sync == "no_sync" else k
    return {
        "all_gather": len(groups) * ag,
        "all_gather_bytes": numel * param_bytes * ag,
        "reduce_scatter": len(groups) * rs,
        "reduce_scatter_bytes": numel * reduce_bytes * rs / world,
        "all_reduce": 1 if clip else 0,
    }


def trainable_numel(module: nn.Module) -> int:
    """Global element count of the trainable parameters (DTensors count globally)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def local_tensor_bytes(
    tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor], device: torch.device
) -> int:
    """Bytes of the local shards of ``tensors`` that live on ``device``'s type."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == device.type:
            total += local.numel() * local.element_size()
    return total


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
