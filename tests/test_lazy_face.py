"""The package face is lazy: ``import fvstep`` and ``fvstep --help`` load no torch.

Each check runs a fresh interpreter and reads its ``sys.modules``; the face's names and
submodules stay importable as they were when the face imported everything up front.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("torch", "torch.distributed.fsdp", "diffusers", "sympy", "fvstep.checkpoint.exporting")
"""Modules whose import made ``fvstep --help`` take seconds."""


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["demo", "--help"],
        ["verify-resume", "--help"],
        ["data", "--help"],
        ["data", "encode", "--help"],
    ],
)
def test_help_and_version_import_no_torch_fsdp_or_diffusers(argv):
    code = (
        "import contextlib, io\nfrom fvstep.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    try:\n        main({argv!r})\n    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
    )
    loaded = _modules_after(code)
    assert "fvstep.cli" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_import_fvstep_imports_no_torch():
    loaded = _modules_after("import fvstep")
    assert "fvstep" in loaded and "torch" not in loaded


def test_every_public_name_is_importable_listed_and_the_one_its_module_defines():
    code = (
        "import fvstep\nimport fvstep.executor.loop\n"
        "from fvstep import *\n"
        "missing = [n for n in fvstep.__all__ if n not in globals()]\n"
        "assert not missing, missing\n"
        "assert set(fvstep.__all__) <= set(dir(fvstep)), set(fvstep.__all__) - set(dir(fvstep))\n"
        "from fvstep import Validation, checkpoint, update\n"
        "assert checkpoint is fvstep.checkpoint and fvstep.Validation is Validation\n"
        "assert fvstep.core.state.TrainState is fvstep.TrainState  # a submodule, read as an attribute\n"
        "import fvstep.core.steps as steps\n"
        "assert update is fvstep.update is steps.update  # one object, no wrapper\n"
        "assert fvstep.compile is steps.compile and fvstep.sequence is steps.sequence\n"
    )
    assert "torch" in _modules_after(code)


def test_a_missing_name_is_an_attribute_error():
    import fvstep

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        fvstep.no_such_name  # noqa: B018
    assert not hasattr(fvstep, "__no_such_dunder__")
