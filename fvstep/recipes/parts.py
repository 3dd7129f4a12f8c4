"""What the shipped recipes share: the model, its preparation, the roles, the data, the
optimizer, validation, trackers and the options of :func:`fvstep.run`, from their options.

Examples:
    >>> module = load_transformer(ModelOptions())          # the tiny Wan
    >>> data = make_data(DataOptions(batch_size=2))         # synthetic latents
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.executor.trackers import TensorBoardTracker, WandbTracker
from fvstep.parallel.activation_checkpoint import resolve_checkpointing
from fvstep.recipes import RunSpec
from fvstep.recipes import init as init_
from fvstep.recipes.options import (
    DataOptions,
    ModelOptions,
    OptimOptions,
    PrepareOptions,
    RunOptions,
)

__all__ = [
    "check_lora",
    "check_lora_targets",
    "check_paths",
    "close_data",
    "compute_dtype",
    "copied_roles",
    "device_for",
    "distilled_run_spec",
    "dmd2_roles",
    "load_transformer",
    "lora_over_base",
    "make_data",
    "make_mesh",
    "make_optimizer",
    "prepare_role",
    "run_spec",
    "takes_init_weights",
    "trained_role",
]


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def device_for(run: RunOptions) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` with CUDA (``"auto"``), else the CPU."""
    use_cuda = run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _model_folder(path: Path) -> tuple[Path, str | None]:
    """A transformer folder, or a pipeline folder and its ``transformer`` subfolder."""
    if (path / "model_index.json").is_file():
        return path, "transformer"
    if (path / "config.json").is_file():
        return path, None
    raise ValueError(
        f"model.path {str(path)!r} is neither a diffusers model folder (config.json) nor a "
        "pipeline folder (model_index.json)"
    )


def load_transformer(model: ModelOptions, *, device: torch.device | None = None) -> nn.Module:
    """The transformer of ``model``: a diffusers folder's weights, or a random init of
    ``model.config`` (else of the tiny Wan) seeded by ``model.seed``.

    Only a config's random init is drawn on ``device``; the caller moves the module there.

    Raises:
        ValueError: If ``model.path`` is not a diffusers folder, or holds a causal Wan.
    """
    from fvstep.core._optional import needs_extra

    with needs_extra("models", "the recipes' transformer"):
        import diffusers

    dtype = _dtype(model.dtype)
    if model.path is not None:
        folder, subfolder = _model_folder(Path(model.path))
        module = diffusers.AutoModel.from_pretrained(
            str(folder), subfolder=subfolder, torch_dtype=dtype
        )
        from fvstep.methods.causal_wan import recorded_chunk_frames

        # a plain from_pretrained makes a causal Wan's export bidirectional: another model
        chunk = recorded_chunk_frames(module)
        if chunk is not None:
            raise ValueError(
                f"model.path {model.path!r} holds a causal Wan (chunk_frames={chunk}); the recipes train "
                "bidirectional models: load it with load_causal in a script (docs/methods/causal_wan.md)"
            )
        return module.train()
    if model.config is not None:
        config = json.loads(Path(model.config).read_text())
        cls = getattr(diffusers, config.get("_class_name", "WanTransformer3DModel"))
        device = device or torch.device("cpu")
        on_gpu = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=on_gpu), device:
            torch.manual_seed(model.seed)
            module = cls.from_config(config)
        return _to_dtype(module, dtype).train()
    from fvstep.methods.models import tiny_wan

    built: Any = tiny_wan(seed=model.seed, **dataclasses.asdict(model.tiny))
    return _to_dtype(built, dtype)


def _to_dtype(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Cast a freshly built fp32 module only when another dtype is asked for."""
    return module if dtype in (None, torch.float32) else module.to(dtype)


def check_lora(options: Any, *, required: bool) -> None:
    """Refuse (``ValueError``) LoRA options that would train nothing or something else: a
    rank below 1 (below 0 where ``0``, a full fine-tune, is allowed), ``alpha <= 0``, no
    targets, or adapters over a model of another dtype than fp32 (bf16 masters)."""
    lora = options.lora
    if lora.rank < (1 if required else 0):
        least = "1" if required else "0 (0: a full fine-tune)"
        raise ValueError(f"lora.rank must be >= {least}, got {lora.rank}")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        raise ValueError(
            f"lora.alpha must be > 0 (the adapter's scale is alpha/rank), got {lora.alpha}"
        )
    if not lora.targets:
        raise ValueError("lora.targets is empty: name the layers to adapt (e.g. [to_q, to_v])")
    if options.model.dtype != "float32":
        raise ValueError(
            f"model.dtype {options.model.dtype} with LoRA: the adapters train in fp32 over the "
            "base; keep model.dtype float32 and set prepare.frozen_dtype for the base's dtype"
        )


def check_lora_targets(names: dict[str, str], targets: tuple[str, ...]) -> None:
    """Refuse (``ValueError``) ``targets`` that match no layer, or match a layer that is
    not ``nn.Linear`` (peft's rule: a module whose name is the target or ends with
    ``.target``); ``names`` maps each module's qualified name to its class name."""
    missing = []
    for target in targets:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        if not hits:
            missing.append(target)
        other = [n for n in hits if names[n] != "Linear"]
        if other:
            raise ValueError(
                f"lora.targets {target!r} matches {other[0]!r}, a {names[other[0]]}: fvstep's "
                "LoRA adapts nn.Linear layers only"
            )
    if missing:
        raise ValueError(
            f"lora.targets {missing} match no layer of the model (a target is a layer's name "
            "or its last parts, e.g. to_q or ffn.net.0.proj)"
        )


def make_mesh(device: torch.device) -> Any:
    """An FSDP2 mesh over every rank when there are several, else ``None``."""
    if fsp.rank_and_world()[1] == 1:
        return None
    return fsp.make_mesh(device_type=device.type)


def compute_dtype(options: PrepareOptions, device: torch.device) -> torch.dtype | None:
    """The dtype roles compute in over their fp32 masters: ``torch.bfloat16`` for
    ``precision="bf16"`` (and ``"auto"`` on CUDA), ``None`` (fp32 throughout) otherwise."""
    if options.precision == "bf16" or (options.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def prepare_role(
    module: nn.Module, options: PrepareOptions, mesh: Any, *, trainable: bool
) -> nn.Module:
    """:func:`fvstep.parallel.prepare` of ``module`` with the recipe's options, frozen roles too.

    ``flash_attention_4`` enables FlashAttention-4 process-wide (``ValueError`` under fp32)."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    dtype = compute_dtype(options, device)
    if options.flash_attention_4:
        if dtype is None:
            raise ValueError(
                "prepare.flash_attention_4 needs bf16 compute (FlashAttention has no fp32 "
                "kernel): set prepare.precision to bf16 (the default on CUDA)"
            )
        fsp.enable_flash_attention_4()
    checkpointing: Any = "none"
    if options.checkpointing != "none":
        named = resolve_checkpointing(options.checkpointing)  # "attention", "narrow": names
        checkpointing = attrs.evolve(named, every=options.checkpoint_every)
    offload = None
    if options.offload_activations_every:
        offload = fsp.ActivationOffloading(every=options.offload_activations_every)
    compile: Any = options.compile
    if options.compile and options.inductor_options:
        compile = {"options": dict(options.inductor_options)}
    frozen = _dtype(options.frozen_dtype)
    return fsp.prepare(
        module,
        mesh=mesh,
        trainable=trainable,
        checkpointing=checkpointing,
        offload_activations=offload,
        compile=compile,
        verify_compile=options.verify_compile and options.compile,
        param_dtype=dtype,
        frozen_dtype=frozen if frozen is not None or dtype is None else dtype,
        attention_backend="_native_flash" if options.flash_attention_4 else None,
    )


def make_optimizer(optim: OptimOptions) -> Any:
    """AdamW at ``optim.lr`` after ``optim.warmup_steps`` of linear warm-up (torch's fused
    kernel unless ``optim.fused`` is ``False``)."""
    lr: Any = optim.lr
    if optim.warmup_steps:
        lr = fs.schedules.constant_with_warmup(optim.lr, warmup_steps=optim.warmup_steps)
    return fs.optim.adamw(
        lr=lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=optim.fused or None
    )


def trained_role(module: nn.Module, optim: OptimOptions) -> fs.Role:
    """A trained role: AdamW of :func:`make_optimizer`, an EMA of decay ``optim.ema`` if set."""
    ema = fs.EMA(optim.ema) if optim.ema is not None else None
    return fs.Role(module, optimizer=make_optimizer(optim), ema=ema)


def takes_init_weights(options: Any, *, fresh: bool) -> bool:
    """Whether ``options.init_from`` fills the trained roles' weights: a fresh run from a
    ``kind="weights"`` source."""
    source = options.init_from
    return fresh and source.path is not None and source.kind == "weights"


def dmd2_roles(options: Any, student: Any, teacher: Any, critic: Any) -> dict[str, fs.Role]:
    """The roles of DMD2-style recipes over prepared modules: the ``student`` (AdamW of
    ``optim``, an EMA), the frozen ``teacher`` saved by its digest, the ``critic`` (AdamW
    at ``critic_lr``)."""
    critic_optim = dataclasses.replace(options.optim, lr=options.critic_lr)
    return {
        "student": trained_role(student, options.optim),
        "teacher": fs.Role(teacher, save_frozen=False),
        "critic": fs.Role(critic, optimizer=make_optimizer(critic_optim)),
    }


def copied_roles(
    options: Any, teacher: nn.Module, student: nn.Module, *, fresh: bool, device: torch.device
) -> dict[str, fs.Role]:
    """:func:`dmd2_roles` of a ``student`` and a critic copied from ``teacher``: both
    filled from ``init_from`` on a fresh run, then all three prepared."""
    critic = copy.deepcopy(teacher)
    if takes_init_weights(options, fresh=fresh):
        init_.init_from(options.init_from, {"student": student, "critic": critic})
    mesh = make_mesh(device)
    prepared = {
        name: prepare_role(m.to(device), options.prepare, mesh, trainable=name != "teacher")
        for name, m in (("student", student), ("teacher", teacher), ("critic", critic))
    }
    return dmd2_roles(options, **prepared)


def lora_over_base(
    options: Any, base: nn.Module, roles: tuple[str, ...], *, fresh: bool, mesh: Any,
    base_role: str,
) -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """The base prepared frozen and one peft LoRA adapter per role over it (sharded over ``mesh``).

    A fresh run fills them from ``init_from``, refused if trained on another ``base_role``."""
    import peft

    from fvstep.methods.lora import add_adapters

    lora = options.lora
    check_lora_targets({n: type(m).__name__ for n, m in base.named_modules()}, lora.targets)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets))
    adapters = add_adapters(base, dict.fromkeys(roles, config), seed=lora.seed)
    base = prepare_role(base, options.prepare, mesh, trainable=False)
    source = options.init_from
    if takes_init_weights(options, fresh=fresh) and source.path is not None:
        init_.check_base_digest(source.path, base, base_role=base_role)
        init_.init_from(source, dict(adapters))
    if mesh is not None:
        for module in adapters.values():
            fsp.shard_module(module, mesh=mesh)
    return base, adapters


def check_paths(options: Any) -> None:
    """Refuse a ``data.path``, ``model.path`` or ``model.config`` that holds nothing to
    read (``ValueError``), before a run writes anything (options without these groups pass)."""
    data, model = getattr(options, "data", None), getattr(options, "model", None)
    path = getattr(data, "path", None)
    if path is not None and not (Path(path) / "index.json").is_file():
        raise ValueError(
            f"data.path {path!r} holds no latent dataset (no index.json): give the folder "
            "that `fvstep data encode` wrote, or leave data.path out for synthetic latents"
        )
    model_path = getattr(model, "path", None)
    if model_path is not None:
        _model_folder(Path(model_path))
    config = getattr(model, "config", None)
    if config is not None and not Path(config).is_file():
        raise ValueError(f"model.config {config!r} is not a file: give a transformer config.json")


def _held_out_indices(shapes: list[Any], num: int) -> list[int]:
    """The first ``num`` items of the first item's shapes (so that they stack into one batch)."""
    if num < 1 or not shapes:
        return []
    return [i for i, s in enumerate(shapes) if s == shapes[0]][:num]


class _Kept:
    """``order`` over the kept items of a dataset: its positions, mapped to their indices."""

    def __init__(self, order: Any, kept: list[int]) -> None:
        self.order, self.kept = order, kept

    def indices(self, step: Any, *, rank: Any = 0, world_size: Any = 1) -> list[int]:
        drawn = self.order.indices(step, rank=rank, world_size=world_size)
        return [self.kept[i] for i in drawn]


def make_data(data: DataOptions, *, held_out: int = 0, device: torch.device | None = None) -> Any:
    """A latent dataset's loader (``data.path``), or a shuffle of synthetic latents.

    Args:
        held_out: With ``data.path``, the validation items (``validation.num_samples``)
            that the loader never draws.
        device: Where the batches are delivered (``None``: the CPU).

    Raises:
        ValueError: If the items left after the held-out ones do not fill a global batch.
    """
    key = fs.random.key(data.seed)
    if data.path is not None:
        from fvstep.executor.latents import BucketedOrder, LatentDataset, WorkerSource

        dataset = LatentDataset(data.path, fields=("latents", "text"))
        held = set(_held_out_indices(dataset.shapes, held_out))
        kept = [i for i in range(len(dataset)) if i not in held]
        world = fsp.rank_and_world()[1]
        if len(kept) < data.batch_size * world:
            raise ValueError(
                f"data.path {data.path!r} has {len(dataset)} items, {len(held)} held out (validation.num_samples "
                f"{held_out}): {len(kept)} < data.batch_size {data.batch_size} x {world} rank(s); hold out or batch fewer"
            )
        order = BucketedOrder(
            [dataset.shapes[i] for i in kept], key=key, batch_size=data.batch_size
        )
        return WorkerSource(
            dataset, _Kept(order, kept), num_workers=data.num_workers, device=device
        )
    from fvstep.executor.data import ShuffledSource, SyntheticLatents

    items = SyntheticLatents(
        data.synthetic_size,
        key=fs.random.fold_in(key, 1),
        shape=data.latent_shape,
        text_shape=data.text_shape,
    )
    collate = None if device is None else functools.partial(_collate_to, device=device)
    return ShuffledSource(items, key=key, batch_size=data.batch_size, collate=collate)


def _collate_to(items: list[Any], *, device: torch.device) -> Any:
    from torch.utils.data import default_collate

    return {k: v.to(device) for k, v in default_collate(items).items()}


def _held_out_items(data: DataOptions, num: int) -> dict[str, torch.Tensor]:
    """``num`` validation items: the dataset's held-out ones, or synthetic ones of another key."""
    if data.path is not None:
        from fvstep.executor.latents import LatentDataset

        dataset: Any = LatentDataset(data.path, fields=("latents", "text"))
        indices = _held_out_indices(dataset.shapes, num)
    else:
        from fvstep.executor.data import SyntheticLatents

        dataset = SyntheticLatents(
            num,
            key=fs.random.key(data.seed + 1000),
            shape=data.latent_shape,
            text_shape=data.text_shape,
        )
        indices = list(range(num))
    items = [dataset[i] for i in indices]
    return {k: torch.stack([item[k] for item in items]).float() for k in ("latents", "text")}


def close_data(data: Any) -> None:
    """Stop a loader's workers (a synthetic source has none)."""
    close = getattr(data, "close", None)
    if close is not None:
        close()


def run_spec(
    options: Any,
    roles: dict[str, fs.Role],
    method: Any,
    *,
    trained: tuple[str, ...],
    device: torch.device,
    sampler: Any = None,
    extra: dict[str, Any] | None = None,
) -> RunSpec:
    """What every recipe returns: the state of ``roles`` (and ``extra``), ``method`` compiled
    with the run's accumulation and clipping, the data and :func:`fvstep.run`'s options; the
    student's sample videos by ``sampler`` (``None``: Euler steps).

    Raises:
        ValueError: For ``validation.every`` without a held-out item, or sample options a run
            cannot honour.
    """
    from fvstep.executor.reporting import Validation
    from fvstep.executor.validation import validation_loss
    from fvstep.recipes.samples import check_samples, sample_validation

    run, validation, trackers = options.run, options.validation, options.trackers
    check_samples(options)  # before the data's workers start, or a held-out item is read
    state = fs.TrainState.create(roles, key=fs.random.key(run.seed), extra=extra)
    step = fs.compile(
        method,
        accumulation=fs.Accumulation(microbatches=run.microbatches),
        clip=fs.clip_grad_norm(options.optim.clip) if options.optim.clip else None,
    )
    data = make_data(options.data, held_out=validation.num_samples, device=device)
    out = Path(run.out)
    run_options: dict[str, Any] = {
        "num_steps": run.num_steps,
        "checkpoints": fs.Checkpoints(
            out, every=run.every, keep=run.keep, async_save=run.async_save
        ),
        "log_every": run.log_every,
        "progress": run.progress,
    }
    if validation.every:
        if validation.num_samples < 1:
            raise ValueError(
                f"validation.num_samples is {validation.num_samples}: validation needs at "
                "least 1 held-out item (or validation.every 0: no validation)"
            )
        held = _held_out_items(options.data, validation.num_samples)
        held = {k: v.to(device) for k, v in held.items()}
        loss = validation_loss(held["latents"], held["text"], role="student")
        run_options["validation"] = Validation(loss, every=validation.every)
    chosen: list[Any] = []
    if trackers.tensorboard:
        chosen.append(TensorBoardTracker(out / "tensorboard"))
    if trackers.wandb_project:
        chosen.append(WandbTracker(project=trackers.wandb_project, dir=out))
    if chosen:
        run_options["trackers"] = chosen
    if fsp.rank_and_world()[1] > 1:
        run_options["parallelism"] = fsp.Layout(
            count_collectives=options.parallel.count_collectives
        )
    if validation.sample_every:
        held = _held_out_items(options.data, validation.num_samples)
        samples = sample_validation(options, held, device=device, sampler=sampler)
        first = run_options.get("validation")
        run_options["validation"] = [samples] if first is None else [first, samples]
    return RunSpec(state, step, data, run_options, trained=trained, close=lambda: close_data(data))


def distilled_run_spec(
    options: Any,
    roles: dict[str, fs.Role],
    method: Any,
    *,
    steps: Any,
    device: torch.device,
    extra: dict[str, Any] | None = None,
) -> RunSpec:
    """:func:`run_spec` of a distillation: ``student`` and ``critic`` trained, the student
    sampling its own few-step schedule ``steps``."""
    from fvstep.executor.sampling import FewStepSampler

    return run_spec(
        options,
        roles,
        method,
        trained=("student", "critic"),
        device=device,
        sampler=FewStepSampler(steps),
        extra=extra,
    )
