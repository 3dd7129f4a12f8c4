"""Start a run from somewhere else (``init_from``): a diffusers model folder, another run's
weights, or another run's whole state (:func:`init_from`). ``docs/recipes.md`` gives the
rules (causal exports, LoRA's frozen base).

Examples:
    >>> load_weights_into(student, source_weights("runs/a", role="student", weights="ema"))
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fvstep import checkpoint as ckpt
from fvstep.recipes.options import InitFrom

__all__ = [
    "check_base_digest",
    "check_causal_source",
    "check_init_state",
    "init_from",
    "load_weights_into",
    "resolve_checkpoint",
    "source_weights",
]


def _is_diffusers_folder(path: Path) -> bool:
    return (path / "model_index.json").is_file() or (path / "config.json").is_file()


def _transformer_folder(path: Path) -> Path:
    """A pipeline folder's ``transformer/``, or ``path`` itself."""
    return path / "transformer" if (path / "model_index.json").is_file() else path


def check_causal_source(path: str | os.PathLike[str], module: nn.Module, *, role: str) -> None:
    """Refuse (``ValueError``) to fill ``module`` from a diffusers folder of a causal Wan
    it is not: bidirectional, or causal of another chunk."""
    from fvstep.methods.causal_wan import chunk_frames_of, is_causal, recorded_chunk_frames

    path = Path(path)
    config = _transformer_folder(path) / "config.json"
    if (path / "manifest.json").is_file() or not config.is_file():
        return
    recorded = recorded_chunk_frames(json.loads(config.read_text()))
    mine = chunk_frames_of(module) if is_causal(module) else None
    if recorded is not None and recorded != mine:
        what = "bidirectional" if mine is None else f"causal of chunk_frames={mine}"
        raise ValueError(
            f"{str(path)!r} holds a causal Wan (chunk_frames={recorded}) and role {role!r} is {what}: "
            "start a causal role from it (fvstep.methods.causal_wan.load_causal), or use a bidirectional folder"
        )


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a checkpoint, else the newest complete one in the run folder ``path``.

    Raises ``ValueError`` if there is none."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    newest = ckpt.latest(path) if path.is_dir() else None
    if newest is None:
        hint = (
            "; it is a diffusers model folder: where a recipe starts from one, pass it as "
            "model.path (a LoRA run's base) or init_from.path of finetune/dmd2"
            if _is_diffusers_folder(path)
            else ""
        )
        raise ValueError(
            f"{str(path)!r} is neither a checkpoint (a step_<n> folder with a manifest) nor "
            f"a run folder holding one{hint}"
        )
    return newest


def _diffusers_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = _transformer_folder(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in the diffusers folder {str(folder)!r}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def source_weights(
    path: str | os.PathLike[str], *, role: str = "student", weights: str = "params"
) -> dict[str, torch.Tensor]:
    """One role's full weights from a checkpoint (or a run's newest), or a diffusers
    folder's weights (``role`` and ``weights`` then do not apply), on the CPU.

    Every rank reads the whole tensors itself (no collective); the values are checked
    against the checkpoint's checksums.

    Raises:
        ValueError: If the checkpoint has no such role, or no EMA for ``weights="ema"``.
        fvstep.checkpoint.DamagedCheckpointError: If the values read do not match.
    """
    import torch.distributed.checkpoint as dcp

    from fvstep.checkpoint.saving import fingerprint

    path = Path(path)
    if _is_diffusers_folder(path) and not (path / "manifest.json").is_file():
        return _diffusers_weights(path)
    folder = resolve_checkpoint(path)
    manifest = ckpt.read_manifest(folder)
    prefix = f"roles.{role}.params." if weights == "params" else f"roles.{role}.ema.params."
    wanted = {p: meta for p, meta in manifest.leaves.items() if p.startswith(prefix)}
    if not wanted:
        roles = sorted({p.split(".")[1] for p in manifest.leaves if p.startswith("roles.")})
        what = "EMA" if weights == "ema" else "saved weights"
        raise ValueError(
            f"checkpoint {str(folder)!r} has no {what} of role {role!r} (its roles: {roles})"
        )
    tensors = {
        p: torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
        for p, meta in wanted.items()
    }
    with warnings.catch_warnings():  # each rank reads alone: DCP's "single process" note
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(dict(tensors), checkpoint_id=folder, no_dist=True)
    paths = sorted(tensors)
    checksums, _ = fingerprint(paths, [tensors[p] for p in paths])  # every rank: the same
    for p in paths:
        if checksums.get(p) != manifest.checksums.get(p):
            raise ckpt.DamagedCheckpointError(
                f"checkpoint {str(folder)!r}: '{p}' does not match the manifest's checksum"
            )
    return {p.removeprefix(prefix): t for p, t in tensors.items()}


def load_weights_into(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``module``'s parameters, by name (before sharding).

    Raises:
        ValueError: If the names differ (naming the first missing and unexpected ones)
            or a shape differs.
    """
    params = dict(module.named_parameters())
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"the weights do not fit the module: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} ({len(missing)} and {len(unexpected)} in all)"
        )
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(
                    f"{name!r} is {tuple(w.shape)} in the source, {tuple(p.shape)} here"
                )
            p.copy_(w.to(p.dtype))


def check_base_digest(
    path: str | os.PathLike[str], base: nn.Module, *, base_role: str = "teacher"
) -> None:
    """Raise ``CheckpointError`` if the checkpoint at ``path`` recorded a digest of its frozen
    ``base_role`` that is not ``base``'s (adapters trained on another base)."""
    from fvstep.checkpoint import base_digest

    folder = resolve_checkpoint(path)
    digests = ckpt.read_manifest(folder).frozen_digests
    if base_role not in digests:
        return
    mine = base_digest(base)
    if mine != digests[base_role]:
        raise ckpt.CheckpointError(
            f"checkpoint {str(folder)!r} was trained on another base model (digest {digests[base_role][:16]}..., "
            f"this run's {mine[:16]}...): use the base its adapters were trained on"
        )


def check_init_state(options: Any) -> None:
    """Refuse (``ValueError``) ``init_from.kind="state"`` from a checkpoint at or past
    ``run.num_steps``, or whose adapters had other ``lora`` options; a resumed run passes."""
    source = options.init_from
    if source.path is None or source.kind != "state":
        return
    out = Path(options.run.out)
    if out.is_dir() and ckpt.latest(out) is not None:
        return
    folder = resolve_checkpoint(source.path)
    step = ckpt.read_manifest(folder).step
    if options.run.num_steps <= step:
        raise ValueError(
            f"init_from.kind state: {str(folder)!r} is at step {step} and run.num_steps is "
            f"{options.run.num_steps} (the step to reach): give run.num_steps > {step}"
        )
    from fvstep.recipes.config import read_config

    saved = (read_config(folder.parent) or {}).get("options", {}).get("lora")
    mine = getattr(options, "lora", None)
    if saved is not None and mine is not None:  # an adapter's state fits only its own scale
        for key in ("rank", "alpha", "targets"):  # not the seed: it only draws the start
            value, new = saved.get(key), getattr(mine, key)
            if (list(new) if isinstance(new, tuple) else new) != value:
                raise ValueError(
                    f"init_from.kind state: the adapters of {str(folder)!r} were trained with "
                    f"lora.{key} {value!r}, this run has {new!r}: continue with the same lora options"
                )


def init_from(
    options: InitFrom, modules: dict[str, nn.Module] | None = None, *, state: Any = None
) -> Any:
    """Apply ``init_from`` options: fill ``modules`` (``kind="weights"``, before the state
    is made) or load a whole ``state`` (``kind="state"``).

    Args:
        modules: For ``kind="weights"``: the trained roles' modules, by role; each gets
            the weights of the source role ``options.roles.get(role, role)``.
        state: For ``kind="state"``: a state of the run's structure (``like``).

    Returns:
        ``None`` for ``kind="weights"``; the loaded state for ``kind="state"``.

    Raises:
        ValueError: For no ``options.path``, a role the run does not train or the source
            lacks, weights that do not fit, or a causal Wan's folder (:func:`check_causal_source`).
        fvstep.checkpoint.CheckpointError: For a state that does not fit.

    Examples:
        >>> state = init_from(InitFrom(path="runs/a", kind="state"), state=state)
    """
    if options.path is None:
        raise ValueError("init_from.path is not set")
    unknown = sorted(set(options.roles) - set(modules or {})) if options.kind == "weights" else []
    if unknown:
        raise ValueError(
            f"init_from.roles names {unknown}, which this run does not train "
            f"(it trains {sorted(modules or {})})"
        )
    if options.kind == "state":
        if state is None:
            raise ValueError("init_from kind='state' needs the state to load into")
        return ckpt.load(resolve_checkpoint(options.path), like=state)
    for role, module in (modules or {}).items():
        check_causal_source(options.path, module, role=role)
        source = options.roles.get(role, role)
        load_weights_into(
            module, source_weights(options.path, role=source, weights=options.weights)
        )
    return None
