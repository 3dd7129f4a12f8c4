"""Plan before you allocate: a run's memory and step time from its config, on the meta device.

:func:`plan_run` takes a recipe's resolved options (``finetune``, ``dmd2``, ``lora_dmd2``)
and the process layout, builds the transformer on the ``meta`` device (no weights, no
GPU), and says, per GPU:

- **static** memory per role: the stored weights (fp32 masters of a trained role, the
  frozen dtype of a frozen one, LoRA adapters in fp32), AdamW's two fp32 moments, an
  fp32 EMA copy, and the fp32 gradients of each trained parameter; FSDP2 divides all of
  them by the world size;
- **saved activations** per block under the chosen checkpointing, a model of bytes per
  token (:data:`SAVED_BYTES_PER_TOKEN`, measured on a CPU Wan block op by op,
  ``tests/test_planning.py``) with Inductor's partitioner folded in for compiled
  blocks without checkpointing (:data:`COMPILED_NONE_FRACTION`, from the measured H200
  rows); offloading removes every n-th block's from the GPU (one block in flight back);
- the **largest transient** of a backward (a block's gradient buffers, the gathered
  parameters of FSDP2's two blocks in flight) and the **predicted peak** (what
  ``torch.cuda.max_memory_allocated`` reports), walked pass by pass for each kind of
  step of the method;
- the **step time**: the model FLOPs of each call (attention and every linear layer),
  times the method's calls (no grad, frozen under grad, trained), plus what the
  checkpointing recomputes, at the kernel rates of a :class:`KernelTable` (shipped for
  the H200 from ``docs/benchmarks.md``; ``fvstep plan --calibrate`` measures one), plus
  the element-wise work the floor counts as free (:attr:`KernelTable.elementwise`) and
  the optimizer; and the fraction of the floor that is.

:func:`suggest_changes` re-plans a run that does not fit under cheaper settings
(checkpointing, offloading, LoRA, more GPUs) and ranks those that fit by step time.
``docs/plan.md`` says what the model leaves out; ``docs/benchmarks.md`` compares it with
the measured rows.

Examples:
    >>> from fvstep.recipes import get_recipe
    >>> from fvstep.recipes.config import parse_options
    >>> recipe = get_recipe("finetune")
    >>> options = parse_options(recipe, ["--config", "examples/wan2.1_1.3b_finetune.yaml"])
    >>> plan = plan_run(recipe.name, options)
    >>> print(plan.format())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

__all__ = [
    "COMPILED_NONE_FRACTION",
    "KERNEL_TABLES",
    "SAVED_BYTES_PER_TOKEN",
    "KernelTable",
    "ModelShape",
    "RolePlan",
    "RunPlan",
    "StepPlan",
    "Suggestion",
    "block_saved_bytes",
    "calibrate_kernels",
    "forward_flops",
    "load_kernel_table",
    "meta_transformer",
    "plan_run",
    "suggest_changes",
]

GIB = 2**30
PLANNED_RECIPES = ("finetune", "dmd2", "lora_dmd2")
"""The recipes :func:`plan_run` knows the roles and calls of."""


# ------------------------------------------------------------------ kernels


@attrs.frozen
class KernelTable:
    """What one GPU does per second: the rates a step's time is predicted from.

    Attributes:
        name: What it describes (``"h200"``, or the device a calibration ran on).
        memory_gib: The GPU's memory (what ``torch.cuda.get_device_properties`` reports).
        attention_forward: Self-attention forward, TFLOP/s, by backend (``"cudnn"``:
            PyTorch's fastest SDPA kernel; ``"fa4"``: FlashAttention-4).
        attention_forward_backward: Forward + backward, TFLOP/s (backward counted 2.5x
            the forward, FlashAttention's count), by backend.
        gemm: bf16 GEMMs at the model's shapes, TFLOP/s.
        memory_bandwidth: HBM GB/s an element-wise kernel (the fused AdamW) reaches.
        host_bandwidth: Host <-> GPU GB/s of pinned copies (activation offloading).
        interconnect: GB/s per GPU of collectives within a node (FSDP2).
        network: GB/s per GPU of collectives across nodes.
        elementwise: The step time beyond the kernel floor, as a fraction of it (norms,
            modulation, rotary, GELU: what the floor counts as free).
        source: Where the numbers come from.
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
    source: str = ""

    def to_json(self) -> str:
        """The table as JSON (what :func:`load_kernel_table` reads)."""
        return json.dumps(attrs.asdict(self), indent=2)


KERNEL_TABLES: dict[str, KernelTable] = {
    "h200": KernelTable(
        name="h200",
        memory_gib=139.8,
        attention_forward={"cudnn": 567.0, "fa4": 718.0},
        attention_forward_backward={"cudnn": 538.0, "fa4": 645.0},
        gemm=700.0,
        source="one H200, torch 2.11, at 32,760 tokens (docs/benchmarks.md: cuDNN "
        "538 TFLOP/s forward+backward, FA4 645, the model's bf16 GEMMs 647-729)",
    ),
    "h100": KernelTable(
        name="h100",
        memory_gib=79.6,
        attention_forward={"cudnn": 567.0, "fa4": 718.0},
        attention_forward_backward={"cudnn": 538.0, "fa4": 645.0},
        gemm=700.0,
        memory_bandwidth=2200.0,
        source="the H200's kernel rates (same SMs and clocks; not measured on an H100) "
        "with the H100's 80 GB and HBM3 bandwidth",
    ),
}
"""The shipped kernel tables, by name (``fvstep plan --kernels h200``)."""


def load_kernel_table(name_or_path: str | None) -> KernelTable:
    """A shipped kernel table by name, or one written by ``fvstep plan --calibrate``.

    Args:
        name_or_path: ``"h200"``, ``"h100"``, a JSON file, or ``None`` (the H200's).

    Returns:
        The table.

    Raises:
        ValueError: If it is neither a shipped name nor a readable table.

    Examples:
        >>> load_kernel_table("h200").attention_forward_backward["fa4"]
        645.0
    """
    if name_or_path is None:
        return KERNEL_TABLES["h200"]
    if name_or_path in KERNEL_TABLES:
        return KERNEL_TABLES[name_or_path]
    try:
        return KernelTable(**json.loads(Path(name_or_path).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"--kernels {name_or_path!r} is neither {' nor '.join(KERNEL_TABLES)} nor a "
            f"kernel table written by `fvstep plan --calibrate` ({e})"
        ) from None


def _median_seconds(fn: Any, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate_kernels(
    shape: ModelShape,
    *,
    device: torch.device | str = "cuda",
    tokens: int | None = None,
    repeats: int = 5,
) -> KernelTable:
    """Measure this machine's attention and GEMM rates at ``shape``'s sizes.

    Self-attention (``scaled_dot_product_attention``, PyTorch's default backend choice,
    bf16 on CUDA, fp32 elsewhere) forward and forward + backward, and the feed-forward
    up-projection's GEMM, each the median of ``repeats`` calls after a warm-up.
    FlashAttention-4's rate is not measured (it is the H200 table's, scaled by the
    measured PyTorch rate); the other fields are the H200 table's.

    Args:
        shape: The model (its heads, head dim and FFN width).
        device: Where to measure.
        tokens: Sequence length (default: 32,760 on CUDA, 512 elsewhere).
        repeats: Timed calls per kernel.

    Returns:
        The measured table, named after the device.

    Examples:
        >>> table = calibrate_kernels(shape, device="cpu", tokens=64, repeats=1)
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t = tokens or (32760 if cuda else 512)
    h, d = shape.num_heads, shape.head_dim
    q, k, v = (
        torch.randn(1, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward() -> None:
        with torch.no_grad():
            sdpa(q, k, v)

    def both() -> None:
        out = sdpa(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    flops = 4.0 * t * t * h * d
    attention_f = flops / _median_seconds(forward, device, repeats) / 1e12
    attention_fb = 3.5 * flops / _median_seconds(both, device, repeats) / 1e12
    x = torch.randn(t, shape.dim, device=device, dtype=dtype)
    w = torch.randn(shape.ffn_dim, shape.dim, device=device, dtype=dtype)
    gemm = 2.0 * t * shape.dim * shape.ffn_dim / _median_seconds(lambda: x @ w.t(), device, 3)
    base = KERNEL_TABLES["h200"]
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
        source=f"measured by fvstep plan --calibrate on {name} at {t} tokens",
    )


# ------------------------------------------------------------------ the model


@attrs.frozen
class ModelShape:
    """The sizes of a Wan transformer the plan needs, read from its meta module.

    Attributes:
        num_layers: Transformer blocks.
        dim: Hidden width (heads x head dim).
        num_heads: Attention heads.
        head_dim: Head dimension.
        ffn_dim: Feed-forward width.
        patch: ``(frames, height, width)`` patch size.
        numel: Parameters of the whole model.
        block_numel: Parameters of one block.
        block_linear_numel: Weights of one block's linear layers.
        linears: ``(name, fan_in, fan_out)`` of every linear layer (and the patch
            embedding, a linear map per token).
    """

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

    @classmethod
    def of(cls, module: nn.Module) -> ModelShape:
        """The shape of a (meta or real) ``WanTransformer3DModel``."""
        cfg: Any = module.config
        block: Any = module.blocks[0]  # type: ignore[index]
        linears = tuple(
            (name, m.weight[0].numel(), m.weight.shape[0])
            for name, m in module.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv3d))
        )
        return cls(
            num_layers=cfg.num_layers,
            dim=cfg.num_attention_heads * cfg.attention_head_dim,
            num_heads=cfg.num_attention_heads,
            head_dim=cfg.attention_head_dim,
            ffn_dim=cfg.ffn_dim,
            patch=tuple(cfg.patch_size),
            numel=sum(p.numel() for p in module.parameters()),
            block_numel=sum(p.numel() for p in block.parameters()),
            block_linear_numel=sum(
                m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)
            ),
            linears=linears,
        )


def meta_transformer(model: Any) -> nn.Module:
    """The transformer of a recipe's ``ModelOptions``, built on the ``meta`` device.

    The config of ``model.path`` (a transformer folder, or a pipeline's ``transformer/``),
    else ``model.config``, else the tiny Wan of ``model.tiny``; no weights are read and
    nothing is allocated.

    Args:
        model: A :class:`fvstep.recipes.options.ModelOptions`.

    Returns:
        The module, its parameters on ``meta``.

    Raises:
        ValueError: If ``model.path`` holds no ``config.json``.

    Examples:
        >>> meta_transformer(ModelOptions()).blocks[0].ffn.net[2].weight.device
        device(type='meta')
    """
    import diffusers

    if model.path is not None:
        folder = Path(model.path)
        config_file = folder / "transformer" / "config.json"
        if not config_file.is_file():
            config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model.path {model.path!r} holds no transformer config.json")
        config = json.loads(config_file.read_text())
    elif model.config is not None:
        config = json.loads(Path(model.config).read_text())
    else:
        tiny = model.tiny
        config = {
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
    cls = getattr(diffusers, config.get("_class_name", "WanTransformer3DModel"))
    with torch.device("meta"):
        built: nn.Module = cls.from_config(config)
        return built


def _tokens_of(name: str, video: int, text: int) -> int:
    """How many tokens per sample a linear layer of a Wan transformer acts on."""
    if name.startswith("condition_embedder.text_embedder"):
        return text
    if name.startswith("condition_embedder.time"):
        return 1
    if ".attn2." in name and name.rsplit(".", 1)[-1] in ("to_k", "to_v"):
        return text  # cross-attention keys and values are projections of the text
    return video


def forward_flops(shape: ModelShape, video: int, text: int) -> tuple[float, float, float]:
    """FLOPs of one sample's forward: ``(self-attention, cross-attention, linear layers)``.

    ``2 * weights * tokens`` for each linear layer (the tokens it acts on), ``4 * T^2 * D``
    per layer for self-attention (``QK^T`` and ``AV``) and ``4 * T * L * D`` for
    cross-attention; norms and element-wise ops are not counted (``benchmarks/analytic.py``
    counts the same, times 3 for forward + backward).

    Args:
        shape: The model.
        video: Video tokens ``T`` a sample.
        text: Text tokens ``L`` a sample.

    Returns:
        The three FLOP counts.

    Examples:
        >>> sum(forward_flops(shape, 32760, 512)) / 1e12  # Wan2.1-1.3B, 480x832x81
        283.0...
    """
    linear = sum(
        2.0 * fan_in * fan_out * _tokens_of(n, video, text) for n, fan_in, fan_out in shape.linears
    )
    self_attention = 4.0 * shape.num_layers * video * video * shape.dim
    cross_attention = 4.0 * shape.num_layers * video * text * shape.dim
    return self_attention, cross_attention, linear


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
"""Bytes a Wan block keeps for its backward, per video token, by checkpointing and compute
dtype (bf16 autocast over fp32 masters, or fp32): ``a * dim + b * ffn_dim + c * heads``.
Read off the op list of ``WanTransformerBlock.forward`` and measured on CPU blocks of
several widths (``tests/test_planning.py`` re-measures them): ``full`` keeps the block's
input (the bf16 hidden stream), ``attention`` adds the two attention outputs and their
log-sum-exp, ``narrow`` every matmul that does not widen, ``selective`` the up-projection
too, ``none`` everything (norm outputs, modulations, q/k/v before and after the norms and
rotary, GELU's input and output)."""

COMPILED_NONE_FRACTION: tuple[tuple[float, float], ...] = ((0.65, 0.289), (1.0, 0.375))
"""Compiled blocks without checkpointing: Inductor's min-cut partitioner keeps less than
eager, as a fraction of eager's ``none`` bytes, by ``compile_memory_budget`` (the
fraction of the first row whose budget is above the given one; ``None``: torch's default,
:data:`COMPILED_DEFAULT_FRACTION`). Fitted to the measured H200 fine-tune rows: budget
0.5 and 0.6 gave 56.3 GiB, 0.65-0.8 gave 67.6 GiB (the partitioner's budget has cliffs,
not a slope)."""

COMPILED_DEFAULT_FRACTION = 0.65
"""Compiled blocks, no checkpointing, torch's default budget: fitted to ``fvstep train``'s
89.4 GiB fine-tune on one H200 (offload every 4th block, EMA)."""


def block_saved_bytes(
    shape: ModelShape,
    tokens: int,
    *,
    checkpointing: str,
    compute: str = "bf16",
    compiled: bool = False,
    memory_budget: float | None = None,
    fp32_weights: bool = True,
) -> float:
    """Bytes one Wan block keeps for its backward (:data:`SAVED_BYTES_PER_TOKEN`).

    Args:
        shape: The model.
        tokens: Video tokens of the micro-batch (all its samples).
        checkpointing: ``"none"``, ``"full"``, ``"selective"``, ``"attention"``, ``"narrow"``.
        compute: ``"bf16"`` (autocast or FSDP2's bf16 parameters) or ``"fp32"``.
        compiled: Whether the block is compiled (changes ``"none"`` only: the
            partitioner's choice, :data:`COMPILED_NONE_FRACTION`).
        memory_budget: Inductor's activation memory budget (compiled ``"none"`` only).
        fp32_weights: Whether bf16 compute casts fp32 weights (one process under
            autocast: the casts are kept for the backward under ``"none"``).

    Returns:
        The bytes.

    Examples:
        >>> block_saved_bytes(shape, 32760, checkpointing="narrow") / 2**30  # 1.3B
        0.94...
    """
    a, b, c = SAVED_BYTES_PER_TOKEN[(checkpointing, compute)]
    per_token = a * shape.dim + b * shape.ffn_dim + c * shape.num_heads
    saved = per_token * tokens
    if checkpointing == "none":
        if compute == "bf16" and fp32_weights:
            saved += 2.0 * shape.block_linear_numel  # autocast's bf16 copies of the weights
        if compiled:
            fraction = COMPILED_DEFAULT_FRACTION
            if memory_budget is not None and memory_budget < 1.0:
                fraction = next(f for limit, f in COMPILED_NONE_FRACTION if memory_budget < limit)
            saved *= fraction
    return saved


def _transient_bytes(shape: ModelShape, tokens: int) -> float:
    """The largest short-lived buffers of a block's backward: the gradients of its hidden
    stream and feed-forward activations (fp32 and bf16), 8 bytes per token per
    ``dim + ffn_dim`` (fitted to the measured fine-tune rows: 2.4-3.5 GiB at 1.3B)."""
    return 8.0 * tokens * (shape.dim + shape.ffn_dim)


def _forward_transient_bytes(shape: ModelShape, tokens: int) -> float:
    """A no-grad forward's largest buffers: the up-projection and GELU outputs (bf16)."""
    return 4.0 * tokens * shape.ffn_dim + 8.0 * tokens * shape.dim


# ------------------------------------------------------------------ roles and calls


@attrs.frozen
class RolePlan:
    """One role's static bytes per GPU.

    Attributes:
        name: The role.
        trained: Whether an optimizer steps it.
        numel: Its parameters (a LoRA role: its adapters).
        weights: Stored weights (fp32 masters when trained).
        gradients: fp32 gradients (trained roles).
        optimizer: AdamW's two fp32 moments.
        ema: An fp32 EMA copy.
        note: How it is stored.
    """

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


@attrs.frozen
class _Call:
    role: str
    kind: str  # "no_grad", "frozen" (gradient to its input only), "trained"


_CALLS: dict[str, dict[str, tuple[_Call, ...]]] = {
    "finetune": {"student": (_Call("student", "trained"),)},
    "dmd2": {
        "critic-only": (_Call("student", "no_grad"), _Call("critic", "trained")),
        "student+critic": (
            _Call("student", "trained"),
            _Call("teacher", "no_grad"),
            _Call("teacher", "no_grad"),
            _Call("critic", "no_grad"),
            _Call("critic", "trained"),
        ),
    },
}
"""Each method's model calls per kind of step (``benchmarks/floor.py``'s ``STEPS``): DMD2's
critic-only step rolls the student out without grad and trains the critic; its
student+critic step trains the student through the teacher's two guidance calls and the
critic's fake score (no grad), then trains the critic. In the ``fused`` ordering both
trained calls' activations are alive together (one backward)."""


def _is_lora(recipe: str, options: Any) -> bool:
    """Whether the trained roles are LoRA adapters over one frozen base."""
    return recipe == "lora_dmd2" or (recipe == "finetune" and options.lora.rank > 0)


def _step_kinds(recipe: str, options: Any) -> dict[str, tuple[_Call, ...]]:
    """The kinds of step of the recipe's method, keyed as :func:`fvstep.plan` names them."""
    from fvstep.core.steps import plan as step_plan

    if recipe == "finetune":
        from fvstep.methods import finetune

        method: Any = finetune()
    else:
        from fvstep.methods import dmd2

        method = dmd2(generator_update_interval=options.generator_update_interval)
    interval = getattr(options, "generator_update_interval", 1)
    kinds: dict[str, tuple[_Call, ...]] = {}
    table = _CALLS["finetune" if recipe == "finetune" else "dmd2"]
    for i in range(interval):
        roles = {r for entry in step_plan(method, i) for r in entry.roles}
        key = (
            "student"
            if recipe == "finetune"
            else ("student+critic" if "student" in roles else "critic-only")
        )
        calls = table[key]
        if _is_lora(recipe, options):  # the base runs under grad for the adapters: frozen
            calls = tuple(_Call(c.role, "frozen" if c.kind == "trained" else c.kind) for c in calls)
        kinds.setdefault(key, calls)
    return kinds


def _lora_numel(module: nn.Module, rank: int, targets: Sequence[str]) -> tuple[int, int, int]:
    """``(adapter parameters, adapted layers on video tokens a block, their fan-in a
    block)`` of one adapter (peft's rule: a module whose name is a target or ends with
    ``.target``; blocks 0's layers stand for every block's)."""
    numel, layers, fan_in = 0, 0, 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            numel += rank * (m.in_features + m.out_features)
            if name.startswith("blocks.0.") and _tokens_of(name, 1, 0):
                layers, fan_in = layers + 1, fan_in + m.in_features
    return numel, layers, fan_in


def _roles(
    recipe: str, options: Any, shape: ModelShape, module: nn.Module, world: int
) -> list[RolePlan]:
    prepare = options.prepare
    bf16 = _compute(options) == "bf16"
    frozen_bytes = (
        2
        if (
            prepare.frozen_dtype in ("bfloat16", "float16")
            or (prepare.frozen_dtype is None and bf16)
        )
        else 4
    )
    model_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[options.model.dtype]
    ema = options.optim.ema is not None

    tensors = len(list(module.parameters()))
    counters = 4.0 * tensors + 8.0  # AdamW's fp32 step a tensor and its int64 count

    def trained(name: str, numel: int, with_ema: bool, note: str) -> RolePlan:
        return RolePlan(
            name, True, numel,
            weights=numel * model_bytes / world,
            gradients=numel * model_bytes / world,
            optimizer=numel * 2 * model_bytes / world + counters,
            ema=numel * 4 / world + 1 if with_ema else 0.0,  # and its bool "initialized"
            note=note,
        )  # fmt: skip

    def frozen(name: str, note: str) -> RolePlan:
        return RolePlan(name, False, shape.numel, shape.numel * frozen_bytes / world, 0, 0, 0, note)

    master = f"{'fp32' if model_bytes == 4 else options.model.dtype} masters, AdamW"
    frozen_note = f"frozen, {'bf16' if frozen_bytes == 2 else 'fp32'}"
    if recipe == "finetune" and not _is_lora(recipe, options):
        return [trained("student", shape.numel, ema, master + (", EMA" if ema else ""))]
    if recipe == "dmd2":
        return [
            trained("student", shape.numel, ema, master + (", EMA" if ema else "")),
            frozen("teacher", frozen_note),
            trained("critic", shape.numel, False, master),
        ]
    lora = options.lora
    numel, _, _ = _lora_numel(module, lora.rank, lora.targets)
    adapted = sum(
        1 for n, m in module.named_modules()
        if isinstance(m, nn.Linear) and any(n == t or n.endswith("." + t) for t in lora.targets)
    )  # fmt: skip
    note = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}, fp32, AdamW"

    def adapter(name: str, with_ema: bool) -> RolePlan:
        return RolePlan(
            name, True, numel, numel * 4 / world, numel * 4 / world,
            numel * 8 / world + 4.0 * 2 * adapted + 8.0,
            numel * 4 / world + 1 if with_ema else 0.0, note + (", EMA" if with_ema else ""),
        )  # fmt: skip

    if recipe == "finetune":
        return [adapter("student", ema), frozen("base", frozen_note)]
    return [
        adapter("student", ema),
        frozen("teacher", frozen_note + " (the one base)"),
        adapter("critic", False),
    ]


def _compute(options: Any) -> str:
    precision = options.prepare.precision
    if precision == "auto":
        return "fp32" if options.run.device == "cpu" else "bf16"
    return precision


# ------------------------------------------------------------------ the plan


@attrs.frozen
class StepPlan:
    """One kind of step of the method: its peak and its time.

    Attributes:
        name: ``"student"`` (fine-tune), ``"critic-only"``, ``"student+critic"``.
        calls: ``(role, kind)`` of each model call, in order.
        activations: The saved activations at the step's peak, bytes per GPU.
        transient: The largest transient at the peak, bytes.
        peak: Predicted ``max_memory_allocated``, bytes.
        floor: Seconds of the attention and GEMM kernels, no recomputation.
        recompute: Seconds the checkpointing recomputes.
        seconds: The predicted step time.
    """

    name: str
    calls: tuple[tuple[str, str], ...]
    activations: float
    transient: float
    peak: float
    floor: float
    recompute: float
    seconds: float


@attrs.frozen
class RunPlan:
    """A run's predicted memory and time per GPU (:func:`plan_run`).

    Attributes:
        recipe: The recipe.
        world: GPUs (``nproc * nodes``).
        shape: The model.
        video_tokens: Video tokens a sample.
        text_tokens: Text tokens a sample.
        roles: Static bytes per role.
        block_activations: Saved bytes of one block a trained call keeps.
        blocks_on_gpu: Blocks whose saved activations stay on the GPU.
        steps: Each kind of step.
        kernels: The kernel table used.
        attention_backend: ``"fa4"`` or ``"cudnn"``.
        capacity: The GPU's memory, bytes.
        margin: Bytes kept free for the allocator's fragmentation.
        settings: The preparation planned (checkpointing, offload, compile, budget).
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
        return sum(s.seconds for s in self.steps) / len(self.steps)

    def format(self) -> str:
        """The plan as the text ``fvstep plan`` prints."""
        gib = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
        s = self.settings
        lines = [
            f"fvstep plan: {self.recipe}, {self.shape.numel / 1e9:.2f} B parameters "
            f"({self.shape.num_layers} blocks, dim {self.shape.dim}, ffn {self.shape.ffn_dim}), "
            f"{self.video_tokens:,} video + {self.text_tokens} text tokens a sample, "
            f"batch {s['batch']} x {s['microbatches']} micro-batch(es), {self.world} GPU(s)",
            f"  preparation: {s['compute']} compute, checkpointing {s['checkpointing']}"
            f"{'' if s['checkpoint_every'] == 1 else ' every ' + str(s['checkpoint_every'])}, "
            f"offload every {s['offload'] or '-'}, compile {s['compile']}"
            f"{'' if s['budget'] is None else ' (budget ' + str(s['budget']) + ')'}, "
            f"attention {self.attention_backend}",
            "",
            "memory per GPU (GiB)       weights  optimizer      ema  gradients",
        ]
        for r in self.roles:
            lines.append(
                f"  {r.name:<10} {r.numel / 1e6:10.1f} M {gib(r.weights)} {gib(r.optimizer)} "
                f"{gib(r.ema)} {gib(r.gradients)}   {r.note}"
            )
        tot = [
            sum(getattr(r, k) for r in self.roles)
            for k in ("weights", "optimizer", "ema", "gradients")
        ]
        lines.append(f"  {'total':<23} {gib(tot[0])} {gib(tot[1])} {gib(tot[2])} {gib(tot[3])}")
        lines += [
            f"  saved activations: {self.block_activations / GIB:.3f} GiB a block a trained call, "
            f"{self.blocks_on_gpu} of {self.shape.num_layers} blocks kept on the GPU",
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
        group, _, field = key.partition(".")
        if field:
            options = dataclasses.replace(
                options, **{group: dataclasses.replace(getattr(options, group), **{field: value})}
            )
        else:
            options = dataclasses.replace(options, **{group: value})
    return options


def plan_run(
    recipe: str,
    options: Any,
    *,
    nproc: int = 1,
    nodes: int = 1,
    kernels: KernelTable | str | None = None,
    margin_gib: float = 2.0,
    _module: nn.Module | None = None,
) -> RunPlan:
    """Plan a run: its memory and step time per GPU, without allocating it.

    Args:
        recipe: ``"finetune"``, ``"dmd2"`` or ``"lora_dmd2"``.
        options: The recipe's resolved options (:func:`fvstep.recipes.config.parse_options`).
        nproc: GPUs a node (FSDP2 over all of them when more than one).
        nodes: Nodes.
        kernels: A :class:`KernelTable`, a shipped table's name or a calibrated table's
            file (default: the H200's).
        margin_gib: Memory kept free for the caching allocator's fragmentation.

    Returns:
        The :class:`RunPlan`.

    Raises:
        ValueError: For a recipe it does not know, or a world size below 1.

    Examples:
        >>> plan = plan_run("finetune", FinetuneOptions())
        >>> plan.fits
        True
    """
    if recipe not in PLANNED_RECIPES:
        raise ValueError(
            f"fvstep plan knows the recipes {', '.join(PLANNED_RECIPES)}, not {recipe!r}"
        )
    if nproc < 1 or nodes < 1:
        raise ValueError(f"--nproc and --nodes must be >= 1, got {nproc} and {nodes}")
    table = kernels if isinstance(kernels, KernelTable) else load_kernel_table(kernels)
    module = _module if _module is not None else meta_transformer(options.model)
    shape = ModelShape.of(module)
    world = nproc * nodes
    prepare, data = options.prepare, options.data
    compute = _compute(options)
    batch = data.batch_size
    _, frames, height, width = data.latent_shape
    pf, ph, pw = shape.patch
    video = (frames // pf) * (height // ph) * (width // pw)
    text = data.text_shape[0]
    tokens = video * batch
    roles = _roles(recipe, options, shape, module, world)
    by_name = {r.name: r for r in roles}
    lora = _is_lora(recipe, options)

    # activations of one block of a trained (or frozen-under-grad) call
    fp32_weights = world == 1 and options.model.dtype == "float32" and not lora
    block = block_saved_bytes(
        shape, tokens, checkpointing=prepare.checkpointing, compute=compute,
        compiled=prepare.compile, memory_budget=prepare.compile_memory_budget,
        fp32_weights=fp32_weights,
    )  # fmt: skip
    every = prepare.checkpoint_every
    if prepare.checkpointing != "none" and every > 1:  # the others keep everything
        plain = block_saved_bytes(
            shape, tokens, checkpointing="none", compute=compute, compiled=prepare.compile,
            memory_budget=prepare.compile_memory_budget, fp32_weights=fp32_weights,
        )  # fmt: skip
        chosen = math.ceil(shape.num_layers / every)
        block = (chosen * block + (shape.num_layers - chosen) * plain) / shape.num_layers
    lora_extra = lora_transient = 0.0
    if lora:  # peft casts each adapted layer's input to the fp32 adapter
        _, layers, fan_in = _lora_numel(module, options.lora.rank, options.lora.targets)
        lora_transient = tokens * (4.0 * fan_in + 4.0 * layers * options.lora.rank)
        if prepare.checkpointing == "none":  # checkpointed blocks recompute the casts
            lora_extra = lora_transient
    block_frozen = block + lora_extra
    offload = prepare.offload_activations_every
    offloaded = len(range(0, shape.num_layers, offload)) if offload else 0
    on_gpu = shape.num_layers - offloaded + (1 if offloaded else 0)  # one block in flight

    # time of one sample's calls
    self_f, cross_f, linear_f = forward_flops(shape, video, text)
    backend = "fa4" if prepare.flash_attention_4 else "cudnn"
    att_f = (self_f + cross_f) / (table.attention_forward[backend] * 1e12)
    att_fb = 3.5 * (self_f + cross_f) / (table.attention_forward_backward[backend] * 1e12)
    lin = linear_f / (table.gemm * 1e12)
    cost = {"no_grad": att_f + lin, "frozen": att_fb + 2 * lin, "trained": att_fb + 3 * lin}
    block_linear_f = sum(
        2.0 * i * o * _tokens_of(n, video, text)
        for n, i, o in shape.linears
        if n.startswith("blocks.")
    ) / (table.gemm * 1e12)
    up = 2.0 * shape.num_layers * video * shape.dim * shape.ffn_dim / (table.gemm * 1e12)
    recompute_one = {
        "none": 0.0, "selective": 0.0, "full": att_f + block_linear_f,
        "attention": block_linear_f, "narrow": up,
    }[prepare.checkpointing] * math.ceil(shape.num_layers / every) / shape.num_layers  # fmt: skip
    comm_bw = (table.network if nodes > 1 else table.interconnect) * 1e9

    transient = _transient_bytes(shape, tokens) + lora_transient
    gathered = 0.0
    if world > 1:  # FSDP2: two blocks' bf16 parameters gathered, one block's fp32 grads
        gathered = 2 * shape.block_numel * 2 + shape.block_numel * 4
    steps = []
    for name, calls in _step_kinds(recipe, options).items():
        grad_calls = [c for c in calls if c.kind != "no_grad"]
        acts = sum(block_frozen if c.kind == "frozen" or lora else block for c in grad_calls)
        acts *= on_gpu
        grads = sum(by_name[c.role].gradients for c in grad_calls)
        # one backward over the trained calls: the activations go as the gradients come
        peak_grad = max(acts, grads) + transient + gathered
        peak_fwd = acts + _forward_transient_bytes(shape, tokens) + gathered
        static = sum(r.static for r in roles)
        peak = static + max(peak_grad, peak_fwd)
        floor = batch * sum(cost[c.kind] for c in calls)
        recompute = batch * len(grad_calls) * recompute_one
        trained_numel = sum(by_name[c.role].numel for c in calls if c.kind != "no_grad")
        optimizer = trained_numel * 36.0 / world / (table.memory_bandwidth * 1e9)
        offload_bytes = 2 * offloaded * block * len(grad_calls)
        compute_s = (floor + recompute) * (1 + table.elementwise)
        copies = offload_bytes / (table.host_bandwidth * 1e9)
        comm = 0.0
        if world > 1:  # all-gathers (forward, backward) and reduce-scatters, overlapped
            per_call = shape.numel * 2 * (world - 1) / world / comm_bw
            comm = sum(per_call * (1 if c.kind == "no_grad" else 3) for c in calls)
        seconds = (max(compute_s, copies, comm) + optimizer) * options.run.microbatches
        steps.append(
            StepPlan(
                name,
                tuple((c.role, c.kind) for c in calls),
                acts,
                transient + gathered,
                peak,
                floor * options.run.microbatches,
                recompute * options.run.microbatches,
                seconds,
            )
        )
    settings = {
        "compute": compute, "checkpointing": prepare.checkpointing,
        "checkpoint_every": every, "offload": offload, "compile": prepare.compile,
        "budget": prepare.compile_memory_budget, "batch": batch,
        "microbatches": options.run.microbatches,
    }  # fmt: skip
    return RunPlan(
        recipe, world, shape, video, text, tuple(roles), block, on_gpu, tuple(steps), table,
        backend, table.memory_gib * GIB, margin_gib * GIB, settings,
    )  # fmt: skip


# ------------------------------------------------------------------ suggestions


@attrs.frozen
class Suggestion:
    """A change that makes a run fit, and its plan.

    Attributes:
        change: The flags that make it (``--prepare.checkpointing narrow``).
        plan: The re-planned run.
    """

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
) -> list[Suggestion]:
    """Changes that make a run fit, fastest first: checkpointing and offloading, LoRA
    (``--lora.rank 64`` of ``finetune``, ``dmd2`` -> ``lora_dmd2``), more GPUs; each
    re-planned with :func:`plan_run`.

    Args:
        recipe: The recipe.
        options: Its options.
        nproc: GPUs a node.
        nodes: Nodes.
        kernels: The kernel table.
        limit: At most this many.

    Returns:
        The changes that fit: those on the same GPUs first, then by predicted step time,
        then by fewer changed settings.

    Examples:
        >>> for s in suggest_changes("dmd2", options):  # doctest: +SKIP
        ...     print(f"{s.plan.mean_seconds:.2f} s  {s.change}")
    """
    module = meta_transformer(options.model)
    found: list[tuple[float, int, Suggestion]] = []

    def consider(change: str, rec: str, opts: Any, n: int, m: int, cost: int) -> None:
        try:
            plan = plan_run(rec, opts, nproc=n, nodes=m, kernels=kernels, _module=module)
        except ValueError:
            return
        if plan.fits:
            found.append((plan.mean_seconds, cost, Suggestion(change, plan)))

    layouts = [(nproc, nodes)]
    for more in (2, 4, 8):
        n, m = min(nproc * more, 8), nodes * max(1, nproc * more // 8)
        if n * m > nproc * nodes and (n, m) not in layouts:
            layouts.append((n, m))
    prepare = options.prepare
    for n, m in layouts:
        for mode in ("none", "selective", "narrow", "attention", "full"):
            for offload in (0, 4, 2, 1):
                flags = []
                if mode != prepare.checkpointing:
                    flags.append(f"--prepare.checkpointing {mode}")
                if offload != prepare.offload_activations_every:
                    flags.append(f"--prepare.offload_activations_every {offload}")
                if (n, m) != (nproc, nodes):
                    flags.append(f"--nproc {n}" + (f" --nodes {m}" if m > 1 else ""))
                if not flags:
                    continue
                opts = _options_with(
                    options,
                    **{"prepare.checkpointing": mode, "prepare.offload_activations_every": offload},
                )
                consider(" ".join(flags), recipe, opts, n, m, len(flags))
    if recipe == "finetune" and not options.lora.rank:
        opts = _options_with(options, **{"lora.rank": 64, "lora.alpha": 64})
        consider("--lora.rank 64 --lora.alpha 64", recipe, opts, nproc, nodes, 2)
    if recipe == "dmd2":
        from fvstep.recipes.lora_dmd2 import LoRADMD2Options

        fields = {f.name for f in dataclasses.fields(LoRADMD2Options)}
        lora = LoRADMD2Options(**{k: v for k, v in vars(options).items() if k in fields})
        consider("fvstep train lora_dmd2 (the same options)", "lora_dmd2", lora, nproc, nodes, 3)
    found.sort(key=lambda x: (x[2].plan.world, round(x[0], 2), x[1]))  # GPUs cost most
    return [s for _, _, s in found[:limit]]
