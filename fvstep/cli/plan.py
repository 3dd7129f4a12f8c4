"""``fvstep plan RECIPE``: :func:`fvstep.recipes.planning.plan_run`'s plan of a run, read
as ``fvstep train`` reads it, and the changes that make it fit (:func:`run_plan`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fvstep.cli.train import parse_recipe_args, recipe_name
from fvstep.core.errors import CLIError

__all__ = ["run_plan", "run_plan_command"]


def run_plan_command(argv: Sequence[str]) -> int:
    """Run ``fvstep plan`` with ``argv`` (the words after ``plan``)."""
    _, options, own = parse_recipe_args("plan", run_plan, argv)
    return run_plan(recipe_name(argv), options, **own)


def run_plan(
    name: str,
    options: Any,
    *,
    nproc: int = 1,
    nodes: int = 1,
    context: int | None = None,
    kernels: str | None = None,
    calibrate: str | None = None,
) -> int:
    """Plan a run's memory and step time per GPU, on the meta device, before it allocates.

    RECIPE (the first word) is any shipped recipe (default finetune). When the run does not
    fit, the changes that make it fit are listed, fastest first.

    Args:
        nproc: GPUs a node
        nodes: nodes
        context: context-parallel degree: each sample's tokens over this many GPUs
        kernels: h200, h100 or a table from --calibrate (default h200)
        calibrate: measure this GPU's kernels into this file, and exit

    Returns:
        0 when the run fits (or after ``--calibrate``), 1 when it does not.

    Raises:
        CLIError: For a recipe the planner does not know.

    Example:
        $ fvstep plan dmd2 --nproc 8 --config examples/wan2.1_1.3b_dmd2.yaml
    """
    from pathlib import Path

    from fvstep.recipes import planning

    if calibrate is not None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape = planning.ModelShape.of(planning.meta_transformer(options.model))
        table = planning.calibrate_kernels(shape, device=device)
        Path(calibrate).write_text(table.to_json())
        print(f"fvstep plan: wrote the kernel table of {table.name} to {calibrate}")
        return 0
    layout: dict[str, Any] = dict(nproc=nproc, nodes=nodes, kernels=kernels, context=context)
    try:
        plan = planning.plan_run(name, options, **layout)
    except ValueError as e:
        raise CLIError(f"fvstep plan: {e}") from None
    print(plan.format())
    if plan.fits:
        return 0
    found = planning.suggest_changes(name, options, **layout)
    if not found:
        print("\nno change tried makes it fit (docs/plan.md lists what is tried)")
        return 1
    print("\nchanges that make it fit, fastest first:")
    for s in found:
        p = s.plan
        print(f"  {p.mean_seconds:7.3f} s/step  peak {p.peak / planning.GIB:6.1f} GiB  {s.change}")
    return 1
