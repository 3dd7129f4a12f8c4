"""``fvstep export CHECKPOINT --out DIR``: a trained role of a ``fvstep train`` run, for
inference.

``CHECKPOINT`` is a ``step_<n>`` folder of a run, or the run's folder (its newest
checkpoint). The run's ``config.yaml`` (written by ``fvstep train``) rebuilds the state's
structure (its ``model.path``, relative to where the run was started, must still be
there: a frozen base saved by digest is verified against it; the dataset is not read),
the checkpoint is loaded into it, and one role is written by the library's
:func:`fvstep.checkpoint.export`, in one of its formats:

- ``--format model`` (default): a diffusers model folder (``format="diffusers"``);
- ``--format pipeline --base DIR``: a whole diffusers pipeline folder, the role in place
  of the base pipeline's transformer;
- ``--format lora``: a LoRA role's adapter in diffusers' LoRA format;
- ``--format merged``: the base with a LoRA role's adapter merged in;
- ``--format safetensors``: one safetensors file.

Of a LoRA run (``lora_dmd2``): a LoRA role (student, critic) is written as ``lora``,
``merged`` or ``safetensors`` (its adapter), its base (the teacher) as ``model``,
``pipeline`` or ``safetensors``, under the plain model's names; another format is refused,
naming one that applies.

``--weights params`` (live, the default) or ``ema``; ``--dtype`` casts. Run it on one
process (a checkpoint saved on several ranks reshards on load), or under ``torchrun``.
"""

from __future__ import annotations

import argparse
from typing import Any

from fvstep.cli.common import CLIError

__all__ = ["add_export_parser", "run_export_command"]

FORMATS = ("model", "pipeline", "lora", "merged", "safetensors")


def add_export_parser(sub: Any) -> None:
    """Add the ``export`` subcommand and its options.

    Example:
        >>> parser = argparse.ArgumentParser(prog="fvstep")
        >>> add_export_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["export", "runs/a", "--out", "x"]).format
        'model'
    """
    export = sub.add_parser(
        "export", help="write a trained role of a fvstep train run for inference (diffusers)"
    )
    export.add_argument(
        "checkpoint", help="a step_<n> folder of a run, or the run folder (its newest)"
    )
    export.add_argument("--out", required=True, help="the folder (or file) to write")
    export.add_argument("--role", default="student", help="the role to export (default student)")
    export.add_argument(
        "--format",
        choices=FORMATS,
        default="model",
        help="model: a diffusers model folder (default); pipeline: a whole pipeline (needs "
        "--base); lora: the LoRA adapter; merged: the base with the adapter merged; "
        "safetensors: one file",
    )
    export.add_argument(
        "--weights", choices=["params", "ema"], default="params", help="live (default) or EMA"
    )
    export.add_argument("--base", help="the base diffusers pipeline folder (--format pipeline)")
    export.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights written"
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing export")
    export.add_argument("--debug", action="store_true", help="show tracebacks")


def _load_run(checkpoint: str) -> tuple[Any, Any]:
    """The state of the checkpoint, loaded into the structure its run's config builds."""
    import dataclasses

    from fvstep import checkpoint as ckpt
    from fvstep.recipes import get_recipe
    from fvstep.recipes.config import read_config
    from fvstep.recipes.init import resolve_checkpoint

    try:
        folder = resolve_checkpoint(checkpoint)
    except ValueError as e:
        raise CLIError(f"fvstep export: {e}") from None
    saved = read_config(folder.parent)
    if saved is None:
        raise CLIError(
            f"fvstep export: no config.yaml in {str(folder.parent)!r}: export reads the run's "
            "config (written by fvstep train) to rebuild its state; for a run of your own "
            "script, call fvstep.checkpoint.export on its loaded state"
        )
    recipe = get_recipe(saved["recipe"])
    options = _options_from(recipe, saved["options"])
    options = dataclasses.replace(  # the state's structure only: no data, no validation
        options,
        data=dataclasses.replace(options.data, path=None),
        run=dataclasses.replace(options.run, device="cpu", progress=False),
        validation=dataclasses.replace(options.validation, every=0),
    )
    spec = recipe.build(options, fresh=False)
    try:
        return ckpt.load(folder, like=spec.state), folder
    finally:
        spec.close()


def _options_from(recipe: Any, tree: dict[str, Any]) -> Any:
    """The options object of a saved config (through the same parser as the command)."""
    import json

    from fvstep.recipes.config import parse_options

    return parse_options(recipe, ["--config", json.dumps(tree)])


def run_export_command(args: argparse.Namespace) -> int:
    """Run ``fvstep export``: load the checkpoint, write the role, print where.

    Returns:
        0 once written.

    Raises:
        CLIError: For a checkpoint without its run's config, ``--format pipeline``
            without ``--base``, or an export the library refuses (a role that is not a
            LoRA role for ``lora``, an existing ``--out`` without ``--overwrite``, ...).

    Example:
        $ fvstep export runs/finetune --out exports/pipe --format pipeline --base tiny-wan
    """
    import torch

    from fvstep.checkpoint import export

    if args.format == "pipeline" and not args.base:
        raise CLIError("fvstep export: --format pipeline needs --base (a pipeline folder)")
    state, folder = _load_run(args.checkpoint)
    if args.format in ("lora", "merged"):
        import fvstep.lora  # noqa: F401  (registers the LoRA formats)
    options = {"base": args.base} if args.format == "pipeline" else {}
    try:
        written = export(
            state,
            args.role,
            args.out,
            format="diffusers" if args.format == "model" else args.format,
            weights=args.weights,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            overwrite=args.overwrite,
            **options,
        )
    except ValueError as e:
        raise CLIError(f"fvstep export: {e}") from None
    if written is not None:
        print(
            f"fvstep export: {args.role} ({args.weights}) of {folder} -> {written} ({args.format})"
        )
    return 0
