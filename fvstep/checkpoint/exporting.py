"""Export of one role for inference: :func:`export`, one mechanism over a table of formats.

:func:`export` checks once what every format needs (the role, its weights, the target),
gathers the role's tensors and writes them atomically; a format (:data:`FORMATS`) says only
which tensors, under which names, and what it writes around them. The formats:
``docs/concepts/checkpoints.md`` ("Export for inference") and ``docs/concepts/lora.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fvstep.checkpoint.saving import fsync
from fvstep.core._optional import needs_extra
from fvstep.core.state import TrainState
from fvstep.core.weights import Weights, roles_holding_other_weights, select_weights
from fvstep.methods.lora import LoRAModule, lora_layers
from fvstep.parallel.ranks import gather_objects, rank_and_world

__all__ = [
    "CAUSAL_METADATA_KEY",
    "FORMATS",
    "MERGED_DTYPE",
    "export",
    "export_names",
    "gather_weights",
    "merge_weights",
]

_WEIGHTS_NAME = "model.safetensors"
"""The file name ``format="safetensors"`` writes when given a directory."""
CAUSAL_METADATA_KEY = "_fvstep_causal"
"""The key of a causal Wan's chunk: in a safetensors export's metadata, and in a diffusers
config (``fvstep.methods.causal_wan.CAUSAL_CONFIG_KEY``, which this layer may not import)."""
_CAUSAL_ROPE_ATTR = "_fvstep_causal_chunk_frames"  # what make_causal sets on the rotary module
Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _ExportJob:
    """One call of :func:`export`, checked, as a format reads it."""

    state: TrainState
    role: str
    path: Path
    weights: Weights
    dtype: torch.dtype | None
    rank0_only: bool
    options: dict[str, Any]  # the keywords of export's formats beyond the common ones

    @property
    def module(self) -> nn.Module:
        return self.state.roles[self.role].role.module

    def gather(
        self,
        dtype_for: Callable[[str], torch.dtype | None] | None = None,
        names: Callable[[str], str | None] | None = None,
    ) -> Tensors | None:
        """The role's tensors (:func:`gather_weights`), renamed by ``names``."""
        keep = not self.rank0_only or rank_and_world()[0] == 0
        role_state = self.state.roles[self.role]
        # the one rule for "the EMA weights" (has the EMA started?)
        sources = select_weights(role_state, self.weights, role=self.role)
        sources.update(role_state.buffers)
        # A tied tensor is one leaf, but state_dict (and a strict load_state_dict) has it under
        # each of its names; its aliases reuse its gathered copy: one gather (a collective, so
        # every rank must skip the same ones) per tensor and dtype.
        named = [*sources.items(), *((alias, sources[c]) for alias, c in role_state.tied)]
        out: Tensors = {}
        gathered: dict[tuple[int, torch.dtype], str] = {}
        for state_name, source in named:
            name = state_name if names is None else names(state_name)
            if name is None:  # the same names on every rank: no gather is skipped on one
                continue
            tensor = source.detach()
            dtype = self.dtype if dtype_for is None else dtype_for(name)
            if dtype is not None and tensor.is_floating_point():
                # Cast the shard before the gather: same bits, less to communicate.
                tensor = tensor.to(dtype)
            first = gathered.setdefault((id(source), tensor.dtype), name)
            if first != name:
                if keep:
                    out[name] = out[first].clone()  # safetensors refuses shared memory
                continue
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # a collective: every rank gets here
            if not keep:
                continue
            tensor = tensor.to("cpu").contiguous()
            local = source.to_local() if isinstance(source, DTensor) else source
            if tensor.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                # Never hand out the state's own memory (and safetensors refuses tensors
                # that share it, e.g. tied weights).
                tensor = tensor.clone()
            out[name] = tensor
        return out if keep else None


class _Writer(NamedTuple):
    """What a format writes: ``write(gather(), into)``, ``into`` a fresh folder (``file`` set:
    a file) renamed to the target; ``check`` runs before the target's own checks."""

    gather: Callable[[], Tensors | None]
    write: Callable[[Tensors, Path], None]
    file: Path | None = None
    check: Callable[[], None] | None = None


def export(
    state: TrainState,
    role: str,
    path: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    rank0_only: bool = True,
    **options: Any,
) -> Path | None:
    """Write one role's full weights for inference, in one of :data:`FORMATS`.

    Every rank calls it (sharded weights are gathered); global rank 0 writes (every rank
    with ``rank0_only=False``), into a temporary file or folder renamed into place. The
    formats and their options: ``docs/concepts/checkpoints.md`` ("Export for inference").

    Args:
        path: The file or folder to write.
        format: ``"safetensors"``, ``"diffusers"``, ``"pipeline"``, or for a LoRA role
            ``"lora"`` or ``"merged"``.
        weights: ``"params"`` or ``"ema"`` (:func:`gather_weights`).
        dtype: Cast floating-point tensors to it (``None``: keep each one's).
        overwrite: Replace an existing target (a file is never replaced by a folder).
        rank0_only: Only global rank 0 writes; else every rank writes ``path``.
        **options: The format's own options (``"pipeline"``: ``base``, ``component``,
            ``scheduler``, ``link``).

    Returns:
        The path written (the file, or the folder) on a writing rank, ``None`` on the others.

    Raises:
        ImportError: If a format's package (diffusers, peft) is not installed.
        ValueError: For an unknown format or option, an unknown role or ``weights``,
            ``weights="ema"`` without an EMA, a non-floating ``dtype``, a role the format
            cannot write (naming the one that can), an existing target without
            ``overwrite=True``, or peft adapters the export would lose. Raised on every rank.
        RuntimeError: On the other ranks, when writing failed on a writing rank.

    Examples:
        >>> export(state, "student", "exports/step_1000", weights="ema")
        PosixPath('exports/step_1000/model.safetensors')
        >>> export(state, "student", "exports/pipe", format="pipeline", weights="ema",
        ...        base="Wan2.1-T2V-1.3B-Diffusers", scheduler=sampler.scheduler())
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; one of {sorted(FORMATS)}")
    _check(state, role, weights, dtype)
    job = _ExportJob(state, role, Path(path), weights, dtype, rank0_only, options)
    writer = FORMATS[format](job)
    if job.options:
        raise ValueError(f"format={format!r} has no option {sorted(job.options)[0]!r}")
    target = writer.file or job.path
    writes = not rank0_only or rank_and_world()[0] == 0

    def check() -> None:
        if writer.check is not None:
            writer.check()
        folder = writer.file is None
        if target.exists() and target.is_dir() != folder:
            kind = "is not a directory" if folder else "is a directory"
            raise ValueError(f"the export target {str(target)!r} exists and {kind}")
        if target.exists() and not overwrite and not (folder and not any(target.iterdir())):
            raise ValueError(
                f"{str(target)!r} exists{' and is not empty' if folder else ''}; pass overwrite=True to "
                "replace it, or choose another path"
            )

    _agree("check the export target", check if writes else None)
    tensors = writer.gather()

    def write() -> None:
        assert tensors is not None
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(target, lambda tmp: writer.write(tensors, tmp), writer.file is None)

    _agree("write the export", write if writes else None)
    return target if writes else None


def gather_weights(
    state: TrainState,
    role: str,
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    rank0_only: bool = True,
) -> Tensors | None:
    """The full (unsharded) weights of one role, on the CPU, keyed like its ``state_dict``.

    A tied tensor is gathered once and copied under each of its names; no two tensors share
    storage. Every rank calls it (DTensors are gathered). ``weights="ema"`` as
    :func:`fvstep.core.weights.select_weights` says; ``dtype`` casts the floating-point
    tensors. With ``rank0_only``, the other ranks return ``None``.

    Raises:
        ValueError: For an unknown role or ``weights``, ``weights="ema"`` for a role
            without an EMA, or a ``dtype`` that is not floating point.

    Examples:
        >>> sd = gather_weights(state, "student", weights="ema", dtype=torch.bfloat16)
    """
    _check(state, role, weights, dtype)
    return _ExportJob(state, role, Path(), weights, dtype, rank0_only, {}).gather()


def export_names(
    module: nn.Module, role: str, *, keep_own_adapters: bool = False
) -> Callable[[str], str | None] | None:
    """How an export names a role's tensors when its module carries peft layers.

    A peft layer that does not compute with an adapter is exported as its base layer
    (``x.base_layer.weight`` as ``x.weight``, adapter tensors left out); the rule:
    ``docs/concepts/lora.md`` ("Exporting the roles of a LoRA run").

    Args:
        role: The role's name (for the errors).
        keep_own_adapters: Keep the ``state_dict`` names of a module computing with its
            own adapters (one peft model as one role) instead of refusing it.

    Returns:
        ``state_dict`` name to export name (``None``: left out), or ``None`` to keep the
        ``state_dict`` names.

    Raises:
        ValueError: For a merged peft layer, or a computing adapter that cannot be kept.

    Examples:
        >>> names = export_names(state.module("teacher"), "teacher")
        >>> names("blocks.0.attn1.to_q.base_layer.weight")
        'blocks.0.attn1.to_q.weight'
    """
    if "peft" not in sys.modules:  # peft layers exist only once peft was imported
        return None
    with needs_extra("lora", "exporting a role with peft layers"):
        from peft.tuners.tuners_utils import BaseTunerLayer

    layers: dict[str, Any] = {
        p: m for p, m in module.named_modules() if isinstance(m, BaseTunerLayer)
    }
    if not layers:
        return None
    computing = []
    for path, layer in layers.items():
        if layer.merged:
            raise ValueError(
                f"role {role!r} has peft adapters {layer.merged_adapters} merged into {path!r}: "
                "unmerge them (peft's unmerge_adapter) or make the merge final (merge_and_unload)"
            )
        if layer.disable_adapters:
            continue
        for adapter in layer.active_adapters:
            held = [getattr(layer, c) for c in layer.adapter_layer_names if hasattr(layer, c)]
            held = [c for c in held if adapter in c]
            if held:
                computing.append((path, adapter, all(c in layer.children() for c in held)))
    if computing:
        if keep_own_adapters and all(own for _, _, own in computing):
            return None  # one peft model as one role: its state_dict, adapters included
        not_own = [c for c in computing if not c[2]]
        path, adapter, own = (not_own if keep_own_adapters else computing)[0]
        if not own:
            raise ValueError(
                f"role {role!r} computes with the peft adapter {adapter!r} at {path!r}, whose weights "
                "are not the role's: export with every other role's adapter off, or export that role"
            )
        raise ValueError(
            f"role {role!r} computes with the peft adapter {adapter!r} at {path!r}, which a plain "
            "model cannot hold: merge it first (merge_and_unload), or make it a role (add_adapters)"
        )

    def rename(name: str) -> str | None:
        parts = name.split(".")
        kept = []
        for i, part in enumerate(parts):
            if ".".join(parts[:i]) in layers:  # the part right under a peft layer
                if part != "base_layer":
                    return None  # an adapter's tensor: not what this role computes
                continue
            kept.append(part)
        return ".".join(kept)

    return rename


# --- the formats of this layer ------------------------------------------------------------


def _safetensors(job: _ExportJob) -> _Writer:
    names = export_names(job.module, job.role, keep_own_adapters=True)
    metadata = {"format": "pt"}
    chunk = _causal_chunk(job.module)
    if chunk is not None:  # a causal Wan, or adapters over one: the file says so
        metadata[CAUSAL_METADATA_KEY] = json.dumps({"chunk_frames": int(chunk)})
    return _Writer(
        gather=lambda: job.gather(names=names),
        write=lambda tensors, tmp: _save_safetensors(tensors, tmp, metadata),
        file=job.path if job.path.suffix == ".safetensors" else job.path / _WEIGHTS_NAME,
    )


def _diffusers(job: _ExportJob) -> _Writer:
    module = job.module
    cls = _diffusers_class(module, job.role)
    _check_causal_record(module, job.role)
    names = export_names(module, job.role)  # peft layers the role does not compute with: plain
    fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())

    def dtype_for(name: str) -> torch.dtype | None:  # as from_pretrained(torch_dtype=) holds them
        if job.dtype is not None and any(m in name.split(".") for m in fp32):
            return torch.float32
        return job.dtype

    def write(tensors: Tensors, folder: Path) -> None:
        with needs_extra("models", "a diffusers export"):
            from diffusers.utils import SAFETENSORS_WEIGHTS_NAME

        _save_safetensors(tensors, folder / SAFETENSORS_WEIGHTS_NAME)
        (folder / cls.config_name).write_text(_config_json(module, cls))
        for file in (SAFETENSORS_WEIGHTS_NAME, cls.config_name, "."):
            fsync(folder / file)

    return _Writer(gather=lambda: job.gather(dtype_for, names), write=write)


def _pipeline(job: _ExportJob) -> _Writer:
    base = job.options.pop("base", None)
    component = job.options.pop("component", "transformer")
    scheduler = job.options.pop("scheduler", None)
    link = job.options.pop("link", False)
    if base is None:
        raise ValueError("format='pipeline' needs base= (the base diffusers pipeline folder)")
    base, model = Path(base), _diffusers(job)
    class_name = _diffusers_class(job.module, job.role).__name__

    def check() -> None:
        index = base / "model_index.json"
        if not index.is_file():
            raise ValueError(
                f"the base {str(base)!r} is not a diffusers pipeline folder: no model_index.json"
            )
        if component not in json.loads(index.read_text()):
            raise ValueError(f"the base pipeline {str(base)!r} has no component {component!r}")
        a, b = job.path.resolve(), base.resolve()
        if a == b or a.is_relative_to(b) or b.is_relative_to(a):
            raise ValueError(
                f"the export {str(job.path)!r} and its base {str(base)!r} must not nest"
            )

    def write(tensors: Tensors, tmp: Path) -> None:
        replaced = (component, ".cache", *(["scheduler"] if scheduler is not None else []))
        for entry in sorted(base.iterdir()):
            if entry.name in replaced:
                continue
            if link:
                os.symlink(entry.resolve(), tmp / entry.name)
            elif entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        (tmp / component).mkdir()
        model.write(tensors, tmp / component)
        index = json.loads((base / "model_index.json").read_text())
        index[component] = ["diffusers", class_name]
        if scheduler is not None:
            scheduler.save_pretrained(tmp / "scheduler")
            index["scheduler"] = ["diffusers", type(scheduler).__name__]
        (tmp / "model_index.json").unlink(missing_ok=True)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fsync(tmp / "model_index.json")

    return _Writer(gather=model.gather, write=write, check=check)


# --- LoRA roles: the adapter alone, or merged into its base --------------------------------

MERGED_DTYPE = torch.float32
"""The dtype :func:`merge_weights` and ``format="merged"`` write by default, whatever the
base's dtype (why: ``docs/concepts/lora.md``, "Export")."""


def _lora_module(job: _ExportJob) -> LoRAModule:
    """The module of the job's role, which must be a LoRA role."""
    module = job.module
    if not isinstance(module, LoRAModule):
        raise ValueError(
            f"role {job.role!r} holds a {type(module).__name__}, not a fvstep.methods.lora.LoRAModule: it has no "
            "adapter to write; export its weights with format='diffusers' (fvstep export --format model)"
        )
    return module


def _base_role(job: _ExportJob, module: LoRAModule) -> str:
    """The role that holds the base of the job's LoRA role."""
    for name, rs in job.state.roles.items():
        if rs.role.module is module.base:
            return name
    raise ValueError(
        f"the base of LoRA role {job.role!r} is not a role of the state: add it as a frozen "
        "role (fvstep.Role(base, save_frozen=False)) so that its weights are in the state"
    )


def _merge_names(module: LoRAModule) -> dict[str, tuple[str, str, float]]:
    """Base weight name -> (lora_A name, lora_B name, scaling) for vanilla Linear LoRA."""
    out: dict[str, tuple[str, str, float]] = {}
    for path, layer in lora_layers(module.base):
        if module.adapter not in layer.__dict__.get("lora_A", {}):
            continue
        if not isinstance(layer.get_base_layer(), torch.nn.Linear) or layer.fan_in_fan_out:
            raise ValueError(
                f"cannot merge adapter {module.adapter!r} into {path!r}: only LoRA on "
                f"nn.Linear layers is merged, not on {type(layer.get_base_layer()).__name__}"
            )
        if layer.use_dora.get(module.adapter) or layer.lora_bias.get(module.adapter):
            raise ValueError(
                f"cannot merge adapter {module.adapter!r} into {path!r}: DoRA and LoRA "
                "biases are not supported"
            )
        out[f"{path}.base_layer.weight"] = (
            f"{path}.lora_A.weight",
            f"{path}.lora_B.weight",
            float(layer.scaling[module.adapter]),
        )
    return out


def merge_weights(
    state: TrainState,
    role: str,
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    rank0_only: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The base's weights with a LoRA role's adapter merged in, keyed as the plain model.

    Each adapted weight becomes ``W + scaling * (B @ A)``, computed in fp32 and cast once
    to ``dtype`` (default :data:`MERGED_DTYPE`). Every rank calls it; ``state`` holds the
    base as a role too. ``weights`` (the adapter's) and ``rank0_only`` as
    :func:`gather_weights`.

    Raises:
        ValueError: For a role that is not a LoRA role, a base that is not a role of the
            state, an adapter that cannot be merged (DoRA, a non-Linear layer), or a
            ``dtype`` that is not floating-point.

    Examples:
        >>> net.load_state_dict(merge_weights(state, "student"))
    """
    _check(state, role, weights, dtype)
    job = _ExportJob(state, role, Path(), weights, None, rank0_only, {})
    module = _lora_module(job)
    merges = _merge_names(module)
    base = gather_weights(state, _base_role(job, module), rank0_only=rank0_only)
    adapter = job.gather()
    if base is None or adapter is None:
        return None
    target = MERGED_DTYPE if dtype is None else dtype
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        if name in merges:
            a, b, scaling = merges[name]
            delta = adapter[b].float() @ adapter[a].float()
            # fp32, then one cast: the base's bf16 first would round the change away
            tensor = tensor.float() + scaling * delta
        if tensor.is_floating_point():
            tensor = tensor.to(target)
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def _lora(job: _ExportJob) -> _Writer:
    with needs_extra("lora", "LoRA export"):
        from diffusers import WanPipeline

    module = _lora_module(job)
    config = module.config.to_dict()  # the adapter's LoraConfig as diffusers stores it
    keys = {"r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "lora_bias"}
    keys |= {"rank_pattern", "alpha_pattern", "init_lora_weights", "lora_dropout"}
    metadata: dict[str, Any] = {
        k: sorted(v) if isinstance(v, set) else v for k, v in config.items() if k in keys
    }
    return _Writer(
        gather=job.gather,
        write=lambda tensors, folder: WanPipeline.save_lora_weights(
            folder, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=metadata
        ),
    )


def _merged(job: _ExportJob) -> _Writer:
    base_role = _base_role(job, _lora_module(job))
    # the base's diffusers model folder (its config, its plain names), of merged tensors
    base_folder = _diffusers(dataclasses.replace(job, role=base_role, options={}))
    return _Writer(
        gather=lambda: merge_weights(
            job.state, job.role, weights=job.weights, dtype=job.dtype, rank0_only=job.rank0_only
        ),
        write=base_folder.write,
    )


FORMATS: dict[str, Callable[[_ExportJob], _Writer]] = {
    "safetensors": _safetensors,
    "diffusers": _diffusers,
    "pipeline": _pipeline,
    "lora": _lora,
    "merged": _merged,
}
"""Format name to the function that makes its :class:`_Writer` for a checked call."""


# --- checks, gathers and atomic writes ----------------------------------------------------


def _check(state: TrainState, role: str, weights: str, dtype: torch.dtype | None) -> None:
    """What every export checks first: the role, its weights, the dtype."""
    if role not in state.roles:
        raise ValueError(f"no role {role!r}; the state has roles {sorted(state.roles)}")
    if role in roles_holding_other_weights(state):
        raise ValueError(
            f"role {role!r} holds its EMA in its parameters here (inside "
            "fvstep.executor.validation.role_module(weights='ema')): export after the with block"
        )
    if weights not in ("params", "ema"):
        raise ValueError(f"weights must be 'params' or 'ema', got {weights!r}")
    if weights == "ema" and state.roles[role].ema is None:
        raise ValueError(
            f"weights='ema' but role {role!r} has no EMA; configure one with "
            "Role(..., ema=fvstep.EMA(decay)) or export weights='params'"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")


def _causal_chunk(module: Any) -> int | None:
    """The chunk of a causal Wan (``make_causal`` marks its rotary module) or LoRA role's base."""
    for candidate in (module, module.__dict__.get("base")):
        chunk = getattr(getattr(candidate, "rope", None), _CAUSAL_ROPE_ATTR, None)
        if chunk is not None:
            return int(chunk)
    return None


def _diffusers_class(module: nn.Module, role: str) -> type[Any]:
    """The diffusers class behind ``module``: its own, or the one ``fully_shard`` wrapped."""
    with needs_extra("models", "a diffusers export"):
        from diffusers import ModelMixin

    if isinstance(module, LoRAModule):
        raise ValueError(
            f"role {role!r} is a LoRA adapter over a base model, not a diffusers model: use "
            "format='merged' (--format merged) or format='lora' (--format lora)"
        )
    if not isinstance(module, ModelMixin):
        raise ValueError(
            f"format='diffusers' needs a diffusers ModelMixin, but role {role!r} holds a "
            f"{type(module).__name__}; use format='safetensors' for a plain safetensors file"
        )
    unwrapped = (c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    return next(c for c in unwrapped if issubclass(c, ModelMixin))


def _check_causal_record(module: nn.Module, role: str) -> None:
    """Refuse a module whose config records a causal chunk its rotary module does not have."""
    record = getattr(module, "config", {}).get(CAUSAL_METADATA_KEY)
    if record is None:
        return
    actual = _causal_chunk(module)
    if actual is None or record.get("chunk_frames") != actual:
        kind = "bidirectional" if actual is None else f"causal of chunk {actual}"
        raise ValueError(
            f"role {role!r}'s config records a causal Wan ({CAUSAL_METADATA_KEY}={dict(record)}) "
            f"but its module is {kind}: load it with fvstep.methods.causal_wan.load_causal"
        )


def _config_json(module: nn.Module, cls: type[Any]) -> str:
    """``config.json`` of ``module`` as ``cls.save_config`` writes it, not naming ``FSDP<Name>``."""
    with needs_extra("models", "a diffusers export"):
        from diffusers.configuration_utils import ConfigMixin, FrozenDict

    attrs = {"__module__": cls.__module__, "_auto_class": getattr(cls, "_auto_class", None)}
    stand_in: Any = type(cls.__name__, (), attrs)()
    stand_in._internal_dict = FrozenDict(dict(cast(Any, module).config))
    return ConfigMixin.to_json_string(stand_in)


def _agree(what: str, action: Callable[[], None] | None) -> None:
    """Run ``action`` (on the ranks that have one); if it failed on any rank, every rank raises
    (a ``RuntimeError`` naming that rank, or a ``ValueError`` if the failure was one)."""
    error: Exception | None = None
    if action is not None:
        try:
            action()
        except Exception as e:
            error = e
    mine = None if error is None else (type(error) is ValueError, str(error))
    outcomes = gather_objects(mine)  # nothing is communicated on one process
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            is_value_error, message = outcome
            kind = ValueError if is_value_error else RuntimeError
            raise kind(f"rank {rank} failed to {what}: {message}")


def _save_safetensors(tensors: Tensors, path: Path, metadata: dict[str, str] | None = None) -> None:
    with needs_extra("models", "a safetensors export"):
        from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata or {"format": "pt"})


def _write_atomically(target: Path, fill: Callable[[Path], None], folder: bool) -> None:
    """Fill a fresh file or folder beside ``target``, fsync it, rename it to ``target``."""
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    try:
        if folder:
            tmp.mkdir()
        fill(tmp)
        for entry in tmp.iterdir() if folder else ():
            if entry.is_file() and not entry.is_symlink():
                fsync(entry)
        fsync(tmp)
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
        moved = folder and target.is_dir() and any(target.iterdir())  # rename(2) needs it empty
        if moved:
            os.replace(target, old)
        os.replace(tmp, target)
        fsync(target.parent)
        if moved:
            shutil.rmtree(old)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
