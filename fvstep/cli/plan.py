"""``fvstep plan RECIPE``: a run's memory and step time per GPU, before it allocates.

It reads the recipe's options as ``fvstep train`` does (``--config`` files and
``--dotted.key value`` flags), builds the model on the ``meta`` device and prints
:func:`fvstep.recipes.planning.plan_run`'s plan; when the run does not fit, the changes that make
it fit, fastest first (:func:`fvstep.recipes.planning.suggest_changes`). ``--nproc``,
``--nodes`` and ``--context`` give the layout (FSDP2 over every GPU; each sample's tokens
over ``--context`` of them). ``--calibrate FILE`` measures this machine's kernels and writes
them as a table for ``--kernels FILE``.
"""

from __future__ import annotations

from typing import Any

from fvstep.cli.common import CLIError

__all__ = ["add_plan_parser", "run_plan_command", "split_plan_args"]

_OWN = {
    "--nproc": "nproc",
    "--nodes": "nodes",
    "--context": "context",
    "--kernels": "kernels",
    "--calibrate": "calibrate",
}


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` subcommand to the ``fvstep`` parser (for ``fvstep --help``; the
    command parses its own arguments: :func:`split_plan_args`).

    Example:
        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="fvstep")
        >>> add_plan_parser(parser.add_subparsers(dest="command"))
    """
    plan = sub.add_parser(
        "plan",
        help="a run's memory and step time per GPU, on the meta device: fvstep plan RECIPE "
        "[--config F] [--key value ...]",
        add_help=False,
    )
    plan.add_argument("recipe", nargs="?", default="finetune")
    plan.add_argument("--config", action="append", help="a YAML or TOML file of options")
    plan.add_argument("--nproc", type=int, default=1, help="GPUs a node")
    plan.add_argument("--nodes", type=int, default=1, help="nodes")
    plan.add_argument(
        "--context", type=int, help="context-parallel degree: each sample over this many GPUs"
    )
    plan.add_argument("--kernels", help="h200, h100 or a table from --calibrate")
    plan.add_argument("--calibrate", metavar="FILE", help="measure this GPU's kernels into FILE")
    plan.add_argument("--debug", action="store_true", help="show tracebacks")


def split_plan_args(argv: list[str]) -> tuple[str, list[str], dict[str, Any]]:
    """``argv`` (after ``plan``) -> the recipe, its options' arguments, the command's flags.

    Raises:
        CLIError: For a flag of its own without a value, or ``--nproc``, ``--nodes`` or
            ``--context`` not a number.

    Example:
        >>> split_plan_args(["dmd2", "--nproc", "8", "--optim.lr", "1e-4"])[2]["nproc"]
        8
    """
    words = list(argv)
    recipe = words.pop(0) if words and not words[0].startswith("-") else "finetune"
    own: dict[str, Any] = {
        "nproc": 1, "nodes": 1, "context": None, "kernels": None, "calibrate": None,
    }  # fmt: skip
    own["help"] = False
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        flag, eq, value = word.partition("=")
        if word in ("-h", "--help"):
            own["help"] = True
        elif word == "--debug":
            pass
        elif flag in _OWN:
            if not eq:
                i += 1
                if i >= len(words):
                    raise CLIError(f"fvstep plan: {flag} needs a value")
                value = words[i]
            if flag in ("--nproc", "--nodes", "--context"):
                try:
                    own[_OWN[flag]] = int(value)
                except ValueError:
                    raise CLIError(f"fvstep plan: {flag} needs a number, got {value!r}") from None
            else:
                own[_OWN[flag]] = value
        else:
            rest.append(word)
        i += 1
    return recipe, rest, own


def run_plan_command(argv: list[str]) -> int:
    """Run ``fvstep plan`` with ``argv`` (the words after ``plan``).

    Returns:
        0 when the run fits (or after ``--calibrate``), 1 when it does not.

    Raises:
        CLIError: For an unknown recipe, a bad option, or a recipe the planner does not know.

    Example:
        >>> run_plan_command(["finetune"])  # doctest: +SKIP
        0
    """
    from fvstep.recipes import get_recipe
    from fvstep.recipes.config import help_text, parse_options

    name, rest, own = split_plan_args(argv)
    try:
        recipe = get_recipe(name)
    except ValueError as e:
        raise CLIError(f"fvstep plan: {e}") from None
    if own["help"]:
        print(
            f"fvstep plan {name} [--nproc N] [--nodes M] [--context C] "
            "[--kernels h200|h100|FILE] [--calibrate FILE] and the recipe's options:\n"
        )
        print(help_text(recipe))
        return 0
    try:
        options = parse_options(recipe, rest)
    except ValueError as e:
        raise CLIError(f"fvstep plan {name}: {e} (see fvstep plan {name} --help)") from None
    from fvstep.recipes import planning

    if own["calibrate"] is not None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape = planning.ModelShape.of(planning.meta_transformer(options.model))
        table = planning.calibrate_kernels(shape, device=device)
        from pathlib import Path

        Path(own["calibrate"]).write_text(table.to_json())
        print(f"fvstep plan: wrote the kernel table of {table.name} to {own['calibrate']}")
        return 0
    try:
        plan = planning.plan_run(
            name, options, nproc=own["nproc"], nodes=own["nodes"], kernels=own["kernels"],
            context=own["context"],
        )  # fmt: skip
    except ValueError as e:
        raise CLIError(f"fvstep plan: {e}") from None
    print(plan.format())
    if plan.fits:
        return 0
    found = planning.suggest_changes(
        name, options, nproc=own["nproc"], nodes=own["nodes"], kernels=own["kernels"],
        context=own["context"],
    )  # fmt: skip
    if not found:
        print("\nno change tried makes it fit (docs/plan.md lists what is tried)")
        return 1
    print("\nchanges that make it fit, fastest first:")
    for s in found:
        p = s.plan
        print(f"  {p.mean_seconds:7.3f} s/step  peak {p.peak / planning.GIB:6.1f} GiB  {s.change}")
    return 1
