"""Export of one role as a diffusers model folder, or as a whole diffusers pipeline folder
(the role plus a base pipeline's other parts: VAE, text encoder, tokenizer, scheduler).

The role is gathered and written as :mod:`fvstep.checkpoint.export` does (every rank
calls; global rank 0 writes; the target's checks and the write's outcome are shared with
every rank), and the folder is written under a temporary name and renamed into place.

The module's config is written as it is, so the record that a model is a causal Wan
(``"_fvstep_causal": {"chunk_frames": n}``, written by
:func:`fvstep.methods.causal_wan.make_causal`) goes into ``config.json``: diffusers'
``from_pretrained`` ignores it and builds the *bidirectional* model of those weights;
:func:`fvstep.methods.causal_wan.load_causal` restores the causal one. A module whose
config records causality it does not have (a causal export loaded with a plain
``from_pretrained``) is refused: its export would claim what it did not compute.

Examples:
    >>> export_diffusers(state, "student", "out/student", dtype=torch.bfloat16)
    >>> WanTransformer3DModel.from_pretrained("out/student")
    >>> export_pipeline(state, "student", "out/pipeline", base="Wan2.1-T2V-1.3B-Diffusers")
    >>> DiffusionPipeline.from_pretrained("out/pipeline")
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fvstep._optional import needs_extra
from fvstep.checkpoint.export import (
    _CAUSAL_ROPE_ATTR,
    CAUSAL_METADATA_KEY,
    _agree,
    _check_options,
    _check_target,
    _gather,
    _replace_dir,
    _role_state,
    _save_safetensors,
    export_names,
)
from fvstep.checkpoint.layout import fsync
from fvstep.parallel.ranks import rank_and_world
from fvstep.state import TrainState
from fvstep.weights import Weights

__all__ = ["export_diffusers", "export_pipeline"]


def export_diffusers(
    state: TrainState,
    role: str,
    path: str | os.PathLike[str],
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path | None:
    """Write a role whose module is a diffusers ``ModelMixin`` as a diffusers model folder.

    The folder holds ``config.json`` (the module's config, as ``save_config`` writes it,
    with the ``_class_name`` of the diffusers class even when the module was wrapped by
    ``fully_shard``) and ``diffusion_pytorch_model.safetensors``, so that
    ``ModelClass.from_pretrained(path)`` (or ``diffusers.AutoModel``) loads it. Call it
    on every rank; global rank 0 writes. A causal Wan's folder records its chunk: load it
    with :func:`fvstep.methods.causal_wan.load_causal` (``from_pretrained`` alone gives
    the bidirectional model).

    With ``dtype``, the tensors of the class's ``_keep_in_fp32_modules`` stay in fp32
    (as ``from_pretrained(..., torch_dtype=dtype)`` would hold them), the others are cast.

    The base of LoRA roles (a module carrying peft layers whose adapters it does not
    compute with: the teacher of ``lora_dmd2``) is written as the plain model it
    computes, under the class's own names (``x.base_layer.weight`` as ``x.weight``; see
    :func:`~fvstep.checkpoint.export.export_names`). A LoRA role itself is refused: write
    it with :func:`fvstep.lora.export_merged` or :func:`fvstep.lora.export_lora`.

    Args:
        state: The training state.
        role: The role's name.
        path: The folder to write. It must not exist, or be empty, unless ``overwrite``.
        weights: ``"params"`` or ``"ema"`` (see :func:`gather_weights`).
        dtype: Cast the floating-point tensors to this dtype (e.g. ``torch.bfloat16``).
        overwrite: Replace an existing non-empty folder at ``path``. The old folder is
            moved aside, the new one renamed into place, then the old one removed.

    Returns:
        ``path`` on rank 0, ``None`` on the others.

    Raises:
        ImportError: If diffusers is not installed.
        ValueError: For an unknown role or ``weights``, a module that is not a diffusers
            ``ModelMixin`` (a LoRA role), one computing with peft adapters (or with
            merged ones), a config recording a causal chunk the module does not have,
            ``weights="ema"`` without an EMA, a non-floating ``dtype``, a ``path`` that is
            a file, or a non-empty ``path`` without ``overwrite=True``. Raised on every
            rank.
        RuntimeError: On the other ranks, when writing failed on rank 0.

    Examples:
        >>> export_diffusers(state, "student", "exports/student", dtype=torch.bfloat16)
        >>> net = WanTransformer3DModel.from_pretrained("exports/student")
    """
    role_state = _role_state(state, role)
    module = role_state.role.module
    cls = _diffusers_class(module, role)
    _check_causal_record(module, role)
    _check_options(role_state, role, weights, dtype)
    names = export_names(module, role)  # peft layers the role does not compute with: plain
    path = Path(path)
    writes = rank_and_world()[0] == 0

    _agree(
        "check the export target",
        functools.partial(_check_target, path, overwrite) if writes else None,
    )
    tensors = _gather(
        role_state,
        role,
        weights=weights,
        dtype_for=_dtype_for(cls, dtype),
        keep=writes,
        names=names,
    )

    def write() -> None:
        assert tensors is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
        try:
            tmp.mkdir()
            _write_model_folder(tensors, module, cls, tmp)
            fsync(tmp)
            _replace_dir(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    _agree("write the export", write if writes else None)
    return path if writes else None


def _dtype_for(cls: type[Any], dtype: torch.dtype | None) -> Callable[[str], torch.dtype | None]:
    """The export dtype of each tensor: ``dtype``, except fp32 for the tensors of the
    class's ``_keep_in_fp32_modules`` (as ``from_pretrained(torch_dtype=dtype)`` holds them)."""
    fp32_names = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())

    def dtype_for(name: str) -> torch.dtype | None:
        if dtype is not None and any(m in name.split(".") for m in fp32_names):
            return torch.float32
        return dtype

    return dtype_for


def _write_model_folder(
    tensors: dict[str, torch.Tensor], module: nn.Module, cls: type[Any], folder: Path
) -> None:
    """``diffusion_pytorch_model.safetensors`` and ``config.json`` in ``folder``, fsynced."""
    with needs_extra("models", "a diffusers export"):
        from diffusers.utils import SAFETENSORS_WEIGHTS_NAME

    _save_safetensors(tensors, folder / SAFETENSORS_WEIGHTS_NAME)
    fsync(folder / SAFETENSORS_WEIGHTS_NAME)
    (folder / cls.config_name).write_text(_config_json(module, cls))
    fsync(folder / cls.config_name)


def export_pipeline(
    state: TrainState,
    role: str,
    path: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str],
    component: str = "transformer",
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    scheduler: Any = None,
    link: bool = False,
    overwrite: bool = False,
) -> Path | None:
    """Write a complete diffusers pipeline folder: the trained role plus a base model's rest.

    ``path`` gets everything of the pipeline folder ``base`` (its ``model_index.json``,
    VAE, text encoder, tokenizer, scheduler, ...), copied (or, with ``link=True``,
    symlinked to ``base``'s absolute paths), except ``component``, which is the role's
    module written as :func:`export_diffusers` writes it (the base of LoRA roles under
    its plain names). So
    ``DiffusionPipeline.from_pretrained(path)`` loads the base pipeline with the trained
    transformer (or its EMA, chosen explicitly). With ``scheduler`` (a diffusers scheduler,
    e.g. ``EulerSampler(...).scheduler()``), its config replaces the base's, so that the
    pipeline samples as the in-training sampler did.

    Call it on every rank. A sharded role is gathered one tensor at a time, each moved to
    the CPU at once, so no rank's GPU ever holds the whole model; global rank 0 writes.
    The folder is written under a temporary name and renamed into place.

    Args:
        state: The training state (a live one, or one loaded with
            ``fvstep.checkpoint.load(checkpoint, like=state)``).
        role: The role to export (a diffusers ``ModelMixin``).
        path: The pipeline folder to write.
        base: The base pipeline folder (with ``model_index.json``).
        component: The pipeline component the role replaces.
        weights: ``"params"`` or ``"ema"`` (see :func:`gather_weights`).
        dtype: Cast the role's floating-point tensors (the base's parts are copied as
            they are).
        scheduler: A diffusers scheduler whose config replaces the base's ``scheduler``.
        link: Symlink the base's other parts instead of copying them.
        overwrite: Replace an existing non-empty folder at ``path``.

    Returns:
        ``path`` on rank 0, ``None`` on the others.

    Raises:
        ImportError: If diffusers is not installed.
        ValueError: For an unknown role or ``weights``, a role that is not a diffusers
            ``ModelMixin`` (a LoRA role), one computing with peft adapters (as
            :func:`export_diffusers`), a ``base`` without ``model_index.json`` or whose
            ``model_index.json`` has no ``component``, ``path`` inside ``base`` (or the
            reverse), or a non-empty ``path`` without ``overwrite=True``. Raised on every
            rank.
        RuntimeError: On the other ranks, when writing failed on rank 0.

    Examples:
        >>> export_pipeline(state, "student", "exports/pipe", base="Wan2.1-T2V-1.3B-Diffusers",
        ...                 weights="ema", scheduler=EulerSampler(50, shift=3.0).scheduler())
        >>> pipe = DiffusionPipeline.from_pretrained("exports/pipe")
    """
    role_state = _role_state(state, role)
    module = role_state.role.module
    cls = _diffusers_class(module, role)
    _check_causal_record(module, role)
    _check_options(role_state, role, weights, dtype)
    names = export_names(module, role)  # peft layers the role does not compute with: plain
    path, base = Path(path), Path(base)
    writes = rank_and_world()[0] == 0

    def check() -> None:
        index = base / "model_index.json"
        if not index.is_file():
            raise ValueError(
                f"the base {str(base)!r} is not a diffusers pipeline folder: no model_index.json"
            )
        if component not in json.loads(index.read_text()):
            raise ValueError(f"the base pipeline {str(base)!r} has no component {component!r}")
        a, b = path.resolve(), base.resolve()
        if a == b or a.is_relative_to(b) or b.is_relative_to(a):
            raise ValueError(f"the export {str(path)!r} and its base {str(base)!r} must not nest")
        _check_target(path, overwrite)

    _agree("check the export target", check if writes else None)
    tensors = _gather(
        role_state,
        role,
        weights=weights,
        dtype_for=_dtype_for(cls, dtype),
        keep=writes,
        names=names,
    )

    def write() -> None:
        assert tensors is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
        try:
            tmp.mkdir()
            for entry in sorted(base.iterdir()):
                if entry.name in (component, ".cache") or (
                    scheduler is not None and entry.name == "scheduler"
                ):
                    continue
                if link:
                    os.symlink(entry.resolve(), tmp / entry.name)
                elif entry.is_dir():
                    shutil.copytree(entry, tmp / entry.name)
                else:
                    shutil.copy2(entry, tmp / entry.name)
            (tmp / component).mkdir()
            _write_model_folder(tensors, module, cls, tmp / component)
            fsync(tmp / component)
            index = json.loads((base / "model_index.json").read_text())
            index[component] = ["diffusers", cls.__name__]
            if scheduler is not None:
                scheduler.save_pretrained(tmp / "scheduler")
                index["scheduler"] = ["diffusers", type(scheduler).__name__]
            (tmp / "model_index.json").unlink(missing_ok=True)
            (tmp / "model_index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
            fsync(tmp / "model_index.json")
            fsync(tmp)
            _replace_dir(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    _agree("write the export", write if writes else None)
    return path if writes else None


def _diffusers_class(module: nn.Module, role: str) -> type[Any]:
    """The diffusers class behind ``module``: its own, or the one ``fully_shard`` wrapped."""
    with needs_extra("models", "a diffusers export"):
        from diffusers import ModelMixin

    if not isinstance(module, ModelMixin) and isinstance(module.__dict__.get("base"), ModelMixin):
        raise ValueError(  # a fvstep.lora.LoRAModule (the checkpoint layer may not import it)
            f"role {role!r} is a LoRA adapter over a base model, not a diffusers model: "
            "write the base with the adapter merged in (fvstep.lora.export_merged; fvstep "
            "export --format merged) or the adapter alone in diffusers' LoRA format "
            "(fvstep.lora.export_lora; --format lora)"
        )
    if not isinstance(module, ModelMixin):
        raise ValueError(
            f"export_diffusers needs a diffusers ModelMixin, but role {role!r} holds a "
            f"{type(module).__name__}; use export_role for a plain safetensors file"
        )
    for cls in type(module).__mro__:
        if issubclass(cls, ModelMixin) and not issubclass(cls, FSDPModule):
            return cls
    raise AssertionError("unreachable: a ModelMixin instance has a ModelMixin class")


def _check_causal_record(module: nn.Module, role: str) -> None:
    """Refuse a module whose config records a causal chunk its rotary module does not have
    (the checkpoint layer reads the two names; it may not import the methods)."""
    record = getattr(module, "config", {}).get(CAUSAL_METADATA_KEY)
    if record is None:
        return
    actual = getattr(getattr(module, "rope", None), _CAUSAL_ROPE_ATTR, None)
    if actual is None or record.get("chunk_frames") != actual:
        raise ValueError(
            f"role {role!r}'s config records a causal Wan ({CAUSAL_METADATA_KEY}={dict(record)}) "
            f"but its module is {'bidirectional' if actual is None else f'causal of chunk {actual}'}"
            " (a causal export loaded with a plain from_pretrained?): load it with "
            "fvstep.methods.causal_wan.load_causal"
        )


def _config_json(module: nn.Module, cls: type[Any]) -> str:
    """``config.json`` as ``cls.save_config`` writes it, for ``module``'s config.

    ``to_json_string`` names ``type(self)``, which for a module wrapped by ``fully_shard``
    is the dynamic ``FSDP<Name>`` class that diffusers cannot load (and it writes that
    name into the module's own config). A stand-in object named after ``cls`` carrying
    a copy of the config gives the file diffusers expects.
    """
    with needs_extra("models", "a diffusers export"):
        from diffusers.configuration_utils import ConfigMixin, FrozenDict

    stand_in_type = type(
        cls.__name__,
        (),
        {"__module__": cls.__module__, "_auto_class": getattr(cls, "_auto_class", None)},
    )
    stand_in: Any = stand_in_type()
    stand_in._internal_dict = FrozenDict(dict(cast(Any, module).config))
    return ConfigMixin.to_json_string(stand_in)
