"""The typed options of the shipped recipes: one dataclass per concern, shared by all.

A recipe's options subclass :class:`RecipeOptions` (``FinetuneOptions.model.path``,
``.optim.lr``, ...); :mod:`fvstep.recipes.config` parses them and says which keys a resumed
run may change. Each field's entry under ``Attributes`` is its help text.

Examples:
    >>> ModelOptions().path is None  # the embedded tiny Wan, randomly initialised
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "DataOptions",
    "InitFrom",
    "LoRAOptions",
    "ModelOptions",
    "OptimOptions",
    "ParallelOptions",
    "PrepareOptions",
    "RecipeOptions",
    "RunOptions",
    "TinyWan",
    "TrackerOptions",
    "ValidationOptions",
]

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class TinyWan:
    """The embedded default model, a tiny Wan (:func:`fvstep.methods.models.tiny_wan`).

    Attributes:
        num_layers: Transformer blocks.
        in_channels: Latent channels (the VAE's ``z_dim``).
        text_dim: Text-embedding features (the text encoder's ``d_model``).
        num_heads: Attention heads.
        dim_per_head: Head dimension.
        ffn_dim: Feed-forward hidden size.
    """

    num_layers: int = 2
    in_channels: int = 4
    text_dim: int = 16
    num_heads: int = 2
    dim_per_head: int = 8
    ffn_dim: int = 32


@dataclass(frozen=True)
class ModelOptions:
    """Where the trained transformer comes from.

    Attributes:
        path: A diffusers transformer folder, or a pipeline folder (its ``transformer/``).
            ``None``: a random init of ``config`` or of ``tiny``.
        config: A transformer ``config.json`` for a random init (no weights read).
        tiny: The embedded tiny Wan, used when neither ``path`` nor ``config`` is given.
        seed: Seeds a random init.
        dtype: The dtype the weights are loaded (and trained) in.
    """

    path: str | None = None
    config: str | None = None
    tiny: TinyWan = field(default_factory=TinyWan)
    seed: int = 0
    dtype: Dtype = "float32"


@dataclass(frozen=True)
class DataOptions:
    """What each step reads.

    Attributes:
        path: A latent dataset made by ``fvstep data encode`` (read by
            :func:`fvstep.executor.latents.latent_source`); ``None``: synthetic latents
            (:class:`fvstep.executor.data.SyntheticLatents`).
        batch_size: The per-rank batch size.
        num_workers: Loader worker processes (a dataset only; does not change the batches).
        seed: Seeds the order (and the synthetic latents).
        synthetic_size: How many synthetic items.
        latent_shape: A synthetic item's latents ``(C, F, H, W)``.
        text_shape: A synthetic item's text embeddings ``(L, D)``.
    """

    path: str | None = None
    batch_size: int = 2
    num_workers: int = 0
    seed: int = 0
    synthetic_size: int = 64
    latent_shape: tuple[int, int, int, int] = (4, 2, 4, 4)
    text_shape: tuple[int, int] = (3, 16)


@dataclass(frozen=True)
class OptimOptions:
    """AdamW with a constant learning rate after a linear warm-up.

    Attributes:
        lr: The learning rate (a resumed run may change it: it applies from its first step).
        warmup_steps: Linear warm-up, in updates of the role.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's betas.
        clip: Clip the global gradient norm to this (``None``: no clipping).
        ema: The decay of an EMA of the trained weights (``None``: no EMA).
        fused: torch's fused AdamW kernel (the faster); ``False``: torch's default for
            the device. The two round differently, so a resumed run may not change it.
    """

    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip: float | None = 1.0
    ema: float | None = 0.99
    fused: bool = True


@dataclass(frozen=True)
class PrepareOptions:
    """How every role is prepared (:func:`fvstep.parallel.prepare`): precision, memory
    and kernels (``docs/recipes.md`` gives a fast plan).

    Attributes:
        precision: ``"bf16"``: bf16 compute over fp32 master weights; ``"fp32"``: fp32
            throughout; ``"auto"``: bf16 on CUDA, fp32 on the CPU (resolved in ``config.yaml``).
        checkpointing: Activation checkpointing of the trained roles' blocks: ``"none"``,
            ``"full"``, ``"selective"`` (matmul and attention outputs kept),
            ``"attention"`` (attention outputs kept) or ``"narrow"`` (attention and the
            matmuls that do not widen their input kept).
        checkpoint_every: Checkpoint every n-th block only (1: every block).
        offload_activations_every: Keep the saved activations of every n-th block in
            pinned host memory between forward and backward (0: none; CUDA only).
        compile: ``torch.compile`` each block (Inductor, with fvstep's safe options).
        compile_memory_budget: Inductor's activation memory budget for the compiled
            blocks (``0``-``1``; ``None``: torch's default).
        inductor_options: Inductor options merged over fvstep's safe ones (e.g.
            ``{"coordinate_descent_tuning": true}``).
        verify_compile: Check every compiled graph's gradients against eager ones once
            before training on them (:mod:`fvstep.parallel.compile_check`).
        frozen_dtype: The dtype frozen roles are stored in (``None``: bf16 when
            ``precision`` resolves to bf16, else as loaded).
        flash_attention_4: Every role's attention on FlashAttention-4 (Hopper/Blackwell
            GPUs, ``fvstep[flash4]``, bf16 compute). A resumed run may not change it.
    """

    precision: Literal["auto", "bf16", "fp32"] = "auto"
    checkpointing: Literal["none", "full", "selective", "attention", "narrow"] = "none"
    checkpoint_every: int = 1
    offload_activations_every: int = 0
    compile: bool = False
    compile_memory_budget: float | None = None
    inductor_options: dict[str, Any] = field(default_factory=dict)
    verify_compile: bool = False
    frozen_dtype: Dtype | None = None
    flash_attention_4: bool = False


@dataclass(frozen=True)
class ParallelOptions:
    """The process layout (:class:`fvstep.parallel.Layout`) on several ranks.

    Attributes:
        count_collectives: Report ``collectives/*`` counts in the metrics.
    """

    count_collectives: bool = False


@dataclass(frozen=True)
class RunOptions:
    """The run's folder and cadences (:func:`fvstep.run`).

    Attributes:
        out: The run folder: checkpoints, ``metrics.jsonl`` and the resolved
            ``config.yaml``. Running the same command again resumes from it.
        num_steps: The step to reach (a resumed run may raise it).
        every: Save a checkpoint every ``every`` steps (and at the end).
        keep: Keep the newest ``keep`` checkpoints (``None``: all).
        log_every: Flush the metrics to ``metrics.jsonl`` and the trackers every
            ``log_every`` steps (every step gets its line; a flush is one device transfer).
        microbatches: Gradient accumulation: micro-batches a step.
        seed: Seeds the training key (noise, timesteps).
        device: ``"auto"`` (CUDA when available, else the CPU), ``"cpu"`` or ``"cuda"``.
        progress: Show a progress bar.
        async_save: Write checkpoints in the background.
    """

    out: str = "runs/fvstep-train"
    num_steps: int = 20
    every: int = 10
    keep: int | None = 3
    log_every: int = 5
    microbatches: int = 1
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    async_save: bool = False


@dataclass(frozen=True)
class ValidationOptions:
    """The flow-matching loss of the trained role on held-out latents, and sample videos
    of it (``docs/recipes.md``).

    Attributes:
        every: Validate every ``every`` steps (``0``: never).
        num_samples: How many held-out latents. With ``data.path``: the dataset's first
            items, which training never draws (``0``: train on every item).
        sample_every: Sample videos every ``sample_every`` steps and at the end (``0``:
            never), into ``<run.out>/media``. Needs ``model.path`` a pipeline folder with a VAE.
        num_videos: Videos a sampling, one per held-out item's prompt, each from fixed
            noise (at most ``num_samples``).
        sample_steps: Euler steps of a bidirectional student (``finetune``,
            ``diffusion_nft``); a distilled student samples its own few-step schedule.
        sample_weights: The student's weights the videos show: ``"ema"``, ``"params"``
            (live), or ``"auto"``: the EMA when the run keeps one, else the live weights.
    """

    every: int = 0
    num_samples: int = 2
    sample_every: int = 0
    num_videos: int = 2
    sample_steps: int = 50
    sample_weights: Literal["auto", "params", "ema"] = "auto"


@dataclass(frozen=True)
class TrackerOptions:
    """Where metrics go besides ``metrics.jsonl``.

    Attributes:
        tensorboard: Write TensorBoard events under ``<run.out>/tensorboard``.
        wandb_project: Log to this Weights & Biases project (offline mode).
    """

    tensorboard: bool = False
    wandb_project: str | None = None


@dataclass(frozen=True)
class InitFrom:
    """Where a new run starts from (:func:`fvstep.recipes.init.init_from`); ignored
    once the run's folder holds a checkpoint (the run resumes from it).

    Attributes:
        path: A diffusers model folder, another run's checkpoint (a ``step_<n>`` folder),
            or another run's folder (its newest checkpoint). ``None``: start from
            ``model``.
        kind: ``"weights"``: the weights of each role named in ``roles`` (from a
            diffusers folder, or from a checkpoint's role), with fresh optimizer state
            and step 0; ``"state"``: the whole state of the checkpoint (its step,
            optimizer state, EMA and key), continued in this run's folder.
        weights: ``"params"`` (live) or ``"ema"``: which weights of the source role.
        roles: This run's role to the source's role (``"student=student"``); default
            each trained role from the role of the same name.
    """

    path: str | None = None
    kind: Literal["weights", "state"] = "weights"
    weights: Literal["params", "ema"] = "params"
    roles: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoRAOptions:
    """The LoRA adapters (``peft.LoraConfig``) of the trained roles.

    Attributes:
        rank: ``r``. In ``finetune``, ``0`` (its default) trains the whole model instead.
        alpha: ``lora_alpha``.
        targets: The target modules.
        seed: Seeds the adapters' initialisation.
    """

    rank: int = 4
    alpha: int = 8
    targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    seed: int = 0


@dataclass(frozen=True)
class RecipeOptions:
    """The option groups every shipped recipe has; a recipe's options subclass it, adding
    their own fields and overriding a group's default where the recipe needs another."""

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    run: RunOptions = field(default_factory=RunOptions)
    validation: ValidationOptions = field(default_factory=ValidationOptions)
    trackers: TrackerOptions = field(default_factory=TrackerOptions)
    init_from: InitFrom = field(default_factory=InitFrom)
