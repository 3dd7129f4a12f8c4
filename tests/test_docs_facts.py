"""The docs state what the code does: facts that drift, compared with their source.

- ``docs/cli.md`` against the ``fvstep`` parsers: every subcommand listed and counted,
  every option of each documented in its section, and no documented option that the
  parser lacks (whatever subcommands exist: they are read from ``fvstep.cli.COMMANDS``;
  ``train``'s and ``plan``'s options are theirs, not a recipe's keys);
- ``docs/cli.md``'s benchmark list against the runnable modules of ``benchmarks/``;
- the install docs against ``pyproject.toml``: the Python and torch floors, every extra.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fvstep.cli import COMMANDS
from fvstep.cli.common import Parser, command_parser
from fvstep.cli.train import recipe_parser
from fvstep.recipes import get_recipe
from fvstep.recipes.config import add_options

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = (ROOT / "docs" / "cli.md").read_text()
NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
# options every subcommand has, documented once for all in the page's introduction
COMMON = {"--help", "--debug"}


def _commands() -> dict[str, Parser]:
    """Every leaf command (``"demo"``, ``"data encode"``) and its parser (``train``'s and
    ``plan``'s for their default recipe)."""
    commands = {}
    for name, command in COMMANDS.items():
        for sub, fn in command.items() if isinstance(command, dict) else [("", command)]:
            if name in ("train", "plan"):
                commands[name] = recipe_parser(name, fn, [])[1]
            else:
                commands[f"{name} {sub}".strip()] = command_parser(fn, f"fvstep {name} {sub}")
    return commands


def _options(command: str) -> set[str]:
    """The ``--options`` of a command's parser; of ``train`` and ``plan``, less the recipe's
    keys (the page documents them as ``--KEY VALUE``: ``fvstep train RECIPE --help`` lists
    them)."""
    options = {o for a in _commands()[command]._actions for o in a.option_strings}
    if command in ("train", "plan"):
        keys = Parser("keys")
        add_options(keys, get_recipe("finetune"))
        options -= {o for a in keys._actions for o in a.option_strings} - {"--config"}
    return {o for o in options if o.startswith("--")} - COMMON


def _section(command: str) -> str:
    match = re.search(rf"^## `fvstep {re.escape(command)}`\n(.*?)(?=^## |\Z)", CLI_MD, re.M | re.S)
    assert match, f"docs/cli.md has no section '## `fvstep {command}`'"
    return match.group(1)


def _documented_options(section: str) -> set[str]:
    """The options of a section's synopsis (its first text block) and its options table."""
    synopsis = re.search(r"```text\n(.*?)```", section, re.S)
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `--")]
    text = (synopsis.group(1) if synopsis else "") + " ".join(rows)
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])", text)) - COMMON


def test_the_cli_reference_lists_and_counts_every_subcommand() -> None:
    names = set(COMMANDS)
    listing = re.search(r"```text\n(.*?)```", CLI_MD, re.S)
    assert listing, "docs/cli.md opens with no list of subcommands"
    listed = {line.split()[1] for line in listing.group(1).splitlines() if line.strip()}
    assert listed == names, f"listed {sorted(listed)}, the parser has {sorted(names)}"
    count = re.search(r"with (\w+) subcommands", CLI_MD)
    assert count, "docs/cli.md does not say how many subcommands there are"
    assert count.group(1) == NUMBERS[len(names)], f"say {NUMBERS[len(names)]} subcommands"


@pytest.mark.parametrize("command", sorted(_commands()))
def test_each_subcommand_documents_exactly_its_options(command: str) -> None:
    section = _section(command)
    options = _options(command)
    missing = {o for o in options if not re.search(rf"`[^`]*{re.escape(o)}\b", section)}
    assert not missing, f"docs/cli.md, fvstep {command}: undocumented {sorted(missing)}"
    unknown = _documented_options(section) - options
    assert not unknown, (
        f"docs/cli.md, fvstep {command}: documents {sorted(unknown)}, no such option"
    )


def test_the_cli_reference_lists_every_runnable_benchmark() -> None:
    runnable = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text()}
    listed = set(re.findall(r"^python -m benchmarks\.(\w+)", _section_benchmarks(), re.M))
    assert listed == runnable, f"listed {sorted(listed)}, runnable {sorted(runnable)}"


def _section_benchmarks() -> str:
    match = re.search(r"^## Benchmarks\n(.*?)(?=^## |\Z)", CLI_MD, re.M | re.S)
    assert match, "docs/cli.md has no Benchmarks section"
    return match.group(1)


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _install_section() -> str:
    text = (ROOT / "docs" / "index.md").read_text()
    match = re.search(r"^## Install\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/index.md has no Install section"
    return match.group(1)


def test_the_install_docs_state_the_python_and_torch_floors_of_pyproject() -> None:
    project = _pyproject()["project"]
    python = re.fullmatch(r">=\s*([\d.]+)", project["requires-python"])
    torch_pin = next(d for d in project["dependencies"] if re.match(r"torch\b", d))
    torch_floor = re.search(r">=\s*([\d.]+)", torch_pin)
    assert python and torch_floor
    section = _install_section()
    assert f"Python ≥ {python.group(1)}" in section, "docs/index.md: the Python floor"
    assert f"PyTorch ≥ {torch_floor.group(1)}" in section, f"docs/index.md: {torch_pin!r}"
    upper = re.search(r"<\s*(\d+)\.(\d+)", torch_pin)
    if upper:  # "torch 2.11–2.13" in the README
        last = f"{upper.group(1)}.{int(upper.group(2)) - 1}"
        readme = (ROOT / "README.md").read_text()
        assert f"torch {torch_floor.group(1)}–{last}" in readme, f"README: {torch_pin!r}"


def test_the_install_docs_name_every_extra_of_pyproject() -> None:
    extras = set(_pyproject()["project"]["optional-dependencies"])
    section = _install_section()
    missing = {e for e in extras if f"`{e}`" not in section}
    assert not missing, (
        f"docs/index.md's Install section does not name the extras {sorted(missing)}"
    )
