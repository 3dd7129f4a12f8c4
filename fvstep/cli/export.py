"""``fvstep export CHECKPOINT --out DIR``: a trained role of a ``fvstep train`` run, for
inference (:func:`run_export`; docs/cli.md says how the run is rebuilt)."""

from __future__ import annotations

from typing import Any, Literal

from fvstep.core.errors import CLIError

__all__ = ["run_export"]


def _load_run(checkpoint: str) -> tuple[Any, Any]:
    """The state of the checkpoint, loaded into the structure its run's config builds."""
    import dataclasses
    import json

    from fvstep import checkpoint as ckpt
    from fvstep.recipes import get_recipe
    from fvstep.recipes.config import parse_options, read_config
    from fvstep.recipes.init import resolve_checkpoint

    try:
        folder = resolve_checkpoint(checkpoint)
    except ValueError as e:
        raise CLIError(f"fvstep export: {e}") from None
    saved = read_config(folder.parent)
    if saved is None:
        raise CLIError(
            f"fvstep export: no config.yaml in {str(folder.parent)!r} (fvstep train writes it); for "
            "a run of your own script, call fvstep.checkpoint.export on its loaded state"
        )
    recipe = get_recipe(saved["recipe"])
    options = parse_options(recipe, ["--config", json.dumps(saved["options"])])
    # The state's structure only, on the CPU: no data, no validation. The dtypes are the
    # run's: its resolved precision ("auto" was bf16 on its GPUs, and a frozen role is
    # checked against the digest of its bf16 weights); FlashAttention-4 changes no tensor
    # and needs a GPU.
    prepare = options.prepare
    if saved.get("precision") in ("bf16", "fp32"):
        prepare = dataclasses.replace(prepare, precision=saved["precision"])
    options = dataclasses.replace(
        options,
        data=dataclasses.replace(options.data, path=None),
        run=dataclasses.replace(options.run, device="cpu", progress=False),
        validation=dataclasses.replace(options.validation, every=0),
        prepare=dataclasses.replace(prepare, flash_attention_4=False, verify_compile=False),
    )
    # Values saved per rank (a stream's cache on each rank) are not weights: one process
    # starts them afresh, so that a run of several ranks exports like a run of one.
    per_rank = ckpt.read_manifest(folder).per_rank
    reset = sorted(p for p in per_rank if not p.startswith("roles."))
    spec = recipe.build(options, fresh=False)
    try:
        return ckpt.load(folder, like=spec.state, reset=reset), folder
    finally:
        spec.close()


def run_export(
    checkpoint: str,
    *,
    out: str,
    role: str = "student",
    format: Literal["model", "pipeline", "lora", "merged", "safetensors"] = "model",
    weights: Literal["params", "ema"] = "params",
    base: str | None = None,
    dtype: Literal["float32", "bfloat16", "float16"] | None = None,
    overwrite: bool = False,
) -> int:
    """Write a trained role of a fvstep train run for inference (diffusers).

    Args:
        checkpoint: a step_<n> folder of a run, or the run folder (its newest)
        out: the folder (or file) to write
        role: the role to export
        format: model: a diffusers model folder; pipeline: a whole pipeline (needs
            --base); lora: the LoRA adapter; merged: the base with the adapter merged;
            safetensors: one file
        weights: live (params) or EMA
        base: the base diffusers pipeline folder (--format pipeline)
        dtype: cast the weights written (default: as trained)
        overwrite: replace an existing export

    Returns:
        0 once written.

    Raises:
        CLIError: For a checkpoint without its run's config, ``--format pipeline``
            without ``--base``, or an export :func:`fvstep.checkpoint.export` refuses.

    Example:
        $ fvstep export runs/finetune --out exports/pipe --format pipeline --base tiny-wan
    """
    import torch

    from fvstep.checkpoint import export

    if format == "pipeline" and not base:
        raise CLIError("fvstep export: --format pipeline needs --base (a pipeline folder)")
    state, folder = _load_run(checkpoint)
    options: dict[str, Any] = {"base": base} if format == "pipeline" else {}
    try:
        written = export(
            state,
            role,
            out,
            format="diffusers" if format == "model" else format,
            weights=weights,
            dtype=getattr(torch, dtype) if dtype else None,
            overwrite=overwrite,
            **options,
        )
    except ValueError as e:
        raise CLIError(f"fvstep export: {e}") from None
    if written is not None:
        print(f"fvstep export: {role} ({weights}) of {folder} -> {written} ({format})")
    return 0
