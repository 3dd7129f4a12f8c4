"""Consolidated inference export of one role: its full weights, or a ``safetensors`` file.

A role's parameters may be FSDP2 shards (DTensors). Export gathers each one with
``DTensor.full_tensor()``, a collective, so **every rank calls the export function**; one
rank (global rank 0) writes. Besides the gathers, an export runs two tiny collectives
when a process group is initialised: the writing ranks' checks of the destination are
shared before the gathers (so a refusal is raised on every rank instead of leaving the
others waiting in a gather), and their outcome is shared after the write (so every rank
returns, or raises, together). Without a process group nothing is communicated.

Files are written atomically: into a temporary file (or folder) next to the target,
flushed and fsynced, then renamed into place. A crash leaves either the old target or
the new one, never a partial file under the target's name. The diffusers model and
pipeline folders are written by :mod:`fvstep.checkpoint.diffusers_export` on these
same rules.

Examples:
    >>> export_role(state, "student", "out/student.safetensors", weights="ema")
    >>> sd = gather_weights(state, "student", weights="ema", dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fvstep._optional import needs_extra
from fvstep.checkpoint.layout import fsync
from fvstep.parallel.ranks import gather_objects, rank_and_world
from fvstep.state import RoleState, TrainState
from fvstep.weights import Weights, roles_holding_other_weights, select_weights

__all__ = ["CAUSAL_METADATA_KEY", "WEIGHTS_NAME", "export_names", "export_role", "gather_weights"]

WEIGHTS_NAME = "model.safetensors"
"""The file name :func:`export_role` writes when given a directory."""
CAUSAL_METADATA_KEY = "_fvstep_causal"
"""The safetensors metadata key under which :func:`export_role` records a causal Wan's
chunk, and the config key of a diffusers export's record
(``fvstep.methods.causal_wan.CAUSAL_CONFIG_KEY``: the checkpoint layer may not import the
methods)."""
_CAUSAL_ROPE_ATTR = "_fvstep_causal_chunk_frames"  # what make_causal sets on the rotary module


def gather_weights(
    state: TrainState,
    role: str,
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    rank0_only: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) weights of one role, on the CPU, keyed like its ``state_dict``.

    The keys are the module's parameter names and persistent buffer names, as in its
    ``state_dict``: a tied tensor (:attr:`~fvstep.state.RoleState.tied`) appears under
    each of its names, gathered once and copied. DTensor leaves are gathered with
    ``full_tensor()``, a collective: call this on every rank.

    Args:
        state: The training state.
        role: The role's name.
        weights: ``"params"`` for the live parameters, ``"ema"`` for the fp32 moving
            average of the trainable parameters (the other parameters and the buffers
            keep their live values); before the EMA's first active update (its
            ``start_step``) the live values, as validation computes with
            (:func:`fvstep.weights.select_weights`, the one rule).
        dtype: Cast the floating-point tensors to this dtype (integer and bool buffers
            are kept as they are); ``None`` keeps each tensor's dtype (fp32 for EMA).
        rank0_only: Return the weights on global rank 0 and ``None`` on the others (which
            drop each gathered tensor at once); ``False`` returns them on every rank.

    Returns:
        Name to contiguous CPU tensor, no two sharing storage; ``None`` on ranks other
        than 0 when ``rank0_only``.

    Raises:
        ValueError: For an unknown role, an unknown ``weights``, ``weights="ema"`` for a
            role without an EMA, or a ``dtype`` that is not floating point.

    Examples:
        >>> sd = gather_weights(state, "student", weights="ema", dtype=torch.bfloat16)
    """
    role_state = _role_state(state, role)
    _check_options(role_state, role, weights, dtype)
    keep = rank0_only is False or rank_and_world()[0] == 0
    return _gather(role_state, role, weights=weights, dtype_for=lambda _: dtype, keep=keep)


def export_role(
    state: TrainState,
    role: str,
    path: str | os.PathLike[str],
    *,
    weights: Weights = "params",
    dtype: torch.dtype | None = None,
    rank0_only: bool = True,
    overwrite: bool = False,
) -> Path | None:
    """Write one role's full weights into a single ``safetensors`` file.

    Call it on every rank (sharded parameters are gathered collectively). The keys are
    the module's ``state_dict`` keys, so ``module.load_state_dict(load_file(path))``
    restores an unsharded copy of the module. A tied tensor is written under each of
    its names (as ``state_dict`` lists it), each its own copy: safetensors cannot store
    shared memory, and a strict ``load_state_dict`` expects every name.

    A module carrying peft layers whose adapters it does not compute with (the base of
    :func:`fvstep.lora.add_adapters`: the teacher of ``lora_dmd2``) is written as the
    plain model it computes: ``x.base_layer.weight`` as ``x.weight``, the adapters' own
    tensors left out, so the file loads strictly into the plain model (the base's class,
    without peft). A module that computes with adapters of its own (one peft model as
    one role) keeps its ``state_dict`` keys.

    Args:
        state: The training state.
        role: The role's name.
        path: A file path ending in ``.safetensors``, or a directory, in which
            ``model.safetensors`` is written (the directory is created if needed).
        weights: ``"params"`` or ``"ema"`` (see :func:`gather_weights`).
        dtype: Cast the floating-point tensors to this dtype (e.g. ``torch.bfloat16``).
        rank0_only: Only global rank 0 writes (the default). ``False``: every rank writes
            to ``path`` (e.g. to node-local disks) and returns it.
        overwrite: Replace an existing file at the target.

    Returns:
        The path of the file written on a writing rank, ``None`` on the others.

    A causal Wan's file (:func:`fvstep.methods.make_causal`), or that of a LoRA role's
    adapters over one, records its chunk in the
    safetensors metadata (:data:`CAUSAL_METADATA_KEY`: ``'{"chunk_frames": n}'``, read
    with ``safetensors.safe_open(path, "pt").metadata()``): the weights alone load into a
    bidirectional Wan without a word, so rebuild the module with ``make_causal(model,
    chunk_frames=n)`` first.

    Raises:
        ValueError: For an unknown role or ``weights``, ``weights="ema"`` without an EMA,
            a non-floating ``dtype``, an existing target without ``overwrite=True``, a
            target that is a directory, or peft adapters that the file would lose (see
            :func:`export_names`). Raised on every rank.
        RuntimeError: On the other ranks, when writing failed on a writing rank.

    Examples:
        >>> export_role(state, "student", "exports/step_1000", weights="ema")
        PosixPath('exports/step_1000/model.safetensors')
    """
    role_state = _role_state(state, role)
    _check_options(role_state, role, weights, dtype)
    names = export_names(role_state.role.module, role, keep_own_adapters=True)
    path = Path(path)
    target = path if path.suffix == ".safetensors" else path / WEIGHTS_NAME
    writes = rank0_only is False or rank_and_world()[0] == 0

    def check_target() -> None:
        if target.is_dir():
            raise ValueError(f"the export target {str(target)!r} is a directory")
        if target.exists() and not overwrite:
            raise ValueError(
                f"{str(target)!r} exists; pass overwrite=True to replace it, or choose another path"
            )

    _agree("check the export target", check_target if writes else None)
    tensors = _gather(
        role_state, role, weights=weights, dtype_for=lambda _: dtype, keep=writes, names=names
    )
    metadata = {"format": "pt"}
    chunk = _causal_chunk(role_state.role.module)
    if chunk is not None:  # a causal Wan, or adapters over one: the file says so
        metadata[CAUSAL_METADATA_KEY] = json.dumps({"chunk_frames": int(chunk)})

    def write() -> None:
        assert tensors is not None
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_file_atomically(target, lambda tmp: _save_safetensors(tensors, tmp, metadata))

    _agree("write the export", write if writes else None)
    return target if writes else None


def export_names(
    module: nn.Module, role: str, *, keep_own_adapters: bool = False
) -> Callable[[str], str | None] | None:
    """How an export names a role's tensors when its module carries peft layers.

    A peft layer (``peft.tuners.tuners_utils.BaseTunerLayer``) holds the weights it wraps
    under ``base_layer``; what the module computes decides the names. A layer neither
    merged nor computing with an adapter (disabled, as the base of
    :func:`fvstep.lora.add_adapters` is between calls) computes its base layer alone:
    ``x.base_layer.weight`` is exported as ``x.weight`` and its adapter tensors (another
    role's, or unused) are left out, so the plain class loads the export and computes
    bitwise what the role does. A module computing with adapters registered in it (one
    peft model as one role) keeps its ``state_dict`` names with ``keep_own_adapters`` (a
    file that loads back into that peft model); otherwise it is refused, as a plain
    export would silently drop what the adapter adds.

    Args:
        module: The role's module.
        role: The role's name (for the errors).
        keep_own_adapters: Keep the names of a module computing with its own adapters.

    Returns:
        ``state_dict`` name to export name (``None``: left out), or ``None`` to keep the
        ``state_dict`` names (no peft layer, or a peft model kept as it is).

    Raises:
        ValueError: For a merged peft layer (its base weights hold the adapter: the
            forward unmerges them when disabled), or a computing adapter that cannot be
            kept, naming the role, the layer, the adapter and the fix.

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
                f"role {role!r} has peft adapters {layer.merged_adapters} merged into "
                f"{path!r}: an export cannot tell them from the base weights; unmerge them "
                "(peft's unmerge_adapter) or make the merge final (merge_and_unload) first"
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
                f"role {role!r} computes with the peft adapter {adapter!r} at {path!r}, whose "
                "weights are not the role's (an adapter switched on outside its LoRAModule's "
                "call?): export with every other role's adapter off, or export that LoRA role"
            )
        raise ValueError(
            f"role {role!r} computes with the peft adapter {adapter!r} at {path!r}, which "
            "a plain model cannot hold: merge it into the weights first (peft's "
            "merge_and_unload), or make the adapter a role (fvstep.lora.add_adapters) and "
            "write it with fvstep.lora.export_lora or export_merged"
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


def _causal_chunk(module: Any) -> int | None:
    """The chunk of a causal Wan (``make_causal`` marks its rotary module), or of the base
    a LoRA role's adapters compute over (held as ``base``, not a submodule); else ``None``."""
    for candidate in (module, module.__dict__.get("base")):
        chunk = getattr(getattr(candidate, "rope", None), _CAUSAL_ROPE_ATTR, None)
        if chunk is not None:
            return int(chunk)
    return None


def _agree(what: str, action: Callable[[], None] | None) -> None:
    """Run ``action`` (on the ranks that have one), then share its outcome with every rank.

    The rank(s) whose action raised re-raise their error; the others raise a
    ``RuntimeError`` naming the failed rank, or a ``ValueError`` when the failure was one,
    so that all ranks leave together and no rank waits in a later collective.
    """
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


def _role_state(state: TrainState, role: str) -> RoleState:
    if role not in state.roles:
        raise ValueError(f"no role {role!r}; the state has roles {sorted(state.roles)}")
    if role in roles_holding_other_weights(state):
        raise ValueError(
            f"role {role!r} holds its EMA in its parameters here (inside "
            "fvstep.validation.role_module(weights='ema')): an export would take them for "
            "the live weights; export after the with block"
        )
    return state.roles[role]


def _check_options(
    role_state: RoleState, role: str, weights: str, dtype: torch.dtype | None
) -> None:
    if weights not in ("params", "ema"):
        raise ValueError(f"weights must be 'params' or 'ema', got {weights!r}")
    if weights == "ema" and role_state.ema is None:
        raise ValueError(
            f"weights='ema' but role {role!r} has no EMA; configure one with "
            "Role(..., ema=fvstep.EMA(decay)) or export weights='params'"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")


def _named_sources(
    role_state: RoleState, role: str, weights: Weights
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``state_dict`` name of the role with the tensor to export under it.

    A tied tensor is one leaf of the state, but ``state_dict`` (and so a strict
    ``load_state_dict``) has it under each of its names: its aliases are yielded too.
    """
    sources = select_weights(role_state, weights, role=role)  # the one rule (EMA started?)
    sources.update(role_state.buffers)
    yield from sources.items()
    for alias, canonical in role_state.tied:
        yield alias, sources[canonical]


def _gather(
    role_state: RoleState,
    role: str,
    *,
    weights: Weights,
    dtype_for: Callable[[str], torch.dtype | None],
    keep: bool,
    names: Callable[[str], str | None] | None = None,
) -> dict[str, torch.Tensor] | None:
    """The role's tensors under their export names: ``names(state_dict name)`` (``None``
    leaves the tensor out; no ``names``: the ``state_dict`` names, see :func:`export_names`)."""
    out: dict[str, torch.Tensor] = {}
    # A tied tensor's aliases reuse its gathered copy: one gather (a collective, so every
    # rank must skip the same ones) per tensor and dtype.
    gathered: dict[tuple[int, torch.dtype], str] = {}
    with torch.no_grad():
        for state_name, source in _named_sources(role_state, role, weights):
            name = state_name if names is None else names(state_name)
            if name is None:  # the same names on every rank: no gather is skipped on one
                continue
            tensor = source.detach()
            dtype = dtype_for(name)
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


def _save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    with needs_extra("models", "a safetensors export"):
        from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata or {"format": "pt"})


def _write_file_atomically(target: Path, write: Callable[[Path], None]) -> None:
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, target)
        fsync(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _check_target(path: Path, overwrite: bool) -> None:
    """Refuse an export target that is a file, or a non-empty folder without ``overwrite``."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"the export target {str(path)!r} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(
            f"{str(path)!r} exists and is not empty; pass overwrite=True to replace it, "
            "or choose another path"
        )


def _replace_dir(new: Path, target: Path) -> None:
    """Rename the folder ``new`` to ``target``, replacing an existing ``target``."""
    if target.is_dir() and any(target.iterdir()):
        # rename(2) replaces empty directories only: move the old one aside first.
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
        os.replace(target, old)
        os.replace(new, target)
        fsync(target.parent)
        shutil.rmtree(old)
    else:
        os.replace(new, target)
        fsync(target.parent)
