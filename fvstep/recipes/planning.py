"""Plan before you allocate: a run's memory and step time per GPU, from its config alone.

:func:`plan_run` reads a recipe's options and the transformer's config (no weights, no GPU)
and predicts each role's static bytes, the saved activations, the KV caches, each kind of
step's peak, and the step time at a :class:`KernelTable`'s rates; :func:`suggest_changes`
ranks cheaper settings that fit. ``docs/plan.md`` says what the model counts.

Examples:
    >>> print(plan_run("finetune", FinetuneOptions()).format())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from fvstep.recipes import RECIPES

__all__ = [
    "CACHE_PASS_BYTES",
    "COMPILED_NONE_FRACTION",
    "SAVED_BYTES_PER_TOKEN",
    "KernelTable",
    "ModelShape",
    "RolePlan",
    "RunPlan",
    "StepPlan",
    "Suggestion",
    "block_saved_bytes",
    "calibrate_kernels",
    "load_kernel_table",
    "meta_transformer",
    "plan_run",
    "suggest_changes",
]

GIB = 2**30
_MARGIN = 2.0 * GIB  # kept free for the caching allocator's fragmentation
_CAUSAL_RECIPES = ("self_forcing", "streaming")  # a causal student with a KV cache


# ------------------------------------------------------------------ kernels


@attrs.frozen
class KernelTable:
    """What one GPU does per second: the rates a step's time is predicted from.

    Rates are TFLOP/s (attention by backend, ``"cudnn"`` or ``"fa4"``; forward + backward
    counts the backward 2.5x the forward), bandwidths GB/s per GPU.

    Attributes:
        memory_bandwidth: HBM bandwidth an element-wise kernel (the fused AdamW) reaches.
        host_bandwidth: Pinned host <-> GPU copies (activation offloading).
        interconnect: Collectives within a node.
        network: Collectives across nodes.
        elementwise: Time beyond the kernel floor, as a fraction of it (compiled blocks).
        masked_attention_forward: A causal chunk's masked self-attention over its KV
            cache (FLOPs counted over the cache's whole capacity).
        elementwise_eager: :attr:`elementwise` for eager blocks (and cache-filling passes).
    """

    name: str
    memory_gib: float
    attention_forward: dict[str, float]
    attention_forward_backward: dict[str, float]
    gemm: float
    memory_bandwidth: float = 3200.0
    host_bandwidth: float = 50.0
    interconnect: float = 350.0
    network: float = 40.0
    elementwise: float = 0.15
    masked_attention_forward: float = 352.0
    masked_attention_forward_backward: float = 331.0
    elementwise_eager: float = 0.37
    source: str = ""

    def to_json(self) -> str:
        """The table as JSON (what :func:`load_kernel_table` reads)."""
        return json.dumps(attrs.asdict(self), indent=2)


_H200 = KernelTable(
    name="h200",
    memory_gib=139.8,
    attention_forward={"cudnn": 567.0, "fa4": 718.0},
    attention_forward_backward={"cudnn": 538.0, "fa4": 645.0},
    gemm=700.0,
    source="one H200, torch 2.11, at 32,760 tokens (docs/benchmarks.md: cuDNN "
    "538 TFLOP/s forward+backward, FA4 645, the model's bf16 GEMMs 647-729; a causal "
    "chunk's masked attention over its cache 352 forward, 331 forward+backward, from "
    "the streaming kernel profile)",
)
_KERNEL_TABLES: dict[str, KernelTable] = {
    "h200": _H200,
    "h100": attrs.evolve(
        _H200,
        name="h100",
        memory_gib=79.6,
        memory_bandwidth=2200.0,
        source="the H200's kernel rates (same SMs and clocks; not measured on an H100) "
        "with the H100's 80 GB and HBM3 bandwidth",
    ),
}


def load_kernel_table(name_or_path: str | None) -> KernelTable:
    """A shipped kernel table by name (``None``: the H200's), or a JSON file written by
    ``fvstep plan --calibrate`` (a missing field gets its default); ``ValueError`` for
    anything else."""
    if name_or_path is None:
        return _KERNEL_TABLES["h200"]
    if name_or_path in _KERNEL_TABLES:
        return _KERNEL_TABLES[name_or_path]
    try:
        return KernelTable(**json.loads(Path(name_or_path).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"--kernels {name_or_path!r} is neither {' nor '.join(_KERNEL_TABLES)} nor a "
            f"kernel table written by `fvstep plan --calibrate` ({e})"
        ) from None


def _median_seconds(fn: Any, device: torch.device, repeats: int) -> float:
    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    fn()
    return sorted(timed() for _ in range(repeats))[repeats // 2]


def calibrate_kernels(
    shape: ModelShape,
    *,
    device: torch.device | str = "cuda",
    tokens: int | None = None,
    repeats: int = 5,
) -> KernelTable:
    """This device's SDPA, masked-attention and GEMM rates at ``shape``'s sizes (``tokens``
    default: 32,760 on CUDA, 512 elsewhere); FA4's rate is the H200's scaled by the measured
    SDPA rate, the other fields the H200's."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t = tokens or (32760 if cuda else 512)
    h, d = shape.num_heads, shape.head_dim
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def rates(queries: int, keys: int, masked: bool) -> tuple[float, float]:
        """SDPA's forward and forward + backward TFLOP/s; ``masked``: with a ``(1, keys)``
        mask of filled slots, as a causal chunk's cached call."""
        q = torch.randn(1, h, queries, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (
            torch.randn(1, h, keys, d, device=device, dtype=dtype, requires_grad=True) for _ in "kv"
        )
        mask = (torch.arange(keys, device=device) < keys - queries // 2)[None] if masked else None

        def forward() -> None:
            with torch.no_grad():
                sdpa(q, k, v, attn_mask=mask)

        def both() -> None:
            out = sdpa(q, k, v, attn_mask=mask)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        flops = 4.0 * queries * keys * h * d
        f = flops / _median_seconds(forward, device, repeats) / 1e12
        return f, 3.5 * flops / _median_seconds(both, device, repeats) / 1e12

    attention_f, attention_fb = rates(t, t, masked=False)
    chunk = max(1, t // 7)
    masked_f, masked_fb = rates(chunk, t + chunk, masked=True)
    x = torch.randn(t, shape.dim, device=device, dtype=dtype)
    w = torch.randn(shape.ffn_dim, shape.dim, device=device, dtype=dtype)
    gemm = 2.0 * t * shape.dim * shape.ffn_dim / _median_seconds(lambda: x @ w.t(), device, 3)
    base = _KERNEL_TABLES["h200"]
    scale = attention_fb / base.attention_forward_backward["cudnn"]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    memory = torch.cuda.get_device_properties(device).total_memory / GIB if cuda else 0.0
    return attrs.evolve(
        base,
        name=name,
        memory_gib=memory or base.memory_gib,
        attention_forward={"cudnn": attention_f, "fa4": base.attention_forward["fa4"] * scale},
        attention_forward_backward={
            "cudnn": attention_fb,
            "fa4": base.attention_forward_backward["fa4"] * scale,
        },
        gemm=gemm / 1e12,
        masked_attention_forward=masked_f,
        masked_attention_forward_backward=masked_fb,
        source=f"measured by fvstep plan --calibrate on {name} at {t} tokens",
    )


# ------------------------------------------------------------------ the model


@attrs.frozen
class ModelShape:
    """The sizes of a Wan transformer the plan needs: ``linears`` are ``(name, fan_in,
    fan_out)`` of each linear layer and convolution (``convs``); ``fp32_numel`` the
    parameters a frozen role keeps in fp32 (diffusers' ``_keep_in_fp32_modules``)."""

    num_layers: int
    dim: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    patch: tuple[int, int, int]
    numel: int
    block_numel: int
    block_linear_numel: int
    linears: tuple[tuple[str, int, int], ...]
    tensors: int = 0
    convs: tuple[str, ...] = ()
    fp32_numel: int = 0

    @classmethod
    def of(cls, module: nn.Module) -> ModelShape:
        """The shape of a (meta or real) ``WanTransformer3DModel``."""
        cfg: Any = module.config
        block: Any = module.blocks[0]  # type: ignore[index]
        linears, convs = [], []
        for name, m in module.named_modules():
            if isinstance(m, (nn.Linear, nn.Conv3d)):
                linears.append((name, m.weight[0].numel(), m.weight.shape[0]))
                if not isinstance(m, nn.Linear):
                    convs.append(name)
        params = list(module.parameters())
        keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
        fp32_numel = sum(
            p.numel()
            for name, p in module.named_parameters()
            if any(k in name.split(".") for k in keep)
        )
        return cls(
            num_layers=cfg.num_layers,
            dim=cfg.num_attention_heads * cfg.attention_head_dim,
            num_heads=cfg.num_attention_heads,
            head_dim=cfg.attention_head_dim,
            ffn_dim=cfg.ffn_dim,
            patch=tuple(cfg.patch_size),
            numel=sum(p.numel() for p in params),
            block_numel=sum(p.numel() for p in block.parameters()),
            block_linear_numel=sum(
                m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)
            ),
            linears=tuple(linears),
            tensors=len(params),
            convs=tuple(convs),
            fp32_numel=fp32_numel,
        )


_WAN_DEFAULTS: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
}
"""``diffusers.WanTransformer3DModel``'s defaults for the keys a config may leave out."""


def _wan_shape(config: dict[str, Any]) -> ModelShape | None:
    """The :class:`ModelShape` of a text-to-video ``WanTransformer3DModel`` config, counted
    layer by layer without importing diffusers (slow to import); ``None`` for another class
    or an image-conditioned config."""
    if config.get("_class_name", "WanTransformer3DModel") != "WanTransformer3DModel":
        return None
    if any(
        config.get(k) is not None for k in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
    ):
        return None
    c = {**_WAN_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    heads, head_dim, layers = c["num_attention_heads"], c["attention_head_dim"], c["num_layers"]
    dim, ffn, patch = heads * head_dim, c["ffn_dim"], tuple(c["patch_size"])
    in_channels = c["in_channels"]
    out_channels = (c["out_channels"] or in_channels) * math.prod(patch)
    linears: list[tuple[str, int, int]] = [("patch_embedding", in_channels * math.prod(patch), dim)]
    tensors = 1 + 2  # the output's scale_shift_table, the patch embedding
    for name, fan_in, fan_out in (
        ("time_embedder.linear_1", c["freq_dim"], dim),
        ("time_embedder.linear_2", dim, dim),
        ("time_proj", dim, 6 * dim),
        ("text_embedder.linear_1", c["text_dim"], dim),
        ("text_embedder.linear_2", dim, dim),
    ):
        linears.append((f"condition_embedder.{name}", fan_in, fan_out))
        tensors += 2
    block_linears = [
        *((f"{attn}.{p}", dim, dim) for attn in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")),
        ("ffn.net.0.proj", dim, ffn),
        ("ffn.net.2", ffn, dim),
    ]  # fmt: skip
    # a block: its scale_shift_table (6 x dim), each linear's weight and bias, the two
    # attentions' norm_q and norm_k (dim each), the cross-attention norm's weight and bias
    norm2 = 2 * dim if c["cross_attn_norm"] else 0
    block_linear_numel = sum(i * o for _, i, o in block_linears)
    block_numel = 6 * dim + sum(i * o + o for _, i, o in block_linears) + 4 * dim + norm2
    block_tensors = 1 + 2 * len(block_linears) + 4 + (2 if norm2 else 0)
    for i in range(layers):
        linears += [(f"blocks.{i}.{n}", fan_in, fan_out) for n, fan_in, fan_out in block_linears]
    linears.append(("proj_out", dim, out_channels))
    tensors += layers * block_tensors + 2
    outside = sum(i * o + o for n, i, o in linears if not n.startswith("blocks."))
    numel = 2 * dim + outside + layers * block_numel
    # kept in fp32 by a frozen role: the time embedder, the scale-shift tables, norm2
    time = sum(i * o + o for n, i, o in linears if ".time_embedder." in n)
    fp32_numel = time + 2 * dim + layers * (6 * dim + norm2)
    return ModelShape(
        num_layers=layers,
        dim=dim,
        num_heads=heads,
        head_dim=head_dim,
        ffn_dim=ffn,
        patch=patch,
        numel=numel,
        block_numel=block_numel,
        block_linear_numel=block_linear_numel,
        linears=tuple(linears),
        tensors=tensors,
        convs=("patch_embedding",),
        fp32_numel=fp32_numel,
    )


def _model_config(model: Any) -> dict[str, Any]:
    """The transformer config of a ``ModelOptions``: ``model.path``'s (a transformer
    folder, or a pipeline's ``transformer/``), else ``model.config``'s, else the tiny Wan's."""
    if model.path is not None:
        folder = Path(model.path)
        config_file = folder / "transformer" / "config.json"
        if not config_file.is_file():
            config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model.path {model.path!r} holds no transformer config.json")
        config: dict[str, Any] = json.loads(config_file.read_text())
        return config
    if model.config is not None:
        config = json.loads(Path(model.config).read_text())
        return config
    tiny = model.tiny
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": tiny.num_heads,
        "attention_head_dim": tiny.dim_per_head,
        "in_channels": tiny.in_channels,
        "out_channels": tiny.in_channels,
        "text_dim": tiny.text_dim,
        "freq_dim": 16,
        "ffn_dim": tiny.ffn_dim,
        "num_layers": tiny.num_layers,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 32,
    }


def meta_transformer(model: Any) -> nn.Module:
    """The transformer of a recipe's ``ModelOptions`` (:func:`_model_config`), on ``meta``;
    ``ValueError`` if ``model.path`` holds no ``config.json``."""
    return _meta_module(_model_config(model))


def _meta_module(config: dict[str, Any]) -> nn.Module:
    import diffusers

    cls = getattr(diffusers, config.get("_class_name", "WanTransformer3DModel"))
    with torch.device("meta"):
        built: nn.Module = cls.from_config(config)
        return built


@functools.lru_cache(maxsize=16)
def _shape_of_config(text: str) -> ModelShape:
    config = json.loads(text)
    return _wan_shape(config) or ModelShape.of(_meta_module(config))


def _shape_for(model: Any) -> ModelShape:
    """The :class:`ModelShape` of a ``ModelOptions``, once a config (cached)."""
    return _shape_of_config(json.dumps(_model_config(model), sort_keys=True))


def _tokens_of(name: str, video: float, text: int) -> float:
    """How many tokens per sample a linear layer of a Wan transformer acts on."""
    if name.startswith("condition_embedder.text_embedder"):
        return text
    if name.startswith("condition_embedder.time"):
        return 1
    if ".attn2." in name and name.rsplit(".", 1)[-1] in ("to_k", "to_v"):
        return text  # cross-attention keys and values are projections of the text
    return video


# ------------------------------------------------------------------ activations

SAVED_BYTES_PER_TOKEN: dict[tuple[str, str], tuple[float, float, float]] = {
    # (checkpointing, compute) -> bytes per video token = a * dim + b * ffn_dim + c * heads
    ("none", "bf16"): (68.0, 4.0, 21.0),
    ("full", "bf16"): (2.0, 0.0, 0.0),
    ("selective", "bf16"): (20.0, 2.0, 8.0),
    ("attention", "bf16"): (6.0, 0.0, 8.0),
    ("narrow", "bf16"): (20.0, 0.0, 8.0),
    ("none", "fp32"): (88.0, 8.0, 21.0),
    ("full", "fp32"): (4.0, 0.0, 0.0),
    ("selective", "fp32"): (40.0, 4.0, 8.0),
    ("attention", "fp32"): (12.0, 0.0, 8.0),
    ("narrow", "fp32"): (40.0, 0.0, 8.0),
}
"""Bytes a Wan block keeps for its backward per video token (docs/plan.md)."""

COMPILED_NONE_FRACTION: tuple[tuple[float, float], ...] = ((0.65, 0.289), (1.0, 0.375))
"""Compiled blocks without checkpointing: the fraction of eager's ``none`` bytes kept,
``(budget limit, fraction)``, the first row above the budget (docs/plan.md)."""

_COMPILED_DEFAULT_FRACTION = 0.65  # the same, at torch's default budget


def block_saved_bytes(
    shape: ModelShape,
    tokens: float,
    *,
    checkpointing: str,
    compute: str = "bf16",
    compiled: bool = False,
    memory_budget: float | None = None,
    fp32_weights: bool = True,
) -> float:
    """Bytes one Wan block keeps for its backward on ``tokens`` video tokens (the whole
    micro-batch's), by :data:`SAVED_BYTES_PER_TOKEN`; ``compiled``, ``memory_budget`` and
    ``fp32_weights`` (autocast's kept bf16 casts) change ``"none"`` only."""
    a, b, c = SAVED_BYTES_PER_TOKEN[(checkpointing, compute)]
    per_token = a * shape.dim + b * shape.ffn_dim + c * shape.num_heads
    saved = per_token * tokens
    if checkpointing == "none":
        if compute == "bf16" and fp32_weights:
            saved += 2.0 * shape.block_linear_numel  # autocast's bf16 copies of the weights
        if compiled:
            fraction = _COMPILED_DEFAULT_FRACTION
            if memory_budget is not None and memory_budget < 1.0:
                fraction = next(f for limit, f in COMPILED_NONE_FRACTION if memory_budget < limit)
            saved *= fraction
    return saved


CACHE_PASS_BYTES: dict[str, float] = {"compiled": 8.0, "eager": 46.0}
"""Bytes a causal chunk's cached call moves per key element it reads (keys x ``dim``,
every layer) beyond its attention and GEMMs, compiled or eager (docs/plan.md)."""

APPEND_COPIES: dict[str, float] = {"grows": 3.5, "evicts": 6.0}
"""Cache-sized copies of one cache-filling pass's append, as the cache grows or evicts."""

CACHED_TRANSIENT_BYTES = 14.0
"""A cached call's backward's short-lived bytes per key element (docs/plan.md)."""

_ROTARY_SAVED_BYTES = 16.0
"""Bytes a cached call under grad keeps per key and head dimension: its fp32 rotary
tables and the table they are sliced from."""


def _model_bytes(options: Any) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[options.model.dtype]


# ------------------------------------------------------------------ roles


@attrs.frozen
class RolePlan:
    """One role's bytes per GPU: its weights, AdamW's moments, an EMA copy, and the
    gradients a trained role adds during a step (``numel``: a LoRA role's adapters)."""

    name: str
    trained: bool
    numel: int
    weights: float
    gradients: float
    optimizer: float
    ema: float
    note: str = ""

    @property
    def static(self) -> float:
        """Everything but the gradients (held across steps)."""
        return self.weights + self.optimizer + self.ema


def _is_lora(recipe: str, options: Any) -> bool:
    """Whether the trained roles are LoRA adapters over one frozen base."""
    return recipe == "lora_dmd2" or (recipe == "finetune" and options.lora.rank > 0)


def _lora_layers(shape: ModelShape, targets: Sequence[str]) -> list[tuple[str, int, int]]:
    """The linear layers a LoRA adapter wraps (peft's rule: a module whose name is a
    target or ends with ``.target``; convolutions are not adapted here)."""
    return [
        (name, i, o)
        for name, i, o in shape.linears
        if name not in shape.convs and any(name == t or name.endswith("." + t) for t in targets)
    ]


def _lora_numel(shape: ModelShape, rank: int, targets: Sequence[str]) -> tuple[int, int, int]:
    """``(adapter parameters, adapted layers on video tokens a block, their fan-in)`` of
    one adapter (block 0 stands for every block)."""
    numel, layers, fan_in = 0, 0, 0
    for name, i, o in _lora_layers(shape, targets):
        numel += rank * (i + o)
        if name.startswith("blocks.0.") and _tokens_of(name, 1, 0):
            layers, fan_in = layers + 1, fan_in + i
    return numel, layers, fan_in


def _stored_bytes(shape: ModelShape, nbytes: int) -> float:
    """A frozen model's bytes stored in a dtype of ``nbytes`` (diffusers' fp32 modules stay
    fp32)."""
    kept = shape.fp32_numel if nbytes < 4 else 0
    return (shape.numel - kept) * nbytes + kept * 4.0


def _roles(recipe: str, options: Any, shape: ModelShape, world: int) -> list[RolePlan]:
    prepare = options.prepare
    frozen_dtype = prepare.frozen_dtype or ("bfloat16" if _compute(options) == "bf16" else None)
    frozen_bytes = 2 if frozen_dtype in ("bfloat16", "float16") else 4
    model_bytes = _model_bytes(options)
    ema = options.optim.ema is not None

    def trained(
        name: str, numel: int, with_ema: bool, note: str,
        nbytes: int = model_bytes, tensors: int = shape.tensors,
    ) -> RolePlan:  # fmt: skip
        return RolePlan(
            name, True, numel,
            weights=numel * nbytes / world,
            gradients=numel * nbytes / world,
            # AdamW's fp32 step a tensor and its int64 count
            optimizer=numel * 2 * nbytes / world + 4.0 * tensors + 8.0,
            ema=numel * 4 / world + 1 if with_ema else 0.0,  # and its bool "initialized"
            note=note + (", EMA" if with_ema else ""),
        )  # fmt: skip

    def frozen(name: str, note: str, nbytes: int = frozen_bytes) -> RolePlan:
        stored = _stored_bytes(shape, nbytes)
        return RolePlan(name, False, shape.numel, stored / world, 0, 0, 0, note)

    model_dtype = "fp32" if model_bytes == 4 else options.model.dtype
    master = f"{model_dtype} masters, AdamW"
    frozen_note = f"frozen, {'bf16' if frozen_bytes == 2 else 'fp32'}"
    student = trained("student", shape.numel, ema, master)
    if recipe == "finetune" and not _is_lora(recipe, options):
        return [student]
    if recipe in ("dmd2", *_CAUSAL_RECIPES):
        if recipe in _CAUSAL_RECIPES:
            student = attrs.evolve(student, note=student.note + ", causal")
        return [
            student,
            frozen("teacher", frozen_note),
            trained("critic", shape.numel, False, master),
        ]
    if recipe == "diffusion_nft":
        roles = [student, frozen("old", f"frozen, {model_dtype} (blended)", model_bytes)]
        if options.kl_weight > 0:
            roles.append(frozen("reference", frozen_note))
        return roles
    lora = options.lora
    numel, _, _ = _lora_numel(shape, lora.rank, lora.targets)
    adapted = len(_lora_layers(shape, lora.targets))
    note = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}, fp32, AdamW"
    student = trained("student", numel, ema, note, 4, 2 * adapted)
    if recipe == "finetune":
        return [student, frozen("base", frozen_note)]
    return [
        student,
        frozen("teacher", frozen_note + " (the one base)"),
        trained("critic", numel, False, note, 4, 2 * adapted),
    ]


def _compute(options: Any) -> str:
    precision = options.prepare.precision
    if precision == "auto":
        return "fp32" if options.run.device == "cpu" else "bf16"
    return precision


# ------------------------------------------------------------------ calls


@attrs.frozen
class _Call:
    """Calls of one role's model alike in a pass of a phase.

    ``kind``: ``"no_grad"``, ``"frozen"`` (under grad, gradient to its input only) or
    ``"trained"``; ``count``: how many (an expectation where the method draws them);
    ``frames``: its queries' latent frames (``None``: the whole video); ``keys``: the
    frames its masked self-attention reads from a KV cache (``None``: dense);
    ``fills``: a cache-filling pass, run eagerly (:data:`APPEND_COPIES`' key).
    """

    role: str
    kind: str
    count: float = 1.0
    frames: float | None = None
    keys: float | None = None
    fills: str | None = None


@attrs.frozen
class _Phase:
    """A stretch of a step with one memory picture (a no-grad rollout, or one backward).

    ``samples``: samples a call; ``repeat``: passes a step; ``held``: bytes beyond the
    static ones alive through it; ``transient``: its own short-lived bytes;
    ``accumulates``: the roles whose earlier passes' gradients it holds (when it repeats)."""

    name: str
    calls: tuple[_Call, ...]
    samples: float
    repeat: float = 1.0
    held: float = 0.0
    transient: float = 0.0
    accumulates: tuple[str, ...] = ()


@attrs.frozen
class _Kind:
    """A kind of step: its phases, its optimizer steps per role, its share of the steps."""

    phases: tuple[_Phase, ...]
    updates: tuple[tuple[str, float], ...]
    share: float = 1.0


_DMD2_CALLS: dict[str, tuple[_Call, ...]] = {
    "critic-only": (_Call("student", "no_grad"), _Call("critic", "trained")),
    "student+critic": (
        _Call("student", "trained"),
        _Call("teacher", "no_grad"),
        _Call("teacher", "no_grad"),
        _Call("critic", "no_grad"),
        _Call("critic", "trained"),
    ),
}
"""DMD2's model calls per kind of step (as ``benchmarks/floor.py``'s ``STEPS``)."""


@functools.lru_cache(maxsize=8)
def _dmd2_schedule(interval: int) -> tuple[str, ...]:
    """The kind of each step of DMD2's cycle of ``interval`` steps (:func:`fvstep.plan`)."""
    from fvstep.core.steps import plan as step_plan
    from fvstep.methods import dmd2

    method: Any = dmd2(generator_update_interval=interval)
    return tuple(
        "student+critic"
        if "student" in {r for entry in step_plan(method, i) for r in entry.roles}
        else "critic-only"
        for i in range(interval)
    )


def _cycle(kinds: Sequence[str]) -> dict[str, float]:
    """Each kind's share of a cycle of steps, in the cycle's order of first appearance."""
    shares: dict[str, float] = {}
    for k in kinds:
        shares[k] = shares.get(k, 0.0) + 1.0 / len(kinds)
    return shares


_TRAINS = {"student+critic": ("student", "critic"), "critic-only": ("critic",)}
"""The roles each kind of a distillation step trains."""


def _step_kinds(recipe: str, options: Any, g: _Planner) -> dict[str, _Kind]:
    """The kinds of step of the recipe's method, keyed as :func:`fvstep.plan` names them."""
    m, b = options.run.microbatches, options.data.batch_size
    per = b / m  # samples a micro-batch
    if recipe == "finetune":
        calls: tuple[_Call, ...] = (_Call("student", "trained"),)
        if _is_lora(recipe, options):
            calls = (_Call("student", "frozen"),)
        phase = _Phase("update", calls, per, m, accumulates=("student",))
        return {"student": _Kind((phase,), (("student", 1.0),))}
    if recipe in ("dmd2", "lora_dmd2"):
        kinds = {}
        for name, share in _cycle(_dmd2_schedule(options.generator_update_interval)).items():
            calls = _DMD2_CALLS[name]
            if _is_lora(recipe, options):  # the base runs under grad for the adapters
                calls = tuple(
                    attrs.evolve(c, kind="frozen") if c.kind == "trained" else c for c in calls
                )
            phase = _Phase("update", calls, per, m, accumulates=_TRAINS[name])
            kinds[name] = _Kind((phase,), tuple((r, 1.0) for r in _TRAINS[name]), share)
        return kinds
    if recipe == "diffusion_nft":
        group = b * options.group_size  # rollouts a step
        inner = group / options.minibatches / m  # samples a micro-batch of an inner update
        rollout = _Phase("rollout", (_Call("old", "no_grad", options.rollout_steps),), group)
        calls = (_Call("old", "no_grad"), _Call("student", "trained"))
        if options.kl_weight > 0:
            calls += (_Call("reference", "no_grad"),)
        # held through the inner updates, fp32: the grouped batch's latents and text, the
        # rollouts' noise and samples, the samples and text shuffled for a pass
        latents, text = math.prod(options.data.latent_shape), math.prod(options.data.text_shape)
        kept = group * 4.0 * (4 * latents + 2 * text)
        update = _Phase(
            "inner", calls, inner, options.num_inner * options.minibatches * m, held=kept,
            accumulates=("student",) if m > 1 else (),  # an optimizer step between updates
        )  # fmt: skip
        steps = float(options.num_inner * options.minibatches)
        return {"student": _Kind((rollout, update), (("student", steps),))}
    # the causal recipes: a rollout of chunks with a KV cache, then the DMD updates
    chunk = options.chunk_frames
    chunks = g.frames // chunk
    if g.frames % chunk:  # as the recipe refuses them (check_latent_frames)
        raise ValueError(
            f"{recipe}: the latents' {g.frames} frames are not a multiple of chunk_frames={chunk}"
        )
    if recipe == "streaming" and g.frames > options.window_frames:  # as init_stream does
        raise ValueError(
            f"streaming: window_frames={options.window_frames} must hold a step's {g.frames} frames"
        )
    # the denoising steps a chunk runs before its exit step, drawn uniformly
    exit_mean = (len(options.denoising_steps) - 1) / 2
    chunk_bytes = chunk * g.cache_frame
    # self-forcing's init_cache(capacity_frames=F) holds the whole video
    capacity = g.frames if recipe == "self_forcing" else options.window_frames + options.sink_frames
    keys = capacity + chunk
    sample_cache = capacity * g.cache_frame
    evicts = recipe == "streaming" and options.steps_per_stream * g.frames > capacity
    rollout_calls = (
        _Call("student", "no_grad", chunks * (exit_mean + 1), chunk, keys),  # steps, exit
        _Call("student", "no_grad", chunks, chunk, keys, fills="evicts" if evicts else "grows"),
    )  # and the context passes
    generator = (
        _Call("student", "trained", chunks, chunk, keys),
        _Call("teacher", "no_grad", 2),
        _Call("critic", "no_grad"),
    )
    critic = (_Call("critic", "trained"),)
    if recipe == "self_forcing":
        held = per * sample_cache
        transient = per * (1.5 * sample_cache + 2 * chunk_bytes)
        both, alone = _TRAINS["student+critic"], _TRAINS["critic-only"]
        # the exit steps regenerated under grad beside the critic's update, over one cache;
        # a critic-only step's rollout cache is gone before the critic's call
        phases: dict[str, tuple[_Phase, ...]] = {
            "student+critic": (
                _Phase("rollout", rollout_calls, per, m, held, transient, accumulates=both),
                _Phase("update", generator + critic, per, m, held, accumulates=both),
            ),
            "critic-only": (
                _Phase("rollout", rollout_calls, per, m, held, transient, accumulates=alone),
                _Phase("update", critic, per, m, accumulates=alone),
            ),
        }
    else:  # the rollout runs on the rank's whole batch from the stream's cache
        window = (capacity + g.frames) * g.cache_frame if evicts else 0.0  # the contexts' buffer
        new = g.frames * g.cache_frame if evicts else 0.0  # the new frames, kept for the buffer
        # the stream's cache and the one being appended to (and the new frames), then the
        # append's copies, the contexts' buffer, or a new stream's zeroed cache
        rollout = _Phase(
            "rollout", rollout_calls, b, 1, held=b * (2 * sample_cache + new),
            transient=b * max(1.5 * sample_cache + 2 * chunk_bytes, window or sample_cache),
        )  # fmt: skip
        # the stream's cache, the rollout's, and its contexts' buffer (or a new stream's cache)
        held = b * (2 * sample_cache + (window or sample_cache))
        updates = (
            _Phase("generator", generator, per, m, held, accumulates=("student",)),
            _Phase("critic", critic, per, m, held, accumulates=("critic",)),
        )
        phases = {"student+critic": (rollout, *updates), "critic-only": (rollout, updates[1])}
    interval = options.generator_update_interval  # the student trains at i % interval == 0
    cycle = _cycle(["critic-only" if i % interval else "student+critic" for i in range(interval)])
    return {
        name: _Kind(phases[name], tuple((r, 1.0) for r in _TRAINS[name]), share)
        for name, share in cycle.items()
    }


# ------------------------------------------------------------------ the plan


@attrs.frozen
class StepPlan:
    """One kind of step (``"student"``, ``"critic-only"``, ``"student+critic"``): its
    predicted ``max_memory_allocated`` (``peak``, bytes per GPU), its time (seconds; ``floor``:
    the kernels alone) and its ``share`` of the method's steps."""

    name: str
    calls: tuple[tuple[str, str], ...]
    activations: float
    transient: float
    peak: float
    floor: float
    recompute: float
    seconds: float
    share: float = 1.0
    held: float = 0.0


@attrs.frozen
class RunPlan:
    """A run's predicted memory (bytes) and time per GPU (:func:`plan_run`).

    Attributes:
        world: GPUs (``nproc * nodes``).
        video_tokens: Video tokens a sample.
        block_activations: Saved bytes of one block a trained call keeps.
        blocks_on_gpu: Blocks whose saved activations stay on the GPU.
        margin: Bytes kept free for the allocator's fragmentation.
        settings: The preparation planned (checkpointing, offload, compile, budget).
        cache: The causal recipes' ``(KV cache bytes per GPU, capacity in latent frames,
            bytes per element)``; ``None`` otherwise.
    """

    recipe: str
    world: int
    shape: ModelShape
    video_tokens: int
    text_tokens: int
    roles: tuple[RolePlan, ...]
    block_activations: float
    blocks_on_gpu: int
    steps: tuple[StepPlan, ...]
    kernels: KernelTable
    attention_backend: str
    capacity: float
    margin: float
    settings: dict[str, Any]
    context: int = 1
    cache: tuple[float, int, int] | None = None

    @property
    def peak(self) -> float:
        """The largest peak of any kind of step, bytes."""
        return max(s.peak for s in self.steps)

    @property
    def fits(self) -> bool:
        """Whether the peak and the allocator's margin fit in the GPU."""
        return self.peak + self.margin <= self.capacity

    @property
    def mean_seconds(self) -> float:
        """The step time averaged over the method's cycle of steps."""
        return sum(s.seconds * s.share for s in self.steps) / sum(s.share for s in self.steps)

    def format(self) -> str:
        """The plan as the text ``fvstep plan`` prints."""
        gib = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
        s = self.settings
        parallel = f"{self.world} GPU(s)"
        if self.context > 1:
            parallel += f", {self.context}-way context parallel"
        lines = [
            f"fvstep plan: {self.recipe}, {self.shape.numel / 1e9:.2f} B parameters "
            f"({self.shape.num_layers} blocks, dim {self.shape.dim}, ffn {self.shape.ffn_dim}), "
            f"{self.video_tokens:,} video + {self.text_tokens} text tokens a sample, "
            f"batch {s['batch']} x {s['microbatches']} micro-batch(es), {parallel}",
            f"  preparation: {s['compute']} compute, checkpointing {s['checkpointing']}"
            f"{'' if s['checkpoint_every'] == 1 else ' every ' + str(s['checkpoint_every'])}, "
            f"offload every {s['offload'] or '-'}, compile {s['compile']}"
            f"{'' if s['budget'] is None else ' (budget ' + str(s['budget']) + ')'}, "
            f"attention {self.attention_backend}",
            "",
            "memory per GPU (GiB)       weights  optimizer      ema  gradients",
        ]
        columns = ("weights", "optimizer", "ema", "gradients")
        for r in self.roles:
            cells = " ".join(gib(getattr(r, k)) for k in columns)
            lines.append(f"  {r.name:<10} {r.numel / 1e6:10.1f} M {cells}   {r.note}")
        totals = " ".join(gib(sum(getattr(r, k) for r in self.roles)) for k in columns)
        lines.append(f"  {'total':<23} {totals}")
        lines.append(
            f"  saved activations: {self.block_activations / GIB:.3f} GiB a block a trained call, "
            f"{self.blocks_on_gpu} of {self.shape.num_layers} blocks kept on the GPU"
        )
        if self.cache is not None:
            size, frames, nbytes = self.cache
            held = max(st.held for st in self.steps)
            lines.append(
                f"  KV cache: {size / GIB:.2f} GiB ({'bf16' if nbytes == 2 else 'fp32'}, "
                f"{frames} latent frames), {held / GIB:.2f} GiB of caches and contexts "
                "held at most"
            )
        lines += [
            "",
            "step              activations  transient     peak   floor s  recompute s   step s  of floor",
        ]
        for st in self.steps:
            lines.append(
                f"  {st.name:<15} {gib(st.activations)}   {gib(st.transient)} {gib(st.peak)} "
                f"{st.floor:9.3f} {st.recompute:12.3f} {st.seconds:8.3f}  {st.floor / st.seconds:7.0%}"
            )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines += [
            "",
            f"predicted peak {self.peak / GIB:.1f} GiB + {self.margin / GIB:.1f} GiB allocator margin "
            f"of {self.capacity / GIB:.1f} GiB ({self.kernels.name}): {verdict}",
            f"kernels: {self.kernels.name}: {self.kernels.source}",
        ]
        return "\n".join(lines)


def _options_with(options: Any, **changes: Any) -> Any:
    """``options`` with dotted keys changed (``prepare.checkpointing="full"``)."""
    for key, value in changes.items():
        group, field = key.split(".")
        changed = dataclasses.replace(getattr(options, group), **{field: value})
        options = dataclasses.replace(options, **{group: changed})
    return options


@functools.lru_cache(maxsize=16)
def _linear_flops(shape: ModelShape, text: int) -> tuple[float, float, float, float]:
    """``(per video token, per call, the blocks' per video token, the blocks' per call)``
    linear FLOPs of one sample's forward (the text and time projections act on the text
    and on one token, whatever the call's video tokens)."""
    token = fixed = block_token = block_fixed = 0.0
    for name, i, o in shape.linears:
        tokens = _tokens_of(name, -1, text)
        flops = 2.0 * i * o
        inside = name.startswith("blocks.")
        if tokens == -1:
            token += flops
            block_token += flops if inside else 0.0
        else:
            fixed += flops * tokens
            block_fixed += flops * tokens if inside else 0.0
    return token, fixed, block_token, block_fixed


@attrs.frozen
class _Cost:
    """One phase's share of a step: its time and its memory picture."""

    floor: float = 0.0
    recompute: float = 0.0
    compute: float = 0.0  # kernels, element-wise work, cache passes and copies
    offload: float = 0.0  # host copies of offloaded activations
    comm: float = 0.0  # FSDP2's collectives (overlapped with compute)
    all_to_all: float = 0.0  # context parallel's (in the attention's way)
    peak: float = 0.0
    activations: float = 0.0
    transient: float = 0.0


@attrs.frozen
class _Planner:
    """One run's settings, and the cost of its calls and phases (:func:`plan_run`)."""

    shape: ModelShape
    table: KernelTable
    prepare: Any
    compute: str
    roles: dict[str, RolePlan]
    world: int
    nodes: int
    context: int
    video: int
    frames: int
    text: int
    cache_frame: float  # one sample's KV cache bytes a latent frame
    fp32_weights: bool
    lora: tuple[int, int, int] | None  # (adapted layers a block, their fan-in, rank)

    @property
    def backend(self) -> str:
        return "fa4" if self.prepare.flash_attention_4 else "cudnn"

    @property
    def offloaded(self) -> int:
        every = self.prepare.offload_activations_every
        return len(range(0, self.shape.num_layers, every)) if every else 0

    @property
    def on_gpu(self) -> int:
        """Blocks whose saved activations stay on the GPU (one offloaded block in flight)."""
        return self.shape.num_layers - self.offloaded + (1 if self.offloaded else 0)

    @property
    def gathered(self) -> float:
        """FSDP2: two blocks' bf16 parameters gathered, one block's fp32 gradients."""
        return 8.0 * self.shape.block_numel if self.world > 1 else 0.0

    def saved(self, tokens: float) -> float:
        """Saved bytes of one block of a call under grad on ``tokens`` tokens of this GPU."""
        p, s = self.prepare, self.shape
        kw: dict[str, Any] = dict(
            compute=self.compute, compiled=p.compile, memory_budget=p.compile_memory_budget,
            fp32_weights=self.fp32_weights,
        )  # fmt: skip
        block = block_saved_bytes(s, tokens, checkpointing=p.checkpointing, **kw)
        if p.checkpointing != "none" and p.checkpoint_every > 1:  # the others keep everything
            plain = block_saved_bytes(s, tokens, checkpointing="none", **kw)
            chosen = math.ceil(s.num_layers / p.checkpoint_every)
            block = (chosen * block + (s.num_layers - chosen) * plain) / s.num_layers
        if self.lora is not None and p.checkpointing == "none":  # checkpointing recomputes them
            block += self.lora_casts(tokens)
        return block

    def lora_casts(self, tokens: float) -> float:
        """peft casts each adapted layer's input to the fp32 adapter."""
        if self.lora is None:
            return 0.0
        layers, fan_in, rank = self.lora
        return tokens * (4.0 * fan_in + 4.0 * layers * rank)

    def tokens(self, call: _Call) -> tuple[float, float]:
        """``(queries on this GPU, keys)`` of one sample's call."""
        q = self.video if call.frames is None else self.video * call.frames / self.frames
        k = q if call.keys is None else self.video * call.keys / self.frames
        return q / self.context, k

    def seconds(self, call: _Call) -> tuple[float, float]:
        """``(floor, recompute)`` seconds of one sample's call."""
        s, t = self.shape, self.table
        q, k = self.tokens(call)
        token, fixed, block_token, block_fixed = _linear_flops(s, self.text)
        gemm = t.gemm * 1e12
        lin = (token * q + fixed) / gemm
        self_flops = 4.0 * s.num_layers * q * k * s.dim  # Ulysses: the heads split
        cross_flops = 4.0 * s.num_layers * q * self.text * s.dim
        if call.keys is None:
            both = self_flops + cross_flops
            att_f = both / (t.attention_forward[self.backend] * 1e12)
            att_fb = 3.5 * both / (t.attention_forward_backward[self.backend] * 1e12)
        else:  # a cached call: masked, over the cache's whole capacity (no FA4: a mask)
            att_f = self_flops / (t.masked_attention_forward * 1e12)
            att_f += cross_flops / (t.attention_forward["cudnn"] * 1e12)
            att_fb = 3.5 * self_flops / (t.masked_attention_forward_backward * 1e12)
            att_fb += 3.5 * cross_flops / (t.attention_forward_backward["cudnn"] * 1e12)
        if call.kind == "no_grad":
            return att_f + lin, 0.0
        floor = att_fb + (2 if call.kind == "frozen" else 3) * lin
        mode, every = self.prepare.checkpointing, self.prepare.checkpoint_every
        block = (block_token * q + block_fixed) / gemm
        again = {
            "full": att_f + block,
            "attention": block,
            "narrow": 2.0 * s.num_layers * q * s.dim * s.ffn_dim / gemm,  # the up-projections
        }.get(mode, 0.0)
        return floor, again * math.ceil(s.num_layers / every) / s.num_layers

    def phase(self, phase: _Phase, static: float) -> _Cost:
        """A phase's time (all its passes) and its peak (the largest pass)."""
        s, t, p, w = self.shape, self.table, self.prepare, self.world
        bandwidth = t.memory_bandwidth * 1e9
        comm_bw = (t.network if self.nodes > 1 else t.interconnect) * 1e9
        floor = recompute = compute = offload = comm = all_to_all = 0.0
        acts = transient = forward = 0.0
        trained: set[str] = set()
        n = phase.samples
        for c in phase.calls:
            q, k = self.tokens(c)
            f, r = self.seconds(c)
            grad = c.kind != "no_grad"
            passes = 1 if not grad else (2 if p.checkpointing == "none" else 3)
            eager = c.fills is not None or not p.compile
            times = c.count * phase.repeat
            floor += times * n * f
            recompute += times * n * r
            compute += times * n * (f + r) * (1 + (t.elementwise_eager if eager else t.elementwise))
            tokens = n * q
            cached = 0.0
            if c.keys is not None:  # its pass over the cache's keys; a filling pass's append
                cached = n * k * s.dim  # key elements a layer
                per_byte = CACHE_PASS_BYTES["eager" if eager else "compiled"]
                compute += times * passes * per_byte * cached * s.num_layers / bandwidth
                if c.fills is not None:
                    filled = (c.keys - (c.frames or 0)) * self.cache_frame * n
                    compute += times * APPEND_COPIES[c.fills] * filled / bandwidth
            if w > 1:  # all-gathers (forward, backward) and reduce-scatters
                comm += times * s.numel * 2 * (w - 1) / w / comm_bw * (3 if grad else 1)
            if self.context > 1:  # Ulysses: q, k, v and the output, (tokens, dim) bf16 a layer
                sent = 4 * s.num_layers * tokens * s.dim * 2 * (self.context - 1) / self.context
                all_to_all += times * passes * sent / comm_bw
            # a forward's largest buffers: the up-projection and GELU outputs (bf16); a cached
            # call's also concatenates and rotates the keys (2 + 2 + 6 bytes)
            forward = max(forward, 4.0 * tokens * s.ffn_dim + 8.0 * tokens * s.dim + 10.0 * cached)
            if not grad:
                continue
            block = self.saved(tokens)
            acts += c.count * block * self.on_gpu
            if c.keys is not None:  # the rotary tables its checkpoint keeps
                acts += c.count * _ROTARY_SAVED_BYTES * n * k * s.head_dim
            offload += times * 2 * self.offloaded * block / (t.host_bandwidth * 1e9)
            # a backward's: the hidden stream's and feed-forward's gradients (fitted)
            buffers = 8.0 * tokens * (s.dim + s.ffn_dim) + CACHED_TRANSIENT_BYTES * cached
            transient = max(transient, buffers + self.lora_casts(tokens))
            if self.roles[c.role].trained:
                trained.add(c.role)
        held_grads = 0.0
        if phase.repeat > 1:  # earlier micro-batches' gradients, accumulated
            held_grads = sum(self.roles[r].gradients for r in phase.accumulates)
        base = static + phase.held + held_grads + self.gathered
        peak = base + acts + forward + phase.transient
        peak_transient = forward
        if trained:  # one backward: the activations go as the gradients come (unless the
            # gradients are held from earlier micro-batches already)
            grads = sum(self.roles[r].gradients for r in trained)
            backward = base + (acts if held_grads else max(acts, grads)) + transient
            if backward >= peak:
                peak, peak_transient = backward, transient
        return _Cost(
            floor, recompute, compute, offload, comm, all_to_all, peak, acts,
            peak_transient + self.gathered,
        )  # fmt: skip


def plan_run(
    recipe: str,
    options: Any,
    *,
    nproc: int = 1,
    nodes: int = 1,
    kernels: KernelTable | str | None = None,
    context: int | None = None,
    _shape: ModelShape | None = None,
    _benchmark: bool = False,
) -> RunPlan:
    """Plan a run: its memory and step time per GPU, without allocating it.

    Args:
        recipe: A shipped recipe's name.
        options: The recipe's resolved options (:func:`fvstep.recipes.config.parse_options`).
        nproc: GPUs a node (FSDP2 over all of them when more than one).
        kernels: A :class:`KernelTable`, a shipped table's name or a calibrated table's
            file (default: the H200's).
        context: The context-parallel degree (Ulysses), the rest data parallel (default:
            ``options.parallel.context`` where the options have it, else 1).

    Raises:
        ValueError: For a recipe it does not know, a world size below 1, a context degree
            that does not divide the world, or context parallel where the run cannot have
            it (a causal student; compiled blocks).
    """
    if recipe not in RECIPES:
        raise ValueError(f"fvstep plan knows the recipes {', '.join(RECIPES)}, not {recipe!r}")
    if nproc < 1 or nodes < 1:
        raise ValueError(f"--nproc and --nodes must be >= 1, got {nproc} and {nodes}")
    world = nproc * nodes
    cp = context if context is not None else getattr(options.parallel, "context", 1)
    if cp < 1 or world % cp:
        raise ValueError(f"the context-parallel degree {cp} must divide the {world} GPU(s)")
    if cp > 1 and recipe in _CAUSAL_RECIPES:
        raise ValueError(
            f"{recipe}'s causal student cannot be context-parallel (fvstep.methods.causal_wan "
            "refuses it: its KV cache follows the whole sequence)"
        )
    if cp > 1 and options.prepare.compile:
        raise ValueError(
            "context parallel runs eagerly (fvstep.parallel.prepare refuses compile with a "
            "context mesh): plan it with --prepare.compile false"
        )
    table = kernels if isinstance(kernels, KernelTable) else load_kernel_table(kernels)
    shape = _shape or _shape_for(options.model)
    if recipe in ("finetune", "lora_dmd2"):  # what the build would refuse, refused here
        from fvstep.recipes.parts import check_lora, check_lora_targets

        check_lora(options, required=recipe != "finetune")
        if _is_lora(recipe, options):
            kinds = {n: "Conv3d" if n in shape.convs else "Linear" for n, _, _ in shape.linears}
            check_lora_targets(kinds, options.lora.targets)
    prepare, data = options.prepare, options.data
    compute = _compute(options)
    batch, micro = data.batch_size, options.run.microbatches
    _, frames, height, width = data.latent_shape
    pf, ph, pw = shape.patch
    frame_tokens = (height // ph) * (width // pw)
    video = (frames // pf) * frame_tokens
    roles = _roles(recipe, options, shape, world)
    if _benchmark and recipe == "diffusion_nft":  # benchmarks.realshape: the old policy frozen
        nbytes = 2 if compute == "bf16" else 4
        roles = [
            attrs.evolve(r, weights=_stored_bytes(shape, nbytes) / world, note="frozen (the benchmark's)")
            if r.name == "old" else r
            for r in roles
        ]  # fmt: skip
    lora = None
    if _is_lora(recipe, options):
        _, layers, fan_in = _lora_numel(shape, options.lora.rank, options.lora.targets)
        lora = (layers, fan_in, options.lora.rank)
    # the causal recipes keep the KV cache in the student's compute dtype
    cache_dtype = 2 if compute == "bf16" else _model_bytes(options)
    # one sample's KV cache a latent frame: keys and values of every layer
    cache_frame = 2.0 * shape.num_layers * frame_tokens * shape.dim * cache_dtype
    planner = _Planner(
        shape, table, prepare, compute, {r.name: r for r in roles}, world, nodes, cp, video,
        frames // pf, data.text_shape[0], cache_frame,
        fp32_weights=world == 1 and options.model.dtype == "float32" and lora is None,
        lora=lora,
    )  # fmt: skip
    static = sum(r.static for r in roles)
    bandwidth = table.memory_bandwidth * 1e9
    steps = []
    for name, kind in _step_kinds(recipe, options, planner).items():
        costs = [planner.phase(phase, static) for phase in kind.phases]
        top = max(costs, key=lambda c: c.peak)
        total = {f: sum(getattr(c, f) for c in costs) for f in attrs.fields_dict(_Cost)}
        optimizer = sum(  # the fused AdamW: 36 bytes a parameter, each optimizer step
            count * planner.roles[role].numel * 36.0 / world / bandwidth
            for role, count in kind.updates
        )
        if recipe == "diffusion_nft":  # the soft update: old = eta old + (1 - eta) student
            optimizer += (
                4 * planner.roles["old"].weights + planner.roles["student"].weights
            ) / bandwidth
        seconds = max(total["compute"], total["offload"], total["comm"])
        seconds += total["all_to_all"] + optimizer
        calls = tuple((c.role, c.kind) for p in kind.phases for c in p.calls)
        held = max(phase.held for phase in kind.phases)
        steps.append(
            StepPlan(
                name, calls, top.activations, top.transient, top.peak, total["floor"],
                total["recompute"], seconds, kind.share, held,
            )
        )  # fmt: skip
    settings = {
        "compute": compute, "checkpointing": prepare.checkpointing,
        "checkpoint_every": prepare.checkpoint_every,
        "offload": prepare.offload_activations_every, "compile": prepare.compile,
        "budget": prepare.compile_memory_budget, "batch": batch, "microbatches": micro,
    }  # fmt: skip
    cache = None
    if recipe in _CAUSAL_RECIPES:
        if recipe == "self_forcing":  # a micro-batch's rollout, over the whole video
            capacity, samples = planner.frames, batch / micro
        else:  # the stream's, over the rank's batch
            capacity, samples = options.window_frames + options.sink_frames, batch
        cache = (samples * capacity * planner.cache_frame, capacity, cache_dtype)
    return RunPlan(
        recipe, world, shape, video, data.text_shape[0], tuple(roles),
        planner.saved(batch / micro * video / cp), planner.on_gpu, tuple(steps), table,
        planner.backend, table.memory_gib * GIB, _MARGIN, settings, cp, cache,
    )  # fmt: skip


# ------------------------------------------------------------------ suggestions


@attrs.frozen
class Suggestion:
    """A change that makes a run fit (its flags: ``--prepare.checkpointing narrow``), and
    the re-planned run."""

    change: str
    plan: RunPlan


def suggest_changes(
    recipe: str,
    options: Any,
    *,
    nproc: int = 1,
    nodes: int = 1,
    kernels: KernelTable | str | None = None,
    limit: int = 5,
    context: int | None = None,
) -> list[Suggestion]:
    """Changes that make a run fit, fastest first: checkpointing and offloading, LoRA,
    context parallel over 2, 4 or 8 of a node's GPUs, more GPUs; each re-planned with
    :func:`plan_run` (whose arguments these are).

    Args:
        limit: At most this many.

    Returns:
        The changes that fit: those on the same GPUs first, then by predicted step time
        (times the context-parallel degree: GPU-seconds a sample), then by fewer changes.

    Examples:
        >>> for s in suggest_changes("dmd2", options):  # doctest: +SKIP
        ...     print(f"{s.plan.mean_seconds:.2f} s  {s.change}")
    """
    table = kernels if isinstance(kernels, KernelTable) else load_kernel_table(kernels)
    shape = _shape_for(options.model)  # once: every plan below reuses it
    found: list[tuple[float, int, Suggestion]] = []
    cp_now = context if context is not None else getattr(options.parallel, "context", 1)

    def consider(change: str, rec: str, opts: Any, n: int, m: int, cost: int, cp: int) -> None:
        try:
            plan = plan_run(rec, opts, nproc=n, nodes=m, kernels=table, context=cp, _shape=shape)
        except ValueError:
            return
        if plan.fits:  # a context group's GPUs share its samples: its time a sample
            found.append((plan.mean_seconds * plan.context, cost, Suggestion(change, plan)))

    layouts = [(nproc, nodes)]
    for more in (2, 4, 8):
        n, m = min(nproc * more, 8), nodes * max(1, nproc * more // 8)
        if n * m > nproc * nodes and (n, m) not in layouts:
            layouts.append((n, m))
    prepare = options.prepare
    modes = ("none", "selective", "narrow", "attention", "full")
    for n, m in layouts:
        # plan_run refuses a context-parallel causal student
        degrees = [cp_now, *(d for d in (2, 4, 8) if d != cp_now and d <= n and n % d == 0)]
        for cp, mode, offload in itertools.product(degrees, modes, (0, 4, 2, 1)):
            flags = []
            if mode != prepare.checkpointing:
                flags.append(f"--prepare.checkpointing {mode}")
            if offload != prepare.offload_activations_every:
                flags.append(f"--prepare.offload_activations_every {offload}")
            if (n, m) != (nproc, nodes):
                flags.append(f"--nproc {n}" + (f" --nodes {m}" if m > 1 else ""))
            changes: dict[str, Any] = {
                "prepare.checkpointing": mode,
                "prepare.offload_activations_every": offload,
            }
            if cp != cp_now:
                flags.append(f"--context {cp} (each sample over {cp} GPUs)")
                if cp > 1 and prepare.compile:  # context parallel runs eagerly
                    flags.append("--prepare.compile false")
                    changes["prepare.compile"] = False
            if flags:
                opts = _options_with(options, **changes)
                consider(" ".join(flags), recipe, opts, n, m, len(flags), cp)
    if recipe == "finetune" and not options.lora.rank:
        opts = _options_with(options, **{"lora.rank": 64, "lora.alpha": 64})
        consider("--lora.rank 64 --lora.alpha 64", recipe, opts, nproc, nodes, 2, cp_now)
    if recipe == "dmd2":
        from fvstep.recipes.lora_dmd2 import LoRADMD2Options

        fields = {f.name for f in dataclasses.fields(LoRADMD2Options)}
        lora = LoRADMD2Options(**{k: v for k, v in vars(options).items() if k in fields})
        consider(
            "fvstep train lora_dmd2 (the same options)", "lora_dmd2", lora, nproc, nodes, 3, cp_now
        )
    found.sort(key=lambda x: (x[2].plan.world, round(x[0], 2), x[1]))  # GPUs cost most
    return [s for _, _, s in found[:limit]]
