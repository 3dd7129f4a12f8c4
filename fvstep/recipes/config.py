"""A recipe's options from a file and flags, and the resolved config kept with the run.

Parsing is jsonargparse's: ``--config F`` (YAML or TOML) and ``--dotted.key value`` flags,
later ones winning, every value type-checked. The resolved ``config.yaml`` is checked on
resume (:func:`check_config_change`; the rules: ``docs/recipes.md``).

Examples:
    >>> parse_options(get_recipe("finetune"), ["--optim.lr", "3e-4"]).optim.lr
    0.0003
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jsonargparse import ActionConfigFile, ArgumentParser

if TYPE_CHECKING:
    from fvstep.recipes import Recipe

from fvstep.core.errors import ConfigChangeError

__all__ = [
    "CONFIG_NAME",
    "add_options",
    "check_config_change",
    "dataset_digest",
    "options_from",
    "parse_options",
    "read_config",
    "write_config",
]

CONFIG_NAME = "config.yaml"
"""The file of the resolved config in a run's folder."""

_MAY_CHANGE = (
    "run.out",
    "run.num_steps",
    "run.every",
    "run.keep",
    "run.log_every",
    "run.progress",
    "run.async_save",
    "data.num_workers",
    "validation",
    "trackers",
    "init_from",
    "prepare.verify_compile",
)
# Keys (and groups) a resumed run may change: none alters a step's math. Learning rates
# (keys ending in ``lr``) may change too: they apply from the resumed run's first step.


class _ConfigFile(ActionConfigFile):
    """``--config F``: YAML, or TOML by its suffix (passed on as JSON, which YAML reads)."""

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: Any = None) -> None:
        if isinstance(values, str) and values.endswith(".toml"):
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            try:
                values = json.dumps(tomllib.loads(Path(values).read_text()))
            except (OSError, ValueError) as e:
                raise TypeError(f"cannot read the config file {values!r}: {e}") from None
        super().__call__(parser, cfg, values, option_string)


def add_options(parser: ArgumentParser, recipe: Recipe) -> None:
    """Add ``--config`` and the keys of ``recipe``'s options (``--optim.lr``, ...) to
    ``parser``, as ``fvstep train RECIPE`` takes them."""
    parser.add_argument(
        "--config", action=_ConfigFile, help="a YAML or TOML file of options (repeatable)"
    )
    parser.add_class_arguments(recipe.options, as_group=True)


def options_from(recipe: Recipe, namespace: Any) -> Any:
    """The options object of ``recipe`` in a namespace parsed (and instantiated) by a
    parser that :func:`add_options` filled."""
    return recipe.options(**{f.name: namespace[f.name] for f in dataclasses.fields(recipe.options)})


def parse_options(recipe: Recipe, argv: Sequence[str]) -> Any:
    """The options of ``recipe`` from ``--config`` files and ``--dotted.key value`` flags
    (e.g. ``["--config", "examples/finetune.yaml", "--run.num_steps", "8"]``; later ones win).

    Raises:
        ValueError: For an unknown key (with the closest key), a value of the wrong type,
            or an unreadable file (the message names the key or the file).
    """
    from fvstep.cli.common import Parser, parse
    from fvstep.core.errors import CLIError

    parser = Parser(f"fvstep train {recipe.name}", recipe.summary)
    add_options(parser, recipe)
    try:
        return options_from(recipe, parse(parser, argv))
    except CLIError as e:
        raise ValueError(str(e)) from None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``; ``init_from.roles`` stays one key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not key.endswith(".roles"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _may_change(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return (
        last == "lr"
        or last.endswith("_lr")
        or any(key == k or key.startswith(k + ".") for k in _MAY_CHANGE)
    )


def check_config_change(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The changed keys of a resumed run's config, for the log (``"optim.lr: 1.0 -> 2.0"``).

    Raises ``ConfigChangeError`` for a change that alters the math (see docs/recipes.md)."""
    if saved.get("recipe") != new.get("recipe"):
        raise ConfigChangeError(
            f"the run was made by recipe {saved.get('recipe')!r}, not {new.get('recipe')!r}: "
            "use another run.out for another recipe"
        )
    _check_world_size(saved, new)
    if "precision" in new and saved.get("precision") != new["precision"]:
        raise ConfigChangeError(
            f"precision: the run being resumed computed in {saved.get('precision')} and would resume in "
            f"{new['precision']}: resume with --prepare.precision {saved.get('precision')}, or start a new run (another run.out; init_from)"
        )
    before, after = saved.get("data_digest"), new.get("data_digest")
    if before is not None and after is not None and before != after:
        raise ConfigChangeError(
            "data.path holds another dataset than the run being resumed was trained on (index.json "
            "changed): put the dataset back, or start a new run (another run.out; init_from)"
        )
    old, now = _flatten(saved.get("options", {})), _flatten(new["options"])
    split = old.get("data.path") is not None or now.get("data.path") is not None
    applied = []
    for key in sorted(set(old) | set(now)):
        a, b = old.get(key, "<absent>"), now.get(key, "<absent>")
        if a == b:
            continue
        if split and key == "validation.num_samples":
            raise ConfigChangeError(
                f"validation.num_samples was {a!r} in the run being resumed and is {b!r} now (it changes "
                f"the items trained on): put it back, or start a new run (another run.out; init_from)"
            )
        if not _may_change(key):
            raise ConfigChangeError(
                f"{key} was {a!r} in the run being resumed and is {b!r} now: put it back, or start a new "
                f"run (another run.out; init_from). Keys that may change: {', '.join(_MAY_CHANGE)}, and learning rates"
            )
        applied.append(f"{key}: {a!r} -> {b!r}")
    return applied


def _ranks(n: Any) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _check_world_size(saved: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse another world size, or a saved config that does not say its own."""
    if "world_size" not in new:  # a comparison of options alone (no run behind it)
        return
    before, after = saved.get("world_size"), new["world_size"]
    if before is None:
        raise ConfigChangeError(
            f"the {CONFIG_NAME} of the run being resumed does not record the world size: continue its "
            "state in a new folder (--run.out NEW --init_from.path OLD --init_from.kind state). See docs/recipes.md"
        )
    if before != after:
        raise ConfigChangeError(
            f"world size: the run being resumed was trained on {_ranks(before)} (--nproc {before}) and is "
            f"resumed on {_ranks(after)} (--nproc {after}): resume with --nproc {before}, or start a new run"
        )


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The resolved config saved in a run's folder (``None`` if there is none)."""
    import yaml

    path = Path(run_dir) / CONFIG_NAME
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "options" not in data:
        raise ValueError(f"{str(path)!r} is not a config written by fvstep train")
    return data


def dataset_digest(path: str | Path | None) -> str | None:
    """The SHA-256 of a latent dataset's ``index.json`` (its shards, checksums and encode
    settings), so that a resume refuses another dataset; ``None`` without an index."""
    if path is None:
        return None
    index = Path(path) / "index.json"
    return hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else None


def write_config(run_dir: str | Path, config: dict[str, Any]) -> Path:
    """Write ``config`` as ``<run_dir>/config.yaml``, atomically."""
    import yaml

    path = Path(run_dir) / CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config, sort_keys=False)
    tmp = path.with_name(f".{CONFIG_NAME}.tmp")
    tmp.write_text("# The resolved config of this run (fvstep train). Resuming checks it.\n" + text)
    tmp.replace(path)
    return path
