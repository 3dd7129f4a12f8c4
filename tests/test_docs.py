"""The tutorial as a reader runs it: its Python blocks pasted into one file (the
``# file: my_method.py`` block saved next to it), run twice in a row in one folder, then
its ``fvstep verify-resume`` command. Every page's examples run once in CI through
``docs/_ext/check_snippets.py`` (``.ci/run``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A loaded 2-core CI box runs one pass in about 20 s; leave it room.
TIMEOUT_S = 600
VERIFY_ARGS = ("--steps", "8", "--interrupt", "3", "6")  # as in docs/tutorial.md


def _load_check_snippets():
    spec = importlib.util.spec_from_file_location(
        "check_snippets", ROOT / "docs" / "_ext" / "check_snippets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _shown_outputs(page: Path) -> list[str]:
    """The lines of a page's ``text`` blocks that follow a Python block: what it says the
    Python prints (a ``text`` block after a ``bash`` block is a command's output)."""
    lines: list[str] = []
    block: str | None = None
    last = None
    for line in page.read_text().splitlines():
        if line.startswith("```") and block is None:
            block = line[3:].strip()
            continue
        if line.startswith("```"):
            last, block = block, None
            continue
        if block == "text" and last == "python":
            lines.append(line)
    return lines


def test_tutorial_runs_twice_in_a_row_with_the_same_output(tmp_path):
    script = _load_check_snippets()._script(ROOT / "docs" / "tutorial.md", tmp_path)
    assert script is not None and (tmp_path / "my_method.py").exists()
    (tmp_path / "tutorial.py").write_text(script)
    outputs = []
    for attempt in (1, 2):
        done = _run([sys.executable, "tutorial.py"], tmp_path)
        assert done.returncode == 0, f"run {attempt}:\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith("20\n30\n")
    printed = outputs[0].splitlines()
    at = 0
    for line in _shown_outputs(ROOT / "docs" / "tutorial.md"):  # what the page says it prints
        assert line in printed[at:], f"docs/tutorial.md shows {line!r}; the code printed:\n" + (
            "\n".join(printed)
        )
        at = printed.index(line, at) + 1

    done = _run(
        [sys.executable, "-m", "fvstep", "verify-resume", "my_method:factory", *VERIFY_ARGS],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == (
        "resume is exact: my_method:factory (8 steps, crashes before [3, 6], "
        "checkpoints every 2, 1 rank(s))"
    )
