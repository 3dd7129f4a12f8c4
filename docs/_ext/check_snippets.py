"""Run the Python examples of the documentation, page by page.

Every fenced block opened with exactly three backticks and ``python`` in a page under
``docs/`` is executed; a page's blocks run in order, as one script, in a fresh
interpreter whose working directory is an empty temporary directory (so examples may
write ``runs/...`` and import modules they write there). Blocks fenced as ``py`` are
shown but not run (fragments, multi-GPU set-ups, shell-dependent code).

A page may hold an example module for other blocks to import: a block whose first line
is ``# file: NAME.py`` is written to ``NAME.py`` instead of being run.

Usage, from the repository root::

    python docs/_ext/check_snippets.py                 # every page
    python docs/_ext/check_snippets.py docs/tutorial.md
    python docs/_ext/check_snippets.py --show docs/tutorial.md   # print what it prints
    python docs/_ext/check_snippets.py --jobs 1        # one page at a time
    python docs/_ext/check_snippets.py --skip docs/tutorial.md   # every page but one

Pages run two at a time by default (each page's torch uses one thread), and their
outcomes are printed in page order.

Exits non-zero if any page fails, printing the page, its script and the error.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_FILE = re.compile(r"^# file: (\S+\.py)\n")
_PRELUDE = "import torch\ntorch.set_num_threads(1)\n"


def _script(page: Path, workdir: Path) -> str | None:
    parts = []
    for block in _BLOCK.findall(page.read_text()):
        named = _FILE.match(block)
        if named:
            (workdir / named.group(1)).write_text(block[named.end() :])
        else:
            parts.append(block)
    return _PRELUDE + "\n".join(parts) if parts else None


def check(page: Path, *, show: bool = False) -> tuple[bool, str]:
    """Run ``page``'s examples; return whether they passed and the outcome to print."""
    with tempfile.TemporaryDirectory(prefix="fvstep-docs-") as tmp:
        workdir = Path(tmp)
        script = _script(page, workdir)
        if script is None:
            return True, ""
        (workdir / "page.py").write_text(script)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "page.py"], cwd=workdir, capture_output=True, text=True
        )
        elapsed = time.perf_counter() - start
    if done.returncode == 0:
        report = f"ok    {page} ({elapsed:.1f} s)"
        return True, report + ("\n" + done.stdout + done.stderr if show else "")
    numbered = "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(script.splitlines()))
    return False, f"FAIL  {page} ({elapsed:.1f} s)\n{numbered}\n{done.stdout}{done.stderr}"


def main(argv: list[str]) -> int:
    show = "--show" in argv
    jobs = 2
    if "--jobs" in argv:
        at = argv.index("--jobs")
        jobs = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    skip: set[Path] = set()
    while "--skip" in argv:
        at = argv.index("--skip")
        skip.add(Path(argv[at + 1]).resolve())
        argv = argv[:at] + argv[at + 2 :]
    root = Path(__file__).resolve().parents[1]
    pages = [Path(a) for a in argv if a != "--show"] or sorted(root.rglob("*.md"))
    pages = [p for p in pages if p.resolve() not in skip]
    ok = True
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for passed, report in pool.map(lambda page: check(page, show=show), pages):
            if report:
                print(report, flush=True)
            ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
